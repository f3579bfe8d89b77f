"""Multi-turn reuse, end to end with real engines and real NIXL.

Prefill's own prefix cache is off in the test app, so every history token prefill did not
compute was pulled from a decode engine: the engine counts prove the reuse.
"""

from __future__ import annotations

import time

import pytest
from ray import serve

from tests.e2e.helpers import MODEL, SYSTEM, chat, complete, delta, engine_stats, reference_tokens

TOOL_RESULT = 'Tool result: {"status": "ok", "items": [1, 2, 3], "path": "/var/log/syslog", "lines": 42} '


def _turn_checks(apps, reply, before, history_len: int):
    """Greedy tokens equal a recomputing engine's; prefill pulled the history."""
    block = apps["pd"].block_size
    assert reply.token_ids == reference_tokens(apps["url"], reply.prompt_token_ids, len(reply.token_ids))
    p = delta(engine_stats("PrefillServer"), before)
    new_tokens = reply.usage["prompt_tokens"] - history_len
    assert p["prompt_tokens_external"] >= history_len - block, (p, history_len)
    assert p["prompt_tokens_computed"] <= new_tokens + block, (p, new_tokens)
    assert p["prompt_tokens_local_hit"] == 0
    assert reply.usage["prompt_tokens_details"]["cached_tokens"] == p["prompt_tokens_external"]
    # The NixlConnector's own stats: prefill read the history over NIXL, without failures.
    assert p["kv_transfers"] >= 1 and p["kv_transfer_bytes"] > 0 and p["kv_failed_transfers"] == 0, p


def _run_chat(apps, session, stream, via_handle=False, turns=3):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look at the logs and the build. " * 3},
    ]
    history_len = 0
    replies = []
    for turn in range(turns):
        before = engine_stats("PrefillServer")
        if via_handle:
            reply = _handle_chat(messages, session)
        else:
            reply = chat(apps["url"], messages, session=session, stream=stream, max_tokens=24)
        if turn == 0:
            assert reply.usage["prompt_tokens_details"]["cached_tokens"] == 0
            assert reply.kvturn["miss_reason"] == "no_conversation"
        else:
            assert reply.kvturn["spliced"], "token-in/token-out should reuse the generated ids"
            _turn_checks(apps, reply, before, history_len)
        t = reply.kvturn["timings"]
        assert 0 <= t["session_s"] <= t["prefill_s"] <= t["first_token_s"]
        # The prefill leg's parts (the engine core stamps this host's monotonic clock) fit
        # within the leg as the ingress timed it.
        parts = [t[f"prefill_{part}"] for part in ("input_s", "queue_s", "compute_s", "output_s")]
        assert all(p >= 0 for p in parts) and sum(parts) <= t["prefill_s"] - t["session_s"]
        history_len = len(reply.prompt_token_ids) + len(reply.token_ids) - 1
        replies.append(reply)
        messages = messages + [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": TOOL_RESULT * 2},
        ]
    return replies


def _handle_chat(messages, session):
    from tests.e2e.helpers import Reply

    handle = serve.get_app_handle("pd")
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
    }
    b = handle.chat.remote(body, session_id=session).result()
    c = b["choices"][0]
    return Reply(
        c["message"]["content"],
        c["token_ids"],
        b["prompt_token_ids"],
        b["usage"],
        b["kvturn"],
        c["finish_reason"],
    )


@pytest.mark.parametrize("mode", ["plain", "sse", "handle"])
def test_three_turn_chat_reuses_history(apps, mode):
    replies = _run_chat(apps, f"chat-{mode}", stream=mode == "sse", via_handle=mode == "handle")
    assert [r.kvturn["session_id"] for r in replies] == [f"chat-{mode}"] * 3
    # Affinity: the session stayed on one decode replica.
    assert len({r.kvturn["decode_replica"] for r in replies}) == 1


def test_completions_token_prompts_reuse(apps):
    url = apps["url"]
    prompt = list(range(20, 180))
    first = complete(url, prompt, session="tok", max_tokens=20)
    history_len = len(prompt) + len(first.token_ids) - 1
    prompt2 = prompt + first.token_ids + list(range(300, 360))
    before = engine_stats("PrefillServer")
    second = complete(url, prompt2, session="tok", max_tokens=20, stream=True)
    _turn_checks(apps, second, before, history_len)


def test_sessionless_client_gets_reuse(apps):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "No header from this client, only the SDK. " * 3},
    ]
    first = chat(apps["url"], messages, max_tokens=24)
    assert first.kvturn["session_id"].startswith("s-")
    previous = first
    for tool_output in (TOOL_RESULT, TOOL_RESULT * 2):
        messages += [
            {"role": "assistant", "content": previous.text},
            {"role": "user", "content": tool_output},
        ]
        before = engine_stats("PrefillServer")
        reply = chat(apps["url"], messages, max_tokens=24)
        # Turns 2 and 3 are matched to the session by their tokens and text alone.
        assert reply.kvturn["session_id"] == first.kvturn["session_id"]
        _turn_checks(apps, reply, before, len(previous.prompt_token_ids) + len(previous.token_ids) - 1)
        previous = reply


def test_interleaved_sessions_do_not_cross_talk(apps):
    url = apps["url"]
    convs = {
        name: [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Session {name}: " + topic * 3},
        ]
        for name, topic in (("a", "weather in Paris. "), ("b", "SELECT id FROM users; "))
    }
    history = {}
    for name, msgs in convs.items():
        r = chat(url, msgs, session=f"il-{name}", max_tokens=20)
        history[name] = len(r.prompt_token_ids) + len(r.token_ids) - 1
        msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": TOOL_RESULT}]
    for name, msgs in convs.items():
        before = engine_stats("PrefillServer")
        r = chat(url, msgs, session=f"il-{name}", max_tokens=20)
        _turn_checks(apps, r, before, history[name])


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("edit", ["user_message", "system_prompt"])
def test_edited_history_never_pulls_past_the_edit(apps, edit):
    """An edited history pulls at most the verified common prefix (none when the edit is
    near the start), and the answer equals a recomputation."""
    url = apps["url"]
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Original question about the logs. " * 3},
    ]
    first = chat(url, msgs, session=f"edit-{edit}", max_tokens=20)
    edited = [dict(m) for m in msgs]
    if edit == "system_prompt":
        edited[0]["content"] = "Be terse. " + SYSTEM
    else:
        edited[1]["content"] = "Edited question about the build. " * 3
    edited += [{"role": "assistant", "content": first.text}, {"role": "user", "content": TOOL_RESULT}]
    before = engine_stats("PrefillServer")
    second = chat(url, edited, session=f"edit-{edit}", max_tokens=20)
    pulled = delta(engine_stats("PrefillServer"), before)["prompt_tokens_external"]
    common = _common_prefix(first.prompt_token_ids + first.token_ids, second.prompt_token_ids)
    assert common < len(first.prompt_token_ids), "the edit must fall inside the stored prompt"
    assert pulled <= common
    if edit == "system_prompt":
        assert pulled == 0 and second.kvturn["miss_reason"] == "prefix_mismatch"
    else:
        assert second.kvturn["reused_from_decode"] == common
    assert second.token_ids == reference_tokens(url, second.prompt_token_ids, len(second.token_ids))


def test_handle_is_single_use(apps):
    """Two turns racing on one stored handle: exactly one pulls it, both answer right."""
    from concurrent.futures import ThreadPoolExecutor

    url = apps["url"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Race two follow-ups. " * 3}]
    first = chat(url, msgs, session="race", max_tokens=20)
    follow = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": TOOL_RESULT}]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: chat(url, follow, session="race", max_tokens=64), range(2)))
    pulled = [r for r in replies if r.kvturn["reused_from_decode"] > 0]
    refused = [r for r in replies if r.kvturn["miss_reason"] == "claimed"]
    assert len(pulled) == 1 and len(refused) == 1, [r.kvturn for r in replies]
    assert replies[0].token_ids == replies[1].token_ids
    assert replies[0].token_ids == reference_tokens(
        url, replies[0].prompt_token_ids, len(replies[0].token_ids)
    )


def test_expired_handle_recomputes(apps):
    url = apps["url"]
    ttl = apps["pd"].sessions.handle_ttl_s
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "This one waits for a slow tool. " * 3},
    ]
    first = chat(url, msgs, session="slow-tool", max_tokens=20)
    time.sleep(ttl + 1)
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": TOOL_RESULT}]
    before = engine_stats("PrefillServer")
    second = chat(url, msgs, session="slow-tool", max_tokens=20)
    assert second.kvturn["miss_reason"] == "expired"
    assert delta(engine_stats("PrefillServer"), before)["prompt_tokens_external"] == 0
    assert second.token_ids == reference_tokens(url, second.prompt_token_ids, len(second.token_ids))
