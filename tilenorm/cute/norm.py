"""Row-norm backward in the CuTe DSL: dx, and dgamma / dbeta folded into the partial buffer,
with the next rows' loads in flight while a row is reduced.

The cuTile backward (tilenorm/cutile/norm.py) loads a row, reduces it, and only then loads the
next: a cuTile persistent loop cannot carry a loaded tile (bench/NOTES.md, #8, #22), so an SM
has loads in flight only while one of its two resident programs is between reductions. That
holds the LayerNorm backward at 32768 x 4096 to ~90% of copy bandwidth on an H200. Here each
thread keeps ``stages`` rows of its 16-byte vectors in registers: the loads of row
``r + (stages - 1) * grid`` are issued before row ``r`` is reduced (#38).

Layout: program ``p`` of ``grid`` takes rows ``p, p + grid, ...`` (one program per row at a
time; ``threads`` threads, each holding ``reps`` 16-byte vectors of the row, a block of
``threads`` vectors apart, so every load is coalesced). The two row sums go through a warp
butterfly, then through shared memory in warp order: a fixed summation tree, so dx is
bit-for-bit reproducible, and so are dgamma and dbeta, whose per-program sums the cuTile
``column_sums`` kernel adds in a fixed order. No atomics, no M x N temporary.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from tilenorm.planner import CUTE_BACKWARD, CuteBackwardPlan

_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
           torch.float32: cutlass.Float32}


class RowNormBackward:
    """The kernel for one (dtypes, width, features, launch config); ``__call__`` launches it on
    ``grid`` programs."""

    def __init__(self, dtype, weight_dtype, cols: int, threads: int, stages: int,
                 ctas_per_sm: int, layer_norm: bool, has_bias: bool):
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.cols = cols
        self.threads = threads
        self.vec = 128 // dtype.width
        if cols % (self.vec * threads):
            raise ValueError(f"{cols} columns are not whole {self.vec}-element vectors of "
                             f"{threads} threads")
        self.reps = cols // (self.vec * threads)
        if stages < 2 or stages % 2:
            raise ValueError(f"stages must be even and >= 2, got {stages}")
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.layer_norm = layer_norm
        self.has_weight = weight_dtype is not None
        self.has_bias = has_bias
        self.warps = threads // cute.arch.WARP_SIZE

    @cute.jit
    def __call__(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor | None,
                 mMean: cute.Tensor | None, mRstd: cute.Tensor, mdX: cute.Tensor,
                 mPartial: cute.Tensor | None, grid: Int32, stream):
        self.kernel(mX, mdY, mW, mMean, mRstd, mdX, mPartial).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream,
            max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=self.ctas_per_sm,
            # Given, so that the compile does not query a device (it also runs on CPUs).
            preferred_smem_carveout=_SMEM_PER_SM)

    @cute.jit
    def _thread_view(self, row: cute.Tensor, tidx: Int32) -> cute.Tensor:
        """This thread's (vec, reps) elements of a row: one 16-byte vector per rep, the reps
        ``threads`` vectors apart."""
        vectors = cute.zipped_divide(row, (self.vec,))
        blocks = cute.logical_divide(vectors, (None, self.threads))
        return blocks[(None, (tidx, None))]

    @cute.jit
    def _load_row(self, mX, mdY, mMean, mRstd, row, tidx, x, dy, stats, slot):
        cute.autovec_copy(self._thread_view(mX[row, None], tidx), x)
        cute.autovec_copy(self._thread_view(mdY[row, None], tidx), dy)
        stats[slot, 0] = mRstd[row]
        if const_expr(self.layer_norm):
            stats[slot, 1] = mMean[row]

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mdY: cute.Tensor, mW: cute.Tensor | None,
               mMean: cute.Tensor | None, mRstd: cute.Tensor, mdX: cute.Tensor,
               mPartial: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        program, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        rows = mX.shape[0]
        last = rows - 1
        inv_n = Float32(1.0 / self.cols)

        smem = cutlass.memory.SmemAllocator()
        # (warp, sum, parity): the row sums of two consecutive rows live in different
        # slots, so one barrier per row orders every write before its reads and every read
        # before the slot's next write.
        sums = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2, 2)), 16)

        shape = (self.vec, self.reps)
        w = cute.make_rmem_tensor(shape, Float32)
        if const_expr(self.has_weight):
            w_in = cute.make_rmem_tensor(shape, self.weight_dtype)
            cute.autovec_copy(self._thread_view(mW, tidx), w_in)
            w.store(w_in.load().to(Float32))
        dw = cute.make_rmem_tensor(shape, Float32)
        dw.fill(0.0)
        db = cute.make_rmem_tensor(shape, Float32)
        db.fill(0.0)
        dx = cute.make_rmem_tensor(shape, self.dtype)
        xs = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(self.stages)]
        dys = [cute.make_rmem_tensor(shape, self.dtype) for _ in range(self.stages)]
        # Register tensors, not Python names: a value the next trip of the loop reads must be
        # memory, not an SSA value of the traced body.
        stats = cute.make_rmem_tensor((self.stages, 2), Float32)

        # Rows past the end are clamped to the last row: loaded, never used.
        for s in cutlass.range_constexpr(self.stages - 1):
            self._load_row(mX, mdY, mMean, mRstd, cutlass.min(program + s * grid, last), tidx,
                           xs[s], dys[s], stats, s)

        for base in cutlass.range(program, rows, self.stages * grid):
            for s in cutlass.range_constexpr(self.stages):
                ahead = (s + self.stages - 1) % self.stages
                self._load_row(mX, mdY, mMean, mRstd,
                               cutlass.min(base + (s + self.stages - 1) * grid, last), tidx,
                               xs[ahead], dys[ahead], stats, ahead)
                row = base + s * grid
                if row < rows:
                    x = xs[s].load().to(Float32)
                    g = dys[s].load().to(Float32)
                    rstd = stats[s, 0]
                    x_hat = ((x - stats[s, 1]) * rstd if const_expr(self.layer_norm)
                             else x * rstd)
                    wdy = g * w.load() if const_expr(self.has_weight) else g
                    if const_expr(self.has_weight):
                        dw.store(dw.load() + g * x_hat)
                    if const_expr(self.has_bias):
                        db.store(db.load() + g)
                    part_a = cute.arch.warp_reduction(
                        (x_hat * wdy).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                        operator.add)
                    part_b = Float32(0.0)
                    if const_expr(self.layer_norm):
                        part_b = cute.arch.warp_reduction(
                            wdy.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), operator.add)
                    parity = s % 2
                    if lane == 0:
                        sums[warp, 0, parity] = part_a
                        sums[warp, 1, parity] = part_b
                    cute.arch.barrier()
                    sum_a = Float32(0.0)
                    sum_b = Float32(0.0)
                    for i in cutlass.range_constexpr(self.warps):
                        sum_a = sum_a + sums[i, 0, parity]
                        if const_expr(self.layer_norm):
                            sum_b = sum_b + sums[i, 1, parity]
                    if const_expr(self.layer_norm):
                        grad = (wdy - (x_hat * (sum_a * inv_n) + sum_b * inv_n)) * rstd
                    else:
                        grad = (wdy - x_hat * (sum_a * inv_n)) * rstd
                    dx.store(grad.to(self.dtype))
                    cute.autovec_copy(dx, self._thread_view(mdX[row, None], tidx))

        if const_expr(self.has_weight):
            cute.autovec_copy(dw, self._thread_view(mPartial[program, 0, None], tidx))
        if const_expr(self.has_bias):
            group = 1 if const_expr(self.has_weight) else 0
            cute.autovec_copy(db, self._thread_view(mPartial[program, group, None], tidx))


#: Shared memory per SM on Hopper and Blackwell datacenter parts (228 KB).
_SMEM_PER_SM = 233472


@dataclass(frozen=True)
class BackwardKey:
    """What selects a compiled variant of the kernel. The row count is one of them: with it
    a runtime value, the loop's bounds cost the registers that two CTAs per SM leave, the
    kernel spills, and it runs at 87.5% of copy bandwidth instead of 97.8% (H200, #38)."""

    rows: int
    dtype: torch.dtype
    weight_dtype: torch.dtype | None
    has_bias: bool
    layer_norm: bool
    cols: int
    threads: int
    stages: int
    ctas_per_sm: int

    @classmethod
    def of(cls, plan: CuteBackwardPlan, dtype: torch.dtype, weight_dtype: torch.dtype | None,
           has_bias: bool, layer_norm: bool) -> BackwardKey:
        return cls(plan.rows, dtype, weight_dtype, has_bias, layer_norm, plan.cols,
                   plan.threads, plan.stages, plan.ctas_per_sm)


def _fake(dtype, shape, stride, align):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def compile_backward(key: BackwardKey, arch: str | None = None):
    """Compile ``key``'s kernel; ``arch`` (e.g. ``"sm_90a"``) compiles without a GPU, for
    that architecture. The result is called as ``fn(h, dy, weight, mean, rstd, dx, partial,
    grid)`` with torch tensors (None for the absent ones) on torch's current stream."""
    dtype = _DTYPES[key.dtype]
    weight_dtype = None if key.weight_dtype is None else _DTYPES[key.weight_dtype]
    kernel = RowNormBackward(dtype, weight_dtype, key.cols, key.threads, key.stages,
                             key.ctas_per_sm, key.layer_norm, key.has_bias)
    rows, slots = key.rows, cute.sym_int()
    # Rows contiguous, so that a row's offset is a multiple of a compile-time stride: a
    # runtime 64-bit stride costs the registers that keep two CTAs resident (#38).
    x, dy, dx = (_fake(dtype, (rows, key.cols), (key.cols, 1), 16) for _ in range(3))
    weight = None if weight_dtype is None else _fake(weight_dtype, (key.cols,), (1,), 16)
    mean = _fake(Float32, (rows,), (1,), 4) if key.layer_norm else None
    rstd = _fake(Float32, (rows,), (1,), 4)
    groups = int(weight_dtype is not None) + int(key.has_bias)
    partial = (_fake(Float32, (slots, groups, key.cols), (groups * key.cols, key.cols, 1), 16)
               if groups else None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    return cute.compile(kernel, x, dy, weight, mean, rstd, dx, partial, Int32(1), stream,
                        options=options)


#: Architectures the ahead-of-time build targets: Hopper and Blackwell datacenter parts.
AOT_ARCHS = ("sm_90a", "sm_100a")
#: Row count of the ahead-of-time builds (kernels are compiled per row count).
AOT_ROWS = 32768


def aot_keys(all_dtypes: bool = False) -> list[BackwardKey]:
    """Every variant the planner's CuTe DSL entries can run: each weight dtype (or none),
    with and without a bias, in bf16 (and fp16 with ``all_dtypes``)."""
    dtypes = (torch.bfloat16, torch.float16) if all_dtypes else (torch.bfloat16,)
    return [BackwardKey(AOT_ROWS, dtype, weight_dtype, has_bias, op == "layer_norm", cols,
                        *config)
            for op, widths in CUTE_BACKWARD.items() for cols, config in widths.items()
            for dtype in dtypes for weight_dtype in (None, dtype, torch.float32)
            for has_bias in ((False, True) if op == "layer_norm" else (False,))]


#: Compiled variants kept per process: a new row count compiles in ~2 s.
MAX_COMPILED = 256


@functools.lru_cache(maxsize=MAX_COMPILED)
def compiled_backward(key: BackwardKey):
    """``key``'s kernel for this process's GPU, compiled once."""
    return compile_backward(key)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with contiguous, 16-byte aligned storage (a copy only when it is not)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def takes(h: torch.Tensor, dy: torch.Tensor) -> bool:
    """Whether the kernel can read ``h`` and ``dy`` (rows, cols) as they are: contiguous and
    16-byte aligned."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (h, dy))


def run_backward(plan: CuteBackwardPlan, h: torch.Tensor, dy: torch.Tensor,
                 weight: torch.Tensor | None, bias: torch.Tensor | None,
                 mean: torch.Tensor | None, rstd: torch.Tensor, dx: torch.Tensor,
                 partial: torch.Tensor | None) -> None:
    """Launch the backward on torch's current stream: ``h``, ``dy``, ``dx`` are (rows, cols)
    as :func:`takes` accepts; ``mean`` (LayerNorm) and ``rstd``
    are (rows,) fp32; ``partial`` is fp32 (plan.grid, groups, cols), dgamma's group first
    (None without weight and bias). ``bias`` is read only for its presence."""
    key = BackwardKey.of(plan, h.dtype, None if weight is None else weight.dtype,
                         bias is not None, mean is not None)
    fn = compiled_backward(key)
    fn(h, dy, None if weight is None else _aligned(weight),
       None if mean is None else mean.contiguous(), rstd.contiguous(), dx, partial, plan.grid)
