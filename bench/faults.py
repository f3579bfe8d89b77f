"""The soak run's faults (`bench.soak`): killing a Serve replica of a deployment (Serve
replaces it) or a handle-store shard (Ray restarts it, empty), at points of the load drawn
by a seed; and finding the app's store shards.
"""

from __future__ import annotations

import asyncio
import random
import time

from bench.deploy import replica_ids


def kill_replica(app: str, deployment: str, rng: random.Random) -> dict:
    import ray

    ids = replica_ids(app, deployment)
    if not ids:
        return {"target": deployment, "killed": None, "why": "no replica found"}
    rid = rng.choice(sorted(ids))
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{app}#{deployment}#{rid}", namespace="serve"), no_restart=True)
    return {"target": deployment, "killed": rid}


def store_shards(app: str) -> list:
    """Actor handles of the app's handle-store shards: from its `SessionStore` deployment,
    else named actors whose name has 'store' and the app's name (older layouts)."""
    import ray
    from ray import serve

    try:
        _, shards = serve.get_deployment_handle("SessionStore", app).shards.remote().result(timeout_s=30)
        return list(shards)
    except Exception:
        pass
    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (actor.get("name"), actor.get("namespace")) if isinstance(actor, dict) else (actor, None)
        if name and "store" in name and app in name and not name.startswith("SERVE_"):
            found.append(ray.get_actor(name, namespace=ns))
    return found


def kill_store_shard(app: str, rng: random.Random) -> dict:
    import ray

    shards = store_shards(app)
    if not shards:
        return {"target": "store", "killed": None, "why": "no store shard found"}
    index = rng.randrange(len(shards))
    ray.kill(shards[index], no_restart=False)  # Ray restarts it, empty
    return {"target": "store", "killed": f"shard {index} of {len(shards)}"}


async def fault_injector(args, kills: list[dict], t0: float, done: list, total: int, can_kill: bool) -> None:
    """Kill a decode replica, a prefill replica and a store shard (`args.app`'s) at points
    drawn by `args.seed`, as fractions of the `total` turns (`done[0]` answered so far);
    each kill's event goes to `kills` (times since `t0`). `args.kills_together` kills the
    prefill replica in the same moment as the decode replica."""
    rng = random.Random(args.seed)
    plan = sorted((rng.uniform(0.1, 0.7), target) for target in ("DecodeServer", "PrefillServer", "store"))
    if args.kills_together:
        at = next(f for f, target in plan if target == "DecodeServer")
        plan = sorted((at if target == "PrefillServer" else f, target) for f, target in plan)
    for fraction, target in plan:
        while done[0] < fraction * total:
            await asyncio.sleep(0.2)
        event = {"at_turns_answered": done[0], "at_s": round(time.monotonic() - t0, 1)}
        if not can_kill:
            event.update(target=target, killed=None, why="no Ray cluster reachable")
        else:
            try:
                # Off the event loop: Serve refuses blocking handle calls inside one.
                if target == "store":
                    result = await asyncio.to_thread(kill_store_shard, args.app, rng)
                else:
                    result = await asyncio.to_thread(kill_replica, args.app, target, rng)
            except Exception as exc:
                result = {"target": target, "killed": None, "why": repr(exc)}
            event.update(result)
        kills.append(event)
        print(f"[soak] fault: {event}", flush=True)
