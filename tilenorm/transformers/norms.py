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
from torch.nn.modules import module as _torch_module

from tilenorm.pytorch.functional import LAYER_NORM as LAYER_NORM_OP
from tilenorm.pytorch.functional import _autocast_out_dtype, layer_norm, rms_norm


def _per_head_under_compile(forward: Callable[..., torch.Tensor]
                            ) -> Callable[..., torch.Tensor]:
    """``forward``, except for per-head vectors in a graph torch.compile traces, where the
    patched class's original forward runs (see the module docstring)."""

    def per_head_to_inductor(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and torch.compiler.is_compiling():
            return type(self)._tilenorm_original.forward(self, x)
        return forward(self, x)

    per_head_to_inductor.__name__ = per_head_to_inductor.__qualname__ = forward.__name__
    return per_head_to_inductor


def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon,
                    out_dtype=torch.promote_types(self.weight.dtype, hidden_states.dtype))


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
                    out_dtype=torch.promote_types(norm.weight.dtype, h_dtype))


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
    the fused ``(norm(a + b), a + b)`` for a decoder layer's add-then-norm."""

    name: str
    forward: Callable[..., torch.Tensor]
    fused: Callable[..., tuple[torch.Tensor, torch.Tensor]]


LLAMA = NormKind("llama", _per_head_under_compile(_llama_forward), _llama_add_norm)
OLMO2 = NormKind("olmo2", _per_head_under_compile(_olmo2_forward), _olmo2_add_norm)
GEMMA = NormKind("gemma", _per_head_under_compile(_gemma_forward), _gemma_add_norm)
LAYER_NORM = NormKind("layer_norm", _layer_norm_forward, _layer_norm_add_norm)


#: torch's global module hooks (dicts registered into in place).
GLOBAL_HOOKS = tuple(getattr(_torch_module, name, {}) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks"))


def observed(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's ``forward``: hooks (its own or
    global) or a ``forward`` set on the instance. A fused add-then-norm skips the module call,
    so it is used only where nothing would observe that."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or any(GLOBAL_HOOKS)
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
    """

    def add_norm(norm, a, b):
        if a is None:
            return norm(b), b
        if (type(norm) in classes and not observed(norm) and a.shape == b.shape
                and a.device == b.device):
            return kind.fused(norm, a, b, torch.promote_types(a.dtype, b.dtype))
        h = a + b
        return norm(h), h

    return add_norm
