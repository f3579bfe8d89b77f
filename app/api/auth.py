"""Optional API keys, and the tenant namespaces they give session ids.

With `access.api_keys` set (as vLLM's `--api-key`), every HTTP route but `/health` needs
`Authorization: Bearer <key>`; a missing or unknown key is a 401 with an OpenAI-style
body. Each key is a tenant: its session ids are namespaced internally by a short hash of
the key (`k<12 hex>:` + the client's id), so one tenant can never claim, read or replace
another tenant's conversation, even with the same `x-session-id`, and a sessionless prompt
only ever matches the tenant's own conversations (`app.turn.turns` keeps matches inside the
turn's namespace). Clients see their own ids only: the prefix is stripped from responses.

`DeploymentHandle` callers are inside the Ray cluster and trusted: without `api_key=` they
share one namespace of their own (`internal:`), apart from every HTTP tenant; with
`api_key=` the key is checked and they are that tenant. Without keys configured nothing
is checked and session ids are not namespaced.

Each tenant also has a cache salt (an HMAC of a fixed label under its key: derived from
the key, never the key itself), carried by every engine request of its turns, so the
engines' prefix caches only ever hit within one tenant: cached_tokens and time to first
token tell a tenant nothing about another's prompts. A client's own `cache_salt` is
hashed with its tenant's, never used as it is. `access.share_prefix_cache` turns the
tenant salts off (a common system prompt is then computed once for all tenants, and the
side channel is open).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from app.config import TenantPolicy
from app.errors import Unauthorized

TRUSTED_NAMESPACE = "internal:"
_SALT_LABEL = b"kvturn prefix-cache salt v1"


@dataclass(frozen=True)
class Tenant:
    """Who a request is: its session namespace, its engines' cache salt, its policy."""

    namespace: str
    cache_salt: str | None
    policy: TenantPolicy

    @property
    def label(self) -> str:
        """The tenant in metrics and stats: its namespace (a hash of the key), bounded by
        the keys configured."""
        return self.namespace.rstrip(":") or "default"

    def salt_for(self, client_salt: str | None) -> str | None:
        """The cache salt of one request: the tenant's, or the client's hashed with it."""
        if client_salt is None:
            return self.cache_salt
        return hashlib.sha256(f"{self.cache_salt or ''}\0{client_salt}".encode()).hexdigest()


def salt_of(key: str) -> str:
    return hmac.new(key.encode(), _SALT_LABEL, hashlib.sha256).hexdigest()


def namespace_of(key: str) -> str:
    """The session-id prefix of one key's tenant."""
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:12] + ":"


class ApiKeys:
    """The configured keys and their tenants. Cheap to call per request; keys are compared
    in constant time."""

    def __init__(
        self,
        keys: Sequence[str],
        policies: Mapping[str, TenantPolicy] | None = None,
        default: TenantPolicy | None = None,
        share_prefix_cache: bool = False,
    ):
        default = default or TenantPolicy()
        policies = policies or {}
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._tenants = [
            Tenant(namespace_of(k), None if share_prefix_cache else salt_of(k), policies.get(k, default))
            for k in keys
        ]
        trusted_salt = None if share_prefix_cache else hashlib.sha256(_SALT_LABEL + b" internal").hexdigest()
        self._trusted = Tenant(TRUSTED_NAMESPACE, trusted_salt, default)
        self._open = Tenant("", None, default)

    @classmethod
    def of(cls, access) -> ApiKeys:
        """From the app's `AccessConfig`."""
        return cls(access.api_keys, access.tenants, access.default_tenant, access.share_prefix_cache)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def tenants(self) -> list[Tenant]:
        """Every tenant requests can come from (keys, trusted callers, or the one tenant of
        a deployment without keys)."""
        return [*self._tenants, self._trusted] if self.enabled else [self._open]

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an HTTP request's `Authorization` header value; the one open
        tenant when keys are off. Raises a 401 `APIError` when the key is missing or unknown."""
        if not self.enabled:
            return self._open
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        return self._lookup(key.strip())

    def handle_tenant(self, api_key: str | None) -> Tenant:
        """The tenant of a `DeploymentHandle` call: trusted without a key, the key's
        tenant with one (raises a 401 `APIError` if it is unknown)."""
        if not self.enabled:
            return self._open
        return self._trusted if api_key is None else self._lookup(api_key)

    def namespace(self, authorization: str | None) -> str:
        """The session namespace of an HTTP request ('' when keys are off)."""
        return self.tenant(authorization).namespace

    def handle_namespace(self, api_key: str | None) -> str:
        return self.handle_tenant(api_key).namespace

    def _lookup(self, key: str) -> Tenant:
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, tenant in zip(self._digests, self._tenants, strict=True):
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        return found


@overload
def scoped(namespace: str, session_id: str) -> str: ...
@overload
def scoped(namespace: str, session_id: None) -> None: ...
@overload
def scoped(namespace: str, session_id: str | None) -> str | None: ...
def scoped(namespace: str, session_id: str | None) -> str | None:
    """The internal id of a client's session id (None stays None)."""
    return None if session_id is None else namespace + session_id


def _unauthorized(message: str) -> Unauthorized:
    return Unauthorized(message)
