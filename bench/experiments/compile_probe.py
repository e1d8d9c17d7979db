"""Where a compiled, host-bound training step's time goes with each norm provider (issue 17):
a Llama-style model at the host-bound size (1 x 1024 tokens, hidden 512, 8 layers), whole
model under ``torch.compile``, norms from torch (``torch.nn.RMSNorm`` swapped in) or tilenorm
(norms only, or with the residual adds fused). Steps are timed interleaved across providers
(CUDA events around each step, median); then one profiled step per provider lists the host
ops by self CPU time and counts kernel launches; dynamo's counters show graph breaks and
recompiles.

    python bench/experiments/compile_probe.py [--steps 30] [--mode default]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
import transformers

import tilenorm.transformers as tt


def build(seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=1024, use_cache=False)
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
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    base = build()
    ids = torch.randint(3, 32000, (1, 1024), device="cuda")
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
        print(f"\n== {provider}: {launches} kernel launches in one step")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
