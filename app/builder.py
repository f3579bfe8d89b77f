"""The composition root: the only place deployments are wired together.

serve run app:graph                                   # defaults: embedded tiny model
serve run app:graph model=Qwen/Qwen3-8B prefill.num_replicas=2
serve run app:graph config=my-config.yaml
serve deploy serve.yaml                               # import_path: app:graph, args: {...}
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.api.ingress import Ingress
from app.config import AppConfig, EngineRoleConfig, Mode
from app.engines.servers import DecodeServer, PrefillServer
from app.fleet.autoscaling import serve_autoscaling_config
from app.fleet.clients import store_settings
from connector.actor import SessionStore

logger = logging.getLogger("ray.serve").getChild(__name__)
_ROUTER = "app.fleet.routing.SessionAffinityRouter"


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
        max_ongoing_requests=role.max_ongoing_requests,
        ray_actor_options=_actor_options(cfg, role),
        # Engine start (weights, compile, warm-up) can take minutes on big models.
        health_check_timeout_s=600,
        graceful_shutdown_timeout_s=cfg.drain.answer_grace_s,
    )
    hosts = role is cfg.decode or cfg.prefill_hosts  # its engine pins conversations
    if hosts and cfg.reuses_kv and cfg.drain.migrate:
        # In-flight answers first, then the moves of the pinned conversations (`app.fleet.drain`).
        options["graceful_shutdown_timeout_s"] = cfg.drain.answer_grace_s + cfg.drain.budget_s
    if role.autoscaling is not None:
        name = "decode" if role is cfg.decode else "prefill"
        options["autoscaling_config"] = serve_autoscaling_config(name, role.autoscaling, role.num_replicas)
    else:
        options["num_replicas"] = role.num_replicas
    if sticky:
        options["request_router_config"] = RequestRouterConfig(request_router_class=_ROUTER)
    return deployment.options(**options)


def bound_config(cfg: AppConfig) -> AppConfig:
    """The config the deployments' constructors get: replica counts and autoscaling left
    out (set to 1 and None).

    Counts live in each deployment's options, and each deployment's version
    (`versioned`) is a hash of this project's code and its constructor arguments: a
    redeploy that changes only a role's count keeps every version, so Serve adds or
    removes replicas of that role and leaves every other replica, and the KV it holds,
    running. A change of code or of any other setting is a new version (a restart)."""
    one = {"num_replicas": 1, "autoscaling": None}
    return cfg.model_copy(
        update={
            "prefill": cfg.prefill.model_copy(update=one),
            "decode": cfg.decode.model_copy(update=one),
            "ingress": cfg.ingress.model_copy(update=one),
        }
    )


def code_fingerprint() -> str:
    """A hash of this project's own modules (`app`, `connector`): a new release restarts
    every replica even when its config is unchanged."""
    import connector

    digest = hashlib.sha256()
    for root in (Path(__file__).parent, Path(str(connector.__file__)).parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def versioned(deployment, *constructor_args: Any):
    """`deployment` with a version that changes exactly when the code or its constructor
    arguments do. Serve's own default for `serve.run` is a random version per deploy
    (every redeploy restarts every replica); setting one is Serve's internal option
    (`_internal=True`), checked here: a Serve without it keeps its own versions."""
    parameters = inspect.signature(deployment.options).parameters
    if "version" not in parameters or "_internal" not in parameters:
        logger.warning("Serve's deployment options have no version: any redeploy restarts every replica")
        return deployment
    version = hashlib.sha256((code_fingerprint() + repr(constructor_args)).encode()).hexdigest()[:20]
    return deployment.options(version=version, _internal=True)


def build(cfg: AppConfig) -> Application:
    """Bind the app graph for a validated config."""
    transfer = cfg.disaggregated
    bound = bound_config(cfg)
    decode_deployment = _engine_deployment(DecodeServer, cfg, cfg.decode, sticky=True)
    decode = versioned(decode_deployment, bound, "decode", transfer).bind(
        bound, bound.decode, transfer=transfer
    )
    prefill = None
    if cfg.mode is not Mode.SINGLE:
        # Hosting prefill replicas are named by the sessions they host.
        sticky = cfg.sessions.prefill_routing == "sticky" or cfg.prefill_hosts
        prefill_deployment = _engine_deployment(PrefillServer, cfg, cfg.prefill, sticky=sticky)
        prefill = versioned(prefill_deployment, bound, "prefill").bind(bound, bound.prefill, transfer=True)
    store = None
    if cfg.mode is not Mode.ONEWAY:
        # Part of the graph: its settings follow every deploy, and it goes with the app.
        placement = {"num_cpus": 0, "resources": dict(cfg.sessions.store_resources)}
        settings = store_settings(cfg)
        store_deployment = SessionStore.options(ray_actor_options=placement)  # type: ignore[attr-defined]
        store = versioned(store_deployment, settings).bind(settings)
    ingress = Ingress.options(  # type: ignore[attr-defined]
        num_replicas=cfg.ingress.num_replicas,
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.ingress.num_cpus},
    )
    ingress = versioned(ingress, bound, cfg.ingress.num_replicas)
    return ingress.bind(bound, prefill, decode, store, ingress_replicas=cfg.ingress.num_replicas)


def graph(args: Mapping[str, Any]) -> Application:
    """`serve run app:graph [key=value ...]`: validate the arguments, then build."""
    return build(AppConfig.from_args(args))
