"""Launch planning for the row-normalization kernels. Pure Python: no GPU, no torch.

Every launch decision (tile shape, single pass or column chunks, occupancy, persistent grid,
partial-buffer shape, 32- or 64-bit indexing, the dgamma reduction's tiling) comes from
:func:`plan_row_norm`, a function of the problem's shape, element size, SM count and
architecture, so CPU tests can check it and :func:`tilenorm.explain` can show it.

A problem is ``rows x heads`` normalized vectors of ``cols`` elements: x viewed as
(rows, heads, cols). Plain norms have ``heads == 1``; per-head (QK) norms keep the head axis so
that a strided (..., H, D) input needs no copy and a per-head weight (H, D) can be applied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

Direction = Literal["forward", "backward"]
Op = Literal["rms_norm", "layer_norm"]

# Per-direction settings, measured on an H200 (bench/NOTES.md has the experiments).
#: The widest row, in bytes of x, kept whole in one tile; wider rows are walked in chunks.
#: LayerNorm holds more per element (the centered row, dbias) and spills sooner.
MAX_SINGLE_PASS_BYTES = {
    "forward": {"rms_norm": 65536, "layer_norm": 32768},
    "backward": {"rms_norm": 32768, "layer_norm": 16384},
}
#: (rows, cols) of the tile for rows wider than the single-pass limit. The forward walks a
#: row in chunks of it, twice (the second pass reads the row back from L2). The backward is
#: column split: a program owns one column block of a strided set of rows, so every SM streams
#: however few rows there are; a first kernel adds up each block's share of the row sums, a
#: second writes dx and dgamma (bench/NOTES.md, #35: 1.8 -> 2.5 TB/s at 4096 x 32768).
CHUNK_TILE = {"forward": (1, 4096), "backward": (1, 4096)}
#: Narrower rows are padded to this many columns: 16 bf16 elements are one 32-byte sector.
MIN_TILE_COLS = 16
#: Elements per single-pass (rows, heads, cols) tile: narrow rows are packed up to this.
TILE_ELEMENTS = {"forward": 8192, "backward": 4096}
#: (widest tile_cols, occupancy, worker warps, persistent) for single-pass tiles, per
#: direction and op: the first entry whose width reaches the tile's applies. Occupancy is the
#: resident programs per SM the kernel is compiled for; worker warps its num_worker_warps hint
#: (None: the compiler's choice). Occupancy 1 with 8 warps gives each thread twice the
#: registers: the widest tiles stop spilling (bench/NOTES.md, #13). A forward that is not
#: persistent gives every row tile its own program: for narrow rows, four 16 KB tiles in
#: flight per SM beat a loop over tiles (#15). The backward is always persistent: its partial
#: buffer has a row per program; 8 warps lift its 4096-element tiles from 512 columns up
#: (LayerNorm's only at 4096), but slow the narrowest ones where the data sits in L2 (#17).
#: Split rows (below) look up their span, the sum of their two pieces: 5120 and 6144 have
#: entries of their own (#29).
_FORWARD_HINTS = ((2048, 4, None, False), (4096, 2, 8, True), (8192, 2, None, True),
                  (32768, 1, 8, True))
SINGLE_PASS_HINTS = {
    "forward": {"rms_norm": _FORWARD_HINTS[:2] + ((6144, 4, 4, True),) + _FORWARD_HINTS[2:],
                "layer_norm": _FORWARD_HINTS},
    "backward": {"rms_norm": ((256, 2, None, True), (4096, 2, 8, True), (5120, 2, None, True),
                              (6144, 2, 8, True), (16384, 1, 8, True)),
                 "layer_norm": ((2048, 2, None, True), (4096, 2, 8, True),
                                (6144, 2, None, True), (16384, 1, 8, True))},
}
#: Tiles of several heads look here first: a program per tile measured slower for them (#15).
MULTI_HEAD_HINTS = {"forward": ((2048, 1, 8, True),), "backward": ()}
#: (occupancy, worker warps) of the chunked forward and the column-split backward.
CHUNKED_HINTS = {"forward": (2, None), "backward": (2, None)}
#: Single-pass rows at most 3/4 of their power-of-two tile (5120 of 8192) are split into two
#: power-of-two pieces (4096 + 1024) instead of padded, from this padded width on, per
#: direction and op. An op absent is never split: the split LayerNorm forward lost to the
#: padded one at 3000, 5120 and 6144, and so did the RMSNorm forward at 3000 (#29).
MIN_SPLIT_TILE_COLS = {"forward": {"rms_norm": 8192},
                       "backward": {"rms_norm": 2048, "layer_norm": 2048}}
#: (numerator, denominator): a row is split when it fills at most this fraction of its padded
#: power-of-two tile. The second piece is the power of two covering the rest of the row.
SPLIT_MAX_FILL = (3, 4)
#: Tile of the fixed-order dgamma reduction over the partial buffer.
REDUCE_TILE = (64, 64)
#: From this compute capability on, the dgamma/dbeta reduction is launched as a programmatic
#: dependent of the backward kernel (it waits for it before reading the partial buffer), and so
#: are the row kernels whose rows are a whole number of 16-element groups, up to a width: with a
#: ragged row tileiras 13.4 builds a different pipeline around the grid-dependency
#: instructions, and the backward at N = 1000 never finished on an H200 (bench/NOTES.md, #25,
#: #27); wider rows gain nothing and the backward loses 5% at 16384, 27% at 131072 (#30).
DEPENDENT_LAUNCH_ARCH = (9, 0)
DEPENDENT_LAUNCH_COLS_MULTIPLE = 16
DEPENDENT_LAUNCH_MAX_COLS = 8192
#: Backwards the CuTe DSL kernel (tilenorm/cute/norm.py) runs instead of cuTile's, per op and
#: row width: (threads, stages, CTAs per SM). Each thread holds ``stages`` rows of its 16-byte
#: vectors, so the next rows' loads are in flight while a row is reduced, which a cuTile loop
#: cannot do; LayerNorm at 32768 x 4096 on an H200: 90.0% -> 98.2% of copy bandwidth for the
#: row kernel (bench/NOTES.md, #38). Widths absent here were not measured to gain.
CUTE_BACKWARD = {"layer_norm": {4096: (256, 2, 2)}}
#: Element sizes the CuTe backward takes: bf16 and fp16, eight to a 16-byte vector.
CUTE_BACKWARD_ITEMSIZES = (2,)
#: Largest element offset 32-bit indexing reaches; beyond it the kernels index with 64 bits.
MAX_INT32_OFFSET = 2**31 - 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class UnsupportedShape(ValueError):
    """The kernels cannot take this problem; the caller falls back to the reference."""


@dataclass(frozen=True)
class RowNormPlan:
    """How one normalization launch covers a (rows, heads, cols) problem.

    Row tile ``t`` is ``tile_rows x tile_heads`` vectors by ``col_tiles`` column tiles of
    ``tile_cols`` columns (a split single-pass tile adds a second piece of ``split_cols``
    columns after the first: 4096 + 1024 for rows of 5120), at row-tile index
    ``t // head_tiles`` and head-tile index ``t % head_tiles``. Program ``p`` of ``grid``
    handles row tiles ``p, p + grid, ...`` (see :meth:`program_row_tiles`). With a per-head
    weight the grid is a multiple of ``head_tiles``, so each program stays on one head tile
    and owns one slot of the ``(grid // head_tiles, heads, cols)`` partial buffer.

    A ``column_split`` backward (rows wider than one tile) has one vector per row tile; its
    program ``p`` takes column tile ``p % col_tiles`` of head ``p // col_tiles % heads`` in
    the rows ``g, g + row_groups, ...`` of its row group ``g = p // (col_tiles * heads)``.
    """

    rows: int
    heads: int
    cols: int
    direction: Direction
    per_head_weight: bool
    tile_rows: int
    tile_heads: int
    tile_cols: int
    split_cols: int
    col_tiles: int
    head_tiles: int
    row_tiles: int
    grid: int
    occupancy: int
    worker_warps: int | None
    index_bits: int
    dependent_launch: bool
    dependent_reduce: bool
    partial_shape: tuple[int, int, int]
    reduce_tile: tuple[int, int]
    reduce_grid: int

    @property
    def single_pass(self) -> bool:
        return self.col_tiles == 1

    @property
    def column_split(self) -> bool:
        """A backward over rows wider than one tile: each program owns one column tile."""
        return self.direction == "backward" and not self.single_pass

    @property
    def span_cols(self) -> int:
        """Columns a row tile's column tiles cover, padding included."""
        return self.col_tiles * self.tile_cols + self.split_cols

    @property
    def config(self) -> tuple:
        """What selects a compiled kernel variant (besides dtypes and feature flags)."""
        return (self.single_pass, self.tile_rows, self.tile_heads, self.tile_cols,
                self.split_cols, self.occupancy, self.worker_warps, self.index_bits)

    @property
    def row_groups(self) -> int:
        """Programs per column tile and head of a column-split backward."""
        return self.grid // (self.col_tiles * self.head_tiles)

    def _split_coordinates(self, program: int) -> tuple[int, int, int]:
        """(row group, head, column tile) of a column-split program."""
        rest, col_tile = divmod(program, self.col_tiles)
        group, head = divmod(rest, self.head_tiles)
        return group, head, col_tile

    def program_row_tiles(self, program: int) -> range:
        """Row tiles of ``program``, in the order it visits them (a column-split backward's
        second kernel visits them in reverse)."""
        if self.column_split:
            group, head, _ = self._split_coordinates(program)
            step = self.row_groups * self.head_tiles
            return range(group * self.head_tiles + head, self.row_tiles, step)
        return range(program, self.row_tiles, self.grid)

    def program_cols(self, program: int) -> range:
        """The columns ``program`` covers in each of its row tiles."""
        if self.column_split:
            start = self._split_coordinates(program)[2] * self.tile_cols
            return range(start, min(start + self.tile_cols, self.cols))
        return range(self.cols)

    def tile_vectors(self, row_tile: int) -> list[tuple[int, int]]:
        """(row, head) pairs of ``row_tile`` that exist (edge tiles may be partial)."""
        r0 = row_tile // self.head_tiles * self.tile_rows
        h0 = row_tile % self.head_tiles * self.tile_heads
        return [(r, h) for r in range(r0, min(r0 + self.tile_rows, self.rows))
                for h in range(h0, min(h0 + self.tile_heads, self.heads))]

    def partial_slot(self, program: int) -> int:
        """The partial-buffer row that ``program`` writes."""
        if self.column_split:
            group, head, _ = self._split_coordinates(program)
            return group if self.per_head_weight else group * self.head_tiles + head
        return program // self.head_tiles if self.per_head_weight else program

    def describe(self) -> str:
        mode = "single pass" if self.single_pass else f"{self.col_tiles} column chunks, 2 passes"
        if self.column_split:
            mode = (f"{self.col_tiles} column tiles x {self.row_groups} row groups, "
                    "row sums then columns")
        heads = f"x{self.tile_heads}" if self.heads > 1 else ""
        grid = (f"persistent grid {self.grid}" if self.grid < self.row_tiles
                else f"grid {self.grid}, a program per row tile")
        split = f"+{self.split_cols}" if self.split_cols else ""
        text = (f"tile {self.tile_rows}{heads}x{self.tile_cols}{split} ({mode}), "
                f"{self.row_tiles} row "
                f"tiles, {grid} (occupancy {self.occupancy})")
        if self.worker_warps:
            text += f", {self.worker_warps} worker warps"
        if self.index_bits == 64:
            text += ", 64-bit offsets"
        if self.dependent_launch:
            text += ", programmatic dependent launch"
        if self.direction == "backward":
            p = self.partial_shape
            shape = f"{p[0]}x{p[2]}" if p[1] == 1 else f"{p[0]}x{p[1]}x{p[2]}"
            text += (f", partial buffer {shape} fp32, dgamma reduce grid {self.reduce_grid} of "
                     f"{self.reduce_tile[0]}x{self.reduce_tile[1]} tiles")
        return text


def max_single_pass_cols(direction: Direction, op: Op, itemsize: int) -> int:
    return MAX_SINGLE_PASS_BYTES[direction][op] // itemsize


@functools.lru_cache(maxsize=4096)
def plan_row_norm(rows: int, cols: int, *, itemsize: int, sm_count: int,
                  arch: tuple[int, int], direction: Direction, heads: int = 1,
                  per_head_weight: bool = False, max_offset: int | None = None,
                  op: Op = "rms_norm") -> RowNormPlan:
    """Plan a normalization (``op``) of ``rows x heads`` vectors of ``cols`` elements: its
    tiles, grid (persistent, or a program per row tile for narrow forwards), occupancy and
    partial buffer.

    ``itemsize`` is the input's element size in bytes and ``arch`` the compute capability.
    ``max_offset`` is the largest element offset any operand reaches (default: that of a
    contiguous tensor); past 2^31 - 1 the kernels index with 64 bits. Raises
    :class:`UnsupportedShape` for problems the kernels cannot take.
    """
    if rows < 1 or cols < 1 or heads < 1:
        raise UnsupportedShape(f"empty problem ({rows}x{heads}x{cols}) needs no kernel")
    if sm_count < 1:
        raise ValueError(f"sm_count must be positive, got {sm_count}")
    if itemsize not in (2, 4):
        raise UnsupportedShape(f"{itemsize}-byte elements are not supported (2 or 4)")
    if direction not in CHUNKED_HINTS:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    if max_offset is None:
        max_offset = rows * heads * cols - 1

    if op not in MAX_SINGLE_PASS_BYTES[direction]:
        raise ValueError(f"op must be 'rms_norm' or 'layer_norm', got {op!r}")
    split_cols = 0
    if cols <= max_single_pass_cols(direction, op, itemsize):
        tile_cols = max(MIN_TILE_COLS, next_pow2(cols))
        vectors = max(1, TILE_ELEMENTS[direction] // tile_cols)
        tile_heads = min(next_pow2(heads), vectors)
        tile_rows = max(1, vectors // tile_heads)
        hint_cols = tile_cols
        min_split = MIN_SPLIT_TILE_COLS[direction].get(op)
        if (heads == 1 and min_split is not None and tile_cols >= min_split
                and cols * SPLIT_MAX_FILL[1] <= SPLIT_MAX_FILL[0] * tile_cols):
            tile_cols //= 2
            split_cols = max(MIN_TILE_COLS, next_pow2(cols - tile_cols))
            hint_cols = tile_cols + split_cols
    else:
        (tile_rows, tile_cols), tile_heads = CHUNK_TILE[direction], 1
    col_tiles = cdiv(cols, tile_cols) if not split_cols else 1
    persistent = True
    if col_tiles == 1:
        hints = SINGLE_PASS_HINTS[direction][op]
        if tile_heads > 1:
            hints = MULTI_HEAD_HINTS[direction] + hints
        occupancy, worker_warps, persistent = next(
            hint[1:] for hint in hints if hint_cols <= hint[0])
    else:
        occupancy, worker_warps = CHUNKED_HINTS[direction]
    head_tiles = cdiv(heads, tile_heads)
    row_tiles = cdiv(rows, tile_rows) * head_tiles
    if direction == "backward" and col_tiles > 1:  # column split (RowNormPlan.column_split)
        row_groups = max(1, min(cdiv(rows, tile_rows),
                                sm_count * occupancy // (col_tiles * head_tiles)))
        grid = row_groups * head_tiles * col_tiles
        partial_rows = row_groups if per_head_weight else row_groups * head_tiles
    else:
        grid = min(row_tiles, sm_count * occupancy) if persistent else row_tiles
        if per_head_weight:
            grid = max(head_tiles, grid // head_tiles * head_tiles)
        partial_rows = grid // head_tiles if per_head_weight else grid
    partial_shape = (partial_rows, heads if per_head_weight else 1, cols)
    reduce_cols = partial_shape[1] * cols
    dependent = tuple(arch) >= DEPENDENT_LAUNCH_ARCH
    return RowNormPlan(
        rows=rows, heads=heads, cols=cols, direction=direction,
        per_head_weight=per_head_weight, tile_rows=tile_rows, tile_heads=tile_heads,
        tile_cols=tile_cols, split_cols=split_cols, col_tiles=col_tiles,
        head_tiles=head_tiles, row_tiles=row_tiles,
        grid=grid, occupancy=occupancy, worker_warps=worker_warps,
        index_bits=64 if max_offset > MAX_INT32_OFFSET else 32,
        dependent_launch=(dependent and cols % DEPENDENT_LAUNCH_COLS_MULTIPLE == 0
                          and cols <= DEPENDENT_LAUNCH_MAX_COLS),
        dependent_reduce=dependent and direction == "backward",
        partial_shape=partial_shape, reduce_tile=REDUCE_TILE,
        reduce_grid=cdiv(reduce_cols, REDUCE_TILE[1]),
    )


@dataclass(frozen=True)
class CuteBackwardPlan:
    """The CuTe DSL backward's launch over ``rows`` rows of ``cols`` columns: ``grid``
    programs of ``threads`` threads, ``ctas_per_sm`` resident per SM; program ``p`` takes rows
    ``p, p + grid, ...`` with ``stages`` rows in registers, and writes partial-buffer row
    ``p`` (``partial_rows == grid``)."""

    rows: int
    cols: int
    threads: int
    stages: int
    ctas_per_sm: int
    grid: int

    @property
    def partial_rows(self) -> int:
        return self.grid

    def program_rows(self, program: int) -> range:
        return range(program, self.rows, self.grid)

    def describe(self) -> str:
        return (f"{self.threads} threads a row, {self.stages} rows in registers, persistent "
                f"grid {self.grid} ({self.ctas_per_sm} per SM), partial buffer "
                f"{self.grid}x{self.cols} fp32 per gradient")


def plan_cute_backward(rows: int, cols: int, *, itemsize: int, sm_count: int, op: Op,
                       heads: int = 1, max_offset: int | None = None
                       ) -> CuteBackwardPlan | None:
    """The CuTe DSL backward for ``rows x heads`` vectors of ``cols`` elements, or None where
    cuTile's runs: widths and element sizes not in :data:`CUTE_BACKWARD`, several heads, and
    offsets past 32 bits (the kernel indexes with 32; ``max_offset`` as for
    :func:`plan_row_norm`)."""
    entry = CUTE_BACKWARD.get(op, {}).get(cols)
    if max_offset is None:
        max_offset = rows * heads * cols - 1
    if (entry is None or heads != 1 or itemsize not in CUTE_BACKWARD_ITEMSIZES or rows < 1
            or max_offset > MAX_INT32_OFFSET):
        return None
    if sm_count < 1:
        raise ValueError(f"sm_count must be positive, got {sm_count}")
    threads, stages, ctas_per_sm = entry
    return CuteBackwardPlan(rows=rows, cols=cols, threads=threads, stages=stages,
                            ctas_per_sm=ctas_per_sm, grid=min(rows, sm_count * ctas_per_sm))
