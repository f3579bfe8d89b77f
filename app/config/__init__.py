"""The app's one validated config tree.

Built once by the builder (`app.graph`) from `serve run` arguments, a YAML file, or a
Serve config's `args:`, validated before any deployment starts, then passed down through
constructors. Every field says what it does; bad values stop `serve run` with a message.

Modules: `base` (the strict base model, `Mode`, the model paths), `engines` (engine roles,
autoscaling, transfer), `service` (sessions, ingress, tenants and access, the API surfaces,
drains), `app_config` (`AppConfig` and its cross-section checks), `loading` (arguments and
YAML to a tree).
"""

from app.config.app_config import AppConfig
from app.config.base import DEFAULT_MODEL, OPEN_MODEL, REPO_ROOT, Mode
from app.config.engines import AutoscalingRoleConfig, EngineRoleConfig, TransferConfig
from app.config.service import (
    AccessConfig,
    DrainConfig,
    IngressConfig,
    OpenAIConfig,
    ResponsesConfig,
    SessionConfig,
    TenantPolicy,
)

__all__ = [
    "DEFAULT_MODEL",
    "OPEN_MODEL",
    "REPO_ROOT",
    "AccessConfig",
    "AppConfig",
    "AutoscalingRoleConfig",
    "DrainConfig",
    "EngineRoleConfig",
    "IngressConfig",
    "Mode",
    "OpenAIConfig",
    "ResponsesConfig",
    "SessionConfig",
    "TenantPolicy",
    "TransferConfig",
]
