"""The C++ host path: ``native_calls.cpp`` built against the installed torch on first use.

A Python ``torch.autograd.Function`` that only allocates its outputs costs about what
torch's whole RMSNorm forward + backward does (bench/NOTES.md #39), so the eager autograd
path runs in C++ (#40, #42): the prepared call's parameter blocks
(:class:`tilenorm.launch.driver.LaunchRecipe`) launched by ``cuLaunchKernelEx`` from a C++
autograd node; it also registers the custom ops' kernels for CUDA tensors, which compiled
graphs call (#43). The extension is compiled once per torch build and source into
``$TILENORM_CACHE_DIR`` (default ``~/.cache/tilenorm``) with the C++ compiler torch's
extensions use (``$CXX``, default ``c++``); it needs torch's and Python's headers, no CUDA
headers. Without a compiler, or with ``TILENORM_NATIVE=0``, the ops take the Python path:
same kernels and results, more host time a call. ``python -m tilenorm`` builds it ahead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("native_calls.cpp")
MODULE = "tilenorm_native_calls"


def cache_root() -> Path:
    """Where built host code lives: ``$TILENORM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tilenorm`` (``~/.cache/tilenorm``)."""
    root = os.environ.get("TILENORM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tilenorm"


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _flags() -> list[str]:
    """Compile and link flags for an extension of this torch (its headers, ABI and libs)."""
    from torch.utils import cpp_extension

    flags = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
             f"-DTORCH_EXTENSION_NAME={MODULE}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    with warnings.catch_warnings():  # torch >= 2.10 calls these flags pybind11's business
        warnings.simplefilter("ignore")
        abi = getattr(cpp_extension, "_get_pybind11_abi_build_flags", list)()
    flags += abi
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    lib = cpp_extension.library_paths()[0]
    flags += [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch", "-ltorch_cpu",
              "-ltorch_python", "-ldl"]
    return flags


def build_key() -> str:
    """The source, torch build, Python and compiler that a built module is valid for."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{torch.__version__} {torch.version.git_version} {sys.version} "
             f"{_compiler()}".encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_root() / f"native-{build_key()}" / f"{MODULE}{suffix}"


def build(verbose: bool = False) -> Path:
    """Compile the extension into the cache (once: a lock serializes processes that start
    together; the module is moved into place complete). Raises ``RuntimeError`` with the
    compiler's output when the build fails."""
    target = library_path()
    if target.exists():
        return target
    if shutil.which(_compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({_compiler()!r} not found; set CXX)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        raise RuntimeError("Python's headers (Python.h) are not installed")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        if verbose:
            print(f"tilenorm: building the C++ host path into {target.parent} (once)",
                  file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([_compiler(), str(SOURCE), "-o", str(out), *_flags()],
                                  capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
            os.replace(out, target)
    return target


@functools.cache
def module() -> ModuleType | None:
    """The built extension, or None (``TILENORM_NATIVE=0``, or it could not be built: a
    warning says why, once)."""
    if os.environ.get("TILENORM_NATIVE", "1") == "0":
        return None
    try:
        path = build(verbose=True)
        spec = importlib.util.spec_from_file_location(MODULE, path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    except (RuntimeError, OSError, ImportError) as error:
        warnings.warn(f"tilenorm: the C++ host path is unavailable ({error}); the ops take the "
                      f"Python path (same results, more host time a call)", stacklevel=3)
        return None
    from tilenorm.pytorch import calls, custom_ops

    loaded.set_op_fallbacks(custom_ops.run_forward, custom_ops.run_backward)
    calls.layouts = loaded.layout_key
    calls.cached_call, calls.remember_call = loaded.cached_call, loaded.remember_call
    calls.forget_cached_calls = loaded.forget_calls
    return loaded


def available() -> bool:
    return module() is not None


@contextlib.contextmanager
def disabled():
    """The Python host path for the block: calls prepared inside it have no C++ call, and
    the prepared calls are dropped on entry and exit (tests compare the two paths)."""
    from tilenorm.pytorch import calls

    saved = os.environ.get("TILENORM_NATIVE")
    os.environ["TILENORM_NATIVE"] = "0"
    calls.clear()
    module.cache_clear()
    _python_path(calls)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TILENORM_NATIVE"]
        else:
            os.environ["TILENORM_NATIVE"] = saved
        calls.clear()
        module.cache_clear()
        _python_path(calls)


def _python_path(calls) -> None:
    calls.layouts = calls.python_layouts
    calls.cached_call = calls.remember_call = calls.forget_cached_calls = calls._nothing
