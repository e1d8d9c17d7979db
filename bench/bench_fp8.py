"""Benchmark of the FP8-output RMSNorm (tilenorm.fp8) beside the unfused paths, in one process:

    tilenorm fused      tilenorm.fp8.rms_norm_forward: the norm writes FP8 (and its scales)
    tilenorm + torch    tilenorm.rms_norm_forward (bf16 y), then torch's quantization of y
    torch.compile       torch.compile of the same norm + amax + quantize (+ transpose) math

No peer with a fused FP8 norm is installed on the GPU host (Transformer Engine is not in the
wheelhouse); the rows say so rather than leave it out silently.

    python bench/bench_fp8.py --experimental                  # every case, ~10 minutes
    python bench/bench_fp8.py --experimental --shapes 32768x4096 --scalings tensor,row
    python bench/bench_fp8.py --report RECORD.json            # targets and plot again

Shapes are of bf16 x (256 MB at the defaults); a case of FP8 x (``fp8x-row``) takes twice
their rows (:func:`case_rows`), so that its E4M3 x too holds 256 MB, as issue 19 asks of x
(with half of it, the kernel's fixed start and its last round of rows were ~7% of its
time on an H200, ncu: bench/NOTES.md #130).

GB/s are of the bytes each scaling must move in one pass (read x, write q and its scales,
rstd, and the transposed copy where asked), for every provider alike; ``own_bound_pct`` is
against the design's bytes: x read twice for the per-tensor current scaling (its amax must
be known before the first value is scaled) and for every transposed copy (its scales run
along M, so a scale needs 32-128 whole rows normalized first: more than an SM holds at
these widths; NOTES #56). Beside the device-to-device copy bandwidth measured in the same
run; each provider's q is checked first (against float64 for tilenorm, against tilenorm's
dequantized output for the others). Targets (issue 19), judged in the record's
``targets``: per-row and per-block (1 x 128 and MX's 1 x 32) >= 90% of copy, per-tensor
current >= 85% of its own bound, transposed >= 80% of copy (of the design's bytes; the
one-pass share is printed beside it), and >= 1.3x the unfused path on every shape.
Cases ``row+t``, ``block+t`` and ``mx+t`` write the copy with scales along M; ``fp8x-row``
reads x in E4M3 with one fp32 multiplier per 128 elements of a row (dequantized in the
kernel) and writes row-scaled FP8: its unfused path dequantizes x with torch first.

``--kernel-times`` also runs each fused call 20 more times under ``torch.profiler`` and keeps
the GPU microseconds a call of each kernel it launches (``kernel_us`` of its rows, in launch
order, printed under the summary): which step of a case of several kernels takes the time,
e.g. ``--scalings row+t,mx+t --kernel-times`` (bench/NOTES.md #120).

``--variants`` compares launch settings instead of providers: a JSON list of objects, each
of :class:`tilenorm.settings_fp8.Fp8Settings` fields and, for the row kernels,
:class:`tilenorm.settings.RowNormSettings` fields (added to ``row_overrides``), e.g.
``'[{}, {"tile_elements": {"forward": 16384, "backward": 4096}}]'``; only the fused kernels
run, each variant's plan beside its numbers. The CuTe DSL row kernel's tables take width
keys, e.g. ``--scalings fp8x-row --variants '[{}, {"cute_forward_fp8_input": {"4096":
[256, 4, 2]}}]'`` (with ``--experimental``, as ``fp8x-row`` itself: the CuTe kernel is
experimental until validated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tilenorm  # noqa: E402
from bench import common  # noqa: E402
from bench.tune_norm import settings_value, variant_settings  # noqa: E402
from tilenorm import dispatch, settings_fp8, testing  # noqa: E402
from tilenorm.device import device_info  # noqa: E402
from tilenorm.pytorch import calls, reference  # noqa: E402

EPS = 1e-6
#: Hidden sizes 2048 to 16384 with x of 256 MB in bf16.
DEFAULT_SHAPES = "65536x2048,32768x4096,16384x8192,8192x16384"
#: Each case: (scaling, transpose, FP8 input's group size or 0 for bf16 x).
CASES = {"tensor": ("tensor", False, 0), "delayed": ("delayed", False, 0),
         "row": ("row", False, 0), "block": ("block", False, 0), "mx": ("mx", False, 0),
         "tensor+t": ("tensor", True, 0), "delayed+t": ("delayed", True, 0),
         "row+t": ("row", True, 0), "block+t": ("block", True, 0), "mx+t": ("mx", True, 0),
         "fp8x-row": ("row", False, 128)}
DEFAULT_CASES = ",".join(CASES)
FP8 = torch.float8_e4m3fn
TOP = reference.fp8_max(FP8)
#: Issue 19's bars, as fractions of the copy bandwidth (of the design's bytes where the case
#: reads x twice) and of the unfused path's time.
TARGET_ONE_PASS = 0.90
TARGET_TENSOR_OWN = 0.85
TARGET_TRANSPOSED = 0.80
TARGET_SPEEDUP = 1.3
#: Eager calls of a fused case under torch.profiler (``--kernel-times``).
KERNEL_TIME_CALLS = 20


def case_rows(m: int, case: str) -> int:
    """The rows ``case`` runs for a shape of ``m`` rows of bf16 x: twice as many for FP8 x, so
    that x holds as many bytes."""
    return 2 * m if CASES[case][2] else m


def bytes_moved(m: int, n: int, itemsize: int, scaling: str, transpose: bool,
                group: int = 0) -> tuple[int, int]:
    """(one-pass bytes, the design's bytes): x read (with its group multipliers where it is
    FP8, ``group`` > 0), q written, scales, rstd, the copy and its scales; the design of
    per-tensor current scaling and of any transposed copy reads x twice."""
    def scale_bytes(rows: int, cols: int) -> int:
        return {"tensor": 4, "delayed": 4, "row": 4 * rows, "block": 4 * rows * -(-cols // 128),
                "mx": rows * -(-cols // 32)}[scaling]

    scales = scale_bytes(m, n)
    if transpose and scaling not in ("tensor", "delayed"):
        scales += scale_bytes(n, m)
    x_bytes = m * n * itemsize + (4 * m * (n // group) if group else 0)
    one = x_bytes + m * n * (2 if transpose else 1) + scales + 4 * m
    two_passes = scaling == "tensor" or transpose
    return one, one + (x_bytes if two_passes else 0)


def _torch_quantize_rows(yf: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) with scales along the rows of fp32 ``yf`` (whole blocks)."""
    m, n = yf.shape
    if scaling == "row":
        s = TOP / yf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        return (yf * s).clamp(-TOP, TOP).to(FP8), 1 / s
    block = reference.FP8_BLOCK_COLS[scaling]
    y3 = yf.view(m, n // block, block)
    a = y3.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    s = torch.exp2(-torch.ceil(torch.log2(a / TOP))) if scaling == "mx" else TOP / a
    q = (y3 * s).clamp(-TOP, TOP).to(FP8).view(m, n)
    return q, (1 / s).squeeze(2)


def torch_quantize(y: torch.Tensor, scaling: str, scale: torch.Tensor, transpose: bool):
    """Quantization as a torch user writes it: amax, scale, clamp, cast (fp32); a copy
    with scales along M quantizes y's transpose the same way."""
    yf = y.float()
    if scaling in ("row", "block", "mx"):
        out = _torch_quantize_rows(yf, scaling)
        return out + (_torch_quantize_rows(yf.t().contiguous(), scaling) if transpose else ())
    s = scale if scaling == "delayed" else TOP / yf.abs().amax().clamp(min=1e-12)
    q = (yf * s).clamp(-TOP, TOP).to(FP8)
    return (q, 1 / s) + ((q.t().contiguous(),) if transpose else ())


def compiled_fp8_norm(x, w, scaling: str, scale, transpose: bool, x_scale_inv=None,
                      group: int = 0):
    """The same (dequantize +) norm + amax + quantize (+ transpose) math, for torch.compile.
    MX scales leave as their bytes: inductor has no E8M0 type in its kernels (torch 2.13)."""
    xf = reference.dequantize_groups(x, x_scale_inv, group) if group else x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w
    q, scale_inv, amax, q_t, scale_inv_t = reference.fp8_quantize(y, scaling, FP8, scale,
                                                                  transpose)
    if scaling == "mx":
        scale_inv = scale_inv.view(torch.uint8)
        scale_inv_t = None if scale_inv_t is None else scale_inv_t.view(torch.uint8)
    return q, scale_inv, amax, q_t, scale_inv_t


def check_fused(out, x, w, scaling: str, x_scale_inv=None, group: int = 0) -> float:
    """tilenorm's q against float64, on the first rows (the largest rounding excess)."""
    rows = slice(0, min(x.shape[0], 2048))
    xs = x[rows]
    if group:
        xs = reference.dequantize_groups(xs, x_scale_inv[rows], group).double()
    ref = testing.float64_norm(xs, w)
    scale_inv = out.scale_inv
    if scaling in ("row", "block", "mx"):
        scale_inv = scale_inv[rows]
    return testing.fp8_rounding_excess(out.data[rows], scale_inv, scaling, ref.y, FP8)


def dequantized(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """q times its scales, whichever provider's layout: a scalar, (M, 1), or (M, blocks) in
    fp32 or E8M0 (or E8M0's bytes)."""
    if scale_inv.dtype in (torch.float8_e8m0fnu, torch.uint8):  # E8M0, or its bytes
        s = torch.pow(2.0, scale_inv.view(torch.uint8).float() - 127)
    else:
        s = scale_inv.float()
    if s.dim() == 2 and s.shape[1] > 1:
        s = s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    return q.float() * s


def fp8_variant(variant: dict, base: settings_fp8.Fp8Settings = settings_fp8.SM90_FP8
                ) -> settings_fp8.Fp8Settings:
    """``base`` (the device's FP8 settings) with ``variant``'s fields replaced;
    RowNormSettings fields join ``row_overrides``."""
    own = {f.name for f in dataclasses.fields(base)}
    row = {k: v for k, v in variant.items() if k not in own}
    rows = variant_settings(row)  # checks the names and converts lists as the settings hold
    changes = {k: settings_value(v) for k, v in variant.items() if k in own}
    return dataclasses.replace(base, **changes, row_overrides={
        **base.row_overrides, **{k: getattr(rows, k) for k in row}})


def forget_plans() -> None:
    """Drops the decisions and prepared calls made with the settings of before."""
    dispatch.decide_fp8.cache_clear()
    calls.clear()


def kernel_times(fn, calls: int = KERNEL_TIME_CALLS) -> dict[str, float]:
    """GPU microseconds a call of ``fn`` spends in each kernel it launches, over ``calls``
    calls under torch.profiler (CUPTI sees cuTile's and the CuTe DSL's launches alike), by
    kernel name in the order of their first launch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = {e.key: e.self_device_time_total for e in prof.key_averages()
              if e.device_type == DeviceType.CUDA}
    order = dict.fromkeys(e.name for e in prof.events() if e.name in totals)
    return {name: totals[name] / calls for name in order}


def run_case(m: int, n: int, case: str, modes: list[str], record: dict,
             variants: list[dict] | None = None, kernel_profile: bool = False) -> None:
    scaling, transpose, group = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    x_scale_inv = None
    if group:  # FP8 x as a previous layer's quantization leaves it: values and multipliers
        x_scale_inv = torch.rand(m, n // group, generator=g, device="cuda") + 0.5
        x = (x.float() * 64).clamp(-TOP, TOP).to(FP8)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    scale = torch.tensor([TOP / 6.0], device="cuda")
    one, design = bytes_moved(m, n, x.element_size(), scaling, transpose, group)
    x_kw = {"x_scale_inv": x_scale_inv, "group_size": group} if group else {}
    kw = {"scale": scale, **x_kw} if scaling == "delayed" else x_kw

    def fused():
        return tilenorm.fp8.rms_norm_forward(x, w, EPS, scaling=scaling, transpose=transpose,
                                             **kw)

    def unfused():
        xin = (reference.dequantize_groups(x, x_scale_inv, group).to(torch.bfloat16)
               if group else x)
        y = tilenorm.rms_norm_forward(xin, w, EPS)[0]
        return torch_quantize(y, scaling, scale, transpose)

    compiled = torch.compile(compiled_fp8_norm, dynamic=True)

    def compiled_call():
        return compiled(x, w, scaling, scale, transpose, x_scale_inv, group)

    row = {"op": f"rms_norm_fp8_{case}", "case": case, "dtype": str(x.dtype).split(".")[-1],
           "M": m, "N": n, "bytes": one, "design_bytes": design}
    args = (x, w, scaling, x_scale_inv, group)
    if variants is not None:
        info = device_info(torch.cuda.current_device())
        base = settings_fp8.fp8_settings_for(info.arch, info.device_class)
        for i, variant in enumerate(variants):
            settings = fp8_variant(variant, base)
            forget_plans()
            with settings_fp8.measuring(settings):
                decision = tilenorm.fp8.explain(x, w, scaling=scaling, transpose=transpose,
                                                **x_kw)
                print(f"v{i}: {(decision.cute_forward or decision.forward).describe()}; "
                      f"{', '.join(decision.kernels)}", flush=True)
                measure(f"tilenorm fused v{i}", fused, fused(), decision,
                        {**row, "variant": variant, "plan": str(decision)}, modes, record,
                        args, kernel_profile)
            forget_plans()
        return
    fused_out = fused()
    decision = tilenorm.fp8.explain(x, w, scaling=scaling, transpose=transpose, **x_kw)
    providers = {"tilenorm fused": fused, "tilenorm + torch": unfused,
                 "torch.compile": compiled_call}
    for name, fn in providers.items():
        measure(name, fn, fused_out, decision, row, modes, record, args, kernel_profile)
    record["rows"].append({**row, "provider": "fused FP8 peer", "mode": "graph",
                           "fwd_gbps": None, "bwd_gbps": None, "fwd_ms": None,
                           "bwd_ms": None, "fwd_err": None, "bwd_err": None,
                           "note": "none installed (Transformer Engine is not in the "
                                   "wheelhouse)"})


def measure(name: str, fn, fused_out, decision, row: dict, modes: list[str], record: dict,
            args: tuple, kernel_profile: bool = False) -> None:
    """Checks ``fn``'s output (provider ``name``; "tilenorm fused..." against float64, the
    others against ``fused_out``) and times it into ``record``; a failure is recorded.
    ``args``: (x, w, scaling, x_scale_inv, group) of the case; ``kernel_profile``: the fused
    rows keep :func:`kernel_times` as ``kernel_us``."""
    one, design = row["bytes"], row["design_bytes"]
    try:
        out = fn()
        if name.startswith("tilenorm fused"):
            err = check_fused(out, *args)
            if not err <= 1:
                raise AssertionError(f"q off the float64 reference by {err:.2f} rounding "
                                     f"bounds")
            if not decision.uses_kernel:
                raise AssertionError(f"not the kernels: {decision}")
        else:
            err = testing.rel_error(dequantized(out[0], out[1]),
                                    dequantized(fused_out.data, fused_out.scale_inv))
            if not err <= 0.05:
                raise AssertionError(f"dequantized output off tilenorm's by {err:.3f}")
        # The fused rows name the kernels that ran (the CuTe DSL ones need --experimental
        # until their family is validated).
        fused = name.startswith("tilenorm fused")
        ran = {"kernels": ", ".join(decision.kernels)} if fused else {}
        if fused and kernel_profile:
            ran["kernel_us"] = kernel_times(fn)
        rows = common.timed_rows(common.Prepared(fn, None, lambda: ()), one, 0, modes,
                                 {**row, **ran, "provider": name, "fwd_err": err,
                                  "bwd_err": None})
        for r in rows:  # each row keeps its run's copy bandwidth: records can merge
            r["copy_gbps"] = record["copy_gbps"]
            r["own_bound_pct"] = 100 * design / (r["fwd_ms"] * 1e-3) / 1e9 / r["copy_gbps"]
        record["rows"] += rows
    except Exception as e:  # a provider's failure is recorded, the sweep goes on
        traceback.print_exc()
        record["failures"].append(f"{row['op']} {row['M']}x{row['N']} {name}: {e}")


def _graph_rows(record: dict) -> dict:
    """{(case, M, N): {provider: graph-mode row}} of the rows that were timed."""
    by_key = {}
    for r in record["rows"]:
        if r.get("mode") == "graph" and r["fwd_gbps"] is not None:
            case = r.get("case", r["op"].removeprefix("rms_norm_fp8_"))
            by_key.setdefault((case, r["M"], r["N"]), {})[r["provider"]] = r
    return by_key


def judge_targets(record: dict) -> list[dict]:
    """Issue 19's bars for every (case, shape) of the record: the fused kernel's share of
    the copy bandwidth (of the design's bytes where x is read twice) and its speed-up over
    the unfused path, each with the bar it is held to and whether it is met."""
    out = []
    for (case, m, n), providers in _graph_rows(record).items():
        fused, unfused = providers.get("tilenorm fused"), providers.get("tilenorm + torch")
        if fused is None:
            continue
        scaling, transpose, _ = CASES[case]
        one_pass = fused["fwd_gbps"] / fused.get("copy_gbps", record["copy_gbps"])
        design = fused["own_bound_pct"] / 100
        if transpose:
            bar, share, what = TARGET_TRANSPOSED, design, "of copy, design bytes (x twice)"
        elif scaling == "tensor":
            bar, share, what = TARGET_TENSOR_OWN, design, "of its own bound (x twice)"
        elif scaling in ("row", "block", "mx"):
            bar, share, what = TARGET_ONE_PASS, one_pass, "of copy, one pass"
        else:  # delayed: no bar of its own in the issue; held to the one-pass bar
            bar, share, what = TARGET_ONE_PASS, one_pass, "of copy, one pass (no issue bar)"
        speedup = unfused["fwd_ms"] / fused["fwd_ms"] if unfused else None
        out.append({"case": case, "M": m, "N": n, "share": share, "one_pass_share": one_pass,
                    "bar": bar, "what": what, "met": share >= bar,
                    "speedup_vs_unfused": speedup,
                    "speedup_met": speedup is not None and speedup >= TARGET_SPEEDUP})
    return out


def print_summary(record: dict) -> None:
    copy = record["copy_gbps"]
    print(f"\ncopy {copy:.0f} GB/s; graph-mode GB/s of the one-pass bytes (% of copy; "
          f"% of copy of the design's bytes)")
    for (case, m, n), providers in _graph_rows(record).items():
        cells = "  ".join(f"{name} {r['fwd_gbps']:.0f} ({100 * r['fwd_gbps'] / copy:.0f}%; "
                          f"{r['own_bound_pct']:.0f}%)" for name, r in providers.items())
        print(f"{case:>10} {m:>6}x{n:<6} {cells}")
    print("\ntargets (issue 19): the fused kernel's share against its bar; speed-up over "
          "tilenorm + torch (bar 1.3x)")
    for t in record.get("targets", []):
        speed = ("-" if t["speedup_vs_unfused"] is None
                 else f"{t['speedup_vs_unfused']:.2f}x {'ok' if t['speedup_met'] else 'MISSED'}")
        print(f"{t['case']:>10} {t['M']:>6}x{t['N']:<6} {100 * t['share']:5.1f}% "
              f"(bar {100 * t['bar']:.0f}% {t['what']}; one pass "
              f"{100 * t['one_pass_share']:.0f}%) {'ok' if t['met'] else 'MISSED'}  {speed}")
    for r in record["rows"]:
        if r.get("mode") == "graph" and r.get("kernel_us"):
            steps = ", ".join(f"{k[:48]} {us:.1f}" for k, us in r["kernel_us"].items())
            print(f"{r['case']:>10} {r['M']:>6}x{r['N']:<6} {r['provider']}: us a call: {steps}")
    for f in record["failures"]:
        print(f"FAILED {f}")


def plot(record: dict, path: Path) -> None:
    """One panel per case: graph-mode GB/s of the one-pass bytes against N, every provider,
    the copy bandwidth as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = _graph_rows(record)
    cases = [c for c in CASES if any(k[0] == c for k in by_key)]
    cols = 4
    fig, axes = plt.subplots(-(-len(cases) // cols), cols, figsize=(4.2 * cols, 3.4 * -(-len(
        cases) // cols)), sharey=True, squeeze=False)
    for ax, case in zip(axes.flat, cases, strict=False):
        keys = sorted(k for k in by_key if k[0] == case)
        for name in ("tilenorm fused", "tilenorm + torch", "torch.compile"):
            pts = [(k[2], by_key[k][name]["fwd_gbps"]) for k in keys if name in by_key[k]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.axhline(record["copy_gbps"], color="k", linestyle="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{case} (x {'E4M3' if CASES[case][2] else 'bf16'})", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s (one-pass bytes)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"FP8-output RMSNorm forward, {record['device']}, CUDA-graph kernel time, "
                 f"x 256 MB; N on the x axis", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--scalings", default=DEFAULT_CASES,
                        help=f"comma-separated cases of {', '.join(CASES)}")
    parser.add_argument("--variants", type=json.loads,
                        help="JSON list of settings variants to compare (fused kernels only)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="GPU us a call of each kernel of the fused cases (torch.profiler)")
    parser.add_argument("--report", type=Path,
                        help="judge the targets of a record and plot it again (no GPU)")
    common.add_run_args(parser)
    args = parser.parse_args(argv)
    if args.report:
        record = json.loads(args.report.read_text())
        record["targets"] = judge_targets(record)
        print_summary(record)
        args.report.write_text(json.dumps(record, indent=1) + "\n")
        plot(record, args.report.with_suffix(".png"))
        return
    record = common.new_record(args, families=("cutile/norm-fp8", "cute/norm-fp8"))
    if args.variants is not None:
        record["variants"] = args.variants
    modes = args.modes.split(",")
    path = args.out or common.RESULTS_DIR / (
        f"{common.device_slug()}-{record['date']}-fp8"
        f"{'-variants' if args.variants is not None else ''}-{record['commit']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    # A record split over several calls (one device call's limit): common.write_record keeps
    # the rows of cases not run now; their failures stay too.
    if path.exists():
        record["failures"] = json.loads(path.read_text()).get("failures", [])
    for m, n in common.parse_shapes(args.shapes):
        for case in args.scalings.split(","):
            rows = case_rows(m, case)
            print(f"{case} {rows}x{n}", flush=True)
            run_case(rows, n, case, modes, record, args.variants, args.kernel_times)
            torch.cuda.empty_cache()  # the next shape's inputs take the memory back
            common.write_record(record, path)  # a cut run keeps its rows
    if args.variants is None:
        record["targets"] = judge_targets(record)
        path.write_text(json.dumps(record, indent=1) + "\n")
        plot(record, path.with_suffix(".png"))
    print_summary(record)
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
