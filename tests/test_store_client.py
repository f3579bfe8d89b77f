"""`connector.actor.StoreClient`: shard handles fetched from the store deployment, checked
against the expected settings, fetched again after a failure; every call has a deadline.
Shards are in-process stand-ins whose `.remote()` calls return awaitables (no Ray)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from connector.actor import StoreClient, StoreSettings, StoreUnavailable
from connector.store import HandleStore, TurnOutcome

SETTINGS = StoreSettings(handle_ttl_s=10, decoder_ttl_s=20, max_sessions=10, max_blocks_per_engine=100, index_block_size=4)


class _Method:
    def __init__(self, shard, name):
        self._shard, self._name = shard, name

    def remote(self, *args):
        async def call():
            if self._shard.hang:
                await asyncio.sleep(3600)
            if self._shard.dead:
                raise ray.exceptions.RayActorError()
            return getattr(self._shard.store, self._name)(*args)

        return call()


class FakeShard:
    def __init__(self):
        self.store = HandleStore(**SETTINGS.store_kwargs())
        self.hang = False
        self.dead = False

    def __getattr__(self, name):
        return _Method(self, name)


class Source:
    def __init__(self, settings=SETTINGS):
        self.settings = settings
        self.shards = [FakeShard()]
        self.fetches = 0

    async def __call__(self):
        self.fetches += 1
        return self.settings, self.shards


async def test_shards_are_fetched_once_and_used_directly():
    source = Source()
    client = StoreClient(source, SETTINGS)
    claim = await client.begin_turn("s1")
    assert (await client.stats())["shards"][0]["open_leases"] == 1
    await client.end_turn(claim, TurnOutcome.UNUSED, None)
    assert (await client.stats())["shards"][0]["open_leases"] == 0
    assert source.fetches == 1


async def test_a_store_with_other_settings_is_refused_until_it_has_ours():
    source = Source(StoreSettings(**{**SETTINGS.__dict__, "handle_ttl_s": 5}))
    client = StoreClient(source, SETTINGS)
    with pytest.raises(StoreUnavailable, match="settings"):
        await client.begin_turn("s1")
    source.settings = SETTINGS  # the redeploy finished
    await client.begin_turn("s1")
    assert source.fetches == 2


async def test_a_late_call_is_unavailable_and_the_shards_are_fetched_again():
    source = Source()
    client = StoreClient(source, SETTINGS, timeout_s=0.05)
    await client.stats()
    source.shards[0].hang = True
    with pytest.raises(StoreUnavailable):
        await client.begin_turn("s1")
    source.shards = [FakeShard()]  # a new store replica with new shards
    await client.begin_turn("s1")
    assert source.fetches == 2


async def test_a_dead_shard_is_unavailable():
    source = Source()
    client = StoreClient(source, SETTINGS)
    source.shards[0].dead = True
    with pytest.raises(StoreUnavailable, match="failed"):
        await client.match([1, 2, 3])


async def test_an_engine_budget_is_split_among_the_shards():
    source = Source()
    source.shards = [FakeShard(), FakeShard(), FakeShard()]
    client = StoreClient(source, SETTINGS)
    await client.set_engine_capacity("d-0", 300)
    # pinned_fraction 0.5 of 100 blocks each: three shards together keep at most 150.
    assert [s.store._pins.budget("d-0") for s in source.shards] == [50, 50, 50]
