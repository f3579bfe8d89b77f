"""A new replica count is not a restart, end to end: the app is redeployed with one decode
replica fewer, and every replica that stays (the other roles', and the surviving decode
replica) keeps running with its engine and the KV it holds, so a session on the survivor
reuses its whole history on its next turn. (The removed replica's conversations recompute:
migrating them is not built yet.)"""

from __future__ import annotations

import pytest

from tests.conftest import pd_config
from tests.e2e.helpers import SYSTEM, chat, reference_tokens

pytestmark = pytest.mark.e2e

APP = "scale"


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


def test_fewer_decode_replicas_leave_every_other_replica_and_its_kv_running(apps):
    from ray import serve

    from app.builder import build

    cfg = pd_config(app_name=APP, **{"decode.num_replicas": 2})
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    try:
        url = apps["url"] + "/" + APP
        sessions = {}
        for i in range(8):  # sessions spread over both decode replicas
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Scale test {i}: " * 6},
            ]
            sessions[f"scale-{i}"] = (msgs, chat(url, msgs, session=f"scale-{i}", max_tokens=12))
        counts = {"Ingress": 1, "PrefillServer": 1, "DecodeServer": 2, "SessionStore": 1}
        before = {d: _replicas(d, n) for d, n in counts.items()}

        serve.run(
            build(pd_config(app_name=APP, **{"decode.num_replicas": 1})), name=APP, route_prefix="/" + APP
        )

        after = {d: _replicas(d, 1) for d in counts}
        for role in ("Ingress", "PrefillServer", "SessionStore"):
            assert after[role] == before[role], (role, before[role], after[role])
        assert len(after["DecodeServer"]) == 1 and after["DecodeServer"] < before["DecodeServer"]
        survivor = next(iter(after["DecodeServer"]))
        on_survivor = [s for s, (_, r) in sessions.items() if r.kvturn["decode_replica"] == survivor]
        assert on_survivor, sessions
        for session in on_survivor:
            msgs, first = sessions[session]
            follow = msgs + [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "Tool: ok. " * 8},
            ]
            nxt = chat(url, follow, session=session, max_tokens=12)
            history = len(first.prompt_token_ids) + len(first.token_ids) - 1
            assert nxt.kvturn["miss_reason"] is None and nxt.kvturn["decode_replica"] == survivor
            assert nxt.kvturn["reused_from_decode"] >= history - cfg.block_size, nxt.kvturn
            assert nxt.token_ids == reference_tokens(apps["url"], nxt.prompt_token_ids, len(nxt.token_ids))
    finally:
        serve.delete(APP)
