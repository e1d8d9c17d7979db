"""The one float64 reference and the one error measure that tests, benchmarks and
``python -m tilenorm`` check every output against.

The reference is float64 autograd of the textbook formula, so its gradients come from
differentiation, not from the algebra the kernels' backward uses:

    h = x + residual                       (a fused residual add; otherwise h = x)
    y = (h - mean(h)) / sqrt(var(h) + eps) * (offset + weight) + bias     (LayerNorm)
    y = h / sqrt(mean(h^2) + eps) * (offset + weight)                      (RMSNorm)

over the last dimension. A weight or bias of shape (N,) is shared by every vector; one of
shape (H, N) on x of shape (..., H, N) is one per head. Problems too large for float64 copies
are checked a block of rows at a time (:func:`row_blocks`, :class:`RelError`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: Elements of x per block of rows when a check walks a large problem in blocks.
BLOCK_ELEMENTS = 1 << 26


@dataclass
class Float64Norm:
    """Float64 results of one normalization: forward outputs and, where a ``dy`` was given,
    the gradients (None where the operand is absent). ``mean`` is None for RMSNorm; ``mean``
    and ``rstd`` have x's shape without its last dimension."""

    y: torch.Tensor
    h: torch.Tensor
    mean: torch.Tensor | None
    rstd: torch.Tensor
    dx: torch.Tensor | None = None
    dweight: torch.Tensor | None = None
    dbias: torch.Tensor | None = None
    dresidual: torch.Tensor | None = None


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().requires_grad_()


def float64_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, eps: float = 1e-6, *,
                 layer_norm: bool = False, offset: float = 0.0,
                 residual: torch.Tensor | None = None, dy: torch.Tensor | None = None,
                 dh: torch.Tensor | None = None) -> Float64Norm:
    """The float64 reference of one normalization over the last dimension; with ``dy`` (the
    gradient reaching y) and ``dh`` (the gradient reaching h of a fused residual add, or
    None), its gradients too."""
    x64, w64, b64, r64 = (_leaf(t) for t in (x, weight, bias, residual))
    h = x64 if r64 is None else x64 + r64
    mean = h.mean(-1, keepdim=True) if layer_norm else None
    centered = h - mean if layer_norm else h
    rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    y = centered * rstd
    if w64 is not None:
        y = y * (offset + w64)
    if b64 is not None:
        y = y + b64
    out = Float64Norm(y=y.detach(), h=h.detach(),
                      mean=None if mean is None else mean.detach().squeeze(-1),
                      rstd=rstd.detach().squeeze(-1))
    if dy is None:
        return out
    outputs, grads = [y], [dy.double()]
    if dh is not None:
        outputs.append(h)
        grads.append(dh.double())
    torch.autograd.backward(outputs, grads)
    out.dx = x64.grad
    out.dweight = None if w64 is None else w64.grad
    out.dbias = None if b64 is None else b64.grad
    out.dresidual = None if r64 is None else r64.grad
    return out


class RelError:
    """Relative error ``||out - ref|| / ||scale||`` (``scale`` defaults to ``ref``),
    accumulated over blocks; absolute where the scale is 0 (an exact result of 0)."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.scale = 0.0

    def add(self, out: torch.Tensor, ref: torch.Tensor,
            scale: torch.Tensor | None = None) -> RelError:
        self.diff += (out.double() - ref.double()).square().sum().item()
        self.scale += (ref if scale is None else scale).double().square().sum().item()
        return self

    @property
    def value(self) -> float:
        if self.scale > 0:
            return (self.diff / self.scale) ** 0.5
        return self.diff ** 0.5


def rel_error(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None
              ) -> float:
    """``||out - ref|| / ||scale or ref||`` in float64 (NaN anywhere gives NaN: never passes a
    ``<=`` check)."""
    return RelError().add(out, ref, scale).value


def row_blocks(rows: int, row_elements: int) -> Iterator[slice]:
    """Slices of at most :data:`BLOCK_ELEMENTS` elements' worth of rows."""
    step = max(1, BLOCK_ELEMENTS // max(row_elements, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def fresh_generator(device: str | torch.device = "cpu") -> tuple[torch.Generator, int]:
    """A generator with a fresh random seed (report it on failure): new inputs every check."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device=device).manual_seed(seed), seed
