"""Flax modules that run tilenorm's ops: drop-ins for Flax's RMSNorm and LayerNorm.

``RMSNorm`` / ``LayerNorm`` subclass ``flax.linen.RMSNorm`` / ``flax.linen.LayerNorm``, and
``NnxRMSNorm`` / ``NnxLayerNorm`` subclass ``flax.nnx.RMSNorm`` / ``flax.nnx.LayerNorm``: the
same fields and constructor, the same parameters (``scale``, ``bias``: names, shapes, init,
``param_dtype``) and the same auto-generated module names in a parent, so a model swaps them in
and keeps its checkpoints. The output dtype follows Flax's rules (``dtype``, else the
promotion of x's and the parameters' dtypes; nnx promotes x and the parameters to it first).

The arithmetic is tilenorm's: float32 (float64 for float64 input) with a two-pass variance,
whatever ``use_fast_variance`` and ``force_float32_reductions`` say. ``axis_name`` names the
mesh axes the features are split across inside ``shard_map``, as in Flax. Only the last axis
is normalized (``reduction_axes`` and ``feature_axes`` -1); ``axis_index_groups`` and ``mask``
are not supported and raise ``ValueError``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.dtypes import canonicalize_dtype

from tilenorm.jax.functional import layer_norm, rms_norm


def _check(module, x, mask) -> None:
    """The options tilenorm does not implement."""
    name = f"tilenorm.jax.flax.{type(module).__name__}"
    for field in ("reduction_axes", "feature_axes"):
        axes = getattr(module, field)
        axes = axes if isinstance(axes, tuple | list) else (axes,)
        if [a % x.ndim if isinstance(a, int) else a for a in axes] != [x.ndim - 1]:
            raise ValueError(f"{name}: {field} must be -1 (the last axis), got {axes!r}")
    if module.axis_index_groups is not None:
        raise ValueError(f"{name}: axis_index_groups is not supported")
    if mask is not None:
        raise ValueError(f"{name}: mask is not supported")


def _linen_dtype(module, x, *params):
    return canonicalize_dtype(x, *params, dtype=module.dtype)


class RMSNorm(nn.RMSNorm):
    """``flax.linen.RMSNorm`` computed by :func:`tilenorm.jax.rms_norm`."""

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        _check(self, x, mask)
        scale = (self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
                 if self.use_scale else None)
        return rms_norm(x, scale, self.epsilon, out_dtype=_linen_dtype(self, x, scale),
                        axis_name=self.axis_name)


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` computed by :func:`tilenorm.jax.layer_norm`."""

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        _check(self, x, mask)
        features = (x.shape[-1],)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = (self.param("bias", self.bias_init, features, self.param_dtype)
                if self.use_bias else None)
        return layer_norm(x, scale, bias, self.epsilon,
                          out_dtype=_linen_dtype(self, x, scale, bias),
                          axis_name=self.axis_name)


def _nnx_promoted(module, x, *params):
    """nnx's promotion of x and the parameters to one dtype; x is left as it is where the
    promotion only widens it (the op reads it and writes y in the promoted dtype)."""
    promoted = module.promote_dtype((x, *params), dtype=module.dtype)
    dtype = promoted[0].dtype
    if jnp.promote_types(x.dtype, dtype) == dtype:
        return x, promoted[1:], dtype
    return promoted[0], promoted[1:], dtype


def _value(param):
    return None if param is None else param[...]


class NnxRMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` computed by :func:`tilenorm.jax.rms_norm`."""

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        _check(self, x, mask)
        x, (scale,), dtype = _nnx_promoted(self, x, _value(self.scale))
        return rms_norm(x, scale, self.epsilon, out_dtype=dtype, axis_name=self.axis_name)


class NnxLayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` computed by :func:`tilenorm.jax.layer_norm`."""

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        _check(self, x, mask)
        x, (scale, bias), dtype = _nnx_promoted(self, x, _value(self.scale), _value(self.bias))
        return layer_norm(x, scale, bias, self.epsilon, out_dtype=dtype,
                          axis_name=self.axis_name)
