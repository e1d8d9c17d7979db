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
    accumulated over blocks; absolute where the scale is 0 (an exact result of 0). ``out``
    is compared on ``ref``'s device (a GPU result against a CPU float64 reference)."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.scale = 0.0

    def add(self, out: torch.Tensor, ref: torch.Tensor,
            scale: torch.Tensor | None = None) -> RelError:
        self.diff += (out.double().to(ref.device) - ref.double()).square().sum().item()
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


# --- FP8 output (tilenorm.fp8) -------------------------------------------------------------


@dataclass
class Float64Fp8Norm:
    """The float64 reference of one FP8-output normalization: ``norm`` is the float64 norm
    of the (dequantized) input, its gradients included where a ``dy`` was given (the
    quantization passes the gradient through unchanged); ``amax`` the float64 max |y| (per
    tensor, per row or per block: the scaling's groups, NaN skipped), and ``scale_inv`` the
    op's scales computed from it by the op's conventions, laid out as the op returns them;
    with ``transpose``, ``amax_t`` and ``scale_inv_t`` likewise of the (N, M) copy, whose
    groups run along M (per column, per 128 x 1 or 32 x 1 block; the per-tensor ones are
    the tensor's). ``terms`` is the size of what y is computed from, (M, N): ``|y - b| +
    |b|``, plus LayerNorm's ``|mean| * rstd * |w|``; fp32 y's rounding error is relative to
    it, not to y, where the bias cancels the rest or the mean is far from 0."""

    norm: Float64Norm
    amax: torch.Tensor
    scale_inv: torch.Tensor
    terms: torch.Tensor
    amax_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None


def _float64_scales(y: torch.Tensor, scaling: str, fp8_dtype: torch.dtype,
                    scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, scale_inv) of float64 ``y`` (R, C) with the scaling's groups along its rows (a
    last block shorter than the others holds what is left), laid out as the op's."""
    from tilenorm.pytorch import reference

    rows, cols = y.shape
    if scaling in ("tensor", "delayed"):
        amax = reference.amax_skipping_nan(y)
    elif scaling == "row":
        amax = reference.amax_skipping_nan(y, dim=1, keepdim=True)
    else:
        block = reference.FP8_BLOCK_COLS[scaling]
        blocks = -(-cols // block)
        padded = torch.nn.functional.pad(y, (0, blocks * block - cols))
        amax = reference.amax_skipping_nan(padded.reshape(rows, blocks, block), dim=2)
    if scaling == "delayed":
        scale_inv = 1.0 / scale.float().reshape(())
    elif scaling == "mx":
        k = reference.mx_exponent(amax.float(), fp8_dtype)
        scale_inv = (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale_inv = 1.0 / reference.scale_from_amax(amax.float(), fp8_dtype)
        if scaling == "block":
            scale_inv = scale_inv.t().contiguous().t()
    return amax, scale_inv


def float64_fp8_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, eps: float = 1e-6, *, scaling: str,
                     fp8_dtype: torch.dtype, scale: torch.Tensor | None = None,
                     layer_norm: bool = False, offset: float = 0.0,
                     residual: torch.Tensor | None = None,
                     x_scale_inv: torch.Tensor | None = None, group_size: int = 0,
                     transpose: bool = False, dy: torch.Tensor | None = None,
                     dh: torch.Tensor | None = None) -> Float64Fp8Norm:
    """The float64 reference of :func:`tilenorm.fp8.rms_norm` (``layer_norm=True``: of
    :func:`tilenorm.fp8.layer_norm`) over the last dimension. FP8 x is dequantized exactly
    (``x_scale_inv`` per ``group_size`` elements) first."""
    if group_size:
        n = x.shape[-1]
        x = (x.double().reshape(-1, n // group_size, group_size)
             * x_scale_inv.double().reshape(-1, n // group_size, 1)).reshape(x.shape)
    ref = float64_norm(x, weight, bias, eps, layer_norm=layer_norm, offset=offset,
                       residual=residual, dy=dy, dh=dh)
    y = ref.y.reshape(-1, ref.y.shape[-1])
    amax, scale_inv = _float64_scales(y, scaling, fp8_dtype, scale)
    terms = y.abs() if bias is None else (y - bias.double()).abs() + bias.double().abs()
    if layer_norm:
        w = 1.0 if weight is None else weight.double().abs()
        terms = terms + (ref.mean * ref.rstd).abs().reshape(-1, 1) * w
    out = Float64Fp8Norm(norm=ref, amax=amax, scale_inv=scale_inv, terms=terms)
    if transpose:
        out.amax_t, out.scale_inv_t = _float64_scales(y.t(), scaling, fp8_dtype, scale)
    return out


def fp8_scales_per_element(scale_inv: torch.Tensor, scaling: str, rows: int, cols: int
                           ) -> torch.Tensor:
    """float64 (rows, cols): each element's dequantizing multiplier."""
    from tilenorm.pytorch.reference import FP8_BLOCK_COLS

    if scaling == "mx":
        s = torch.pow(2.0, scale_inv.view(torch.uint8).double() - 127)
    else:
        s = scale_inv.double()
    if scaling in ("tensor", "delayed"):
        return s.reshape(1, 1).expand(rows, cols)
    if scaling == "row":
        return s.expand(rows, cols)
    return s.repeat_interleave(FP8_BLOCK_COLS[scaling], dim=1)[:, :cols]


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, scaling: str) -> torch.Tensor:
    """float64 ``q * scale_inv`` of an FP8 output, (rows, cols)."""
    q2 = q.reshape(-1, q.shape[-1]).double()
    return q2 * fp8_scales_per_element(scale_inv, scaling, *q2.shape)


def fp8_step(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The spacing of FP8 values at |v| (float64): 2^(exponent - mantissa bits), the
    subnormal spacing below the smallest normal."""
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8_dtype]
    min_exponent = torch.finfo(fp8_dtype).smallest_normal
    e = torch.floor(torch.log2(v.double().abs().clamp(min=min_exponent)))
    return torch.pow(2.0, e - mantissa_bits)


def fp8_rounding_excess(q: torch.Tensor, scale_inv: torch.Tensor, scaling: str,
                        y: torch.Tensor, fp8_dtype: torch.dtype,
                        terms: torch.Tensor | None = None) -> float:
    """The largest ``|q * s - saturate(y / s) * s| / bound`` over the elements whose float64
    reference ``y`` is a number, where ``s`` is the output's own multiplier of the element
    and ``bound`` half an FP8 step at ``|y / s|`` times ``s``, plus the fp32 arithmetic's
    share (2^-20 of ``terms``, the size of what y is summed from: |y| by default, see
    :class:`Float64Fp8Norm`). At most 1 when every value is the reference rounded to FP8 at
    the output's scales (saturated where the scale puts it past the format's largest
    value)."""
    from tilenorm.pytorch.reference import fp8_max

    y2 = y.reshape(-1, y.shape[-1]).double()
    q, scale_inv = q.to(y2.device), scale_inv.to(y2.device)  # a GPU output, a CPU reference
    size = y2.abs() if terms is None else terms.reshape(y2.shape).double()
    s = fp8_scales_per_element(scale_inv, scaling, *y2.shape)
    top = fp8_max(fp8_dtype)
    ideal = (y2 / s).clamp(-top, top)
    bound = 0.5 * fp8_step(ideal, fp8_dtype) * s * (1 + 2.0 ** -10) + 2.0 ** -20 * size
    excess = ((fp8_dequantize(q, scale_inv, scaling) - ideal * s).abs() / bound)
    finite = ~y2.isnan()
    return float(excess[finite].max()) if finite.any() else 0.0
