"""Where a call's host time goes (GPU host, 256 x 1024 bf16, GPU idle): the pieces of
tilenorm's RMSNorm forward and backward timed apart, the floor of any design built on a
Python ``torch.autograd.Function`` (a Function that only allocates its outputs), and a
cProfile of the module's forward + backward step. bench/NOTES.md #39 records what it showed.

    python bench/experiments/host_profile.py [--experimental]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tilenorm  # noqa: E402
from tilenorm.benchmark import host_us  # noqa: E402
from tilenorm.pytorch import calls, functional  # noqa: E402


class AllocateOnly(torch.autograd.Function):
    """The floor of a Python-autograd op: its forward allocates y and rstd, its backward dx
    and dweight; nothing is launched."""

    @staticmethod
    def forward(ctx, x, weight):
        y = torch.empty_like(x)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experimental", action="store_true")
    args = parser.parse_args()
    tilenorm.set_experimental(args.experimental)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, generator=g, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype)
    dev = x.device
    y, _, rstd = tilenorm.rms_norm_forward(x, w)
    prepared = functional._prepared("rms_norm", x, w, None, None, 1e-6, 0.0, None, False,
                                    False, None, None)
    call = prepared.call
    print(tilenorm.explain(x, w))
    backward = calls.backward_call(call.spec, dy, None, x, w, None, 0.0, x.dtype, None)
    partial = torch.empty(backward.partial.shape, dtype=torch.float32, device=dev)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    p = [t.data_ptr() for t in (x, w, y, rstd, dy, dx, partial, dw)]
    module = tilenorm.RMSNorm(1024, device="cuda", dtype=torch.bfloat16)
    theirs = torch.nn.RMSNorm(1024, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()

    def step(m):
        def run():
            xg.grad = None
            m.weight.grad = None
            m(xg).backward(dy)
        return run

    def floor_step():
        xg.grad = None
        w.requires_grad_(True)
        w.grad = None
        AllocateOnly.apply(xg, w).backward(dy)

    def no_grad(m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    pieces = {
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "torch.empty((256,), f32)": lambda: torch.empty((256,), dtype=torch.float32,
                                                        device=dev),
        "4 x data_ptr()": lambda: (x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr()),
        "current stream handle": lambda: torch._C._cuda_getCurrentRawStream(dev.index),
        "lean launch, forward": lambda: call.launch(0, p[0], p[1], p[2], p[3], 1e-6, 0.0),
        "lean launch, backward row kernel": lambda: backward.launch_row(
            0, p[4], p[0], p[1], p[3], p[5], p[6], 0.0),
        "lean launch, dgamma reduction": lambda: backward.launch_reduce(0, p[6], p[7]),
        "prepared-call lookup": lambda: functional._prepared(
            "rms_norm", x, w, None, None, 1e-6, 0.0, None, False, False, None, None),
        "ForwardCall.run": lambda: call.run(x, w, None, None, 1e-6, 0.0),
        "BackwardCall.run": lambda: backward.run(dy, None, x, w, None, None, rstd, 0.0),
        "tilenorm.rms_norm_forward": lambda: tilenorm.rms_norm_forward(x, w),
        "tilenorm.rms_norm_backward": lambda: tilenorm.rms_norm_backward(dy, x, w, rstd),
        "torch._fused_rms_norm": lambda: torch.ops.aten._fused_rms_norm(x, [1024], w, 1e-6),
        "module no_grad, tilenorm": no_grad(module),
        "module no_grad, torch": no_grad(theirs),
        "step, tilenorm.RMSNorm": step(module),
        "step, torch.nn.RMSNorm": step(theirs),
        "step, Function that only allocates": floor_step,
    }
    results = {name: host_us(fn, calls=7000 if name.startswith("step") else 21000, rounds=7)
               for name, fn in pieces.items()}
    profile = cProfile.Profile()
    run = step(module)
    profile.enable()
    for _ in range(2000):
        run()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host us per call")
    for name, value in results.items():
        print(f"  {name:>36}: {value:7.2f}")


if __name__ == "__main__":
    main()
