"""The disk cache of compiled CuTe DSL kernels (tilenorm/launch/cute_cache.py): built and
loaded without a GPU here; the GPU tests run every CuTe kernel through it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from tests.kernel_harness import OUT_TOL, fresh_generator, poisoned, rel
from tilenorm.launch import cute, cute_cache
from tilenorm.planner import plan_cute_forward
from tilenorm.testing import float64_norm

needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
gpu = pytest.mark.gpu
ARCH = (9, 0)


def _key() -> cute.ForwardKey:
    """The smallest forward the tables route: bf16 RMSNorm without a weight."""
    return min((k for k in cute.aot_forward_keys()
                if k.cluster == 1 and k.weight_dtype is None and not k.layer_norm
                and not k.has_residual), key=lambda k: k.cols)


class Compiles:
    """``compile_forward`` counting its calls (the JIT and the exported compile alike)."""

    def __init__(self):
        self.calls = []

    def __call__(self, key, arch=None):
        self.calls.append(arch)
        return cute.compile_forward(key, arch)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILENORM_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_key_names_the_variant_and_architecture_not_the_host(monkeypatch):
    """A variant's files are shared by processes and hosts of the same DSL and TVM-FFI: its
    key changes with the variant and the architecture, not with Python or the compiler."""
    import dataclasses

    key = _key()
    k = cute_cache.build_key(key, "sm_90a")
    assert k == cute_cache.build_key(dataclasses.replace(key), "sm_90a")
    assert k != cute_cache.build_key(key, "sm_100a")
    assert k != cute_cache.build_key(dataclasses.replace(key, cols=key.cols * 2), "sm_90a")
    monkeypatch.setattr(sys, "version", "0.0 (another Python)")
    monkeypatch.setenv("CXX", "/another/c++")
    assert cute_cache.build_key(key, "sm_90a") == k
    assert cute_cache.entry_name(key, "sm_90a") == f"tilenorm_cute_{k}"
    assert {p.name for p in cute_cache.SOURCES} >= {
        "cute_row_norm_forward.py", "cute_cluster_norm_backward.py", "cute_row_norm_fp8.py",
        "cute.py"}


@needs_cute
def test_a_variant_compiles_once_into_the_cache_and_loads_from_it(cache):
    """The first load compiles (for the named architecture), exports and links; a later
    process finds the library and compiles nothing. What loads is the kernel's TVM-FFI entry:
    it checks its arguments as the JIT-compiled function does."""
    key, compiles = _key(), Compiles()
    fn = cute_cache.load(key, ARCH, compiles)
    assert compiles.calls == ["sm_90a"]
    folder = cute_cache.variant_dir(key, "sm_90a")
    assert folder.parent == cache
    assert {cute_cache.OBJECT, cute_cache.library_name()} <= {p.name for p in folder.iterdir()}
    with pytest.raises(TypeError, match="Expects 11 parameters"):
        fn()
    again = Compiles()
    assert callable(cute_cache.load(key, ARCH, again)) and again.calls == []


@needs_cute
def test_objects_built_without_a_gpu_are_linked_where_they_load(cache):
    """An object file built elsewhere (the ahead-of-time build, another host) is linked, not
    compiled again."""
    key = _key()
    cute_cache.build_object(key, "sm_90a", cute.compile_forward)
    assert not (cute_cache.variant_dir(key, "sm_90a") / cute_cache.library_name()).exists()

    def refuse(*args):
        raise AssertionError("compiled again")

    assert callable(cute_cache.load(key, ARCH, refuse))
    assert (cute_cache.variant_dir(key, "sm_90a") / cute_cache.library_name()).exists()


def test_without_a_library_the_kernel_is_compiled_in_the_process(cache, monkeypatch):
    """``TILENORM_NATIVE=0`` (or no compiler): the JIT compile for the current GPU, no
    files."""
    monkeypatch.setenv("TILENORM_NATIVE", "0")
    assert cute_cache.unavailable() == "TILENORM_NATIVE=0"
    calls = []
    assert cute_cache.load(_key(), ARCH, lambda *a: calls.append(a) or "jit") == "jit"
    assert calls == [(_key(),)] and not list(cache.iterdir())
    monkeypatch.delenv("TILENORM_NATIVE")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert "no C++ compiler" in cute_cache.unavailable()


@needs_cute
def test_a_failed_build_warns_and_compiles_in_the_process(cache, monkeypatch):
    def fail(*args):
        raise RuntimeError("the linker is broken")

    monkeypatch.setattr(cute_cache, "build", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cute_cache.load(_key(), ARCH, lambda key, arch=None: ("jit", arch)) == (
            "jit", None)
    assert any("the linker is broken" in str(w.message) for w in caught)


@needs_cute
def test_processes_starting_together_build_once_and_both_load(cache):
    """Two processes loading one absent variant at once (xdist workers, ranks of a job): both
    load it; the library is linked once (the build lock) and whole."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from tests.test_cute_cache import _key, ARCH
        from tilenorm.launch import cute, cute_cache
        fn = cute_cache.load(_key(), ARCH, cute.compile_forward)
        print(type(fn).__name__)
    """)
    env = dict(os.environ, TILENORM_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "Function" and "kernel cache failed" not in err
    folder = cute_cache.variant_dir(_key(), "sm_90a")
    built = [p.name for p in folder.iterdir() if p.suffix in (".o", ".so")]
    assert sorted(built) == sorted([cute_cache.OBJECT, cute_cache.library_name()])


@needs_cute
def test_a_library_that_does_not_load_warns_and_compiles_in_the_process(cache):
    key = _key()
    folder = cute_cache.variant_dir(key, "sm_90a")
    folder.mkdir(parents=True)
    (folder / cute_cache.library_name()).write_bytes(b"not a shared library")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cute_cache.load(key, ARCH, lambda key, arch=None: ("jit", arch)) == ("jit", None)
    assert any("kernel cache failed" in str(w.message) for w in caught)


@needs_cute
def test_an_environment_elsewhere_links_its_own_library(monkeypatch):
    """The library is named by the files it links: a moved or another environment does not
    load one whose run paths name files it lacks."""
    name = cute_cache.library_name()
    monkeypatch.setattr(cute_cache, "link_inputs", lambda: ("/elsewhere/libtvm_ffi.so",))
    assert cute_cache.library_name() != name


@gpu
@needs_cute
def test_the_loaded_kernel_gives_the_jit_compiled_ones_bits(cache):
    """The library the cache loads and the DSL's JIT compile of the same variant, on the same
    inputs and poisoned outputs: the same bits, within float64's tolerance (RMSNorm with a
    weight and a residual at 4096 columns)."""
    import tvm_ffi

    g, seed = fresh_generator("cuda")
    m, n, dtype = 1031, 4096, torch.bfloat16
    x, r = (torch.randn(m, n, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    arch = torch.cuda.get_device_capability()
    plan = plan_cute_forward(m, n, itemsize=2, arch=arch, op="rms_norm").with_residual()
    key = cute.ForwardKey.of(plan, "bfloat16", "bfloat16", False, False, False, True)
    loaded = cute_cache.load(key, arch, cute.compile_forward)
    assert isinstance(loaded, tvm_ffi.Function), type(loaded)
    outputs = []
    for fn in (loaded, cute.compile_forward(key)):
        y, h, rstd = poisoned((m, n), dtype), poisoned((m, n), dtype), poisoned((m,),
                                                                                torch.float32)
        fn(x, r, w, None, y, h, None, rstd, 1e-6, 0.0, plan.grid)
        torch.cuda.synchronize()
        outputs.append((y, h, rstd))
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b), seed
    ref = float64_norm(x, w, None, 1e-6, residual=r)
    assert rel(outputs[0][0], ref.y) <= OUT_TOL[dtype], seed


@needs_cute
def test_a_dsl_warning_in_an_xdist_worker_reaches_the_controller(tmp_path):
    """xdist's controller re-raises a worker's warning by importing its category's module:
    the DSL's own classes (``cutlass.base_dsl``) import there only once this suite's
    conftest has put the DSL's folder on ``sys.path`` (without it the run crashes with
    ModuleNotFoundError: the whole CI run, not one test)."""
    pytest.importorskip("xdist")
    suite = tmp_path / "tests"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        (Path(__file__).parent / "conftest.py").read_text())
    (suite / "test_probe.py").write_text(textwrap.dedent("""
        import warnings

        from tilenorm.launch import cute


        def test_warns_with_a_dsl_category():
            assert cute.available()
            from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning

            warnings.simplefilter("always")
            warnings.warn("probe", DSLOptimizationWarning)
        """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider",
                          "-q", str(suite)], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed, 1 warning" in run.stdout
