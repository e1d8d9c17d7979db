"""Row-norm forward in the CuTe DSL for rows too wide for one CTA: each row held across a
cluster of ``cluster`` CTAs, each reading its slice of the row once.

One CTA holds at most ~32768 columns of a row (RowNormForward, cute_row_norm_forward.py: the
whole row and its parameters in registers); past that cuTile's chunked forward reads every
row twice, at ~66% of copy bandwidth (bench/NOTES.md #65). Here cluster CTA ``r`` of row
``b`` (CTA ``b * cluster + r`` of a one-shot grid of ``rows * cluster``) takes columns
``[r * N / cluster, (r + 1) * N / cluster)``: Quack's recipe (#66) at 16384 columns a CTA of
256 threads, 4 CTAs an SM; through the op on an H100 RMSNorm runs at 100% of copy at 65536
and 97% at 131072 (#79), LayerNorm at 94% at 65536 (#83):

- x's slice (and the residual's) is staged in shared memory by 16-byte ``cp.async``, one
  group, and read from there for every pass; a thread reads back only the vectors it copied,
  so ``cp.async.wait_group 0`` alone orders them (no block barrier). x lives in registers a
  vector at a time, which is what keeps the 64 registers of 4 CTAs an SM from spilling. With
  a residual a CTA stages 64 KiB, so 3 CTAs an SM fit in the 228 KB of shared memory.
- One cluster exchange a row, for both ops. Each warp reduces its values by a warp
  butterfly and pushes them with ``st.async`` into slot ``rank * warps + warp`` of every
  cluster CTA's shared memory, counted by that CTA's one mbarrier (armed for ``sums *
  cluster * warps * 4`` bytes). RMSNorm's one value is the warp's sum of squares; every
  thread adds the slots in rank order, each rank's warps in warp order. LayerNorm's are a
  pair, the warp's sum and the sum of its elements' squares about its own mean (its
  elements of h read twice from shared memory before the push); every thread combines the
  pairs in that same fixed order by Chan et al.'s parallel formula
  (:meth:`ClusterRowNormForward._row_moments`). Either way every CTA of the cluster, and
  every rerun, gets the same bits of the row's statistics. LayerNorm took two exchanges
  before (the mean, then the centered row's variance), each a round trip through
  distributed shared memory, where it ran at 85-92% of copy at 32768-131072 columns
  against RMSNorm's 100-101% (#87); the one-exchange kernel is not timed yet.
- One relaxed cluster arrive at entry, its wait just before the first remote store, so
  every peer's mbarrier is initialised before anything lands in it. No trailing cluster
  barrier: a CTA reads only its own shared memory, after its mbarrier has counted every
  peer's bytes, so no peer exits while a store into it is outstanding.

The math is RowNormForward's, fp32 throughout (LayerNorm's variance is of centered values,
as there, though centered on each warp's mean and combined)::

    h = x + residual       (stored, rounded to x's dtype; the rounded h is normalized)
    mu = mean(h)           (layer_norm)
    rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = n * w + n * offset + b            (n = (h - mu) * rstd)

The weight in x's dtype is held in registers, its loads issued while the copies fly (the
probe's recipe, #75); an fp32 weight (twice the registers) and the bias are read a vector at
a time where they are used (L2 hits), which keeps every variant within the 64 registers
without a spill (cuobjdump of the sm_90a cubins, tests/test_cute_forward.py). #75 timed
RMSNorm with a weight in x's dtype; the other variants are not timed yet.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from tilenorm.kernels.cute_cluster_rows import PARTIAL_BYTES, ClusterRowKernel
from tilenorm.kernels.cute_row_norm_forward import NormForwardKernel


class ClusterRowNormForward(NormForwardKernel, ClusterRowKernel):
    """The kernel for one (dtypes, width, features, cluster, launch config); ``__call__``
    launches it on ``grid`` = rows x ``cluster`` CTAs, one row a cluster."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, cluster: int,
                 ctas_per_sm: int, layer_norm: bool, has_bias: bool, has_offset: bool,
                 has_residual: bool):
        super().__init__(dtype, weight_dtype, cols, threads, ctas_per_sm, layer_norm,
                         has_bias, has_offset, has_residual)
        self._split_row(cluster)
        self.cluster_dims = [cluster, 1, 1]
        #: The weight held in registers: a 2-byte one only, as x's (the module's docstring).
        self.hold_weight = self.has_weight and weight_dtype.width == dtype.width
        #: Values each warp pushes in the row's one cluster exchange: LayerNorm's sum of its
        #: elements and the sum of their squares about its own mean, RMSNorm's sum of squares.
        self.sums = 2 if layer_norm else 1
        #: Elements of a row each warp holds: 32 lanes of ``reps`` vectors, the same count for
        #: every warp (``_thread_view``).
        self.warp_cols = cute.arch.WARP_SIZE * self.vec * self.reps

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: x's slice (and the residual's), the
        partial slots, the mbarrier (each aligned as allocated)."""
        staged = self.slice * self.dtype.width // 8 * (2 if self.has_residual else 1)
        return staged + self.slot_bytes(self.sums) + 8

    @cute.jit
    def _row_moments(self, part: Float32, t_x: cute.Tensor, v: cute.Tensor,
                     slots: cute.Tensor, mbar, rank: Int32, lane: Int32,
                     warp: Int32) -> tuple[Float32, Float32]:
        """LayerNorm's mean and variance of the row in one cluster exchange (``part``: this
        thread's sum of its elements; ``t_x`` its elements of h in shared memory, read again
        a vector at a time through ``v``). Each warp takes its own mean, then the sum of its
        elements' squares about it, and pushes the pair (sum, centered sum of squares) to
        every cluster CTA (the slots and mbarrier used once: phase 0). Every thread then
        combines the pairs in one fixed tree (:meth:`_fixed_order_sum`) by Chan et al.'s
        parallel formula, every warp holding ``warp_cols`` = n_w of the N elements::

            mean = sum_i(sum_i) / N
            M2 = sum_i(M2_i + n_w * (sum_i / n_w - mean)^2)

        Every sum of squares is of centered values: no E[h^2] - E[h]^2 cancellation (the
        large-mean test, tests/test_cute_forward.py). The combine takes warp i's mean as the
        same product of the same bits the warp centered on. Where that mean is not the
        warp's exact mean, M2 errs by 2 * n_w * (the difference) * (mean_i - mean); with
        16-bit h there is no difference where it would count: the values of a row of large
        mean against its spread lie on one coarse grid, so a warp's fp32 sum is exact, and
        so is its mean with n_w a power of two (2048 at the settings' 16384-column slices
        of 256 threads)."""
        inv_warp_n = Float32(1.0 / self.warp_cols)
        warp_sum = cute.arch.warp_reduction(part, operator.add)
        warp_mean = warp_sum * inv_warp_n
        # A compiler fence for shared memory: without it the compiler holds the first pass's
        # vectors in registers for this one, which spills (cuobjdump, sm_90a); h is read
        # again from shared memory instead.
        cute.arch.sync_warp()
        part = Float32(0.0)
        for k in cutlass.range_constexpr(self.reps):
            cute.autovec_copy(t_x[None, k], v)
            c = v.load().to(Float32) - warp_mean
            part = part + (c * c).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        cute.arch.cluster_wait()  # every peer's mbarrier initialised
        self._push_warp_values([warp_sum, cute.arch.warp_reduction(part, operator.add)],
                               slots, mbar, 0, rank, lane, warp)
        mean = self._fixed_order_sum(lambda i: slots[i, 0]) * Float32(1.0 / self.cols)
        # The same fence: the sums read again rather than all 2 * cluster * warps values
        # held across the mean (which spills at clusters of 4 and 8).
        cute.arch.sync_warp()
        m2 = self._fixed_order_sum(
            lambda i: self._about_row_mean(slots, i, mean, inv_warp_n))
        return mean, m2 * Float32(1.0 / self.cols)

    def _about_row_mean(self, slots: cute.Tensor, slot: int, mean: Float32,
                        inv_warp_n: Float32) -> Float32:
        """A warp's sum of squares about the row's mean, from its pair in ``slot``:
        M2_i + n_w * (mean_i - mean)^2."""
        spread = slots[slot, 0] * inv_warp_n - mean
        return slots[slot, 1] + Float32(self.warp_cols) * spread * spread

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor | None, mW: cute.Tensor | None,
               mB: cute.Tensor | None, mY: cute.Tensor, mH: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, eps: Float32, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_in_cluster_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = cta // self.cluster
        inv_n = Float32(1.0 / self.cols)

        smem = cutlass.memory.SmemAllocator()
        s_x = smem.allocate_tensor(self.dtype, cute.make_layout((self.slice,)), 128)
        s_r = (smem.allocate_tensor(self.dtype, cute.make_layout((self.slice,)), 128)
               if const_expr(self.has_residual) else None)
        # (slot, value): slot r * warps + w holds warp w's values from cluster CTA r.
        parts = smem.allocate_tensor(
            Float32, cute.make_layout((self.cluster * self.warps, self.sums)), 16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((1,)), 8)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar.iterator, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        # x's (and the residual's) slice to shared memory: 16-byte cp.async, one group.
        # ``.ca``, Quack's (#75 timed ``.cg`` no faster).
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS),
                                  self.dtype, num_bits_per_copy=128)
        t_x = self._thread_view(s_x, tidx)
        cute.copy(g2s, self._slice_view(mX[row, None], rank, tidx), t_x)
        if const_expr(self.has_residual):
            cute.copy(g2s, self._slice_view(mR[row, None], rank, tidx),
                      self._thread_view(s_r, tidx))
        cute.arch.cp_async_commit_group()
        # The weight into registers while the copies fly.
        shape = (self.vec, self.reps)
        w_view = self._slice_view(mW, rank, tidx) if const_expr(self.has_weight) else None
        w_held = (cute.make_rmem_tensor(shape, self.weight_dtype)
                  if const_expr(self.hold_weight) else None)
        if const_expr(self.hold_weight):
            cute.autovec_copy(w_view, w_held)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(
                mbar.iterator, self.sums * self.cluster * self.warps * PARTIAL_BYTES)
        cute.arch.cp_async_wait_group(0)

        # First pass, a vector at a time in a fixed order: h = x + residual (rounded, stored,
        # and written over x's slice for the passes that follow), then this thread's part of
        # the row's sum (LayerNorm) or sum of squares (RMSNorm).
        v = cute.make_rmem_tensor((self.vec,), self.dtype)
        part = Float32(0.0)
        for k in cutlass.range_constexpr(self.reps):
            cute.autovec_copy(t_x[None, k], v)
            if const_expr(self.has_residual):
                r_v = cute.make_rmem_tensor((self.vec,), self.dtype)
                cute.autovec_copy(self._thread_view(s_r, tidx)[None, k], r_v)
                v.store((v.load().to(Float32) + r_v.load().to(Float32)).to(self.dtype))
                cute.autovec_copy(v, t_x[None, k])
                cute.autovec_copy(v, self._slice_view(mH[row, None], rank, tidx)[None, k])
            h = v.load().to(Float32)
            part = part + ((h if const_expr(self.layer_norm) else h * h)
                           .reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
        # The row's statistics, one cluster exchange (slots and mbarrier used once: phase 0).
        if const_expr(self.layer_norm):
            mu, mean_square = self._row_moments(part, t_x, v, parts, mbar.iterator, rank,
                                                lane, warp)
        else:
            cute.arch.cluster_wait()  # every peer's mbarrier initialised
            total, = self._push_sums([part], parts, mbar.iterator, 0, rank, lane, warp)
            mu, mean_square = Float32(0.0), total * inv_n
        rstd = cute.math.rsqrt(mean_square + eps)
        if rank == 0 and tidx == 0:
            if const_expr(self.layer_norm):
                mMean[row] = mu
            mRstd[row] = rstd

        # h read again, normalized, scaled and stored a vector at a time.
        t_y = self._slice_view(mY[row, None], rank, tidx)
        b_view = self._slice_view(mB, rank, tidx) if const_expr(self.has_bias) else None
        param = cute.make_rmem_tensor((self.vec,), self.weight_dtype if self.has_weight
                                      else self.dtype)
        out = cute.make_rmem_tensor((self.vec,), self.dtype)
        for k in cutlass.range_constexpr(self.reps):
            cute.autovec_copy(t_x[None, k], v)
            h = v.load().to(Float32)
            n = (h - mu if const_expr(self.layer_norm) else h) * rstd
            y = n
            if const_expr(self.has_weight):
                if const_expr(self.hold_weight):
                    w = w_held[None, k].load().to(Float32)
                else:
                    cute.autovec_copy(w_view[None, k], param)
                    w = param.load().to(Float32)
                y = n * w
                if const_expr(self.has_offset):
                    y = y + n * offset
            if const_expr(self.has_bias):
                cute.autovec_copy(b_view[None, k], param)
                y = y + param.load().to(Float32)
            out.store(y.to(self.dtype))
            cute.autovec_copy(out, t_y[None, k])
