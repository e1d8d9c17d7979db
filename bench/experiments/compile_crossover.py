"""Where, under torch.compile, a norm is better left to inductor than held as tilenorm's custom
op (issue 17; sets ``tilenorm.dispatch.COMPILED_INDUCTOR_MAX_BYTES``, bench/NOTES.md #61).

One compiled call of a decoder layer's fused add-then-norm, ``tilenorm.rms_norm(x, w,
residual=r, prenorm=True)`` in bf16 (weight bf16, as in a bf16 model), forward and backward
(``torch.autograd.grad`` of y and h), compiled twice per shape: every norm held as the custom
op (the kernels), and every norm traced as torch operations for inductor. For each: the
float64 check of y, h, dx, dresidual, dweight; kernel time and kernels launched per call (the
profiler's device time summed over kernels); time with host overhead (calls back to back,
events); host microseconds per call (wall time, GPU idle between rounds). The crossover is
the largest x at which inductor's call is no slower than the custom op's in both kernel time
and time with host overhead.

    python bench/experiments/compile_crossover.py [--shapes 1024x512,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tilenorm  # noqa: E402
from bench import common  # noqa: E402
from tilenorm import dispatch  # noqa: E402

SHAPES = ("1024x512,2048x512,1024x2048,2048x2048,4096x2048,8192x2048,4096x4096,8192x4096,"
          "16384x4096")
PATHS = {"inductor": 1 << 62, "custom op": -1}  # COMPILED_INDUCTOR_MAX_BYTES for each


def kernel_time(step, calls: int = 20) -> tuple[float, float]:
    """(GPU microseconds, kernels) per call of ``step``: the profiler's self device time summed
    over every kernel, without the gaps between launches (a compiled autograd step does not
    capture into a CUDA graph here: the capture was invalidated)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(e.self_device_time_total for e in kernels) / calls, len(kernels) / calls


def measure(m: int, n: int, path: str, g: torch.Generator) -> dict:
    dispatch.COMPILED_INDUCTOR_MAX_BYTES = PATHS[path]
    torch._dynamo.reset()

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device="cuda")).to(
            torch.bfloat16)

    x, r, dy, dh = (rand(m, n) for _ in range(4))
    w = rand(n, scale=0.2, shift=1.0)
    x.requires_grad_(), r.requires_grad_(), w.requires_grad_()

    def add_norm(x, r, w):
        return tilenorm.rms_norm(x, w, 1e-6, residual=r, prenorm=True)

    held = "tilenorm.norm_fwd" in traced_ops(add_norm, x, r, w)
    torch._dynamo.reset()
    fn = torch.compile(add_norm, fullgraph=True, dynamic=False)

    def step():
        y, h = fn(x, r, w)
        return (y, h, *torch.autograd.grad((y, h), (x, r, w), (dy, dh)))

    y, h, dx, dr, dw = step()
    errors = common.float64_errors({"y": y, "h": h, "dx": dx, "dresidual": dr, "dweight": dw},
                                   x.detach(), w.detach(), None, 1e-6, residual=r.detach(),
                                   dy=dy, dh=dh)
    gpu_us, kernels = kernel_time(step)
    return {"M": m, "N": n, "x_mib": m * n * 2 / 2**20, "path": path, "custom_op": held,
            "errors": errors, "gpu_us": gpu_us,
            "eager_us": 1e3 * common.eager_ms(step, calls=20),
            "host_us": common.host_us(step, calls=1000), "kernels": kernels}


def traced_ops(fn, *args) -> list[str]:
    """The call targets of the graph dynamo traces of ``fn(*args)``: what a compiled call
    holds."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return [str(node.target) for gm in graphs for node in gm.graph.nodes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    copy = common.copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "commit": common.git_commit(), "copy_gbps": copy, "torch": torch.__version__,
              "validation": [str(tilenorm.explain(torch.empty(8, 512, device="cuda",
                                                              dtype=torch.bfloat16)).status)],
              "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{record['device']}: copy {copy:.0f} GB/s; commit {record['commit']}")
    print(f"{'M x N':>12} {'MiB':>6} {'path':>10} {'GPU us':>9} {'eager us':>9} "
          f"{'host us':>8} {'kernels':>7} {'worst err':>9}")
    for m, n in common.parse_shapes(args.shapes):
        for path in PATHS:
            row = measure(m, n, path, g)
            record["rows"].append(row)
            print(f"{m:>6}x{n:<5} {row['x_mib']:6.1f} {path:>10} {row['gpu_us']:9.1f} "
                  f"{row['eager_us']:9.1f} {row['host_us']:8.1f} {row['kernels']:7.1f} "
                  f"{max(row['errors'].values()):9.1e}", flush=True)
            assert row["custom_op"] == (path == "custom op"), row
    by = {(r["M"], r["N"], r["path"]): r for r in record["rows"]}
    left = [(r["x_mib"], r["M"], r["N"]) for r in record["rows"] if r["path"] == "inductor"
            and r["gpu_us"] <= by[r["M"], r["N"], "custom op"]["gpu_us"]
            and r["eager_us"] <= by[r["M"], r["N"], "custom op"]["eager_us"]]
    record["inductor_no_slower_up_to_mib"] = max(left)[0] if left else None
    print(f"inductor no slower in kernel and eager time at: {sorted(left)}")
    out = args.out or (common.RESULTS_DIR / f"compile-crossover-{common.device_slug()}-"
                       f"{record['date']}-{record['commit']}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
