"""FP8 training norms: RMSNorm and LayerNorm whose output is quantized to FP8 in the same pass
(per tensor, per row, per 1 x 128 block, MXFP8), fused with the residual add, optionally
reading FP8 input. The PyTorch ops of :mod:`tilenorm.pytorch.fp8`, whose docstring is the
design.

    out = tilenorm.fp8.rms_norm_forward(x, w, scaling="row")     # launch level
    a = tilenorm.fp8.rms_norm(x, w, scaling="tensor", transpose=True)   # with autograd
    a.fp8, a.scale_inv, a.amax, a.fp8_t
"""

from tilenorm.pytorch.fp8 import (
    FP8_DTYPES,
    MX_LAYOUTS,
    SCALINGS,
    Float8NormOutput,
    Float8NormTensor,
    dequantize,
    explain,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)

__all__ = ["FP8_DTYPES", "MX_LAYOUTS", "SCALINGS", "Float8NormOutput", "Float8NormTensor",
           "dequantize", "explain", "layer_norm", "layer_norm_backward", "layer_norm_forward",
           "rms_norm", "rms_norm_backward", "rms_norm_forward"]
