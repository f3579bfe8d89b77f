"""The sessionless match index: which stored conversation a prompt without a session
continues.

`connector.store.HandleStore` owns one `MatchIndex`: it has the index keys of each new
record computed (`keys`), adds and removes records as they enter and leave the store, and
asks `match` for a prompt's session. The index holds session ids only; records are
resolved through the store's map, passed in on each `match`.

Each conversation is indexed under the chain hash of its token blocks where its prompt
ends and where its tokens end, and (with text) under the chain hash of its text blocks.
A lookup walks the prompt's chain once, deepest first; at the deepest hit it checks the
most recent `fanout` candidates past the hashed blocks and verifies the best token by
token. Work is counted in the store's `counts` (`match_candidates`,
`match_compared_tokens`, `match_hash_collisions`) and bounded by the prompt.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import islice

from connector.events import StoreEvent
from connector.records import Record, common_prefix_len, compact, text_chain, token_chain

MATCH_FANOUT = 16
"""Most recent candidates examined per index key in `match` (sessions whose stored
tokens end on the very same block chain, e.g. identical prompts with short answers)."""

_Best = tuple[int, float, str]
"""A candidate as compared: (tokens agreeing, stored at, session id); larger is better."""


class MatchIndex:
    """Chain hash -> sessions (oldest first), for token blocks and for text blocks."""

    def __init__(self, counts: Counter[str], block: int, text_block: int, fanout: int = MATCH_FANOUT):
        self._counts = counts
        self._block = block
        self._text_block = text_block
        self._fanout = fanout
        self._tokens: dict[int, dict[str, None]] = {}
        self._text: dict[int, dict[str, None]] = {}

    def keys(self, record: Record, old: Record | None, base: tuple[array, str | None] | None) -> None:
        """Set `record`'s index fields from its tokens and text: `token_keys`, `chain`,
        `text_key`, `text_chain`. The chains continue `old`'s (the session's previous
        record) when the new turn extends it, so only the blocks it adds are hashed;
        `base`: the ids and text the turn is known to start with (a resolved tail)."""
        block, tokens, text = self._block, record.tokens, record.text
        prompt_blocks, all_blocks = record.prompt_len // block, len(tokens) // block
        start, prev = 0, 0
        if old is not None and old.chain[0] <= prompt_blocks:
            n = old.chain[0] * block
            if (base is not None and base[0] is old.tokens) or tokens[:n] == old.tokens[:n]:
                start, prev = old.chain
        hashes = token_chain(
            tokens[start * block : all_blocks * block].tobytes(),
            block * tokens.itemsize,
            all_blocks - start,
            0,
            prev,
        )

        def at(blocks: int) -> int:
            """Chain hash of the first `blocks` blocks (0 for none)."""
            return 0 if blocks == 0 else prev if blocks == start else hashes[blocks - start - 1]

        # A prompt shorter than one block is not indexed at all.
        keys = (at(prompt_blocks), at(all_blocks)) if prompt_blocks else ()
        record.token_keys = tuple(dict.fromkeys(keys))
        record.chain = (all_blocks, at(all_blocks))
        record.text_key, record.text_chain = None, (0, 0)
        if text is not None:
            width = self._text_block
            blocks, start, prev = len(text) // width, 0, 0
            if old is not None and old.text is not None:
                n = old.text_chain[0] * width
                if (base is not None and base[1] is old.text) or (
                    n <= len(text) and text[:n] == old.text[:n]
                ):
                    start, prev = old.text_chain
            text_hashes = text_chain(text, width, blocks, start, prev)
            last = text_hashes[-1] if text_hashes else prev
            record.text_chain = (blocks, last)
            record.text_key = last if blocks else None

    def add(self, record: Record) -> None:
        for key in record.token_keys:
            self._tokens.setdefault(key, {})[record.session_id] = None
        if record.text_key is not None:
            self._text.setdefault(record.text_key, {})[record.session_id] = None

    def remove(self, record: Record) -> None:
        for key in record.token_keys:
            _unindex(self._tokens, key, record.session_id)
        if record.text_key is not None:
            _unindex(self._text, record.text_key, record.session_id)

    def match(
        self, prompt_ids: Sequence[int], prompt_text: str | None, records: Mapping[str, Record]
    ) -> tuple[str | None, int]:
        """The session whose stored prompt is a prefix of `prompt_ids` or whose text is a
        prefix of `prompt_text`, and how many of its tokens agree; (None, 0) for none."""
        best = self._match_tokens(compact(prompt_ids), records)
        if prompt_text is not None:
            by_text = self._match_text(prompt_text, records)
            if by_text is not None and (best is None or by_text > best):
                best = by_text
        return (best[2], best[0]) if best is not None else (None, 0)

    def _match_tokens(self, prompt: array, records: Mapping[str, Record]) -> _Best | None:
        block, counts = self._block, self._counts
        hashes = token_chain(prompt.tobytes(), block * prompt.itemsize, len(prompt) // block)
        for blocks in range(len(hashes), 0, -1):
            bucket = self._tokens.get(hashes[blocks - 1])
            if not bucket:
                continue
            base = blocks * block
            best = None
            for session_id in islice(reversed(bucket), self._fanout):
                record = records[session_id]
                counts[StoreEvent.MATCH_CANDIDATES] += 1
                tokens, end = record.tokens, record.prompt_len
                if end > len(prompt):
                    continue
                if end > base:  # the prompt's tail past the hashed blocks (under a block)
                    counts[StoreEvent.MATCH_COMPARED_TOKENS] += end - base
                    if tokens[base:end] != prompt[base:end]:
                        continue
                agree = common_prefix_len(tokens, prompt, max(base, end))
                counts[StoreEvent.MATCH_COMPARED_TOKENS] += agree - max(base, end) + 1
                key = (agree, record.stored_at, session_id)
                best = key if best is None or key > best else best
            if best is None:
                continue
            # One candidate verified token by token over the hashed blocks.
            counts[StoreEvent.MATCH_COMPARED_TOKENS] += base
            if records[best[2]].tokens[:base] == prompt[:base]:
                return best
            counts[StoreEvent.MATCH_HASH_COLLISIONS] += 1
        return None

    def _match_text(self, text: str, records: Mapping[str, Record]) -> _Best | None:
        width = self._text_block
        hashes = text_chain(text, width, len(text) // width)
        for blocks in range(len(hashes), 0, -1):
            bucket = self._text.get(hashes[blocks - 1])
            if not bucket:
                continue
            best = None
            for session_id in islice(reversed(bucket), self._fanout):
                record = records[session_id]
                self._counts[StoreEvent.MATCH_CANDIDATES] += 1
                if record.text is not None and text.startswith(record.text):
                    key = (len(record.tokens), record.stored_at, session_id)
                    best = key if best is None or key > best else best
            if best is not None:
                return best
        return None


def _unindex(index: dict[int, dict[str, None]], key: int, session_id: str) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.pop(session_id, None)
        if not bucket:
            del index[key]
