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
                                                      row-major; with ``mx_layout="swizzled"``
                                                      the 128 x 4 tiles Blackwell's MXFP8 GEMMs
                                                      read (below)
=========== ========================================= ============================================

M is the product of x's leading dimensions; q keeps x's shape.

Transposed copies
-----------------
``transpose=True`` also writes the (N, M) copy ``data_t`` (contiguous) that the
weight-gradient GEMM reads: dW contracts over M, so the copy's scales run along M, each one
a function of the amax of y's values it covers:

=========== ========================================= ============================================
scaling     scale_inv_t (of the (N, M) copy)          layout
=========== ========================================= ============================================
"tensor",   the tensor's ``scale_inv`` (one scale     the same tensor, shape ()
"delayed"   serves both copies)
"row"       one per column of y: its amax over all    (N, 1) fp32: ``torch._scaled_mm``'s rowwise
            M rows                                    scale of the copy as ``a``; ``.t()``, (1, N),
                                                      as ``b`` (the copy's ``.t()``)
"block"     one per 128 x 1 block of y (a 1 x 128     (N, cdiv(M, 128)) fp32, strides (1, N): the
            block of the copy)                        copy's BlockWise1x128 scale as ``a``, and as
                                                      ``b`` in ``torch.nn.functional.scaled_mm``;
                                                      ``.t()`` is (cdiv(M, 128), N) contiguous,
                                                      ``torch._scaled_mm``'s ``scale_b`` of 1 x 128
                                                      blocks, and the memory of TE's columnwise
                                                      ``scale_inv`` of 1-D block scaling ((M / 128,
                                                      N), TE padding N to a multiple of 4)
"mx"        one per 32 x 1 block of y, E8M0           (N, cdiv(M, 32)) ``torch.float8_e8m0fnu``,
                                                      row-major: the copy's own MX scales as the
                                                      128 x 4 swizzle takes them. TE keeps MXFP8's
                                                      columnwise data (M, N), untransposed, with
                                                      scales (M / 32, N) padded: the transpose of
                                                      these
=========== ========================================= ============================================

(Checked against torch 2.13's ``_meta_registrations.py``, which states the shapes and strides
``_scaled_mm`` and ``scaled_mm`` take, and TE's ``Float8BlockQuantizer.get_scale_shape`` and
``MXFP8Quantizer``.) A last block along M shorter than 128 (32) takes the amax of the rows it
holds; the GEMMs themselves want M a multiple of 128 (32). ``dequantize(data_t,
scale_inv_t, scaling)`` dequantizes a copy, whose scales run along its own rows.

The kernels: the row kernel writes q and its scales as without the copy; for "row" it also
keeps, per program, each column's amax over its rows in a (grid, N) fp32 buffer, which
``fp8_column_amax`` reduces to one per column (max is exact and order-free: the same bits on
every run). ``fp8_quantize_transposed`` then re-reads x (or h) over 128 x 128 blocks (64 x
128 for "row") with the saved rstd (and mean), takes each block's 128 x 1 (four 32 x 1)
amaxes on chip, or the column's, and writes the copy and its scales. Rows past M count in
no amax (a padding row normalizes to LayerNorm's bias). x is read twice, as for per-tensor
current scaling. No atomics: reruns are bit-identical. For RMSNorm of 2-byte x without a
residual, M a multiple of 16, the CuTe DSL pass ``TransposedFp8Quantize``
(``tilenorm/kernels/cute_fp8_transpose.py``) writes the copy instead, with the same math
and scales (``tilenorm.dispatch`` decides; bench/NOTES.md #60 says why); for "row" at the
CuTe row kernel's widths that kernel keeps the column amaxes, and the copy computes y as it
does (``x * w`` first, then ``rstd``).

MX scales for Blackwell
-----------------------
``mx_layout="swizzled"`` returns MX scales (q's, and the copy's) in the layout that
Blackwell's block-scaled GEMMs read: cuBLAS's "1-D block scaling factors layout" (the cuBLAS
documentation's section on block scaling), which ``torch._scaled_mm`` and
``torch.nn.functional.scaled_mm`` take for MXFP8 on sm_100 (``SwizzleType.SWIZZLE_32_4_4``;
torch 2.13's meta checks ask for ``round_up(rows, 128) * round_up(K / 32, 4)`` E8M0 scales,
contiguous) and TE's MXFP8 tensors hold with ``with_gemm_swizzled_scales``
(``nvte_swizzle_scaling_factors``). The (R, C) scales (R rows of the operand, C = K / 32
groups: (M, N / 32) for q, (N, M / 32) for the copy) are zero-padded to (round_up(R, 128),
round_up(C, 4)) and cut into 128 x 4 tiles, stored one after another row-major over the
tiles, 512 bytes each; within a tile, element (i, j) sits at byte ``(i % 32) * 16 +
(i // 32) * 4 + j``. The result has that padded shape (TE's; torch's ``to_blocked`` in
``torch/testing/_internal/common_quantized.py`` returns the same bytes flat). The kernels
write the row-major scales as before and ``fp8_swizzle_mx_scales`` re-lays them, padding
included (one more launch per scale tensor, reading and writing 1 / 32 byte an element);
the reference path is ``reference.swizzle_mx_scales``. :func:`dequantize` (and the tensor's
``dequantize``) reads either layout.

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
program (rows past M left out) into an fp32 partial buffer; pass 2, over (rows x
128-column) blocks, reads the whole partial buffer (max is exact and order-free, so every
program gets the same amax bit for bit), derives the scale, re-reads x (or h) and writes q
(and the transposed copy); its program 0 writes ``amax`` and ``scale_inv``. x is read
twice: the "two reads" design the issue allows (5 bytes a bf16 element instead of 3).
"delayed" with ``transpose=True`` runs the same two passes with the given scale. Without
``transpose``, "delayed" is one pass plus a one-program kernel that folds the per-program
amaxes into ``amax``. No atomics anywhere.

FP8 input
---------
``x`` may be FP8 with ``x_scale_inv`` of shape (M, N / group_size) fp32 (one dequantize
multiplier per group of ``group_size`` consecutive elements of a row, a power of two up to
128; COAT uses 16): the kernels dequantize as they load. RMSNorm of FP8 x without a residual,
in groups of 16 elements or more, reads it in the CuTe DSL row kernel at the widths of
``settings_fp8.cute_forward_fp8_input``, which keeps the next rows' loads in flight; other
cases take cuTile's. A transposed copy of FP8 x is cuTile's ``fp8_quantize_transposed`` (the
CuTe copy reads 2-byte x), after the CuTe row kernel for "block" and "mx" scales; for "row"
scales cuTile's row kernel runs, whose y the copy's column amaxes are taken of. The backward
re-reads FP8 x and its scales (nothing bf16 is saved). With a fused
residual, h = dequant(x) + residual is stored and the backward reads h, as the bf16 ops do.

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
COAT-style fused Function calls the launch-level pair instead. FP8 x itself takes no gradient
through autograd (torch would cast it to FP8; the op raises if it requires one): the weight's
and the residual's gradients flow, and dx of FP8 x comes from the launch-level backward.

torch.compile
-------------
A compiled graph holds the ops as the ``torch.library`` custom ops ``tilenorm::fp8_norm_fwd``
and, for FP8 x, ``tilenorm::fp8_norm_input_bwd`` (``tilenorm/pytorch/custom_ops.py``: fake
implementations; inside, the same prepared calls as eager, kernels or reference path), with
no graph break (``fullgraph=True``, dynamic shapes). The ops return plain contiguous tensors
(data, scale_inv, amax, data_t, scale_inv_t, h, mean, rstd; block scales as their
transpose, MX scales as bytes, since inductor's C++ kernels have no E8M0 type); the traced
code around them takes the views this module returns and builds the
:class:`Float8NormTensor`, a traceable wrapper subclass (``__tensor_flatten__``). Autograd
is a Function the graph traces whole (``Fp8NormOpFunction``): forward the custom op,
backward ``tilenorm::norm_bwd`` (the bf16 norms' op) over h, or ``fp8_norm_input_bwd``. It
is not registered on the custom op, because the gradient of the op's FP8 output would reach
it cast to FP8 (the engine casts a gradient to its output's dtype), the reason the subclass
exists. A compiled function may return the tensor, but not to a caller who backpropagates a
plain gradient into it: AOTAutograd expects that gradient to be a Float8NormTensor (torch
2.13 lets a subclass declare no plain tangent). Inside a compiled model the tensor flows to
its consumer, as in eager mode.

Limits
------
Rows up to one tile (the forward's single-pass width: 32768 elements of 2-byte x for RMSNorm,
16384 for LayerNorm; the FP8-input backward's, half that); wider rows take the reference path,
and :func:`explain` names the limit. Operands are read contiguous (others are copied). The
swizzle of a copy's MX scales launches M / 1024 programs along the grid's second dimension,
whose CUDA limit (65535) sends M past about 2**26 rows to the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch.utils import _pytree

from tilenorm import dispatch
from tilenorm._experimental import experimental_enabled
from tilenorm.arguments import LAYER_NORM, RMS_NORM, dres_apart
from tilenorm.dispatch import Fp8Decision, Fp8Problem
from tilenorm.launch import cute, cutile, cutile_fp8
from tilenorm.launch.cutile_fp8 import Fp8NormFeatures
from tilenorm.launch.driver import ArrayLayout, DriverLaunch
from tilenorm.layout import contiguous_strides
from tilenorm.planner import CuteFp8ForwardPlan, CuteFp8TransposePlan
from tilenorm.pytorch import calls, checks, reference
from tilenorm.pytorch.calls import DTYPE_NAMES, NormSpec

Scaling = Literal["tensor", "delayed", "row", "block", "mx"]
SCALINGS = ("tensor", "delayed", "row", "block", "mx")
MxLayout = Literal["row_major", "swizzled"]
MX_LAYOUTS = reference.MX_LAYOUTS
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: The largest group of FP8 x's elements one multiplier may cover: the second pass's
#: 128-column blocks hold whole groups.
MAX_GROUP_SIZE = 128


class Float8NormOutput(NamedTuple):
    """A launch-level FP8-output forward: q (``data``, x's shape), its dequantizing scales
    (``scale_inv``, laid out per ``scaling``: see the module docstring), this call's
    ``amax`` (per-tensor scalings, shape (); else None), the (N, M) copy ``data_t`` and its
    scales ``scale_inv_t`` (with ``transpose=True``), the residual sum ``h`` (with a
    residual; else None), and the statistics ``mean`` (LayerNorm) and ``rstd`` (fp32, x's
    shape without N) that the backward takes; ``mx_layout`` says how MX scales are laid
    out."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor | None
    data_t: torch.Tensor | None
    scale_inv_t: torch.Tensor | None
    h: torch.Tensor | None
    mean: torch.Tensor | None
    rstd: torch.Tensor
    scaling: str
    mx_layout: str = "row_major"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` in ``dtype``, x's shape."""
        return dequantize(self.data, self.scale_inv, self.scaling, dtype, self.mx_layout)

    def dequantize_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data_t * scale_inv_t`` in ``dtype``, (N, M)."""
        return dequantize(self.data_t, self.scale_inv_t, self.scaling, dtype, self.mx_layout)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, scaling: str,
               dtype: torch.dtype = torch.float32, mx_layout: MxLayout = "row_major"
               ) -> torch.Tensor:
    """FP8 ``data`` (..., N) times its scales (the layout of ``scaling`` and, for "mx",
    ``mx_layout``), in ``dtype``. A transposed copy (N, M) takes its own scales the same
    way: they run along its rows."""
    q = data.reshape(-1, data.shape[-1]).float()
    if scaling == "mx" and mx_layout == "swizzled":
        scale_inv = reference.unswizzle_mx_scales(scale_inv, q.shape[0], -(-q.shape[1] // 32))
    if scaling == "mx":
        s = torch.pow(2.0, scale_inv.view(torch.uint8).float() - 127)
    else:
        s = scale_inv.float()
    if scaling in ("block", "mx"):
        s = s.repeat_interleave(reference.FP8_BLOCK_COLS[scaling], dim=1)[:, :q.shape[1]]
    return (q * s).to(dtype).reshape(data.shape)


# --- autograd's view of the FP8 output -----------------------------------------------------


class Float8NormTensor(torch.Tensor):
    """The FP8 output of :func:`rms_norm` / :func:`layer_norm` as autograd sees it: a wrapper
    of nominal dtype (x's, or bf16 for FP8 x) and x's shape, so that the gradient reaching it
    is in that dtype. ``fp8`` is q, ``scale_inv`` its scales (see the module docstring),
    ``amax`` this call's (per-tensor scalings), ``fp8_t`` the (N, M) copy and
    ``scale_inv_t`` its scales, ``mx_layout`` how MX scales are laid out. An FP8 GEMM reads
    those; every other use of the tensor sees its dequantized value.

    A traceable wrapper subclass (``__tensor_flatten__``): ``torch.compile`` builds it
    inside a graph. Inside, it flows to its consumers; a compiled function that returns it
    to a caller who backpropagates a plain gradient into it fails, as AOTAutograd expects
    that gradient to be of the output's subclass (torch 2.13 lets a subclass declare no
    plain tangent): return what its consumer made of it instead."""

    fp8: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor | None
    fp8_t: torch.Tensor | None
    #: ``scale_inv`` itself for the per-tensor scalings.
    scale_inv_t: torch.Tensor | None
    scaling: str
    mx_layout: str

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor | None,
                fp8_t: torch.Tensor | None, scale_inv_t: torch.Tensor | None, scaling: str,
                dtype: torch.dtype, mx_layout: MxLayout = "row_major"):
        t = torch.Tensor._make_wrapper_subclass(cls, fp8.shape, dtype=dtype,
                                                device=fp8.device)
        t.fp8, t.scale_inv, t.amax, t.scaling = fp8, scale_inv, amax, scaling
        t.fp8_t, t.scale_inv_t, t.mx_layout = fp8_t, scale_inv_t, mx_layout
        return t

    def __init__(self, *args, **kwargs):
        """Everything is set in ``__new__``; Dynamo traces a construction through both."""

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``fp8 * scale_inv`` as a plain tensor, in the nominal dtype by default."""
        return dequantize(self.fp8, self.scale_inv, self.scaling, dtype or self.dtype,
                          self.mx_layout)

    def __repr__(self) -> str:
        return (f"Float8NormTensor(scaling={self.scaling!r}, fp8={self.fp8.dtype}, "
                f"nominal dtype={self.dtype}, shape={tuple(self.shape)})")

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        names = ("fp8", "scale_inv", "amax", "fp8_t", "scale_inv_t")
        return ([n for n in names if getattr(self, n) is not None],
                (self.scaling, self.dtype, self.mx_layout))

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride
                             ) -> Float8NormTensor:
        scaling, dtype, mx_layout = meta
        return Float8NormTensor(inner["fp8"], inner["scale_inv"], inner.get("amax"),
                                inner.get("fp8_t"), inner.get("scale_inv_t"), scaling, dtype,
                                mx_layout)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            t = args[0]
            return cls(t.fp8, t.scale_inv, t.amax, t.fp8_t, t.scale_inv_t, t.scaling,
                       t.dtype, t.mx_layout)

        def plain(a):
            return a.dequantize() if isinstance(a, Float8NormTensor) else a

        args, kwargs = _pytree.tree_map(plain, (args, kwargs))
        return func(*args, **kwargs)


# --- argument checks -----------------------------------------------------------------------


def _check(op: str, x, weight, bias, residual, scaling, fp8_dtype, scale, transpose,
           x_scale_inv, group_size, prenorm, residual_dtype, mx_layout="row_major") -> int:
    """Every check of an FP8 call's arguments but eps and offset; x's group size (0: x is
    not FP8)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    fp8_x = x.dtype in FP8_DTYPES
    if not fp8_x:
        checks.check_x(op, x)
    elif x.dim() == 0:
        raise ValueError(f"{op}: x must have at least 1 dimension (..., N), got a 0-d tensor")
    n = x.shape[-1]
    checks.check_param(op, "weight", weight, x)
    checks.check_param(op, "bias", bias, x)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (n,):
            raise ValueError(f"{op}: {name} must have shape ({n},) (x's last dimension), got "
                             f"{tuple(p.shape)}")
    checks.check_residual(op, residual, x)
    checks.check_dtype(op, "residual_dtype", residual_dtype)
    checks.check_flag(op, "prenorm", prenorm)
    checks.check_flag(op, "transpose", transpose)
    if residual_dtype is not None and residual is None:
        raise ValueError(f"{op}: residual_dtype is the dtype of the residual stream; it needs "
                         f"a residual")
    if prenorm and residual is None:
        raise ValueError(f"{op}: prenorm=True returns (y, x + residual); it needs a residual")
    if scaling not in SCALINGS:
        raise ValueError(f"{op}: scaling must be one of {', '.join(map(repr, SCALINGS))}, "
                         f"got {scaling!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                        f"got {fp8_dtype}")
    if mx_layout not in MX_LAYOUTS:
        raise ValueError(f"{op}: mx_layout must be one of {', '.join(map(repr, MX_LAYOUTS))}, "
                         f"got {mx_layout!r}")
    if mx_layout != "row_major" and scaling != "mx":
        raise ValueError(f"{op}: mx_layout lays out MX scales; scaling={scaling!r} has none")
    if scaling == "delayed":
        if not (isinstance(scale, torch.Tensor) and scale.numel() == 1
                and scale.dtype == torch.float32 and scale.device == x.device):
            raise ValueError(f"{op}: scaling='delayed' takes scale, the quantize multiplier "
                             f"(fp8_max / amax of the history), as a one-element float32 "
                             f"tensor on {x.device}")
    elif scale is not None:
        raise ValueError(f"{op}: scale is the given multiplier of scaling='delayed'; "
                         f"scaling={scaling!r} computes its own")
    block = reference.FP8_BLOCK_COLS.get(scaling)
    if block and n % block:
        raise ValueError(f"{op}: scaling={scaling!r} scales blocks of {block} columns; x's "
                         f"last dimension {n} is not a multiple of {block}")
    if not fp8_x:
        if x_scale_inv is not None or group_size is not None:
            raise ValueError(f"{op}: x_scale_inv and group_size describe FP8 x; x is "
                             f"{x.dtype}")
        return 0
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
            or group_size & (group_size - 1) or group_size > MAX_GROUP_SIZE
            or n % group_size):
        raise ValueError(f"{op}: FP8 x takes group_size, the elements per scale: a power of "
                         f"two up to {MAX_GROUP_SIZE} dividing N = {n}; got {group_size!r}")
    rows = x.numel() // n if n else 0
    if not (isinstance(x_scale_inv, torch.Tensor) and x_scale_inv.dtype == torch.float32
            and tuple(x_scale_inv.shape) == (rows, n // group_size)
            and x_scale_inv.device == x.device):
        raise ValueError(f"{op}: FP8 x takes x_scale_inv, one float32 multiplier per group: "
                         f"shape ({rows}, {n // group_size}) on {x.device}")
    if x.requires_grad:
        raise ValueError(f"{op}: FP8 x cannot take a gradient through autograd (torch would "
                         f"cast it to FP8); use rms_norm_backward / layer_norm_backward")
    return group_size


# --- prepared calls ------------------------------------------------------------------------


class _Launcher:
    """A bound kernel ready to launch from the pointers of named tensors: its arrays'
    layouts by the kernel's names, and the tensors' names where they differ
    (``operands``)."""

    def __init__(self, bound: cutile.BoundKernel, layouts: dict[str, ArrayLayout],
                 device: torch.device, arch: tuple[int, int],
                 operands: dict[str, str] | None = None):
        launch: DriverLaunch | None = calls.driver_launch(bound, layouts, device, arch)
        if launch is None:
            raise ValueError(f"{bound.name}: an operand overlaps itself")
        self.name, self.launch = bound.name, launch.launch
        operands = operands or {}
        self.names = [operands.get(name, name) for name in bound.arrays if name in layouts]
        self.scalars = [name for name, _ in launch.recipe.scalars]

    def __call__(self, stream: int, tensors: dict[str, torch.Tensor],
                 scalars: dict[str, float] | None = None):
        """Launch on ``stream`` from the pointers of ``tensors`` and the runtime scalars the
        kernel takes from ``scalars``, all by name."""
        if not self.launch(stream, *(tensors[name].data_ptr() for name in self.names),
                           *(scalars[name] for name in self.scalars)):
            raise RuntimeError(f"{self.name}: operands not 16-byte aligned")


class _CuteLauncher:
    """The CuTe DSL FP8-output row kernel, compiled once a width and feature set (any row
    count), launched for one layout like a :class:`_Launcher` (TVM-FFI launches on the
    current stream)."""

    def __init__(self, plan: CuteFp8ForwardPlan, spec: Fp8Spec, scaling: str, x, weight,
                 arch: tuple[int, int]):
        self.plan, self.scaling, self.group = plan, scaling, spec.group
        self.fn = cute.compiled_fp8_forward(cute.Fp8ForwardKey(
            None, DTYPE_NAMES[x.dtype],
            None if weight is None else DTYPE_NAMES[weight.dtype],
            DTYPE_NAMES[spec.fp8_dtype], self.scaling, spec.has_offset, plan.cols,
            plan.threads, plan.stages, plan.ctas_per_sm, plan.recompute_t, plan.column_amax,
            spec.group, plan.clamp, plan.shared_ring), arch)
        # The program's amax, or with column_amax its column amaxes.
        self.amax = "column_amax_partial" if plan.column_amax else "amax_partial"

    def __call__(self, stream: int, tensors: dict[str, torch.Tensor],
                 scalars: dict[str, float]):
        rows, cols = self.plan.rows, self.plan.cols
        weight = tensors.get("weight")
        q = tensors["q"].view(rows, cols).view(torch.uint8) if self.scaling != "amax" else None
        x, x_scale_inv = tensors["x"].view(rows, cols), None
        if self.group:  # FP8 x as its bytes, as q
            x = x.view(torch.uint8)
            x_scale_inv = tensors["x_scale_inv"].view(rows, cols // self.group)
        self.fn(x, x_scale_inv, None if weight is None else weight.view(cols),
                tensors["scale"].reshape(1) if self.scaling == "delayed" else None, q,
                tensors.get("q_scale"), tensors["rstd"], tensors.get(self.amax),
                scalars["eps"], scalars["offset"], self.plan.grid)


class _CuteTransposeLauncher:
    """The CuTe DSL transposed copy (scales along M), compiled for one width, launched like
    a :class:`_Launcher` (TVM-FFI launches on the current stream)."""

    def __init__(self, plan: CuteFp8TransposePlan, spec: Fp8Spec, x, weight,
                 arch: tuple[int, int]):
        self.plan = plan
        self.fn = cute.compiled_fp8_transpose(cute.Fp8TransposeKey(
            DTYPE_NAMES[x.dtype], None if weight is None else DTYPE_NAMES[weight.dtype],
            DTYPE_NAMES[spec.fp8_dtype], spec.scaling, spec.has_offset, plan.cols,
            plan.tile_cols, plan.ctas_per_sm, plan.weight_first), arch)

    def __call__(self, stream: int, tensors: dict[str, torch.Tensor],
                 scalars: dict[str, float]):
        rows, cols = self.plan.rows, self.plan.cols
        weight = tensors.get("weight")
        self.fn(tensors["x"].view(rows, cols), None if weight is None else weight.view(cols),
                tensors["rstd"], tensors.get("column_amax"),
                tensors["q_t"].view(torch.uint8), tensors["q_t_scale"], scalars["offset"],
                self.plan.grid[1])


def _dense(dtype: torch.dtype, shape: tuple[int, ...]) -> ArrayLayout:
    return ArrayLayout(DTYPE_NAMES[dtype], tuple(shape), contiguous_strides(tuple(shape)))


def _kernel_operand(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as the kernels read it: contiguous on 16-byte-aligned storage (a copy only
    where it is not)."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class Fp8Spec:
    """Everything about an FP8 call that its layout key does not say."""

    op: str
    scaling: str
    fp8_dtype: torch.dtype
    transpose: bool
    group: int
    has_offset: bool
    mx_layout: str = "row_major"

    @property
    def layer_norm(self) -> bool:
        return self.op == LAYER_NORM

    @property
    def swizzled(self) -> bool:
        return self.mx_layout == "swizzled"


@dataclass
class Fp8ForwardCall:
    """An FP8-output forward with one operand layout: the decision and, where kernels run,
    their launchers in order."""

    spec: Fp8Spec
    decision: Fp8Decision
    rows: int
    cols: int
    out_shape: tuple[int, ...]
    h_dtype: torch.dtype | None
    nominal_dtype: torch.dtype
    device: torch.device
    launchers: list = field(default_factory=list)
    #: Programs of the row kernel that write an amax each (per-tensor scalings).
    partials: int = 0
    #: The backward calls of this forward's saved operands, by the gradients' layouts.
    backward_calls: dict = field(default_factory=dict)

    def outputs(self) -> dict[str, torch.Tensor]:
        """Fresh outputs of the kernels, by their array names (tests poison them)."""
        s, dev, rows, cols = self.spec, self.device, self.rows, self.cols
        out = {"q": torch.empty(self.out_shape, dtype=s.fp8_dtype, device=dev),
               "rstd": torch.empty(rows, dtype=torch.float32, device=dev)}
        if s.layer_norm:
            out["mean"] = torch.empty(rows, dtype=torch.float32, device=dev)
        if self.h_dtype is not None:
            out["residual_out"] = torch.empty(self.out_shape, dtype=self.h_dtype, device=dev)
        if s.scaling in ("tensor", "delayed"):
            out["amax"] = torch.empty((), dtype=torch.float32, device=dev)
            out["scale_inv"] = torch.empty((), dtype=torch.float32, device=dev)
            out["amax_partial"] = torch.empty(self.partials, dtype=torch.float32, device=dev)
        elif s.scaling == "row":
            out["q_scale"] = torch.empty((rows, 1), dtype=torch.float32, device=dev)
        elif s.scaling == "block":  # torch._scaled_mm's BlockWise1x128 layout: M contiguous
            out["q_scale"] = torch.empty_strided((rows, cols // 128), (1, rows),
                                                 dtype=torch.float32, device=dev)
        else:
            out["q_scale"] = torch.empty((rows, cols // 32), dtype=torch.uint8, device=dev)
        if s.transpose:
            out["q_t"] = torch.empty((cols, rows), dtype=s.fp8_dtype, device=dev)
        if s.transpose and s.scaling == "row":
            out["q_t_scale"] = torch.empty((cols, 1), dtype=torch.float32, device=dev)
            out["column_amax_partial"] = torch.empty((self.partials, cols),
                                                     dtype=torch.float32, device=dev)
            out["column_amax"] = torch.empty(cols, dtype=torch.float32, device=dev)
        elif s.transpose and s.scaling == "block":  # (N, M / 128), N contiguous
            out["q_t_scale"] = torch.empty_strided((cols, -(-rows // 128)), (1, cols),
                                                   dtype=torch.float32, device=dev)
        elif s.transpose and s.scaling == "mx":
            out["q_t_scale"] = torch.empty((cols, -(-rows // 32)), dtype=torch.uint8,
                                           device=dev)
        if s.swizzled:  # q_scale and q_t_scale stay row-major, as the swizzle reads them
            out["q_scale_blocked"] = torch.empty(_blocked_shape(rows, cols // 32),
                                                 dtype=torch.uint8, device=dev)
            if s.transpose:
                out["q_t_scale_blocked"] = torch.empty(_blocked_shape(cols, -(-rows // 32)),
                                                       dtype=torch.uint8, device=dev)
        return out

    def run(self, x, weight, bias, residual, x_scale_inv, scale, eps: float, offset: float
            ) -> Float8NormOutput:
        s = self.spec
        if not self.decision.uses_kernel:
            q, scale_inv, amax, q_t, scale_inv_t, h, mean, rstd = \
                reference.norm_fp8_forward(
                    x, weight, bias, eps, scaling=s.scaling, fp8_dtype=s.fp8_dtype,
                    scale=scale, transpose=s.transpose, layer_norm=s.layer_norm,
                    offset=offset, residual=residual, residual_dtype=self.h_dtype,
                    x_scale_inv=x_scale_inv, group_size=s.group, mx_layout=s.mx_layout)
            return Float8NormOutput(q, scale_inv, amax, q_t, scale_inv_t,
                                    h if residual is not None else None, mean, rstd,
                                    s.scaling, s.mx_layout)
        out = self.outputs()
        self.launch(out, x, weight, bias, residual, x_scale_inv, scale, eps, offset)
        return self.result(out)

    def launch(self, out: dict[str, torch.Tensor], x, weight, bias, residual, x_scale_inv,
               scale, eps: float, offset: float) -> None:
        """Launch the kernels on the current stream into ``out`` (from :meth:`outputs`)."""
        xs = _kernel_operand(x)
        tensors = {name: _kernel_operand(t) for name, t in (
            ("weight", weight), ("bias", bias), ("residual", residual),
            ("x_scale_inv", x_scale_inv), ("scale", scale)) if t is not None}
        tensors.update(out, x=xs, h=out.get("residual_out", xs))
        for name in ("amax", "scale_inv"):
            if name in out:
                tensors[name] = out[name].view(1)
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        scalars = {"eps": eps, "offset": offset}
        for launcher in self.launchers:
            launcher(stream, tensors, scalars)

    def result(self, out: dict[str, torch.Tensor]) -> Float8NormOutput:
        """The launch's outputs as the op returns them."""
        stat = self.out_shape[:-1]
        suffix = "_blocked" if self.spec.swizzled else ""
        scale_inv = out.get("scale_inv", out.get("q_scale" + suffix))
        scale_inv_t = out.get("q_t_scale" + suffix, scale_inv) if self.spec.transpose else None
        if self.spec.scaling == "mx":
            scale_inv = scale_inv.view(torch.float8_e8m0fnu)
            if scale_inv_t is not None:
                scale_inv_t = scale_inv_t.view(torch.float8_e8m0fnu)
        return Float8NormOutput(out["q"], scale_inv, out.get("amax"), out.get("q_t"),
                                scale_inv_t, out.get("residual_out"),
                                out["mean"].view(stat) if "mean" in out else None,
                                out["rstd"].view(stat), self.spec.scaling,
                                self.spec.mx_layout)


def _problem(spec: Fp8Spec, x, weight, bias, residual, rows: int, cols: int) -> Fp8Problem:
    dtypes = tuple(DTYPE_NAMES.get(t.dtype, str(t.dtype))
                   for t in (x, weight, bias, residual) if t is not None)
    return Fp8Problem(op=spec.op, device_type=x.device.type, device_index=x.device.index,
                      dtypes=dtypes, rows=rows, cols=cols, scaling=spec.scaling,
                      transpose=spec.transpose, has_residual=residual is not None,
                      mx_layout=spec.mx_layout, max_offset=max(x.numel() - 1, 0),
                      allow_experimental=experimental_enabled(), group=spec.group)


def _blocked_shape(rows: int, groups: int) -> tuple[int, int]:
    """The padded shape of (rows, groups) MX scales in 128 x 4 tiles."""
    return -(-rows // 128) * 128, -(-groups // 4) * 4


def _blocked_layout(rows: int, groups: int) -> ArrayLayout:
    """(rows, groups) MX scales in 128 x 4 tiles as the swizzle writes them: (row blocks,
    column blocks, 32, 4, 4) bytes."""
    shape = (-(-rows // 128), -(-groups // 4), 32, 4, 4)
    return ArrayLayout("uint8", shape, contiguous_strides(shape))


def _layouts(spec: Fp8Spec, x, weight, bias, residual, h_dtype, rows, cols, partials
             ) -> dict[str, ArrayLayout]:
    """Every operand's layout as the kernels read it (contiguous, (rows, cols) views)."""
    shape = (rows, cols)
    layouts = {"x": _dense(x.dtype, shape), "rstd": _dense(torch.float32, (rows,)),
               "q": _dense(spec.fp8_dtype, shape)}
    if spec.layer_norm:
        layouts["mean"] = _dense(torch.float32, (rows,))
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            layouts[name] = _dense(p.dtype, (1, cols))
    if spec.group:
        layouts["x_scale_inv"] = _dense(torch.float32, (rows, cols // spec.group))
    if residual is not None:
        layouts["residual"] = _dense(residual.dtype, shape)
        layouts["residual_out"] = _dense(h_dtype, shape)
    if spec.scaling in ("tensor", "delayed"):
        layouts["amax_partial"] = _dense(torch.float32, (partials,))
        layouts["amax"] = layouts["scale_inv"] = _dense(torch.float32, (1,))
    if spec.scaling == "delayed":
        layouts["scale"] = _dense(torch.float32, (1,))
    if spec.scaling == "row":
        layouts["q_scale"] = _dense(torch.float32, (rows, 1))
    elif spec.scaling == "block":
        layouts["q_scale"] = ArrayLayout("float32", (rows, cols // 128), (1, rows))
    elif spec.scaling == "mx":
        layouts["q_scale"] = _dense(torch.uint8, (rows, cols // 32))
    if spec.transpose:
        layouts["q_t"] = _dense(spec.fp8_dtype, (cols, rows))
    if spec.transpose and spec.scaling == "row":
        layouts["q_t_scale"] = _dense(torch.float32, (cols, 1))
        layouts["column_amax_partial"] = _dense(torch.float32, (partials, cols))
        layouts["column_amax"] = _dense(torch.float32, (cols,))
    elif spec.transpose and spec.scaling == "block":
        layouts["q_t_scale"] = ArrayLayout("float32", (cols, -(-rows // 128)), (1, cols))
    elif spec.transpose and spec.scaling == "mx":
        layouts["q_t_scale"] = _dense(torch.uint8, (cols, -(-rows // 32)))
    return layouts


def build_forward(spec: Fp8Spec, x, weight, bias, residual, residual_dtype,
                  nominal_dtype: torch.dtype) -> Fp8ForwardCall:
    """The prepared FP8 forward for these (already checked) operands."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    h_dtype = None if residual is None else (residual_dtype or residual.dtype)
    problem = _problem(spec, x, weight, bias, residual, rows, cols)
    decision = dispatch.decide_fp8(problem)
    call = Fp8ForwardCall(spec=spec, decision=decision, rows=rows, cols=cols,
                          out_shape=tuple(x.shape), h_dtype=h_dtype,
                          nominal_dtype=nominal_dtype, device=x.device)
    if not decision.uses_kernel:
        return call
    plan, arch = decision.forward, decision.device.arch
    features = Fp8NormFeatures(layer_norm=spec.layer_norm, has_weight=weight is not None,
                               has_bias=bias is not None, has_residual=residual is not None,
                               has_offset=spec.has_offset, group=spec.group)
    fp8_max = cutile_fp8.FP8_MAX[DTYPE_NAMES[spec.fp8_dtype]]
    per_tensor = spec.scaling in ("tensor", "delayed")
    column_amax = decision.column_amax is not None
    cute_plan = decision.cute_forward
    call.partials = (cute_plan or plan).grid if per_tensor or column_amax else 0
    layouts = _layouts(spec, x, weight, bias, residual, h_dtype, rows, cols, call.partials)
    # The second pass reads h: x as loaded (FP8 x with its multipliers), or the stored
    # residual sum.
    second = dict(layouts, h=layouts["residual_out"] if residual is not None else layouts["x"])
    if residual is not None:
        second.pop("x_scale_inv", None)
    two_passes = decision.quantize is not None
    row_scaling = problem.row_scaling
    # The row kernel: CuTe DSL's where the decision has it (its launcher comes first below).
    kernels = [] if cute_plan is not None else [(cutile_fp8.bind_fp8_forward(
        plan, features, row_scaling, fp8_max, column_amax), layouts)]
    if column_amax:
        kernels.append((cutile_fp8.bind_fp8_column_amax(decision.column_amax), layouts))
    if two_passes and per_tensor:
        kernels.append((cutile_fp8.bind_fp8_quantize(
            decision.quantize, features, call.partials, spec.scaling == "tensor",
            spec.transpose, fp8_max), second))
    elif two_passes:
        kernels.append((cutile_fp8.bind_fp8_quantize_transposed(
            decision.quantize, features, spec.scaling, fp8_max), second))
    elif spec.scaling == "delayed":
        kernels.append((cutile_fp8.bind_fp8_amax_finish(call.partials,
                                                        plan.dependent_launch), layouts))
    call.launchers = ([_CuteLauncher(cute_plan, spec, row_scaling, x, weight, arch)] if cute_plan
                      else [])
    call.launchers += [_Launcher(b, {k: v for k, v in kernel_layouts.items() if k in b.arrays},
                                 x.device, arch) for b, kernel_layouts in kernels]
    # The CuTe DSL transposed copy where the decision has it, after the column amaxes.
    if decision.cute_transpose is not None:
        call.launchers.append(_CuteTransposeLauncher(decision.cute_transpose, spec, x, weight,
                                                     arch))
    # The swizzle re-lays the row-major scales the kernels above wrote: q's, then q_t's.
    for swizzle, scales in ((decision.swizzle, "q_scale"), (decision.swizzle_t, "q_t_scale")):
        if swizzle is not None:
            swizzle_layouts = {"scales": layouts[scales],
                               "blocked": _blocked_layout(swizzle.rows, swizzle.groups)}
            call.launchers.append(_Launcher(
                cutile_fp8.bind_fp8_mx_swizzle(swizzle), swizzle_layouts, x.device, arch,
                {"scales": scales, "blocked": scales + "_blocked"}))
    return call


# --- the backward of FP8 x -----------------------------------------------------------------


@dataclass
class Fp8InputBackwardCall:
    """The backward of a norm of FP8 x with one operand layout: the FP8-input kernel and the
    fixed-order reduction of its partial buffer, or the reference path."""

    layer_norm: bool
    group: int
    decision: Fp8Decision
    rows: int
    cols: int
    device: torch.device
    groups: int = 0
    partial: cutile.PartialBuffer | None = None
    launch_row: _Launcher | None = None
    launch_reduce: _Launcher | None = None

    def run(self, dy, x, x_scale_inv, weight, bias, mean, rstd, offset: float):
        """(dx, dweight, dbias): dx in dy's dtype."""
        if not self.decision.uses_kernel:
            h = reference.dequantize_groups(x, x_scale_inv, self.group)
            dx, _, dweight, dbias = reference.norm_backward(
                dy, None, h, weight, bias, mean, rstd, offset=offset, x_dtype=dy.dtype)
            return dx, dweight, dbias
        dev = self.device
        dx = torch.empty(x.shape, dtype=dy.dtype, device=dev)
        tensors = {"dy": _kernel_operand(dy), "x": _kernel_operand(x),
                   "x_scale_inv": _kernel_operand(x_scale_inv), "rstd": rstd, "dx": dx}
        if mean is not None:
            tensors["mean"] = mean
        dweight = dbias = partial = None
        if self.groups:
            partial = torch.empty(self.partial.shape, dtype=torch.float32, device=dev)
            base = partial.view(-1)
        if weight is not None:
            tensors["weight"] = _kernel_operand(weight)
            dweight = torch.empty_like(weight, memory_format=torch.contiguous_format)
            tensors["partial_w"] = base[:self.partial.group_size]
        if bias is not None:
            dbias = torch.empty_like(bias, memory_format=torch.contiguous_format)
            start = self.partial.group_offset(int(weight is not None)) // 4
            tensors["partial_b"] = base[start:]
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        self.launch_row(stream, tensors, {"offset": offset})
        if self.groups:
            outs = [t for t in (dweight, dbias) if t is not None]
            self.launch_reduce(stream, {"partial": partial,
                                        **dict(zip(("out_a", "out_b"), outs, strict=False))})
        return dx, dweight, dbias


def build_input_backward(op: str, dy, x, weight, bias, group: int) -> Fp8InputBackwardCall:
    """The prepared backward of a norm of FP8 x for these (already checked) operands."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    spec = Fp8Spec(op, "row", x.dtype, False, group, False)
    decision = dispatch.decide_fp8(_problem(spec, x, weight, bias, None, rows, cols))
    call = Fp8InputBackwardCall(layer_norm=op == LAYER_NORM, group=group, decision=decision,
                                rows=rows, cols=cols, device=x.device)
    if not decision.uses_kernel:
        return call
    plan, arch = decision.backward, decision.device.arch
    features = Fp8NormFeatures(layer_norm=op == LAYER_NORM, has_weight=weight is not None,
                               has_bias=bias is not None, group=group)
    call.groups = (weight is not None) + (bias is not None)
    call.partial = cutile.PartialBuffer.of(plan, max(call.groups, 1))
    shape = (rows, cols)
    layouts = {"dy": _dense(dy.dtype, shape), "x": _dense(x.dtype, shape),
               "x_scale_inv": _dense(torch.float32, (rows, cols // group)),
               "rstd": _dense(torch.float32, (rows,)), "dx": _dense(dy.dtype, shape)}
    if op == LAYER_NORM:
        layouts["mean"] = _dense(torch.float32, (rows,))
    partial = ArrayLayout("float32", *call.partial.group())
    if weight is not None:
        layouts["weight"] = _dense(weight.dtype, (1, cols))
        layouts["partial_w"] = partial
    if bias is not None:
        layouts["partial_b"] = partial
    # The bias needs no operand of its own: dbias is the column sum of dy.
    call.launch_row = _Launcher(cutile_fp8.bind_fp8_input_backward(plan, features), layouts,
                                x.device, arch)
    if call.groups:
        outs = [p for p in (weight, bias) if p is not None]
        reduce_layouts = {"partial": ArrayLayout("float32", *call.partial.reduced())}
        reduce_layouts |= {name: _dense(p.dtype, (cols,))
                           for name, p in zip(("out_a", "out_b"), outs, strict=False)}
        call.launch_reduce = _Launcher(cutile.bind_reduce(plan, call.groups), reduce_layouts,
                                       x.device, arch)
    return call


# --- autograd and the ops ------------------------------------------------------------------


class _Prepared:
    """A layout's FP8 forward call with the options it was checked with."""

    __slots__ = ("call", "eps", "offset")

    def __init__(self, call: Fp8ForwardCall, eps: float, offset: float):
        self.call, self.eps, self.offset = call, eps, offset


def _prepared(op, x, weight, bias, residual, eps, offset, scaling, fp8_dtype, scale,
              transpose, x_scale_inv, group_size, prenorm, residual_dtype,
              mx_layout) -> _Prepared:
    """The prepared call for these arguments: looked up by their layout, or checked and
    prepared the first time."""
    try:
        key = ("fp8", op, calls.layouts(x, weight, bias, residual, x_scale_inv, scale), eps,
               offset, scaling, fp8_dtype, transpose, group_size, prenorm, residual_dtype,
               mx_layout, x.requires_grad, experimental_enabled())
        found = calls.lookup(key)
    except (AttributeError, TypeError):  # not tensors
        found = key = None
    if found is None:
        group = _check(op, x, weight, bias, residual, scaling, fp8_dtype, scale, transpose,
                       x_scale_inv, group_size, prenorm, residual_dtype, mx_layout)
        eps = checks.check_eps(op, eps)
        offset = checks.check_offset(op, offset, weight)
        spec = Fp8Spec(op, scaling, fp8_dtype, transpose, group, offset != 0, mx_layout)
        nominal = torch.bfloat16 if group else x.dtype
        found = _Prepared(build_forward(spec, x, weight, bias, residual, residual_dtype,
                                        nominal), eps, offset)
        if key is not None:
            calls.store(key, found)
    return found


def _input_backward_call(call: Fp8ForwardCall, dy, x, weight, bias) -> Fp8InputBackwardCall:
    key = ("fp8 input backward", dy.shape, dy.stride(), dy.dtype)
    found = call.backward_calls.get(key)
    if found is None:
        found = call.backward_calls[key] = build_input_backward(call.spec.op, dy, x, weight,
                                                                bias, call.spec.group)
    return found


class Fp8NormFunction(torch.autograd.Function):
    """Returns the :class:`Float8NormTensor`, or (it, h) with a fused residual add. The
    backward is the bf16 norms' over h (x, or the residual sum), or for FP8 x the FP8-input
    kernel re-reading x and its multipliers."""

    @staticmethod
    def forward(ctx, prepared, x, weight, bias, residual, x_scale_inv, scale):
        call = prepared.call
        out = call.run(x, weight, bias, residual, x_scale_inv, scale, prepared.eps,
                       prepared.offset)
        y = Float8NormTensor(out.data, out.scale_inv, out.amax, out.data_t,
                             out.scale_inv_t, out.scaling, call.nominal_dtype, out.mx_layout)
        h = x if residual is None else out.h
        ctx.save_for_backward(h, x_scale_inv, weight, bias, out.mean, out.rstd)
        ctx.call, ctx.offset, ctx.x_dtype = call, prepared.offset, x.dtype
        ctx.residual_dtype = None if residual is None else residual.dtype
        return y if residual is None else (y, out.h)

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, x_scale_inv, weight, bias, mean, rstd = ctx.saved_tensors
        call = ctx.call
        if call.spec.group and ctx.residual_dtype is None:
            dx, dweight, dbias = _input_backward_call(call, dy, h, weight, bias).run(
                dy, h, x_scale_inv, weight, bias, mean, rstd, ctx.offset)
            return None, None, dweight, dbias, None, None, None
        key = (dy.shape, dy.stride(), dy.dtype,
               None if dh is None else (dh.stride(), dh.dtype))
        bwd = call.backward_calls.get(key)
        if bwd is None:
            spec = NormSpec(call.spec.op, call.spec.layer_norm)
            bwd = call.backward_calls[key] = calls.backward_call(
                spec, dy, dh, h, weight, bias, ctx.offset, call.nominal_dtype,
                ctx.residual_dtype)
        dx, dres, dweight, dbias = bwd.run(dy, dh, h, weight, bias, mean, rstd, ctx.offset)
        return None, dx, dweight, dbias, dres, None, None


def _apply(op, x, weight, bias, eps, scaling, fp8_dtype, scale, transpose, offset, residual,
           prenorm, residual_dtype, x_scale_inv, group_size, mx_layout):
    if torch.compiler.is_compiling():
        return _traced(op, x, weight, bias, eps, scaling, fp8_dtype, scale, transpose, offset,
                       residual, prenorm, residual_dtype, x_scale_inv, group_size, mx_layout)
    p = _prepared(op, x, weight, bias, residual, eps, offset, scaling, fp8_dtype, scale,
                  transpose, x_scale_inv, group_size, prenorm, residual_dtype, mx_layout)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias, residual)):
        out = Fp8NormFunction.apply(p, x, weight, bias, residual, x_scale_inv, scale)
        y, h = (out, None) if residual is None else out
    else:
        r = p.call.run(x, weight, bias, residual, x_scale_inv, scale, p.eps, p.offset)
        y = Float8NormTensor(r.data, r.scale_inv, r.amax, r.data_t, r.scale_inv_t,
                             r.scaling, p.call.nominal_dtype, r.mx_layout)
        h = r.h
    return (y, h) if prenorm else y


# --- torch.compile -------------------------------------------------------------------------
#
# A compiled graph holds the tilenorm::fp8_norm_fwd and fp8_norm_input_bwd custom ops
# (tilenorm.pytorch.custom_ops), which return plain contiguous tensors; the views the ops
# return (the block scales' strides, the per-tensor copy's shared scale) and the
# Float8NormTensor are made in the traced code around them. Their autograd is a Function the
# graph traces whole: a gradient registered on the custom op would reach its FP8 output
# cast to FP8, the reason the subclass exists.


def forward_op_outputs(x, weight, bias, residual, x_scale_inv, scale, eps: float,
                       offset: float, layer_norm: bool, scaling: str, fp8_dtype: torch.dtype,
                       transpose: bool, group_size: int, residual_dtype: torch.dtype | None,
                       mx_layout: str) -> tuple[torch.Tensor, ...]:
    """tilenorm::fp8_norm_fwd: (data, scale_inv, amax, data_t, scale_inv_t, h, mean, rstd)
    of the prepared call, contiguous (block scales as their (N / 128, M) transpose, MX
    scales as their bytes), absent ones empty (and the per-tensor copy's scale, which is
    scale_inv)."""
    op = LAYER_NORM if layer_norm else RMS_NORM
    p = _prepared(op, x, weight, bias, residual, eps, offset, scaling, fp8_dtype, scale,
                  transpose, x_scale_inv, group_size or None, False, residual_dtype, mx_layout)
    out = p.call.run(x, weight, bias, residual, x_scale_inv, scale, p.eps, p.offset)
    scale_dtype = torch.uint8 if scaling == "mx" else torch.float32
    scale_inv = out.scale_inv.t() if scaling == "block" else out.scale_inv
    scale_inv_t = None if scaling in ("tensor", "delayed") else out.scale_inv_t
    if scale_inv_t is not None and scaling == "block":
        scale_inv_t = scale_inv_t.t()

    def stored(t, dtype):
        if t is None:
            return torch.empty(0, dtype=dtype, device=x.device)
        return t.view(dtype).contiguous() if t.dtype == torch.float8_e8m0fnu else \
            t.contiguous()

    return (stored(out.data, fp8_dtype), stored(scale_inv, scale_dtype),
            stored(out.amax, torch.float32), stored(out.data_t, fp8_dtype),
            stored(scale_inv_t, scale_dtype), stored(out.h, x.dtype),
            stored(out.mean, torch.float32), stored(out.rstd, torch.float32))


def _output_of_op(outputs: tuple[torch.Tensor, ...], scaling: str, transpose: bool,
                  layer_norm: bool, has_residual: bool, mx_layout: str) -> Float8NormOutput:
    """tilenorm::fp8_norm_fwd's outputs as the eager op returns them."""
    data, scale_inv, amax, data_t, scale_inv_t, h, mean, rstd = outputs
    per_tensor = scaling in ("tensor", "delayed")
    if scaling == "block":
        scale_inv, scale_inv_t = scale_inv.t(), scale_inv_t.t()
    elif scaling == "mx":
        scale_inv = scale_inv.view(torch.float8_e8m0fnu)
        scale_inv_t = scale_inv_t.view(torch.float8_e8m0fnu)
    if not transpose:
        data_t = scale_inv_t = None
    elif per_tensor:
        scale_inv_t = scale_inv
    return Float8NormOutput(data, scale_inv, amax if per_tensor else None, data_t,
                            scale_inv_t, h if has_residual else None,
                            mean if layer_norm else None, rstd, scaling, mx_layout)


def _forward_op(x, weight, bias, residual, x_scale_inv, scale, eps, offset, layer_norm,
                scaling, fp8_dtype, transpose, group, residual_dtype, mx_layout
                ) -> Float8NormOutput:
    outputs = torch.ops.tilenorm.fp8_norm_fwd(x, weight, bias, residual, x_scale_inv, scale,
                                              eps, offset, layer_norm, scaling, fp8_dtype,
                                              transpose, group, residual_dtype, mx_layout)
    return _output_of_op(outputs, scaling, transpose, layer_norm, residual is not None,
                         mx_layout)


def input_backward_op_outputs(dy, x, x_scale_inv, weight, bias, mean, rstd, offset: float,
                              group_size: int) -> tuple[torch.Tensor, ...]:
    """tilenorm::fp8_norm_input_bwd: (dx, dweight, dbias) of a norm of FP8 x (LayerNorm
    where ``mean`` is given), contiguous, absent ones empty."""
    op = LAYER_NORM if mean is not None else RMS_NORM
    offset = checks.check_offset(op, offset, weight)
    call = build_input_backward(op, dy, x, weight, bias, group_size)
    dx, dweight, dbias = call.run(dy, x, x_scale_inv, weight, bias, mean, rstd, offset)
    empty = dx.new_empty(0)
    return (dx.contiguous(), empty if dweight is None else dweight.contiguous(),
            empty if bias is None else dbias.contiguous())


class Fp8NormOpFunction(torch.autograd.Function):
    """The autograd of :func:`rms_norm` / :func:`layer_norm` in a compiled graph: forward
    the tilenorm::fp8_norm_fwd custom op and the :class:`Float8NormTensor` of its outputs;
    backward tilenorm::norm_bwd over h (the bf16 norms' op), or for FP8 x
    tilenorm::fp8_norm_input_bwd. The gradient arrives in the tensor's nominal dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, x_scale_inv, scale, eps, offset, layer_norm,
                scaling, fp8_dtype, transpose, group, residual_dtype, mx_layout):
        out = _forward_op(x, weight, bias, residual, x_scale_inv, scale, eps, offset,
                          layer_norm, scaling, fp8_dtype, transpose, group, residual_dtype,
                          mx_layout)
        nominal = torch.bfloat16 if group else x.dtype
        y = Float8NormTensor(out.data, out.scale_inv, out.amax, out.data_t, out.scale_inv_t,
                             scaling, nominal, mx_layout)
        ctx.save_for_backward(x if residual is None else out.h, x_scale_inv, weight, bias,
                              out.mean, out.rstd)
        ctx.offset, ctx.group, ctx.nominal_dtype = offset, group, nominal
        ctx.residual_dtype = None if residual is None else residual.dtype
        return y if residual is None else (y, out.h)

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, x_scale_inv, weight, bias, mean, rstd = ctx.saved_tensors
        has_residual = ctx.residual_dtype is not None
        dx = dres = None  # FP8 x takes no gradient
        if ctx.group and not has_residual:
            _, dweight, dbias = torch.ops.tilenorm.fp8_norm_input_bwd(
                dy, h, x_scale_inv, weight, bias, mean, rstd, ctx.offset, ctx.group)
        else:
            grad_x, dres, dweight, dbias = torch.ops.tilenorm.norm_bwd(
                dy, dh if has_residual else None, h, weight, bias, mean, rstd, ctx.offset, 1,
                False, ctx.nominal_dtype, ctx.residual_dtype)
            if not dres_apart(ctx.nominal_dtype, ctx.residual_dtype):
                dres = grad_x
            dx = None if ctx.group else grad_x
        return (dx, None if weight is None else dweight, None if bias is None else dbias,
                dres if has_residual else None) + (None,) * 11


def _traced(op, x, weight, bias, eps, scaling, fp8_dtype, scale, transpose, offset, residual,
            prenorm, residual_dtype, x_scale_inv, group_size, mx_layout):
    """:func:`_apply` under ``torch.compile``: the checks that hold for symbolic shapes here,
    the numeric ones on eps and offset inside the custom op."""
    group = _check(op, x, weight, bias, residual, scaling, fp8_dtype, scale, transpose,
                   x_scale_inv, group_size, prenorm, residual_dtype, mx_layout)
    args = (x, weight, bias, residual, x_scale_inv, scale, eps, offset, op == LAYER_NORM,
            scaling, fp8_dtype, transpose, group, residual_dtype, mx_layout)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias, residual)):
        out = Fp8NormOpFunction.apply(*args)
        y, h = (out, None) if residual is None else out
    else:
        r = _forward_op(*args)
        y = Float8NormTensor(r.data, r.scale_inv, r.amax, r.data_t, r.scale_inv_t, scaling,
                             torch.bfloat16 if group else x.dtype, mx_layout)
        h = r.h
    return (y, h) if prenorm else y


def _traced_forward(op, x, weight, bias, eps, scaling, fp8_dtype, scale, transpose, offset,
                    residual, residual_dtype, x_scale_inv, group_size, mx_layout
                    ) -> Float8NormOutput:
    group = _check(op, x, weight, bias, residual, scaling, fp8_dtype, scale, transpose,
                   x_scale_inv, group_size, False, residual_dtype, mx_layout)
    return _forward_op(x, weight, bias, residual, x_scale_inv, scale, eps, offset,
                       op == LAYER_NORM, scaling, fp8_dtype, transpose, group, residual_dtype,
                       mx_layout)


_OPS_DOC = """
    Args:
        x: the input (..., N): bfloat16, float16, float32, or FP8 (E4M3/E5M2) with
            ``x_scale_inv`` and ``group_size``. Read contiguous (other layouts are copied).
        scaling: "tensor" (current per-tensor scaling: two passes, x read twice),
            "delayed" (the given ``scale``), "row" (per token), "block" (1 x 128) or "mx"
            (MXFP8: 1 x 32, E8M0); see the module docstring for each one's scale layout.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scale: for "delayed", TE's quantize multiplier: a one-element float32 tensor.
        transpose: also write the (N, M) copy for the weight-gradient GEMM, with scales
            along M for "row" (per column), "block" (128 x 1) and "mx" (32 x 1).
        offset: Gemma's weight offset, ``offset + weight`` in fp32 (rms_norm only).
        residual, prenorm, residual_dtype: a fused residual add, as in
            :func:`tilenorm.rms_norm`; h is stored in ``residual_dtype`` (default the
            residual's) and normalized as stored.
        x_scale_inv, group_size: FP8 x's float32 multipliers, (M, N / group_size), one per
            ``group_size`` (a power of two up to 128) consecutive elements of a row.
        mx_layout: "row_major" (default) or "swizzled": MX scales (and the copy's) in the
            128 x 4 blocked layout that Blackwell's MXFP8 GEMMs read, padded to
            (round_up(rows, 128), round_up(groups, 4)) (see the module docstring).
"""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             scaling: Scaling, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
             scale: torch.Tensor | None = None, transpose: bool = False, offset: float = 0.0,
             residual: torch.Tensor | None = None, prenorm: bool = False,
             residual_dtype: torch.dtype | None = None,
             x_scale_inv: torch.Tensor | None = None, group_size: int | None = None,
             mx_layout: MxLayout = "row_major"
             ) -> Float8NormTensor | tuple[Float8NormTensor, torch.Tensor]:
    """RMSNorm over the last dimension with its output quantized to FP8: a
    :class:`Float8NormTensor` (``(it, h)`` with ``prenorm=True``), differentiable in x (not
    FP8 x), weight and residual; the gradient arrives in the tensor's nominal dtype.
    """
    return _apply(RMS_NORM, x, weight, None, eps, scaling, fp8_dtype, scale, transpose,
                  offset, residual, prenorm, residual_dtype, x_scale_inv, group_size,
                  mx_layout)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, scaling: Scaling,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn, scale: torch.Tensor | None = None,
               transpose: bool = False, residual: torch.Tensor | None = None,
               prenorm: bool = False, residual_dtype: torch.dtype | None = None,
               x_scale_inv: torch.Tensor | None = None, group_size: int | None = None,
               mx_layout: MxLayout = "row_major"
               ) -> Float8NormTensor | tuple[Float8NormTensor, torch.Tensor]:
    """LayerNorm over the last dimension with its output quantized to FP8; as
    :func:`rms_norm`.
    """
    return _apply(LAYER_NORM, x, weight, bias, eps, scaling, fp8_dtype, scale, transpose, 0.0,
                  residual, prenorm, residual_dtype, x_scale_inv, group_size, mx_layout)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                     *, scaling: Scaling, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                     scale: torch.Tensor | None = None, transpose: bool = False,
                     offset: float = 0.0, residual: torch.Tensor | None = None,
                     residual_dtype: torch.dtype | None = None,
                     x_scale_inv: torch.Tensor | None = None, group_size: int | None = None,
                     mx_layout: MxLayout = "row_major") -> Float8NormOutput:
    """The FP8-output RMSNorm without autograd, for a Function that keeps its own graph (a
    COAT-style fused norm and GEMM): a :class:`Float8NormOutput`.
    """
    if torch.compiler.is_compiling():
        return _traced_forward(RMS_NORM, x, weight, None, eps, scaling, fp8_dtype, scale,
                               transpose, offset, residual, residual_dtype, x_scale_inv,
                               group_size, mx_layout)
    p = _prepared(RMS_NORM, x, weight, None, residual, eps, offset, scaling, fp8_dtype,
                  scale, transpose, x_scale_inv, group_size, False, residual_dtype,
                  mx_layout)
    return p.call.run(x, weight, None, residual, x_scale_inv, scale, p.eps, p.offset)


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, eps: float = 1e-5, *,
                       scaling: Scaling, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                       scale: torch.Tensor | None = None, transpose: bool = False,
                       residual: torch.Tensor | None = None,
                       residual_dtype: torch.dtype | None = None,
                       x_scale_inv: torch.Tensor | None = None,
                       group_size: int | None = None,
                       mx_layout: MxLayout = "row_major") -> Float8NormOutput:
    """The FP8-output LayerNorm without autograd: a :class:`Float8NormOutput`.
    """
    if torch.compiler.is_compiling():
        return _traced_forward(LAYER_NORM, x, weight, bias, eps, scaling, fp8_dtype, scale,
                               transpose, 0.0, residual, residual_dtype, x_scale_inv,
                               group_size, mx_layout)
    p = _prepared(LAYER_NORM, x, weight, bias, residual, eps, 0.0, scaling, fp8_dtype, scale,
                  transpose, x_scale_inv, group_size, False, residual_dtype, mx_layout)
    return p.call.run(x, weight, bias, residual, x_scale_inv, scale, p.eps, p.offset)


for _op in (rms_norm, layer_norm, rms_norm_forward, layer_norm_forward):
    _op.__doc__ += _OPS_DOC


def _input_backward(op, dy, x, weight, bias, mean, rstd, x_scale_inv, group_size, offset):
    _check(op, x, weight, bias, None, "row", torch.float8_e4m3fn, None, False, x_scale_inv,
           group_size, False, None)
    if x.dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: the FP8 backward takes FP8 x; for {x.dtype} x use "
                         f"tilenorm.{op}_backward over h")
    if not isinstance(dy, torch.Tensor) or dy.shape != x.shape or dy.device != x.device:
        raise ValueError(f"{op}: dy must be a tensor of x's shape {tuple(x.shape)} on "
                         f"{x.device}")
    stat = x.shape[:-1]
    for name, t in (("rstd", rstd), ("mean", mean)):
        if (name == "rstd" or op == LAYER_NORM) and not (
                isinstance(t, torch.Tensor) and t.shape == stat and t.dtype == torch.float32
                and t.is_contiguous() and t.device == x.device):
            raise ValueError(f"{op}: {name} must be the forward's: contiguous float32 of "
                             f"shape {tuple(stat)} on {x.device}")
    if torch.compiler.is_compiling():  # offset is checked inside the op
        dx, dweight, dbias = torch.ops.tilenorm.fp8_norm_input_bwd(
            dy, x, x_scale_inv, weight, bias, mean if op == LAYER_NORM else None, rstd,
            offset, group_size)
        return (dx, None if weight is None else dweight, None if bias is None else dbias)
    offset = checks.check_offset(op, offset, weight)
    call = build_input_backward(op, dy, x, weight, bias, group_size)
    return call.run(dy, x, x_scale_inv, weight, bias, mean, rstd, offset)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor, *, x_scale_inv: torch.Tensor, group_size: int,
                      offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward of :func:`rms_norm_forward` of FP8 x (no residual): ``(dx, dweight)``,
    re-reading x and its multipliers; dx in dy's dtype, dweight in the weight's. (The
    backward of bf16 x, or of a fused residual add, is :func:`tilenorm.rms_norm_backward`
    over h: the FP8 output does not change it.)"""
    return _input_backward(RMS_NORM, dy, x, weight, None, None, rstd, x_scale_inv,
                           group_size, offset)[:2]


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, *,
                        x_scale_inv: torch.Tensor, group_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward of :func:`layer_norm_forward` of FP8 x: ``(dx, dweight, dbias)``; see
    :func:`rms_norm_backward`."""
    return _input_backward(LAYER_NORM, dy, x, weight, bias, mean, rstd, x_scale_inv,
                           group_size, 0.0)


def explain(x: torch.Tensor, weight: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, *, scaling: Scaling,
            bias: torch.Tensor | None = None, layer_norm: bool = False,
            fp8_dtype: torch.dtype = torch.float8_e4m3fn, transpose: bool = False,
            x_scale_inv: torch.Tensor | None = None, group_size: int | None = None,
            mx_layout: MxLayout = "row_major") -> Fp8Decision:
    """What the FP8 op decides to run for these operands, and why (``str()`` it)."""
    op = LAYER_NORM if layer_norm else RMS_NORM
    scale = torch.ones(1, device=x.device) if scaling == "delayed" else None
    return _prepared(op, x, weight, bias, residual, 1e-6, 0.0, scaling, fp8_dtype, scale,
                     transpose, x_scale_inv, group_size, False, None,
                     mx_layout).call.decision
