"""The static description of one call: what a forward or backward computes, everything but the
arrays. It is hashable, so it is the non-differentiable argument of the ``custom_vjp``, the
static argument of the ``custom_partitioning`` and part of ``jax.jit``'s cache key."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tilenorm.arguments import LAYER_NORM


@dataclass(frozen=True)
class NormSpec:
    """One normalization over the last ``dims`` dimensions of x (``per_head``: the last one,
    with a weight (H, N) for x (..., H, N)).

    ``residual_dtype`` is the residual input's dtype and ``h_dtype`` the residual stream's (both
    None without a fused residual add); ``prenorm`` says that h is an output, so that a
    gradient of h reaches the backward. ``axis_name`` names the mesh axes the normalized
    dimensions are split across (inside ``shard_map`` or a partitioned call): the row
    statistics are summed over them with ``psum``.

    ``batch_dims`` leading dimensions of x are vmapped ones (the batching rules of
    :mod:`tilenorm.jax.functional` add them): the weight and bias gradients are per example
    over them, and with ``batched_params`` the weight and bias have them too, as leading
    dimensions (per-example parameters)."""

    op: str
    dims: int
    per_head: bool
    eps: float
    offset: float
    x_dtype: np.dtype
    out_dtype: np.dtype
    residual_dtype: np.dtype | None
    h_dtype: np.dtype | None
    has_weight: bool
    has_bias: bool
    prenorm: bool
    axis_name: tuple[str, ...] = ()
    batch_dims: int = 0
    batched_params: bool = False

    @property
    def layer_norm(self) -> bool:
        return self.op == LAYER_NORM

    @property
    def has_residual(self) -> bool:
        return self.h_dtype is not None

    @property
    def param_dims(self) -> int:
        """The weight's and bias's number of dimensions."""
        return 2 if self.per_head else self.dims


def compute_dtype(dtype) -> np.dtype:
    """The arithmetic's dtype: float64 for float64 operands, float32 otherwise."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
