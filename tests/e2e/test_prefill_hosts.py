"""Prefill replicas that host sessions (`transfer.prefill_hosts`), end to end with real
engines: an idle prefill replica computes and streams a new session's turns itself, over
its own prefix cache, as one engine would; a turn it cannot afford (here, one past what
decode-local turns may compute) goes through an ordinary P/D leg on that replica, over
the history it caches, and the decode engine reads the whole prompt and takes the
session over. Greedy tokens equal a recomputing engine's throughout; the engines' own
counters say who computed what, and no block stays pinned on the prefill engine. A
prefill replica that stops (a downscale) hands the sessions it hosts to decode over
NIXL, as a stopping decode replica does."""

from __future__ import annotations

import time

import pytest

from tests.conftest import pd_config
from tests.e2e.helpers import SYSTEM, chat, delta, engine_stats, kv_stats, reference_tokens
from tests.e2e.test_scaling import _replicas

APP = "host"
BUSY_LIMIT = 128
SETTINGS = {
    "decode.num_replicas": 1,
    "prefill.enable_prefix_caching": True,
    "transfer.prefill_hosts": True,
    "transfer.decode_local_tokens": 48,
    "transfer.decode_local_busy_tokens": BUSY_LIMIT,
    # Outputs on a loaded 2-core runner often come past 40 ms, and a replica whose streams
    # came late hosts nothing new until it has idled 10 s: a lenient target keeps that rule
    # (tests/test_prefill_hosts.py) out of these tests of hosting and its hand-offs.
    "transfer.itl_target_ms": 1000.0,
}


@pytest.fixture(scope="module")
def host(apps):
    from ray import serve

    from app.builder import build

    cfg = pd_config(app_name=APP, **{**SETTINGS, "prefill.num_replicas": 2})
    assert cfg.prefill_hosts
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    yield {"url": apps["url"] + "/" + APP, "cfg": cfg}
    serve.delete(APP)


def _prefill_pins(replica: str) -> int:
    from ray import serve

    from app.engines.wire import ReplicaQuery

    handle = serve.get_deployment_handle("PrefillServer", APP)
    blocks = handle.kv_blocks.remote(ReplicaQuery(replica)).result()
    assert blocks["replica_id"] == replica
    return blocks["pinned_requests"]


def test_a_prefill_replica_hosts_a_session_then_hands_it_to_decode(apps, host):
    block = host["cfg"].block_size
    url = host["url"]

    # Turn 1: an idle prefill replica hosts the new session; decode computes nothing. New
    # sessions go to one of the three idle replicas at random: sessions are opened until a
    # prefill replica hosts one.
    prefills = _replicas("PrefillServer", 2, app=APP)
    for attempt in range(12):
        before = {r: engine_stats("PrefillServer", r, app=APP) for r in prefills}
        d0 = engine_stats("DecodeServer", app=APP)
        session = f"host-{attempt}"
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Attempt {attempt}. " + "Look at the logs and the build. " * 3},
        ]
        r1 = chat(url, messages, session=session, max_tokens=16, stream=True)
        if r1.kvturn["placement"] == "hosted":
            break
        assert r1.kvturn["decode_replica"] not in prefills, r1.kvturn
    assert len(r1.prompt_token_ids) <= BUSY_LIMIT
    assert r1.kvturn["placement"] == "hosted"
    hosting = r1.kvturn["decode_replica"]
    assert hosting in prefills

    def _stats():
        return engine_stats("PrefillServer", hosting, app=APP), engine_stats("DecodeServer", app=APP)

    p0 = before[hosting]
    p1, d1 = _stats()
    assert delta(p1, p0)["prompt_tokens_computed"] >= len(r1.prompt_token_ids) - block
    assert delta(d1, d0)["prompt_tokens_total"] == 0, "the decode engine got no request"
    assert r1.token_ids == reference_tokens(apps["url"], r1.prompt_token_ids, len(r1.token_ids))
    history = len(r1.prompt_token_ids) + len(r1.token_ids) - 1

    # Turn 2: there again, over what its prefix cache kept of turn 1.
    messages += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Go on."}]
    r2 = chat(url, messages, session=session, max_tokens=16)
    assert r2.kvturn["placement"] == "hosted" and r2.kvturn["spliced"]
    p2, d2 = _stats()
    p = delta(p2, p1)
    assert p["prompt_tokens_local_hit"] >= history - block, (p, history)
    assert p["prompt_tokens_computed"] <= len(r2.prompt_token_ids) - history + block, p
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == p["prompt_tokens_local_hit"]
    assert delta(d2, d1)["prompt_tokens_total"] == 0
    assert r2.token_ids == reference_tokens(apps["url"], r2.prompt_token_ids, len(r2.token_ids))

    # Turn 3 brings a tool result past what decode-local turns may compute: a P/D leg on
    # the hosting replica over its own cache (nothing pulled), and decode reads it all.
    history = len(r2.prompt_token_ids) + len(r2.token_ids) - 1
    messages += [
        {"role": "assistant", "content": r2.text},
        {"role": "user", "content": "Tool result: " + "build ok, 0 warnings; " * 24},
    ]
    r3 = chat(url, messages, session=session, max_tokens=16)
    assert len(r3.prompt_token_ids) - history > BUSY_LIMIT
    assert r3.kvturn["placement"] == "too_long"
    p3, d3 = _stats()
    p, d = delta(p3, p2), delta(d3, d2)
    assert p["prompt_tokens_local_hit"] >= history - block, (p, history)
    assert p["prompt_tokens_external"] == 0 and p["kv_transfers"] == 0, p
    # Decode computed nothing: it read what its own cache lacked (a session it took
    # before this one shares the system prompt).
    assert d["prompt_tokens_external"] + d["prompt_tokens_local_hit"] >= len(r3.prompt_token_ids) - block, d
    assert d["prompt_tokens_external"] >= history - block and d["prompt_tokens_computed"] <= block, d
    assert d["kv_transfers"] >= 1 and d["kv_failed_transfers"] == 0, d
    assert r3.kvturn["reused_from_decode"] == 0
    assert r3.token_ids == reference_tokens(apps["url"], r3.prompt_token_ids, len(r3.token_ids))
    turns = kv_stats(url)["turns"]
    assert turns["host_handoff"] == 1 and turns["placed_hosted"] == 2, turns

    # Turn 4: the session is decode's now; its short turn is computed there.
    history = len(r3.prompt_token_ids) + len(r3.token_ids) - 1
    messages += [{"role": "assistant", "content": r3.text}, {"role": "user", "content": "Thanks."}]
    r4 = chat(url, messages, session=session, max_tokens=16)
    assert r4.kvturn["placement"] == "short"
    p4, d4 = _stats()
    assert delta(p4, p3)["prompt_tokens_total"] == 0
    assert delta(d4, d3)["prompt_tokens_local_hit"] >= history - block
    assert r4.token_ids == reference_tokens(apps["url"], r4.prompt_token_ids, len(r4.token_ids))

    # Nothing stays pinned on the prefill engine: the hosted turns' blocks were released
    # when the session left, the leg's were read by decode.
    deadline = time.monotonic() + 10
    while _prefill_pins(hosting) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _prefill_pins(hosting) == 0


def test_a_stopping_prefill_replica_hands_its_sessions_to_decode(apps, host):
    """One prefill replica fewer (a redeploy that changes only the count: no restart):
    the removed one hands the sessions it hosts to the decode replica over NIXL before
    its engine ends, so their next turns reuse the whole history there; the survivor's
    sessions stay hosted on it."""
    from ray import serve

    from app.builder import build

    url, block = host["url"], host["cfg"].block_size
    prefills = _replicas("PrefillServer", 2, app=APP)
    (decode,) = _replicas("DecodeServer", 1, app=APP)
    on: dict[str, list[str]] = {r: [] for r in prefills}
    sessions = {}
    # New sessions land on any of the three idle replicas at random: open them until each
    # prefill replica hosts at least one (those decode took are left out).
    for i in range(32):
        if min(map(len, on.values())) >= 1:
            break
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Drain test {i}: " * 6}]
        reply = chat(url, msgs, session=f"hdrain-{i}", max_tokens=12)
        if reply.kvturn["decode_replica"] == decode:
            continue
        assert reply.kvturn["placement"] == "hosted", reply.kvturn
        msgs.append({"role": "assistant", "content": reply.text})
        sessions[f"hdrain-{i}"] = (msgs, reply)
        on[reply.kvturn["decode_replica"]].append(f"hdrain-{i}")
    assert min(map(len, on.values())) >= 1, on
    read_before = engine_stats("DecodeServer", decode, app=APP)

    serve.run(build(pd_config(app_name=APP, **SETTINGS)), name=APP, route_prefix="/" + APP)
    (survivor,) = _replicas("PrefillServer", 1, app=APP)
    assert _replicas("DecodeServer", 1, app=APP) == {decode}
    (removed,) = prefills - {survivor}
    histories = {s: len(r.prompt_token_ids) + len(r.token_ids) - 1 for s, (_, r) in sessions.items()}
    read = delta(engine_stats("DecodeServer", decode, app=APP), read_before)
    assert read["prompt_tokens_external"] >= sum(histories[s] - block for s in on[removed]), read
    store = [shard["counts"] for shard in kv_stats(url)["store"]["shards"]]
    assert sum(c.get("moved", 0) for c in store) >= len(on[removed]), store

    for session, (msgs, _) in sessions.items():
        nxt = chat(url, msgs + [{"role": "user", "content": "Go on."}], session=session, max_tokens=12)
        where = decode if session in on[removed] else survivor
        assert nxt.kvturn["miss_reason"] is None and nxt.kvturn["decode_replica"] == where, nxt.kvturn
        cached = nxt.usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= histories[session] - block, (session, nxt.usage, nxt.kvturn)
        assert nxt.token_ids == reference_tokens(apps["url"], nxt.prompt_token_ids, len(nxt.token_ids))
