"""Probe (GPU): an RMSNorm forward that holds a row too wide for one CTA across a cluster of
CTAs, each reading its slice of the row once (bench/NOTES.md #65: from 65536 columns
tilenorm's forward reads every row twice, 64% of copy, where Quack's cluster forward reaches
98%).

One-shot grid, R rows a cluster: CTA ``r`` of a cluster of ``C`` loads columns
``[r * N / C, (r + 1) * N / C)`` of its R rows into registers (16-byte vectors, ``threads``
vectors apart; every load issued first), reduces each row's sum of squares (warp butterfly,
then its warps in order), writes them to its own shared memory, and arrives at the cluster
barrier once. After the wait every thread reads the C sums of each row through distributed
shared memory in rank order (a fixed tree: every CTA gets the same bits, so a row's slices
share one rstd), then scales and stores its slices. A second cluster barrier keeps every CTA
resident until its peers have read its sums.

Variants (``--kinds``): ``cluster``, the above (pull); ``push``, one row a cluster with the
partials pushed by ``st.async`` into every peer's shared memory, x in registers
(:class:`ClusterPushRmsNormForward`); ``smem``, the push reduction with x staged in shared
memory by 16-byte ``cp.async`` (``.ca``; #75 timed ``.cg`` no faster, and the product kernel
no longer takes it) and read from there twice, 16384 columns a CTA of 256 threads, 4 CTAs an
SM: Quack's recipe (NOTES #66), shipped as ``ClusterRowNormForward``
(tilenorm/kernels/cute_cluster_norm_forward.py, #75), which this kind builds
(:func:`smem_kernel`).

For each shape and (cluster, threads, CTAs per SM, rows a cluster): y and rstd poisoned, one
launch checked against float64, a rerun bit-identical, then CUDA-graph time in rounds beside
tilenorm's op and Quack; GB/s of the one-pass bytes against the copy bandwidth of the same
process.

    python bench/experiments/cute_cluster_forward_probe.py --out cluster.json
    python bench/experiments/cute_cluster_forward_probe.py --compile-only   # CPU, sm_90a

``--compile-only`` needs no GPU: each variant's sm_90a cubin read by cuobjdump (registers,
stack, spill stores / loads, shared-memory and cp.async instructions, shared bytes, the CTAs
an SM its registers and shared memory allow).
"""

from __future__ import annotations

import argparse
import operator
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tilenorm.launch import cute as cute_launch  # noqa: E402

cute_launch.available()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

from bench.experiments import forward_probe_cases  # noqa: E402
from bench.experiments.forward_probe_cases import EPS  # noqa: E402
from tilenorm.kernels.cute_cluster_norm_forward import ClusterRowNormForward  # noqa: E402
from tilenorm.kernels.cute_cluster_rows import float_bits  # noqa: E402

#: Width -> (cluster, threads, CTAs per SM, rows a cluster) candidates: each CTA's slice whole
#: 16-byte vectors of its threads.
CONFIGS = {
    32768: [(2, 512, 2, 1), (2, 256, 4, 1), (2, 256, 2, 2), (4, 256, 4, 2)],
    65536: [(8, 256, 4, 1), (4, 256, 4, 1), (8, 256, 2, 2), (4, 256, 2, 2)],
    131072: [(8, 512, 2, 1), (8, 256, 2, 2), (8, 512, 1, 2), (8, 256, 4, 1)],
}
#: The push variant's (one row a cluster): Quack's shape, 16384 columns a CTA of 256 threads,
#: 4 CTAs an SM (#66), which with x in registers instead of Quack's shared memory spills (95
#: stores at 64 registers, sm_90a); and 2 CTAs an SM, which does not have to.
PUSH_CONFIGS = {n: [(n // 16384, 256, 4, 1), (n // 16384, 256, 2, 1)]
                for n in (32768, 65536, 131072)}
#: Shared memory per SM on Hopper and Blackwell datacenter parts (228 KB).
_SMEM_PER_SM = 233472


@dsl_user_op
def load_peer_f32(smem_ptr, rank, *, loc=None, ip=None) -> Float32:
    """The fp32 at ``smem_ptr`` in the shared memory of cluster CTA ``rank``
    (``ld.shared::cluster``: a DSMEM tensor takes no loads in the DSL)."""
    peer = cute.arch.map_dsmem_ptr(smem_ptr, rank, loc=loc, ip=ip)
    return Float32(llvm.load(T.f32(), peer.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip))


class ClusterRmsNormForward:
    """bf16 / fp16 RMSNorm forward, weight in x's dtype, one row a cluster of ``cluster``
    CTAs."""

    def __init__(self, dtype, cols: int, cluster: int, threads: int, ctas_per_sm: int,
                 rows_per_cluster: int = 1):
        self.dtype = dtype
        self.cols = cols
        self.cluster = cluster
        self.threads = threads
        self.ctas_per_sm = ctas_per_sm
        self.vec = 128 // dtype.width
        self.slice = cols // cluster
        if cols % cluster or self.slice % (self.vec * threads):
            raise ValueError(f"{cols} columns are not {cluster} slices of whole "
                             f"{self.vec}-element vectors of {threads} threads")
        self.reps = self.slice // (self.vec * threads)
        self.warps = threads // cute.arch.WARP_SIZE
        self.rows_per_cluster = rows_per_cluster
        #: ``preferred_smem_carveout`` as passed (NOTES #64: the driver's unit is a
        #: percentage; a few bytes of shared memory make it moot here), or None: the DSL
        #: derives one that holds ``ctas_per_sm`` CTAs.
        self.carveout = _SMEM_PER_SM

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
                 eps: Float32, grid: Int32, stream):
        self.kernel(mX, mW, mY, mRstd, eps).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1],
            stream=stream, max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.ctas_per_sm,
            **({} if self.carveout is None else {"preferred_smem_carveout": self.carveout}))

    @cute.jit
    def _thread_view(self, row: cute.Tensor, rank: Int32, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of CTA ``rank``'s slice of a row."""
        piece = cute.zipped_divide(row, (self.slice,))[(None, rank)]
        vectors = cute.zipped_divide(piece, (self.vec,))
        blocks = cute.logical_divide(vectors, (None, self.threads))
        return blocks[(None, (tidx, None))]

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_in_cluster_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        ring = self.rows_per_cluster
        first = (bidx // self.cluster) * ring

        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, ring)), 16)
        mine = smem.allocate_tensor(Float32, cute.make_layout((ring,)), 16)

        shape = (self.vec, self.reps)
        xs = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(ring)]
        for s in cutlass.range_constexpr(ring):  # rows past the end: the last, never stored
            cute.autovec_copy(
                self._thread_view(mX[cutlass.min(first + s, last), None], rank, tidx), xs[s])
        w_in = cute.make_rmem_tensor(shape, self.dtype)
        cute.autovec_copy(self._thread_view(mW, rank, tidx), w_in)

        for s in cutlass.range_constexpr(ring):
            x = xs[s].load().to(Float32)
            part = cute.arch.warp_reduction(
                (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), operator.add)
            if lane == 0:
                sums[warp, s] = part
        cute.arch.barrier()
        if tidx < ring:
            own = Float32(0.0)
            for i in cutlass.range_constexpr(self.warps):
                own = own + sums[i, tidx]
            mine[tidx] = own
        # Release this CTA's sums to the cluster, acquire every peer's.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        y = cute.make_rmem_tensor(shape, self.dtype)
        for s in cutlass.range_constexpr(ring):
            row = first + s
            total = Float32(0.0)
            for r in cutlass.range_constexpr(self.cluster):
                total = total + load_peer_f32(mine.iterator + s, r)
            rstd = cute.math.rsqrt(total * Float32(1.0 / self.cols) + eps)
            if row < rows:
                if rank == 0 and tidx == 0:
                    mRstd[row] = rstd
                y.store((xs[s].load().to(Float32) * rstd * w_in.load().to(Float32))
                        .to(self.dtype))
                cute.autovec_copy(y, self._thread_view(mY[row, None], rank, tidx))
        # No CTA leaves while a peer may still read its sum.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


class ClusterPushRmsNormForward(ClusterRmsNormForward):
    """The same row slices, one row a cluster, reduced the way Quack's cluster forward does
    (bench/NOTES.md #66): each warp's partial pushed into every peer's shared memory with
    ``st.async``, counted by the receiver's mbarrier (armed for warps x C x 4 bytes); one
    relaxed cluster arrive at entry, its wait just before the first remote store (so every
    peer's mbarrier is initialised); no block or trailing cluster barrier: a CTA reads only
    its own shared memory, once its mbarrier has counted every peer's bytes."""

    def __init__(self, dtype, cols: int, cluster: int, threads: int, ctas_per_sm: int,
                 rows_per_cluster: int = 1):
        if rows_per_cluster != 1:
            raise ValueError("the push variant takes one row a cluster")
        super().__init__(dtype, cols, cluster, threads, ctas_per_sm)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mRstd: cute.Tensor,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.block_in_cluster_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = bidx // self.cluster

        smem = cutlass.memory.SmemAllocator()
        # Slot warp * C + r: warp ``warp``'s partial from cluster CTA r.
        parts = smem.allocate_tensor(Float32, cute.make_layout((self.warps * self.cluster,)),
                                     16)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout((1,)), 8)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar.iterator, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()

        shape = (self.vec, self.reps)
        x_in = cute.make_rmem_tensor(shape, self.dtype)
        cute.autovec_copy(self._thread_view(mX[row, None], rank, tidx), x_in)
        w_in = cute.make_rmem_tensor(shape, self.dtype)
        cute.autovec_copy(self._thread_view(mW, rank, tidx), w_in)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator,
                                                    self.warps * self.cluster * 4)
        x = x_in.load().to(Float32)
        part = cute.arch.warp_reduction((x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                        operator.add)
        cute.arch.cluster_wait()
        if lane < self.cluster:
            cute.arch.store_async_dsmem(parts.iterator + (warp * self.cluster + rank),
                                        float_bits(part), mbar.iterator, lane)
        cute.arch.mbarrier_wait(mbar.iterator, 0)
        total = Float32(0.0)
        for i in cutlass.range_constexpr(self.warps * self.cluster):
            total = total + parts[i]
        rstd = cute.math.rsqrt(total * Float32(1.0 / self.cols) + eps)
        if rank == 0 and tidx == 0:
            mRstd[row] = rstd
        y = cute.make_rmem_tensor(shape, self.dtype)
        y.store((x * rstd * w_in.load().to(Float32)).to(self.dtype))
        cute.autovec_copy(y, self._thread_view(mY[row, None], rank, tidx))


def smem_kernel(dtype, cols: int, cluster: int, threads: int, ctas_per_sm: int,
                rows_per_cluster: int = 1) -> ClusterRowNormForward:
    """Quack's cluster forward recipe (bench/NOTES.md #66), as shipped: the product kernel
    (:class:`~tilenorm.kernels.cute_cluster_norm_forward.ClusterRowNormForward`, x staged in
    shared memory by ``cp.async``, the partials pushed with ``st.async``), RMSNorm with a
    weight in x's dtype, ``rows_per_cluster`` rows a cluster."""
    return ClusterRowNormForward(dtype, dtype, cols, threads, rows_per_cluster, cluster,
                                 ctas_per_sm, False, False, False, False)


def make_kernel(kind: str, dtype, cols: int, config: tuple[int, int, int, int]):
    """The kernel object of variant ``kind`` (:data:`KINDS`) at ``config``."""
    make, extra = KINDS[kind]
    return make(dtype, cols, *config, **extra)


def compile_kernel(dtype, cols: int, config: tuple[int, int, int, int],
                   arch: str | None = None, kind: str = "cluster",
                   dump_dir: str | None = None):
    """Compiled for every row count; called as ``fn(x, w, y, rstd, eps, grid)``. ``arch``
    compiles without a GPU (a kernel without a carveout is told an SM's shared memory, as
    the schedule probe does); ``dump_dir`` keeps the cubin there."""
    kernel = make_kernel(kind, dtype, cols, config)
    rows = cute.sym_int()
    x, y = (cute.runtime.make_fake_tensor(dtype, (rows, cols), stride=(cols, 1),
                                          assumed_align=16) for _ in range(2))
    w = cute.runtime.make_fake_tensor(dtype, (cols,), stride=(1,), assumed_align=16)
    rstd = cute.runtime.make_fake_tensor(Float32, (rows,), stride=(1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    if dump_dir:
        options += f" --keep-cubin --dump-dir {dump_dir}"
    shipped = isinstance(kernel, ClusterRowNormForward)
    undo = lambda: None  # noqa: E731
    if arch and not shipped:
        from bench.experiments.cute_forward_schedule_probe import _device_free_compile
        undo = _device_free_compile(kernel.carveout)
    try:
        if not shipped:
            return cute.compile(kernel, x, w, y, rstd, Float32(EPS), Int32(1), stream,
                                options=options)
        # The product kernel's operands: no residual, bias, h or mean; no offset.
        fn = cute.compile(kernel, x, None, w, None, y, None, None, rstd, Float32(EPS),
                          Float32(0.0), Int32(1), stream, options=options)
        return lambda x, w, y, rstd, eps, grid: fn(x, None, w, None, y, None, None, rstd,
                                                   eps, 0.0, grid)
    finally:
        undo()


def variants(n: int, kinds=None) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(kind, config) of every kernel timed at width ``n``, of ``kinds`` (all by default)."""
    out = ([("cluster", c) for c in CONFIGS[n]] + [("push", c) for c in PUSH_CONFIGS[n]]
           + [(k, c) for k in SMEM_KINDS for c in SMEM_CONFIGS[n]])
    return [(k, c) for k, c in out if kinds is None or k in kinds]


def candidates(n: int, kinds=None) -> list[forward_probe_cases.Candidate]:
    """Every variant of width ``n`` (of ``kinds``), named ``"<kind> <config>"``."""
    def maker(kind, config):
        def make(x, w, y, rstd):
            fn = compile_kernel(cutlass.BFloat16, n, config, kind=kind)
            grid = -(-x.shape[0] // config[3]) * config[0]
            return lambda: fn(x, w, y, rstd, EPS, grid)
        return make

    return [(f"{kind} {config}", maker(kind, config)) for kind, config in variants(n, kinds)]


def compile_only(widths, kinds, arch: str) -> None:
    """Every variant compiled for ``arch`` without a GPU, its cubin read by cuobjdump:
    registers, stack bytes, spill stores / loads (``STL`` / ``LDL``), shared-memory loads and
    ``cp.async`` (``LDS`` / ``LDGSTS``), 16-byte global loads / stores, static shared bytes
    (cuobjdump's: the 1 KB sm_90 reserves) and the dynamic bytes a CTA allocates; and the
    CTAs an SM the registers and shared memory allow (65536 registers, 228 KB, 2048
    threads)."""
    import re
    import tempfile
    import time

    from bench.experiments.cute_forward_schedule_probe import resources

    print(f"{'variant':>34} {'regs':>5} {'stack':>6} {'STL/LDL':>8} {'LDS':>4} "
          f"{'LDGSTS':>6} {'LDG/STG.128':>11} {'static':>7} {'dynamic':>8} {'CTAs/SM':>7} "
          f"{'s':>5}")
    failed = 0
    for n in widths:
        for kind, config in variants(n, kinds):
            label = f"{n} {kind} {config}"
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.time()
                try:
                    compile_kernel(cutlass.BFloat16, n, config, arch, kind=kind, dump_dir=tmp)
                except Exception as e:
                    failed += 1
                    print(f"{label:>34} FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                seconds = time.time() - t0
                cubins = sorted(Path(tmp).rglob("*.cubin"))
                if not cubins:
                    print(f"{label:>34} compiled in {seconds:.1f} s, no cubin kept")
                    continue
                r = resources(cubins[0])
                sass = ""
                if r.get("spill_stores") is not None:
                    from bench.kernel_resources import cubin_resources, find_cuobjdump
                    sass = cubin_resources(cubins[0], find_cuobjdump())[1]
            kernel = make_kernel(kind, cutlass.BFloat16, n, config)
            dynamic = kernel.shared_bytes() if hasattr(kernel, "shared_bytes") else 0
            threads = config[1]
            fits = None
            if r.get("registers") is not None and r.get("shared") is not None:
                regs_cta = -(-r["registers"] * threads // 256) * 256  # warp allocation unit
                fits = min(65536 // regs_cta, 2048 // threads,
                           _SMEM_PER_SM // (r["shared"] + dynamic))
            lds = len(re.findall(r"\bLDS(\.\S+)?\b", sass)) if sass else "?"
            ldgsts = len(re.findall(r"\bLDGSTS\b", sass)) if sass else "?"

            def show(key, r=r):
                return "?" if r.get(key) is None else str(r[key])

            flag = "  SPILLS" if r.get("stack") or r.get("spill_stores") else ""
            print(f"{label:>34} {show('registers'):>5} {show('stack'):>6} "
                  f"{show('spill_stores') + '/' + show('spill_loads'):>8} {lds:>4} "
                  f"{ldgsts:>6} {show('ldg128') + '/' + show('stg128'):>11} "
                  f"{show('shared'):>7} {dynamic:>8} {fits if fits else '?':>7} "
                  f"{seconds:5.1f}{flag}", flush=True)
    if failed:
        raise SystemExit(f"{failed} variant(s) failed to compile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, CONFIGS)))
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="variants to build, comma-separated, of: " + ", ".join(KINDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every configuration for --arch, no GPU, and print what "
                             "its cubin holds")
    parser.add_argument("--arch", default="sm_90a")
    args = parser.parse_args()
    widths = [int(n) for n in args.widths.split(",")]
    kinds = [k.strip() for k in args.kinds.split(",")]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}: take {list(KINDS)}")
    if args.compile_only:
        compile_only(widths, kinds, args.arch)
        return
    if args.out is None:
        parser.error("--out is required (unless --compile-only)")
    forward_probe_cases.run(widths, lambda n: candidates(n, kinds), args.rounds, args.out)


#: Variant name -> (kernel class, extra constructor arguments).
KINDS = {
    "cluster": (ClusterRmsNormForward, {}),
    "push": (ClusterPushRmsNormForward, {}),
    "smem": (smem_kernel, {}),
}
#: The shared-memory variants.
SMEM_KINDS = ("smem",)
#: The shared-memory variant's configs: Quack's shape (16384 columns a CTA of 256 threads,
#: 4 CTAs an SM, one row a cluster).
SMEM_CONFIGS = {n: [(n // 16384, 256, 4, 1)] for n in (32768, 65536, 131072)}


if __name__ == "__main__":
    main()
