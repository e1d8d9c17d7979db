"""What the CuTe DSL cluster kernels (cute_cluster_norm_forward.py,
cute_cluster_norm_backward.py) share: a row split into one slice a cluster CTA, the
cluster-size limit, the push of each warp's partials of a row to every CTA of the cluster
and the fixed-order sums of them that the kernels' row sums use, and bf16 widened by integer
ops.

Apart from cute_rows.py, which the FP8 and JAX families pin too (tilenorm/validation.py):
a change here re-validates only the cluster kernels' family.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from tilenorm.kernels.cute_rows import RowKernel

#: The largest cluster every Hopper and Blackwell part launches (the portable size; a larger
#: one needs a non-portable opt-in the kernels do not make).
MAX_PORTABLE_CLUSTER = 8
#: Bytes of one pushed partial (an fp32).
PARTIAL_BYTES = 4


@dsl_user_op
def float_bits(value: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of an fp32 as an i32 (``st.async`` stores i32 words)."""
    return Int32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


class ClusterRowKernel(RowKernel):
    """A kernel holding a row across a cluster of ``cluster`` CTAs: CTA ``r`` takes columns
    ``[r * slice, (r + 1) * slice)``, each thread ``reps`` 16-byte vectors of its slice."""

    dtype: type
    cols: int
    warps: int
    cluster: int
    slice: int
    reps: int

    def _split_row(self, cluster: int) -> None:
        """Set ``cluster``, ``slice`` and ``reps``, or refuse a cluster no part launches or
        slices that are not whole vectors of the threads (``cols``, ``vec`` and ``threads``
        set)."""
        if not 1 <= cluster <= MAX_PORTABLE_CLUSTER:
            raise ValueError(f"cluster {cluster}: portable clusters are 1 to "
                             f"{MAX_PORTABLE_CLUSTER} CTAs")
        if self.cols % cluster or (self.cols // cluster) % (self.vec * self.threads):
            raise ValueError(f"{self.cols} columns are not {cluster} slices of whole "
                             f"{self.vec}-element vectors of {self.threads} threads")
        self.cluster = cluster
        self.slice = self.cols // cluster
        self.reps = self.slice // (self.vec * self.threads)

    def slot_bytes(self, sums: int) -> int:
        """Shared bytes of the slots of ``sums`` values a warp pushes (a slot each for every
        warp of each cluster CTA), 16-byte aligned as allocated."""
        return -(-sums * self.cluster * self.warps * PARTIAL_BYTES // 16) * 16

    @cute.jit
    def _slice_view(self, row: cute.Tensor, rank: Int32, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of cluster CTA ``rank``'s slice of a row."""
        return self._thread_view(cute.zipped_divide(row, (self.slice,))[(None, rank)], tidx)

    @cute.jit
    def _widen(self, v: cute.Tensor):
        """This thread's vector ``v`` (x's dtype, in registers) in fp32. bf16 by integer ops
        on its 32-bit words, a shift and a mask a pair of elements (an fp32 is a bf16 and 16
        zero bits below): the DSL's conversion spends three a pair, two of them moving the
        high half down and back (bench/NOTES.md #119). Exact either way."""
        if const_expr(self.dtype is not cutlass.BFloat16):
            return v.load().to(Float32)
        words = cute.recast_tensor(v, Int32)
        bits = cute.make_rmem_tensor((self.vec,), Int32)
        for k in cutlass.range_constexpr(self.vec // 2):
            bits[2 * k] = words[k] << 16
            bits[2 * k + 1] = words[k] & Int32(-65536)
        return cute.recast_tensor(bits, Float32).load()

    @cute.jit
    def _push_warp_values(self, values: list, slots: cute.Tensor, mbar, phase: Int32,
                          rank: Int32, lane: Int32, warp: Int32) -> None:
        """Each of ``values`` (this warp's, the same in every lane) pushed by ``st.async`` into
        slot ``rank * warps + warp`` of column ``j`` of ``slots`` (cluster * warps,
        len(values)) in every cluster CTA (lane ``r`` to rank ``r``), counted by the mbarrier
        at ``mbar`` (armed by the caller for ``len(values) * cluster * warps *
        PARTIAL_BYTES``); returns once its ``phase`` completes: every slot of this CTA
        holds its peer warp's values."""
        if lane < self.cluster:
            for j in cutlass.range_constexpr(len(values)):
                cute.arch.store_async_dsmem(
                    slots[None, j].iterator + (rank * self.warps + warp),
                    float_bits(values[j]), mbar, lane)
        cute.arch.mbarrier_wait(mbar, phase)

    @cute.jit
    def _push_sums(self, parts: list, slots: cute.Tensor, mbar, phase: Int32, rank: Int32,
                   lane: Int32, warp: Int32) -> list:
        """Each of ``parts`` (this thread's partials of a row's sums) summed over the cluster:
        a warp butterfly, each warp's sums pushed (:meth:`_push_warp_values`, same
        arguments), then each column's slots added in rank order, each rank's warps in warp
        order (a fixed tree): every CTA of the cluster, and every rerun, gets the same
        bits."""
        self._push_warp_values([cute.arch.warp_reduction(part, operator.add)
                                for part in parts], slots, mbar, phase, rank, lane, warp)
        return [self._fixed_order_sum(lambda slot, j=j: slots[slot, j])
                for j in range(len(parts))]

    def lane_runs(self) -> tuple[int, int]:
        """(group, per) of :meth:`_push_sums_lanes`: the slots (``cluster * warps``) as
        ``group`` runs of ``per``, ``group`` the largest power of two dividing their count,
        at most a warp's lanes."""
        count = self.cluster * self.warps
        group = min(count & -count, cute.arch.WARP_SIZE)
        return group, count // group

    @cute.jit
    def _push_sums_lanes(self, parts: list, slots: cute.Tensor, mbar, phase: Int32,
                         rank: Int32, lane: Int32, warp: Int32,
                         ranked: cutlass.Constexpr = False) -> list:
        """:meth:`_push_sums` with the slots added across the warp's lanes instead of by
        every lane in turn (:meth:`_lane_sum`, ``ranked`` as there). Every lane, every CTA
        of the cluster and every rerun gets the same bits."""
        self._push_warp_values([cute.arch.warp_reduction(part, operator.add)
                                for part in parts], slots, mbar, phase, rank, lane, warp)
        return [self._lane_sum(lambda slot, j=j: slots[slot, j], lane, ranked)
                for j in range(len(parts))]

    def _lane_sum(self, term: Callable[[int], Float32], lane: Int32,
                  ranked: bool = False) -> Float32:
        """The sum of ``term(slot)`` over the cluster * warps slots spread over a warp's
        lanes: lane ``l`` adds run ``l % group`` of ``per`` adjacent slots in order
        (:meth:`_run_sum`), then the lanes' runs are combined, every lane getting the total.

        - ``ranked``: :meth:`_fixed_order_sum`'s tree, so the same bits as it: the runs are
          the ranks' (``group`` = cluster, ``per`` = warps), and every lane adds lanes 0 to
          ``cluster - 1``'s runs in rank order by shuffles. A lane's cost a sum: ``warps``
          reads and adds, ``cluster`` shuffles and adds, where the fixed-order sum costs a
          read and an add a slot (64 at clusters of 8, bench/NOTES.md #123).
        - else the runs of :meth:`lane_runs`, added by a butterfly over ``group`` lanes (a
          warp wider than ``group`` repeats it): another fixed tree, each butterfly level
          adding the same two values in either order (an IEEE add is commutative); ``per``
          reads and adds and log2(group) shuffles and adds (#119)."""
        group, per = (self.cluster, self.warps) if ranked else self.lane_runs()
        own = self._run_sum(term, (lane % group) * per, per)
        if not ranked:
            return cute.arch.warp_reduction(own, operator.add, threads_in_group=group)
        total = cute.arch.shuffle_sync(own, 0)
        for r in range(1, group):
            total = total + cute.arch.shuffle_sync(own, r)
        return total

    @staticmethod
    def _run_sum(term: Callable[[int], Float32], first, per: int) -> Float32:
        """``term(first) + term(first + 1) + ... + term(first + per - 1)``, added in that
        order: a rank's warps in both trees."""
        total = term(first)
        for i in range(1, per):
            total = total + term(first + i)
        return total

    def _fixed_order_sum(self, term: Callable[[int], Float32]) -> Float32:
        """The sum of ``term(slot)`` over the cluster * warps slots in a fixed tree: each
        rank's warps added in warp order, then the ranks in rank order (the ranks' chains
        independent, so the adds overlap). Unrolled as the kernel is traced."""
        total = None
        for r in range(self.cluster):
            own = self._run_sum(term, r * self.warps, self.warps)
            total = own if total is None else total + own
        return total
