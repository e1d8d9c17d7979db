"""tilenorm: persistent, tile-based, deterministic normalization kernels for PyTorch.

    import tilenorm
    y = tilenorm.rms_norm(x, weight, eps=1e-6)
    norm = tilenorm.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
    print(tilenorm.explain(x, weight))
"""

from tilenorm._experimental import experimental, experimental_enabled, set_experimental
from tilenorm.pytorch import RMSNorm, explain, rms_norm, rms_norm_backward, rms_norm_forward

__version__ = "0.1.0"
__all__ = [
    "RMSNorm",
    "experimental",
    "experimental_enabled",
    "explain",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "set_experimental",
]
