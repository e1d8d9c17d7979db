"""The kernel path for CUDA: tilenorm's cuTile kernels, and the CuTe DSL forwards and cluster
backward, as XLA FFI custom calls.

When a call is traced for CUDA and :func:`tilenorm.dispatch.decide` covers its shard, the
forward (backward) here prepares the shard's kernel launches through
:mod:`tilenorm.launch` (a cubin per operand layout, its parameter block written once; this
needs the GPU, at trace time), registers them with the FFI module
(:mod:`tilenorm.jax.native`) and emits one custom call that launches them on XLA's stream.
Where the torch side runs a CuTe DSL forward (x of 64 MiB and more at the widths it was
measured to gain; the cluster forward, a row across a cluster of CTAs, from 32768 or 65536
columns) or the cluster backward (RMSNorm and LayerNorm from 32768 columns), that kernel
runs instead as the custom call of its own library (:mod:`tilenorm.jax.cute_ffi`), once
their family (``cute/jax``) is validated on a GPU or experimental kernels are on. The cluster
backward's fp32 partial buffer (a row of dweight's and/or dbias's sums per cluster) is a
result of its call, summed by cuTile's fixed-order ``column_sums`` in a call of its own, as
on the torch side.

The kernels index every operand as dense (rows, heads, cols) arrays: the shard's operands are
reshaped to that (free for the usual layouts; the vmapped dimensions of a batching rule's
backward are moved next to the heads, a transpose XLA materializes). The backward's fp32
workspaces (the column-split row sums, the partial buffer of the weight gradients) and a
small buffer whose slices stand in for the operands a compiled variant never touches are
extra results of the custom call that the caller drops: XLA plans them like any buffer
(no allocation while the program runs, nothing held between calls) and they keep the call
a pure function of its operands.

:func:`install` is called on ``import tilenorm.jax`` where a CUDA plugin of jaxlib is
installed; building the FFI module and registering its targets wait until a call is first
traced for CUDA, and where either fails :func:`tilenorm.jax.explain` says why and the
reference path runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tilenorm import dispatch as kernel_dispatch
from tilenorm import validation
from tilenorm.arguments import dres_apart
from tilenorm.jax import dispatch
from tilenorm.jax.spec import NormSpec
from tilenorm.layout import contiguous_strides, view_strides
from tilenorm.planner import CuteClusterBackwardPlan, CuteForwardPlan

if TYPE_CHECKING:
    from tilenorm.launch.cute import ClusterBackwardKey, ForwardKey

#: The slices of the placeholder result, 16 bytes each: more than the operands any kernel
#: leaves unused.
_PLACEHOLDER_SLOTS = 16
_FLOAT32 = np.dtype(np.float32)


# --- the shard as the kernels see it ---------------------------------------------------------


@dataclass(frozen=True)
class _Shape3:
    """How a shard's arrays fold into the kernels' (rows, heads, cols): ``batch`` vmapped
    dimensions, then the row dimensions, then the heads of a per-head weight (1 without),
    then the ``cols`` of the normalized dimensions."""

    batch: int
    rows: int
    heads: int
    cols: int

    @classmethod
    def of(cls, spec: NormSpec, shape: tuple[int, ...]) -> _Shape3:
        cols = math.prod(shape[len(shape) - spec.dims:])
        batch = math.prod(shape[:spec.batch_dims])
        heads = shape[-2] if spec.per_head else 1
        return cls(batch, math.prod(shape) // (batch * heads * cols), heads, cols)

    @property
    def kernel_heads(self) -> int:
        """The kernels' heads: a weight gradient each (every vmapped example's own)."""
        return self.batch * self.heads

    @property
    def shape3(self) -> tuple[int, int, int]:
        return self.rows, self.kernel_heads, self.cols

    def to_kernel(self, t: jax.Array, stats: bool = False) -> jax.Array:
        """An operand (``stats``: a row statistic, without the normalized dimensions) as the
        kernels' dense (rows, heads[, cols])."""
        inner = (self.heads,) if stats else (self.heads, self.cols)
        t = t.reshape((self.batch, self.rows) + inner)
        if self.batch > 1:
            t = jnp.moveaxis(t, 0, 1)
        return t.reshape(self.shape3[:2] if stats else self.shape3)

    def from_kernel(self, t: jax.Array, shape: tuple[int, ...], stats: bool = False
                    ) -> jax.Array:
        """The inverse of :meth:`to_kernel`, back to ``shape``."""
        inner = (self.heads,) if stats else (self.heads, self.cols)
        t = t.reshape((self.rows, self.batch) + inner)
        if self.batch > 1:
            t = jnp.moveaxis(t, 1, 0)
        return t.reshape(shape)

    def param(self, spec: NormSpec, p: jax.Array) -> jax.Array:
        """A weight of the parameter shape as the kernels' (1, heads, cols): one copy per
        vmapped example where the backward keeps their gradients apart."""
        p = jnp.broadcast_to(p, (self.batch,) + p.shape) if self.batch > 1 else p
        return p.reshape(1, self.kernel_heads if spec.per_head or self.batch > 1 else 1,
                         self.cols)


def _layout(dtype, shape: tuple[int, ...]):
    """A dense array's layout as :mod:`tilenorm.launch.driver` takes it (torch's strides for
    size-one dimensions, so that JAX and torch share compiled variants)."""
    from tilenorm.launch.driver import ArrayLayout

    return ArrayLayout(np.dtype(dtype).name, tuple(shape),
                       view_strides(tuple(shape), contiguous_strides(tuple(shape))))


# --- preparing a call ------------------------------------------------------------------------


def launch_recipe(bound, layouts: dict, decision: kernel_dispatch.Decision):
    """The launch recipe of ``bound`` for arrays of ``layouts`` by name (the others get the
    placeholder's layout) on the decision's device: compiled and loaded now, on the GPU."""
    from tilenorm.launch.driver import ArrayLayout, DriverLaunch

    placeholder = ArrayLayout("float32", (1,), (1,))
    arrays = tuple(layouts.get(name, placeholder) for name in bound.arrays)
    return DriverLaunch(bound, arrays, decision.device.index, decision.device.arch).recipe


class _Call:
    """A custom call being prepared: its operands and results, its launches (recipes in
    order), and where each kernel array name points: (operand or result, its index, a byte
    offset)."""

    def __init__(self):
        self.operands: list = []
        self.results: list[jax.ShapeDtypeStruct] = []
        self.pointers: dict[str, tuple[str, int, int]] = {}
        self.launches: tuple = ()

    def operand(self, name: str, t: jax.Array) -> None:
        self.pointers[name] = ("operand", len(self.operands), 0)
        self.operands.append(t)

    def result(self, shape: tuple[int, ...], dtype) -> int:
        self.results.append(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)))
        return len(self.results) - 1

    def at_result(self, name: str, index: int, offset: int = 0) -> None:
        self.pointers[name] = ("result", index, offset)

    def emit(self, target: str, spec: NormSpec) -> list[jax.Array]:
        """Register the launches and emit the custom call; its results but the placeholder."""
        from tilenorm.jax import native

        placeholder = self.result((_PLACEHOLDER_SLOTS * 16,), np.uint8)
        names = sorted({name for r in self.launches for name, _ in r.arrays})
        absent = [name for name in names if name not in self.pointers]
        if len(absent) > _PLACEHOLDER_SLOTS:
            raise ValueError(f"tilenorm: {len(absent)} unused kernel operands; the call has "
                             f"{_PLACEHOLDER_SLOTS} placeholders")
        for slot, name in enumerate(absent):
            self.at_result(name, placeholder, 16 * slot)
        pointers = []
        for name in names:
            kind, index, offset = self.pointers[name]
            buffer = index if kind == "operand" else len(self.operands) + index
            pointers.append(native.Pointer(buffer, offset))
        table = {name: i for i, name in enumerate(names)}
        call = native.register_call([(r, table) for r in self.launches], pointers,
                                    [spec.eps, spec.offset], len(self.operands),
                                    len(self.results))
        operands, results = _varying_alike(self.operands, self.results)
        out = jax.ffi.ffi_call(target, results)(*operands, call=np.int64(call))
        return list(out[:-1])


def _varying_alike(operands: list, results: list) -> tuple[list, list]:
    """Inside ``shard_map`` (with its type checks): the operands cast to vary over the mesh
    axes that any of them varies over (a replicated weight beside a split x), as an FFI
    call's operands must, and the results typed as varying over them too, as the reference
    path's results are (``lax.platform_dependent`` takes the branches' types to agree)."""
    axes = frozenset().union(*(dispatch.varying_axes(t) for t in operands))
    if not axes:
        return operands, results
    operands = [_vary(t, tuple(sorted(axes - dispatch.varying_axes(t)))) for t in operands]
    aval = jax.typeof(operands[0])
    manual = getattr(aval, "manual_axis_type", None)
    if manual is None:  # JAX before 0.10
        typed = {"vma": frozenset(aval.vma)}
    else:  # the type's mesh: shard_map's, whose axes are manual
        typed = {"manual_axis_type": manual,
                 "sharding": NamedSharding(aval.sharding.mesh, PartitionSpec())}
    return operands, [jax.ShapeDtypeStruct(r.shape, r.dtype, **typed) for r in results]


def _vary(t: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``t`` cast to vary over ``axes`` as well (``lax.pcast``; ``lax.pvary`` before)."""
    if not axes:
        return t
    pcast = getattr(jax.lax, "pcast", None)
    return pcast(t, axes, to="varying") if pcast is not None else jax.lax.pvary(t, axes)


@functools.lru_cache(maxsize=1024)
def _forward_recipes(spec: NormSpec, decision: kernel_dispatch.Decision, shape3, dtypes):
    from tilenorm.launch import cutile

    x_dtype, residual_dtype, weight_dtype, bias_dtype = dtypes
    features = cutile.NormFeatures(
        layer_norm=spec.layer_norm, has_weight=weight_dtype is not None,
        per_head_weight=spec.per_head, has_bias=bias_dtype is not None,
        has_residual=residual_dtype is not None, has_offset=spec.offset != 0)
    bound = cutile.bind_forward(decision.forward, features)
    rows, heads, cols = shape3
    param = (1, heads if spec.per_head else 1, cols)
    layouts = {"x": _layout(x_dtype, shape3), "y": _layout(spec.out_dtype, shape3),
               "rstd": _layout(_FLOAT32, shape3[:2])}
    if residual_dtype is not None:
        layouts["residual"] = _layout(residual_dtype, shape3)
        layouts["residual_out"] = _layout(spec.h_dtype, shape3)
    if spec.layer_norm:
        layouts["mean"] = _layout(_FLOAT32, shape3[:2])
    for name, dtype in (("weight", weight_dtype), ("bias", bias_dtype)):
        if dtype is not None:
            layouts[name] = _layout(dtype, param)
    return (launch_recipe(bound, layouts, decision),)


def _dtype(t) -> np.dtype | None:
    return None if t is None else np.dtype(t.dtype)


def forward(spec: NormSpec, decision: kernel_dispatch.Decision, x, residual, weight, bias):
    """``(y, h, mean, rstd)`` of one shard as :func:`tilenorm.jax.reference.forward`, by the
    forward kernel: the CuTe DSL forward where the decision has it, the call's operands
    allow it and its library builds (:func:`cute_forward_variant`), else cuTile's."""
    from tilenorm.jax import native

    variant = cute_forward_variant(spec, decision, x, residual, weight, bias)
    if variant is not None:
        target = _cute_target(variant[1], decision.device.arch, "forward")
        if target is not None:
            return _cute_forward(spec, variant[0], target, x, residual, weight, bias)
    s = _Shape3.of(spec, x.shape)
    call = _Call()
    call.operand("x", s.to_kernel(x))
    if residual is not None:
        call.operand("residual", s.to_kernel(residual))
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            call.operand(name, s.param(spec, p))
    stat = s.shape3[:2]
    call.at_result("y", call.result(s.shape3, spec.out_dtype))
    if residual is not None:
        call.at_result("residual_out", call.result(s.shape3, spec.h_dtype))
    if spec.layer_norm:
        call.at_result("mean", call.result(stat, _FLOAT32))
    call.at_result("rstd", call.result(stat, _FLOAT32))
    call.launches = _forward_recipes(spec, decision, s.shape3,
                                     tuple(_dtype(t) for t in (x, residual, weight, bias)))
    out = call.emit(native.FORWARD_TARGET, spec)
    stat_shape = x.shape[:x.ndim - spec.dims]
    y = s.from_kernel(out.pop(0), x.shape)
    h = s.from_kernel(out.pop(0), x.shape) if residual is not None else None
    mean = s.from_kernel(out.pop(0), stat_shape, stats=True) if spec.layer_norm else None
    rstd = s.from_kernel(out.pop(0), stat_shape, stats=True)
    return y, h, mean, rstd


# --- the CuTe DSL forward ---------------------------------------------------------------------


def _name(dtype) -> str:
    return np.dtype(dtype).name


def cute_forward_variant(spec: NormSpec, decision: kernel_dispatch.Decision, x, residual,
                         weight, bias) -> tuple[CuteForwardPlan, ForwardKey] | None:
    """``(plan, key)`` of the CuTe DSL forward for this shard, or None where cuTile's runs:
    :func:`tilenorm.dispatch.forward_kernel` on the call's facts, as the torch side decides
    (y and h in x's dtype, parameters in x's dtype or fp32, a bias only with a weight of its
    dtype). JAX's operands are dense: the kernel reads them as (rows, cols), a free
    reshape."""
    if decision.cute_forward is None:
        return None
    x_dtype = np.dtype(x.dtype)

    def name(t) -> str | None:
        return None if t is None else _name(t.dtype)

    facts = kernel_dispatch.ForwardFacts.of(
        x_dtype.name, _name(spec.out_dtype), name(weight), name(bias), name(residual),
        None if residual is None else _name(spec.h_dtype), dense=True)
    plan = kernel_dispatch.forward_kernel(decision, facts)
    if not isinstance(plan, CuteForwardPlan):
        return None
    from tilenorm.launch import cute

    key = cute.ForwardKey.of(plan, x_dtype.name,
                             None if weight is None else _name(weight.dtype),
                             bias is not None, spec.layer_norm, spec.offset != 0,
                             residual is not None)
    return plan, key


@functools.lru_cache(maxsize=256)
def _cute_target(key: ForwardKey | ClusterBackwardKey, arch: tuple[int, int], direction: str
                 ) -> str | None:
    """The variant's custom-call target, built and registered once a process; None (with a
    warning, once) where its library cannot be built: cuTile's ``direction`` ("forward",
    "backward") runs instead. A failure is cached too, so that a trace does not compile the
    kernel again to fail."""
    from tilenorm.jax import cute_ffi
    from tilenorm.launch import cute_cache

    try:
        return cute_ffi.target(key, cute_cache.arch_name(arch))
    except (RuntimeError, OSError, AttributeError) as error:
        warnings.warn(f"tilenorm: the CuTe DSL {direction}'s XLA FFI call for {key} is "
                      f"unavailable ({error}); cuTile's {direction} runs", RuntimeWarning,
                      stacklevel=2)
        return None


def _cute_forward(spec: NormSpec, plan: CuteForwardPlan, target: str, x, residual, weight,
                  bias):
    """``(y, h, mean, rstd)`` of one shard by the CuTe DSL forward's custom call: x and the
    residual as (rows, cols), the parameters as (cols,), the statistics (rows,)."""
    rows, cols = plan.rows, plan.cols
    if math.prod(x.shape) != rows * cols:
        raise ValueError(f"tilenorm: the CuTe DSL forward was planned for {rows} x {cols}, "
                         f"the shard is {x.shape}")
    operands = [x.reshape(rows, cols)]
    if residual is not None:
        operands.append(residual.reshape(rows, cols))
    operands += [p.reshape(cols) for p in (weight, bias) if p is not None]
    results = [jax.ShapeDtypeStruct((rows, cols), np.dtype(spec.out_dtype))]
    if residual is not None:
        results.append(jax.ShapeDtypeStruct((rows, cols), np.dtype(spec.h_dtype)))
    if spec.layer_norm:
        results.append(jax.ShapeDtypeStruct((rows,), _FLOAT32))
    results.append(jax.ShapeDtypeStruct((rows,), _FLOAT32))
    operands, results = _varying_alike(operands, results)
    out = list(jax.ffi.ffi_call(target, results)(
        *operands, eps=np.float32(spec.eps), offset=np.float32(spec.offset),
        grid=np.int64(plan.grid)))
    stat_shape = x.shape[:x.ndim - spec.dims]
    y = out.pop(0).reshape(x.shape)
    h = out.pop(0).reshape(x.shape) if residual is not None else None
    mean = out.pop(0).reshape(stat_shape) if spec.layer_norm else None
    rstd = out.pop(0).reshape(stat_shape)
    return y, h, mean, rstd


@dataclass(frozen=True)
class _BackwardRecipes:
    """A backward's launches in order and the workspaces they need."""

    recipes: tuple
    row_sums: tuple[int, ...]  # the row-sums workspace's shape; () without
    partial: tuple[int, ...]  # the partial buffer's shape; () without weight or bias
    partial_b_offset: int  # bytes from the partial buffer to dbias's group


@functools.lru_cache(maxsize=1024)
def _backward_recipes(spec: NormSpec, decision: kernel_dispatch.Decision, shape3, dtypes,
                      has_dh: bool) -> _BackwardRecipes:
    from tilenorm.launch import cutile
    from tilenorm.launch.driver import ArrayLayout

    dy_dtype, h_dtype, weight_dtype, has_bias = dtypes
    has_weight = weight_dtype is not None
    split = dres_apart(spec.x_dtype, spec.residual_dtype)
    # dense_aligned=False: the cuTile plan, whose launches the FFI call runs (not the CuTe
    # DSL one), with 64-bit offsets where they are needed.
    plan = kernel_dispatch.backward_kernel(decision, kernel_dispatch.BackwardFacts(
        has_residual=spec.residual_dtype is not None, has_dres_in=has_dh,
        has_offset=spec.offset != 0, same_dtypes=spec.x_dtype == h_dtype == dy_dtype,
        dense_aligned=False, max_offset=math.prod(shape3) - 1))
    features = cutile.NormFeatures(
        layer_norm=spec.layer_norm, has_weight=has_weight,
        per_head_weight=spec.per_head or spec.batch_dims > 0,
        has_bias=has_bias, has_offset=spec.offset != 0)
    groups = has_weight + has_bias
    partial = cutile.PartialBuffer.of(plan, groups)
    row = cutile.bind_backward(plan, features, has_dh, split)
    layouts = {"dy": _layout(dy_dtype, shape3), "h": _layout(h_dtype, shape3),
               "rstd": _layout(_FLOAT32, shape3[:2]), "dx": _layout(spec.x_dtype, shape3)}
    if has_weight:
        layouts["weight"] = _layout(weight_dtype, (1,) + shape3[1:])
        layouts["partial_w"] = ArrayLayout("float32", *partial.group())
    if has_bias:
        layouts["partial_b"] = ArrayLayout("float32", *partial.group())
    if spec.layer_norm:
        layouts["mean"] = _layout(_FLOAT32, shape3[:2])
    if has_dh:
        layouts["dres_in"] = _layout(spec.h_dtype, shape3)
    if split:
        layouts["dres"] = _layout(spec.residual_dtype, shape3)
    row_sums = ()
    if row.first is not None:
        row_sums = shape3[:2] + row.workspace
        layouts["row_sums"] = _layout(_FLOAT32, row_sums)
    recipes = [launch_recipe(k, layouts, decision) for k in (row.first, row) if k is not None]
    if groups:
        outs = {name: ArrayLayout("float32", (shape3[1] * shape3[2],), (1,))
                for name in ("out_a", "out_b")[:groups]}
        recipes.append(launch_recipe(cutile.bind_reduce(plan, groups), {
            "partial": ArrayLayout("float32", *partial.reduced()), **outs}, decision))
    return _BackwardRecipes(tuple(recipes), row_sums, partial.shape if groups else (),
                            partial.group_offset(int(has_weight)))


def backward(spec: NormSpec, decision: kernel_dispatch.Decision, dy, dh, h, weight, bias,
             mean, rstd):
    """``(dx, dresidual, dweight, dbias)`` of one shard as
    :func:`tilenorm.jax.reference.backward`, by the backward kernels: the weight and bias
    gradients in float32, summed over the shard's rows (per vmapped example). The CuTe DSL
    cluster backward where the decision has it, the call's operands allow it and its library
    builds (:func:`cute_backward_variant`), else cuTile's kernels."""
    from tilenorm.jax import native

    variant = cute_backward_variant(spec, decision, dy, dh, h, weight, bias)
    if variant is not None:
        target = _cute_target(variant[1], decision.device.arch, "backward")
        if target is not None:
            return _cute_cluster_backward(spec, decision, variant[0], target, dy, dh, h,
                                          weight, bias, mean, rstd)
    s = _Shape3.of(spec, h.shape)
    call = _Call()
    call.operand("dy", s.to_kernel(dy))
    if dh is not None:
        call.operand("dres_in", s.to_kernel(dh))
    call.operand("h", s.to_kernel(h))
    if weight is not None:
        call.operand("weight", s.param(spec, weight))
    if mean is not None:
        call.operand("mean", s.to_kernel(mean.astype(_FLOAT32), stats=True))
    call.operand("rstd", s.to_kernel(rstd.astype(_FLOAT32), stats=True))
    prepared = _backward_recipes(spec, decision, s.shape3,
                                 (np.dtype(dy.dtype), np.dtype(h.dtype), _dtype(weight),
                                  bias is not None), dh is not None)
    split = dres_apart(spec.x_dtype, spec.residual_dtype)
    call.at_result("dx", call.result(s.shape3, spec.x_dtype))
    if split:
        call.at_result("dres", call.result(s.shape3, spec.residual_dtype))
    flat = (s.kernel_heads * s.cols,)
    for out_name in ("out_a", "out_b")[:(weight is not None) + (bias is not None)]:
        call.at_result(out_name, call.result(flat, _FLOAT32))
    if prepared.partial:
        partial = call.result((math.prod(prepared.partial),), _FLOAT32)
        call.at_result("partial", partial)
        if weight is not None:
            call.at_result("partial_w", partial)
        if bias is not None:
            call.at_result("partial_b", partial, prepared.partial_b_offset)
    if prepared.row_sums:
        call.at_result("row_sums", call.result(prepared.row_sums, _FLOAT32))
    call.launches = prepared.recipes
    out = call.emit(native.BACKWARD_TARGET, spec)
    dx = s.from_kernel(out.pop(0), h.shape)
    dres = None
    if split:
        dres = s.from_kernel(out.pop(0), h.shape)
    elif spec.residual_dtype is not None:
        dres = dx
    param_shape = h.shape[:spec.batch_dims] + h.shape[h.ndim - spec.param_dims:]
    dweight = out.pop(0).reshape(param_shape) if weight is not None else None
    dbias = out.pop(0).reshape(param_shape) if bias is not None else None
    return dx, dres, dweight, dbias


# --- the CuTe DSL cluster backward ----------------------------------------------------------


def cute_backward_variant(spec: NormSpec, decision: kernel_dispatch.Decision, dy, dh, h,
                          weight, bias
                          ) -> tuple[CuteClusterBackwardPlan, ClusterBackwardKey] | None:
    """``(plan, key)`` of the CuTe DSL cluster backward for this shard, or None where
    cuTile's kernels run: :func:`tilenorm.dispatch.backward_kernel` on the call's facts, as
    the torch side decides (dy, h, dx and the gradient that reached h in x's dtype, the
    residual's gradient dx itself). JAX's operands are dense and XLA's buffers aligned (the
    exported entry checks both): the kernel reads them as (rows, cols), a free reshape."""
    if not isinstance(decision.cute_backward, CuteClusterBackwardPlan):
        return None
    x_dtype = np.dtype(spec.x_dtype)
    facts = kernel_dispatch.BackwardFacts(
        has_residual=spec.residual_dtype is not None, has_dres_in=dh is not None,
        has_offset=spec.offset != 0,
        same_dtypes=(x_dtype == np.dtype(h.dtype) == np.dtype(dy.dtype)
                     and (dh is None or np.dtype(dh.dtype) == x_dtype)),
        dense_aligned=True, max_offset=math.prod(h.shape) - 1,
        dres_apart=dres_apart(spec.x_dtype, spec.residual_dtype))
    plan = kernel_dispatch.backward_kernel(decision, facts)
    if not isinstance(plan, CuteClusterBackwardPlan):
        return None
    from tilenorm.launch import cute

    key = cute.ClusterBackwardKey.of(plan, x_dtype.name,
                                     None if weight is None else _name(weight.dtype),
                                     weight is not None and spec.offset != 0, dh is not None,
                                     spec.layer_norm, bias is not None)
    return plan, key


def _cute_cluster_call(spec: NormSpec, plan: CuteClusterBackwardPlan, target: str, dy, dh, h,
                       weight, bias, mean, rstd) -> tuple[jax.Array, jax.Array | None]:
    """``(dx, partial)`` of one shard by the cluster backward's custom call: h, dy and dh as
    (rows, cols), the weight (cols,), LayerNorm's mean and rstd (rows,); dx (rows, cols) and,
    with a weight or a bias, the fp32 partial buffer (clusters, groups, cols) of dweight's
    then dbias's per-cluster sums, a result of the call that the caller reduces (the bias
    itself is no operand: its gradient needs only dy)."""
    rows, cols = plan.rows, plan.cols
    if math.prod(h.shape) != rows * cols:
        raise ValueError(f"tilenorm: the CuTe DSL backward was planned for {rows} x {cols}, "
                         f"the shard is {h.shape}")
    operands = [h.reshape(rows, cols), dy.reshape(rows, cols)]
    if weight is not None:
        operands.append(weight.reshape(cols))
    if spec.layer_norm:
        operands.append(mean.astype(_FLOAT32).reshape(rows))
    operands.append(rstd.astype(_FLOAT32).reshape(rows))
    if dh is not None:
        operands.append(dh.reshape(rows, cols))
    results = [jax.ShapeDtypeStruct((rows, cols), np.dtype(spec.x_dtype))]
    groups = (weight is not None) + (bias is not None)
    if groups:
        results.append(jax.ShapeDtypeStruct((plan.partial_rows, groups, cols), _FLOAT32))
    operands, results = _varying_alike(operands, results)
    out = jax.ffi.ffi_call(target, results)(
        *operands, eps=np.float32(spec.eps), offset=np.float32(spec.offset),
        grid=np.int64(plan.grid))
    return out[0], out[1] if groups else None


@functools.lru_cache(maxsize=256)
def _column_sums_recipe(decision: kernel_dispatch.Decision, partial_shape: tuple[int, ...]):
    """cuTile's fixed-order reduction of a (slots, groups, cols) partial buffer into one
    (cols,) per group, as the torch side launches it after the CuTe DSL backwards (the
    decision's cuTile plan sets its grid and tiles)."""
    from tilenorm.launch import cutile
    from tilenorm.launch.driver import ArrayLayout

    groups = partial_shape[1]
    outs = {name: ArrayLayout("float32", partial_shape[2:], (1,))
            for name in ("out_a", "out_b")[:groups]}
    return launch_recipe(cutile.bind_reduce(decision.backward, groups), {
        "partial": ArrayLayout("float32", partial_shape, contiguous_strides(partial_shape)),
        **outs}, decision)


def _cute_cluster_backward(spec: NormSpec, decision: kernel_dispatch.Decision,
                           plan: CuteClusterBackwardPlan, target: str, dy, dh, h, weight, bias,
                           mean, rstd):
    """``(dx, dresidual, dweight, dbias)`` of one shard by the cluster backward's call, then
    cuTile's ``column_sums`` over its partial buffer in a call of the FFI module. The sum is
    the kernel torch's side runs, in its fixed order: every rerun, and the torch side on the
    same partial buffer, gets the same bits (XLA's own reduce of the buffer may split its
    columns differently per compile, and, split across blocks, add with atomics)."""
    from tilenorm.jax import native

    dx, partial = _cute_cluster_call(spec, plan, target, dy, dh, h, weight, bias, mean, rstd)
    dx = dx.reshape(h.shape)
    dres = None if spec.residual_dtype is None else dx
    if partial is None:
        return dx, dres, None, None
    call = _Call()
    call.operand("partial", partial)
    for out_name in ("out_a", "out_b")[:partial.shape[1]]:
        call.at_result(out_name, call.result((plan.cols,), _FLOAT32))
    call.launches = (_column_sums_recipe(decision, tuple(partial.shape)),)
    sums = call.emit(native.BACKWARD_TARGET, spec)
    param_shape = h.shape[:spec.batch_dims] + h.shape[h.ndim - spec.param_dims:]
    dweight = sums.pop(0).reshape(param_shape) if weight is not None else None
    dbias = sums.pop(0).reshape(param_shape) if bias is not None else None
    return dx, dres, dweight, dbias


# --- installing ------------------------------------------------------------------------------


@functools.cache
def unavailable() -> str | None:
    """Why the kernel path cannot run in this process (None: it can): the FFI module is
    built and its targets registered here, once."""
    try:
        from tilenorm.jax import native

        native.register_targets()
    except (RuntimeError, OSError, ImportError, AttributeError) as error:
        return f"the XLA FFI module of the kernel path is unavailable ({error})"
    return None


def covers(problem: kernel_dispatch.Problem) -> kernel_dispatch.Decision:
    """:func:`tilenorm.dispatch.decide`, where the FFI module is available, with the CuTe DSL
    forward and cluster backward only where their own calls may run (:func:`_cute_plans`);
    the CuTe DSL row backward has no call here (the backward's FFI call launches cuTile's
    kernels)."""
    reason = unavailable()
    if reason is not None:
        return kernel_dispatch.Decision(op=problem.op, reason=reason)
    decision = kernel_dispatch.decide(problem)
    if not decision.uses_kernel:
        return decision
    cute_forward, cute_backward, why = _cute_plans(problem, decision)
    return dataclasses.replace(decision, cute_forward=cute_forward, cute_backward=cute_backward,
                               reason=decision.reason + why)


def _cute_plans(problem: kernel_dispatch.Problem, decision: kernel_dispatch.Decision
                ) -> tuple[CuteForwardPlan | None, CuteClusterBackwardPlan | None, str]:
    """The decision's CuTe DSL forward and cluster backward where JAX may run them, and what
    to add to its reason. Their XLA FFI calls (:mod:`tilenorm.jax.cute_ffi`) are a family of
    their own, :data:`tilenorm.validation.CUTE_JAX`: they run once a GPU run validated it,
    or where experimental kernels are allowed, and only where their libraries can be built."""
    forward = decision.cute_forward
    backward = decision.cute_backward
    why = ""
    if backward is not None and not isinstance(backward, CuteClusterBackwardPlan):
        why = (f"; the torch side's {kernel_dispatch.cute_backward_name(backward)} has no "
               f"XLA FFI call, so cuTile's backward runs")
        backward = None
    if forward is None and backward is None:
        return None, None, why
    names = " and ".join(
        ([kernel_dispatch.cute_forward_name(forward)] if forward is not None else [])
        + ([kernel_dispatch.cute_backward_name(backward)] if backward is not None else []))
    family = validation.CUTE_JAX
    record = validation.validation_record(family)
    if record is None and not problem.allow_experimental:
        return None, None, why + (
            f"; the XLA FFI calls of the CuTe DSL kernels ({family.name}: {names}) are "
            f"experimental (not yet validated on a GPU at this source) and experimental "
            f"kernels are off, so cuTile's kernels run (TILENORM_EXPERIMENTAL=1 enables them)")
    from tilenorm.jax import cute_ffi

    reason = cute_ffi.unavailable()
    if reason is not None:
        return None, None, why + (f"; the XLA FFI calls of the CuTe DSL kernels ({names}) "
                                  f"cannot be built ({reason}), so cuTile's kernels run")
    status = ("experimental" if record is None
              else f"stable (validated on {record['device']}, {record['date']}, commit "
                   f"{record['commit']})")
    return forward, backward, why + (f"; the CuTe DSL's XLA FFI calls run {names} "
                                     f"({family.name} {status})")


def kernel_path(covers: Callable = covers) -> dispatch.KernelPath:
    """The CUDA kernel path; ``covers`` decides which calls it runs."""
    return dispatch.KernelPath(platform=dispatch.CUDA, covers=covers, forward=forward,
                               backward=backward)


def has_cuda_plugin() -> bool:
    """Whether jaxlib's CUDA plugin is installed (without starting any backend)."""
    return any(importlib.util.find_spec(name) is not None
               for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def install() -> dispatch.KernelPath | None:
    """Install the CUDA kernel path (see the module's docstring); returns the path it
    replaces."""
    return dispatch.set_kernel_path(kernel_path())


def install_default() -> None:
    """What ``import tilenorm.jax`` does: install the kernel path where jaxlib has a CUDA
    plugin and ``TILENORM_NATIVE`` is not 0."""
    if os.environ.get("TILENORM_NATIVE", "1") != "0" and has_cuda_plugin():
        install()
