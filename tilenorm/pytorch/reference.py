"""Reference implementations in plain torch: the path for CPU tensors and for every case no
kernel covers, with the kernels' semantics.

    h = x + residual, rounded to residual_dtype   (fused residual add, default the residual's
                                                   dtype; otherwise h = x)
    mu = mean(h) (LayerNorm only), rstd = 1 / sqrt(mean((h - mu)^2) + eps)
    y = (h - mu) * rstd * (offset + weight) + bias, rounded once to out_dtype

over the last ``dims`` dimensions. Arithmetic is fp32 (fp64 for fp64 inputs; the product with
an fp64 weight in fp64, as torch does). The weight and bias have the normalized dimensions'
shape, or (H, N) per head for x of shape (..., H, N). :func:`norm` is differentiable through
autograd; :func:`norm_forward` and :func:`norm_backward` are the launch-level pair the custom
ops use.
"""

from __future__ import annotations

import struct

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _residual_sum(x: torch.Tensor, residual: torch.Tensor | None,
                  residual_dtype: torch.dtype | None) -> torch.Tensor:
    if residual is None:
        return x
    dtype = residual_dtype or residual.dtype
    if x.dtype == residual.dtype == dtype:
        # torch adds 16-bit floats in fp32 and rounds once: the same values, and under
        # torch.compile the graph a model's own `residual + out` gives (bench/NOTES.md #62)
        return x + residual
    acc = compute_dtype(x.dtype)
    return (x.to(acc) + residual.to(acc)).to(dtype)


def _dims(dims: int) -> tuple[int, ...]:
    return tuple(range(-dims, 0))


def _stats(hf: torch.Tensor, layer_norm: bool, eps: float, dims: int
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    mean = hf.mean(dim=_dims(dims), keepdim=True) if layer_norm else None
    centered = hf - mean if layer_norm else hf
    return mean, torch.rsqrt(centered.square().mean(dim=_dims(dims), keepdim=True) + eps)


def _affine(x_hat, weight, bias, offset, acc):
    y = x_hat
    for p in (weight, bias):  # an fp64 parameter on fp32 input: the product in fp64
        if p is not None and p.dtype == torch.float64:
            y = y.to(torch.float64)
    # Type promotion multiplies a 16-bit weight in y's dtype without a cast of its own, and a
    # zero offset adds nothing: the traced graph is then torch's rms_norm's, op for op (#84).
    if weight is not None:
        y = y * (weight if offset == 0 else weight.to(y.dtype) + offset)
    if bias is not None:
        y = y + bias
    return y


def _forward(x, weight, bias, eps, layer_norm, offset, residual, residual_dtype, out_dtype,
             dims):
    """(y, h, mean, rstd) with mean and rstd keeping the normalized dimensions."""
    acc = compute_dtype(x.dtype)
    h = _residual_sum(x, residual, residual_dtype)
    hf = h.to(acc)
    mean, rstd = _stats(hf, layer_norm, eps, dims)
    x_hat = (hf - mean if layer_norm else hf) * rstd
    y = _affine(x_hat, weight, bias, offset, acc).to(out_dtype or x.dtype)
    return y, h, mean, rstd


def norm(x: torch.Tensor, weight: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, eps: float = 1e-6, *, layer_norm: bool = False,
         offset: float = 0.0, residual: torch.Tensor | None = None,
         residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
         dims: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h), differentiable in every tensor argument; h is x without a residual."""
    y, h, _, _ = _forward(x, weight, bias, eps, layer_norm, offset, residual, residual_dtype,
                          out_dtype, dims)
    return y, h


def norm_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, *, layer_norm: bool = False, offset: float = 0.0,
                 residual: torch.Tensor | None = None,
                 residual_dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None, dims: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h, mean, rstd): the kernels' outputs. mean (None for RMSNorm) and rstd have x's
    shape without the normalized dimensions, in the compute dtype."""
    with torch.no_grad():
        y, h, mean, rstd = _forward(x, weight, bias, eps, layer_norm, offset, residual,
                                    residual_dtype, out_dtype, dims)
    stat = x.shape[:x.dim() - dims]
    return y, h, None if mean is None else mean.reshape(stat), rstd.reshape(stat)


def _fold(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over every leading dimension that ``like`` (a weight or bias) lacks."""
    return t.reshape(-1, *like.shape).sum(0).to(like.dtype)


def norm_backward(dy: torch.Tensor, dres_in: torch.Tensor | None, h: torch.Tensor,
                  weight: torch.Tensor | None, bias: torch.Tensor | None,
                  mean: torch.Tensor | None, rstd: torch.Tensor, *, offset: float = 0.0,
                  x_dtype: torch.dtype | None = None, dims: int = 1,
                  dy_more: tuple[torch.Tensor, ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                             torch.Tensor | None]:
    """(dx, dh, dweight, dbias) from the forward's h, mean and rstd. dh is the gradient of the
    residual stream in h's dtype (the residual's gradient); dx the same values in
    ``x_dtype`` (default h's dtype). y's gradient is ``dy`` plus each of ``dy_more``, added
    in the computation dtype."""
    acc = compute_dtype(h.dtype)
    stat = h.shape[:h.dim() - dims] + (1,) * dims
    axes = _dims(dims)
    with torch.no_grad():
        r = rstd.to(acc).reshape(stat)
        hf = h.to(acc)
        x_hat = (hf - mean.to(acc).reshape(stat) if mean is not None else hf) * r
        g = dy.to(acc)
        for part in dy_more:
            g = g + part.to(acc)
        wdy = g * (weight.to(acc) + offset) if weight is not None else g
        d = wdy - x_hat * (x_hat * wdy).mean(dim=axes, keepdim=True)
        if mean is not None:
            d = d - wdy.mean(dim=axes, keepdim=True)
        d = d * r
        if dres_in is not None:
            d = d + dres_in.to(acc)
        dweight = None if weight is None else _fold(g * x_hat, weight)
        dbias = None if bias is None else _fold(g, bias)
        return d.to(x_dtype or h.dtype), d.to(h.dtype), dweight, dbias


# --- FP8 output (tilenorm.fp8) -------------------------------------------------------------
#
# The kernels' quantization (tilenorm/kernels/cutile_row_norm_fp8.py) in torch, on fp32 y:
# the path of CPU tensors and of every FP8 case no kernel covers, and the one definition of
# the scale conventions that the float64 reference (tilenorm.testing) reuses.

#: Columns per scale of the block scalings: DeepSeek-V3's 1 x 128 and MXFP8's 1 x 32.
FP8_BLOCK_COLS = {"block": 128, "mx": 32}
#: How MX scales are laid out: (rows, groups) row-major, or "swizzled" into the 128 x 4
#: tiles of Blackwell's block-scaled GEMMs (:func:`swizzle_mx_scales`).
MX_LAYOUTS = ("row_major", "swizzled")
_FLOAT32_MAX = torch.finfo(torch.float32).max


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return torch.finfo(fp8_dtype).max


def amax_skipping_nan(y: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |y| over ``dim`` (every dimension where None), NaN read as 0; 0 over nothing."""
    a = torch.nan_to_num(y.abs(), nan=0.0)
    dims = tuple(range(a.dim())) if dim is None else dim
    if a.numel() == 0:
        return torch.zeros_like(a.sum(dim=dims, keepdim=keepdim))
    return a.amax(dim=dims, keepdim=keepdim)


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``fp8_max / amax``: 1 where amax is 0 or not finite, clamped to the largest fp32
    where it would overflow (the kernels' ``_scale_of``)."""
    amax = amax.float()
    usable = (amax > 0) & (amax <= _FLOAT32_MAX)
    # A tensor numerator: torch's ``float / tensor`` is ``reciprocal(tensor) * float``, two
    # roundings, 1 ulp off the kernels' correctly rounded quotient in a quarter of cases.
    top = torch.full_like(amax, fp8_max(fp8_dtype))
    scale = top / torch.where(usable, amax, torch.ones_like(amax))
    return torch.where(usable, scale.clamp(max=_FLOAT32_MAX), torch.ones_like(amax))


def mx_exponent(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """int32 k, the smallest with ``amax <= fp8_max * 2^k``, from the fp32 bits of both
    (clamped to [-127, 127]; 0 for amax = 0): the kernels' ``_mx_exponent``."""
    a_bits = amax.float().view(torch.int32)
    (m_bits,) = struct.unpack("<i", struct.pack("<f", fp8_max(fp8_dtype)))
    k = ((a_bits >> 23) & 0xFF) - ((m_bits >> 23) & 0xFF)
    k = k + ((a_bits & 0x7FFFFF) > (m_bits & 0x7FFFFF)).to(torch.int32)
    return torch.where(amax > 0, k.clamp(-127, 127), torch.zeros_like(k))


def saturate(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Clamp to +-fp8_max, NaN kept."""
    m = fp8_max(fp8_dtype)
    return torch.where(v > m, m, torch.where(v < -m, -m, v))


def quantize_along_rows(y: torch.Tensor, scaling: str, fp8_dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) of fp32 ``y`` (R, C) with scales along its rows: one per row ("row",
    (R, 1) fp32), per 1 x 128 block ("block", (R, cdiv(C, 128)) fp32 with strides (1, R)) or
    per 1 x 32 block ("mx", (R, cdiv(C, 32)) E8M0). A last block shorter than the others
    takes the amax of what it holds. The transposed copies are this of y's transpose."""
    rows, cols = y.shape
    if scaling == "row":
        s = scale_from_amax(amax_skipping_nan(y, dim=1, keepdim=True), fp8_dtype)
        return saturate(y * s, fp8_dtype).to(fp8_dtype), 1.0 / s
    block = FP8_BLOCK_COLS[scaling]
    blocks = -(-cols // block)
    # Zeros leave a block's amax as it is.
    y3 = torch.nn.functional.pad(y, (0, blocks * block - cols)).reshape(rows, blocks, block)
    block_amax = amax_skipping_nan(y3, dim=2, keepdim=True)
    if scaling == "mx":
        k = mx_exponent(block_amax, fp8_dtype)
        scaled = y3 * torch.pow(2.0, -k.float())
        scale_inv = (k + 127).to(torch.uint8).reshape(rows, blocks).view(torch.float8_e8m0fnu)
    else:
        s = scale_from_amax(block_amax, fp8_dtype)
        scaled = y3 * s
        scale_inv = (1.0 / s).reshape(rows, blocks).t().contiguous().t()
    q = saturate(scaled.reshape(rows, blocks * block)[:, :cols], fp8_dtype).to(fp8_dtype)
    return q, scale_inv


def fp8_quantize(y: torch.Tensor, scaling: str, fp8_dtype: torch.dtype,
                 scale: torch.Tensor | None = None, transpose: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None, torch.Tensor | None]:
    """(q, scale_inv, amax, q_t, scale_inv_t) of fp32 ``y`` of shape (M, N), as the kernels
    lay them out: scale_inv of shape () for "tensor" and "delayed" (whose given ``scale`` q
    uses), else as :func:`quantize_along_rows`; amax (shape ()) for the per-tensor
    scalings, else None; where ``transpose``, the (N, M) copy q_t and its scales: the
    per-tensor scale_inv itself, else :func:`quantize_along_rows` of y's transpose ((N, 1)
    per column, (N, cdiv(M, 128)) per 128 x 1 block with strides (1, N), (N, cdiv(M, 32))
    E8M0 per 32 x 1 block)."""
    if scaling not in ("tensor", "delayed"):
        q, scale_inv = quantize_along_rows(y, scaling, fp8_dtype)
        q_t = scale_inv_t = None
        if transpose:
            q_t, scale_inv_t = quantize_along_rows(y.t().contiguous(), scaling, fp8_dtype)
        return q, scale_inv, None, q_t, scale_inv_t
    amax = amax_skipping_nan(y)
    s = scale_from_amax(amax, fp8_dtype) if scaling == "tensor" else scale.float().reshape(())
    q = saturate(y * s, fp8_dtype).to(fp8_dtype)
    scale_inv = 1.0 / s
    if transpose:
        return q, scale_inv, amax, q.t().contiguous(), scale_inv
    return q, scale_inv, amax, None, None


def swizzle_mx_scales(scales: torch.Tensor) -> torch.Tensor:
    """(R, C) E8M0 scales (R rows of a GEMM operand, C groups of 32 along K) in cuBLAS's 1-D
    block scaling factor layout, what ``torch._scaled_mm`` / ``scaled_mm`` take for MXFP8 on
    Blackwell (``SwizzleType.SWIZZLE_32_4_4``), as TE's and torch's ``to_blocked`` lay them
    out: (R, C) zero-padded to (round_up(R, 128), round_up(C, 4)), cut into 128 x 4 tiles
    stored one after another row-major over the tiles, 512 bytes each, in which element
    (i, j) of a tile sits at ``(i % 32) * 16 + (i // 32) * 4 + j``. Returned in that padded
    (round_up(R, 128), round_up(C, 4)) shape, contiguous (TE's; torch's ``to_blocked``
    returns the same bytes flat)."""
    rows, cols = scales.shape
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(row_blocks * 128, col_blocks * 4, dtype=torch.uint8,
                         device=scales.device)
    padded[:rows, :cols] = scales.view(torch.uint8)
    # Row 128 r + 32 a + b, column 4 c + j goes to tile (r, c), place (b, a, j).
    tiles = padded.reshape(row_blocks, 4, 32, col_blocks, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_blocks * 128, col_blocks * 4).view(scales.dtype)


def unswizzle_mx_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) scales that :func:`swizzle_mx_scales` laid out as ``blocked``."""
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    tiles = blocked.view(torch.uint8).reshape(row_blocks, col_blocks, 32, 4, 4)
    padded = tiles.permute(0, 3, 2, 1, 4).reshape(row_blocks * 128, col_blocks * 4)
    return padded[:rows, :cols].view(blocked.dtype)


def dequantize_groups(x: torch.Tensor, x_scale_inv: torch.Tensor, group_size: int
                      ) -> torch.Tensor:
    """fp32 values of FP8 x (..., N) with one multiplier per ``group_size`` elements of a row
    (x_scale_inv (M, N / group_size))."""
    n = x.shape[-1]
    xf = x.float().reshape(-1, n // group_size, group_size)
    return (xf * x_scale_inv.float().reshape(-1, n // group_size, 1)).reshape(x.shape)


def norm_fp8_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     eps: float, *, scaling: str, fp8_dtype: torch.dtype,
                     scale: torch.Tensor | None = None, transpose: bool = False,
                     layer_norm: bool = False, offset: float = 0.0,
                     residual: torch.Tensor | None = None,
                     residual_dtype: torch.dtype | None = None,
                     x_scale_inv: torch.Tensor | None = None, group_size: int = 0,
                     mx_layout: str = "row_major") -> tuple:
    """(q, scale_inv, amax, q_t, scale_inv_t, h, mean, rstd) of a norm over the last
    dimension with FP8 output, computed as the kernels compute it (fp32). FP8 x comes with
    ``x_scale_inv`` and ``group_size``; h is the dequantized x (fp32) without a residual,
    else the sum stored in ``residual_dtype``; MX scales ``mx_layout`` "swizzled" are
    :func:`swizzle_mx_scales`'s."""
    with torch.no_grad():
        xv = dequantize_groups(x, x_scale_inv, group_size) if group_size else x
        n = x.shape[-1]
        y, h, mean, rstd = _forward(xv, weight, bias, eps, layer_norm, offset, residual,
                                    residual_dtype, torch.float32, 1)
        q, scale_inv, amax, q_t, scale_inv_t = fp8_quantize(y.reshape(-1, n), scaling,
                                                            fp8_dtype, scale, transpose)
        if mx_layout == "swizzled":
            scale_inv = swizzle_mx_scales(scale_inv)
            scale_inv_t = None if scale_inv_t is None else swizzle_mx_scales(scale_inv_t)
    stat = x.shape[:-1]
    return (q.reshape(x.shape), scale_inv, amax, q_t, scale_inv_t, h,
            None if mean is None else mean.reshape(stat), rstd.reshape(stat))
