"""RMSNorm forward and backward in cuTile: persistent grid-stride kernels.

y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), all arithmetic in fp32.

Every kernel runs on a persistent grid (about SM count x occupancy programs, chosen by
:mod:`tilenorm.planner`); program ``p`` handles row tiles ``p, p + grid, p + 2 * grid, ...``.
Rows that fit in one tile are done in a single pass ("single" kernels); wider rows are walked
in column chunks twice, the second pass reading the row back from L2 ("chunked" kernels).

The backward writes dx and folds ``sum(dy * x_hat)`` over the program's rows into row ``p`` of
a ``(grid, cols)`` fp32 partial buffer; :func:`tilenorm.cutile.reduce.column_sum` then adds the
rows in a fixed order. No M x N temporary, no atomics: results are bit-for-bit repeatable.
"""

from __future__ import annotations

import functools

import cuda.tile as ct
import torch

from tilenorm.cutile.reduce import column_sum
from tilenorm.planner import RowNormPlan

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


def _weight_chunk(weight, chunk, TILE_N, HAS_WEIGHT):
    """Columns ``[chunk * TILE_N, (chunk + 1) * TILE_N)`` of the weight as a (1, TILE_N) fp32
    tile, or ones when the norm has no weight."""
    if HAS_WEIGHT:
        w = ct.load(weight, index=(chunk,), shape=(TILE_N,), padding_mode=ZERO)
        return w.astype(ct.float32).reshape((1, TILE_N))
    return ct.full((1, TILE_N), 1.0, dtype=ct.float32)


@ct.kernel
def rms_norm_fwd_single(x, weight, y, rstd, eps: float, inv_n: float,
                        TILE_M: ConstInt, TILE_N: ConstInt, HAS_WEIGHT: ConstBool):
    row_tiles = ct.num_tiles(x, axis=0, shape=(TILE_M, TILE_N))
    w = _weight_chunk(weight, 0, TILE_N, HAS_WEIGHT)
    for t in range(ct.bid(0), row_tiles, ct.num_blocks(0)):
        xt = ct.load(x, index=(t, 0), shape=(TILE_M, TILE_N), padding_mode=ZERO)
        xt = xt.astype(ct.float32)
        r = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * inv_n + eps)
        ct.store(y, index=(t, 0), tile=(xt * r * w).astype(y.dtype))
        ct.store(rstd, index=(t,), tile=r.reshape((TILE_M,)))


@ct.kernel
def rms_norm_fwd_chunked(x, weight, y, rstd, eps: float, inv_n: float,
                         TILE_M: ConstInt, TILE_N: ConstInt, HAS_WEIGHT: ConstBool):
    row_tiles = ct.num_tiles(x, axis=0, shape=(TILE_M, TILE_N))
    chunks = ct.num_tiles(x, axis=1, shape=(TILE_M, TILE_N))
    for t in range(ct.bid(0), row_tiles, ct.num_blocks(0)):
        acc = ct.zeros((TILE_M, TILE_N), dtype=ct.float32)
        for c in range(chunks):
            xt = ct.load(x, index=(t, c), shape=(TILE_M, TILE_N), padding_mode=ZERO)
            xt = xt.astype(ct.float32)
            acc += xt * xt
        r = ct.rsqrt(ct.sum(acc, axis=1, keepdims=True) * inv_n + eps)
        for c in range(chunks):
            xt = ct.load(x, index=(t, c), shape=(TILE_M, TILE_N), padding_mode=ZERO)
            w = _weight_chunk(weight, c, TILE_N, HAS_WEIGHT)
            ct.store(y, index=(t, c), tile=(xt.astype(ct.float32) * r * w).astype(y.dtype))
        ct.store(rstd, index=(t,), tile=r.reshape((TILE_M,)))


@ct.kernel
def rms_norm_bwd_single(dy, x, weight, rstd, dx, partial, inv_n: float,
                        TILE_M: ConstInt, TILE_N: ConstInt, HAS_WEIGHT: ConstBool):
    program = ct.bid(0)
    row_tiles = ct.num_tiles(x, axis=0, shape=(TILE_M, TILE_N))
    w = _weight_chunk(weight, 0, TILE_N, HAS_WEIGHT)
    dw = ct.zeros((TILE_M, TILE_N), dtype=ct.float32)
    for t in range(program, row_tiles, ct.num_blocks(0)):
        xt = ct.load(x, index=(t, 0), shape=(TILE_M, TILE_N), padding_mode=ZERO)
        dyt = ct.load(dy, index=(t, 0), shape=(TILE_M, TILE_N), padding_mode=ZERO)
        # Rows past M load rstd = 0, which zeroes their x_hat and dx (never stored anyway).
        r = ct.load(rstd, index=(t,), shape=(TILE_M,), padding_mode=ZERO).reshape((TILE_M, 1))
        x_hat = xt.astype(ct.float32) * r
        dyt = dyt.astype(ct.float32)
        wdy = dyt * w
        c = ct.sum(x_hat * wdy, axis=1, keepdims=True) * inv_n
        ct.store(dx, index=(t, 0), tile=((wdy - x_hat * c) * r).astype(dx.dtype))
        if HAS_WEIGHT:
            dw += dyt * x_hat
    if HAS_WEIGHT:
        ct.store(partial, index=(program, 0), tile=ct.sum(dw, axis=0, keepdims=True))


@ct.kernel
def rms_norm_bwd_chunked(dy, x, weight, rstd, dx, partial, inv_n: float,
                         TILE_M: ConstInt, TILE_N: ConstInt, HAS_WEIGHT: ConstBool):
    program = ct.bid(0)
    row_tiles = ct.num_tiles(x, axis=0, shape=(TILE_M, TILE_N))
    chunks = ct.num_tiles(x, axis=1, shape=(TILE_M, TILE_N))
    if HAS_WEIGHT:
        # The program's partial row is accumulated in place, once per row tile; start at 0.
        for c in range(chunks):
            ct.store(partial, index=(program, c), tile=ct.zeros((1, TILE_N), dtype=ct.float32))
    for t in range(program, row_tiles, ct.num_blocks(0)):
        r = ct.load(rstd, index=(t,), shape=(TILE_M,), padding_mode=ZERO).reshape((TILE_M, 1))
        acc = ct.zeros((TILE_M, TILE_N), dtype=ct.float32)
        for c in range(chunks):
            xt = ct.load(x, index=(t, c), shape=(TILE_M, TILE_N), padding_mode=ZERO)
            dyt = ct.load(dy, index=(t, c), shape=(TILE_M, TILE_N), padding_mode=ZERO)
            w = _weight_chunk(weight, c, TILE_N, HAS_WEIGHT)
            acc += xt.astype(ct.float32) * dyt.astype(ct.float32) * w
        # mean(x_hat * w * dy) = rstd * mean(x * w * dy)
        c_row = ct.sum(acc, axis=1, keepdims=True) * (r * inv_n)
        for c in range(chunks):
            xt = ct.load(x, index=(t, c), shape=(TILE_M, TILE_N), padding_mode=ZERO)
            dyt = ct.load(dy, index=(t, c), shape=(TILE_M, TILE_N), padding_mode=ZERO)
            w = _weight_chunk(weight, c, TILE_N, HAS_WEIGHT)
            x_hat = xt.astype(ct.float32) * r
            dyt = dyt.astype(ct.float32)
            ct.store(dx, index=(t, c), tile=((dyt * w - x_hat * c_row) * r).astype(dx.dtype))
            if HAS_WEIGHT:
                acc_w = ct.load(partial, index=(program, c), shape=(1, TILE_N))
                ct.store(partial, index=(program, c),
                         tile=acc_w + ct.sum(dyt * x_hat, axis=0, keepdims=True))


@functools.cache
def with_occupancy(kernel: ct.kernel, occupancy: int) -> ct.kernel:
    """The kernel compiled for ``occupancy`` CTAs per SM (each variant has its own JIT cache)."""
    return kernel.replace_hints(occupancy=occupancy)


def forward_launch(plan: RowNormPlan, x, weight, y, rstd, eps, inv_n, has_weight: bool):
    """(kernel, grid, args) of the forward for ``plan``. Shared by the launcher and by
    ahead-of-time export (which passes parameter constraints in place of tensors and scalars),
    so both build exactly the same kernel variants."""
    kernel = rms_norm_fwd_single if plan.single_pass else rms_norm_fwd_chunked
    args = (x, weight, y, rstd, eps, inv_n, plan.tile_rows, plan.tile_cols, has_weight)
    return with_occupancy(kernel, plan.occupancy), (plan.grid, 1, 1), args


def backward_launch(plan: RowNormPlan, dy, x, weight, rstd, dx, partial, inv_n,
                    has_weight: bool):
    """(kernel, grid, args) of the backward's first kernel for ``plan`` (see forward_launch)."""
    kernel = rms_norm_bwd_single if plan.single_pass else rms_norm_bwd_chunked
    args = (dy, x, weight, rstd, dx, partial, inv_n, plan.tile_rows, plan.tile_cols,
            has_weight)
    return with_occupancy(kernel, plan.occupancy), (plan.grid, 1, 1), args


def reduce_launch(plan: RowNormPlan, partial, out):
    tile_r, tile_c = plan.reduce_tile
    return column_sum, (plan.reduce_grid, 1, 1), (partial, out, tile_r, tile_c)


@functools.cache
def _placeholder(device: torch.device, slot: int) -> torch.Tensor:
    # Stands in for an argument that HAS_WEIGHT=False never touches (the weight, the partial
    # buffer); one buffer per slot so that no two kernel arguments alias.
    return torch.empty(1, dtype=torch.float32, device=device)


def _stream(device: torch.device) -> int:
    # torch.cuda.current_stream() costs ~4 us per call; the raw handle costs ~0.1 us.
    return torch._C._cuda_getCurrentRawStream(device.index)


def forward(plan: RowNormPlan, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
            y: torch.Tensor | None = None, rstd: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of the 2-D CUDA tensor ``x``; returns (y, rstd).

    ``y`` and ``rstd`` may be given (every element is overwritten); otherwise they are
    allocated: y contiguous in x's dtype, rstd fp32 of shape (M,).
    """
    if y is None:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rstd is None:
        rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    has_weight = weight is not None
    w = weight if has_weight else _placeholder(x.device, 0)
    kernel, grid, args = forward_launch(plan, x, w, y, rstd, float(eps), 1.0 / plan.cols,
                                        has_weight)
    ct.launch(_stream(x.device), grid, kernel, args)
    return y, rstd


def backward(plan: RowNormPlan, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
             rstd: torch.Tensor, dx: torch.Tensor | None = None,
             partial: torch.Tensor | None = None, dweight: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients (dx, dweight) of RMSNorm for 2-D ``dy`` and ``x``; dweight is None without a
    weight. ``dx``, the fp32 ``partial`` buffer of ``plan.partial_shape`` and ``dweight`` may
    be given; the kernels overwrite every element, so none needs zeroing."""
    if dx is None:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    has_weight = weight is not None
    stream = _stream(x.device)
    if has_weight:
        if partial is None:
            partial = torch.empty(plan.partial_shape, dtype=torch.float32, device=x.device)
        w = weight
    else:
        w, partial = _placeholder(x.device, 0), _placeholder(x.device, 1)
    kernel, grid, args = backward_launch(plan, dy, x, w, rstd, dx, partial, 1.0 / plan.cols,
                                         has_weight)
    ct.launch(stream, grid, kernel, args)
    if not has_weight:
        return dx, None
    if dweight is None:
        dweight = torch.empty(plan.cols, dtype=weight.dtype, device=x.device)
    kernel, grid, args = reduce_launch(plan, partial, dweight)
    ct.launch(stream, grid, kernel, args)
    return dx, dweight
