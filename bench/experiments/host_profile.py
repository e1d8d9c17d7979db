"""Where a call's host time goes (GPU host, 256 x 1024 bf16, GPU idle): the pieces of
tilenorm's RMSNorm and LayerNorm calls timed apart, on the C++ host path and the Python one,
beside torch's; the floor of a Python ``torch.autograd.Function`` (one that only allocates
its outputs); and a cProfile of each module's no_grad forward and forward + backward step.
bench/NOTES.md #39 and #40 record what it showed.

    python bench/experiments/host_profile.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tilenorm  # noqa: E402
from tilenorm.benchmark import host_us  # noqa: E402
from tilenorm.pytorch import functional, native  # noqa: E402


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


def step(m, x, dy):
    def run():
        x.grad = None
        m.weight.grad = None
        m(x).backward(dy)
    return run


def no_grad(m, x):
    def run():
        with torch.no_grad():
            m(x)
    return run


def pieces(op: str, x, xg, dy) -> dict:
    n, dev = x.shape[-1], x.device
    layer_norm = op == "layer_norm"
    ours = (tilenorm.LayerNorm if layer_norm else tilenorm.RMSNorm)(
        n, device=dev, dtype=x.dtype)
    theirs = (torch.nn.LayerNorm if layer_norm else torch.nn.RMSNorm)(
        n, device=dev, dtype=x.dtype)
    w = ours.weight.detach()
    b = ours.bias.detach() if layer_norm else None
    eps = functional.default_eps(x.dtype) if ours.eps is None else ours.eps
    prepared = functional._prepared(op, x, w, b, None, eps, 0.0, ours.normalized_shape, False,
                                    False, None, None)
    call = prepared.call
    print(tilenorm.explain(x, w, bias=b, layer_norm=layer_norm))
    cpp = native.module()
    out = {
        "module no_grad, tilenorm": no_grad(ours, x),
        "module no_grad, torch": no_grad(theirs, x),
        "functional no_grad": lambda: _no_grad_functional(op, x, w, b, eps),
        "prepared-call lookup": lambda: functional._prepared(
            op, x, w, b, None, eps, 0.0, ours.normalized_shape, False, False, None, None),
        "ForwardCall.run": lambda: call.run(x, w, b, None, eps, 0.0),
        "step, tilenorm module": step(ours, xg, dy),
        "step, torch module": step(theirs, xg, dy),
    }
    if cpp is not None and call.native is not None:
        out["C++ forward (direct)"] = lambda: cpp.forward(call.native, x, w, b, None, eps, 0.0)
        wg = ours.weight
        bg = ours.bias if layer_norm else None
        call.native_autograd(x, w, b, 0.0)

        def cpp_step():
            xg.grad = None
            wg.grad = None
            cpp.apply(call.native, xg, wg, bg, None, eps, 0.0).backward(dy)
        out["step, C++ apply (direct)"] = cpp_step
    return out


def _no_grad_functional(op, x, w, b, eps):
    with torch.no_grad():
        if op == "layer_norm":
            tilenorm.layer_norm(x, w, b, eps)
        else:
            tilenorm.rms_norm(x, w, eps)


def profile(name: str, fn, calls: int = 3000) -> str:
    for _ in range(20):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    return f"--- cProfile: {name}, {calls} calls ---\n{text.getvalue()}"


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype)
    xg = x.clone().requires_grad_()
    w = torch.randn(1024, generator=g, device="cuda", dtype=torch.bfloat16)

    def floor_step():
        xg.grad = None
        w.requires_grad_(True)
        w.grad = None
        AllocateOnly.apply(xg, w).backward(dy)

    results = {"common": {
        "torch.empty_like(x)": host_us(lambda: torch.empty_like(x), 21000, 7),
        "torch.empty((256,), f32)": host_us(
            lambda: torch.empty((256,), dtype=torch.float32, device=x.device), 21000, 7),
        "step, Function that only allocates": host_us(floor_step, 7000, 7),
    }}
    reports = []
    for op in ("rms_norm", "layer_norm"):
        fns = pieces(op, x, xg, dy)
        results[op] = {name: host_us(fn, calls=7000 if "step" in name else 21000, rounds=7)
                       for name, fn in fns.items()}
        reports.append(profile(f"{op} module no_grad", fns["module no_grad, tilenorm"]))
        reports.append(profile(f"{op} module step", fns["step, tilenorm module"]))
    print("\n".join(reports))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, C++ host path "
          f"{'on' if native.available() else 'off'}: host us per call")
    for group, values in results.items():
        print(f"  [{group}]")
        for name, value in values.items():
            print(f"  {name:>36}: {value:7.2f}")


if __name__ == "__main__":
    main()
