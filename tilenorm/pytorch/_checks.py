"""Input validation shared by the PyTorch ops (every bad input raises a clear error before any
kernel sees it), and the (rows, heads, cols) views the kernels take."""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_x(op: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least 1 dimension (..., N), got a 0-d tensor")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be a floating-point tensor (bfloat16, float16, float32 "
                        f"or float64), got {x.dtype}")


def check_param(op: str, name: str, p: object, x: torch.Tensor, per_head: bool = False
                ) -> None:
    """``p`` (weight or bias) must be None or a (N,) tensor on x's device, in x's dtype or
    float32 (fp32 master weights beside bf16/fp16 activations). With ``per_head`` it may also
    be (H, N) for x of shape (..., H, N): one weight per head."""
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
    n = x.shape[-1]
    per_head_shape = tuple(x.shape[-2:]) if per_head and x.dim() >= 2 else None
    if p.shape != (n,) and tuple(p.shape) != per_head_shape:
        allowed = f"({n},)" + (f" or {per_head_shape} (per head)" if per_head_shape else "")
        raise ValueError(f"{op}: {name} must have shape {allowed} to match x of shape "
                         f"{tuple(x.shape)}, got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{op}: {name} is on {p.device} but x is on {x.device}; "
                         f"they must be on the same device")
    allowed = (x.dtype,) if x.dtype in (torch.float32, torch.float64) else (x.dtype,
                                                                            torch.float32)
    if p.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{op}: {name} must be {names} for x of dtype {x.dtype}, got {p.dtype}")


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


def check_eps(op: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    return eps


def check_offset(op: str, offset: object, weight: torch.Tensor | None) -> float:
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"{op}: offset must be a real number, got {type(offset).__name__}")
    offset = float(offset)
    if not math.isfinite(offset):
        raise ValueError(f"{op}: offset must be finite, got {offset}")
    if offset != 0.0 and weight is None:
        raise ValueError(f"{op}: offset scales the weight as (offset + weight); it needs a "
                         f"weight")
    return offset


def view_3d(shape: tuple[int, ...], strides: tuple[int, ...], keep_heads: bool
            ) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """(shape, strides) of a (rows, heads, N) view of a tensor with this shape and these
    strides, or None when its leading dimensions do not fold into two. With ``keep_heads``
    the heads axis is exactly the second-to-last dimension."""
    n, n_stride = shape[-1], strides[-1]
    groups: list[list[int]] = []  # [size, stride], innermost first
    lead = list(zip(shape[:-1], strides[:-1], strict=True))
    if keep_heads:
        groups.append([lead[-1][0], lead[-1][1]])
        lead = lead[:-1]
    for size, stride in reversed(lead):
        if size == 1:
            continue
        # Fold into the group outside it when contiguous with it, never into the kept heads.
        if groups and not (keep_heads and len(groups) == 1) and \
                stride == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        return None
    if not keep_heads and len(groups) == 1:
        groups.insert(0, [1, 0])  # one folded leading group: all rows, one head
    while len(groups) < 2:
        groups.append([1, 0])
    (h, h_stride), (a, a_stride) = groups
    return (a, h, n), (a_stride, h_stride, n_stride)


def max_offset(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The largest element offset from the first element of a tensor with these strides."""
    return sum((s - 1) * st for s, st in zip(shape, strides, strict=True))
