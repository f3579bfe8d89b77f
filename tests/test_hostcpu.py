"""`bench.hostcpu`: the process roles the fleet study's CPU accounting reads."""

from __future__ import annotations

import os

from bench.hostcpu import HOST_ROLES, ROLES, cpu_by_role, role_of, spent


def test_roles_from_process_titles():
    assert role_of("VLLM::Worker", 1) == "engine_worker"
    assert role_of("VLLM::EngineCore", 1) == "engine_core"
    assert role_of("ray::ServeReplica:fleet-dp:Ingress.handle_request_with_rejection", 1) == "ingress"
    assert role_of("ray::ServeReplica:fleet-dp:Ingress", 1) == "ingress"
    assert role_of("ray::ServeReplica:app:DecodeServer.handle_request_with_rejection", 1) == "engine_front"
    assert role_of("ray::ServeReplica:app:PrefillServer", 1) == "engine_front"
    assert role_of("ray::ServeReplica:app:SessionStore", 1) == "store"
    assert role_of("ray::ProxyActor.receive_asgi_messages", 1) == "proxy"
    assert role_of("ray::ServeController.listen_for_change", 1) == "controller"
    assert role_of("python -m bench", os.getpid()) == "client"
    assert role_of("/usr/bin/raylet", 1) is None
    assert "engine_worker" not in HOST_ROLES


def test_spent_per_role_and_per_turn():
    before = dict.fromkeys(ROLES, 1.0)
    after = {**before, "engine_worker": 11.0, "ingress": 3.0, "proxy": 2.0}
    used = spent(before, after, turns=10)
    assert used["engine_worker"] == 10.0 and used["ingress"] == 2.0
    assert used["host_per_turn_s"] == 0.3  # ingress 2 + proxy 1, not the engine's 10
    assert spent(before, after, turns=0)["host_per_turn_s"] is None
    # This process is counted as the client.
    assert cpu_by_role()["client"] > 0
