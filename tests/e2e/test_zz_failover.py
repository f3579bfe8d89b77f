"""Runs last: nothing leaked after the suite, then engines die under the conversation.

The faults are real: Serve replicas of the shared `pd` app killed with `ray.kill` (their
engine processes follow them), between turns, in the middle of a streamed answer, and the
whole prefill pool. Each turn after a fault answers with the reference engine's tokens;
a stream cut by its decode replica goes on on a survivor, with no error event (chat, a
forced tool call, a Responses stream)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import ray

from tests.e2e.helpers import MODEL, SYSTEM, chat, kv_stats, reference_tokens


def _replica_names(deployment: str) -> list[str]:
    """The live replica actors of `deployment`, as Ray lists them."""
    prefix = f"SERVE_REPLICA::pd#{deployment}#"
    names = (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
    return [name for name in names if name.startswith(prefix)]


def _replica_actor(deployment: str, replica: str | None = None):
    for name in _replica_names(deployment):
        if replica is None or name.endswith(replica):
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


def _wait_noticed(deployment: str, replicas: int, before: set[str], within_s: float = 120.0) -> None:
    """Until Serve's controller counts fewer than `replicas` running replicas of `deployment`
    (it notices a killed replica within seconds; until then `_wait_running` would pass), or
    has already started a replica that was not among `before` (the names at the kill): a
    long answer after the kill can outlast the replacement's start."""
    from ray import serve

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = serve.status().applications["pd"].deployments[deployment].replica_states
        if states.get("RUNNING", 0) < replicas or sum(states.values()) != states.get("RUNNING", 0):
            return
        if set(_replica_names(deployment)) - before:
            return
        time.sleep(1)
    raise AssertionError(f"Serve never noticed a killed {deployment} replica: {states}")


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


def _killed_mid_stream(url: str, path: str, body: dict, plain: dict, session: str, output: Callable):
    """Send `plain` under `session` (its decode replica becomes the session's), then `body`
    streamed under it; kill that replica at the first data event the client got output in
    (`output(event)`). Returns the victim, the stream's data events and the counters' growth."""
    headers = {"x-session-id": session}
    r = httpx.post(url + path, json=plain, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    victim = r.json()["kvturn"]["decode_replica"]
    before = kv_stats(url)["turns"]
    events: list[dict] = []
    killed = False
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=300) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if not killed and output(events[-1]):
                names = set(_replica_names("DecodeServer"))
                ray.kill(_replica_actor("DecodeServer", victim), no_restart=True)
                killed = True
    assert killed, events[-3:]
    _wait_noticed("DecodeServer", 2, names)  # so that the next test waits for its replacement
    after = kv_stats(url)["turns"]
    grew = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert not any("error" in e or e.get("type") in ("error", "response.failed") for e in events), events[-2:]
    assert grew.get("decode_failed", 0) == 0, grew
    return victim, events, grew


def _has_tokens(event: dict) -> bool:
    return any(c.get("token_ids") for c in event.get("choices", []))


def _has_tool_call(event: dict) -> bool:
    return any(c["delta"].get("tool_calls") for c in event.get("choices", []))


def _has_text(event: dict) -> bool:
    return event.get("type") == "response.output_text.delta" and bool(event["delta"])


def _reference(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + "/ref" + path, json={**body, "stream": False}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_decode_replica_killed_mid_stream_the_answer_goes_on(apps):
    """The session's decode replica dies after the first token of a long greedy stream: a
    survivor computes the prompt plus the tokens sent and goes on; the client gets every
    token once, the reference engine's, and no error event."""
    url = apps["url"]
    _wait_running("DecodeServer", 2)  # the replica killed above is back
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Lose the replica, not the stream. " * 2},
    ]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 800,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    plain = {**body, "stream": False, "max_tokens": 8}
    del plain["stream_options"]
    started = time.monotonic()
    victim, events, grew = _killed_mid_stream(
        url, "/v1/chat/completions", body, plain, "midstream", _has_tokens
    )
    waited = time.monotonic() - started
    choices = [c for e in events for c in e.get("choices", [])]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    last = events[-1]
    ref = _reference(url, "/v1/chat/completions", plain | {"max_tokens": 800})
    assert next(e["prompt_token_ids"] for e in events if "prompt_token_ids" in e) == ref["prompt_token_ids"]
    assert len(ids) == 800 and ids == ref["choices"][0]["token_ids"]
    assert text == ref["choices"][0]["message"]["content"]
    assert last["usage"]["completion_tokens"] == 800
    assert next(e["kvturn"] for e in events if "kvturn" in e)["decode_replica"] != victim
    assert grew.get("decode_continued") == 1 and grew.get("decode_continued_resumed") == 1, grew
    assert grew.get(f"decode_continued_from/resumed/{victim}") == 1, grew
    # The tokens sent before the cut: in the survivor's prompt, or generated again where
    # they end mid-character (the random model's answer starts with an invalid byte).
    sent = grew.get("decode_continued_tokens", 0) + grew.get("decode_replayed_tokens", 0)
    assert 0 < sent < 800, grew
    print(f"\nstream cut after {sent} tokens, answered in {waited:.1f} s: {grew}")


WRITE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "description": "Write a note",
        "parameters": {
            "type": "object",
            "properties": {"note": {"type": "string"}},
            "required": ["note"],
            "additionalProperties": False,
        },
    },
}


def test_decode_replica_killed_mid_tool_call_the_call_goes_on(apps):
    """A forced tool call streams structured output: the survivor replays the answer under
    the same grammar and the client gets the arguments it lacks, the reference's."""
    url = apps["url"]
    _wait_running("DecodeServer", 2)
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Write a long note about the replicas. " * 2},
    ]
    plain = {
        "model": MODEL,
        "messages": msgs,
        "tools": [WRITE],
        "tool_choice": {"type": "function", "function": {"name": "write_note"}},
        "max_tokens": 400,
        "temperature": 0,
        "return_token_ids": True,
    }
    body = {**plain, "stream": True}
    victim, events, grew = _killed_mid_stream(
        url, "/v1/chat/completions", body, {**plain, "max_tokens": 8}, "midcall", _has_tool_call
    )
    choices = [c for e in events for c in e.get("choices", [])]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
    arguments = "".join((tc.get("function") or {}).get("arguments") or "" for tc in calls)
    ref = _reference(url, "/v1/chat/completions", plain)["choices"][0]
    assert ids == ref["token_ids"]
    assert arguments == ref["message"]["tool_calls"][0]["function"]["arguments"]
    assert [tc["function"]["name"] for tc in calls if (tc.get("function") or {}).get("name")] == [
        "write_note"
    ]
    assert grew.get("decode_continued_replayed_grammar") == 1, grew
    assert grew.get(f"decode_continued_from/replayed_grammar/{victim}") == 1, grew


def test_decode_replica_killed_mid_response_stream_the_response_goes_on(apps):
    url = apps["url"]
    _wait_running("DecodeServer", 2)
    plain = {
        "model": MODEL,
        "instructions": SYSTEM,
        "input": "Keep the response going when a replica dies. " * 2,
        "max_output_tokens": 600,
        # The greedy answer would end after ~35 tokens, before the kill lands on a loaded
        # machine: the whole 600 keep the stream going while the replica dies.
        "ignore_eos": True,
        "temperature": 0,
    }
    body = {**plain, "stream": True}
    victim, events, grew = _killed_mid_stream(
        url, "/v1/responses", body, {**plain, "max_output_tokens": 8}, "midresponse", _has_text
    )
    text = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    # The answer runs to its limit: the response ends incomplete (max_output_tokens).
    done = next(e for e in events if e.get("type") == "response.incomplete")["response"]
    ref = _reference(url, "/v1/responses", plain)
    assert text == ref["output"][0]["content"][0]["text"] == done["output"][0]["content"][0]["text"]
    assert done["usage"]["output_tokens"] == ref["usage"]["output_tokens"] == 600
    assert done["incomplete_details"] == ref["incomplete_details"] == {"reason": "max_output_tokens"}
    assert grew.get("decode_continued") == 1, grew
    assert grew.get(f"decode_continued_from/resumed/{victim}") == 1, grew


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
