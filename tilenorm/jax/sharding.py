"""The ops under ``jax.shard_map`` for an x split across a mesh: call them inside ``jax.jit``.

    from jax.sharding import PartitionSpec as P
    from tilenorm.jax import sharding

    y = sharding.rms_norm(x, weight, mesh=mesh, spec=P("data", None))        # data parallel
    y = sharding.rms_norm(x, weight, mesh=mesh, spec=P("data", "model"))     # + tensor parallel

``spec`` is x's partition spec. Each device normalizes its shard of x: the weight and bias
are passed replicated across the mesh axes that split the rows and split like x along the
normalized dimensions; y (and h) come back split like x, and so do dx and dresidual. The
weight and bias gradients are summed with ``psum`` over the axes that split the rows (inside
the ops' ``custom_vjp``) and stay split along the normalized dimensions, whose row statistics
are ``psum``'d partial sums (``axis_name``).

Under ``jax.jit`` with ``NamedSharding``-ed operands the plain ops do the same without a
``shard_map`` (:mod:`tilenorm.jax.partitioning`); these are for code that wants the
per-device program spelled out, and for meshes whose axes are explicit.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec
from jax.typing import DTypeLike

from tilenorm.arguments import LAYER_NORM, RMS_NORM
from tilenorm.jax import checks, functional
from tilenorm.jax.partitioning import mesh_axes


def _entries(spec: PartitionSpec, ndim: int) -> tuple:
    if len(spec) > ndim:
        raise ValueError(f"spec {spec} has more entries than x has dimensions ({ndim})")
    return tuple(spec) + (None,) * (ndim - len(spec))


def _sharded(op, x, weight, bias, eps, per_head, offset, residual, prenorm, residual_dtype,
             out_dtype, mesh, spec):
    norm = checks.forward_spec(op, x, weight, bias, residual, eps, offset, per_head, prenorm,
                               out_dtype, residual_dtype, None)
    entries = _entries(spec, x.ndim)
    x_spec = PartitionSpec(*entries)
    param_spec = PartitionSpec(*entries[x.ndim - norm.param_dims:])
    axis_name = mesh_axes(entries[x.ndim - norm.dims:]) or None

    def shard(x, residual, weight, bias):
        return functional._apply(op, x, weight, bias, eps, per_head, offset, residual, prenorm,
                                 residual_dtype, out_dtype, axis_name)

    def present(t, s):
        return None if t is None else s

    in_specs = (x_spec, present(residual, x_spec), present(weight, param_spec),
                present(bias, param_spec))
    out_specs = (x_spec, x_spec) if prenorm else x_spec
    return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
        x, residual, weight, bias)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float | None = 1e-6, *,
             mesh: Mesh, spec: PartitionSpec, offset: float = 0.0,
             residual: jax.Array | None = None, prenorm: bool = False,
             out_dtype: DTypeLike | None = None, residual_dtype: DTypeLike | None = None,
             per_head: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`tilenorm.jax.rms_norm` of an x split across ``mesh`` as ``spec`` says, one
    ``shard_map`` program per device; other arguments as there."""
    return _sharded(RMS_NORM, x, weight, None, eps, per_head, offset, residual, prenorm,
                    residual_dtype, out_dtype, mesh, spec)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float | None = 1e-5, *, mesh: Mesh, spec: PartitionSpec,
               residual: jax.Array | None = None, prenorm: bool = False,
               out_dtype: DTypeLike | None = None, residual_dtype: DTypeLike | None = None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`tilenorm.jax.layer_norm` of an x split across ``mesh`` as ``spec`` says; see
    :func:`rms_norm`."""
    return _sharded(LAYER_NORM, x, weight, bias, eps, False, 0.0, residual, prenorm,
                    residual_dtype, out_dtype, mesh, spec)
