"""What a prompt costs an engine that is streaming other answers, as a fleet's engines do.

    python -m bench.prefill_joining --model fleet-qwen3 --compiled --streams 0,2,4 --history 2048

The grid (`bench.prefill_cost --grid`) times prompts on an idle engine. Here one engine
(vLLM's `AsyncLLM`, the grid's settings: float32, one OpenMP thread, prefix caching)
first streams `--streams` answers without pause, each over a history of its own of
`--history` tokens; then `--reps` prompts of a cached history of `--history` tokens plus
`--new` fresh ones (`max_tokens=1`) are timed from submission to their first output, one
at a time, each after a pause of 0-20 ms (so they arrive at any point of a step).

Beside each median it prints what the simulation's engine (`bench.sim.engine.Engine`,
fitted on the grid: `bench.sim.params.cpu_fleet`) gives for the same case, probed the
same way: the grid's fit read where the fleet's engines run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import RESULTS
from bench.prefill_cost import _ints

RESULT = "prefill-joining: "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefill_joining",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="fleet-qwen3", help="a path, or a shape of bench.models")
    p.add_argument("--streams", default="0,2,4", help="answers streaming while the prompts are timed")
    p.add_argument("--history", type=int, default=2048, help="each stream's and each prompt's history")
    p.add_argument("--news", default="64,256,1024", help="fresh tokens per timed prompt")
    p.add_argument("--reps", type=int, default=8, help="timed prompts per point (default: %(default)s)")
    p.add_argument("--compiled", action="store_true", help="compile the model, as the fleet's engines run")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS / "prefill_joining.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


async def _measure(args: argparse.Namespace) -> list[dict]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from bench.prefill_cost import engine_settings

    max_len = 12288
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_settings(args, max_len)))
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    endless = SamplingParams(max_tokens=max_len - args.history - 64, temperature=0.0, ignore_eos=True)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(n)]

    async def to_first(prompt: list[int], request_id: str) -> float:
        started = time.perf_counter()
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=prompt), one, request_id):
            break
        return time.perf_counter() - started

    async def stream(request_id: str, going: asyncio.Event) -> None:
        async for out in llm.generate(
            TokensPrompt(prompt_token_ids=fresh(args.history)), endless, request_id
        ):
            if len(out.outputs[0].token_ids) >= 3:
                going.set()

    history = fresh(args.history)
    await to_first(fresh(300), "warmup")
    await to_first(history, "history")  # cached from here on
    points = []
    for k in _ints(args.streams):
        ids = [f"stream-{k}-{i}" for i in range(k)]
        going = [asyncio.Event() for _ in ids]
        tasks = [asyncio.create_task(stream(rid, ev)) for rid, ev in zip(ids, going, strict=True)]
        await asyncio.gather(*(ev.wait() for ev in going))
        for new in _ints(args.news):
            times = []
            for rep in range(args.reps + 1):  # the first one warms up
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                elapsed = await to_first(history + fresh(new), f"prompt-{k}-{new}-{rep}")
                if rep:
                    times.append(elapsed)
            points.append({"streams": k, "history": args.history, "new": new, "seconds": times})
            print(f"streams {k} new {new}: {statistics.median(times):.4f} s", file=sys.stderr)
        await llm.abort(ids)
        await asyncio.gather(*tasks, return_exceptions=True)
    llm.shutdown()
    return points


def simulated(streams: int, history: int, new: int, probes: int = 40) -> float:
    """The simulation's engine, fitted on the grid: the median seconds from a prompt's
    arrival to its first output while `streams` answers decode over their own histories,
    each probe after a pause of 0-20 ms."""
    import simpy

    from bench.sim.engine import Engine, Job
    from bench.sim.params import cpu_fleet

    env = simpy.Environment()
    engine = Engine(env, cpu_fleet().engine, "e", 32)
    rng = random.Random(0)
    seconds: list[float] = []

    def probe():
        for _ in range(streams):
            engine.submit(Job(0, history, 10**6))
        yield env.timeout(0.1)
        for _ in range(probes):
            yield env.timeout(rng.uniform(0.0, 0.02))
            job = engine.submit(Job(new, history, 1))
            yield job.first
            assert job.first_at is not None
            seconds.append(job.first_at - job.submitted_at)

    done = env.process(probe())
    env.run(until=done)
    return statistics.median(seconds)


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.models import ensure_model
    from bench.prefill_cost import _shapes

    if args.model in _shapes():
        args.model = str(ensure_model(args.model))
    if args.worker:
        print(RESULT + json.dumps(asyncio.run(_measure(args))), flush=True)
        return 0
    from bench.prefill_cost import _env

    argv_worker = [sys.executable, "-m", "bench.prefill_joining", *(argv or sys.argv[1:]), "--worker"]
    env = _env(argparse.Namespace(threads=args.threads, raw_nixl=False))
    done = subprocess.run(argv_worker, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker failed:\n{done.stderr[-3000:]}")
    points = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith(RESULT))[len(RESULT) :])
    print("| streams | history | new | ms to the first output (median) | simulated | measured / simulated |")
    print("|---:|---:|---:|---:|---:|---:|")
    for point in points:
        point["median_s"] = statistics.median(point["seconds"])
        point["simulated_s"] = simulated(point["streams"], point["history"], point["new"])
        ratio = point["median_s"] / point["simulated_s"]
        print(
            f"| {point['streams']} | {point['history']} | {point['new']} | {point['median_s'] * 1e3:.1f} "
            f"| {point['simulated_s'] * 1e3:.1f} | {ratio:.2f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "points": points}, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
