"""The ``torch.library`` custom ops: what ``torch.compile`` and ``torch.export`` see.

``tilenorm::norm_fwd`` and ``tilenorm::norm_bwd`` have fake implementations and registered
autograd, so a compiled graph holds them without a break (``fullgraph=True``, dynamic shapes,
CUDA graphs); inside, they run the same prepared calls as eager mode, which pick kernel or
reference at run time. For CUDA tensors the C++ host path registers kernels of its own that
run a call seen before without Python and fall back on :func:`run_forward` /
:func:`run_backward` (NOTES #43), and its own autograd, the formula below in C++ (NOTES #44).
Eager calls do not come here: the dispatcher costs ~8 us a call.

Tracing either op installs :mod:`tilenorm.pytorch.graph_passes` in inductor's config (once):
its post-grad pass hands ``norm_bwd`` a gradient's parts unsummed, for the kernel to add.

The FP8-output ops (:mod:`tilenorm.pytorch.fp8`) are ``tilenorm::fp8_norm_fwd`` and, for FP8
x, ``tilenorm::fp8_norm_input_bwd``, with fake implementations; their autograd is the
module's own Function around them (see there), whose backward of bf16 x is ``norm_bwd``.
"""

from __future__ import annotations

import torch

from tilenorm.arguments import dres_apart
from tilenorm.pytorch import checks, graph_passes, reference
from tilenorm.pytorch.calls import NormSpec, backward_call, forward_call


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


def _spec(layer_norm: bool, dims: int, per_head: bool) -> NormSpec:
    return NormSpec("layer_norm" if layer_norm else "rms_norm", layer_norm, dims, per_head)


def run_forward(x, weight, bias, residual, eps, offset, layer_norm, dims, per_head, out_dtype,
                residual_dtype):
    """norm_fwd's outputs and its prepared call's C++ twin (None where it has none): the
    Python implementation, which the C++ kernels for CUDA tensors fall back on for arguments
    they have not seen (``native_calls.cpp``, NOTES #43)."""
    spec = _spec(layer_norm, dims, per_head)
    checks.check_eps(spec.op, eps)
    checks.check_offset(spec.op, offset, weight)
    call = forward_call(spec, x, weight, bias, residual, out_dtype, residual_dtype,
                        offset != 0)
    y, h, mean, rstd = call.run(x, weight, bias, residual, eps, offset)
    # Contiguous, as the fake says (the reference path keeps a strided x's layout).
    return (y.contiguous(), _empty(x) if residual is None else h.contiguous(),
            _empty(rstd) if mean is None else mean, rstd), call.native


@torch.library.custom_op("tilenorm::norm_fwd", mutates_args=())
def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, eps: float, offset: float, layer_norm: bool,
             dims: int, per_head: bool, out_dtype: torch.dtype | None,
             residual_dtype: torch.dtype | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd); h is empty without a residual and mean empty for RMSNorm. Under
    ``torch.compile`` eps and offset may have been symbolic when traced: they are checked
    here, where they are numbers."""
    return run_forward(x, weight, bias, residual, eps, offset, layer_norm, dims, per_head,
                       out_dtype, residual_dtype)[0]


@norm_fwd.register_fake
def _(x, weight, bias, residual, eps, offset, layer_norm, dims, per_head, out_dtype,
      residual_dtype):
    graph_passes.install()
    acc = reference.compute_dtype(x.dtype)
    rstd = torch.empty(x.shape[:x.dim() - dims], dtype=acc, device=x.device)
    mean = torch.empty_like(rstd) if layer_norm else rstd.new_empty(0)
    h = x.new_empty(0) if residual is None else torch.empty(
        x.shape, dtype=residual_dtype or residual.dtype, device=x.device)
    return torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device), h, mean, rstd


def run_backward(dy, dres_in, h, weight, bias, mean, rstd, offset, dims, per_head, x_dtype,
                 residual_dtype, dy2=None, dy3=None):
    """norm_bwd's outputs and its prepared call's C++ twin, as :func:`run_forward`."""
    spec = _spec(mean is not None, dims, per_head)
    dy_more = tuple(t for t in (dy2, dy3) if t is not None)
    call = backward_call(spec, dy, dres_in, h, weight, bias, offset, x_dtype, residual_dtype,
                         dy_more)
    dx, dres, dweight, dbias = call.run(dy, dres_in, h, weight, bias, mean, rstd, offset,
                                        dy_more)
    # Contiguous, as the fake says (the reference path keeps a strided dy's layout). The
    # residual's gradient is dx itself unless its dtype differs (custom-op outputs may not
    # alias each other: the autograd formula hands dx to both, NOTES #45).
    dx = dx.contiguous()
    dres = dres.contiguous() if call.split else None
    return (dx, _empty(dx) if dres is None else dres,
            _empty(dx) if dweight is None else dweight.contiguous(),
            _empty(dx) if dbias is None else dbias.contiguous()), call.native


@torch.library.custom_op("tilenorm::norm_bwd", mutates_args=())
def norm_bwd(dy: torch.Tensor, dres_in: torch.Tensor | None, h: torch.Tensor,
             weight: torch.Tensor | None, bias: torch.Tensor | None,
             mean: torch.Tensor | None, rstd: torch.Tensor, offset: float, dims: int,
             per_head: bool, x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
             dy2: torch.Tensor | None = None, dy3: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dres, dweight, dbias); absent ones are empty tensors, and so is dres where the
    residual has x's dtype (its gradient is dx). y's gradient is dy, plus dy2 and dy3 where
    given: a compiled graph's gradients of an output that several layers read, which
    :mod:`tilenorm.pytorch.graph_passes` hands over unsummed for the kernel to add."""
    return run_backward(dy, dres_in, h, weight, bias, mean, rstd, offset, dims, per_head,
                        x_dtype, residual_dtype, dy2, dy3)[0]


@norm_bwd.register_fake
def _(dy, dres_in, h, weight, bias, mean, rstd, offset, dims, per_head, x_dtype,
      residual_dtype, dy2=None, dy3=None):
    graph_passes.install()

    def like(p):  # a fresh contiguous tensor each: outputs must not alias
        return h.new_empty(0, dtype=x_dtype) if p is None else torch.empty(
            p.shape, dtype=p.dtype, device=p.device)

    return (torch.empty(h.shape, dtype=x_dtype, device=h.device),
            torch.empty(h.shape, dtype=residual_dtype, device=h.device)
            if dres_apart(x_dtype, residual_dtype) else like(None),
            like(weight), like(bias))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _eps, offset, layer_norm, dims, per_head, _out, _res = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(x if residual is None else h, weight, bias,
                          mean if layer_norm else None, rstd)
    ctx.offset, ctx.x_dtype, ctx.dims, ctx.per_head = offset, x.dtype, dims, per_head
    ctx.residual_dtype = None if residual is None else residual.dtype


def _backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    has_residual = ctx.residual_dtype is not None
    dx, dres, dweight, dbias = torch.ops.tilenorm.norm_bwd(
        dy, dh if has_residual else None, h, weight, bias, mean, rstd, ctx.offset, ctx.dims,
        ctx.per_head, ctx.x_dtype, ctx.residual_dtype)
    if not dres_apart(ctx.x_dtype, ctx.residual_dtype):
        dres = dx
    return (dx, dweight if weight is not None else None, dbias if bias is not None else None,
            dres if has_residual else None, None, None, None, None, None, None, None)


norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# --- FP8 output (tilenorm.fp8) -------------------------------------------------------------
#
# The FP8 ops return plain tensors, laid out contiguous (the fake implementations' promise;
# tilenorm.pytorch.fp8 takes the views the ops return) and MX scales as their bytes (uint8:
# inductor's C++ kernels have no E8M0 type, and a view made in the graph is no kernel);
# absent ones are empty. Their autograd is tilenorm.pytorch.fp8's Function around them,
# which builds the Float8NormTensor: a gradient registered on this op's FP8 output would
# reach it cast to FP8, the reason the subclass exists.


def _fp8_scale_shape(scaling: str, mx_layout: str, rows, cols) -> tuple:
    """The scales of ``rows`` rows of ``cols`` as the op returns them: contiguous, the
    block scales transposed ((cols / 128, rows); the module takes the (rows, cols / 128)
    view with strides (1, rows)), swizzled MX scales padded to 128 x 4 tiles."""
    if scaling in ("tensor", "delayed"):
        return ()
    if scaling == "row":
        return (rows, 1)
    if scaling == "block":
        return (-(-cols // 128), rows)
    groups = -(-cols // 32)
    if mx_layout == "swizzled":
        return (-(-rows // 128) * 128, -(-groups // 4) * 4)
    return (rows, groups)


@torch.library.custom_op("tilenorm::fp8_norm_fwd", mutates_args=())
def fp8_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 residual: torch.Tensor | None, x_scale_inv: torch.Tensor | None,
                 scale: torch.Tensor | None, eps: float, offset: float, layer_norm: bool,
                 scaling: str, fp8_dtype: torch.dtype, transpose: bool, group_size: int,
                 residual_dtype: torch.dtype | None, mx_layout: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale_inv, amax, data_t, scale_inv_t, h, mean, rstd) of
    :func:`tilenorm.fp8.rms_norm_forward` (``layer_norm``: of ``layer_norm_forward``); eps
    and offset checked here, where they are numbers. ``group_size`` 0: x is not FP8."""
    from tilenorm.pytorch import fp8  # here: tilenorm.pytorch.fp8 imports this package

    return fp8.forward_op_outputs(x, weight, bias, residual, x_scale_inv, scale, eps,
                                  offset, layer_norm, scaling, fp8_dtype, transpose,
                                  group_size, residual_dtype, mx_layout)


@fp8_norm_fwd.register_fake
def _(x, weight, bias, residual, x_scale_inv, scale, eps, offset, layer_norm, scaling,
      fp8_dtype, transpose, group_size, residual_dtype, mx_layout):
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    dev = x.device
    scale_dtype = torch.uint8 if scaling == "mx" else torch.float32
    per_tensor = scaling in ("tensor", "delayed")

    def empty(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=dev)

    return (empty(x.shape, fp8_dtype),
            empty(_fp8_scale_shape(scaling, mx_layout, rows, cols), scale_dtype),
            empty(() if per_tensor else 0, torch.float32),
            empty((cols, rows) if transpose else 0, fp8_dtype),
            empty(_fp8_scale_shape(scaling, mx_layout, cols, rows) if transpose
                  and not per_tensor else 0, scale_dtype),
            empty(x.shape if residual is not None else 0,
                  residual_dtype or (residual.dtype if residual is not None else x.dtype)),
            empty(x.shape[:-1] if layer_norm else 0, torch.float32),
            empty(x.shape[:-1], torch.float32))


@torch.library.custom_op("tilenorm::fp8_norm_input_bwd", mutates_args=())
def fp8_norm_input_bwd(dy: torch.Tensor, x: torch.Tensor, x_scale_inv: torch.Tensor,
                       weight: torch.Tensor | None, bias: torch.Tensor | None,
                       mean: torch.Tensor | None, rstd: torch.Tensor, offset: float,
                       group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of a norm of FP8 x (LayerNorm where ``mean`` is given), re-reading
    x and its multipliers; absent ones are empty."""
    from tilenorm.pytorch import fp8  # here: tilenorm.pytorch.fp8 imports this package

    return fp8.input_backward_op_outputs(dy, x, x_scale_inv, weight, bias, mean, rstd,
                                         offset, group_size)


@fp8_norm_input_bwd.register_fake
def _(dy, x, x_scale_inv, weight, bias, mean, rstd, offset, group_size):
    def like(p):
        return dy.new_empty(0) if p is None else torch.empty(p.shape, dtype=p.dtype,
                                                             device=p.device)

    return torch.empty(x.shape, dtype=dy.dtype, device=dy.device), like(weight), like(bias)
