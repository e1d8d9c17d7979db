"""Kernels written in the CuTe DSL (``nvidia-cutlass-dsl``): where a kernel needs loads in
flight across rows, which a cuTile persistent loop cannot express (bench/NOTES.md, #8, #22)."""

from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    """True when the CuTe DSL and its TVM-FFI call path are importable."""
    try:
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True
