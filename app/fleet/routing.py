"""Session affinity for engine replicas: a Ray Serve request router (public API,
`ray.serve.request_router`), and the liveness view it feeds.

Runs inside the ingress process (Serve builds one router per deployment handle). A request
that names a `preferred_replica` (the replica that served the session's previous turn)
goes there while that replica lives and accepts work; otherwise, and for requests without
a preference, Serve's power of two choices: two random replicas, the less loaded first.
A retried request names the replicas that failed it (`avoid_replicas`): they are left out
while another replica runs.

Liveness: Serve tells each router which replicas are running (`update_replicas`, from the
controller's long poll) and which died (`on_replica_actor_died`, when a call to one fails
with an actor death). The router publishes that to `LIVENESS`, keyed by (app, deployment),
and the ingress reads it through a `LiveReplicas` view it is handed, to tell that a
session's decode replica is gone before asking prefill to pull from it. Serve builds
routers itself from a class path (no object can be handed to one), so this per-process
table is the channel; it holds only what Serve last told the routers here.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from connector.patching import require_set_in_init


class Liveness:
    """Running replicas per (app, deployment), as the routers of this process last saw them."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, str], frozenset[str]] = {}

    def record(self, app: str, deployment: str, replica_ids: frozenset[str]) -> None:
        self._live[(app, deployment)] = replica_ids

    def discard(self, app: str, deployment: str, replica_id: str) -> None:
        key = (app, deployment)
        if key in self._live:
            self._live[key] = self._live[key] - {replica_id}

    def alive(self, app: str, deployment: str, replica_id: str) -> bool | None:
        """Whether the replica runs; None while no router here has heard from Serve."""
        live = self._live.get((app, deployment))
        return None if live is None else replica_id in live

    def running(self, app: str, deployment: str) -> frozenset[str] | None:
        """The running replicas; None while no router here has heard from Serve."""
        return self._live.get((app, deployment))


LIVENESS = Liveness()


@dataclass(frozen=True)
class LiveReplicas:
    """The ingress's view of one deployment's running replicas (fed by its router)."""

    app: str
    deployment: str
    liveness: Liveness = LIVENESS

    def alive(self, replica_id: str) -> bool | None:
        return self.liveness.alive(self.app, self.deployment, replica_id)

    def running(self) -> frozenset[str] | None:
        return self.liveness.running(self.app, self.deployment)

    async def stopping(self, replica_id: str) -> bool:
        """Whether a replica out of the running set still lives: Serve is draining it
        (graceful shutdown), its engine still up. False once its actor is gone."""
        return await asyncio.to_thread(replica_actor_exists, self.app, self.deployment, replica_id)


def replica_actor_exists(app: str, deployment: str, replica_id: str) -> bool:
    """Whether Serve's actor of the replica is registered (Serve names each replica's actor
    by its full id, in its own namespace; the name goes when the actor dies)."""
    import ray

    full = f"{app}#{deployment}#{replica_id}" if app else f"{deployment}#{replica_id}"
    try:
        ray.get_actor(f"SERVE_REPLICA::{full}", namespace="serve")
    except ValueError:
        return False
    return True


def _preferred(pending: PendingRequest | None) -> str | None:
    if pending is None or not pending.args:
        return None
    return getattr(pending.args[0], "preferred_replica", None)


def _avoided(pending: PendingRequest | None) -> tuple[str, ...]:
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "avoid_replicas", ()) or ())


def _ids(replicas) -> frozenset[str]:
    return frozenset(r.replica_id.unique_id for r in replicas)


def process_liveness() -> Liveness:
    """This process's `LIVENESS`, looked up in the imported module at call time. Serve
    ships a custom router class to the handle's process pickled *by value* (its module's
    globals copied with it): a router that wrote to its own `LIVENESS` global would fill
    a copy nobody reads."""
    from app.fleet import routing

    return routing.LIVENESS


# Serve keeps a router's deployment in a private attribute; checked here, at import, so
# a Ray that changed it fails loudly instead of routing blind.
require_set_in_init(RequestRouter, "_deployment_id")


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    """Prefer the session's replica; least loaded of two random replicas otherwise."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        process_liveness().record(self.app_name, self._deployment_id.name, _ids(replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        process_liveness().discard(self.app_name, self._deployment_id.name, replica_id.unique_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        avoid = _avoided(pending_request)
        if avoid:
            # A retry: replicas that failed this turn only if no other is left.
            candidate_replicas = [
                r for r in candidate_replicas if r.replica_id.unique_id not in avoid
            ] or candidate_replicas
        wanted = _preferred(pending_request)
        preferred = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != wanted]
        two = random.sample(others, min(2, len(others)))
        # Serve probes each rank's queue lengths and takes the least loaded replica that
        # accepts; the preferred replica alone is the first rank, tried before the rest.
        return [group for group in (preferred, two) if group]
