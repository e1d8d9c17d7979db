"""Where a compiled training step's time goes with each norm provider (issue 17): bench_training's
models and sizes (``--model``, ``--size``), the whole model under ``torch.compile`` in
bench_training's ``Runner`` (its compiled call, optimizer and step), each provider patched by
bench_training's own patch. Steps are timed interleaved across providers (CUDA events around each
step, median) beside the host's time to enqueue a step (wall time to the step's return,
unsynchronized, median); then profiled steps per provider count kernel launches, sum the GPU time of
the norms' kernels (inductor's fused norm kernels, tilenorm's) against the step's, the host time in
dynamo's guard checks, and lists the kernels whose launch counts differ from the first provider's;
dynamo's counters show graph breaks and recompiles.

    python bench/experiments/compile_probe.py [--model qwen3] [--size host] [--steps 30]
        [--profile-steps 5]
"""

from __future__ import annotations

import argparse
import collections
import copy
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_training as bt  # noqa: E402

#: The kernels of a norm: inductor's fused ones name the op, tilenorm's are its own.
NORM_KERNEL = re.compile(r"rms_norm|norm_fwd|norm_bwd|column_sums|row_sums|RowNorm")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
#: The profiler's name for dynamo's guard evaluation before a compiled frame runs.
GUARDS = re.compile(r"Cache Lookup|guard", re.IGNORECASE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=bt.MODELS, default="llama")
    parser.add_argument("--size", choices=bt.SIZES, default="host")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--providers", default="hf,torch,tilenorm,tilenorm+residual")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="profiled steps per provider; counts and times are per step")
    args = parser.parse_args()
    bt._raise_recompile_limits()
    spec, size, device = bt.MODELS[args.model], bt.SIZES[args.size], torch.device("cuda")
    base = bt.build_base(spec, size, device, torch.bfloat16, seed=0)
    batches = bt.make_batches(size, 1, seed=0, device=device)
    runs = {}
    for provider in args.providers.split(","):
        model = copy.deepcopy(base)
        bt.PATCHES[provider](model, spec)
        runner = bt.Runner(model, "compile", batches, lr=1e-4, device=device)
        runner.start(5)
        runs[provider] = (runner.step, [], [])
        print(f"{provider}: compiled", file=sys.stderr, flush=True)
    from torch._dynamo.utils import counters

    print("dynamo counters:", {k: dict(v) for k, v in counters.items()
                               if k in ("frames", "stats", "graph_break", "recompiles")})
    for k in range(args.steps):
        order = bt.round_order(list(runs), k)
        for provider in order:
            step, times, host = runs[provider]
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
    print(f"\n{args.model} {args.size}: median of {args.steps} interleaved steps, ms")
    print(f"  {'provider':20s} {'step':>8s} {'host enqueue':>13s}")
    for provider, (_, times, host) in runs.items():
        print(f"  {provider:20s} {statistics.median(times):8.2f} {statistics.median(host):13.2f}")
    from torch.profiler import ProfilerActivity, profile

    first = None
    n = args.profile_steps
    for provider, (step, _, _) in runs.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in LAUNCHES) / n
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.self_device_time_total > 0]
        norms = [e for e in kernels if NORM_KERNEL.search(e.key)]
        guards = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                  and GUARDS.search(e.key)]
        count = collections.Counter({e.key: e.count / n for e in kernels})
        print(f"\n== {provider}, a step (mean of {n} profiled): {launches:.0f} kernel launches; "
              f"GPU time {sum(e.self_device_time_total for e in kernels) / n:.0f} us, of it "
              f"the norms' {sum(e.self_device_time_total for e in norms) / n:.0f} us in "
              f"{sum(e.count for e in norms) / n:.0f}; guard checks "
              + ", ".join(f"{e.key} {e.count / n:.0f}x {e.cpu_time_total / n:.0f} us"
                          for e in guards))
        for e in sorted(norms, key=lambda e: -e.self_device_time_total):
            print(f"   {e.self_device_time_total / n:9.1f} us {e.count / n:4.0f}x  {e.key[:110]}")
        if first is None:
            first = count
        else:
            for key in sorted(set(count) | set(first), key=lambda k: count[k] - first[k]):
                if count[key] != first[key]:
                    print(f"   kernel count {first[key]:6.1f} -> {count[key]:6.1f}  {key[:110]}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))


if __name__ == "__main__":
    main()
