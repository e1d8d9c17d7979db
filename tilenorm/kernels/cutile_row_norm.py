"""RMSNorm and LayerNorm forward and backward in cuTile: persistent grid-stride kernels.

One kernel template serves both ops (LayerNorm is the RMSNorm of the centered row) and every
feature; compile-time constants select the variant, so a feature that is off costs nothing:

    h = x + residual                      (HAS_RESIDUAL; stored as residual_out, the norm reads it)
    mu = mean(h)                          (LAYER_NORM; stored as mean)
    rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = (h - mu) * rstd * (offset + w) + b    (w: HAS_WEIGHT, per head with PER_HEAD; b: HAS_BIAS)

All arithmetic is fp32; y takes y's dtype (the output dtype may differ from x's).

Operands are viewed as (rows, heads, cols): plain norms have one head; per-head (QK) norms keep
the head axis so strided (..., H, D) inputs need no copy. Every kernel runs on a persistent
grid that :mod:`tilenorm.planner` lays out; program ``p`` handles row tiles ``p, p + grid,
...``. Rows that fit in one tile are done in one pass ("single" kernels; rows of one head that
would pad a power-of-two tile by a third or more are held as two pieces instead, "split"
kernels). Wider rows: the forward walks them in column chunks twice, the second pass reading
the row back from L2 ("chunked"); the backward is column split, each program owning one column
tile of its rows: a first kernel writes each tile's share of the row sums, a second adds them
up and writes dx ("row_sums", "columns").

The backward reads y's gradient as the sum of ``DY_TERMS`` (1 to 3) arrays, added in fp32 as
they load: a compiled graph whose norm output feeds several projections hands over their
gradients unsummed (:mod:`tilenorm.pytorch.graph_passes`), which saves the pass that would add
them. It writes dx (and, for a fused residual, the residual's gradient) and folds
``sum(dy * x_hat)`` (and ``sum(dy)``) over the program's rows into its slot of a fp32 partial
buffer; ``column_sums`` (:mod:`tilenorm.kernels.cutile_column_sums`) adds the slots in a fixed
order. No M x N temporary, no atomics: results are bit-for-bit repeatable.

Each kernel exists twice: with 32-bit indexing and, for operands whose offsets pass 2^31 - 1,
with 64-bit indexing (``plan.index_bits``). On Hopper and later most launches are programmatic
dependents (``plan.dependent_launch``, ``plan.dependent_reduce``): a kernel may start while the
one before it drains, and waits for it before touching memory.
"""

from __future__ import annotations

import cuda.tile as ct

from tilenorm.kernels.cutile_column_sums import start_after_predecessor

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


def _store(a, index, tile):
    """Every store goes through registers, not TMA: faster for y (bench/NOTES.md, #10), and
    with TMA stores of rstd and dx a few rows came out wrong, intermittently (#14)."""
    ct.store(a, index=index, tile=tile, allow_tma=False)


# --- tile helpers (inlined into the kernels) ---------------------------------------------


def _param(p, head_tile, chunk, TILE_H, TILE_N, PER_HEAD):
    """A (1, TILE_H or 1, TILE_N) fp32 tile of a (1, heads or 1, cols) weight or bias."""
    if PER_HEAD:
        t = ct.load(p, index=(0, head_tile, chunk), shape=(1, TILE_H, TILE_N),
                    padding_mode=ZERO)
    else:
        t = ct.load(p, index=(0, 0, chunk), shape=(1, 1, TILE_N), padding_mode=ZERO)
    return t.astype(ct.float32)


def _scale(weight, head_tile, chunk, TILE_H, TILE_N, HAS_WEIGHT, PER_HEAD):
    """The fp32 weight tile of one column chunk, or ones without a weight."""
    if HAS_WEIGHT:
        return _param(weight, head_tile, chunk, TILE_H, TILE_N, PER_HEAD)
    return ct.full((1, 1, TILE_N), 1.0, dtype=ct.float32)


def _times_scale(v, scale, offset, HAS_OFFSET):
    """``v * (offset + w)``, computed as ``v * w + v * offset``: the weight tile stays as
    loaded. A loaded tile can be re-read, a computed one must live in registers for the whole
    persistent loop, which spills at 8192-element tiles (bench/NOTES.md, #12)."""
    out = v * scale
    if HAS_OFFSET:
        out = out + v * offset
    return out


def _affine(v, weight, bias, offset, head_tile, chunk, TILE_H, TILE_N, HAS_WEIGHT, PER_HEAD,
            HAS_BIAS, HAS_OFFSET):
    out = _times_scale(v, _scale(weight, head_tile, chunk, TILE_H, TILE_N, HAS_WEIGHT,
                                 PER_HEAD), offset, HAS_OFFSET)
    if HAS_BIAS:
        out = out + _param(bias, head_tile, chunk, TILE_H, TILE_N, PER_HEAD)
    return out


def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


def _row_sums(a, b):
    """Row sums of two tiles in one reduction: LayerNorm's backward needs both, and one
    reduction tree costs one round of shared-memory exchanges instead of two."""
    return ct.reduce((a, b), axis=2, func=_add_pairs, identity=(0.0, 0.0), keepdims=True)


def _column_mask(chunk, cols, TILE_N):
    """(1, 1, TILE_N): True on the columns of chunk ``chunk`` that exist."""
    index = ct.arange(TILE_N, dtype=ct.int32) + chunk * TILE_N
    return (index < cols).reshape((1, 1, TILE_N))


def _load3(a, index, shape):
    return ct.load(a, index=index, shape=shape, padding_mode=ZERO)


def _load_dy(dy, dy2, dy3, index, shape, DY_TERMS):
    """y's gradient, fp32: the sum of its ``DY_TERMS`` parts."""
    g = _load3(dy, index, shape).astype(ct.float32)
    if DY_TERMS > 1:
        g = g + _load3(dy2, index, shape).astype(ct.float32)
    if DY_TERMS > 2:
        g = g + _load3(dy3, index, shape).astype(ct.float32)
    return g


def _row_stat(a, row_tile, head_tile, TILE_A, TILE_H):
    """A (TILE_A, TILE_H, 1) tile of a (rows, heads) statistic; rows past the end read 0."""
    t = ct.load(a, index=(row_tile, head_tile), shape=(TILE_A, TILE_H), padding_mode=ZERO)
    return t.reshape((TILE_A, TILE_H, 1))


def _store_stat(a, row_tile, head_tile, value, TILE_A, TILE_H):
    _store(a, (row_tile, head_tile), value.reshape((TILE_A, TILE_H)))


def _residual_sum(xt, rt, residual_out, row_tile, head_tile, chunk):
    """h = x + residual, rounded to the residual stream's dtype (what the norm and the
    backward read), stored, and returned in fp32."""
    h = (xt.astype(ct.float32) + rt.astype(ct.float32)).astype(residual_out.dtype)
    _store(residual_out, (row_tile, head_tile, chunk), h)
    return h.astype(ct.float32)


def _store_partial(partial, acc, slot, head_tile, chunk, PER_HEAD):
    """Fold a (TILE_A, TILE_H, TILE_N) accumulator into the program's partial-buffer slot."""
    if PER_HEAD:
        folded = ct.sum(acc, axis=0, keepdims=True)
        index = (slot, head_tile, chunk)
    else:
        folded = ct.sum(ct.sum(acc, axis=0, keepdims=True), axis=1, keepdims=True)
        index = (slot, 0, chunk)
    _store(partial, index, folded)


# --- forward -----------------------------------------------------------------------------


def _store_y(y, normed, scale, shift, offset, index, HAS_BIAS, HAS_OFFSET):
    out = _times_scale(normed, scale, offset, HAS_OFFSET)
    if HAS_BIAS:
        out = out + shift
    _store(y, index, out.astype(y.dtype))


def _fwd_tile(xt, rt, t, head_tiles, scale, shift, y, residual_out, mean, rstd, eps, inv_n,
              offset, TILE_A, TILE_H, TILE_N, LAYER_NORM, HAS_BIAS, HAS_RESIDUAL, PADDED,
              HAS_OFFSET):
    """Normalize one loaded single-pass row tile and store its outputs."""
    row_tile, head_tile = t // head_tiles, t % head_tiles
    if HAS_RESIDUAL:
        v = _residual_sum(xt, rt, residual_out, row_tile, head_tile, 0)
    else:
        v = xt.astype(ct.float32)
    if LAYER_NORM:
        mu = ct.sum(v, axis=2, keepdims=True) * inv_n
        v = v - mu
        if PADDED:  # padding columns load 0; centered they would be -mu: keep them out
            v = ct.where(_column_mask(0, y.shape[2], TILE_N), v, 0.0)
        _store_stat(mean, row_tile, head_tile, mu, TILE_A, TILE_H)
    r = ct.rsqrt(ct.sum(v * v, axis=2, keepdims=True) * inv_n + eps)
    _store_y(y, v * r, scale, shift, offset, (row_tile, head_tile, 0), HAS_BIAS, HAS_OFFSET)
    _store_stat(rstd, row_tile, head_tile, r, TILE_A, TILE_H)


def norm_fwd_single(x, residual, weight, bias, y, residual_out, mean, rstd,
                    eps: float, offset: float, inv_n: float,
                    TILE_A: ConstInt, TILE_H: ConstInt, TILE_N: ConstInt,
                    LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool, PER_HEAD: ConstBool,
                    HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool, PADDED: ConstBool,
                    HAS_OFFSET: ConstBool, DEPENDENT: ConstBool):
    start_after_predecessor(DEPENDENT)
    shape = (TILE_A, TILE_H, TILE_N)
    head_tiles = ct.num_tiles(x, axis=1, shape=shape)
    row_tiles = ct.num_tiles(x, axis=0, shape=shape) * head_tiles
    program, step = ct.bid(0), ct.num_blocks(0)
    # With a per-head weight the grid is a multiple of head_tiles: one head tile per program,
    # so the program loads its weight and bias once.
    head_tile_w = program % head_tiles
    scale = _scale(weight, head_tile_w, 0, TILE_H, TILE_N, HAS_WEIGHT, PER_HEAD)
    shift = scale
    if HAS_BIAS:
        shift = _param(bias, head_tile_w, 0, TILE_H, TILE_N, PER_HEAD)
    for t in range(program, row_tiles, step):
        xt = _load3(x, (t // head_tiles, t % head_tiles, 0), shape)
        rt = xt
        if HAS_RESIDUAL:
            rt = _load3(residual, (t // head_tiles, t % head_tiles, 0), shape)
        _fwd_tile(xt, rt, t, head_tiles, scale, shift, y, residual_out, mean, rstd, eps,
                  inv_n, offset, TILE_A, TILE_H, TILE_N, LAYER_NORM, HAS_BIAS, HAS_RESIDUAL,
                  PADDED, HAS_OFFSET)


def _piece(x, residual, residual_out, row_tile, chunk, shape, HAS_RESIDUAL):
    """One piece of a split row in fp32 (with a fused residual, h = x + residual, stored)."""
    xt = _load3(x, (row_tile, 0, chunk), shape)
    if HAS_RESIDUAL:
        rt = _load3(residual, (row_tile, 0, chunk), shape)
        return _residual_sum(xt, rt, residual_out, row_tile, 0, chunk)
    return xt.astype(ct.float32)


def norm_fwd_split(x, residual, weight, bias, y, residual_out, mean, rstd,
                   eps: float, offset: float, inv_n: float,
                   TILE_A: ConstInt, TILE_H: ConstInt, TILE_N: ConstInt,
                   LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool, PER_HEAD: ConstBool,
                   HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool, PADDED: ConstBool,
                   HAS_OFFSET: ConstBool, DEPENDENT: ConstBool, SPLIT_N: ConstInt):
    """The single-pass forward for rows of one head held as two power-of-two pieces,
    ``TILE_N`` columns and then ``SPLIT_N`` (5120 = 4096 + 1024) instead of one tile padded to
    ``2 * TILE_N``; only the second piece may be padded. ``TILE_H`` and ``PER_HEAD`` are
    those of the single-pass signature (one head: a per-head weight is the shared one)."""
    start_after_predecessor(DEPENDENT)
    first, second = (TILE_A, 1, TILE_N), (TILE_A, 1, SPLIT_N)
    at = TILE_N // SPLIT_N  # the second piece's index in tiles of its own width
    row_tiles = ct.num_tiles(x, axis=0, shape=first)
    scale = _scale(weight, 0, 0, 1, TILE_N, HAS_WEIGHT, False)
    scale2 = _scale(weight, 0, at, 1, SPLIT_N, HAS_WEIGHT, False)
    shift, shift2 = scale, scale2
    if HAS_BIAS:
        shift = _param(bias, 0, 0, 1, TILE_N, False)
        shift2 = _param(bias, 0, at, 1, SPLIT_N, False)
    for t in range(ct.bid(0), row_tiles, ct.num_blocks(0)):
        v = _piece(x, residual, residual_out, t, 0, first, HAS_RESIDUAL)
        v2 = _piece(x, residual, residual_out, t, at, second, HAS_RESIDUAL)
        if LAYER_NORM:
            mu = (ct.sum(v, axis=2, keepdims=True) + ct.sum(v2, axis=2, keepdims=True)) * inv_n
            v = v - mu
            v2 = v2 - mu
            if PADDED:  # as in _fwd_tile: centered padding would be -mu
                v2 = ct.where(_column_mask(at, y.shape[2], SPLIT_N), v2, 0.0)
            _store_stat(mean, t, 0, mu, TILE_A, 1)
        r = ct.rsqrt((ct.sum(v * v, axis=2, keepdims=True) +
                      ct.sum(v2 * v2, axis=2, keepdims=True)) * inv_n + eps)
        _store_y(y, v * r, scale, shift, offset, (t, 0, 0), HAS_BIAS, HAS_OFFSET)
        _store_y(y, v2 * r, scale2, shift2, offset, (t, 0, at), HAS_BIAS, HAS_OFFSET)
        _store_stat(rstd, t, 0, r, TILE_A, 1)


def norm_fwd_chunked(x, residual, weight, bias, y, residual_out, mean, rstd,
                     eps: float, offset: float, inv_n: float,
                     TILE_A: ConstInt, TILE_H: ConstInt, TILE_N: ConstInt,
                     LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool, PER_HEAD: ConstBool,
                     HAS_BIAS: ConstBool, HAS_RESIDUAL: ConstBool, PADDED: ConstBool,
                     HAS_OFFSET: ConstBool, DEPENDENT: ConstBool):
    start_after_predecessor(DEPENDENT)
    shape = (TILE_A, TILE_H, TILE_N)
    head_tiles = ct.num_tiles(x, axis=1, shape=shape)
    row_tiles = ct.num_tiles(x, axis=0, shape=shape) * head_tiles
    chunks = ct.num_tiles(x, axis=2, shape=shape)
    cols = x.shape[2]
    program = ct.bid(0)
    head_tile_w = program % head_tiles
    for t in range(program, row_tiles, ct.num_blocks(0)):
        row_tile, head_tile = t // head_tiles, t % head_tiles
        acc = ct.zeros(shape, dtype=ct.float32)
        mu = ct.zeros((TILE_A, TILE_H, 1), dtype=ct.float32)
        m2 = ct.zeros((TILE_A, TILE_H, 1), dtype=ct.float32)
        for c in range(chunks):
            xt = _load3(x, (row_tile, head_tile, c), shape)
            if HAS_RESIDUAL:
                rt = _load3(residual, (row_tile, head_tile, c), shape)
                v = _residual_sum(xt, rt, residual_out, row_tile, head_tile, c)
            else:
                v = xt.astype(ct.float32)
            if LAYER_NORM:
                # Merge this chunk's exact mean and squared deviations into the row's
                # (Chan et al.): no E[x^2] - E[x]^2 cancellation.
                seen = c * (TILE_N * 1.0)
                count = min(cols - c * TILE_N, TILE_N) * 1.0
                chunk_mean = ct.sum(v, axis=2, keepdims=True) / count
                d = v - chunk_mean
                if PADDED:
                    d = ct.where(_column_mask(c, cols, TILE_N), d, 0.0)
                delta = chunk_mean - mu
                mu = mu + delta * (count / (seen + count))
                m2 = m2 + ct.sum(d * d, axis=2, keepdims=True) + \
                    delta * delta * (seen * count / (seen + count))
            else:
                acc += v * v
        if LAYER_NORM:
            r = ct.rsqrt(m2 * inv_n + eps)
            _store_stat(mean, row_tile, head_tile, mu, TILE_A, TILE_H)
        else:
            r = ct.rsqrt(ct.sum(acc, axis=2, keepdims=True) * inv_n + eps)
        source = residual_out if HAS_RESIDUAL else x
        for c in range(chunks):
            v = _load3(source, (row_tile, head_tile, c), shape)
            v = v.astype(ct.float32)
            if LAYER_NORM:
                v = v - mu
            out = _affine(v * r, weight, bias, offset, head_tile_w, c, TILE_H, TILE_N,
                          HAS_WEIGHT, PER_HEAD, HAS_BIAS, HAS_OFFSET)
            _store(y, (row_tile, head_tile, c), out.astype(y.dtype))
        _store_stat(rstd, row_tile, head_tile, r, TILE_A, TILE_H)


# --- backward ----------------------------------------------------------------------------


def _x_hat(v, mean, rstd_t, row_tile, head_tile, TILE_A, TILE_H, LAYER_NORM):
    if LAYER_NORM:
        return (v - _row_stat(mean, row_tile, head_tile, TILE_A, TILE_H)) * rstd_t
    return v * rstd_t


def _store_dx(d, dres_in, dx, dres, index, HAS_DRES_IN, STORE_DRES):
    """Store the input gradient; with a fused residual it also flows to the residual (plus
    the gradient that reached the residual output directly)."""
    if HAS_DRES_IN:
        d = d + _load3(dres_in, index, d.shape).astype(ct.float32)
    _store(dx, index, d.astype(dx.dtype))
    if STORE_DRES:
        _store(dres, index, d.astype(dres.dtype))


def norm_bwd_single(dy, dy2, dy3, h, weight, mean, rstd, dres_in, dx, dres, partial_w,
                    partial_b, offset: float, inv_n: float,
                    TILE_A: ConstInt, TILE_H: ConstInt, TILE_N: ConstInt,
                    LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool, PER_HEAD: ConstBool,
                    HAS_BIAS: ConstBool, HAS_DRES_IN: ConstBool, STORE_DRES: ConstBool,
                    HAS_OFFSET: ConstBool, DY_TERMS: ConstInt, DEPENDENT: ConstBool):
    start_after_predecessor(DEPENDENT)
    shape = (TILE_A, TILE_H, TILE_N)
    head_tiles = ct.num_tiles(h, axis=1, shape=shape)
    row_tiles = ct.num_tiles(h, axis=0, shape=shape) * head_tiles
    program = ct.bid(0)
    head_tile_w = program % head_tiles
    scale = _scale(weight, head_tile_w, 0, TILE_H, TILE_N, HAS_WEIGHT, PER_HEAD)
    dw = ct.zeros(shape, dtype=ct.float32)
    db = ct.zeros(shape, dtype=ct.float32)
    for t in range(program, row_tiles, ct.num_blocks(0)):
        row_tile, head_tile = t // head_tiles, t % head_tiles
        v = _load3(h, (row_tile, head_tile, 0), shape).astype(ct.float32)
        g = _load_dy(dy, dy2, dy3, (row_tile, head_tile, 0), shape, DY_TERMS)
        # Rows past the end load rstd = 0, which zeroes their x_hat and dx (never stored).
        r = _row_stat(rstd, row_tile, head_tile, TILE_A, TILE_H)
        x_hat = _x_hat(v, mean, r, row_tile, head_tile, TILE_A, TILE_H, LAYER_NORM)
        wdy = _times_scale(g, scale, offset, HAS_OFFSET)
        if LAYER_NORM:
            sum_hw, sum_w = _row_sums(x_hat * wdy, wdy)
            d = wdy - x_hat * (sum_hw * inv_n) - sum_w * inv_n
        else:
            d = wdy - x_hat * (ct.sum(x_hat * wdy, axis=2, keepdims=True) * inv_n)
        _store_dx(d * r, dres_in, dx, dres, (row_tile, head_tile, 0), HAS_DRES_IN,
                  STORE_DRES)
        if HAS_WEIGHT:
            dw += g * x_hat
        if HAS_BIAS:
            db += g
    slot = program // head_tiles if PER_HEAD else program
    if HAS_WEIGHT:
        _store_partial(partial_w, dw, slot, head_tile_w, 0, PER_HEAD)
    if HAS_BIAS:
        _store_partial(partial_b, db, slot, head_tile_w, 0, PER_HEAD)


def norm_bwd_split(dy, dy2, dy3, h, weight, mean, rstd, dres_in, dx, dres, partial_w,
                   partial_b, offset: float, inv_n: float,
                   TILE_A: ConstInt, TILE_H: ConstInt, TILE_N: ConstInt,
                   LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool, PER_HEAD: ConstBool,
                   HAS_BIAS: ConstBool, HAS_DRES_IN: ConstBool, STORE_DRES: ConstBool,
                   HAS_OFFSET: ConstBool, DY_TERMS: ConstInt, DEPENDENT: ConstBool,
                   SPLIT_N: ConstInt):
    """The single-pass backward over the two pieces of :func:`norm_fwd_split`."""
    start_after_predecessor(DEPENDENT)
    first, second = (TILE_A, 1, TILE_N), (TILE_A, 1, SPLIT_N)
    at = TILE_N // SPLIT_N
    row_tiles = ct.num_tiles(h, axis=0, shape=first)
    program = ct.bid(0)
    scale = _scale(weight, 0, 0, 1, TILE_N, HAS_WEIGHT, False)
    scale2 = _scale(weight, 0, at, 1, SPLIT_N, HAS_WEIGHT, False)
    dw, db = ct.zeros(first, dtype=ct.float32), ct.zeros(first, dtype=ct.float32)
    dw2, db2 = ct.zeros(second, dtype=ct.float32), ct.zeros(second, dtype=ct.float32)
    for t in range(program, row_tiles, ct.num_blocks(0)):
        v = _load3(h, (t, 0, 0), first).astype(ct.float32)
        v2 = _load3(h, (t, 0, at), second).astype(ct.float32)
        g = _load_dy(dy, dy2, dy3, (t, 0, 0), first, DY_TERMS)
        g2 = _load_dy(dy, dy2, dy3, (t, 0, at), second, DY_TERMS)
        # Padding columns load dy = 0: they add nothing to the sums and are never stored.
        r = _row_stat(rstd, t, 0, TILE_A, 1)
        x_hat = _x_hat(v, mean, r, t, 0, TILE_A, 1, LAYER_NORM)
        x_hat2 = _x_hat(v2, mean, r, t, 0, TILE_A, 1, LAYER_NORM)
        wdy = _times_scale(g, scale, offset, HAS_OFFSET)
        wdy2 = _times_scale(g2, scale2, offset, HAS_OFFSET)
        if LAYER_NORM:
            sum_hw, sum_w = _row_sums(x_hat * wdy, wdy)
            sum_hw2, sum_w2 = _row_sums(x_hat2 * wdy2, wdy2)
            c_hw, c_w = (sum_hw + sum_hw2) * inv_n, (sum_w + sum_w2) * inv_n
            d = wdy - x_hat * c_hw - c_w
            d2 = wdy2 - x_hat2 * c_hw - c_w
        else:
            c_hw = (ct.sum(x_hat * wdy, axis=2, keepdims=True) +
                    ct.sum(x_hat2 * wdy2, axis=2, keepdims=True)) * inv_n
            d = wdy - x_hat * c_hw
            d2 = wdy2 - x_hat2 * c_hw
        _store_dx(d * r, dres_in, dx, dres, (t, 0, 0), HAS_DRES_IN, STORE_DRES)
        _store_dx(d2 * r, dres_in, dx, dres, (t, 0, at), HAS_DRES_IN, STORE_DRES)
        if HAS_WEIGHT:
            dw += g * x_hat
            dw2 += g2 * x_hat2
        if HAS_BIAS:
            db += g
            db2 += g2
    if HAS_WEIGHT:
        _store_partial(partial_w, dw, program, 0, 0, False)
        _store_partial(partial_w, dw2, program, 0, at, False)
    if HAS_BIAS:
        _store_partial(partial_b, db, program, 0, 0, False)
        _store_partial(partial_b, db2, program, 0, at, False)


def _split_program(h, TILE_N):
    """(row group, head, column tile, row groups, row tiles) of this column-split program."""
    shape = (1, 1, TILE_N)
    col_tiles = ct.num_tiles(h, axis=2, shape=shape)
    heads = ct.num_tiles(h, axis=1, shape=shape)
    rest = ct.bid(0) // col_tiles
    return (rest // heads, rest % heads, ct.bid(0) % col_tiles,
            ct.num_blocks(0) // (col_tiles * heads), ct.num_tiles(h, axis=0, shape=shape))


def _split_x_hat_wdy(dy, dy2, dy3, h, scale, mean, rstd, row, head, col_tile, offset, TILE_N,
                     LAYER_NORM, HAS_OFFSET, DY_TERMS):
    """(dy, x_hat, w * dy, rstd) of one column tile of one vector, fp32."""
    shape = (1, 1, TILE_N)
    v = _load3(h, (row, head, col_tile), shape).astype(ct.float32)
    g = _load_dy(dy, dy2, dy3, (row, head, col_tile), shape, DY_TERMS)
    r = _row_stat(rstd, row, head, 1, 1)
    x_hat = _x_hat(v, mean, r, row, head, 1, 1, LAYER_NORM)
    # Padding columns load dy = 0: they add nothing to any sum and are never stored.
    return g, x_hat, _times_scale(g, scale, offset, HAS_OFFSET), r


def norm_bwd_row_sums(dy, dy2, dy3, h, weight, mean, rstd, row_sums, offset: float,
                      TILE_N: ConstInt, LAYER_NORM: ConstBool, HAS_WEIGHT: ConstBool,
                      PER_HEAD: ConstBool, HAS_OFFSET: ConstBool, DY_TERMS: ConstInt,
                      DEPENDENT: ConstBool):
    """First kernel of the column-split backward (rows wider than one tile): each program
    writes its column tile's share of sum(x_hat * wdy) (and of sum(wdy)) for every vector it
    owns to ``row_sums[row, head, 0 (1), column tile]``. Splitting rows across programs keeps
    every SM streaming however few rows there are: 1024 rows of 131072 are 32768 tiles."""
    start_after_predecessor(DEPENDENT)
    group, head, col_tile, row_groups, rows = _split_program(h, TILE_N)
    scale = _scale(weight, head, col_tile, 1, TILE_N, HAS_WEIGHT, PER_HEAD)
    for row in range(group, rows, row_groups):
        _, x_hat, wdy, _ = _split_x_hat_wdy(dy, dy2, dy3, h, scale, mean, rstd, row, head,
                                            col_tile, offset, TILE_N, LAYER_NORM, HAS_OFFSET,
                                            DY_TERMS)
        if LAYER_NORM:
            sum_hw, sum_w = _row_sums(x_hat * wdy, wdy)
            _store(row_sums, (row, head, 1, col_tile), sum_w.reshape((1, 1, 1, 1)))
        else:
            sum_hw = ct.sum(x_hat * wdy, axis=2, keepdims=True)
        _store(row_sums, (row, head, 0, col_tile), sum_hw.reshape((1, 1, 1, 1)))


def norm_bwd_columns(dy, dy2, dy3, h, weight, mean, rstd, row_sums, dres_in, dx, dres,
                     partial_w, partial_b, offset: float, inv_n: float,
                     TILE_N: ConstInt, SUM_TILES: ConstInt, LAYER_NORM: ConstBool,
                     HAS_WEIGHT: ConstBool, PER_HEAD: ConstBool, HAS_BIAS: ConstBool,
                     HAS_DRES_IN: ConstBool, STORE_DRES: ConstBool, HAS_OFFSET: ConstBool,
                     DY_TERMS: ConstInt, DEPENDENT: ConstBool):
    """Second kernel of the column-split backward, on :func:`norm_bwd_row_sums`'s programs:
    a vector's sums are its tiles' shares added in a fixed order (``SUM_TILES``: the column
    tiles padded to a power of two), then dx is written for the program's column tile and
    dgamma (dbeta) folded into its partial slot. Newest rows first: the row sums pass just
    read them, and some are still in L2."""
    start_after_predecessor(DEPENDENT)
    group, head, col_tile, row_groups, rows = _split_program(h, TILE_N)
    scale = _scale(weight, head, col_tile, 1, TILE_N, HAS_WEIGHT, PER_HEAD)
    dw = ct.zeros((1, 1, TILE_N), dtype=ct.float32)
    db = ct.zeros((1, 1, TILE_N), dtype=ct.float32)
    sums = (1, 1, 1, SUM_TILES)
    last = rows - 1 - (rows - 1 - group) % row_groups
    for i in range(group, rows, row_groups):
        row = last + group - i
        g, x_hat, wdy, r = _split_x_hat_wdy(dy, dy2, dy3, h, scale, mean, rstd, row, head,
                                            col_tile, offset, TILE_N, LAYER_NORM, HAS_OFFSET,
                                            DY_TERMS)
        c_hw = ct.sum(_load3(row_sums, (row, head, 0, 0), sums), axis=3) * inv_n
        if LAYER_NORM:
            c_w = ct.sum(_load3(row_sums, (row, head, 1, 0), sums), axis=3) * inv_n
            d = wdy - x_hat * c_hw - c_w
        else:
            d = wdy - x_hat * c_hw
        _store_dx(d * r, dres_in, dx, dres, (row, head, col_tile), HAS_DRES_IN, STORE_DRES)
        if HAS_WEIGHT:
            dw += g * x_hat
        if HAS_BIAS:
            db += g
    slot = group if PER_HEAD else group * ct.num_tiles(h, axis=1, shape=(1, 1, TILE_N)) + head
    if HAS_WEIGHT:
        _store_partial(partial_w, dw, slot, head, col_tile, PER_HEAD)
    if HAS_BIAS:
        _store_partial(partial_b, db, slot, head, col_tile, PER_HEAD)
