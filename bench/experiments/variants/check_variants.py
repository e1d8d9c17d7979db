"""CPU check of a variants file (``bench/experiments/variants/*.json``, as ``gpu_kit.sh
variants`` runs it) before its GPU run: each variant goes through the tools' own path on
a described device, an H200 by default (sm_90, 132 SMs, the h200 tables). For
bench_norm_ops that is ``bench.tune_norm.measuring_variant`` (the device's settings with the
variant's fields replaced) around the ops' dispatch: each shape's decision, as
``tilenorm.explain`` prints it (``--explain``), and the forward and backward kernel that its
plain bf16 RMSNorm / LayerNorm call runs; for tune_norm (``--cases op:N[:M]``, cuTile
only) ``tune_norm.variant_settings`` and the planner with those settings; for bench_fp8
``bench_fp8.fp8_variant`` (its FP8 settings fields, and row ones) around the FP8 ops'
dispatch: each case's CuTe row kernel launch (or cuTile's kernel), :func:`_fp8_runs`. A case's
``expect`` (one {shape: {"fwd", "bwd"}} a variant, in :func:`signature`'s words) is checked;
a variant that the tools would refuse, or whose plan differs, fails here, not on the GPU.
A case's ``patch`` ({"module.ATTRIBUTE": value}) is applied for its variants only.

With ``--compile`` every CuTe DSL kernel (sm_90a) and cuTile kernel (sm_90) those plans
launch is compiled here, no GPU, and its registers, stack and spill stores / loads read off
the cubin (``cuobjdump``: pip nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): a variant whose
kernel does not compile, or spills, shows before it costs device time.

    PYTHONPATH=. python bench/experiments/variants/check_variants.py \\
        bench/experiments/variants/narrow-h200.json --compile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import bench_fp8, common, tune_norm  # noqa: E402
from tilenorm import dispatch  # noqa: E402
from tilenorm.device import DeviceInfo  # noqa: E402
from tilenorm.planner import (  # noqa: E402
    CuteBackwardPlan,
    CuteClusterBackwardPlan,
    CuteForwardPlan,
    RowNormPlan,
    plan_row_norm,
)
from tilenorm.settings import H100_PEAK_BANDWIDTH, settings_for  # noqa: E402

DEVICES = {
    # The H200's HBM3e: 4.8 TB/s; any bandwidth above the H100 SXM's picks the h200 tables.
    "h200": DeviceInfo(0, "NVIDIA H200 (described)", 132, (9, 0), 60 << 20,
                       4_800_000_000_000),
    "h100": DeviceInfo(0, "NVIDIA H100 80GB HBM3 (described)", 132, (9, 0), 50 << 20,
                       H100_PEAK_BANDWIDTH),
}


def signature(plan) -> str:
    """A plan in a few words: ``cute T,R,C`` (forward: threads, rows a CTA, CTAs an SM[,
    cluster]), ``cute two-pass T,S,C`` (threads, vectors a thread a step, CTAs an SM),
    ``cute T,S,C gridG`` (row backward: threads, stages, CTAs an SM),
    ``cute cluster K,T,S,C clustersG``, ``cutile RxC occO wW per-tile|persistent``
    (forward) or ``cutile RxC occO wW gridG`` (backward; ``w-``: the compiler's warps);
    `` shared_ring`` where the row backward's ring is in shared memory."""
    if isinstance(plan, CuteForwardPlan):
        if plan.step:
            return f"cute two-pass {plan.threads},{plan.step},{plan.ctas_per_sm}"
        entry = plan.entry if plan.cluster > 1 else plan.entry[:3]
        return "cute " + ",".join(map(str, entry))
    if isinstance(plan, CuteClusterBackwardPlan):
        return (f"cute cluster {plan.cluster},{plan.threads},{plan.stages},"
                f"{plan.ctas_per_sm} clusters{plan.clusters}")
    if isinstance(plan, CuteBackwardPlan):
        return (f"cute {plan.threads},{plan.stages},{plan.ctas_per_sm} grid{plan.grid}"
                + " shared_ring" * plan.shared_ring)
    assert isinstance(plan, RowNormPlan)
    tile = f"{plan.tile_rows}x{plan.tile_cols}" + (f"+{plan.split_cols}" if plan.split_cols
                                                    else "")
    if not plan.single_pass:
        tile += f" {plan.col_tiles} col tiles"
    head = f"cutile {tile} occ{plan.occupancy} w{plan.worker_warps or '-'}"
    if plan.direction == "forward":
        return f"{head} {'persistent' if plan.grid < plan.row_tiles else 'per-tile'}"
    return f"{head} grid{plan.grid}"


@contextlib.contextmanager
def described_device(info: DeviceInfo):
    """The tools' device queries answered with ``info`` (no GPU here)."""
    saved = (dispatch.device_info, dispatch.max_active_clusters, tune_norm.device_info,
             torch.cuda.current_device)
    dispatch.device_info = tune_norm.device_info = lambda index: info
    # The cluster backward's and the persistent forward's grids: an estimate (every SM holds
    # ctas_per_sm of them).
    dispatch.max_active_clusters = (
        lambda index, cluster, threads, ctas: info.sm_count * ctas // cluster)
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        (dispatch.device_info, dispatch.max_active_clusters, tune_norm.device_info,
         torch.cuda.current_device) = saved


def bench_call_plans(op: str, m: int, n: int, dtype: str = "bfloat16"):
    """(decision, forward plan, backward plan) of bench_norm_ops's call of ``op`` at m x n:
    x, dy and weight in ``dtype`` (LayerNorm: fp32 weight and bias), contiguous, aligned."""
    layer_norm = op == "layer_norm"
    w = "float32" if layer_norm else dtype
    dtypes = (dtype, w, w) if layer_norm else (dtype, w)
    if op not in ("rms_norm", "layer_norm"):
        raise SystemExit(f"check_variants covers plain rms_norm and layer_norm, not {op}")
    p = dispatch.Problem(op=op, device_type="cuda", device_index=0, dtypes=dtypes, rows=m,
                         heads=1, cols=n, per_head_weight=False, max_offset=m * n - 1,
                         allow_experimental=True)
    decision = dispatch.decide(p)
    if not decision.uses_kernel:
        return decision, None, None
    fwd = dispatch.forward_kernel(decision, dispatch.ForwardFacts.of(
        dtype, dtype, w, w if layer_norm else None, None, None, dense=True))
    bwd = dispatch.backward_kernel(decision, dispatch.BackwardFacts(
        has_residual=False, has_dres_in=False, has_offset=False, same_dtypes=True,
        dense_aligned=True, max_offset=m * n - 1))
    return decision, fwd, bwd


class Compiler:
    """Compiles the kernels plans launch (bf16 x, the op's weight dtype) for sm_90(a) and
    reads their resources; each kernel variant once."""

    def __init__(self):
        from bench import kernel_resources

        self.kr = kernel_resources
        self.tool = kernel_resources.cuobjdump()
        self.done: dict = {}

    def __call__(self, plan, op: str, dtype: str = "bfloat16") -> str:
        from tilenorm.launch import aot, cute

        layer_norm = op == "layer_norm"
        weight = "float32" if layer_norm else dtype
        if isinstance(plan, CuteForwardPlan):
            key = cute.ForwardKey.of(plan, dtype, weight, layer_norm, layer_norm,
                                     False, False)
            build = lambda: cute.compile_forward(key, arch="sm_90a")  # noqa: E731
        elif isinstance(plan, CuteClusterBackwardPlan):
            key = cute.ClusterBackwardKey.of(plan, dtype, weight, False, False,
                                             layer_norm, layer_norm)
            build = lambda: cute.compile_cluster_backward(key, arch="sm_90a")  # noqa: E731
        elif isinstance(plan, CuteBackwardPlan):
            key = cute.BackwardKey.of(plan, dtype, weight, layer_norm, layer_norm)
            build = lambda: cute.compile_backward(key, arch="sm_90a")  # noqa: E731
        else:
            v = aot.OP_VARIANTS["layer_norm" if layer_norm else "rms"]
            key = (plan.config, plan.direction, plan.rows, plan.cols, op)
            if key not in self.done:
                parts = []
                for job in aot.plan_jobs(plan, v):
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(aot.export(job, "sm_90"))
                        f.flush()
                        r = self.kr.cubin_resources(Path(f.name), self.tool)[0]
                    parts.append(f"{job.label}: {self._words(r)}")
                self.done[key] = "; ".join(parts)
            return self.done[key]
        return self.cute(key, build)

    def cute(self, key, build) -> str:
        """The resources of the CuTe DSL kernel ``build()`` compiles (``key``'s, once)."""
        if key not in self.done:
            with tempfile.TemporaryDirectory() as d, self.kr.keeping_cubins(d):
                build()
                cubins = sorted(Path(d).rglob("*.cubin"), key=os.path.getmtime)
                r = self.kr.cubin_resources(cubins[-1], self.tool)[0]
            self.done[key] = self._words(r)
        return self.done[key]

    @staticmethod
    def _words(r: dict) -> str:
        spill = (f", SPILLS {r['spill_stores']} STL / {r['spill_loads']} LDL"
                 if r["stack"] or r["spill_stores"] else "")
        return f"{r['registers']} registers, stack {r['stack']}{spill}"


def check(path: Path, device: str, compile_: bool, show: bool) -> int:
    doc = json.loads(path.read_text())
    cases = [(f"cases[{i}]", c) for i, c in enumerate(doc.get("cases", []))]
    cases += [(f"patched_cases[{i}]", c) for i, c in enumerate(doc.get("patched_cases", []))]
    compiler = Compiler() if compile_ else None
    failures = 0
    with described_device(DEVICES[device]):
        for name, case in cases:
            tool = case.get("tool", "bench_norm_ops")
            if tool == "tune_norm":
                runs = [tune_case(c) for c in case.get("cases", "").split(",") if c]
            elif tool == "bench_fp8":
                shapes = case.get("shapes", "")
                runs = [(c, bench_fp8.case_rows(m, c), n)
                        for m, n in (common.parse_shapes(shapes) if shapes else [])
                        for c in case.get("scalings", bench_fp8.DEFAULT_CASES).split(",")]
            elif tool == "bench_norm_ops":
                runs = [(op, *map(int, s.split("x"))) for op in case.get(
                    "ops", "rms_norm").split(",") for s in case.get("shapes", "").split(",")
                    if s]
            else:
                raise SystemExit(f"{name}: check_variants does not know the tool {tool}")
            ops = sorted({op for op, _, _ in runs})
            variants = case["variants"]
            expect = case.get("expect")
            if variants and variants[0] != {}:
                print(f"{name}: v0 is not {{}} (the shipped tables)")
                failures += 1
            if expect is not None and len(expect) != len(variants):
                print(f"{name}: {len(expect)} expectations for {len(variants)} variants")
                failures += 1
            what = (f"--cases {case.get('cases')}" if tool == "tune_norm" else
                    f"--scalings {','.join(ops)} --shapes {case.get('shapes')}"
                    if tool == "bench_fp8" else
                    f"--ops {','.join(ops)} --shapes {case.get('shapes')}")
            print(f"=== {name}: {tool} {what} ({len(variants)} variants x {len(runs)} runs"
                  f"{', patch ' + json.dumps(case['patch']) if 'patch' in case else ''})")
            cute_at_v0: dict = {}  # bench_fp8: (case, shape) -> whether v0 runs the CuTe kernel
            with tune_norm.patched(case.get("patch", {})):
                for i, variant in enumerate(variants):
                    try:
                        if tool == "bench_fp8":
                            failures += _fp8_runs(i, variant, runs, device, compiler,
                                                  cute_at_v0)
                            continue
                        if tool == "tune_norm":
                            info = DEVICES[device]
                            settings = tune_norm.variant_settings(
                                variant, settings_for(info.arch, info.device_class))
                            for op, m, n in runs:
                                failures += _one(i, op, m, n, expect, compiler, show,
                                                 settings)
                            continue
                        with tune_norm.measuring_variant(variant):
                            for op, m, n in runs:
                                failures += _one(i, op, m, n, expect, compiler, show,
                                                 dtype=case.get("dtype", "bfloat16"))
                    except (Exception, SystemExit) as e:
                        print(f"  v{i}: REFUSED: {type(e).__name__}: {e}")
                        failures += 1
    print(f"{failures} failure(s)")
    return failures


def _fp8_runs(i: int, variant: dict, runs, device: str, compiler, cute_at_v0: dict) -> int:
    """bench_fp8's variant ``i`` (``bench_fp8.fp8_variant``: FP8 settings fields, and row
    ones) at each (case, M, N) of ``runs``: the decision ``tilenorm.fp8`` makes for the
    bench's operands (bf16 weight, E4M3 q, FP8 x where the case has a group), its CuTe row
    kernel's launch or cuTile's (marked where v0 runs the CuTe kernel), and with
    ``compiler`` that kernel's resources; a kernel that does not compile is a failure."""
    from tilenorm import settings_fp8
    from tilenorm.launch import cute

    info = DEVICES[device]
    settings = bench_fp8.fp8_variant(variant, settings_fp8.fp8_settings_for(
        info.arch, info.device_class))
    failures = 0
    with settings_fp8.measuring(settings):
        dispatch.decide_fp8.cache_clear()
        for case, m, n in runs:
            scaling, transpose, group = bench_fp8.CASES[case]
            x = "float8_e4m3fn" if group else "bfloat16"
            p = dispatch.Fp8Problem(
                op="rms_norm", device_type="cuda", device_index=0, dtypes=(x, "bfloat16"),
                rows=m, cols=n, scaling=scaling, transpose=transpose, has_residual=False,
                max_offset=m * n - 1, allow_experimental=True, group=group)
            plan = dispatch.decide_fp8(p).cute_forward
            at = f"  v{i} {case} {m}x{n}:"
            if i == 0:
                cute_at_v0[case, m, n] = plan is not None
            if plan is None:
                # Where v0 runs the CuTe kernel: the variant's table leaves the width, or its
                # entry is refused (not resident, #128), which the variant may not mean.
                lost = cute_at_v0.get((case, m, n), False)
                print(f"{at} cuTile's row kernel{'  (v0: the CuTe kernel)' * lost}")
                continue
            print(f"{at} cute {plan.threads},{plan.stages},{plan.ctas_per_sm} grid{plan.grid}"
                  + " recompute_t" * plan.recompute_t + " column_amax" * plan.column_amax
                  + " clamp" * plan.clamp + " shared_ring" * plan.shared_ring)
            if compiler is not None:
                key = cute.Fp8ForwardKey(None, x, "bfloat16", "float8_e4m3fn", p.row_scaling,
                                         False, n, plan.threads, plan.stages,
                                         plan.ctas_per_sm, plan.recompute_t,
                                         plan.column_amax, group, plan.clamp,
                                         plan.shared_ring)
                try:
                    words = compiler.cute(key, lambda k=key: cute.compile_fp8_forward(
                        k, "sm_90a"))
                    print(f"    compiled: {words}", flush=True)
                except Exception as e:  # a kernel that does not compile fails the variant
                    print(f"    DOES NOT COMPILE: {type(e).__name__}: {str(e)[:300]}")
                    failures += 1
        dispatch.decide_fp8.cache_clear()
    return failures


def tune_case(text: str) -> tuple[str, int, int]:
    """(op, M, N) of a tune_norm case ``op:N[:M]`` (M: x of 256 MiB), its ops rms and
    layer_norm (the others are not planned here)."""
    op, n, *m = text.split(":")
    if op not in TUNE_OPS:
        raise SystemExit(f"tune_norm case {text}: check_variants plans rms and layer_norm")
    n = int(n)
    return TUNE_OPS[op], int(m[0]) if m else tune_norm.X_BYTES // (2 * n), n


TUNE_OPS = {"rms": "rms_norm", "layer_norm": "layer_norm"}


def _one(i, op, m, n, expect, compiler, show, settings=None, dtype="bfloat16") -> int:
    """One variant's run at one shape: through the ops' dispatch in x's ``dtype``, or with
    ``settings`` the cuTile plans tune_norm binds."""
    shape = f"{m}x{n}"
    if settings is None:
        decision, fwd, bwd = bench_call_plans(op, m, n, dtype)
        if fwd is None:
            print(f"  v{i} {op} {shape}: REFERENCE PATH: {decision}")
            return 1
    else:
        info = dispatch.device_info(0)
        decision = None
        fwd, bwd = (plan_row_norm(m, n, itemsize=2, sm_count=info.sm_count, arch=info.arch,
                                  direction=d, op=op, settings=settings)
                    for d in ("forward", "backward"))
    # The dgamma reduction over the partial buffer: cuTile's, tiled by the cuTile backward's
    # plan, after either backward.
    cutile_bwd = bwd if isinstance(bwd, RowNormPlan) else decision.backward
    got = {"fwd": signature(fwd), "bwd": signature(bwd),
           "reduce": f"reduce {cutile_bwd.reduce_tile[0]}x{cutile_bwd.reduce_tile[1]} "
                     f"grid{cutile_bwd.reduce_grid}"}
    want = (expect[i].get(shape) if expect is not None and i < len(expect) else None)
    bad = want is not None and any(got[k] != v for k, v in want.items())
    verdict = "" if want is None else (f"  MISMATCH, expected {want}" if bad else "  ok")
    rows = getattr(bwd, "partial_rows", None) or bwd.partial_shape[0]
    print(f"  v{i} {op} {shape}: fwd {got['fwd']} | bwd {got['bwd']} | {got['reduce']} "
          f"over {rows} rows{verdict}")
    if show:
        text = str(decision) if decision is not None else (
            f"forward:  {fwd.describe()}\nbackward: {bwd.describe()}")
        print("    " + text.replace("\n", "\n    "))
    if compiler is not None:
        for direction, plan in (("fwd", fwd), ("bwd", bwd)):
            try:
                print(f"    {direction} compiled: {compiler(plan, op, dtype)}", flush=True)
            except Exception as e:  # a kernel that does not compile is the variant's failure
                print(f"    {direction} DOES NOT COMPILE: {type(e).__name__}: "
                      f"{str(e)[:300]}")
                return 1
    return int(bad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--device", choices=DEVICES, default="h200")
    parser.add_argument("--compile", action="store_true",
                        help="compile every kernel the plans launch and read its resources")
    parser.add_argument("--explain", action="store_true",
                        help="print each decision as tilenorm.explain does")
    args = parser.parse_args()
    sys.exit(1 if check(args.file, args.device, args.compile, args.explain) else 0)


if __name__ == "__main__":
    main()
