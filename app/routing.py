"""Session affinity for engine replicas: a Ray Serve request router.

Runs inside the ingress process (Serve builds one router per deployment handle). A request
that names a `preferred_replica` (the replica that served the session's previous turn)
goes there while that replica lives and accepts work; otherwise, and for requests without
a preference, it falls back to Serve's power-of-two-choices (least loaded of two).

The router also records which replicas are alive, so the ingress can tell that a
session's decode replica is gone before asking prefill to pull from it.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica

# deployment name -> unique ids of its running replicas, as last seen by a router here.
_LIVE: dict[str, frozenset[str]] = {}


def replica_alive(deployment: str, replica_id: str) -> bool | None:
    """Whether `replica_id` of `deployment` is running; None if no router has seen it yet."""
    live = _LIVE.get(deployment)
    return None if live is None else replica_id in live


def _preferred(pending: Optional[PendingRequest]) -> str | None:
    if pending is None or not pending.args:
        return None
    return getattr(pending.args[0], "preferred_replica", None)


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Prefer the session's replica; least loaded of two otherwise."""

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        _LIVE[self._deployment_id.name] = frozenset(r.replica_id.unique_id for r in replicas)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        ranked = await super().choose_replicas(candidate_replicas, pending_request)
        wanted = _preferred(pending_request)
        if wanted is None:
            return ranked
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == wanted:
                # Tried first; if it rejects (at max_ongoing_requests), the next rank is.
                rest = [[r for r in group if r is not replica] for group in ranked]
                return [[replica]] + [group for group in rest if group]
        return ranked
