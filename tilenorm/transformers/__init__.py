"""Hugging Face transformers models with tilenorm's norms, patched in one call.

    import tilenorm.transformers as tt
    report = tt.apply(model)             # a built model, in place; print(report)
    tt.reset(model)                      # back to transformers' own classes
    tt.apply_to("llama")                 # or patch the classes before building models
    tt.reset_classes()

Families: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma2, Gemma3, Phi3, OLMo2 and GPT-NeoX.
Every norm module of these families computes with tilenorm (Qwen3's and Gemma3's per-head
q/k norms included), and where a decoder layer adds a sublayer's output to the residual
stream and then normalizes the sum, the add and the norm are one tilenorm call; for the
Llama-shaped families (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE) on transformers 5.5-5.24 the
add that ends each layer is also one call with the next layer's input norm, the model's loop
passing (output, residual) pairs from layer to layer. transformers is an optional dependency:
``pip install 'tilenorm[transformers]'``.
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without transformers installed
    raise ImportError("tilenorm.transformers patches Hugging Face transformers models and "
                      "needs transformers >= 4.51: pip install 'tilenorm[transformers]' (or "
                      "pip install 'transformers>=4.51')") from e

from tilenorm.transformers.families import FAMILIES
from tilenorm.transformers.patching import apply, apply_to, reset, reset_classes
from tilenorm.transformers.report import Report, Skipped

__all__ = ["FAMILIES", "Report", "Skipped", "apply", "apply_to", "reset", "reset_classes"]
