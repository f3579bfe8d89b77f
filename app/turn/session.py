"""The session step of a turn (`Turns.run`): which conversation the turn continues and
its claimed KV handle. A session is named by the client (the session header), by the
agent (`prompt_cache_key`, Claude Code's metadata: claimed, and given back untouched when
the prompt does not extend it), or found by the prompt's tokens in the store's index
(`sessions.match_sessionless`); else it is new. A turn whose conversation is being moved
off a stopping replica waits for the move (`drain.wait_s`); a new session past its
tenant's live limit is refused (429). Every store call goes through `call`: a store that
fails costs reuse, never the turn.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter

from app.config import AppConfig
from app.errors import RateLimited
from app.turn.events import MissReason, TurnCount
from app.turn.model import Store, Tokenizer, TurnInput
from app.turn.steps import Session
from connector.records import Conversation, TurnOutcome

logger = logging.getLogger("ray.serve").getChild(__name__)

MOVE_POLL_S = 0.05
"""How often a turn waiting for its conversation's move asks the store again."""


class Sessions:
    """One per ingress replica (`Turns` owns it), over the app's store (None: every turn
    is a new session and nothing is kept)."""

    def __init__(self, cfg: AppConfig, store: Store | None, tokenizer: Tokenizer, counts: Counter[str]):
        self._cfg = cfg
        self._store = store
        self._tok = tokenizer
        self.counts = counts

    async def resolve(self, turn: TurnInput) -> Session:
        """The session step: which conversation, and its claimed handle."""
        session_id, prompt_ids = turn.session_id, turn.prompt_ids
        if self._store is None:
            return Session(session_id or turn.namespace + new_session(), prompt_ids, None)
        claim = None
        if session_id is not None and turn.session_keyed:
            self.counts[TurnCount.SESSION_FROM_AGENT] += 1
            claim = await self.call(self._store.begin_turn(session_id), None, "begin_turn")
            if claim is not None and not _extends(turn, prompt_ids, claim.conversation):
                # A sub-agent or a fork under the agent's key: the keyed conversation
                # stays as it is, and this turn finds its own by its prompt.
                self.counts[TurnCount.SESSION_KEY_DIVERGED] += 1
                given_back = self._store.end_turn(claim, TurnOutcome.KEPT, None)
                await self.call(given_back, None, "end_turn")
                keyed, claim = session_id, None
                session_id, prompt_ids = await self._matched(turn, prompt_ids)
                if session_id == keyed:
                    session_id = None
        elif session_id is None:
            session_id, prompt_ids = await self._matched(turn, prompt_ids)
        session_id = session_id or turn.namespace + new_session()
        # Store unavailable: the turn runs without reuse and is not stored.
        if claim is None:
            claim = await self.call(self._store.begin_turn(session_id), None, "begin_turn")
        wait_until = time.monotonic() + self._cfg.drain.wait_s
        while claim is not None and claim.miss_reason == MissReason.MOVING and time.monotonic() < wait_until:
            # A stopping decode replica is handing this conversation to a peer (`app.fleet.drain`):
            # wait for the new handle rather than recompute the history.
            self.counts[TurnCount.MOVE_WAITED] += 1
            await self.call(self._store.end_turn(claim, TurnOutcome.UNUSED, None), None, "end_turn")
            await asyncio.sleep(MOVE_POLL_S)
            claim = await self.call(self._store.begin_turn(session_id), None, "begin_turn")
        if claim is not None and claim.retry_after_s is not None:
            seconds = max(1, math.ceil(claim.retry_after_s))
            raise RateLimited(
                f"Rate limit reached for this API key: its maximum of live sessions. Retry in {seconds} s.",
                seconds,
            )
        return Session(session_id, prompt_ids, claim)

    async def _matched(self, turn: TurnInput, prompt_ids) -> tuple[str | None, tuple[int, ...] | None]:
        """The stored conversation of the turn's tenant that its prompt continues, by the
        store's prompt index (`sessions.match_sessionless`), or None."""
        if not self._cfg.sessions.match_sessionless:
            return None, prompt_ids
        assert self._store is not None
        if prompt_ids is None:
            prompt_ids = tuple(self._tok.encode(turn.prompt_text or ""))
        session_id, _ = await self.call(self._store.match(prompt_ids, turn.prompt_text), (None, 0), "match")
        if session_id is not None and not session_id.startswith(turn.namespace):
            session_id = None  # another tenant's conversation: never matched across
        self.counts[TurnCount.SESSIONLESS_MATCHED if session_id else TurnCount.SESSIONLESS_NEW] += 1
        return session_id, prompt_ids

    async def call(self, call, default, what: str):
        """Await a store call; if it fails (the client's deadline included), count
        `store_unavailable`, log, and return `default`: a store fault costs reuse, never
        the turn."""
        try:
            return await call
        except Exception as exc:
            self.counts[TurnCount.STORE_UNAVAILABLE] += 1
            logger.warning("store %s failed, turn goes on without it: %r", what, exc)
            return default


def new_session() -> str:
    return "s-" + uuid.uuid4().hex


def text_extends(text: str | None, conv: Conversation | None) -> bool:
    """Whether the prompt's text starts with the stored conversation's exact text."""
    return text is not None and conv is not None and conv.text is not None and text.startswith(conv.text)


def _extends(turn: TurnInput, prompt_ids, conv: Conversation | None) -> bool:
    """Whether the turn's prompt continues the stored conversation `conv` (its text, or
    its exact tokens); True when there is none to compare (a new or busy session)."""
    if conv is None or text_extends(turn.prompt_text, conv):
        return True
    ids = prompt_ids if prompt_ids is not None else turn.prompt_ids
    return ids is not None and tuple(ids[: len(conv.token_ids)]) == conv.token_ids
