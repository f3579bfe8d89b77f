"""The Responses chain's bookkeeping: which stored response a request continues, who owns
that continuation, and keeping, reading and deleting stored responses (the store's
`connector.response_store`, on the session's shard).

A response continued for the first time carries on its session and its KV (the
`owner`); any later continuation of the same response is a fork, with a session of its
own. A continuation taken but not finished is given back (`release`), so the chain's next
request can still own it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from app.api.auth import Tenant, scoped
from app.api.responses_api import assistant_message, input_items
from app.errors import APIError, NotFound, ServerError
from app.turn.events import TurnCount
from app.turn.turns import Turns
from connector.client import StoreClient
from connector.response_store import StoredResponse
from connector.store_api import StoreUnavailable

logger = logging.getLogger("ray.serve").getChild(__name__)


@dataclass
class ResponseTurn:
    """A Responses request on its way: the response it continues (`previous`, whose
    continuation it `owner`s or forks) and the chat turn it runs as."""

    request: Any
    tenant: Tenant
    previous: StoredResponse | None
    owner: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat messages of the whole conversation this response answers."""
    body: Any = None
    prepared: Any = None

    def stored(self, response: dict[str, Any]) -> tuple[StoredResponse, list[dict[str, Any]]]:
        """The response to store: what it added to its conversation (its input messages
        and its output as the next turn renders it) over its parent; and the parent's
        whole history, to store it alone if the shard lost the parent."""
        history = self.previous.messages if self.previous is not None else []
        # The messages that came from the history and the request's instructions (which
        # do not carry over a chain), not from its input.
        inherited = (1 if self.request.instructions else 0) + sum(
            1 for m in history if m.get("role") != "system"
        )
        stored = StoredResponse(
            key=scoped(self.tenant.namespace, response["id"]),
            session_id=response["kvturn"]["session_id"],
            created_at=time.time(),
            body=response,
            messages=self.messages[inherited:] + [assistant_message(response["output"])],
            input_items=input_items(self.request),
            parent_key=self.previous.key if self.previous is not None else None,
        )
        return stored, history


class ResponseChain:
    """One per ingress replica, over the app's store (None in oneway mode: no chains)."""

    def __init__(self, store: StoreClient | None, turns: Turns):
        self._store = store
        self._turns = turns

    async def continue_(self, namespace: str, request: Any) -> tuple[StoredResponse, bool]:
        """The response `request.previous_response_id` names and whether this request owns
        its continuation; 400 if no such response is kept."""
        if self._store is None:
            raise APIError(
                400, "this deployment keeps no responses (mode=oneway)", param="previous_response_id"
            )
        key = scoped(namespace, request.previous_response_id)
        try:
            previous, owner = await self._store.continue_response(key, request.request_id)
        except StoreUnavailable as exc:
            raise ServerError(503, f"the response store is unavailable, retry: {exc}") from exc
        if previous is None:
            raise APIError(
                400,
                f"Previous response with id '{request.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return previous, owner

    async def release(self, turn: ResponseTurn) -> None:
        """Give back a continuation `turn` owns but did not finish."""
        if turn.owner and turn.previous is not None and self._store is not None:
            try:
                await self._store.release_continuation(turn.previous.key, turn.request.request_id)
            except StoreUnavailable:
                pass  # the continuation stays taken: later ones fork (reuse lost, never an answer)

    async def keep(self, turn: ResponseTurn, response: dict) -> None:
        """Store a finished response (unless `store: false`) with what it added to its
        conversation: its input messages and its output as the next turn renders it."""
        if not turn.request.store or self._store is None:
            return
        stored, history = turn.stored(response)
        try:
            result = await self._store.put_response(stored, history)
        except StoreUnavailable as exc:
            logger.warning("response %s not stored: %r", response["id"], exc)
            result = "unavailable"
        if result != "stored":
            self._turns.counts[TurnCount.not_stored(result)] += 1

    async def get(self, namespace: str, response_id: str, *, delete: bool = False) -> StoredResponse:
        """The stored response (taken out of the store with `delete`), or a 404."""
        found = None
        if self._store is not None:
            op = self._store.delete_response if delete else self._store.get_response
            found = await op(scoped(namespace, response_id))
        if found is None:
            raise NotFound(f"No response with id '{response_id}'.", param="response_id")
        return found

    async def input_items(self, namespace: str, response_id: str) -> dict:
        items = (await self.get(namespace, response_id)).input_items
        return {
            "object": "list",
            "data": items,
            "first_id": items[0].get("id") if items else None,
            "last_id": items[-1].get("id") if items else None,
            "has_more": False,
        }

    async def delete(self, namespace: str, response_id: str) -> dict:
        """Forget a stored response; if no response continued it yet (the latest of its
        chain), its conversation's pinned KV is freed too."""
        found = await self.get(namespace, response_id, delete=True)
        if found.continued_by is None and self._store is not None:  # found: a store answered
            await self._store.end_session(scoped(namespace, found.session_id))
            await self._turns.memory.flush()
        return {"id": response_id, "object": "response", "deleted": True}
