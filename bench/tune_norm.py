"""Planner experiments for the norm kernels: GB/s, error and rerun repeatability of each
variant on each case, and (``--host``) the host time of the launch-level functions. Results
feed bench/NOTES.md; the winners become settings in ``tilenorm/settings.py``.

A variant is a JSON object of :class:`tilenorm.settings.RowNormSettings` fields to replace in
the device's settings (``settings_for(arch, device_class)``; lists for tuples; the old
upper-case planner names such as ``SINGLE_PASS_HINTS`` are accepted too, so recorded
variants rerun), e.g.
``{"single_pass_hints": {"forward": {"rms_norm": [[2048, 4, null, false], [32768, 1, 8,
true]], "layer_norm": [[32768, 1, 8, true]]}, "backward": {...}}}`` or ``{"tile_elements":
{"forward": 16384, "backward": 4096}}``: the planner derives grids and partial buffers from
them as it does for users (``plan_row_norm(..., settings=variant)``). A case is ``op:N`` or
``op:N:M`` with op one of rms, layer_norm, offset, residual, per_head (32 heads of N / 32,
one weight shared by the heads); M defaults to making x 256 MiB.

The kernels are the cuTile ones (forward; backward with its dgamma/dbeta reduction), bound
to the plans and launched from raw pointers as the ops launch them; the CuTe DSL backward,
which the ops take for some LayerNorm widths, is not in this tool. Every output is checked
against the float64 reference of :mod:`tilenorm.testing`, every row of it.

    python bench/tune_norm.py --cases rms:4096,layer_norm:4096 \\
        --variants '[{}, {"chunked_hints": {"forward": [2, null], "backward": [1, 8]}}]'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from tilenorm import planner  # noqa: E402
from tilenorm.benchmark import graph_ms, host_us  # noqa: E402
from tilenorm.device import device_info  # noqa: E402
from tilenorm.launch import cutile  # noqa: E402
from tilenorm.launch.cutile import NormFeatures  # noqa: E402
from tilenorm.pytorch.calls import tensor_launcher  # noqa: E402
from tilenorm.settings import SM90, RowNormSettings, settings_for  # noqa: E402

DEFAULT_CASES = "rms:128,rms:1024,rms:4096,rms:8192,rms:16384,rms:65536"
FEATURES = {
    "rms": NormFeatures(),
    "layer_norm": NormFeatures(layer_norm=True, has_bias=True),
    "offset": NormFeatures(has_offset=True),
    "residual": NormFeatures(has_residual=True),
    "per_head": NormFeatures(),
}
X_BYTES = 256 << 20
EPS = 1e-6


def settings_value(value):
    """JSON values as the settings hold them: lists as tuples, digit keys as ints (widths)."""
    if isinstance(value, list):
        return tuple(settings_value(v) for v in value)
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: settings_value(v)
                for k, v in value.items()}
    return value


#: A variant's key for module attributes set while it runs, ``{"module.ATTRIBUTE": value}``
#: (:func:`patched`), beside its settings fields: a dispatch constant no settings field holds,
#: e.g. ``{"patch": {"tilenorm.dispatch.CUTE_FORWARD_MIN_BYTES": 0}}``.
PATCH = "patch"


@contextlib.contextmanager
def patched(patch: dict) -> Iterator[None]:
    """``{"module.ATTRIBUTE": value}`` set for the block, each restored after it."""
    saved = []
    try:
        for dotted, value in patch.items():
            module, attr = dotted.rsplit(".", 1)
            mod = importlib.import_module(module)
            if not hasattr(mod, attr):
                raise SystemExit(f"{module} has no attribute {attr} to patch")
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def variant_settings(variant: dict, base: RowNormSettings = SM90) -> RowNormSettings:
    """``base`` with the fields ``variant`` names replaced (its :data:`PATCH` aside)."""
    fields = {f.name for f in dataclasses.fields(RowNormSettings)}
    changes = {key.lower(): settings_value(value) for key, value in variant.items()
               if key != PATCH}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; RowNormSettings has {sorted(fields)}")
    return dataclasses.replace(base, **changes)


@contextlib.contextmanager
def measuring_variant(variant: dict) -> Iterator[RowNormSettings]:
    """This device's settings with ``variant``'s fields replaced (:func:`variant_settings`),
    in force for the ops called inside (:func:`tilenorm.settings.measuring`), and its
    :data:`PATCH` applied; the decisions and prepared calls made with other settings are
    dropped on entry and on exit, since both are cached by problem, not by settings."""
    from tilenorm import dispatch, settings
    from tilenorm.pytorch import calls

    info = device_info(torch.cuda.current_device())
    replaced = variant_settings(variant, settings_for(info.arch, info.device_class))
    dispatch.decide.cache_clear()
    calls.clear()
    try:
        with patched(variant.get(PATCH, {})), settings.measuring(replaced):
            yield replaced
    finally:
        dispatch.decide.cache_clear()
        calls.clear()


def measure_case(info, settings: RowNormSettings, op: str, n: int, m: int | None = None
                 ) -> dict:
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
                                      op=kind, settings=settings)
                for d in ("forward", "backward"))
    y, dx = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    h = torch.full_like(x, float("nan")) if f.has_residual else x
    mean = torch.empty(m, heads, device="cuda") if f.layer_norm else None
    rstd = torch.empty(m, heads, device="cuda")
    dw = torch.empty_like(w)
    db = torch.empty_like(w) if f.has_bias else None
    groups = 1 + f.has_bias
    buffer = cutile.PartialBuffer.of(bwd, groups)
    partial = torch.empty(buffer.shape, device="cuda")
    row_kernel = cutile.bind_backward(bwd, f, f.has_residual, False)
    operands = dict(dy=dy, h=h, weight=w, mean=mean, rstd=rstd, dres_in=dres_in, dx=dx,
                    partial_w=partial.as_strided(*buffer.group(), 0),
                    partial_b=partial.as_strided(*buffer.group(), buffer.group_size)
                    if f.has_bias else None)
    launch_first = None
    if row_kernel.first is not None:  # a column-split backward's row sums
        operands["row_sums"] = torch.empty((m, heads) + row_kernel.workspace, device="cuda")
        launch_first = tensor_launcher(row_kernel.first, operands)
    launch_fwd = tensor_launcher(cutile.bind_forward(fwd, f), dict(
        x=x, residual=r, weight=w, bias=b, y=y, residual_out=h if f.has_residual else None,
        mean=mean, rstd=rstd))
    launch_row = tensor_launcher(row_kernel, operands)
    launch_reduce = tensor_launcher(cutile.bind_reduce(bwd, groups), dict(
        partial=partial.as_strided(*buffer.reduced()), out_a=dw.view(-1),
        out_b=None if db is None else db.view(-1)))

    def forward():
        launch_fwd(EPS, offset)

    def backward():
        if launch_first is not None:
            launch_first(offset)
        launch_row(offset)
        launch_reduce()

    forward()
    backward()
    err = common.float64_errors(
        {"y": y, "dx": dx, "dweight": dw.view(-1)}, x, w.view(-1),
        None if b is None else b.view(-1), EPS, layer_norm=f.layer_norm, offset=offset,
        residual=r, dy=dy, dh=dres_in)
    errors = {"fwd_err": err["y"], "bwd_err": err["dx"], "dw_err": err["dweight"]}
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
    info = device_info(torch.cuda.current_device())
    settings = variant_settings(variant, settings_for(info.arch, info.device_class))
    for case in cases:
        yield {"variant": variant, **measure_case(info, settings, *case)}
        torch.cuda.empty_cache()


def host_breakdown(calls: int = 3000) -> dict:
    """Microseconds per call of the public launch-level functions on a tiny shape (the
    maintained host benchmark, beside every peer, is bench/bench_host.py)."""
    import tilenorm

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = (1 + 0.5 * torch.randn(1024, device="cuda")).to(torch.bfloat16)
    _, h, rstd = tilenorm.rms_norm_forward(x, w, EPS)
    steps = {
        "empty_like": lambda: torch.empty_like(x),
        "rms_norm_forward": lambda: tilenorm.rms_norm_forward(x, w, EPS),
        "rms_norm_backward": lambda: tilenorm.rms_norm_backward(dy, h, w, rstd),
        "rms_norm (autograd off)": lambda: tilenorm.rms_norm(x, w, EPS),
    }
    return {name: host_us(fn, calls) for name, fn in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="[{}]", help="JSON list of variants")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--host", action="store_true", help="also time the host path")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [(op, *map(int, sizes)) for op, *sizes in (c.split(":") for c in args.cases.split(","))]
    variants = json.loads(args.variants)
    for variant in variants:  # a typo fails now, not after the first variant's cases
        variant_settings(variant)
    results = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(),
               "host_us": host_breakdown() if args.host else {}, "rows": []}
    for name, us in results["host_us"].items():
        print(f"host {name:>24}: {us:6.2f} us")
    for variant in variants:
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
