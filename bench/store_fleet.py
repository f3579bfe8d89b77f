"""The conversations `bench.store` stores and times (`Fleet`): token ids and texts of
many sessions sharing one system prompt, each with a decode handle, and each session's
next turn."""

from __future__ import annotations

import argparse
import random
from array import array

from connector.handle import KVHandle, Location
from connector.store import Conversation

BLOCK = 32
"""Tokens per KV block (the store's index block size)."""
ANSWER = 128
"""Tokens of each turn's answer."""
NEXT_PROMPT = 64
"""New prompt tokens of a session's next turn."""
NEW_MESSAGE = 512
"""Tokens of a new conversation's first message (after the system prompt)."""


class Fleet:
    """Token ids and texts of `n` conversations sharing one system prompt. Arrays are
    concatenated from shared pieces (a memcpy each), so 100k x 8k tokens builds fast."""

    def __init__(self, args: argparse.Namespace):
        rng = random.Random(args.seed)
        self.args = args
        self.system = array("i", (rng.randrange(1000, 100_000) for _ in range(args.system)))
        self.body = array("i", (rng.randrange(1000, 100_000) for _ in range(args.tokens)))
        cpt = args.chars_per_token
        self.system_text = (
            "".join(chr(97 + rng.randrange(26)) for _ in range(args.system * cpt)) if cpt else None
        )
        self.body_text = (
            "".join(chr(97 + rng.randrange(26)) for _ in range(args.tokens * cpt)) if cpt else None
        )
        self._serial = 0

    def unique(self, n: int, tag: int) -> array:
        """`n` ids that start with a block no other tag shares."""
        return (array("i", [1_000_000_000 + tag]) + self.body[: max(0, n - 1)])[:n]

    def text(self, n_tokens: int, tag: int) -> str | None:
        if self.body_text is None:
            return None
        head = f"<{tag:010d}>"
        return (head + self.body_text[: n_tokens * self.args.chars_per_token])[
            : n_tokens * self.args.chars_per_token
        ]

    def handle(self, engine: int, num_tokens: int) -> KVHandle:
        self._serial += 1
        blocks = -(-num_tokens // BLOCK)
        return KVHandle(
            Location.DECODE,
            f"engine-{engine}",
            f"req-{self._serial}",
            (tuple(range(blocks)),),
            "10.0.0.2",
            5601,
            num_tokens - 1,
        )

    def conversation(self, i: int) -> Conversation:
        a = self.args
        ids = self.system + self.unique(a.tokens - a.system, i)
        body = self.text(a.tokens - a.system, i)
        text = self.system_text + body if self.system_text is not None and body is not None else None
        return Conversation(
            f"s{i}",
            ids,
            len(ids) - ANSWER,
            text,
            self.handle(i % a.engines, len(ids)),
            f"decode#{i % a.engines}",
        )

    def next_turn(self, conv: Conversation, tag: int) -> Conversation:
        """The session's next turn: 64 new prompt tokens and a 128-token answer."""
        extra = self.unique(NEXT_PROMPT + ANSWER, tag)
        ids = conv.compact_ids + extra
        more = self.text(NEXT_PROMPT + ANSWER, tag)
        text = conv.text + more if conv.text is not None and more is not None else None
        assert conv.handle is not None  # every fleet conversation has one
        engine = int(conv.handle.engine_id.rsplit("-", 1)[1])
        return Conversation(
            conv.session_id,
            ids,
            len(conv.compact_ids) + NEXT_PROMPT,
            text,
            self.handle(engine, len(ids)),
            conv.decode_replica,
        )
