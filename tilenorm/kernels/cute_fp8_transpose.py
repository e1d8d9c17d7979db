"""The transposed FP8 copy of a normalized output in the CuTe DSL: the (cols, rows) copy
``q_t`` whose scales run along the rows of y (the weight-gradient GEMM's contraction
dimension), after the row kernel that wrote rstd (and, for a per-row scaling, the column
amaxes).

cuTile's ``fp8_quantize_transposed`` (cutile_row_norm_fp8.py) does the same over 128 x 128
(64 x 128) blocks held as whole tiles: 128 registers, or 206 for the per-row scaling's copy,
and few bytes in flight (bench/NOTES.md #60). Here a CTA takes one tile of ``TILE_ROWS`` =
128 rows of y by ``tile_cols`` (128 or 64) columns, and each of its ``16 * tile_cols / 8``
threads 8 consecutive rows by 8 consecutive columns: eight 16-byte loads of x, so a warp's
load is two 256-byte runs of x's rows. Enough CTAs an SM (``ctas_per_sm``) keep tiles in
flight while others quantize and store.

The math is cuTile's pass, fp32 throughout, so the copy has its bits (without the Gemma
offset, whose contraction the compilers may choose differently, cute_row_norm_fp8.py)::

    y = (x * rstd) * w (+ (x * rstd) * offset)       q_t = cast(saturate(y * scale))

or with ``weight_first`` the CuTe row kernel's, whose column amaxes a per-row scaling's
copy then takes (``column_amax`` there)::

    t = x * w (+ x * offset)        y = t * rstd

Scales (``scaling``): ``"row"``, one per column of y from the row kernel's ``column_amax``
(the (cols, 1) fp32 ``scale_inv`` written by the first row tile's CTAs); ``"block"``, one
per 128 x 1 block of y, (cols, cdiv(rows, 128)) fp32 with strides (1, cols); ``"mx"``, one
per 32 x 1 block, E8M0 bytes (cols, cdiv(rows, 32)) row-major. A block's amax: each thread's
8 rows, then a butterfly over the warp's lanes of the same columns, then the warps' maxima
of the block (shared memory, in warp order: max is exact and order-free, reruns are
bit-identical). Rows past the end load the last row with rstd 0: y is 0 (or NaN where x is
not finite, which every amax skips), in no amax, never stored.

The transposed store: each thread converts a column's 8 values to 8 FP8 bytes, one 8-byte
chunk of that column's line in shared memory ((tile_cols, 16) chunks); chunk ``g`` of the
thread with column vector ``c`` sits at ``g ^ c`` (the lanes of a warp write distinct banks).
Then each thread copies 16-byte runs of a line (two chunks, swapped back where ``c`` is odd)
to ``q_t``, eight lanes a 128-byte run of a row of ``q_t``. The row count is a runtime value
and a multiple of 16 (a 16-byte run is all inside or all past the end; the planner sends
other row counts to cuTile's pass).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from tilenorm.kernels.cute_row_norm_fp8 import Fp8Scales
from tilenorm.kernels.cute_rows import SMEM_CARVEOUT

#: Scalings whose copies the kernel writes; ``BLOCK_ROWS`` the rows of y one scale covers.
SCALINGS = ("row", "block", "mx")
BLOCK_ROWS = {"row": 128, "block": 128, "mx": 32}
#: Rows of a tile: one 128 x 1 block, four 32 x 1 MX blocks of each column.
TILE_ROWS = 128
#: Columns a tile may take.
TILE_COLS = (128, 64)
#: Rows one thread holds, and the bytes of one chunk of a column's line in shared memory.
THREAD_ROWS = 8
#: 16-byte runs of a line: a row of q_t's tile.
LINE_RUNS = TILE_ROWS // 16
#: The row count's divisor: q_t's rows start 16-byte aligned, and a run is whole.
ROW_MULTIPLE = 16


class TransposedFp8Quantize(Fp8Scales):
    """The kernel for one (dtypes, scaling, tile width, CTAs per SM, offset);
    ``__call__`` launches it on (cols / tile_cols, cdiv(rows, 128)) CTAs."""

    def __init__(self, dtype, weight_dtype, fp8_dtype, fp8_max: float, cols: int,
                 tile_cols: int, ctas_per_sm: int, scaling: str, has_offset: bool,
                 weight_first: bool = False):
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        if dtype.width != 16:
            raise ValueError("the transposed copy reads 2-byte x")
        if tile_cols not in TILE_COLS or cols % tile_cols:
            raise ValueError(f"{cols} columns are not whole tiles of one of {TILE_COLS}")
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_max
        self.cols = cols
        self.tile_cols = tile_cols
        self.ctas_per_sm = ctas_per_sm
        self.scaling = scaling
        self.has_weight = weight_dtype is not None
        self.has_offset = has_offset
        self.weight_first = weight_first
        self.vec = 128 // dtype.width
        #: Threads along a tile's row (one 16-byte vector each) and along its rows.
        self.col_threads = tile_cols // self.vec
        self.row_groups = TILE_ROWS // THREAD_ROWS
        self.threads = self.col_threads * self.row_groups
        self.warps = self.threads // cute.arch.WARP_SIZE
        self.warp_rows = TILE_ROWS // self.warps
        self.block_rows = BLOCK_ROWS[scaling]
        #: Scales of a column in a tile, and the warps whose rows one of them covers.
        self.tile_blocks = TILE_ROWS // self.block_rows
        self.block_warps = self.block_rows // self.warp_rows

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor | None, mRstd: cute.Tensor,
                 mColumnAmax: cute.Tensor | None, mQt: cute.Tensor, mQtScale: cute.Tensor,
                 offset: Float32, row_tiles: Int32, stream):
        self.kernel(mX, mW, mRstd, mColumnAmax, mQt, mQtScale, offset).launch(
            grid=[self.cols // self.tile_cols, row_tiles, 1], block=[self.threads, 1, 1],
            stream=stream, max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor | None, mRstd: cute.Tensor,
               mColumnAmax: cute.Tensor | None, mQt: cute.Tensor, mQtScale: cute.Tensor,
               offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        col_tile, row_tile, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        c = tidx % self.col_threads
        g = tidx // self.col_threads
        first_row = row_tile * TILE_ROWS + g * THREAD_ROWS
        vector = col_tile * self.col_threads + c

        smem = cutlass.memory.SmemAllocator()
        # The copy's tile: (line = column of the tile, 8-byte chunk of 8 rows), swizzled.
        lines = smem.allocate_tensor(
            cutlass.Int64, cute.make_layout((self.tile_cols, 2 * LINE_RUNS),
                                            stride=(2 * LINE_RUNS, 1)), 16)
        scales = smem.allocate_tensor(
            Float32, cute.make_layout((self.tile_blocks, self.tile_cols),
                                      stride=(self.tile_cols, 1)), 16)
        maxima = None
        if const_expr(self.scaling != "row"):
            maxima = smem.allocate_tensor(
                Float32, cute.make_layout((self.warps, self.tile_cols),
                                          stride=(self.tile_cols, 1)), 16)

        # x: (column j, row i) of this thread's 8 x 8; rows past the end load the last row.
        xs = cute.make_rmem_tensor((self.vec, THREAD_ROWS), self.dtype)
        for i in cutlass.range_constexpr(THREAD_ROWS):
            row = cutlass.min(first_row + i, last)
            cute.autovec_copy(cute.zipped_divide(mX[row, None], (self.vec,))[None, vector],
                              xs[None, i])
        rstd = cute.make_rmem_tensor((THREAD_ROWS,), Float32)
        for i in cutlass.range_constexpr(THREAD_ROWS):
            r = mRstd[cutlass.min(first_row + i, last)]
            if first_row + i > last:
                r = Float32(0.0)
            rstd[i] = r
        w = None
        if const_expr(self.has_weight):
            w_in = cute.make_rmem_tensor((self.vec,), self.weight_dtype)
            cute.autovec_copy(cute.zipped_divide(mW, (self.vec,))[None, vector], w_in)
            w = cute.make_rmem_tensor((self.vec,), Float32)
            w.store(w_in.load().to(Float32))

        xf = cute.make_rmem_tensor((self.vec, THREAD_ROWS), Float32)
        xf.store(xs.load().to(Float32))
        y = cute.make_rmem_tensor((self.vec, THREAD_ROWS), Float32)
        for i in cutlass.range_constexpr(THREAD_ROWS):
            for j in cutlass.range_constexpr(self.vec):
                if const_expr(self.weight_first):
                    t = xf[j, i]
                    if const_expr(self.has_weight):
                        t = xf[j, i] * w[j]
                        if const_expr(self.has_offset):
                            t = t + xf[j, i] * offset
                    y[j, i] = t * rstd[i]
                else:
                    normed = xf[j, i] * rstd[i]
                    v = normed
                    if const_expr(self.has_weight):
                        v = normed * w[j]
                        if const_expr(self.has_offset):
                            v = v + normed * offset
                    y[j, i] = v

        if const_expr(self.scaling != "row"):
            # Each column's largest |y| over the thread's rows, the warp's, then in shared
            # memory by warp.
            for j in cutlass.range_constexpr(self.vec):
                m = Float32(0.0)
                for i in cutlass.range_constexpr(THREAD_ROWS):
                    m = cute.arch.fmax(m, cute.math.absf(y[j, i]))
                for k in cutlass.range_constexpr(self.col_threads.bit_length() - 1, 5):
                    m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, 1 << k))
                if lane < self.col_threads:
                    maxima[warp, c * self.vec + j] = m
            cute.arch.barrier()

        # Each (block, column) of the tile: its scale to shared memory, its scale_inv out.
        bits = cute.make_rmem_tensor((2,), Float32)
        slots = self.tile_blocks * self.tile_cols
        for k in cutlass.range_constexpr((slots + self.threads - 1) // self.threads):
            slot = tidx + k * self.threads
            if slot < slots:
                col = slot // self.tile_blocks
                block = slot % self.tile_blocks
                n = col_tile * self.tile_cols + col
                amax = Float32(0.0)
                if const_expr(self.scaling == "row"):
                    amax = mColumnAmax[n]
                else:
                    for b in cutlass.range_constexpr(self.block_warps):
                        amax = cute.arch.fmax(amax, maxima[block * self.block_warps + b, col])
                if const_expr(self.scaling == "mx"):
                    e = self._mx_exponent(amax, bits)
                    scales[block, col] = self._power_of_two(-e, bits)
                    index = row_tile * self.tile_blocks + block
                    if index < mQtScale.shape[1]:
                        mQtScale[n, index] = cutlass.Uint8(e + 127)
                else:
                    scale = self._scale_of(amax)
                    scales[block, col] = scale
                    if const_expr(self.scaling == "block"):
                        mQtScale[n, row_tile] = Float32(1.0) / scale
                    # Two ifs: one decided when tracing, one at run time.
                    if const_expr(self.scaling == "row"):  # noqa: SIM102
                        if row_tile == 0:
                            mQtScale[n, 0] = Float32(1.0) / scale
        cute.arch.barrier()

        # Quantize a column's 8 values at a time into its line's chunk g, swizzled.
        block = (g * THREAD_ROWS) // self.block_rows
        chunk = g ^ c
        for j in cutlass.range_constexpr(self.vec):
            scale = scales[block, c * self.vec + j]
            qf = cute.make_rmem_tensor((THREAD_ROWS,), Float32)
            for i in cutlass.range_constexpr(THREAD_ROWS):
                qf[i] = y[j, i] * scale  # the conversion saturates (cute_row_norm_fp8.py)
            q = cute.make_rmem_tensor((THREAD_ROWS,), self.fp8_dtype)
            q.store(qf.load().to(self.fp8_dtype))
            lines[c * self.vec + j, chunk] = cute.recast_tensor(q, cutlass.Int64)[0]
        cute.arch.barrier()

        # 16-byte runs of the lines to q_t's rows; rows past the end are not stored.
        runs = self.tile_cols * LINE_RUNS
        for k in cutlass.range_constexpr(runs // self.threads):
            run = tidx + k * self.threads
            line = run // LINE_RUNS
            s = run % LINE_RUNS
            if row_tile * TILE_ROWS + s * 16 < rows:
                swizzle = line // self.vec
                pair = cute.make_rmem_tensor((2,), cutlass.Int64)
                cute.autovec_copy(
                    cute.zipped_divide(lines[line, None], (2,))[None, s ^ (swizzle >> 1)],
                    pair)
                out = cute.make_rmem_tensor((2,), cutlass.Int64)
                first = pair[0]
                second = pair[1]
                if swizzle % 2 == 1:
                    first = pair[1]
                    second = pair[0]
                out[0] = first
                out[1] = second
                n = col_tile * self.tile_cols + line
                cute.autovec_copy(
                    cute.recast_tensor(out, cutlass.Uint8),
                    cute.zipped_divide(mQt[n, None], (16,))[None, row_tile * LINE_RUNS + s])
