"""Compiled CuTe DSL kernels kept on disk: a process loads a variant that it or another
process compiled before (milliseconds) where it would compile it again (0.4-2.5 s a variant,
each process, bench/NOTES.md #114). A variant is the DSL's export of the compiled kernel (an
object file whose one entry takes TVM-FFI's safe-call ABI, the cubin inside), linked into a
shared library of its own and loaded through TVM-FFI, which calls that entry exactly as it
calls the JIT-compiled function: the same arguments, the caller's current stream.

A variant's files live in ``cute-<key>/`` under :func:`tilenorm.launch.build.cache_root`,
keyed by the variant, the architecture, the kernels' sources and the DSL's and TVM-FFI's
versions. The object file depends on nothing else of the host, so objects built on a machine
without a GPU serve any host with those versions; the library is linked from it where it
loads, named by the files it links (an environment moved or installed elsewhere links its
own). Framework-neutral; nothing here needs a GPU. Where no library can be built
(:func:`unavailable`: ``TILENORM_NATIVE=0``, no C++ compiler) the JIT-compiled function runs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

from tilenorm.launch import build as launch_build

_PACKAGE = Path(__file__).resolve().parent.parent
#: What a compiled variant depends on beyond its key: the CuTe DSL kernel files and the module
#: that compiles them (operand layouts, alignment, compile options).
SOURCES = (*sorted((_PACKAGE / "kernels").glob("cute_*.py")),
           Path(__file__).with_name("cute.py"))
#: The distributions whose versions a compiled variant depends on.
VERSIONED = ("nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi")
OBJECT = "kernel.o"


def arch_name(arch: tuple[int, int]) -> str:
    """The DSL's ``--gpu-arch`` for a compute capability: the architecture-specific target
    (``sm_90a``) from Hopper on, as the ahead-of-time builds use (``cute.AOT_ARCHS``)."""
    major, minor = arch
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def version(distribution: str) -> str:
    """An installed distribution's version ("none" where it is not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _sources_and_toolchain() -> bytes:
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    h.update(" ".join(f"{d} {version(d)}" for d in VERSIONED).encode())
    return h.digest()


def build_key(key: Any, arch: str) -> str:
    """A short hash of the variant (a key of :mod:`tilenorm.launch.cute`), the architecture
    (``sm_90a``), the kernels' sources and the DSL's and TVM-FFI's versions."""
    h = hashlib.sha256(_sources_and_toolchain())
    h.update(f"{type(key).__name__} {astuple(key)} {arch}".encode())
    return h.hexdigest()[:16]


def variant_dir(key: Any, arch: str) -> Path:
    return launch_build.cache_root() / f"cute-{build_key(key, arch)}"


def entry_name(key: Any, arch: str) -> str:
    """The exported entry's name, unique to the build, so that a symbol of one library never
    stands in for another's, whatever the loader does."""
    return f"tilenorm_cute_{build_key(key, arch)}"


# --- the toolchain ---------------------------------------------------------------------------


def runtime_library() -> Path:
    """The DSL's runtime (``libcute_dsl_runtime.so``), the one its own JIT loads."""
    from cutlass.base_dsl.env_manager import get_prefix_dsl_libs

    for path in (get_prefix_dsl_libs("CUTE_DSL") or "").split(os.pathsep):
        if Path(path).name == "libcute_dsl_runtime.so" and Path(path).is_file():
            return Path(path)
    raise RuntimeError("the CuTe DSL's runtime library (libcute_dsl_runtime.so) was not found")


@functools.cache
def link_inputs() -> tuple[str, ...]:
    """The DSL runtime and TVM-FFI, and where to find them at load time. A library is linked
    against the very files the DSL and ``tvm_ffi`` load, so that the process holds one copy
    of each: TVM-FFI's stream (``TVMFFIEnvSetStream``) is per copy."""
    from tvm_ffi import libinfo

    tvm_lib = Path(libinfo.find_libtvm_ffi())
    runtime = runtime_library()
    return (str(runtime), str(tvm_lib), f"-Wl,-rpath,{runtime.parent}",
            f"-Wl,-rpath,{tvm_lib.parent}")


def library_name() -> str:
    """A variant's library in this environment: named by the files it links and finds at
    load time (:func:`link_inputs`)."""
    return f"kernel-{hashlib.sha256(' '.join(link_inputs()).encode()).hexdigest()[:12]}.so"


def unavailable() -> str | None:
    """Why no library can be built in this process (None: one can): the DSL and TVM-FFI, the
    DSL's runtime library, a C++ compiler. ``TILENORM_NATIVE=0`` turns it off, as it does the
    other C++ builds. Asked once a variant a process (its callers cache what they load)."""
    from tilenorm.launch import cute

    if os.environ.get("TILENORM_NATIVE", "1") == "0":
        return "TILENORM_NATIVE=0"
    if not cute.available():
        return "the CuTe DSL (nvidia-cutlass-dsl-libs-cu13, apache-tvm-ffi) is not installed"
    if shutil.which(launch_build.compiler()) is None:
        return f"no C++ compiler ({launch_build.compiler()!r} not found; set CXX)"
    try:
        link_inputs()
    except (RuntimeError, OSError, ImportError) as error:
        return str(error)
    return None


# --- building and loading --------------------------------------------------------------------


def export_object(compiled: Any, path: Path, name: str) -> None:
    """Export a compiled kernel to the object ``path``, its entry ``__tvm_ffi_<name>``; written
    beside and moved into place complete (processes that export it together each write whole
    files)."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        compiled.export_to_c(str(out), function_name=name)
        os.replace(out, path)


def build_object(key: Any, arch: str, compile_kernel: Callable) -> Path:
    """The variant's object file in the cache: ``compile_kernel(key, arch)`` exported, once.
    ``RuntimeError`` where the compile fails (the DSL's own errors are wrapped)."""
    folder = variant_dir(key, arch)
    obj = folder / OBJECT
    if not obj.exists():
        folder.mkdir(parents=True, exist_ok=True)
        try:
            export_object(compile_kernel(key, arch), obj, entry_name(key, arch))
        except Exception as error:  # the DSL's compile errors are its own classes
            raise RuntimeError(f"compiling the CuTe DSL kernel {key} for {arch} failed: "
                               f"{type(error).__name__}: {error}") from error
    return obj


def build(key: Any, arch: str, compile_kernel: Callable) -> Path:
    """The variant's library in the cache, linked from its object file (compiled first where
    absent). ``RuntimeError`` where a step fails or no library can be built here."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    target = variant_dir(key, arch) / library_name()
    if target.exists():
        return target
    obj = build_object(key, arch, compile_kernel)
    return launch_build.build_library(obj, target, ["-shared", *link_inputs()],
                                      f"the CuTe DSL kernel {key}")


def load(key: Any, arch: tuple[int, int], compile_kernel: Callable) -> Callable:
    """``key``'s kernel for ``arch`` (a compute capability) from the cache, built there first
    where absent (``compile_kernel(key, arch_name)``, the DSL's compile of it); where no
    library can be built, or building or loading one fails (with a warning), the
    JIT-compiled ``compile_kernel(key)`` for the current GPU."""
    if unavailable() is None:
        name = arch_name(arch)
        try:
            import tvm_ffi

            # load_module keeps the library loaded for the process's life.
            module = tvm_ffi.load_module(str(build(key, name, compile_kernel)))
            return getattr(module, entry_name(key, name))
        except Exception as error:  # a build's RuntimeError, or whatever loading raises
            warnings.warn(f"tilenorm: the CuTe DSL kernel cache failed ({type(error).__name__}:"
                          f" {error}); compiling in this process instead", RuntimeWarning,
                          stacklevel=2)
    return compile_kernel(key)
