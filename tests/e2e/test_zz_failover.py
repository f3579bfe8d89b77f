"""Runs last: nothing leaked after the suite, then engines die under the conversation.

The faults are real: Serve replicas of the shared `pd` app killed with `ray.kill` (their
engine processes follow them), between turns, in the middle of a streamed answer, and the
whole prefill pool. Each turn after a fault answers with the reference engine's tokens;
a stream cut by its decode replica ends with an OpenAI-style error event and `[DONE]`."""

from __future__ import annotations

import json
import time

import httpx
import ray

from tests.e2e.helpers import MODEL, SYSTEM, chat, kv_stats, reference_tokens


def _replica_actor(deployment: str, replica: str | None = None):
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith(f"SERVE_REPLICA::pd#{deployment}#") and (
            replica is None or name.endswith(replica)
        ):
            return ray.get_actor(name, namespace="serve")
    raise AssertionError(f"no live {deployment} replica {replica or ''}")


def _wait_running(deployment: str, replicas: int, within_s: float = 600.0) -> None:
    """Until Serve runs `replicas` healthy replicas of `deployment` again (a killed one is
    replaced, its engine started anew)."""
    from ray import serve

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = serve.status().applications["pd"].deployments[deployment].replica_states
        if states.get("RUNNING", 0) >= replicas and sum(states.values()) == states.get("RUNNING", 0):
            return
        time.sleep(2)
    raise AssertionError(f"{deployment} not back to {replicas} replicas: {states}")


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


def test_response_chain_outlives_its_ingress_replica(apps):
    """Stored responses live in the store's shards: a chain goes on through the ingress
    replica that replaced the one that answered its first turn, with its history reused."""
    body = {"model": MODEL, "instructions": SYSTEM, "input": "Where is Oslo?", "max_output_tokens": 12}
    body["temperature"] = 0
    first = {
        app: httpx.post(apps["url"] + prefix + "/v1/responses", json=body, timeout=300).json()
        for app, prefix in (("pd", ""), ("ref", "/ref"))
    }
    ray.kill(_replica_actor("Ingress"), no_restart=True)
    _wait_running("Ingress", 1)
    deadline = time.monotonic() + 120
    while httpx.get(apps["url"] + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the new ingress replica never became healthy"
        time.sleep(1)
    follow = {**body, "input": "And its weather?"}
    second = {
        app: httpx.post(
            apps["url"] + prefix + "/v1/responses",
            json={**follow, "previous_response_id": first[app]["id"]},
            timeout=300,
        )
        for app, prefix in (("pd", ""), ("ref", "/ref"))
    }
    assert second["pd"].status_code == 200, second["pd"].text
    mine, theirs = second["pd"].json(), second["ref"].json()
    history = first["pd"]["usage"]["input_tokens"] + first["pd"]["usage"]["output_tokens"]
    assert mine["usage"]["input_tokens_details"]["cached_tokens"] >= 0.9 * history, mine["usage"]
    assert mine["kvturn"]["session_id"] == first["pd"]["kvturn"]["session_id"]
    assert mine["output"][0]["content"][0]["text"] == theirs["output"][0]["content"][0]["text"]


def test_decode_replica_killed_between_turns(apps):
    url = apps["url"]
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Survive a lost decode replica. " * 3},
    ]
    first = chat(url, msgs, session="failover", max_tokens=20)
    victim = first.kvturn["decode_replica"]
    ray.kill(_replica_actor("DecodeServer", victim), no_restart=True)
    msgs += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Tool result: ok. " * 4},
    ]
    second = chat(url, msgs, session="failover", max_tokens=20)
    assert second.kvturn["decode_replica"] != victim
    assert second.token_ids == reference_tokens(url, second.prompt_token_ids, len(second.token_ids))


def test_decode_replica_killed_mid_stream(apps):
    url = apps["url"]
    _wait_running("DecodeServer", 2)  # the replica killed above is back
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Lose the stream, keep the session. " * 2},
    ]
    first = chat(url, msgs, session="midstream", max_tokens=8)
    victim = first.kvturn["decode_replica"]
    msgs += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now a long answer, please."},
    ]
    # The session's next turn streams from the same replica; it dies after the first token.
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    events, killed_at = [], None
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": "midstream"}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if killed_at is None and line.startswith("data: {") and '"content"' in line:
                killed_at = len(events)
                ray.kill(_replica_actor("DecodeServer", victim), no_restart=True)
    assert killed_at is not None and events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "decode_failed" and error["error"]["type"] == "server_error", error
    # Tokens were streamed before the error, fewer than asked: the answer was cut.
    streamed = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert (
        0
        < sum(len(c["choices"][0]["delta"].get("content") or "") for c in streamed if c.get("choices"))
        < 1500
    )
    # The client sends the turn again: the surviving replica answers it correctly.
    again = chat(url, msgs, session="midstream", max_tokens=12)
    assert again.kvturn["decode_replica"] != victim
    assert again.token_ids == reference_tokens(url, again.prompt_token_ids, len(again.token_ids))


def test_unstreamed_turn_outlives_its_decode_replica(apps):
    """A turn that does not stream has sent nothing when its decode replica dies midway:
    a surviving replica computes it again, and the client gets the whole answer."""
    import threading

    url = apps["url"]
    _wait_running("DecodeServer", 2)  # the replica killed above is back
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Lose the replica, not the answer. " * 2},
    ]
    first = chat(url, msgs, session="unstreamed", max_tokens=8)
    victim = first.kvturn["decode_replica"]
    msgs += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now a long answer, please."},
    ]
    before = kv_stats(url)["turns"]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 800,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    reply: dict = {}

    def send():
        reply["r"] = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"x-session-id": "unstreamed"}, timeout=300
        )

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.5)  # the prefill leg is done and decode is generating (800 tokens take seconds)
    assert "r" not in reply, "the answer finished before the replica could be killed"
    ray.kill(_replica_actor("DecodeServer", victim), no_restart=True)
    sender.join()
    r = reply["r"]
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["kvturn"]["decode_replica"] != victim
    ids = b["choices"][0]["token_ids"]
    assert len(ids) == 800 and ids == reference_tokens(url, b["prompt_token_ids"], 800)
    after = kv_stats(url)["turns"]
    assert after.get("decode_restarted", 0) - before.get("decode_restarted", 0) == 1, (before, after)
    assert after.get("decode_failed", 0) == before.get("decode_failed", 0)


def test_prefill_pool_lost_decode_computes_the_turn(apps):
    url = apps["url"]
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Survive a lost prefill pool. " * 3},
    ]
    first = chat(url, msgs, session="no-prefill", max_tokens=12)
    assert first.kvturn["reused_from_decode"] == 0
    counts = kv_stats(url)["turns"]
    ray.kill(_replica_actor("PrefillServer"), no_restart=True)  # the only prefill replica
    msgs += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Tool result: still fine. " * 4},
    ]
    started = time.monotonic()
    second = chat(url, msgs, session="no-prefill", max_tokens=12)
    waited = time.monotonic() - started
    after = kv_stats(url)["turns"]
    grew = {
        k: after.get(k, 0) - counts.get(k, 0)
        for k in ("prefill_skipped", "prefill_failed", "pull_timeout", "prefill_timeout")
    }
    # The leg that pulled from the dead replica failed or timed out. Then either no prefill
    # replica answered within the deadlines and decode computed the prompt, or Serve's
    # replacement replica came up in time and recomputed it (a fast restart): the turn is
    # answered either way, without the lost pull.
    assert grew["prefill_failed"] + grew["pull_timeout"] == 1, grew
    assert grew["prefill_skipped"] == 1 or second.usage["prompt_tokens_details"]["cached_tokens"] == 0, grew
    assert second.kvturn["reused_from_decode"] == 0
    assert second.token_ids == reference_tokens(url, second.prompt_token_ids, len(second.token_ids))
    cfg = apps["pd"].transfer
    assert waited < cfg.pull_timeout_s + 2 * cfg.prefill_timeout_s + 60, waited
