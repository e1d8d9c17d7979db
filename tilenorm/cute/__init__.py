"""Kernels written in the CuTe DSL (``nvidia-cutlass-dsl``): where a kernel needs loads in
flight across rows, which a cuTile persistent loop cannot express (bench/NOTES.md, #8, #22)."""

from __future__ import annotations

import functools
import importlib

#: What the kernels import: the CuTe DSL and the TVM-FFI path they are called through.
REQUIRED_MODULES = ("cutlass.cute", "tvm_ffi")


@functools.cache
def available() -> bool:
    """True when every module in :data:`REQUIRED_MODULES` imports."""
    try:
        for module in REQUIRED_MODULES:
            importlib.import_module(module)
    except ImportError:
        return False
    return True
