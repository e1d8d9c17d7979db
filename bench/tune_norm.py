"""Planner experiments for the norm kernels: GB/s, error and rerun repeatability of each
variant on each case, and (``--host``) the host time of the launch-level functions. Results
feed bench/NOTES.md; the winners become planner defaults.

A variant is a JSON object of planner module settings to override (lists for tuples),
e.g. ``{"SINGLE_PASS_HINTS": {"forward": {"rms_norm": [[2048, 4, null, false], [32768, 1, 8,
true]], "layer_norm": [[32768, 1, 8, true]]}, "backward": {...}}}`` or ``{"TILE_ELEMENTS":
{"forward": 16384, "backward": 4096}}``: the planner derives grids and partial buffers as it
does for users. A case is ``op:N`` or ``op:N:M`` with op one of rms, layer_norm, offset,
residual, per_head (32 heads of N / 32); M defaults to making x 256 MiB.

    python bench/tune_norm.py --cases rms:4096,layer_norm:4096 \\
        --variants '[{}, {"CHUNKED_HINTS": {"forward": [2, null], "backward": [1, 8]}}]'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tilenorm import planner, reference  # noqa: E402
from tilenorm.benchmark import graph_ms, host_us  # noqa: E402
from tilenorm.cutile import norm as kernels  # noqa: E402
from tilenorm.cutile.norm import NormFeatures  # noqa: E402
from tilenorm.device import device_info  # noqa: E402

DEFAULT_CASES = "rms:128,rms:1024,rms:4096,rms:8192,rms:16384,rms:65536"
FEATURES = {
    "rms": NormFeatures(),
    "layer_norm": NormFeatures(layer_norm=True, has_bias=True),
    "offset": NormFeatures(has_offset=True),
    "residual": NormFeatures(has_residual=True),
    "per_head": NormFeatures(),
}
X_BYTES = 256 << 20


def _tuples(value):
    """JSON lists as the tuples the planner's settings are."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def with_overrides(overrides: dict) -> dict:
    """Set planner module settings; returns the previous values."""
    saved = {k: getattr(planner, k) for k in overrides}
    for key, value in overrides.items():
        setattr(planner, key, _tuples(value))
    planner.plan_row_norm.cache_clear()
    return saved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure_case(info, op: str, n: int, m: int | None = None) -> dict:
    heads = 32 if op == "per_head" else 1
    cols = n // heads
    m = m or X_BYTES // (2 * n)
    f = FEATURES[op]
    offset = 1.0 if f.has_offset else 0.0
    x = torch.randn(m, heads, cols, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    # LayerNorm's parameters in fp32, as bench_norm_ops.py (and torch autocast) has them.
    w = torch.randn(1, 1, cols, device="cuda",
                    dtype=torch.float32 if f.layer_norm else torch.bfloat16)
    b = torch.randn_like(w) if f.has_bias else None
    r = torch.randn_like(x) if f.has_residual else None
    dres_in = torch.randn_like(x) if f.has_residual else None
    kind = "layer_norm" if f.layer_norm else "rms_norm"
    fwd, bwd = (planner.plan_row_norm(m, cols, heads=heads, itemsize=2,
                                      sm_count=info.sm_count, arch=info.arch, direction=d,
                                      op=kind)
                for d in ("forward", "backward"))
    y, dx = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    h = torch.full_like(x, float("nan")) if f.has_residual else x
    mean = torch.empty(m, heads, device="cuda") if f.layer_norm else None
    rstd = torch.empty(m, heads, device="cuda")
    dw = torch.empty_like(w)
    db = torch.empty_like(w) if f.has_bias else None
    partial = kernels.partial_buffer(bwd, dw, db)

    def forward():
        kernels.forward(fwd, f, x=x, weight=w, bias=b, residual=r, y=y,
                        residual_out=h if f.has_residual else None, mean=mean, rstd=rstd,
                        eps=1e-6, offset=offset)

    def backward():
        kernels.backward(bwd, f, dy=dy, h=h, weight=w, mean=mean, rstd=rstd, dres_in=dres_in,
                         dx=dx, dres=None, partial=partial, dweight=dw, dbias=db,
                         offset=offset)

    forward()
    backward()
    ref_y, ref_h, ref_mean, ref_rstd = reference.norm_forward(
        x, w.view(-1), None if b is None else b.view(-1), 1e-6, layer_norm=f.layer_norm,
        offset=offset, residual=r)
    ref_dx, _, ref_dw, _ = reference.norm_backward(
        dy, dres_in, ref_h, w.view(-1), None, ref_mean, ref_rstd, offset=offset)
    errors = {"fwd_err": _rel(y, ref_y), "bwd_err": _rel(dx, ref_dx),
              "dw_err": _rel(dw.view(-1), ref_dw)}
    del ref_y, ref_h, ref_mean, ref_rstd, ref_dx
    arrays = x.numel() * 2
    fwd_bytes = arrays * (4 if f.has_residual else 2)
    bwd_bytes = arrays * (4 if f.has_residual else 3)
    first = [t.clone() for t in (y, dx, dw)]
    f_ms, b_ms = _time_once((op, m, n, fwd), forward), _time_once((op, m, n, bwd), backward)
    forward()
    backward()
    changed = [name for name, a, t in zip(("y", "dx", "dweight"), first, (y, dx, dw),
                                          strict=True) if not torch.equal(a, t)]
    return {"op": op, "M": m, "N": n, "fwd_gbps": fwd_bytes / f_ms / 1e6,
            "bwd_gbps": bwd_bytes / b_ms / 1e6, **errors, "changed_on_rerun": changed,
            "fwd_plan": fwd.describe(), "bwd_plan": bwd.describe()}


_timed: dict = {}


def _time_once(key, fn) -> float:
    """Graph-replay ms of ``fn``; a plan already timed on this case (in an earlier variant)
    is not timed again."""
    if key not in _timed:
        _timed[key] = graph_ms(fn)
    return _timed[key]


def run_variant(variant: dict, cases: list[tuple]) -> Iterator[dict]:
    """Each case's row under ``variant``, as soon as it is measured."""
    saved = with_overrides(variant)
    info = device_info(torch.cuda.current_device())
    try:
        for case in cases:
            yield {"variant": variant, **measure_case(info, *case)}
    finally:
        with_overrides(saved)


def host_breakdown(calls: int = 3000) -> dict:
    """Microseconds per call of the public launch-level functions on a tiny shape."""
    import tilenorm

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    _, h, rstd = tilenorm.rms_norm_forward(x, w, 1e-6)
    steps = {
        "empty_like": lambda: torch.empty_like(x),
        "rms_norm_forward": lambda: tilenorm.rms_norm_forward(x, w, 1e-6),
        "rms_norm_backward": lambda: tilenorm.rms_norm_backward(x, h, w, rstd),
        "rms_norm (autograd off)": lambda: tilenorm.rms_norm(x, w, 1e-6),
    }
    return {name: host_us(fn, calls) for name, fn in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="[{}]", help="JSON list of variants")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--host", action="store_true", help="also time the host path")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [(op, *map(int, sizes)) for op, *sizes in (c.split(":") for c in args.cases.split(","))]
    results = {"host_us": host_breakdown() if args.host else {}, "rows": []}
    for name, us in results["host_us"].items():
        print(f"host {name:>24}: {us:6.2f} us")
    for variant in json.loads(args.variants):
        for row in run_variant(variant, cases):
            results["rows"].append(row)
            changed = row["changed_on_rerun"]
            print(f"{json.dumps(variant):>60} {row['op']:>10} {row['M']:>7}x{row['N']:<6}: "
                  f"fwd {row['fwd_gbps']:5.0f} bwd {row['bwd_gbps']:5.0f} GB/s  err "
                  f"{row['fwd_err']:.1e} {row['bwd_err']:.1e} {row['dw_err']:.1e}"
                  f"{'  CHANGED ON RERUN: ' if changed else ''}{','.join(changed)}", flush=True)
            if args.out:  # after every row: a run cut short keeps what it measured
                args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
