"""The reference path in jnp: what runs on the CPU, for float64, inside a batching rule with
per-example weights and wherever the kernels do not cover a call, with the semantics of
:mod:`tilenorm.pytorch.reference`:

    h = x + residual, summed in fp32 and stored in h_dtype   (fused residual add; else h = x)
    mu = mean(h) (LayerNorm only), rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = (h - mu) * rstd * (offset + weight) + bias, rounded once to out_dtype

over the last ``spec.dims`` dimensions, in float32: float64 where h is float64 (the sum where
x or the residual is), and the product with a float64 parameter in float64. These functions
compute one shard: the row statistics are ``psum``'d over ``spec.axis_name``, the mesh axes
the normalized dimensions are split across, so that a hidden dimension split over devices
costs one all-reduce of a scalar per row (two for LayerNorm) instead of an all-gather of x.

``spec.batch_dims`` leading dimensions of x are vmapped ones (see
:mod:`tilenorm.jax.functional`): the weight gradient is kept per example over them, and with
``spec.batched_params`` the weight and bias carry them too.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from tilenorm.jax.spec import NormSpec, compute_dtype


def _row_sum(t, spec: NormSpec):
    """The sum over the normalized dimensions, over every shard of them; keeps the dims."""
    s = jnp.sum(t, axis=tuple(range(-spec.dims, 0)), keepdims=True)
    return lax.psum(s, spec.axis_name) if spec.axis_name else s


def _count(shape: tuple[int, ...], spec: NormSpec) -> int:
    """How many elements one row statistic covers, over every shard."""
    n = math.prod(shape[len(shape) - spec.dims:])
    for name in spec.axis_name:
        n *= lax.axis_size(name)
    return n


def _param(p, spec: NormSpec, ndim: int):
    """A weight or bias shaped to broadcast against an array of ``ndim`` dimensions: per
    example ones get a 1 for each row dimension after the batch dimensions."""
    if p is None or not spec.batched_params:
        return p
    k = spec.batch_dims
    return jnp.expand_dims(p, tuple(range(k, ndim - spec.param_dims)))


def forward(spec: NormSpec, x, residual, weight, bias):
    """``(y, h, mean, rstd)`` of one shard: h is None without a residual, mean None for
    RMSNorm; mean and rstd have x's shape without the normalized dimensions, in the compute
    dtype."""
    h = None
    if residual is not None:
        total = np.promote_types(compute_dtype(x.dtype), compute_dtype(residual.dtype))
        h = (x.astype(total) + residual.astype(total)).astype(spec.h_dtype)
    hf = (x if h is None else h).astype(compute_dtype((x if h is None else h).dtype))
    n = _count(hf.shape, spec)
    mean = _row_sum(hf, spec) / n if spec.layer_norm else None
    centered = hf if mean is None else hf - mean
    rstd = lax.rsqrt(_row_sum(jnp.square(centered), spec) / n + spec.eps)
    y = centered * rstd
    params = [_param(p, spec, x.ndim) for p in (weight, bias)]
    if any(p is not None and p.dtype == jnp.float64 for p in params):
        y = y.astype(jnp.float64)
    if weight is not None:
        y = y * (params[0].astype(y.dtype) + spec.offset)
    if bias is not None:
        y = y + params[1].astype(y.dtype)
    normalized = tuple(range(x.ndim - spec.dims, x.ndim))
    return (y.astype(spec.out_dtype), h,
            None if mean is None else jnp.squeeze(mean, normalized),
            jnp.squeeze(rstd, normalized))


def _fold(t, spec: NormSpec):
    """Sum ``t`` over its row dimensions: the dimensions between the batch dimensions and a
    parameter's."""
    return jnp.sum(t, axis=tuple(range(spec.batch_dims, t.ndim - spec.param_dims)))


def backward(spec: NormSpec, dy, dh, h, weight, bias, mean, rstd):
    """``(dx, dresidual, dweight, dbias)`` of one shard from the forward's h, mean and rstd:
    dx in x's dtype, dresidual (None without a residual) in the residual's, dweight and dbias
    summed over this shard's rows in the compute dtype (the caller sums them over shards and
    rounds them to the parameters' dtypes). ``dh`` is the gradient that reached h, or None."""
    acc = compute_dtype(h.dtype)
    normalized = tuple(range(h.ndim - spec.dims, h.ndim))
    r = jnp.expand_dims(rstd.astype(acc), normalized)
    hf = h.astype(acc)
    x_hat = (hf if mean is None else hf - jnp.expand_dims(mean.astype(acc), normalized)) * r
    g = dy.astype(acc)
    wdy = g if weight is None else g * (_param(weight, spec, h.ndim).astype(acc) + spec.offset)
    n = _count(h.shape, spec)
    d = wdy - x_hat * (_row_sum(x_hat * wdy, spec) / n)
    if spec.layer_norm:
        d = d - _row_sum(wdy, spec) / n
    d = d * r
    if dh is not None:
        d = d + dh.astype(acc)
    dres = None if spec.residual_dtype is None else d.astype(spec.residual_dtype)
    dweight = None if weight is None else _fold(g * x_hat, spec)
    dbias = None if bias is None else _fold(g, spec)
    return d.astype(spec.x_dtype), dres, dweight, dbias
