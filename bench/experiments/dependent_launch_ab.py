"""Programmatic dependent launch as planned against ordinary launches, on the same inputs in
one process (bench/NOTES.md #27, #30): CUDA-graph kernel time of the forward, the backward
(with its dgamma/dbeta reduction) and the two back to back, whether every mode gives
bit-identical outputs, and dx's error against tilenorm.testing's float64 reference. Modes:
``ordinary`` (no kernel waits on its predecessor; the grid-dependency instructions are
compiled out), ``reduce`` (only the reduction is a dependent launch), ``planned`` (what the
planner chooses: the row kernels too where their rows are whole 16-element groups, up to the
settings' width). The cuTile kernels, launched from raw pointers as the ops launch them.

    python bench/experiments/dependent_launch_ab.py [--cases rms:32768:128,layer_norm:32768:4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import common  # noqa: E402
from tilenorm import planner  # noqa: E402
from tilenorm.benchmark import graph_ms  # noqa: E402
from tilenorm.device import device_info  # noqa: E402
from tilenorm.launch import cutile  # noqa: E402
from tilenorm.launch.cutile import NormFeatures  # noqa: E402
from tilenorm.pytorch.calls import tensor_launcher  # noqa: E402

DEFAULT_CASES = "rms:32768:128,rms:32768:4096,layer_norm:32768:4096,layer_norm:131072:1024"
MODES = ("ordinary", "reduce", "planned")
EPS = 1e-5


def with_mode(plan: planner.RowNormPlan, mode: str) -> planner.RowNormPlan:
    return dataclasses.replace(plan, dependent_launch=plan.dependent_launch and mode == "planned",
                               dependent_reduce=plan.dependent_reduce and mode != "ordinary")


def run_mode(plans, f, x, dy, w, b, mode: str) -> tuple[dict, list]:
    """Times and outputs of one launch mode."""
    fwd, bwd = (with_mode(p, mode) for p in plans)
    m, ln = x.shape[0], f.layer_norm
    y = torch.full_like(x, float("nan"))
    dx = torch.full_like(x, float("nan"))
    mean = torch.empty(m, 1, device="cuda") if ln else None
    rstd = torch.empty(m, 1, device="cuda")
    dw, db = torch.empty_like(w), (torch.empty_like(w) if ln else None)
    groups = 1 + ln
    partial = torch.empty(cutile.partial_shape(bwd, groups), device="cuda")
    slots, prows, pcols = partial.shape
    row_kernel = cutile.bind_backward(bwd, f, False, False)
    operands = dict(dy=dy, h=x, weight=w, mean=mean, rstd=rstd, dx=dx,
                    partial_w=partial[:, :prows // groups],
                    partial_b=partial[:, prows // groups:] if ln else None)
    first = None
    if row_kernel.first is not None:
        operands["row_sums"] = torch.empty((m, 1) + row_kernel.workspace, device="cuda")
        first = tensor_launcher(row_kernel.first, operands)
    launch_fwd = tensor_launcher(cutile.bind_forward(fwd, f), dict(
        x=x, weight=w, bias=b, y=y, mean=mean, rstd=rstd))
    launch_row = tensor_launcher(row_kernel, operands)
    launch_reduce = tensor_launcher(cutile.bind_reduce(bwd, groups), dict(
        partial=partial.view(slots, groups, prows // groups * pcols), out_a=dw.view(-1),
        out_b=None if db is None else db.view(-1)))

    def forward():
        launch_fwd(EPS, 0.0)

    def backward():
        if first is not None:
            first(0.0)
        launch_row(0.0)
        launch_reduce()

    def both():
        forward()
        backward()

    both()
    torch.cuda.synchronize()
    err = common.float64_errors({"dx": dx}, x, w.view(-1), None if b is None else b.view(-1),
                                EPS, layer_norm=ln, dy=dy)["dx"]
    times = {name: graph_ms(fn) * 1e3 for name, fn in
             (("fwd_us", forward), ("bwd_us", backward), ("fwd_bwd_us", both))}
    outputs = [t.clone() for t in (y, dx, dw) + (() if db is None else (db,))]
    return {"mode": mode, **times, "dx_err": err}, outputs


def measure(op: str, m: int, n: int) -> list[dict]:
    ln = op == "layer_norm"
    f = NormFeatures(layer_norm=ln, has_bias=ln)
    info = device_info(torch.cuda.current_device())
    x = torch.randn(m, 1, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(1, 1, n, device="cuda", dtype=torch.float32 if ln else torch.bfloat16)
    b = torch.randn_like(w) if ln else None
    kind = "layer_norm" if ln else "rms_norm"
    plans = [planner.plan_row_norm(m, n, itemsize=2, sm_count=info.sm_count, arch=info.arch,
                                   direction=d, op=kind) for d in ("forward", "backward")]
    runs = [run_mode(plans, f, x, dy, w, b, mode) for mode in MODES]
    base = runs[0][1]
    return [{"op": op, "M": m, "N": n, **row, "bit_identical_to_ordinary":
             all(torch.equal(a, c) for a, c in zip(base, out, strict=True))}
            for row, out in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(), "rows": []}
    for case in args.cases.split(","):
        op, m, n = case.split(":")
        for row in measure(op, int(m), int(n)):
            result["rows"].append(row)
            print(f"{op:>10} {row['M']:>7}x{row['N']:<6} {row['mode']:>8}"
                  f" fwd {row['fwd_us']:8.2f} us  bwd {row['bwd_us']:8.2f} us  fwd+bwd "
                  f"{row['fwd_bwd_us']:8.2f} us  dx err {row['dx_err']:.1e}  identical "
                  f"{row['bit_identical_to_ordinary']}", flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
