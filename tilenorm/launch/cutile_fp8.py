"""Binds FP8-output norm plans to their cuTile kernels
(:mod:`tilenorm.kernels.cutile_row_norm_fp8`): kernel, compile options, grid, compile-time
arguments, operand order. Framework-neutral, like :mod:`tilenorm.launch.cutile`, whose
:class:`~tilenorm.launch.cutile.BoundKernel` these are; the launchers and the ahead-of-time
build (:mod:`tilenorm.launch.aot`) bind through the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilenorm.kernels import cutile_row_norm_fp8 as kernels
from tilenorm.kernels.cutile_row_norm_fp8 import (
    fp8_amax_finish,
    fp8_column_amax,
    fp8_quantize_normed,
    fp8_quantize_transposed,
    fp8_swizzle_mx_scales,
    norm_bwd_fp8_input_single,
    norm_fwd_fp8_single,
)
from tilenorm.launch import cutile
from tilenorm.launch.cutile import BoundKernel
from tilenorm.planner import BlockPlan, ColumnAmaxPlan, MxSwizzlePlan, RowNormPlan, next_pow2

# Each kernel's array parameters, in order: what the 64-bit variants and the launchers read.
cutile.ARRAYS.update({
    norm_fwd_fp8_single: ("x", "x_scale_inv", "residual", "weight", "bias", "scale", "q",
                          "q_scale", "residual_out", "mean", "rstd", "amax_partial",
                          "column_amax_partial"),
    fp8_quantize_normed: ("h", "x_scale_inv", "weight", "bias", "mean", "rstd", "scale",
                          "amax_partial", "q", "q_t", "amax", "scale_inv"),
    fp8_amax_finish: ("amax_partial", "scale", "amax", "scale_inv"),
    fp8_column_amax: ("column_amax_partial", "column_amax"),
    fp8_quantize_transposed: ("h", "x_scale_inv", "weight", "bias", "mean", "rstd",
                              "column_amax", "q_t", "q_t_scale"),
    fp8_swizzle_mx_scales: ("scales", "blocked"),
    norm_bwd_fp8_input_single: ("dy", "x", "x_scale_inv", "weight", "mean", "rstd", "dx",
                                "partial_w", "partial_b"),
})

#: The largest finite value of each FP8 format (what saturation clamps to).
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: The row kernel's SCALING for each way it quantizes: "amax" is the first of two passes
#: (no q, one amax per program), "delayed" a given per-tensor scale.
ROW_SCALINGS = {"amax": kernels.AMAX_ONLY, "delayed": kernels.TENSOR, "row": kernels.ROW,
                "block": kernels.BLOCK, "mx": kernels.MX}
#: Columns per scale of the block scalings: DeepSeek-V3's 1 x 128 and MXFP8's 1 x 32. Their
#: transposed copies scale as many rows of a column (128 x 1, 32 x 1).
BLOCK_COLS = {"block": 128, "mx": 32}
#: The transposing kernel's SCALING for each scaling whose copy has scales along M.
TRANSPOSED_SCALINGS = {"row": kernels.ROW, "block": kernels.BLOCK, "mx": kernels.MX}


@dataclass(frozen=True)
class Fp8NormFeatures:
    """The compile-time features of one FP8-output normalization. ``group``: x is FP8 with
    one fp32 multiplier per ``group`` elements of a row (0: x is bf16, fp16 or fp32)."""

    layer_norm: bool = False
    has_weight: bool = True
    has_bias: bool = False
    has_residual: bool = False
    has_offset: bool = False
    group: int = 0


def _bound(fn, grid: int, occupancy: int, index_bits: int, worker_warps: int | None,
           constants: tuple, dependent_launch: bool) -> BoundKernel:
    return BoundKernel(cutile.compiled(fn, occupancy, index_bits, worker_warps), fn,
                       cutile.ARRAYS[fn], (grid, 1, 1), constants, dependent_launch,
                       index_bits)


def bind_fp8_forward(plan: RowNormPlan, features: Fp8NormFeatures, scaling: str,
                     fp8_max: float, column_amax: bool = False) -> BoundKernel:
    """The one-pass row kernel for ``plan`` (single pass, one head) quantizing with
    ``scaling`` (a key of :data:`ROW_SCALINGS`), and with ``column_amax`` keeping each
    column's amax per program; runtime arguments ``(x, x_scale_inv, residual, weight, bias,
    scale, q, q_scale, residual_out, mean, rstd, amax_partial, column_amax_partial, eps,
    offset)``: x, residual, q, residual_out (rows, cols); x_scale_inv (rows, cols / group);
    weight and bias (1, cols); scale (1,); q_scale (rows, 1), (rows, cols / 128) or
    (rows, cols / 32) uint8; mean and rstd (rows,); amax_partial (grid,) and
    column_amax_partial (grid, cols) fp32."""
    if not plan.single_pass or plan.split_cols or plan.heads != 1:
        raise ValueError("the FP8 row kernel takes single-pass, unsplit, one-head plans")
    f = features
    constants = (1.0 / plan.cols, fp8_max, plan.tile_rows, plan.tile_cols, f.layer_norm,
                 f.has_weight, f.has_bias, f.has_residual, plan.tile_cols != plan.cols,
                 f.has_offset, f.group, ROW_SCALINGS[scaling], BLOCK_COLS.get(scaling, 0),
                 column_amax, plan.dependent_launch)
    return _bound(norm_fwd_fp8_single, plan.grid, plan.occupancy, plan.index_bits,
                  plan.worker_warps, constants, plan.dependent_launch)


def bind_fp8_quantize(plan: BlockPlan, features: Fp8NormFeatures, partials: int,
                      current: bool, transpose: bool, fp8_max: float) -> BoundKernel:
    """The second pass of a per-tensor scaling after a first of ``partials`` programs
    (scale from their amaxes where ``current``, else the given one); runtime arguments
    ``(h, x_scale_inv, weight, bias, mean, rstd, scale, amax_partial, q, q_t, amax,
    scale_inv, offset)``: h is x, or the residual sum the first pass stored (read as is,
    x_scale_inv unused, even for FP8 x); q_t (cols, rows); amax and scale_inv (1,) fp32."""
    f = features
    # With a fused residual the second pass reads the stored sum h, not FP8 x.
    group = 0 if f.has_residual else f.group
    constants = (fp8_max, plan.tile_rows, plan.tile_cols, next_pow2(partials), f.layer_norm,
                 f.has_weight, f.has_bias, f.has_offset, group, current, transpose,
                 plan.dependent_launch)
    return _bound(fp8_quantize_normed, plan.grid, plan.occupancy, plan.index_bits, None,
                  constants, plan.dependent_launch)


def bind_fp8_column_amax(plan: ColumnAmaxPlan) -> BoundKernel:
    """Each column's amax over the row kernel's per-program column amaxes; runtime arguments
    ``(column_amax_partial, column_amax)``: (partials, cols) and (cols,) fp32."""
    return _bound(fp8_column_amax, plan.grid, 1, 32, None,
                  (plan.tile_rows, plan.tile_cols, plan.dependent_launch),
                  plan.dependent_launch)


def bind_fp8_quantize_transposed(plan: BlockPlan, features: Fp8NormFeatures, scaling: str,
                                 fp8_max: float) -> BoundKernel:
    """The (cols, rows) copy of a ``scaling`` (a key of :data:`TRANSPOSED_SCALINGS`) whose
    scales run along the rows; runtime arguments ``(h, x_scale_inv, weight, bias, mean, rstd,
    column_amax, q_t, q_t_scale, offset)``: h as for :func:`bind_fp8_quantize`; column_amax
    (cols,) fp32 ("row"); q_t (cols, rows); q_t_scale (cols, 1) fp32, (cols, cdiv(rows,
    128)) fp32 or (cols, cdiv(rows, 32)) uint8."""
    f = features
    block_rows = BLOCK_COLS.get(scaling, 1)
    if plan.tile_rows % block_rows:
        raise ValueError(f"a {scaling!r} copy scales blocks of {block_rows} rows: the tile's "
                         f"{plan.tile_rows} rows must hold whole blocks")
    group = 0 if f.has_residual else f.group
    constants = (fp8_max, plan.tile_rows, plan.tile_cols, f.layer_norm, f.has_weight,
                 f.has_bias, f.has_offset, group, TRANSPOSED_SCALINGS[scaling], block_rows,
                 plan.dependent_launch)
    return _bound(fp8_quantize_transposed, plan.grid, plan.occupancy, plan.index_bits, None,
                  constants, plan.dependent_launch)


def bind_fp8_mx_swizzle(plan: MxSwizzlePlan) -> BoundKernel:
    """MX scales into the 128 x 4 blocked layout; runtime arguments ``(scales, blocked)``:
    (rows, groups) uint8 and the (cdiv(rows, 128), cdiv(groups, 4), 32, 4, 4) uint8 view of
    the blocked scales."""
    return BoundKernel(cutile.compiled(fp8_swizzle_mx_scales, 1, 32, None),
                       fp8_swizzle_mx_scales, cutile.ARRAYS[fp8_swizzle_mx_scales],
                       (*plan.grid, 1), (plan.tiles, plan.dependent_launch),
                       plan.dependent_launch, 32)


def bind_fp8_amax_finish(partials: int, dependent_launch: bool) -> BoundKernel:
    """One program after a one-pass delayed scaling of ``partials`` programs; runtime
    arguments ``(amax_partial, scale, amax, scale_inv)``."""
    return _bound(fp8_amax_finish, 1, 1, 32, None, (next_pow2(partials), dependent_launch),
                  dependent_launch)


def bind_fp8_input_backward(plan: RowNormPlan, features: Fp8NormFeatures) -> BoundKernel:
    """The backward of a norm of FP8 x (single pass, no residual); runtime arguments
    ``(dy, x, x_scale_inv, weight, mean, rstd, dx, partial_w, partial_b, offset)``: dy, x,
    dx (rows, cols); partial_w and partial_b (grid, 1, cols) groups of
    :class:`~tilenorm.launch.cutile.PartialBuffer`, reduced by
    :func:`~tilenorm.launch.cutile.bind_reduce`."""
    if not plan.single_pass or plan.split_cols or plan.heads != 1 or features.group == 0:
        raise ValueError("the FP8-input backward takes single-pass, unsplit, one-head plans "
                         "of FP8 x")
    f = features
    constants = (1.0 / plan.cols, plan.tile_rows, plan.tile_cols, f.group, f.layer_norm,
                 f.has_weight, f.has_bias, f.has_offset, plan.dependent_launch)
    return _bound(norm_bwd_fp8_input_single, plan.grid, plan.occupancy, plan.index_bits,
                  plan.worker_warps, constants, plan.dependent_launch)
