"""A new replica count is not a restart, and a stopping decode replica loses no
conversation, end to end: the app is redeployed with one decode replica fewer while a
stream is in flight on each. Every replica that stays (the other roles', the surviving
decode replica) keeps running with its engine and the KV it holds; the stream on the
removed replica completes; the removed replica hands its conversations to the survivor
over NIXL (`app.fleet.drain`), so every session, wherever it was, reuses its whole history on
its next turn, with the tokens a plain engine computes."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import pd_config
from tests.e2e.helpers import SYSTEM, Reply, chat, complete, delta, engine_stats, kv_stats, reference_tokens

pytestmark = pytest.mark.e2e

APP = "scale"
LONG = 256
"""Tokens of the answers that stream through the redeploy."""


def _replicas(deployment: str, count: int, within_s: float = 180.0, app: str = APP) -> set[str]:
    """The ids of the deployment's replicas once exactly `count` run and none is starting
    or stopping."""
    import ray
    from ray import serve

    deadline = time.monotonic() + within_s
    while True:
        states = serve.status().applications[app].deployments[deployment].replica_states
        names = {
            a["name"].rsplit("#", 1)[1]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")
        }
        if states == {"RUNNING": count} and len(names) == count:
            return names
        assert time.monotonic() < deadline, (deployment, states, names)
        time.sleep(1)


def _computed_per_replica(deployment: str, replicas: set[str], app: str) -> dict[str, int]:
    """Prompt tokens each replica's engine computed, for a deployment whose router does
    not take a replica query (prefill's balances load): asked until each has answered."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    found: dict[str, int] = {}
    for _ in range(100):
        stats = handle.stats.remote().result()
        found[stats["replica_id"]] = stats["prompt_tokens_computed"]
        if set(found) >= replicas:
            return found
    raise AssertionError(f"replicas {replicas - set(found)} never answered")


def test_fewer_decode_replicas_keep_every_replica_running_and_move_the_removed_ones_kv(apps):
    from ray import serve

    from app.builder import build

    cfg = pd_config(app_name=APP, **{"decode.num_replicas": 2})
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    try:
        url = apps["url"] + "/" + APP
        counts = {"Ingress": 1, "PrefillServer": 1, "DecodeServer": 2, "SessionStore": 1}
        before = {d: _replicas(d, n) for d, n in counts.items()}
        on: dict[str, list[str]] = {r: [] for r in before["DecodeServer"]}
        sessions = {}
        # New sessions land on the less loaded of the two decode replicas, a coin toss
        # when both are idle: sessions are opened (2 turns each, then paused) until each
        # replica holds at least two.
        for i in range(24):
            if i >= 6 and min(map(len, on.values())) >= 2:
                break
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
            on[second.kvturn["decode_replica"]].append(session)
        assert min(map(len, on.values())) >= 2, on  # both replicas hold conversations
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


def test_a_new_replica_takes_the_oldest_conversations_of_a_nearly_full_one(apps):
    """Scale-up with rebalancing: one decode replica holds 6 conversations of 10 blocks,
    61% of its pinned budget (98 blocks) and past `drain.rebalance_above` (50%); a second
    replica is added and the ingress moves the oldest conversations to it over NIXL, down to
    the middle of the marks (40%), before any is evicted. Their next turns read the history
    from the new replica, with the tokens a plain engine computes."""
    from ray import serve

    from app.builder import build

    app = "rebalance"
    overrides = {
        "sessions.pinned_fraction": 0.012,  # floor(0.012 * 8191 blocks) = 98 blocks
        "sessions.handle_ttl_s": 200,
        "transfer.decoder_kv_blocks_ttl_s": 300,
        "drain.rebalance_above": 0.5,
        "drain.rebalance_below": 0.3,
    }
    cfg = pd_config(app_name=app, **{"decode.num_replicas": 1}, **overrides)
    serve.run(build(cfg), name=app, route_prefix="/" + app)
    try:
        url = apps["url"] + "/" + app
        sessions = {}
        for i in range(6):  # 300 prompt ids + 12 answered: 311 positions, 10 blocks each
            prompt = [(7 + 37 * i + 13 * j) % 500 + 10 for j in range(300)]  # the vocabulary has 581
            sessions[f"rb-{i}"] = (prompt, complete(url, prompt, session=f"rb-{i}", max_tokens=12))
        first = {r.kvturn["decode_replica"] for _, r in sessions.values()}
        stats = kv_stats(url)["store"]["shards"]
        assert sum(sum(s["pinned_blocks"].values()) for s in stats) == 60, stats
        assert sum(s["counts"].get("evicted_for_blocks", 0) for s in stats) == 0

        serve.run(
            build(pd_config(app_name=app, **{"decode.num_replicas": 2}, **overrides)),
            name=app,
            route_prefix="/" + app,
        )
        old = next(iter(first))
        new = next(iter(_replicas("DecodeServer", 2, app=app) - first))
        deadline = time.monotonic() + 60
        while kv_stats(url)["turns"].get("rebalance_moved", 0) < 3:
            assert time.monotonic() < deadline, kv_stats(url)["turns"]
            time.sleep(1)
        turns = kv_stats(url)["turns"]
        stats = kv_stats(url)["store"]["shards"]
        # 60 - 0.4 * 98 = 20.8 blocks to move: three conversations, the oldest ones.
        assert turns["rebalance_moved"] == 3 and turns["rebalance_moved_blocks"] == 30, turns
        assert sum(s["counts"].get("evicted_for_blocks", 0) for s in stats) == 0
        assert sum(s["counts"].get("moved", 0) for s in stats) == 3
        for i, (session, (prompt, reply)) in enumerate(sessions.items()):
            follow = prompt + reply.token_ids + [(42 + 11 * j) % 500 + 10 for j in range(40)]
            nxt = complete(url, follow, session=session, max_tokens=12)
            history = len(prompt) + len(reply.token_ids) - 1
            assert nxt.kvturn["miss_reason"] is None, nxt.kvturn
            assert nxt.kvturn["decode_replica"] == (new if i < 3 else old), (session, nxt.kvturn)
            assert nxt.kvturn["reused_from_decode"] >= history - cfg.block_size, (session, nxt.kvturn)
            assert nxt.token_ids == reference_tokens(apps["url"], nxt.prompt_token_ids, len(nxt.token_ids))
    finally:
        serve.delete(app)


def _deploy_config(app: str, args: dict, deployments: list[dict], within_s: float = 300.0) -> None:
    """Deploy an app as `serve deploy` does (a Serve config, through the controller's
    declarative API: every deployment's version is then Serve's hash of the `args`), and
    wait until it runs."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    entry = {"name": app, "route_prefix": f"/{app}", "import_path": "app:graph", "args": args}
    config = ServeDeploySchema.model_validate({"applications": [{**entry, "deployments": deployments}]})
    _get_global_client().deploy_apps(config)
    deadline = time.monotonic() + within_s
    while (status := serve.status().applications.get(app)) is None or status.status != "RUNNING":
        assert time.monotonic() < deadline, status
        time.sleep(1)


def test_fewer_prefill_replicas_under_load_fail_no_turn(apps):
    """A prefill downscale while agents keep talking, through a Serve config as an
    operator's `serve deploy` applies it: the same `args`, and a `deployments:` override of
    the prefill replicas' count from 2 to 1, while three clients send turns back to back.
    Serve stops routing to the removed replica, lets its legs in flight finish, and the
    replica ends its engine once the decode engines have read the KV of its last legs: no
    turn fails, no leg falls back, every answer has the tokens a plain engine computes,
    and the decode replica, the surviving prefill replica and the other roles keep
    running (the override changed no deployment's version)."""
    from ray import serve

    app = "pscale"
    cfg = pd_config(app_name=app, **{"decode.num_replicas": 1})
    args = cfg.model_dump(mode="json", exclude_defaults=True)
    _deploy_config(app, args, [{"name": "PrefillServer", "num_replicas": 2}])
    try:
        url = apps["url"] + "/" + app
        counts = {"Ingress": 1, "PrefillServer": 2, "DecodeServer": 1, "SessionStore": 1}
        before = {d: _replicas(d, n, app=app) for d, n in counts.items()}
        computed = _computed_per_replica("PrefillServer", before["PrefillServer"], app)

        replies: list[Reply] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def agent(k: int) -> None:
            session, turn, msgs = f"pscale-{k}-0", 0, []
            while not stop.is_set() and not errors:
                if turn % 5 == 0:  # a fresh session every 5 turns keeps prompts short
                    session = f"pscale-{k}-{turn // 5}"
                    msgs = [{"role": "system", "content": SYSTEM}]
                msgs.append({"role": "user", "content": f"Tool {k}.{turn}: result line. " * 12})
                try:
                    reply = chat(url, msgs, session=session, max_tokens=8)
                except BaseException as exc:  # reported below
                    errors.append(exc)
                    return
                replies.append(reply)
                msgs.append({"role": "assistant", "content": reply.text})
                turn += 1

        threads = [threading.Thread(target=agent, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(5)  # every agent in its stride, legs on both prefill replicas
        now = _computed_per_replica("PrefillServer", before["PrefillServer"], app)
        served = {r: now[r] - n for r, n in computed.items()}
        redeployed_at = len(replies)
        _deploy_config(app, args, [{"name": "PrefillServer", "num_replicas": 1}])
        after = {d: _replicas(d, 1, app=app) for d in counts}
        time.sleep(3)  # and a few turns on the one left
        stop.set()
        for t in threads:
            t.join(timeout=120)

        turns = kv_stats(url)["turns"]
        print(f"\n{len(replies)} turns, {redeployed_at} before the redeploy; legs before it: {served}")
        assert not errors, errors
        assert all(served.values()), served  # both prefill replicas computed legs before
        assert len(replies) > redeployed_at + 6, (redeployed_at, len(replies))
        for role in ("Ingress", "DecodeServer", "SessionStore"):
            assert after[role] == before[role], (role, before[role], after[role])
        assert after["PrefillServer"] < before["PrefillServer"]
        assert turns.get("prefill_failed", 0) == turns.get("prefill_timeout", 0) == 0, turns
        for reply in replies:
            assert reply.finish_reason in ("length", "stop") and reply.token_ids, reply
            assert reply.token_ids == reference_tokens(
                apps["url"], reply.prompt_token_ids, len(reply.token_ids)
            )
        # The turns on the survivor still read their history back from decode.
        late = replies[redeployed_at:]
        assert sum(r.kvturn["reused_from_decode"] > 0 for r in late) >= len(late) // 2, [
            r.kvturn for r in late
        ]
    finally:
        serve.delete(app)
