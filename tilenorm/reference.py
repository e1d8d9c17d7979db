"""Reference implementations in plain torch: the path for CPU tensors and for every case no
kernel covers, with the kernels' semantics (fp32 arithmetic, fp64 for fp64 inputs, result in
x's dtype). Differentiable through autograd."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    acc = compute_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) with rstd of shape x.shape[:-1] in the compute dtype: the kernels' outputs."""
    acc = compute_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight) from the forward's rstd: the kernels' backward, in torch."""
    acc = compute_dtype(x.dtype)
    rstd = rstd.to(acc).unsqueeze(-1)
    x_hat = x.to(acc) * rstd
    dyf = dy.to(acc)
    wdy = dyf * weight.to(acc) if weight is not None else dyf
    dx = (wdy - x_hat * (x_hat * wdy).mean(dim=-1, keepdim=True)) * rstd
    dweight = None
    if weight is not None:
        dweight = (dyf * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dweight
