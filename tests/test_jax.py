"""tilenorm.jax on the CPU: the reference path against float64, the custom_vjp, jit, vmap,
checkpoint and donation, shard_map and custom_partitioning on 8 host devices, the kernel-path
switch, the Flax modules, and every argument error."""

from __future__ import annotations

import contextlib
import os
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
# Before any backend starts: the CPU backend only (on the GPU host JAX would otherwise take 75%
# of the GPU's memory from the torch tests beside it), 8 CPU devices for the sharding tests
# (this module is the only one that imports jax; each pytest-xdist worker is its own process),
# float64 for references.
with contextlib.suppress(RuntimeError):  # a backend already up keeps its platform and devices
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tilenorm.jax as tj  # noqa: E402
from tilenorm import dispatch as kernel_dispatch  # noqa: E402
from tilenorm.device import DeviceInfo  # noqa: E402
from tilenorm.jax import reference, sharding  # noqa: E402
from tilenorm.validation import CUTILE_NORM  # noqa: E402

# These tests run the reference path: the CUDA kernel path that import installs where jaxlib
# has a CUDA plugin is tests/test_jax_gpu.py's.
tj.set_kernel_path(None)

TOL = {jnp.float32: 1e-6, jnp.float64: 1e-12, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
GRAD_TOL = {jnp.float32: 1e-5, jnp.float64: 1e-11, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    scale = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return diff / scale if scale > 0 else diff


def rand(rng, shape, dtype, loc=0.0, scale=1.0):
    return jnp.asarray(loc + scale * rng.standard_normal(shape), dtype)


def plain_norm(x, weight=None, bias=None, eps=1e-6, *, layer_norm=False, offset=0.0,
               residual=None, dims=1):
    """The textbook formula in plain jnp (float64 inputs give the float64 reference whose
    gradients jax.grad takes); returns (y, h)."""
    h = x if residual is None else x + residual
    axes = tuple(range(-dims, 0))
    centered = h - h.mean(axes, keepdims=True) if layer_norm else h
    y = centered / jnp.sqrt(jnp.square(centered).mean(axes, keepdims=True) + eps)
    if weight is not None:
        y = y * (offset + weight)
    if bias is not None:
        y = y + bias
    return y, h


def numpy_norm(x, weight=None, bias=None, eps=1e-6, *, layer_norm=False, offset=0.0,
               residual=None, dims=1):
    """(y, h, mean, rstd) in numpy float64 from the operands as given (rounded)."""
    f64 = [None if t is None else np.asarray(t, np.float64) for t in (x, weight, bias, residual)]
    x, weight, bias, residual = f64
    h = x if residual is None else x + residual
    axes = tuple(range(-dims, 0))
    mean = h.mean(axes, keepdims=True) if layer_norm else 0.0
    rstd = 1 / np.sqrt(np.square(h - mean).mean(axes, keepdims=True) + eps)
    y = (h - mean) * rstd
    if weight is not None:
        y = y * (offset + weight)
    if bias is not None:
        y = y + bias
    stat = x.shape[:x.ndim - dims]
    return y, h, mean.reshape(stat) if layer_norm else None, rstd.reshape(stat)


def f64(t):
    return None if t is None else jnp.asarray(t, jnp.float64)


# --- the reference path against float64 ----------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 64), (17, 1000)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("layer_norm,affine", [
    (False, "none"), (False, "weight"), (True, "none"), (True, "weight"),
    (True, "weight+bias")])
def test_forward_and_gradients_match_float64(shape, dtype, layer_norm, affine):
    rng, seed = fresh_rng()
    n = shape[-1]
    x = rand(rng, shape, dtype, loc=3.0 if layer_norm else 0.0)
    w = rand(rng, n, dtype, 1.0, 0.5) if affine != "none" else None
    b = rand(rng, n, dtype) if affine == "weight+bias" else None
    dy = rand(rng, shape, dtype)
    eps = 1e-5

    def ours(x, w, b):
        return (tj.layer_norm(x, w, b, eps) if layer_norm else tj.rms_norm(x, w, eps))

    y, vjp = jax.vjp(ours, x, w, b)
    dx, dw, db = vjp(dy)
    ref_y, ref_vjp = jax.vjp(lambda x, w, b: plain_norm(x, w, b, eps, layer_norm=layer_norm)[0],
                             f64(x), f64(w), f64(b))
    rdx, rdw, rdb = ref_vjp(f64(dy))
    assert y.dtype == dtype and y.shape == shape
    assert rel(y, numpy_norm(x, w, b, eps, layer_norm=layer_norm)[0]) <= TOL[dtype], seed
    assert rel(y, ref_y) <= TOL[dtype], seed
    assert dx.dtype == dtype
    if n > 1:  # for N = 1 the exact dx is O(eps): no relative accuracy to ask for
        assert rel(dx, rdx) <= GRAD_TOL[dtype], seed
    for ours_g, ref_g, p in ((dw, rdw, w), (db, rdb, b)):
        if p is not None:
            assert ours_g.dtype == dtype and rel(ours_g, ref_g) <= GRAD_TOL[dtype], seed


def test_launch_level_pair_matches_reference_and_vjp():
    rng, seed = fresh_rng()
    x = rand(rng, (4, 6, 96), jnp.float32, 2.0)
    w, b = rand(rng, 96, jnp.float32, 1.0, 0.3), rand(rng, 96, jnp.float32)
    r = rand(rng, (4, 6, 96), jnp.float32)
    dy, dh = rand(rng, x.shape, jnp.float32), rand(rng, x.shape, jnp.float32)
    y, h, mean, rstd = tj.layer_norm_forward(x, w, b, residual=r, residual_dtype=jnp.float64)
    ry, rh, rmean, rrstd = numpy_norm(x, w, b, 1e-5, layer_norm=True, residual=r)
    assert h.dtype == jnp.float64 and mean.shape == rstd.shape == (4, 6)
    assert mean.dtype == rstd.dtype == jnp.float64  # the stream is float64: so is the arithmetic
    for out, ref in ((y, ry), (h, rh), (mean, rmean), (rstd, rrstd)):
        assert rel(out, ref) <= 1e-6, seed
    dx, dres, dw, db = tj.layer_norm_backward(dy, h, w, b, mean, rstd, dh=dh,
                                              x_dtype=jnp.float32, residual_dtype=jnp.float32)
    _, vjp = jax.vjp(lambda x, w, b, r: tj.layer_norm(x, w, b, residual=r, prenorm=True,
                                                      residual_dtype=jnp.float64), x, w, b, r)
    vdx, vdw, vdb, vdr = vjp((dy, dh.astype(jnp.float64)))
    assert dx.dtype == dres.dtype == jnp.float32 and dw.dtype == db.dtype == jnp.float32
    for out, ref in ((dx, vdx), (dres, vdr), (dw, vdw), (db, vdb)):
        assert rel(out, ref) <= 1e-6, seed
    y, h, rstd = tj.rms_norm_forward(x, w)
    assert h is x and rstd.shape == (4, 6) and rstd.dtype == jnp.float32
    dx, dres, dw = tj.rms_norm_backward(dy, h, w, rstd)
    _, vjp = jax.vjp(lambda x, w: tj.rms_norm(x, w), x, w)
    vdx, vdw = vjp(dy)
    assert dres is None and rel(dx, vdx) <= 1e-6 and rel(dw, vdw) <= 1e-6, seed


@pytest.mark.parametrize("x_dtype,r_dtype,h_dtype", [
    (jnp.bfloat16, jnp.float32, None), (jnp.bfloat16, jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.float32, None), (jnp.float16, jnp.float16, None)])
def test_fused_residual_add(x_dtype, r_dtype, h_dtype):
    rng, seed = fresh_rng()
    x, r = rand(rng, (5, 3, 128), x_dtype), rand(rng, (5, 3, 128), r_dtype)
    w = rand(rng, 128, jnp.float32, 1.0, 0.5)
    dy, dh = rand(rng, x.shape, x_dtype), rand(rng, x.shape, h_dtype or r_dtype)

    def ours(x, w, r):
        return tj.rms_norm(x, w, residual=r, prenorm=True, residual_dtype=h_dtype)

    (y, h), vjp = jax.vjp(ours, x, w, r)
    dx, dw, dr = vjp((dy, dh))
    assert y.dtype == x_dtype and h.dtype == (h_dtype or r_dtype)
    assert dx.dtype == x_dtype and dr.dtype == r_dtype and dw.dtype == jnp.float32
    h64 = (np.asarray(x, np.float64) + np.asarray(r, np.float64)).astype(h.dtype)
    assert rel(h, h64) == 0, seed  # summed in float32 (exact here), rounded once
    tol = TOL[x_dtype] if x_dtype != jnp.float32 else 1e-6
    assert rel(y, numpy_norm(h, w)[0]) <= tol, seed
    # the reference normalizes h as stored, with the gradient reaching h added
    _, ref_vjp = jax.vjp(lambda h, w: plain_norm(h, w)[0], f64(h), f64(w))
    rdh, rdw = ref_vjp(f64(dy))
    rdh = rdh + f64(dh)
    grad_tol = 2 * GRAD_TOL[x_dtype]
    assert rel(dx, rdh) <= grad_tol and rel(dr, rdh) <= grad_tol, seed
    assert rel(dw, rdw) <= grad_tol, seed
    y2 = tj.rms_norm(x, w, residual=r, residual_dtype=h_dtype)  # without prenorm: y only
    assert jnp.array_equal(y2, y)


def test_gemma_offset_per_head_and_multi_dim_weights():
    rng, seed = fresh_rng()
    x = rand(rng, (3, 4, 8, 32), jnp.float32)
    wh = rand(rng, (8, 32), jnp.float32, 0.0, 0.2)
    dy = rand(rng, x.shape, jnp.float32)
    cases = [
        # (ours, plain float64 reference with its normalized dims)
        (lambda x, w: tj.rms_norm(x, w, offset=1.0, per_head=True),
         lambda x, w: plain_norm(x, w, offset=1.0, dims=1)[0]),
        (lambda x, w: tj.rms_norm(x, w),  # torch's semantics: over the weight's (H, N)
         lambda x, w: plain_norm(x, w, dims=2)[0]),
        (lambda x, w: tj.layer_norm(x, w, w * 0.5, eps=None),
         lambda x, w: plain_norm(x, w, w * 0.5, float(jnp.finfo(jnp.float32).eps),
                                 layer_norm=True, dims=2)[0]),
    ]
    for ours, plain in cases:
        y, vjp = jax.vjp(ours, x, wh)
        ref, ref_vjp = jax.vjp(plain, f64(x), f64(wh))
        assert rel(y, ref) <= 1e-6, seed
        for g, rg in zip(vjp(dy), ref_vjp(f64(dy)), strict=True):
            assert rel(g, rg) <= 1e-5, seed


def test_dtypes_of_outputs_and_parameters():
    rng, seed = fresh_rng()
    x = rand(rng, (6, 64), jnp.bfloat16)
    w32, w64 = rand(rng, 64, jnp.float32, 1.0, 0.3), rand(rng, 64, jnp.float64, 1.0, 0.3)
    y = tj.rms_norm(x, w32, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32 and rel(y, numpy_norm(x, w32)[0]) <= 1e-6, seed
    assert tj.rms_norm(x, w64).dtype == jnp.bfloat16  # y keeps x's dtype
    x32 = x.astype(jnp.float32)
    y = tj.rms_norm(x32, w64, out_dtype="float64")  # the product with a float64 weight in fp64
    assert y.dtype == jnp.float64 and rel(y, numpy_norm(x32, w64)[0]) <= 1e-7, seed
    gw = jax.grad(lambda w: tj.rms_norm(x, w).astype(jnp.float32).sum())(w64)
    assert gw.dtype == jnp.float64
    empty = tj.layer_norm(jnp.ones((0, 8), jnp.float32), jnp.ones(8))
    assert empty.shape == (0, 8)


# --- transformations -----------------------------------------------------------------------


def _loss(fn):
    def loss(x, w):
        y = fn(x, w)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1])))
    return loss


def test_jit_reruns_are_bit_identical_and_static_args_retrace():
    rng, _ = fresh_rng()
    x = rand(rng, (64, 256), jnp.bfloat16)
    w = rand(rng, 256, jnp.float32, 1.0, 0.5)
    step = jax.jit(jax.value_and_grad(_loss(lambda x, w: tj.rms_norm(x, w)), argnums=(0, 1)))
    first = step(x, w)
    for _ in range(3):
        again = step(x, w)
        assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(first),
                                                         jax.tree.leaves(again), strict=True))
    by_eps = jax.jit(lambda x, w, eps: tj.rms_norm(x, w, eps), static_argnums=2)
    assert not jnp.array_equal(by_eps(x, w, 1e-6), by_eps(x, w, 10.0))


def test_vmap_adds_rows_and_sums_weight_gradients_only_where_asked():
    rng, seed = fresh_rng()
    x = rand(rng, (4, 3, 64), jnp.float32)
    w, wb = rand(rng, 64, jnp.float32, 1.0, 0.5), rand(rng, (4, 64), jnp.float32, 1.0, 0.5)
    ours, plain = _loss(lambda x, w: tj.rms_norm(x, w)), _loss(lambda x, w: plain_norm(x, w)[0])

    def close(a, b):
        return all(rel(p, q) <= 1e-6 for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                    strict=True))

    # the forward: an unbatched weight, vmapped over any axis of x
    assert close(jax.vmap(tj.rms_norm, in_axes=(0, None))(x, w), tj.rms_norm(x, w))
    assert close(jax.vmap(tj.rms_norm, in_axes=(1, None), out_axes=1)(x, w), tj.rms_norm(x, w))
    # grad of vmap: the weight is shared, its gradient the sum over the batch
    assert close(jax.grad(lambda x, w: jax.vmap(ours, (0, None))(x, w).sum(), (0, 1))(x, w),
                 jax.grad(lambda x, w: jax.vmap(plain, (0, None))(x, w).sum(), (0, 1))(
                     f64(x), f64(w))), seed
    # vmap of grad: per-example gradients of the shared weight
    per_example = jax.vmap(jax.grad(ours, (0, 1)), (0, None))(x, w)
    assert per_example[1].shape == (4, 64)
    assert close(per_example, jax.vmap(jax.grad(plain, (0, 1)), (0, None))(f64(x), f64(w)))
    # a weight per example, forward and both orders of grad and vmap
    assert close(jax.vmap(tj.rms_norm)(x, wb), jax.vmap(lambda x, w: plain_norm(x, w)[0])(
        f64(x), f64(wb)))
    assert close(jax.vmap(jax.grad(ours, (0, 1)))(x, wb),
                 jax.vmap(jax.grad(plain, (0, 1)))(f64(x), f64(wb)))
    assert close(jax.grad(lambda x, w: jax.vmap(ours)(x, w).sum(), (0, 1))(x, wb),
                 jax.grad(lambda x, w: jax.vmap(plain)(x, w).sum(), (0, 1))(f64(x), f64(wb)))
    # nested: per-example gradients over two batch axes, LayerNorm with a bias
    xx = x.reshape(2, 2, 3, 64)

    def ln(fn):
        return lambda x, w: jnp.sum(fn(x, w) * jnp.sin(jnp.arange(64)))

    g = jax.vmap(jax.vmap(jax.grad(ln(lambda x, w: tj.layer_norm(x, w, w)), (0, 1)),
                          (0, None)), (0, None))(xx, w)
    rg = jax.vmap(jax.vmap(jax.grad(ln(lambda x, w: plain_norm(x, w, w, 1e-5,
                                                               layer_norm=True)[0]), (0, 1)),
                           (0, None)), (0, None))(f64(xx), f64(w))
    assert g[1].shape == (2, 2, 64) and close(g, rg), seed


def test_checkpoint_and_donation():
    rng, seed = fresh_rng()
    x = rand(rng, (32, 128), jnp.float32)
    w = rand(rng, 128, jnp.float32, 1.0, 0.5)
    loss = _loss(lambda x, w: tj.layer_norm(x, w, w))
    plain = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    for policy in (None, jax.checkpoint_policies.nothing_saveable):
        remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), (0, 1)))(x, w)
        assert all(rel(a, b) <= 1e-6 for a, b in zip(remat, plain, strict=True)), seed
    expected = tj.rms_norm(x, w)
    donated = jnp.array(x)
    y = jax.jit(lambda x, w: tj.rms_norm(x, w), donate_argnums=0)(donated, w)
    assert jnp.array_equal(y, expected) and donated.is_deleted()


# --- which path runs -------------------------------------------------------------------------


def test_explain_says_which_path_and_why():
    x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones(64, jnp.bfloat16)
    d = tj.explain(x, w)
    assert not d.uses_kernel and d.platform == "cpu"
    assert str(d) == ("rms_norm on cpu: reference path (jnp), because x is on cpu; the kernels "
                      "run on cuda")
    shapes = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64,), jnp.float32)
    assert "no kernel path installed" in tj.explain(*shapes, platform="cuda").reason
    assert "split across the mesh axes ('model',)" in tj.explain(
        *shapes, platform="cuda", axis_name="model").reason
    assert tj.explain(x, w, bias=w, layer_norm=True).op == "layer_norm"


def _fake_decision(problem, reason="covered by the test's kernel path"):
    device = DeviceInfo(index=0, name="test device", sm_count=132, arch=(9, 0), l2_bytes=1 << 25)
    plan = kernel_dispatch.plan_row_norm(problem.rows, problem.cols, heads=problem.heads,
                                         per_head_weight=problem.per_head_weight, itemsize=4,
                                         sm_count=132, arch=(9, 0), direction="forward")
    return kernel_dispatch.Decision(op=problem.op, reason=reason, family=CUTILE_NORM,
                                    forward=plan, backward=plan, device=device)


@pytest.fixture
def recording_kernel_path():
    """A kernel path for the CPU that runs the reference and records the shapes and problems
    it was traced with."""
    seen = {"forward": [], "backward": [], "problems": []}

    def covers(problem):
        seen["problems"].append(problem)
        return _fake_decision(problem)

    def forward(spec, decision, x, residual, weight, bias):
        seen["forward"].append(x.shape)
        return reference.forward(spec, x, residual, weight, bias)

    def backward(spec, decision, dy, dh, h, weight, bias, mean, rstd):
        seen["backward"].append(h.shape)
        return reference.backward(spec, dy, dh, h, weight, bias, mean, rstd)

    previous = tj.set_kernel_path(tj.KernelPath("cpu", covers, forward, backward))
    yield seen
    tj.set_kernel_path(previous)


def test_kernel_path_is_taken_where_it_covers_the_call(recording_kernel_path):
    seen = recording_kernel_path
    rng, seed = fresh_rng()
    x, w = rand(rng, (8, 96), jnp.float32), rand(rng, 96, jnp.float32, 1.0, 0.5)
    d = tj.explain(x, w)
    assert d.uses_kernel and str(d).startswith("rms_norm on cpu: kernel path")
    g = jax.jit(jax.grad(_loss(lambda x, w: tj.rms_norm(x, w)), (0, 1)))(x, w)
    assert seen["forward"] and seen["backward"]
    rg = jax.grad(_loss(lambda x, w: plain_norm(x, w)[0]), (0, 1))(f64(x), f64(w))
    assert all(rel(a, b) <= 1e-5 for a, b in zip(g, rg, strict=True)), seed
    problem = seen["problems"][0]
    assert (problem.rows, problem.heads, problem.cols, problem.dtypes) == (
        8, 1, 96, ("float32", "float32", "float32"))
    # vmap with a shared weight: the batch is rows in the forward, heads (a weight gradient
    # each) in the backward; per-example weights take the reference path. (The kernel path
    # is also traced with the unbatched shapes, for the abstract evaluation.)
    xb = x.reshape(2, 4, 96)
    jax.vmap(jax.grad(_loss(lambda x, w: tj.rms_norm(x, w)), (0, 1)), (0, None))(xb, w)
    assert (2, 4, 96) in seen["forward"] and (2, 4, 96) in seen["backward"]
    assert seen["problems"][-1].heads == 2 and seen["problems"][-1].per_head_weight
    seen["forward"].clear()
    jax.vmap(tj.rms_norm)(xb, jnp.stack([w, w]))
    assert (2, 4, 96) not in seen["forward"]


def test_kernel_path_that_does_not_cover_a_call_leaves_it_to_the_reference():
    def covers(problem):
        return kernel_dispatch.Decision(op=problem.op, reason="no plan for this shape")

    previous = tj.set_kernel_path(tj.KernelPath("cpu", covers, None, None))
    try:
        d = tj.explain(jnp.ones((2, 8)), None)
        assert not d.uses_kernel and d.reason == "no plan for this shape"
        assert tj.rms_norm(jnp.ones((2, 8))).shape == (2, 8)
    finally:
        tj.set_kernel_path(previous)


def test_kernel_branch_is_lowered_for_its_platform_only():
    """With a CUDA kernel path installed one jitted function lowers the kernel for CUDA and
    the reference for the CPU (exported without a GPU)."""
    target = "tilenorm_test_forward"

    def forward(spec, decision, x, residual, weight, bias):
        y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, spec.out_dtype))(x)
        return (y,) + reference.forward(spec, x, residual, weight, bias)[1:]

    previous = tj.set_kernel_path(tj.KernelPath("cuda", _fake_decision, forward, None))
    try:
        fn = jax.jit(lambda x, w: tj.rms_norm(x, w))
        args = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64,),
                                                                                   jnp.float32)
        checks = [jax.export.DisabledSafetyCheck.custom_call(target)]
        for platforms, has_kernel in ((["cuda"], True), (["cpu"], False),
                                      (["cpu", "cuda"], True)):
            exported = jax.export.export(fn, platforms=platforms, disabled_checks=checks)(*args)
            assert (target in exported.mlir_module()) == has_kernel, platforms
        assert tj.explain(*args, platform="cuda").uses_kernel
    finally:
        tj.set_kernel_path(previous)


# --- sharding on 8 host devices -------------------------------------------------------------


needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices")


def _mesh(shape, names, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _put(mesh, t, *spec):
    return jax.device_put(t, NamedSharding(mesh, P(*spec)))


def _inputs(rng, layer_norm):
    x = rand(rng, (16, 8, 64), jnp.float32, 2.0 if layer_norm else 0.0)
    w = rand(rng, 64, jnp.float32, 1.0, 0.5)
    return x, w, (rand(rng, 64, jnp.float32) if layer_norm else None)


def _grads(fn, x, w, b):
    """A function of (x, w, b) returning (y, (dx, dw[, db])) for the gradient cos(n) on
    every row."""
    def run(x, w, b):
        y, vjp = jax.vjp(fn, x, w, b)
        grads = vjp(jnp.broadcast_to(jnp.cos(jnp.arange(y.shape[-1])), y.shape).astype(y.dtype))
        return y, grads[:2] if b is None else grads
    return run


def _norm(layer_norm):
    if layer_norm:
        return lambda x, w, b: tj.layer_norm(x, w, b)
    return lambda x, w, b: tj.rms_norm(x, w)


@needs_8
@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("mesh_shape,x_spec", [
    ((8,), ("data", None, None)),          # data parallel
    ((8,), (None, "data", None)),          # sequence parallel
    ((2, 4), (None, None, "model")),       # tensor parallel: the hidden dimension split
    ((2, 4), ("data", None, "model")),     # both
    ((2, 4), (("data", "model"), None, None)),
])
@pytest.mark.parametrize("explicit", [False, True])
def test_jit_with_named_shardings_partitions_per_shard(layer_norm, mesh_shape, x_spec,
                                                        explicit):
    rng, seed = fresh_rng()
    names = ("data",) if len(mesh_shape) == 1 else ("data", "model")
    mesh = _mesh(mesh_shape, names, explicit)
    x, w, b = _inputs(rng, layer_norm)
    step = _grads(_norm(layer_norm), x, w, b)
    y, grads = step(x, w, b)
    xs, ws = _put(mesh, x, *x_spec), _put(mesh, w)
    bs = None if b is None else _put(mesh, b)
    args = (xs, ws) if b is None else (xs, ws, bs)
    jitted = jax.jit(step if b is not None else lambda x, w: step(x, w, None))
    sy, sgrads = jitted(*args)
    assert rel(sy, y) <= 1e-6, seed
    for s, g in zip(sgrads, grads, strict=True):
        assert rel(s, g) <= 1e-6, seed
    assert sgrads[0].sharding.spec == P(*x_spec)  # dx split like x
    hlo = jitted.lower(*args).compile().as_text()
    gathered = re.findall(r"= \w+\[([\d,]*)\][^=]* all-gather\(", hlo)
    assert all(np.prod([int(d) for d in g.split(",")]) <= 64 for g in gathered), gathered
    # no device ever gathers x: at most a hidden-split weight gradient is gathered
    hidden_split = x_spec[-1] is not None
    # an all-reduce of the weight gradients where rows are split, of the row statistics
    # where the hidden dimension is
    assert ("all-reduce" in hlo) == (hidden_split or any(e is not None for e in x_spec[:-1]))


@needs_8
def test_per_head_weights_split_with_their_heads():
    rng, seed = fresh_rng()
    mesh = _mesh((2, 4), ("data", "model"))
    x, wh = rand(rng, (6, 8, 32), jnp.bfloat16), rand(rng, (8, 32), jnp.float32, 0.0, 0.3)

    def norm(x, w, b):
        return tj.rms_norm(x, w, offset=1.0, per_head=True)

    # Against the unsharded jit: XLA's fusions round dx differently from eager's ops (a bf16
    # flip in dx at some seeds), which is not what sharding is checked for.
    y, grads = jax.jit(_grads(norm, x, wh, None))(x, wh, None)
    xs, ws = _put(mesh, x, "data", "model"), _put(mesh, wh, "model")
    sy, sgrads = jax.jit(_grads(norm, x, wh, None))(xs, ws, None)
    assert jnp.array_equal(sy, y), seed  # rows and heads are independent: the same bits
    assert all(rel(a, b) <= 1e-6 for a, b in zip(sgrads, grads, strict=True)), seed
    assert sgrads[1].sharding.spec == P("model")  # summed over "data", split like the heads


@needs_8
def test_fused_residual_add_split_across_devices():
    rng, seed = fresh_rng()
    mesh = _mesh((2, 4), ("data", "model"))
    x, r = rand(rng, (8, 4, 64), jnp.bfloat16), rand(rng, (8, 4, 64), jnp.float32)
    w = rand(rng, 64, jnp.float32, 1.0, 0.5)
    dy, dh = rand(rng, x.shape, jnp.bfloat16), rand(rng, x.shape, jnp.float32)

    def run(norm):
        def grads(x, w, r):
            (y, h), vjp = jax.vjp(norm, x, w, r)
            return y, h, vjp((dy, dh))
        return grads

    def plain(x, w, r):
        return tj.rms_norm(x, w, residual=r, prenorm=True)

    def helper(x, w, r):
        return sharding.rms_norm(x, w, residual=r, prenorm=True, mesh=mesh,
                                 spec=P("data", None, "model"))

    ref = run(plain)(x, w, r)
    args = _put(mesh, x, "data", None, "model"), w, _put(mesh, r, "data", None, "model")
    for norm in (plain, helper):
        out = jax.jit(run(norm))(*args)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
            assert rel(a, b) <= (1e-2 if a.dtype == jnp.bfloat16 else 1e-6), seed
        assert out[1].sharding.spec == P("data", None, "model")  # h split like x


@needs_8
def test_uneven_shards_are_gathered_and_gspmd_partitions_too():
    rng, seed = fresh_rng()
    mesh = _mesh((2, 4), ("data", "model"))
    x, w = rand(rng, (15, 62), jnp.float32, 1.0), rand(rng, 62, jnp.float32, 1.0, 0.5)

    def split(x, w):  # 15 rows over 2 devices, 62 columns over 4: padded shards
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", "model")))
        return tj.layer_norm(x, w, w)

    fn = _grads(lambda x, w, b: split(x, w), x, w, None)
    y, grads = _grads(lambda x, w, b: tj.layer_norm(x, w, w), x, w, None)(x, w, None)
    for partitioner in ("shardy", "gspmd"):
        previous = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
        try:
            sy, sgrads = jax.jit(fn)(x, w, None)
            # GSPMD: the custom_partitioning's infer_sharding_from_operands
            xs = _put(mesh, rand(rng, (16, 64), jnp.float32), "data", "model")
            ws = _put(mesh, rand(rng, 64, jnp.float32))
            step = _grads(_norm(True), xs, ws, ws)
            ry, rgrads = step(np.asarray(xs), np.asarray(ws), np.asarray(ws))
            py, pgrads = jax.jit(step)(xs, ws, ws)
        finally:
            jax.config.update("jax_use_shardy_partitioner", previous)
        assert rel(sy, y) <= 1e-6, (partitioner, seed)
        assert all(rel(a, b) <= 1e-6 for a, b in zip(sgrads, grads, strict=True)), seed
        assert rel(py, ry) <= 1e-6, (partitioner, seed)
        assert all(rel(a, b) <= 1e-6 for a, b in zip(pgrads, rgrads, strict=True)), seed
        assert pgrads[0].sharding.spec == P("data", "model")


@needs_8
def test_partitioned_calls_run_the_kernel_path_per_shard(recording_kernel_path):
    seen = recording_kernel_path
    rng, seed = fresh_rng()
    mesh = _mesh((8,), ("data",))
    x, w, _ = _inputs(rng, False)
    step = jax.jit(_grads(_norm(False), x, w, None))
    _, grads = step(_put(mesh, x, "data"), _put(mesh, w), None)
    # each device's shard (and, for the abstract evaluation, the whole x)
    assert (2, 8, 64) in seen["forward"] and (2, 8, 64) in seen["backward"]
    _, ref = _grads(_norm(False), x, w, None)(x, w, None)
    assert all(rel(a, b) <= 1e-6 for a, b in zip(grads, ref, strict=True)), seed
    # the hidden dimension split: the statistics need the other devices' partial sums
    seen["forward"].clear()
    mesh = _mesh((2, 4), ("data", "model"))
    jax.jit(_norm(False))(_put(mesh, x, "data", None, "model"), _put(mesh, w, "model"), None)
    assert (8, 8, 16) not in seen["forward"] and (16, 8, 64) in seen["forward"]


@needs_8
@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("mesh_shape,x_spec", [
    ((8,), ("data", None, None)), ((2, 4), ("data", None, "model")),
    ((4, 2), (None, "data", "model"))])
def test_sharding_helper_psums_weight_gradients(layer_norm, mesh_shape, x_spec):
    rng, seed = fresh_rng()
    names = ("data",) if len(mesh_shape) == 1 else ("data", "model")
    mesh = _mesh(mesh_shape, names)
    x, w, b = _inputs(rng, layer_norm)
    step = _grads(_norm(layer_norm), x, w, b)
    y, grads = step(x, w, b)

    def sharded(x, w, b):
        spec = P(*x_spec)
        if layer_norm:
            return sharding.layer_norm(x, w, b, mesh=mesh, spec=spec)
        return sharding.rms_norm(x, w, mesh=mesh, spec=spec)

    sstep = jax.jit(_grads(sharded, x, w, b))
    xs = _put(mesh, x, *x_spec)
    sy, sgrads = sstep(xs, w, b)
    assert rel(sy, y) <= 1e-6, seed
    for s, g in zip(sgrads, grads, strict=True):
        assert rel(s, g) <= 1e-6, seed
    assert sgrads[0].sharding.spec == P(*x_spec)
    jaxpr = str(jax.make_jaxpr(_grads(sharded, x, w, b))(x, w, b))
    row_axes = [e for e in x_spec[:-1] if e is not None]
    assert re.search(rf"psum.*axes=\('{row_axes[0]}',\)", jaxpr)  # dweight summed over rows


@needs_8
@pytest.mark.parametrize("check_vma", [True, False])
def test_ops_inside_a_users_shard_map(check_vma):
    rng, seed = fresh_rng()
    mesh = _mesh((2, 4), ("data", "model"))
    x, w, b = _inputs(rng, True)
    _, grads = _grads(_norm(True), x, w, b)(x, w, b)
    inner = jax.shard_map(lambda x, w, b: tj.layer_norm(x, w, b, axis_name="model"),
                          mesh=mesh, in_specs=(P("data", None, "model"), P("model"),
                                               P("model")),
                          out_specs=P("data", None, "model"), check_vma=check_vma)
    _, sgrads = jax.jit(_grads(inner, x, w, b))(x, w, b)
    for s, g in zip(sgrads, grads, strict=True):
        assert rel(s, g) <= 1e-6, seed


# --- Flax ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flax_modules():
    pytest.importorskip("flax")
    import flax.linen as nn
    from flax import nnx

    import tilenorm.jax.flax as tf
    return nn, nnx, tf


LINEN_CASES = [(kind, options) for kind in ("RMSNorm", "LayerNorm") for options in (
    {}, {"param_dtype": jnp.bfloat16}, {"dtype": jnp.bfloat16}, {"use_scale": False},
    {"epsilon": 1e-3, "dtype": jnp.float32})] + [("LayerNorm", {"use_bias": False})]


@pytest.mark.parametrize("kind,options", LINEN_CASES)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_linen_modules_match_flax(flax_modules, kind, options, x_dtype):
    nn, _, tf = flax_modules
    rng, seed = fresh_rng()
    x = rand(rng, (3, 5, 48), x_dtype, 1.0)
    ours, theirs = getattr(tf, kind)(**options), getattr(nn, kind)(**options)

    class Model(nn.Module):
        norm: type

        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(self.norm(**options)(x))

    for a, b in ((ours, theirs), (Model(getattr(tf, kind)), Model(getattr(nn, kind)))):
        key = jax.random.key(seed)
        va, vb = a.init(key, x), b.init(key, x)
        assert jax.tree.structure(va) == jax.tree.structure(vb)
        assert all(p.dtype == q.dtype and jnp.array_equal(p, q) for p, q in zip(
            jax.tree.leaves(va), jax.tree.leaves(vb), strict=True))
    params = jax.tree.map(lambda t: t + jnp.asarray(0.3 * rng.standard_normal(t.shape),
                                                    t.dtype), theirs.init(key, x))
    ya, yb = ours.apply(params, x), theirs.apply(params, x)
    assert ya.dtype == yb.dtype and ya.shape == yb.shape
    assert rel(ya, yb) <= (1e-5 if ya.dtype == jnp.float32 else 1e-2), seed


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("options", [{}, {"param_dtype": jnp.bfloat16},
                                     {"dtype": jnp.bfloat16}, {"use_scale": False}])
def test_nnx_modules_match_flax(flax_modules, kind, options):
    _, nnx, tf = flax_modules
    rng, seed = fresh_rng()
    x = rand(rng, (4, 48), jnp.bfloat16, 1.0)
    ours, theirs = getattr(tf, "Nnx" + kind)(48, rngs=nnx.Rngs(seed), **options), \
        getattr(nnx, kind)(48, rngs=nnx.Rngs(seed), **options)
    sa, sb = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    nnx.update(ours, jax.tree.map(lambda t: t + jnp.asarray(
        0.3 * rng.standard_normal(t.shape), t.dtype), sb))
    nnx.update(theirs, nnx.state(ours, nnx.Param))
    ya, yb = ours(x), theirs(x)
    assert ya.dtype == yb.dtype
    assert rel(ya, yb) <= (1e-5 if ya.dtype == jnp.float32 else 1e-2), seed


def test_flax_options_tilenorm_does_not_implement_raise(flax_modules):
    nn, nnx, tf = flax_modules
    x = jnp.ones((2, 3, 8))
    with pytest.raises(ValueError, match="reduction_axes must be -1"):
        tf.LayerNorm(reduction_axes=(1, 2)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="feature_axes must be -1"):
        tf.RMSNorm(feature_axes=1).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="axis_index_groups is not supported"):
        tf.RMSNorm(axis_index_groups=[[0]]).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="mask is not supported"):
        tf.NnxRMSNorm(8, rngs=nnx.Rngs(0))(x, mask=x > 0)
    assert tf.RMSNorm(reduction_axes=(2,)).init(jax.random.key(0), x)  # the last axis


# --- errors --------------------------------------------------------------------------------


X = np.ones((2, 8), np.float32)
W = np.ones(8, np.float32)


@pytest.mark.parametrize("call,exc,words", [
    (lambda: tj.rms_norm([1.0, 2.0]), TypeError, "rms_norm: x must be a jax.Array, got list"),
    (lambda: tj.rms_norm(jnp.ones(())), ValueError, "x must have at least 1 dimension"),
    (lambda: tj.rms_norm(jnp.ones((2, 8), jnp.int32)), TypeError,
     "x must be a floating-point array"),
    (lambda: tj.rms_norm(X, W[:4]), ValueError, "x must end in normalized_shape (4,)"),
    (lambda: tj.layer_norm(X, W, W[:4]), ValueError, "bias must have normalized_shape (8,)"),
    (lambda: tj.rms_norm(X, "w"), TypeError, "weight must be a jax.Array or None, got str"),
    (lambda: tj.rms_norm(X, W.astype(np.int32)), TypeError,
     "weight must be a floating-point array"),
    (lambda: tj.rms_norm(X, W, eps=-1.0), ValueError, "eps must be finite and >= 0"),
    (lambda: tj.rms_norm(X, W, eps="1"), TypeError, "eps must be a real number"),
    (lambda: tj.rms_norm(X, W, offset=float("nan")), ValueError, "offset must be finite"),
    (lambda: tj.rms_norm(X, offset=1.0), ValueError, "offset scales the weight"),
    (lambda: tj.rms_norm(X, W, residual=X[:1]), ValueError, "residual must have x's shape"),
    (lambda: tj.rms_norm(X, W, residual=3), TypeError, "residual must be a jax.Array or None"),
    (lambda: tj.rms_norm(X, W, prenorm=True), ValueError, "prenorm=True returns (y, x + "
                                                          "residual); it needs a residual"),
    (lambda: tj.rms_norm(X, W, prenorm=1), TypeError, "prenorm must be True or False"),
    (lambda: tj.rms_norm(X, W, residual_dtype=jnp.float32), ValueError,
     "residual_dtype is the dtype of the residual stream; it needs a residual"),
    (lambda: tj.rms_norm(X, W, out_dtype=jnp.int8), TypeError,
     "out_dtype must be None or one of"),
    (lambda: tj.rms_norm(X, W, out_dtype="complex"), TypeError, "out_dtype must be None"),
    (lambda: tj.rms_norm(X, W, per_head=True), ValueError,
     "per_head=True takes x of shape (..., H, N) and a weight of shape (H, N)"),
    (lambda: tj.rms_norm(X, W, axis_name=3), TypeError, "axis_name must be None, a mesh axis"),
    (lambda: tj.rms_norm_backward(X[:1], X, W, np.ones(2, np.float32)), ValueError,
     "dy must be a jax.Array of h's shape (2, 8)"),
    (lambda: tj.rms_norm_backward(X, X, W, np.ones(2, np.float64)), ValueError,
     "rstd must be the forward's: of shape (2,) and dtype float32"),
    (lambda: tj.layer_norm_backward(X, X, W, None, None, np.ones(2, np.float32)), ValueError,
     "mean must be the forward's"),
    (lambda: tj.rms_norm_backward(X, X, W, np.ones(2, np.float32), x_dtype="int8"), TypeError,
     "x_dtype must be None or one of"),
])
def test_bad_arguments_raise_clear_errors(call, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        call()
