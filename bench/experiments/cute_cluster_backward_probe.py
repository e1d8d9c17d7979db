"""Probe (GPU): an RMSNorm backward that holds a row too wide for one CTA across a cluster of
CTAs, reading x and dy ONCE (issue 20, backward): from 32768 columns tilenorm's backward reads
every row twice (the two-pass bound, 3/5 of copy bandwidth; ~2.5 TB/s on an H200).

Math (fp32): ``xhat = x * rstd`` (rstd as the forward saved it), ``g = dy * w``,
``c = sum_row(g * xhat) / N``, ``dx = rstd * (g - xhat * c)``; ``dweight = sum_rows(dy * xhat)``.
bf16 x, dy, w, dx; fp32 rstd and partial.

Layout (:class:`ClusterRmsNormBackward`): a cluster of ``C`` CTAs holds a row (default
``C = N / 16384``: every CTA 16384 columns, 32 KiB of bf16 x and 32 KiB of dy), CTA ``r``
columns ``[r * N / C, (r + 1) * N / C)``, each thread ``reps`` 16-byte vectors ``threads``
vectors apart (the forward probe's ``_thread_view``). PERSISTENT over rows: cluster ``k`` of
``clusters`` takes rows ``k, k + clusters, ...``; a static assignment, so dweight sums the same
rows in the same order on every run.

Per row, per CTA:

- x and dy of the row were staged in shared memory by 16-byte ``cp.async`` (``stages`` row
  buffers: with ``stages`` >= 2 the copies of row ``i + stages - 1`` are issued before row
  ``i`` is waited on; with 1, the next row's copies are issued once this row's last read is
  done, and other CTAs of the SM cover the gap). A thread reads back only the vectors it
  copied, so ``cp.async.wait_group`` alone orders the staging: no block barrier anywhere in
  the row loop.
- pass 1 (shared memory -> registers, a vector at a time): the thread's partial of
  ``sum(g * xhat)`` in vector order, and ``dweight += dy * xhat`` into fp32 registers (the
  CTA's 16384-column slice of dweight lives in its threads' registers across all its rows);
- the row sum crosses the cluster as the forward probe's push
  (:class:`~bench.experiments.cute_cluster_forward_probe.ClusterSmemPushRmsNormForward`): warp
  ``w`` of CTA ``r`` ``st.async``-es its warp sum into slot ``r * warps + w`` of every CTA
  (lane ``l`` to CTA ``l``), counted by that CTA's mbarrier (armed for ``warps * C * 4``
  bytes); every thread then adds the slots in rank order, warps in order, so every CTA of the
  cluster (and every rerun) has the same bits of ``c``;
- pass 2 (shared memory again): dx, stored from registers (16-byte stores).

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

dweight: at the end each CTA writes its fp32 slice to ``partial[cluster, cols]`` (clusters x
N, fp32; no atomics, no M x N temporary). A fixed-order column sum reduces it: tilenorm's is
``tilenorm/kernels/cutile_column_sums.py``; this probe checks with ``partial.double().sum(0)``
and times with ``torch.sum(partial, 0)`` (deterministic, but not the product's reduction).

Grid: as many clusters as are co-resident, ``cuOccupancyMaxActiveClusters`` of the kernel's
own cubin (else the DSL's ``HardwareInfo`` count at one CTA an SM times CTAs per SM, a lower
bound): a persistent grid larger than what is co-resident would run its last clusters after
the others; the count is in the record (``clusters``, ``clusters_from``). A first launch that
has not returned in ``HANG_S`` seconds (a cluster that never completes a row) dumps the stack
and exits, the record so far written.

    python bench/experiments/cute_cluster_backward_probe.py --out bwd.json       # GPU
    python bench/experiments/cute_cluster_backward_probe.py --compile-only       # CPU, sm_90a

``--compile-only`` needs no GPU: each configuration's sm_90a cubin read by cuobjdump
(registers, stack, spill stores / loads, LDS / LDGSTS / STG.128 counts, static and dynamic
shared bytes, the CTAs an SM its registers, shared memory and threads allow).

On a GPU, per width (bf16, x of 256 MB): dx and partial poisoned with NaN, one launch checked
against float64 (:func:`tilenorm.testing.float64_norm`, computed once per width; every element
written; dx and dweight relative errors), a rerun bit-identical, then CUDA-graph time
(:func:`tilenorm.benchmark.graph_ms`) in ``--rounds`` rounds beside tilenorm's own backward
(``tilenorm.rms_norm_backward``) and Quack's (``quack.rmsnorm.rmsnorm_bwd``, where it
imports); each probe kernel alone and with its column sum. GB/s of the bytes that must move
(x and dy read, dx written, w and rstd read) and % of :func:`tilenorm.benchmark.copy_gbps` of
the same process; a JSON record at ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import json
import operator
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tilenorm.launch import cute as cute_launch  # noqa: E402

cute_launch.available()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, const_expr  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402

from bench.experiments.cute_cluster_forward_probe import (  # noqa: E402
    _SMEM_PER_SM,
    CACHE_MODES,
    float_bits,
)

EPS = 1e-6
#: x of 256 MB in bf16 for every width: several times the L2.
SHAPE_BYTES = 256 << 20
#: Columns a CTA holds by default (Quack's forward shape, bench/NOTES.md #66).
SLICE = 16384
#: Where a CTA's slice of the weight may live (:class:`ClusterRmsNormBackward`).
WEIGHT_IN = ("regs", "smem")


class Config(NamedTuple):
    """One kernel configuration: ``stages`` row buffers of x and dy in shared memory (2 x
    32 KiB a stage at 16384 columns a CTA), ``ctas_per_sm`` asked of the compiler
    (``min_blocks_per_mp``), the weight in registers or shared memory."""

    cluster: int
    threads: int
    stages: int
    ctas_per_sm: int
    weight: str = "regs"

    def label(self) -> str:
        return (f"C{self.cluster} t{self.threads} s{self.stages} k{self.ctas_per_sm} "
                f"w{self.weight}")


def default_configs(n: int) -> list[Config]:
    """Width ``n``'s candidates: 16384 columns a CTA; 2 and 3 stages at one CTA an SM (128 /
    192 KiB; 255 registers hold the weight and dweight); 512 threads at 2 stages; one stage at
    2 CTAs an SM (64 KiB, plus 32 KiB of weight: in registers, 256 threads spill at 128);
    and, at 32768 and 65536, Quack's Hopper backward shape (8192 columns a CTA of 256 threads,
    its cluster N / 8192 kept portable, two stages, 2 CTAs an SM)."""
    c = n // SLICE
    out = [Config(c, 256, 2, 1), Config(c, 256, 3, 1), Config(c, 512, 2, 1),
           Config(c, 256, 1, 2, "smem"), Config(c, 512, 1, 2, "smem"),
           Config(c, 256, 2, 1, "smem")]
    if n // 8192 <= 8:
        out.append(Config(n // 8192, 256, 2, 2))
    return out


#: Width -> its candidates (:func:`default_configs`).
CONFIGS = {n: default_configs(n) for n in (32768, 65536, 131072)}
#: Relative errors against float64 above which a case is recorded as a failure (still timed):
#: dx is bf16 (~2e-3 rms rounding); dweight is fp32 sums of exact bf16 products.
TOLERANCE = {"dx": 1e-2, "dweight": 1e-4}
#: Seconds a first launch may take before the process dumps its stack and exits (a kernel
#: that never completes a row would otherwise hold the device until the command's limit).
HANG_S = 60
#: Registers an SM, threads an SM (sm_90).
_REGS_PER_SM, _THREADS_PER_SM = 65536, 2048


class ClusterRmsNormBackward:
    """bf16 / fp16 RMSNorm backward, weight in x's dtype, one row a cluster of ``cluster``
    CTAs at a time, persistent over rows; dweight's per-cluster sums into ``partial``."""

    def __init__(self, dtype, cols: int, cluster: int, threads: int, stages: int,
                 ctas_per_sm: int, weight: str = "regs", cache: str = "global"):
        self.dtype = dtype
        self.cols = cols
        self.cluster = cluster
        self.threads = threads
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.vec = 128 // dtype.width
        self.slice = cols // cluster
        if cols % cluster or self.slice % (self.vec * threads):
            raise ValueError(f"{cols} columns are not {cluster} slices of whole "
                             f"{self.vec}-element vectors of {threads} threads")
        if not 1 <= cluster <= 8:
            raise ValueError(f"cluster {cluster}: portable clusters are 1 to 8 CTAs")
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        if cache not in CACHE_MODES:
            raise ValueError(f"cache mode {cache!r} is not one of {sorted(CACHE_MODES)}")
        self.cache = cache
        if weight not in WEIGHT_IN:
            raise ValueError(f"weight in {weight!r}: take one of {WEIGHT_IN}")
        #: Where the CTA's slice of the weight lives: ``"regs"`` (bf16, its fp32 conversion
        #: shared by both passes, so 64 more fp32 registers live across the row sum at 256
        #: threads), or ``"smem"`` (32 KiB more shared memory at 16384 columns, read back
        #: a vector at a time in each pass).
        self.weight = weight
        self.reps = self.slice // (self.vec * threads)
        self.warps = threads // cute.arch.WARP_SIZE
        if self.warps < cluster:
            raise ValueError("a warp's lanes push to the peers: need warps >= cluster")
        #: Rows the loop body is unrolled over: buffer (``% stages``) and reduction slot
        #: indices are compile-time, and at least two slots rotate.
        self.unroll = max(2, stages)
        # The DSL derives the carveout from ctas_per_sm (NOTES #64: 233472 is no valid
        # percentage); without a GPU, _device_free_compile answers its device query.
        self.carveout = None

    def shared_bytes(self) -> int:
        """Dynamic shared memory a CTA allocates: the x and dy row buffers, the reduction
        slots, the mbarriers (each aligned as allocated)."""
        rows = (2 * self.stages + (self.weight == "smem")) * self.slice * self.dtype.width // 8
        slots = -(-self.unroll * self.cluster * self.warps * 4 // 16) * 16
        return -(-rows // 128) * 128 + slots + 8 * self.unroll

    @cute.jit
    def __call__(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor,
                 mRstd: cute.Tensor, mdX: cute.Tensor, mPartial: cute.Tensor, grid: Int32,
                 stream):
        self.kernel(mX, mdY, mW, mRstd, mdX, mPartial).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
            stream=stream, max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm,
            **({} if self.carveout is None else {"preferred_smem_carveout": self.carveout}))

    @cute.jit
    def _vectors(self, piece: cute.Tensor, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of a ``slice``-long piece: one 16-byte vector a
        rep, ``threads`` vectors apart (every warp's access 512 contiguous bytes)."""
        vectors = cute.zipped_divide(piece, (self.vec,))
        blocks = cute.logical_divide(vectors, (None, self.threads))
        return blocks[(None, (tidx, None))]

    @cute.jit
    def _thread_view(self, row: cute.Tensor, rank: Int32, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of CTA ``rank``'s slice of a row."""
        return self._vectors(cute.zipped_divide(row, (self.slice,))[(None, rank)], tidx)

    @cute.jit
    def _stage(self, g2s, mX: cute.Tensor, mdY: cute.Tensor, s_x: cute.Tensor,
               s_dy: cute.Tensor, row: Int32, rows: Int32, buf: int, rank: Int32,
               tidx: Int32):
        """This thread's vectors of x and dy of ``row`` into buffer ``buf`` (nothing past the
        last row), committed as one group: every call commits exactly one, so that
        ``wait_group`` counts rows."""
        if row < rows:
            cute.copy(g2s, self._thread_view(mX[row, None], rank, tidx),
                      self._vectors(s_x[None, buf], tidx))
            cute.copy(g2s, self._thread_view(mdY[row, None], rank, tidx),
                      self._vectors(s_dy[None, buf], tidx))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _weight(self, w_in: cute.Tensor, t_w: cute.Tensor | None, k: int):
        """The fp32 weight of this thread's vector ``k``: from registers, or read back from
        shared memory into ``w_in`` (one vector)."""
        if const_expr(self.weight == "regs"):
            return w_in[None, k].load().to(Float32)
        cute.autovec_copy(t_w[None, k], w_in)
        return w_in.load().to(Float32)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor, mRstd: cute.Tensor,
               mdX: cute.Tensor, mPartial: cute.Tensor):
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
        s_x = smem.allocate_tensor(self.dtype, cute.make_layout((self.slice, stages)), 128)
        s_dy = smem.allocate_tensor(self.dtype, cute.make_layout((self.slice, stages)), 128)
        s_w = None
        if const_expr(self.weight == "smem"):
            s_w = smem.allocate_tensor(self.dtype, cute.make_layout((self.slice,)), 128)
        # (slot, row of the unrolled loop): slot r * warps + w holds warp w's partial from
        # cluster CTA r.
        parts = smem.allocate_tensor(Float32, cute.make_layout((slots, unroll)), 16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((unroll,)), 8)
        if tidx == 0:
            for s in cutlass.range_constexpr(unroll):
                cute.arch.mbarrier_init(mbar.iterator + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=CACHE_MODES[self.cache]),
                                  self.dtype, num_bits_per_copy=128)
        shape = (self.vec, self.reps)
        w_in = cute.make_rmem_tensor(shape if self.weight == "regs" else (self.vec,),
                                     self.dtype)
        t_w = None
        if const_expr(self.weight == "smem"):
            # Joins the first row's group: waited on with it.
            t_w = self._vectors(s_w, tidx)
            cute.copy(g2s, self._thread_view(mW, rank, tidx), t_w)
        # The first rows' copies in flight before anything else.
        for j in cutlass.range_constexpr(max(stages - 1, 1)):
            self._stage(g2s, mX, mdY, s_x, s_dy, first + j * clusters, rows, j, rank, tidx)

        if const_expr(self.weight == "regs"):
            cute.autovec_copy(self._thread_view(mW, rank, tidx), w_in)
        dw = cute.make_rmem_tensor(shape, Float32)
        dw.fill(0.0)
        x_v = cute.make_rmem_tensor((self.vec,), self.dtype)
        dy_v = cute.make_rmem_tensor((self.vec,), self.dtype)
        dx_v = cute.make_rmem_tensor((self.vec,), self.dtype)

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
                    self._stage(g2s, mX, mdY, s_x, s_dy, row + (stages - 1) * clusters, rows,
                                (s + stages - 1) % stages, rank, tidx)
                if row < rows:
                    rstd = mRstd[row]
                    cute.arch.cp_async_wait_group(stages - 1 if stages > 1 else 0)
                    t_x = self._vectors(s_x[None, buf], tidx)
                    t_dy = self._vectors(s_dy[None, buf], tidx)
                    # Pass 1: this thread's part of sum(g * xhat), vectors in order, and
                    # dweight.
                    part = Float32(0.0)
                    for k in cutlass.range_constexpr(self.reps):
                        cute.autovec_copy(t_x[None, k], x_v)
                        cute.autovec_copy(t_dy[None, k], dy_v)
                        x_hat = x_v.load().to(Float32) * rstd
                        dy = dy_v.load().to(Float32)
                        g = dy * self._weight(w_in, t_w, k)
                        part = part + (g * x_hat).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        dw[None, k].store(dw[None, k].load() + dy * x_hat)
                    part = cute.arch.warp_reduction(part, operator.add)
                    # Push the warp's sum into slot (rank, warp) of every CTA of the cluster.
                    mbar_s = mbar.iterator + s
                    if tidx == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar_s, slots * 4)
                    if lane < self.cluster:
                        cute.arch.store_async_dsmem(
                            parts.iterator + (s * slots + rank * self.warps + warp),
                            float_bits(part), mbar_s, lane)
                    cute.arch.mbarrier_wait(mbar_s, phase)
                    total = Float32(0.0)
                    for r in cutlass.range_constexpr(self.cluster):
                        own = parts[r * self.warps, s]
                        for i in cutlass.range_constexpr(1, self.warps):
                            own = own + parts[r * self.warps + i, s]
                        total = own if r == 0 else total + own
                    # The slot's reads before any later st.async into it (async proxy); the
                    # warp's sync orders every lane's reads before the lanes below cluster
                    # push the next row (a shuffle alone orders no memory).
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_warp()
                    c = total * inv_n
                    # Pass 2: dx from shared memory again.
                    t_dx = self._thread_view(mdX[row, None], rank, tidx)
                    for k in cutlass.range_constexpr(self.reps):
                        cute.autovec_copy(t_x[None, k], x_v)
                        cute.autovec_copy(t_dy[None, k], dy_v)
                        x_hat = x_v.load().to(Float32) * rstd
                        g = dy_v.load().to(Float32) * self._weight(w_in, t_w, k)
                        dx_v.store(((g - x_hat * c) * rstd).to(self.dtype))
                        cute.autovec_copy(dx_v, t_dx[None, k])
                if const_expr(stages == 1):
                    # Buffer 0 is free once this thread's reads of it are done.
                    self._stage(g2s, mX, mdY, s_x, s_dy, row + clusters, rows, 0, rank, tidx)

        cute.arch.cp_async_wait_group(0)
        cute.autovec_copy(dw, self._thread_view(mPartial[first, None], rank, tidx))
        # No CTA exits while a peer's push to it may be in flight.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


def make_kernel(cols: int, config: Config, dtype=None,
                cache: str = "global") -> ClusterRmsNormBackward:
    return ClusterRmsNormBackward(dtype or cutlass.BFloat16, cols, *config, cache=cache)


def compile_kernel(cols: int, config: Config, arch: str | None = None,
                   dump_dir: str | None = None, cache: str = "global"):
    """Compiled for every row and cluster count; called as ``fn(x, dy, w, rstd, dx, partial,
    grid)`` on the current stream. ``arch`` compiles without a GPU; ``dump_dir`` keeps the
    cubin there."""
    kernel = make_kernel(cols, config, cache=cache)
    dtype = kernel.dtype
    rows, clusters = cute.sym_int(), cute.sym_int()
    x, dy, dx = (cute.runtime.make_fake_tensor(dtype, (rows, cols), stride=(cols, 1),
                                               assumed_align=16) for _ in range(3))
    w = cute.runtime.make_fake_tensor(dtype, (cols,), stride=(1,), assumed_align=16)
    rstd = cute.runtime.make_fake_tensor(Float32, (rows,), stride=(1,), assumed_align=4)
    partial = cute.runtime.make_fake_tensor(Float32, (clusters, cols), stride=(cols, 1),
                                            assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    if dump_dir:
        options += f" --keep-cubin --dump-dir {dump_dir}"
    undo = lambda: None  # noqa: E731
    if arch:
        from bench.experiments.cute_forward_schedule_probe import _device_free_compile
        undo = _device_free_compile(kernel.carveout)
    try:
        return cute.compile(kernel, x, dy, w, rstd, dx, partial, Int32(1), stream,
                            options=options)
    finally:
        undo()


def configs_for(n: int, wanted: list[list[str]] | None) -> list[Config]:
    """The configurations of width ``n``: ``wanted``, each ``[cluster, threads, stages,
    ctas_per_sm, weight]`` (cluster ``auto``: N / 16384; weight optional, ``regs``), else
    :data:`CONFIGS`."""
    if not wanted:
        return CONFIGS[n]
    out = []
    for c in wanted:
        cluster = n // SLICE if c[0] == "auto" else int(c[0])
        out.append(Config(cluster, *(int(v) for v in c[1:4]), *c[4:]))
    return out


# --- compile only (no GPU) --------------------------------------------------------------------


def compile_only(widths, wanted, arch: str, cache: str) -> None:
    """Every configuration compiled for ``arch`` without a GPU, its cubin read by cuobjdump:
    registers, stack bytes, spill stores / loads (``STL`` / ``LDL``), shared-memory loads,
    ``cp.async`` and 16-byte global stores (``LDS`` / ``LDGSTS`` / ``STG.128``), static
    shared bytes (cuobjdump's: the 1 KB sm_90 reserves), the dynamic bytes a CTA allocates;
    and the CTAs an SM its registers, shared memory and threads allow, against the
    ``ctas_per_sm`` asked (``min_blocks_per_mp``)."""
    from bench.experiments.cute_forward_schedule_probe import resources
    from bench.kernel_resources import cubin_resources, find_cuobjdump

    print(f"{'width config':>30} {'regs':>5} {'stack':>6} {'STL/LDL':>8} {'LDS':>5} "
          f"{'LDGSTS':>6} {'STG.128':>7} {'static':>7} {'dynamic':>8} {'CTAs/SM':>7} "
          f"{'asked':>5} {'s':>5}")
    failed = 0
    for n in widths:
        for config in configs_for(n, wanted):
            name = f"{n} {config.label()}"
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                try:
                    compile_kernel(n, config, arch, dump_dir=tmp, cache=cache)
                except Exception as e:
                    failed += 1
                    print(f"{name:>30} FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                seconds = time.time() - t0
                cubins = sorted(Path(tmp).rglob("*.cubin"))
                if not cubins:
                    print(f"{name:>30} compiled in {seconds:.1f} s, no cubin kept")
                    continue
                r = resources(cubins[0])
                tool = find_cuobjdump()
                sass = cubin_resources(cubins[0], tool)[1] if tool else ""
            kernel = make_kernel(n, config, cache=cache)
            dynamic = kernel.shared_bytes()
            threads = config.threads
            fits = None
            if r.get("registers") is not None and r.get("shared") is not None:
                regs_cta = -(-r["registers"] * threads // 256) * 256  # warp allocation unit
                fits = min(_REGS_PER_SM // regs_cta, _THREADS_PER_SM // threads,
                           _SMEM_PER_SM // (r["shared"] + dynamic))

            def count(pattern, sass=sass):
                return str(len(re.findall(pattern, sass))) if sass else "?"

            def show(key, r=r):
                return "?" if r.get(key) is None else str(r[key])

            lds, ldgsts, stg = (count(p) for p in (r"\bLDS(\.\S+)?\b", r"\bLDGSTS\b",
                                                   r"\bSTG\.E\.128\b"))
            flag = "  SPILLS" if r.get("stack") or r.get("spill_stores") else ""
            if fits is not None and fits < config.ctas_per_sm:
                flag += "  FEWER CTAs"
            print(f"{name:>30} {show('registers'):>5} {show('stack'):>6} "
                  f"{show('spill_stores') + '/' + show('spill_loads'):>8} "
                  f"{lds:>5} {ldgsts:>6} {stg:>7} {show('shared'):>7} {dynamic:>8} "
                  f"{fits if fits else '?':>7} {config.ctas_per_sm:>5} {seconds:5.1f}{flag}",
                  flush=True)
    if failed:
        raise SystemExit(f"{failed} configuration(s) failed to compile")


# --- GPU --------------------------------------------------------------------------------------


def must_move_bytes(m: int, n: int) -> int:
    """x and dy read, dx written (bf16), w read (bf16), rstd read (fp32)."""
    return 3 * m * n * 2 + n * 2 + m * 4


@functools.cache
def max_clusters_estimate(cluster: int, ctas_per_sm: int) -> int:
    """A lower bound of the clusters of ``cluster`` CTAs co-resident at ``ctas_per_sm`` CTAs
    an SM: the driver's count at one CTA an SM (``cuOccupancyMaxActiveClusters`` of an empty
    kernel with an SM's shared memory, the DSL's ``HardwareInfo``) times ``ctas_per_sm``."""
    from cutlass.utils import HardwareInfo

    return ctas_per_sm * HardwareInfo().get_max_active_clusters(cluster)


def max_clusters(fn, kernel: ClusterRmsNormBackward) -> tuple[int, str]:
    """(clusters co-resident, how it was found) of compiled ``fn``: the driver's
    ``cuOccupancyMaxActiveClusters`` of its own cubin (``--keep-cubin``) at its block, cluster
    and dynamic shared memory; else :func:`max_clusters_estimate`."""
    try:
        from cuda.bindings import driver

        def check(result):
            if result[0] != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"CUDA driver error {result[0]}")
            return result[1] if len(result) == 2 else None

        library = check(driver.cuLibraryLoadData(fn.artifacts.CUBIN, None, None, 0, None,
                                                 None, 0))
        func = check(driver.cuKernelGetFunction(
            check(driver.cuLibraryEnumerateKernels(1, library))[0]))
        smem = kernel.shared_bytes()
        check(driver.cuFuncSetAttribute(
            func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem))
        config = driver.CUlaunchConfig()
        config.blockDimX, config.blockDimY, config.blockDimZ = kernel.threads, 1, 1
        config.gridDimX, config.gridDimY, config.gridDimZ = kernel.cluster, 1, 1
        config.sharedMemBytes = smem
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        value = driver.CUlaunchAttributeValue()
        value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = kernel.cluster, 1, 1
        attr.value = value
        config.numAttrs = 1
        config.attrs = [attr]
        found = check(driver.cuOccupancyMaxActiveClusters(func, config))
        if found > 0:
            return found, "cuOccupancyMaxActiveClusters of the kernel"
    except Exception as e:
        print(f"occupancy of the kernel failed ({type(e).__name__}: {e}); estimating",
              flush=True)
    return (max_clusters_estimate(kernel.cluster, kernel.ctas_per_sm),
            "HardwareInfo x CTAs per SM")


def reference(x, dy, w):
    """float64 dx (whole, on the GPU) and dweight of RMSNorm's backward, a block of rows at a
    time (:func:`tilenorm.testing.float64_norm`)."""
    import torch

    from tilenorm.testing import float64_norm, row_blocks

    m, n = x.shape
    dx = torch.empty(m, n, dtype=torch.float64, device=x.device)
    dweight = torch.zeros(n, dtype=torch.float64, device=x.device)
    for block in row_blocks(m, n):
        ref = float64_norm(x[block], w, None, EPS, dy=dy[block])
        dx[block] = ref.dx
        dweight += ref.dweight
        del ref
    return dx, dweight


def measure_width(n: int, configs, rounds: int, record: dict, copy: float, cache: str,
                  save, reruns: int = 5) -> None:
    import torch

    import tilenorm
    from tilenorm.benchmark import graph_ms
    from tilenorm.testing import rel_error

    m = SHAPE_BYTES // (2 * n)
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    rstd = torch.rsqrt(x.float().square().mean(-1) + EPS)
    t0 = time.time()
    ref_dx, ref_dw = reference(x, dy, w)
    print(f"{m}x{n}: float64 reference in {time.time() - t0:.1f} s", flush=True)

    cases = []  # (name, launch, errors, extra)
    for config in configs:
        name = config.label()
        try:
            c = config.cluster
            with tempfile.TemporaryDirectory() as tmp:
                fn = compile_kernel(n, config, dump_dir=tmp, cache=cache)
            resident, source = max_clusters(fn, make_kernel(n, config, cache=cache))
            clusters = min(resident, m)
            grid = clusters * c
            dx = torch.full_like(x, float("nan"))
            partial = torch.full((clusters, n), float("nan"), device="cuda")
            dw32 = torch.empty(n, device="cuda")
            dw = torch.empty_like(w)

            def kernel(fn=fn, dx=dx, partial=partial, grid=grid):
                fn(x, dy, w, rstd, dx, partial, grid)

            def with_sum(kernel=kernel, partial=partial, dw32=dw32, dw=dw):
                kernel()
                torch.sum(partial, 0, out=dw32)
                dw.copy_(dw32)

            save()  # a hang (a cluster that never completes a row) exits with the record
            faulthandler.dump_traceback_later(HANG_S, exit=True)
            kernel()
            torch.cuda.synchronize()
            faulthandler.cancel_dump_traceback_later()
            first_dx, first_partial = dx.clone(), partial.clone()
            if first_dx.isnan().any() or first_partial.isnan().any():
                raise AssertionError(f"{name}: not every element of dx / partial written")
            errs = {"dx": rel_error(dx, ref_dx),
                    "dweight": rel_error(partial.double().sum(0), ref_dw)}
            for _ in range(reruns):
                dx.fill_(float("nan"))
                partial.fill_(float("nan"))
                kernel()
                torch.cuda.synchronize()
                if not (torch.equal(first_dx, dx) and torch.equal(first_partial, partial)):
                    raise AssertionError(f"{name}: a rerun is not bit-identical")
            del first_dx, first_partial
            # Partial trips: fewer rows than clusters, and one past two rounds of them.
            for rows in sorted({1, max(1, clusters - 1), 2 * clusters + 1} - {m}):
                if rows > m:
                    continue
                few = min(resident, rows)
                dx_few = torch.full_like(x[:rows], float("nan"))
                partial_few = torch.full((few, n), float("nan"), device="cuda")
                faulthandler.dump_traceback_later(HANG_S, exit=True)
                fn(x[:rows], dy[:rows], w, rstd[:rows], dx_few, partial_few, few * c)
                torch.cuda.synchronize()
                faulthandler.cancel_dump_traceback_later()
                want_dx, want_dw = reference(x[:rows], dy[:rows], w)
                got = {"dx": rel_error(dx_few, want_dx),
                       "dweight": rel_error(partial_few.double().sum(0), want_dw)}
                if not all(v <= TOLERANCE[k] for k, v in got.items()):
                    raise AssertionError(f"{name}: {rows} rows: errors {got}")
            bad = {k: v for k, v in errs.items() if not v <= TOLERANCE[k]}
            if bad:
                record["failures"].append(f"{n} {name}: errors {bad} above {TOLERANCE}")
            extra = {"config": config._asdict(), "clusters": clusters, "grid": grid,
                     "clusters_resident": resident, "clusters_from": source}
            cases.append((f"probe {name}", kernel, errs, extra))
            cases.append((f"probe {name} + sum", with_sum, errs, extra))
        except Exception as e:
            traceback.print_exc(limit=3)
            record["failures"].append(f"{n} {name}: {type(e).__name__}: {e}")

    try:
        out = {}

        def op():
            out["r"] = tilenorm.rms_norm_backward(dy, x, w, rstd)

        op()
        torch.cuda.synchronize()
        errs = {"dx": rel_error(out["r"][0], ref_dx), "dweight": rel_error(out["r"][2], ref_dw)}
        with contextlib.suppress(Exception):  # what the op runs, where it says
            errs["decision"] = str(tilenorm.explain(x, w))
        cases.append(("tilenorm op", op, errs, {}))
    except Exception as e:
        traceback.print_exc(limit=3)
        record["failures"].append(f"{n} tilenorm op: {type(e).__name__}: {e}")
    try:
        from quack.rmsnorm import rmsnorm_bwd

        def quack():
            rmsnorm_bwd(x, w, dy, rstd)

        quack()
        torch.cuda.synchronize()
        cases.append(("quack", quack, {}, {}))
    except Exception as e:
        record["failures"].append(f"quack: {type(e).__name__}: {e}")

    times = [[] for _ in cases]
    for _ in range(rounds):
        for i, (_, launch, _, _) in enumerate(cases):
            times[i].append(graph_ms(launch))
    nbytes = must_move_bytes(m, n)
    for (name, _, errs, extra), ms_list in zip(cases, times, strict=True):
        ms = sorted(ms_list)[len(ms_list) // 2]
        gbps = nbytes / (ms * 1e-3) / 1e9
        record["rows"].append({"M": m, "N": n, "case": name, "ms": ms, "ms_rounds": ms_list,
                               "gbps": gbps, "pct_copy": 100 * gbps / copy, **errs, **extra})
        print(f"{m:>6}x{n:<6} {name:>26} {ms * 1e3:8.1f} us {gbps:6.0f} GB/s "
              f"{100 * gbps / copy:5.1f}%  dx err {errs.get('dx', float('nan')):.1e} "
              f"dw err {errs.get('dweight', float('nan')):.1e}", flush=True)


def run(widths, wanted, rounds: int, out: Path, cache: str, reruns: int) -> None:
    import torch

    from bench.common import git_commit
    from tilenorm.benchmark import copy_gbps

    copy = copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
              "copy_gbps": copy, "cache": cache, "bytes": "3*M*N*2 + N*2 + M*4",
              "rows": [], "failures": []}
    print(f"{record['device']}: copy {copy:.0f} GB/s", flush=True)
    def save():
        out.write_text(json.dumps(record, indent=1) + "\n")

    for n in widths:
        measure_width(n, configs_for(n, wanted), rounds, record, copy, cache, save, reruns)
        save()
        torch.cuda.empty_cache()
    for failure in record["failures"]:
        print("FAILED", failure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, CONFIGS)))
    parser.add_argument("--configs", default="",
                        help="semicolon-separated cluster,threads,stages,ctas_per_sm[,weight] "
                             "(cluster 'auto': N/16384; weight regs or smem), e.g. "
                             "'auto,256,3,1;auto,256,1,2,smem'; default: CONFIGS")
    parser.add_argument("--cache", choices=sorted(CACHE_MODES), default="global",
                        help="cp.async cache mode (.cg past L1 by default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reruns", type=int, default=5,
                        help="reruns each compared bit for bit with the first")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every configuration for --arch, no GPU, and print what "
                             "its cubin holds")
    parser.add_argument("--arch", default="sm_90a")
    args = parser.parse_args()
    widths = [int(n) for n in args.widths.split(",")]
    wanted = [c.split(",") for c in args.configs.split(";") if c]
    if args.compile_only:
        compile_only(widths, wanted, args.arch, args.cache)
        return
    if args.out is None:
        parser.error("--out is required (unless --compile-only)")
    run(widths, wanted, args.rounds, args.out, args.cache, args.reruns)


if __name__ == "__main__":
    main()
