"""FP8 training norms (issue 19): RMSNorm and LayerNorm whose output goes straight to FP8 for
the next GEMM, fused with the residual add, optionally reading FP8 input; deterministic.

Where things live
-----------------
``tilenorm.fp8`` (this module) is the API; the device code is
``tilenorm/kernels/cutile_row_norm_fp8.py`` (its own kernel family, ``cutile/norm-fp8``, so
the validated bf16 kernels keep their record), bound in ``tilenorm/launch/cutile_fp8.py``
and planned in ``tilenorm/planner.py`` (``plan_fp8_*``). CPU tensors, and anything no kernel
covers, take the reference path of ``tilenorm/pytorch/reference.py`` (``norm_fp8_forward``)
with the kernels' semantics; ``tilenorm/testing.py`` holds the float64 reference of the same
math (``float64_fp8_norm``) that the tests and benchmarks check against.

Ops
---
``rms_norm(x, weight, eps, *, scaling, fp8_dtype, scale, transpose, offset, residual,
prenorm, residual_dtype, x_scale_inv, group_size)`` and ``layer_norm(x, weight, bias, eps,
...)`` with autograd, and the launch-level ``rms_norm_forward`` / ``layer_norm_forward`` (no
autograd: a :class:`Float8NormOutput`) and ``rms_norm_backward`` / ``layer_norm_backward``.

``scaling`` says how y (computed in fp32) is scaled into FP8 (E4M3 ``torch.float8_e4m3fn``
or E5M2 ``torch.float8_e5m2``, ``fp8_dtype``):

=========== ========================================= ============================================
scaling     scale_inv (what dequantizes: y ~ q * s)   layout
=========== ========================================= ============================================
"tensor"    one, from this call's amax (current)      shape (), fp32
"delayed"   one, 1 / ``scale`` (TE's multiplier)      shape (), fp32; ``amax`` of this call returned
"row"       one per row (per token)                   (M, 1) fp32: ``torch._scaled_mm``'s rowwise
"block"     one per 1 x 128 block of a row            (M, N / 128) fp32, strides (1, M): the
                                                      layout of ``torch._scaled_mm``'s
                                                      BlockWise1x128 and DeepGEMM
"mx"        one per 1 x 32 block, E8M0 (power of 2)   (M, N / 32) ``torch.float8_e8m0fnu``,
                                                      row-major (MXFP8; Blackwell's GEMMs take
                                                      it after the 128 x 4 swizzle)
=========== ========================================= ============================================

M is the product of x's leading dimensions; q keeps x's shape. ``transpose=True`` also
writes the (N, M) copy that the weight-gradient GEMM reads, from the same pass over y: for
"tensor" and "delayed" (one scale serves both copies). Row and block scales run along N; the
transposed copy needs its own along M (128 x 1 blocks), so for "row", "block" and "mx" it is
designed (a second pass of 128-row column blocks, scales (N, M / 128)) but not built, and
asking for it raises.

Scale conventions
-----------------
For a group G (the tensor, a row or a block) with ``amax = max |y|`` over G (NaN ignored):

- fp32 ``scale = fp8_max / amax`` (E4M3 448, E5M2 57344), ``q = cast(saturate(y * scale))``
  with round-to-nearest-even, ``scale_inv = 1 / scale`` (fp32, correctly rounded): what
  ``torch._scaled_mm`` takes, and what TE and torchao store. Saturation happens before the
  cast (E5M2 would otherwise round to inf; E4M3 has no inf).
- ``amax == 0`` (an all-zero group) or ``amax`` not finite: ``scale = 1``, so q is 0 (or
  saturated) and ``scale_inv`` is 1, finite. A scale that would overflow fp32 (amax below
  ~1e-36) is clamped to the largest finite fp32.
- "delayed": ``scale`` is TE's quantize multiplier (a one-element fp32 tensor on x's device,
  from the amax history); q uses it as given, ``scale_inv = 1 / scale``, and ``amax`` is
  this call's, for the history.
- "mx": the power of two ``scale_inv = 2^k`` with the smallest k such that ``amax <= fp8_max
  * 2^k`` (rounded up, as TE's MXFP8 cast, so nothing saturates; the OCP spec's floor would
  saturate the block's largest values), computed exactly from amax's bits; k is clamped to
  E8M0's [-127, 127]; ``amax == 0`` gives k = 0.
- NaN stays where it was: a NaN (or inf) in x makes its row's y NaN (rstd is NaN), and the
  amax of every group skips NaN, so other rows' and blocks' scales and values are untouched.
  A NaN element quantizes to FP8 NaN.

Per-tensor current scaling: two launches, deterministic
-------------------------------------------------------
A tensor's amax is known only after every row is normalized. Pass 1 (one program per SM,
persistent) reads x (and the residual, writing h), writes rstd (and mean) and one amax per
program into an fp32 partial buffer; pass 2, over (rows x 128-column) blocks, reads the whole
partial buffer (max is exact and order-free, so every program gets the same amax bit for
bit), derives the scale, re-reads x (or h) and writes q (and the transposed copy); its
program 0 writes ``amax`` and ``scale_inv``. x is read twice: the "two reads" design the
issue allows (5 bytes a bf16 element instead of 3). "delayed" with ``transpose=True`` runs the
same two passes with the given scale. Without ``transpose``, "delayed" is one pass plus a
one-program kernel that folds the per-program amaxes into ``amax``. No atomics anywhere.

FP8 input
---------
``x`` may be FP8 with ``x_scale_inv`` of shape (M, N / group_size) fp32 (one dequantize
multiplier per group of ``group_size`` consecutive elements of a row, a power of two up to
128; COAT uses 16): the kernels dequantize as they load. The backward re-reads FP8 x and its
scales (nothing bf16 is saved). With a fused residual, h = dequant(x) + residual is stored and
the backward reads h, as the bf16 ops do.

Autograd: how the FP8 output's gradient arrives in bf16
-------------------------------------------------------
Torch's autograd engine casts a gradient to the dtype of the tensor it is the gradient of, so
a plain FP8 output would receive an FP8 gradient. The peers avoid this two ways: Transformer
Engine's ``Float8Tensor`` and torchao's ``Float8TrainingTensor`` are wrapper subclasses whose
dtype is the nominal high-precision one (the FP8 bytes and scales are attributes), so the
gradient arrives in that dtype; COAT keeps the FP8 norm output inside one
``autograd.Function`` with the GEMM that consumes it, whose backward hands the norm's backward
a bf16 gradient. tilenorm follows TE and torchao: ``tilenorm.fp8.rms_norm`` returns a
:class:`Float8NormTensor`, a wrapper subclass of nominal dtype x's (bf16), shape x's, holding
``fp8`` (the quantized data), ``scale_inv``, ``amax``, ``fp8_t`` and the scaling. An FP8 GEMM
Function takes it as an input, reads ``.fp8`` and ``.scale_inv`` and returns a bf16 gradient
for it, which reaches the norm's backward (dx in x's nominal dtype, bf16; dweight fp32 through
the fixed-order partial buffer, bit-identical reruns). Any other use of the tensor sees its
dequantized value (``q * scale_inv`` in the nominal dtype), so ordinary code stays correct. A
COAT-style fused Function calls the launch-level pair instead.
"""
