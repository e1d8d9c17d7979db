"""Training-step benchmark: every norm provider inside Hugging Face transformers models, eager
and under torch.compile (issue 17).

    python bench/bench_training.py                        # the default matrix, bf16, CUDA
    python bench/bench_training.py --models llama --sizes host --modes eager --plot
    python bench/bench_training.py --sizes host --profile     # host-bound, with host profiles
    python bench/bench_training.py --device cpu --sizes tiny --modes eager --dtype float32

Models are built from configs (no downloads), random weights from ``--seed``, norm weights
randomized too (around 1, Gemma's around 0 for its ``1 + w``) so that they matter. One model
per model/size is built and every provider gets a ``copy.deepcopy`` of it: same weights, same
batches, and only the norms differ.

Models (``--models``): ``llama`` (LlamaForCausalLM, kv heads = heads / 2, MLP 2.75 x hidden),
``qwen3`` (Qwen3ForCausalLM, per-head q/k norms, kv heads = heads / 4, MLP 3 x hidden) and
``gemma3`` (Gemma3ForCausalLM on a Gemma3TextConfig: ``1 + w`` norms, four per layer plus the
q/k norms, sliding window = sequence / 4, kv heads = heads / 4, MLP 3 x hidden), head_dim =
hidden / heads. Sizes (``--sizes``):

  gpu    2 x 4096 tokens, hidden 2048, 8 layers, 16 heads, vocab 32000 (GPU-bound)
  host   1 x 1024 tokens, hidden 512, 8 layers, 8 heads, vocab 32000 (host-bound)
  tiny   1 x 64 tokens, hidden 64, 2 layers, 4 heads, vocab 512 (a CPU smoke test)

Providers (``--providers``), each patching its copy of the model in place:

  hf                 the model's own norm modules
  torch              every RMSNorm module replaced by ``torch.nn.RMSNorm`` holding the same
                     weight Parameter; Gemma's by a ``torch.nn.RMSNorm`` subclass calling
                     ``F.rms_norm(x, ..., 1 + weight)``: the parameter stays ``w`` (optimizer
                     state and weight decay as in HF), one N-element add per call more, and
                     ``1 + w`` is rounded to the weight's dtype where HF adds in fp32
  liger              ``liger_kernel.transformers.monkey_patch._apply_liger_kernel_to_instance``
                     with ``rms_norm=True`` and every other boolean option of the family's
                     ``apply_liger_kernel_to_*`` False (rope, swiglu/geglu, cross entropy,
                     fused linear cross entropy, ...: read from its signature, recorded); the
                     modeling module's classes Liger replaces process-wide are put back after
  quack              every RMSNorm module replaced by ``quack.rmsnorm.QuackRMSNorm`` holding
                     the same weight; Gemma's calls ``quack.rmsnorm.rmsnorm(...,
                     weight_offset=1.0)`` (absent, with the reason, where quack has no
                     ``weight_offset``)
  tilenorm           ``tilenorm.transformers.apply(model, residual=False)``: the norms
  tilenorm+residual  ``tilenorm.transformers.apply(model, residual=True)``: the norms and each
                     decoder layer's residual add fused with the norm that follows it (for
                     Llama and Qwen3 the add ending a layer too, with the next layer's input
                     norm or the final norm: the row's ``fused_across``)

A provider that fails to import is recorded under ``absent`` and skipped; one that fails to
patch or run a configuration is recorded under ``failures``; the run goes on.

Modes (``--modes``): ``eager``, and ``compile``: ``torch.compile(..., dynamic=False)`` of a call
of the whole model (default inductor), one per provider's model, ``torch._dynamo.reset()``
between model/size/modes (and between providers with ``--timing sequential``). Each provider's
call has a code object of its own (:func:`compiled_call`), so its dynamo cache holds its own
entries only, as a process that trains one model does. Dynamo's recompile limits are raised to
64 per code object and 1024 in all and hitting one raises instead of silently running eagerly
(``fail_on_recompile_limit_hit``; the settings are the record's ``dynamo``).

One training step: ``model(input_ids=ids, labels=ids, use_cache=False).loss`` (transformers'
own shifted cross entropy), ``loss.backward()``, ``torch.optim.AdamW(lr=--lr, fused=True)``
step (foreach where fused is unavailable), ``zero_grad(set_to_none=True)``; weights in
``--dtype`` (bf16), ``model.train()``. Step i takes batch i mod ``--batches`` of a fixed set of
token batches drawn from a Zipf distribution over the text ids (every id but pad, bos and eos):
a unigram law the model learns, so that the loss moves (on uniform tokens the initial loss,
~log(vocab), is already the best there is). Gemma3 once diverged here, HF's own run included:
the batches held the pad id (Zipf's most frequent rank), whose embedding row is zero, so a
sequence starting with it kept an exactly zero residual row through every layer, and each
RMSNorm backward of a zero row scales the gradient by 1/sqrt(eps) = 1e3: with Gemma3's norms
before and after each sublayer that grew ~2e5 a layer and overflowed (inf, then NaN) within 8
layers, in bf16 and fp32 alike (Llama and Qwen3: ~2e2 a layer, finite). The learning rate
is fixed, 1e-4 by default: on the CPU, Llama at the host size with 1 x 256 tokens in bf16, 100
steps took the loss from 10.45 to 6.30, and a correct norm rounding once (torch.nn.RMSNorm)
ended 1.0e-4 (relative) from HF's loss; at 3e-4 the same pair ended 3.8e-4 apart and at 1e-3
3.1e-2: bf16 trajectories that large steps make diverge from any rounding difference.

Timing (``--timing``), per model/size/mode. ``interleaved`` (default): every provider's copy is
built, patched, compiled and started first: step 0 (which compiles, under compile; its
gradients are the step-0 check), then untimed steps up to ``--warmup`` / ``--compile-warmup``
steps, or to the end of the training run where there is one (its loss is the trained-loss
check). Then one untimed round and ``--steps / --round-steps`` timed rounds: round k runs
``--round-steps`` steps of every provider before round k + 1 of any, in the order of row k of a
Williams design (:func:`round_order`: over a cycle of rounds each provider takes every place in
the round once and follows every other provider once; a rotation kept each provider's
neighbours, and with them how often it ran before hf in a round, while the first turn after
the collection runs 5-8% slower and the last 2-4% faster than the second at the host size),
garbage collected before each round and synchronized before each provider's turn,
so that the host's and the GPU's drift over the minutes of a run reaches every provider alike
(timed one after another, providers differed by 20-40% at the host size, #41); the host size
takes rounds of one step, since the host's speed moves within seconds (#49). ``sequential``:
the same for one provider at a time, each freed before the next (for less memory: interleaved,
the gpu size holds 6 copies of a ~0.5B-parameter model with AdamW state, ~20 GB). Within a turn
the steps run back to back, each between two CUDA events (no synchronization in between, as in
a training loop: a GPU-bound step is its GPU time, a host-bound one includes the host's time);
a turn's steps sum to its time, and the median over the turns of their mean step time is
recorded (in turns of several steps a step's own time is not: where the host is the bottleneck
the GPU's queue moves time between back-to-back steps, and single steps spread by +-20% around
a steady mean, NOTES #47; a turn of one step starts and ends synchronized), with its quartiles,
every step's and every turn's time, the timing, rounds and steps per round, the first step's
wall time and the peak memory above the weights (the most allocated during a turn beyond what
was allocated before it, plus the optimizer state: gradients, optimizer state and activations).
On the CPU the wall time of each step. ``--profile``: 3 more steps per provider under
``torch.profiler`` after the timed rounds; the 15 ops with the most self CPU time (name, count,
self CPU us over the 3 steps) are the row's ``profile_top``: where the host's time goes; on a
GPU also ``profile_kernels``, the 25 kernels with the most GPU time (name, count, GPU us over
the 3 steps) and their totals a step: where the GPU's time goes (a compiled step's norms
against inductor's, NOTES.md #70).

Correctness, against a reference: the hf provider in eager mode run once more per model/size
(so that the hf rows show the run-to-run noise of HF itself, e.g. the attention backward's
atomics, and compile's difference from eager). At step 0, before the update: the loss's
relative difference, the relative difference of the global gradient norm, and the largest
relative difference of a parameter's gradient norm (which parameter is recorded). Then the loss
after ``--train-steps`` updates (the loss of step ``--train-steps``, before the timed steps of
the same run), for the sizes of ``--train-sizes`` in eager mode (``--train-compile``: compile
too; ``--train-steps 0``: never).

Budget: whole-model compiles (one per provider of each compiled model/size) dominate a run;
the default matrix (3 models x 2 sizes x 2 modes x 6 providers) takes more than one device call
of 10 minutes. Model/size/modes run eager first, then compiled, model by model, size by size,
each with all its providers or none; each is written to the record as it ends, and one that
would end past ``--budget-s`` (by the most seconds a provider took so far at its size and mode)
is skipped and recorded as such, so that the run ends in time with what it measured. The rest
is a second call writing the same file (``--modes compile --models gemma3``, say): a record
already at the path keeps its rows, each replaced by a new row or failure of its configuration
(a skip leaves a row in place), so that a split run gives one record; ``--missing`` runs only
the model/size/modes the record lacks (`bench/experiments/training_record.sh` is one such call).

Writes bench/results/<device>-<date>-training-<commit>.json (or ``--out``), with ``--plot`` a
PNG beside it, and prints the step times, peak memory, correctness and the targets (PASS /
FAIL) last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import importlib.metadata
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402


@dataclass(frozen=True)
class Size:
    name: str
    batch: int
    seq: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    #: Host-bound: the size of the "no slower than torch" target.
    host_bound: bool
    #: Timed steps per provider and steps of one provider in a round, unless --steps /
    #: --round-steps say otherwise. A host-bound step's time spreads by 30% within a run
    #: (NOTES #47) and costs ~15 ms, so that size takes ten times the steps, a round of one
    #: step each: the host's speed moved turn means of ten steps by +-20% from one turn to
    #: the next (NOTES #49), so only neighbouring steps share a state the paired ratio cancels.
    steps: int = 20
    round_steps: int = 2


SIZES = {s.name: s for s in (
    Size("gpu", 2, 4096, 2048, 8, 16, 32000, host_bound=False),
    Size("host", 1, 1024, 512, 8, 8, 32000, host_bound=True, steps=200, round_steps=1),
    Size("tiny", 1, 64, 64, 2, 4, 512, host_bound=True),
)}


#: The special tokens of every config; the batches never hold them (see make_batches).
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FIRST_TEXT_ID = max(SPECIAL_IDS.values()) + 1


@dataclass(frozen=True)
class Model:
    name: str
    causal_lm: str
    config: str
    #: The family's RMSNorm class name: the modules the torch and quack providers replace.
    norm: str
    #: 1.0 for Gemma's ``x_hat * (1 + w)``.
    offset: float
    kv_div: int
    mlp: float

    def build_config(self, size: Size):
        import transformers

        head_dim = size.hidden // size.heads
        extra = {}
        if self.name == "gemma3":
            extra = dict(query_pre_attn_scalar=head_dim, sliding_window=size.seq // 4)
        return getattr(transformers, self.config)(
            vocab_size=size.vocab, hidden_size=size.hidden,
            intermediate_size=int(size.hidden * self.mlp), num_hidden_layers=size.layers,
            num_attention_heads=size.heads, num_key_value_heads=size.heads // self.kv_div,
            head_dim=head_dim, max_position_embeddings=size.seq, use_cache=False,
            **SPECIAL_IDS, **extra)


MODELS = {m.name: m for m in (
    Model("llama", "LlamaForCausalLM", "LlamaConfig", "LlamaRMSNorm", 0.0, 2, 2.75),
    Model("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen3RMSNorm", 0.0, 4, 3.0),
    Model("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma3RMSNorm", 1.0, 4, 3.0),
)}
PROVIDERS = ("hf", "torch", "liger", "quack", "tilenorm", "tilenorm+residual")
MODES = ("eager", "compile")
#: The import each provider needs: a failure is recorded once and the provider skipped.
IMPORTS = {"liger": "liger_kernel.transformers.monkey_patch", "quack": "quack.rmsnorm",
           "tilenorm": "tilenorm.transformers", "tilenorm+residual": "tilenorm.transformers"}
#: Providers whose kernels exist only on CUDA devices.
CUDA_ONLY = ("liger", "quack")
OURS = ("tilenorm", "tilenorm+residual")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: Step 0 against the reference, by dtype: the loss's relative difference, and each parameter's
#: gradient norm's. In bf16 a norm computed another (correct) way rounds differently and the
#: difference goes through every layer's backward; HF's own run-to-run noise is in its rows.
#: In fp32 only the order of operations differs.
LOSS0_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
#: Issue 17: the loss after the training run within this of HF's.
TRAIN_LOSS_TOL = 1e-3
TIMINGS = ("interleaved", "sequential")
#: ``--profile``: steps profiled after the timed ones, the ops kept (by self CPU time) and
#: the kernels kept (by GPU time).
PROFILE_STEPS, PROFILE_TOP, PROFILE_KERNELS = 3, 15, 25
#: Dynamo's limits of cache entries per code object and in all, raised so that every
#: provider's compiled model of a group (the same forward's code object, told apart by guards)
#: stays compiled; hitting one raises instead of running the model eagerly.
RECOMPILE_LIMIT, ACCUMULATED_RECOMPILE_LIMIT = 64, 1024


# --- providers --------------------------------------------------------------------------


def _eps(norm: torch.nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _swap_norms(model: torch.nn.Module, spec: Model, make: Callable[[int, float], torch.nn.Module]
                ) -> int:
    """Replace every ``spec.norm`` module by ``make(dim, eps)`` holding the same weight
    Parameter (so the optimizer and state dict see the same parameters); the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == spec.norm:
                new = make(child.weight.shape[0], _eps(child))
                new.weight = child.weight
                setattr(parent, name, new)
                count += 1
    if not count:
        raise RuntimeError(f"no {spec.norm} module in {type(model).__name__}")
    return count


class _TorchOffsetRMSNorm(torch.nn.RMSNorm):
    """Gemma's ``x_hat * (1 + w)`` through torch's RMSNorm, the parameter still ``w``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, 1 + self.weight, self.eps)


def patch_torch(model, spec: Model) -> dict:
    cls = _TorchOffsetRMSNorm if spec.offset else torch.nn.RMSNorm
    count = _swap_norms(model, spec, lambda dim, eps: cls(dim, eps=eps, device="meta"))
    api = ("torch.nn.RMSNorm subclass, F.rms_norm(x, ..., 1 + w)" if spec.offset
           else "torch.nn.RMSNorm")
    return {"api": api, "norm_modules": count}


def patch_quack(model, spec: Model) -> dict:
    q = importlib.import_module("quack.rmsnorm")
    if not hasattr(q, "QuackRMSNorm"):
        raise NotImplementedError("this quack.rmsnorm has no QuackRMSNorm module")
    cls = q.QuackRMSNorm
    api = "quack.rmsnorm.QuackRMSNorm"
    if spec.offset:
        if "weight_offset" not in inspect.signature(q.rmsnorm).parameters:
            raise NotImplementedError("this quack.rmsnorm.rmsnorm has no weight_offset for "
                                      "Gemma's (1 + w)")

        class QuackOffsetRMSNorm(q.QuackRMSNorm):
            def forward(self, x):
                return q.rmsnorm(x, self.weight, eps=self.eps, weight_offset=spec.offset)

        cls = QuackOffsetRMSNorm
        api = "quack.rmsnorm.QuackRMSNorm subclass, rmsnorm(..., weight_offset=1.0)"
    count = _swap_norms(model, spec, lambda dim, eps: cls(dim, eps=eps, device="meta"))
    return {"api": api, "norm_modules": count}


@contextlib.contextmanager
def _module_restored(module):
    """Put ``module``'s globals back afterwards: Liger's ``apply_liger_kernel_to_*`` replace
    classes in the modeling module process-wide (``modeling_llama.LlamaRMSNorm =
    LigerRMSNorm``), which would change the next models built and tilenorm's class checks."""
    before = dict(vars(module))
    try:
        yield
    finally:
        for name in set(vars(module)) - set(before):
            delattr(module, name)
        for name, value in before.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def patch_liger(model, spec: Model) -> dict:
    mp = importlib.import_module("liger_kernel.transformers.monkey_patch")
    model_type = model.config.model_type
    if model_type not in mp.MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise NotImplementedError(f"this Liger has no kernels for {model_type}")
    apply_fn = mp.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    # Every boolean option off but the norm, whatever options this Liger version has.
    options = {name: name == "rms_norm"
               for name, p in inspect.signature(apply_fn).parameters.items()
               if isinstance(p.default, bool)}
    if "rms_norm" not in options:
        raise NotImplementedError(f"{apply_fn.__name__} has no rms_norm option")
    with _module_restored(sys.modules[type(model).__module__]):
        mp._apply_liger_kernel_to_instance(model=model, **options)
    # Liger binds its forward on each norm instance: count them, so that a silent no-op shows.
    count = sum("forward" in m.__dict__ for m in model.modules()
                if type(m).__name__ == spec.norm)
    if not count:
        raise RuntimeError(f"Liger patched no {spec.norm} of {type(model).__name__}")
    return {"api": f"_apply_liger_kernel_to_instance ({apply_fn.__name__}) {options}",
            "norm_modules": count}


def _patch_tilenorm(model, residual: bool) -> dict:
    import tilenorm.transformers as tt

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tt.apply(model, residual=residual)
    if not report.norm_modules:
        raise RuntimeError(f"tilenorm.transformers.apply patched no norm:\n{report}")
    return {"api": f"tilenorm.transformers.apply(model, residual={residual})",
            "norm_modules": report.norm_modules, "per_head_norms": report.per_head_norms,
            "fused_layers": report.fused_layers, "fused_across": report.fused_across,
            "report": str(report),
            "warnings": [str(w.message)[:500] for w in caught]}


PATCHES: dict[str, Callable[[torch.nn.Module, Model], dict]] = {
    "hf": lambda model, spec: {"api": f"transformers' {spec.norm}"},
    "torch": patch_torch,
    "liger": patch_liger,
    "quack": patch_quack,
    "tilenorm": lambda model, spec: _patch_tilenorm(model, residual=False),
    "tilenorm+residual": lambda model, spec: _patch_tilenorm(model, residual=True),
}


# --- models, data, steps ----------------------------------------------------------------


def build_base(spec: Model, size: Size, device: torch.device, dtype: torch.dtype, seed: int):
    """The model every provider copies: built on the device from the seed, norm weights
    randomized (HF initializes them to 1, or 0 for Gemma, where any norm gives the same
    weight gradient up to rounding), cast to ``dtype``, in training mode."""
    import transformers

    config = spec.build_config(size)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, spec.causal_lm)(config)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == spec.norm:
                module.weight.copy_(1 - spec.offset + 0.1 * torch.randn_like(module.weight))
    return model.to(dtype).train()


def make_batches(size: Size, count: int, seed: int, device: torch.device) -> torch.Tensor:
    """``count`` batches of token ids, Zipf-distributed over the text ids (``FIRST_TEXT_ID``
    up: rank k, id ``FIRST_TEXT_ID + k - 1``, with probability ~ 1/k), drawn on the CPU from
    ``seed`` so every device gets the same. Never a special id: the pad id's embedding row is
    zero (``padding_idx``), and a sequence starting with it keeps an exactly zero residual row
    whose norms' backward overflows in Gemma3 (see the module's docstring)."""
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, size.vocab - FIRST_TEXT_ID + 1, dtype=torch.float64)
    ranks = torch.multinomial(probs, count * size.batch * size.seq, replacement=True,
                              generator=g)
    return (ranks + FIRST_TEXT_ID).view(count, size.batch, size.seq).to(device)


def make_optimizer(model: torch.nn.Module, lr: float) -> tuple[torch.optim.Optimizer, bool]:
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True), True
    except (RuntimeError, ValueError):  # fused AdamW is not built for every device and dtype
        return torch.optim.AdamW(params, lr=lr), False


def forward_backward(call, ids: torch.Tensor) -> torch.Tensor:
    loss = call(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def grad_norms(model: torch.nn.Module) -> dict[str, float]:
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    values = torch.stack([torch.linalg.vector_norm(g.float()) for _, g in named]).tolist()
    return {n: v for (n, _), v in zip(named, values, strict=True)}


@dataclass
class Trace:
    """What one run of a provider measured."""

    loss0: float
    grads0: dict[str, float]
    losses: list[float]
    step_ms: list[float] = field(default_factory=list)
    #: Each timed turn's mean step time (its steps run back to back).
    turn_ms: list[float] = field(default_factory=list)
    first_step_s: float = 0.0
    peak_gib: float | None = None
    fused_adamw: bool = False


class Runner:
    """One provider's model in training: its optimizer, the module it calls (its own
    ``torch.compile`` of the model under compile), and every step it took, step i on batch
    i mod ``len(batches)``."""

    def __init__(self, model: torch.nn.Module, mode: str, batches: torch.Tensor, lr: float,
                 device: torch.device):
        self.model, self.batches, self.device = model, batches, device
        self.opt, self.fused = make_optimizer(model, lr)
        self.call = compiled_call(model) if mode == "compile" else model
        self.losses: list[torch.Tensor] = []
        self.grads0: dict[str, float] = {}
        self.first_step_s = 0.0
        self.step_ms: list[float] = []
        self.turn_ms: list[float] = []
        self.peak_bytes: int | None = None
        #: Wall seconds of this provider's setup and timed steps (its row's ``config_s``).
        self.wall_s = 0.0

    def step(self) -> None:
        loss = forward_backward(self.call, self.batches[len(self.losses) % len(self.batches)])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss)

    def start(self, steps: int) -> None:
        """Step 0 (its gradients kept for the check before its update; it compiles, under
        compile), then untimed steps up to ``steps`` in all."""
        begin = time.perf_counter()
        self.losses.append(forward_backward(self.call, self.batches[0]))
        self.grads0 = grad_norms(self.model)  # synchronizes: the first step's time is all of it
        self.first_step_s = time.perf_counter() - begin
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        while len(self.losses) < steps:
            self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, steps: int) -> list[float]:
        """``steps`` steps back to back, each between two CUDA events (no synchronization in
        between, as in a training loop), on the CPU each step's wall time; ms each. Updates
        the peak memory above the weights: the most allocated during these steps beyond what
        was allocated before them, plus the optimizer state."""
        begin = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(steps)]
            for first, last in events:
                first.record()
                self.step()
                last.record()
            torch.cuda.synchronize(self.device)
            ms = [first.elapsed_time(last) for first, last in events]
            peak = torch.cuda.max_memory_allocated(self.device) - before + _state_bytes(self.opt)
            self.peak_bytes = max(peak, self.peak_bytes or 0)
        else:
            ms = []
            for _ in range(steps):
                start = time.perf_counter()
                self.step()
                ms.append((time.perf_counter() - start) * 1e3)
        self.wall_s += time.perf_counter() - begin
        return ms

    def profile(self, steps: int, top: int, kernels: int) -> dict:
        """``steps`` more steps under ``torch.profiler``: ``host``, the ``top`` ops by self CPU
        time with their call counts over those steps; on a GPU ``kernels``, the ``kernels``
        kernels with the most GPU time, and the kernels' count and GPU time a step."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                self.step()
            if cuda:
                torch.cuda.synchronize(self.device)
        events = prof.key_averages()
        ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        out = {"host": [{"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total}
                        for e in ops[:top]]}
        if cuda:
            on_gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                            key=lambda e: e.self_device_time_total, reverse=True)
            out["kernels"] = [{"name": e.key[:160], "count": e.count,
                               "gpu_us": e.self_device_time_total} for e in on_gpu[:kernels]]
            out["kernels_per_step"] = sum(e.count for e in on_gpu) / steps
            out["gpu_us_per_step"] = sum(e.self_device_time_total for e in on_gpu) / steps
        return out

    def trace(self) -> Trace:
        values = torch.stack(self.losses).float().tolist()
        peak = None if self.peak_bytes is None else self.peak_bytes / 2**30
        return Trace(values[0], self.grads0, values, self.step_ms, self.turn_ms,
                     self.first_step_s, peak, self.fused)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in opt.state.values()
               for v in state.values() if torch.is_tensor(v))


def round_order(names: list[str], k: int) -> list[str]:
    """Round k's order of ``names``: row k of a Williams design, a Latin square whose rows
    (n of them, 2n for an odd count n) put each name in every place once and after every
    other name once: the first row 0, 1, n-1, 2, n-2, ..., each next one adding 1 (mod n), an
    odd n's rows also reversed. A turn's place in its round and the turn before it both move
    a host-bound step's time (bench/NOTES.md #49), and a paired ratio compares two providers'
    turns of one round: balanced over a cycle, neither favours a provider."""
    n = len(names)
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    rows = [[(j + i) % n for j in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [names[j] for j in rows[k % len(rows)]] if n else []


def time_rounds(runners: dict[str, Runner], steps: int, round_steps: int,
                failed: dict[str, Exception]) -> int:
    """Fill each runner's ``step_ms`` with ``steps`` timed steps: round k runs
    ``round_steps`` steps of every runner before round k + 1 of any, in the order
    :func:`round_order` gives round k, after one untimed round; garbage collected before each
    round, and not during it. A runner that raises is moved to ``failed`` and the others go
    on. The number of timed rounds."""
    rounds = math.ceil(steps / round_steps)
    for k in range(rounds + 1):
        names = list(runners)
        gc.collect()
        gc.disable()  # as timeit: no collection lands inside a round
        try:
            for name in round_order(names, k):
                count = (round_steps if k == 0
                         else min(round_steps, steps - (k - 1) * round_steps))
                try:
                    ms = runners[name].timed(count)
                except Exception as e:
                    traceback.print_exc(limit=4)
                    failed[name] = e.with_traceback(None)
                    del runners[name]
                    continue
                if k:
                    runners[name].step_ms += ms
                    runners[name].turn_ms.append(sum(ms) / len(ms))
        finally:
            gc.enable()
        if not runners:
            break
    return rounds


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def compare(trace: Trace, ref: Trace, train_steps: int | None) -> dict:
    """The correctness fields of a row: step 0 and the trained loss against the reference."""
    total = math.sqrt(sum(v * v for v in trace.grads0.values()))
    ref_total = math.sqrt(sum(v * v for v in ref.grads0.values()))
    per_param = {n: _rel(trace.grads0.get(n, math.inf), v) for n, v in ref.grads0.items()}
    extra = set(trace.grads0) - set(ref.grads0)  # a gradient where HF has none is wrong too
    per_param.update({n: math.inf for n in extra})
    worst = max(per_param, key=per_param.get)
    row = {"loss0": trace.loss0, "ref_loss0": ref.loss0, "loss0_rel": _rel(trace.loss0, ref.loss0),
           "grad_norm": total, "ref_grad_norm": ref_total,
           "grad_norm_rel": _rel(total, ref_total), "param_grad_rel_max": per_param[worst],
           "param_grad_worst": worst, "train_steps": None, "train_loss": None,
           "ref_train_loss": None, "train_loss_rel": None}
    if train_steps:
        row.update(train_steps=train_steps, train_loss=trace.losses[train_steps],
                   ref_train_loss=ref.losses[train_steps],
                   train_loss_rel=_rel(trace.losses[train_steps], ref.losses[train_steps]))
    return row


def compiled_call(model: torch.nn.Module) -> Callable:
    """``torch.compile`` of a call of ``model`` through a wrapper whose code object is its own.
    Dynamo keeps compiled entries on the code object of the frame it compiles: compiled as
    ``torch.compile(model)``, every provider's model of one class shares one cache, and each
    call first tests the guards of the entries ahead of its own, a host cost that depends on
    which providers ran before and that a process with one model never pays (#67: 264-396 us
    a step in Gemma3's host-size compile, hf's the cheapest). The wrapper only calls the
    model, so the traced graph is the model's."""
    def call(*args, **kwargs):
        return model(*args, **kwargs)

    own = types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__,
                             call.__defaults__, call.__closure__)
    return torch.compile(own, dynamic=False)


def _raise_recompile_limits() -> dict:
    """Dynamo's cache limits at least ``RECOMPILE_LIMIT`` / ``ACCUMULATED_RECOMPILE_LIMIT``
    (``cache_size_limit`` / ``accumulated_cache_size_limit`` in older torch), failing where
    one is hit; the settings, for the record."""
    config = torch._dynamo.config
    settings = {}
    for names, value in ((("recompile_limit", "cache_size_limit"), RECOMPILE_LIMIT),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"),
                          ACCUMULATED_RECOMPILE_LIMIT),
                         (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True)):
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None:
            setattr(config, name, max(getattr(config, name), value))
            settings[name] = getattr(config, name)
    return settings


def free(device: torch.device, compiled: bool) -> None:
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- records ----------------------------------------------------------------------------


def _key(entry: dict) -> tuple:
    return entry["model"], entry["size"], entry["mode"], entry["provider"]


def put(record: dict, part: str, entry: dict) -> None:
    """Add a row, failure or skip to the record, with the commit that wrote it (a record
    written over several calls may hold several), replacing what an earlier run writing the
    same file recorded for that configuration; a skip leaves an earlier run's row in place."""
    key = _key(entry)
    if part == "skipped" and any(_key(r) == key for r in record["rows"]):
        return
    for name in ("rows", "failures", "skipped"):
        record[name] = [e for e in record[name] if _key(e) != key]
    record[part].append({**entry, "commit": record["commit"]})


def commits(record: dict) -> str:
    """The commits that wrote the record's rows (the record's own where a row names none)."""
    seen = dict.fromkeys(r.get("commit") or record["commit"] for r in record["rows"])
    return ", ".join(seen) or record["commit"]


def _versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("transformers", "liger-kernel", "quack-kernels", "triton", "cuda-tile",
                 "nvidia-cutlass-dsl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _decisions(spec: Model, size: Size, device, dtype) -> dict[str, str]:
    """What tilenorm runs for this model's norms (kernels or the reference path, and why); a
    warning where a CUDA run would time the reference path."""
    import tilenorm

    tokens, head_dim = size.batch * size.seq, size.hidden // size.heads
    x = torch.empty(tokens, size.hidden, device=device, dtype=dtype)
    w = torch.empty(size.hidden, device=device, dtype=dtype)
    found = {"norm": tilenorm.explain(x, w),
             "residual + norm": tilenorm.explain(x, w, torch.empty_like(x))}
    if spec.name != "llama":
        q = torch.empty(tokens, size.heads, head_dim, device=device, dtype=dtype)
        found["q/k norm"] = tilenorm.explain(q, w[:head_dim])
    for what, decision in found.items():
        if device.type == "cuda" and not decision.uses_kernel:
            print(f"WARNING: tilenorm's {what} of {spec.name} {size.name} takes the reference "
                  f"path ({decision.reason}); --experimental runs unvalidated kernels")
    return {what: str(decision) for what, decision in found.items()}


def _groups(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Rows by (model, size, mode), then by provider, in the order measured."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(_key(r)[:3], {})[r["provider"]] = r
    return groups


def sign_test_turns(turns: int, level: float = 0.05) -> int:
    """The fewest of ``turns`` paired turns one provider must win for a two-sided sign test
    at ``level`` to call it faster (turns + 1 where none suffices)."""
    tail = 0.0
    for k in range(turns, -1, -1):
        tail += math.comb(turns, k) / 2 ** turns
        if tail > level / 2:
            return k + 1
    return turns + 1


def paired(row: dict | None, base: dict | None) -> dict | None:
    """``row`` against ``base`` turn by turn: providers of a group are timed in rounds, turn k
    of each in round k, so the host's drift over a run (NOTES.md #49) cancels in the ratio of
    turn k's mean steps. The median ratio with its quartiles, the turns ``row`` won, and the
    sign test's verdict: "faster", "slower", or "tie" (within the noise)."""
    a, b = (r and r.get("turns_ms") for r in (row, base))
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    q = statistics.quantiles(ratios, n=4)
    wins, need = sum(x < y for x, y in zip(a, b, strict=True)), sign_test_turns(len(a))
    verdict = ("faster" if wins >= need else "slower" if len(a) - wins >= need else "tie")
    return {"ratio": statistics.median(ratios), "ratio_p25": q[0], "ratio_p75": q[2],
            "won": wins, "turns": len(a), "verdict": verdict}


def _slowest_against(ours: dict | None, others: dict[str, dict]
                     ) -> tuple[str | None, dict | None]:
    """The provider "fastest" is judged against, with ours paired with it: of those the
    paired test finds ours slower than, the one with the highest ratio; where there is none,
    the fastest by median."""
    if not others:
        return None, None
    pairs = {p: paired(ours, r) for p, r in others.items()}
    lost = [p for p, v in pairs.items() if v and v["verdict"] == "slower"]
    against = (max(lost, key=lambda p: pairs[p]["ratio"]) if lost
               else min(others, key=lambda p: others[p]["step_ms"]))
    return against, pairs[against]


def targets(rows: list[dict], dtype: torch.dtype) -> list[dict]:
    """Issue 17's targets over the rows that were measured; the step-time ones carry the
    paired comparison (:func:`paired`) with the provider they are held against, and pass
    where it does not find ours slower ("fastest": paired with every other provider, none
    measurably faster, the target naming the one that is where there is one; "<= torch": not
    measurably slower), else where the medians say so."""
    out = []
    for (model, size, mode), by in _groups(rows).items():
        where = f"{model} {size} {mode}"
        ours = by.get("tilenorm+residual")
        others = {p: r for p, r in by.items() if p != "tilenorm+residual"}
        against, pair = _slowest_against(ours, others)
        out.append({"target": f"{where}: tilenorm+residual fastest", "unit": "ms",
                    "measured": ours and ours["step_ms"],
                    "limit": against and others[against]["step_ms"], "against": against,
                    "paired": pair})
        torch_row = by.get("torch")
        for provider in OURS:
            row = by.get(provider)
            if SIZES[size].host_bound:
                out.append({"target": f"{where}: {provider} step <= torch", "unit": "ms",
                            "measured": row and row["step_ms"],
                            "limit": torch_row and torch_row["step_ms"], "against": "torch",
                            "paired": paired(row, torch_row)})
            if row is None:
                continue
            out.append({"target": f"{where}: {provider} step 0 loss <= {LOSS0_TOL[dtype]:g}",
                        "measured": row["loss0_rel"], "limit": LOSS0_TOL[dtype]})
            out.append({"target": f"{where}: {provider} step 0 grad norms <= "
                                  f"{GRAD_TOL[dtype]:g}",
                        "measured": row["param_grad_rel_max"], "limit": GRAD_TOL[dtype]})
            if row["train_loss_rel"] is not None:
                out.append({"target": f"{where}: {provider} loss after {row['train_steps']} "
                                      f"steps <= {TRAIN_LOSS_TOL:g}",
                            "measured": row["train_loss_rel"], "limit": TRAIN_LOSS_TOL})
    for t in out:
        t.setdefault("unit", "rel")
        t["pass"] = (None if t["measured"] is None or t["limit"] is None
                     else t["paired"]["verdict"] != "slower" if t.get("paired")
                     else t["measured"] <= t["limit"])
    return out


def print_tables(record: dict) -> None:
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in record["rows"])]
    groups = _groups(record["rows"])
    copy_gbps = record["copy_gbps"]
    print(f"\n{record['device']} ({'-' if copy_gbps is None else f'{copy_gbps:.0f}'} GB/s copy), "
          f"{record['dtype']}, commit {commits(record)}; the median of each provider's "
          f"timed steps ({record['args']['steps'] or 'the size default'}), timed "
          f"{record['args'].get('timing', 'sequential')}")
    for title, column, fmt in (("step ms", "step_ms", "{:.2f}"),
                               ("peak GiB above the weights", "peak_gib", "{:.2f}")):
        if all(r[column] is None for r in record["rows"]):
            continue  # no memory figures on the CPU
        print(f"\n{title:>26} " + " ".join(f"{p:>17}" for p in providers))
        for (model, size, mode), by in groups.items():
            cells = []
            for p in providers:
                v = by[p][column] if p in by else None
                cells.append("-" if v is None else fmt.format(v))
            print(f"{f'{model} {size} {mode}':>26} " + " ".join(f"{c:>17}" for c in cells))

    def e(v):
        return "-" if v is None else f"{v:.1e}"

    def ms(v):
        return "-" if v is None else f"{v:.2f} ms"

    print(f"\n{'correctness vs HF eager':>26} {'provider':>17} {'loss0':>8} {'grad':>8} "
          f"{'param':>8} {'trained':>8}  worst parameter")
    for (model, size, mode), by in groups.items():
        for p in providers:
            if p in by:
                r = by[p]
                print(f"{f'{model} {size} {mode}':>26} {p:>17} {e(r['loss0_rel']):>8} "
                      f"{e(r['grad_norm_rel']):>8} {e(r['param_grad_rel_max']):>8} "
                      f"{e(r['train_loss_rel']):>8}  {r['param_grad_worst']}")
    for name, why in record["absent"].items():
        print(f"absent: {name}: {why}")
    for f in record["failures"]:
        print(f"FAILED {' '.join(_key(f))}: {f['error']}")
    for s in record["skipped"]:
        print(f"skipped {' '.join(_key(s))}: {s['reason']}")
    print(f"\n{'target':>62} {'measured':>9} {'limit':>9}  result  paired by turn (ratio "
          f"[p25, p75], turns won: sign test)")
    for t in record["targets"]:
        result = "MISSING" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        show = e if t["unit"] == "rel" else ms
        pair = t.get("paired")
        how = "" if not pair else (
            f"  {pair['ratio']:.3f} [{pair['ratio_p25']:.3f}, {pair['ratio_p75']:.3f}] of "
            f"{t['against']}'s, {pair['won']}/{pair['turns']}: {pair['verdict']}")
        print(f"{t['target']:>62} {show(t['measured']):>9} {show(t['limit']):>9}  "
              f"{result:7}{how}")


def _quartiles(row: dict) -> tuple[float, float]:
    """The 25th and 75th percentile of a row's turns' mean step ms (of its steps in records
    from before turns were kept; its median twice where it has one)."""
    steps = row.get("turns_ms") or row.get("steps_ms") or [row["step_ms"]]
    if len(steps) < 2:
        return row["step_ms"], row["step_ms"]
    q = statistics.quantiles(steps, n=4)
    return q[0], q[2]


def plot(record: dict, path: Path) -> None:
    """Step time per provider, one panel per model/size/mode, relative to HF's (ms on top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(record["rows"])
    if not groups:
        raise ValueError("no rows to plot")
    cols = min(4, len(groups))
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(max(4.2 * cols, 8), 3.6 * nrows),
                             squeeze=False)
    for ax, ((model, size, mode), by) in zip(axes.flat, groups.items(), strict=False):
        names = [p for p in PROVIDERS if p in by]
        base = by["hf"]["step_ms"] if "hf" in by else 1.0
        values = [by[p]["step_ms"] / base for p in names]
        # The steps' quartiles as error bars: a host-bound step spreads (NOTES #47).
        quartiles = [_quartiles(by[p]) for p in names]
        spread = [[(by[p]["step_ms"] - q[0]) / base for p, q in zip(names, quartiles,
                                                                   strict=True)],
                  [(q[1] - by[p]["step_ms"]) / base for p, q in zip(names, quartiles,
                                                                  strict=True)]]
        bars = ax.bar(range(len(names)), values, yerr=spread, capsize=2,
                      color=["C3" if p in OURS else "C0" for p in names])
        for bar, p in zip(bars, names, strict=True):
            ax.annotate(f"{by[p]['step_ms']:.1f}", (bar.get_x() + bar.get_width() / 2,
                                                   bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("step time / HF's" if "hf" in by else "step ms")
        ax.set_title(f"{model} {size} {mode}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(f"Training step, {record['device']}, {record['dtype']}, {commits(record)}, "
                 f"timed {record['args'].get('timing', 'sequential')} (ms on the bars)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Workbench:
    """The models, batches and references of one run, built when first needed and kept (every
    mode and provider of a model/size copies the same base), and one model/size/mode's
    measurement."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype, record: dict, *,
                 decisions: bool, train_sizes: list[str]):
        self.args, self.device, self.dtype, self.record = args, device, dtype, record
        self.decisions, self.train_sizes = decisions, train_sizes
        self.bases: dict[tuple[str, str], torch.nn.Module] = {}
        self.batches: dict[tuple[str, str], torch.Tensor] = {}
        self.refs: dict[tuple[str, str], Trace | str] = {}

    def reference(self, spec: Model, size: Size) -> Trace:
        """HF eager's step 0 and, for the training sizes, its losses over the training run;
        built with the base model. A failure is kept: every configuration of the model/size
        reports it without trying again."""
        key = (spec.name, size.name)
        if key not in self.refs:
            try:
                self.bases[key] = build_base(spec, size, self.device, self.dtype, self.args.seed)
                self.batches[key] = make_batches(size, self.args.batches, self.args.seed + 1,
                                                 self.device)
                if self.decisions:
                    self.record["tilenorm_decisions"][f"{spec.name}/{size.name}"] = _decisions(
                        spec, size, self.device, self.dtype)
                trained = self.args.train_steps if size.name in self.train_sizes else 0
                runner = Runner(copy.deepcopy(self.bases[key]), "eager", self.batches[key],
                                self.args.lr, self.device)
                runner.start(trained + 1)
                ref = runner.trace()
                del runner
                self.record["references"][f"{spec.name}/{size.name}"] = {
                    "loss0": ref.loss0, "losses": ref.losses,
                    "grad_norm": math.sqrt(sum(v * v for v in ref.grads0.values())),
                    "attn_implementation": self.bases[key].config._attn_implementation}
                self.refs[key] = ref
            except Exception as e:
                traceback.print_exc(limit=4)
                self.refs[key] = f"{type(e).__name__}: {e}"
            free(self.device, compiled=False)
        ref = self.refs[key]
        if isinstance(ref, str):
            raise RuntimeError(f"no reference for {spec.name} {size.name}: {ref}")
        return ref

    def _start(self, spec: Model, size: Size, mode: str, provider: str, steps: int
               ) -> tuple[Runner, dict]:
        """A patched copy of the base model, started (``Runner.start``): its runner, whose
        ``wall_s`` is the time all this took, and its row's fields from the patch."""
        begin = time.perf_counter()
        key = (spec.name, size.name)
        model = copy.deepcopy(self.bases[key])
        info = PATCHES[provider](model, spec)
        self.record["providers"][f"{provider} {spec.name}"] = info.pop("api")
        runner = Runner(model, mode, self.batches[key], self.args.lr, self.device)
        runner.start(steps)
        runner.wall_s = time.perf_counter() - begin
        return runner, info

    def measure_group(self, spec: Model, size: Size, mode: str, providers: list[str],
                      log: Callable[[str], None]) -> dict[str, dict | Exception]:
        """Every provider of one model/size/mode, each on its own copy of the base model: its
        row's fields, or what it raised (``NotImplementedError``: the provider has no such
        kernel). ``--timing interleaved`` builds, patches, compiles and starts (step 0, the
        warm-up and the training run) every provider first and then times them in rounds;
        ``sequential`` does all of it one provider at a time, each freed before the next."""
        ref, args = self.reference(spec, size), self.args
        trained = (args.train_steps if size.name in self.train_sizes
                   and (mode == "eager" or args.train_compile) else 0)
        warmup = args.compile_warmup if mode == "compile" else args.warmup
        chunks = [providers] if args.timing == "interleaved" else [[p] for p in providers]
        out: dict[str, dict | Exception] = {}
        for chunk in chunks:
            runners: dict[str, Runner] = {}
            infos: dict[str, dict] = {}
            for provider in chunk:
                try:
                    runners[provider], infos[provider] = self._start(
                        spec, size, mode, provider, max(warmup, trained + 1))
                except Exception as e:
                    if not isinstance(e, NotImplementedError):
                        traceback.print_exc(limit=4)
                    out[provider] = e.with_traceback(None)  # its frames hold the model
                    continue
                log(f"{provider} ready (first step {runners[provider].first_step_s:.1f} s, "
                    f"{runners[provider].wall_s:.1f} s)")
            failed: dict[str, Exception] = {}
            steps, round_steps = args.steps or size.steps, args.round_steps or size.round_steps
            rounds = time_rounds(runners, steps, round_steps, failed) if runners else 0
            out.update(failed)
            for provider, runner in runners.items():
                profile: dict = {}
                if args.profile:
                    try:
                        got = runner.profile(PROFILE_STEPS, PROFILE_TOP, PROFILE_KERNELS)
                        profile = {"profile_top": got["host"]}
                        if "kernels" in got:
                            profile.update(profile_kernels=got["kernels"], **{
                                k: got[k] for k in ("kernels_per_step", "gpu_us_per_step")})
                    except Exception as e:  # the profile is extra: its failure is recorded
                        profile = {"profile_top": f"{type(e).__name__}: {e}"[:300]}
                trace = runner.trace()
                step_ms = statistics.median(trace.turn_ms)
                p25, p75 = _quartiles({"step_ms": step_ms, "turns_ms": trace.turn_ms})
                out[provider] = {
                    **infos[provider], "timing": args.timing, "rounds": rounds,
                    "round_steps": round_steps, "step_ms": step_ms,
                    "step_ms_p25": p25, "step_ms_p75": p75,
                    "steps_ms": trace.step_ms, "turns_ms": trace.turn_ms,
                    "tokens_per_s": size.batch * size.seq / (step_ms * 1e-3),
                    "first_step_s": trace.first_step_s, "peak_gib": trace.peak_gib,
                    "fused_adamw": trace.fused_adamw, "config_s": runner.wall_s,
                    **({"profile_steps": PROFILE_STEPS, **profile} if args.profile else {}),
                    **compare(trace, ref, trained)}
            runners.clear()
            runner = None  # the last one's model goes too
            # Between groups only, in interleaved timing (main frees after each group).
            if args.timing == "sequential":
                free(self.device, compiled=mode == "compile")
        return out


# --- main -------------------------------------------------------------------------------


def _split(text: str, allowed) -> list[str]:
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in allowed]
    if unknown:
        raise SystemExit(f"unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,qwen3,gemma3")
    parser.add_argument("--sizes", default="gpu,host", help="of gpu, host, tiny")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--steps", type=int,
                        help="timed steps per provider (their median recorded; default: the "
                             "size's, 200 at the host size, 20 otherwise)")
    parser.add_argument("--round-steps", type=int,
                        help="steps of one provider in a round (default: the size's, 1 at "
                             "the host size, 2 otherwise)")
    parser.add_argument("--timing", choices=TIMINGS, default="interleaved",
                        help="interleaved: every provider of a model/size/mode built first, "
                             "then timed in rounds; sequential: one provider after another, "
                             "each freed before the next (less memory)")
    parser.add_argument("--profile", action="store_true",
                        help=f"the top {PROFILE_TOP} host ops (and on a GPU the top "
                             f"{PROFILE_KERNELS} kernels) of {PROFILE_STEPS} steps under "
                             f"torch.profiler after the timed ones, per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, eager")
    parser.add_argument("--compile-warmup", type=int, default=5,
                        help="untimed steps first under compile (the first compiles)")
    parser.add_argument("--train-steps", type=int, default=100,
                        help="updates before the trained-loss check (0: none)")
    parser.add_argument("--train-sizes", default="host,tiny",
                        help="sizes that get the trained-loss check")
    parser.add_argument("--train-compile", action="store_true",
                        help="the trained-loss check under compile too")
    parser.add_argument("--batches", type=int, default=8, help="fixed batches, cycled")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="skip configurations that would end later (0: no limit)")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    parser.add_argument("--missing", action="store_true",
                        help="with an existing --out: run only the model/size/modes that lack "
                             "a row for some provider (a run split over several calls)")
    parser.add_argument("--plot", action="store_true", help="a PNG beside the JSON")
    parser.add_argument("--report", type=Path, metavar="RECORD",
                        help="run nothing: recompute a record's targets (written back), print "
                             "its tables and plot it beside itself (a record written over "
                             "several calls)")
    parser.add_argument("--experimental", action="store_true",
                        help="let tilenorm run kernels not yet validated on a GPU")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch's deterministic algorithms for every provider (HF's own "
                             "run repeats itself bit for bit, so the loss checks judge the norms "
                             "alone; its attention backward is slower: not for the record's "
                             "step times)")
    args = parser.parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True)
    if args.report:
        record = json.loads(args.report.read_text())
        record["targets"] = targets(record["rows"], getattr(torch, record["dtype"]))
        args.report.write_text(json.dumps(record, indent=1) + "\n")  # targets: derived
        plot(record, args.report.with_suffix(".png"))
        print(f"wrote {args.report.with_suffix('.png')}")
        print_tables(record)
        return record
    given = [v for v in (args.steps, args.round_steps) if v is not None]
    if min(*given, args.warmup, args.compile_warmup, args.batches) < 1:
        parser.error("--steps, --round-steps, --warmup, --compile-warmup and --batches must "
                     "be >= 1")
    started = time.perf_counter()
    models = [MODELS[m] for m in _split(args.models, MODELS)]
    sizes = [SIZES[s] for s in _split(args.sizes, SIZES)]
    modes = _split(args.modes, MODES)
    providers = _split(args.providers, PROVIDERS)
    train_sizes = _split(args.train_sizes, SIZES)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: --device cpu --sizes tiny for a smoke test")
    import transformers  # noqa: F401  (the models; a clear error before anything runs)

    absent = {}
    for name in providers:
        if name in CUDA_ONLY and not cuda:
            absent[name] = "needs a CUDA device (its kernels are Triton / CuTe DSL)"
            continue
        if name in IMPORTS:
            try:
                importlib.import_module(IMPORTS[name])
            except Exception as e:  # an absent peer is recorded, not fatal
                absent[name] = f"{type(e).__name__}: {e}"[:300]
    if cuda and set(OURS) & set(providers) - absent.keys():
        common.refuse_unvalidated(args.experimental)

    copy_bw = common.copy_gbps() if cuda else None
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    date, commit = datetime.date.today().isoformat(), common.git_commit()
    slug = common.device_slug() if cuda else "cpu"
    path = args.out or common.RESULTS_DIR / f"{slug}-{date}-training-{commit}.json"
    groups = [(spec, size, mode) for mode in modes for spec in models for size in sizes]
    runs = [p for p in providers if p not in absent]
    record = {"device": name, "date": date, "commit": commit, "copy_gbps": copy_bw,
              "versions": _versions(), "dtype": args.dtype,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "dynamo": _raise_recompile_limits() if "compile" in modes else None,
              "sizes": {s.name: asdict(s) for s in sizes},
              "models": {m.name: asdict(m) for m in models},
              "absent": absent, "providers": {}, "references": {}, "tilenorm_decisions": {},
              "rows": [], "failures": [], "skipped": [], "targets": []}
    if path.exists():  # a run split over several calls: one record (see put)
        old = json.loads(path.read_text())
        for part in ("rows", "failures", "skipped"):
            record[part] = old.get(part, [])
        for part in ("absent", "providers", "references", "tilenorm_decisions"):
            record[part] = {**old.get(part, {}), **record[part]}

    recorded = {_key(r) for r in record["rows"]}

    def write():
        record["targets"] = targets(record["rows"], dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")

    print(f"{name}: copy {'-' if copy_bw is None else f'{copy_bw:.0f}'} GB/s; {len(groups)} "
          f"model/size/modes of {len(runs)} providers, timed {args.timing}; absent: "
          f"{', '.join(absent) or 'none'}", flush=True)
    trains = "eager" in modes or args.train_compile
    bench = Workbench(args, device, dtype, record,
                      decisions=any(p in OURS for p in runs),
                      train_sizes=train_sizes if trains else [])
    #: Seconds per provider of a model/size/mode, the most seen, by (size, mode).
    estimate: dict[tuple[str, str], float] = {}
    for n, (spec, size, mode) in enumerate(groups if runs else [], 1):
        group = {"model": spec.name, "size": size.name, "mode": mode}
        elapsed = time.perf_counter() - started
        head = f"[{n}/{len(groups)} {elapsed:5.0f}s] {' '.join(group.values())}:"
        if args.missing and all(_key({**group, "provider": p}) in recorded for p in runs):
            print(f"{head} recorded already", flush=True)
            continue
        # All providers or none: the comparison (and the "fastest" target) needs all of them.
        guess = estimate.get((size.name, mode), max(
            (v for (_, m), v in estimate.items() if m == mode), default=0.0))
        if args.budget_s and elapsed + guess * len(runs) > args.budget_s:
            for provider in runs:
                put(record, "skipped", {**group, "provider": provider,
                                        "reason": f"budget: {elapsed:.0f} s spent of "
                                                  f"{args.budget_s:.0f}, ~{guess:.0f} s a "
                                                  f"provider"})
            print(f"{head} skipped (budget)", flush=True)
            continue
        try:
            bench.reference(spec, size)  # outside the group's time (its estimate)
        except Exception as e:
            for provider in runs:
                put(record, "failures", {**group, "provider": provider,
                                         "error": f"{type(e).__name__}: {e}"[:800]})
            print(f"{head} FAILED (reference)", flush=True)
            continue
        begin = time.perf_counter()
        try:
            results = bench.measure_group(
                spec, size, mode, runs, lambda text, head=head: print(f"{head} {text}", flush=True))
        except Exception as e:  # not one provider's: every row of the group fails
            traceback.print_exc(limit=4)
            results = dict.fromkeys(runs, e.with_traceback(None))
        finally:
            free(device, compiled=mode == "compile")
        seconds = time.perf_counter() - begin
        estimate[(size.name, mode)] = max(seconds / len(runs),
                                          estimate.get((size.name, mode), 0.0))
        for provider in runs:
            where = {**group, "provider": provider}
            result = results[provider]
            if isinstance(result, NotImplementedError):
                record["absent"][f"{provider} {spec.name}"] = str(result)[:300]
                print(f"{head} {provider} absent: {result}", flush=True)
            elif isinstance(result, Exception):
                put(record, "failures", {**where,
                                         "error": f"{type(result).__name__}: {result}"[:800]})
                print(f"{head} {provider} FAILED: {type(result).__name__}: {result}"[:300],
                      flush=True)
            else:
                put(record, "rows", {**where, **result})
                print(f"{head} {provider} {result['step_ms']:.2f} ms/step (first step "
                      f"{result['first_step_s']:.1f} s, {result['config_s']:.1f} s)",
                      flush=True)
        write()
    write()
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    if args.plot:
        try:
            plot(record, path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
        except Exception as e:  # a missing matplotlib costs the plot, not the record
            print(f"plot skipped: {type(e).__name__}: {e}")
    print_tables(record)
    return record


if __name__ == "__main__":
    main()
