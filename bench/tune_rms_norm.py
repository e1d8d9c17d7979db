"""Planner experiments for the RMSNorm kernels: GB/s of each variant, and where the host time
of one launch goes. Results feed bench/NOTES.md; the winners become planner defaults.

    python bench/tune_rms_norm.py --variants '[{"TILE_ELEMENTS": 8192}, {"OCCUPANCY": 4}]'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tilenorm import planner  # noqa: E402
from tilenorm.benchmark import graph_ms, host_us  # noqa: E402
from tilenorm.cutile import rms_norm as kernels  # noqa: E402
from tilenorm.device import device_info  # noqa: E402

DEFAULT_N = [128, 1024, 4096, 8192, 16384, 65536]


def with_overrides(overrides: dict):
    """Apply planner overrides (OCCUPANCY as an int applies to both directions)."""
    saved = {k: getattr(planner, k) for k in overrides}
    for key, value in overrides.items():
        if key == "OCCUPANCY" and isinstance(value, int):
            value = {"forward": value, "backward": value}
        setattr(planner, key, value)
    planner.plan_row_norm.cache_clear()
    return saved


def measure_shape(info, m: int, n: int) -> dict:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fwd, bwd = (planner.plan_row_norm(m, n, itemsize=2, sm_count=info.sm_count, arch=info.arch,
                                      direction=d) for d in ("forward", "backward"))
    _, rstd = kernels.forward(fwd, x, w, 1e-6)
    f = graph_ms(lambda: kernels.forward(fwd, x, w, 1e-6))
    b = graph_ms(lambda: kernels.backward(bwd, dy, x, w, rstd))
    fb, bb = 2 * m * n * 2 + 2 * n + 4 * m, 3 * m * n * 2 + 4 * n + 4 * m
    return {"M": m, "N": n, "fwd_gbps": fb / f / 1e6, "bwd_gbps": bb / b / 1e6,
            "fwd_plan": fwd.describe(), "bwd_plan": bwd.describe()}


def run_variant(overrides: dict, ns: list[int]) -> list[dict]:
    saved = with_overrides(overrides)
    info = device_info(torch.cuda.current_device())
    try:
        return [{"variant": overrides, **measure_shape(info, (256 << 20) // (2 * n), n)}
                for n in ns]
    finally:
        with_overrides(saved)


def host_breakdown(calls: int = 3000) -> dict:
    """Microseconds per call of each step of tilenorm.rms_norm_forward on a tiny shape."""
    import importlib

    import tilenorm
    from tilenorm.pytorch import _checks, routing

    op = importlib.import_module("tilenorm.pytorch.rms_norm")  # the package exports the function

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    plan = routing.kernel_plan(x, "forward")
    y, rstd = kernels.forward(plan, x, w, 1e-6)
    kernel, grid, args = kernels.forward_launch(plan, x, w, y, rstd, 1e-6, 1 / 1024, True)
    import cuda.tile as ct

    stream = kernels._stream(x.device)
    steps = {
        "checks": lambda: (_checks.check_x("op", x), _checks.check_param("op", "w", w, x)),
        "route": lambda: op._route(x),
        "as_kernel_rows": lambda: _checks.as_kernel_rows(x),
        "kernel_plan": lambda: routing.kernel_plan(x, "forward"),
        "current_device": torch.cuda.current_device,
        "empty y": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "empty rstd": lambda: torch.empty(256, dtype=torch.float32, device=x.device),
        "ct.launch": lambda: ct.launch(stream, grid, kernel, args),
        "kernels.forward": lambda: kernels.forward(plan, x, w, 1e-6),
        "rms_norm_forward": lambda: tilenorm.rms_norm_forward(x, w, 1e-6),
        "rms_norm (autograd off)": lambda: tilenorm.rms_norm(x, w, 1e-6),
    }
    return {name: host_us(fn, calls) for name, fn in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="[{}]", help="JSON list of planner overrides")
    parser.add_argument("--n", default=",".join(map(str, DEFAULT_N)))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ns = [int(v) for v in args.n.split(",")]
    results = {"host_us": host_breakdown(), "rows": []}
    for name, us in results["host_us"].items():
        print(f"host {name:>24}: {us:6.2f} us")
    for overrides in json.loads(args.variants):
        results["rows"] += run_variant(overrides, ns)
        for r in results["rows"][-len(ns):]:
            print(f"{json.dumps(r['variant']):>48} N={r['N']:>6}: fwd {r['fwd_gbps']:5.0f} "
                  f"bwd {r['bwd_gbps']:5.0f} GB/s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
