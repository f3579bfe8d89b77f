"""A new replica count is not a restart, and a stopping decode replica loses no
conversation, end to end: the app is redeployed with one decode replica fewer while a
stream is in flight on each. Every replica that stays (the other roles', the surviving
decode replica) keeps running with its engine and the KV it holds; the stream on the
removed replica completes; the removed replica hands its conversations to the survivor
over NIXL (`app.drain`), so every session, wherever it was, reuses its whole history on
its next turn, with the tokens a plain engine computes."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import pd_config
from tests.e2e.helpers import SYSTEM, Reply, chat, delta, engine_stats, kv_stats, reference_tokens

pytestmark = pytest.mark.e2e

APP = "scale"
LONG = 256
"""Tokens of the answers that stream through the redeploy."""


def _replicas(deployment: str, count: int, within_s: float = 180.0) -> set[str]:
    """The ids of the deployment's replicas once exactly `count` run and none is starting
    or stopping."""
    import time

    import ray
    from ray import serve

    deadline = time.monotonic() + within_s
    while True:
        states = serve.status().applications[APP].deployments[deployment].replica_states
        names = {
            a["name"].rsplit("#", 1)[1]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")
        }
        if states == {"RUNNING": count} and len(names) == count:
            return names
        assert time.monotonic() < deadline, (deployment, states, names)
        time.sleep(1)


def test_fewer_decode_replicas_keep_every_replica_running_and_move_the_removed_ones_kv(apps):
    from ray import serve

    from app.builder import build

    cfg = pd_config(app_name=APP, **{"decode.num_replicas": 2})
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    try:
        url = apps["url"] + "/" + APP
        sessions = {}
        for i in range(6):  # sessions spread over both decode replicas, paused after 2 turns
            session = f"scale-{i}"
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Scale test {i}: " * 6},
            ]
            first = chat(url, msgs, session=session, max_tokens=12)
            msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Go on. " * 6}]
            second = chat(url, msgs, session=session, max_tokens=12)
            msgs.append({"role": "assistant", "content": second.text})
            sessions[session] = (msgs, second)
        counts = {"Ingress": 1, "PrefillServer": 1, "DecodeServer": 2, "SessionStore": 1}
        before = {d: _replicas(d, n) for d, n in counts.items()}
        on = {
            r: [s for s, (_, t) in sessions.items() if t.kvturn["decode_replica"] == r]
            for r in before["DecodeServer"]
        }
        assert all(on.values()), on  # both replicas hold conversations
        external_before = {r: engine_stats("DecodeServer", r, app=APP) for r in before["DecodeServer"]}

        # A long answer streams on each decode replica (a third turn of one of its
        # sessions) while the app is redeployed.
        streams: dict[str, object] = {}

        def stream(session: str) -> None:
            msgs = sessions[session][0] + [{"role": "user", "content": "Write a long story."}]
            try:
                streams[session] = chat(url, msgs, session=session, stream=True, max_tokens=LONG)
            except BaseException as exc:  # reported below
                streams[session] = exc

        threads = [threading.Thread(target=stream, args=(on[r][0],)) for r in sorted(on)]
        for t in threads:
            t.start()
        serve.run(
            build(pd_config(app_name=APP, **{"decode.num_replicas": 1})), name=APP, route_prefix="/" + APP
        )
        for t in threads:
            t.join(timeout=300)
        for session, reply in streams.items():
            assert isinstance(reply, Reply), (session, reply)
            assert reply.finish_reason in ("length", "stop") and reply.token_ids, (session, reply)
            msgs = sessions[session][0] + [
                {"role": "user", "content": "Write a long story."},
                {"role": "assistant", "content": reply.text},
            ]
            sessions[session] = (msgs, reply)

        after = {d: _replicas(d, 1) for d in counts}
        for role in ("Ingress", "PrefillServer", "SessionStore"):
            assert after[role] == before[role], (role, before[role], after[role])
        assert len(after["DecodeServer"]) == 1 and after["DecodeServer"] < before["DecodeServer"]
        survivor = next(iter(after["DecodeServer"]))
        removed = next(iter(before["DecodeServer"] - after["DecodeServer"]))
        moved = on[removed]

        # The survivor read the removed replica's conversations over NIXL while it drained.
        read = delta(engine_stats("DecodeServer", survivor, app=APP), external_before[survivor])
        histories = {s: len(t.prompt_token_ids) + len(t.token_ids) - 1 for s, (_, t) in sessions.items()}
        assert read["prompt_tokens_external"] >= sum(histories[s] - cfg.block_size for s in moved), read
        store = [shard["counts"] for shard in kv_stats(url)["store"]["shards"]]
        assert sum(c.get("moved", 0) for c in store) >= len(moved), store

        for session, (msgs, _) in sessions.items():
            follow = msgs + [{"role": "user", "content": "Tool: ok. " * 8}]
            nxt = chat(url, follow, session=session, max_tokens=12)
            history = histories[session]
            assert nxt.kvturn["miss_reason"] is None and nxt.kvturn["decode_replica"] == survivor, nxt.kvturn
            assert nxt.usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * history, (session, nxt.usage)
            assert nxt.kvturn["reused_from_decode"] >= history - cfg.block_size, (session, nxt.kvturn)
            assert nxt.token_ids == reference_tokens(apps["url"], nxt.prompt_token_ids, len(nxt.token_ids))
    finally:
        serve.delete(APP)
