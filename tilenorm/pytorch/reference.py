"""Reference implementations in plain torch: the path for CPU tensors and for every case no
kernel covers, with the kernels' semantics.

    h = x + residual, rounded to residual_dtype   (fused residual add; otherwise h = x)
    mu = mean(h) (LayerNorm only), rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = (h - mu) * rstd * (offset + weight) + bias, rounded once to out_dtype

over the last ``dims`` dimensions. Arithmetic is fp32 (fp64 for fp64 inputs; the product with
an fp64 weight in fp64, as torch does). The weight and bias have the normalized dimensions'
shape, or (H, N) per head for x of shape (..., H, N). :func:`norm` is differentiable through
autograd; :func:`norm_forward` and :func:`norm_backward` are the launch-level pair the custom
ops use.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _residual_sum(x: torch.Tensor, residual: torch.Tensor | None,
                  residual_dtype: torch.dtype | None) -> torch.Tensor:
    if residual is None:
        return x
    acc = compute_dtype(x.dtype)
    return (x.to(acc) + residual.to(acc)).to(residual_dtype)


def _dims(dims: int) -> tuple[int, ...]:
    return tuple(range(-dims, 0))


def _stats(hf: torch.Tensor, layer_norm: bool, eps: float, dims: int
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    mean = hf.mean(dim=_dims(dims), keepdim=True) if layer_norm else None
    centered = hf - mean if layer_norm else hf
    return mean, torch.rsqrt(centered.square().mean(dim=_dims(dims), keepdim=True) + eps)


def _affine(x_hat, weight, bias, offset, acc):
    y = x_hat
    for p in (weight, bias):  # an fp64 parameter on fp32 input: the product in fp64
        if p is not None and p.dtype == torch.float64:
            y = y.to(torch.float64)
    if weight is not None:
        y = y * (weight.to(y.dtype) + offset)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def _forward(x, weight, bias, eps, layer_norm, offset, residual, residual_dtype, out_dtype,
             dims):
    """(y, h, mean, rstd) with mean and rstd keeping the normalized dimensions."""
    acc = compute_dtype(x.dtype)
    h = _residual_sum(x, residual, residual_dtype)
    hf = h.to(acc)
    mean, rstd = _stats(hf, layer_norm, eps, dims)
    x_hat = (hf - mean if layer_norm else hf) * rstd
    y = _affine(x_hat, weight, bias, offset, acc).to(out_dtype or x.dtype)
    return y, h, mean, rstd


def norm(x: torch.Tensor, weight: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, eps: float = 1e-6, *, layer_norm: bool = False,
         offset: float = 0.0, residual: torch.Tensor | None = None,
         residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
         dims: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h), differentiable in every tensor argument; h is x without a residual."""
    y, h, _, _ = _forward(x, weight, bias, eps, layer_norm, offset, residual, residual_dtype,
                          out_dtype, dims)
    return y, h


def norm_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, *, layer_norm: bool = False, offset: float = 0.0,
                 residual: torch.Tensor | None = None,
                 residual_dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None, dims: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h, mean, rstd): the kernels' outputs. mean (None for RMSNorm) and rstd have x's
    shape without the normalized dimensions, in the compute dtype."""
    with torch.no_grad():
        y, h, mean, rstd = _forward(x, weight, bias, eps, layer_norm, offset, residual,
                                    residual_dtype, out_dtype, dims)
    stat = x.shape[:x.dim() - dims]
    return y, h, None if mean is None else mean.reshape(stat), rstd.reshape(stat)


def _fold(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over every leading dimension that ``like`` (a weight or bias) lacks."""
    return t.reshape(-1, *like.shape).sum(0).to(like.dtype)


def norm_backward(dy: torch.Tensor, dres_in: torch.Tensor | None, h: torch.Tensor,
                  weight: torch.Tensor | None, bias: torch.Tensor | None,
                  mean: torch.Tensor | None, rstd: torch.Tensor, *, offset: float = 0.0,
                  x_dtype: torch.dtype | None = None, dims: int = 1,
                  dy_more: tuple[torch.Tensor, ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                             torch.Tensor | None]:
    """(dx, dh, dweight, dbias) from the forward's h, mean and rstd. dh is the gradient of the
    residual stream in h's dtype (the residual's gradient); dx the same values in
    ``x_dtype`` (default h's dtype). y's gradient is ``dy`` plus each of ``dy_more``, added
    in the computation dtype."""
    acc = compute_dtype(h.dtype)
    stat = h.shape[:h.dim() - dims] + (1,) * dims
    axes = _dims(dims)
    with torch.no_grad():
        r = rstd.to(acc).reshape(stat)
        hf = h.to(acc)
        x_hat = (hf - mean.to(acc).reshape(stat) if mean is not None else hf) * r
        g = dy.to(acc)
        for part in dy_more:
            g = g + part.to(acc)
        wdy = g * (weight.to(acc) + offset) if weight is not None else g
        d = wdy - x_hat * (x_hat * wdy).mean(dim=axes, keepdim=True)
        if mean is not None:
            d = d - wdy.mean(dim=axes, keepdim=True)
        d = d * r
        if dres_in is not None:
            d = d + dres_in.to(acc)
        dweight = None if weight is None else _fold(g * x_hat, weight)
        dbias = None if bias is None else _fold(g, bias)
        return d.to(x_dtype or h.dtype), d.to(h.dtype), dweight, dbias
