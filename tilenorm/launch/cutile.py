"""Binds row-norm launch plans to the cuTile kernels (:mod:`tilenorm.kernels`): which kernel
function, compiled for which occupancy, index width and warps; its grid; its compile-time
arguments; the order of its operands. Framework-neutral: a bound kernel launches on a given
stream from arrays cuTile takes (anything with DLPack or the CUDA array interface), and
:mod:`tilenorm.launch.driver` launches the same compiled code from raw device pointers.

Ahead-of-time builds (:mod:`tilenorm.launch.aot`) bind through the same functions, so they
build exactly the variants that run.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import cuda.tile as ct

# The native launch, not the ``ct.launch`` attribute: TileGym replaces that attribute with a
# positional-only wrapper that rejects ``programmatic_dependent_launch`` once it is imported.
from cuda.tile._cext import launch as native_launch

from tilenorm.kernels.cutile_column_sums import column_sums
from tilenorm.kernels.cutile_row_norm import (
    norm_bwd_columns,
    norm_bwd_row_sums,
    norm_bwd_single,
    norm_bwd_split,
    norm_fwd_chunked,
    norm_fwd_single,
    norm_fwd_split,
)
from tilenorm.planner import RowNormPlan, next_pow2


@dataclass(frozen=True)
class NormFeatures:
    """The compile-time features of one normalization (see
    :mod:`tilenorm.kernels.cutile_row_norm`)."""

    layer_norm: bool = False
    has_weight: bool = True
    per_head_weight: bool = False
    has_bias: bool = False
    has_residual: bool = False
    has_offset: bool = False


#: Each kernel's array parameters, in order (the other parameters are scalars).
ARRAYS = {
    norm_fwd_single: ("x", "residual", "weight", "bias", "y", "residual_out", "mean", "rstd"),
    norm_bwd_single: ("dy", "dy2", "dy3", "h", "weight", "mean", "rstd", "dres_in", "dx",
                      "dres", "partial_w", "partial_b"),
}
ARRAYS[norm_fwd_chunked] = ARRAYS[norm_fwd_split] = ARRAYS[norm_fwd_single]
ARRAYS[norm_bwd_split] = ARRAYS[norm_bwd_single]
ARRAYS[norm_bwd_row_sums] = ("dy", "dy2", "dy3", "h", "weight", "mean", "rstd", "row_sums")
ARRAYS[norm_bwd_columns] = ARRAYS[norm_bwd_row_sums] + ARRAYS[norm_bwd_single][7:]
ARRAYS[column_sums._pyfunc] = ("partial", "out_a", "out_b")

#: (single pass, split single pass, wider rows) kernels per direction.
_KERNELS = {"forward": (norm_fwd_single, norm_fwd_split, norm_fwd_chunked),
            "backward": (norm_bwd_single, norm_bwd_split, norm_bwd_columns)}
#: The kernel that adds up the backward's partial buffer.
REDUCE_KERNEL_NAME = column_sums._pyfunc.__name__


def _indexed_with_int64(fn):
    """A copy of kernel function ``fn`` whose array parameters index with 64 bits."""
    wide = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    wide.__annotations__ = {**fn.__annotations__,
                            **dict.fromkeys(ARRAYS[fn], ct.IndexedWithInt64)}
    wide.__qualname__ = fn.__qualname__
    wide.__module__ = fn.__module__
    return wide


@functools.cache
def compiled(fn, occupancy: int, index_bits: int, worker_warps: int | None) -> ct.kernel:
    """The kernel for ``fn`` compiled for ``occupancy`` CTAs per SM, ``index_bits``-bit
    indexing and ``worker_warps`` (None: the compiler's choice); each variant has its own JIT
    cache."""
    source = _indexed_with_int64(fn) if index_bits == 64 else fn
    return ct.kernel(source, occupancy=occupancy, num_worker_warps=worker_warps)


def _compiled_for(fn, plan: RowNormPlan) -> ct.kernel:
    return compiled(fn, plan.occupancy, plan.index_bits, plan.worker_warps)


@dataclass(frozen=True)
class BoundKernel:
    """A kernel variant with its grid and trailing arguments resolved once: a launch passes
    only the operands and the runtime scalars. ``arrays`` names its array parameters in
    order (:data:`ARRAYS`); ``constants`` are the arguments after the runtime ones."""

    kernel: ct.kernel
    #: The kernel's Python function (its parameters and annotations).
    source: types.FunctionType
    arrays: tuple[str, ...]
    grid: tuple[int, int, int]
    constants: tuple
    dependent_launch: bool
    index_bits: int
    #: A column-split backward's row-sums kernel, launched first, and the (sums, column
    #: tiles) trailing shape of its fp32 ``row_sums`` workspace (see bind_backward).
    first: BoundKernel | None = None
    workspace: tuple[int, int] = ()

    @property
    def name(self) -> str:
        return self.source.__name__

    def args(self, *runtime) -> tuple:
        return runtime + self.constants

    def launch(self, stream: int, *runtime) -> None:
        """Launch on ``stream`` (a raw CUstream handle) with ``runtime`` arguments: arrays in
        :attr:`arrays` order (DLPack or CUDA-array-interface objects), then scalars."""
        native_launch(stream, self.grid, self.kernel, runtime + self.constants,
                      programmatic_dependent_launch=self.dependent_launch)


def kernel_source(plan: RowNormPlan):
    """The kernel function (before compilation) that runs ``plan`` (a column-split backward
    runs :func:`norm_bwd_row_sums` before it)."""
    single, split, wide = _KERNELS[plan.direction]
    if not plan.single_pass:
        return wide
    return split if plan.split_cols else single


def kernel_names(plan: RowNormPlan) -> tuple[str, ...]:
    """The kernels ``plan`` runs, in launch order (the reduction aside)."""
    first = ("norm_bwd_row_sums",) if plan.column_split else ()
    return first + (kernel_source(plan).__name__,)


def _bound(fn, plan: RowNormPlan, constants: tuple, **kw) -> BoundKernel:
    return BoundKernel(_compiled_for(fn, plan), fn, ARRAYS[fn], (plan.grid, 1, 1),
                       constants, plan.dependent_launch, plan.index_bits, **kw)


def _split_constant(plan: RowNormPlan) -> tuple:
    return (plan.split_cols,) if plan.split_cols else ()


def bind_forward(plan: RowNormPlan, features: NormFeatures) -> BoundKernel:
    """The forward for ``plan``; runtime arguments ``(x, residual, weight, bias, y,
    residual_out, mean, rstd, eps, offset)``: x, residual, y and residual_out (rows, heads,
    cols), weight and bias (1, heads or 1, cols), mean and rstd (rows, heads) fp32. Shared by
    the launchers and by ahead-of-time export (which passes parameter constraints as the
    runtime arguments), so both build exactly the same kernel variants."""
    f = features
    constants = (1.0 / plan.cols, plan.tile_rows, plan.tile_heads, plan.tile_cols,
                 f.layer_norm, f.has_weight, f.per_head_weight, f.has_bias, f.has_residual,
                 plan.span_cols != plan.cols, f.has_offset,
                 plan.dependent_launch) + _split_constant(plan)
    return _bound(kernel_source(plan), plan, constants)


#: The most parts of y's gradient a backward adds up as it loads them (dy, dy2, dy3).
MAX_DY_TERMS = 3


def bind_backward(plan: RowNormPlan, features: NormFeatures, has_dres_in: bool,
                  store_dres: bool, dy_terms: int = 1) -> BoundKernel:
    """The backward's row kernel for ``plan``; runtime arguments ``(dy, dy2, dy3, h, weight,
    mean, rstd, dres_in, dx, dres, partial_w, partial_b, offset)`` (see bind_forward; y's
    gradient is the sum of the first ``dy_terms`` of dy, dy2, dy3; the partial buffers are
    (slots, heads or 1, cols) fp32). A column-split plan's kernel also takes the ``row_sums``
    workspace after rstd, and carries the row-sums kernel (``first``: ``(dy, dy2, dy3, h,
    weight, mean, rstd, row_sums, offset)``)."""
    if not 1 <= dy_terms <= MAX_DY_TERMS:
        raise ValueError(f"dy_terms must be 1 to {MAX_DY_TERMS}, got {dy_terms}")
    f = features
    fn = kernel_source(plan)
    if plan.column_split:
        first = _bound(norm_bwd_row_sums, plan,
                       (plan.tile_cols, f.layer_norm, f.has_weight, f.per_head_weight,
                        f.has_offset, dy_terms, plan.dependent_launch))
        sums = 2 if f.layer_norm else 1
        constants = (1.0 / plan.cols, plan.tile_cols, next_pow2(plan.col_tiles), f.layer_norm,
                     f.has_weight, f.per_head_weight, f.has_bias, has_dres_in, store_dres,
                     f.has_offset, dy_terms, plan.dependent_launch)
        return _bound(fn, plan, constants, first=first, workspace=(sums, plan.col_tiles))
    constants = (1.0 / plan.cols, plan.tile_rows, plan.tile_heads, plan.tile_cols,
                 f.layer_norm, f.has_weight, f.per_head_weight, f.has_bias, has_dres_in,
                 store_dres, f.has_offset, dy_terms,
                 plan.dependent_launch) + _split_constant(plan)
    return _bound(fn, plan, constants)


def bind_reduce(plan: RowNormPlan, groups: int) -> BoundKernel:
    """The fixed-order reduction of ``groups`` (1: dgamma or dbeta, 2: both) partial sums;
    runtime arguments ``(partial, out_a, out_b)``: the partial buffer as
    :meth:`PartialBuffer.reduced` lays it out, the outputs flat."""
    return BoundKernel(column_sums, column_sums._pyfunc, ARRAYS[column_sums._pyfunc],
                       (plan.reduce_grid, groups, 1),
                       plan.reduce_tile + (plan.dependent_reduce,), plan.dependent_reduce, 32)


@dataclass(frozen=True)
class PartialBuffer:
    """The backward's fp32 partial buffer: dgamma's and dbeta's per-program sums side by side
    in one allocation of :attr:`shape`, (slots, groups, group size). Each group is the row
    kernel's (slots, heads, cols) operand and starts on a 16-byte boundary (its size rounded
    up to 4 elements), so every operand's base is aligned whatever the width."""

    slots: int
    groups: int
    heads: int
    cols: int

    @classmethod
    def of(cls, plan: RowNormPlan, groups: int) -> PartialBuffer:
        slots, heads, cols = plan.partial_shape
        return cls(slots, groups, heads, cols)

    @property
    def group_size(self) -> int:
        return -(-self.heads * self.cols // 4) * 4

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.slots, self.groups, self.group_size

    def group(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shape, strides) of one group as the row kernel's partial operand."""
        return ((self.slots, self.heads, self.cols),
                (self.groups * self.group_size, self.cols, 1))

    def group_offset(self, index: int) -> int:
        """Bytes from the buffer's base to group ``index``."""
        return index * self.group_size * 4

    def reduced(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shape, strides) of the buffer as the reduction reads it: (slots, groups,
        heads * cols)."""
        return ((self.slots, self.groups, self.heads * self.cols),
                (self.groups * self.group_size, self.group_size, 1))
