"""The checks of the ops' arguments that no framework decides: eps, offset, flags and the
normalized dimensions. Every adapter (``tilenorm.pytorch``, ``tilenorm.jax``) raises these
``TypeError``s and ``ValueError``s, worded alike, before any kernel sees the call."""

from __future__ import annotations

import math
import numbers

RMS_NORM, LAYER_NORM = "rms_norm", "layer_norm"


def check_eps(op: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    return eps


def check_offset(op: str, offset: object, weight: object) -> float:
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"{op}: offset must be a real number, got {type(offset).__name__}")
    offset = float(offset)
    if not math.isfinite(offset):
        raise ValueError(f"{op}: offset must be finite, got {offset}")
    if offset != 0.0 and weight is None:
        raise ValueError(f"{op}: offset scales the weight as (offset + weight); it needs a "
                         f"weight")
    return offset


def check_flag(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be True or False, got {type(value).__name__}")


def normalized_dims(op: str, x, weight, bias, normalized_shape, per_head: bool) -> int:
    """Check the shapes of x, weight and bias (arrays of any framework: ``.shape`` is read)
    against the normalized dimensions and return how many trailing dimensions are
    normalized: ``normalized_shape`` (an int or a sequence of ints) where given, else the
    weight's (or bias's) shape, else the last dimension; with ``per_head`` the last one, the
    weight being (H, N)."""
    if per_head:
        if op != RMS_NORM:
            raise ValueError(f"{op}: per_head weights are an rms_norm option")
        if len(x.shape) < 2 or weight is None or tuple(weight.shape) != tuple(x.shape[-2:]):
            raise ValueError(f"{op}: per_head=True takes x of shape (..., H, N) and a weight of "
                             f"shape (H, N); got x {tuple(x.shape)} and weight "
                             f"{None if weight is None else tuple(weight.shape)}")
        if normalized_shape is not None and _shape(op, normalized_shape) != (x.shape[-1],):
            raise ValueError(f"{op}: with per_head=True each head's last dimension is "
                             f"normalized: normalized_shape must be None or "
                             f"({x.shape[-1]},)")
        return 1
    if normalized_shape is not None:
        shape = _shape(op, normalized_shape)
    elif weight is not None:
        shape = tuple(weight.shape)
    elif bias is not None:
        shape = tuple(bias.shape)
    else:
        shape = (x.shape[-1],)
    if not shape:
        raise ValueError(f"{op}: normalized_shape must have at least one dimension")
    if len(x.shape) < len(shape) or tuple(x.shape[len(x.shape) - len(shape):]) != shape:
        raise ValueError(f"{op}: x must end in normalized_shape {shape}, got "
                         f"{tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != shape:
            per_head_hint = (op == RMS_NORM and len(p.shape) == 2
                             and normalized_shape is not None)
            hint = ("; for one weight per head of x (..., H, N) pass per_head=True"
                    if per_head_hint else "")
            raise ValueError(f"{op}: {name} must have normalized_shape {shape}, got "
                             f"{tuple(p.shape)}{hint}")
    return len(shape)


def _shape(op: str, normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, bool):
        raise TypeError(f"{op}: normalized_shape must be an int or a sequence of ints")
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    try:
        shape = tuple(normalized_shape)
    except TypeError:
        raise TypeError(f"{op}: normalized_shape must be an int or a sequence of ints, got "
                        f"{type(normalized_shape).__name__}") from None
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise TypeError(f"{op}: normalized_shape must be an int or a sequence of ints, got "
                        f"{normalized_shape!r}")
    return shape


def dres_apart(x_dtype: object, residual_dtype: object | None) -> bool:
    """Whether a backward writes the residual's gradient apart from dx (any framework's
    dtypes): only where the residual's dtype is not x's (the values are the same; elsewhere
    dx serves both)."""
    return residual_dtype is not None and residual_dtype != x_dtype
