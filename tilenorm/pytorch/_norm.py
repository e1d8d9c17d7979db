"""The machinery every normalization op shares: per-layout launch recipes, the eager autograd
function, and the ``torch.library`` custom ops.

Eager calls go through a ``torch.autograd.Function`` straight to the cuTile launchers (the
custom-op dispatcher would add ~8 us a call); what a call needs beyond its tensors (checks,
route, plans, the (rows, heads, cols) view) is computed once per layout and looked up after.
Under ``torch.compile`` every call goes through ``tilenorm::norm_fwd`` / ``tilenorm::norm_bwd``,
which have fake implementations and registered autograd (so ``fullgraph=True`` sees no graph
break) and pick kernel or reference inside, at run time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from tilenorm import reference
from tilenorm._experimental import experimental_enabled
from tilenorm.cutile import norm as cutile_norm
from tilenorm.cutile.norm import NormFeatures
from tilenorm.planner import MAX_INT32_OFFSET, CuteBackwardPlan, RowNormPlan
from tilenorm.pytorch._checks import (
    check_dtype,
    check_offset,
    check_param,
    check_residual,
    check_x,
    max_offset,
    view_3d,
)
from tilenorm.pytorch.routing import Route, route_problem
from tilenorm.validation import CUTILE_NORM

#: The CuTe DSL backward's name in routes (kept here: tilenorm.cute.norm imports the CuTe DSL,
#: which happens only when a route runs it).
CUTE_BACKWARD_NAME = "RowNormBackward (CuTe DSL)"


def kernel_names(forward: RowNormPlan, backward: RowNormPlan,
                 cute_backward: CuteBackwardPlan | None = None) -> tuple[str, ...]:
    """The kernels that run a route's forward and backward plans (and its CuTe DSL backward),
    in launch order."""
    cute = (CUTE_BACKWARD_NAME,) if cute_backward is not None else ()
    return tuple(fn.__name__ for plan in (forward, backward)
                 for fn in cutile_norm.kernel_sources(plan)) + cute + (
        cutile_norm.REDUCE_KERNEL_NAME,)


#: Layouts remembered; past this the cache starts over (a long-running job with ever new
#: shapes must not grow without bound).
MAX_RECIPES = 4096


@dataclass(frozen=True)
class Recipe:
    """What a call with one layout of operands runs: the route (kernel plans or reference),
    the feature set, and the (rows, heads, cols) view of x (``copy_x``: x's leading dimensions
    do not fold into two, so the kernels read a contiguous copy). ``kernels`` holds the
    route's kernels bound to their plans, so that a call only passes operands."""

    route: Route
    features: NormFeatures
    shape3: tuple[int, int, int]
    copy_x: bool
    out_dtype: torch.dtype
    residual_dtype: torch.dtype | None
    kernels: BoundKernels | None


@dataclass(frozen=True)
class BoundKernels:
    """A route's kernels with grids and compile-time arguments resolved, per weight offset
    (compiled in only where it is not 0) and, for the backward, per residual gradient input
    and separate residual-dtype gradient output; the reduction per count of dweight and
    dbias."""

    forward: dict[bool, cutile_norm.BoundKernel]
    backward: dict[tuple[bool, bool, bool], cutile_norm.BoundKernel]
    reduce: dict[int, cutile_norm.BoundKernel]
    placeholders: tuple[torch.Tensor, ...]

    @classmethod
    def bind(cls, route: Route, features: NormFeatures, device: torch.device) -> BoundKernels:
        flavours = {o: _with_offset(features, o) for o in (False, True)}
        fwd, bwd = route.forward, route.backward
        return cls(
            forward={o: cutile_norm.bind_forward(fwd, f) for o, f in flavours.items()},
            backward={(o, dres_in, dres): cutile_norm.bind_backward(bwd, f, dres_in, dres)
                      for o, f in flavours.items() for dres_in in (False, True)
                      for dres in (False, True)},
            reduce={groups: cutile_norm.bind_reduce(bwd, groups) for groups in (1, 2)},
            placeholders=cutile_norm.placeholders(device))


def _with_offset(features: NormFeatures, has_offset: bool) -> NormFeatures:
    """The features a call compiles: the weight offset only where it is not 0."""
    return dataclasses.replace(features, has_offset=has_offset)


def _meta(t):
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype, t.device
    return None if t is None else ("not a tensor", type(t))


_RECIPES: dict = {}


def recipe(op: str, layer_norm: bool, per_head_ok: bool, x: torch.Tensor,
           weight: torch.Tensor | None, bias: torch.Tensor | None,
           residual: torch.Tensor | None, out_dtype: torch.dtype | None,
           residual_dtype: torch.dtype | None) -> Recipe:
    """The recipe for this call's layout; checks every operand the first time it is seen."""
    key = (op, _meta(x), _meta(weight), _meta(bias), _meta(residual), out_dtype,
           residual_dtype, experimental_enabled())
    return _cached(key, lambda: _build_recipe(op, layer_norm, per_head_ok, x, weight, bias,
                                              residual, out_dtype, residual_dtype))


def _cached(key, build) -> Recipe:
    found = _RECIPES.get(key)
    if found is None:
        found = build()
        if len(_RECIPES) >= MAX_RECIPES:
            _RECIPES.clear()
        _RECIPES[key] = found
    return found


def check_operands(op, per_head_ok, x, weight, bias, residual, out_dtype, residual_dtype):
    check_x(op, x)
    check_param(op, "weight", weight, x, per_head=per_head_ok)
    check_param(op, "bias", bias, x)
    check_residual(op, residual, x)
    check_dtype(op, "out_dtype", out_dtype)
    check_dtype(op, "residual_dtype", residual_dtype)
    if residual_dtype is not None and residual is None:
        raise ValueError(f"{op}: residual_dtype is the dtype of the residual stream; it needs "
                         f"a residual")


def _build_recipe(op, layer_norm, per_head_ok, x, weight, bias, residual, out_dtype,
                  residual_dtype) -> Recipe:
    check_operands(op, per_head_ok, x, weight, bias, residual, out_dtype, residual_dtype)
    if residual is not None and residual_dtype is None:
        residual_dtype = residual.dtype
    return _make_recipe(op, layer_norm, x, weight, bias, residual, out_dtype, residual_dtype)


def _make_recipe(op, layer_norm, x, weight, bias, residual, out_dtype, residual_dtype
                 ) -> Recipe:
    per_head = weight is not None and weight.dim() == 2
    features = NormFeatures(layer_norm=layer_norm, has_weight=weight is not None,
                            per_head_weight=per_head, has_bias=bias is not None,
                            has_residual=residual is not None)
    view = view_3d(tuple(x.shape), x.stride(), keep_heads=per_head)
    copy_x = view is None
    if copy_x:
        heads = x.shape[-2] if per_head else 1
        shape3 = (x.numel() // (heads * x.shape[-1]), heads, x.shape[-1])
    else:
        shape3 = view[0]
    offsets = [x.numel() - 1 if copy_x else max_offset(*view)]
    if residual is not None:
        offsets.append(max_offset(tuple(residual.shape), residual.stride()))
    dtypes = tuple(t.dtype for t in (x, weight, bias, residual) if t is not None)
    dtypes += tuple(d for d in (out_dtype, residual_dtype) if d is not None)
    route = route_problem(op, CUTILE_NORM, kernel_names, x.device, dtypes, *shape3, per_head,
                          max(offsets), experimental_enabled())
    kernels = BoundKernels.bind(route, features, x.device) if route.uses_kernel else None
    return Recipe(route=route, features=features, shape3=shape3, copy_x=copy_x,
                  out_dtype=out_dtype or x.dtype, residual_dtype=residual_dtype,
                  kernels=kernels)


def backward_recipe(layer_norm: bool, h: torch.Tensor, weight: torch.Tensor | None,
                    bias: torch.Tensor | None) -> Recipe:
    """The recipe of a backward over the normalized input ``h`` (x, or the residual stream
    of a fused residual add, whose dtype may differ from the weight's)."""
    key = ("backward", layer_norm, _meta(h), _meta(weight), _meta(bias),
           experimental_enabled())
    op = "layer_norm" if layer_norm else "rms_norm"
    return _cached(key, lambda: _make_recipe(op, layer_norm, h, weight, bias, None, None, None))


def _as_shape3(t: torch.Tensor, shape3) -> torch.Tensor:
    try:
        return t.view(shape3)
    except RuntimeError:  # strides that do not fold like x's: the kernels read a copy
        return t.reshape(shape3)


def _on_device(x: torch.Tensor):
    # cuTile launches into the current CUDA context: make it x's device.
    if x.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(x.device)


def kernel_forward(rc: Recipe, x, weight, bias, residual, eps: float, offset: float):
    """(y, h, mean, rstd) from the kernels; h is x without a residual, mean None for RMSNorm.
    mean and rstd have shape x.shape[:-1]."""
    shape3, dev, ph = rc.shape3, x.device, rc.kernels.placeholders
    x3 = x.reshape(shape3) if rc.copy_x else x.view(shape3)
    y = torch.empty(shape3, dtype=rc.out_dtype, device=dev)
    rstd = torch.empty(shape3[:2], dtype=torch.float32, device=dev)
    mean = torch.empty(shape3[:2], dtype=torch.float32, device=dev) \
        if rc.features.layer_norm else None
    h = r3 = None
    if residual is not None:
        r3 = _as_shape3(residual, shape3)
        h = torch.empty(shape3, dtype=rc.residual_dtype, device=dev)
    # Weights and biases are (N,) or (H, N); the kernels take them as (1, 1 or H, N).
    with _on_device(x):
        cutile_norm.run_forward(
            rc.kernels.forward[offset != 0], cutile_norm.stream_handle(dev), ph, x3, r3,
            None if weight is None else weight.view(1, -1, shape3[2]),
            None if bias is None else bias.view(1, -1, shape3[2]), y, h, mean, rstd, eps,
            offset)
    stat_shape = x.shape[:-1]
    return (y.view(x.shape), x if h is None else h.view(x.shape),
            None if mean is None else mean.view(stat_shape), rstd.view(stat_shape))


def kernel_backward(rc: Recipe, dy, dres_in, h, weight, bias, mean, rstd, offset: float,
                    x_dtype: torch.dtype, residual_in_dtype: torch.dtype | None):
    """(dx, dres, dweight, dbias) from the kernels. dres (the residual input's gradient) is
    dx itself when the residual has x's dtype, None without a residual."""
    shape3, dev, ph = rc.shape3, h.device, rc.kernels.placeholders
    h3 = h.reshape(shape3) if rc.copy_x and residual_in_dtype is None else _as_shape3(h, shape3)
    dy3 = _as_shape3(dy, shape3)
    cute_plan = rc.route.cute_backward
    if (cute_plan is not None and dres_in is None and residual_in_dtype is None
            and offset == 0 and x_dtype == h.dtype == dy.dtype):
        h2, dy2 = h3[:, 0], dy3[:, 0]
        if _cute_norm().takes(h2, dy2):
            return _cute_backward(rc, cute_plan, h2, dy2, weight, bias, mean, rstd, h.shape)
    dres_in3 = None if dres_in is None else _as_shape3(dres_in, shape3)
    split = residual_in_dtype is not None and residual_in_dtype != x_dtype
    kernel = rc.kernels.backward[offset != 0, dres_in3 is not None, split]
    plan = rc.route.backward
    if plan.index_bits == 32 and not (dy3.is_contiguous() and h3.is_contiguous() and (
            dres_in3 is None or dres_in3.is_contiguous())):
        widest = max(max_offset(tuple(t.shape), t.stride()) for t in (dy3, h3) +
                     (() if dres_in3 is None else (dres_in3,)))
        if widest > MAX_INT32_OFFSET:
            plan = dataclasses.replace(plan, index_bits=64)
            kernel = cutile_norm.bind_backward(plan, _with_offset(rc.features, offset != 0),
                                               dres_in3 is not None, split)
    dx = torch.empty(shape3, dtype=x_dtype, device=dev)
    dres = torch.empty(shape3, dtype=residual_in_dtype, device=dev) if split else None
    dweight = None if weight is None else torch.empty_like(weight)
    dbias = None if bias is None else torch.empty_like(bias)
    partial = cutile_norm.partial_buffer(plan, dweight, dbias)
    reduce = rc.kernels.reduce.get(cutile_norm.gradient_groups(dweight, dbias))
    stat = shape3[:2]
    with _on_device(h):
        cutile_norm.run_backward(
            kernel, reduce, cutile_norm.stream_handle(dev), ph, dy3, h3,
            None if weight is None else weight.view(1, -1, shape3[2]),
            None if mean is None else mean.view(stat), rstd.view(stat), dres_in3, dx, dres,
            partial, dweight, dbias, offset)
    dx = dx.view(h.shape)
    if residual_in_dtype is not None:
        dres = dx if not split else dres.view(h.shape)
    return dx, dres, dweight, dbias


def _cute_norm():
    from tilenorm.cute import norm

    return norm


def _cute_backward(rc: Recipe, plan: CuteBackwardPlan, h2, dy2, weight, bias, mean, rstd,
                   shape) -> tuple:
    """kernel_backward on the CuTe DSL kernel: (rows, cols) views h2 and dy2."""
    dev = h2.device
    dx = torch.empty(h2.shape, dtype=h2.dtype, device=dev)
    dweight = None if weight is None else torch.empty_like(weight)
    dbias = None if bias is None else torch.empty_like(bias)
    groups = cutile_norm.gradient_groups(dweight, dbias)
    partial = (torch.empty((plan.partial_rows, groups, plan.cols), dtype=torch.float32,
                           device=dev) if groups else None)
    rows = h2.shape[0]
    with _on_device(h2):
        _cute_norm().run_backward(plan, h2, dy2, weight, bias,
                                  None if mean is None else mean.reshape(rows), rstd.reshape(rows),
                                  dx, partial)
        if partial is not None:
            cutile_norm.run_reduce(rc.kernels.reduce[groups], cutile_norm.stream_handle(dev),
                                   rc.kernels.placeholders, partial, dweight, dbias)
    return dx.view(shape), None, dweight, dbias


def _forward(rc: Recipe, x, weight, bias, residual, eps, offset):
    if rc.route.uses_kernel:
        return kernel_forward(rc, x, weight, bias, residual, eps, offset)
    return reference.norm_forward(x, weight, bias, eps, layer_norm=rc.features.layer_norm,
                                  offset=offset, residual=residual,
                                  residual_dtype=rc.residual_dtype, out_dtype=rc.out_dtype)


def _backward(rc: Recipe, dy, dres_in, h, weight, bias, mean, rstd, offset, x_dtype,
              residual_in_dtype):
    if rc.route.uses_kernel:
        return kernel_backward(rc, dy, dres_in, h, weight, bias, mean, rstd, offset, x_dtype,
                               residual_in_dtype)
    dx, dh, dweight, dbias = reference.norm_backward(dy, dres_in, h, weight, bias, mean, rstd,
                                                     offset=offset, x_dtype=x_dtype)
    dres = None if residual_in_dtype is None else dh.to(residual_in_dtype)
    return dx, dres, dweight, dbias


class NormFunction(torch.autograd.Function):
    """Eager autograd over the kernels: returns y, or (y, h) with a residual."""

    @staticmethod
    def forward(ctx, rc: Recipe, x, weight, bias, residual, eps, offset):
        y, h, mean, rstd = kernel_forward(rc, x, weight, bias, residual, eps, offset)
        ctx.save_for_backward(h, weight, bias, mean, rstd)
        ctx.rc, ctx.offset, ctx.x_dtype = rc, offset, x.dtype
        ctx.residual_in_dtype = None if residual is None else residual.dtype
        if residual is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx, dy, dres_in=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dres, dweight, dbias = kernel_backward(
            ctx.rc, dy, dres_in, h, weight, bias, mean, rstd, ctx.offset, ctx.x_dtype,
            ctx.residual_in_dtype)
        return None, dx, dweight, dbias, dres, None, None


# --- torch.library custom ops (the torch.compile path) -------------------------------------


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


@torch.library.custom_op("tilenorm::norm_fwd", mutates_args=())
def norm_fwd_op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                residual: torch.Tensor | None, eps: float, offset: float, layer_norm: bool,
                out_dtype: torch.dtype | None, residual_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd); h is empty without a residual and mean empty for RMSNorm."""
    op = "layer_norm" if layer_norm else "rms_norm"
    rc = recipe(op, layer_norm, True, x, weight, bias, residual, out_dtype, residual_dtype)
    y, h, mean, rstd = _forward(rc, x, weight, bias, residual, eps, offset)
    return (y, _empty(x) if residual is None else h, _empty(rstd) if mean is None else mean,
            rstd)


@norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps, offset, layer_norm, out_dtype, residual_dtype):
    acc = reference.compute_dtype(x.dtype)
    rstd = torch.empty(x.shape[:-1], dtype=acc, device=x.device)
    mean = torch.empty_like(rstd) if layer_norm else rstd.new_empty(0)
    h = x.new_empty(0) if residual is None else torch.empty(
        x.shape, dtype=residual_dtype or residual.dtype, device=x.device)
    return torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device), h, mean, rstd


@torch.library.custom_op("tilenorm::norm_bwd", mutates_args=())
def norm_bwd_op(dy: torch.Tensor, dres_in: torch.Tensor | None, h: torch.Tensor,
                weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor | None, rstd: torch.Tensor, offset: float,
                x_dtype: torch.dtype, residual_in_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dres, dweight, dbias); absent ones are empty tensors."""
    rc = backward_recipe(mean is not None, h, weight, bias)
    dx, dres, dweight, dbias = _backward(rc, dy, dres_in, h, weight, bias, mean, rstd, offset,
                                         x_dtype, residual_in_dtype)
    if dres is dx:
        dres = dx.clone()  # custom-op outputs may not alias each other
    return (dx, _empty(dx) if dres is None else dres,
            _empty(dx) if dweight is None else dweight, _empty(dx) if dbias is None else dbias)


@norm_bwd_op.register_fake
def _(dy, dres_in, h, weight, bias, mean, rstd, offset, x_dtype, residual_in_dtype):
    def like(p):  # a fresh tensor each: outputs must not alias
        return h.new_empty(0, dtype=x_dtype) if p is None else torch.empty_like(p)

    return (torch.empty(h.shape, dtype=x_dtype, device=h.device),
            like(None) if residual_in_dtype is None else torch.empty(
                h.shape, dtype=residual_in_dtype, device=h.device),
            like(weight), like(bias))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _eps, offset, layer_norm, _out, _res = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(x if residual is None else h, weight, bias,
                          mean if layer_norm else None, rstd)
    ctx.offset, ctx.x_dtype = offset, x.dtype
    ctx.residual_in_dtype = None if residual is None else residual.dtype


def _custom_op_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dres, dweight, dbias = torch.ops.tilenorm.norm_bwd(
        dy, dh if ctx.residual_in_dtype is not None else None, h, weight, bias, mean, rstd,
        ctx.offset, ctx.x_dtype, ctx.residual_in_dtype)
    return (dx, dweight if weight is not None else None, dbias if bias is not None else None,
            dres if ctx.residual_in_dtype is not None else None, None, None, None, None, None)


norm_fwd_op.register_autograd(_custom_op_backward, setup_context=_setup_context)


def apply(op: str, layer_norm: bool, per_head_ok: bool, x, weight, bias, residual, eps: float,
          offset: float, out_dtype, residual_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) of the op with autograd: kernels where the route says so, else the reference.
    h is x without a residual. Checks every operand (once per layout in eager mode)."""
    if torch.compiler.is_compiling():
        # The op routes inside its implementation, so Dynamo traces no routing code.
        check_operands(op, per_head_ok, x, weight, bias, residual, out_dtype, residual_dtype)
        y, h, _, _ = torch.ops.tilenorm.norm_fwd(x, weight, bias, residual, eps, offset,
                                                 layer_norm, out_dtype, residual_dtype)
        return y, x if residual is None else h
    rc = recipe(op, layer_norm, per_head_ok, x, weight, bias, residual, out_dtype,
                residual_dtype)
    if not rc.route.uses_kernel:
        return reference.norm(x, weight, bias, eps, layer_norm=layer_norm, offset=offset,
                              residual=residual, residual_dtype=rc.residual_dtype,
                              out_dtype=rc.out_dtype)
    out = NormFunction.apply(rc, x, weight, bias, residual, eps, offset)
    return (out, x) if residual is None else out


def launch_forward(op, layer_norm, per_head_ok, x, weight, bias, residual, eps, offset,
                   out_dtype, residual_dtype):
    """Launch-level forward without autograd: (y, h, mean, rstd) as in kernel_forward."""
    rc = recipe(op, layer_norm, per_head_ok, x, weight, bias, residual, out_dtype,
                residual_dtype)
    return _forward(rc, x, weight, bias, residual, eps, offset)


def launch_backward(op, layer_norm, dy, dres_in, h, weight, bias, mean, rstd, offset, x_dtype,
                    residual_in_dtype):
    """Launch-level backward: (dx, dres, dweight, dbias) as in kernel_backward, after checking
    the operands against h (the forward's normalized input; once per layout)."""
    offset = check_offset(op, offset, weight)
    key = ("launch_backward", layer_norm, _meta(dy), _meta(dres_in), _meta(h), _meta(weight),
           _meta(bias), _meta(mean), _meta(rstd), x_dtype, residual_in_dtype,
           experimental_enabled())
    rc = _cached(key, lambda: _checked_backward_recipe(op, layer_norm, dy, dres_in, h, weight,
                                                       bias, mean, rstd, x_dtype,
                                                       residual_in_dtype))
    return _backward(rc, dy, dres_in, h, weight, bias, mean, rstd, offset, x_dtype or h.dtype,
                     residual_in_dtype)


def _checked_backward_recipe(op, layer_norm, dy, dres_in, h, weight, bias, mean, rstd,
                             x_dtype, residual_in_dtype) -> Recipe:
    check_x(op, h)
    check_dtype(op, "x_dtype", x_dtype)
    check_dtype(op, "residual_dtype", residual_in_dtype)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.device != h.device or p.shape[-1] != h.shape[-1]):
            raise ValueError(f"{op}: {name} of shape {tuple(p.shape)} on {p.device} does not "
                             f"match h of shape {tuple(h.shape)} on {h.device}")
    for name, t in (("dy", dy), ("dh", dres_in)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != h.shape
                              or t.device != h.device):
            raise ValueError(f"{op}: {name} must be a tensor of h's shape {tuple(h.shape)} on "
                             f"{h.device}")
    stat_dtype = reference.compute_dtype(h.dtype)
    for name, t in (("rstd", rstd), ("mean", mean)):
        if (t is not None or name == "rstd") and (
                not isinstance(t, torch.Tensor) or t.shape != h.shape[:-1]
                or t.dtype != stat_dtype):
            raise ValueError(f"{op}: {name} must be the forward's, of shape "
                             f"{tuple(h.shape[:-1])} and dtype {stat_dtype}")
    return backward_recipe(layer_norm, h, weight, bias)
