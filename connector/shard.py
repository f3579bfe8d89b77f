"""One shard of the store: runs every `connector.store_api.StoreOp` by name.

`StoreShard` is what each shard actor runs (`connector.actor.HandleStoreActor`, in its
own process), called by every ingress replica's `connector.client.StoreClient`: one
operation a call (`call`), or a batch of per-turn operations packed in one pickle
(`apply`). It holds no reference to anything outside its process and frees nothing
itself: handles its store lets go wait in the releases outbox until an ingress takes them
(`take_releases`) and asks their decode engines to free the blocks. `LocalActor` runs a
shard in process behind the actor's calling convention (tests, benchmarks). No Ray.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from connector.response_store import StoredResponse
from connector.store import HandleStore
from connector.store_api import Part, Route, StoreOp

if TYPE_CHECKING:
    from connector.settings import StoreSettings


def pack(value: Any) -> bytes:
    """A batch or its results as one pickle (the C pickler: several times cheaper per
    object than the general serializer Ray would otherwise run over every claim and
    conversation; Ray then moves a single bytes object)."""
    try:
        return pickle.dumps(value, protocol=5)
    except Exception:
        # An error that does not pickle still reaches its caller, as its description.
        if not isinstance(value, list):
            raise
        return pickle.dumps(
            [(ok, v if ok or _pickles(v) else RuntimeError(repr(v))) for ok, v in value], protocol=5
        )


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=5)
        return True
    except Exception:
        return False


def _batched(name: str) -> StoreOp | None:
    try:
        op = StoreOp.of(name)
    except ValueError:
        return None
    return op if op.route is Route.BATCHED else None


def apply_ops(store: HandleStore, ops: Sequence[tuple[str, tuple]] | bytes) -> list[tuple[bool, Any]] | bytes:
    """Run a batch of `(StoreOp value, args)` on `store` in order: one `(ok, result or
    exception)` per operation. Only `Route.BATCHED` operations travel in batches; one
    operation's error does not stop the others. A packed batch (`pack`) gets packed results."""
    if isinstance(ops, bytes):
        return pack(apply_ops(store, pickle.loads(ops)))
    results: list[tuple[bool, Any]] = []
    for name, args in ops:
        op = _batched(name)
        if op is None:
            results.append((False, ValueError(f"{name!r} is not a batched store operation")))
            continue
        try:
            results.append((True, getattr(store, op.method)(*args)))
        except Exception as exc:  # returned to that operation's caller
            results.append((False, exc))
    return results


def _detached(value: Any) -> Any:
    """Responses leave the shard detached: whole histories, never the shard's own records."""
    if isinstance(value, StoredResponse):
        return value.detached()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


class StoreShard:
    """One shard of the store: a `HandleStore` and a `ResponseStore`. Calls are cheap and
    never block. Runs as a Ray actor (`HandleStoreActor`); plain, it is what tests drive."""

    def __init__(self, settings: StoreSettings):
        self._settings = {**settings.store_kwargs(), "responses": settings.response_kwargs()}
        self.store = settings.handle_store()
        self.responses = settings.response_store()
        self._parts = {Part.HANDLES: self.store, Part.RESPONSES: self.responses, Part.SHARD: self}

    def call(self, op: StoreOp | str, *args: Any) -> Any:
        """Run one operation (a `StoreOp` or its value) on the part that implements it."""
        op = StoreOp.of(op)
        result = getattr(self._parts[op.part], op.method)(*args)
        return _detached(result) if op.part is Part.RESPONSES else result

    def apply(self, ops: list[tuple[str, tuple]] | bytes) -> list[tuple[bool, Any]] | bytes:
        """A batch of per-turn operations from one ingress (`StoreClient`, packed), in order."""
        return apply_ops(self.store, ops)

    def stats(self) -> dict:
        """The shard's state and counters (its stored responses' under `responses`), the
        settings it was built with, and the CPU time its process has used (`cpu_s`, every
        thread: Ray's own work on its calls included), from which a caller can tell what
        the shard costs per operation."""
        return {
            **self.store.stats(),
            "responses": self.responses.stats(),
            "settings": self._settings,
            "cpu_s": time.process_time(),
        }


class _LocalMethod:
    def __init__(self, shard: StoreShard, name: str):
        self._shard, self._name = shard, name

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return getattr(self._shard, self._name)(*args)

        return call()


class LocalActor:
    """A `StoreShard` in process, called as its actor is (`actor.call.remote(...)` gives an
    awaitable): what `StoreClient.of_shards` talks to."""

    def __init__(self, shard: StoreShard):
        self.shard = shard

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(self.shard, name)
