"""Fixed-order column reduction of a partial buffer: the second step of every backward.

A persistent backward leaves one fp32 row of per-program sums in a ``(grid, cols)`` partial
buffer. This kernel adds those rows in the same order on every run, so dgamma (and dbeta) are
bit-for-bit reproducible; there are no atomics anywhere.
"""

from __future__ import annotations

import cuda.tile as ct

ConstInt = ct.Constant[int]


@ct.kernel
def column_sum(partial, out, TILE_R: ConstInt, TILE_C: ConstInt):
    """``out[c] = sum_r partial[r, c]`` for the ``TILE_C`` columns of this program.

    Rows are visited in increasing tiles of ``TILE_R`` and the tile is collapsed once at the
    end, so the summation tree depends only on the compiled kernel and ``partial.shape[0]``.
    """
    col_tile = ct.bid(0)
    row_tiles = ct.num_tiles(partial, axis=0, shape=(TILE_R, TILE_C))
    acc = ct.zeros((TILE_R, TILE_C), dtype=ct.float32)
    for i in range(row_tiles):
        acc += ct.load(partial, index=(i, col_tile), shape=(TILE_R, TILE_C),
                       padding_mode=ct.PaddingMode.ZERO)
    # Through registers, as every store in norm.py (bench/NOTES.md, #14).
    ct.store(out, index=(col_tile,), tile=ct.sum(acc, axis=0).astype(out.dtype),
             allow_tma=False)
