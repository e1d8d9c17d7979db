"""Row-norm backward in the CuTe DSL: dx, and dgamma / dbeta folded into the partial buffer,
with the next rows' loads in flight while a row is reduced.

The cuTile backward (tilenorm/kernels/cutile_row_norm.py) loads a row, reduces it, and only
then loads the next: a cuTile persistent loop cannot carry a loaded tile (bench/NOTES.md, #8,
#22), so an SM has loads in flight only while one of its two resident programs is between
reductions. That holds the LayerNorm backward at 32768 x 4096 to ~90% of copy bandwidth on an
H200. Here each thread keeps ``stages`` rows of its 16-byte vectors in registers: the loads of
row ``r + (stages - 1) * grid`` are issued before row ``r`` is reduced (#38).

Layout: program ``p`` of ``grid`` takes rows ``p, p + grid, ...`` (one program per row at a
time; ``threads`` threads, each holding ``reps`` 16-byte vectors of the row, a block of
``threads`` vectors apart, so every load is coalesced). The two row sums go through a warp
butterfly, then through shared memory in warp order: a fixed summation tree, so dx is
bit-for-bit reproducible, and so are dgamma and dbeta, whose per-program sums the cuTile
``column_sums`` kernel adds in a fixed order. No atomics, no M x N temporary.

``shared_ring``: the ring in shared memory, filled by ``cp.async`` (x and dy by 16 bytes,
each thread its own vectors; rstd and the mean by 4, each thread its own copy), so that no
load of the loop sets a register scoreboard. The register ring's loads share one, and the
first use of each trip's last row waits behind the row just issued: a memory latency a
trip (bench/NOTES.md #132). The same values in the same order; RMSNorm's bits equal the
register ring's on the H200, LayerNorm's differ in 13 of 4M dx elements at 1000 x 4096
(deterministic, as accurate: a different contraction, not a race).
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from tilenorm.kernels.cute_rows import SMEM_CARVEOUT, RowKernel, ring_copies


class RowNormBackward(RowKernel):
    """The kernel for one (dtypes, width, features, launch config); ``__call__`` launches it on
    ``grid`` programs."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, stages: int,
                 ctas_per_sm: int, layer_norm: bool, has_bias: bool,
                 shared_ring: bool = False):
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.cols = cols
        self.threads = threads
        self.vec = 128 // dtype.width
        self.reps = self._whole_vectors(cols)
        if stages < 2 or stages % 2:
            raise ValueError(f"stages must be even and >= 2, got {stages}")
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.layer_norm = layer_norm
        self.has_weight = weight_dtype is not None
        self.has_bias = has_bias
        self.shared_ring = shared_ring
        self.warps = threads // cute.arch.WARP_SIZE

    @cute.jit
    def __call__(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor | None,
                 mMean: cute.Tensor | None, mRstd: cute.Tensor, mdX: cute.Tensor,
                 mPartial: cute.Tensor | None, grid: Int32, stream):
        self.kernel(mX, mdY, mW, mMean, mRstd, mdX, mPartial).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream,
            max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.jit
    def _load_row(self, mX, mdY, mMean, mRstd, row, tidx, x, dy, stats, slot):
        cute.autovec_copy(self._thread_view(mX[row, None], tidx), x)
        cute.autovec_copy(self._thread_view(mdY[row, None], tidx), dy)
        stats[slot, 0] = mRstd[row]
        if const_expr(self.layer_norm):
            stats[slot, 1] = mMean[row]

    @cute.jit
    def _stage_row(self, copies: tuple, mX, mdY, mMean, mRstd, row, tidx, x, dy, stats):
        """``shared_ring``: this thread's vectors of ``row`` of x and dy and its copy of the
        row's rstd (and mean) into its shared-memory slots (``stats``: rstd, then the mean
        ``threads`` words on) by ``cp.async``, committed as one group (every call one, so
        that ``wait_group`` counts rows)."""
        one = cute.make_layout((1,))
        cute.copy(copies[0], self._thread_view(mX[row, None], tidx), x)
        cute.copy(copies[0], self._thread_view(mdY[row, None], tidx), dy)
        cute.copy(copies[1], cute.make_tensor(mRstd.iterator + row, one),
                  cute.make_tensor(stats.iterator, one))
        if const_expr(self.layer_norm):
            cute.copy(copies[1], cute.make_tensor(mMean.iterator + row, one),
                      cute.make_tensor(stats.iterator + self.threads, one))
        cute.arch.cp_async_commit_group()

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, mdX: cute.Tensor,
               mPartial: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        program, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        inv_n = Float32(1.0 / self.cols)

        smem = cutlass.memory.SmemAllocator()
        # (warp, sum, parity): the row sums of two consecutive rows live in different
        # slots, so one barrier per row orders every write before its reads and every read
        # before the slot's next write.
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2, 2)), 16)

        shape = (self.vec, self.reps)
        w = cute.make_rmem_tensor(shape, Float32)
        if const_expr(self.has_weight):
            w_in = cute.make_rmem_tensor(shape, self.weight_dtype)
            cute.autovec_copy(self._thread_view(mW, tidx), w_in)
            w.store(w_in.load().to(Float32))
        dw = cute.make_rmem_tensor(shape, Float32)
        dw.fill(0.0)
        db = cute.make_rmem_tensor(shape, Float32)
        db.fill(0.0)
        dx = cute.make_rmem_tensor(shape, self.dtype)
        # Register tensors, not Python names: a value the next trip of the loop reads must be
        # memory, not an SSA value of the traced body.
        stats = cute.make_rmem_tensor((self.stages, 2), Float32)
        if const_expr(self.shared_ring):
            # (element, slot) of x and dy, a thread's vectors where _thread_view puts them in
            # a row (a warp's 16-byte copies and reads are 512 consecutive bytes); (thread,
            # rstd | mean, slot), each thread its own copy of the row's statistics.
            s_x = smem.allocate_tensor(self.dtype, cute.make_layout((self.cols, self.stages)),
                                       16)
            s_dy = smem.allocate_tensor(self.dtype,
                                        cute.make_layout((self.cols, self.stages)), 16)
            s_stats = smem.allocate_tensor(
                Float32, cute.make_layout((self.threads, 2, self.stages)), 16)
            xs = [self._thread_view(s_x[None, j], tidx) for j in range(self.stages)]
            dys = [self._thread_view(s_dy[None, j], tidx) for j in range(self.stages)]
            slot_stats = [s_stats[tidx, None, j] for j in range(self.stages)]
            x_held = cute.make_rmem_tensor(shape, self.dtype)
            dy_held = cute.make_rmem_tensor(shape, self.dtype)
            copies = ring_copies(self.dtype)
            for s in cutlass.range_constexpr(self.stages):
                self._stage_row(copies, mX, mdY, mMean, mRstd,
                                cutlass.min(program + s * grid, last), tidx, xs[s], dys[s],
                                slot_stats[s])
        else:
            xs = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(self.stages)]
            dys = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(self.stages)]
            # Rows past the end are clamped to the last row: loaded, never used.
            for s in cutlass.range_constexpr(self.stages - 1):
                self._load_row(mX, mdY, mMean, mRstd, cutlass.min(program + s * grid, last),
                               tidx, xs[s], dys[s], stats, s)

        for base in cutlass.range(program, rows, self.stages * grid):
            for s in cutlass.range_constexpr(self.stages):
                x_slot, dy_slot = xs[s], dys[s]
                if const_expr(self.shared_ring):
                    # This row's copies landed (later rows may be in flight): to registers.
                    cute.arch.cp_async_wait_group(self.stages - 1)
                    cute.autovec_copy(xs[s], x_held)
                    cute.autovec_copy(dys[s], dy_held)
                    x_slot, dy_slot = x_held, dy_held
                    stats[s, 0] = slot_stats[s][0]
                    if const_expr(self.layer_norm):
                        stats[s, 1] = slot_stats[s][1]
                else:
                    ahead = (s + self.stages - 1) % self.stages
                    self._load_row(mX, mdY, mMean, mRstd,
                                   cutlass.min(base + (s + self.stages - 1) * grid, last),
                                   tidx, xs[ahead], dys[ahead], stats, ahead)
                row = base + s * grid
                if row < rows:
                    x = x_slot.load().to(Float32)
                    g = dy_slot.load().to(Float32)
                    rstd = stats[s, 0]
                    x_hat = ((x - stats[s, 1]) * rstd if const_expr(self.layer_norm)
                             else x * rstd)
                    wdy = g * w.load() if const_expr(self.has_weight) else g
                    if const_expr(self.has_weight):
                        dw.store(dw.load() + g * x_hat)
                    if const_expr(self.has_bias):
                        db.store(db.load() + g)
                    part_a = cute.arch.warp_reduction(
                        (x_hat * wdy).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                        operator.add)
                    part_b = Float32(0.0)
                    if const_expr(self.layer_norm):
                        part_b = cute.arch.warp_reduction(
                            wdy.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), operator.add)
                    parity = s % 2
                    if lane == 0:
                        sums[warp, 0, parity] = part_a
                        sums[warp, 1, parity] = part_b
                    cute.arch.barrier()
                    sum_a = Float32(0.0)
                    sum_b = Float32(0.0)
                    for i in cutlass.range_constexpr(self.warps):
                        sum_a = sum_a + sums[i, 0, parity]
                        if const_expr(self.layer_norm):
                            sum_b = sum_b + sums[i, 1, parity]
                    if const_expr(self.layer_norm):
                        grad = (wdy - (x_hat * (sum_a * inv_n) + sum_b * inv_n)) * rstd
                    else:
                        grad = (wdy - x_hat * (sum_a * inv_n)) * rstd
                    dx.store(grad.to(self.dtype))
                    cute.autovec_copy(dx, self._thread_view(mdX[row, None], tidx))
                if const_expr(self.shared_ring):
                    # The slots refilled once the row is done with them (as the FP8 row
                    # kernel's, cute_row_norm_fp8.py: a refill racing the row's own shared
                    # loads, NOTES #133).
                    self._stage_row(copies, mX, mdY, mMean, mRstd,
                                    cutlass.min(base + (s + self.stages) * grid, last), tidx,
                                    xs[s], dys[s], slot_stats[s])
        if const_expr(self.shared_ring):
            cute.arch.cp_async_wait_group(0)  # no copy left in flight into a freed CTA

        if const_expr(self.has_weight):
            cute.autovec_copy(dw, self._thread_view(mPartial[program, 0, None], tidx))
        if const_expr(self.has_bias):
            group = 1 if const_expr(self.has_weight) else 0
            cute.autovec_copy(db, self._thread_view(mPartial[program, group, None], tidx))


