"""`python -m bench --profile elastic`: a decode replica goes away in the middle of an
agentic workload, with the drain's moves on and off.

Per run (`drain.migrate` on, then off): deploy bidir with one prefill and two decode
replicas, warm up, run the sessions to turn `DOWN_AT`, hold every session there, redeploy
with one decode replica (Serve stops one; with the moves on, it hands its conversations to
the survivor over NIXL before it goes), then resume them `RESUME_SPACING_S` apart and run
the remaining turns. A session is *affected* when its turn `DOWN_AT` was answered by the
replica that went away.

Reported per run: the affected sessions' TTFT on their next turn against their own
steady state (the mean of their two turns before) and against the unaffected sessions'
same turn; their cached tokens and miss reasons on that turn; how long the downscale took.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from bench.client import kv_stats, run_workload, served_model
from bench.deploy import LocalCluster, deployed, replica_ids
from bench.profiles import Profile, cluster_cpus
from bench.record import TurnRecord
from bench.stats import mean, ratio
from bench.workload import Workload

DOWN_AT = 4
"""The last turn before the downscale."""
RESUME_SPACING_S = 0.5
"""After the downscale the held sessions resume this far apart, in session order."""


def app_config(profile: Profile, model_path: str, app: str, migrate: bool, decode_replicas: int):
    cfg = profile.app_config("bidir", model_path, app)
    return cfg.model_copy(
        update={
            "decode": cfg.decode.model_copy(update={"num_replicas": decode_replicas}),
            "drain": cfg.drain.model_copy(update={"migrate": migrate}),
        }
    )


def _decode_replicas(app: str) -> set[str]:
    return set(replica_ids(app, "DecodeServer"))


def _wait_decode_replicas(app: str, count: int, within_s: float = 300.0) -> None:
    from ray import serve

    deadline = time.monotonic() + within_s
    while True:
        states = serve.status().applications[app].deployments["DecodeServer"].replica_states
        if states == {"RUNNING": count} and len(_decode_replicas(app)) == count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app}: decode replicas {states}")
        time.sleep(0.5)


def _serving(url: str, app: str, decode_replicas: int, warmup: Workload | None) -> tuple[str, set[str]]:
    """Once the app (answering) has its decode replicas running: the model it serves and
    those replicas' ids, after the warm-up sessions (if any) ran."""
    _wait_decode_replicas(app, decode_replicas)
    replicas = _decode_replicas(app)
    model = asyncio.run(served_model(url))
    if warmup is not None:
        asyncio.run(run_workload(url, model, warmup, session_prefix=f"warm-{uuid.uuid4().hex[:6]}"))
    return model, replicas


def run_one(
    cluster: LocalCluster,
    profile: Profile,
    model_path: str,
    workload: Workload,
    warmup: Workload | None,
    migrate: bool,
    log,
) -> dict[str, Any]:
    from ray import serve

    from app.builder import build

    label = "migrate" if migrate else "no-migrate"
    app = f"elastic-{label}"
    log(f"[{label}] deploying 1 prefill + 2 decode replicas")
    cfg = app_config(profile, model_path, app, migrate, 2)
    with deployed(cfg, cluster=cluster, name=app, health_timeout_s=300.0) as dep:
        url = dep.url
        model, before = _serving(url, app, 2, warmup)
        arrived = 0
        released = asyncio.Event()
        downscale: dict[str, float] = {}

        def scale_down() -> None:
            t = time.perf_counter()
            serve.run(build(app_config(profile, model_path, app, migrate, 1)), name=app, route_prefix="/")
            _wait_decode_replicas(app, 1)
            downscale["seconds"] = time.perf_counter() - t

        async def gate(session: int, turn: int) -> bool:
            nonlocal arrived
            if turn != DOWN_AT + 1:
                return True
            arrived += 1
            if arrived == len(workload.sessions):
                log(f"[{label}] every session paused after turn {DOWN_AT}: removing a decode replica")
                await asyncio.to_thread(scale_down)
                released.set()
            await released.wait()
            # Resume one session at a time, as they came in (not as one burst).
            await asyncio.sleep(RESUME_SPACING_S * order.index(session))
            return True

        order = [p.index for p in workload.sessions]
        records, wall = asyncio.run(
            run_workload(url, model, workload, session_prefix=f"el-{uuid.uuid4().hex[:6]}", gate=gate)
        )
        removed = before - _decode_replicas(app)
    return {"label": label, "migrate": migrate, "wall_s": wall, "downscale_s": downscale.get("seconds")} | (
        summarize(records, removed)
    )


def summarize(records: list[TurnRecord], removed: set[str]) -> dict[str, Any]:
    """The affected sessions' next turn against their steady state and the others'."""
    by = {(r.session, r.turn): r for r in records}
    sessions = sorted({r.session for r in records})
    affected = [s for s in sessions if (r := by.get((s, DOWN_AT))) and r.decode_replica in removed]
    others = [s for s in sessions if s not in affected]
    nxt = DOWN_AT + 1

    def ttfts(group: list[int], turns: range) -> list[float]:
        found = (by.get((s, t)) for s in group for t in turns)
        return [r.ttft_s for r in found if r is not None and r.ok and r.ttft_s is not None]

    steady = mean(ttfts(affected, range(DOWN_AT - 1, DOWN_AT + 1)))
    after = mean(ttfts(affected, range(nxt, nxt + 1)))
    others_after = mean(ttfts(others, range(nxt, nxt + 1)))
    next_turns = [by[(s, nxt)] for s in affected if (s, nxt) in by]
    return {
        "errors": sum(1 for r in records if not r.ok),
        "affected_sessions": affected,
        "affected_steady_ttft_s": steady,
        "affected_next_ttft_s": after,
        "unaffected_next_ttft_s": others_after,
        "next_vs_steady": ratio(after, steady),
        "next_vs_unaffected": ratio(after, others_after),
        "affected_next_cached_share": ratio(
            sum(r.cached_tokens or 0 for r in next_turns), sum(r.prompt_tokens or 0 for r in next_turns)
        ),
        "affected_next_miss_reasons": sorted({r.miss_reason for r in next_turns if r.miss_reason}),
        "records": [r.as_dict() for r in records],
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    def f(v, digits=3):
        return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    columns = (
        "run",
        "affected",
        "steady TTFT",
        "next-turn TTFT",
        "unaffected next TTFT",
        "next/steady",
        "next/unaffected",
        "cached share",
        "miss reasons",
        "downscale s",
        "errors",
    )
    lines = [
        f"Downscale 2 -> 1 decode replicas after turn {DOWN_AT}; affected: sessions whose turn {DOWN_AT} "
        "the removed replica answered. TTFT in seconds.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
    ]
    for r in runs:
        row = (
            r["label"],
            str(len(r["affected_sessions"])),
            f(r["affected_steady_ttft_s"]),
            f(r["affected_next_ttft_s"]),
            f(r["unaffected_next_ttft_s"]),
            f(r["next_vs_steady"], 2),
            f(r["next_vs_unaffected"], 2),
            f(r["affected_next_cached_share"], 2),
            ", ".join(r["affected_next_miss_reasons"]) or "-",
            f(r["downscale_s"], 1),
            str(r["errors"]),
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(args, prof: Profile, model_path: str, workload: Workload, warmup: Workload | None, log) -> int:
    if workload.spec.turns <= DOWN_AT or workload.spec.concurrency < workload.spec.sessions:
        raise SystemExit(f"--profile elastic needs more than {DOWN_AT} turns and every session in flight")
    started = time.perf_counter()
    runs = []
    with LocalCluster(args.port, prof.env, num_cpus=cluster_cpus()) as cluster:
        for migrate in (True, False):
            runs.append(run_one(cluster, prof, model_path, workload, warmup, migrate, log))
    results = {
        "profile": prof.name,
        "down_at": DOWN_AT,
        "workload": workload.summary(),
        "engine": {k: v for k, v in prof.as_dict().items() if k not in ("workload", "name")},
        "runs": runs,
        "duration_s": time.perf_counter() - started,
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(markdown(runs))
    print(f"\nresults: {out}\ntotal time: {results['duration_s']:.0f} s")
    return 1 if any(r["errors"] for r in runs) else 0


# -- autoscaling: decode 1 -> 2 under load, back to 1 when idle ----------------------------

SCALED_AT = 5
"""Sessions wait before this turn until the decode pool has scaled up."""
IDLE_AT = 7
"""Before this turn all sessions but one end (DELETE); the pool then scales down."""


def autoscale_config(profile: Profile, model_path: str, app: str):
    cfg = profile.app_config("bidir", model_path, app)
    scaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_kv_in_use": 0.15,
        "upscale_delay_s": 3.0,
        "downscale_delay_s": 15.0,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 4.0,
    }
    decode = cfg.decode.model_dump() | {"num_replicas": 1, "autoscaling": scaling}
    drain = cfg.drain.model_dump() | {"rebalance_above": 0.4, "rebalance_below": 0.2}
    return type(cfg).model_validate(cfg.model_dump() | {"decode": decode, "drain": drain})


def autoscale_main(
    args, prof: Profile, model_path: str, workload: Workload, warmup: Workload | None, log
) -> int:
    """Run the sessions to turn `SCALED_AT - 1` (the pool's KV in use passes the target),
    hold them until Serve has added a decode replica and the ingress has rebalanced onto
    it, run up to turn `IDLE_AT - 1`, then end all sessions but one (one the new replica
    holds, when there is one: Serve removes the newest replica first) and hold that one
    until Serve has removed a replica (its conversations move to the survivor); then it
    runs its last turns."""
    import httpx

    spec = workload.spec
    if spec.turns < IDLE_AT + 1 or spec.concurrency < spec.sessions or spec.sessions < 2:
        raise SystemExit(
            f"--profile autoscale needs {IDLE_AT + 1} turns and 2 sessions or more, all in flight"
        )
    app = "autoscale"
    prefix = f"as-{uuid.uuid4().hex[:6]}"
    timeline: list[tuple[float, str]] = []
    started = time.perf_counter()

    def mark(event: str) -> None:
        timeline.append((round(time.perf_counter() - started, 1), event))
        log(f"[autoscale] {timeline[-1][0]:7.1f} s  {event}")

    replica_of: dict[int, str | None] = {}  # session -> the decode replica of its last turn
    kept: set[int] = set()
    first: set[str] = set()
    cfg = autoscale_config(prof, model_path, app)
    with deployed(
        cfg, port=args.port, env=prof.env, num_cpus=cluster_cpus(), name=app, health_timeout_s=300.0
    ) as dep:
        url = dep.url
        model, first = _serving(url, app, 1, warmup)
        mark("deployed: 1 decode replica (autoscaling 1-2 on KV in use, target 0.15)")
        arrived = {SCALED_AT: 0, IDLE_AT: 0}
        released = {SCALED_AT: asyncio.Event(), IDLE_AT: asyncio.Event()}

        def scale_up_and_rebalance() -> None:
            _wait_decode_replicas(app, 2, within_s=600)
            mark("2 decode replicas running")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if ((asyncio.run(kv_stats(url)) or {}).get("turns") or {}).get("rebalance_moved"):
                    mark("the ingress rebalanced conversations onto the new replica")
                    return
                time.sleep(0.5)

        def end_others_and_scale_down() -> None:
            on_new = [s for s, r in replica_of.items() if r is not None and r not in first]
            kept.add(on_new[0] if on_new else min(replica_of))
            with httpx.Client(timeout=30) as client:
                for s in replica_of:
                    if s not in kept:
                        client.delete(f"{url}/v1/sessions/{prefix}-s{s}").raise_for_status()
            where = "the new replica" if on_new else "the first replica"
            mark(f"ended every session but {sorted(kept)} (on {where})")
            _wait_decode_replicas(app, 1, within_s=600)

        async def gate(session: int, turn: int) -> bool:
            if turn not in arrived:
                return True
            arrived[turn] += 1
            if arrived[turn] == len(workload.sessions):
                if turn == SCALED_AT:
                    mark(f"every session paused after turn {SCALED_AT - 1}: waiting for a second replica")
                    await asyncio.to_thread(scale_up_and_rebalance)
                else:
                    await asyncio.to_thread(end_others_and_scale_down)
                    mark("1 decode replica running")
                released[turn].set()
            await released[turn].wait()
            return turn != IDLE_AT or session in kept

        def on_turn(record: TurnRecord) -> None:
            if record.ok:
                replica_of[record.session] = record.decode_replica

        before = asyncio.run(kv_stats(url))
        records, wall = asyncio.run(
            run_workload(url, model, workload, session_prefix=prefix, gate=gate, on_turn=on_turn)
        )
        after = asyncio.run(kv_stats(url))
        last = _decode_replicas(app)
    store = [s.get("counts", {}) for s in ((after or {}).get("store") or {}).get("shards", [])]
    turns = ((after or {}).get("turns") or {}) if after else {}
    kept_turns = [r for r in records if r.session in kept and r.turn >= IDLE_AT - 1]
    result = {
        "profile": prof.name,
        "timeline": timeline,
        "errors": sum(1 for r in records if not r.ok),
        "rebalance_moved": turns.get("rebalance_moved", 0)
        - ((before or {}).get("turns") or {}).get("rebalance_moved", 0),
        "store_moved": sum(c.get("moved", 0) for c in store),
        "first_replicas": sorted(first),
        "last_replicas": sorted(last),
        "kept_turns": [
            {
                "session": r.session,
                "turn": r.turn,
                "decode_replica": r.decode_replica,
                "cached_tokens": r.cached_tokens,
                "prompt_tokens": r.prompt_tokens,
                "miss_reason": r.miss_reason,
                "ttft_s": r.ttft_s,
            }
            for r in kept_turns
        ],
        "wall_s": wall,
        "records": [r.as_dict() for r in records],
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    for t, event in timeline:
        print(f"{t:7.1f} s  {event}")
    print(f"conversations moved: {result['store_moved']} (rebalancing: {result['rebalance_moved']})")
    for k in result["kept_turns"]:
        cached, prompt, miss, replica = (
            k["cached_tokens"],
            k["prompt_tokens"],
            k["miss_reason"],
            k["decode_replica"],
        )
        print(
            f"kept session {k['session']}, turn {k['turn']} on {replica}: "
            f"cached {cached} of {prompt}, miss {miss}"
        )
    print(f"decode replicas: first {result['first_replicas']}, last {result['last_replicas']}")
    print(f"errors: {result['errors']}\nresults: {out}")
    return 1 if result["errors"] else 0
