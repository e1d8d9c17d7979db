"""Float64 forward and backward of every normalization, computed in row blocks so that even
2^31-element problems fit beside the tensors under test, and the norms needed for relative
errors. Operands are (rows, heads, N) or (rows, N); weights (N,) or (heads, N)."""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 26


def row_blocks(rows: int, row_elements: int):
    step = max(1, BLOCK_ELEMENTS // max(row_elements, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _h(x, residual):
    return x.double() if residual is None else x.double() + residual.double()


def norm_fwd(x, w, b, eps, *, layer_norm=False, offset=0.0, residual=None):
    """(y, h, mean, rstd) in float64 for one block of rows; mean is None for RMSNorm."""
    h = _h(x, residual)
    mean = h.mean(-1, keepdim=True) if layer_norm else None
    c = h - mean if layer_norm else h
    rstd = torch.rsqrt(c.square().mean(-1, keepdim=True) + eps)
    y = c * rstd
    if w is not None:
        y = y * (w.double() + offset)
    if b is not None:
        y = y + b.double()
    return y, h, None if mean is None else mean.squeeze(-1), rstd.squeeze(-1)


def norm_bwd(dy, x, w, eps, *, layer_norm=False, offset=0.0, residual=None, dh=None):
    """(dx, dw rows, db rows, |w dy rstd|) in float64 for one block of rows. dx is also the
    residual's gradient (it includes dh, the gradient that reached h directly)."""
    h = _h(x, residual)
    dy = dy.double()
    mean = h.mean(-1, keepdim=True) if layer_norm else 0.0
    c = h - mean
    rstd = torch.rsqrt(c.square().mean(-1, keepdim=True) + eps)
    x_hat = c * rstd
    wdy = dy * (w.double() + offset) if w is not None else dy
    d = wdy - x_hat * (x_hat * wdy).mean(-1, keepdim=True)
    if layer_norm:
        d = d - wdy.mean(-1, keepdim=True)
    dx = d * rstd
    if dh is not None:
        dx = dx + dh.double()
    lead = -1 if w is None or w.dim() == 1 else (-1, w.shape[0])
    n = x.shape[-1]
    shape = (-1, n) if lead == -1 else (-1, lead[1], n)
    return (dx, (dy * x_hat).reshape(shape).sum(0), dy.reshape(shape).sum(0), wdy * rstd)


class RelError:
    """Accumulates ||out - ref|| and ||scale|| over blocks: relative error = their ratio."""

    def __init__(self):
        self.diff = 0.0
        self.ref = 0.0

    def add(self, out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None):
        self.diff += (out.double() - ref).square().sum().item()
        self.ref += (ref if scale is None else scale).square().sum().item()

    @property
    def value(self) -> float:
        return (self.diff / self.ref) ** 0.5 if self.ref > 0 else float(self.diff > 0)
