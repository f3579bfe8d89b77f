"""Runs last: nothing leaked after the suite, then a decode replica dies mid-conversation."""

from __future__ import annotations

import time

import ray

from tests.e2e.helpers import SYSTEM, chat, kv_stats, reference_tokens


def test_no_handle_left_claimed_and_pins_expire(apps):
    stats = kv_stats(apps["url"])["store"]["shards"]
    assert all(s["claimed_handles"] == 0 and s["open_leases"] == 0 for s in stats), stats
    assert any(s["counts"].get("pulled", 0) > 0 for s in stats)
    time.sleep(apps["pd"].transfer.decoder_kv_blocks_ttl_s + 1)
    stats = kv_stats(apps["url"])["store"]["shards"]
    # Every handle left the store (expired, superseded, pulled) and no decode engine is
    # believed to pin blocks for us past its TTL.
    assert all(sum(s["pinned_blocks"].values()) == 0 for s in stats), stats
    assert all(s["handles"].get("stored", 0) == 0 for s in stats), stats


def test_decode_replica_killed_between_turns(apps):
    url = apps["url"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Survive a lost decode replica. " * 3}]
    first = chat(url, msgs, session="failover", max_tokens=20)
    victim = first.kvturn["decode_replica"]
    name = next(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::pd#DecodeServer#") and a["name"].endswith(victim)
    )
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Tool result: ok. " * 4}]
    second = chat(url, msgs, session="failover", max_tokens=20)
    assert second.kvturn["decode_replica"] != victim
    assert second.token_ids == reference_tokens(url, second.prompt_token_ids, len(second.token_ids))
