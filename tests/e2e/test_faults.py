"""Faults on the shared `pd` app: the store is the builder's (its settings are the app's),
and a restarted store shard costs reuse for one turn, never the turn."""

from __future__ import annotations

import time

import httpx
import ray
from ray import serve

from tests.e2e.helpers import SYSTEM, chat, kv_stats, reference_tokens


def test_the_apps_store_runs_with_the_apps_settings(apps):
    shards = kv_stats(apps["url"])["store"]["shards"]
    cfg = apps["pd"]
    assert len(shards) == cfg.sessions.store_shards
    assert all(s["settings"]["handle_ttl_s"] == cfg.sessions.handle_ttl_s for s in shards)
    assert all(s["settings"]["decoder_ttl_s"] == cfg.transfer.decoder_kv_blocks_ttl_s for s in shards)


def test_store_shard_restart_costs_reuse_not_the_turn(apps):
    url = apps["url"]
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Lose the store, keep the answer. " * 3},
    ]
    first = chat(url, msgs, session="store-restart", max_tokens=12)
    _, shards = serve.get_deployment_handle("SessionStore", "pd").shards.remote().result()
    for shard in shards:
        ray.kill(shard, no_restart=False)  # Ray restarts it, empty
    for _ in range(60):  # until the restarted shards answer (a turn meanwhile is served unstored)
        r = httpx.get(url + "/v1/kv/stats", timeout=30)
        if r.status_code == 200 and "shards" in r.json().get("store", {}):
            break
        time.sleep(0.5)
    msgs += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Tool result: ok. " * 4},
    ]
    second = chat(url, msgs, session="store-restart", max_tokens=12)
    # Served (by recompute: the handle was lost with the shard), with the right tokens.
    assert second.kvturn["reused_from_decode"] == 0
    assert second.token_ids == reference_tokens(url, second.prompt_token_ids, len(second.token_ids))
    # The restarted store keeps the new turn: the next turn reuses again.
    msgs += [
        {"role": "assistant", "content": second.text},
        {"role": "user", "content": "And once more. " * 4},
    ]
    third = chat(url, msgs, session="store-restart", max_tokens=12)
    assert third.kvturn["reused_from_decode"] > 0
    assert third.token_ids == reference_tokens(url, third.prompt_token_ids, len(third.token_ids))
