"""What holds LayerNorm below RMSNorm at the cluster widths (issue 20): LayerNorm's forward ran
at 85-92% of copy at 32768-131072 columns where RMSNorm's cluster forward gives 100-101%
(bench/NOTES.md #87). Each case runs through the public op (``tilenorm.layer_norm`` /
``tilenorm.rms_norm``, bf16 x), forward only (no autograd) and forward + backward
(``torch.autograd.grad`` of y against x and the parameters), timed by CUDA-graph replay in
rounds beside the device's copy bandwidth of the same run, the outputs and gradients checked
against float64 (:func:`tilenorm.testing.float64_norm`). The cases tell the parameters'
share (fp32, bf16, none) from the op's own (LayerNorm's mean beside RMSNorm): LayerNorm with
fp32 / bf16 weight and bias and without them, RMSNorm with an fp32 / bf16 weight.

    python bench/experiments/layer_norm_wide_probe.py --experimental --out R.json
    python bench/experiments/layer_norm_wide_probe.py --experimental --out R.json \
        --variants '[{}, {"cute_forward": {"layer_norm": {"65536": [256, 2, 3, 4]}}}]'

``--variants`` (a JSON list, as bench/bench_norm_ops.py takes it) runs every case under
each: the device's settings with the variant's fields replaced.

Bytes are those that must move (as bench/bench_norm_ops.py counts them): forward x and y,
the parameters, the statistics; forward + backward adds dy, x again and dx, the parameters
again and their gradients, the statistics again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench import common  # noqa: E402

#: (rows, columns): the cluster widths of #87, x of 256-512 MB.
SHAPES = ((4096, 32768), (4096, 65536), (1024, 131072))
#: name: (LayerNorm, parameter dtype or None (no weight, no bias)).
CASES = {
    "ln w32 b32": (True, torch.float32),
    "ln w16 b16": (True, torch.bfloat16),
    "ln no affine": (True, None),
    "rms w32": (False, torch.float32),
    "rms w16": (False, torch.bfloat16),
}


def operands(m: int, n: int, case: str, g: torch.Generator) -> dict:
    """Fresh operands of one case: x and dy (bf16), the parameters (None without them)."""
    layer_norm, pdtype = CASES[case]

    def randn(*shape, dtype=torch.bfloat16, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device="cuda")).to(dtype)

    w = randn(n, dtype=pdtype, scale=0.5, shift=1.0) if pdtype is not None else None
    b = randn(n, dtype=pdtype, scale=0.5) if layer_norm and pdtype is not None else None
    return {"x": randn(m, n, shift=0.5 if layer_norm else 0.0), "w": w, "b": b,
            "dy": randn(m, n), "eps": 1e-5 if layer_norm else 1e-6}


def bytes_moved(ops: dict, layer_norm: bool) -> tuple[int, int]:
    """(forward, forward + backward) bytes that must move."""
    x = ops["x"]
    mn = x.numel() * x.element_size()
    params = sum(t.numel() * t.element_size() for t in (ops["w"], ops["b"]) if t is not None)
    stats = 4 * x.shape[0] * (2 if layer_norm else 1)
    forward = 2 * mn + params + stats
    return forward, forward + 3 * mn + 2 * params + stats


def launches(ops: dict, layer_norm: bool):
    """The op's forward (no autograd) and forward + backward: closures returning y, and y
    with the gradients of x, w and b (None where absent)."""
    import tilenorm

    x, w, b, dy, eps = ops["x"], ops["w"], ops["b"], ops["dy"], ops["eps"]
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]

    def norm(x, w, b):
        if layer_norm:
            return tilenorm.layer_norm(x, w, b, eps=eps)
        return tilenorm.rms_norm(x, w, eps=eps)

    def forward():
        with torch.no_grad():
            return norm(x, w, b)

    def forward_backward():
        y = norm(*leaves)
        wrt = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(y, wrt, dy))
        return (y.detach(), *(next(grads) if t is not None else None for t in leaves))

    return forward, forward_backward


def errors(ops: dict, layer_norm: bool, forward, forward_backward) -> dict:
    """Relative errors against float64: y of the forward, y and every gradient of forward +
    backward."""
    x, w, b, dy, eps = ops["x"], ops["w"], ops["b"], ops["dy"], ops["eps"]
    y_fwd = forward()
    y, dx, dw, db = forward_backward()
    torch.cuda.synchronize()
    fwd = common.float64_errors({"y": y_fwd}, x, w, b, eps, layer_norm=layer_norm)
    both = common.float64_errors({"y": y, "dx": dx, "dweight": dw, "dbias": db}, x, w, b,
                                 eps, layer_norm=layer_norm, dy=dy)
    return {"fwd_err": fwd["y"], "fwd_bwd_err": max(both.values()), "errors": both}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON record")
    ap.add_argument("--experimental", action="store_true",
                    help="let tilenorm run kernels not yet validated on a GPU")
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", type=json.loads, default=[{}],
                    help="JSON list of settings variants (default: the device's settings)")
    args = ap.parse_args(argv)
    from bench.tune_norm import measuring_variant

    record = common.new_record(args)
    record["rounds"] = args.rounds
    record["variants"] = args.variants
    g = torch.Generator(device="cuda").manual_seed(87)
    for m, n in common.parse_shapes(args.shapes):
        for case in args.cases.split(","):
            for i, variant in enumerate(args.variants):
                with measuring_variant(variant):
                    run_case(record, args, m, n, case, g, i)
    copy = record["copy_gbps"]
    print(f"\n% of copy ({copy:.0f} GB/s), CUDA-graph time, median of {args.rounds} rounds")
    print(f"{'M x N':>13} {'case':>12} {'variant':>7} {'fwd':>6} {'fwd+bwd':>8}")
    for r in record["rows"]:
        print(f"{r['M']:>6}x{r['N']:<6} {r['case']:>12} {'v' + str(r['variant']):>7} "
              f"{r['fwd_pct_copy']:6.1f} {r['fwd_bwd_pct_copy']:8.1f}")
    for failure in record["failures"]:
        print("FAILED", failure)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


def run_case(record: dict, args, m: int, n: int, case: str, g: torch.Generator,
             variant: int) -> None:
    """One case under the settings in force: its row (or failure) into ``record``."""
    import tilenorm

    layer_norm, _ = CASES[case]
    ops = operands(m, n, case, g)
    decision = tilenorm.explain(ops["x"], ops["w"], bias=ops["b"], layer_norm=layer_norm)
    row = {"case": case, "M": m, "N": n, "variant": variant,
           "kernels": list(decision.kernels), "status": decision.status,
           "plan": str(decision)}
    try:
        forward, forward_backward = launches(ops, layer_norm)
        row.update(errors(ops, layer_norm, forward, forward_backward))
        times = {"fwd": [], "fwd_bwd": []}
        for _ in range(args.rounds):
            times["fwd"].append(common.graph_ms(forward))
            times["fwd_bwd"].append(common.graph_ms(forward_backward))
    except Exception as e:  # one case's failure is recorded, the others still run
        record["failures"].append(f"{m}x{n} {case} v{variant}: {type(e).__name__}: {e}")
        print("FAILED", record["failures"][-1], flush=True)
        return
    for name, moved in zip(("fwd", "fwd_bwd"), bytes_moved(ops, layer_norm), strict=True):
        ms = sorted(times[name])[len(times[name]) // 2]
        gbps = moved / (ms * 1e-3) / 1e9
        row.update({f"{name}_ms": ms, f"{name}_gbps": gbps,
                    f"{name}_pct_copy": 100 * gbps / record["copy_gbps"]})
    record["rows"].append(row)
    print(f"{m:>5}x{n:<6} {case:>12} v{variant}  fwd {row['fwd_pct_copy']:5.1f}%  fwd+bwd "
          f"{row['fwd_bwd_pct_copy']:5.1f}%  err {row['fwd_err']:.1e} / "
          f"{row['fwd_bwd_err']:.1e}  {', '.join(row['kernels'])}", flush=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
