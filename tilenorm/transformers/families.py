"""The supported model families and the transformers sources verified for each.

A decoder layer's ``forward`` is rewritten (:mod:`tilenorm.transformers.rewrite`) only when
the digest of its installed source is listed here: each listed source was read, its
add-then-norm statements checked to be the residual stream feeding the named norm, and the
rewrite's output reviewed. Likewise a norm class's ``forward`` (with ``_norm`` where it has
one) is computed by tilenorm only when its digest maps to a :class:`~.norms.NormKind`. The
versions are those whose wheels were read (4.51.3, 4.52.4, 4.53.3, 4.54.1, 4.55.4, 4.56.2,
4.57.6, 5.0.0, 5.2.0, 5.5.4, 5.10.4, 5.14.1, 5.17.0, 5.20.2, 5.22.2, 5.23.0, 5.24.0); a source first
seen in a release between two of them with the same digest is the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tilenorm.transformers import norms

#: Norm forward digests -> (kind, versions read).
NORM_SOURCES: Mapping[str, tuple[norms.NormKind, str]] = {
    "cdbbe12603e777d7": (norms.LLAMA, "4.51-5.0 (Qwen2/Qwen3 to 4.55, OLMo2 4.51)"),
    "d676bfe9af0e524d": (norms.LLAMA, "5.2-5.24 (Qwen2/Qwen3 from 4.56)"),
    "f9957f8133baab5e": (norms.OLMO2, "4.52-5.0"),
    "1d33e8f6cf071536": (norms.OLMO2, "5.2-5.24"),
    "cf90de394758cdc8": (norms.GEMMA, "Gemma2 4.51-5.24"),
    "09dc8cdc8d8d6915": (norms.GEMMA, "Gemma3 4.51-5.24"),
}

#: The decoder-layer forward shared by Llama, Mistral, Qwen2 and Qwen3 (and Qwen3-MoE from
#: 5.0): digest -> versions read.
_LLAMA_LAYERS = {
    "fad71a96c49a55a0": "4.51",
    "00793770ade80209": "4.52",
    "0d3b6d0c7b7b0976": "4.53",
    "a4aa098da4e92d06": "4.54-4.55",
    "e61c75d2243cbdf6": "4.56-4.57",
    "e19cd8992f3bfeeb": "5.0-5.2",
    "461ed20abeb521a9": "5.5-5.23",
    # 5.24: a deprecate_kwarg decorator and past_key_values renamed cache; the adds and
    # norms as before
    "c58bc6a3bd6504f8": "5.24",
}

#: The Llama-shaped layer forwards whose rewrite for a loop carrying (output, residual) pairs
#: (:func:`~.rewrite.fuse_across`) was reviewed: digest -> versions read.
_LLAMA_LAYERS_ACROSS = {
    "461ed20abeb521a9": "5.5-5.23 (read: 5.5, 5.10, 5.14, 5.17, 5.20, 5.22, 5.23)",
    "c58bc6a3bd6504f8": "5.24",
}


def _models(*digests: str) -> dict[str, str]:
    """A family's model forwards (``LlamaModel.forward`` and the like) whose loop rewrite
    (:func:`~.rewrite.loop_across`) was reviewed, as (5.5-5.22, 5.23, 5.24) digests: 5.23
    changed an annotation, 5.24 renamed past_key_values to cache."""
    return dict(zip(digests, ("5.5-5.22 (read: 5.5, 5.10, 5.14, 5.17, 5.20, 5.22)", "5.23",
                              "5.24"), strict=True))


@dataclass(frozen=True)
class Family:
    """A model family: its modeling module, decoder layer and norm classes, and which of a
    layer's norms take the sum of a residual add."""

    name: str
    title: str
    module: str
    layer: str
    #: The norm class; None: the family uses ``torch.nn.LayerNorm``, and the LayerNorms that
    #: are children of the family's own modules are its norms.
    norm: str | None
    #: The layer's norms whose input is ``residual + sublayer output``: one tilenorm call
    #: each (empty: nothing to fuse, ``no_fusion`` says why).
    fused: tuple[str, ...] = ()
    layers: Mapping[str, str] = field(default_factory=dict)
    no_fusion: str = ""
    #: The base model class whose loop over the layers can carry (output, residual) pairs,
    #: so that the add ending each layer is fused with the next layer's ``entry`` norm and
    #: the last with the model's final norm; None: not supported for the family.
    model: str | None = None
    #: The model forwards and the layer forwards verified for that: digest -> versions.
    models: Mapping[str, str] = field(default_factory=dict)
    layers_across: Mapping[str, str] = field(default_factory=dict)
    entry: str = "input_layernorm"


def _family(name, title, prefix, fused=("post_attention_layernorm",), layers=None,
            no_fusion="", layer=None, norm="RMSNorm", models=()):
    return Family(name, title, f"transformers.models.{name}.modeling_{name}",
                  layer or f"{prefix}DecoderLayer", norm and f"{prefix}{norm}", fused,
                  _LLAMA_LAYERS if layers is None else layers, no_fusion,
                  f"{prefix}Model" if models else None, _models(*models) if models else {},
                  _LLAMA_LAYERS_ACROSS if models else {})


FAMILIES: Mapping[str, Family] = {f.name: f for f in (
    _family("llama", "Llama", "Llama",
            models=("aa5e80868d38712e", "3bc97b32d434f172", "6ad906eadeb491cd")),
    _family("mistral", "Mistral", "Mistral",
            models=("b237e110b64c5018", "dc333785d7df2df4", "0a953917a1d67760")),
    _family("qwen2", "Qwen2", "Qwen2",
            models=("040ee3766c9f8336", "af291875cf3623be", "4098825e5a456532")),
    _family("qwen3", "Qwen3", "Qwen3",
            models=("040ee3766c9f8336", "af291875cf3623be", "4098825e5a456532")),
    _family("qwen3_moe", "Qwen3-MoE", "Qwen3Moe",
            models=("374874f0d4e3d8e5", "c9142b881ecff1ce", "990dce21442ed1d9"), layers={
        "465283e1ee512bde": "4.51-4.52",
        "e0c229449afa12b6": "4.53",
        "5e2957ed4c445af4": "4.54-4.55",
        "519923429efec229": "4.56",
        "dd1a32e989584190": "4.57",
        "e19cd8992f3bfeeb": "5.0-5.2",
        "461ed20abeb521a9": "5.5-5.23",
        "c58bc6a3bd6504f8": "5.24",
    }),
    # Gemma2/3 normalize each sublayer's output before its add; the add after attention
    # feeds pre_feedforward_layernorm, the add after the MLP ends the layer.
    _family("gemma2", "Gemma2", "Gemma2", fused=("pre_feedforward_layernorm",), layers={
        "ad80999bb3dacea6": "4.51",
        "2044a8c84bdb619f": "4.52",
        "a03cd1d18c0f7247": "4.53-4.54",
        "537e15908e00a2cf": "4.55",
        "05bd8aa0d5ee178c": "4.56-4.57",
        "0eb1f3a99168a33c": "5.0-5.2",
        "8f29b865c61902ba": "5.5-5.14",
        "6a782ffdf5861ef9": "5.17-5.23",
        "9673c4b49cacf62c": "5.24",
    }),
    _family("gemma3", "Gemma3", "Gemma3", fused=("pre_feedforward_layernorm",), layers={
        "2c579442a0651f29": "4.51",
        "130453d5bf41a179": "4.52",
        "a2dc9e3a96235db9": "4.53-4.54",
        "8a308fdf4164a07a": "4.55",
        "9be2d17e9136e016": "4.56-4.57",
        "bbc6b707be5c602b": "5.0-5.2",
        "78a7d4e25e488971": "5.5-5.22",
        "06827e6c4404d2b6": "5.23",
        "f0e376e682386ca6": "5.24",
    }),
    _family("phi3", "Phi3", "Phi3", layers={
        "b26fb164d1d050a9": "4.51-4.52",
        "f6a98ad36084e98b": "4.53",
        "a22f38fb29d61eee": "4.54-4.55",
        "db02ea2ff7d7f25b": "4.56-4.57",
        "780abeac1c51f9e2": "5.0-5.2",
        "68e80cb69ca4ef11": "5.5-5.14",
        "daaa63565aa0a25b": "5.17-5.23",
        "95f20d9c7c28dda8": "5.24",
    }),
    _family("olmo2", "OLMo2", "Olmo2", fused=(), layers={}, no_fusion=(
        "OLMo2 normalizes each sublayer's output before the residual add: no add feeds a "
        "norm inside a layer (norms only)")),
    # Only the sequential residual (use_parallel_residual=False) adds attention's output to
    # the stream before post_attention_layernorm; the parallel one normalizes the layer's
    # input for both sublayers.
    _family("gpt_neox", "GPT-NeoX", "GPTNeoX", layer="GPTNeoXLayer", norm=None, layers={
        "2b43311486f7ec1e": "4.51-4.52",
        "66a46d42d6851020": "4.53-4.57",
        "4cd5e99e50669124": "5.0",
        "127955d52cb1e449": "5.2",
        "a6a1f62e86621001": "5.5-5.22",
        "dc677538129901a8": "5.23-5.24",
    }),
)}

#: Why a GPT-NeoX layer with the parallel residual fuses nothing.
NEOX_PARALLEL = ("parallel residual (use_parallel_residual=True): attention and MLP both read "
                 "the layer's input; no add feeds a norm")
#: Why the adds that end layers are not fused with the next layer's input norm.
ACROSS_LAYERS = ("the add that ends a layer is not fused with the next layer's input norm: "
                 "done only for the Llama-shaped families on transformers versions whose "
                 "model forward was verified")
#: When a model fusing across layers computes a call as written instead.
ACROSS_LAYERS_PER_CALL = (
    "adds across layers: each layer returns (output, residual) to the next, whose input norm "
    "adds them, the model's final norm the last; a call computes as written (each layer "
    "returning the residual stream) when output_hidden_states is requested or a decoder "
    "layer has hooks (transformers' own hidden-state recorders excepted while inactive) or "
    "a forward replaced on the instance")
