"""Tenants inside the handle store: whose conversation is whose, fair shares of each decode
engine's pinned budget, and a bound on each tenant's kept conversations.

A session id that starts with a tenant namespace (`k<12 hex>:` for an API key, `internal:`
for trusted handle callers, written by `app.api.auth`) belongs to that tenant; other ids to
the one tenant of a deployment without keys (""). The store calls this module on every
change of what a tenant keeps; all methods are O(1) but `victim`, which is O(tenants on
the engine).

A tenant's `max_sessions` bounds its *live* sessions (used within the store's handle TTL,
while their KV may still be pinned): a turn that would start one more is refused
(`refusal`, a 429 at the ingress) until the oldest goes idle. Idle sessions stay kept.

Shares are weighted max-min: when a decode engine's waiting handles exceed its budget,
the tenant whose pinned blocks are largest for its weight gives up its least recently
stored conversation. A tenant alone on an engine may use all of the budget (idle share is
lent); when another tenant stores, the first is then the one over its share and its own
oldest conversations go first (the share is reclaimed on demand). A tenant over its share
that stores more evicts its own. Within the chosen tenant, conversations whose client asked
for long retention (`retained`) go only when the tenant has no other stored on the engine:
retention picks the victim inside a tenant, never which tenant gives up blocks.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from collections.abc import Mapping

NAMESPACE = re.compile(r"^(k[0-9a-f]{12}:|internal:)")


def tenant_of(session_id: str) -> str:
    """The tenant namespace a session id starts with ("" for none)."""
    found = NAMESPACE.match(session_id)
    return found.group(1) if found else ""


class TenantShares:
    """Per decode engine and tenant: waiting (stored or claimed) blocks and the tenant's
    stored conversations, oldest first, retained ones apart; per tenant: its
    conversations, least recently used first."""

    def __init__(
        self, weights: Mapping[str, float] | None = None, max_sessions: Mapping[str, int] | None = None
    ):
        self._weights = dict(weights or {})
        self._max_sessions = dict(max_sessions or {})
        self.blocks: Counter[tuple[str, str]] = Counter()
        self._stored: dict[tuple[str, str, bool], OrderedDict[str, None]] = {}  # (engine, tenant, retained)
        self._tenants_on: dict[str, Counter[str]] = {}  # engine -> tenant -> stored sessions
        self._sessions: dict[str, OrderedDict[str, float]] = {}  # kept, by last use
        self._live: dict[str, OrderedDict[str, float]] = {}  # used within the window, by last use

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    # -- pinned blocks ----------------------------------------------------------------------

    def hold(self, engine_id: str, tenant: str, blocks: int) -> None:
        self.blocks[(engine_id, tenant)] += blocks

    def let_go(self, engine_id: str, tenant: str, blocks: int) -> None:
        key = (engine_id, tenant)
        self.blocks[key] -= blocks
        if self.blocks[key] <= 0:
            del self.blocks[key]

    def stored(self, engine_id: str, tenant: str, session_id: str, retained: bool = False) -> None:
        """A conversation's handle is now STORED (evictable) on `engine_id`; `retained`:
        its client asked for long retention."""
        self._stored.setdefault((engine_id, tenant, retained), OrderedDict())[session_id] = None
        self._tenants_on.setdefault(engine_id, Counter())[tenant] += 1

    def unstored(self, engine_id: str, tenant: str, session_id: str, retained: bool = False) -> None:
        """The handle left STORED (claimed, read, evicted, expired, ...); `retained` as
        it was stored."""
        key = (engine_id, tenant, retained)
        sessions = self._stored.get(key)
        if sessions is None or session_id not in sessions:
            return
        del sessions[session_id]
        if not sessions:
            del self._stored[key]
        on = self._tenants_on[engine_id]
        on[tenant] -= 1
        if on[tenant] <= 0:
            del on[tenant]
            if not on:
                del self._tenants_on[engine_id]

    def victim(self, engine_id: str) -> str | None:
        """The session whose handle goes when `engine_id` is over its budget: of the
        tenant with the most pinned blocks for its weight, the oldest stored one not
        retained, else its oldest retained one."""
        tenants = self._tenants_on.get(engine_id)
        if not tenants:
            return None
        tenant = max(tenants, key=lambda t: (self.blocks[(engine_id, t)] / self.weight(t), t))
        sessions = self._stored.get((engine_id, tenant, False)) or self._stored[(engine_id, tenant, True)]
        return next(iter(sessions))

    # -- kept and live conversations -----------------------------------------------------

    def touch(self, tenant: str, session_id: str, now: float) -> None:
        """The session was used or stored at `now`: it is the tenant's most recent."""
        for table in (self._sessions, self._live):
            sessions = table.setdefault(tenant, OrderedDict())
            sessions[session_id] = now
            sessions.move_to_end(session_id)

    def forget(self, tenant: str, session_id: str) -> None:
        for table in (self._sessions, self._live):
            sessions = table.get(tenant)
            if sessions is not None:
                sessions.pop(session_id, None)
                if not sessions:
                    del table[tenant]

    def refusal(self, tenant: str, session_id: str, now: float, window_s: float) -> float | None:
        """Seconds until the tenant may start `session_id`, a session it does not keep
        yet, when it already has its maximum of live sessions (used within `window_s`);
        None: it may start now."""
        limit = self._max_sessions.get(tenant)
        if limit is None:
            return None
        live = self._live.get(tenant)
        if live is None:
            return None
        while live and next(iter(live.values())) <= now - window_s:
            live.popitem(last=False)  # idle past the window: kept, but no longer live
        if session_id in live or len(live) < limit:
            return None
        return next(iter(live.values())) + window_s - now

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tenant: sessions kept and blocks pinned for it (all engines)."""
        out: dict[str, dict[str, int]] = {}
        for tenant, sessions in self._sessions.items():
            out.setdefault(tenant, {"sessions": 0, "pinned_blocks": 0})["sessions"] = len(sessions)
        for (_, tenant), blocks in self.blocks.items():
            out.setdefault(tenant, {"sessions": 0, "pinned_blocks": 0})["pinned_blocks"] += blocks
        return out
