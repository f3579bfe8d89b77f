"""Node-local reservations shared by the engine replicas of one machine.

Replicas on a node start at the same time, so "is it free?" checks race: two engines took
the same NIXL side-channel port, or would bind their threads to the same cores. A
`NodeRegistry` is a small file of `pid:value` entries guarded by an exclusive lock;
entries of processes that are gone are dropped on every reservation, so a crashed
replica's ports and cores come back by themselves.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class NodeRegistry:
    """Integers (ports, core ids) held by live processes of this node."""

    def __init__(self, path: str):
        self.path = path

    def reserve(
        self, pick: Callable[[set[int]], list[int] | None], pid: int | None = None
    ) -> list[int] | None:
        """Under the lock: call `pick(taken)` with the values live processes hold, and
        record what it returns for `pid` (default: this process). Returns that list, or
        None when `pick` found nothing."""
        pid = os.getpid() if pid is None else pid
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                held = [(p, v) for p, v in self._read() if pid_alive(p)]
                chosen = pick({v for _, v in held})
                if chosen:
                    held += [(pid, v) for v in chosen]
                self._write(held)
                return chosen
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> list[tuple[int, int]]:
        if not os.path.exists(self.path):
            return []
        entries = []
        for item in open(self.path).read().split():
            pid, _, value = item.partition(":")
            try:
                entries.append((int(pid), int(value)))
            except ValueError:
                continue  # a torn or foreign line: ignore it
        return entries

    def _write(self, entries: list[tuple[int, int]]) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(" ".join(f"{p}:{v}" for p, v in entries))
        os.replace(tmp, self.path)
