"""The XLA FFI module of the kernel path: ``ffi_calls.cc`` built on first use against the
installed jaxlib's FFI headers, loaded with ctypes.

It holds the custom-call targets :data:`FORWARD_TARGET` and :data:`BACKWARD_TARGET` and a
registry of prepared calls (:func:`register_call`): the kernel launches that
:mod:`tilenorm.launch.driver` prepares for one shard's shapes and dtypes, as plain data, and
where each takes its data pointers from the call's operand and result buffers. It is built
once per jaxlib and source into :func:`tilenorm.launch.build.cache_root` (beside the torch
extension) with ``$CXX`` (default ``c++``); it needs neither torch, Python's headers nor CUDA
headers. ``TILENORM_NATIVE=0`` turns it off (and with it the kernel path).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib

from tilenorm.launch import build as launch_build
from tilenorm.launch.driver import LaunchRecipe

SOURCE = Path(__file__).with_name("ffi_calls.cc")
FORWARD_TARGET = "tilenorm_norm_forward"
BACKWARD_TARGET = "tilenorm_norm_backward"
#: The lowering platform the targets are registered for (``jax.ffi.register_ffi_target``).
FFI_PLATFORM = "CUDA"


def build_key() -> str:
    """The sources, jaxlib, Python and compiler that a built library is valid for."""
    return launch_build.source_key((SOURCE, launch_build.RECIPE_HEADER),
                                   f"jaxlib {jaxlib.__version__}")


def library_path() -> Path:
    return launch_build.cache_root() / f"jax-ffi-{build_key()}" / "tilenorm_ffi_calls.so"


def _flags() -> list[str]:
    return ["-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
            f"-isystem{jax.ffi.include_dir()}", f"-I{launch_build.RECIPE_HEADER.parent}",
            "-ldl"]


def build(verbose: bool = False) -> Path:
    """Compile the FFI module into the cache (once); ``RuntimeError`` with the compiler's
    output where that fails."""
    return launch_build.build_library(SOURCE, library_path(), _flags(),
                                      "the XLA FFI calls", verbose)


class _Launch(ctypes.Structure):
    """ffi_calls.cc: TilenormLaunch."""

    _fields_ = [("kernel", ctypes.c_uint64), ("grid", ctypes.c_uint32 * 3),
                ("dependent", ctypes.c_int32),
                ("params", ctypes.c_void_p), ("params_size", ctypes.c_uint32),
                ("param_offsets", ctypes.POINTER(ctypes.c_uint32)),
                ("num_params", ctypes.c_uint32),
                ("array_pointers", ctypes.POINTER(ctypes.c_int32)),
                ("array_offsets", ctypes.POINTER(ctypes.c_uint32)),
                ("num_arrays", ctypes.c_uint32),
                ("scalar_values", ctypes.POINTER(ctypes.c_int32)),
                ("scalar_offsets", ctypes.POINTER(ctypes.c_uint32)),
                ("num_scalars", ctypes.c_uint32)]


@functools.cache
def library() -> ctypes.CDLL:
    """The built module, loaded (built first where needed); ``RuntimeError`` where it cannot
    be, or ``TILENORM_NATIVE=0``."""
    if os.environ.get("TILENORM_NATIVE", "1") == "0":
        raise RuntimeError("TILENORM_NATIVE=0")
    lib = ctypes.CDLL(str(build(verbose=True)))
    lib.tilenorm_register_call.restype = ctypes.c_int64
    lib.tilenorm_register_call.argtypes = [
        ctypes.POINTER(_Launch), ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32, ctypes.POINTER(ctypes.c_float),
        ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    lib.tilenorm_registered_calls.restype = ctypes.c_int64
    lib.tilenorm_registered_calls.argtypes = []
    return lib


@functools.cache
def register_targets() -> None:
    """Register the custom-call targets with XLA for CUDA (once a process)."""
    lib = library()
    for target in (FORWARD_TARGET, BACKWARD_TARGET):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                    platform=FFI_PLATFORM)


@dataclass(frozen=True)
class Pointer:
    """Where a kernel's data pointer points: ``offset`` bytes into buffer ``buffer`` of the
    custom call (its operands, then its results, in order)."""

    buffer: int
    offset: int = 0


def _array(ctype, values: Sequence):
    return (ctype * max(len(values), 1))(*values)


def register_call(launches: Sequence[tuple[LaunchRecipe, dict[str, int]]],
                  pointers: Sequence[Pointer], values: Sequence[float], operands: int,
                  results: int) -> int:
    """Register a prepared call: ``launches`` in order, each a recipe with the index into
    ``pointers`` of each of its runtime arrays by name; its fp32 scalars by name from
    ``values`` (index 0: eps, 1: offset). Returns the id for the custom call's ``call``
    attribute. Registered calls live as long as the process (compiled programs name them)."""
    keep = []  # what the C structures point into, alive until the call returns
    structs = (_Launch * len(launches))()
    for struct, (recipe, slots) in zip(structs, launches, strict=True):
        scalars = [_SCALAR_VALUES[name] for name, _ in recipe.scalars]
        arrays = [
            _array(ctypes.c_uint32, recipe.param_offsets),
            _array(ctypes.c_int32, [slots[name] for name, _ in recipe.arrays]),
            _array(ctypes.c_uint32, [offset for _, offset in recipe.arrays]),
            _array(ctypes.c_int32, scalars),
            _array(ctypes.c_uint32, [offset for _, offset in recipe.scalars])]
        params = ctypes.create_string_buffer(recipe.params, len(recipe.params))
        keep += [params, *arrays]
        struct.kernel = recipe.kernel
        struct.grid[:] = recipe.grid
        struct.dependent = int(recipe.dependent_launch)
        struct.params, struct.params_size = ctypes.addressof(params), len(recipe.params)
        struct.param_offsets, struct.num_params = arrays[0], len(recipe.param_offsets)
        struct.array_pointers, struct.array_offsets = arrays[1], arrays[2]
        struct.num_arrays = len(recipe.arrays)
        struct.scalar_values, struct.scalar_offsets = arrays[3], arrays[4]
        struct.num_scalars = len(recipe.scalars)
    call = library().tilenorm_register_call(
        structs, len(launches), _array(ctypes.c_int32, [p.buffer for p in pointers]),
        _array(ctypes.c_uint64, [p.offset for p in pointers]), len(pointers),
        _array(ctypes.c_float, values), len(values), operands, results)
    if call < 0:
        raise ValueError("tilenorm: the FFI module rejected a prepared call (an index out of "
                         "range, or more kernel parameters than it takes)")
    return call


#: The runtime fp32 scalars the kernels take, by name: their index in a call's values.
_SCALAR_VALUES = {"eps": 0, "offset": 1}


def registered_calls() -> int:
    """How many prepared calls this process has registered."""
    return library().tilenorm_registered_calls()
