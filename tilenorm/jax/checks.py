"""Validation of the JAX ops' arguments: every bad input raises a ``TypeError`` or
``ValueError`` naming the argument, with the PyTorch ops' messages (``jax.Array`` for
``torch.Tensor``), before anything is traced. The checks of Python scalars (eps, offset,
flags) and of the normalized dimensions are :mod:`tilenorm.arguments`', shared with PyTorch.
Shapes and dtypes are static under ``jax.jit``, so every check holds for traced arrays too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tilenorm.arguments import (
    LAYER_NORM,
    check_eps,
    check_flag,
    check_offset,
    normalized_dims,
)
from tilenorm.jax.spec import NormSpec, compute_dtype

FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32,
                                           jnp.float64))
_DTYPE_NAMES = "bfloat16, float16, float32 or float64"


def default_eps(dtype) -> float:
    """``eps=None``: the epsilon of the computation dtype, torch's rule."""
    return float(jnp.finfo(compute_dtype(dtype)).eps)


def _is_array(t: object) -> bool:
    return isinstance(t, (jax.Array, np.ndarray))


def check_x(op: str, x: object, name: str = "x") -> None:
    if not _is_array(x):
        raise TypeError(f"{op}: {name} must be a jax.Array, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError(f"{op}: {name} must have at least 1 dimension (..., N), got a 0-d "
                         f"array")
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be a floating-point array ({_DTYPE_NAMES}), got "
                        f"{x.dtype}")


def check_param(op: str, name: str, p: object) -> None:
    """``p`` (weight or bias) must be None or a floating-point array; its dtype may differ
    from x's (y keeps x's dtype), its shape is checked by
    :func:`tilenorm.arguments.normalized_dims`."""
    if p is None:
        return
    if not _is_array(p):
        raise TypeError(f"{op}: {name} must be a jax.Array or None, got {type(p).__name__}")
    if np.dtype(p.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be a floating-point array ({_DTYPE_NAMES}), got "
                        f"{p.dtype}")


def check_residual(op: str, residual: object, x) -> None:
    if residual is None:
        return
    if not _is_array(residual):
        raise TypeError(f"{op}: residual must be a jax.Array or None, got "
                        f"{type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(residual.shape)}")
    if np.dtype(residual.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: residual must be a floating-point array, got {residual.dtype}")


def dtype_arg(op: str, name: str, dtype: object) -> np.dtype | None:
    """A dtype argument (``jnp.bfloat16``, ``"float32"``, ``np.float64``, ...) as a numpy
    dtype; None stays None."""
    if dtype is None:
        return None
    try:
        found = np.dtype(dtype)
    except TypeError:
        found = None
    if found not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be None or one of jnp.bfloat16, jnp.float16, "
                        f"jnp.float32, jnp.float64; got {dtype!r}")
    return found


def axis_names(op: str, axis_name: object) -> tuple[str, ...]:
    """``axis_name``: None, a mesh axis name, or a tuple of them."""
    if axis_name is None:
        return ()
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{op}: axis_name must be None, a mesh axis name or a tuple of them, "
                        f"got {axis_name!r}")
    return names


def forward_spec(op: str, x, weight, bias, residual, eps, offset, per_head, prenorm,
                 out_dtype, residual_dtype, axis_name) -> NormSpec:
    """Check a forward's arguments; the spec of the call."""
    check_x(op, x)
    check_flag(op, "per_head", per_head)
    check_flag(op, "prenorm", prenorm)
    check_param(op, "weight", weight)
    check_param(op, "bias", bias)
    dims = normalized_dims(op, x, weight, bias, None, per_head)
    check_residual(op, residual, x)
    out_dtype = dtype_arg(op, "out_dtype", out_dtype)
    residual_dtype = dtype_arg(op, "residual_dtype", residual_dtype)
    if residual_dtype is not None and residual is None:
        raise ValueError(f"{op}: residual_dtype is the dtype of the residual stream; it needs "
                         f"a residual")
    if prenorm and residual is None:
        raise ValueError(f"{op}: prenorm=True returns (y, x + residual); it needs a residual")
    eps = check_eps(op, default_eps(x.dtype) if eps is None else eps)
    offset = check_offset(op, offset, weight)
    x_dtype = np.dtype(x.dtype)
    r_dtype = None if residual is None else np.dtype(residual.dtype)
    return NormSpec(op=op, dims=dims, per_head=per_head, eps=eps, offset=offset,
                    x_dtype=x_dtype, out_dtype=out_dtype or x_dtype, residual_dtype=r_dtype,
                    h_dtype=residual_dtype or r_dtype, has_weight=weight is not None,
                    has_bias=bias is not None, prenorm=prenorm,
                    axis_name=axis_names(op, axis_name))


def backward_spec(op: str, dy, dh, h, weight, bias, mean, rstd, offset, per_head, x_dtype,
                  residual_dtype, axis_name) -> NormSpec:
    """Check a launch-level backward's operands against h; the spec of the call."""
    check_x(op, h, "h")
    check_flag(op, "per_head", per_head)
    check_param(op, "weight", weight)
    check_param(op, "bias", bias)
    dims = normalized_dims(op, h, weight, bias, None, per_head)
    x_dtype = dtype_arg(op, "x_dtype", x_dtype)
    residual_dtype = dtype_arg(op, "residual_dtype", residual_dtype)
    offset = check_offset(op, offset, weight)
    for name, t in (("dy", dy), ("dh", dh)):
        if (t is not None or name == "dy") and (not _is_array(t) or t.shape != h.shape):
            raise ValueError(f"{op}: {name} must be a jax.Array of h's shape "
                             f"{tuple(h.shape)}")
    stat_shape = tuple(h.shape[:h.ndim - dims])
    stat_dtype = compute_dtype(h.dtype)
    for name, t in (("rstd", rstd), ("mean", mean)):
        if (t is not None or name == "rstd" or op == LAYER_NORM) and (
                not _is_array(t) or tuple(t.shape) != stat_shape
                or np.dtype(t.dtype) != stat_dtype):
            raise ValueError(f"{op}: {name} must be the forward's: of shape {stat_shape} and "
                             f"dtype {stat_dtype}")
    h_dtype = np.dtype(h.dtype)
    return NormSpec(op=op, dims=dims, per_head=per_head, eps=0.0, offset=offset,
                    x_dtype=x_dtype or h_dtype, out_dtype=np.dtype(dy.dtype),
                    residual_dtype=residual_dtype,
                    h_dtype=None if residual_dtype is None else h_dtype,
                    has_weight=weight is not None, has_bias=bias is not None,
                    prenorm=dh is not None, axis_name=axis_names(op, axis_name))

