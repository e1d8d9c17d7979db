"""LayerNorm for PyTorch over the last dimension: the functional op and its launch-level
forward and backward. Autograd, custom ops and routing live in :mod:`tilenorm.pytorch._norm`."""

from __future__ import annotations

import torch

from tilenorm.pytorch import _norm
from tilenorm.pytorch._checks import check_eps

OP = "layer_norm"


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *,
               residual: torch.Tensor | None = None, prenorm: bool = False,
               residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dimension:
    ``(x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` (biased variance, as
    ``torch.nn.functional.layer_norm``).

    ``weight`` and ``bias`` are None or (N,); ``residual``, ``prenorm``, ``residual_dtype`` and
    ``out_dtype`` work as in :func:`tilenorm.rms_norm`. Any leading shape and strides; fp32
    arithmetic (fp64 for fp64 input); differentiable in x, weight, bias and residual.
    """
    eps = check_eps(OP, eps)
    y, h = _norm.apply(OP, True, False, x, weight, bias, residual, eps, 0.0, out_dtype,
                       residual_dtype)
    return (y, h) if prenorm else y


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, eps: float = 1e-5, *,
                       residual: torch.Tensor | None = None,
                       residual_dtype: torch.dtype | None = None,
                       out_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch-level forward without autograd: (y, h, mean, rstd); mean and rstd have shape
    x.shape[:-1]."""
    eps = check_eps(OP, eps)
    return _norm.launch_forward(OP, True, False, x, weight, bias, residual, eps, 0.0,
                                out_dtype, residual_dtype)


def layer_norm_backward(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, *,
                        dh: torch.Tensor | None = None, x_dtype: torch.dtype | None = None,
                        residual_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                   torch.Tensor | None]:
    """Launch-level backward from :func:`layer_norm_forward`'s h, mean and rstd: (dx,
    dresidual, dweight, dbias); see :func:`tilenorm.rms_norm_backward` for dh, x_dtype and
    residual_dtype."""
    if mean is None:
        raise ValueError(f"{OP}: mean must be the forward's, not None")
    return _norm.launch_backward(OP, True, dy, dh, h, weight, bias, mean, rstd, 0.0, x_dtype,
                                 residual_dtype)
