"""Which kernels are stable: validated on a GPU, recorded in ``validation.json``.

A kernel family is stable while ``validation.json`` holds a record for it whose source digest
equals the SHA-256 of the family's source files as installed; any edit to those files makes
the family experimental again until the GPU tests pass on the new code and a new record is
committed. CONTRIBUTING.md describes the procedure.

    python -m tilenorm validation summarize --junit J.xml --commit C --out S.json   (GPU host)
    python -m tilenorm validation record S.json                                     (checkout)
    python -m tilenorm validation status
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
RECORD_FILE = PACKAGE_DIR / "validation.json"


@dataclass(frozen=True)
class KernelFamily:
    """Kernels validated together: the files whose digest a validation record pins."""

    name: str
    language: str
    sources: tuple[str, ...]
    #: Whether what the kernels need is installed (None: always): a GPU run without it skips
    #: their tests and validates nothing of the family.
    installed: Callable[[], bool] | None = None

    def digest(self) -> str:
        return _digest(self.sources)

    def runnable(self) -> bool:
        return self.installed is None or self.installed()


def _cute_installed() -> bool:
    from tilenorm.launch import cute

    return cute.available()


#: A family's sources are its kernel files and the measured settings they are launched with;
#: the CuTe DSL families' also the layer that compiles, keeps and binds them
#: (launch/cute.py: operand layouts, alignment, compile options; launch/cute_cache.py: the
#: library a process loads), whose effect only a GPU run shows (bench/NOTES.md #109, #115).
#: Other host code can change without a GPU re-run; the CPU tests cover it.
CUTE_LAUNCH = ("launch/cute.py", "launch/cute_cache.py")
CUTILE_NORM = KernelFamily(
    "cutile/norm", "cuTile",
    ("kernels/cutile_row_norm.py", "kernels/cutile_column_sums.py", "settings.py"))
#: The CuTe DSL forwards and backwards (a row a CTA, and a row across a cluster of CTAs);
#: the backwards hand their partial buffers to cuTile's reduction.
CUTE_NORM = KernelFamily(
    "cute/norm", "CuTe DSL",
    ("kernels/cute_row_norm_forward.py", "kernels/cute_cluster_norm_forward.py",
     "kernels/cute_row_norm_backward.py", "kernels/cute_cluster_norm_backward.py",
     "kernels/cute_rows.py", "kernels/cute_cluster_rows.py",
     "kernels/cutile_column_sums.py", "settings.py", *CUTE_LAUNCH),
    _cute_installed)
#: The FP8-output norms (issue 19): their kernels, the reduction their backward shares, and
#: both settings files they are launched with.
CUTILE_NORM_FP8 = KernelFamily(
    "cutile/norm-fp8", "cuTile",
    ("kernels/cutile_row_norm_fp8.py", "kernels/cutile_column_sums.py", "settings.py",
     "settings_fp8.py"))
#: The CuTe DSL FP8-output row kernel and transposed copy; their settings live in
#: settings_fp8.py.
CUTE_NORM_FP8 = KernelFamily(
    "cute/norm-fp8", "CuTe DSL",
    ("kernels/cute_row_norm_fp8.py", "kernels/cute_fp8_transpose.py", "kernels/cute_rows.py",
     "settings_fp8.py", *CUTE_LAUNCH),
    _cute_installed)


def _cute_jax_installed() -> bool:
    """The CuTe DSL and a jaxlib with its CUDA plugin (looked up, not imported): a GPU run
    without them skips the JAX tests."""
    import importlib.util

    return _cute_installed() and any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


#: The CuTe DSL kernels called from JAX (issue 18): an XLA FFI handler that hands XLA's
#: buffers and stream to a kernel's TVM-FFI export (bench/NOTES.md #68), for the forwards (a
#: row a CTA, and a row across a cluster of CTAs) and the cluster backward (RMSNorm and
#: LayerNorm), whose partial buffer cuTile's reduction sums. Its C++ is in the digest beside
#: the kernels and their settings: the CPU tests build it and call it up to the kernel's
#: load, but only a GPU runs the launch (XLA's stream, the buffers' device memory, the
#: cluster launch).
CUTE_JAX = KernelFamily(
    "cute/jax", "CuTe DSL",
    ("jax/cute_ffi_calls.cc", "kernels/cute_row_norm_forward.py",
     "kernels/cute_cluster_norm_forward.py", "kernels/cute_cluster_norm_backward.py",
     "kernels/cute_rows.py", "kernels/cute_cluster_rows.py", "kernels/cutile_column_sums.py",
     "settings.py", *CUTE_LAUNCH),
    _cute_jax_installed)
FAMILIES = (CUTILE_NORM, CUTE_NORM, CUTILE_NORM_FP8, CUTE_NORM_FP8, CUTE_JAX)


@functools.cache
def _digest(sources: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for rel in sources:
        h.update(rel.encode() + b"\0" + (PACKAGE_DIR / rel).read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _records() -> dict:
    if not RECORD_FILE.exists():
        return {}
    return json.loads(RECORD_FILE.read_text())["kernels"]


def validation_record(family: KernelFamily) -> dict | None:
    """The GPU validation record that covers the family's current sources, if any."""
    record = _records().get(family.name)
    if record is None or record.get("source_sha256") != family.digest():
        return None
    return record


def is_stable(family: KernelFamily) -> bool:
    return validation_record(family) is not None


def _junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites)
             for key in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def summarize(junits: list[Path], commit: str, out: Path, markers: str | None = None) -> dict:
    """On the GPU host after the GPU tests (one JUnit file per pytest run): what ran
    (``markers``: pytest's ``-m``), where, and how it went."""
    import torch

    per_run = [_junit_counts(junit) for junit in junits]
    counts = {key: sum(c[key] for c in per_run) for key in per_run[0]}
    summary = {
        "device": torch.cuda.get_device_name(),
        "arch": "sm_{}{}".format(*torch.cuda.get_device_capability()),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "torch": torch.__version__,
        "tests": counts,
        "markers": markers,
        "source_sha256": {f.name: f.digest() for f in FAMILIES if f.runnable()},
    }
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def record(summary_path: Path, families: list[str] | None = None) -> list[str]:
    """Mark the families of a fully passing GPU run stable, if their sources still match;
    only those named in ``families`` where given (a run of one family's tests validates
    that family, not the others whose sources it also digested)."""
    summary = json.loads(summary_path.read_text())
    unknown = set(families or ()) - {f.name for f in FAMILIES}
    if unknown:
        raise SystemExit(f"not recording: no kernel family named {sorted(unknown)}")
    tests = summary["tests"]
    if tests["failures"] or tests["errors"] or tests["passed"] == 0:
        raise SystemExit(f"not recording: the GPU run did not pass cleanly ({tests})")
    data = json.loads(RECORD_FILE.read_text()) if RECORD_FILE.exists() else {"kernels": {}}
    recorded = []
    for family in FAMILIES:
        if families is not None and family.name not in families:
            continue
        tested = summary["source_sha256"].get(family.name)
        if tested is None:
            print(f"skip {family.name}: its kernels could not run on the GPU host")
            continue
        if tested != family.digest():
            print(f"skip {family.name}: the sources changed since the GPU run")
            continue
        data["kernels"][family.name] = {
            "source_sha256": tested,
            "device": summary["device"],
            "arch": summary["arch"],
            "date": summary["date"],
            "commit": summary["commit"],
            "tests": f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                     f"{tests['skipped']} skipped"
                     + (f" (-m '{summary['markers']}')" if summary.get("markers") else ""),
        }
        recorded.append(family.name)
    RECORD_FILE.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return recorded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tilenorm validation")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="summarize a GPU test run (on the GPU host)")
    s.add_argument("--junit", type=Path, required=True, action="append",
                   help="a pytest run's JUnit XML (repeat for several runs)")
    s.add_argument("--commit", required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--markers", help="the pytest -m expression the run selected")
    r = sub.add_parser("record", help="record a passing GPU run in validation.json")
    r.add_argument("summary", type=Path)
    r.add_argument("--family", action="append", dest="families",
                   help="record only this family (repeat for several; default: every "
                        "family the run digested)")
    sub.add_parser("status", help="print each kernel family's status")
    args = parser.parse_args(argv)
    if args.command == "summarize":
        print(json.dumps(summarize(args.junit, args.commit, args.out, args.markers), indent=2))
    elif args.command == "record":
        print("recorded:", ", ".join(record(args.summary, args.families)) or "nothing")
    else:
        for family in FAMILIES:
            rec = validation_record(family)
            state = (f"stable (validated on {rec['device']}, {rec['date']}, {rec['commit']})"
                     if rec else "experimental")
            print(f"{family.name}: {state}")
