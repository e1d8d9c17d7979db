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
from tilenorm.cutile import norm as kernels  # noqa: E402
from tilenorm.cutile.norm import NormFeatures  # noqa: E402
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
    feats = NormFeatures()
    x3, dy3, w3 = x.view(m, 1, n), dy.view(m, 1, n), w.view(1, 1, n)
    y, dx = torch.empty_like(x3), torch.empty_like(x3)
    rstd = torch.empty(m, 1, device="cuda")
    partial = torch.empty(bwd.partial_shape, device="cuda")
    dw = torch.empty_like(w)

    def forward():
        kernels.forward(fwd, feats, x=x3, weight=w3, bias=None, residual=None, y=y,
                        residual_out=None, mean=None, rstd=rstd, eps=1e-6)

    def backward():
        kernels.backward(bwd, feats, dy=dy3, h=x3, weight=w3, mean=None, rstd=rstd, dres_in=None,
                         dx=dx, dres=None, partial_w=partial, partial_b=None, dweight=dw,
                         dbias=None)

    forward()
    f, b = graph_ms(forward), graph_ms(backward)  # ms
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
    import cuda.tile as ct

    import tilenorm
    from tilenorm.pytorch import _norm

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    rc = _norm.recipe("rms_norm", False, True, x, w, None, None, None, None)
    _, _, _, rstd = _norm.kernel_forward(rc, x, w, None, None, 1e-6, 0.0)
    y3 = torch.empty(rc.shape3, dtype=x.dtype, device=x.device)
    kernel, grid, args = kernels.forward_launch(
        rc.route.forward, rc.features, x.view(rc.shape3), kernels._placeholder(x.device, 0),
        w.view(1, 1, -1), kernels._placeholder(x.device, 2), y3,
        kernels._placeholder(x.device, 3), kernels._placeholder(x.device, 4),
        rstd.view(256, 1), 1e-6, 0.0)
    stream = kernels._stream(x.device)
    steps = {
        "recipe lookup": lambda: _norm.recipe("rms_norm", False, True, x, w, None, None, None,
                                              None),
        "view 3-d": lambda: x.view(rc.shape3),
        "current_device": torch.cuda.current_device,
        "empty y": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "empty rstd": lambda: torch.empty(256, 1, dtype=torch.float32, device=x.device),
        "ct.launch": lambda: ct.launch(stream, grid, kernel, args),
        "kernel_forward": lambda: _norm.kernel_forward(rc, x, w, None, None, 1e-6, 0.0),
        "rms_norm_forward": lambda: tilenorm.rms_norm_forward(x, w, 1e-6),
        "rms_norm_backward": lambda: tilenorm.rms_norm_backward(x, x, w, rstd),
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
