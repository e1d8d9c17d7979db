"""Builds tilenorm's C++ launchers (the torch extension of :mod:`tilenorm.pytorch.native`, the
XLA FFI module of :mod:`tilenorm.jax.native`) on first use: the compiler, the cache they are
built into, and a build that processes starting together run once. Framework-neutral: needs
no torch and no JAX."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

#: The header both launchers include: the prepared launch itself.
RECIPE_HEADER = Path(__file__).with_name("recipe.h")


def cache_root() -> Path:
    """Where built host code lives: ``$TILENORM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tilenorm`` (``~/.cache/tilenorm``)."""
    root = os.environ.get("TILENORM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tilenorm"


def compiler() -> str:
    """The C++ compiler: ``$CXX``, default ``c++``."""
    return os.environ.get("CXX") or "c++"


def source_key(sources: Iterable[Path], toolchain: str) -> str:
    """A short hash of the sources' text, the toolchain description (the framework's build,
    Python) and the compiler: what a built library is valid for."""
    h = hashlib.sha256()
    for source in sources:
        h.update(source.read_bytes())
    h.update(f"{toolchain} {sys.version} {compiler()}".encode())
    return h.hexdigest()[:16]


def build_library(source: Path, target: Path, flags: list[str], what: str,
                  verbose: bool = False) -> Path:
    """Compile ``source`` into the shared library ``target`` unless it is there (once: a lock
    serializes processes that start together; the library is moved into place complete).
    ``what`` names it in messages. Raises ``RuntimeError`` with the compiler's output when the
    build fails."""
    if target.exists():
        return target
    if shutil.which(compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({compiler()!r} not found; set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        if verbose:
            print(f"tilenorm: building {what} into {target.parent} (once)", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([compiler(), str(source), "-o", str(out), *flags],
                                  capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-4000:]}")
            os.replace(out, target)
    return target
