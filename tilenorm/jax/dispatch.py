"""Which path computes one shard of a JAX call, and why: the one place that decides.

The reference path (:mod:`tilenorm.jax.reference`, jnp) runs wherever the kernel path does
not. The kernel path is a :class:`KernelPath` installed with :func:`set_kernel_path`: the
forward and backward of tilenorm's prepared kernels as a JAX call (an XLA FFI call of the
launches that :mod:`tilenorm.launch.driver` prepares), for one lowering platform. Until one is
installed every call takes the reference path, and :func:`decide` says so;
:mod:`tilenorm.jax.kernels` is tilenorm's, installed on ``import tilenorm.jax`` where jaxlib
has a CUDA plugin.

Where the kernel path covers a call, the shard's computation is a
``jax.lax.platform_dependent`` choice: the kernel path where the program is lowered for its
platform, the reference path for any other, so one jitted function runs on CPU and GPU alike.
A call is decided when it is traced: install the kernel path before tracing (``jax.jit``
caches traces).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, reshard

from tilenorm import dispatch as kernel_dispatch
from tilenorm._experimental import experimental_enabled
from tilenorm.jax import reference
from tilenorm.jax.spec import NormSpec

#: The lowering platform of the CUDA kernels.
CUDA = "cuda"


@dataclass(frozen=True)
class KernelPath:
    """The kernels as JAX functions, for arrays of one lowering platform.

    ``covers`` decides a :class:`tilenorm.dispatch.Problem` (:func:`tilenorm.dispatch.decide`
    for the CUDA kernels); ``forward(spec, decision, x, residual, weight, bias)`` and
    ``backward(spec, decision, dy, dh, h, weight, bias, mean, rstd)`` have the signatures and
    results of :func:`tilenorm.jax.reference.forward` / ``backward`` after the spec (weight
    and bias gradients unrounded, summed over the shard's rows) and run one shard."""

    platform: str
    covers: Callable[[kernel_dispatch.Problem], kernel_dispatch.Decision]
    forward: Callable
    backward: Callable


_kernel_path: KernelPath | None = None


def varying_axes(t) -> frozenset:
    """The ``shard_map`` mesh axes over which ``t`` varies: its type's
    ``manual_axis_type.varying`` (JAX 0.10 on; ``vma`` before)."""
    aval = jax.typeof(t)
    manual = getattr(aval, "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset(getattr(aval, "vma", ()))


def set_kernel_path(path: KernelPath | None) -> KernelPath | None:
    """Install the kernel path (None: none, every call takes the reference path); returns
    the one it replaces. Calls traced before keep the path they were traced with."""
    global _kernel_path
    previous, _kernel_path = _kernel_path, path
    return previous


def kernel_path() -> KernelPath | None:
    """The installed kernel path, or None."""
    return _kernel_path


@dataclass(frozen=True)
class Decision:
    """What computes a call lowered for ``platform``, and why (``str()`` it). ``kernels`` is
    the kernel decision (plans, status) where the kernel path runs, else None."""

    op: str
    platform: str
    reason: str
    kernels: kernel_dispatch.Decision | None = None

    @property
    def uses_kernel(self) -> bool:
        return self.kernels is not None

    def __str__(self) -> str:
        if not self.uses_kernel:
            return f"{self.op} on {self.platform}: reference path (jnp), because {self.reason}"
        return f"{self.op} on {self.platform}: kernel path\n{self.kernels}"


def _problem(spec: NormSpec, x, residual, weight, bias) -> kernel_dispatch.Problem:
    """The kernels' view of a shard: rows x heads vectors of cols elements (the batch
    dimensions of a batching rule are heads: each has a weight gradient of its own)."""
    shape = tuple(x.shape)
    cols = math.prod(shape[len(shape) - spec.dims:])
    heads = math.prod(shape[:spec.batch_dims]) * (shape[-2] if spec.per_head else 1)
    rows = math.prod(shape) // (heads * cols) if heads * cols else 0
    dtypes = [t.dtype for t in (x, weight, bias, residual) if t is not None]
    dtypes += [d for d in (spec.out_dtype, spec.h_dtype) if d is not None]
    return kernel_dispatch.Problem(
        op=spec.op, device_type=CUDA, device_index=0,
        dtypes=tuple(np.dtype(d).name for d in dtypes), rows=rows, heads=heads, cols=cols,
        per_head_weight=spec.per_head or spec.batch_dims > 0,
        max_offset=max(math.prod(shape) - 1, 0), allow_experimental=experimental_enabled())


def decide(spec: NormSpec, x, residual, weight, bias, platform: str) -> Decision:
    """What computes the shard of a call with these operands (arrays, tracers or
    ``jax.ShapeDtypeStruct``s; x is h for a backward) when lowered for ``platform``."""
    path = _kernel_path
    kernels_platform = CUDA if path is None else path.platform
    if platform != kernels_platform:
        return Decision(spec.op, platform, f"x is on {platform}; the kernels run on "
                                           f"{kernels_platform}")
    if spec.axis_name:
        return Decision(spec.op, platform,
                        f"the normalized dimension is split across the mesh axes "
                        f"{spec.axis_name}: the row statistics are partial sums added across "
                        f"devices, which the kernels do not compute")
    if spec.batched_params:
        return Decision(spec.op, platform, "the weight or bias is batched by jax.vmap (a "
                                           "weight per example)")
    if path is None:
        return Decision(spec.op, platform,
                        "tilenorm.jax has no kernel path installed (jaxlib has no CUDA "
                        "plugin, or TILENORM_NATIVE=0)")
    kernels = path.covers(_problem(spec, x, residual, weight, bias))
    if not kernels.uses_kernel:
        return Decision(spec.op, platform, kernels.reason)
    return Decision(spec.op, platform, kernels.reason, kernels)


def _either(spec: NormSpec, arrays: tuple, reference_fn: Callable, launch: str, x, residual,
            weight, bias):
    """``reference_fn`` over ``arrays``, or a platform-dependent choice of the kernel path's
    ``launch`` (``"forward"`` or ``"backward"``) where the path covers a call over these x (h
    for a backward), residual, weight and bias."""
    path = _kernel_path
    if path is not None:
        decision = decide(spec, x, residual, weight, bias, path.platform)
        if decision.uses_kernel:
            reference_fn = functools.partial(reference_fn, spec)
            kernel = _unsplit(functools.partial(getattr(path, launch), spec, decision.kernels),
                              reference_fn)
            return lax.platform_dependent(*arrays, default=reference_fn,
                                          **{path.platform: kernel})
    return reference_fn(spec, *arrays)


def _split(t) -> bool:
    """Whether ``t``'s type is split across explicit mesh axes."""
    return t is not None and any(e is not None for e in jax.typeof(t).sharding.spec)


def _unsplit(kernel: Callable, reference_fn: Callable) -> Callable:
    """``kernel`` for operands whose types may be split across a mesh's explicit axes: the
    kernel path reshapes its operands to the kernels' (rows, heads, cols), which such types
    do not always allow, so it gets them replicated, and its results get the types of the
    reference path's. Only a call on one device runs this way, where nothing moves; a call
    partitioned across devices traces it for its types, and each device runs the computation
    of its shard, whose operands are plain arrays."""
    def run(*arrays):
        if not any(_split(t) for t in arrays):
            return kernel(*arrays)
        wanted = jax.eval_shape(reference_fn, *arrays)
        out = kernel(*(None if t is None else reshard(
            t, NamedSharding(jax.typeof(t).sharding.mesh, PartitionSpec())) for t in arrays))
        return tuple(o if o is None or jax.typeof(o).sharding.spec == w.sharding.spec
                     else reshard(o, w.sharding) for o, w in zip(out, wanted, strict=True))
    return run


def forward(spec: NormSpec, x, residual, weight, bias):
    """``(y, h, mean, rstd)`` of one shard, as :func:`tilenorm.jax.reference.forward`."""
    return _either(spec, (x, residual, weight, bias), reference.forward, "forward", x,
                   residual, weight, bias)


def backward(spec: NormSpec, dy, dh, h, weight, bias, mean, rstd, row_axes=()):
    """``(dx, dresidual, dweight, dbias)`` of one shard, as
    :func:`tilenorm.jax.reference.backward`; dweight and dbias are summed with ``psum`` over
    ``row_axes``, the mesh axes that split the rows sharing a weight."""
    dx, dres, dweight, dbias = _either(spec, (dy, dh, h, weight, bias, mean, rstd),
                                       reference.backward, "backward", h, None, weight, bias)
    if row_axes:
        dweight, dbias = (None if g is None else lax.psum(g, row_axes)
                          for g in (dweight, dbias))
    return dx, dres, dweight, dbias
