"""What the forward probes (cute_forward_widths.py, cute_cluster_forward_probe.py) share: one
width's inputs, each candidate kernel checked on poisoned outputs, the baselines beside them,
and timing every case in rounds into the record."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from bench import common

EPS = 1e-6
#: x of 256 MB in bf16 for every width: several times the L2.
SHAPE_BYTES = 256 << 20
#: (name, launch, float64 errors) of one timed case.
Case = tuple[str, Callable[[], None], dict]
#: A candidate kernel: its name, and what makes its launch writing y and rstd of x and w
#: (``make(x, w, y, rstd)``; it compiles, so its failure is the candidate's).
Candidate = tuple[str, Callable[..., Callable[[], None]]]


def one_pass_bytes(m: int, n: int) -> int:
    """x and w read, y (bf16) and rstd (fp32) written."""
    return 2 * m * n * 2 + n * 2 + m * 4


def baselines(x: torch.Tensor, w: torch.Tensor, record: dict) -> list[Case]:
    """tilenorm's op as it dispatches today, and Quack's forward where it imports."""
    import tilenorm

    def op():
        tilenorm.rms_norm_forward(x, w, EPS)

    cases = [("tilenorm op", op, {})]
    try:
        from quack.rmsnorm import rmsnorm_fwd

        def quack():
            rmsnorm_fwd(x, w, eps=EPS, store_rstd=True)

        cases.append(("quack", quack, {}))
    except Exception as e:
        record["failures"].append(f"quack: {type(e).__name__}: {e}")
    return cases


def time_cases(cases: list[Case], m: int, n: int, rounds: int, record: dict,
               copy: float) -> None:
    """CUDA-graph time of every case once a round (drift falls on all alike), the median of
    ``rounds`` recorded and printed as GB/s and % of ``copy``."""
    times = [[] for _ in cases]
    for _ in range(rounds):
        for i, (_, launch, _) in enumerate(cases):
            times[i].append(common.graph_ms(launch))
    for (name, _, errs), ms_list in zip(cases, times, strict=True):
        ms = sorted(ms_list)[len(ms_list) // 2]
        gbps = one_pass_bytes(m, n) / (ms * 1e-3) / 1e9
        record["rows"].append({"M": m, "N": n, "case": name, "ms": ms, "gbps": gbps,
                               "pct_copy": 100 * gbps / copy, **errs})
        print(f"{m:>7}x{n:<6} {name:>24} {gbps:6.0f} GB/s {100 * gbps / copy:5.1f}%  "
              f"y err {errs.get('y', float('nan')):.1e} rstd err "
              f"{errs.get('rstd', float('nan')):.1e}", flush=True)


def checked(name: str, launch: Callable[[], None], y: torch.Tensor, rstd: torch.Tensor,
            x: torch.Tensor, w: torch.Tensor) -> Case:
    """``launch`` (writing y and rstd, poisoned by the caller) run once and checked against
    float64, then again: every element written and the rerun bit-identical, or it raises."""
    launch()
    torch.cuda.synchronize()
    first, first_rstd = y.clone(), rstd.clone()
    errs = common.float64_errors({"y": y, "rstd": rstd}, x, w, eps=EPS)
    launch()
    torch.cuda.synchronize()
    if first.isnan().any() or first_rstd.isnan().any():
        raise AssertionError(f"{name}: not every element written")
    if not (torch.equal(first, y) and torch.equal(first_rstd, rstd)):
        raise AssertionError(f"{name}: a rerun is not bit-identical")
    return name, launch, errs


def measure_width(n: int, candidates: Iterable[Candidate], rounds: int, record: dict,
                  copy: float) -> None:
    """bf16 x of :data:`SHAPE_BYTES` and w of width ``n``; each candidate made, checked
    (:func:`checked`; a failure recorded, the others go on) and timed beside the baselines
    into ``record``."""
    m = SHAPE_BYTES // (2 * n)
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    cases = []
    for name, make in candidates:
        try:
            y = torch.full_like(x, float("nan"))
            rstd = torch.full((m,), float("nan"), device="cuda")
            cases.append(checked(name, make(x, w, y, rstd), y, rstd, x, w))
        except Exception as e:
            traceback.print_exc(limit=3)
            record["failures"].append(f"{n} {name}: {type(e).__name__}: {e}")
    cases += baselines(x, w, record)
    time_cases(cases, m, n, rounds, record, copy)


def run(widths: Iterable[int], candidates: Callable[[int], list[Candidate]], rounds: int,
        out: Path) -> None:
    """Every width's candidates measured (:func:`measure_width`) into one record at ``out``,
    written after each width, with the device, commit and copy bandwidth of this process."""
    copy = common.copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(),
              "copy_gbps": copy, "rows": [], "failures": []}
    print(f"{record['device']}: copy {copy:.0f} GB/s", flush=True)
    for n in widths:
        measure_width(n, candidates(n), rounds, record, copy)
        out.write_text(json.dumps(record, indent=1) + "\n")
        torch.cuda.empty_cache()
    for failure in record["failures"]:
        print("FAILED", failure)
