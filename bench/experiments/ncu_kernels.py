"""The kernels of a few shapes once each, for Nsight Compute's counters: every case runs
twice outside the profiled region (compiles, plans, warms), then once inside it
(``cudaProfilerStart`` / ``Stop``), so ``ncu --profile-from-start off`` sees one launch of
each of its kernels, on fresh random inputs (bf16 x of the shape). ncu's DRAM throughput is
against the device's peak: a copy's share of it is read from the copy kernel of another
tool (torch's ``copy_`` of a tensor is a driver memcpy, which ncu does not profile).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python bench/experiments/ncu_kernels.py fp8x:8192x16384 bwd:18724x7168

Cases: ``fwd:MxN`` / ``bwd:MxN`` (bf16 RMSNorm), ``fp8x:MxN`` (E4M3 x
with fp32 multipliers per 128 elements, row-scaled FP8 out, as bench_fp8.py's
``fp8x-row``), ``row:MxN`` (bf16 x, row-scaled FP8 out), ``qfwd:MxN`` / ``qbwd:MxN``
(Quack's RMSNorm, for its counters beside tilenorm's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tilenorm  # noqa: E402

EPS = 1e-6
FP8 = torch.float8_e4m3fn
GROUP = 128


def case(spec: str):
    kind, shape = spec.split(":")
    m, n = (int(v) for v in shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    if kind == "fwd":
        return lambda: tilenorm.rms_norm_forward(x, w, EPS)
    if kind == "bwd":
        dy = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
        _, _, rstd = tilenorm.rms_norm_forward(x, w, EPS)
        return lambda: tilenorm.rms_norm_backward(dy, x, w, rstd)
    if kind in ("qfwd", "qbwd"):
        from quack.rmsnorm import rmsnorm_bwd, rmsnorm_fwd

        if kind == "qfwd":
            return lambda: rmsnorm_fwd(x, w, eps=EPS, store_rstd=True)
        dy = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
        rstd = rmsnorm_fwd(x, w, eps=EPS, store_rstd=True)[2]
        return lambda: rmsnorm_bwd(x, w, dy, rstd)
    if kind == "row":
        return lambda: tilenorm.fp8.rms_norm_forward(x, w, EPS, scaling="row")
    if kind == "fp8x":
        top = torch.finfo(FP8).max
        xs = torch.rand(m, n // GROUP, generator=g, device="cuda") + 0.5
        xq = (x.float() * 64).clamp(-top, top).to(FP8)
        return lambda: tilenorm.fp8.rms_norm_forward(xq, w, EPS, scaling="row",
                                                     x_scale_inv=xs, group_size=GROUP)
    raise SystemExit(f"unknown case {spec!r}")


def main() -> None:
    specs = sys.argv[1:]
    calls = [case(s) for s in specs]
    for fn in calls:
        fn()
        fn()
    torch.cuda.synchronize()
    for spec, fn in zip(specs, calls, strict=True):
        print(f"profiling {spec}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
