"""The PyTorch layer: functional ops, autograd, torch.library custom ops and modules."""

from tilenorm.pytorch.modules import RMSNorm
from tilenorm.pytorch.rms_norm import explain, rms_norm, rms_norm_backward, rms_norm_forward

__all__ = ["RMSNorm", "explain", "rms_norm", "rms_norm_backward", "rms_norm_forward"]
