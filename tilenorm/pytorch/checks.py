"""Validation of the PyTorch ops' arguments: every bad input raises a clear ``TypeError`` or
``ValueError`` naming the argument before any kernel sees it. Under ``torch.compile`` the
numeric checks of Python scalars that Dynamo may have made symbolic are left to eager mode."""

from __future__ import annotations

import torch

from tilenorm.arguments import check_eps, check_flag, check_offset

__all__ = ["FLOAT_DTYPES", "check_dtype", "check_eps", "check_flag", "check_offset",
           "check_param", "check_residual", "check_x"]

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
    """``p`` (weight or bias) must be None or a floating-point tensor on x's device (its
    shape is checked against the normalized dimensions by the op). Its dtype may differ from
    x's, as torch allows: y keeps x's dtype."""
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
    if p.device != x.device:
        raise ValueError(f"{op}: {name} is on {p.device} but x is on {x.device}; "
                         f"they must be on the same device")
    if p.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be a floating-point tensor (bfloat16, float16, "
                        f"float32 or float64), got {p.dtype}")


def check_residual(op: str, residual: object, x: torch.Tensor) -> None:
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{op}: residual must be a torch.Tensor or None, got "
                        f"{type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}; "
                         f"they must be on the same device")
    if residual.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: residual must be a floating-point tensor, got {residual.dtype}")


def check_dtype(op: str, name: str, dtype: object) -> None:
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be None or one of torch.bfloat16, torch.float16, "
                        f"torch.float32, torch.float64; got {dtype!r}")
