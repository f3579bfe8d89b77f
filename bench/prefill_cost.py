"""What computing a turn's new tokens costs one engine, and what slows a prefill engine.

    python -m bench.prefill_cost                      # cpu profile's model, 6k history + 1k new
    python -m bench.prefill_cost --history 3000 --new 700 --reps 3
    python -m bench.prefill_cost --grid --model fleet-qwen3 --compiled   # the simulation's grid

One experiment per suspected cause of bidir's prefill engine computing the same new tokens
more slowly than a single engine (the cpu profile's gap):

* `plain`: an engine as `single` runs it; the history is in its prefix cache.
* `nixl`: the same engine with the NixlConnector configured as the app's prefill engine
  (its KV cache layout and scheduler/worker hooks), no transfer: the connector's own cost.
* `plain+decode`, `nixl+decode`: the same while another engine process decodes two
  sequences without pause, as the decode engine does beside prefill in bidir (cores and
  memory bandwidth shared).

Each variant runs in a fresh process: one engine (one OpenMP thread, unbound, as the app
sizes engines on this 2-core machine), the history computed once, then `--reps` requests
of the history plus `--new` fresh tokens each, `max_tokens=1`, timed from submission to
output; then the time per token of 64 decode steps over the same history. Prints a
markdown table of the medians per variant and their ratio to `plain`.

`--grid` (the `plain` variant unless `--variants` says otherwise) calibrates the fleet
simulation (`bench.sim.params`): one engine computes each history of `--histories` once,
then per (history, new) pair of `--histories` x `--news` times `--reps` requests of the
history plus that many fresh tokens (median seconds to the first output), and per history
length the decode step time of `--batches` sequences, each over its own history of that
length (64 steps, less the same request's time to its first output). Prints the points
and the least-squares fits of `bench.sim.costs.fit_prefill` and `fit_decode`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

from bench import RESULTS

VARIANTS = ("plain", "nixl", "plain+decode", "nixl+decode")
RESULT = "prefill-cost: "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefill_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default="bench-qwen3", help="a path, or a shape of bench.models (default: %(default)s)"
    )
    p.add_argument("--history", type=int, default=6000, help="cached history tokens (default: %(default)s)")
    p.add_argument(
        "--new", type=int, default=1000, help="new tokens computed per request (default: %(default)s)"
    )
    p.add_argument("--reps", type=int, default=3, help="timed requests per variant (default: %(default)s)")
    p.add_argument("--variants", default=None, help="comma-separated (default: all; with --grid: plain)")
    p.add_argument("--grid", action="store_true", help="every pair of --histories x --news, one engine")
    p.add_argument("--histories", default="0,2048,6144,12288,24576", help="grid: cached tokens")
    p.add_argument("--news", default="64,256,1024", help="grid: new tokens per request")
    p.add_argument("--batches", default="1,4", help="grid: sequences decoding together at each history")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="compile the model (enforce_eager off), as the fleet profile's engines run",
    )
    p.add_argument(
        "--max-model-len", type=int, default=0, help="default: 12288, or what the grid's largest prompt needs"
    )
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine (default: %(default)s)")
    p.add_argument(
        "--raw-nixl",
        action="store_true",
        help="without the app's vLLM plugin settings (NIXL's progress thread spins)",
    )
    p.add_argument("--out", help="default: results/prefill_cost.json (--grid: prefill_cost_grid.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _max_model_len(args: argparse.Namespace) -> int:
    if args.max_model_len:
        return args.max_model_len
    if not args.grid:
        return 12288
    need = max(_ints(args.histories)) + max(_ints(args.news)) + 64
    return max(12288, -(-need // 1024) * 1024)


def _engine(args: argparse.Namespace, nixl: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if nixl:
        kv = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"backends": ["UCX"], "bidirectional_kv_xfer": True},
        )
    return LLM(**engine_settings(args, _max_model_len(args)), kv_transfer_config=kv)


def engine_settings(args: argparse.Namespace, max_model_len: int) -> dict:
    """The measured engine's vLLM arguments (the fleet study's model settings: random
    weights in float32, prefix caching, 1 GiB of KV), for `LLM` here and `AsyncLLM` in
    `bench.prefill_joining`."""
    return {
        "model": args.model,
        "load_format": "dummy",
        "dtype": "float32",
        "enforce_eager": not args.compiled,
        "max_model_len": max_model_len,
        "block_size": 32,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": 1 << 30,
        "disable_log_stats": True,
    }


def _measure(args: argparse.Namespace, nixl: bool) -> dict:
    from vllm import SamplingParams, TokensPrompt

    if args.grid:
        return _measure_grid(args, _engine(args, nixl))
    llm = _engine(args, nixl)
    rng = random.Random(0)
    history = [rng.randrange(10, 500) for _ in range(args.history)]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=history)], one, use_tqdm=False)
    times = []
    for rep in range(args.reps + 1):  # the first one warms up
        new = [rng.randrange(10, 500) for _ in range(args.new)]
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=history + new)], one, use_tqdm=False)
        elapsed = time.perf_counter() - t
        cached = out[0].num_cached_tokens or 0
        if rep:
            times.append(elapsed)
        assert cached >= args.history - 32, f"history not cached ({cached} of {args.history})"
    # Decode steps over the same history: 64 tokens after a fully cached prompt.
    steps = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
    itl = []
    for _ in range(2):
        prompt = history + [rng.randrange(10, 500)]
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)  # cache it
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], steps, use_tqdm=False)
        itl.append((time.perf_counter() - t) / 64)
    return {"seconds": times, "median_s": statistics.median(times), "itl_s": min(itl)}


def _measure_grid(args: argparse.Namespace, llm) -> dict:
    """The grid's points on one engine (see the module docstring)."""
    from vllm import SamplingParams, TokensPrompt

    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    steps = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)

    def timed(prompts: list[list[int]], sampling) -> tuple[float, list]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        return time.perf_counter() - t, out

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(n)]

    timed([fresh(300)], one)  # warm-up (compilation, first allocations)
    points, decode = [], []
    for history_len in _ints(args.histories):
        history = fresh(history_len)
        cold_s = timed([history], one)[0] if history else 0.0
        for new_len in _ints(args.news):
            times, cached = [], []
            for rep in range(args.reps + 1):  # the first one warms up
                elapsed, out = timed([history + fresh(new_len)], one)
                if rep:
                    times.append(elapsed)
                    cached.append(out[0].num_cached_tokens or 0)
            assert min(cached) >= history_len - 32, f"history not cached ({cached} of {history_len})"
            point = {"history": history_len, "new": new_len, "cached": min(cached), "seconds": times}
            points.append(point | {"median_s": statistics.median(times), "cold_s": cold_s})
            print(f"history {history_len} new {new_len}: {statistics.median(times):.4f} s", file=sys.stderr)
        # Each decoding sequence over its own history, as a fleet's streams are (sequences
        # sharing one would read its KV from the CPU's cache).
        others = [fresh(history_len) for _ in range(max(_ints(args.batches)) - 1)]
        if history_len and others:
            timed(others, one)
        for batch in _ints(args.batches):
            prompts = [h + fresh(1) for h in [history, *others][:batch]]
            first = min(timed(prompts, one)[0] for _ in range(2))  # the first call caches them
            total = min(timed(prompts, steps)[0] for _ in range(2))
            step_s = max(0.0, total - first) / 64
            decode.append({"history": history_len, "batch": batch, "step_s": step_s, "first_s": first})
    return {"points": points, "decode": decode}


def _decode_forever(args: argparse.Namespace) -> None:
    from vllm import SamplingParams, TokensPrompt

    llm = _engine(args, nixl=False)
    rng = random.Random(1)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 500) for _ in range(2000)]) for _ in range(2)]
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    print("ready", flush=True)
    while True:
        llm.generate(prompts, long, use_tqdm=False)


def _env(args: argparse.Namespace) -> dict:
    from app.config import EngineRoleConfig, TransferConfig
    from app.engines.setup import plugin_env

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "UCX_NET_DEVICES": "lo",
    }
    # The app's engine settings (`app.engines.setup.plugin_env`), as every CPU engine of the app
    # gets them; --raw-nixl leaves vLLM and NIXL as they are.
    settings = plugin_env(TransferConfig(), EngineRoleConfig(), transfer=True, cpu=True)
    for key, value in settings.items():
        env.pop(key, None)
        if value is not None and not args.raw_nixl:
            env[key] = value
    return env


def _run(args: argparse.Namespace, variant: str) -> dict:
    base = [
        sys.executable,
        "-m",
        "bench.prefill_cost",
        "--model",
        args.model,
        "--history",
        str(args.history),
        "--new",
        str(args.new),
        "--reps",
        str(args.reps),
        "--max-model-len",
        str(_max_model_len(args)),
    ]
    if args.compiled:
        base.append("--compiled")
    if args.grid:
        base += ["--grid", "--histories", args.histories, "--news", args.news, "--batches", args.batches]
    decoder = None
    try:
        if variant.endswith("+decode"):
            # Its own process group: vLLM's engine core is a child process, and killing only
            # the driver would leave it running (and holding its memory).
            decoder = subprocess.Popen(
                base + ["--worker", "decode"],
                env=_env(args),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            assert decoder.stdout is not None  # stdout=PIPE
            while (line := decoder.stdout.readline()) and line.strip() != "ready":
                pass
            time.sleep(2)
        worker = "nixl" if variant.startswith("nixl") else "plain"
        done = subprocess.run(
            base + ["--worker", worker], env=_env(args), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
        return json.loads(
            next(line for line in done.stdout.splitlines() if line.startswith(RESULT))[len(RESULT) :]
        )
    finally:
        if decoder is not None:
            os.killpg(decoder.pid, signal.SIGKILL)
            decoder.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model in _shapes():
        from bench.models import ensure_model

        args.model = str(ensure_model(args.model))
    if args.worker == "decode":
        _decode_forever(args)
        return 0
    if args.worker:
        print(RESULT + json.dumps(_measure(args, nixl=args.worker == "nixl")), flush=True)
        return 0
    variants = args.variants or ("plain" if args.grid else ",".join(VARIANTS))
    results = {}
    for variant in variants.split(","):
        t = time.perf_counter()
        results[variant] = _run(args, variant)
        took = f"({time.perf_counter() - t:.0f} s with start-up)"
        if args.grid:
            print(f"{variant}: {len(results[variant]['points'])} points {took}", flush=True)
        else:
            print(f"{variant}: median {results[variant]['median_s']:.2f} s {took}", flush=True)
    out = args.out or str(RESULTS / ("prefill_cost_grid.json" if args.grid else "prefill_cost.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results}, f, indent=2
        )
    print(_grid_table(args, results) if args.grid else _table(args, results))
    print(f"results: {out}")
    return 0


def _table(args: argparse.Namespace, results: dict) -> str:
    base = results.get("plain", {}).get("median_s")
    lines = [
        f"{args.new} new tokens over a cached history of {args.history}, "
        f"model `{os.path.basename(args.model)}`, "
        f"{args.threads} thread(s) per engine, median of {args.reps}.",
        "",
        "| variant | prefill seconds | vs plain | decode ms a token | vs plain |",
        "|---|---:|---:|---:|---:|",
    ]
    base_itl = results.get("plain", {}).get("itl_s")
    for variant, r in results.items():
        ratio = f"{r['median_s'] / base:.2f}x" if base else "-"
        itl_ratio = f"{r['itl_s'] / base_itl:.2f}x" if base_itl else "-"
        lines.append(f"| {variant} | {r['median_s']:.2f} | {ratio} | {1000 * r['itl_s']:.1f} | {itl_ratio} |")
    return "\n".join(lines)


def _grid_table(args: argparse.Namespace, results: dict) -> str:
    """Per variant: the measured points, then the fits the simulation uses."""
    from bench.sim.costs import fit_decode, fit_prefill

    lines = [
        f"model `{os.path.basename(args.model)}`, {args.threads} thread(s), "
        f"{'compiled' if args.compiled else 'eager'}, median of {args.reps}."
    ]
    for variant, r in results.items():
        lines += [
            "",
            f"{variant}:",
            "",
            "| history | new | cached | ms to first output |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {p['history']} | {p['new']} | {p['cached']} | {1000 * p['median_s']:.1f} |"
            for p in r["points"]
        ]
        lines += ["", "| history | batch | decode ms a step |", "|---:|---:|---:|"]
        lines += [f"| {d['history']} | {d['batch']} | {1000 * d['step_s']:.2f} |" for d in r["decode"]]
        fixed, token_s, attn_s, ctx_s = fit_prefill(
            [(p["history"] + p["new"] - p["cached"], p["cached"], p["median_s"]) for p in r["points"]]
        )
        step_s, seq_s, step_ctx_s = fit_decode([(d["batch"], d["history"], d["step_s"]) for d in r["decode"]])
        lines += [
            "",
            f"prefill fit: {1000 * fixed:.2f} ms + {1e6 * token_s:.2f} us a token "
            f"+ {1e9 * attn_s:.2f} ns a token per context token + {1e9 * ctx_s:.0f} ns per cached token",
            f"decode fit: {1000 * step_s:.2f} ms a step + {1000 * seq_s:.3f} ms a sequence "
            f"+ {1e9 * step_ctx_s:.0f} ns per context token",
        ]
    return "\n".join(lines)


def _shapes():
    from bench.models import SHAPES

    return SHAPES


if __name__ == "__main__":
    sys.exit(main())
