"""The forward and backward as ``custom_partitioning`` calls: under ``jax.jit`` with sharded
operands (``NamedSharding``), XLA's partitioner hands each device its shard of x and the
shard's computation runs there (:mod:`tilenorm.jax.dispatch`), instead of gathering the
operands of an opaque kernel onto every device.

How x's dimensions may be split across mesh axes:

- rows (data and sequence parallelism; any leading dimension): each shard normalizes its
  rows; the backward sums its weight and bias gradients with ``psum`` over those axes.
- the normalized dimensions (tensor parallelism): the weight and bias are split like them,
  and each shard ``psum``s its partial row sums (the sum of squares, after the sum for
  LayerNorm's mean: an all-reduce of one value per row each, never an all-gather of x); the
  backward ``psum``s its row dot products the same way; weight gradients stay split.
- the heads of a per-head weight, and the dimensions a batching rule added with per-example
  weights: the parameters and their gradients are split like them.

Outside a mesh (one device) and inside a ``shard_map`` over every mesh axis the function is
inlined as it is.
"""

from __future__ import annotations

import dataclasses
import math

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from tilenorm.jax import dispatch
from tilenorm.jax.spec import NormSpec


@dataclasses.dataclass(frozen=True)
class _Split:
    """How an x (or h) of a call is split: its partition spec padded to its rank, and which
    mesh axes split the rows sharing a weight (``row_axes``) and the normalized dimensions
    (``hidden_axes``)."""

    entries: tuple
    row_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]

    @staticmethod
    def of(spec: NormSpec, arg, mesh) -> _Split:
        """The split of ``arg`` (a ``jax.ShapeDtypeStruct`` with a ``NamedSharding``) as the
        call computes it: a dimension that its mesh axes do not divide evenly is gathered
        (the padding of an uneven shard would enter the row sums and the weight gradient)."""
        sharding = arg.sharding
        if not isinstance(sharding, NamedSharding):
            raise NotImplementedError(f"tilenorm.jax partitions operands with a "
                                      f"NamedSharding; got {sharding}")
        ndim = len(arg.shape)
        entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        entries = tuple(None if size % math.prod(mesh.shape[a] for a in mesh_axes((e,)))
                        else e for e, size in zip(entries, arg.shape, strict=True))
        rows = entries[spec.batch_dims:ndim - spec.param_dims]
        return _Split(entries, mesh_axes(rows), mesh_axes(entries[ndim - spec.dims:]))

    def x(self, mesh) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*self.entries))

    def stat(self, mesh, spec: NormSpec) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*self.entries[:len(self.entries) - spec.dims]))

    def param(self, mesh, spec: NormSpec, gradient: bool = False) -> NamedSharding:
        """A weight or bias (``gradient``: their gradients, per example over the batch
        dimensions) split like x's dimensions that it spans."""
        lead = self.entries[:spec.batch_dims] if spec.batched_params or gradient else ()
        tail = self.entries[len(self.entries) - spec.param_dims:]
        return NamedSharding(mesh, PartitionSpec(*lead, *tail))


def mesh_axes(entries) -> tuple[str, ...]:
    """The mesh axis names in partition spec entries (None, a name or a tuple of names)."""
    out = []
    for entry in entries:
        if entry is not None:
            out += [entry] if isinstance(entry, str) else list(entry)
    return tuple(out)


def _present(flags, values) -> tuple:
    return tuple(v if f else None for f, v in zip(flags, values, strict=True))


# --- sharding rules (Shardy) and result shardings (GSPMD) ----------------------------------


def _factors(spec: NormSpec, ndim: int) -> tuple[str, str, str, str]:
    """Einsum-like factors of x (of rank ``ndim``), of a weight, of a weight's gradient and
    of a row statistic."""
    k, p = spec.batch_dims, spec.param_dims
    names = ([f"b{i}" for i in range(k)] + [f"r{i}" for i in range(ndim - k - p)]
             + (["h"] if spec.per_head else []) + [f"n{i}" for i in range(spec.dims)])
    param = names[ndim - p:]
    gradient = names[:k] + param
    return (" ".join(names), " ".join(gradient if spec.batched_params else param),
            " ".join(gradient), " ".join(names[:ndim - spec.dims]))


def _forward_rule(spec: NormSpec, mesh, operand_types, result_types) -> str:
    x, param, _, stat = _factors(spec, operand_types[0].rank)
    ins = [x] + [f for f, used in ((x, spec.has_residual), (param, spec.has_weight),
                                   (param, spec.has_bias)) if used]
    outs = [f for f, used in ((x, True), (x, spec.has_residual), (stat, spec.layer_norm),
                              (stat, True)) if used]
    return f"{', '.join(ins)} -> {', '.join(outs)}"


def _backward_rule(spec: NormSpec, mesh, operand_types, result_types) -> str:
    x, param, gradient, stat = _factors(spec, operand_types[0].rank)
    ins = [f for f, used in ((x, True), (x, spec.prenorm), (x, True), (param, spec.has_weight),
                             (param, spec.has_bias), (stat, spec.layer_norm), (stat, True))
           if used]
    outs = [f for f, used in ((x, True), (x, spec.residual_dtype is not None),
                              (gradient, spec.has_weight), (gradient, spec.has_bias)) if used]
    return f"{', '.join(ins)} -> {', '.join(outs)}"


def _forward_results(spec: NormSpec, mesh, split: _Split) -> tuple:
    xs, stat = split.x(mesh), split.stat(mesh, spec)
    return _present((True, spec.has_residual, spec.layer_norm, True), (xs, xs, stat, stat))


def _backward_results(spec: NormSpec, mesh, split: _Split) -> tuple:
    xs, grad = split.x(mesh), split.param(mesh, spec, gradient=True)
    return _present((True, spec.residual_dtype is not None, spec.has_weight, spec.has_bias),
                    (xs, xs, grad, grad))


def _forward_infer(spec, mesh, arg_shapes, result_shape):
    x = arg_shapes[0]
    return _forward_results(spec, mesh, _Split.of(spec, x, mesh))


def _backward_infer(spec, mesh, arg_shapes, result_shape):
    h = arg_shapes[2]
    return _backward_results(spec, mesh, _Split.of(spec, h, mesh))


# --- partitions -----------------------------------------------------------------------------


def _local(spec: NormSpec, split: _Split) -> NormSpec:
    return dataclasses.replace(spec, axis_name=spec.axis_name + split.hidden_axes)


def _forward_partition(spec: NormSpec, mesh, arg_shapes, result_shape):
    x = arg_shapes[0]
    split = _Split.of(spec, x, mesh)
    xs, param = split.x(mesh), split.param(mesh, spec)
    args = _present((True, spec.has_residual, spec.has_weight, spec.has_bias),
                    (xs, xs, param, param))
    local = _local(spec, split)

    def shard(x, residual, weight, bias):
        return dispatch.forward(local, x, residual, weight, bias)

    return mesh, shard, _forward_results(spec, mesh, split), args


def _backward_partition(spec: NormSpec, mesh, arg_shapes, result_shape):
    h = arg_shapes[2]
    split = _Split.of(spec, h, mesh)
    xs, param, stat = split.x(mesh), split.param(mesh, spec), split.stat(mesh, spec)
    args = _present((True, spec.prenorm, True, spec.has_weight, spec.has_bias,
                     spec.layer_norm, True), (xs, xs, xs, param, param, stat, stat))
    local = _local(spec, split)

    def shard(dy, dh, h, weight, bias, mean, rstd):
        return dispatch.backward(local, dy, dh, h, weight, bias, mean, rstd,
                                 row_axes=split.row_axes)

    return mesh, shard, _backward_results(spec, mesh, split), args


def _unsplit_backward(spec: NormSpec, dy, dh, h, weight, bias, mean, rstd):
    return dispatch.backward(spec, dy, dh, h, weight, bias, mean, rstd)


#: ``forward(spec, x, residual, weight, bias)``: :func:`tilenorm.jax.dispatch.forward` of
#: the whole call, partitioned.
forward = custom_partitioning(dispatch.forward, static_argnums=(0,))
forward.def_partition(_forward_partition, infer_sharding_from_operands=_forward_infer,
                      sharding_rule=_forward_rule)

#: ``backward(spec, dy, dh, h, weight, bias, mean, rstd)``: the backward of the whole call,
#: partitioned (weight gradients summed over the shards of the rows).
backward = custom_partitioning(_unsplit_backward, static_argnums=(0,))
backward.def_partition(_backward_partition, infer_sharding_from_operands=_backward_infer,
                       sharding_rule=_backward_rule)
