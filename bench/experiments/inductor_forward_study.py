"""Why torch.compile's RMSNorm forward reads 100-101% of copy bandwidth at 7168-32768 columns
where tilenorm's CuTe forward reads 97-99% (issue 20, bench/NOTES.md #135, #136).

Runs without tilenorm's kernel toolchains (no cuTile, no CuTe DSL): torch.compile of the
sweep's own forward (``reference.norm_forward``, y and rstd), and a one-row-a-program Triton
forward of the same math whose cache policies are the variable: the weight's load with
``evict_last`` (what inductor gives a load broadcast over rows), x's with ``evict_first``,
y's store ``.cs``, and the warps a program. Each case: outputs poisoned (NaN) before its
first launch, then y and rstd against the float64 reference on the first and last rows;
CUDA-graph kernel time (median); GB/s of x read + y written + rstd written (the weight once);
the copy bandwidth of the same run. ``--ncu`` runs each case once between
``cudaProfilerStart`` / ``Stop`` for Nsight Compute's counters (its DRAM and L2 bytes say
whether the weight's re-reads reach L2), and ``--dump DIR`` writes inductor's generated
kernels there.

    python bench/experiments/inductor_forward_study.py --out R.json --dump D
    ncu --clock-control none --profile-from-start off --metrics ... \\
        python bench/experiments/inductor_forward_study.py --ncu
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]


def _module(relpath: str):
    """A torch-only module of tilenorm loaded by path: the package's own import needs cuTile,
    which this study's host may lack."""
    spec = importlib.util.spec_from_file_location(relpath.replace("/", "_")[:-3],
                                                  ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


benchmark = _module("tilenorm/benchmark.py")
testing = _module("tilenorm/testing.py")
reference = _module("tilenorm/pytorch/reference.py")

EPS = 1e-6
#: bf16 x of 256 MB, as the sweep (bench_rms_norm.SWEEP_BYTES).
X_BYTES = 256 << 20
WIDTHS = (4096, 7168, 8192, 32768)
CHECK_ROWS = 256


@triton.jit
def rms_norm_forward_row(X, W, Y, RSTD, eps, COLS: tl.constexpr, BLOCK: tl.constexpr,
                         X_POLICY: tl.constexpr, W_POLICY: tl.constexpr,
                         Y_CACHE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < COLS
    x = tl.load(X + row * COLS + offs, mask=mask, other=0.0,
                eviction_policy=X_POLICY).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0, eviction_policy=W_POLICY).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / COLS + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * COLS + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask,
             cache_modifier=Y_CACHE)


#: name: (x's eviction policy, the weight's, y's store modifier, warps a program or 0 for
#: the width's default: 8 up to 8192 columns, 16 above)
TRITON_CASES = {
    "triton plain": ("", "", "", 0),
    "triton w evict_last": ("", "evict_last", "", 0),
    "triton w evict_last, x evict_first": ("evict_first", "evict_last", "", 0),
    "triton w evict_last, y .cs": ("", "evict_last", ".cs", 0),
    "triton w evict_last, half warps": ("", "evict_last", "", -1),
    "triton w evict_last, double warps": ("", "evict_last", "", -2),
}


def triton_forward(case: tuple, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                   rstd: torch.Tensor):
    x_policy, w_policy, y_cache, warps = case
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    default = 8 if cols <= 8192 else 16
    warps = {0: default, -1: default // 2, -2: default * 2}.get(warps, warps)

    def run():
        rms_norm_forward_row[(rows,)](x, w, y, rstd, EPS, COLS=cols, BLOCK=block,
                                      X_POLICY=x_policy, W_POLICY=w_policy,
                                      Y_CACHE=y_cache, num_warps=warps)
        return y, rstd

    return run


def compiled_forward():
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.recompile_limit = 1024

    def fwd(x, w):
        y, _, _, rstd = reference.norm_forward(x, w, None, EPS)
        return y, rstd

    return torch.compile(fwd, dynamic=False)


def cases(cols: int):
    """(name, x, w, fn) for every provider at ``cols`` columns; fn() returns (y, rstd) with
    the outputs it wrote poisoned beforehand."""
    rows = X_BYTES // (2 * cols)
    x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(cols, device="cuda")).to(torch.bfloat16)
    compiled = compiled_forward()
    yield "torch.compile", x, w, lambda: compiled(x, w)
    for name, case in TRITON_CASES.items():
        y = torch.full_like(x, float("nan"))
        rstd = torch.full((rows,), float("nan"), device="cuda")
        yield name, x, w, triton_forward(case, x, w, y, rstd)


def check(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> dict:
    """y's and rstd's relative error against float64 on the first and last rows."""
    err_y, err_r = testing.RelError(), testing.RelError()
    for part in (slice(0, CHECK_ROWS), slice(x.shape[0] - CHECK_ROWS, x.shape[0])):
        ref = testing.float64_norm(x[part], w, eps=EPS)
        err_y.add(y[part], ref.y)
        err_r.add(rstd[part], ref.rstd)
    return {"y": err_y.value, "rstd": err_r.value}


def measure(out: Path) -> None:
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_gbps": benchmark.copy_gbps(), "rows": []}
    for cols in WIDTHS:
        for name, x, w, fn in cases(cols):
            y, rstd = fn()
            torch.cuda.synchronize()
            errors = check(x, w, y, rstd)
            ms = benchmark.graph_ms(fn)
            moved = 2 * x.numel() * x.element_size() + x.shape[0] * 4 + w.numel() * 2
            row = {"cols": cols, "rows": x.shape[0], "provider": name, "ms": ms,
                   "gbps": moved / (ms * 1e-3) / 1e9, "rel_error": errors}
            record["rows"].append(row)
            print(f"{cols:6} {name:38} {row['gbps']:7.0f} GB/s  y {errors['y']:.1e}"
                  f"  rstd {errors['rstd']:.1e}", flush=True)
    record["copy_gbps_after"] = benchmark.copy_gbps()
    out.write_text(json.dumps(record, indent=1))
    print(f"copy {record['copy_gbps']:.0f} / {record['copy_gbps_after']:.0f} GB/s")


def profile() -> None:
    """Each case warmed twice, then once inside the profiled region."""
    for cols in (7168, 8192, 32768):
        for name, _, _, fn in cases(cols):
            if name not in ("torch.compile", "triton plain", "triton w evict_last"):
                continue
            fn()
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name} {cols}")
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()


def dump_inductor(directory: Path) -> None:
    """inductor's generated Triton kernels of this run (its cache directory's sources that
    hold a ``@triton.jit`` kernel), one file."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        raise SystemExit("--dump reads inductor's cache: set TORCHINDUCTOR_CACHE_DIR")
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    sources = sorted(p for p in cache.rglob("*.py") if "@triton.jit" in p.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "inductor_kernels.txt").write_text(
        "".join(f"# ==== {p.relative_to(cache)}\n{p.read_text()}\n" for p in sources))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--dump", type=Path)
    args = parser.parse_args()
    if args.ncu:
        profile()
    if args.out:
        measure(args.out)
    if args.dump:
        dump_inductor(args.dump)


if __name__ == "__main__":
    sys.exit(main())
