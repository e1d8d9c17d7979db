"""Whether kernels marked experimental (not yet validated on a GPU) may run.

Off by default. ``TILENORM_EXPERIMENTAL=1`` turns it on for the process;
:func:`set_experimental` and the :func:`experimental` context manager change it at run time.
Under ``torch.compile`` the value at trace time is the one compiled in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _from_env() -> bool:
    raw = os.environ.get("TILENORM_EXPERIMENTAL", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"TILENORM_EXPERIMENTAL={raw!r}: expected one of "
                     f"{sorted(_TRUE | _FALSE - {''})} or unset")


_enabled = _from_env()
#: Called after every change: caches of what runs (a framework's prepared calls) drop it.
on_change: list[Callable[[], None]] = []


def experimental_enabled() -> bool:
    """True when experimental kernels may run."""
    return _enabled


def set_experimental(enabled: bool) -> None:
    """Allow (True) or forbid (False) experimental kernels from now on."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_experimental expects a bool, got {type(enabled).__name__}")
    _enabled = enabled
    for forget in on_change:
        forget()


@contextlib.contextmanager
def experimental(enabled: bool = True) -> Iterator[None]:
    """Allow (or, with ``enabled=False``, forbid) experimental kernels inside the block."""
    previous = _enabled
    set_experimental(enabled)
    try:
        yield
    finally:
        set_experimental(previous)
