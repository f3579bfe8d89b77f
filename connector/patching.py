"""The one mechanism every patch of private vLLM, NIXL or Ray code in this project uses:
check what it replaces or relies on, and skip it with a warning when that changed.

A patch function first calls `require` (attributes of a class or module: methods,
module globals) and `require_set_in_init` (instance attributes, which exist only once an
object is built, read from the source of `__init__` along the MRO) on everything it
replaces, calls, reads or writes. Each raises `Unsupported` naming what is missing,
before anything is patched. `apply_patch` runs the patch: on `Unsupported` it logs what
is off and why (with the installed vLLM and the series the patches were written for,
`SUPPORTED_VLLM`) and returns False; the engine then runs without that patch, as vLLM
ships. Any other exception propagates.

This module imports nothing of the project, so patch modules (`connector.vllm_plugin`,
`connector.release`) import it and not each other.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

SUPPORTED_VLLM = "0.32."
"""The vLLM series whose private code the patches were written against. Each patch
checks the attributes it replaces or calls before it patches: on another vLLM one whose
target changed is skipped with a warning (`Unsupported`), and the engine runs without it."""

logger = logging.getLogger(__name__)


class Unsupported(RuntimeError):
    """The installed vLLM or NIXL lacks what a patch replaces or calls."""


def apply_patch(what: str, patch: Callable[..., Any], *args: Any) -> bool:
    """Run `patch(*args)`; on `Unsupported`, log that `what` is off and why, and return
    False (True when it ran)."""
    try:
        patch(*args)
    except Unsupported as e:
        logger.warning(
            "kvturn: %s is off in this engine: %s (vLLM %s; written for %sx)",
            what,
            e,
            vllm_version(),
            SUPPORTED_VLLM,
        )
        return False
    return True


def vllm_version() -> str:
    """The installed vLLM's version, or "not installed"."""
    try:
        from vllm import __version__
    except ImportError:
        return "not installed"
    return __version__


def require(obj: Any, *names: str) -> None:
    """Raise `Unsupported` naming those of `names` that `obj` lacks."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise Unsupported(
            f"{getattr(obj, '__name__', type(obj).__name__)} has no {', '.join(map(repr, missing))}"
        )


def require_set_in_init(cls: type, *names: str) -> None:
    """Raise `Unsupported` unless the `__init__` of `cls` or of one of its bases sets each
    of the instance attributes `names` (`self.<name>` as a whole word in their source; a
    class without Python source is taken as it is)."""
    try:
        source = "".join(
            inspect.getsource(k.__dict__["__init__"])
            for k in cls.__mro__
            if "__init__" in k.__dict__ and k is not object
        )
    except (OSError, TypeError):
        return
    for name in names:
        if not re.search(rf"\bself\.{re.escape(name)}\b", source):
            raise Unsupported(f"{cls.__name__}.__init__ no longer sets {name!r}")
