"""The JAX ops: RMSNorm and LayerNorm with a ``custom_vjp``, their launch-level forward and
backward, and :func:`explain`.

Semantics are the PyTorch ops' (:mod:`tilenorm.pytorch.functional`): float32 arithmetic
(float64 for float64 input), y in x's dtype unless ``out_dtype``, a fused residual add summed
in float32 and stored in ``residual_dtype``, Gemma's weight offset, a weight per head, and the
same errors for bad arguments. The normalized dimensions are the weight's (or bias's), else
the last one.

How a call is built, outside in:

- ``jax.custom_vjp``: the backward is tilenorm's, with float32 accumulation; the weight and
  bias gradients are summed over rows by one reduction in a fixed order, so reruns of a
  compiled function are bit-identical. Inside ``shard_map`` a gradient is ``psum``'d over
  the mesh axes its parameter is not split across (a replicated weight under data
  parallelism).
- ``jax.custom_batching.custom_vmap``: ``jax.vmap`` adds its axis as rows when the parameters
  are not batched (the forward) or as dimensions whose weight gradient is kept per example
  (the backward; ``jax.grad`` of a vmapped function sums them, ``jax.vmap`` of ``jax.grad``
  keeps them); batched parameters are per-example weights.
- ``custom_partitioning`` (:mod:`tilenorm.jax.partitioning`): under ``jax.jit`` with sharded
  operands each device computes its shard.
- :mod:`tilenorm.jax.dispatch`: the shard's computation, the kernel path or the jnp
  reference path.

Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) is not defined, as for any
``custom_vjp``, nor are second derivatives (the backward is a ``custom_partitioning`` call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from tilenorm.arguments import LAYER_NORM, RMS_NORM
from tilenorm.jax import checks, dispatch, partitioning
from tilenorm.jax.spec import NormSpec

AxisName = str | tuple[str, ...] | None


# --- batching rules ------------------------------------------------------------------------


def _batched(x, batched: bool, size: int):
    """x with the batch dimension in front (broadcast where it was not batched)."""
    if x is None or batched:
        return x
    return jnp.broadcast_to(x, (size,) + x.shape)


def _per_example(spec: NormSpec, params_batched: bool) -> NormSpec:
    """The spec with one more batch dimension whose parameters are per example where any is
    batched (or was at an inner level)."""
    return dataclasses.replace(spec, batch_dims=spec.batch_dims + 1,
                               batched_params=spec.batched_params or params_batched)


def _forward_rule(spec: NormSpec, axis_size: int, in_batched, x, residual, weight, bias):
    bx, br, bw, bb = in_batched
    x, residual = _batched(x, bx, axis_size), _batched(residual, br, axis_size)
    if spec.batched_params or bw or bb:
        spec = _per_example(spec, True)
        weight, bias = _batched(weight, bw, axis_size), _batched(bias, bb, axis_size)
    # else the batch dimension is more rows
    out = _forward(spec, x, residual, weight, bias)
    return out, tuple(None if o is None else True for o in out)


def _backward_rule(spec: NormSpec, axis_size: int, in_batched, dy, dh, h, weight, bias, mean,
                   rstd):
    bdy, bdh, bh, bw, bb, bmean, brstd = in_batched
    dy, dh, h = (_batched(t, b, axis_size) for t, b in ((dy, bdy), (dh, bdh), (h, bh)))
    mean, rstd = _batched(mean, bmean, axis_size), _batched(rstd, brstd, axis_size)
    spec = _per_example(spec, bool(bw or bb))
    if spec.batched_params:
        weight, bias = _batched(weight, bw, axis_size), _batched(bias, bb, axis_size)
    out = _backward(spec, dy, dh, h, weight, bias, mean, rstd)
    return out, tuple(None if o is None else True for o in out)


def _batchable(spec: NormSpec, fn: Callable, rule: Callable) -> jax.custom_batching.custom_vmap:
    batchable = jax.custom_batching.custom_vmap(lambda *args: fn(spec, *args))
    batchable.def_vmap(lambda axis_size, in_batched, *args: rule(spec, axis_size, in_batched,
                                                                   *args))
    return batchable


def _forward(spec: NormSpec, x, residual, weight, bias):
    """``(y, h, mean, rstd)``: the partitioned forward with its batching rule."""
    return _batchable(spec, partitioning.forward, _forward_rule)(x, residual, weight, bias)


def _backward(spec: NormSpec, dy, dh, h, weight, bias, mean, rstd):
    """``(dx, dresidual, dweight, dbias)``, gradients unrounded: the partitioned backward
    with its batching rule."""
    return _batchable(spec, partitioning.backward, _backward_rule)(dy, dh, h, weight, bias,
                                                                    mean, rstd)


# --- autodiff -------------------------------------------------------------------------------


def _typed_like(gradient, primal):
    """``gradient`` with ``primal``'s type: summed over the ``shard_map`` axes it varies over
    and ``primal`` does not (the gradient of a parameter replicated across devices is the sum
    of every device's), and resharded to ``primal``'s sharding where the mesh's axes are
    explicit (a replicated weight's gradient from x split along its hidden dimension)."""
    if gradient is None:
        return None
    axes = tuple(sorted(dispatch.varying_axes(gradient) - dispatch.varying_axes(primal)))
    if axes:
        gradient = lax.psum(gradient, axes)
    wanted = jax.typeof(primal).sharding
    return gradient if jax.typeof(gradient).sharding.spec == wanted.spec else jax.reshard(
        gradient, wanted)


def _norm_primal(spec: NormSpec, x, residual, weight, bias):
    y, h, _, _ = _forward(spec, x, residual, weight, bias)
    return (y, h) if spec.prenorm else y


def _norm_fwd(spec: NormSpec, x, residual, weight, bias):
    y, h, mean, rstd = _forward(spec, x, residual, weight, bias)
    saved = (x if h is None else h, weight, bias, mean, rstd)
    return ((y, h) if spec.prenorm else y), saved


def _norm_bwd(spec: NormSpec, saved, gradient):
    h, weight, bias, mean, rstd = saved
    dy, dh = gradient if spec.prenorm else (gradient, None)
    dx, dres, dweight, dbias = _backward(spec, dy, dh, h, weight, bias, mean, rstd)
    dweight, dbias = (None if g is None else _typed_like(g, p).astype(p.dtype)
                      for g, p in ((dweight, weight), (dbias, bias)))
    return _typed_like(dx, h), _typed_like(dres, h), dweight, dbias


_norm = jax.custom_vjp(_norm_primal, nondiff_argnums=(0,))
_norm.defvjp(_norm_fwd, _norm_bwd)


def _apply(op, x, weight, bias, eps, per_head, offset, residual, prenorm, residual_dtype,
           out_dtype, axis_name):
    spec = checks.forward_spec(op, x, weight, bias, residual, eps, offset, per_head, prenorm,
                               out_dtype, residual_dtype, axis_name)
    return _norm(spec, x, residual, weight, bias)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float | None = 1e-6, *,
             offset: float = 0.0, residual: jax.Array | None = None, prenorm: bool = False,
             out_dtype: DTypeLike | None = None, residual_dtype: DTypeLike | None = None,
             per_head: bool = False, axis_name: AxisName = None
             ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm: ``y = h / sqrt(mean(h^2) + eps) * (offset + weight)`` with ``h = x`` (or
    ``x + residual``), the mean over the normalized dimensions.

    Args:
        x: the input, of any shape ``(..., *weight.shape)``; bfloat16, float16, float32 or
            float64.
        weight: None, or an array of the normalized dimensions' shape (default: the last
            dimension); with ``per_head=True`` one of shape (H, N) for x of shape (..., H, N).
            Any floating dtype; y keeps x's dtype (the product is taken in float32, float64
            for a float64 operand).
        eps: added to the mean square; ``None`` is ``finfo(float32).eps`` (float64's for
            float64 x), torch's rule. Finite and >= 0.
        offset: the weight is used as ``offset + weight`` (Gemma's ``1 + w`` is
            ``offset=1.0``), in float32. Needs a weight.
        residual: an array of x's shape: the op normalizes ``h = x + residual``, summed in
            float32 and stored in ``residual_dtype`` (default the residual's dtype).
        prenorm: with a residual, return ``(y, h)`` so that h carries the residual stream.
        out_dtype: y's dtype; default x's.
        residual_dtype: the dtype h is stored in (needs a residual).
        per_head: normalize each last-dimension vector of x (..., H, N) with the weight row
            of its head: the QK-norm of attention with a weight per head.
        axis_name: inside ``shard_map``, the mesh axis (or axes) that the normalized
            dimension is split across (tensor parallelism): the row statistics are summed
            across it, as ``flax.linen.RMSNorm``'s ``axis_name``. Not needed under
            ``jax.jit`` with sharded operands, where the partitioning does it.

    Returns:
        y, or ``(y, h)`` with ``prenorm=True``.

    Differentiable (reverse mode) in x, weight and residual, the gradient that reaches h
    included. Works under ``jax.jit`` (the arguments other than arrays are static),
    ``jax.vmap``, ``jax.checkpoint`` and ``shard_map``. Bad arguments raise ``TypeError`` or
    ``ValueError`` naming the argument.
    """
    return _apply(RMS_NORM, x, weight, None, eps, per_head, offset, residual, prenorm,
                  residual_dtype, out_dtype, axis_name)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float | None = 1e-5, *, residual: jax.Array | None = None,
               prenorm: bool = False, out_dtype: DTypeLike | None = None,
               residual_dtype: DTypeLike | None = None, axis_name: AxisName = None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """LayerNorm: ``y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias`` (biased
    variance, as ``torch.nn.functional.layer_norm``) over the normalized dimensions.

    Args:
        x: the input, of any shape ``(..., *weight.shape)``.
        weight, bias: None or arrays of the normalized dimensions' shape, any floating dtype;
            y keeps x's dtype.
        eps: added to the variance; ``None`` as in :func:`rms_norm`. Finite and >= 0.
        residual, prenorm, residual_dtype: a fused residual add, as in :func:`rms_norm`.
        out_dtype: y's dtype; default x's.
        axis_name: the mesh axes the normalized dimension is split across, as in
            :func:`rms_norm`.

    Returns:
        y, or ``(y, h)`` with ``prenorm=True``. Differentiable in x, weight, bias and residual.
    """
    return _apply(LAYER_NORM, x, weight, bias, eps, False, 0.0, residual, prenorm,
                  residual_dtype, out_dtype, axis_name)


# --- launch level --------------------------------------------------------------------------


def rms_norm_forward(x: jax.Array, weight: jax.Array | None = None,
                     eps: float | None = 1e-6, *, offset: float = 0.0,
                     residual: jax.Array | None = None,
                     residual_dtype: DTypeLike | None = None,
                     out_dtype: DTypeLike | None = None, per_head: bool = False,
                     axis_name: AxisName = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The forward without a VJP, for frameworks that keep their own graph: ``(y, h, rstd)``.
    h is x without a residual; rstd is float32 (float64 for float64 x) of x's shape without
    the normalized dimensions. Arguments as in :func:`rms_norm`."""
    spec = checks.forward_spec(RMS_NORM, x, weight, None, residual, eps, offset, per_head,
                               False, out_dtype, residual_dtype, axis_name)
    y, h, _, rstd = _forward(spec, x, residual, weight, None)
    return y, (x if h is None else h), rstd


def layer_norm_forward(x: jax.Array, weight: jax.Array | None = None,
                       bias: jax.Array | None = None, eps: float | None = 1e-5, *,
                       residual: jax.Array | None = None,
                       residual_dtype: DTypeLike | None = None,
                       out_dtype: DTypeLike | None = None, axis_name: AxisName = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The forward without a VJP: ``(y, h, mean, rstd)``; see :func:`rms_norm_forward`."""
    spec = checks.forward_spec(LAYER_NORM, x, weight, bias, residual, eps, 0.0, False, False,
                               out_dtype, residual_dtype, axis_name)
    y, h, mean, rstd = _forward(spec, x, residual, weight, bias)
    return y, (x if h is None else h), mean, rstd


def _launch_backward(op, dy, dh, h, weight, bias, mean, rstd, offset, per_head, x_dtype,
                     residual_dtype, axis_name):
    spec = checks.backward_spec(op, dy, dh, h, weight, bias, mean, rstd, offset, per_head,
                                x_dtype, residual_dtype, axis_name)
    dx, dres, dweight, dbias = _backward(spec, dy, dh, h, weight, bias, mean, rstd)
    return (dx, dres, *(None if g is None else g.astype(p.dtype)
                        for g, p in ((dweight, weight), (dbias, bias))))


def rms_norm_backward(dy: jax.Array, h: jax.Array, weight: jax.Array | None,
                      rstd: jax.Array, *, offset: float = 0.0, per_head: bool = False,
                      dh: jax.Array | None = None, x_dtype: DTypeLike | None = None,
                      residual_dtype: DTypeLike | None = None, axis_name: AxisName = None
                      ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The backward from :func:`rms_norm_forward`'s h and rstd: ``(dx, dresidual, dweight)``.
    With a fused residual pass ``residual_dtype`` (the residual input's dtype), ``x_dtype``
    (x's dtype, default h's) and ``dh``, the gradient that reached h directly (or None);
    dresidual is None without a residual, dweight None without a weight. dweight is summed
    over every row (inside ``shard_map``, over this device's rows)."""
    return _launch_backward(RMS_NORM, dy, dh, h, weight, None, None, rstd, offset, per_head,
                            x_dtype, residual_dtype, axis_name)[:3]


def layer_norm_backward(dy: jax.Array, h: jax.Array, weight: jax.Array | None,
                        bias: jax.Array | None, mean: jax.Array, rstd: jax.Array, *,
                        dh: jax.Array | None = None, x_dtype: DTypeLike | None = None,
                        residual_dtype: DTypeLike | None = None, axis_name: AxisName = None
                        ) -> tuple[jax.Array, jax.Array | None, jax.Array | None,
                                   jax.Array | None]:
    """The backward from :func:`layer_norm_forward`'s h, mean and rstd: ``(dx, dresidual,
    dweight, dbias)``; ``dh``, ``x_dtype`` and ``residual_dtype`` as in
    :func:`rms_norm_backward`."""
    return _launch_backward(LAYER_NORM, dy, dh, h, weight, bias, mean, rstd, 0.0, False,
                            x_dtype, residual_dtype, axis_name)


def explain(x: jax.Array, weight: jax.Array | None = None,
            residual: jax.Array | None = None, *, bias: jax.Array | None = None,
            layer_norm: bool = False, per_head: bool = False,
            out_dtype: DTypeLike | None = None, residual_dtype: DTypeLike | None = None,
            axis_name: AxisName = None, platform: str | None = None) -> dispatch.Decision:
    """What :func:`rms_norm` (with ``layer_norm=True``, :func:`layer_norm`) runs for these
    operands on one device when lowered for ``platform`` (default: x's platform, or JAX's
    default backend for a tracer or shape), and why: the kernel path or the reference path.
    Print it (``str()``); operands may be arrays or ``jax.ShapeDtypeStruct``s."""
    op = LAYER_NORM if layer_norm else RMS_NORM
    platform = _platform(x) if platform is None else platform
    found = []

    def decide(x, weight, residual, bias):
        spec = checks.forward_spec(op, x, weight, bias, residual, None, 0.0, per_head, False,
                                   out_dtype, residual_dtype, axis_name)
        found.append(dispatch.decide(spec, x, residual, weight, bias, platform))

    jax.eval_shape(decide, x, weight, residual, bias)
    return found[0]


def _platform(x) -> str:
    """The lowering platform of x's devices (``cuda`` for NVIDIA GPUs)."""
    try:
        device = next(iter(x.devices()))
    except (AttributeError, TypeError, StopIteration, jax.errors.ConcretizationTypeError):
        return _lowering_platform(jax.default_backend())
    return _lowering_platform(device.platform)


def _lowering_platform(name: str) -> str:
    return dispatch.CUDA if name == "gpu" else name
