"""Helpers shared by the benchmarks: the package's timers, the float64 check
(:mod:`tilenorm.testing`, the one reference of tests, bench and ``python -m tilenorm``),
result records, and kernel launches at launch level for the planner tools."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tilenorm.benchmark import copy_gbps, eager_ms, graph_ms, host_us
from tilenorm.testing import RelError, float64_norm, rel_error, row_blocks

__all__ = ["Prepared", "add_run_args", "copy_gbps", "device_slug", "eager_ms", "float64_errors",
           "git_commit", "graph_ms", "host_us", "new_record", "parse_shapes",
           "print_table", "rel_error", "timed_rows", "write_record"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Prepared:
    """One provider bound to one problem: closures that launch forward and backward (None
    where the provider has no backward), and one that returns the outputs to check."""

    fwd: Callable[[], object]
    bwd: Callable[[], object] | None
    outputs: Callable[[], tuple]


def timed_rows(prepared: Prepared, fwd_bytes: int, bwd_bytes: int, modes: list[str],
               row: dict) -> list[dict]:
    """One record row per mode ("graph": CUDA-graph kernel time, "eager": with host
    overhead): ``row``'s keys plus GB/s and ms, forward and backward (None without one)."""
    rows = []
    for mode in modes:
        timer = graph_ms if mode == "graph" else eager_ms
        fwd_ms = timer(prepared.fwd)
        bwd_ms = None if prepared.bwd is None else timer(prepared.bwd)
        rows.append({**row, "mode": mode,
                     "fwd_gbps": fwd_bytes / (fwd_ms * 1e-3) / 1e9,
                     "bwd_gbps": None if bwd_ms is None else bwd_bytes / (bwd_ms * 1e-3) / 1e9,
                     "fwd_ms": fwd_ms, "bwd_ms": bwd_ms})
    return rows


def float64_errors(outs: dict[str, torch.Tensor | None], x: torch.Tensor,
                   weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   eps: float = 1e-6, *, layer_norm: bool = False, offset: float = 0.0,
                   residual: torch.Tensor | None = None, dy: torch.Tensor | None = None,
                   dh: torch.Tensor | None = None, rows: slice | None = None
                   ) -> dict[str, float]:
    """Relative errors (:func:`tilenorm.testing.rel_error`) of ``outs`` against
    :func:`tilenorm.testing.float64_norm` of the same arguments, by the reference's field
    names (``y``, ``h``, ``dx``, ``dresidual``, ``dweight``, ``dbias``; None values are
    skipped). Rows (x's first dimension) are walked in blocks
    (:func:`tilenorm.testing.row_blocks`) so that large problems fit in float64; ``rows``
    limits the check to those rows, except for ``dweight`` and ``dbias``, which sum over
    every row."""
    outs = {k: v for k, v in outs.items() if v is not None}
    m = x.shape[0]
    per_row = {k: RelError() for k in outs if k not in ("dweight", "dbias")}
    sums = {k: 0 for k in outs if k in ("dweight", "dbias")}
    limit = range(m)[rows] if rows is not None else range(m)
    for block in row_blocks(m, x[:1].numel()):
        need_rows = bool(per_row) and (block.start < limit.stop and block.stop > limit.start)
        if not (need_rows or sums):
            continue

        def part(t, block=block):
            return None if t is None else t[block]

        ref = float64_norm(x[block], weight, bias, eps, layer_norm=layer_norm, offset=offset,
                           residual=part(residual), dy=part(dy), dh=part(dh))
        if need_rows:
            lo, hi = max(block.start, limit.start), min(block.stop, limit.stop)
            sub = slice(lo - block.start, hi - block.start)
            for name, err in per_row.items():
                err.add(outs[name][lo:hi], getattr(ref, name)[sub])
        for name in sums:
            sums[name] = sums[name] + getattr(ref, name)
        del ref
    errors = {name: err.value for name, err in per_row.items()}
    errors.update({name: rel_error(outs[name], total) for name, total in sums.items()})
    return errors


def git_commit() -> str:
    """The commit under test: $TILENORM_COMMIT (the GPU host's copy has no .git), else git."""
    if os.environ.get("TILENORM_COMMIT"):
        return os.environ["TILENORM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_slug() -> str:
    return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")


def write_record(record: dict, path: Path | None = None) -> Path:
    """Write ``record`` as bench/results/<device>-<date>.json (or ``path``), merging rows with
    an existing record of the same file so that several ops can share one day's record."""
    path = path or RESULTS_DIR / f"{device_slug()}-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        old = json.loads(path.read_text())
        key = ("op", "dtype", "M", "N", "provider", "mode")
        new_keys = {tuple(r[k] for k in key) for r in record["rows"]}
        record["rows"] = [r for r in old.get("rows", [])
                          if tuple(r[k] for k in key) not in new_keys] + record["rows"]
        seen = {(o["op"], o["provider"]) for o in record["overhead"]}
        record["overhead"] = [o for o in old.get("overhead", [])
                              if (o["op"], o["provider"]) not in seen] + record["overhead"]
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def add_run_args(parser) -> None:
    """The options every per-op benchmark takes."""
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--modes", default="graph,eager")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    parser.add_argument("--experimental", action="store_true",
                        help="let tilenorm run kernels not yet validated on a GPU")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def refuse_unvalidated(experimental: bool,
                       families: tuple[str, ...] = ("cutile/norm", "cute/norm")) -> None:
    """Allow experimental kernels if ``experimental``; then stop the run while one of
    tilenorm's ``families`` that is installed is experimental and experimental kernels are
    off: tilenorm's rows would time its reference path under its name."""
    import tilenorm
    from tilenorm import validation
    from tilenorm._experimental import experimental_enabled

    if experimental:
        tilenorm.set_experimental(True)
    unvalidated = [f.name for f in validation.FAMILIES
                   if f.name in families and f.runnable() and not validation.is_stable(f)]
    if unvalidated and not experimental_enabled():
        raise SystemExit(f"tilenorm's {', '.join(unvalidated)} kernels are experimental at "
                         f"this source: pass --experimental, or validate them first")


def new_record(args, families: tuple[str, ...] = ("cutile/norm", "cute/norm")) -> dict:
    """Apply the run options and start a record: device, date, commit, and the copy
    bandwidth measured now, in the same process as the providers. Refuses to run while
    tilenorm's rows would time its reference path (``refuse_unvalidated``)."""
    refuse_unvalidated(args.experimental, families)
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy:.0f} GB/s")
    return {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "commit": git_commit(), "copy_gbps": copy, "torch": torch.__version__,
            "rows": [], "overhead": [], "failures": []}


def print_table(record: dict) -> None:
    copy = record["copy_gbps"]

    def pct(v):
        return "      -      " if v is None else f"{v:6.0f} ({100 * v / copy:3.0f}%)"

    def err(v):
        return "-" if v is None else f"{v:.1e}"

    print(f"\ncopy bandwidth {copy:.0f} GB/s; GB/s (% of copy)")
    print(f"{'op':>18} {'M x N':>14} {'provider':>14} {'mode':>6} {'fwd':>13} {'bwd':>13} "
          f"{'fwd err':>8} {'bwd err':>8}")
    for r in record["rows"]:
        print(f"{r['op']:>18} {r['M']:>7}x{r['N']:<6} {r['provider']:>14} {r['mode']:>6} "
              f"{pct(r['fwd_gbps'])} {pct(r['bwd_gbps'])} {err(r['fwd_err']):>8} "
              f"{err(r['bwd_err']):>8}")
    for o in record["overhead"]:
        bwd = "-" if o["bwd_host_us"] is None else f"{o['bwd_host_us']:.1f}"
        print(f"host us/call {o['op']:>18} {o['provider']:>14}: fwd {o['fwd_host_us']:.1f}, "
              f"bwd {bwd}")
    for f in record["failures"]:
        print(f"FAILED {f}")
