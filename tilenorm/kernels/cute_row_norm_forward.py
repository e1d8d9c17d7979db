"""Row-norm forward in the CuTe DSL: a one-shot grid of short CTAs, each loading a few whole
rows at once, then reducing and storing them.

The cuTile forward (tilenorm/kernels/cutile_row_norm.py) is a persistent loop that cannot keep
the next tile's loads in flight (bench/NOTES.md #8, #22), and a persistent CuTe loop that
does keep them (a register ring of rows, as the CuTe backward's) still stops at 92-93% of
copy bandwidth on an H100: a persistent grid never rebalances an SM that falls behind. Here
CTA ``b`` of ``ceil(rows / R)`` takes rows ``[b * R, b * R + R)``: it issues every 16-byte
load of its R rows first, then reduces and stores each row and exits, so the hardware hands
the next CTA to whichever SM frees a slot first (99.2-99.8% of copy from 512 to 16384
columns, where the persistent ring of the same body sat at 91-93%: #65).

The math is the cuTile kernel's, fp32 throughout::

    h = x + residual                      (has_residual: stored, rounded to h's dtype, and
                                           the rounded h is what is normalized)
    mu = mean(h)                          (layer_norm: stored as mean; the variance is then
                                           taken of the centered row, a second reduction)
    rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = n * w + n * offset + b            (n = (h - mu) * rstd; w, offset, b where present)

Layout: ``threads`` threads each hold ``reps`` 16-byte vectors of a row, ``threads`` vectors
apart, so every warp's load is 512 contiguous bytes. A row's sums go through a warp butterfly,
then through shared memory in warp order: a fixed summation tree, so every output is
bit-for-bit reproducible. The row count is a runtime value: it bounds only which rows a CTA
takes, so one compiled kernel serves every row count at no register cost.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from tilenorm.kernels.cute_rows import SMEM_CARVEOUT, RowKernel

#: L2 eviction policies for ``.L2::cache_hint`` loads, keyed by the L1 eviction priority they
#: go with: what ``createpolicy.fractional.L2::evict_*`` gives at fraction 1.0 (CUTLASS's
#: ``CacheHintSm90`` values), as Triton emits for an ``eviction_policy``.
_L2_POLICY = {cute.nvgpu.CacheEvictionPriority.EVICT_FIRST: 0x12F0000000000000,
              cute.nvgpu.CacheEvictionPriority.EVICT_LAST: 0x14F0000000000000}


class NormForwardKernel(RowKernel):
    """What the CuTe DSL forwards (this one and the cluster forward,
    cute_cluster_norm_forward.py) share: their dtypes and features, their operands, and the
    launch on ``grid`` CTAs (in clusters of ``cluster_dims`` where set)."""

    #: The launch's cluster shape; None: no clusters.
    cluster_dims: list[int] | None = None

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, ctas_per_sm: int,
                 layer_norm: bool, has_bias: bool, has_offset: bool, has_residual: bool):
        if (has_offset or has_bias) and weight_dtype is None:
            raise ValueError("a weight offset or a bias needs a weight (of the bias's dtype)")
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.cols = cols
        self.threads = threads
        self.vec = 128 // dtype.width
        self.ctas_per_sm = ctas_per_sm
        self.layer_norm = layer_norm
        self.has_weight = weight_dtype is not None
        self.has_bias = has_bias
        self.has_offset = has_offset
        self.has_residual = has_residual
        self.warps = threads // cute.arch.WARP_SIZE

    @cute.jit
    def __call__(self, mX: cute.Tensor, mR: cute.Tensor | None, mW: cute.Tensor | None,
                 mB: cute.Tensor | None, mY: cute.Tensor, mH: cute.Tensor | None,
                 mMean: cute.Tensor | None, mRstd: cute.Tensor, eps: Float32,
                 offset: Float32, grid: Int32, stream):
        self.kernel(mX, mR, mW, mB, mY, mH, mMean, mRstd, eps, offset).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=self.cluster_dims,
            stream=stream, max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=SMEM_CARVEOUT)


class RowNormForward(NormForwardKernel):
    """The kernel for one (dtypes, width, features, launch config); ``__call__`` launches it on
    ``grid`` CTAs of ``rows_per_cta`` rows each."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, rows_per_cta: int,
                 ctas_per_sm: int, layer_norm: bool, has_bias: bool, has_offset: bool,
                 has_residual: bool):
        super().__init__(dtype, weight_dtype, cols, threads, ctas_per_sm, layer_norm,
                         has_bias, has_offset, has_residual)
        self.reps = self._whole_vectors(cols)
        if rows_per_cta < 1:
            raise ValueError(f"rows_per_cta must be >= 1, got {rows_per_cta}")
        self.rows_per_cta = rows_per_cta

    @cute.jit
    def _row_sum(self, v, sums: cute.Tensor, slot: int, lane: Int32, warp: Int32) -> Float32:
        """The row's sum of ``v`` over every thread: a warp butterfly, then the warps' sums
        through shared memory in warp order (a fixed tree). Consecutive reductions use
        different slots, so one barrier each orders every write before its reads and every
        read before the slot's next write."""
        part = cute.arch.warp_reduction(v.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                        operator.add)
        if lane == 0:
            sums[warp, slot] = part
        cute.arch.barrier()
        total = Float32(0.0)
        for i in cutlass.range_constexpr(self.warps):
            total = total + sums[i, slot]
        return total

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor | None, mW: cute.Tensor | None,
               mB: cute.Tensor | None, mY: cute.Tensor, mH: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, eps: Float32, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        inv_n = Float32(1.0 / self.cols)
        first = cta * self.rows_per_cta

        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2)), 16)

        shape = (self.vec, self.reps)
        xs = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(self.rows_per_cta)]
        rs = [cute.make_rmem_tensor(shape, self.dtype)
              for _ in range(self.rows_per_cta if self.has_residual else 0)]
        # Every row's loads first (rows past the end clamped to the last: loaded, never used),
        # then the parameters': they are L2 hits that wait behind the rows anyway.
        for s in cutlass.range_constexpr(self.rows_per_cta):
            row = cutlass.min(first + s, last)
            cute.autovec_copy(self._thread_view(mX[row, None], tidx), xs[s])
            if const_expr(self.has_residual):
                cute.autovec_copy(self._thread_view(mR[row, None], tidx), rs[s])
        w = cute.make_rmem_tensor(shape, self.weight_dtype if self.has_weight else self.dtype)
        if const_expr(self.has_weight):
            cute.autovec_copy(self._thread_view(mW, tidx), w)
        b = cute.make_rmem_tensor(shape, w.element_type)
        if const_expr(self.has_bias):
            cute.autovec_copy(self._thread_view(mB, tidx), b)
        out = cute.make_rmem_tensor(shape, self.dtype)

        for s in cutlass.range_constexpr(self.rows_per_cta):
            row = first + s
            if row < rows:
                if const_expr(self.has_residual):
                    out.store((xs[s].load().to(Float32) + rs[s].load().to(Float32))
                              .to(self.dtype))
                    cute.autovec_copy(out, self._thread_view(mH[row, None], tidx))
                    v = out.load().to(Float32)
                else:
                    v = xs[s].load().to(Float32)
                # Slots: LayerNorm's two reductions a row take 0 and 1; RMSNorm's one
                # alternates by row.
                if const_expr(self.layer_norm):
                    mu = self._row_sum(v, sums, 0, lane, warp) * inv_n
                    v = v - mu
                    if tidx == 0:
                        mMean[row] = mu
                slot = 1 if const_expr(self.layer_norm) else s % 2
                rstd = cute.math.rsqrt(self._row_sum(v * v, sums, slot, lane, warp) * inv_n
                                       + eps)
                if tidx == 0:
                    mRstd[row] = rstd
                n = v * rstd
                y = n
                if const_expr(self.has_weight):
                    y = n * w.load().to(Float32)
                    if const_expr(self.has_offset):
                        y = y + n * offset
                if const_expr(self.has_bias):
                    y = y + b.load().to(Float32)
                out.store(y.to(self.dtype))
                cute.autovec_copy(out, self._thread_view(mY[row, None], tidx))



class TwoPassRowNormForward(RowNormForward):
    """One row a CTA, walked twice: torch.compile's schedule (bench/NOTES.md #136, #138).
    Each thread takes its 16-byte vectors of the row ``step`` at a time, so it holds few
    registers (at most 32 on sm_90a at the table's entries) and an SM many CTAs; the loops
    are unrolled, so that the first pass issues every step's load before its first sum
    (one load in flight a thread held it at 72-92% of copy, #138). The first pass loads x
    (and the residual) ``evict_last`` from L1 and L2, so that the row stays on chip, and
    sums; LayerNorm's second pass sums the centered squares from there; the last pass loads
    them ``evict_first`` with the parameters ``evict_last``, and stores y. With a residual,
    h is stored in the first pass and recomputed from L1 after it: rounding the same sum of
    the same values, the same h.

    The sums add up element-wise across steps, then through the warp butterfly and shared
    memory in warp order (:meth:`RowNormForward._row_sum`): a fixed tree, bit-for-bit
    reproducible, but another tree than the one-shot kernel's."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, step: int,
                 ctas_per_sm: int, layer_norm: bool, has_bias: bool, has_offset: bool,
                 has_residual: bool):
        super().__init__(dtype, weight_dtype, cols, threads, 1, ctas_per_sm, layer_norm,
                         has_bias, has_offset, has_residual)
        if step < 1 or self.reps % step:
            raise ValueError(f"{self.reps} vectors a thread are not whole steps of {step}")
        self.step = step

    @cute.jit
    def _steps(self, row: cute.Tensor, tidx: Int32) -> cute.Tensor:
        """This thread's vectors of ``row`` as (vec, (step, steps)): step ``c`` is
        ``[(None, (None, c))]``."""
        return cute.logical_divide(self._thread_view(row, tidx), (None, self.step))

    @cute.jit
    def _load(self, src: cute.Tensor, dst: cute.Tensor, priority):
        """``src`` (global) into ``dst`` (registers) in 16-byte loads, evicted by
        ``priority`` from L1 and L2 alike: an L2 hint keeps the row there between the passes
        and lets the last pass's lines go first (bench/NOTES.md #138: 97-99% of copy without
        it, 99-102% with it)."""
        n = 128 // src.element_type.width
        atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), src.element_type,
                                   num_bits_per_copy=128, l1c_evict_priority=priority)
        cute.copy(atom, cute.logical_divide(src, cute.make_layout(n)),
                  cute.logical_divide(dst, cute.make_layout(n)),
                  cache_policy=cutlass.Int64(_L2_POLICY[priority]))

    @cute.jit
    def _load_h(self, xs: cute.Tensor, rs: cute.Tensor | None, x: cute.Tensor,
                r: cute.Tensor | None, h: cute.Tensor, c: Int32, priority):
        """Step ``c`` of h in fp32: x, or x + residual rounded to x's dtype (left in ``h``
        too); loaded with the L1 eviction ``priority``."""
        self._load(xs[(None, (None, c))], x, priority)
        v = x.load().to(Float32)
        if const_expr(self.has_residual):
            self._load(rs[(None, (None, c))], r, priority)
            h.store((v + r.load().to(Float32)).to(self.dtype))
            v = h.load().to(Float32)
        return v

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor | None, mW: cute.Tensor | None,
               mB: cute.Tensor | None, mY: cute.Tensor, mH: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, eps: Float32, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        inv_n = Float32(1.0 / self.cols)
        keep = cute.nvgpu.CacheEvictionPriority.EVICT_LAST
        last_use = cute.nvgpu.CacheEvictionPriority.EVICT_FIRST
        steps = self.reps // self.step

        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2)), 16)

        chunk = (self.vec, self.step)
        xs = self._steps(mX[row, None], tidx)
        ys = self._steps(mY[row, None], tidx)
        rs = self._steps(mR[row, None], tidx) if const_expr(self.has_residual) else None
        hs = self._steps(mH[row, None], tidx) if const_expr(self.has_residual) else None
        x = cute.make_rmem_tensor(chunk, self.dtype)
        r = cute.make_rmem_tensor(chunk, self.dtype) if const_expr(self.has_residual) else None
        h = cute.make_rmem_tensor(chunk, self.dtype)
        acc = cute.make_rmem_tensor(chunk, Float32)

        acc.fill(0.0)
        for c in cutlass.range(steps, unroll_full=True):
            v = self._load_h(xs, rs, x, r, h, c, keep)
            if const_expr(self.has_residual):
                cute.autovec_copy(h, hs[(None, (None, c))])
            if const_expr(self.layer_norm):
                acc.store(acc.load() + v)
            else:
                acc.store(acc.load() + v * v)
        mu = Float32(0.0)
        if const_expr(self.layer_norm):
            mu = self._row_sum(acc.load(), sums, 0, lane, warp) * inv_n
            if tidx == 0:
                mMean[row] = mu
            acc.fill(0.0)
            for c in cutlass.range(steps, unroll_full=True):
                v = self._load_h(xs, rs, x, r, h, c, keep) - mu
                acc.store(acc.load() + v * v)
        rstd = cute.math.rsqrt(self._row_sum(acc.load(), sums, 1, lane, warp) * inv_n + eps)
        if tidx == 0:
            mRstd[row] = rstd

        ws = self._steps(mW, tidx) if const_expr(self.has_weight) else None
        bs = self._steps(mB, tidx) if const_expr(self.has_bias) else None
        w = cute.make_rmem_tensor(chunk, self.weight_dtype if self.has_weight else self.dtype)
        b = cute.make_rmem_tensor(chunk, w.element_type)
        out = cute.make_rmem_tensor(chunk, self.dtype)
        for c in cutlass.range(steps, unroll_full=True):
            v = self._load_h(xs, rs, x, r, h, c, last_use)
            if const_expr(self.layer_norm):
                v = v - mu
            n = v * rstd
            y = n
            if const_expr(self.has_weight):
                self._load(ws[(None, (None, c))], w, keep)
                y = n * w.load().to(Float32)
                if const_expr(self.has_offset):
                    y = y + n * offset
            if const_expr(self.has_bias):
                self._load(bs[(None, (None, c))], b, keep)
                y = y + b.load().to(Float32)
            out.store(y.to(self.dtype))
            cute.autovec_copy(out, ys[(None, (None, c))])
