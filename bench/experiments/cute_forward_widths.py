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
from bench.experiments import forward_probe_cases  # noqa: E402
from bench.experiments.forward_probe_cases import EPS, SHAPE_BYTES  # noqa: E402
from tilenorm.launch import cute  # noqa: E402
from tilenorm.planner import CuteForwardPlan  # noqa: E402

#: Widths and candidate (threads, rows a CTA, CTAs per SM): 16-byte vectors a thread whole.
CONFIGS = {
    512: [(64, 2, 16), (64, 4, 8)],
    1024: [(128, 2, 8), (64, 2, 16)],
    2048: [(128, 2, 8), (128, 4, 6), (256, 2, 4)],
    5120: [(128, 2, 4), (128, 1, 8), (640, 1, 2)],
    7168: [(128, 2, 4), (128, 1, 8), (896, 1, 2)],
    32768: [(1024, 1, 1), (512, 1, 1), (1024, 1, 2)],
}


def measure_width(n: int, rounds: int, record: dict, copy: float) -> None:
    """Every case of width ``n`` checked and timed into ``record``."""
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

            cases.append(forward_probe_cases.checked(f"cute {config}", launch, y, rstd, x, w))
        except Exception as e:
            traceback.print_exc(limit=3)
            record["failures"].append(f"{n} {config}: {type(e).__name__}: {e}")

    cases += forward_probe_cases.baselines(x, w, record)
    forward_probe_cases.time_cases(cases, m, n, rounds, record, copy)


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
