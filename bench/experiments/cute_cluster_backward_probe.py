"""Probe (GPU): an RMSNorm backward that holds a row too wide for one CTA across a cluster of
CTAs, reading x and dy ONCE (issue 20, backward): from 32768 columns tilenorm's backward reads
every row twice (the two-pass bound, 3/5 of copy bandwidth; ~2.5 TB/s on an H200).

The kernel is tilenorm's own (:class:`~tilenorm.kernels.cute_cluster_norm_backward.
ClusterRowNormBackward`, whose docstring has the math, layout and synchronisation), bf16 x,
dy, w and dx, fp32 rstd and partial; this probe times its configurations beyond the routed
ones (cluster, threads, ``stages``, CTAs per SM; the weight in shared memory, slower in
#75, and the ``cp.async`` cache mode are no longer the kernel's options).
dweight's partial buffer (clusters x 1 x N, fp32) is checked with
``partial.double().sum``, timed with ``torch.sum(partial, 0)`` (deterministic, but not the
product's reduction, ``tilenorm/kernels/cutile_column_sums.py``).

Grid: as many clusters as are co-resident, ``cuOccupancyMaxActiveClusters`` of the kernel's
own cubin (else the DSL's ``HardwareInfo`` count at one CTA an SM times CTAs per SM, a lower
bound): a persistent grid larger than what is co-resident would run its last clusters after
the others; the count is in the record (``clusters``, ``clusters_from``), beside the count
tilenorm plans with (``clusters_stand_in``, :func:`tilenorm.device.max_active_clusters`). A
first launch that has not returned in ``HANG_S`` seconds (a cluster that never completes a
row) dumps the stack and exits, the record so far written.

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
from cutlass import Float32, Int32  # noqa: E402

from bench.experiments.cute_cluster_forward_probe import _SMEM_PER_SM  # noqa: E402
from tilenorm.kernels.cute_cluster_norm_backward import ClusterRowNormBackward  # noqa: E402

EPS = 1e-6
#: x of 256 MB in bf16 for every width: several times the L2.
SHAPE_BYTES = 256 << 20
#: Columns a CTA holds by default (Quack's forward shape, bench/NOTES.md #66).
SLICE = 16384


class Config(NamedTuple):
    """One kernel configuration: ``stages`` row buffers of x and dy in shared memory (2 x
    32 KiB a stage at 16384 columns a CTA), ``ctas_per_sm`` asked of the compiler
    (``min_blocks_per_mp``)."""

    cluster: int
    threads: int
    stages: int
    ctas_per_sm: int

    def label(self) -> str:
        return f"C{self.cluster} t{self.threads} s{self.stages} k{self.ctas_per_sm}"


def default_configs(n: int) -> list[Config]:
    """Width ``n``'s candidates: 16384 columns a CTA; 2 and 3 stages at one CTA an SM (128 /
    192 KiB; 255 registers hold the weight and dweight); 512 threads at 2 stages; and, at
    32768 and 65536, Quack's Hopper backward shape (8192 columns a CTA of 256 threads, its
    cluster N / 8192 kept portable, two stages, 2 CTAs an SM)."""
    c = n // SLICE
    out = [Config(c, 256, 2, 1), Config(c, 256, 3, 1), Config(c, 512, 2, 1)]
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


def make_kernel(cols: int, config: Config, dtype=None) -> ClusterRowNormBackward:
    """tilenorm's RMSNorm kernel at ``config``, the weight in x's dtype."""
    dtype = dtype or cutlass.BFloat16
    return ClusterRowNormBackward(dtype, dtype, cols, config.cluster, config.threads,
                                  config.stages, config.ctas_per_sm)


def compile_kernel(cols: int, config: Config, arch: str | None = None,
                   cubin_dir: str | None = None):
    """Compiled for every row and cluster count; called as ``fn(x, dy, w, None, rstd, None,
    dx, partial, 0.0, grid)`` on the current stream (RMSNorm: no mean; no residual's
    gradient, no weight offset). ``arch`` compiles without a GPU; ``cubin_dir`` keeps the
    cubin there."""
    kernel = make_kernel(cols, config)
    dtype = kernel.dtype
    rows, clusters = cute.sym_int(), cute.sym_int()
    x, dy, dx = (cute_launch._fake(dtype, (rows, cols), (cols, 1), 16) for _ in range(3))
    w = cute_launch._fake(dtype, (cols,), (1,), 16)
    rstd = cute_launch._fake(Float32, (rows,), (1,), 4)
    partial = cute_launch._fake(Float32, (clusters, 1, cols), (cols, cols, 1), 16)
    return cute_launch._compile(kernel, arch, x, dy, w, None, rstd, None, dx, partial,
                                Float32(0.0), Int32(1), cubin_dir=cubin_dir)


def configs_for(n: int, wanted: list[list[str]] | None) -> list[Config]:
    """The configurations of width ``n``: ``wanted``, each ``[cluster, threads, stages,
    ctas_per_sm]`` (cluster ``auto``: N / 16384), else :data:`CONFIGS`."""
    if not wanted:
        return CONFIGS[n]
    out = []
    for c in wanted:
        cluster = n // SLICE if c[0] == "auto" else int(c[0])
        out.append(Config(cluster, *(int(v) for v in c[1:4])))
    return out


# --- compile only (no GPU) --------------------------------------------------------------------


def compile_only(widths, wanted, arch: str) -> None:
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
                    compile_kernel(n, config, arch, cubin_dir=tmp)
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
            kernel = make_kernel(n, config)
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


def max_clusters(fn, kernel: ClusterRowNormBackward) -> tuple[int, str]:
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


def measure_width(n: int, configs, rounds: int, record: dict, copy: float, save,
                  reruns: int = 5) -> None:
    import torch

    import tilenorm
    from tilenorm.benchmark import graph_ms
    from tilenorm.device import max_active_clusters
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
                fn = compile_kernel(n, config, cubin_dir=tmp)
            resident, source = max_clusters(fn, make_kernel(n, config))
            clusters = min(resident, m)
            grid = clusters * c
            dx = torch.full_like(x, float("nan"))
            partial = torch.full((clusters, 1, n), float("nan"), device="cuda")
            dw32 = torch.empty(n, device="cuda")
            dw = torch.empty_like(w)

            def kernel(fn=fn, dx=dx, partial=partial, grid=grid):
                fn(x, dy, w, None, rstd, None, dx, partial, 0.0, grid)

            def with_sum(kernel=kernel, partial=partial, dw32=dw32, dw=dw):
                kernel()
                torch.sum(partial[:, 0], 0, out=dw32)
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
                    "dweight": rel_error(partial.double().sum((0, 1)), ref_dw)}
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
                partial_few = torch.full((few, 1, n), float("nan"), device="cuda")
                faulthandler.dump_traceback_later(HANG_S, exit=True)
                fn(x[:rows], dy[:rows], w, None, rstd[:rows], None, dx_few, partial_few, 0.0,
                   few * c)
                torch.cuda.synchronize()
                faulthandler.cancel_dump_traceback_later()
                want_dx, want_dw = reference(x[:rows], dy[:rows], w)
                got = {"dx": rel_error(dx_few, want_dx),
                       "dweight": rel_error(partial_few.double().sum((0, 1)), want_dw)}
                if not all(v <= TOLERANCE[k] for k, v in got.items()):
                    raise AssertionError(f"{name}: {rows} rows: errors {got}")
            bad = {k: v for k, v in errs.items() if not v <= TOLERANCE[k]}
            if bad:
                record["failures"].append(f"{n} {name}: errors {bad} above {TOLERANCE}")
            extra = {"config": config._asdict(), "clusters": clusters, "grid": grid,
                     "clusters_resident": resident, "clusters_from": source,
                     "clusters_stand_in": max_active_clusters(
                         torch.cuda.current_device(), c, config.threads,
                         config.ctas_per_sm)}
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


def run(widths, wanted, rounds: int, out: Path, reruns: int) -> None:
    import torch

    from bench.common import git_commit
    from tilenorm.benchmark import copy_gbps

    copy = copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
              "copy_gbps": copy, "bytes": "3*M*N*2 + N*2 + M*4",
              "rows": [], "failures": []}
    print(f"{record['device']}: copy {copy:.0f} GB/s", flush=True)
    def save():
        out.write_text(json.dumps(record, indent=1) + "\n")

    for n in widths:
        measure_width(n, configs_for(n, wanted), rounds, record, copy, save, reruns)
        save()
        torch.cuda.empty_cache()
    for failure in record["failures"]:
        print("FAILED", failure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, CONFIGS)))
    parser.add_argument("--configs", default="",
                        help="semicolon-separated cluster,threads,stages,ctas_per_sm "
                             "(cluster 'auto': N/16384), e.g. 'auto,256,3,1;2,512,2,1'; "
                             "default: CONFIGS")
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
        compile_only(widths, wanted, args.arch)
        return
    if args.out is None:
        parser.error("--out is required (unless --compile-only)")
    run(widths, wanted, args.rounds, args.out, args.reruns)


if __name__ == "__main__":
    main()
