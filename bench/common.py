"""Helpers shared by the per-op benchmarks: the package's timers, errors, result records."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

from tilenorm.benchmark import copy_gbps, eager_ms, graph_ms, host_us

__all__ = ["copy_gbps", "device_slug", "eager_ms", "git_commit", "graph_ms", "host_us",
           "rel_error", "write_record"]

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
