"""RMSNorm for PyTorch: the functional op, its autograd, and its ``torch.library`` custom ops.

Eager calls go through a ``torch.autograd.Function`` straight to the cuTile launchers (the
custom-op dispatcher would add ~8 us a call). Under ``torch.compile`` every call goes through
the ``tilenorm::rms_norm_fwd`` / ``tilenorm::rms_norm_bwd`` custom ops, which have fake
implementations and registered autograd (so ``fullgraph=True`` sees no graph break) and pick
kernel or reference inside, at run time.
"""

from __future__ import annotations

import contextlib

import torch

from tilenorm import reference
from tilenorm.cutile import rms_norm as cutile_rms_norm
from tilenorm.pytorch._checks import as_kernel_rows, check_eps, check_param, check_x
from tilenorm.pytorch.routing import Route, kernel_plan, route
from tilenorm.validation import CUTILE_RMS_NORM

OP = "rms_norm"
KERNEL_NAMES = (
    ("rms_norm_fwd_single", "rms_norm_bwd_single", "column_sum"),
    ("rms_norm_fwd_chunked", "rms_norm_bwd_chunked", "column_sum"),
)


def _route(x: torch.Tensor) -> Route:
    return route(OP, CUTILE_RMS_NORM, KERNEL_NAMES, x)


def _on_device(x: torch.Tensor):
    # cuTile launches into the current CUDA context: make it x's device.
    if x.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(x.device)


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, rstd, the (M, N) input the backward reads) from the kernels, or from the reference
    where the route says so."""
    if not _route(x).uses_kernel:
        y, rstd = reference.rms_norm_forward(x, weight, eps)
        return y, rstd, x
    x2d = as_kernel_rows(x)
    plan = kernel_plan(x2d, "forward")
    with _on_device(x):
        y, rstd = cutile_rms_norm.forward(plan, x2d, weight, eps)
    return y.view(x.shape), rstd.view(x.shape[:-1]), x2d


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
              rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not _route(x).uses_kernel:
        return reference.rms_norm_backward(dy, x, weight, rstd)
    x2d = as_kernel_rows(x)
    args = (kernel_plan(x2d, "backward"), as_kernel_rows(dy), x2d, weight, rstd.view(-1))
    with _on_device(x):
        dx, dweight = cutile_rms_norm.backward(*args)
    return dx.view(dy.shape), dweight


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd, x2d = _forward(x, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dweight = _backward(dy.reshape(x2d.shape), x2d, weight, rstd)
        return dx.view(dy.shape), dweight, None


@torch.library.custom_op("tilenorm::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of RMSNorm over x's last dimension; rstd has shape x.shape[:-1]."""
    y, rstd, _ = _forward(x, weight, eps)
    return y, rstd


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape[:-1], dtype=reference.compute_dtype(x.dtype), device=x.device))


@torch.library.custom_op("tilenorm::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight); dweight is an empty tensor when there is no weight."""
    dx, dweight = _backward(dy, x, weight, rstd)
    if dweight is None:
        dweight = torch.empty(0, dtype=x.dtype, device=x.device)
    return dx, dweight


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd):
    dweight_shape, dweight_dtype = ((0,), x.dtype) if weight is None else (weight.shape,
                                                                           weight.dtype)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(dweight_shape, dtype=dweight_dtype, device=x.device))


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _custom_op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.tilenorm.rms_norm_bwd(dy, x, weight, rstd)
    return dx, (dweight if weight is not None else None), None


_rms_norm_fwd_op.register_autograd(_custom_op_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    Any leading shape ``(..., N)`` and any strides; returns x's shape and dtype. Arithmetic is
    fp32 (fp64 for fp64 input). Differentiable in x and weight. CUDA tensors in bf16/fp16/fp32
    run the cuTile kernels when they are stable or experimental kernels are enabled;
    everything else takes the torch reference path (see :func:`tilenorm.explain`).
    """
    check_x(OP, x)
    check_param(OP, "weight", weight, x)
    eps = check_eps(OP, eps)
    if torch.compiler.is_compiling():
        # The op routes inside its implementation, so Dynamo traces no routing code.
        return torch.ops.tilenorm.rms_norm_fwd(x, weight, eps)[0]
    if not _route(x).uses_kernel:
        return reference.rms_norm(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, eps)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch-level forward without autograd: (y, rstd), rstd of shape x.shape[:-1] (fp32;
    fp64 for fp64 input). For frameworks that keep their own autograd graph."""
    check_x(OP, x)
    check_param(OP, "weight", weight, x)
    y, rstd, _ = _forward(x, weight, check_eps(OP, eps))
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch-level backward: (dx, dweight) from :func:`rms_norm_forward`'s rstd; dweight is
    None without a weight."""
    check_x(OP, x)
    check_param(OP, "weight", weight, x)
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        raise ValueError(f"{OP}: dy must match x in shape, dtype and device, got "
                         f"{tuple(dy.shape)} {dy.dtype} {dy.device} for x {tuple(x.shape)} "
                         f"{x.dtype} {x.device}")
    if rstd.shape != x.shape[:-1] or rstd.dtype != reference.compute_dtype(x.dtype):
        raise ValueError(f"{OP}: rstd must be the forward's, of shape {tuple(x.shape[:-1])} "
                         f"and dtype {reference.compute_dtype(x.dtype)}")
    return _backward(dy, x, weight, rstd)


def explain(x: torch.Tensor, weight: torch.Tensor | None = None) -> Route:
    """What :func:`rms_norm` would run for ``x`` and ``weight``, and why (``str()`` it)."""
    check_x(OP, x)
    check_param(OP, "weight", weight, x)
    return _route(x)
