"""Optional API keys, and the tenant namespaces they give session ids.

With `access.api_keys` set (as vLLM's `--api-key`), every HTTP route but `/health` needs
`Authorization: Bearer <key>`; a missing or unknown key is a 401 with an OpenAI-style
body. Each key is a tenant: its session ids are namespaced internally by a short hash of
the key (`k<12 hex>:` + the client's id), so one tenant can never claim, read or replace
another tenant's conversation, even with the same `x-session-id`, and a sessionless prompt
only ever matches the tenant's own conversations (`app.turns` keeps matches inside the
turn's namespace). Clients see their own ids only: the prefix is stripped from responses.

`DeploymentHandle` callers are inside the Ray cluster and trusted: without `api_key=` they
share one namespace of their own (`internal:`), apart from every HTTP tenant; with
`api_key=` the key is checked and they are that tenant. Without keys configured nothing
is checked and session ids are not namespaced.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

from app.protocol import APIError

TRUSTED_NAMESPACE = "internal:"


def namespace_of(key: str) -> str:
    """The session-id prefix of one key's tenant."""
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:12] + ":"


class ApiKeys:
    """The configured keys. Cheap to call per request; keys are compared in constant time."""

    def __init__(self, keys: Sequence[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._namespaces = [namespace_of(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def namespace(self, authorization: str | None) -> str:
        """The tenant namespace of an HTTP request's `Authorization` header value.
        '' when keys are off; raises a 401 `APIError` when the key is missing or unknown."""
        if not self.enabled:
            return ""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        return self._lookup(key.strip())

    def handle_namespace(self, api_key: str | None) -> str:
        """The namespace of a `DeploymentHandle` call: trusted without a key, the key's
        tenant with one (raises a 401 `APIError` if it is unknown)."""
        if not self.enabled:
            return ""
        return TRUSTED_NAMESPACE if api_key is None else self._lookup(api_key)

    def _lookup(self, key: str) -> str:
        digest = hashlib.sha256(key.encode()).digest()
        found = ""
        for known, namespace in zip(self._digests, self._namespaces):
            if hmac.compare_digest(known, digest):
                found = namespace
        if not found:
            raise _unauthorized("Incorrect API key provided.")
        return found


def scoped(namespace: str, session_id: str | None) -> str | None:
    """The internal id of a client's session id (None stays None)."""
    return None if session_id is None else namespace + session_id


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")
