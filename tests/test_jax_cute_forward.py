"""The CuTe DSL kernels of tilenorm.jax's kernel path (issue 18, bench/NOTES.md #68): the row and
cluster forwards and the cluster backward (RMSNorm and LayerNorm), on the CPU: each compiled
variant exported for sm_90a and linked with its XLA FFI handler (:mod:`tilenorm.jax.cute_ffi`),
the cluster launch in the exported host code, the routing that picks them on a made-up H100,
the gate of their kernel family (``cute/jax``), and the calls themselves up to the kernel's
load: through XLA's CPU backend the handler hands the exported entry the DLTensors of the
kernel path's operands and results, and the entry's own checks of every array (dtype, shape,
strides, device, alignment) pass before it stops where a GPU is needed. The GPU tests are in
tests/test_jax_kernel_path.py (``test_cute_forward_*``, ``test_cute_cluster_*``).
"""

from __future__ import annotations

import ctypes
import functools
import re
import warnings

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import tilenorm  # noqa: E402
import tilenorm.jax as tj  # noqa: E402
from tests.test_jax_gpu import _lowered_for_cuda, _unlaunchable_recipe  # noqa: E402
from tilenorm import dispatch as kernel_dispatch  # noqa: E402
from tilenorm import validation  # noqa: E402
from tilenorm.device import DeviceInfo  # noqa: E402
from tilenorm.jax import checks, cute_ffi, kernels, native  # noqa: E402
from tilenorm.jax import dispatch as jax_dispatch  # noqa: E402
from tilenorm.launch import cute, cute_cache  # noqa: E402
from tilenorm.planner import (  # noqa: E402
    CuteClusterBackwardPlan,
    plan_cute_cluster_backward,
    plan_cute_forward,
)
from tilenorm.settings import SM90  # noqa: E402

needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
#: The host calls pass host memory as CUDA's: where a GPU is, the kernel would launch on it.
no_gpu = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="calls the entry with host memory: only without a GPU")
pytestmark = needs_cute

FAKE_H100 = DeviceInfo(index=0, name="made-up H100", sm_count=132, arch=(9, 0),
                       l2_bytes=50 << 20)
ARCH = "sm_90a"
#: The narrowest width both ops route (RMSNorm's 512 and 1024 are RMSNorm's alone).
WIDTH = min(set(SM90.cute_forward["rms_norm"]) & set(SM90.cute_forward["layer_norm"]))
BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32
#: What the entry's own argument checks say (the DSL's messages): none may reach XLA.
ARGUMENT_ERRORS = ("Mismatched", "Misaligned", "Expects", "Out of bound", "TypeError",
                   "ValueError")


def _key(op="rms_norm", cols=WIDTH, dtype="bfloat16", weight="float32", bias=False,
         offset=False, residual=False, rows=9) -> tuple:
    plan = plan_cute_forward(rows, cols, itemsize=2, arch=(9, 0), op=op,
                             resident_clusters=lambda *shape: RESIDENT_CLUSTERS)
    if residual:  # what a call with a fused residual runs (dispatch.forward_kernel)
        plan = plan.with_residual()
    return plan, cute.ForwardKey.of(plan, dtype, weight, bias, op == "layer_norm", offset,
                                    residual)


#: Clusters the made-up H100 holds at once (``fake_h100``): fewer than most tests' rows.
RESIDENT_CLUSTERS = 15
#: The widths of the cluster backward: RMSNorm's, and LayerNorm's among them.
CLUSTER_BACKWARD_WIDTHS = sorted(SM90.cute_cluster_backward["rms_norm"])
LAYER_NORM_CLUSTER_BACKWARD_WIDTHS = sorted(SM90.cute_cluster_backward["layer_norm"])
#: (op, width) of every cluster backward entry.
CLUSTER_BACKWARD_ENTRIES = [(op, cols) for op, widths in SM90.cute_cluster_backward.items()
                            for cols in sorted(widths)]


def _backward_key(cols=None, weight="bfloat16", offset=False, dres_in=False, rows=37,
                  op="rms_norm", bias=False) -> tuple:
    cols = min(SM90.cute_cluster_backward[op]) if cols is None else cols
    plan = plan_cute_cluster_backward(
        rows, cols, itemsize=2, arch=(9, 0), op=op,
        resident_clusters=lambda cluster, threads, ctas_per_sm: RESIDENT_CLUSTERS)
    return plan, cute.ClusterBackwardKey.of(plan, "bfloat16", weight, offset, dres_in,
                                            op == "layer_norm", bias)


# --- the library -----------------------------------------------------------------------------


def test_arch_names_are_the_architecture_specific_targets():
    assert cute_cache.arch_name((9, 0)) == "sm_90a"
    assert cute_cache.arch_name((10, 0)) == "sm_100a"
    assert cute_cache.arch_name((8, 0)) == "sm_80"


def test_build_key_names_the_variant_and_architecture():
    _, key = _key()
    _, other = _key(residual=True)
    _, backward = _backward_key()
    assert cute_ffi.build_key(key, ARCH) == cute_ffi.build_key(key, ARCH)
    assert len({cute_ffi.build_key(key, ARCH), cute_ffi.build_key(other, ARCH),
                cute_ffi.build_key(key, "sm_100a"), cute_ffi.build_key(backward, ARCH)}) == 4
    assert cute_ffi.target_name(key, ARCH).startswith(cute_ffi.TARGET_PREFIX)
    assert cute_ffi.target_name(backward, ARCH).startswith(cute_ffi.BACKWARD_TARGET_PREFIX)


def test_entry_arrays_follow_the_compiled_signatures():
    """The handler fills the entry's arrays in its order: the forward's (x, residual, weight,
    bias, y, h, mean, rstd), the cluster backward's (h, dy, weight, mean, rstd, dres_in, dx,
    partial), the signature of ClusterRowNormBackward.__call__; 1 an operand, 2 a result,
    0 None. The backward's partial buffer is a result with a weight or a bias (LayerNorm's
    dbias group), its mean an operand for LayerNorm only."""
    assert cute_ffi.entry_arrays(_key("layer_norm", bias=True, residual=True)[1]) == (
        1, 1, 1, 1, 2, 2, 2, 2)
    assert cute_ffi.entry_arrays(_key(weight=None)[1]) == (1, 0, 0, 0, 2, 0, 0, 2)
    assert cute_ffi.entry_arrays(_backward_key()[1]) == (1, 1, 1, 0, 1, 0, 2, 2)
    assert cute_ffi.entry_arrays(_backward_key(weight=None, dres_in=True)[1]) == (
        1, 1, 0, 0, 1, 1, 2, 0)
    assert cute_ffi.entry_arrays(_backward_key(op="layer_norm", bias=True)[1]) == (
        1, 1, 1, 1, 1, 0, 2, 2)
    assert cute_ffi.entry_arrays(_backward_key(weight=None, op="layer_norm", bias=True,
                                               dres_in=True)[1]) == (1, 1, 0, 1, 1, 1, 2, 2)
    assert cute_ffi.entry_arrays(_backward_key(weight=None, op="layer_norm")[1]) == (
        1, 1, 0, 1, 1, 0, 2, 0)


def test_entry_arrays_match_the_cluster_backward_signature():
    """The backward's slots are the kernel's own array parameters, in order (what
    compile_cluster_backward compiles it with)."""
    import inspect

    from tilenorm.kernels.cute_cluster_norm_backward import ClusterRowNormBackward

    params = list(inspect.signature(ClusterRowNormBackward.__call__).parameters)
    arrays = params[1:params.index("offset")]
    assert arrays == ["mX", "mdY", "mW", "mMean", "mRstd", "mdResIn", "mdX", "mPartial"]
    assert len(cute_ffi.entry_arrays(_backward_key()[1])) == len(arrays)


def test_library_builds_once_without_a_gpu_and_exports_only_its_handlers(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("TILENORM_CACHE_DIR", str(tmp_path))
    assert cute_ffi.unavailable() is None
    _, key = _key(op="layer_norm", dtype="float16", weight="float16", bias=True)
    path = cute_ffi.build(key, ARCH)
    assert path.is_relative_to(tmp_path) and path.is_file()
    built = path.stat().st_mtime_ns
    assert cute_ffi.build(key, ARCH) == path and path.stat().st_mtime_ns == built
    lib = ctypes.CDLL(str(path))
    for name in (cute_ffi.HANDLER, cute_ffi.HOST_HANDLER, cute_ffi.CALLS):
        assert getattr(lib, name)
    # The exported object's entry and its internals stay inside the library.
    entry = f"__tvm_ffi_tilenorm_cute_{cute_ffi.build_key(key, ARCH)}"
    with pytest.raises(AttributeError):
        getattr(lib, entry)
    calls = getattr(lib, cute_ffi.CALLS)
    calls.restype = ctypes.c_int64
    assert calls() == 0


def _launcher(ir: str) -> str:
    """The exported host function that launches the kernel (its LLVM IR body)."""
    (body,) = [body for body in re.findall(r"^define [^\n]*\{\n(.*?)^\}", ir,
                                           re.MULTILINE | re.DOTALL)
               if "@_cudaLaunchKernelEx(" in body]
    return body


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_the_export_launches_the_cluster_shape(tmp_path, kind):
    """The exported entry launches the cluster kernels as clusters: its host code (the DSL
    4.8.1's lowering, the module its own JIT loads too) fills cudaLaunchKernelEx's attributes
    with cudaLaunchAttributeClusterDimension (4) and (cluster, 1, 1)."""
    if kind == "forward":
        key = _key(cols=65536, weight="bfloat16", rows=64)[1]
        compiled = cute.compile_forward(key, ARCH)
    else:
        key = _backward_key()[1]
        compiled = cute.compile_cluster_backward(key, ARCH)
    assert key.cluster > 1
    path = tmp_path / "kernel.ll"
    compiled.export_to_c(str(path), function_name="cluster_probe")
    body = _launcher(path.read_text())
    stores = r"store i32 {}, ptr [^\n]+\n\s+"
    pattern = "".join(stores.format(v) for v in (4, key.cluster, 1)) + r"store i32 1, ptr"
    assert re.search(pattern, body), body


def test_unavailable_says_why(monkeypatch):
    cute_ffi.unavailable.cache_clear()
    try:
        monkeypatch.setenv("TILENORM_NATIVE", "0")
        assert cute_ffi.unavailable() == "TILENORM_NATIVE=0"
        cute_ffi.unavailable.cache_clear()
        monkeypatch.delenv("TILENORM_NATIVE")
        monkeypatch.setenv("CXX", "/nonexistent/c++")
        assert "no C++ compiler" in cute_ffi.unavailable()
        with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
            cute_ffi.build(_key()[1], ARCH)
    finally:
        cute_ffi.unavailable.cache_clear()


# --- routing on a made-up H100 ---------------------------------------------------------------


@pytest.fixture
def fake_h100(monkeypatch):
    """Decide as if the shard lived on an H100 (the decision needs only its properties, and
    at the cluster backward's widths how many clusters it holds at once)."""
    monkeypatch.setattr(kernel_dispatch, "device_info", lambda index: FAKE_H100)
    monkeypatch.setattr(kernel_dispatch, "max_active_clusters",
                        lambda device, cluster, threads, ctas_per_sm: RESIDENT_CLUSTERS)
    kernel_dispatch.decide.cache_clear()
    yield
    kernel_dispatch.decide.cache_clear()


def _records(monkeypatch, jax_forward: bool):
    """Every family validated but ``cute/jax`` (validated with ``jax_forward``)."""
    record = {"device": "made-up H100", "date": "2026-01-01", "commit": "abc"}

    def validation_record(family):
        if family is validation.CUTE_JAX and not jax_forward:
            return None
        return record
    monkeypatch.setattr(validation, "validation_record", validation_record)


def _problem(rows, cols=WIDTH, allow=False, op="rms_norm", dtypes=("bfloat16", "float32")):
    return kernel_dispatch.Problem(op, "cuda", 0, dtypes, rows, 1, cols, False,
                                   rows * cols - 1, allow)


#: Rows of bf16 x that hold the smallest x the torch side runs the CuTe DSL forward for.
MIN_ROWS = kernel_dispatch.CUTE_FORWARD_MIN_BYTES // (2 * WIDTH)


def test_covers_keeps_the_cute_forward_only_where_its_family_may_run(fake_h100, monkeypatch):
    _records(monkeypatch, jax_forward=False)
    off = kernels.covers(_problem(MIN_ROWS))
    assert off.uses_kernel and off.cute_forward is None and off.cute_backward is None
    torch_side = kernel_dispatch.decide(_problem(MIN_ROWS, allow=True)).cute_forward
    name = kernel_dispatch.cute_forward_name(torch_side)
    assert f"cute/jax: {name}" in off.reason
    assert "experimental" in off.reason
    on = kernels.covers(_problem(MIN_ROWS, allow=True))
    assert on.cute_forward == torch_side
    assert on.cute_forward is not None and on.cute_backward is None
    assert f"the CuTe DSL's XLA FFI calls run {name} (cute/jax experimental)" in on.reason
    # where the torch side keeps cuTile's forward, so does JAX
    assert kernels.covers(_problem(MIN_ROWS - 1, allow=True)).cute_forward is None
    assert kernels.covers(_problem(MIN_ROWS, cols=WIDTH + 8, allow=True)).cute_forward is None
    _records(monkeypatch, jax_forward=True)
    kernel_dispatch.decide.cache_clear()
    stable = kernels.covers(_problem(MIN_ROWS))
    assert stable.cute_forward is not None and "cute/jax stable" in stable.reason


def test_covers_keeps_cutile_where_no_library_can_be_built(fake_h100, monkeypatch):
    _records(monkeypatch, jax_forward=True)
    monkeypatch.setattr(cute_ffi, "unavailable", lambda: "no C++ compiler")
    decision = kernels.covers(_problem(MIN_ROWS))
    assert decision.cute_forward is None and "no C++ compiler" in decision.reason


#: (op, width) of every cluster forward entry the default class runs: rows held across a
#: cluster of CTAs, by a one-shot grid or a persistent one (LayerNorm's from 32768); not the
#: widths its two-pass forward takes.
CLUSTER_ROUTED = [(op, cols) for op, widths in SM90.cute_forward.items()
                  for cols, entry in widths.items()
                  if len(entry) >= 4 and cols not in SM90.cute_forward_two_pass[op]]


@pytest.mark.parametrize(("op", "cols"), CLUSTER_ROUTED)
def test_covers_takes_the_cluster_kernels_where_torch_does(fake_h100, monkeypatch, op, cols):
    """Where the torch side runs the cluster forward (and the cluster backward, RMSNorm's and
    LayerNorm's, on the device's co-resident clusters), so does JAX once its family may run,
    the persistent one on those clusters too; explain names them."""
    _records(monkeypatch, jax_forward=True)
    rows = -(-kernel_dispatch.CUTE_FORWARD_MIN_BYTES // (2 * cols))  # the torch side's least x
    problem = _problem(rows, cols=cols, allow=True, op=op)
    torch_side = kernel_dispatch.decide(problem)
    decision = kernels.covers(problem)
    assert decision.cute_forward == torch_side.cute_forward and decision.cute_forward.cluster > 1
    plan = decision.cute_forward
    groups = -(-rows // plan.rows_per_cta)
    assert plan.grid == (min(groups, RESIDENT_CLUSTERS) if plan.persistent
                         else groups) * plan.cluster
    assert plan.persistent == (len(SM90.cute_forward[op][cols]) == 5)
    forward_text = f"{kernel_dispatch.CUTE_CLUSTER_FORWARD_NAME}: {plan.describe()}"
    assert kernel_dispatch.CUTE_CLUSTER_FORWARD_NAME in decision.kernels
    if cols in SM90.cute_cluster_backward[op]:
        plan = decision.cute_backward
        assert isinstance(plan, CuteClusterBackwardPlan) and plan == torch_side.cute_backward
        assert plan.clusters == RESIDENT_CLUSTERS and plan.partial_rows == RESIDENT_CLUSTERS
        assert kernel_dispatch.CUTE_CLUSTER_BACKWARD_NAME in decision.kernels
        assert (f"XLA FFI calls run {kernel_dispatch.CUTE_CLUSTER_FORWARD_NAME} and "
                f"{kernel_dispatch.CUTE_CLUSTER_BACKWARD_NAME} (cute/jax stable"
                in decision.reason)
    else:
        assert decision.cute_backward is None
    text = str(decision)
    assert forward_text in text and "cluster forward" in forward_text
    # the family not validated and experimental kernels off: cuTile's kernels, saying why
    _records(monkeypatch, jax_forward=False)
    off = kernels.covers(_problem(rows, cols=cols, op=op))
    assert off.uses_kernel and off.cute_forward is None and off.cute_backward is None
    assert not any("CuTe" in name for name in off.kernels)
    assert "cute/jax: " + kernel_dispatch.CUTE_CLUSTER_FORWARD_NAME in off.reason


#: (op, width) of every fp32 cluster backward entry.
FP32_CLUSTER_BACKWARD_ENTRIES = [(op, cols) for op, widths in
                                 SM90.cute_cluster_backward_fp32.items() for cols in sorted(widths)]


@pytest.mark.parametrize(("op", "cols"), FP32_CLUSTER_BACKWARD_ENTRIES)
def test_covers_takes_the_fp32_tables_kernels_where_torch_does(fake_h100, monkeypatch, op,
                                                               cols):
    """fp32 rows run the CuTe DSL kernels of the fp32 tables (``cute_forward_fp32``,
    ``cute_cluster_backward_fp32``), the plans the torch side makes."""
    _records(monkeypatch, jax_forward=True)
    rows = -(-kernel_dispatch.CUTE_FORWARD_MIN_BYTES // (4 * cols))
    problem = _problem(rows, cols=cols, allow=True, op=op, dtypes=("float32", "float32"))
    torch_side = kernel_dispatch.decide(problem)
    decision = kernels.covers(problem)
    assert decision.uses_kernel
    assert isinstance(decision.cute_backward, CuteClusterBackwardPlan)
    assert decision.cute_backward == torch_side.cute_backward
    assert decision.cute_forward is not None
    assert decision.cute_forward == torch_side.cute_forward


def test_covers_leaves_the_row_backward_to_cutile(fake_h100, monkeypatch):
    """The torch side's CuTe DSL row backward (LayerNorm at 4096) has no JAX call: cuTile's
    backward runs, and the reason says so."""
    _records(monkeypatch, jax_forward=True)
    problem = _problem(4096, cols=4096, allow=True, op="layer_norm")
    assert kernel_dispatch.decide(problem).cute_backward is not None
    decision = kernels.covers(problem)
    assert decision.cute_backward is None
    assert (f"{kernel_dispatch.CUTE_BACKWARD_NAME} has no XLA FFI call, so cuTile's backward "
            f"runs" in decision.reason)


@pytest.mark.parametrize(("op", "cols"), CLUSTER_BACKWARD_ENTRIES)
def test_explain_names_the_cluster_kernels(fake_h100, monkeypatch, cols, op):
    """``tilenorm.jax.explain`` on the installed kernel path: the torch side's names of the
    CuTe DSL forward (the two-pass forward where the two-pass table has the
    width, the cluster forward where its settings entry has a cluster) and the
    cluster backward, among the kernels it runs."""
    _records(monkeypatch, jax_forward=True)
    previous = tj.set_kernel_path(kernels.kernel_path())
    shape = jax.ShapeDtypeStruct((4, 1024, cols), BF16)
    param = jax.ShapeDtypeStruct((cols,), BF16)
    try:
        with tilenorm.experimental():
            d = (tj.explain(shape, param, platform="cuda") if op == "rms_norm" else
                 tj.explain(shape, param, bias=param, layer_norm=True, platform="cuda"))
    finally:
        tj.set_kernel_path(previous)
    assert d.uses_kernel
    text = str(d)
    forward = (kernel_dispatch.CUTE_TWO_PASS_FORWARD_NAME
               if cols in SM90.cute_forward_two_pass[op] else
               kernel_dispatch.CUTE_CLUSTER_FORWARD_NAME if len(SM90.cute_forward[op][cols]) >= 4
               else kernel_dispatch.CUTE_FORWARD_NAME)
    for name in (forward, kernel_dispatch.CUTE_CLUSTER_BACKWARD_NAME):
        assert name in d.kernels.kernels and name in text


@pytest.mark.parametrize("dx_dtype,dh,residual_dtype,offset,expected", [
    (BF16, False, None, 0.0, (True, "bfloat16", False, False)),
    (BF16, True, BF16, 1.0, (True, "bfloat16", True, True)),
    (BF16, False, None, 0.0, None),  # dy in fp32 (y in fp32)
    (BF16, True, FP32, 0.0, None),  # the residual's gradient apart from dx (fp32 residual)
], ids=["plain", "prenorm-gemma", "fp32-dy", "fp32-residual"])
def test_backward_variant_follows_the_call_facts(fake_h100, monkeypatch, dx_dtype, dh,
                                                 residual_dtype, offset, expected):
    """The cluster backward runs for the operands the torch side runs it for
    (:func:`tilenorm.dispatch.backward_kernel`), as the compiled variant of their dtypes."""
    _records(monkeypatch, jax_forward=True)
    cols = CLUSTER_BACKWARD_WIDTHS[0]
    shape = (37, cols)
    dy_dtype = FP32 if expected is None and residual_dtype is None else BF16
    found = []

    def decide(x, r, h, dy, w, dh):
        spec = checks.forward_spec("rms_norm", x, w, None, r, None, offset, False,
                                   r is not None, None, None, None)
        decision = kernels.covers(jax_dispatch._problem(spec, h, None, w, None))
        found.append(kernels.cute_backward_variant(spec, decision, dy, dh, h, w, None))

    h_dtype = BF16 if residual_dtype is None else residual_dtype
    r = None if residual_dtype is None else jax.ShapeDtypeStruct(shape, residual_dtype)
    with tilenorm.experimental():
        jax.eval_shape(decide, jax.ShapeDtypeStruct(shape, dx_dtype), r,
                       jax.ShapeDtypeStruct(shape, h_dtype),
                       jax.ShapeDtypeStruct(shape, dy_dtype),
                       jax.ShapeDtypeStruct((cols,), BF16),
                       jax.ShapeDtypeStruct(shape, h_dtype) if dh else None)
    (variant,) = found
    if expected is None:
        assert variant is None
        return
    plan, key = variant
    assert isinstance(plan, CuteClusterBackwardPlan) and plan.rows == 37
    assert (True, key.dtype, key.has_offset, key.has_dres_in) == expected
    assert key.weight_dtype == "bfloat16" and key.cols == cols
    assert not key.layer_norm and not key.has_bias and key.groups == 1


@pytest.mark.parametrize("weight,bias", [(BF16, BF16), (FP32, FP32), (None, BF16),
                                         (BF16, None)],
                         ids=["bf16-params", "fp32-params", "bias-only", "weight-only"])
def test_layer_norm_backward_variant_takes_mean_and_dbias(fake_h100, monkeypatch, weight,
                                                          bias):
    """JAX's LayerNorm at the cluster widths runs the cluster backward, as the torch side
    does: the variant has LayerNorm's mean and the bias's gradient group (dweight's first)."""
    _records(monkeypatch, jax_forward=True)
    found = []
    for cols in LAYER_NORM_CLUSTER_BACKWARD_WIDTHS:
        shape = (37, cols)

        def decide(x, w, b):
            spec = checks.forward_spec("layer_norm", x, w, b, None, None, 0.0, False, False,
                                       None, None, None)
            decision = kernels.covers(jax_dispatch._problem(spec, x, None, w, b))
            found.append(kernels.cute_backward_variant(spec, decision, x, None, x, w, b))

        def param(dtype, cols=cols):
            return None if dtype is None else jax.ShapeDtypeStruct((cols,), dtype)

        with tilenorm.experimental():
            jax.eval_shape(decide, jax.ShapeDtypeStruct(shape, BF16), param(weight),
                           param(bias))
        plan, key = found.pop()
        assert isinstance(plan, CuteClusterBackwardPlan) and plan.cols == cols
        assert key.layer_norm and key.has_bias == (bias is not None) and not key.has_offset
        assert key.weight_dtype == (None if weight is None else np.dtype(weight).name)
        assert key.groups == (weight is not None) + (bias is not None)


def _spec(x, w, b, r, layer_norm=False, offset=0.0, out_dtype=None, stream=None):
    return checks.forward_spec("layer_norm" if layer_norm else "rms_norm", x, w, b, r, None,
                               offset, False, r is not None, out_dtype, stream, None)


def _sds(shape, dtype):
    return None if dtype is None else jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("x,w,b,r,out,stream,layer_norm,expected", [
    (BF16, FP32, None, None, None, None, False, ("bfloat16", "float32", False, False)),
    (BF16, BF16, None, BF16, None, None, False, ("bfloat16", "bfloat16", False, True)),
    (FP16, None, None, None, None, None, False, ("float16", None, False, False)),
    (BF16, FP32, FP32, BF16, None, None, True, ("bfloat16", "float32", True, True)),
    (BF16, FP16, None, None, None, None, False, None),  # weight in another 2-byte dtype
    (BF16, FP32, None, None, FP32, None, False, None),  # y not in x's dtype
    (BF16, FP32, None, FP32, None, None, False, None),  # residual not in x's dtype
    (BF16, FP32, None, BF16, None, FP32, False, None),  # h not in x's dtype
    (BF16, None, FP32, None, None, None, True, None),  # a bias without a weight
    (BF16, FP32, BF16, None, None, None, True, None),  # bias and weight apart
], ids=["fp32-weight", "prenorm", "no-weight", "ln-bias-prenorm", "fp16-weight",
        "fp32-out", "fp32-residual", "fp32-stream", "bias-alone", "bias-dtype"])
def test_variant_follows_the_call_facts(fake_h100, monkeypatch, x, w, b, r, out, stream,
                                        layer_norm, expected):
    """The CuTe forward runs for the operands the torch side runs it for
    (:func:`tilenorm.dispatch.forward_kernel`), as the compiled variant of their dtypes."""
    _records(monkeypatch, jax_forward=True)
    shape = (MIN_ROWS, WIDTH)
    xs, rs = _sds(shape, x), _sds(shape, r)
    ws, bs = _sds((WIDTH,), w), _sds((WIDTH,), b)
    found = []

    def decide(x, w, b, r):  # on tracers, as a traced call decides
        spec = _spec(x, w, b, r, layer_norm, out_dtype=out, stream=stream)
        decision = kernels.covers(jax_dispatch._problem(spec, x, r, w, b))
        found.append((decision, kernels.cute_forward_variant(spec, decision, x, r, w, b)))

    jax.eval_shape(decide, xs, ws, bs, rs)
    ((decision, variant),) = found
    if expected is None:
        assert variant is None
        return
    assert decision.cute_forward is not None
    plan, key = variant
    assert plan is decision.cute_forward
    assert (key.dtype, key.weight_dtype, key.has_bias, key.has_residual) == expected
    assert key.layer_norm == layer_norm and key.cols == WIDTH and not key.has_offset


# --- lowering for CUDA -----------------------------------------------------------------------


@pytest.fixture
def cute_routed(fake_h100, monkeypatch):
    """The installed kernel path on a made-up H100 with experimental kernels on and the CuTe
    forward from any size (the recipes of cuTile's backward unlaunchable, as in
    tests/test_jax_gpu.py: preparing one loads a cubin on the GPU)."""
    monkeypatch.setattr(kernel_dispatch, "CUTE_FORWARD_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "launch_recipe", _unlaunchable_recipe)
    kernels._forward_recipes.cache_clear()
    kernels._backward_recipes.cache_clear()
    native.register_targets()
    previous = tj.set_kernel_path(kernels.kernel_path())
    with tilenorm.experimental():
        yield
    tj.set_kernel_path(previous)
    kernels._forward_recipes.cache_clear()
    kernels._backward_recipes.cache_clear()


def _cute_calls(text: str) -> list[str]:
    return re.findall(rf"custom_call @({cute_ffi.TARGET_PREFIX}[0-9a-f]+)\(", text)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms-gemma", "ln-bias"])
def test_lowered_step_runs_the_cute_forward_and_cutiles_backward(cute_routed, layer_norm):
    x = jax.ShapeDtypeStruct((3, 5, WIDTH), BF16)
    w = jax.ShapeDtypeStruct((WIDTH,), FP32)

    def loss(x, w, r):
        if layer_norm:
            y, h = tj.layer_norm(x, w, w, residual=r, prenorm=True)
        else:
            y, h = tj.rms_norm(x, w, residual=r, prenorm=True, offset=1.0)
        return jnp.sum(y.astype(FP32)) + jnp.sum(h.astype(FP32))

    text = _lowered_for_cuda(jax.grad(loss, (0, 1, 2)), x, w, x)
    (target,) = _cute_calls(text)
    assert f"custom_call @{native.FORWARD_TARGET}(" not in text
    assert text.count(f"custom_call @{native.BACKWARD_TARGET}(") == 1
    plan, key = _key("layer_norm" if layer_norm else "rms_norm", bias=layer_norm,
                     offset=not layer_norm, residual=True, rows=15)
    assert target == cute_ffi.target_name(key, ARCH)
    call = next(line for line in text.splitlines() if f"@{target}(" in line)
    assert f"grid = {plan.grid} : i64" in call
    assert re.search(r"offset = 1\.0+e\+00 : f32" if not layer_norm else
                     r"offset = 0\.0+e\+00 : f32", call)
    results = "(tensor<15x{0}xbf16>, tensor<15x{0}xbf16>, {1}tensor<15xf32>)".format(
        WIDTH, "tensor<15xf32>, " if layer_norm else "")
    assert call.endswith(results), call


def _call_line(text: str, target: str) -> str:
    return next(line for line in text.splitlines() if f"@{target}(" in line)


@pytest.mark.parametrize(("op", "cols"), CLUSTER_BACKWARD_ENTRIES)
def test_lowered_step_runs_the_cluster_kernels(cute_routed, monkeypatch, cols, op):
    """At the cluster backward's widths a training step is the CuTe DSL forward's call, the
    cluster backward's (dx and the partial buffer of its co-resident clusters, 37 rows on
    15 of them; LayerNorm's with the mean and dweight's and dbias's groups) and the FFI
    module's one call of cuTile's column sums over that buffer."""
    _records(monkeypatch, jax_forward=True)
    kernels._column_sums_recipe.cache_clear()
    layer_norm = op == "layer_norm"
    x = jax.ShapeDtypeStruct((37, cols), BF16)
    w = jax.ShapeDtypeStruct((cols,), BF16)

    def loss(x, w, r):
        if layer_norm:
            y, h = tj.layer_norm(x, w, w, residual=r, prenorm=True)
        else:
            y, h = tj.rms_norm(x, w, residual=r, prenorm=True, offset=1.0)
        return jnp.sum(y.astype(FP32)) + jnp.sum(h.astype(FP32))

    text = _lowered_for_cuda(jax.grad(loss, (0, 1, 2)), x, w, x)
    forward_plan, forward_key = _key(op, cols=cols, weight="bfloat16", bias=layer_norm,
                                     offset=not layer_norm, residual=True, rows=37)
    (forward,) = _cute_calls(text)
    assert forward == cute_ffi.target_name(forward_key, ARCH)
    assert f"grid = {forward_plan.grid} : i64" in _call_line(text, forward)
    plan, key = _backward_key(cols, offset=not layer_norm, dres_in=True, op=op,
                              bias=layer_norm)
    backward = cute_ffi.target_name(key, ARCH)
    call = _call_line(text, backward)
    assert f"grid = {plan.grid} : i64" in call and plan.grid == 15 * key.cluster
    operands = (f"tensor<37x{cols}xbf16>, tensor<37x{cols}xbf16>, tensor<{cols}xbf16>, "
                + "tensor<37xf32>, " * (1 + layer_norm) + f"tensor<37x{cols}xbf16>)")
    groups = 1 + layer_norm
    assert operands in call, call
    assert call.endswith(f"(tensor<37x{cols}xbf16>, tensor<15x{groups}x{cols}xf32>)"), call
    assert f"custom_call @{native.FORWARD_TARGET}(" not in text
    (reduce,) = [line for line in text.splitlines()
                 if f"custom_call @{native.BACKWARD_TARGET}(" in line]
    assert f"(tensor<15x{groups}x{cols}xf32>)" in reduce
    assert reduce.split("->")[1].count(f"tensor<{cols}xf32>") == groups, reduce
    kernels._column_sums_recipe.cache_clear()


@pytest.mark.parametrize("transform", ["vmap", "shard_map", "checkpoint"])
def test_transformed_forward_lowers_to_the_cute_call(cute_routed, transform):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    x = jax.ShapeDtypeStruct((4, 6, WIDTH), BF16)
    w = jax.ShapeDtypeStruct((WIDTH,), BF16)

    def norm(x, w):
        return tj.rms_norm(x, w)

    forwards = 1
    if transform == "vmap":  # the vmapped dimension is more rows: one call of 24
        fn = jax.vmap(norm, (0, None))
    elif transform == "shard_map":
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        fn = jax.shard_map(norm, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    else:
        fn, forwards = jax.checkpoint(norm), 2
    step = jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w).astype(FP32)), (0, 1))
    text = _lowered_for_cuda(step, x, w)
    assert len(_cute_calls(text)) == forwards
    assert text.count(f"custom_call @{native.BACKWARD_TARGET}(") == 1


def test_a_library_that_fails_to_build_leaves_cutiles_forward(cute_routed, monkeypatch):
    def fail(key, arch):
        raise RuntimeError("compiling the CuTe DSL forward failed: test")

    monkeypatch.setattr(cute_ffi, "target", fail)
    kernels._cute_target.cache_clear()
    try:
        x = jax.ShapeDtypeStruct((7, WIDTH), FP16)
        with pytest.warns(RuntimeWarning, match="cuTile's forward runs"):
            text = _lowered_for_cuda(tj.rms_norm, x)
        assert not _cute_calls(text) and f"custom_call @{native.FORWARD_TARGET}(" in text
        with warnings.catch_warnings():  # the failure is remembered: no second build
            warnings.simplefilter("error")
            _lowered_for_cuda(lambda x: tj.rms_norm(x, eps=1e-5), x)
    finally:
        kernels._cute_target.cache_clear()


# --- the call through XLA's CPU backend, up to the kernel's load ------------------------------


@functools.cache
def _host_target(key: cute_ffi.Key) -> str:
    """The variant's handler for XLA's CPU backend (``HOST_HANDLER``), registered once."""
    name = cute_ffi.target_name(key, ARCH) + "_host"
    handler = getattr(cute_ffi.library(key, ARCH), cute_ffi.HOST_HANDLER)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    return name


@pytest.fixture
def cute_on_cpu(fake_h100, monkeypatch):
    """The kernel path for XLA's CPU backend whose forward is the CuTe call's host handler:
    the kernel path's own routing, operands and results, the entry's own checks."""
    monkeypatch.setattr(kernel_dispatch, "CUTE_FORWARD_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "_cute_target", lambda key, arch, direction:
                        _host_target(key) if arch == (9, 0) else None)
    previous = tj.set_kernel_path(tj.KernelPath("cpu", kernels.covers, kernels.forward,
                                                kernels.backward))
    with tilenorm.experimental():
        yield jax.devices("cpu")[0]
    tj.set_kernel_path(previous)


def _reaches_the_kernel_load(run, kernel: str = "forward") -> str:
    """Run ``run``: the handler's error, which must be the kernel's load (no GPU here), not
    one of the entry's argument checks."""
    with pytest.raises(Exception, match=f"the CuTe DSL {kernel} failed") as info:
        jax.block_until_ready(run())
    message = str(info.value)
    assert re.search("cuda", message, re.IGNORECASE), message
    assert not any(word in message for word in ARGUMENT_ERRORS), message
    return message


VARIANTS = {  # (op, x dtype, weight dtype, bias, residual, offset, width, shape)
    "rms-bf16-fp32-weight": ("rms_norm", BF16, FP32, False, False, 0.0, WIDTH, (3, 3)),
    "rms-bf16-prenorm-gemma": ("rms_norm", BF16, BF16, False, True, 1.0, 8192, (5,)),
    "rms-fp16-no-weight": ("rms_norm", FP16, None, False, False, 0.0, 16384, (2, 1, 1)),
    "ln-fp16-bias-prenorm": ("layer_norm", FP16, FP16, True, True, 0.0, WIDTH, (11,)),
    "ln-bf16-fp32-params": ("layer_norm", BF16, FP32, True, False, 0.0, 8192, (4, 2)),
    "rms-bf16-cluster-gemma": ("rms_norm", BF16, BF16, False, False, 1.0, 65536, (3,)),
    "rms-bf16-cluster-prenorm": ("rms_norm", BF16, FP32, False, True, 0.0, 131072, (2,)),
    "ln-bf16-cluster-bias": ("layer_norm", BF16, BF16, True, False, 0.0, 32768, (3,)),
}


@no_gpu
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_host_call_passes_every_argument_check_of_the_kernel(cute_on_cpu, name):
    op, dtype, w_dtype, has_bias, has_residual, offset, cols, rows = VARIANTS[name]
    device = cute_on_cpu
    rng = np.random.default_rng(0)

    def arr(shape, dt):
        return jax.device_put(jnp.asarray(rng.standard_normal(shape), dt), device)

    x = arr(rows + (cols,), dtype)
    r = arr(rows + (cols,), dtype) if has_residual else None
    w = arr((cols,), w_dtype) if w_dtype is not None else None
    b = arr((cols,), w_dtype) if has_bias else None

    def norm(x, w, b, r):
        if op == "layer_norm":
            return tj.layer_norm_forward(x, w, b, residual=r)
        return tj.rms_norm_forward(x, w, offset=offset, residual=r)

    text = jax.jit(norm).lower(x, w, b, r).as_text()
    assert len(re.findall(r"custom_call @tilenorm_cute_forward_[0-9a-f]+_host\(", text)) == 1
    assert native.FORWARD_TARGET not in text
    _reaches_the_kernel_load(lambda: jax.jit(norm)(x, w, b, r))


@no_gpu
def test_the_kernels_own_checks_reach_xla_as_errors(cute_on_cpu):
    """A weight of another dtype than the compiled variant's: the entry's message, through
    the handler, is the error XLA raises; so is a call with an operand missing."""
    plan, key = _key(rows=4)
    target = _host_target(key)
    x = jnp.zeros((4, WIDTH), BF16)
    w = jnp.ones((WIDTH,), BF16)  # the variant takes fp32
    spec = _spec(x, w.astype(FP32), None, None)
    with pytest.raises(Exception, match="Mismatched Tensor.*expected dtype=float32"):
        jax.block_until_ready(jax.jit(lambda x, w: kernels._cute_forward(
            spec, plan, target, x, None, w, None))(x, w))
    results = [jax.ShapeDtypeStruct((4, WIDTH), BF16), jax.ShapeDtypeStruct((4,), FP32)]
    with pytest.raises(Exception, match="other operands or results"):
        jax.block_until_ready(jax.ffi.ffi_call(target, results)(
            x, eps=np.float32(1e-6), offset=np.float32(0), grid=np.int64(plan.grid)))
    assert cute_ffi.calls_run(target) == 0  # not a registered CUDA target


@no_gpu
@pytest.mark.parametrize("op,weight,bias,dres_in,offset", [
    ("rms_norm", "bfloat16", False, False, 0.0), ("rms_norm", "float32", False, True, 1.0),
    ("rms_norm", None, False, True, 0.0), ("layer_norm", "bfloat16", True, False, 0.0),
    ("layer_norm", "float32", False, True, 0.0), ("layer_norm", None, True, False, 0.0),
    ("layer_norm", None, False, False, 0.0)],
    ids=["bf16-weight", "fp32-weight-dres-gemma", "no-weight-dres", "ln-bf16-params",
         "ln-fp32-weight-dres", "ln-bias-only", "ln-no-params"])
def test_host_backward_call_passes_every_argument_check_of_the_kernel(cute_on_cpu, op, weight,
                                                                      bias, dres_in, offset):
    """The cluster backward's call as the kernel path makes it (37 rows, 15 clusters):
    every array it hands the entry passes the entry's checks (LayerNorm's mean among them,
    its partial buffer one or two groups)."""
    cols = min(SM90.cute_cluster_backward[op])
    plan, key = _backward_key(cols, weight, weight is not None and offset != 0, dres_in,
                              op=op, bias=bias)
    device = cute_on_cpu
    rng = np.random.default_rng(1)

    def arr(shape, dt):
        return jax.device_put(jnp.asarray(rng.standard_normal(shape), dt), device)

    h, dy = arr((37, cols), BF16), arr((37, cols), BF16)
    dh = arr((37, cols), BF16) if dres_in else None
    w = None if weight is None else arr((cols,), np.dtype(weight))
    b = arr((cols,), BF16) if bias else None
    mean = arr((37,), FP32) if op == "layer_norm" else None
    rstd = arr((37,), FP32)
    r = h if dres_in else None
    spec = _spec(h, w, b, r, layer_norm=op == "layer_norm", offset=offset)
    target = _host_target(key)

    def call(h, dy, w, b, mean, rstd, dh):
        return kernels._cute_cluster_call(spec, plan, target, dy, dh, h, w, b, mean, rstd)

    lowered = jax.jit(call).lower(h, dy, w, b, mean, rstd, dh).as_text()
    line = _call_line(lowered, target)
    assert f"grid = {plan.grid} : i64" in line
    groups = (w is not None) + (b is not None)
    partial = f"tensor<{plan.partial_rows}x{groups}x{cols}xf32>"
    assert (partial in line) == (groups > 0), line
    _reaches_the_kernel_load(lambda: jax.jit(call)(h, dy, w, b, mean, rstd, dh),
                             "cluster backward")
