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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.experiments import forward_probe_cases  # noqa: E402
from bench.experiments.forward_probe_cases import EPS  # noqa: E402
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


def candidates(n: int) -> list[forward_probe_cases.Candidate]:
    """The CuTe forward at each of width ``n``'s configurations."""
    def maker(config):
        def make(x, w, y, rstd):
            plan = CuteForwardPlan.of(x.shape[0], n, config)
            fn = cute.compiled_forward(cute.ForwardKey.of(
                plan, "bfloat16", "bfloat16", False, False, False, False),
                torch.cuda.get_device_capability(x.device))
            return lambda: fn(x, None, w, None, y, None, None, rstd, EPS, 0.0, plan.grid)
        return make

    return [(f"cute {config}", maker(config)) for config in CONFIGS[n]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default=",".join(map(str, CONFIGS)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    forward_probe_cases.run(map(int, args.widths.split(",")), candidates, args.rounds, args.out)

if __name__ == "__main__":
    main()
