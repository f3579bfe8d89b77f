"""The handle store's open leases: one per `begin_turn`, until its `end_turn` or deadline.

`connector.store.HandleStore` owns one `LeaseBook`: it opens a lease per claim (with or
without a handle), pops it when the turn ends, marks a session's leases ended when the
session is, and collects the leases past their deadline. Leases are kept in insertion
order, which is deadline order because the timeout is uniform and the clock monotonic;
every operation is O(1) but `end_session` (O(the session's open leases)).
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterator

from connector.handle import KVHandle


class Lease:
    """One claim, a turn's or a move's: the handle it holds (None for a miss) and what it
    was handed."""

    __slots__ = ("session_id", "handle", "decode_replica", "stored_at", "deadline", "ended", "base", "move")

    def __init__(
        self,
        session_id: str,
        handle: KVHandle | None,
        decode_replica: str | None,
        stored_at: float,
        deadline: float,
        base: tuple[array, str | None] | None = None,
        move: bool = False,
    ):
        self.session_id = session_id
        self.handle = handle
        self.decode_replica = decode_replica
        self.stored_at = stored_at
        self.deadline = deadline
        self.ended = False
        """The session was ended while the lease was open: its new turn is not stored."""
        self.base = base
        """(ids, text) of the conversation handed out with the claim: what a
        `ConversationTail` ending this lease extends."""
        self.move = move
        """The claim is a move's (`HandleStore.begin_move`), not a turn's."""


class LeaseBook:
    """Open leases by id (deadline order) and by session."""

    def __init__(self, timeout_s: float):
        self._timeout = timeout_s
        self._leases: OrderedDict[int, Lease] = OrderedDict()
        self._open: dict[str, set[int]] = {}  # session -> its open leases
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def open(
        self,
        session_id: str,
        handle: KVHandle | None,
        decode_replica: str | None,
        stored_at: float,
        now: float,
        base: tuple[array, str | None] | None,
        move: bool = False,
    ) -> int:
        """A new lease, due `timeout_s` from `now`; returns its id."""
        lease_id = next(self._ids)
        self._leases[lease_id] = Lease(
            session_id, handle, decode_replica, stored_at, now + self._timeout, base, move
        )
        self._open.setdefault(session_id, set()).add(lease_id)
        return lease_id

    def pop(self, lease_id: int) -> Lease | None:
        """The lease, closed now; None if it was closed already (ended or past its deadline)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            open_leases = self._open[lease.session_id]
            open_leases.discard(lease_id)
            if not open_leases:
                del self._open[lease.session_id]
        return lease

    def end_session(self, session_id: str) -> bool:
        """Mark the session's open leases ended; False if it has none."""
        open_leases = self._open.get(session_id, ())
        for lease_id in open_leases:
            self._leases[lease_id].ended = True
        return bool(open_leases)

    def moving(self, session_id: str, handle: KVHandle | None) -> bool:
        """Whether an open lease of the session is a move's claim of `handle`."""
        return any(
            (lease := self._leases[i]).move and lease.handle is handle for i in self._open.get(session_id, ())
        )

    def expired(self, now: float) -> Iterator[Lease]:
        """Close and yield the leases whose deadline is past, earliest first."""
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))
            if lease.deadline > now:
                break
            self.pop(lease_id)
            yield lease
