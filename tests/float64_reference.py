"""Float64 RMSNorm forward and backward, computed in row blocks so that even 2^31-element
problems fit beside the tensors under test, and the norms needed for relative errors."""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 26


def row_blocks(rows: int, cols: int):
    step = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor | None, eps: float):
    """(y, rstd) in float64 for one block of rows (2-D x)."""
    x = x.double()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    y = x * rstd
    if w is not None:
        y = y * w.double()
    return y, rstd.squeeze(-1)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None, eps: float):
    """(dx, dw contribution of these rows, |w dy rstd|) in float64 for one block of rows."""
    x, dy = x.double(), dy.double()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    x_hat = x * rstd
    wdy = dy * w.double() if w is not None else dy
    c = (x_hat * wdy).mean(-1, keepdim=True)
    dx = (wdy - x_hat * c) * rstd
    dw = (dy * x_hat).sum(0)
    return dx, dw, wdy * rstd


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
