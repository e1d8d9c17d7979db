"""Helpers shared by the per-op benchmarks: the package's timers, errors, result records."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

from tilenorm.benchmark import copy_gbps, eager_ms, graph_ms, host_us

__all__ = ["add_run_args", "copy_gbps", "device_slug", "eager_ms", "git_commit", "graph_ms",
           "host_us", "new_record", "parse_shapes", "rel_error", "write_record"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


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


def new_record(args) -> dict:
    """Apply the run options and start a record: device, date, commit, and the copy
    bandwidth measured now, in the same process as the providers."""
    if args.experimental:
        import tilenorm

        tilenorm.set_experimental(True)
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy:.0f} GB/s")
    return {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "commit": git_commit(), "copy_gbps": copy, "torch": torch.__version__,
            "rows": [], "overhead": [], "failures": []}
