"""Row-norm forward in the CuTe DSL for rows too wide for one CTA: each row held across a
cluster of ``cluster`` CTAs, each reading its slice of the row once.

One CTA holds at most ~32768 columns of a row (RowNormForward, cute_row_norm_forward.py: the
whole row and its parameters in registers); past that cuTile's chunked forward reads every
row twice, at ~66% of copy bandwidth (bench/NOTES.md #65). Here cluster CTA ``r`` of group
``b`` (CTA ``b * cluster + r`` of a one-shot grid of ``ceil(rows / R) * cluster``) takes
columns ``[r * N / cluster, (r + 1) * N / cluster)`` of each of the group's ``R`` =
``rows_per_cta`` rows: Quack's recipe (#66) at one row, 16384 columns a CTA of 256 threads,
4 CTAs an SM; through the op on an H100 RMSNorm runs at 100% of copy at 65536 and 97% at
131072 (#79), LayerNorm with fp32 parameters at 92 / 92 / 86% at 32768 / 65536 / 131072
(#89). Parameters not held in registers (fp32 ones, the bias) are read from L2 for every
row of one row a CTA, 8 bytes a column against x's 2 (#89): with R rows a CTA each vector
of them is read once for the R rows.

- x's slices (and the residual's) are staged in shared memory by 16-byte ``cp.async``, one group,
  and read from there for every pass; a group's rows past the end are clamped to the last row,
  loaded and reduced (every CTA pushes its full count of values), never stored; a thread reads back
  only the vectors it copied, so ``cp.async.wait_group 0`` alone orders them (no block barrier). x
  lives in registers a vector at a time, which is what keeps the 64 registers of 4 CTAs an SM from
  spilling. With a residual a CTA stages 64 KiB, so 3 CTAs an SM fit in the 228 KB of shared memory.
- One cluster exchange for the CTA's rows, for both ops. Each warp reduces its values by a warp
  butterfly and pushes them with ``st.async`` into slot ``rank * warps + warp`` of every cluster
  CTA's shared memory (row ``i``'s in columns ``[i * sums, (i + 1) * sums)``), counted by that CTA's
  one mbarrier (armed for ``sums * R * cluster * warps * 4`` bytes). RMSNorm's one value is the
  warp's sum of squares; every thread adds the slots in rank order, each rank's warps in warp order.
  LayerNorm's are a pair, the warp's sum and the sum of its elements' squares about its own mean
  (its elements of h read twice from shared memory before the push); every thread combines the pairs
  in that same fixed order by Chan et al.'s parallel formula
  (:meth:`ClusterRowNormForward._row_moments`). Either way every CTA of the cluster, and every
  rerun, gets the same bits of the row's statistics. With two exchanges (the mean, then the centered
  row's variance) LayerNorm ran at 85% of copy at 32768 columns, with one at 92% (#87, #89).
- One relaxed cluster arrive at entry, its wait just before the first remote store, so every peer's
  mbarrier is initialised before anything lands in it. No trailing cluster barrier: a CTA reads only
  its own shared memory, after its mbarrier has counted every peer's bytes, so no peer exits while a
  store into it is outstanding.

The math is RowNormForward's, fp32 throughout (LayerNorm's variance is of centered values,
as there, though centered on each warp's mean and combined)::

    h = x + residual       (stored, rounded to x's dtype; the rounded h is normalized)
    mu = mean(h)           (layer_norm)
    rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = n * w + n * offset + b            (n = (h - mu) * rstd)

The weight in x's dtype is held in registers, its loads issued while the copies fly (the
probe's recipe, #75); an fp32 weight (twice the registers) and the bias are read a vector at
a time where they are used (L2 hits, once for the CTA's rows), which keeps every variant of
one row a CTA within the 64 registers of 4 CTAs an SM without a spill, and those of 2 rows
within the 85 of 3 CTAs an SM (128 of 2 at 131072; cuobjdump of the sm_90a cubins,
tests/test_cute_forward.py).

:class:`PersistentClusterRowNormForward` runs the same arithmetic over a persistent grid, the
parameters staged in shared memory once a CTA, the combine spread over lanes in the same tree:
its bits are this kernel's at the same (threads, cluster): the same operations at every step,
no add of two products whose fused form each kernel's compile would pick (:meth:`_affine`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from tilenorm.kernels.cute_cluster_rows import PARTIAL_BYTES, ClusterRowKernel
from tilenorm.kernels.cute_row_norm_forward import NormForwardKernel


class ClusterRowNormForward(NormForwardKernel, ClusterRowKernel):
    """The kernel for one (dtypes, width, features, cluster, launch config); ``__call__``
    launches it on ``grid`` = ceil(rows / rows_per_cta) x ``cluster`` CTAs: a cluster holds
    ``rows_per_cta`` rows, each of its CTAs the same slice of each."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, rows_per_cta: int,
                 cluster: int, ctas_per_sm: int, layer_norm: bool, has_bias: bool,
                 has_offset: bool, has_residual: bool):
        super().__init__(dtype, weight_dtype, cols, threads, ctas_per_sm, layer_norm,
                         has_bias, has_offset, has_residual)
        self._split_row(cluster)
        if rows_per_cta < 1:
            raise ValueError(f"rows_per_cta must be >= 1, got {rows_per_cta}")
        self.rows_per_cta = rows_per_cta
        self.cluster_dims = [cluster, 1, 1]
        #: The weight held in registers: a 2-byte one only, as x's (the module's docstring).
        self.hold_weight = self.has_weight and weight_dtype.width == dtype.width
        #: Values each warp pushes for a row in the cluster exchange: LayerNorm's sum of its
        #: elements and the sum of their squares about its own mean, RMSNorm's sum of squares.
        self.sums = 2 if layer_norm else 1
        #: Elements of a row each warp holds: 32 lanes of ``reps`` vectors, the same count for
        #: every warp (``_thread_view``).
        self.warp_cols = cute.arch.WARP_SIZE * self.vec * self.reps

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: its rows' slices of x (and the residual's),
        the partial slots, the mbarrier (each aligned as allocated)."""
        staged = (self.rows_per_cta * self.slice * self.dtype.width // 8
                  * (2 if self.has_residual else 1))
        return staged + self.slot_bytes(self.sums * self.rows_per_cta) + 8

    @cute.jit
    def _row_moments(self, parts: list, vector: Callable, slots: cute.Tensor, mbar,
                     rank: Int32, lane: Int32, warp: Int32, phase: Int32 = 0,
                     wait_peers: cutlass.Constexpr = True,
                     lanes: cutlass.Constexpr = False) -> list:
        """LayerNorm's (mean, variance) of each of the CTA's rows in one cluster exchange
        (``parts[i]``: this thread's sum of its elements of row ``i``; ``vector(i, k)``: its
        vector ``k`` of that row's h in fp32, read again). Each warp takes its own mean of
        each row, then the sum of its elements' squares about it, and pushes the pairs (sum,
        centered sum of squares) to every cluster CTA (the slots and mbarrier at ``phase``;
        row ``i``'s pair in columns ``2i`` and ``2i + 1``; ``wait_peers``: the first use,
        which waits for every peer's mbarrier to be initialised). Each row's pairs are then
        combined in one fixed tree (:meth:`_fixed_order_sum`, by every thread; with
        ``lanes`` the same tree spread over the warp's lanes, :meth:`_lane_sum`) by Chan et
        al.'s parallel formula, every warp holding ``warp_cols`` = n_w of the N elements::

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
        warp_sums = [cute.arch.warp_reduction(part, operator.add) for part in parts]
        if const_expr(not lanes):
            # A compiler fence for shared memory: without it the compiler holds the first
            # pass's vectors in registers for this one, which spills (cuobjdump, sm_90a); h
            # is read again from shared memory instead.
            cute.arch.sync_warp()
        values = []
        for i in cutlass.range_constexpr(self.rows_per_cta):
            warp_mean = warp_sums[i] * inv_warp_n
            part = Float32(0.0)
            for k in cutlass.range_constexpr(self.reps):
                c = vector(i, k) - warp_mean
                part = part + (c * c).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            values += [warp_sums[i], cute.arch.warp_reduction(part, operator.add)]
        if const_expr(wait_peers):
            cute.arch.cluster_wait()  # every peer's mbarrier initialised
        self._push_warp_values(values, slots, mbar, phase, rank, lane, warp)
        inv_n = Float32(1.0 / self.cols)
        means = [self._slot_sum(lambda slot, i=i: slots[slot, 2 * i], lane, lanes) * inv_n
                 for i in range(self.rows_per_cta)]
        if const_expr(not lanes):
            # The same fence: the sums read again rather than all 2 * cluster * warps values
            # held across the mean (which spills at clusters of 4 and 8).
            cute.arch.sync_warp()
        return [(means[i], self._slot_sum(
                    lambda slot, i=i: self._about_row_mean(slots, slot, 2 * i, means[i],
                                                           inv_warp_n), lane, lanes) * inv_n)
                for i in range(self.rows_per_cta)]

    def _slot_sum(self, term: Callable[[int], Float32], lane: Int32, lanes: bool) -> Float32:
        """The fixed-order sum of ``term`` over the slots: by every thread in turn, or with
        ``lanes`` spread over the warp's lanes in the same tree (the same bits)."""
        return self._lane_sum(term, lane, ranked=True) if lanes else self._fixed_order_sum(term)

    @cute.jit
    def _staged_vector(self, staged: cute.Tensor, v: cute.Tensor):
        """A vector of h read from shared memory (``staged``) through ``v``, in fp32."""
        cute.autovec_copy(staged, v)
        return v.load().to(Float32)

    def _about_row_mean(self, slots: cute.Tensor, slot: int, column: int, mean: Float32,
                        inv_warp_n: Float32) -> Float32:
        """A warp's sum of squares about its row's mean, from its pair in ``slot``, columns
        ``column`` and ``column + 1``: M2_i + n_w * (mean_i - mean)^2."""
        spread = slots[slot, column] * inv_warp_n - mean
        return slots[slot, column + 1] + Float32(self.warp_cols) * spread * spread

    @cute.jit
    def _affine(self, n, k: cutlass.Constexpr, w_held: cute.Tensor | None,
                w_v: cute.Tensor, b_v: cute.Tensor, offset: Float32):
        """y of the normalized vector ``n`` (fp32) of rep ``k``: ``n * w + n * offset + b``
        for the parameters present, the weight held in ``w_held`` (``hold_weight``) or
        loaded into ``w_v``, the bias into ``b_v``.

        With the offset, ``n * w`` and ``n * offset`` are added by one explicit ``fma(n, w,
        n * offset)``: from ``n * w + n * offset``, an add of two products, the compilers
        fuse one of them into the add by the code around it (``fma(n, offset, n * w)`` in
        the persistent kernel's sm_90a SASS, ``fma(n, w, n * offset)`` in the one-shot
        kernel's), and the two kernels' y then differs in the last bit. ``n * w + b`` has
        one product to fuse, which both kernels' SASS fuses; as an explicit fma it cost
        LayerNorm's fp32 one-shot kernel at 16384 columns with a residual ((256, 2, 4, 4),
        64 registers) two spill stores."""
        y = n
        if const_expr(self.has_weight):
            if const_expr(self.hold_weight):
                w = w_held[None, k].load().to(Float32)
            else:
                w = w_v.load().to(Float32)
            y = cute.math.fma(n, w, n * offset) if const_expr(self.has_offset) else n * w
        if const_expr(self.has_bias):
            y = y + b_v.load().to(Float32)
        return y

    def _stored(self, row: Int32, rows: Int32):
        """Whether ``row`` is one to store: with one row a cluster the grid holds exactly the
        rows (no test, no register); with several the last cluster's may run past the end."""
        return True if const_expr(self.rows_per_cta == 1) else row < rows

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor | None, mW: cute.Tensor | None,
               mB: cute.Tensor | None, mY: cute.Tensor, mH: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, eps: Float32, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_in_cluster_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        first = cta // self.cluster * self.rows_per_cta
        inv_n = Float32(1.0 / self.cols)

        smem = cutlass.memory.SmemAllocator()
        # (element, row): column i holds row first + i's slice.
        staged = cute.make_layout((self.slice, self.rows_per_cta))
        s_x = smem.allocate_tensor(self.dtype, staged, 128)
        s_r = (smem.allocate_tensor(self.dtype, staged, 128)
               if const_expr(self.has_residual) else None)
        # (slot, value): slot r * warps + w holds warp w's values from cluster CTA r, row i's
        # in columns [i * sums, (i + 1) * sums).
        parts = smem.allocate_tensor(
            Float32, cute.make_layout((self.cluster * self.warps,
                                       self.sums * self.rows_per_cta)), 16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((1,)), 8)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar.iterator, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        # The rows' slices of x (and the residual) to shared memory: 16-byte cp.async, one
        # group. ``.ca``, Quack's (#75 timed ``.cg`` no faster). Rows past the end are
        # clamped to the last: loaded and reduced so that every CTA pushes its full count of
        # values, never stored.
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS),
                                  self.dtype, num_bits_per_copy=128)
        t_xs = [self._thread_view(s_x[None, i], tidx) for i in range(self.rows_per_cta)]
        t_rs = ([self._thread_view(s_r[None, i], tidx) for i in range(self.rows_per_cta)]
                if const_expr(self.has_residual) else None)
        for i in cutlass.range_constexpr(self.rows_per_cta):
            src = first + i
            if const_expr(self.rows_per_cta > 1):
                src = cutlass.min(src, last)
            cute.copy(g2s, self._slice_view(mX[src, None], rank, tidx), t_xs[i])
            if const_expr(self.has_residual):
                cute.copy(g2s, self._slice_view(mR[src, None], rank, tidx), t_rs[i])
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
                mbar.iterator,
                self.sums * self.rows_per_cta * self.cluster * self.warps * PARTIAL_BYTES)
        cute.arch.cp_async_wait_group(0)

        # First pass, a vector at a time in a fixed order: h = x + residual (rounded, stored,
        # and written over x's slice for the passes that follow), then this thread's part of
        # each row's sum (LayerNorm) or sum of squares (RMSNorm).
        v = cute.make_rmem_tensor((self.vec,), self.dtype)
        parts_of_rows = []
        for i in cutlass.range_constexpr(self.rows_per_cta):
            row = first + i
            part = Float32(0.0)
            for k in cutlass.range_constexpr(self.reps):
                cute.autovec_copy(t_xs[i][None, k], v)
                if const_expr(self.has_residual):
                    r_v = cute.make_rmem_tensor((self.vec,), self.dtype)
                    cute.autovec_copy(t_rs[i][None, k], r_v)
                    v.store((v.load().to(Float32) + r_v.load().to(Float32)).to(self.dtype))
                    cute.autovec_copy(v, t_xs[i][None, k])
                    if self._stored(row, rows):
                        cute.autovec_copy(
                            v, self._slice_view(mH[row, None], rank, tidx)[None, k])
                h = v.load().to(Float32)
                part = part + ((h if const_expr(self.layer_norm) else h * h)
                               .reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            parts_of_rows.append(part)
        # The rows' statistics, one cluster exchange (slots and mbarrier used once: phase 0).
        if const_expr(self.layer_norm):
            moments = self._row_moments(parts_of_rows,
                                        lambda i, k: self._staged_vector(t_xs[i][None, k], v),
                                        parts, mbar.iterator, rank, lane, warp)
        else:
            cute.arch.cluster_wait()  # every peer's mbarrier initialised
            totals = self._push_sums(parts_of_rows, parts, mbar.iterator, 0, rank, lane, warp)
            moments = [(Float32(0.0), total * inv_n) for total in totals]
        mus = [mu for mu, _ in moments]
        rstds = [cute.math.rsqrt(mean_square + eps) for _, mean_square in moments]
        if rank == 0 and tidx == 0:
            for i in cutlass.range_constexpr(self.rows_per_cta):
                if self._stored(first + i, rows):
                    if const_expr(self.layer_norm):
                        mMean[first + i] = mus[i]
                    mRstd[first + i] = rstds[i]

        # h read again, normalized, scaled and stored a vector at a time, each vector of the
        # parameters read once for every row of the CTA.
        b_view = self._slice_view(mB, rank, tidx) if const_expr(self.has_bias) else None
        param_dtype = self.weight_dtype if self.has_weight else self.dtype
        w_v = cute.make_rmem_tensor((self.vec,), param_dtype)
        b_v = cute.make_rmem_tensor((self.vec,), param_dtype)
        out = cute.make_rmem_tensor((self.vec,), self.dtype)
        for k in cutlass.range_constexpr(self.reps):
            if const_expr(self.has_weight and not self.hold_weight):
                cute.autovec_copy(w_view[None, k], w_v)
            if const_expr(self.has_bias):
                cute.autovec_copy(b_view[None, k], b_v)
            for i in cutlass.range_constexpr(self.rows_per_cta):
                row = first + i
                if self._stored(row, rows):
                    cute.autovec_copy(t_xs[i][None, k], v)
                    h = v.load().to(Float32)
                    n = (h - mus[i] if const_expr(self.layer_norm) else h) * rstds[i]
                    out.store(self._affine(n, k, w_held, w_v, b_v, offset).to(self.dtype))
                    cute.autovec_copy(
                        out, self._slice_view(mY[row, None], rank, tidx)[None, k])


class PersistentClusterRowNormForward(ClusterRowNormForward):
    """The cluster forward as a persistent loop: ``__call__``'s ``grid`` is ``clusters *
    cluster`` CTAs (as many clusters as are resident at once), cluster ``c`` taking row
    groups ``c, c + clusters, ...`` of ``rows_per_cta`` rows (group ``g``: rows ``[g * R,
    (g + 1) * R)``, those past the end loaded and reduced, never stored), each CTA its slice
    of each row.

    What it is for: a parameter not held in registers (an fp32 weight, the bias) is read once
    a kernel into shared memory instead of once a row group from L2 (8 bytes a column against
    x's 2 with LayerNorm's fp32 weight and bias: LayerNorm at 4096 x 65536 ran at 75% of an
    H200's copy, at the same absolute rate as an H100's 95%, bench/NOTES.md #98, #101); and
    the next groups' slices are in flight while a group is reduced and stored.

    - A ring of ``stages`` row groups in shared memory, filled by 16-byte ``cp.async``, one
      commit group a row group: the first ``stages`` issued before the loop; a thread reads
      its vectors of a group into registers (widened to fp32 once: every pass runs from
      there), then at once issues the copies of the group ``stages`` later into the slot it
      read, so ``cp.async.wait_group stages - 1`` finds a group's copies landed. A thread
      reads back only the vectors it copied, so no block barrier orders the ring.
    - The staged parameters' slices are copied once, in the first commit group, in a layout
      where a warp's 16-byte reads hit every bank once: a thread's vector of ``vec`` fp32
      (32 bytes beside a 16-byte vector of 2-byte x) split into 16-byte chunks, chunk ``j``
      of the CTA's vectors ``threads`` chunks apart, where the vectors side by side would
      serve a quarter warp's reads in two passes (bench/NOTES.md #123).
    - The cluster exchange of a group (:meth:`_row_moments` with ``lanes``, or
      :meth:`_push_sums_lanes` ``ranked``): the one-shot kernel's values and fixed tree,
      with the slots added across a warp's lanes, lane ``r`` rank ``r``'s warps in order,
      then the lanes in rank order by shuffles: the same bits as :class:`ClusterRowNormForward`
      at the same (threads, cluster), where every thread adding every slot cost ~10
      instructions an element at 65536 (#123). The slots and mbarriers rotate over ``unroll``
      = max(2, stages) groups (the loop is unrolled that far, so ring and slot indices are
      compile-time; each mbarrier's phase flips every trip). Two sets suffice with no
      "empty" barrier, as in the cluster backward (cute_cluster_norm_backward.py): a CTA
      pushes group ``i + 2`` into a set only after its wait for group ``i + 1``, which needs
      every warp of every peer to have pushed group ``i + 1``, which each does only after
      reading group ``i``'s slots; the proxy fence orders those reads before the peers'
      ``st.async`` into the slots. A peer's bytes may reach an mbarrier before thread 0 arms
      it for their group (the phase's transaction count goes below zero until then, which
      PTX allows).
    - Every CTA of a cluster takes the same groups, so the exchange's counts hold; the grid's
      clusters beyond the groups take none.

    No residual (its call runs the one-shot kernel, ``planner.residual_entry``)."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, rows_per_cta: int,
                 cluster: int, stages: int, ctas_per_sm: int, layer_norm: bool,
                 has_bias: bool, has_offset: bool):
        super().__init__(dtype, weight_dtype, cols, threads, rows_per_cta, cluster,
                         ctas_per_sm, layer_norm, has_bias, has_offset, False)
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        self.stages = stages
        #: Row groups the loop body is unrolled over: ring slot (``% stages``) and exchange
        #: set indices are compile-time, and at least two sets rotate.
        self.unroll = max(2, stages)
        #: The parameters staged in shared memory: those not held in registers.
        self.stage_weight = self.has_weight and not self.hold_weight
        self.param_dtype = weight_dtype if self.has_weight else dtype

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: the ring, the staged parameters' slices,
        ``unroll`` sets of slots and mbarriers (each aligned as allocated)."""
        ring = self.stages * self.rows_per_cta * self.slice * self.dtype.width // 8
        params = ((int(self.stage_weight) + int(self.has_bias)) * self.slice
                  * self.param_dtype.width // 8)
        return (ring + params + self.slot_bytes(self.sums * self.rows_per_cta * self.unroll)
                + 8 * self.unroll)

    def _param_layout(self) -> cute.Layout:
        """A staged parameter's slice, (vector element, (thread, rep)): a vector as 16-byte
        chunks (``chunk`` elements each), chunk ``j`` of thread ``t``'s rep ``k`` at chunk
        ``(k * chunks + j) * threads + t`` of the slice, so a warp's reads of one chunk are
        512 contiguous bytes."""
        chunk = 128 // self.param_dtype.width
        chunks = self.vec // chunk
        t = self.threads
        return cute.make_layout(((chunk, chunks), (t, self.reps)),
                                stride=((1, t * chunk), (chunk, chunks * t * chunk)))

    @cute.jit
    def _stage(self, g2s, mX: cute.Tensor, s_x: cute.Tensor, group: Int32, groups: Int32,
               buf: int, rank: Int32, tidx: Int32):
        """This thread's vectors of row group ``group`` into ring slot ``buf`` (nothing past
        the last group; rows past the last row clamped to it), committed as one group:
        every call commits exactly one, so that ``wait_group`` counts row groups."""
        if group < groups:
            last = mX.shape[0] - 1
            for i in cutlass.range_constexpr(self.rows_per_cta):
                row = group * self.rows_per_cta + i
                if const_expr(self.rows_per_cta > 1):
                    row = cutlass.min(row, last)
                cute.copy(g2s, self._slice_view(mX[row, None], rank, tidx),
                          self._thread_view(s_x[None, i, buf], tidx))
        cute.arch.cp_async_commit_group()

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor | None, mW: cute.Tensor | None,
               mB: cute.Tensor | None, mY: cute.Tensor, mH: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, eps: Float32, offset: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        rank = cute.arch.block_in_cluster_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        groups = (rows + self.rows_per_cta - 1) // self.rows_per_cta
        clusters = grid // self.cluster
        first = cta // self.cluster
        stages, unroll = self.stages, self.unroll

        smem = cutlass.memory.SmemAllocator()
        # (element, row of the group, ring slot).
        s_x = smem.allocate_tensor(
            self.dtype, cute.make_layout((self.slice, self.rows_per_cta, stages)), 128)
        s_w = (smem.allocate_tensor(self.param_dtype, self._param_layout(), 128)
               if const_expr(self.stage_weight) else None)
        s_b = (smem.allocate_tensor(self.param_dtype, self._param_layout(), 128)
               if const_expr(self.has_bias) else None)
        # (slot, value, set): slot r * warps + w holds warp w's values from cluster CTA r,
        # row i's of the group in columns [i * sums, (i + 1) * sums).
        parts = smem.allocate_tensor(
            Float32, cute.make_layout((self.cluster * self.warps,
                                       self.sums * self.rows_per_cta, unroll)), 16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((unroll,)), 8)
        if tidx == 0:
            for u in cutlass.range_constexpr(unroll):
                cute.arch.mbarrier_init(mbar.iterator + u, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        # The staged parameters' chunks, in the first commit group with the first row group.
        t_w = s_w[None, (tidx, None)] if const_expr(self.stage_weight) else None
        t_b = s_b[None, (tidx, None)] if const_expr(self.has_bias) else None
        if const_expr(self.stage_weight or self.has_bias):
            g2s_p = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS),
                self.param_dtype, num_bits_per_copy=128)
            chunk = (128 // self.param_dtype.width,)
            for m, t in ((mW, t_w), (mB, t_b)):
                if const_expr(t is not None):
                    view = self._slice_view(m, rank, tidx)
                    for k in cutlass.range_constexpr(self.reps):
                        cute.copy(g2s_p, cute.zipped_divide(view[None, k], chunk),
                                  cute.zipped_divide(t[None, k], chunk))
        # ``.ca``, as the one-shot kernel's.
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS),
                                  self.dtype, num_bits_per_copy=128)
        for j in cutlass.range_constexpr(stages):
            self._stage(g2s, mX, s_x, first + j * clusters, groups, j, rank, tidx)
        # A 2-byte weight into registers while the copies fly.
        w_held = None
        if const_expr(self.hold_weight):
            w_held = cute.make_rmem_tensor((self.vec, self.reps), self.weight_dtype)
            cute.autovec_copy(self._slice_view(mW, rank, tidx), w_held)

        v = cute.make_rmem_tensor((self.vec,), self.dtype)
        hs = [cute.make_rmem_tensor((self.vec, self.reps), Float32)
              for _ in range(self.rows_per_cta)]
        mine = (groups - first + clusters - 1) // clusters
        trips = (mine + unroll - 1) // unroll
        cute.arch.cluster_wait()  # every peer's mbarriers initialised
        for trip in cutlass.range(0, trips, 1):
            phase = trip % 2
            for u in cutlass.range_constexpr(unroll):
                group = first + (trip * unroll + u) * clusters
                buf = u % stages
                if group < groups:  # the same for every CTA of the cluster
                    cute.arch.cp_async_wait_group(stages - 1)
                    for i in cutlass.range_constexpr(self.rows_per_cta):
                        t_x = self._thread_view(s_x[None, i, buf], tidx)
                        for k in cutlass.range_constexpr(self.reps):
                            cute.autovec_copy(t_x[None, k], v)
                            hs[i][None, k].store(self._widen(v))
                    # The slot read: group + stages clusters into it.
                    self._stage(g2s, mX, s_x, group + stages * clusters, groups, buf, rank,
                                tidx)
                    self._normalize_group(mY, mMean, mRstd, hs, parts[None, None, u],
                                          mbar.iterator + u, phase, group, rank, tidx, lane,
                                          warp, w_held, t_w, t_b, eps, offset)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _normalize_group(self, mY, mMean, mRstd, hs: list, slots: cute.Tensor, mbar,
                         phase: Int32, group: Int32, rank: Int32, tidx: Int32, lane: Int32,
                         warp: Int32, w_held, t_w, t_b, eps: Float32, offset: Float32):
        """One row group from registers (``hs[i]``: this thread's elements of row ``i``, fp32):
        its sums, the cluster exchange in ``slots`` and ``mbar`` at ``phase``, its
        statistics, y."""
        rows = mY.shape[0]
        first = group * self.rows_per_cta
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(
                mbar, self.sums * self.rows_per_cta * self.cluster * self.warps * PARTIAL_BYTES)
        parts = []
        for i in cutlass.range_constexpr(self.rows_per_cta):
            part = Float32(0.0)
            for k in cutlass.range_constexpr(self.reps):
                h = hs[i][None, k].load()
                part = part + ((h if const_expr(self.layer_norm) else h * h)
                               .reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            parts.append(part)
        if const_expr(self.layer_norm):
            moments = self._row_moments(parts, lambda i, k: hs[i][None, k].load(), slots,
                                        mbar, rank, lane, warp, phase, False, True)
        else:
            inv_n = Float32(1.0 / self.cols)
            moments = [(Float32(0.0), total * inv_n) for total in self._push_sums_lanes(
                parts, slots, mbar, phase, rank, lane, warp, True)]
        # The slots' reads before any later st.async into them (async proxy); the warp's
        # sync orders every lane's reads before the lanes below cluster push the next group
        # (a shuffle alone orders no memory).
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        mus = [mu for mu, _ in moments]
        rstds = [cute.math.rsqrt(var + eps) for _, var in moments]
        if rank == 0 and tidx == 0:
            for i in cutlass.range_constexpr(self.rows_per_cta):
                if self._stored(first + i, rows):
                    if const_expr(self.layer_norm):
                        mMean[first + i] = mus[i]
                    mRstd[first + i] = rstds[i]
        w_v = cute.make_rmem_tensor((self.vec,), self.param_dtype)
        b_v = cute.make_rmem_tensor((self.vec,), self.param_dtype)
        out = cute.make_rmem_tensor((self.vec,), self.dtype)
        for k in cutlass.range_constexpr(self.reps):
            if const_expr(self.stage_weight):
                cute.autovec_copy(t_w[None, k], w_v)
            if const_expr(self.has_bias):
                cute.autovec_copy(t_b[None, k], b_v)
            for i in cutlass.range_constexpr(self.rows_per_cta):
                row = first + i
                if self._stored(row, rows):
                    h = hs[i][None, k].load()
                    n = (h - mus[i] if const_expr(self.layer_norm) else h) * rstds[i]
                    out.store(self._affine(n, k, w_held, w_v, b_v, offset).to(self.dtype))
                    cute.autovec_copy(
                        out, self._slice_view(mY[row, None], rank, tidx)[None, k])
