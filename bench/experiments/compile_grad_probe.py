"""Which layer of a compiled step's tilenorm path puts a parameter's gradient off (issue 17):
one model and size of ``bench_training.py``, step 0's gradients of tilenorm's patched model
against HF's own eager ones, per parameter, in one of several variants: ``eager``,
``aot_eager`` (the traced graph, no inductor), ``inductor``, and ``inductor`` with the custom
op's Python autograd registered over the C++ one (``--python-autograd``). Run it once with
``TILENORM_NATIVE=0`` too for the all-Python path.

    python bench/experiments/compile_grad_probe.py --model qwen3 --size host --variant inductor
"""

from __future__ import annotations

import argparse
import copy

import torch

from bench import bench_training as bt


def python_autograd_over_cpp() -> None:
    """The custom op's Python autograd at AutogradCUDA, where the C++ one was."""
    from torch._library import autograd

    from tilenorm.pytorch import custom_ops

    lib = torch.library.Library("tilenorm", "IMPL")  # noqa: TOR901 - kept for the process
    impl = autograd.make_autograd_impl(custom_ops.norm_fwd._opoverload, custom_ops.norm_fwd)
    lib.impl("norm_fwd", impl, "AutogradCUDA", with_keyset=True)
    python_autograd_over_cpp.lib = lib


def grads(model, call, ids) -> dict[str, torch.Tensor]:
    bt.forward_backward(call, ids)
    out = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3")
    parser.add_argument("--size", default="host")
    parser.add_argument("--variant", default="inductor", choices=("eager", "aot_eager",
                                                                  "inductor"))
    parser.add_argument("--residual", action="store_true")
    parser.add_argument("--python-autograd", action="store_true")
    parser.add_argument("--show", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.python_autograd:
        python_autograd_over_cpp()
    spec, size, device = bt.MODELS[args.model], bt.SIZES[args.size], torch.device(args.device)
    base = bt.build_base(spec, size, device, torch.bfloat16, seed=0)
    ids = bt.make_batches(size, 1, 0, device)[0]
    ref = grads(base, base, ids)
    model = copy.deepcopy(base)
    bt._patch_tilenorm(model, residual=args.residual)
    call = model if args.variant == "eager" else torch.compile(
        model, backend="inductor" if args.variant == "inductor" else "aot_eager")
    got = grads(model, call, ids)
    errors = sorted(((((got[n] - ref[n]).norm() / ref[n].norm()).item(), n) for n in ref),
                    reverse=True)
    label = f"{args.model} {args.size} {args.variant} residual={args.residual} " \
            f"python_autograd={args.python_autograd}"
    print(f"{label}: worst {errors[0][0]:.2e}, over 0.05: "
          f"{sum(e > 0.05 for e, _ in errors)} of {len(errors)}")
    for e, n in errors[:args.show]:
        print(f"    {e:.2e}  {n}")


if __name__ == "__main__":
    main()
