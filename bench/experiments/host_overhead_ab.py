"""Host microseconds per call of the launch-level RMSNorm functions, for A/B comparisons of two
source trees: run it alternately with each tree first on PYTHONPATH, pinned to one core, and
compare processes in the same state (torch.empty_like is printed as the yardstick: a process
lands in a fast or a slow state).

    for i in 1 2 3 4 5 6; do
      PYTHONPATH=/old/tree taskset -c 3 python3 bench/experiments/host_overhead_ab.py old
      PYTHONPATH=$PWD taskset -c 3 python3 bench/experiments/host_overhead_ab.py new
    done

One-off A/B (added at 94cabc9) on the public launch-level API only, so it runs against any
tree that has it (NOTES #21, #26; records bench/results/host-ab-*.json). The maintained host
benchmark, every provider in one process, is bench/bench_host.py.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

import tilenorm


def host_us(fn, calls: int = 600, rounds: int = 5) -> float:
    # Its own timer, not tilenorm.benchmark.host_us: that one belongs to the tree under test,
    # and both trees must be timed the same way.
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _, h, rstd = tilenorm.rms_norm_forward(x, w, 1e-6)
    xg = x.detach().requires_grad_()
    result = {
        "fwd": host_us(lambda: tilenorm.rms_norm_forward(x, w, 1e-6)),
        "bwd": host_us(lambda: tilenorm.rms_norm_backward(dy, h, w, rstd)),
        "autograd fwd": host_us(lambda: tilenorm.rms_norm(xg, w, 1e-6)),
        "empty_like": host_us(lambda: torch.empty_like(x)),
    }
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    print(label, json.dumps({k: round(v, 2) for k, v in result.items()}))


if __name__ == "__main__":
    main()
