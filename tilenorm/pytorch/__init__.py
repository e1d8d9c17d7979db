"""The PyTorch layer: functional ops, autograd, torch.library custom ops and modules."""

from tilenorm.pytorch.layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from tilenorm.pytorch.modules import LayerNorm, RMSNorm
from tilenorm.pytorch.rms_norm import explain, rms_norm, rms_norm_backward, rms_norm_forward

__all__ = ["LayerNorm", "RMSNorm", "explain", "layer_norm", "layer_norm_backward",
           "layer_norm_forward", "rms_norm", "rms_norm_backward", "rms_norm_forward"]
