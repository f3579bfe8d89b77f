"""Session store benchmark: the handle store at agent-fleet scale.

    python -m bench.store                             # 1k, 10k, 100k sessions, then the Ray actor
    python -m bench.store --quick                     # 1k and 10k, shorter actor run
    python -m bench.store --sessions 1000 --no-actor
    python -m bench store --quick                     # the same via `make bench BENCH_ARGS="store --quick"`

Live sessions of `--tokens` (8k) tokens sharing a `--system` (2k) token system prompt, each
with its rendered text (`--chars-per-token` characters a token) and a decode handle on one
of `--engines` engines, are stored in one `connector.store.HandleStore`, in this process.
Then, on random sessions:

* begin+end turn: `begin_turn` and `end_turn` storing the next turn (64 new prompt tokens
  and a 128-token answer), timed together (building the next turn is not timed);
* sessionless match of a new conversation (the system prompt and a new 512-token message);
* sessionless match of an existing conversation's next turn (its tokens and 64 more).

Prompts are passed as lists of ints and the new turn as a compact `Conversation`, as they
arrive through Ray. Also: bytes per session (the store's estimate) and the process's
resident memory growth while building. Then, through the real Ray actor
(`connector.actor.HandleStoreActor`, `ray.init(num_cpus=2)`: run it under the heavy lock),
`--callers` asyncio callers in this process do begin+end turn pairs on `--actor-sessions`
sessions for `--actor-seconds` through `StoreClient`, as an ingress does (its per-shard
batches included): turns/s of one shard and the latency of a pair.

Results: JSON (`--out`) and a markdown table next to it (same name, `.md`), also printed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import RESULTS
from bench.store_fleet import BLOCK, NEW_MESSAGE, NEXT_PROMPT, Fleet
from connector.store import HandleStore, TurnOutcome

DEFAULT_OUT = RESULTS / "store.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sessions",
        default="1000,10000,100000",
        help="live session counts, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--quick", action="store_true", help="1k and 10k sessions, fewer operations, a 5 s actor run"
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens per conversation (default: %(default)s)")
    p.add_argument(
        "--system", type=int, default=2048, help="shared system prompt tokens (default: %(default)s)"
    )
    p.add_argument(
        "--chars-per-token",
        type=int,
        default=4,
        help="rendered text per token; 0: no text (default: %(default)s)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=16,
        help="decode engines the handles are spread over (default: %(default)s)",
    )
    p.add_argument(
        "--ops", type=int, default=2000, help="timed operations of each kind per size (default: %(default)s)"
    )
    p.add_argument(
        "--actor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure through the Ray actor",
    )
    p.add_argument(
        "--actor-sessions", type=int, default=1000, help="sessions in the actor (default: %(default)s)"
    )
    p.add_argument(
        "--actor-seconds", type=float, default=15.0, help="length of the actor run (default: %(default)s)"
    )
    p.add_argument(
        "--callers",
        type=int,
        default=8,
        help="concurrent asyncio callers of the actor (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (default: results/store.json)")
    args = p.parse_args(argv)
    if args.quick:
        if args.sessions == p.get_default("sessions"):
            args.sessions = "1000,10000"
        args.ops = min(args.ops, 500)
        args.actor_seconds = min(args.actor_seconds, 5.0)
    args.sizes = [int(s) for s in args.sessions.split(",") if s.strip()]
    return args


def new_store(sessions: int) -> HandleStore:
    return HandleStore(
        handle_ttl_s=420,
        decoder_ttl_s=480,
        max_sessions=sessions * 2,
        max_blocks_per_engine=10**12,
        index_block_size=BLOCK,
        max_store_bytes=1 << 40,
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary_ms(values: list[float]) -> dict:
    return {
        "p50_ms": pct(values, 0.5) * 1e3,
        "p99_ms": pct(values, 0.99) * 1e3,
        "mean_ms": statistics.fmean(values) * 1e3,
    }


# -- in process ---------------------------------------------------------------------------------


def run_size(fleet: Fleet, n: int, ops: int, rng: random.Random, log) -> dict:
    gc.collect()
    rss0 = rss_bytes()
    started = time.perf_counter()
    store = new_store(n)
    for i in range(n):
        store.put(fleet.conversation(i))
        if i and i % 20_000 == 0:
            log(f"  {i} sessions stored ({time.perf_counter() - started:.0f} s)")
    build_s = time.perf_counter() - started
    gc.collect()
    rss = rss_bytes() - rss0
    stats = store.stats()
    log(
        f"  {n} sessions in {build_s:.1f} s; store {stats['bytes'] / 2**20:.0f} MiB, "
        f"rss +{rss / 2**20:.0f} MiB"
    )

    gc.disable()  # time the store, not the collector's passes over 100k records
    try:
        turn_s = []
        for k in range(ops):
            sid = f"s{rng.randrange(n)}"
            t0 = time.perf_counter()
            claim = store.begin_turn(sid)
            t1 = time.perf_counter()
            assert claim.conversation is not None  # no session is evicted here
            nxt = fleet.next_turn(claim.conversation, 10**7 + k)
            t2 = time.perf_counter()
            store.end_turn(claim.lease_id, TurnOutcome.PULLED, nxt)
            turn_s.append((t1 - t0) + (time.perf_counter() - t2))

        store.counts.clear()
        new_s = []
        for k in range(ops):
            prompt = list(fleet.system + fleet.unique(NEW_MESSAGE, 2 * 10**7 + k))
            message = fleet.text(NEW_MESSAGE, 2 * 10**7 + k)
            text = (
                fleet.system_text + message if fleet.system_text is not None and message is not None else None
            )
            t0 = time.perf_counter()
            matched, _ = store.match(prompt, text)
            new_s.append(time.perf_counter() - t0)
            assert matched is None, f"a new conversation matched {matched}"
        new_work = {k: v / ops for k, v in store.counts.items() if k.startswith("match_")}

        store.counts.clear()
        next_s = []
        for k in range(ops):
            sid = f"s{rng.randrange(n)}"
            conv = store.begin_turn(sid)
            store.end_turn(conv.lease_id, TurnOutcome.UNUSED, None)
            held = conv.conversation
            assert held is not None  # no session is evicted here
            prompt = list(held.compact_ids + fleet.unique(NEXT_PROMPT, 3 * 10**7 + k))
            more = fleet.text(NEXT_PROMPT, 3 * 10**7 + k)
            text = held.text + more if held.text is not None and more is not None else None
            t0 = time.perf_counter()
            found, agree = store.match(prompt, text)
            next_s.append(time.perf_counter() - t0)
            assert found == sid and agree == held.num_tokens, (sid, found, agree)
        next_work = {k: v / ops for k, v in store.counts.items() if k.startswith("match_")}
    finally:
        gc.enable()
    result = {
        "sessions": n,
        "build_s": build_s,
        "bytes_per_session": stats["bytes_per_session"],
        "store_bytes": stats["bytes"],
        "rss_growth_bytes": rss,
        "begin_end_turn": summary_ms(turn_s),
        "match_new": {**summary_ms(new_s), "work_per_match": new_work},
        "match_next_turn": {**summary_ms(next_s), "work_per_match": next_work},
    }
    del store
    gc.collect()
    return result


# -- through the Ray actor --------------------------------------------------------------------


def run_actor(fleet: Fleet, args: argparse.Namespace, log) -> dict:
    import ray

    from connector.actor import HandleStoreActor
    from connector.client import StoreClient
    from connector.settings import StoreSettings

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = HandleStoreActor.remote(
            StoreSettings(
                handle_ttl_s=420,
                decoder_ttl_s=480,
                max_sessions=10**6,
                max_blocks_per_engine=10**12,
                index_block_size=BLOCK,
            )
        )
        n = args.actor_sessions
        # What an ingress replica uses: per-turn operations batched per shard.
        client = StoreClient.of_actors([actor], timeout_s=60.0)

        async def preload():
            # Each session's earlier turns, through this client as through an ingress.
            for start in range(0, n, 64):
                claims = await asyncio.gather(
                    *(client.begin_turn(f"s{i}") for i in range(start, min(n, start + 64)))
                )
                await asyncio.gather(
                    *(
                        client.end_turn(c, TurnOutcome.UNUSED, fleet.conversation(int(c.session_id[1:])))
                        for c in claims
                    )
                )

        async def caller(idx: int, stop_at: float, pairs: list[float]):
            rng = random.Random(args.seed + idx)
            k = 0
            while time.perf_counter() < stop_at:
                sid = f"s{rng.randrange(n)}"
                t0 = time.perf_counter()
                claim = await client.begin_turn(sid)
                held = claim.conversation
                nxt = fleet.next_turn(held, 4 * 10**7 + idx * 10**6 + k) if held is not None else None
                await client.end_turn(claim, TurnOutcome.PULLED, nxt)
                pairs.append(time.perf_counter() - t0)
                k += 1

        async def run() -> tuple[list[float], float, float]:
            await preload()
            pairs: list[float] = []
            cpu0 = (await actor.stats.remote())["cpu_s"]
            t0 = time.perf_counter()
            await asyncio.gather(*(caller(i, t0 + args.actor_seconds, pairs) for i in range(args.callers)))
            elapsed = time.perf_counter() - t0
            return pairs, elapsed, (await actor.stats.remote())["cpu_s"] - cpu0

        t0 = time.perf_counter()
        pairs, elapsed, cpu_s = asyncio.run(run())
        log(
            f"  actor: {len(pairs)} turns in {elapsed:.1f} s ({len(pairs) / elapsed:.0f}/s), "
            f"preload {time.perf_counter() - t0 - elapsed:.0f} s"
        )
        # What a turn costs the shard's process (all its threads), whoever else shares the cores:
        # the rate one shard would sustain on a core of its own with callers that keep up.
        us_per_turn, per_cpu_s = 1e6 * cpu_s / max(1, len(pairs)), len(pairs) / max(cpu_s, 1e-9)
        log(
            f"  shard CPU: {cpu_s:.1f} s, {us_per_turn:.0f} us a turn ({per_cpu_s:,.0f} turns per CPU-second)"
        )
        stats = ray.get(actor.stats.remote())
        return {
            "sessions": n,
            "callers": args.callers,
            "seconds": elapsed,
            "turns": len(pairs),
            "turns_per_s": len(pairs) / elapsed,
            "shard_cpu_s": cpu_s,
            "shard_cpu_us_per_turn": us_per_turn,
            "turns_per_shard_cpu_s": per_cpu_s,
            "pair_latency": summary_ms(pairs),
            "bytes_per_session": stats["bytes_per_session"],
        }
    finally:
        ray.shutdown()


# -- report -----------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    a = results["args"]
    lines = [
        f"Sessions of {a['tokens']} tokens sharing a {a['system']}-token system prompt, "
        f"text {a['chars_per_token']} chars/token, "
        f"{a['engines']} engines, {a['ops']} operations each; {results['host']['cpus']} CPUs.",
        "",
        "| live sessions | build | bytes/session | RSS growth | begin+end turn p50 / p99 "
        "| match new conversation p50 / p99 | match next turn p50 / p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["in_process"]:
        t, m, x = r["begin_end_turn"], r["match_new"], r["match_next_turn"]
        lines.append(
            f"| {r['sessions']:,} | {r['build_s']:.0f} s | {r['bytes_per_session'] / 1024:.1f} KiB "
            f"| {r['rss_growth_bytes'] / 2**30:.2f} GiB "
            f"| {t['p50_ms']:.3f} / {t['p99_ms']:.3f} ms | {m['p50_ms']:.2f} / {m['p99_ms']:.2f} ms "
            f"| {x['p50_ms']:.2f} / {x['p99_ms']:.2f} ms |"
        )
    actor = results.get("actor")
    if actor:
        p = actor["pair_latency"]
        lines += [
            "",
            "| through the Ray actor (1 shard) | sessions | callers | turns/s | begin+end p50 / p99 "
            "| shard CPU a turn | turns per shard CPU-second |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| `HandleStoreActor` | {actor['sessions']:,} | {actor['callers']} "
            f"| {actor['turns_per_s']:,.0f} "
            f"| {p['p50_ms']:.2f} / {p['p99_ms']:.2f} ms "
            f"| {actor['shard_cpu_us_per_turn']:.0f} us | {actor['turns_per_shard_cpu_s']:,.0f} |",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    fleet = Fleet(args)
    rng = random.Random(args.seed)
    results: dict = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "sizes")},
        "in_process": [],
    }
    for n in args.sizes:
        log(f"{n} sessions in process")
        results["in_process"].append(run_size(fleet, n, args.ops, rng, log))
    if args.actor:
        log(f"Ray actor, {args.actor_sessions} sessions, {args.callers} callers")
        try:
            results["actor"] = run_actor(fleet, args, log)
        except Exception as exc:  # keep the in-process figures
            log(f"  actor run failed: {exc!r}")
            results["actor_error"] = repr(exc)
    table = markdown(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
