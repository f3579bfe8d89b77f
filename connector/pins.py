"""The pin ledger: how many KV blocks each decode engine keeps pinned for the store, and the
outbox of handles that left unread.

`connector.store.HandleStore` owns one and tells it every change: a handle entering
(`hold`), a held handle leaving (`let_go`), a handle nobody will read that was never held
(`unread_handle`), an engine's capacity (`set_capacity`) or death (`forget_engine`), and
time passing (`sweep`). It answers per engine: blocks pinned, the budget for waiting
handles, and (`take`) the releases to send to the decode engines. Every call is O(1) but
`take` (O(releases)), `sweep` (O(log n) per release past its TTL) and `forget_engine`
(O(releases pending)).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter

from connector.handle import KVHandle
from connector.records import HandleState, Release


class PinLedger:
    """Blocks each decode engine keeps pinned for us, kept incrementally.

    `waiting`: blocks of handles still STORED or CLAIMED; `unread`: blocks of handles
    that left unread, until their release is taken or the decode engine's TTL frees
    them. The outbox of releases is exactly the unread handles."""

    def __init__(self, decoder_ttl_s: float, default_budget: int, pinned_fraction: float):
        self._decoder_ttl = decoder_ttl_s
        self._default_budget = default_budget
        self._fraction = pinned_fraction
        self.budgets: dict[str, int] = {}
        self.waiting: Counter[str] = Counter()
        self.unread: Counter[str] = Counter()
        self._outbox: dict[tuple[str, str], tuple[Release, float]] = {}
        self._deadlines: list[tuple[float, str, str]] = []  # heap; entries gone from the outbox are stale
        self._gone: set[str] = set()

    def budget(self, engine_id: str) -> int:
        return self.budgets.get(engine_id, self._default_budget)

    def knows(self, engine_id: str) -> bool:
        """Whether the engine's capacity was set (else the default budget applies)."""
        return engine_id in self.budgets

    def set_capacity(self, engine_id: str, total_blocks: int) -> None:
        self.budgets[engine_id] = math.floor(self._fraction * total_blocks)

    def pinned(self, engine_id: str) -> int:
        return self.waiting[engine_id] + self.unread[engine_id]

    def engines(self) -> set[str]:
        return {e for e, n in self.waiting.items() if n} | {e for e, n in self.unread.items() if n}

    def hold(self, handle: KVHandle) -> None:
        self.waiting[handle.engine_id] += handle.num_blocks

    def unhold(self, handle: KVHandle) -> None:
        """Undo `hold`: the handle's blocks are no longer waiting under it (nothing is
        released; the handle's engine keeps them)."""
        self.waiting[handle.engine_id] -= handle.num_blocks

    def let_go(
        self, handle: KVHandle, reason: HandleState, stored_at: float, decode_replica: str | None, now: float
    ) -> None:
        """A held handle leaves; unless it was read or its engine is gone, its release
        goes to the outbox and its blocks stay counted until taken or freed by the TTL."""
        self.unhold(handle)
        if reason not in (HandleState.PULLED, HandleState.DROPPED):
            self.unread_handle(handle, reason, stored_at, decode_replica, now)

    def unread_handle(
        self, handle: KVHandle, reason: HandleState, stored_at: float, decode_replica: str | None, now: float
    ) -> None:
        """A handle nobody will read (held or never stored): release it."""
        freed_at = stored_at + self._decoder_ttl
        key = (handle.engine_id, handle.request_id)
        if handle.engine_id in self._gone or freed_at <= now or key in self._outbox:
            return
        release = Release(handle.engine_id, handle.request_id, decode_replica, handle.num_blocks, reason)
        self._outbox[key] = (release, freed_at)
        heapq.heappush(self._deadlines, (freed_at, *key))
        self.unread[handle.engine_id] += handle.num_blocks

    def take(self) -> list[Release]:
        out = [release for release, _ in self._outbox.values()]
        for release in out:
            self.unread[release.engine_id] -= release.num_blocks
        self._outbox.clear()
        return out

    def sweep(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            freed_at, engine_id, request_id = heapq.heappop(self._deadlines)
            key = (engine_id, request_id)
            entry = self._outbox.get(key)
            if entry is not None and entry[1] == freed_at:
                del self._outbox[key]
                self.unread[entry[0].engine_id] -= entry[0].num_blocks

    def forget_engine(self, engine_id: str) -> None:
        """The engine is gone: nothing of it is pinned or to be released any more."""
        self._gone.add(engine_id)
        for key in [k for k in self._outbox if k[0] == engine_id]:
            del self._outbox[key]
        self.unread[engine_id] = 0

    @property
    def pending(self) -> int:
        return len(self._outbox)
