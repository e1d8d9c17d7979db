"""RMSNorm and LayerNorm backward in the CuTe DSL for rows too wide for one CTA: a cluster
of CTAs holds a row, reading x and dy once (issue 20). From 32768 columns the other backwards
read every row twice (the two-pass bound, 3/5 of copy bandwidth); through the op the RMSNorm
backward runs at 94% of copy at 2048 x 65536 and 86-87% at 1024 x 131072 on an H100 (bench/
NOTES.md #79, #81).

Math (fp32), the mean and rstd as the forward saved them: ``xhat = (x - mean) * rstd``
(RMSNorm: ``x * rstd``), ``g = dy * (w + offset)``, ``c = sum_row(g * xhat) / N``,
``b = sum_row(g) / N`` (LayerNorm only), ``dx = rstd * (g - (xhat * c + b)) (+ dres_in)``
(RMSNorm: ``rstd * (g - xhat * c)``), computed as ``g * rstd - ((x - mean) * (c * rstd *
rstd) + b * rstd)``; ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)``.

Layout (:class:`ClusterRowNormBackward`): a cluster of ``cluster`` CTAs holds a row, CTA
``r`` columns ``[r * N / C, (r + 1) * N / C)``, each thread ``reps`` 16-byte vectors
``threads`` vectors apart. Persistent over rows: cluster ``k`` of ``clusters`` takes rows
``k, k + clusters, ...``, a static assignment, so dweight sums the same rows in the same
order on every run.

Per row, per CTA:

- x and dy (and dres_in) of the row were staged in shared memory by 16-byte ``cp.async``
  (``stages`` row buffers: with ``stages`` >= 2 the copies of row ``i + stages - 1`` are
  issued before row ``i`` is waited on; with 1, the next row's copies are issued once this
  row's last read is done, and other CTAs of the SM cover the gap). A thread reads back only
  the vectors it copied, so ``cp.async.wait_group`` alone orders the staging: no block
  barrier in the row loop. With ``stage_stats`` each thread stages its own copy of the
  row's rstd (and mean) beside them by a 4-byte ``cp.async``, where the kernel otherwise
  loads them right before their first use and waits a memory latency a row (bench/NOTES.md
  #132).
- pass 1 (shared memory -> registers, a vector at a time): the thread's partials of
  ``sum(g * xhat)`` (and LayerNorm's ``sum(g)``) in vector order, and ``dweight += dy *
  xhat`` (``dbias += dy``) into fp32 registers (the CTA's slices of dweight and dbias live
  in its threads' registers across all its rows);
- the row sums cross the cluster by push (:meth:`ClusterRowKernel._push_sums_lanes`,
  cute_cluster_rows.py): warp ``w`` of CTA ``r`` ``st.async``-es its warp sums into slot
  ``r * warps + w`` of every CTA (lane ``l`` to CTA ``l``), counted by that CTA's mbarrier
  (armed for ``sums * warps * C * 4`` bytes: LayerNorm's two sums are pushed together);
  each warp then adds the slots across its lanes in a fixed tree (a lane a run of adjacent
  slots, then a butterfly), so every CTA of the cluster (and every rerun) has the same bits
  of ``c`` (and ``b``);
- pass 2 (shared memory again): dx, stored from registers (16-byte stores), with the
  gradient that reached h through a fused residual add (``dres_in``) added in fp32.

The reduction slots and mbarriers rotate over ``max(2, stages)`` rows (the row loop is
unrolled that far, so buffer and slot indices are compile-time). Two slots suffice with no
"empty" barrier: a CTA pushes row ``i + 2`` into a slot only after its own wait for row
``i + 1`` completed, which needs every warp of every peer to have pushed row ``i + 1``, which
each warp does only after its wait for row ``i`` and its reads of row ``i``'s slot (and the
``complete_tx`` the push performs is a release at cluster scope). For the same reason an
mbarrier cannot be re-armed before its previous phase completed. Each slot's phase flips
every trip of the unrolled loop.

One relaxed cluster arrive at entry (its wait before the first push: every peer's mbarriers
initialised); one full cluster barrier at the end, once per CTA, not per row (no CTA exits
while a peer's ``st.async`` to it may be in flight, or while it may still push to a peer).

dweight and dbias: at the end each CTA writes its fp32 slices to ``partial[cluster, group,
cols]`` (clusters x groups x N, dweight's group first; no atomics, no M x N temporary), which
tilenorm's fixed-order ``column_sums`` (cutile_column_sums.py) reduces. The grid is as many
clusters as are co-resident (:func:`tilenorm.device.max_active_clusters`): a persistent grid
larger than that would run its last clusters after the others.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from tilenorm.kernels.cute_cluster_rows import PARTIAL_BYTES, ClusterRowKernel
from tilenorm.kernels.cute_rows import SMEM_CARVEOUT, ring_copies


class ClusterRowNormBackward(ClusterRowKernel):
    """RMSNorm or LayerNorm (``layer_norm``) backward of bf16 / fp16 rows, one row a cluster
    of ``cluster`` CTAs at a time, persistent over rows; dweight's and dbias's per-cluster
    sums into the partial buffer. The weight is in x's dtype or fp32 (or absent: g = dy, no
    dweight); ``has_bias`` adds dbias's group; ``has_offset`` adds the launch's ``offset`` to
    the weight (Gemma's ``1 + w``); ``has_dres_in`` adds ``dres_in`` to dx; ``stage_stats``
    stages each row's rstd (and mean) with the row (the module docstring)."""

    def __init__(self, dtype, weight_dtype, cols: int, cluster: int, threads: int,
                 stages: int, ctas_per_sm: int, layer_norm: bool = False,
                 has_bias: bool = False, has_offset: bool = False, has_dres_in: bool = False,
                 stage_stats: bool = False):
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.has_weight = weight_dtype is not None
        self.cols = cols
        self.threads = threads
        self.vec = 128 // dtype.width
        self.warps = threads // cute.arch.WARP_SIZE
        self._split_row(cluster)
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        if has_offset and not self.has_weight:
            raise ValueError("a weight offset needs a weight")
        if self.warps < cluster:
            raise ValueError("a warp's lanes push to the peers: need warps >= cluster")
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.layer_norm = layer_norm
        self.has_bias = has_bias
        self.has_offset = has_offset
        self.has_dres_in = has_dres_in
        self.stage_stats = stage_stats
        #: Row statistics a thread stages with ``stage_stats``: rstd, and LayerNorm's mean.
        self.stats = 2 if layer_norm else 1
        #: Row sums pushed across the cluster: sum(g * xhat), and LayerNorm's sum(g).
        self.sums = 2 if layer_norm else 1
        #: Gradient groups in the partial buffer: dweight and/or dbias.
        self.groups = int(self.has_weight) + int(has_bias)
        #: Rows the loop body is unrolled over: buffer (``% stages``) and reduction slot
        #: indices are compile-time, and at least two slots rotate.
        self.unroll = max(2, stages)

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: the x and dy (and dres_in) row buffers,
        with ``stage_stats`` each thread's rstd (and mean) of each buffered row, the
        reduction slots, the mbarriers (each aligned as allocated)."""
        rows = (2 + self.has_dres_in) * self.stages * self.slice * self.dtype.width // 8
        stats = self.stage_stats * self.threads * self.stages * self.stats * 4
        return (-(-rows // 128) * 128 + -(-stats // 16) * 16
                + self.slot_bytes(self.sums * self.unroll) + 8 * self.unroll)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor | None,
                 mMean: cute.Tensor | None, mRstd: cute.Tensor, mdResIn: cute.Tensor | None,
                 mdX: cute.Tensor, mPartial: cute.Tensor | None, offset: Float32, grid: Int32,
                 stream):
        self.kernel(mX, mdY, mW, mMean, mRstd, mdResIn, mdX, mPartial, offset).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
            stream=stream, max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=SMEM_CARVEOUT)

    @cute.jit
    def _stage(self, copies: tuple, sources: list, buffers: list, stats: list, row: Int32,
               rows: Int32, buf: int, rank: Int32, tidx: Int32):
        """This thread's vectors of ``row`` of each of ``sources`` (x, dy and dres_in) into
        buffer ``buf`` of its shared-memory buffers and, with ``stage_stats``, the row's
        value of each of ``stats`` ((rstd, its slots) and LayerNorm's (mean, its slots))
        into this thread's slot of the buffer (nothing past the last row), committed as one
        group: every call commits exactly one, so that ``wait_group`` counts rows."""
        if row < rows:
            for source, staged in zip(sources, buffers, strict=True):
                cute.copy(copies[0], self._slice_view(source[row, None], rank, tidx),
                          self._thread_view(staged[None, buf], tidx))
            for source, slots in stats:
                cute.copy(copies[1], cute.make_tensor(source.iterator + row,
                                                      cute.make_layout((1,))),
                          cute.make_tensor(slots.iterator + (tidx + self.threads * buf),
                                           cute.make_layout((1,))))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _scale(self, dy, w: cute.Tensor | None, k: int, offset: Float32):
        """``dy * (w + offset)`` of this thread's vector ``k`` (the weight held in
        registers); ``dy`` without a weight."""
        if const_expr(not self.has_weight):
            return dy
        scale = w[None, k].load().to(Float32)
        if const_expr(self.has_offset):
            scale = scale + offset
        return dy * scale

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, mdResIn: cute.Tensor | None,
               mdX: cute.Tensor, mPartial: cute.Tensor | None, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        rank = cute.arch.block_in_cluster_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        first = bidx // self.cluster
        clusters = gdim // self.cluster
        stages, unroll, slots = self.stages, self.unroll, self.cluster * self.warps
        inv_n = Float32(1.0 / self.cols)

        smem = cutlass.memory.SmemAllocator()
        # (column, buffer, operand): x, dy (and dres_in) of ``stages`` rows, one base address.
        operands = 2 + self.has_dres_in
        staged = smem.allocate_tensor(
            self.dtype, cute.make_layout((self.slice, stages, operands)), 128)
        s_x, s_dy = staged[None, None, 0], staged[None, None, 1]
        sources, buffers = [mX, mdY], [s_x, s_dy]
        s_dres = None
        if const_expr(self.has_dres_in):
            # Staged like x and dy: in registers across the row sum, it spills at 131072.
            s_dres = staged[None, None, 2]
            sources.append(mdResIn)
            buffers.append(s_dres)
        # stage_stats: (thread, buffer) of rstd (and mean), each thread its own copy, so that
        # its wait_group orders them as it orders its vectors.
        stats, s_rstd, s_mean = [], None, None
        if const_expr(self.stage_stats):
            s_rstd = smem.allocate_tensor(Float32, cute.make_layout((self.threads, stages)), 16)
            stats.append((mRstd, s_rstd))
            if const_expr(self.layer_norm):
                s_mean = smem.allocate_tensor(Float32,
                                              cute.make_layout((self.threads, stages)), 16)
                stats.append((mMean, s_mean))
        # (slot, sum, row of the unrolled loop): slot r * warps + w holds warp w's partial
        # from cluster CTA r.
        parts = smem.allocate_tensor(Float32, cute.make_layout((slots, self.sums, unroll)),
                                     16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((unroll,)), 8)
        if tidx == 0:
            for s in cutlass.range_constexpr(unroll):
                cute.arch.mbarrier_init(mbar.iterator + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        # x and dy by ``.cg`` (read once, past L1), rstd and mean by ``.ca``.
        copies = ring_copies(self.dtype)
        # The first rows' copies in flight before anything else.
        for j in cutlass.range_constexpr(max(stages - 1, 1)):
            self._stage(copies, sources, buffers, stats, first + j * clusters, rows, j, rank,
                        tidx)

        shape = (self.vec, self.reps)
        w = None
        if const_expr(self.has_weight):
            w = cute.make_rmem_tensor(shape, self.weight_dtype)
            cute.autovec_copy(self._slice_view(mW, rank, tidx), w)
        dw = cute.make_rmem_tensor(shape, Float32)
        dw.fill(0.0)
        db = cute.make_rmem_tensor(shape, Float32)
        db.fill(0.0)
        x_v = cute.make_rmem_tensor((self.vec,), self.dtype)
        dy_v = cute.make_rmem_tensor((self.vec,), self.dtype)
        dx_v = cute.make_rmem_tensor((self.vec,), self.dtype)
        dres_v = cute.make_rmem_tensor((self.vec,), self.dtype)

        # This cluster's rows, in trips of ``unroll``.
        mine = (rows - first + clusters - 1) // clusters
        trips = (mine + unroll - 1) // unroll
        cute.arch.cluster_wait()  # every peer's mbarriers initialised
        for trip in cutlass.range(0, trips, 1):
            phase = trip % 2
            for s in cutlass.range_constexpr(unroll):
                row = first + (trip * unroll + s) * clusters
                buf = s % stages
                if const_expr(stages > 1):
                    # Row i + stages - 1 into the buffer row i - 1 freed.
                    self._stage(copies, sources, buffers, stats, row + (stages - 1) * clusters,
                                rows, (s + stages - 1) % stages, rank, tidx)
                if row < rows:
                    if const_expr(not self.stage_stats):
                        rstd = mRstd[row]
                        mean = mMean[row] if const_expr(self.layer_norm) else Float32(0.0)
                    cute.arch.cp_async_wait_group(stages - 1 if stages > 1 else 0)
                    if const_expr(self.stage_stats):
                        rstd = s_rstd[tidx, buf]
                        mean = s_mean[tidx, buf] if const_expr(self.layer_norm) else Float32(0.0)
                    t_x = self._thread_view(s_x[None, buf], tidx)
                    t_dy = self._thread_view(s_dy[None, buf], tidx)
                    # Pass 1: this thread's parts of sum(g * xhat) (and sum(g)), vectors in
                    # order, and dweight (and dbias).
                    part_a = Float32(0.0)
                    part_b = Float32(0.0)
                    for k in cutlass.range_constexpr(self.reps):
                        cute.autovec_copy(t_x[None, k], x_v)
                        cute.autovec_copy(t_dy[None, k], dy_v)
                        x = self._widen(x_v)
                        x_hat = (x - mean) * rstd if const_expr(self.layer_norm) else x * rstd
                        dy = self._widen(dy_v)
                        g = self._scale(dy, w, k, offset)
                        part_a = part_a + (g * x_hat).reduce(cute.ReductionOp.ADD,
                                                             Float32(0.0), 0)
                        if const_expr(self.layer_norm):
                            part_b = part_b + g.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        if const_expr(self.has_weight):
                            dw[None, k].store(dw[None, k].load() + dy * x_hat)
                        if const_expr(self.has_bias):
                            db[None, k].store(db[None, k].load() + dy)
                    # Both sums into slot (rank, warp) of every CTA of the cluster.
                    mbar_s = mbar.iterator + s
                    if tidx == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(
                            mbar_s, self.sums * slots * PARTIAL_BYTES)
                    totals = self._push_sums_lanes([part_a, part_b][:self.sums],
                                                   parts[None, None, s], mbar_s, phase, rank,
                                                   lane, warp)
                    # The slots' reads before any later st.async into them (async proxy);
                    # the warp's sync orders every lane's reads before the lanes below
                    # cluster push the next row (a shuffle alone orders no memory).
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_warp()
                    # dx = rstd * (g - (xhat * c + b)) with rstd taken into the row's
                    # constants: rstd * g - ((x - mean) * c rstd^2 + b rstd), a multiply an
                    # element fewer (bench/NOTES.md #119).
                    c = totals[0] * inv_n * rstd * rstd
                    b = totals[1] * inv_n * rstd if const_expr(self.layer_norm) else Float32(0.0)
                    # Pass 2: dx from shared memory again.
                    t_dx = self._slice_view(mdX[row, None], rank, tidx)
                    t_dres = None
                    if const_expr(self.has_dres_in):
                        t_dres = self._thread_view(s_dres[None, buf], tidx)
                    for k in cutlass.range_constexpr(self.reps):
                        cute.autovec_copy(t_x[None, k], x_v)
                        cute.autovec_copy(t_dy[None, k], dy_v)
                        x = self._widen(x_v)
                        g = self._scale(self._widen(dy_v), w, k, offset)
                        if const_expr(self.layer_norm):
                            grad = g * rstd - ((x - mean) * c + b)
                        else:
                            grad = g * rstd - x * c
                        if const_expr(self.has_dres_in):
                            cute.autovec_copy(t_dres[None, k], dres_v)
                            grad = grad + self._widen(dres_v)
                        dx_v.store(grad.to(self.dtype))
                        cute.autovec_copy(dx_v, t_dx[None, k])
                if const_expr(stages == 1):
                    # Buffer 0 is free once this thread's reads of it are done.
                    self._stage(copies, sources, buffers, stats, row + clusters, rows, 0, rank,
                                tidx)

        cute.arch.cp_async_wait_group(0)
        if const_expr(self.has_weight):
            cute.autovec_copy(dw, self._slice_view(mPartial[first, 0, None], rank, tidx))
        if const_expr(self.has_bias):
            group = 1 if const_expr(self.has_weight) else 0
            cute.autovec_copy(db, self._slice_view(mPartial[first, group, None], rank, tidx))
        # No CTA exits while a peer's push to it may be in flight.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
