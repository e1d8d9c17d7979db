"""tilenorm: persistent, tile-based, deterministic normalization kernels for PyTorch.

    import tilenorm
    y = tilenorm.rms_norm(x, weight, eps=1e-6)
    y, h = tilenorm.rms_norm(x, weight, residual=h, prenorm=True)     # fused residual add
    q = tilenorm.rms_norm(q, q_weight, per_head=True)                 # (..., H, D) QK-norm
    y = tilenorm.layer_norm(x, weight, bias, eps=1e-5)
    norm = tilenorm.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
    print(tilenorm.explain(x, weight))
    q = tilenorm.fp8.rms_norm(x, weight, scaling="row")                # FP8 output
"""

from tilenorm import fp8
from tilenorm._experimental import experimental, experimental_enabled, set_experimental
from tilenorm.pytorch import (
    LayerNorm,
    RMSNorm,
    explain,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)

__version__ = "0.1.0"
__all__ = [
    "LayerNorm",
    "RMSNorm",
    "experimental",
    "experimental_enabled",
    "explain",
    "fp8",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "set_experimental",
]
