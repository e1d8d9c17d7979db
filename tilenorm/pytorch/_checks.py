"""Input validation shared by the PyTorch ops: every bad input raises a clear error before
any kernel sees it."""

from __future__ import annotations

import math
import numbers

import torch

from tilenorm.planner import MAX_INT32_OFFSET

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_x(op: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least 1 dimension (..., N), got a 0-d tensor")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be a floating-point tensor (bfloat16, float16, float32 "
                        f"or float64), got {x.dtype}")


def check_param(op: str, name: str, p: object, x: torch.Tensor) -> None:
    """``p`` (weight or bias) must be None or a (N,) tensor on x's device, in x's dtype or
    float32 (fp32 master weights beside bf16/fp16 activations)."""
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
    n = x.shape[-1]
    if p.shape != (n,):
        raise ValueError(f"{op}: {name} must have shape ({n},) to match x's last dimension, "
                         f"got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{op}: {name} is on {p.device} but x is on {x.device}; "
                         f"they must be on the same device")
    allowed = (x.dtype,) if x.dtype in (torch.float32, torch.float64) else (x.dtype,
                                                                            torch.float32)
    if p.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{op}: {name} must be {names} for x of dtype {x.dtype}, got {p.dtype}")


def check_eps(op: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    return eps


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) as an (M, N) view with the same strides where the leading dimensions collapse
    (the kernels take any strides); a copy only where they do not."""
    n = t.shape[-1]
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


def as_kernel_rows(t: torch.Tensor) -> torch.Tensor:
    """:func:`as_rows`, made contiguous where its strides reach past 32-bit offsets."""
    rows = as_rows(t)
    m, n = rows.shape
    if (m - 1) * rows.stride(0) + (n - 1) * rows.stride(1) > MAX_INT32_OFFSET:
        rows = rows.contiguous()
    return rows
