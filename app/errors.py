"""Errors a client sees, and the one place any exception becomes an OpenAI-style body.

`APIError` carries a status, OpenAI's `type` / `code` / `param`, extension `details` (sent
as the body's `kvturn` field) and HTTP `headers` (e.g. `Retry-After`). The family below
names the kinds the app raises; every route and every handle method goes through
`error_body` (an HTTP route's error response, `as_api_error` for a Serve handle caller,
a stream's error event in `app.api.shaping.sse`). Imports no vLLM at module level: the
turn pipeline raises these too.

What each other exception becomes:

* `connector.store_api.StoreUnavailable` (a store call failed or timed out) -> 503
  `store_unavailable`: only where a request is *about* the store (ending a session); a
  turn never fails for it (the pipeline goes on without reuse).
* vLLM's `VLLMValidationError`, pydantic's validation errors, Starlette's HTTP errors and
  `ValueError`/`TypeError` marked by `client_error` -> 400 (404/405/413 as Starlette says).
* anything else -> 500 `internal server error`, logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ray.serve").getChild(__name__)


class APIError(Exception):
    """An error the client caused or must see, as an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.details = details
        """Extension facts beside the error (e.g. the decode replica that failed), sent
        as the body's `kvturn` field."""
        self.headers = headers
        """HTTP headers of the answer (e.g. `Retry-After` of a 429)."""

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }
        if self.details:
            body["kvturn"] = self.details
        return body


class ClientError(APIError):
    """400: the request is wrong (bad values, context too long, ...)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, **kw: Any):
        super().__init__(kw.pop("status", 400), message, param=param, code=code, **kw)


class NotFound(ClientError):
    """404: no such model, session, route."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code, status=404, type="NotFoundError")


class Unauthorized(ClientError):
    """401: a missing or unknown API key."""

    def __init__(self, message: str):
        super().__init__(message, code="invalid_api_key", status=401)


class RateLimited(ClientError):
    """429: a tenant's quota is spent; `retry_after_s` goes out as `Retry-After`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(
            message,
            code="rate_limit_exceeded",
            status=429,
            type="rate_limit_error",
            headers={"Retry-After": str(retry_after_s)},
        )


class ServerError(APIError):
    """5xx: the fleet failed the request; the client may send it again."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, details: dict[str, Any] | None = None
    ):
        super().__init__(status, message, type="server_error", code=code, details=details)


class DecodeFailed(ServerError):
    """502: decode replicas failed the turn after its answer reached the client (or on
    every attempt). Names the replica in `details`."""

    def __init__(self, replica: str | None):
        super().__init__(
            502,
            "the decode replica failed while answering; send the turn again",
            code="decode_failed",
            details={"decode_replica": replica},
        )


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and OpenAI-style body of any exception (500 for the unexpected)."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException
    from vllm.exceptions import VLLMValidationError

    from connector.store_api import StoreUnavailable

    if isinstance(exc, APIError):
        return exc.status, exc.body()
    if isinstance(exc, StoreUnavailable):
        unavailable = ServerError(
            503, "the session store is unavailable; try again", code="store_unavailable"
        )
        return 503, unavailable.body()
    if isinstance(exc, VLLMValidationError):
        return _invalid(str(exc).split(" (parameter=")[0], exc.parameter)
    if isinstance(exc, (RequestValidationError, ValidationError)):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _invalid("the request body is not valid JSON")
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, VLLMValidationError):
            return error_body(cause)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = ".".join(loc) or None
        return _invalid(f"{param}: {message}" if param else message, param)
    if isinstance(exc, HTTPException):
        kind = {404: "not_found_error", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code, "invalid_request_error"
        )
        return exc.status_code, APIError(exc.status_code, str(exc.detail), type=kind).body()
    if isinstance(exc, (ValueError, TypeError)) and getattr(exc, "_kvturn_client_error", False):
        return _invalid(str(exc))
    logger.exception("internal error", exc_info=exc)
    return 500, ServerError(500, "internal server error").body()


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the `APIError` its body says (for handle callers, who get the
    exception rather than a body): status, type, code, param and details kept."""
    if isinstance(exc, APIError):
        return exc
    status, body = error_body(exc)
    error = body["error"]
    return APIError(status, error["message"], type=error["type"], param=error["param"], code=error["code"])


def _invalid(message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    return 400, ClientError(message, param=param).body()


def client_error(exc: BaseException) -> BaseException:
    """Mark a ValueError/TypeError raised by vLLM while building a request from the
    client's values (e.g. `SamplingParams` checks): it maps to 400, not 500."""
    exc._kvturn_client_error = True  # type: ignore[attr-defined]
    return exc
