"""Drop-in replacements for torch.nn normalization modules."""

from __future__ import annotations

import math

import torch

from tilenorm.pytorch._checks import check_x
from tilenorm.pytorch.layer_norm import layer_norm
from tilenorm.pytorch.rms_norm import rms_norm


def _fold_trailing(name: str, x: torch.Tensor, normalized_shape: tuple[int, ...]
                   ) -> torch.Tensor:
    """x with its trailing ``normalized_shape`` dimensions folded into one (a view where the
    strides allow): normalizing over them is normalizing over that one."""
    check_x(name, x)
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[-k:]) != tuple(normalized_shape):
        raise ValueError(f"{name}: x must end in normalized_shape {tuple(normalized_shape)}, "
                         f"got {tuple(x.shape)}")
    return x if k == 1 else x.reshape(*x.shape[:-k], math.prod(normalized_shape))


def _flat(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.reshape(-1)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by tilenorm.

    A subclass, so parameters, defaults, ``state_dict`` keys, ``reset_parameters`` and
    ``isinstance`` checks are torch's own. Normalizes over the trailing
    ``len(normalized_shape)`` dimensions; ``eps=None`` means ``torch.finfo(x.dtype).eps``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _fold_trailing("RMSNorm", x, self.normalized_shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(flat, _flat(self.weight), eps).view(x.shape)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by tilenorm: same parameters, defaults (``eps=1e-5``,
    ``elementwise_affine=True``, ``bias=True``), ``state_dict`` keys and ``isinstance``.
    Normalizes over the trailing ``len(normalized_shape)`` dimensions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _fold_trailing("LayerNorm", x, self.normalized_shape)
        return layer_norm(flat, _flat(self.weight), _flat(self.bias), self.eps).view(x.shape)
