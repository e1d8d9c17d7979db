"""Launch planning for the row-normalization kernels. Pure Python: no GPU, no torch.

Every launch decision (tile shape, single pass or column chunks, occupancy, persistent grid,
partial-buffer shape, the dgamma reduction's tiling) comes from :func:`plan_row_norm`, a
function of (M, N, element size, SM count, architecture), so CPU tests can check it and
:func:`tilenorm.explain` can show it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

Direction = Literal["forward", "backward"]

# Per-direction settings, measured on an H200 (bench/NOTES.md has the experiments).
#: The widest row kept whole in one tile (registers); wider rows are walked in chunks.
MAX_SINGLE_PASS_COLS = {"forward": 16384, "backward": 8192}
#: (rows, cols) of the tile that walks rows wider than MAX_SINGLE_PASS_COLS. The backward
#: takes several rows per tile so that its read-modify-write of the program's partial row
#: happens once per tile rows instead of once per row.
CHUNK_TILE = {"forward": (1, 4096), "backward": (8, 512)}
#: Narrower rows are padded to this many columns: 16 bf16 elements are one 32-byte sector.
MIN_TILE_COLS = 16
#: Elements per single-pass (TILE_M, TILE_N) tile: narrow rows are packed up to this.
TILE_ELEMENTS = {"forward": 8192, "backward": 4096}
#: Resident programs per SM that the kernels are compiled for (the occupancy hint).
OCCUPANCY = {"forward": 2, "backward": 2}
#: Tile of the fixed-order dgamma reduction over the partial buffer.
REDUCE_TILE = (64, 64)
#: Kernels index with 32-bit integers: element offsets up to 2^31 - 1, so at most 2^31
#: elements (larger tensors need 64-bit offsets, not yet planned).
MAX_INT32_OFFSET = 2**31 - 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class UnsupportedShape(ValueError):
    """The kernels cannot take this problem; the caller falls back to the reference."""


@dataclass(frozen=True)
class RowNormPlan:
    """How one normalization launch covers an (M, N) problem.

    Program ``p`` of ``grid`` handles row tiles ``p, p + grid, ...`` (see
    :meth:`program_row_tiles`); a row tile is ``tile_rows`` rows by ``col_tiles`` column tiles
    of ``tile_cols`` columns.
    """

    rows: int
    cols: int
    direction: Direction
    tile_rows: int
    tile_cols: int
    col_tiles: int
    row_tiles: int
    grid: int
    occupancy: int
    partial_shape: tuple[int, int]
    reduce_tile: tuple[int, int]
    reduce_grid: int

    @property
    def single_pass(self) -> bool:
        return self.col_tiles == 1

    def program_row_tiles(self, program: int) -> range:
        """Row tiles of ``program``, in the order it visits them."""
        return range(program, self.row_tiles, self.grid)

    def tile_row_range(self, row_tile: int) -> range:
        """Rows of ``row_tile`` that exist (the last tile may be partial)."""
        start = row_tile * self.tile_rows
        return range(start, min(start + self.tile_rows, self.rows))

    def describe(self) -> str:
        mode = "single pass" if self.single_pass else f"{self.col_tiles} column chunks, 2 passes"
        text = (f"tile {self.tile_rows}x{self.tile_cols} ({mode}), {self.row_tiles} row tiles, "
                f"persistent grid {self.grid} (occupancy {self.occupancy})")
        if self.direction == "backward":
            text += (f", partial buffer {self.partial_shape[0]}x{self.partial_shape[1]} fp32, "
                     f"dgamma reduce grid {self.reduce_grid} of {self.reduce_tile[0]}x"
                     f"{self.reduce_tile[1]} tiles")
        return text


@functools.lru_cache(maxsize=4096)
def plan_row_norm(rows: int, cols: int, *, itemsize: int, sm_count: int,
                  arch: tuple[int, int], direction: Direction) -> RowNormPlan:
    """Plan a persistent normalization over an (rows, cols) problem.

    ``itemsize`` is the input's element size in bytes and ``arch`` the compute capability.
    Raises :class:`UnsupportedShape` for problems the kernels cannot take.
    """
    if rows < 1 or cols < 1:
        raise UnsupportedShape(f"empty problem ({rows}x{cols}) needs no kernel")
    if sm_count < 1:
        raise ValueError(f"sm_count must be positive, got {sm_count}")
    if itemsize not in (2, 4):
        raise UnsupportedShape(f"{itemsize}-byte elements are not supported (2 or 4)")
    if direction not in OCCUPANCY:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    if rows * cols - 1 > MAX_INT32_OFFSET:
        raise UnsupportedShape(
            f"{rows}x{cols} has {rows * cols} elements, more than 32-bit offsets reach")

    if cols <= MAX_SINGLE_PASS_COLS[direction]:
        tile_cols = max(MIN_TILE_COLS, next_pow2(cols))
        tile_rows = max(1, TILE_ELEMENTS[direction] // tile_cols)
    else:
        tile_rows, tile_cols = CHUNK_TILE[direction]
    col_tiles = cdiv(cols, tile_cols)
    row_tiles = cdiv(rows, tile_rows)
    occupancy = OCCUPANCY[direction]
    grid = min(row_tiles, sm_count * occupancy)
    partial_shape = (grid, col_tiles * tile_cols)
    reduce_tile = REDUCE_TILE
    return RowNormPlan(
        rows=rows, cols=cols, direction=direction,
        tile_rows=tile_rows, tile_cols=tile_cols, col_tiles=col_tiles, row_tiles=row_tiles,
        grid=grid, occupancy=occupancy, partial_shape=partial_shape,
        reduce_tile=reduce_tile, reduce_grid=cdiv(partial_shape[1], reduce_tile[1]),
    )


def kernel_configs(direction: Direction) -> list[tuple[bool, int, int, int]]:
    """Every (single_pass, tile_rows, tile_cols, occupancy) that :func:`plan_row_norm` can
    choose for ``direction``: the set that ahead-of-time compilation must cover."""
    occupancy = OCCUPANCY[direction]
    configs = []
    tile_cols = MIN_TILE_COLS
    while tile_cols <= next_pow2(MAX_SINGLE_PASS_COLS[direction]):
        configs.append((True, max(1, TILE_ELEMENTS[direction] // tile_cols), tile_cols,
                        occupancy))
        tile_cols *= 2
    configs.append((False, *CHUNK_TILE[direction], occupancy))
    return configs
