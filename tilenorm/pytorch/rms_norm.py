"""RMSNorm for PyTorch: the functional op (with Gemma's weight offset, a fused residual add,
per-head weights and an output dtype), its launch-level forward and backward, and ``explain``.
Autograd, custom ops and routing live in :mod:`tilenorm.pytorch._norm`."""

from __future__ import annotations

import torch

from tilenorm.pytorch import _norm
from tilenorm.pytorch._checks import check_eps, check_offset
from tilenorm.pytorch.routing import Route

OP = "rms_norm"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             offset: float = 0.0, residual: torch.Tensor | None = None, prenorm: bool = False,
             residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    - ``weight``: None, (N,), or (H, N) for x of shape (..., H, N): one weight per head
      (QK-norm); a (N,) weight on (..., H, N) normalizes each head with the same weight.
    - ``offset``: Gemma's ``1 + weight`` is ``offset=1.0``; computed in fp32.
    - ``residual``: a tensor of x's shape; the op normalizes ``h = x + residual`` (summed in
      fp32, stored in ``residual_dtype``, default the residual's dtype) and, with
      ``prenorm=True``, returns ``(y, h)`` so that h carries the residual stream on.
    - ``out_dtype``: y's dtype (default x's).

    Any leading shape and any strides; arithmetic is fp32 (fp64 for fp64 input). Differentiable
    in x, weight and residual (including the gradient that reaches h). CUDA tensors in
    bf16/fp16/fp32 run the cuTile kernels when they are stable or experimental kernels are
    enabled; everything else takes the torch reference path (see :func:`tilenorm.explain`).
    """
    eps = check_eps(OP, eps)
    offset = check_offset(OP, offset, weight)
    y, h = _norm.apply(OP, False, True, x, weight, None, residual, eps, offset, out_dtype,
                       residual_dtype)
    return (y, h) if prenorm else y


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                     *, offset: float = 0.0, residual: torch.Tensor | None = None,
                     residual_dtype: torch.dtype | None = None,
                     out_dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch-level forward without autograd: (y, h, rstd). h is x without a residual; rstd
    has shape x.shape[:-1], fp32 (fp64 for fp64 input). For frameworks that keep their own
    autograd graph."""
    eps = check_eps(OP, eps)
    offset = check_offset(OP, offset, weight)
    y, h, _, rstd = _norm.launch_forward(OP, False, True, x, weight, None, residual, eps,
                                         offset, out_dtype, residual_dtype)
    return y, h, rstd


def rms_norm_backward(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor, *, offset: float = 0.0,
                      dh: torch.Tensor | None = None, x_dtype: torch.dtype | None = None,
                      residual_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch-level backward from :func:`rms_norm_forward`'s h and rstd: (dx, dresidual,
    dweight). With a fused residual pass ``residual_dtype`` (the residual input's dtype),
    ``x_dtype`` (x's dtype, default h's) and ``dh``, the gradient that reached h directly
    (or None); dresidual is None without a residual, dweight None without a weight."""
    return _norm.launch_backward(OP, False, dy, dh, h, weight, None, None, rstd, offset,
                                 x_dtype, residual_dtype)[:3]


def explain(x: torch.Tensor, weight: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
            layer_norm: bool = False, out_dtype: torch.dtype | None = None,
            residual_dtype: torch.dtype | None = None) -> Route:
    """What :func:`rms_norm` (or, with ``layer_norm=True``, :func:`layer_norm`) would run for
    these operands, and why (``str()`` it)."""
    op = "layer_norm" if layer_norm else OP
    return _norm.recipe(op, layer_norm, not layer_norm, x, weight, bias, residual, out_dtype,
                        residual_dtype).route
