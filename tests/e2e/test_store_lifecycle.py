"""The session store's lifetime follows the application: `SessionStore` (a Serve deployment)
owns its shard actors, a redeploy with other settings gets a store with them, a restarted
shard is empty but answers, and deleting the app removes the shards. No engines needed:
the deployment is run on its own (the builder binds the same deployment into the app;
`test_faults.py` reads the app's store settings back)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from tests.conftest import PD_PORT

pytestmark = pytest.mark.e2e


def _settings(ttl: float):
    from connector.settings import StoreSettings

    return StoreSettings(
        handle_ttl_s=ttl,
        decoder_ttl_s=40,
        max_sessions=100,
        max_blocks_per_engine=1000,
        index_block_size=32,
        shards=2,
    )


def _dead(actor, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.5)
    return False


def test_store_follows_redeploys_survives_shard_restarts_and_leaves_with_the_app(ray_cluster):
    from ray import serve

    from connector.actor import SessionStore
    from connector.client import StoreClient
    from connector.store_api import StoreUnavailable

    serve.start(http_options={"host": "127.0.0.1", "port": PD_PORT})  # as the `apps` fixture
    name = "store-lifecycle"
    serve.run(SessionStore.bind(_settings(25)), name=name, route_prefix=None)
    handle = serve.get_deployment_handle("SessionStore", name)
    settings, old_shards = handle.shards.remote().result()
    assert settings == _settings(25) and len(old_shards) == 2
    assert [ray.get(s.stats.remote())["settings"]["handle_ttl_s"] for s in old_shards] == [25, 25]

    # Redeploy with a new handle TTL: a new store with the new setting; the old shards go.
    serve.run(SessionStore.bind(_settings(30)), name=name, route_prefix=None)
    client = StoreClient.of_deployment(handle, _settings(30))
    stats = asyncio.run(client.stats())
    assert [s["settings"]["handle_ttl_s"] for s in stats["shards"]] == [30, 30]
    assert all(_dead(s) for s in old_shards)
    # An ingress built for other settings refuses the running store (no reuse, no error).
    with pytest.raises(StoreUnavailable, match="settings"):
        asyncio.run(StoreClient.of_deployment(handle, _settings(25)).stats())

    # A shard restart loses its state, never the calls after it.
    async def claim_and_restart():
        await client.begin_turn("s1")  # a turn in flight holds a lease
        assert (await client.stats())["shards"][_shard("s1")]["open_leases"] == 1
        _, shards = await handle.shards.remote()
        ray.kill(shards[_shard("s1")], no_restart=False)
        # The kill is asynchronous: the old shard may still answer for a moment. Only a
        # restart can drop the lease (no turn ended it), so wait for the fresh shard.
        for _ in range(60):
            try:
                stats = await client.stats()
                if stats["shards"][_shard("s1")]["open_leases"] == 0:
                    return stats
            except StoreUnavailable:
                pass
            await asyncio.sleep(0.5)
        raise AssertionError("the restarted shard never answered, or kept the lease")

    stats = asyncio.run(claim_and_restart())
    assert stats["shards"][_shard("s1")]["open_leases"] == 0  # lost with the old shard
    assert asyncio.run(client.begin_turn("s2")).session_id == "s2"  # and it serves again

    # Deleting the app removes the store.
    _, shards = handle.shards.remote().result()
    serve.delete(name)
    assert all(_dead(s) for s in shards)


def _shard(session_id: str) -> int:
    from connector.store_api import shard_of

    return shard_of(session_id, 2)
