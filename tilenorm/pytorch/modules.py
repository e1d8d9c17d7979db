"""Drop-in replacements for ``torch.nn.RMSNorm`` and ``torch.nn.LayerNorm``."""

from __future__ import annotations

import torch

from tilenorm.pytorch.functional import LAYER_NORM, RMS_NORM, _apply


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by tilenorm.

    A subclass, so parameters, defaults, ``state_dict`` keys, ``reset_parameters`` and
    ``isinstance`` checks are torch's own; the forward follows ``torch.nn.functional.rms_norm``
    (normalizes over the trailing ``normalized_shape`` dimensions; ``eps=None`` is
    ``torch.finfo(torch.float32).eps``; y keeps x's dtype whatever the weight's).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # rms_norm's body, one call shallower: a module call is host-bound (NOTES #40)
        return _apply(RMS_NORM, x, self.weight, None, self.eps, self.normalized_shape, False,
                      0.0, None, False, None, None)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by tilenorm: same parameters, defaults (``eps=1e-5``,
    ``elementwise_affine=True``, ``bias=True``), ``state_dict`` keys and ``isinstance``;
    normalizes over the trailing ``normalized_shape`` dimensions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(LAYER_NORM, x, self.weight, self.bias, self.eps, self.normalized_shape,
                      False, 0.0, None, False, None, None)
