"""Probe (GPU): the CuTe DSL FP8-output RMSNorm forward (tilenorm/kernels/cute_row_norm_fp8.py)
launched directly, beside the op (``tilenorm.fp8``, the kernels it decides on) on the same
inputs (issue 19, bench/NOTES.md #56, #57). Records before 988bfe4 name the op's rows
"cuTile op": then the op ran the cuTile kernels; records before #109 time a kernel compiled
for the shape's row count, and name the other "runtime rows".

For each shape: every launch configuration of ``--configs`` with row scaling, then the best
one with every other scaling. Each launch is checked first: q against float64 at its own
scales (``tilenorm.testing.fp8_rounding_excess`` <= 1), rstd, the amax partials, scales
never NaN where x is finite, two runs bit-identical, outputs poisoned before each; then timed
under CUDA-graph replay. GB/s are of the one-pass bytes (``bench_fp8.bytes_moved``) beside
the copy bandwidth of the same run.

    TILENORM_EXPERIMENTAL=1 python bench/experiments/cute_fp8_probe.py --out probe.json

``--compile-only sm_90a`` needs no GPU: it compiles the kernel without flags ("shipped") and
``--variant``'s at ``--configs`` for ``--scalings`` and prints each cubin's registers and
spills.

``--variant``: the kernel's ``recompute_t`` flag (recompute-t) or its ``clamp`` (clamp: each
value clamped to +-fp8_max before the FP8 conversion, #117, #125), compiled and timed right
after the kernel without it at the same configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tilenorm  # noqa: E402
from bench import bench_fp8, common  # noqa: E402
from tilenorm import testing  # noqa: E402
from tilenorm.device import device_info  # noqa: E402
from tilenorm.launch import cute  # noqa: E402
from tilenorm.pytorch import reference  # noqa: E402

FP8 = torch.float8_e4m3fn
EPS = 1e-6
#: (threads, stages, CTAs per SM) per width.
CONFIGS = {
    2048: [(256, 2, 2), (256, 4, 2), (256, 4, 3), (128, 4, 4), (256, 8, 2)],
    4096: [(256, 2, 2), (256, 4, 2), (256, 4, 3), (512, 4, 1), (128, 4, 4)],
    8192: [(256, 2, 2), (256, 4, 2), (512, 2, 2), (512, 4, 1), (1024, 2, 1)],
    16384: [(512, 2, 2), (512, 4, 1), (1024, 2, 1), (256, 2, 2), (1024, 4, 1)],
}
SCALINGS = ("row", "block", "mx", "delayed", "amax")
#: ``--variant``: name -> the kernel's flag it sets, ``recompute_t`` (#74; #58's
#: LeanBlockScales, once timed here, is the kernel's block path since #100) or ``clamp``
#: (#117, #125).
VARIANTS = {"recompute-t": "recompute_t", "clamp": "clamp"}


def variant_of(key: cute.Fp8ForwardKey, variant: str | None) -> cute.Fp8ForwardKey:
    """``key`` as ``variant`` (None: the kernel's own) compiles it."""
    return dataclasses.replace(key, **{VARIANTS[variant]: True}) if variant else key


def outputs(m: int, n: int, scaling: str, grid: int, row_major_blocks: bool = False
            ) -> dict[str, torch.Tensor | None]:
    """Poisoned outputs: NaN floats, 0xFF bytes (NaN in E4M3 and E8M0)."""
    dev = "cuda"
    q = None if scaling == "amax" else torch.full((m, n), 0xFF, dtype=torch.uint8, device=dev)
    if scaling == "row":
        q_scale = torch.full((m, 1), float("nan"), device=dev)
    elif scaling == "block" and row_major_blocks:
        q_scale = torch.full((m, n // 128), float("nan"), device=dev)
    elif scaling == "block":
        q_scale = torch.full((n // 128, m), float("nan"), device=dev).t()
    elif scaling == "mx":
        q_scale = torch.full((m, n // 32), 0xFF, dtype=torch.uint8, device=dev)
    else:
        q_scale = None
    amax = (torch.full((grid,), float("nan"), device=dev)
            if scaling in ("amax", "delayed") else None)
    return {"q": q, "q_scale": q_scale, "rstd": torch.full((m,), float("nan"), device=dev),
            "amax": amax}


def check(out: dict, x: torch.Tensor, w: torch.Tensor, scaling: str, scale: torch.Tensor
          ) -> float:
    """The largest rounding excess over the first 2048 rows (<= 1 passes), after the checks
    that every output was written."""
    rows = slice(0, min(x.shape[0], 2048))
    ref = testing.float64_norm(x[rows], w, eps=EPS)
    rstd_err = testing.rel_error(out["rstd"][rows], ref.rstd)
    assert out["rstd"].isfinite().all(), "rstd left unwritten"
    assert rstd_err < 1e-5, f"rstd off by {rstd_err:.1e}"
    if scaling in ("amax", "delayed"):  # every row's |y|, in fp32 on the GPU
        assert out["amax"].isfinite().all(), "amax partials left unwritten"
        xf = x.float()
        want = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w.float()
                ).abs().max().item()
        got = out["amax"].max().item()
        assert abs(got - want) <= 1e-5 * want, f"amax {got} vs {want}"
    if scaling == "amax":
        return 0.0
    q = out["q"][rows]
    assert not (q == 0xFF).all(dim=1).any(), "a row of q left unwritten"
    q = q.view(FP8)
    if scaling == "delayed":
        scale_inv = (1 / scale).reshape(())
    else:
        scale_inv = out["q_scale"][rows]
        if scaling == "mx":
            assert not (scale_inv == 0xFF).any(), "MX scales left unwritten"
        else:
            assert scale_inv.isfinite().all(), "scales left unwritten"
    return testing.fp8_rounding_excess(q, scale_inv, scaling, ref.y, FP8)


def run(key: cute.Fp8ForwardKey, x, w, scale, grid, row_major_blocks: bool = False):
    fn = (cute.compile_fp8_forward(key, row_major_block_scales=row_major_blocks)
          if row_major_blocks
          else cute.compiled_fp8_forward(key, torch.cuda.get_device_capability()))
    out = outputs(*x.shape, key.scaling, grid, row_major_blocks)

    def launch():
        fn(x, None, w, scale if key.scaling == "delayed" else None, out["q"], out["q_scale"],
           out["rstd"], out["amax"], EPS, 0.0, grid)
    return launch, out


def measure(m: int, n: int, scaling: str, config, info, record: dict, x, w, scale,
            row_major_blocks: bool = False, variant: str | None = None,
            static_rows: bool = False) -> dict:
    threads, stages, ctas = config
    grid = min(m, info.sm_count * ctas)
    key = cute.Fp8ForwardKey(m if static_rows else None, "bfloat16", "bfloat16",
                             "float8_e4m3fn", scaling, False, n, threads, stages, ctas)
    t0 = time.time()
    key = variant_of(key, variant)
    launch, out = run(key, x, w, scale, grid, row_major_blocks)
    compile_s = time.time() - t0
    launch()
    torch.cuda.synchronize()
    err = check(out, x, w, scaling, scale)
    def bits(v):
        return v.contiguous().view(torch.uint8)

    first = {k: None if v is None else bits(v).clone() for k, v in out.items()}
    for v in out.values():  # poison again: the rerun must write everything, identically
        if v is not None:
            v.fill_(float("nan") if v.is_floating_point() else 0xFF)
    launch()
    torch.cuda.synchronize()
    for k, v in out.items():
        if v is not None and not torch.equal(bits(v), first[k]):
            raise AssertionError(f"{k} differs between two runs")
    ms = common.graph_ms(launch)
    one = bench_fp8.bytes_moved(m, n, 2, scaling, False)[0] if scaling != "amax" else (
        m * n * 2 + 4 * m)  # pass 1 alone moves x and rstd
    if row_major_blocks:
        scaling = "block, row-major scales"
    if variant:
        scaling = f"{scaling}, {variant}"
    if static_rows:
        scaling = f"{scaling}, static rows"
    row = {"M": m, "N": n, "scaling": scaling, "config": list(config), "grid": grid,
           "err": err, "ms": ms, "gbps": one / (ms * 1e-3) / 1e9, "compile_s": compile_s}
    row["pct_copy"] = 100 * row["gbps"] / record["copy_gbps"]
    print(f"cute  {scaling:>7} {m}x{n} {config}: {row['gbps']:.0f} GB/s "
          f"({row['pct_copy']:.1f}%), err {err:.2f}, compile {compile_s:.1f} s", flush=True)
    record["rows"].append(row)
    return row


def op_row(m, n, scaling, record, x, w, scale) -> None:
    """The op (``tilenorm.fp8``, whichever kernels it decides on), same inputs, one-pass bytes
    of the same scaling."""
    kw = {"scale": scale} if scaling == "delayed" else {}
    s = "tensor" if scaling == "amax" else scaling
    ms = common.graph_ms(lambda: tilenorm.fp8.rms_norm_forward(x, w, EPS, scaling=s, **kw))
    one, _ = bench_fp8.bytes_moved(m, n, 2, s, False)
    gbps = one / (ms * 1e-3) / 1e9
    record["rows"].append({"M": m, "N": n, "scaling": s, "config": "op", "ms": ms,
                           "gbps": gbps, "pct_copy": 100 * gbps / record["copy_gbps"]})
    print(f"op    {s:>7} {m}x{n}: {gbps:.0f} GB/s ({100 * gbps / record['copy_gbps']:.1f}%)",
          flush=True)


def compile_only(arch: str, shapes, configs: dict, scalings: list[str],
                 variant: str | None) -> None:
    """Compile the kernel without flags and ``variant`` at each shape's configurations for
    ``arch`` without a GPU and print registers, stack bytes and spill stores / loads
    (``STL`` / ``LDL`` in the SASS): what two CTAs of 256 threads at 16384 columns (128
    registers a thread) need (issue 19)."""
    from bench.kernel_resources import cubin_resources, cuobjdump, keeping_cubins

    tool = cuobjdump()
    print(f"{'shape':>12} {'config':>14} {'scaling':>8} {'kernel':>22} {'regs':>5} "
          f"{'stack':>6} {'STL/LDL':>9}")
    for m, n in shapes:
        for config in configs.get(n, []):
            for scaling in scalings:
                shipped = cute.Fp8ForwardKey(None, "bfloat16", "bfloat16", "float8_e4m3fn",
                                             scaling, False, n, *config)
                for name in ("shipped", variant) if variant else ("shipped",):
                    key = variant_of(shipped, None if name == "shipped" else name)
                    with tempfile.TemporaryDirectory() as tmp:
                        try:
                            with keeping_cubins(tmp):
                                cute.compile_fp8_forward(key, arch)
                            r = cubin_resources(sorted(Path(tmp).rglob("*.cubin"))[0], tool)[0]
                        except Exception as e:
                            print(f"{m}x{n:<6} {str(config):>14} {scaling:>8} {name:>22} "
                                  f"FAILED {type(e).__name__}: {e}", flush=True)
                            continue
                    flag = "  SPILLS" if r["stack"] or r["spill_stores"] else ""
                    print(f"{m}x{n:<6} {str(config):>14} {scaling:>8} {name:>22} "
                          f"{r['registers']:>5} {r['stack']:>6} "
                          f"{r['spill_stores']:>4}/{r['spill_loads']:<4}{flag}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=bench_fp8.DEFAULT_SHAPES)
    parser.add_argument("--out", type=Path, help="the record (JSON); required but with "
                                                 "--compile-only")
    parser.add_argument("--configs", type=json.loads,
                        help='JSON {"cols": [[threads, stages, ctas], ...]} replacing CONFIGS')
    parser.add_argument("--scalings", default=",".join(SCALINGS[1:]),
                        help="the scalings run with each shape's best row configuration")
    parser.add_argument("--row-major-blocks", action="store_true",
                        help="also time block scaling with row-major scales (NOTES #57)")
    parser.add_argument("--variant", choices=list(VARIANTS),
                        help="also time this kernel variant: recompute-t (the kernel's "
                             "recompute_t, NOTES #74) or clamp (its clamp before the FP8 "
                             "conversion, NOTES #117, #125)")
    parser.add_argument("--variant-configs", type=json.loads,
                        help='JSON {"cols": [[threads, stages, ctas], ...]}: time --variant '
                             "at these instead of the shipped kernel's best row configuration")
    parser.add_argument("--static-rows", action="store_true",
                        help="also time each scaling compiled for the shape's row count only "
                             "(the ops compile one kernel for every row count, NOTES #109)")
    parser.add_argument("--compile-only", metavar="ARCH",
                        help="no GPU: compile for ARCH (e.g. sm_90a) at --configs for "
                             "--scalings and print registers and spills")
    args = parser.parse_args()
    configs = {int(k): [tuple(c) for c in v] for k, v in (args.configs or {}).items()}
    configs = {**CONFIGS, **configs}
    variant_configs = {int(k): [tuple(c) for c in v]
                       for k, v in (args.variant_configs or {}).items()}
    if args.compile_only:
        compile_only(args.compile_only, common.parse_shapes(args.shapes), configs,
                     args.scalings.split(","), args.variant)
        return
    if args.out is None:
        parser.error("--out is required (but with --compile-only)")
    tilenorm.set_experimental(True)
    info = device_info(torch.cuda.current_device())
    copy = common.copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(),
              "copy_gbps": copy, "rows": [], "failures": []}
    print(f"{record['device']}: copy {copy:.0f} GB/s", flush=True)
    for m, n in common.parse_shapes(args.shapes):
        g = torch.Generator(device="cuda").manual_seed(m + n)
        x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
        w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
        scale = torch.tensor([reference.fp8_max(FP8) / 6.0], device="cuda")
        best = None
        for config in configs[n]:
            try:
                row = measure(m, n, "row", config, info, record, x, w, scale)
                if best is None or row["gbps"] > best["gbps"]:
                    best = row
            except Exception as e:
                traceback.print_exc(limit=3)
                record["failures"].append(f"row {m}x{n} {config}: {type(e).__name__}: {e}")
        op_row(m, n, "row", record, x, w, scale)
        for scaling in args.scalings.split(","):
            if best is None:
                break
            try:
                measure(m, n, scaling, tuple(best["config"]), info, record, x, w, scale)
                if scaling == "block" and args.row_major_blocks:
                    measure(m, n, scaling, tuple(best["config"]), info, record, x, w, scale,
                            row_major_blocks=True)
                if args.variant:
                    for config in variant_configs.get(n, [tuple(best["config"])]):
                        measure(m, n, scaling, config, info, record, x, w, scale,
                                variant=args.variant)
                if args.static_rows:
                    measure(m, n, scaling, tuple(best["config"]), info, record, x, w, scale,
                            static_rows=True)
                op_row(m, n, scaling, record, x, w, scale)
            except Exception as e:
                traceback.print_exc(limit=3)
                record["failures"].append(f"{scaling} {m}x{n}: {type(e).__name__}: {e}")
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        del x
        torch.cuda.empty_cache()
    print("\nsummary (GB/s, % of copy)")
    for r in record["rows"]:
        print(f"{r['scaling']:>7} {r['M']:>6}x{r['N']:<6} {str(r['config']):>16} "
              f"{r['gbps']:6.0f} {r['pct_copy']:5.1f}%")
    for f in record["failures"]:
        print("FAILED", f)


if __name__ == "__main__":
    main()
