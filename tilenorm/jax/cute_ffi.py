"""The CuTe DSL kernels as XLA FFI custom calls (bench/NOTES.md #68): for one compiled
variant (a :class:`tilenorm.launch.cute.ForwardKey`, the row or the cluster forward, or a
:class:`~tilenorm.launch.cute.ClusterBackwardKey`, the cluster backward, on one
architecture), the DSL's export of the compiled kernel (an object whose one entry takes the
TVM-FFI safe-call ABI, the cubin inside, and launches it with the kernel's cluster shape)
linked with ``cute_ffi_calls.cc``, the XLA FFI handler that calls it on XLA's stream, into a
library of its own.

A library is built on first use into :func:`tilenorm.launch.build.cache_root` (beside the
FFI module of :mod:`tilenorm.jax.native`), once per variant, architecture, sources and
toolchain (the DSL, TVM-FFI and jaxlib versions, Python, the compiler); building one
compiles the handler, and the kernel (~4 s) where the torch side has not already put its
object file in the cache (:mod:`tilenorm.launch.cute_cache`). Each is loaded with ctypes and
registered as a custom-call target of its own, :func:`target`. Nothing here needs a GPU: the
CPU tests build and call the libraries (:data:`HOST_HANDLER`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
from dataclasses import astuple
from pathlib import Path
from typing import TypeAlias

from tilenorm.launch import build as launch_build
from tilenorm.launch import cute, cute_cache

SOURCE = Path(__file__).with_name("cute_ffi_calls.cc")
#: Files whose text goes into what a library holds beyond its key: the handler, the kernel
#: and the module that compiles it.
_PACKAGE = Path(__file__).resolve().parent.parent
BUILD_SOURCES = (SOURCE, *(_PACKAGE / "kernels" / name for name in (
    "cute_row_norm_forward.py", "cute_cluster_norm_forward.py",
    "cute_cluster_norm_backward.py", "cute_rows.py", "cute_cluster_rows.py")),
    _PACKAGE / "launch" / "cute.py")
#: The XLA FFI handler of every library (each is loaded on its own, so the names agree).
HANDLER = "tilenorm_cute_call"
#: The same call for XLA's CPU backend: the CPU tests' way into the exported entry's argument
#: checks (see ``cute_ffi_calls.cc``); never registered for CUDA.
HOST_HANDLER = "tilenorm_cute_call_without_gpu"
#: The library's count of calls that reached the kernel.
CALLS = "tilenorm_cute_calls"
#: A compiled variant a library holds.
Key: TypeAlias = cute.ForwardKey | cute.ClusterBackwardKey
#: The custom-call targets, one per library: the kernel's prefix and the build key.
TARGET_PREFIX = "tilenorm_cute_forward_"
BACKWARD_TARGET_PREFIX = "tilenorm_cute_cluster_backward_"
#: The distributions whose versions a built library depends on.
_VERSIONED = (*cute_cache.VERSIONED, "jaxlib")


def build_key(key: Key, arch: str) -> str:
    """A short hash of the variant, the architecture, the sources and the toolchain."""
    versions = " ".join(f"{d} {cute_cache.version(d)}" for d in _VERSIONED)
    return launch_build.source_key(
        BUILD_SOURCES, f"{type(key).__name__} {astuple(key)} {arch} {versions}")


def _is_forward(key: Key) -> bool:
    return isinstance(key, cute.ForwardKey)


def target_name(key: Key, arch: str) -> str:
    """The custom-call target of the variant's library."""
    return (TARGET_PREFIX if _is_forward(key) else BACKWARD_TARGET_PREFIX) + build_key(key, arch)


def library_path(key: Key, arch: str) -> Path:
    return (launch_build.cache_root() / f"jax-cute-{build_key(key, arch)}"
            / "tilenorm_cute_call.so")


# --- the toolchain ---------------------------------------------------------------------------


@functools.cache
def _link_inputs() -> tuple[str, ...]:
    """The include flags of XLA's FFI and TVM-FFI, and the DSL runtime and TVM-FFI to link
    (:func:`tilenorm.launch.cute_cache.link_inputs`)."""
    import jax
    from tvm_ffi import libinfo

    includes = dict.fromkeys([jax.ffi.include_dir(), libinfo.find_include_path(),
                              libinfo.find_dlpack_include_path()])
    return (*(f"-isystem{path}" for path in includes), *cute_cache.link_inputs())


@functools.cache
def unavailable() -> str | None:
    """Why no library can be built in this process (None: one can): those of
    :func:`tilenorm.launch.cute_cache.unavailable` (``TILENORM_NATIVE=0`` among them), and
    XLA's FFI headers."""
    reason = cute_cache.unavailable()
    if reason is not None:
        return reason
    try:
        _link_inputs()
    except (RuntimeError, OSError, ImportError) as error:
        return str(error)
    return None


# --- building --------------------------------------------------------------------------------


#: How the handler fills one of the entry's array arguments (``TILENORM_CUTE_ARRAYS``).
_ABSENT, _OPERAND, _RESULT = 0, 1, 2


def entry_arrays(key: Key) -> tuple[int, ...]:
    """The entry's array arguments as the handler fills them: absent (None), the call's next
    operand or its next result. The forward's: x, residual, weight, bias, y, h, mean, rstd;
    the cluster backward's: h, dy, weight, mean, rstd, dres_in, dx, partial (dweight's
    and/or dbias's groups, ``ClusterBackwardKey.groups``)."""
    has_weight = key.weight_dtype is not None

    def given(present: bool, kind: int) -> int:
        return kind if present else _ABSENT

    if _is_forward(key):
        return (_OPERAND, given(key.has_residual, _OPERAND), given(has_weight, _OPERAND),
                given(key.has_bias, _OPERAND), _RESULT, given(key.has_residual, _RESULT),
                given(key.layer_norm, _RESULT), _RESULT)
    return (_OPERAND, _OPERAND, given(has_weight, _OPERAND), given(key.layer_norm, _OPERAND),
            _OPERAND, given(key.has_dres_in, _OPERAND), _RESULT, given(key.groups > 0, _RESULT))


def _defines(key: Key, entry: str) -> list[str]:
    kernel = "forward" if _is_forward(key) else "cluster backward"
    return [f"-DTILENORM_CUTE_ENTRY={entry}", f"-DTILENORM_CUTE_KERNEL=\"{kernel}\"",
            f"-DTILENORM_CUTE_ARRAYS={','.join(map(str, entry_arrays(key)))}",
            f"-DTILENORM_CUTE_TAKES_EPS={int(_is_forward(key))}"]


#: The library's exported symbols (a linker version script): its handlers and the call
#: counter; the exported object's own symbols stay inside it.
_EXPORTS = "{ global: " + HANDLER + "; " + HOST_HANDLER + "; " + CALLS + "; local: *; };\n"


def build(key: Key, arch: str, verbose: bool = False) -> Path:
    """Build the variant's library into the cache (once): the kernel's object file (the one
    the torch side loads, :func:`tilenorm.launch.cute_cache.build_object`), then compile the
    handler and link the two. ``RuntimeError`` where a step fails (the DSL's own errors are
    wrapped)."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    target = library_path(key, arch)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    obj = cute_cache.build_object(
        key, arch, cute.compile_forward if _is_forward(key) else cute.compile_cluster_backward)
    name = cute_cache.entry_name(key, arch)
    exports = target.with_name("exports.map")
    if not exports.exists():
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False) as f:
            f.write(_EXPORTS)
        os.replace(f.name, exports)
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
             *_defines(key, f"__tvm_ffi_{name}"), str(obj), *_link_inputs(),
             f"-Wl,--version-script={exports}"]
    return launch_build.build_library(SOURCE, target, flags, f"the CuTe DSL kernel {key}",
                                      verbose)


@functools.cache
def library(key: Key, arch: str) -> ctypes.CDLL:
    """The variant's library, loaded (built first where needed)."""
    lib = ctypes.CDLL(str(build(key, arch, verbose=True)))
    calls = getattr(lib, CALLS)
    calls.restype = ctypes.c_int64
    calls.argtypes = []
    return lib


@functools.cache
def target(key: Key, arch: str) -> str:
    """The variant's custom-call target, registered with XLA for CUDA (built and loaded
    first, once a process); ``RuntimeError`` or ``OSError`` where that fails."""
    import jax

    from tilenorm.jax import native

    name = target_name(key, arch)
    lib = library(key, arch)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, HANDLER)),
                                platform=native.FFI_PLATFORM)
    _registered[name] = lib
    return name


#: The libraries of the registered targets, by target name.
_registered: dict[str, ctypes.CDLL] = {}


def calls_run(name: str) -> int:
    """How many calls of a registered target reached its kernel in this process (0 for a
    target not registered here)."""
    lib = _registered.get(name)
    return 0 if lib is None else getattr(lib, CALLS)()
