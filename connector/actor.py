"""The handle store as Ray actors, and the Serve deployment that owns them.

Lifetime: `SessionStore` is a deployment of the application graph (bound by the builder
with the app's `StoreSettings`). Its one replica creates the shards (`HandleStoreActor`,
non-detached, so they die with it): a redeploy with other settings replaces the replica
and with it the shards, and `serve delete` removes them with the app; the replica kills
them when it goes (`__del__`). A shard that dies is restarted by Ray (`max_restarts=-1`)
empty: reuse is lost, never correctness.

Ingress replicas ask `SessionStore` for the shard handles (`shards()`) once, and again
after a call failed, then call the shards directly (`connector.client.StoreClient`). Each
shard actor runs a `connector.shard.StoreShard`: every operation is `call(op, *args)` or a
batch (`apply`), as `connector.store_api.StoreOp` declares them.
"""

from __future__ import annotations

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from connector.settings import StoreSettings
from connector.shard import StoreShard

HandleStoreActor = ray.remote(num_cpus=0, max_restarts=-1)(StoreShard)


@serve.deployment(
    name="SessionStore", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
)
class SessionStore:
    """Owns the shards of one app's store (created here, they share this replica's fate).
    Called by ingress replicas: `shards()` at their first store call and after a failure."""

    def __init__(self, settings: StoreSettings):
        self._settings = settings
        # Beside this replica (soft): the shards follow its placement (`sessions.store_resources`).
        near = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self._shards = [
            HandleStoreActor.options(scheduling_strategy=near).remote(settings)
            for _ in range(settings.shards)
        ]

    def shards(self) -> tuple[StoreSettings, list]:
        """This store's settings and its shard actor handles, in shard order."""
        return self._settings, self._shards

    def __del__(self):
        for shard in getattr(self, "_shards", ()):
            ray.kill(shard, no_restart=True)
