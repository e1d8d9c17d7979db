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
import functools
import importlib.machinery
import importlib.util
import os
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import torch

from tilenorm.launch import build as launch_build
from tilenorm.launch.build import cache_root

__all__ = ["available", "build", "cache_root", "disabled", "library_path", "module"]

SOURCE = Path(__file__).with_name("native_calls.cpp")
MODULE = "tilenorm_native_calls"
_compiler = launch_build.compiler


def _flags() -> list[str]:
    """Compile and link flags for an extension of this torch (its headers, ABI and libs)."""
    from torch.utils import cpp_extension

    flags = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
             f"-DTORCH_EXTENSION_NAME={MODULE}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{launch_build.RECIPE_HEADER.parent}"]
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
    """The sources, torch build, Python and compiler that a built module is valid for."""
    return launch_build.source_key((SOURCE, launch_build.RECIPE_HEADER),
                                   f"{torch.__version__} {torch.version.git_version}")


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
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        raise RuntimeError("Python's headers (Python.h) are not installed")
    return launch_build.build_library(SOURCE, target, _flags(), "the C++ host path", verbose)


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
