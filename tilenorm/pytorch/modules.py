"""Drop-in replacements for torch.nn normalization modules."""

from __future__ import annotations

import math

import torch

from tilenorm.pytorch._checks import check_x
from tilenorm.pytorch.rms_norm import rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by tilenorm.

    A subclass, so parameters, defaults, ``state_dict`` keys, ``reset_parameters`` and
    ``isinstance`` checks are torch's own. Normalizes over the trailing
    ``len(normalized_shape)`` dimensions; ``eps=None`` means ``torch.finfo(x.dtype).eps``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_x("RMSNorm", x)
        k = len(self.normalized_shape)
        if x.dim() < k or tuple(x.shape[-k:]) != tuple(self.normalized_shape):
            raise ValueError(f"RMSNorm: x must end in normalized_shape "
                             f"{tuple(self.normalized_shape)}, got {tuple(x.shape)}")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if k == 1:
            return rms_norm(x, self.weight, eps)
        n = math.prod(self.normalized_shape)
        weight = None if self.weight is None else self.weight.reshape(n)
        return rms_norm(x.reshape(*x.shape[:-k], n), weight, eps).view(x.shape)
