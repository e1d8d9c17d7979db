"""Fixed-order column reduction of a partial buffer: the second step of every backward.

A persistent backward leaves one fp32 row of per-program sums per group (dgamma, and dbeta for
LayerNorm) in a ``(grid, groups, cols)`` partial buffer. This kernel adds those rows in the
same order on every run, so dgamma and dbeta are bit-for-bit reproducible; there are no
atomics anywhere.
"""

from __future__ import annotations

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


def start_after_predecessor(DEPENDENT: bool):
    """A kernel's first step when it is launched as a programmatic dependent (Hopper and later,
    ``RowNormPlan.dependent_launch``): the launch may overlap the drain of the kernel before
    it, so it waits for that kernel to finish and its writes to be visible before touching
    memory, then lets its own successor begin launching (which in turn waits for this grid).
    Compiled out otherwise: the instructions alone change tileiras's pipeline (bench/NOTES.md,
    #25)."""
    if DEPENDENT:
        ct.grid_dependency_control_wait()
        ct.grid_dependency_control_launch_dependents()


@ct.kernel
def column_sums(partial, out_a, out_b, TILE_R: ConstInt, TILE_C: ConstInt,
                DEPENDENT: ConstBool):
    """``out[c] = sum_r partial[r, g, c]`` for the ``TILE_C`` columns of this program, where
    group ``g`` (the grid's second axis: dgamma, dbeta) writes ``out_a`` or ``out_b``. One
    launch serves both groups: a second launch costs ~3 us, 1.4% of a LayerNorm backward at
    32768 x 4096 (bench/NOTES.md, #23).

    Rows are visited in increasing tiles of ``TILE_R`` and the tile is collapsed once at the
    end, so the summation tree depends only on the compiled kernel and ``partial.shape[0]``.
    """
    start_after_predecessor(DEPENDENT)
    col_tile, group = ct.bid(0), ct.bid(1)
    shape = (TILE_R, 1, TILE_C)
    row_tiles = ct.num_tiles(partial, axis=0, shape=shape)
    acc = ct.zeros(shape, dtype=ct.float32)
    for i in range(row_tiles):
        acc += ct.load(partial, index=(i, group, col_tile), shape=shape,
                       padding_mode=ct.PaddingMode.ZERO)
    total = ct.sum(acc, axis=0).reshape((TILE_C,))
    # Through registers, as every store in norm.py (bench/NOTES.md, #14).
    if group == 0:
        ct.store(out_a, index=(col_tile,), tile=total.astype(out_a.dtype), allow_tma=False)
    else:
        ct.store(out_b, index=(col_tile,), tile=total.astype(out_b.dtype), allow_tma=False)
