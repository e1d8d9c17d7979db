"""The norm computations of the supported families, in tilenorm, with each family's dtype
rules; and the fused add-then-norm that patched decoder layers call.

Each kind reproduces one norm forward of transformers (identified by its source's digest in
:mod:`tilenorm.transformers.families`):

    llama       y = weight * round(x_hat, x.dtype)      Llama, Mistral, Qwen2/3, Phi3
    olmo2       y = round(weight * x_hat, x.dtype)      OLMo2
    gemma       y = round(x_hat * (1 + weight), x.dtype) in fp32   Gemma2, Gemma3
    layer_norm  torch.nn.LayerNorm                      GPT-NeoX

with ``x_hat = x / sqrt(mean(x^2) + eps)`` in fp32. tilenorm multiplies ``x_hat`` by the
weight in fp32 and rounds once, to the dtype the family's forward returns (for llama the
promotion of the weight's and x's dtypes). The llama kind's extra rounding of ``x_hat`` to x's
dtype before the multiply is therefore skipped: identical in fp32, within one rounding of the
low-precision dtype (bf16/fp16) otherwise.

One exception: a per-head (q/k) norm, x of (batch, seq, heads, head_dim), inside a graph that
torch.compile traces runs the family's own forward. Inductor fuses that with the RoPE that
follows (and their backwards), reading and writing q and k once each way, where a norm
kernel of its own, however fast, adds a pass out and back (bench/NOTES.md #45).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import promote_types
from torch.compiler import is_compiling
from torch.nn.modules import module as _torch_module

from tilenorm.pytorch.functional import LAYER_NORM as LAYER_NORM_OP
from tilenorm.pytorch.functional import _autocast_out_dtype, layer_norm, rms_norm

_Forward = Callable[..., torch.Tensor]


def _per_head_under_compile(forward: _Forward) -> Callable[[_Forward], _Forward]:
    """For a patched class whose original forward is ``original``: ``forward``, except for
    per-head vectors in a graph torch.compile traces, where ``original`` runs (see the module
    docstring). ``original`` is bound when the class is patched: traced code that looked the
    class up (``type(self)``) would have Dynamo guard that each norm's class is the others'."""

    def bind(original: _Forward) -> _Forward:
        def per_head_to_inductor(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 4 and is_compiling():
                return original(self, x)
            return forward(self, x)

        per_head_to_inductor.__name__ = per_head_to_inductor.__qualname__ = forward.__name__
        return per_head_to_inductor

    return bind


def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon,
                    out_dtype=promote_types(self.weight.dtype, hidden_states.dtype))


def _olmo2_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon,
                    out_dtype=hidden_states.dtype)


def _gemma_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps, offset=1.0, out_dtype=x.dtype)


def _layer_norm_forward(self, input: torch.Tensor) -> torch.Tensor:
    return layer_norm(input, self.weight, self.bias, self.eps,
                      normalized_shape=self.normalized_shape)


def _llama_add_norm(norm, a, b, h_dtype):
    return rms_norm(b, norm.weight, norm.variance_epsilon, residual=a, prenorm=True,
                    residual_dtype=h_dtype,
                    out_dtype=promote_types(norm.weight.dtype, h_dtype))


def _olmo2_add_norm(norm, a, b, h_dtype):
    return rms_norm(b, norm.weight, norm.variance_epsilon, residual=a, prenorm=True,
                    residual_dtype=h_dtype, out_dtype=h_dtype)


def _gemma_add_norm(norm, a, b, h_dtype):
    return rms_norm(b, norm.weight, norm.eps, offset=1.0, residual=a, prenorm=True,
                    residual_dtype=h_dtype, out_dtype=h_dtype)


def _layer_norm_add_norm(norm, a, b, h_dtype):
    # y in the dtype tilenorm's layer_norm gives h: h's, or float32 under CUDA autocast
    out_dtype = _autocast_out_dtype(LAYER_NORM_OP, b) or h_dtype
    return layer_norm(b, norm.weight, norm.bias, norm.eps,
                      normalized_shape=norm.normalized_shape, residual=a, prenorm=True,
                      residual_dtype=h_dtype, out_dtype=out_dtype)


@dataclass(frozen=True)
class NormKind:
    """One family norm's semantics: the tilenorm forward that replaces its ``forward`` and
    the fused ``(norm(a + b), a + b)`` for a decoder layer's add-then-norm. ``per_head``: the
    kind's per-head (q/k) norms run the class's own forward in a graph torch.compile traces
    (``forward`` takes that original forward and gives the patched class's forward)."""

    name: str
    forward: Callable[..., torch.Tensor]
    fused: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    per_head: bool = False

    def forward_of(self, original: type) -> Callable[..., torch.Tensor]:
        """The forward of ``original``'s tilenorm subclass (a function of its own for each
        class where ``per_head``)."""
        return self.forward(original.forward) if self.per_head else self.forward


LLAMA = NormKind("llama", _per_head_under_compile(_llama_forward), _llama_add_norm, True)
OLMO2 = NormKind("olmo2", _per_head_under_compile(_olmo2_forward), _olmo2_add_norm, True)
GEMMA = NormKind("gemma", _per_head_under_compile(_gemma_forward), _gemma_add_norm, True)
LAYER_NORM = NormKind("layer_norm", _layer_norm_forward, _layer_norm_add_norm)


#: torch's global module hooks (dicts registered into in place).
GLOBAL_HOOKS = tuple(getattr(_torch_module, name, {}) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks"))


def _any_global_hook_of_ours() -> bool:
    return any(GLOBAL_HOOKS)


#: Whether any global module hook is registered: torch's own test where it has one. Traced, it
#: reads the dicts where ``Module.__call__`` does, which Dynamo guards already; reading them
#: here would add guards that each is the same dict.
any_global_hook: Callable[[], object] = getattr(_torch_module, "_has_any_global_hook",
                                                _any_global_hook_of_ours)

#: The attribute of each tilenorm class (:mod:`tilenorm.transformers.patching`) that tells it
#: from every other class: a string of its own, None in a class derived from it afterwards.
#: Read through an instance, it gives exact-class checks that torch.compile resolves from the
#: guards on the instance's type it has anyway, where ``type(module)`` in traced code adds a
#: guard that each module's class is the others'.
EXACT = "_tilenorm_exact"


def observed(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's ``forward``: hooks (its own or
    global) or a ``forward`` set on the instance. A fused add-then-norm skips the module call,
    so it is used only where nothing would observe that."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or any_global_hook()
                or "forward" in module.__dict__)


def make_add_norm(kind: NormKind, classes: tuple[type, ...]
                  ) -> Callable[[torch.nn.Module, torch.Tensor, torch.Tensor],
                                tuple[torch.Tensor, torch.Tensor]]:
    """``add_norm(norm, a, b) -> (norm(a + b), a + b)`` for a patched decoder layer or model.

    One tilenorm call where ``norm`` is exactly one of ``classes`` (the family's norm class
    and its tilenorm subclass), nothing observes its call, and a and b add without
    broadcasting; otherwise the add and the module call as written, so that hooks, a PEFT
    wrapper or a norm replaced after patching see what they would have seen. ``a`` None (the
    first layer of a loop carrying residuals, which has none): ``(norm(b), b)``.

    The tilenorm subclass is told by :data:`EXACT` (an instance of it, not of a class derived
    from it or of a wrapper, whose ``__getattr__`` may forward the attribute); the family's
    class by ``type(norm)``, as with ``apply(model, norms=False)``.
    """
    fused = kind.fused  # a function: the kind itself would be guarded as aliased per source
    patched = next((c for c in classes if c.__dict__.get(EXACT) is not None), None)
    token = None if patched is None else patched.__dict__[EXACT]
    others = tuple(c for c in classes if c is not patched)

    def add_norm(norm, a, b):
        if a is None:
            return norm(b), b
        exact = (getattr(norm, EXACT) == token if patched is not None
                 and isinstance(norm, patched) else type(norm) in others)
        if exact and not observed(norm) and a.shape == b.shape and a.device == b.device:
            return fused(norm, a, b, promote_types(a.dtype, b.dtype))
        h = a + b
        return norm(h), h

    return add_norm
