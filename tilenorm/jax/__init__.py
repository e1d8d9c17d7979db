"""tilenorm for JAX: RMSNorm and LayerNorm with tilenorm's semantics, a ``custom_vjp``, a
batching rule and sharding rules (``pip install tilenorm[jax]``).

    import tilenorm.jax as tj
    y = tj.rms_norm(x, weight, eps=1e-6)
    y, h = tj.rms_norm(x, weight, residual=h, prenorm=True)      # fused residual add
    q = tj.rms_norm(q, q_weight, per_head=True)                  # (..., H, D) QK-norm
    y = tj.layer_norm(x, weight, bias, eps=1e-5)
    print(tj.explain(x, weight))                                 # which path runs, and why

:mod:`tilenorm.jax.sharding` runs the ops under ``shard_map``; :mod:`tilenorm.jax.flax` has
Flax modules (imported on first use).

Importing this module installs the CUDA kernel path (:mod:`tilenorm.jax.kernels`: the cuTile
kernels as XLA FFI calls) where jaxlib has a CUDA plugin and ``TILENORM_NATIVE`` is not 0; it
starts no backend and builds nothing until a call is first traced for CUDA.
"""

import importlib

from tilenorm.jax import kernels
from tilenorm.jax.dispatch import Decision, KernelPath, kernel_path, set_kernel_path
from tilenorm.jax.functional import (
    explain,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)

__all__ = [
    "Decision",
    "KernelPath",
    "explain",
    "kernel_path",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "set_kernel_path",
]

kernels.install_default()


def __getattr__(name: str):
    if name in ("flax", "sharding"):
        return importlib.import_module(f"tilenorm.jax.{name}")
    raise AttributeError(f"module 'tilenorm.jax' has no attribute {name!r}")
