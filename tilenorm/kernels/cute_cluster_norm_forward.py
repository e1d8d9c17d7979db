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
- Each row sum is reduced by a warp butterfly, then every warp's partial is pushed with
  ``st.async`` into slot ``rank * warps + warp`` of every cluster CTA's shared memory,
  counted by that CTA's mbarrier (armed for ``cluster * warps * 4`` bytes). Every thread
  then adds the slots in rank order, each rank's warps in warp order: every CTA of the
  cluster, and every rerun, gets the same bits of the row's sum.
- One relaxed cluster arrive at entry, its wait just before the first remote store, so
  every peer's mbarriers are initialised before anything lands in them. No trailing cluster
  barrier: a CTA reads only its own shared memory, after its mbarrier has counted every
  peer's bytes, so no peer exits while a store into it is outstanding.

The math is RowNormForward's, fp32 throughout (LayerNorm's variance of the centered row: a
second cluster reduction, with its own slots and mbarrier, so that a fast peer's second
partial never counts toward this CTA's first)::

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
        #: Cluster reductions a row: LayerNorm's mean and variance, RMSNorm's sum of squares.
        self.reductions = 2 if layer_norm else 1

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: x's slice (and the residual's), the
        partial slots, the mbarriers (each aligned as allocated)."""
        staged = self.slice * self.dtype.width // 8 * (2 if self.has_residual else 1)
        return staged + self.slot_bytes(self.reductions) + 8 * self.reductions

    @cute.jit
    def _cluster_sum(self, part: Float32, parts: cute.Tensor, mbar: cute.Tensor,
                     reduction: int, rank: Int32, lane: Int32, warp: Int32) -> Float32:
        """The row's sum of every thread's ``part`` over the cluster, in reduction
        ``reduction``'s slots and mbarrier (each used once: phase 0)."""
        if const_expr(reduction == 0):
            cute.arch.cluster_wait()  # every peer's mbarriers initialised
        total, = self._push_sums([part], parts[None, None, reduction],
                                 mbar.iterator + reduction, 0, rank, lane, warp)
        return total

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
        # (slot, sum, reduction): reduction j's slot r * warps + w holds warp w's partial
        # from cluster CTA r.
        parts = smem.allocate_tensor(
            Float32, cute.make_layout((self.cluster * self.warps, 1, self.reductions)), 16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((self.reductions,)), 8)
        if tidx == 0:
            for j in cutlass.range_constexpr(self.reductions):
                cute.arch.mbarrier_init(mbar.iterator + j, 1)
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
            for j in cutlass.range_constexpr(self.reductions):
                cute.arch.mbarrier_arrive_and_expect_tx(
                    mbar.iterator + j, self.cluster * self.warps * PARTIAL_BYTES)
        cute.arch.cp_async_wait_group(0)

        # First pass, a vector at a time in a fixed order: h = x + residual (rounded, stored,
        # and written over x's slice for the passes that follow), then the row's first sum.
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
        total = self._cluster_sum(part, parts, mbar, 0, rank, lane, warp)
        mu = Float32(0.0)
        if const_expr(self.layer_norm):
            # The variance of the centered row: h read again, a second cluster reduction.
            mu = total * inv_n
            part = Float32(0.0)
            for k in cutlass.range_constexpr(self.reps):
                cute.autovec_copy(t_x[None, k], v)
                c = v.load().to(Float32) - mu
                part = part + (c * c).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            total = self._cluster_sum(part, parts, mbar, 1, rank, lane, warp)
        rstd = cute.math.rsqrt(total * inv_n + eps)
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
