"""RMSNorm for PyTorch: the functional op (with Gemma's weight offset, a fused residual add,
per-head weights and an output dtype), its launch-level forward and backward, and ``explain``.
Autograd, custom ops and routing live in :mod:`tilenorm.pytorch._norm`."""

from __future__ import annotations

import torch

from tilenorm.pytorch import _norm
from tilenorm.pytorch._checks import check_dtype, check_eps, check_offset, check_x
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
    return _launch_backward(OP, False, dy, h, weight, None, None, rstd, offset, dh, x_dtype,
                            residual_dtype)[:3]


def _launch_backward(op, layer_norm, dy, h, weight, bias, mean, rstd, offset, dh, x_dtype,
                     residual_dtype):
    """Checks the launch-level backward's operands against h, then launches it."""
    check_x(op, h)
    check_dtype(op, "x_dtype", x_dtype)
    check_dtype(op, "residual_dtype", residual_dtype)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.device != h.device or p.shape[-1] != h.shape[-1]):
            raise ValueError(f"{op}: {name} of shape {tuple(p.shape)} on {p.device} does not "
                             f"match h of shape {tuple(h.shape)} on {h.device}")
    offset = check_offset(op, offset, weight)
    for name, t in (("dy", dy), ("dh", dh)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != h.shape
                              or t.device != h.device):
            raise ValueError(f"{op}: {name} must be a tensor of h's shape {tuple(h.shape)} on "
                             f"{h.device}")
    stat_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    for name, t in (("rstd", rstd), ("mean", mean)):
        if (t is not None or name == "rstd") and (
                not isinstance(t, torch.Tensor) or t.shape != h.shape[:-1]
                or t.dtype != stat_dtype):
            raise ValueError(f"{op}: {name} must be the forward's, of shape "
                             f"{tuple(h.shape[:-1])} and dtype {stat_dtype}")
    return _norm.launch_backward(layer_norm, dy, dh, h, weight, bias, mean, rstd, offset,
                                 x_dtype or h.dtype, residual_dtype)


def explain(x: torch.Tensor, weight: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
            layer_norm: bool = False, out_dtype: torch.dtype | None = None,
            residual_dtype: torch.dtype | None = None) -> Route:
    """What :func:`rms_norm` (or, with ``layer_norm=True``, :func:`layer_norm`) would run for
    these operands, and why (``str()`` it)."""
    op = "layer_norm" if layer_norm else OP
    return _norm.recipe(op, layer_norm, not layer_norm, x, weight, bias, residual, out_dtype,
                        residual_dtype).route
