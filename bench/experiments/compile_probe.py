"""Where a compiled training step's time goes with each norm provider (issue 17): a
Llama-style model at the host-bound size (1 x 1024 tokens, hidden 512, 8 layers) or, with
``--size gpu``, bench_training's GPU-bound one (2 x 4096 tokens, hidden 2048), whole model
under ``torch.compile``, norms from torch (``torch.nn.RMSNorm`` swapped in) or tilenorm (norms
only, or with the residual adds fused). Steps are timed interleaved across providers (CUDA
events around each step, median); then one profiled step per provider lists the host ops by
self CPU time, counts kernel launches, and sums the GPU time of the norms' kernels (inductor's
fused norm kernels, tilenorm's) against the step's; dynamo's counters show graph breaks and
recompiles.

    python bench/experiments/compile_probe.py [--steps 30] [--mode default] [--size gpu]
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys

import torch
import transformers

import tilenorm.transformers as tt

#: (batch, seq, hidden, intermediate, heads, kv heads): bench_training's Llama sizes.
SIZES = {"host": (1, 1024, 512, 1408, 8, 4), "gpu": (2, 4096, 2048, 5632, 16, 8)}
#: The kernels of a norm: inductor's fused ones name the op, tilenorm's are its own.
NORM_KERNEL = re.compile(r"rms_norm|norm_fwd|norm_bwd|column_sums|row_sums|RowNorm")


def build(size: str, seed: int = 0) -> torch.nn.Module:
    _, seq, hidden, intermediate, heads, kv_heads = SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=8, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=seq, use_cache=False)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def swap_torch(model: torch.nn.Module) -> None:
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ == "LlamaRMSNorm":
                new = torch.nn.RMSNorm(child.weight.shape[0], eps=child.variance_epsilon,
                                       device="cuda", dtype=torch.bfloat16)
                new.weight = child.weight
                setattr(module, child_name, new)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mode", default="default", help="torch.compile mode")
    parser.add_argument("--providers", default="torch,tilenorm,tilenorm+residual")
    parser.add_argument("--size", choices=SIZES, default="host")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    base = build(args.size)
    batch, seq = SIZES[args.size][:2]
    ids = torch.randint(3, 32000, (batch, seq), device="cuda")
    runs = {}
    for provider in args.providers.split(","):
        model = copy.deepcopy(base)
        if provider == "torch":
            swap_torch(model)
        elif provider != "hf":
            tt.apply(model, residual=provider == "tilenorm+residual")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(model, mode=None if args.mode == "default" else args.mode)

        def step(compiled=compiled, opt=opt):
            loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        runs[provider] = (step, [])
        print(f"{provider}: compiled", file=sys.stderr, flush=True)
    from torch._dynamo.utils import counters

    print("dynamo counters:", {k: dict(v) for k, v in counters.items()
                               if k in ("frames", "stats", "graph_break", "recompiles")})
    for k in range(args.steps):
        order = list(runs)
        order = order[k % len(order):] + order[:k % len(order)]
        for provider in order:
            step, times = runs[provider]
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
    print("\nstep ms, median of", args.steps, "interleaved")
    for provider, (_, times) in runs.items():
        print(f"  {provider:20s} {statistics.median(times):8.2f}  (min {min(times):.2f})")
    from torch.profiler import ProfilerActivity, profile

    for provider, (step, _) in runs.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events
                       if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                    "cudaLaunchKernelExC"))
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.self_device_time_total > 0]
        norms = [e for e in kernels if NORM_KERNEL.search(e.key)]
        norm_us = sum(e.self_device_time_total for e in norms)
        total_us = sum(e.self_device_time_total for e in kernels)
        print(f"\n== {provider}: {launches} kernel launches in one step; GPU time {total_us:.0f} "
              f"us, of it the norms' kernels {norm_us:.0f} us in {sum(e.count for e in norms)}")
        for e in sorted(norms, key=lambda e: -e.self_device_time_total):
            print(f"   {e.self_device_time_total:9.1f} us {e.count:4d}x  {e.key[:110]}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
