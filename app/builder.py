"""The composition root: the only place deployments are wired together.

serve run app:graph                                   # defaults: embedded tiny model
serve run app:graph model=Qwen/Qwen3-8B prefill.num_replicas=2
serve run app:graph config=my-config.yaml
serve deploy serve.yaml                               # import_path: app:graph, args: {...}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.clients import store_settings
from app.config import AppConfig, EngineRoleConfig, Mode
from app.ingress import Ingress
from app.servers import DecodeServer, PrefillServer
from connector.actor import SessionStore

_ROUTER = "app.routing.SessionAffinityRouter"


def _actor_options(cfg: AppConfig, role: EngineRoleConfig) -> dict[str, Any]:
    env = dict(cfg.env)
    return {
        "num_cpus": role.num_cpus,
        "num_gpus": role.num_gpus,
        "resources": dict(role.resources),
        "runtime_env": {"env_vars": env} if env else {},
    }


def _engine_deployment(deployment, cfg: AppConfig, role: EngineRoleConfig, *, sticky: bool):
    options: dict[str, Any] = dict(
        num_replicas=role.num_replicas,
        max_ongoing_requests=role.max_ongoing_requests,
        ray_actor_options=_actor_options(cfg, role),
        # Engine start (weights, compile, warm-up) can take minutes on big models.
        health_check_timeout_s=600,
        graceful_shutdown_timeout_s=30,
    )
    if sticky:
        options["request_router_config"] = RequestRouterConfig(request_router_class=_ROUTER)
    return deployment.options(**options)


def bound_config(cfg: AppConfig) -> AppConfig:
    """The config the deployments' constructors get: replica counts left out (set to 1).

    Serve restarts a deployment's replicas when its constructor arguments change, but
    only adds or removes replicas when `num_replicas` alone changes. Counts live in each
    deployment's options, so a redeploy with another count of one role scales that role
    and leaves every other replica, and the KV it holds, running."""
    one = {"num_replicas": 1}
    return cfg.model_copy(
        update={
            "prefill": cfg.prefill.model_copy(update=one),
            "decode": cfg.decode.model_copy(update=one),
            "ingress": cfg.ingress.model_copy(update=one),
        }
    )


def build(cfg: AppConfig) -> Application:
    """Bind the app graph for a validated config."""
    transfer = cfg.disaggregated
    bound = bound_config(cfg)
    decode = _engine_deployment(DecodeServer, cfg, cfg.decode, sticky=True).bind(
        bound, bound.decode, transfer=transfer
    )
    prefill = None
    if cfg.mode is not Mode.SINGLE:
        sticky = cfg.sessions.prefill_routing == "sticky"
        prefill = _engine_deployment(PrefillServer, cfg, cfg.prefill, sticky=sticky).bind(
            bound, bound.prefill, transfer=True
        )
    store = None
    if cfg.mode is not Mode.ONEWAY:
        # Part of the graph: its settings follow every deploy, and it goes with the app.
        placement = {"num_cpus": 0, "resources": dict(cfg.sessions.store_resources)}
        store = SessionStore.options(ray_actor_options=placement).bind(store_settings(cfg))  # type: ignore[attr-defined]
    ingress = Ingress.options(  # type: ignore[attr-defined]
        num_replicas=cfg.ingress.num_replicas,
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.ingress.num_cpus},
    )
    return ingress.bind(bound, prefill, decode, store, ingress_replicas=cfg.ingress.num_replicas)


def graph(args: Mapping[str, Any]) -> Application:
    """`serve run app:graph [key=value ...]`: validate the arguments, then build."""
    return build(AppConfig.from_args(args))
