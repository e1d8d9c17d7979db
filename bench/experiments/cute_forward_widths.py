"""Probe (GPU): one-shot configurations of the CuTe forward (tilenorm/kernels/
cute_row_norm_forward.py) at widths the settings do not route to it yet (bench/NOTES.md #65),
beside tilenorm's op as it dispatches today and Quack.

For each shape and (threads, rows a CTA, CTAs per SM): y and rstd poisoned, one launch checked
against float64 (every element written, y within bf16 tolerance), a rerun bit-identical, then
CUDA-graph time in ``--rounds`` rounds (every case of a shape once a round), median kept. GB/s
of the one-pass bytes (x and w read, y and rstd written) against the copy bandwidth of the
same process. RMSNorm, bf16 x and weight.

    python bench/experiments/cute_forward_widths.py --out widths.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import common  # noqa: E402
from tilenorm.launch import cute  # noqa: E402
from tilenorm.planner import CuteForwardPlan  # noqa: E402

EPS = 1e-6
#: Widths and candidate (threads, rows a CTA, CTAs per SM): 16-byte vectors a thread whole.
CONFIGS = {
    512: [(64, 2, 16), (64, 4, 8)],
    1024: [(128, 2, 8), (64, 2, 16)],
    2048: [(128, 2, 8), (128, 4, 6), (256, 2, 4)],
    5120: [(128, 2, 4), (128, 1, 8), (640, 1, 2)],
    7168: [(128, 2, 4), (128, 1, 8), (896, 1, 2)],
    32768: [(1024, 1, 1), (512, 1, 1), (1024, 1, 2)],
}
SHAPE_BYTES = 256 << 20


def one_pass_bytes(m: int, n: int) -> int:
    return 2 * m * n * 2 + n * 2 + m * 4


def measure_width(n: int, rounds: int, record: dict, copy: float) -> None:
    """Every case of width ``n`` checked and timed into ``record``."""
    import tilenorm

    m = SHAPE_BYTES // (2 * n)
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    cases = []
    for config in CONFIGS[n]:
        try:
            plan = CuteForwardPlan.of(m, n, config)
            fn = cute.compiled_forward(cute.ForwardKey.of(
                plan, "bfloat16", "bfloat16", False, False, False, False))
            y = torch.full_like(x, float("nan"))
            rstd = torch.full((m,), float("nan"), device="cuda")

            def launch(fn=fn, y=y, rstd=rstd, grid=plan.grid):
                fn(x, None, w, None, y, None, None, rstd, EPS, 0.0, grid)

            launch()
            torch.cuda.synchronize()
            first = y.clone()
            errs = common.float64_errors({"y": y, "rstd": rstd}, x, w, eps=EPS)
            launch()
            torch.cuda.synchronize()
            assert not first.isnan().any() and torch.equal(first, y), "written, rerun equal"
            cases.append((f"cute {config}", launch, errs))
        except Exception as e:
            traceback.print_exc(limit=3)
            record["failures"].append(f"{n} {config}: {type(e).__name__}: {e}")

    def op():
        tilenorm.rms_norm_forward(x, w, EPS)

    cases.append(("tilenorm op", op, {}))
    try:
        from quack.rmsnorm import rmsnorm_fwd

        def quack():
            rmsnorm_fwd(x, w, eps=EPS, store_rstd=True)

        cases.append(("quack", quack, {}))
    except Exception as e:
        record["failures"].append(f"quack: {type(e).__name__}: {e}")
    times = [[] for _ in cases]
    for _ in range(rounds):
        for i, (_, launch, _) in enumerate(cases):
            times[i].append(common.graph_ms(launch))
    for (name, _, errs), ms_list in zip(cases, times, strict=True):
        ms = sorted(ms_list)[len(ms_list) // 2]
        gbps = one_pass_bytes(m, n) / (ms * 1e-3) / 1e9
        record["rows"].append({"M": m, "N": n, "case": name, "ms": ms, "gbps": gbps,
                               "pct_copy": 100 * gbps / copy, **errs})
        print(f"{m:>7}x{n:<6} {name:>22} {gbps:6.0f} GB/s {100 * gbps / copy:5.1f}%  "
              f"y err {errs.get('y', float('nan')):.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, CONFIGS)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    copy = common.copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(),
              "copy_gbps": copy, "rows": [], "failures": []}
    print(f"{record['device']}: copy {copy:.0f} GB/s", flush=True)
    for n in map(int, args.widths.split(",")):
        measure_width(n, args.rounds, record, copy)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        torch.cuda.empty_cache()
    for f in record["failures"]:
        print("FAILED", f)


if __name__ == "__main__":
    main()
