"""What the CuTe DSL cluster kernels (cute_cluster_norm_forward.py,
cute_cluster_norm_backward.py) share: a row split into one slice a cluster CTA, the
cluster-size limit, and the push of each warp's partials of a row to every CTA of the
cluster (with the fixed-order sum of them that both kernels' row sums use).

Apart from cute_rows.py, which the FP8 and JAX families pin too (tilenorm/validation.py):
a change here re-validates only the cluster kernels' family.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
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
                         rank: Int32, lane: Int32, warp: Int32) -> list:
        """:meth:`_push_sums` with the slots added across the warp's lanes instead of by
        every lane in turn: ``group`` runs of ``per`` adjacent slots (:meth:`lane_runs`),
        lane ``l`` adding run ``l % group`` in order, then a butterfly over ``group`` lanes
        adding the runs (a fixed tree; a warp wider than ``group`` repeats it). Every lane,
        every CTA of the cluster and every rerun gets the same bits: each butterfly level
        adds the same two values in either order, and an IEEE add is commutative. A sum
        costs a lane ``per`` reads and adds and log2(group) shuffles and adds a row, where
        the loop over the slots costs it a read and an add a slot (64 at 65536 columns;
        bench/NOTES.md #119)."""
        self._push_warp_values([cute.arch.warp_reduction(part, operator.add)
                                for part in parts], slots, mbar, phase, rank, lane, warp)
        group, per = self.lane_runs()
        first = (lane % group) * per
        return [cute.arch.warp_reduction(
                    functools.reduce(operator.add, [slots[first + i, j] for i in range(per)]),
                    operator.add, threads_in_group=group)
                for j in range(len(parts))]

    def _fixed_order_sum(self, term: Callable[[int], Float32]) -> Float32:
        """The sum of ``term(slot)`` over the cluster * warps slots in a fixed tree: each
        rank's warps added in warp order, then the ranks in rank order (the ranks' chains
        independent, so the adds overlap). Unrolled as the kernel is traced."""
        total = None
        for r in range(self.cluster):
            own = term(r * self.warps)
            for i in range(1, self.warps):
                own = own + term(r * self.warps + i)
            total = own if total is None else total + own
        return total
