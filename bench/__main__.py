"""kvturn benchmark: multi-turn agentic sessions through each serving mode.

    python -m bench                          # CPU profile: oneway, bidir, single, one after another
    python -m bench --profile smoke --out /tmp/smoke.json
    python -m bench --profile gpu            # one accelerator, Qwen3-8B shape, ~24k-token histories
    python -m bench --url http://host:8000 --label bidir-prod   # an already running deployment
    python -m bench --api responses          # sessions speak OpenAI's Responses API (bidir, single)
    python -m bench store --quick            # the session store alone (bench/store.py)

Without --url it starts a local Ray cluster of its own, deploys the app once per mode
(`oneway`: plain P/D, prefill recomputes the history each turn; `bidir`: P/D with the
history pulled back from decode; `single`: one engine with prefix caching and session
affinity, no transfer), drives the same workload through each, deletes it, and shuts
Ray down. Results: a JSON file, a PNG of TTFT p50 per turn next to it, and markdown
tables on stdout.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import RESULTS, settings
from bench.apis import Api
from bench.profiles import DEFAULT_MODES, MODES, PROFILES, cluster_cpus
from bench.profiles import profile as get_profile

DEFAULT_OUT = RESULTS / "latest.json"

PROFILE_HELP = """\
profiles:
  cpu    (default) models/bench-qwen3: Qwen3 with 12 layers, hidden 768, 12 heads / 4 KV
         heads, head_dim 64, intermediate 2048, random weights (load_format=dummy),
         float32 (bfloat16 is far slower on CPUs without AVX512-BF16), eager; 1 GiB KV
         cache per engine; each engine replica gets half the cores (num_cpus), and the app
         sizes its OpenMP threads from that, unbound (--threads to set them).
         2 sessions x 6 turns, concurrency 2: system ~600 tokens, tool results ~1400
         tokens, answers 32 tokens, histories up to ~8k tokens (seed 4).
         About 12 minutes on 2 cores.
  agentic  The embedded model with the app's defaults; 2 sessions x 24 short turns, mostly
         tool results of 100-300 tokens, histories up to ~7k tokens (coding agents).
  gpu    One accelerator (e.g. an H200) shared by prefill and decode (num_gpus 0.5 and
         gpu_memory_utilization 0.45 each; the single engine gets the same share).
         models/bench-qwen3-8b: Qwen3-8B's architecture (36 layers, hidden 4096, 32/8
         heads, head_dim 128, intermediate 12288) with random weights, bfloat16, CUDA
         graphs, 32 GiB KV cache per engine, max_model_len 32768. 8 sessions x 6 turns,
         concurrency 8: system ~2000, tool results ~4400, answers 128 tokens; histories
         up to ~24k tokens. KV moves over NIXL/UCX from GPU memory (no UCX_NET_DEVICES
         set: pass --env UCX_NET_DEVICES=... to pin one).
  chat   The embedded model with the app's defaults (compiled, 1 GiB KV), 1 session x 6
         turns of ~300 new tokens, 16-token answers: the fixed per-turn cost of P/D.
  smoke  The embedded tiny model, 2 sessions x 2 turns of short texts.
  elastic  The agentic workload, 6 sessions x 8 turns (~3k-token histories), on 1 prefill +
         2 decode replicas; one decode replica is removed after turn 4, once with the
         drain's moves on and once off (drain.migrate): the affected sessions' next-turn
         TTFT against their steady state. About 3 minutes on 2 cores.
  autoscale  The elastic workload on a decode pool autoscaling 1-2 on KV in use (target
         0.15, 128 MiB decode engines): up under load, down once all but one session
         ended; the kept session's next turn shows its KV survived.

Prefill prefix caching is off in every profile (--prefill-prefix-caching turns it on):
the benchmark has one prefill engine, whose own cache would keep every session's last
prompt, so `oneway` would not recompute the history and `bidir` would pull nothing.
With many prefill replicas and least-loaded routing, a turn rarely finds its session's
history in the prefill replica it lands on.

The benchmark models share the tiny model's tokenizer (its vocabulary is small, so the
embedding and LM head are too); they are written under models/ on first use.
"""


API_HELP = """\
APIs (--api; one per run, every session, warm-up included, on the same workload):
  chat       (default) POST /v1/chat/completions: the whole history every turn, the
             session in the session header.
  responses  POST /v1/responses, stateful: after the first turn only the new input, with
             previous_response_id (no session header). Tool results of --tool-calls
             workloads go as function_call + function_call_output items, others as user
             messages. Needs the app's response store: not in oneway, which is left out of
             the default --modes.
  messages   POST /v1/messages (Anthropic): the whole history every turn, tool results as
             tool_result blocks, tool calls as tool_use blocks; no session header (the
             server finds the conversation by its prompt). The API has no kvturn extension:
             no per-request reuse facts or app timings.
The results name the API in a top-level "api" field and in each mode's; run the benchmark
once per API (e.g. --out results/responses.json) to compare reuse and TTFT.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        epilog=API_HELP + "\n" + PROFILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--profile", choices=PROFILES, default="cpu", help="model, engine and workload preset (default: cpu)"
    )
    p.add_argument(
        "--modes",
        help=f"comma-separated modes to deploy, in order, of {','.join(MODES)} (default: "
        f"{','.join(DEFAULT_MODES)}; without oneway for --api responses). dp: two single engines with "
        "session affinity, the same engine count as P/D; dp-again: dp once more "
        "(dp,MODE,dp-again brackets MODE)",
    )
    p.add_argument(
        "--api",
        type=Api,
        choices=list(Api),
        default=Api.CHAT,
        metavar="{" + ",".join(a.value for a in Api) + "}",
        help="the API every session speaks (default: chat; see APIs below)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        help="replay a JSONL conversation trace (session_id, timestamp, input_tokens, output_tokens; "
        "see bench/traces.py) instead of the profile's workload",
    )
    p.add_argument("--url", help="benchmark a deployment already serving at URL (one mode; no deploy)")
    p.add_argument("--label", help="name of the --url deployment in the results (default: 'url')")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="results JSON; the PNG goes next to it (default: results/latest.json)",
    )
    p.add_argument(
        "--port", type=int, default=8300, help="Serve HTTP port of the local cluster (default: %(default)s)"
    )

    w = p.add_argument_group("workload (defaults come from the profile)")
    w.add_argument("--sessions", type=int, help="concurrent conversations")
    w.add_argument("--turns", type=int, help="turns per conversation")
    w.add_argument("--concurrency", type=int, help="sessions in flight at once")
    w.add_argument(
        "--level-sessions",
        type=int,
        default=1,
        help="fleet profiles: sessions per agent at each level; a level keeps its agents running at "
        "once and starts the next session as one ends (more turns for its TTFT by history bucket)",
    )
    w.add_argument(
        "--max-agents",
        type=int,
        help="fleet profiles: run only the levels of at most this many agents (the first runs anyway)",
    )
    w.add_argument("--system-tokens", type=int, help="shared system prompt length")
    w.add_argument("--user-tokens", type=int, help="user message length")
    w.add_argument("--tool-tokens", type=int, help="tool result length")
    w.add_argument("--answer-tokens", type=int, help="answer length (max_tokens, ignore_eos)")
    w.add_argument(
        "--tool-prob", type=float, help="chance a later turn adds a tool result instead of a user message"
    )
    w.add_argument("--seed", type=int, help="workload seed")
    w.add_argument(
        "--tool-calls",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="answers before a tool result go back as assistant tool calls (rendered by the chat template)",
    )
    w.add_argument(
        "--warmup-turns",
        type=int,
        default=2,
        help="turns of the unmeasured warm-up session per mode (0: none; default 2)",
    )

    e = p.add_argument_group("engines (defaults come from the profile)")
    e.add_argument("--model", help="model path or id (overrides the profile's model)")
    e.add_argument("--dtype", help="e.g. float32, bfloat16")
    e.add_argument("--load-format", help="vLLM load format (profile default: dummy, random weights)")
    e.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skip graph capture/compilation",
    )
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--kv-cache-mib", type=int, help="KV cache per engine in MiB")
    e.add_argument(
        "--decode-kv-cache-mib",
        type=int,
        help="the decode (and single) engine's KV cache in MiB, when it differs",
    )
    e.add_argument(
        "--prefill-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching on the prefill engine",
    )
    e.add_argument("--pull-timeout-s", type=float, help="the app's transfer.pull_timeout_s (profile default)")
    e.add_argument(
        "--decode-local-tokens",
        type=int,
        help="the app's transfer.decode_local_tokens: bidir turns computing at most this many tokens "
        "skip prefill (0: none do)",
    )
    e.add_argument(
        "--decode-local-busy-tokens",
        type=int,
        help="the app's transfer.decode_local_busy_tokens: while prefill is busy, bidir turns computing "
        "at most this many tokens go to their decode replica when it answers sooner (0: never)",
    )
    e.add_argument(
        "--host-offload-gib",
        type=float,
        help="accelerator profiles: host DRAM per engine for vLLM's OffloadingConnector beside NIXL "
        "(transfer.host_offload_bytes)",
    )
    e.add_argument(
        "--threads",
        type=int,
        help="CPU profiles: OpenMP threads per engine (default: the app's sizing, half the cores)",
    )
    e.add_argument(
        "--cpu-binding",
        choices=("nobind", "exclusive", "vllm"),
        help="CPU profiles: the app's cpu_binding per engine (default: the app's, nobind)",
    )
    e.add_argument(
        "--transfer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of the app's transfer.* settings, e.g. decode_chunk_tokens=128 (repeatable; "
        "the value is read as JSON, else as a string)",
    )
    e.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for Ray and the engines (repeatable)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _profile_from(args: argparse.Namespace):
    prof = get_profile(args.profile)
    spec_changes = {
        k: getattr(args, k)
        for k in (
            "sessions",
            "turns",
            "concurrency",
            "system_tokens",
            "user_tokens",
            "tool_tokens",
            "answer_tokens",
            "tool_prob",
            "seed",
            "tool_calls",
        )
        if getattr(args, k) is not None
    }
    from dataclasses import replace

    env = dict(prof.env)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    transfer = {**prof.transfer, **settings(args.transfer, "--transfer")}
    return prof.with_overrides(
        transfer=transfer,
        workload=replace(prof.workload, **spec_changes),
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_mib << 20 if args.kv_cache_mib else None,
        decode_kv_cache_bytes=args.decode_kv_cache_mib << 20 if args.decode_kv_cache_mib else None,
        prefill_prefix_caching=args.prefill_prefix_caching,
        pull_timeout_s=args.pull_timeout_s,
        decode_local_tokens=args.decode_local_tokens,
        decode_local_busy_tokens=args.decode_local_busy_tokens,
        cpu_threads=args.threads,
        cpu_binding=args.cpu_binding,
        host_offload_bytes=int(args.host_offload_gib * (1 << 30)) if args.host_offload_gib else None,
        env=env,
    )


# Modes that keep no responses: a Responses chain can't continue there.
NO_RESPONSE_STORE = ("oneway",)


def _modes(requested: str | None, api: Api) -> list[str]:
    """The modes to deploy, in order: `--modes`, or all that can serve `api`."""
    if requested is None:
        return [m for m in DEFAULT_MODES if not (api is Api.RESPONSES and m in NO_RESPONSE_STORE)]
    modes = [m.strip() for m in requested.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}: choose from {list(MODES)}")
    stateless = [m for m in modes if m in NO_RESPONSE_STORE]
    if api is Api.RESPONSES and stateless:
        raise SystemExit(f"--api responses needs the response store, which mode(s) {stateless} lack")
    return modes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["store"]:  # the session store benchmark: python -m bench store [--quick ...]
        from bench import store

        return store.main(argv[1:])
    args = parse_args(argv)
    prof = _profile_from(args)
    from tqdm import tqdm

    from bench import report, runner
    from bench.deploy import LocalCluster
    from bench.workload import TokenCounter, WorkloadSpec, generate

    started = time.perf_counter()
    spec: WorkloadSpec = prof.workload
    model_path = runner.resolve_model(prof) if not args.url else (args.model or runner.resolve_model(prof))
    counter = TokenCounter(model_path)
    if args.trace is not None:
        from bench.traces import read_trace, to_workload

        workload = to_workload(read_trace(args.trace, system_tokens=spec.system_tokens), counter)
    elif prof.trace is not None:
        from bench.traces import to_workload

        workload = to_workload(prof.trace.generate(), counter, seed=prof.trace.seed)
    else:
        workload = generate(spec, counter)
    spec = workload.spec
    warmup = None
    if args.warmup_turns > 0:
        from dataclasses import replace

        warm_spec = replace(
            spec,
            sessions=1,
            concurrency=1,
            turns=args.warmup_turns,
            system_tokens=min(spec.system_tokens, 200),
            tool_tokens=min(spec.tool_tokens, 300),
        )
        warmup = generate(warm_spec, counter, tag="warmup")

    if prof.name in ("fleet", "fleet-32k", "fleet-gpu") and not args.url and args.trace is None:
        from bench import fleet

        modes = _modes(args.modes or "dp,oneway,bidir", args.api)
        return fleet.main(args, prof, model_path, modes, lambda msg: print(msg, file=sys.stderr))
    if prof.name in ("elastic", "autoscale"):
        from bench import elastic

        run = elastic.main if prof.name == "elastic" else elastic.autoscale_main
        return run(args, prof, model_path, workload, warmup, lambda msg: print(msg, file=sys.stderr))
    modes = [args.label or "url"] if args.url else _modes(args.modes, args.api)

    total = len(modes) * spec.sessions * spec.turns
    bar = tqdm(total=total, unit="turn", disable=args.no_progress, file=sys.stderr, dynamic_ncols=True)

    def log(msg: str) -> None:
        bar.write(msg, file=sys.stderr)

    def on_turn(record) -> None:
        bar.update(1)
        if record.ok:
            bar.set_postfix_str(f"s{record.session} t{record.turn} ttft {record.ttft_s:.2f}s")
        else:
            log(f"  session {record.session} turn {record.turn}: {record.error}")

    runs = []
    if args.url:
        bar.set_description(modes[0])
        runs.append(runner.run_url(args.url, modes[0], workload, warmup, on_turn, log, api=args.api))
    else:
        with LocalCluster(args.port, prof.env, num_cpus=cluster_cpus()) as cluster:
            for mode in modes:
                bar.set_description(mode)
                runs.append(
                    runner.run_mode(
                        cluster, prof, mode, model_path, workload, warmup, on_turn, log, api=args.api
                    )
                )
    bar.close()

    meta = {
        "profile": prof.name,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": None,
        "model": model_path,
        "model_name": Path(model_path).name if "/" in model_path else model_path,
        "url": args.url,
        "api": args.api.value,
        "engine": {k: v for k, v in prof.as_dict().items() if k not in ("workload", "name", "model")},
        "workload": workload.summary(),
        "host": {
            "machine": platform.machine(),
            "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(),
        },
    }
    results = report.build_results(meta, runs, spec.turns)
    results["duration_s"] = time.perf_counter() - started
    out: Path = args.out
    report.write_json(results, out)
    png = None if args.no_plot else report.plot(results, out.with_suffix(".png"))
    print(report.markdown(results))
    print(
        f"\nresults: {out}"
        + (f"\nplot: {png}" if png else "")
        + f"\ntotal time: {results['duration_s']:.0f} s"
    )
    failed = sum(m["overall"]["errors"] for m in results["modes"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
