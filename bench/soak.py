"""Soak and fault run (`make soak`, not in CI): many concurrent multi-turn sessions while
replicas and a store shard are killed, then what was left behind.

    python -m bench.soak                          # own Ray cluster and app (tiny model)
    python -m bench.soak --url http://host:8000   # a running app (kills need its Ray cluster)

Load: `--sessions` (64) sessions x `--turns` (5) chat turns, all at once; half of them
stream, and half (crossed with the first half) send no session header (the app matches
their prompts). Each turn appends the answer and a tool result. New turns stop at
`--duration-s`.

Faults, at random points of the load (drawn by `--seed`, as fractions of all turns
answered): one decode replica and one prefill replica are killed (`ray.kill` of their
Serve replica actors, `SERVE_REPLICA::<app>#DecodeServer#...`, Serve replaces them) and
one handle-store shard (restarted by Ray, its handles lost). `--kills-together` kills the
decode and the prefill replica in the same moment.

A stream that fails after its first chunk ends with an error event that names the decode
replica it ran on (`kvturn.decode_replica`); the report counts those on the killed decode
replica apart from any other (which should be none).

Report (printed as markdown, written as JSON to `results/`): requests, errors by
kind, reuse (cached / prompt tokens of later turns, and the share of later turns that
reused), handles left claimed after the load, pinned blocks on each decode engine after
the decode TTL (the engine's own block pool: `DecodeServer.kv_blocks`), and vLLM engine
processes left over (beyond live replicas while the app runs; all of them after the app
and Ray are shut down, own cluster only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import RESULTS
from bench.client import wait_healthy
from bench.deploy import deployed, engine_pids, replica_ids
from bench.faults import fault_injector, store_shards
from bench.sse import CompletionStream, apayloads

SYSTEM = "You are a build assistant. Call tools, read their results, answer briefly. " * 4
TOOL = 'Tool result: {"status": "ok", "failed": [], "log": "' + "compiled module; " * 12 + '"}'


@dataclass
class Turn:
    session: int
    turn: int
    stream: bool
    header: bool
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    miss_reason: str | None = None
    seconds: float = 0.0
    failed_on: str | None = None
    """The decode replica a failed stream ran on, as its error event says."""


@dataclass
class Report:
    config: dict
    turns: list[Turn] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    claimed_handles_after_load: int | None = None
    store_after_load: dict | None = None
    pinned_blocks_after_ttl: dict | None = None
    engine_processes_while_running: dict | None = None
    engine_processes_after_shutdown: int | None = None
    turn_counts: dict | None = None
    """The ingress's orchestration counters after the load (`/v1/kv/stats`)."""
    budgets: dict | None = None
    """Pin budgets the store holds for each live decode engine, per shard, after the TTL."""
    wall_s: float = 0.0

    def summary(self) -> dict:
        later = [t for t in self.turns if t.ok and t.turn > 1]
        errors = Counter(t.error for t in self.turns if not t.ok)
        killed_decode = {k.get("killed") for k in self.kills if k.get("target") == "DecodeServer"}
        streams_failed = [t for t in self.turns if not t.ok and (t.error or "").startswith("stream_error")]
        return {
            "requests": len(self.turns),
            "ok": sum(t.ok for t in self.turns),
            "errors": dict(errors),
            "http_errors": sum(1 for t in self.turns if (t.error or "").startswith("http_")),
            "stream_errors_on_killed_decode": sum(1 for t in streams_failed if t.failed_on in killed_decode),
            "stream_errors_elsewhere": sum(1 for t in streams_failed if t.failed_on not in killed_decode),
            "later_turns_ok": len(later),
            "reuse_token_fraction": round(
                sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later)), 3
            ),
            "later_turns_reusing": round(sum(t.cached_tokens > 0 for t in later) / max(1, len(later)), 3),
            "later_turn_misses": dict(Counter(t.miss_reason for t in later if t.miss_reason)),
            "turn_counters": self.turn_counts,
            "kills": self.kills,
            "claimed_handles_after_load": self.claimed_handles_after_load,
            "pinned_blocks_after_ttl": self.pinned_blocks_after_ttl,
            "pin_budgets_after_ttl": self.budgets,
            "engine_processes_while_running": self.engine_processes_while_running,
            "engine_processes_after_shutdown": self.engine_processes_after_shutdown,
            "wall_s": round(self.wall_s, 1),
        }


# -- load -------------------------------------------------------------------------------


async def one_turn(
    client: httpx.AsyncClient, url: str, model: str, messages: list, rec: Turn, session_id: str | None
) -> tuple[str | None, str | None]:
    """Send one turn; fill `rec`. Returns (answer text, session id to send back)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    headers = {"x-session-id": session_id} if session_id else {}
    started = time.monotonic()
    try:
        if not rec.stream:
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            if r.status_code != 200:
                rec.error = f"http_{r.status_code}"
                return None, session_id
            data = r.json()
            usage, text = data["usage"], data["choices"][0]["message"]["content"]
            rec.miss_reason = (data.get("kvturn") or {}).get("miss_reason")
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            stream = CompletionStream()
            async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    rec.error = f"http_{r.status_code}"
                    return None, session_id
                async for data in apayloads(r.aiter_lines()):
                    stream.feed(data)
            if stream.kvturn is not None:
                rec.miss_reason = stream.kvturn.get("miss_reason")
            if stream.error is not None:
                rec.error = "stream_error:" + str(stream.error.get("code") or stream.error.get("type"))
                rec.failed_on = stream.error_replica
                return None, session_id
            if not stream.done or stream.usage is None:
                rec.error = "stream_cut"
                return None, session_id
            usage, text = stream.usage, stream.text
    except httpx.HTTPError as exc:
        rec.error = "transport:" + type(exc).__name__
        return None, session_id
    finally:
        rec.seconds = time.monotonic() - started
    rec.ok = True
    rec.prompt_tokens = usage["prompt_tokens"]
    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return text, session_id


async def run_session(i: int, args, client, model: str, deadline: float, report: Report, done: list) -> None:
    stream, header = i % 2 == 0, (i // 2) % 2 == 0
    session_id = f"soak-{args.seed}-{i}" if header else None
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {i}: build target {i * 7919 % 1000} and fix what fails."},
    ]
    for t in range(1, args.turns + 1):
        if time.monotonic() > deadline:
            return
        rec = Turn(session=i, turn=t, stream=stream, header=header)
        report.turns.append(rec)
        text, session_id = await one_turn(client, args.url, model, messages, rec, session_id)
        done[0] += 1
        if text is not None:
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": TOOL}]


# -- what was left ----------------------------------------------------------------------


def store_state(app: str) -> dict | None:
    import ray

    shards = []
    for actor in store_shards(app):
        try:
            shards.append(ray.get(actor.stats.remote(), timeout=30))
        except Exception as exc:
            shards.append({"error": repr(exc)})
    return {"shards": shards} if shards else None


def decode_blocks(app: str) -> dict:
    """Per live decode replica: its engine's block pool (`kv_blocks`), or the engine stats'
    usage fraction if the replica has no `kv_blocks`."""
    from ray import serve

    from app.engines.wire import ReplicaQuery

    handle = serve.get_deployment_handle("DecodeServer", app)
    out = {}
    for rid in replica_ids(app, "DecodeServer"):
        try:
            try:
                blocks = handle.kv_blocks.remote(ReplicaQuery(rid)).result(timeout_s=60)
            except Exception:  # an app without DecodeServer.kv_blocks
                blocks = None
            if blocks is not None:
                out[rid] = {
                    k: blocks[k]
                    for k in ("engine_id", "total", "free", "pinned", "pinned_requests")
                    if k in blocks
                }
                continue
            stats = handle.stats.remote(ReplicaQuery(rid)).result(timeout_s=60)
            out[rid] = {"kv_cache_usage": stats.get("kv_cache_usage")}
        except Exception as exc:
            out[rid] = {"error": repr(exc)}
    return out


def pin_budgets(app: str, engines: dict) -> dict:
    """For each live decode engine (`decode_blocks`' replicas), the pin budget each store
    shard holds for it (None: the shard has none and applies its default)."""
    state = store_state(app) or {}
    shards = state.get("shards", [])
    out = {}
    for rid, blocks in engines.items():
        engine_id = blocks.get("engine_id")
        out[rid] = [(s.get("pin_budgets") or {}).get(engine_id) for s in shards]
    return out


def engine_processes(app: str, own: bool) -> dict:
    """Engine processes beside the live engine replicas (`own`: this driver's cluster,
    whose engines are counted alone)."""
    live = len(replica_ids(app, "DecodeServer")) + len(replica_ids(app, "PrefillServer"))
    running = len(engine_pids(os.getpid() if own else None))
    return {
        "engine_processes": running,
        "live_engine_replicas": live,
        "beyond_live_replicas": max(0, running - live),
    }


# -- driver -----------------------------------------------------------------------------


def soak_config(args):
    from app.config import AppConfig

    model = str(Path(__file__).resolve().parent.parent / "models" / "tiny-qwen3")
    return AppConfig.model_validate(
        {
            "mode": "bidir",
            "model": model,
            "enforce_eager": True,
            "max_model_len": 4096,
            "default_max_tokens": 16,
            "prefill": {
                "num_cpus": 0.5,
                "num_replicas": args.prefill_replicas,
                "enable_prefix_caching": False,
                "kv_cache_memory_bytes": 256 << 20,
            },
            "decode": {
                "num_cpus": 0.5,
                "num_replicas": args.decode_replicas,
                "kv_cache_memory_bytes": 256 << 20,
            },
            "transfer": {
                "kv_buffer_device": "cpu",
                "decoder_kv_blocks_ttl_s": args.decode_ttl_s,
                "pull_timeout_s": 15,
            },
            "sessions": {"handle_ttl_s": args.decode_ttl_s * 0.75},
            "app_name": args.app,
            "env": {"OMP_NUM_THREADS": "1"},
        }
    )


async def drive(args, report: Report, can_kill: bool) -> None:
    await wait_healthy(args.url, timeout_s=900)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=args.sessions * 2)
    ) as client:
        model = (await client.get(args.url + "/v1/models", headers={})).json()["data"][0]["id"]
        done = [0]
        report.config["t0"] = time.monotonic()
        deadline = report.config["t0"] + args.duration_s
        total = args.sessions * args.turns
        injector = asyncio.create_task(
            fault_injector(args, report.kills, report.config["t0"], done, total, can_kill)
        )
        await asyncio.gather(
            *(run_session(i, args, client, model, deadline, report, done) for i in range(args.sessions))
        )
        injector.cancel()
        try:
            stats = (await client.get(args.url + "/v1/kv/stats")).json()
            report.turn_counts = stats.get("turns")
        except Exception:
            pass


def load_and_inspect(args, report: Report, can_kill: bool, own: bool = False) -> None:
    """Run the load with its faults, then (with a Ray cluster) read what was left: the
    store after the load, pinned blocks and pin budgets after the decode TTL, engine
    processes while the app runs (`own`: the cluster is this process's)."""
    asyncio.run(drive(args, report, can_kill))
    print(f"[soak] load done: {len(report.turns)} requests", flush=True)
    if not can_kill:
        return
    time.sleep(3)  # closing store updates of the last turns
    report.store_after_load = store_state(args.app)
    shards = (report.store_after_load or {}).get("shards", [])
    report.claimed_handles_after_load = sum(int(s.get("claimed_handles") or 0) for s in shards)
    wait = args.decode_ttl_s + 15
    print(f"[soak] waiting {wait:.0f} s (decode TTL) before reading pinned blocks", flush=True)
    time.sleep(wait)
    report.pinned_blocks_after_ttl = decode_blocks(args.app)
    report.budgets = pin_budgets(args.app, report.pinned_blocks_after_ttl)
    report.engine_processes_while_running = engine_processes(args.app, own)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running app (default: deploy one on an own Ray cluster)")
    p.add_argument("--app", default="soak", help="Serve application name (faults look its replicas up)")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--duration-s", type=float, default=300.0, help="no new turn starts after this")
    p.add_argument(
        "--decode-ttl-s",
        type=float,
        default=60.0,
        help="own app: decode pin time (pinned blocks are read after it)",
    )
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8197)
    p.add_argument("--metrics-port", type=int, default=8198)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--kills-together",
        action="store_true",
        help="kill the prefill replica in the same moment as the decode replica",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import ray

    started = time.monotonic()
    report = Report(config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    if args.url is None:  # an own Ray cluster and app
        env = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
        with deployed(
            soak_config(args),
            port=args.port,
            env=env,
            num_cpus=8,
            metrics_port=args.metrics_port,
            namespace=None,
            name=args.app,
            health_timeout_s=900.0,
            engines_gone_s=60.0,
        ) as dep:
            args.url = dep.url
            print(f"[soak] app running after {time.monotonic() - started:.0f} s", flush=True)
            load_and_inspect(args, report, can_kill=True, own=True)
        report.engine_processes_after_shutdown = len(dep.left_over or ())
    else:
        try:
            ray.init(address="auto", log_to_driver=False)
            can_kill = True
        except Exception:
            can_kill = False
        load_and_inspect(args, report, can_kill)
    report.wall_s = time.monotonic() - started
    summary = report.summary()
    out = args.out or RESULTS / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report.config.pop("t0", None)
    out.write_text(
        json.dumps(
            {
                "summary": summary,
                "config": report.config,
                "turns": [asdict(t) for t in report.turns],
                "store_after_load": report.store_after_load,
            },
            indent=1,
        )
    )
    print("\n| figure | value |\n| --- | --- |")
    for key, value in summary.items():
        print(f"| {key} | {json.dumps(value)} |")
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
