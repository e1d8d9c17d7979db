"""tilenorm.jax's kernel path under JAX's transformations (issue 18): reruns under jit,
``jax.vmap``, ``jax.checkpoint``, donation, ``jax.grad`` and ``jax.value_and_grad``,
``shard_map`` and ``NamedSharding``-ed operands on a one-device mesh, the Flax modules, and
every dtype and feature, each against the float64 reference (:func:`tilenorm.testing.float64_norm`
and :func:`tilenorm.testing.rel_error`) on fresh random inputs, each checking that the kernel
path ran (the custom calls in the lowered program).

Every test runs on two backends (the ``backend`` fixture):

- ``cuda`` (marked ``gpu``): the kernel path installed by ``import tilenorm.jax`` (the cuTile
  launches as XLA FFI calls) on the first CUDA device. Run this module without
  tests/test_jax.py, which forces JAX's CPU backend:
  ``python -m pytest -q -m gpu tests/test_jax_gpu.py tests/test_jax_kernel_path.py``.
- ``emulated`` (the CPU): the kernel path's own code (:mod:`tilenorm.jax.kernels`: the
  kernels' (rows, heads, cols) view of every operand, the vmapped dimensions moved next to the
  heads, the launches' layouts, the registered call) with each FFI call replaced by a jnp
  emulation of the kernels, which also checks that the layouts the launches were prepared with
  are the shapes and dtypes of the call's operands and results. It checks the layout plumbing
  and these tests themselves where there is no GPU.

The CuTe DSL kernels' own custom calls (``cute/jax``: ``test_cute_forward_*`` and
``test_cute_cluster_*`` at the end) run on the GPU only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from unittest import mock

import numpy as np
import pytest
import torch

from tests.test_jax_gpu import (
    GRAD_TOL,
    TOL,
    _cuda_device,  # noqa: F401  (needs_cuda's condition is evaluated in this module)
    _fake_decision,
    _rel,
    _unlaunchable_recipe,
    needs_cuda,
)

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tilenorm  # noqa: E402
import tilenorm.jax as tj  # noqa: E402
from tilenorm import dispatch as kernel_dispatch  # noqa: E402
from tilenorm.arguments import dres_apart  # noqa: E402
from tilenorm.jax import cute_ffi, kernels, native, sharding  # noqa: E402
from tilenorm.jax.dispatch import varying_axes  # noqa: E402
from tilenorm.launch import cute  # noqa: E402
from tilenorm.planner import CuteClusterBackwardPlan  # noqa: E402
from tilenorm.testing import float64_norm  # noqa: E402

F32 = np.dtype(np.float32)


# --- the emulated kernels ------------------------------------------------------------------


def _emulated_forward(spec, ops: dict) -> dict:
    """The forward kernel's outputs from its operands, all dense (rows, heads, cols): the
    weight and bias (1, heads or 1, cols), the statistics (rows, heads)."""
    x = ops["x"].astype(F32)
    out = {}
    if "residual" in ops:
        h = (x + ops["residual"].astype(F32)).astype(spec.h_dtype)
        out["residual_out"] = h
        x = h.astype(F32)
    n = x.shape[-1]
    if spec.layer_norm:
        mean = jnp.sum(x, -1) / n
        out["mean"] = mean
        x = x - mean[..., None]
    rstd = jax.lax.rsqrt(jnp.sum(x * x, -1) / n + np.float32(spec.eps))
    y = x * rstd[..., None]
    if "weight" in ops:
        y = y * (ops["weight"].astype(F32) + np.float32(spec.offset))
    if "bias" in ops:
        y = y + ops["bias"].astype(F32)
    out["y"], out["rstd"] = y.astype(spec.out_dtype), rstd
    return out


def _emulated_backward(spec, ops: dict) -> dict:
    """The backward kernels' outputs: dx (and dres where it is written apart), and the weight
    and bias gradients of each kernel head, summed over rows, flat (heads * cols), as
    ``out_a`` (the weight's, else the bias's) and ``out_b``."""
    h, g, rstd = ops["h"].astype(F32), ops["dy"].astype(F32), ops["rstd"][..., None]
    n = h.shape[-1]
    x_hat = (h - ops["mean"][..., None] if "mean" in ops else h) * rstd
    wdy = g * (ops["weight"].astype(F32) + np.float32(spec.offset)) if "weight" in ops else g
    d = wdy - x_hat * (jnp.sum(x_hat * wdy, -1, keepdims=True) / n)
    if spec.layer_norm:
        d = d - jnp.sum(wdy, -1, keepdims=True) / n
    d = d * rstd
    if "dres_in" in ops:
        d = d + ops["dres_in"].astype(F32)
    out = {"dx": d.astype(spec.x_dtype)}
    if dres_apart(spec.x_dtype, spec.residual_dtype):
        out["dres"] = d.astype(spec.residual_dtype)
    sums = ([jnp.sum(g * x_hat, 0)] if "weight" in ops else []) + (
        [jnp.sum(g, 0)] if spec.has_bias else [])
    for name, s in zip(("out_a", "out_b")[:len(sums)], sums, strict=True):
        out[name] = s.reshape(-1)
    return out


class _EmulatedLaunches:
    """The layouts each launch was prepared with (a recipe's ``kernel`` is its index here)."""

    def __init__(self):
        self.layouts: list[dict] = []

    def recipe(self, bound, layouts, decision):
        recipe = _unlaunchable_recipe(bound, layouts, decision)
        self.layouts.append(dict(layouts))
        return dataclasses.replace(recipe, kernel=len(self.layouts) - 1)

    def check_layouts(self, call, operands, results) -> None:
        """Every array a launch was prepared for is an operand or result of the call, of the
        prepared shape and dtype (the partial buffer is one flat result that its groups and
        the reduction view as they please)."""
        placeholder = len(call.operands) + len(results) - 1
        for recipe in call.launches:
            for name, layout in self.layouts[recipe.kernel].items():
                kind, index, _ = call.pointers[name]
                buffer = index if kind == "operand" else len(call.operands) + index
                assert buffer != placeholder, f"{name} points at the placeholder"
                if name.startswith("partial"):
                    continue
                t = operands[index] if kind == "operand" else results[index]
                assert (tuple(t.shape), np.dtype(t.dtype).name) == (
                    layout.shape, layout.dtype), (name, t, layout)

    def emit(self, original):
        """``_Call.emit`` with the FFI call replaced by :meth:`run`, after JAX's own typing of
        the call (its operands' and results' types: shapes, dtypes, ``shard_map``'s varying
        axes) has accepted it."""
        real_ffi_call = jax.ffi.ffi_call

        def emit(call, target, spec):
            def ffi_call(name, results):
                assert name == target

                def run(*operands, **attributes):
                    declared = jax.eval_shape(
                        functools.partial(real_ffi_call(name, results), **attributes),
                        *operands)
                    return self.run(call, target, spec, operands, results, declared)
                return run

            with mock.patch.object(jax.ffi, "ffi_call", ffi_call):
                return original(call, target, spec)
        return emit

    def run(self, call, target, spec, operands, results, declared):
        self.check_layouts(call, operands, results)
        ops = {name: operands[i] for name, (kind, i, _) in call.pointers.items()
               if kind == "operand"}
        emulate = _emulated_forward if target == native.FORWARD_TARGET else _emulated_backward

        def kernel(ops):
            return emulate(spec, ops)

        kernel.__name__ = f"emulated_{target}"  # the lowered program calls it by this name
        outs = jax.jit(kernel)(ops)
        named = {i: name for name, (kind, i, offset) in call.pointers.items()
                 if kind == "result" and offset == 0 and name in outs
                 and i < len(results) - 1}  # the last is the placeholder
        values = []
        for i, r in enumerate(results):
            if i in named:  # of the type the FFI call declares
                value = outs[named[i]]
                assert (value.shape, value.dtype, varying_axes(value)) == (
                    declared[i].shape, declared[i].dtype, varying_axes(declared[i])), (
                    named[i], jax.typeof(value), declared[i])
            else:  # workspaces and the placeholder, which the caller drops
                value = jnp.zeros(r.shape, r.dtype)
            values.append(value)
        return values


# --- the backends ----------------------------------------------------------------------------


@dataclasses.dataclass
class Backend:
    name: str
    device: object
    call_pattern: str  # a custom call of the target in the lowered program

    def put(self, t):
        return None if t is None else jax.device_put(t, self.device)

    def mesh(self, explicit: bool = False) -> Mesh:
        kind = AxisType.Explicit if explicit else AxisType.Auto
        return Mesh(np.array([self.device]), ("data",), axis_types=(kind,))

    def calls(self, text: str, target: str) -> int:
        """How many calls of the kernels' ``target`` the program text holds."""
        return len(re.findall(self.call_pattern.format(re.escape(target)), text))

    def same(self, a, b) -> bool:
        """Whether two programs that run the same kernels on the same operands agree: on the
        GPU to the bit (the kernels' reductions have a fixed order); the emulation is XLA's,
        whose fusions round differently from one program to another, so there within a few
        roundings."""
        if self.name == "cuda":
            return _identical(a, b)
        la, lb = _leaves(a), _leaves(b)
        return jax.tree.structure(a) == jax.tree.structure(b) and all(
            p.dtype == q.dtype and p.shape == q.shape
            and _rel(p, q) <= (1e-6 if p.dtype.itemsize >= 4 else 1e-3)
            for p, q in zip(la, lb, strict=True))

    def lowered_calls(self, fn, *args, target: str = native.FORWARD_TARGET) -> int:
        return self.calls(jax.jit(fn).lower(*args).as_text(), target)

    def compiled_calls(self, jitted, *args, target: str = native.FORWARD_TARGET) -> int:
        """Calls of ``target`` in the program as compiled (after the partitioner ran the
        ``custom_partitioning`` rules); the emulation's are in the lowered program."""
        if self.name == "cuda":
            text = jitted.lower(*args).compile().as_text()
            return len(re.findall(rf'custom_call_target="{re.escape(target)}"', text))
        return self.calls(jitted.lower(*args).as_text(), target)


@pytest.fixture(params=["emulated",
                        pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def backend(request, monkeypatch):
    if request.param == "cuda":
        path = tj.kernel_path()
        assert path is not None and path.platform == "cuda" and \
            path.forward is kernels.forward, "import tilenorm.jax installed no CUDA kernel path"
        yield Backend("cuda", _cuda_device(), r"stablehlo\.custom_call @{}\(")
        return
    launches = _EmulatedLaunches()
    monkeypatch.setattr(kernels, "launch_recipe", launches.recipe)
    monkeypatch.setattr(kernels._Call, "emit", launches.emit(kernels._Call.emit))
    kernels._forward_recipes.cache_clear()
    kernels._backward_recipes.cache_clear()
    previous = tj.set_kernel_path(tj.KernelPath("cpu", _fake_decision, kernels.forward,
                                                kernels.backward))
    yield Backend("emulated", jax.devices("cpu")[0], r"call @emulated_{}\(")
    tj.set_kernel_path(previous)
    kernels._forward_recipes.cache_clear()
    kernels._backward_recipes.cache_clear()


# --- cases and the float64 reference -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: x's shape and dtype, LayerNorm (with a bias) or RMSNorm, a fused residual
    add (with ``prenorm=True``: h is an output) of a residual of ``residual`` dtype stored in
    ``stream`` (default the residual's), a weight per head, Gemma's offset, the weight's and
    bias's dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: object
    layer_norm: bool = False
    residual: object = None
    stream: object = None
    per_head: bool = False
    offset: float = 0.0
    param: object = jnp.float32

    @property
    def eps(self) -> float:
        return 1e-5 if self.layer_norm else 1e-6

    @property
    def pshape(self) -> tuple[int, ...]:
        return tuple(self.shape[-2:]) if self.per_head else (self.shape[-1],)

    @property
    def prenorm(self) -> bool:
        return self.residual is not None

    def norm(self, x, w, b, r):
        if self.layer_norm:
            return tj.layer_norm(x, w, b, self.eps, residual=r, prenorm=self.prenorm,
                                 residual_dtype=self.stream)
        return tj.rms_norm(x, w, self.eps, residual=r, prenorm=self.prenorm,
                           residual_dtype=self.stream, per_head=self.per_head,
                           offset=self.offset)

    def inputs(self, backend, rng):
        """Fresh random (x, w, b, r, dy, dh) on the backend's device."""
        x = rand(rng, self.shape, self.dtype)
        w = rand(rng, self.pshape, self.param, 1.0, 0.3)
        b = rand(rng, self.pshape, self.param, 0.0, 0.2) if self.layer_norm else None
        r = rand(rng, self.shape, self.residual) if self.prenorm else None
        dy = rand(rng, self.shape, self.dtype)
        dh = rand(rng, self.shape, self.stream or self.residual) if self.prenorm else None
        return tuple(backend.put(t) for t in (x, w, b, r, dy, dh))

    def explain(self, x, w, b, r):
        return tj.explain(x, w, r, bias=b, layer_norm=self.layer_norm,
                          per_head=self.per_head, residual_dtype=self.stream)

    def float64(self, x, w, b, r, dy=None, dh=None):
        """:func:`tilenorm.testing.float64_norm` of the call (a weight per head broadcast
        to x, its gradients summed per head)."""
        def t(a):
            return None if a is None else torch.from_numpy(np.asarray(a, np.float64))

        w64, b64 = t(w), t(b)
        if self.per_head:
            w64 = w64.expand(self.shape)
        ref = float64_norm(t(x), w64, b64, self.eps, layer_norm=self.layer_norm,
                           offset=self.offset, residual=t(r), dy=t(dy), dh=t(dh))
        if self.per_head and ref.dweight is not None:
            ref.dweight = ref.dweight.reshape((-1,) + self.pshape).sum(0)
        return ref


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def rand(rng, shape, dtype, loc=0.0, scale=1.0):
    return jnp.asarray(loc + scale * rng.standard_normal(shape), dtype)


def _vjp_step(norm, prenorm: bool):
    """(outputs, gradients of (x, w, b, r)) for the cotangents dy (and dh)."""
    def step(x, w, b, r, dy, dh):
        out, vjp = jax.vjp(norm, x, w, b, r)
        return out, vjp((dy, dh) if prenorm else dy)
    return step


def _leaves(tree) -> list:
    return [np.asarray(t) for t in jax.tree.leaves(tree)]


def _identical(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        p.dtype == q.dtype and p.shape == q.shape and np.array_equal(p, q, equal_nan=False)
        for p, q in zip(la, lb, strict=True))


def _check_grads(case, grads, ref, seed, what=""):
    dx, dw, db, dr = grads
    tol = GRAD_TOL[case.dtype]
    assert _rel(dx, ref.dx) <= tol, (what, "dx", seed)
    assert _rel(dw, ref.dweight) <= tol, (what, "dweight", seed)
    if case.layer_norm:
        assert _rel(db, ref.dbias) <= tol, (what, "dbias", seed)
    if case.prenorm:
        assert _rel(dr, ref.dresidual) <= tol, (what, "dresidual", seed)


BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32
# Shapes are shared between tests: the kernels compile once per layout.
RMS_BF16 = Case("rms-bf16", (16, 4096), BF16)
GEMMA_FP16 = Case("rms-fp16-prenorm-gemma", (3, 7, 1000), FP16, residual=FP16, offset=1.0)
LN_FP32 = Case("ln-fp32-odd", (9, 333), FP32, layer_norm=True)
CASES = [
    RMS_BF16,
    GEMMA_FP16,
    LN_FP32,
    Case("rms-fp32-prenorm-odd", (9, 333), FP32, residual=FP32),
    Case("rms-bf16-fp32-stream", (4, 5, 1000), BF16, residual=BF16, stream=FP32),
    Case("rms-bf16-fp32-residual-gemma", (4, 5, 1000), BF16, residual=FP32, offset=1.0),
    Case("ln-bf16-prenorm", (5, 2, 2000), BF16, layer_norm=True, residual=BF16),
    Case("ln-fp16-prenorm-odd", (6, 77), FP16, layer_norm=True, residual=FP16),
    Case("per-head-bf16-gemma", (6, 8, 128), BF16, per_head=True, offset=1.0),
    Case("per-head-fp32-odd", (5, 3, 72), FP32, per_head=True),
]


# --- every dtype and feature: grad and value_and_grad under jit, reruns ---------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_value_and_grad_under_jit_and_bit_identical_reruns(backend, case):
    rng, seed = fresh_rng()
    x, w, b, r, dy, dh = case.inputs(backend, rng)
    decision = case.explain(x, w, b, r)
    assert decision.uses_kernel, str(decision)

    def loss(x, w, b, r, dy, dh):
        out = case.norm(x, w, b, r)
        y, h = out if case.prenorm else (out, None)
        total = jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
        if h is not None:
            total = total + jnp.sum(h.astype(jnp.float32) * dh.astype(jnp.float32))
        return total

    args = (x, w, b, r, dy, dh)
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    text = value_and_grad.lower(*args).as_text()
    assert backend.calls(text, native.FORWARD_TARGET) == 1
    assert backend.calls(text, native.BACKWARD_TARGET) == 1
    value, grads = first = value_and_grad(*args)
    # y's gradient is dy exactly (dh, h's): the float64 reference of the same cotangents
    ref = case.float64(x, w, b, r, dy, dh)
    ref_value = float((ref.y * torch.from_numpy(np.asarray(dy, np.float64))).sum())
    scale = ref.y.norm() * float(np.linalg.norm(np.asarray(dy, np.float64)))
    if case.prenorm:
        dh64 = torch.from_numpy(np.asarray(dh, np.float64))
        ref_value += float((ref.h * dh64).sum())
        scale = scale + ref.h.norm() * dh64.norm()
    assert _rel(value, ref_value, scale) <= TOL[case.dtype], seed
    _check_grads(case, grads, ref, seed)
    # three runs of the compiled function, forward and backward: the same bits
    for _ in range(2):
        assert _identical(value_and_grad(*args), first), seed
    # jax.grad under jit: the same kernels on the same operands
    assert backend.same(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args), grads), seed
    # the forward's outputs themselves
    out = jax.jit(case.norm)(x, w, b, r)
    y, h = out if case.prenorm else (out, None)
    assert y.dtype == case.dtype and _rel(y, ref.y) <= TOL[case.dtype], seed
    if case.prenorm:
        assert h.dtype == (case.stream or case.residual)
        assert _rel(h, ref.h) <= TOL[case.stream or case.residual], seed


# --- vmap ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "ln"])
def test_vmap_values_and_per_example_weight_gradients(backend, layer_norm):
    rng, seed = fresh_rng()
    case = dataclasses.replace(LN_FP32, shape=(3, 4, 333)) if layer_norm else \
        dataclasses.replace(RMS_BF16, shape=(3, 5, 4096))
    x, w, b, _, dy, _ = case.inputs(backend, rng)
    batch = case.shape[0]

    def norm(x, w, b):
        return case.norm(x, w, b, None)

    def loss(x, w, b, dy):
        return jnp.sum(norm(x, w, b).astype(jnp.float32) * dy.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    forward = jax.vmap(norm, (0, None, None))
    per_example = jax.vmap(grad, (0, None, None, 0))
    summed = jax.grad(lambda x, w, b, dy: jnp.sum(jax.vmap(loss, (0, None, None, 0))(
        x, w, b, dy)), argnums=(0, 1, 2))
    per_row = jax.vmap(per_example, (0, None, None, 0))  # nested: every row its own example
    assert backend.lowered_calls(forward, x, w, b) == 1
    for fn in (per_example, summed, per_row):
        assert backend.lowered_calls(fn, x, w, b, dy, target=native.BACKWARD_TARGET) == 1

    y = jax.jit(forward)(x, w, b)
    g = jax.jit(per_example)(x, w, b, dy)
    refs = [case.float64(x[i], w, b, None, dy[i]) for i in range(batch)]
    loop_y = [jax.jit(norm)(x[i], w, b) for i in range(batch)]
    loop_g = [jax.jit(grad)(x[i], w, b, dy[i]) for i in range(batch)]
    tol, grad_tol = TOL[case.dtype], GRAD_TOL[case.dtype]
    assert _rel(y, torch.stack([r.y for r in refs])) <= tol, seed
    assert _rel(y, jnp.stack(loop_y)) <= tol, seed
    assert g[1].shape == (batch,) + case.pshape  # a weight gradient per example
    for k, name in enumerate(("dx", "dweight", "dbias")[:3 if layer_norm else 2]):
        ref = torch.stack([getattr(r, name) for r in refs])
        assert _rel(g[k], ref) <= grad_tol, (name, seed)
        assert _rel(g[k], jnp.stack([lg[k] for lg in loop_g])) <= grad_tol, (name, seed)
    # grad of vmap: the shared weight's gradient summed over the batch
    whole = case.float64(x, w, b, None, dy)
    sg = jax.jit(summed)(x, w, b, dy)
    assert _rel(sg[0], whole.dx) <= grad_tol and _rel(sg[1], whole.dweight) <= grad_tol, seed
    if layer_norm:
        assert _rel(sg[2], whole.dbias) <= grad_tol, seed
    # nested vmap: per-row weight gradients
    rg = jax.jit(per_row)(x, w, b, dy)
    assert rg[1].shape == case.shape
    x2, dy2 = (np.asarray(t).reshape(-1, case.shape[-1]) for t in (x, dy))
    rows = [case.float64(x2[i:i + 1], w, b, None, dy2[i:i + 1]) for i in range(len(x2))]
    assert _rel(rg[1], torch.stack([r.dweight for r in rows]).reshape(case.shape)) <= \
        grad_tol, seed
    # a weight per example is the reference path's (the kernels take one weight per call)
    wb = backend.put(rand(rng, (batch,) + case.pshape, jnp.float32, 1.0, 0.3))
    assert backend.lowered_calls(jax.vmap(norm, (0, 0, None)), x, wb, b) == 0
    yb = jax.jit(jax.vmap(norm, (0, 0, None)))(x, wb, b)
    assert _rel(yb, torch.stack([case.float64(x[i], wb[i], b, None).y
                                 for i in range(batch)])) <= tol, seed


# --- checkpoint, donation --------------------------------------------------------------------


@pytest.mark.parametrize("case", [LN_FP32, GEMMA_FP16], ids=lambda c: c.name)
def test_checkpoint_recomputes_the_forward_with_the_same_results(backend, case):
    rng, seed = fresh_rng()
    args = case.inputs(backend, rng)
    plain = jax.jit(_vjp_step(case.norm, case.prenorm))
    expected = plain(*args)
    ref = case.float64(*args)
    _check_grads(case, expected[1], ref, seed)
    policies = {"default": (None, 2),
                "nothing_saveable": (jax.checkpoint_policies.nothing_saveable, 2),
                "everything_saveable": (jax.checkpoint_policies.everything_saveable, 1)}
    for name, (policy, forwards) in policies.items():
        step = _vjp_step(jax.checkpoint(case.norm, policy=policy), case.prenorm)
        text = jax.jit(step).lower(*args).as_text()
        # the backward recomputes the forward unless the policy saves its results
        assert backend.calls(text, native.FORWARD_TARGET) == forwards, name
        assert backend.calls(text, native.BACKWARD_TARGET) == 1, name
        # the same kernels on the same operands: the same bits
        assert backend.same(jax.jit(step)(*args), expected), (name, seed)


def test_donated_inputs_leave_the_results_unchanged(backend):
    rng, seed = fresh_rng()
    for case in (RMS_BF16, GEMMA_FP16):
        x, w, b, r, dy, dh = case.inputs(backend, rng)
        expected = jax.jit(case.norm)(x, w, b, r)
        step = _vjp_step(case.norm, case.prenorm)
        expected_step = jax.jit(step)(x, w, b, r, dy, dh)

        def copy(t):
            return None if t is None else jnp.array(t, copy=True)

        # x (and the residual): the buffers of y (and h), which have their shapes
        donated = [copy(x), copy(r)]
        fn = jax.jit(case.norm, donate_argnums=(0, 3) if case.prenorm else (0,))
        assert backend.calls(fn.lower(*donated[:1], w, b, donated[1]).as_text(),
                             native.FORWARD_TARGET) == 1
        out = fn(donated[0], w, b, donated[1])
        assert backend.same(out, expected), (case.name, seed)
        assert all(t.is_deleted() for t in donated if t is not None), case.name
        # the backward: x, dy (and the residual, dh) donated to y, dx (and h, dresidual)
        donated = [copy(t) for t in (x, r, dy, dh)]
        jitted = jax.jit(step, donate_argnums=(0, 3, 4, 5) if case.prenorm else (0, 4))
        operands = (donated[0], w, b, donated[1], donated[2], donated[3])
        assert backend.calls(jitted.lower(*operands).as_text(), native.BACKWARD_TARGET) == 1
        out = jitted(*operands)
        assert backend.same(out, expected_step), (case.name, seed)
        assert donated[0].is_deleted() and donated[2].is_deleted(), case.name
        _check_grads(case, out[1], case.float64(x, w, b, r, dy, dh), seed, case.name)


# --- one-device meshes -----------------------------------------------------------------------


@pytest.mark.parametrize("case", [RMS_BF16, LN_FP32, GEMMA_FP16], ids=lambda c: c.name)
def test_shard_map_on_one_device_psums_the_weight_gradient(backend, case):
    rng, seed = fresh_rng()
    mesh = backend.mesh()
    args = case.inputs(backend, rng)
    spec = P("data")

    def helper(x, w, b, r):
        kw = dict(mesh=mesh, spec=spec, residual=r, prenorm=case.prenorm)
        if case.layer_norm:
            return sharding.layer_norm(x, w, b, case.eps, **kw)
        return sharding.rms_norm(x, w, case.eps, offset=case.offset, **kw)

    def inside(x, w, b, r):  # the op inside a user's shard_map
        out = (spec, spec) if case.prenorm else spec
        params = P() if b is not None else None
        return jax.shard_map(lambda x, w, b, r: case.norm(x, w, b, r), mesh=mesh,
                             in_specs=(spec, P(), params, spec if case.prenorm else None),
                             out_specs=out)(x, w, b, r)

    expected = jax.jit(_vjp_step(case.norm, case.prenorm))(*args)
    for norm in (helper, inside):
        step = _vjp_step(norm, case.prenorm)
        jaxpr = str(jax.make_jaxpr(step)(*args))
        assert re.search(r"psum\S*\[[^\]]*axes=\('data',\)", jaxpr), norm.__name__
        text = jax.jit(step).lower(*args).as_text()
        assert backend.calls(text, native.FORWARD_TARGET) == 1, norm.__name__
        assert backend.calls(text, native.BACKWARD_TARGET) == 1, norm.__name__
        # the same shard, the same kernels; a psum over one device: the same bits
        assert backend.same(jax.jit(step)(*args), expected), (norm.__name__, seed)
    _check_grads(case, expected[1], case.float64(*args), seed)


@pytest.mark.parametrize("case,explicit", [(RMS_BF16, False), (LN_FP32, False),
                                           (GEMMA_FP16, False), (GEMMA_FP16, True)],
                         ids=["rms", "ln", "prenorm-gemma", "prenorm-gemma-explicit-axes"])
def test_named_shardings_on_one_device_match_the_unsharded_call(backend, case, explicit):
    rng, seed = fresh_rng()
    mesh = backend.mesh(explicit)
    args = case.inputs(backend, rng)
    step = jax.jit(_vjp_step(case.norm, case.prenorm))
    expected = step(*args)

    def put(t, rows_split):
        if t is None:
            return None
        return jax.device_put(t, NamedSharding(mesh, P("data") if rows_split else P()))

    x, w, b, r, dy, dh = args
    sharded = (put(x, True), put(w, False), put(b, False), put(r, True), put(dy, True),
               put(dh, True))
    assert backend.compiled_calls(step, *sharded) == 1
    assert backend.compiled_calls(step, *sharded, target=native.BACKWARD_TARGET) == 1
    out = step(*sharded)
    assert backend.same(out, expected), seed
    _check_grads(case, out[1], case.float64(*args), seed)


# --- Flax ------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_flax_modules_run_the_kernel_path(backend, api, kind):
    pytest.importorskip("flax")
    import flax.linen as nn
    from flax import nnx

    import tilenorm.jax.flax as tf

    rng, seed = fresh_rng()
    layer_norm = kind == "LayerNorm"
    case = Case(kind, (4, 7, 1000), BF16, layer_norm=layer_norm)
    x = backend.put(rand(rng, case.shape, BF16, 1.0 if layer_norm else 0.0))
    dy = backend.put(rand(rng, case.shape, jnp.float32))  # y is float32: bf16 x, fp32 params
    names = ("scale", "bias") if layer_norm else ("scale",)

    def perturbed(t):
        return t + backend.put(rand(rng, t.shape, t.dtype, 0.0, 0.3))

    if api == "linen":
        ours, theirs = getattr(tf, kind)(epsilon=case.eps), getattr(nn, kind)(epsilon=case.eps)
        key = jax.random.key(seed)
        params, their_params = ours.init(key, x), theirs.init(key, x)
        assert _identical(params, their_params)  # names, shapes, dtypes, values
        params = jax.tree.map(perturbed, params)

        def apply(params, x):
            return ours.apply(params, x)

        def param_values(params):
            return [params["params"][n] for n in names]
    else:
        ours, theirs = (module(case.shape[-1], epsilon=case.eps, rngs=nnx.Rngs(seed))
                        for module in (getattr(tf, "Nnx" + kind), getattr(nnx, kind)))
        mine, their_state = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
        assert _identical(mine, their_state)
        graphdef, params = nnx.split(ours)
        params = jax.tree.map(perturbed, params)

        def apply(params, x):
            return nnx.merge(graphdef, params)(x)

        def param_values(params):
            return [params[n][...] for n in names]

    def loss(params, x, dy):
        return jnp.sum(apply(params, x) * dy)

    scale, *bias = param_values(params)
    decision = tj.explain(x, scale, bias=bias[0] if bias else None, layer_norm=layer_norm,
                          out_dtype=jnp.float32)
    assert decision.uses_kernel, str(decision)
    assert backend.lowered_calls(apply, params, x) == 1
    grad = jax.grad(loss, argnums=(0, 1))
    assert backend.lowered_calls(grad, params, x, dy, target=native.BACKWARD_TARGET) == 1
    y = jax.jit(apply)(params, x)
    dparams, dx = jax.jit(grad)(params, x, dy)
    ref = case.float64(x, scale, bias[0] if bias else None, None, dy)
    # float32 arithmetic on x shifted by 1 (LayerNorm): a tolerance of 1e-5, as flax's own
    assert y.dtype == jnp.float32 and _rel(y, ref.y) <= 1e-5, seed
    assert dx.dtype == BF16 and _rel(dx, ref.dx) <= GRAD_TOL[BF16], seed
    grads = param_values(dparams)
    assert _rel(grads[0], ref.dweight) <= GRAD_TOL[FP32], seed
    if layer_norm:
        assert _rel(grads[1], ref.dbias) <= GRAD_TOL[FP32], seed


# --- the CuTe DSL kernels: their own XLA FFI calls (cute/jax) --------------------------------
#
# Where the torch side runs the CuTe DSL forward (x of 64 MiB and more at the widths of the
# settings' ``cute_forward`` table: a row a CTA, or from 32768 / 65536 columns a row across a
# cluster of CTAs), the kernel path's forward is the custom call of that kernel's own library
# (tilenorm.jax.cute_ffi); so is the cluster backward (RMSNorm and LayerNorm) at its widths
# (32768, 65536, 131072), whose partial buffer cuTile's column sums reduce. These run on the
# GPU only (the emulation above replaces the cuTile calls' launches, which these calls have
# none of): tests/test_jax_cute_forward.py checks the rest on the CPU.

needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
CUTE_TARGET = re.compile(rf"stablehlo\.custom_call @({cute_ffi.TARGET_PREFIX}[0-9a-f]+)\(")


def _cuda_backend() -> Backend:
    return Backend("cuda", _cuda_device(), r"stablehlo\.custom_call @{}\(")


@pytest.fixture
def cute_forward_runs(monkeypatch):
    """Experimental kernels on (the family runs by default once a GPU run validates it) and
    the CuTe DSL forward from any size of x, so that small shapes take it; yields the custom
    call targets that the kernel path's CuTe forward emitted (a spy)."""
    emitted = []
    emit = kernels._cute_forward

    def spy(spec, plan, target, *operands):
        emitted.append(target)
        return emit(spec, plan, target, *operands)

    monkeypatch.setattr(kernels, "_cute_forward", spy)
    monkeypatch.setattr(kernel_dispatch, "CUTE_FORWARD_MIN_BYTES", 0)
    kernel_dispatch.decide.cache_clear()
    with tilenorm.experimental():
        yield emitted
    kernel_dispatch.decide.cache_clear()


def _one_cute_call(text: str) -> str:
    """The one CuTe forward target the program calls, where it calls no cuTile forward."""
    targets = CUTE_TARGET.findall(text)
    assert len(targets) == 1, targets
    assert f"custom_call @{native.FORWARD_TARGET}(" not in text
    return targets[0]


def _cute_forward_fn(case):
    """The launch-level forward of a case: ``(y, h, mean, rstd)``."""
    def forward(x, w, b, r):
        if case.layer_norm:
            return tj.layer_norm_forward(x, w, b, case.eps, residual=r)
        y, h, rstd = tj.rms_norm_forward(x, w, case.eps, offset=case.offset, residual=r)
        return y, h, None, rstd
    return forward


def _routed(case) -> bool:
    """Whether the settings route the case's width to the CuTe forward (on Hopper): the
    table of x's element size."""
    from tilenorm.settings import SM90

    table = SM90.cute_forward_fp32 if case.dtype == FP32 else SM90.cute_forward
    return case.shape[-1] in table["layer_norm" if case.layer_norm else "rms_norm"]


def _row_errors(out, ref) -> np.ndarray:
    """Each row's relative error (a row that no CTA wrote is garbage, whatever the rest)."""
    out = np.asarray(out, np.float64).reshape(-1, np.shape(out)[-1])
    ref = np.asarray(ref, np.float64).reshape(out.shape)
    return np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1)


CUTE_CASES = [  # every width of the table; fp32 parameters unless ``param``
    Case("cute-rms-bf16-odd-rows", (3, 1001, 4096), BF16),  # a last CTA of one row
    Case("cute-rms-bf16-weight-prenorm", (555, 8192), BF16, residual=BF16, param=BF16),
    Case("cute-rms-fp16-prenorm-gemma", (2, 501, 4096), FP16, residual=FP16, offset=1.0),
    Case("cute-rms-bf16-16384", (129, 16384), BF16),
    Case("cute-rms-bf16-32768-prenorm", (33, 32768), BF16, residual=BF16),
    Case("cute-ln-bf16", (777, 4096), BF16, layer_norm=True),
    Case("cute-ln-fp16-5120", (301, 5120), FP16, layer_norm=True, param=FP16),
    Case("cute-ln-bf16-prenorm", (257, 8192), BF16, layer_norm=True, residual=BF16),
    # the cluster forward: a row across a cluster of CTAs; prime row counts
    Case("cute-rms-bf16-65536-cluster", (67, 65536), BF16, param=BF16),
    Case("cute-rms-bf16-131072-cluster-prenorm-gemma", (2, 37, 131072), BF16, residual=BF16,
         offset=1.0),
    Case("cute-ln-bf16-32768-cluster", (131, 32768), BF16, layer_norm=True, param=BF16),
    Case("cute-ln-bf16-65536-cluster-prenorm", (67, 65536), BF16, layer_norm=True,
         residual=BF16),
    # fp32 x: the fp32 tables' entries, one CTA a row and a row across a cluster
    Case("cute-rms-fp32-5120-prenorm", (301, 5120), FP32, residual=FP32),
    Case("cute-ln-fp32-12288-cluster", (67, 12288), FP32, layer_norm=True),
]


@pytest.mark.gpu
@needs_cuda
@needs_cute
@pytest.mark.parametrize("case", CUTE_CASES, ids=[c.name for c in CUTE_CASES])
def test_cute_forward_values_statistics_and_bit_identical_reruns(cute_forward_runs, case):
    assert _routed(case), case.name
    rng, seed = fresh_rng()
    x, w, b, r, _, _ = case.inputs(_cuda_backend(), rng)
    decision = case.explain(x, w, b, r)
    assert decision.uses_kernel and decision.kernels.cute_forward is not None, str(decision)
    forward = jax.jit(_cute_forward_fn(case))
    target = _one_cute_call(forward.lower(x, w, b, r).as_text())
    assert cute_forward_runs and set(cute_forward_runs) == {target}
    before = cute_ffi.calls_run(target)
    first = jax.block_until_ready(forward(x, w, b, r))
    for _ in range(2):  # the same bits: each row is one CTA's, in a fixed order
        assert _identical(forward(x, w, b, r), first), seed
    assert cute_ffi.calls_run(target) - before == 3, "the CuTe forward's handler ran"
    y, h, mean, rstd = first
    if case.prenorm:  # the residual stream: x + r in float32, rounded once
        assert h.dtype == case.dtype
        exact = (np.asarray(x, np.float32) + np.asarray(r, np.float32)).astype(case.dtype)
        assert np.array_equal(np.asarray(h), exact), seed
    # the statistics describe h as stored (rounded to x's dtype; x itself without a
    # residual), so the reference is h's
    ref = case.float64(h, w, b, None)
    assert y.dtype == case.dtype and y.shape == case.shape
    assert _rel(y, ref.y) <= TOL[case.dtype], seed
    assert _row_errors(y, ref.y).max() <= 2 * TOL[case.dtype], seed
    assert rstd.dtype == F32 and rstd.shape == case.shape[:-1]
    rstd_err = np.abs(np.asarray(rstd, np.float64) / ref.rstd.numpy() - 1)
    assert rstd_err.max() <= 1e-5, (seed, float(rstd_err.max()))
    if case.layer_norm:
        assert mean.dtype == F32 and mean.shape == case.shape[:-1]
        # relative to each row's spread: the mean of a centered row is near 0
        assert _rel(mean, ref.mean, 1 / ref.rstd) <= 1e-5, seed
    else:
        assert mean is None


@pytest.mark.gpu
@needs_cuda
@needs_cute
@pytest.mark.parametrize("case", [CUTE_CASES[1], CUTE_CASES[2], CUTE_CASES[7]],
                         ids=lambda c: c.name)
def test_cute_forward_feeds_cutiles_backward(cute_forward_runs, case):
    """value_and_grad: the CuTe forward's h, mean and rstd are what cuTile's backward
    reads; outputs and gradients against float64, reruns bit-identical."""
    rng, seed = fresh_rng()
    args = case.inputs(_cuda_backend(), rng)
    step = jax.jit(_vjp_step(case.norm, case.prenorm))
    text = step.lower(*args).as_text()
    _one_cute_call(text)
    assert text.count(f"custom_call @{native.BACKWARD_TARGET}(") == 1
    (y, h), grads = first = step(*args)
    ref = case.float64(*args)
    assert _rel(y, ref.y) <= TOL[case.dtype], seed
    assert _rel(h, ref.h) <= TOL[case.dtype], seed
    _check_grads(case, grads, ref, seed)
    assert _identical(step(*args), first), seed


@pytest.mark.gpu
@needs_cuda
@needs_cute
def test_cute_forward_under_vmap_and_shard_map_is_the_plain_call(cute_forward_runs):
    """The vmapped dimension is more rows, a one-device shard_map the same shard: the same
    kernel over the same rows, so the same bits."""
    rng, seed = fresh_rng()
    backend = _cuda_backend()
    case = Case("cute-rms-bf16", (4, 100, 4096), BF16, param=BF16)
    x, w, _, _, _, _ = case.inputs(backend, rng)

    def norm(x, w):
        return tj.rms_norm(x, w, case.eps)

    plain = jax.jit(norm)(x, w)
    mesh = backend.mesh()
    variants = {
        "vmap": jax.vmap(norm, (0, None)),
        "shard_map": jax.shard_map(norm, mesh=mesh, in_specs=(P("data"), P()),
                                   out_specs=P("data")),
    }
    for name, fn in variants.items():
        _one_cute_call(jax.jit(fn).lower(x, w).as_text())
        assert _identical(jax.jit(fn)(x, w), plain), (name, seed)
    assert _rel(plain, case.float64(x, w, None, None).y) <= TOL[BF16], seed


@pytest.mark.gpu
@needs_cuda
@needs_cute
def test_cute_forward_from_the_size_the_torch_side_takes_it():
    """Without the fixture's lower bound: x of 64 MiB takes the CuTe forward (a row less
    keeps cuTile's), as on the torch side."""
    rng, seed = fresh_rng()
    cols = 4096
    rows = kernel_dispatch.CUTE_FORWARD_MIN_BYTES // (2 * cols)
    fn = jax.jit(lambda x, w: tj.rms_norm(x, w, 1e-6))
    backend = _cuda_backend()
    w = backend.put(rand(rng, (cols,), BF16, 1.0, 0.3))
    smaller = jax.ShapeDtypeStruct((rows - 1, cols), BF16)
    with tilenorm.experimental():
        kernel_dispatch.decide.cache_clear()
        assert not CUTE_TARGET.search(fn.lower(smaller, w).as_text())
        x = backend.put(rand(rng, (rows, cols), BF16))
        _one_cute_call(fn.lower(x, w).as_text())
        y = fn(x, w)
    ref = float64_norm(torch.from_numpy(np.asarray(x, np.float64)),
                       torch.from_numpy(np.asarray(w, np.float64)), None, 1e-6)
    assert _rel(y, ref.y) <= TOL[BF16], seed


# --- the CuTe DSL cluster backward ------------------------------------------------------------

CLUSTER_BACKWARD_TARGET = re.compile(
    rf"stablehlo\.custom_call @({cute_ffi.BACKWARD_TARGET_PREFIX}[0-9a-f]+)\(")

CLUSTER_CASES = [  # the cluster backward's widths; prime row counts (37 to 293)
    Case("cluster-rms-bf16-65536", (293, 65536), BF16, param=BF16),
    Case("cluster-rms-bf16-65536-fp32-weight-prenorm-gemma", (67, 65536), BF16,
         residual=BF16, offset=1.0),
    Case("cluster-rms-bf16-131072-prenorm", (3, 37, 131072), BF16, residual=BF16,
         param=BF16),
    Case("cluster-rms-bf16-131072-fp32-weight", (131, 131072), BF16),
    # the one-CTA CuTe forward at 32768, then the cluster backward
    Case("cluster-rms-bf16-32768", (101, 32768), BF16, param=BF16),
    # LayerNorm: the mean an operand, dbias the partial buffer's second group (the first
    # without a weight)
    Case("cluster-ln-bf16-32768-prenorm", (67, 32768), BF16, layer_norm=True, residual=BF16,
         param=BF16),
    Case("cluster-ln-bf16-65536-fp32-params", (131, 65536), BF16, layer_norm=True),
    Case("cluster-ln-bf16-131072", (37, 131072), BF16, layer_norm=True, param=BF16),
    # fp32 x: the fp32 table's cluster backward, the forward one CTA a row or a cluster
    Case("cluster-ln-fp32-8192-prenorm", (131, 8192), FP32, layer_norm=True, residual=FP32),
    Case("cluster-rms-fp32-131072-gemma", (37, 131072), FP32, offset=1.0),
]


#: (case, with affine parameters): Gemma's offset needs a weight; LayerNorm without them is
#: ``elementwise_affine=False`` (a bias alone takes cuTile's forward, as on the torch side).
CLUSTER_STEPS = [(case, weighted) for case in CLUSTER_CASES
                 for weighted in ((True,) if case.offset else (True, False))]


@pytest.mark.gpu
@needs_cuda
@needs_cute
@pytest.mark.parametrize(("case", "weighted"), CLUSTER_STEPS,
                         ids=[c.name + ("" if weighted else "-no-weight")
                              for c, weighted in CLUSTER_STEPS])
def test_cute_cluster_step_values_gradients_and_bit_identical_reruns(cute_forward_runs, case,
                                                                     weighted):
    """A training step at the cluster kernels' widths: the CuTe DSL forward's call (the
    kernel its plan names: cluster, two-pass or one-shot), the cluster backward's (on the
    device's co-resident clusters, as the torch side plans it) and, with a weight or a bias,
    cuTile's column sums over its partial buffer; outputs and gradients against float64,
    reruns bit for bit."""
    from tilenorm.device import max_active_clusters

    rng, seed = fresh_rng()
    x, w, b, r, dy, dh = case.inputs(_cuda_backend(), rng)
    if not weighted:  # no affine parameters (a bias alone takes cuTile's forward)
        w = b = None
    decision = case.explain(x, w, b, r)
    assert decision.uses_kernel, str(decision)
    forward_plan, plan = decision.kernels.cute_forward, decision.kernels.cute_backward
    assert forward_plan is not None, str(decision)
    assert isinstance(plan, CuteClusterBackwardPlan), str(decision)
    rows = math.prod(case.shape[:-1])
    resident = max_active_clusters(0, plan.cluster, plan.threads, plan.ctas_per_sm)
    assert plan.rows == rows and plan.clusters == min(rows, resident)
    for name in (kernel_dispatch.cute_forward_name(forward_plan),
                 kernel_dispatch.CUTE_CLUSTER_BACKWARD_NAME):
        assert name in decision.kernels.kernels and name in str(decision)
    step = jax.jit(_vjp_step(case.norm, case.prenorm))
    args = (x, w, b, r, dy, dh)
    text = step.lower(*args).as_text()
    _one_cute_call(text)
    (target,) = CLUSTER_BACKWARD_TARGET.findall(text)
    # cuTile's row kernels never run; its column sums do where there is a weight or a bias
    assert text.count(f"custom_call @{native.BACKWARD_TARGET}(") == int(
        w is not None or b is not None)
    before = cute_ffi.calls_run(target)
    first = jax.block_until_ready(step(*args))
    for _ in range(2):  # the same bits: a static row-to-cluster map, fixed-order sums
        assert _identical(step(*args), first), seed
    assert cute_ffi.calls_run(target) - before == 3, "the cluster backward's handler ran"
    out, (dx, dw, db, dr) = first
    ref = case.float64(x, w, b, r, dy, dh)
    y, h = out if case.prenorm else (out, None)
    assert _rel(y, ref.y) <= TOL[case.dtype], seed
    if case.prenorm:
        assert _rel(h, ref.h) <= TOL[case.dtype], seed
        assert _rel(dr, ref.dresidual) <= GRAD_TOL[case.dtype], seed
    assert dx.dtype == case.dtype and _rel(dx, ref.dx) <= GRAD_TOL[case.dtype], seed
    assert _row_errors(dx, ref.dx).max() <= 2 * GRAD_TOL[case.dtype], seed
    if weighted:
        assert dw.dtype == w.dtype and _rel(dw, ref.dweight) <= GRAD_TOL[case.dtype], seed
    else:
        assert dw is None
    if case.layer_norm and weighted:
        assert db.dtype == b.dtype and _rel(db, ref.dbias) <= GRAD_TOL[case.dtype], seed
    else:
        assert db is None


@pytest.mark.gpu
@needs_cuda
@needs_cute
def test_cute_cluster_backward_without_the_forward_size_bound():
    """Without the fixture's bound on the forward: x of fewer than 64 MiB keeps cuTile's
    forward (as on the torch side) while the cluster backward runs (it has no such bound
    there either)."""
    rng, seed = fresh_rng()
    case = CLUSTER_CASES[0]
    args = case.inputs(_cuda_backend(), rng)
    assert math.prod(case.shape) * 2 < kernel_dispatch.CUTE_FORWARD_MIN_BYTES
    step = jax.jit(_vjp_step(case.norm, case.prenorm))
    with tilenorm.experimental():
        kernel_dispatch.decide.cache_clear()
        text = step.lower(*args).as_text()
        assert not CUTE_TARGET.search(text) and f"@{native.FORWARD_TARGET}(" in text
        assert len(CLUSTER_BACKWARD_TARGET.findall(text)) == 1
        y, grads = step(*args)
    ref = case.float64(*args)
    assert _rel(y, ref.y) <= TOL[case.dtype], seed
    _check_grads(case, grads, ref, seed)
