"""python -m tilenorm: an environment report, a self-check of every op against a float64
reference, then a short benchmark beside torch.compile (with a GPU) or an ahead-of-time
build of the kernels for sm_90 and sm_100 (without one).

    python -m tilenorm                 the main job
    python -m tilenorm --aot-all       build every kernel variant (all features and dtypes)
    python -m tilenorm validation ...  GPU validation records (see tilenorm.validation)

Compiled kernels are cached on disk: cuTile's in $CUDA_TILE_CACHE_DIR (default
$XDG_CACHE_HOME/cutile-python, that is ~/.cache/cutile-python; at most
$CUDA_TILE_CACHE_SIZE bytes, 2 GB by default, oldest entries dropped first; "off" disables
it); the C++ host path (tilenorm.pytorch.native, built here if it is not yet) and the CuTe
DSL kernels (tilenorm.launch.cute_cache: compiled here for sm_90a and sm_100a without a GPU,
linked and loaded where they run) in $TILENORM_CACHE_DIR (default ~/.cache/tilenorm).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import sys
import time
from collections.abc import Callable

import torch

import tilenorm
from tilenorm import validation
from tilenorm.testing import (
    float64_fp8_norm,
    float64_norm,
    fp8_rounding_excess,
    fresh_generator,
    rel_error,
)

EPS = 1e-6


def cache_dir() -> str:
    """Where cuTile keeps compiled kernels, as cuda-tile reads it from the environment."""
    from cutile_cache._env import get_cache_dir_from_env

    return get_cache_dir_from_env() or "off (CUDA_TILE_CACHE_DIR)"


def report() -> None:
    import cuda.tile as ct
    from cuda.tile._compile import _find_compiler_bin, _get_compiler_version_string

    print("tilenorm", tilenorm.__version__)
    print(f"  python {platform.python_version()}, torch {torch.__version__}, "
          f"cuda-tile {ct.__version__}")
    compiler = _get_compiler_version_string() or ""
    release = [line for line in compiler.splitlines() if "release" in line]
    try:
        where = _find_compiler_bin().path
    except FileNotFoundError:
        where = "not found"
    print(f"  cuTile compiler (tileiras): {release[0].strip() if release else 'not found'} "
          f"({where})")
    print(f"  compile cache: {cache_dir()} (CUDA_TILE_CACHE_DIR moves it)")
    from tilenorm.pytorch import native

    host = (f"built in {native.library_path().parent} (TILENORM_CACHE_DIR moves it)"
            if native.available() else "off: the Python path (the warning above says why)")
    print(f"  C++ host path: {host}", flush=True)
    if torch.cuda.is_available():
        from tilenorm.device import device_info

        info = device_info(torch.cuda.current_device())
        print(f"  GPU: {info.name}, {info.sm}, {info.sm_count} SMs, "
              f"{info.l2_bytes >> 20} MiB L2, {info.memory_bandwidth / 1e12:.2f} TB/s peak "
              f"DRAM: settings of device class {info.device_class}")
    else:
        print("  GPU: none (no CUDA device visible): reference path only; kernels are built "
              "ahead of time below")
    print(f"  experimental kernels: {'enabled' if tilenorm.experimental_enabled() else 'off'}")
    for family in validation.FAMILIES:
        record = validation.validation_record(family)
        state = (f"stable (validated on {record['device']}, {record['date']}, "
                 f"commit {record['commit']}: {record['tests']})" if record else "experimental")
        print(f"  {family.name} [{family.language}]: {state}")


def self_check(device: str) -> bool:
    """Every op's forward and backward against the float64 reference on fresh random inputs;
    on a GPU the kernels themselves (experimental or not)."""
    ok = True
    cases = [((4, 1000), torch.float32, 1e-5), ((3, 7, 4096), torch.bfloat16, 1e-2),
             ((2, 20000), torch.float16, 1e-2)]
    g, seed = fresh_generator(device)
    with tilenorm.experimental(device == "cuda"):
        for layer_norm in (False, True):
            for shape, dtype, tol in cases:
                x = torch.randn(shape, device=device, generator=g).to(dtype).requires_grad_()
                w = (1 + 0.5 * torch.randn(shape[-1], device=device, generator=g)
                     ).requires_grad_()
                b = (torch.randn(shape[-1], device=device, generator=g).requires_grad_()
                     if layer_norm else None)
                dy = torch.randn(shape, device=device, generator=g, dtype=dtype)
                decision = tilenorm.explain(x, w, bias=b, layer_norm=layer_norm)
                y = (tilenorm.layer_norm(x, w, b, EPS) if layer_norm
                     else tilenorm.rms_norm(x, w, EPS))
                y.backward(dy)
                ref = float64_norm(x, w, b, EPS, layer_norm=layer_norm, dy=dy)
                errs = [rel_error(y, ref.y), rel_error(x.grad, ref.dx),
                        rel_error(w.grad, ref.dweight)]
                if layer_norm:
                    errs.append(rel_error(b.grad, ref.dbias))
                passed = max(errs[:2]) <= tol and max(errs[2:]) <= max(tol, 1e-3)
                ok &= passed
                path = (f"{decision.family.language} {', '.join(decision.kernels[:2])}"
                        if decision.uses_kernel else "reference")
                op = "layer_norm" if layer_norm else "rms_norm"
                print(f"  {op:>10} {str(dtype)[6:]:>8} {str(shape):>14} via {path}: rel err "
                      f"y {errs[0]:.1e} dx {errs[1]:.1e} dparams {max(errs[2:]):.1e} "
                      f"{'ok' if passed else f'FAILED (seed {seed})'}")
    return ok & fp8_self_check(device)


def fp8_self_check(device: str) -> bool:
    """The FP8-output RMSNorm with each scaling: q within FP8 rounding of float64 at its own
    scales, and dx through autograd (the gradient in bf16) against float64."""
    ok = True
    g, seed = fresh_generator(device)
    e4m3 = torch.float8_e4m3fn
    with tilenorm.experimental(device == "cuda"):
        for scaling in tilenorm.fp8.SCALINGS:
            x = torch.randn(21, 4096, device=device, generator=g).to(torch.bfloat16)
            w = 1 + 0.5 * torch.randn(4096, device=device, generator=g)
            dy = torch.randn(x.shape, device=device, generator=g, dtype=torch.bfloat16)
            scale = torch.tensor([20.0], device=device) if scaling == "delayed" else None
            decision = tilenorm.fp8.explain(x, w, scaling=scaling)
            xg = x.clone().requires_grad_()
            y = tilenorm.fp8.rms_norm(xg, w, EPS, scaling=scaling, scale=scale)
            y.backward(dy)
            ref = float64_fp8_norm(x, w, eps=EPS, scaling=scaling, fp8_dtype=e4m3,
                                   scale=scale, dy=dy)
            excess = fp8_rounding_excess(y.fp8, y.scale_inv, scaling, ref.norm.y, e4m3)
            dx_err = rel_error(xg.grad, ref.norm.dx)
            passed = excess <= 1 and dx_err <= 1e-2
            ok &= passed
            path = (f"{decision.family.language} {', '.join(decision.kernels)}"
                    if decision.uses_kernel else "reference")
            print(f"  {'fp8 ' + scaling:>14} bfloat16 (21, 4096) via {path}: q at "
                  f"{excess:.2f} of its rounding bound, dx {dx_err:.1e} "
                  f"{'ok' if passed else f'FAILED (seed {seed})'}")
    return ok


def short_benchmark() -> None:
    from tilenorm.benchmark import copy_gbps, graph_ms
    from tilenorm.pytorch import reference

    copy = copy_gbps()
    m, n = 32768, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fwd_bytes, bwd_bytes = 2 * m * n * 2 + 2 * n + 4 * m, 3 * m * n * 2 + 4 * n + 4 * m

    def reference_fwd(x, w):
        y, _, _, rstd = reference.norm_forward(x, w, None, EPS)
        return y, rstd

    def reference_bwd(dy, x, w, rstd):
        return reference.norm_backward(dy, None, x, w, None, None, rstd)

    compiled_fwd, compiled_bwd = torch.compile(reference_fwd), torch.compile(reference_bwd)
    with tilenorm.experimental():
        _, _, rstd = tilenorm.rms_norm_forward(x, w, EPS)
        providers = {
            "tilenorm": (lambda: tilenorm.rms_norm_forward(x, w, EPS),
                         lambda: tilenorm.rms_norm_backward(dy, x, w, rstd)),
            "torch.compile": (lambda: compiled_fwd(x, w),
                              lambda: compiled_bwd(dy, x, w, rstd)),
        }
        print(f"  rms_norm bf16 {m}x{n}, CUDA-graph kernel time; device copy {copy:.0f} GB/s")
        for name, (fwd, bwd) in providers.items():
            f, b = graph_ms(fwd), graph_ms(bwd)
            print(f"  {name:>14}: forward {fwd_bytes / f / 1e6:6.0f} GB/s "
                  f"({100 * fwd_bytes / f / 1e6 / copy:3.0f}% of copy), backward "
                  f"{bwd_bytes / b / 1e6:6.0f} GB/s ({100 * bwd_bytes / b / 1e6 / copy:3.0f}%)")


def _jobs(all_dtypes: bool):
    from tilenorm.launch.aot import jobs

    every = list(jobs())
    if all_dtypes:
        return every
    return [j for j in every if "/" not in j.label]


def _export_one(index: int, gpu_code: str, all_dtypes: bool) -> None:
    from tilenorm.launch.aot import export

    export(_jobs(all_dtypes)[index], gpu_code)


class _Progress:
    """One line every few seconds while builds run: the count done, the time so far."""

    def __init__(self, total: int, every_s: float = 5.0):
        self.total, self.every_s, self.done = total, every_s, 0
        self.start = self.last = time.perf_counter()

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            print(f"    {self.done}/{self.total} built ({now - self.start:.0f} s)", flush=True)


def build_ahead_of_time(all_dtypes: bool) -> bool:
    from tilenorm.launch.aot import GPU_CODES

    work = [(i, code) for code in GPU_CODES for i in range(len(_jobs(all_dtypes)))]
    scope = ("every feature and dtype combination" if all_dtypes
             else "bf16 variants of every planner configuration")
    print(f"  {len(work)} cuTile kernel builds ({scope}) for {', '.join(GPU_CODES)}, "
          f"{os.cpu_count()} at a time", flush=True)
    ok, start = True, time.perf_counter()
    progress = _Progress(len(work))
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        futures = {pool.submit(_export_one, i, code, all_dtypes): (i, code) for i, code in work}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except Exception as e:
                ok = False
                print(f"  FAILED {futures[future]}: {type(e).__name__}: {e}", flush=True)
            progress.step()
    _report_builds(ok, start)
    return ok & build_cute_ahead_of_time(all_dtypes)


def cute_builds(all_dtypes: bool) -> list[tuple[tuple, Callable]]:
    """(key, compile function) of every CuTe DSL variant the tables route."""
    from tilenorm.launch import cute

    return ([(key, cute.compile_forward) for key in cute.aot_forward_keys(all_dtypes)]
            + [(key, cute.compile_backward) for key in cute.aot_keys(all_dtypes)]
            + [(key, cute.compile_cluster_backward)
               for key in cute.aot_cluster_backward_keys(all_dtypes)]
            + [(key, cute.compile_fp8_forward) for key in cute.aot_fp8_keys(all_dtypes)]
            + [(key, cute.compile_fp8_transpose)
               for key in cute.aot_fp8_transpose_keys(all_dtypes)])


def build_cute_ahead_of_time(all_dtypes: bool, archs: tuple[str, ...] | None = None) -> bool:
    """Every CuTe DSL variant the tables route, compiled for each of ``archs`` (default: the
    ahead-of-time architectures) into the disk cache (:mod:`tilenorm.launch.cute_cache`): a
    GPU host with the same DSL and TVM-FFI links and loads them instead of compiling."""
    from tilenorm.launch import build as launch_build
    from tilenorm.launch import cute, cute_cache

    if not cute.available():
        print("  CuTe DSL kernels: not built (nvidia-cutlass-dsl-libs-cu13 or apache-tvm-ffi "
              "missing)")
        return True
    builds, archs = cute_builds(all_dtypes), archs or cute.AOT_ARCHS
    print(f"  {len(builds) * len(archs)} CuTe DSL kernel builds for "
          f"{', '.join(archs)} into {launch_build.cache_root()}", flush=True)
    ok, start = True, time.perf_counter()
    progress = _Progress(len(builds) * len(archs))
    for key, compile_kernel in builds:
        for arch in archs:
            try:
                cute_cache.build_object(key, arch, compile_kernel)
            except RuntimeError as e:
                ok = False
                print(f"  FAILED {key} {arch}: {type(e).__name__}: {e}", flush=True)
            progress.step()
    _report_builds(ok, start)
    return ok


def _report_builds(ok: bool, start: float) -> None:
    print(f"  {'all built' if ok else 'some builds FAILED'} in "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validation"]:
        validation.main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m tilenorm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aot-all", action="store_true",
                        help="without a GPU, build every dtype variant, not only bf16")
    args = parser.parse_args(argv)

    report()
    gpu = torch.cuda.is_available()
    print("self-check (float64 reference):", flush=True)
    ok = self_check("cuda" if gpu else "cpu")
    if gpu:
        print("short benchmark:", flush=True)
        short_benchmark()
    else:
        print("ahead-of-time build (no GPU needed):", flush=True)
        ok &= build_ahead_of_time(args.aot_all)
    print("tilenorm: all checks passed" if ok else "tilenorm: CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
