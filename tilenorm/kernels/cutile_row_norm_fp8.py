"""RMSNorm and LayerNorm with FP8 output (and optionally FP8 input) in cuTile: persistent
grid-stride kernels, deterministic, no atomics.

The math is that of :mod:`tilenorm.kernels.cutile_row_norm` (fp32 throughout)::

    v = dequant(x) if GROUP else x        (FP8 x: one fp32 multiplier per GROUP elements)
    h = v + residual                      (HAS_RESIDUAL; stored as residual_out)
    mu = mean(h)                          (LAYER_NORM; stored as mean)
    rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = (h - mu) * rstd * (offset + w) + b

and then y is quantized: ``q = cast(saturate(y * scale))`` for a scale per tensor, per row
or per block of ``BLOCK_N`` columns (``SCALING``). A group's scale is ``fp8_max / amax`` and
its stored ``scale_inv`` ``1 / scale`` (:func:`_scale_of`); MX blocks take the power of two
:func:`_mx_exponent` and store its E8M0 byte. Every amax skips NaN, so a NaN stays in its
row; saturation keeps every finite value finite in both FP8 formats.

Operands are 2-D (rows, cols); weight and bias (1, cols); mean and rstd (rows,). Kernels:

- :func:`norm_fwd_fp8_single`: the row on chip, one pass. Per-row, per-block and MX scales,
  or a given per-tensor scale (delayed scaling); or, with ``SCALING == AMAX_ONLY``, no q at
  all: the statistics and one amax per program, pass 1 of the two-pass per-tensor scalings.
  With ``COLUMN_AMAX`` it also keeps each column's largest |y| over the program's rows, for
  the per-column scales of a transposed copy.
- :func:`fp8_quantize_normed`: pass 2, over (TILE_R x TILE_C) blocks: re-reads h (or x),
  rstd and the amax of every pass-1 program, and writes q and its (cols, rows) transpose.
- :func:`fp8_column_amax`: each column's amax over the per-program column amaxes of the row
  kernel, before :func:`fp8_quantize_transposed` of a per-row scaling.
- :func:`fp8_quantize_transposed`: the (cols, rows) copy of a per-row, per-block or MX
  scaling, whose scales run along the rows of y (the copy's contraction dimension): one per
  column, per 128 x 1 or per 32 x 1 block of y; over (TILE_R x TILE_C) blocks, re-reading h
  (or x) with the saved statistics.
- :func:`fp8_swizzle_mx_scales`: MX scales from row-major to the 128 x 4 blocked layout
  that Blackwell's block-scaled GEMMs read.
- :func:`fp8_amax_finish`: one program folding the per-program amaxes of a one-pass delayed
  scaling into this call's amax.
- :func:`norm_bwd_fp8_input_single`: the backward of an FP8-input norm, re-reading FP8 x and
  its group scales; dgamma (dbeta) go to a partial buffer that
  :func:`tilenorm.kernels.cutile_column_sums.column_sums` adds in a fixed order.
"""

from __future__ import annotations

import cuda.tile as ct

from tilenorm.kernels.cutile_column_sums import start_after_predecessor

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO

#: SCALING values, in an order the kernels test by comparison: up to TENSOR they keep one
#: amax per program (AMAX_ONLY writes no q: pass 1 of the two-pass per-tensor scalings); from
#: BLOCK on they scale blocks of BLOCK_N columns.
AMAX_ONLY, TENSOR, ROW, BLOCK, MX = 0, 1, 2, 3, 4
#: The largest finite fp32: a scale that would overflow is clamped to it.
FLOAT32_MAX = 3.4028234663852886e38


def _store(a, index, tile):
    """Through registers, not TMA, as every store of cutile_row_norm.py (bench/NOTES.md #10,
    #14)."""
    ct.store(a, index=index, tile=tile, allow_tma=False)


# --- quantization helpers ------------------------------------------------------------------


def _abs_skipping_nan(y):
    """|y| with NaN read as 0: an amax that skips NaN keeps a NaN row's scale out of every
    other group's."""
    a = ct.abs(y)
    return ct.where(ct.isnan(a), 0.0, a)


def _scale_of(amax, fp8_max):
    """``fp8_max / amax``; 1 where amax is 0 or not finite (q is then 0, or saturated), and
    clamped to the largest fp32 where it would overflow."""
    usable = (amax > 0.0) & (amax <= FLOAT32_MAX)
    scale = fp8_max / ct.where(usable, amax, 1.0)
    return ct.where(usable, ct.minimum(scale, FLOAT32_MAX), 1.0)


def _saturate(v, fp8_max):
    """Clamp to +-fp8_max before the cast (E5M2 would round past it to inf, E4M3 to NaN).
    Comparisons, not min/max: NaN passes through and casts to FP8 NaN."""
    v = ct.where(v > fp8_max, fp8_max, v)
    return ct.where(v < -fp8_max, -fp8_max, v)


def _mx_exponent(amax, fp8_max):
    """The smallest k with ``amax <= fp8_max * 2^k`` (so no element saturates), from the
    bits of both: with ``amax = (1 + ma) 2^ea`` and ``fp8_max = (1 + mf) 2^ef``, k is
    ``ea - ef``, plus 1 where ``ma > mf``. Clamped to E8M0's [-127, 127]; 0 for amax = 0.
    Exact: no division, no logarithm."""
    a_bits = ct.bitcast(amax, ct.int32)
    m_bits = ct.bitcast(ct.full(amax.shape, fp8_max, dtype=ct.float32), ct.int32)
    k = ((a_bits >> 23) & 0xFF) - ((m_bits >> 23) & 0xFF)
    k = k + ct.where((a_bits & 0x7FFFFF) > (m_bits & 0x7FFFFF), 1, 0)
    k = ct.minimum(ct.maximum(k, -127), 127)
    return ct.where(amax > 0.0, k, 0)


def _power_of_two(k):
    """2^k as fp32 for k in [-126, 127]: the exponent field's bits."""
    return ct.bitcast((k + 127) << 23, ct.float32)


def _quantize_blocks(y, q, q_scale, row_tile, fp8_max, TILE_A, TILE_N, BLOCK_N, SCALING):
    """Quantize a (TILE_A, TILE_N) tile of y with one scale per BLOCK_N columns: fp32
    ``scale_inv`` per block (BLOCK), or MX's E8M0 byte ``k + 127`` (MX). Blocks past the row's
    end hold y = 0 and are never stored."""
    blocks = TILE_N // BLOCK_N
    y3 = y.reshape((TILE_A, blocks, BLOCK_N))
    amax = ct.max(_abs_skipping_nan(y3), axis=2, keepdims=True)
    if SCALING == MX:
        k = _mx_exponent(amax, fp8_max)
        # k <= 121 even for an infinite amax, and k >= -127: 2^-k is a normal fp32.
        scaled = y3 * _power_of_two(-k)
        _store(q_scale, (row_tile, 0), (k + 127).reshape((TILE_A, blocks)).astype(ct.uint8))
    else:
        scale = _scale_of(amax, fp8_max)
        scaled = y3 * scale
        _store(q_scale, (row_tile, 0), (1.0 / scale).reshape((TILE_A, blocks)))
    q_tile = _saturate(scaled, fp8_max).reshape((TILE_A, TILE_N)).astype(q.dtype)
    _store(q, (row_tile, 0), q_tile)


# --- loading and normalizing ----------------------------------------------------------------


def _load2(a, index, shape):
    return ct.load(a, index=index, shape=shape, padding_mode=ZERO)


def _dequantized(x, x_scale_inv, row_tile, col_tile, TILE_A, TILE_N, GROUP):
    """A (TILE_A, TILE_N) fp32 tile of x: FP8 x times its per-GROUP multipliers (GROUP > 0),
    else x as loaded."""
    xt = _load2(x, (row_tile, col_tile), (TILE_A, TILE_N)).astype(ct.float32)
    if GROUP == 0:
        return xt
    groups = TILE_N // GROUP
    s = _load2(x_scale_inv, (row_tile, col_tile), (TILE_A, groups))
    v = xt.reshape((TILE_A, groups, GROUP)) * s.reshape((TILE_A, groups, 1))
    return v.reshape((TILE_A, TILE_N))


def _param(p, col_tile, TILE_N):
    return _load2(p, (0, col_tile), (1, TILE_N)).astype(ct.float32)


def _times_weight(v, weight, offset, col_tile, TILE_N, HAS_WEIGHT, HAS_OFFSET):
    """``v * (offset + w)`` as ``v * w + v * offset``: the weight tile stays as loaded
    (cutile_row_norm.py's _times_scale says why)."""
    if HAS_WEIGHT:
        out = v * _param(weight, col_tile, TILE_N)
        if HAS_OFFSET:
            out = out + v * offset
        return out
    return v


def _affine(normed, weight, bias, offset, col_tile, TILE_N, HAS_WEIGHT, HAS_BIAS,
            HAS_OFFSET):
    out = _times_weight(normed, weight, offset, col_tile, TILE_N, HAS_WEIGHT, HAS_OFFSET)
    if HAS_BIAS:
        out = out + _param(bias, col_tile, TILE_N)
    return out


def _column_mask(cols, TILE_N):
    return (ct.arange(TILE_N, dtype=ct.int32) < cols).reshape((1, TILE_N))


def _inside_rows(a, row_tile, rows, TILE_A, HAS_BIAS):
    """``a`` (TILE_A, n) with the rows past the end read as 0. A padding row loads x = 0 and
    normalizes to the bias, which must not count in an amax; without a bias it is 0."""
    if HAS_BIAS:
        index = ct.arange(TILE_A, dtype=ct.int32) + row_tile * TILE_A
        return ct.where((index < rows).reshape((TILE_A, 1)), a, 0.0)
    return a


# --- forward, one pass ----------------------------------------------------------------------


def norm_fwd_fp8_single(x, x_scale_inv, residual, weight, bias, scale, q, q_scale,
                        residual_out, mean, rstd, amax_partial, column_amax_partial,
                        eps: float, offset: float, inv_n: float, fp8_max: float,
                        TILE_A: ConstInt, TILE_N: ConstInt, LAYER_NORM: ConstBool,
                        HAS_WEIGHT: ConstBool, HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool,
                        PADDED: ConstBool, HAS_OFFSET: ConstBool, GROUP: ConstInt,
                        SCALING: ConstInt, BLOCK_N: ConstInt, COLUMN_AMAX: ConstBool,
                        DEPENDENT: ConstBool):
    """One pass over rows that fit in one (TILE_A, TILE_N) tile. ``q_scale`` is (rows, 1)
    fp32 (ROW), (rows, cols / BLOCK_N) fp32 (BLOCK) or uint8 E8M0 bytes (MX); ``scale`` the
    given (1,) multiplier (TENSOR). AMAX_ONLY and TENSOR write the largest |y| of the
    program's rows to ``amax_partial[program]``; COLUMN_AMAX writes each column's largest
    |y| over the program's rows to row ``program`` of the (grid, cols) fp32
    ``column_amax_partial``."""
    start_after_predecessor(DEPENDENT)
    shape = (TILE_A, TILE_N)
    program = ct.bid(0)
    row_tiles = ct.num_tiles(x, axis=0, shape=shape)
    amax_acc = ct.zeros((TILE_A, 1), dtype=ct.float32)
    column_acc = ct.zeros((1, TILE_N), dtype=ct.float32)
    for t in range(program, row_tiles, ct.num_blocks(0)):
        v = _dequantized(x, x_scale_inv, t, 0, TILE_A, TILE_N, GROUP)
        if HAS_RESIDUAL:
            h = (v + _load2(residual, (t, 0), shape).astype(ct.float32)).astype(
                residual_out.dtype)
            _store(residual_out, (t, 0), h)
            v = h.astype(ct.float32)
        if LAYER_NORM:
            mu = ct.sum(v, axis=1, keepdims=True) * inv_n
            v = v - mu
            if PADDED:  # padding columns load 0; centered they would be -mu
                v = ct.where(_column_mask(x.shape[1], TILE_N), v, 0.0)
            _store(mean, (t,), mu.reshape((TILE_A,)))
        r = ct.rsqrt(ct.sum(v * v, axis=1, keepdims=True) * inv_n + eps)
        _store(rstd, (t,), r.reshape((TILE_A,)))
        y = _affine(v * r, weight, bias, offset, 0, TILE_N, HAS_WEIGHT, HAS_BIAS, HAS_OFFSET)
        if SCALING <= TENSOR:
            a = _inside_rows(_abs_skipping_nan(y), t, x.shape[0], TILE_A, HAS_BIAS)
            amax_acc = ct.maximum(amax_acc, ct.max(a, axis=1, keepdims=True))
        if COLUMN_AMAX:
            a = _inside_rows(_abs_skipping_nan(y), t, x.shape[0], TILE_A, HAS_BIAS)
            column_acc = ct.maximum(column_acc, ct.max(a, axis=0, keepdims=True))
        if SCALING == TENSOR:
            s = _load2(scale, (0,), (1,)).reshape((1, 1))
            _store(q, (t, 0), _saturate(y * s, fp8_max).astype(q.dtype))
        elif SCALING == ROW:
            row_scale = _scale_of(ct.max(_abs_skipping_nan(y), axis=1, keepdims=True),
                                  fp8_max)
            _store(q, (t, 0), _saturate(y * row_scale, fp8_max).astype(q.dtype))
            _store(q_scale, (t, 0), 1.0 / row_scale)
        elif SCALING >= BLOCK:
            _quantize_blocks(y, q, q_scale, t, fp8_max, TILE_A, TILE_N, BLOCK_N, SCALING)
    if SCALING <= TENSOR:
        _store(amax_partial, (program,),
               ct.max(amax_acc, axis=0, keepdims=True).reshape((1,)))
    if COLUMN_AMAX:
        _store(column_amax_partial, (program, 0), column_acc)


# --- per-tensor scalings: the finishing kernels ----------------------------------------------


def _amax_of_partials(amax_partial, PARTIALS):
    """The largest of every pass-1 program's amax: exact and independent of the order."""
    return ct.max(_load2(amax_partial, (0,), (PARTIALS,)), axis=0, keepdims=True)


def fp8_quantize_normed(h, x_scale_inv, weight, bias, mean, rstd, scale, amax_partial, q, q_t,
                        amax, scale_inv, offset: float, fp8_max: float,
                        TILE_R: ConstInt, TILE_C: ConstInt, PARTIALS: ConstInt,
                        LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool, HAS_BIAS: ConstBool,
                        HAS_OFFSET: ConstBool, GROUP: ConstInt, CURRENT: ConstBool,
                        TRANSPOSE: ConstBool, DEPENDENT: ConstBool):
    """Pass 2 of a per-tensor scaling, after :func:`norm_fwd_fp8_single` with AMAX_ONLY:
    over (TILE_R, TILE_C) blocks of the (rows, cols) h (x, the stored residual sum, or FP8
    x with its multipliers), y from the saved rstd (and mean), quantized with the scale of
    the tensor's amax (CURRENT: the largest of the first ``PARTIALS`` (a power of two,
    zero-padded) pass-1 amaxes) or the given ``scale``; q and, with TRANSPOSE, its
    (cols, rows) copy ``q_t``. Program 0 writes ``amax`` and ``scale_inv`` (1,)."""
    start_after_predecessor(DEPENDENT)
    tensor_amax = _amax_of_partials(amax_partial, PARTIALS)
    if CURRENT:
        s = _scale_of(tensor_amax, fp8_max).reshape((1, 1))
    else:
        s = _load2(scale, (0,), (1,)).reshape((1, 1))
    if ct.bid(0) == 0:
        _store(amax, (0,), tensor_amax)
        _store(scale_inv, (0,), (1.0 / s).reshape((1,)))
    shape = (TILE_R, TILE_C)
    col_blocks = ct.num_tiles(h, axis=1, shape=shape)
    blocks = ct.num_tiles(h, axis=0, shape=shape) * col_blocks
    for b in range(ct.bid(0), blocks, ct.num_blocks(0)):
        row_block, col_block = b // col_blocks, b % col_blocks
        v = _dequantized(h, x_scale_inv, row_block, col_block, TILE_R, TILE_C, GROUP)
        if LAYER_NORM:
            v = v - _load2(mean, (row_block,), (TILE_R,)).reshape((TILE_R, 1))
        r = _load2(rstd, (row_block,), (TILE_R,)).reshape((TILE_R, 1))
        y = _affine(v * r, weight, bias, offset, col_block, TILE_C, HAS_WEIGHT, HAS_BIAS,
                    HAS_OFFSET)
        quantized = _saturate(y * s, fp8_max)
        _store(q, (row_block, col_block), quantized.astype(q.dtype))
        if TRANSPOSE:
            _store(q_t, (col_block, row_block), ct.transpose(quantized).astype(q_t.dtype))


def fp8_amax_finish(amax_partial, scale, amax, scale_inv, PARTIALS: ConstInt,
                    DEPENDENT: ConstBool):
    """After a one-pass delayed scaling: this call's amax, the largest of the first
    ``PARTIALS`` (zero-padded) per-program amaxes, and ``scale_inv = 1 / scale``. One
    program."""
    start_after_predecessor(DEPENDENT)
    _store(amax, (0,), _amax_of_partials(amax_partial, PARTIALS))
    _store(scale_inv, (0,), 1.0 / _load2(scale, (0,), (1,)))


# --- transposed copies with scales along the rows of y ---------------------------------------


def fp8_column_amax(column_amax_partial, column_amax, TILE_R: ConstInt, TILE_C: ConstInt,
                    DEPENDENT: ConstBool):
    """``column_amax[c]``: the largest of the (grid, cols) ``column_amax_partial[:, c]`` that
    the row kernel's programs wrote (COLUMN_AMAX), for this program's TILE_C columns. Max is
    exact and independent of the order: the same bits on every run."""
    start_after_predecessor(DEPENDENT)
    col_tile = ct.bid(0)
    shape = (TILE_R, TILE_C)
    acc = ct.zeros(shape, dtype=ct.float32)
    for i in range(ct.num_tiles(column_amax_partial, axis=0, shape=shape)):
        acc = ct.maximum(acc, _load2(column_amax_partial, (i, col_tile), shape))
    _store(column_amax, (col_tile,), ct.max(acc, axis=0, keepdims=True).reshape((TILE_C,)))


def fp8_quantize_transposed(h, x_scale_inv, weight, bias, mean, rstd, column_amax, q_t,
                            q_t_scale, offset: float, fp8_max: float,
                            TILE_R: ConstInt, TILE_C: ConstInt, LAYER_NORM: ConstBool,
                            HAS_WEIGHT: ConstBool, HAS_BIAS: ConstBool, HAS_OFFSET: ConstBool,
                            GROUP: ConstInt, SCALING: ConstInt, BLOCK_R: ConstInt,
                            DEPENDENT: ConstBool):
    """The (cols, rows) copy ``q_t`` of y and its scales ``q_t_scale``, over (TILE_R, TILE_C)
    blocks of the (rows, cols) h (as :func:`fp8_quantize_normed` reads it), after the row
    kernel that wrote the statistics. The scales run along y's rows, the copy's contraction
    dimension: ROW, one per column, from ``column_amax`` (cols,), written as the (cols, 1)
    fp32 ``q_t_scale`` by the programs of the first row block; BLOCK, one per BLOCK_R x 1
    block, ``q_t_scale`` (cols, cdiv(rows, BLOCK_R)) fp32; MX, one per BLOCK_R x 1 block,
    E8M0 bytes. TILE_R is a multiple of BLOCK_R, so a block's rows are all in one tile;
    rows past the end are left out of its amax."""
    start_after_predecessor(DEPENDENT)
    shape = (TILE_R, TILE_C)
    col_blocks = ct.num_tiles(h, axis=1, shape=shape)
    blocks = ct.num_tiles(h, axis=0, shape=shape) * col_blocks
    for b in range(ct.bid(0), blocks, ct.num_blocks(0)):
        row_block, col_block = b // col_blocks, b % col_blocks
        v = _dequantized(h, x_scale_inv, row_block, col_block, TILE_R, TILE_C, GROUP)
        if LAYER_NORM:
            v = v - _load2(mean, (row_block,), (TILE_R,)).reshape((TILE_R, 1))
        r = _load2(rstd, (row_block,), (TILE_R,)).reshape((TILE_R, 1))
        y = _affine(v * r, weight, bias, offset, col_block, TILE_C, HAS_WEIGHT, HAS_BIAS,
                    HAS_OFFSET)
        if SCALING == ROW:
            s = _scale_of(_load2(column_amax, (col_block,), (TILE_C,)).reshape((1, TILE_C)),
                          fp8_max)
            quantized = _saturate(y * s, fp8_max)
            if row_block == 0:
                _store(q_t_scale, (col_block, 0), (1.0 / s).reshape((TILE_C, 1)))
        else:
            groups = TILE_R // BLOCK_R
            a = _inside_rows(_abs_skipping_nan(y), row_block, h.shape[0], TILE_R, HAS_BIAS)
            amax = ct.max(a.reshape((groups, BLOCK_R, TILE_C)), axis=1, keepdims=True)
            y3 = y.reshape((groups, BLOCK_R, TILE_C))
            if SCALING == MX:
                k = _mx_exponent(amax, fp8_max)
                scaled = y3 * _power_of_two(-k)
                stored = ct.transpose((k + 127).reshape((groups, TILE_C))).astype(ct.uint8)
            else:
                block_scale = _scale_of(amax, fp8_max)
                scaled = y3 * block_scale
                stored = ct.transpose((1.0 / block_scale).reshape((groups, TILE_C)))
            _store(q_t_scale, (col_block, row_block), stored)
            quantized = _saturate(scaled, fp8_max).reshape((TILE_R, TILE_C))
        _store(q_t, (col_block, row_block), ct.transpose(quantized).astype(q_t.dtype))


# --- MX scales in the layout of Blackwell's block-scaled GEMMs ---------------------------------


def fp8_swizzle_mx_scales(scales, blocked, TILE_CB: ConstInt, DEPENDENT: ConstBool):
    """The (R, C) row-major E8M0 bytes ``scales`` in cuBLAS's 1-D block-scaling-factor
    layout (the 128 x 4 "swizzle" of MXFP8 on Blackwell): tiles of 128 rows x 4 columns,
    row-major over the tile grid, each 512 contiguous bytes in which element (i, j) sits at
    ``(i % 32) * 16 + (i // 32) * 4 + j``. ``blocked`` is that memory as a (cdiv(R, 128),
    cdiv(C, 4), 32, 4, 4) array. Program (r, k) moves row block r's tiles k * TILE_CB
    onwards; rows past R and columns past C are written as 0 (as torch's ``to_blocked``
    pads), so every byte of ``blocked`` is written once."""
    start_after_predecessor(DEPENDENT)
    row_block, chunk = ct.bid(0), ct.bid(1)
    s = _load2(scales, (row_block, chunk), (128, 4 * TILE_CB))
    # Row 32 a + b and column 4 c + j of the tiles go to (c, b, a, j).
    tiles = ct.permute(s.reshape((4, 32, TILE_CB, 4)), (2, 1, 0, 3))
    _store(blocked, (row_block, chunk, 0, 0, 0), tiles.reshape((1, TILE_CB, 32, 4, 4)))


# --- backward of FP8 input -------------------------------------------------------------------


def _store_partial(partial, acc, slot):
    """Fold a (TILE_A, TILE_N) accumulator into slot ``slot`` of a (slots, 1, cols) partial
    buffer."""
    folded = ct.sum(acc, axis=0, keepdims=True)
    _store(partial, (slot, 0, 0), folded.reshape((1, 1, acc.shape[1])))


def norm_bwd_fp8_input_single(dy, x, x_scale_inv, weight, mean, rstd, dx, partial_w,
                              partial_b, offset: float, inv_n: float,
                              TILE_A: ConstInt, TILE_N: ConstInt, GROUP: ConstInt,
                              LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool,
                              HAS_BIAS: ConstBool, HAS_OFFSET: ConstBool, DEPENDENT: ConstBool):
    """The single-pass backward of a norm of FP8 x (no residual): x and its multipliers are
    re-read and dequantized, dy (y's gradient, in its own dtype) read in fp32, dx written in
    dx's dtype; ``sum(dy * x_hat)`` (and ``sum(dy)``) over the program's rows fold into its
    slot of the (grid, 1, cols) partial buffers. Rows past the end load rstd = 0: their
    x_hat and dx are 0 and never stored."""
    start_after_predecessor(DEPENDENT)
    shape = (TILE_A, TILE_N)
    program = ct.bid(0)
    row_tiles = ct.num_tiles(x, axis=0, shape=shape)
    dw = ct.zeros(shape, dtype=ct.float32)
    db = ct.zeros(shape, dtype=ct.float32)
    for t in range(program, row_tiles, ct.num_blocks(0)):
        v = _dequantized(x, x_scale_inv, t, 0, TILE_A, TILE_N, GROUP)
        g = _load2(dy, (t, 0), shape).astype(ct.float32)
        r = _load2(rstd, (t,), (TILE_A,)).reshape((TILE_A, 1))
        if LAYER_NORM:
            v = v - _load2(mean, (t,), (TILE_A,)).reshape((TILE_A, 1))
        x_hat = v * r
        wdy = _times_weight(g, weight, offset, 0, TILE_N, HAS_WEIGHT, HAS_OFFSET)
        d = wdy - x_hat * (ct.sum(x_hat * wdy, axis=1, keepdims=True) * inv_n)
        if LAYER_NORM:
            d = d - ct.sum(wdy, axis=1, keepdims=True) * inv_n
        _store(dx, (t, 0), (d * r).astype(dx.dtype))
        if HAS_WEIGHT:
            dw += g * x_hat
        if HAS_BIAS:
            db += g
    if HAS_WEIGHT:
        _store_partial(partial_w, dw, program)
    if HAS_BIAS:
        _store_partial(partial_b, db, program)
