"""tilenorm.transformers: patching tiny models of every supported family (built from their
configs, no downloads) and checking outputs and gradients against the unpatched model, reset,
class-level patching, torch.compile, activation checkpointing, PEFT and hooks."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilenorm  # noqa: E402
import tilenorm.transformers as tt  # noqa: E402
from tilenorm.testing import rel_error as rel  # noqa: E402

gpu = pytest.mark.gpu
VOCAB, HIDDEN, LAYERS, HEADS, HEAD_DIM = 97, 64, 2, 4, 16
#: The tilenorm op rounds once where Llama-style norms round x_hat to the input dtype before
#: the weight multiply; in bf16 both stay this close to the fp32 model.
BF16_TOL = 5e-2


def _config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    gqa = dict(num_key_value_heads=2)
    t = transformers
    configs = {
        "llama": lambda: t.LlamaConfig(**common, **gqa),
        "mistral": lambda: t.MistralConfig(**common, **gqa),
        "qwen2": lambda: t.Qwen2Config(**common, **gqa),
        "qwen3": lambda: t.Qwen3Config(**common, **gqa, head_dim=HEAD_DIM),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**common, **gqa, head_dim=HEAD_DIM, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=32,
                                              decoder_sparse_step=1),
        "gemma2": lambda: t.Gemma2Config(**common, **gqa, head_dim=HEAD_DIM,
                                         query_pre_attn_scalar=HEAD_DIM, sliding_window=8),
        "gemma3": lambda: t.Gemma3TextConfig(**common, **gqa, head_dim=HEAD_DIM,
                                             query_pre_attn_scalar=HEAD_DIM, sliding_window=8),
        "phi3": lambda: t.Phi3Config(**common, **gqa),
        "olmo2": lambda: t.Olmo2Config(**common, **gqa),
        "gpt_neox": lambda: t.GPTNeoXConfig(**common),
    }
    config = configs[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _model_class(family: str):
    t = transformers
    return {"llama": t.LlamaForCausalLM, "mistral": t.MistralForCausalLM,
            "qwen2": t.Qwen2ForCausalLM, "qwen3": t.Qwen3ForCausalLM,
            "qwen3_moe": t.Qwen3MoeForCausalLM, "gemma2": t.Gemma2ForCausalLM,
            "gemma3": t.Gemma3ForCausalLM, "phi3": t.Phi3ForCausalLM,
            "olmo2": t.Olmo2ForCausalLM, "gpt_neox": t.GPTNeoXForCausalLM}[family]


def build(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A tiny model with random weights, norms' included (so that the weight, Gemma's
    ``1 + w`` and biases all matter)."""
    torch.manual_seed(seed)
    model = _model_class(family)(_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if "gemma" in family else 1.0) + 0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


#: family -> (norm modules, per-head norms, fused layers, norms fused with the add ending the
#: layer before: layer 1's input norm and the final norm) of the 2-layer models.
EXPECTED = {
    "llama": (5, 0, 2, 2), "mistral": (5, 0, 2, 2), "qwen2": (5, 0, 2, 2),
    "qwen3": (5, 4, 2, 2), "qwen3_moe": (5, 4, 2, 2), "gemma2": (9, 0, 2, 0),
    "gemma3": (9, 4, 2, 0), "phi3": (5, 0, 2, 0), "olmo2": (9, 0, 0, 0), "gpt_neox": (5, 0, 0, 0),
}
FAMILIES = list(EXPECTED)
#: The families whose model loop carries (output, residual) pairs.
ACROSS = [f for f in FAMILIES if EXPECTED[f][3]]


def _counts(report):
    return report.norm_modules, report.per_head_norms, report.fused_layers, report.fused_across


def _run(model, ids, proj):
    """Logits and the gradients of a random projection of them, by parameter name."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits.float() * proj).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _inputs(seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    proj = torch.randn(2, 12, VOCAB, generator=g)
    return ids.to(device), proj.to(device)


def _worst(out, ref):
    logits, grads = out
    ref_logits, ref_grads = ref
    assert grads.keys() == ref_grads.keys()
    return max([rel(logits, ref_logits)] + [rel(grads[n], ref_grads[n]) for n in grads])


def _classes(model):
    return [(n, type(m)) for n, m in model.named_modules()]


# --- apply: counts and parity ------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_counts_and_fp32_parity(family):
    model = build(family)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported family patches without warnings
        report = tt.apply(model)
    assert _counts(report) == EXPECTED[family], str(report)
    assert not report.refused, str(report)
    assert report.families and "refused" not in str(report)
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5


#: The bf16 parity's MoE routes every token to every expert: a top-k router turns a rounding
#: difference at a near-tie into another expert's gradient, a jump of the routing, not of the
#: norm (which rounding wins a tie depends on the CPU's bf16 GEMM); with every expert taken
#: the routing weights stay continuous.
BF16_PARITY_CONFIG = {"qwen3_moe": {"num_experts_per_tok": 4}}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_parity(family):
    """Patched and unpatched bf16 models are both within bf16 rounding of the fp32 model."""
    config = BF16_PARITY_CONFIG.get(family, {})
    ref32 = build(family, **config)
    model, hf = build(family, torch.bfloat16, **config), build(family, torch.bfloat16, **config)
    tt.apply(model)
    ids, proj = _inputs()
    exact = _run(ref32, ids, proj)
    ours, theirs = _worst(_run(model, ids, proj), exact), _worst(_run(hf, ids, proj), exact)
    assert ours <= BF16_TOL and ours <= 2 * theirs + 1e-3, (ours, theirs)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_autocast_parity(family):
    """Under bf16 autocast (fp32 weights, an fp32 residual stream, bf16 projections) the
    patched model matches the unpatched one within bf16 rounding: Qwen3's q/k norms see bf16
    input and fp32 weights, where transformers rounds x_hat to bf16 and tilenorm does not."""
    model = build(family)
    ref = copy.deepcopy(model)
    tt.apply(model)
    ids, proj = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = _run(model, ids, proj), _run(ref, ids, proj)
    assert ours[0].dtype == theirs[0].dtype
    assert _worst(ours, theirs) <= BF16_TOL


def test_norm_output_dtypes_follow_the_family():
    """Llama's norm returns the promotion of the weight's and the input's dtypes, Gemma's the
    input's (OLMo2's the input's from transformers 4.52, Llama's rule before): with fp32
    weights on bf16 input, no autocast, the patched norms return what the originals did."""
    for family, dtype in (("llama", torch.float32), ("gemma3", torch.bfloat16),
                          ("olmo2", None)):
        model = build(family)
        norm = model.model.layers[0].post_attention_layernorm
        x = torch.randn(2, 3, HIDDEN, dtype=torch.bfloat16)
        before = norm(x)
        tt.apply(model)
        after = norm(x)
        assert after.dtype == before.dtype == (dtype or before.dtype)
        assert rel(after, before) <= 1e-2


def test_gpt_neox_sequential_residual_is_fused():
    model = build("gpt_neox", use_parallel_residual=False)
    ref = copy.deepcopy(model)
    report = tt.apply(model)
    assert _counts(report) == (5, 0, 2, 0), str(report)
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5


def test_by_design_skips_are_reported_without_warning():
    for family, reason in (("olmo2", "OLMo2 normalizes each sublayer's output"),
                           ("gpt_neox", "parallel residual")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = tt.apply(build(family))
        assert len(report.skipped) == LAYERS and all(s.expected for s in report.skipped)
        assert reason in str(report)


def test_norms_only_and_residual_only():
    ids, proj = _inputs()
    ref = build("qwen3")
    expected = _run(ref, ids, proj)
    norms_only, residual_only = build("qwen3"), build("qwen3")
    assert _counts(tt.apply(norms_only, residual=False)) == (5, 4, 0, 0)
    assert _counts(tt.apply(residual_only, norms=False)) == (0, 0, 2, 2)
    assert type(norms_only.model) is type(ref.model)
    assert type(residual_only.model.norm) is type(ref.model.norm)
    for model in (norms_only, residual_only):
        assert _worst(_run(model, ids, proj), expected) <= 1e-5


def test_apply_twice_counts_the_same():
    model = build("gemma3")
    first, second = tt.apply(model), tt.apply(model)
    assert _counts(first) == _counts(second) == EXPECTED["gemma3"]


def test_fused_forward_is_the_installed_forward_rewritten():
    model = build("llama")
    tt.apply(model)
    layer_cls = type(model.model.layers[0])
    text = inspect.getsource(layer_cls.forward)
    assert "_tilenorm_add_norm(self.post_attention_layernorm, residual, hidden_states)" in text
    assert "self.self_attn(" in text and text.count("_tilenorm_add_norm") == 1
    original = tt.patching.original_class(layer_cls)
    assert original is not layer_cls and original.__name__ == layer_cls.__name__
    assert isinstance(model.model.layers[0], original)


# --- reset --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "olmo2", "gpt_neox"])
def test_reset_restores_the_model_exactly(family):
    model = build(family)
    ref = copy.deepcopy(model)
    classes = _classes(model)
    tensors = {k: (v, v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}
    tt.apply(model)
    assert _classes(model) != classes
    tt.reset(model)
    assert _classes(model) == classes
    assert all("forward" not in m.__dict__ for m in model.modules())
    after = model.state_dict(keep_vars=True)
    assert after.keys() == tensors.keys()
    assert all(after[k] is v and v.data_ptr() == ptr for k, (v, ptr) in tensors.items())
    ids, proj = _inputs()
    logits, grads = _run(model, ids, proj)
    ref_logits, ref_grads = _run(ref, ids, proj)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


# --- what is left alone ---------------------------------------------------------------------


def test_unknown_model_is_left_alone_with_a_warning():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS,
                                     n_head=HEADS, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    classes = _classes(model)
    with pytest.warns(UserWarning, match="no supported model family in GPT2LMHeadModel"):
        report = tt.apply(model)
    assert _classes(model) == classes
    assert _counts(report) == (0, 0, 0, 0) and not report.families
    assert "LayerNorm" in str(report) and "not a norm of a supported family" in str(report)


def _unverified_forward(monkeypatch, cls):
    """``cls.forward`` replaced by a forward of another source that calls it."""
    original = cls.forward

    def forward(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)


def test_unverified_forward_is_refused(monkeypatch):
    """A decoder-layer forward that is not a verified source is never rewritten."""
    from transformers.models.llama import modeling_llama

    _unverified_forward(monkeypatch, modeling_llama.LlamaDecoderLayer)
    model = build("llama")
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="left unpatched"):
        report = tt.apply(model)
    assert _counts(report) == (5, 0, 0, 0)
    assert "not one verified for tilenorm" in str(report)
    assert type(model.model.layers[0]) is modeling_llama.LlamaDecoderLayer
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5


def test_instance_forward_is_refused():
    model = build("llama")
    layer = model.model.layers[0]
    layer.forward = layer.forward  # as another library's per-instance hooks do
    with pytest.warns(UserWarning, match="left unpatched"):
        report = tt.apply(model)
    assert report.fused_layers == 1 and "replaced on the instance" in str(report)


def test_wrapper_subclass_is_refused():
    """A layer whose class was subclassed after building (as FSDP2's fully_shard does) is
    not a class tilenorm verified."""
    model = build("llama")
    layer = model.model.layers[0]
    layer.__class__ = type("FSDPLlamaDecoderLayer", (type(layer),), {})
    with pytest.warns(UserWarning, match="left unpatched"):
        report = tt.apply(model)
    assert report.fused_layers == 1 and "derives from LlamaDecoderLayer" in str(report)
    assert type(layer).__name__ == "FSDPLlamaDecoderLayer"


def test_deepcopy_keeps_the_patches():
    model = build("gemma3")
    tt.apply(model)
    twin = copy.deepcopy(model)
    assert _classes(twin) == _classes(model)
    ids, proj = _inputs()
    assert _worst(_run(twin, ids, proj), _run(model, ids, proj)) == 0


def test_hooked_norm_takes_the_unfused_path():
    """A hook on a norm that a fused layer would skip sees its call all the same."""
    model = build("llama")
    ref = copy.deepcopy(model)
    tt.apply(model)
    seen = []
    for m in (model, ref):
        m.model.layers[1].post_attention_layernorm.register_forward_hook(
            lambda mod, args, out: seen.append(args[0].detach().clone()))
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5
    assert len(seen) == 2 and rel(seen[0], seen[1]) <= 1e-6


def _doubled(cls: type) -> type:
    """A class derived from ``cls`` whose forward doubles ``cls``'s output."""

    class Doubled(cls):
        def forward(self, *args, **kwargs):
            return 2 * super().forward(*args, **kwargs)

    return Doubled


def _compiled_then(model, compiled):
    """``model`` as called: after a first call, compiled with Dynamo if ``compiled`` (so that
    what changes afterwards must fail a guard to be seen)."""
    torch._dynamo.reset()
    call = torch.compile(model, backend="eager") if compiled else model
    call(_inputs()[0])
    return call


def _dynamo_guards_module_classes() -> bool:
    """Whether this torch's Dynamo recompiles a model one of whose submodules had its class
    switched after the first call (2.13 does; 2.11 runs the old graph, an unpatched HF model's
    too: bench/NOTES.md #97)."""
    class Scale(torch.nn.Module):  # a parameter: 2.11 sees the switch of a parameterless one
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.weight

    torch._dynamo.reset()
    model = torch.nn.Sequential(Scale())
    call = torch.compile(model, backend="eager")
    x = torch.ones(2)
    call(x)
    model[0].__class__ = _doubled(Scale)
    return bool(call(x)[0] == 2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_norm_subclassed_after_patching_takes_the_unfused_path(compiled):
    """A norm whose class derives from the tilenorm class after patching is not that class:
    the fused layer calls it (compiled: a class switched after the first call fails a guard
    and recompiles, where torch's Dynamo guards module classes at all)."""
    if compiled and not _dynamo_guards_module_classes():
        pytest.skip(f"torch {torch.__version__}'s Dynamo does not see a module's class "
                    "switched after compiling, with or without tilenorm")
    model = build("qwen3")
    ref = copy.deepcopy(model)
    tt.apply(model)
    call = _compiled_then(model, compiled)
    for m in (model, ref):
        for norm in (m.model.layers[0].post_attention_layernorm,
                     m.model.layers[1].input_layernorm, m.model.norm):
            norm.__class__ = _doubled(type(norm))
    ids, _ = _inputs()
    assert rel(call(ids).logits, ref(ids).logits) <= 1e-5


@pytest.mark.filterwarnings("ignore:Using `torch.compile.module.` when there are global hooks")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("scope", ["module", "global"])
def test_hooked_norm_takes_the_unfused_path_compiled(compiled, scope):
    """A forward hook on a norm a fused add would skip, or on every module (a global hook),
    sees the norm's call, under torch.compile too. (Registered before the first call: Dynamo
    does not guard on module hooks, ``skip_nnmodule_hook_guards``.)"""
    from torch.nn.modules import module as torch_module

    model = build("qwen3")
    ref = copy.deepcopy(model)
    tt.apply(model)
    norm_class = tt.patching.original_class(type(model.model.norm))

    def hook(module, args, out):
        return 2 * out if isinstance(module, norm_class) and out.shape[-1] == HIDDEN else None

    handles = []
    if scope == "global":
        handles.append(torch_module.register_module_forward_hook(hook))
    else:
        for m in (model, ref):
            handles += [m.model.layers[0].post_attention_layernorm.register_forward_hook(hook),
                        m.model.norm.register_forward_hook(hook)]
    try:
        torch._dynamo.reset()
        call = torch.compile(model, backend="eager") if compiled else model
        ids, _ = _inputs()
        assert rel(call(ids).logits, ref(ids).logits) <= 1e-5
    finally:
        for handle in handles:
            handle.remove()


# --- class-level patching ----------------------------------------------------------------


def test_class_level_patching_then_building():
    from transformers.models.qwen3 import modeling_qwen3

    ref = build("qwen3")
    before = build("qwen3")
    try:
        report = tt.apply_to("qwen3")
        assert report.classes == ["modeling_qwen3.Qwen3RMSNorm",
                                  "modeling_qwen3.Qwen3DecoderLayer",
                                  "modeling_qwen3.Qwen3Model"], str(report)
        model = build("qwen3")
        assert type(before.model.layers[0]) is tt.patching.original_class(
            modeling_qwen3.Qwen3DecoderLayer)
        assert _counts(tt.apply(model)) == EXPECTED["qwen3"]
        ids, proj = _inputs()
        assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5
    finally:
        tt.reset_classes()
    assert "_tilenorm_original" not in vars(modeling_qwen3.Qwen3DecoderLayer)
    assert "_tilenorm_original" not in vars(modeling_qwen3.Qwen3RMSNorm)
    assert "_tilenorm_original" not in vars(modeling_qwen3.Qwen3Model)
    tt.reset(model)
    assert _classes(model) == _classes(ref)
    assert _counts(tt.apply(build("qwen3"), norms=False, residual=False)) == (0, 0, 0, 0)


def test_class_level_gpt_neox_leaves_layer_norm_alone():
    forward = vars(torch.nn.LayerNorm)["forward"]
    try:
        report = tt.apply_to("gpt_neox")
        assert report.classes == ["modeling_gpt_neox.GPTNeoXLayer"]
        assert "torch.nn.LayerNorm" in str(report)
        assert vars(torch.nn.LayerNorm)["forward"] is forward
        model = build("gpt_neox", use_parallel_residual=False)
        assert all(type(m) is torch.nn.LayerNorm for m in model.modules()
                   if isinstance(m, torch.nn.LayerNorm))
        assert _counts(tt.apply(model)) == (5, 0, 2, 0)
    finally:
        tt.reset_classes()


def test_apply_to_unknown_family():
    with pytest.raises(ValueError, match="unknown family 'bert'"):
        tt.apply_to("bert")


# --- torch.compile, checkpointing, PEFT ------------------------------------------------------


@pytest.mark.parametrize("as_ops", [False, True], ids=["small-norms-to-inductor", "custom-ops"])
@pytest.mark.parametrize("family,backend", [
    ("llama", "aot_eager"), ("gemma3", "aot_eager"), ("qwen3", "eager"), ("qwen3", "aot_eager")])
def test_torch_compile(family, backend, as_ops, request):
    if as_ops:
        request.getfixturevalue("compiled_as_custom_ops")
    torch._dynamo.reset()
    model = build(family)
    ref = copy.deepcopy(model)
    tt.apply(model)
    compiled = torch.compile(model, backend=backend)
    ids, proj = _inputs()
    assert _worst(_run(compiled, ids, proj), _run(ref, ids, proj)) <= 1e-5


def _compiled_graphs(model, call):
    """The graphs dynamo traces while ``call`` runs ``torch.compile(model, fullgraph=True)``
    (a backend that records them and runs them as traced)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    call(torch.compile(model, backend=backend, fullgraph=True))
    return graphs


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_torch_compile_fullgraph_traces_the_fused_calls(family, compiled_as_custom_ops):
    """One graph, no break, holding one fused tilenorm call (a norm_fwd with a residual)
    per layer and one per norm fed by the add ending a layer (Llama, Qwen3), and a tilenorm
    call per norm over the hidden size: the per-head q/k norms are the family's own code there,
    for inductor to fuse with RoPE (and run as tilenorm eagerly,
    test_apply_counts_and_fp32_parity)."""
    model = build(family)
    tt.apply(model)
    ids, _ = _inputs()
    graphs = _compiled_graphs(model, lambda compiled: compiled(ids, use_cache=False))
    calls = [n for gm in graphs for n in gm.graph.nodes
             if n.target in (torch.ops.tilenorm.norm_fwd, torch.ops.tilenorm.norm_fwd.default)]
    fused = [n for n in calls if n.args[3] is not None]
    assert len(graphs) == 1 and len(fused) == LAYERS + EXPECTED[family][3]
    assert len(calls) == EXPECTED[family][0]
    qk_norms = [n for gm in graphs for n in gm.graph.nodes
                if n.target in (torch.rsqrt, torch.ops.aten.rsqrt.default)]
    assert len(qk_norms) == EXPECTED[family][1]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_torch_compile_leaves_small_norms_to_inductor(family):
    """The tiny models' norms are below tilenorm.dispatch.COMPILED_INDUCTOR_MAX_BYTES: under
    torch.compile each is traced as torch operations, fused adds included, in one graph with
    no tilenorm op, and the model computes what the unpatched one does."""
    model = build(family)
    ref = copy.deepcopy(model)
    tt.apply(model)
    ids, proj = _inputs()
    got = []
    graphs = _compiled_graphs(model, lambda compiled: got.append(_run(compiled, ids, proj)))
    assert len(graphs) == 1
    assert not [n for n in graphs[0].graph.nodes if "tilenorm" in str(n.target)]
    rsqrts = [n for n in graphs[0].graph.nodes
              if n.target in (torch.rsqrt, torch.ops.aten.rsqrt.default)]
    assert len(rsqrts) == EXPECTED[family][0] + EXPECTED[family][1]
    assert _worst(got[0], _run(ref, ids, proj)) <= 1e-5


def test_inductor_hands_norm_bwd_the_projections_gradients_unsummed(compiled_as_custom_ops):
    """In a compiled patched Llama's backward, each layer's input norm gets the q, k and v
    projections' gradients as dy, dy2, dy3 and its MLP norm gate's and up's as dy, dy2
    (tilenorm.pytorch.graph_passes), and the gradients are eager's."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    parts = []

    class Record(CustomGraphPass):
        def __call__(self, graph):
            parts.extend(1 + len(n.kwargs) for n in graph.nodes
                         if n.target is torch.ops.tilenorm.norm_bwd.default)

        def uuid(self):
            return None  # no graph cache: the passes run

    torch._dynamo.reset()
    model = build("llama")
    ref = copy.deepcopy(model)
    tt.apply(model)
    ids, proj = _inputs()
    saved = config.post_grad_custom_post_pass
    config.post_grad_custom_post_pass = Record()  # tracing puts the fold before it
    try:
        with config.patch(fx_graph_cache=False):
            got = _run(torch.compile(model), ids, proj)
    finally:
        config.post_grad_custom_post_pass = saved
    assert sorted(parts) == [1] + [2] * LAYERS + [3] * LAYERS
    assert _worst(got, _run(ref, ids, proj)) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_gradient_checkpointing(family):
    """The patched layers are checkpointed (their MLP runs again in the backward) and give
    the unpatched model's gradients."""
    model = build(family).train()
    ref = copy.deepcopy(model)
    tt.apply(model)
    calls = []
    for m in (model, ref):
        # activation_checkpointing_enable: the name from transformers 5.23 on
        getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)()
        m.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    ids, proj = _inputs()
    out = _run(model, ids, proj)
    patched_calls = len(calls)
    assert _worst(out, _run(ref, ids, proj)) <= 1e-5
    assert patched_calls == 2 and len(calls) == 4


def test_peft_lora():
    peft = pytest.importorskip("peft")
    model = build("qwen3")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ref = copy.deepcopy(wrapped)
    report = tt.apply(wrapped)
    assert _counts(report) == EXPECTED["qwen3"], str(report)
    ids, proj = _inputs()
    out, expected = _run(wrapped, ids, proj), _run(ref, ids, proj)
    assert any("lora_A" in n for n in out[1])
    assert _worst(out, expected) <= 1e-5
    tt.reset(wrapped)
    assert _classes(wrapped) == _classes(ref)


def test_peft_modules_to_save_norm_is_not_fused():
    """A norm wrapped by PEFT is no longer the family's norm: the layer keeps its add."""
    peft = pytest.importorskip("peft")
    model = build("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["post_attention_layernorm"]))
    ref = copy.deepcopy(wrapped)
    with pytest.warns(UserWarning, match="left unpatched"):
        report = tt.apply(wrapped)
    assert report.fused_layers == 0 and "ModulesToSaveWrapper" in str(report)
    ids, proj = _inputs()
    assert _worst(_run(wrapped, ids, proj), _run(ref, ids, proj)) <= 1e-5


# --- fusion across layers ------------------------------------------------------------------------


def _fused_adds(model, call, monkeypatch):
    """How many tilenorm calls with a residual (a fused add) ``call(model)`` makes."""
    from tilenorm.transformers import norms

    fused = []
    rms_norm = norms.rms_norm

    def counted(*args, **kwargs):
        fused.append(kwargs.get("residual") is not None)
        return rms_norm(*args, **kwargs)

    monkeypatch.setattr(norms, "rms_norm", counted)
    call(model)
    monkeypatch.undo()
    return sum(fused)


@pytest.mark.parametrize("family", ACROSS)
def test_across_layers_fuses_every_norm_fed_by_an_add(family, monkeypatch):
    """Each layer's post-attention norm, each later layer's input norm and the final norm take
    an add: 2 * LAYERS fused calls, where the in-layer fusion alone makes LAYERS."""
    model = build(family)
    tt.apply(model)
    ids, _ = _inputs()
    assert _fused_adds(model, lambda m: m(ids), monkeypatch) == 2 * LAYERS
    within = build(family)
    tt.apply(within)
    # the model class only put back: the layers fused, the loop as transformers wrote it
    within.model.__class__ = tt.patching.original_class(type(within.model))
    assert _fused_adds(within, lambda m: m(ids), monkeypatch) == LAYERS


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_across_layers_hidden_states(family, monkeypatch):
    """A call requesting hidden states computes as written (the layers return the residual
    stream the recorder keeps) and records what the unpatched model does; the calls after it
    fuse across layers again, transformers' recorders on the layers notwithstanding."""
    model = build(family)
    ref = copy.deepcopy(model)
    tt.apply(model)
    ids, _ = _inputs()
    got = model(ids, output_hidden_states=True)
    expected = ref(ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(expected.hidden_states) == LAYERS + 1
    assert all(rel(a, b) <= 1e-5 for a, b in zip(got.hidden_states, expected.hidden_states,
                                                         strict=True))
    assert rel(got.logits, expected.logits) <= 1e-5
    assert model.model.layers[0]._forward_hooks  # the recorders stay installed
    assert _fused_adds(model, lambda m: m(ids), monkeypatch) == 2 * LAYERS
    assert _fused_adds(model, lambda m: m(ids, output_hidden_states=True),
                       monkeypatch) == LAYERS
    # some layers' hidden states only (transformers >= 5.5): computed as written as well
    some, some_ref = (m(ids, output_hidden_states=[1]).hidden_states for m in (model, ref))
    assert [h is None for h in some] == [h is None for h in some_ref]
    assert any(h is not None for h in some)
    assert all(rel(a, b) <= 1e-5 for a, b in zip(some, some_ref, strict=True) if a is not None)


def test_across_layers_hooked_layer_sees_the_residual_stream():
    """A forward hook on a decoder layer sees the stream the unpatched layer returns: the call
    computes as written."""
    model = build("llama")
    ref = copy.deepcopy(model)
    tt.apply(model)
    seen = []
    for m in (model, ref):
        m.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(out))
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5
    assert all(isinstance(o, torch.Tensor) for o in seen) and rel(seen[0], seen[1]) <= 1e-6


def test_across_layers_wrapped_layer_computes_as_written():
    """A layer wrapped after patching (a checkpoint wrapper, another library's module) is not
    a pairs-capable class: the loop is the one transformers wrote."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    model = build("qwen2")
    ref = copy.deepcopy(model)
    tt.apply(model)
    model.model.layers[1] = Wrapper(model.model.layers[1])
    ref.model.layers[1] = Wrapper(ref.model.layers[1])
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_across_layers_subclassed_layer_computes_as_written(compiled):
    """A layer whose class derives from the pairs-capable class after patching (a user's
    subclass, FSDP2's class) is not pairs-capable: the loop is the one transformers wrote
    (compiled: a recompile after the first call)."""
    model = build("qwen2")
    ref = copy.deepcopy(model)
    tt.apply(model)
    call = _compiled_then(model, compiled)
    for m in (model, ref):
        m.model.layers[1].__class__ = _doubled(type(m.model.layers[1]))
    ids, _ = _inputs()
    assert rel(call(ids).logits, ref(ids).logits) <= 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_across_layers_gradient_checkpointing(reentrant, monkeypatch):
    """Checkpointed layers exchanging pairs (the residual a positional argument, so that the
    reentrant checkpoint differentiates it too) give the unpatched model's gradients."""
    model = build("llama").train()
    ref = copy.deepcopy(model)
    tt.apply(model)
    calls = []
    for m in (model, ref):
        getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)(
            {"use_reentrant": reentrant})
        m.model.layers[1].mlp.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    ids, proj = _inputs()
    out = _run(model, ids, proj)
    assert len(calls) == 2  # the forward and its recomputation
    assert _worst(out, _run(ref, ids, proj)) <= 1e-5
    # each layer once more in the backward; the final norm is not recomputed
    assert _fused_adds(model, lambda m: _run(m, ids, proj), monkeypatch) == 4 * LAYERS - 1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_across_layers_generate_with_cache(family):
    model, ref = build(family), build(family)
    tt.apply(model)
    ids, _ = _inputs()
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    out, expected = model(ids, use_cache=True), ref(ids, use_cache=True)
    step = ids[:, -1:]
    nxt = model(step, past_key_values=out.past_key_values).logits
    assert rel(nxt, ref(step, past_key_values=expected.past_key_values).logits) <= 1e-5


def test_across_layers_num_hidden_layers_slices_the_loop():
    """A config running fewer layers than the model holds: the pairs stop at the last one run
    and the final norm adds them."""
    model = build("llama", num_hidden_layers=3)
    ref = copy.deepcopy(model)
    report = tt.apply(model)
    assert report.fused_across == 3
    for m in (model, ref):
        m.config.num_hidden_layers = 2
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5


def test_across_layers_reset_restores_the_forwards():
    from transformers.models.llama import modeling_llama

    model = build("llama")
    tt.apply(model)
    assert type(model.model).forward is not modeling_llama.LlamaModel.forward
    tt.reset(model)
    assert type(model.model) is modeling_llama.LlamaModel
    assert type(model.model.layers[0]) is modeling_llama.LlamaDecoderLayer
    assert type(model.model).forward is modeling_llama.LlamaModel.forward


def test_across_layers_unverified_model_forward_keeps_the_in_layer_fusion(monkeypatch):
    from transformers.models.llama import modeling_llama

    _unverified_forward(monkeypatch, modeling_llama.LlamaModel)
    model = build("llama")
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = tt.apply(model)
    assert _counts(report) == (5, 0, 2, 0), str(report)
    assert "fusion across layers" in str(report) and not report.refused
    assert type(model.model) is modeling_llama.LlamaModel
    ids, proj = _inputs()
    assert _worst(_run(model, ids, proj), _run(ref, ids, proj)) <= 1e-5


def test_across_layers_moe_router_logits(monkeypatch):
    """Router logits are recorded from the routers, not the layers: a call recording them
    still fuses across layers, and records what the unpatched model does."""
    model = build("qwen3_moe")
    ref = copy.deepcopy(model)
    tt.apply(model)
    ids, _ = _inputs()
    got, expected = (m(ids, output_router_logits=True) for m in (model, ref))
    assert len(got.router_logits) == len(expected.router_logits) == LAYERS
    assert all(rel(a, b) <= 1e-5
               for a, b in zip(got.router_logits, expected.router_logits, strict=True))
    assert rel(got.logits, expected.logits) <= 1e-5
    assert _fused_adds(model, lambda m: m(ids, output_router_logits=True),
                       monkeypatch) == 2 * LAYERS


def _not_a_llama_layer(self, hidden_states, attention_mask=None):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states = residual + self.self_attn(hidden_states)
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    return residual + self.mlp(hidden_states)  # the sum returned, not assigned first


def _not_a_llama_model(self, hidden_states):
    for layer in self.layers:
        hidden_states = layer(hidden_states)
        hidden_states = hidden_states * 2
    return self.norm(hidden_states)


def test_across_layers_rewrite_refuses_other_shapes():
    from tilenorm.transformers import rewrite

    with pytest.raises(rewrite.Unsupported, match="returning the sum"):
        rewrite.fuse_across(_not_a_llama_layer, ("post_attention_layernorm",),
                            "input_layernorm", lambda *a: a)
    with pytest.raises(rewrite.Unsupported, match="expected a loop over self.layers"):
        rewrite.loop_across(_not_a_llama_model, lambda *a: a, lambda *a: True)


def test_across_layers_compiled_hidden_states():
    """A compiled model switches between the pairs and the loop as written by the call: hidden
    states requested after a call without them are the unpatched model's."""
    torch._dynamo.reset()
    model = build("llama")
    ref = copy.deepcopy(model)
    tt.apply(model)
    compiled = torch.compile(model, backend="aot_eager")
    ids, _ = _inputs()
    assert rel(compiled(ids).logits, ref(ids).logits) <= 1e-5
    got = compiled(ids, output_hidden_states=True).hidden_states
    expected = ref(ids, output_hidden_states=True).hidden_states
    assert all(rel(a, b) <= 1e-5 for a, b in zip(got, expected, strict=True))
    assert rel(compiled(ids).logits, ref(ids).logits) <= 1e-5


def test_across_layers_compile_has_no_graph_break():
    """The whole model under torch.compile: the per-call check traces (transformers' recorders
    installed too), no graph break."""
    model = build("qwen3")
    tt.apply(model)
    ids, _ = _inputs()
    model(ids, output_hidden_states=True)  # installs the recorders
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


# --- the optional dependency ------------------------------------------------------------------


def test_tilenorm_does_not_import_transformers():
    code = "import sys, tilenorm; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_without_transformers_says_how_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import tilenorm.transformers\nexcept ImportError as e:\n"
            "    assert 'pip install' in str(e), e\nelse:\n    raise SystemExit(1)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- GPU ----------------------------------------------------------------------------------



def _bf16_cuda_errors(family, prepare=lambda model: model, compiled=False):
    """(ours, theirs): the worst relative error of the patched bf16 model on the GPU (after
    ``prepare``, under torch.compile if ``compiled``) and of transformers' own bf16 model,
    each against the fp32 model, and the patched model."""
    ref32 = build(family).cuda()
    model, hf = build(family, torch.bfloat16).cuda(), build(family, torch.bfloat16).cuda()
    report = tt.apply(model)
    assert _counts(report) == EXPECTED[family], str(report)
    model = prepare(model)
    ids, proj = _inputs(device="cuda")
    torch._dynamo.reset()
    call = torch.compile(model, fullgraph=True) if compiled else model
    exact = _run(ref32, ids, proj)
    return _worst(_run(call, ids, proj), exact), _worst(_run(hf, ids, proj), exact), model


@gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_apply_and_reset_cuda(family):
    """Every family in bf16 on the GPU: patched, as close to the fp32 model as transformers'
    own bf16 model is; reset, the unpatched model's outputs and gradients within its own
    run-to-run noise (the attention backward's atomics)."""
    with tilenorm.experimental():
        x = torch.randn(2, 12, HIDDEN, device="cuda", dtype=torch.bfloat16)
        assert tilenorm.explain(x, torch.ones(HIDDEN, device="cuda")).uses_kernel
        ours, theirs, model = _bf16_cuda_errors(family)
    assert ours <= BF16_TOL and ours <= 2 * theirs + 1e-3, (ours, theirs)
    tt.reset(model)
    hf = build(family, torch.bfloat16).cuda()
    ids, proj = _inputs(device="cuda")
    first = _run(hf, ids, proj)
    noise = _worst(_run(hf, ids, proj), first)
    assert _worst(_run(model, ids, proj), first) <= max(2 * noise, 1e-6)


@gpu
@pytest.mark.parametrize("as_ops", [False, True], ids=["small-norms-to-inductor", "custom-ops"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_torch_compile_cuda(family, as_ops, request):
    """The whole patched bf16 model under torch.compile (inductor) on the GPU, its norms left
    to inductor (their size) or held as tilenorm's ops (the kernels): as close to the fp32
    model as transformers' own bf16 model is."""
    if as_ops:
        request.getfixturevalue("compiled_as_custom_ops")
    with tilenorm.experimental():
        ours, theirs, _ = _bf16_cuda_errors(family, compiled=True)
    assert ours <= BF16_TOL and ours <= 2 * theirs + 1e-3, (ours, theirs)


@gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_across_layers_cuda(family):
    """The loop carrying (output, residual) pairs in bf16 on the GPU (the counts checked by
    _bf16_cuda_errors): as close to the fp32 model as transformers' bf16 model is, eagerly,
    with reentrant checkpointing and under torch.compile; hidden states recorded within bf16
    rounding of the unpatched bf16 model's."""
    def reentrant(model):
        model.train()
        getattr(model, "activation_checkpointing_enable",
                model.gradient_checkpointing_enable)({"use_reentrant": True})
        return model

    with tilenorm.experimental():
        for prepare, compiled in ((lambda m: m, False), (reentrant, False),
                                  (lambda m: m, True)):
            ours, theirs, model = _bf16_cuda_errors(family, prepare, compiled)
            assert ours <= BF16_TOL and ours <= 2 * theirs + 1e-3, (ours, theirs, compiled)
        hf = build(family, torch.bfloat16).cuda()
        ids, _ = _inputs(device="cuda")
        with torch.no_grad():
            got = model(ids, output_hidden_states=True).hidden_states
            expected = hf(ids, output_hidden_states=True).hidden_states
    assert rel(got[0], expected[0]) == 0
    assert all(rel(a, b) <= BF16_TOL for a, b in zip(got, expected, strict=True))


@gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_gradient_checkpointing_cuda(family):
    """The patched bf16 layers checkpointed on the GPU (their MLP runs again in the backward):
    as close to the fp32 model as transformers' own bf16 model is."""
    calls = []

    def checkpointed(model):
        model.train()
        getattr(model, "activation_checkpointing_enable",
                model.gradient_checkpointing_enable)()
        model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(m))
        return model

    with tilenorm.experimental():
        ours, theirs, _ = _bf16_cuda_errors(family, checkpointed)
    assert len(calls) == 2
    assert ours <= BF16_TOL and ours <= 2 * theirs + 1e-3, (ours, theirs)
