"""Stored Responses API objects (`previous_response_id`), kept in the handle store's shards.

A response lives in the shard its key hashes to (`connector.actor`), so any ingress
replica can continue any chain and an ingress restart loses nothing; a shard restart
loses that shard's responses (the client then gets a not-found, as after expiry).

Bounded three ways: a count, a byte estimate, and a TTL counted from the last use (put,
get or continuation), like a cache. Because every use moves a response to the end of
the LRU order and the TTL is uniform, the LRU order is also the expiry order: the sweep
pops expired responses from the front, O(expired). Pure Python, no Ray; called from one
thread at a time (a shard is a single-threaded actor, which makes `continue_from` atomic).

Tenants are told apart by key prefix only: the ingress prefixes response ids with the
tenant namespace, as it does session ids (`connector.shares.tenant_of`).
"""

from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.events import ResponseEvent
from connector.shares import tenant_of


@dataclass
class StoredResponse:
    """One response as a later request continues it: what to show (`body`) and what it
    added to its conversation (`messages`), over the response it continued (`parent_key`).

    A chain's history is not copied into each response (that would grow a store's bytes
    with the square of a chain's length): a response keeps only its own messages, and its
    shard links it to its parent's record (`parent`) when it is stored. Responses of one
    chain, forks included, share a routing key (`route_of`), so they meet on one shard.
    Records leave a shard as `detached` copies that carry the whole history instead."""

    key: str
    """The response id, prefixed by the tenant namespace ("k0123456789ab:resp_...")."""
    session_id: str
    """Session id (without the tenant namespace) of the conversation the response belongs to."""
    created_at: float
    body: dict
    """The Response object, JSON-able."""
    messages: list[dict]
    """Chat messages this response added (its input and its output); in a `detached`
    copy, the whole conversation up to and including this response's output."""
    input_items: list[dict]
    parent_key: str | None = None
    """The response this one continued (None: the first of its chain, or a detached copy)."""
    continued_by: str | None = None
    """Request id of the first request that continued this response (`continue_from`)."""
    parent: StoredResponse | None = field(default=None, repr=False, compare=False)
    """The parent's record, linked by the shard. It stays alive while a child needs its
    messages, even after the shard forgot it (not counted in the byte bound then)."""
    nbytes: int = field(init=False, repr=False)
    """Size of its JSON encoding, counted once: what the byte bound counts. The Python
    objects a shard keeps cost a few times that, in proportion."""

    def __post_init__(self) -> None:
        payload = json.dumps([self.body, self.messages, self.input_items], separators=(",", ":"))
        self.nbytes = len(payload) + len(self.key) + len(self.session_id)

    def history(self) -> list[dict]:
        """The conversation up to and including this response's output."""
        chain: list[StoredResponse] = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return [m for record in reversed(chain) for m in record.messages]

    def detached(self) -> StoredResponse:
        """A copy that stands alone (the whole history in `messages`), to leave the shard."""
        return StoredResponse(
            self.key,
            self.session_id,
            self.created_at,
            self.body,
            self.history(),
            self.input_items,
            continued_by=self.continued_by,
        )


def route_of(key: str) -> str:
    """The key a response is placed by: its chain's, shared by every response that
    continues it (`app.api.responses_api.new_id`: `resp_` + 16 hex of chain + 16 of its own)."""
    namespace, _, rid = key.rpartition("resp_")
    return namespace + "resp_" + rid[:16] if len(rid) == 32 else key


class ResponseStore:
    """LRU map of key -> `StoredResponse`, bounded by count, bytes and TTL since last use.

    Every method first sweeps the expired responses. Nothing blocks."""

    def __init__(
        self,
        *,
        max_responses: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._max_responses = max_responses
        self._max_bytes = max_bytes
        self._ttl = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        """key -> (last use, response), least recently used (first to expire) first."""
        self._bytes = 0
        self._tenants: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        """Events by `ResponseEvent` (read by plain string too)."""

    def put(self, resp: StoredResponse) -> str:
        """Store `resp`, replacing a response of the same key, linked to its parent, then
        evict the least recently used until within both bounds. Returns "stored";
        "no_parent" when its parent is not kept here (send it again `detached`);
        "too_big" when it alone exceeds the byte bound (a response of its key already
        kept stays)."""
        now = self._sweep()
        if resp.nbytes > self._max_bytes:
            self.counts[ResponseEvent.REFUSED_TOO_BIG] += 1
            return "too_big"
        if resp.parent_key is not None:
            parent = self._entries.get(resp.parent_key)
            if parent is None:
                return "no_parent"
            resp.parent = parent[1]
        self._remove(resp.key)
        self._entries[resp.key] = (now, resp)
        self._bytes += resp.nbytes
        self._tenants[tenant_of(resp.key)] += 1
        self.counts[ResponseEvent.STORED] += 1
        while len(self._entries) > self._max_responses or self._bytes > self._max_bytes:
            over_count = len(self._entries) > self._max_responses
            self._remove(next(iter(self._entries)))
            self.counts[ResponseEvent.EVICTED if over_count else ResponseEvent.EVICTED_FOR_BYTES] += 1
        return "stored"

    def get(self, key: str) -> StoredResponse | None:
        """The response, now the most recently used (its TTL starts again)."""
        self._sweep()
        return self._touch(key)

    def continue_from(self, key: str, request_id: str) -> tuple[StoredResponse | None, bool]:
        """The response a request continues, and whether the request owns the
        continuation: True for the first request to continue it (or the same one
        again), which may then carry on its session; False for any other (a fork,
        counted), which the caller runs in a new session. A use, like `get`."""
        self._sweep()
        resp = self._touch(key)
        if resp is None:
            return None, False
        if resp.continued_by in (None, request_id):
            resp.continued_by = request_id
            return resp, True
        self.counts[ResponseEvent.FORKED] += 1
        return resp, False

    def release_continuation(self, key: str, request_id: str) -> None:
        """Give back the continuation `request_id` owns (it failed before storing its own
        response), so that a later request may own it. Not a use."""
        self._sweep()
        entry = self._entries.get(key)
        if entry is not None and entry[1].continued_by == request_id:
            entry[1].continued_by = None

    def delete(self, key: str) -> StoredResponse | None:
        """Forget a response now (the client deleted it); None if none was kept."""
        self._sweep()
        resp = self._remove(key)
        if resp is not None:
            self.counts[ResponseEvent.DELETED] += 1
        return resp

    def stats(self) -> dict:
        """Responses and bytes kept, kept responses per tenant namespace (a hash of its
        key, never the key), and the counts as plain strings."""
        self._sweep()
        return {
            "responses": len(self._entries),
            "response_bytes": self._bytes,
            "response_tenants": dict(self._tenants),
            "counts": {str(event): n for event, n in self.counts.items()},
        }

    def _touch(self, key: str) -> StoredResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries[key] = (self._clock(), entry[1])
        self._entries.move_to_end(key)
        return entry[1]

    def _remove(self, key: str) -> StoredResponse | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        resp = entry[1]
        self._bytes -= resp.nbytes
        tenant = tenant_of(key)
        self._tenants[tenant] -= 1
        if not self._tenants[tenant]:
            del self._tenants[tenant]
        return resp

    def _sweep(self) -> float:
        """Drop the responses unused for the TTL; returns the time now."""
        now = self._clock()
        while self._entries:
            key, (used_at, _) = next(iter(self._entries.items()))
            if used_at + self._ttl > now:
                break
            self._remove(key)
            self.counts[ResponseEvent.EXPIRED] += 1
        return now
