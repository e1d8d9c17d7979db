"""The PyTorch adapter: functional ops with autograd, launch-level forward and backward,
``torch.library`` custom ops for ``torch.compile``, and modules.

    functional.py   rms_norm, layer_norm, *_forward / *_backward, explain
    modules.py      RMSNorm, LayerNorm (subclasses of torch.nn's)
    checks.py       argument validation
    calls.py        per-layout prepared calls: outputs, pointers, launches
    autograd.py     the eager autograd Function
    custom_ops.py   tilenorm::norm_fwd / norm_bwd (and the FP8 ops' fp8_norm_fwd /
                    fp8_norm_input_bwd) for torch.compile and torch.export
    reference.py    the torch reference path (CPU, float64, shapes no kernel covers)
"""

from tilenorm.pytorch import custom_ops  # noqa: F401  (registers the tilenorm:: ops)
from tilenorm.pytorch.functional import (
    explain,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)
from tilenorm.pytorch.modules import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm", "explain", "layer_norm", "layer_norm_backward",
           "layer_norm_forward", "rms_norm", "rms_norm_backward", "rms_norm_forward"]
