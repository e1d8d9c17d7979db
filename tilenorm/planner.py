"""Launch planning for the row-normalization kernels. Pure Python: no GPU, no torch.

Every launch decision (tile shape, single pass or column chunks, occupancy, persistent grid,
partial-buffer shape, 32- or 64-bit indexing, the dgamma reduction's tiling) comes from
:func:`plan_row_norm`, a function of the problem's shape, element size, SM count,
architecture and device class and of their measured settings (:mod:`tilenorm.settings`), so
CPU tests can check it and :func:`tilenorm.explain` can show it.

A problem is ``rows x heads`` normalized vectors of ``cols`` elements: x viewed as
(rows, heads, cols). Plain norms have ``heads == 1``; per-head (QK) norms keep the head axis so
that a strided (..., H, D) input needs no copy and a per-head weight (H, D) can be applied.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tilenorm.settings import (
    CLUSTER_SLICE_COLS,
    DEFAULT_DEVICE_CLASS,
    TWO_PASS_L1_BYTES,
    DeviceClass,
    RowNormSettings,
    _cluster_forward,
    settings_for,
)
from tilenorm.settings_fp8 import fp8_settings_for, row_settings_for

Direction = Literal["forward", "backward"]
Op = Literal["rms_norm", "layer_norm"]

#: Largest element offset 32-bit indexing reaches; beyond it the kernels index with 64 bits.
MAX_INT32_OFFSET = 2**31 - 1
#: CUDA's limit on a grid's second dimension.
MAX_GRID_Y = 65535


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


def max_single_pass_cols(direction: Direction, op: Op, itemsize: int,
                         settings: RowNormSettings | None = None) -> int:
    settings = settings or settings_for((9, 0))
    return settings.max_single_pass_bytes[direction][op] // itemsize


def plan_row_norm(rows: int, cols: int, *, itemsize: int, sm_count: int,
                  arch: tuple[int, int], direction: Direction, heads: int = 1,
                  per_head_weight: bool = False, max_offset: int | None = None,
                  op: Op = "rms_norm", settings: RowNormSettings | None = None,
                  device_class: DeviceClass = DEFAULT_DEVICE_CLASS) -> RowNormPlan:
    """Plan a normalization (``op``) of ``rows x heads`` vectors of ``cols`` elements: its
    tiles, grid (persistent, or a program per row tile for narrow forwards), occupancy and
    partial buffer.

    ``itemsize`` is the input's element size in bytes and ``arch`` the compute capability.
    ``max_offset`` is the largest element offset any operand reaches (default: that of a
    contiguous tensor); past 2^31 - 1 the kernels index with 64 bits. ``settings`` default
    to the architecture's and ``device_class``'s (:func:`tilenorm.settings.settings_for`).
    Raises :class:`UnsupportedShape` for problems the kernels cannot take.
    """
    # The settings are resolved before the cache, so that a plan made inside
    # settings.measuring() is keyed by the settings under measurement.
    return _plan_row_norm(rows, cols, itemsize, sm_count, tuple(arch), direction, heads,
                          per_head_weight, max_offset, op,
                          settings or settings_for(arch, device_class))


@functools.lru_cache(maxsize=4096)
def _plan_row_norm(rows: int, cols: int, itemsize: int, sm_count: int, arch: tuple[int, int],
                   direction: Direction, heads: int, per_head_weight: bool,
                   max_offset: int | None, op: Op, s: RowNormSettings) -> RowNormPlan:
    if rows < 1 or cols < 1 or heads < 1:
        raise UnsupportedShape(f"empty problem ({rows}x{heads}x{cols}) needs no kernel")
    if sm_count < 1:
        raise ValueError(f"sm_count must be positive, got {sm_count}")
    if itemsize not in (2, 4):
        raise UnsupportedShape(f"{itemsize}-byte elements are not supported (2 or 4)")
    if direction not in s.chunked_hints:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    if max_offset is None:
        max_offset = rows * heads * cols - 1

    if op not in s.max_single_pass_bytes[direction]:
        raise ValueError(f"op must be 'rms_norm' or 'layer_norm', got {op!r}")
    split_cols = 0
    if cols <= max_single_pass_cols(direction, op, itemsize, s):
        tile_cols = max(s.min_tile_cols, next_pow2(cols))
        vectors = max(1, s.tile_elements[direction] // tile_cols)
        tile_heads = min(next_pow2(heads), vectors)
        tile_rows = max(1, vectors // tile_heads)
        hint_cols = tile_cols
        min_split = s.min_split_tile_cols[direction].get(op)
        if (heads == 1 and min_split is not None and tile_cols >= min_split
                and cols * s.split_max_fill[1] <= s.split_max_fill[0] * tile_cols):
            tile_cols //= 2
            split_cols = max(s.min_tile_cols, next_pow2(cols - tile_cols))
            hint_cols = tile_cols + split_cols
    else:
        (tile_rows, tile_cols), tile_heads = s.chunk_tile[direction], 1
    col_tiles = cdiv(cols, tile_cols) if not split_cols else 1
    persistent = True
    if col_tiles == 1:
        hints = tuple(hint for min_rows, hint in s.many_rows_hints[direction].get(op, ())
                      if rows * heads >= min_rows) + s.single_pass_hints[direction][op]
        if tile_heads > 1:
            hints = s.multi_head_hints[direction] + hints
        occupancy, worker_warps, persistent = next(
            hint[1:] for hint in hints if hint_cols <= hint[0])
    else:
        occupancy, worker_warps = s.chunked_hints[direction]
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
    dependent = tuple(arch) >= s.dependent_launch_arch
    return RowNormPlan(
        rows=rows, heads=heads, cols=cols, direction=direction,
        per_head_weight=per_head_weight, tile_rows=tile_rows, tile_heads=tile_heads,
        tile_cols=tile_cols, split_cols=split_cols, col_tiles=col_tiles,
        head_tiles=head_tiles, row_tiles=row_tiles,
        grid=grid, occupancy=occupancy, worker_warps=worker_warps,
        index_bits=64 if max_offset > MAX_INT32_OFFSET else 32,
        dependent_launch=(dependent and cols % s.dependent_launch_cols_multiple == 0
                          and cols <= s.dependent_launch_max_cols),
        dependent_reduce=dependent and direction == "backward",
        partial_shape=partial_shape, reduce_tile=s.reduce_tile,
        reduce_grid=cdiv(reduce_cols, s.reduce_tile[1]),
    )


@dataclass(frozen=True)
class CuteRowPlan:
    """A CuTe DSL row kernel's launch over ``rows`` rows of ``cols`` columns: ``grid``
    programs of ``threads`` threads, ``ctas_per_sm`` resident per SM; program ``p`` takes rows
    ``p, p + grid, ...`` with ``stages`` rows in registers."""

    rows: int
    cols: int
    threads: int
    stages: int
    ctas_per_sm: int
    grid: int

    @classmethod
    def of(cls, rows: int, cols: int, entry: tuple[int, int, int], sm_count: int):
        """The plan of a settings table's (threads, stages, CTAs per SM) ``entry``."""
        if sm_count < 1:
            raise ValueError(f"sm_count must be positive, got {sm_count}")
        threads, stages, ctas_per_sm = entry
        if stages < 2 or stages % 2:
            # The kernels reduce consecutive rows in two shared-memory slots by the row's
            # place in the ring: with an odd ring the last row and the next ring's first
            # share a slot, one write racing the other's reads.
            raise ValueError(f"a CuTe row kernel's stages must be even and >= 2, got {stages}")
        return cls(rows=rows, cols=cols, threads=threads, stages=stages,
                   ctas_per_sm=ctas_per_sm, grid=min(rows, sm_count * ctas_per_sm))

    def program_rows(self, program: int) -> range:
        return range(program, self.rows, self.grid)

    def _launch(self) -> str:
        return (f"{self.threads} threads a row, {self.stages} rows in registers, persistent "
                f"grid {self.grid} ({self.ctas_per_sm} per SM)")


@dataclass(frozen=True)
class CuteBackwardPlan(CuteRowPlan):
    """The CuTe DSL backward's launch; program ``p`` writes partial-buffer row ``p``
    (``partial_rows == grid``). ``shared_ring``: the kernel's ring in shared memory."""

    shared_ring: bool = False

    @property
    def partial_rows(self) -> int:
        return self.grid

    def describe(self) -> str:
        return (f"{self._launch()}, partial buffer {self.grid}x{self.cols} fp32 per "
                f"gradient" + (", the ring in shared memory" if self.shared_ring else ""))


def plan_cute_backward(rows: int, cols: int, *, itemsize: int, sm_count: int,
                       arch: tuple[int, int], op: Op, heads: int = 1,
                       max_offset: int | None = None, settings: RowNormSettings | None = None,
                       device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                       ) -> CuteBackwardPlan | None:
    """The CuTe DSL backward for ``rows x heads`` vectors of ``cols`` elements, or None where
    cuTile's runs: widths not in the settings' ``cute_backward`` table (2-byte x only),
    several heads, and offsets past 32 bits (the kernel indexes with 32; ``max_offset`` as
    for :func:`plan_row_norm`; ``settings`` as there)."""
    s = settings or settings_for(arch, device_class)
    entry = _cute_entry(s.cute_table("backward", itemsize), op, rows, cols, heads, max_offset)
    if entry is None:
        return None
    plan = CuteBackwardPlan.of(rows, cols, entry, sm_count)
    if cols not in s.cute_backward_shared_ring.get(op, ()):
        return plan
    # The ring: x and dy's stages rows, each thread's rstd and mean a row.
    per_cta = (16 * (plan.threads // 32) + plan.stages * (2 * cols * itemsize + 8 * plan.threads)
               + RESERVED_SHARED_BYTES)
    if plan.ctas_per_sm * per_cta > SM_SHARED_BYTES.get(arch[0], SM_SHARED_BYTES[9]):
        raise ValueError(f"cute_backward_shared_ring at {op} {cols}: {plan.ctas_per_sm} CTAs "
                         f"of {per_cta} bytes of shared memory do not fit an SM")
    return dataclasses.replace(plan, shared_ring=True)


@dataclass(frozen=True)
class CuteClusterBackwardPlan:
    """The CuTe DSL cluster backward's launch over ``rows`` rows of ``cols`` columns:
    ``clusters`` clusters of ``cluster`` CTAs of ``threads`` threads (``ctas_per_sm``
    resident per SM), cluster ``k`` taking rows ``k, k + clusters, ...`` with ``stages`` rows
    staged in shared memory; cluster ``k`` writes partial-buffer row ``k``."""

    rows: int
    cols: int
    cluster: int
    threads: int
    stages: int
    ctas_per_sm: int
    clusters: int
    #: The kernel's ``stage_stats``: each row's rstd (and mean) staged with the row.
    stage_stats: bool = False

    @classmethod
    def of(cls, rows: int, cols: int, entry: tuple[int, int, int, int],
           resident_clusters: int) -> CuteClusterBackwardPlan:
        """The plan of a settings table's (cluster, threads, stages, CTAs per SM) ``entry``
        with ``resident_clusters`` co-resident on the device: a persistent grid of more would
        run its last clusters after the others, and one of more than ``rows`` would idle."""
        if rows < 1 or resident_clusters < 1:
            raise ValueError(f"rows and resident clusters must be positive, got {rows}, "
                             f"{resident_clusters}")
        cluster, threads, stages, ctas_per_sm = entry
        return cls(rows=rows, cols=cols, cluster=cluster, threads=threads, stages=stages,
                   ctas_per_sm=ctas_per_sm, clusters=min(rows, resident_clusters))

    @property
    def grid(self) -> int:
        """CTAs launched: whole clusters."""
        return self.clusters * self.cluster

    @property
    def partial_rows(self) -> int:
        return self.clusters

    def cluster_rows(self, cluster: int) -> range:
        return range(cluster, self.rows, self.clusters)

    def describe(self) -> str:
        return (f"a row a cluster of {self.cluster} CTAs ({self.cols // self.cluster} columns "
                f"a CTA, {self.threads} threads), {self.stages} rows staged in shared memory, "
                f"persistent grid {self.clusters} clusters ({self.ctas_per_sm} CTAs per SM), "
                f"partial buffer {self.clusters}x{self.cols} fp32"
                + (", rstd staged with the row" if self.stage_stats else ""))


def plan_cute_cluster_backward(rows: int, cols: int, *, itemsize: int, arch: tuple[int, int],
                               op: Op, resident_clusters: Callable[[int, int, int], int],
                               heads: int = 1, max_offset: int | None = None,
                               settings: RowNormSettings | None = None,
                               device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                               ) -> CuteClusterBackwardPlan | None:
    """The CuTe DSL cluster backward for ``rows x heads`` vectors of ``cols`` elements, or
    None where another backward runs (as :func:`plan_cute_backward`, from the settings'
    ``cute_cluster_backward`` table, ``cute_cluster_backward_fp32`` for 4-byte x).
    ``resident_clusters(cluster, threads, ctas_per_sm)``: how many clusters of the entry's
    shape are co-resident on the device (:func:`tilenorm.device.max_active_clusters`), asked
    only where an entry applies; none (a device whose GPCs cannot hold the cluster) leaves
    the row to another backward."""
    s = settings or settings_for(arch, device_class)
    entry = _cute_entry(s.cute_table("cluster_backward", itemsize), op, rows, cols, heads,
                        max_offset)
    if entry is None:
        return None
    cluster, threads, _, ctas_per_sm = entry
    resident = resident_clusters(cluster, threads, ctas_per_sm)
    if resident < 1:  # a device that holds no such cluster at once: another backward runs
        return None
    plan = CuteClusterBackwardPlan.of(rows, cols, entry, resident)
    if s.cluster_backward_stage_stats(op, cols, itemsize):
        plan = dataclasses.replace(plan, stage_stats=True)
    return plan


def _cute_entry(table: dict, op: Op, rows: int, cols: int, heads: int,
                max_offset: int | None) -> tuple[int, ...] | None:
    """A CuTe DSL kernel's ``table`` entry (the settings' table for x's element size) for the
    shape, or None where cuTile's runs: widths the table does not list, several heads, no
    rows, offsets past 32 bits (the kernels index with 32)."""
    entry = table.get(op, {}).get(cols)
    if max_offset is None:
        max_offset = rows * heads * cols - 1
    if entry is None or heads != 1 or rows < 1 or max_offset > MAX_INT32_OFFSET:
        return None
    return entry


@dataclass(frozen=True)
class CuteForwardPlan:
    """The CuTe DSL forward's launch over ``rows`` rows of ``cols`` columns: a one-shot grid,
    CTA ``b`` of ``grid`` taking rows ``[b * rows_per_cta, (b + 1) * rows_per_cta)`` with
    ``threads`` threads; ``ctas_per_sm`` is the residency the compile keeps registers for.
    With ``cluster`` > 1 (the cluster forward) each row is held across ``cluster`` CTAs:
    CTA ``b`` takes one slice of each of rows ``[b // cluster * rows_per_cta, ...)``."""

    rows: int
    cols: int
    threads: int
    rows_per_cta: int
    ctas_per_sm: int
    grid: int
    cluster: int = 1
    #: The persistent cluster forward's ring of row groups in shared memory (0: the one-shot
    #: grid): ``grid / cluster`` co-resident clusters, cluster ``c`` taking row groups ``c,
    #: c + grid / cluster, ...`` of ``rows_per_cta`` rows.
    stages: int = 0
    #: The two-pass forward's 16-byte vectors a thread a step (0: another forward): one row a
    #: CTA, ``grid`` = ``rows``.
    step: int = 0

    @property
    def persistent(self) -> bool:
        return self.stages > 0

    @classmethod
    def two_pass(cls, rows: int, cols: int, entry: tuple[int, int, int]) -> CuteForwardPlan:
        """The plan of a ``cute_forward_two_pass`` entry (threads, vectors a thread a step,
        CTAs per SM)."""
        threads, step, ctas_per_sm = entry
        if rows < 1 or step < 1:
            raise ValueError(f"rows and the step must be positive, got {rows}, {step}")
        return cls(rows=rows, cols=cols, threads=threads, rows_per_cta=1,
                   ctas_per_sm=ctas_per_sm, grid=rows, step=step)

    @classmethod
    def of(cls, rows: int, cols: int, entry: tuple[int, ...],
           resident_clusters: int | None = None) -> CuteForwardPlan:
        """The plan of a settings table's (threads, rows a CTA, CTAs per SM[, cluster[,
        stages]]) ``entry``; a persistent one (``stages``, its ring of row groups) needs the
        clusters of its shape the device holds at once
        (:func:`tilenorm.device.max_active_clusters`): a persistent grid of more would run
        its last clusters after the others."""
        threads, rows_per_cta, ctas_per_sm, *rest = entry
        cluster = rest[0] if rest else 1
        if rows < 1 or rows_per_cta < 1:
            raise ValueError(f"rows and rows_per_cta must be positive, got {rows}, "
                             f"{rows_per_cta}")
        if not is_persistent(entry):
            return cls(rows=rows, cols=cols, threads=threads, rows_per_cta=rows_per_cta,
                       ctas_per_sm=ctas_per_sm, grid=cdiv(rows, rows_per_cta) * cluster,
                       cluster=cluster)
        stages = entry[4]
        if cluster < 2 or isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"a persistent forward holds a row across a cluster of 2 or more "
                             f"CTAs, a ring of 1 or more row groups: got {entry}")
        if resident_clusters is None or resident_clusters < 1:
            raise ValueError("a persistent forward's grid needs the clusters co-resident on "
                             f"the device, got {resident_clusters}")
        clusters = min(cdiv(rows, rows_per_cta), resident_clusters)
        return cls(rows=rows, cols=cols, threads=threads, rows_per_cta=rows_per_cta,
                   ctas_per_sm=ctas_per_sm, grid=clusters * cluster, cluster=cluster,
                   stages=stages)

    def program_rows(self, program: int) -> list[int] | range:
        if self.persistent:
            clusters, r = self.grid // self.cluster, self.rows_per_cta
            return [row for group in range(program // self.cluster, cdiv(self.rows, r),
                                           clusters)
                    for row in range(group * r, min(group * r + r, self.rows))]
        start = program // self.cluster * self.rows_per_cta
        return range(start, min(start + self.rows_per_cta, self.rows))

    @property
    def entry(self) -> tuple[int, ...]:
        """The settings entry of this plan: (threads, rows a CTA, CTAs per SM, cluster[,
        stages where persistent]); a two-pass plan's ``cute_forward_two_pass`` entry,
        (threads, vectors a thread a step, CTAs per SM)."""
        if self.step:
            return (self.threads, self.step, self.ctas_per_sm)
        entry = (self.threads, self.rows_per_cta, self.ctas_per_sm, self.cluster)
        return (*entry, self.stages) if self.persistent else entry

    def with_residual(self) -> CuteForwardPlan:
        """The plan a call with a fused residual runs (:func:`residual_entry`): the two-pass
        forward's own where the SM's rows of x and the residual fit L1
        (:data:`~tilenorm.settings.TWO_PASS_L1_BYTES`), else one row a cluster."""
        if self.step:
            if 2 * 2 * self.cols * self.ctas_per_sm <= TWO_PASS_L1_BYTES:
                return self
            if self.cols < 2 * CLUSTER_SLICE_COLS:
                raise ValueError(f"a two-pass entry at {self.cols} columns keeps more than "
                                 f"TWO_PASS_L1_BYTES of rows an SM with a residual")
            return CuteForwardPlan.of(self.rows, self.cols, _cluster_forward(self.cols))
        entry = residual_entry(self.cols, self.entry)
        return self if entry == self.entry else CuteForwardPlan.of(self.rows, self.cols, entry)

    def describe(self) -> str:
        if self.step:
            return (f"CuTe DSL two-pass forward, grid {self.grid}: a row a CTA of "
                    f"{self.threads} threads ({self.ctas_per_sm} per SM), walked twice "
                    f"{self.step} vector{'s' if self.step > 1 else ''} a thread a step, the "
                    f"second pass from L1")
        if self.persistent:
            rows = "a row" if self.rows_per_cta == 1 else f"{self.rows_per_cta} rows"
            return (f"CuTe DSL persistent cluster forward, grid {self.grid}: "
                    f"{self.grid // self.cluster} clusters of {self.cluster} CTAs of "
                    f"{self.threads} threads ({self.ctas_per_sm} per SM), {rows} at a time, "
                    f"a ring of {self.stages} in flight, the parameters staged once")
        if self.cluster > 1:
            rows = "a row" if self.rows_per_cta == 1 else f"{self.rows_per_cta} rows"
            return (f"CuTe DSL cluster forward, one-shot grid {self.grid}: {rows} across a "
                    f"cluster of {self.cluster} CTAs of {self.threads} threads "
                    f"({self.ctas_per_sm} per SM), their slices staged in shared memory")
        return (f"CuTe DSL, one-shot grid {self.grid} of {self.rows_per_cta} rows a CTA, "
                f"{self.threads} threads a row ({self.ctas_per_sm} per SM)")


def is_persistent(entry: tuple[int, ...]) -> bool:
    """Whether a ``cute_forward`` entry is the persistent cluster forward's: a fifth element,
    its ring of row groups."""
    return len(entry) > 4


def residual_entry(cols: int, entry: tuple[int, ...]) -> tuple[int, ...]:
    """The ``cute_forward`` entry a call with a fused residual runs for the table's ``entry``
    at ``cols`` columns: one row a cluster of ``CLUSTER_SLICE_COLS``-column slices (the
    settings' ``_cluster_forward``) where ``entry`` holds several rows a cluster of a row that
    spans two such slices or more, else ``entry``. A residual doubles what a CTA stages: two
    rows a cluster of 8 at 65536 columns then keep a spill slot and run at 94% of copy where
    one row a cluster of 4 runs at 101% (H100, #95). A persistent entry (a fifth element)
    runs the one-shot kernel with a residual too: the persistent one takes none."""
    if is_persistent(entry):  # the persistent kernel takes no residual
        return _cluster_forward(cols)
    several_rows = len(entry) == 4 and entry[1] > 1 and entry[3] > 1
    if not several_rows or cols < 2 * CLUSTER_SLICE_COLS:
        return entry
    return _cluster_forward(cols)


def plan_cute_forward(rows: int, cols: int, *, itemsize: int, arch: tuple[int, int], op: Op,
                      heads: int = 1, max_offset: int | None = None,
                      settings: RowNormSettings | None = None,
                      device_class: DeviceClass = DEFAULT_DEVICE_CLASS,
                      resident_clusters: Callable[[int, int, int], int] | None = None
                      ) -> CuteForwardPlan | None:
    """The CuTe DSL forward for ``rows x heads`` vectors of ``cols`` elements, or None where
    cuTile's runs: widths not in the settings' ``cute_forward`` table (``cute_forward_fp32``
    for 4-byte x; other element sizes have none), several heads, and offsets past 32 bits
    (the kernel indexes with 32; ``max_offset`` as for :func:`plan_row_norm`; ``settings``
    as there). ``resident_clusters(cluster, threads,
    ctas_per_sm)`` (as for :func:`plan_cute_cluster_backward`) sizes a persistent entry's
    grid, asked only for one; a device whose GPCs cannot hold the cluster leaves the row to
    another forward."""
    s = settings or settings_for(arch, device_class)
    if itemsize == 2:
        two_pass = _cute_entry(s.cute_forward_two_pass, op, rows, cols, heads, max_offset)
        if two_pass is not None:
            return CuteForwardPlan.two_pass(rows, cols, two_pass)
    entry = _cute_entry(s.cute_table("forward", itemsize), op, rows, cols, heads, max_offset)
    if entry is None:
        return None
    resident = None
    if is_persistent(entry):
        threads, _, ctas_per_sm, cluster, _ = entry
        if resident_clusters is None:
            raise ValueError("a persistent forward entry needs resident_clusters")
        resident = resident_clusters(cluster, threads, ctas_per_sm)
        if resident < 1:
            return None
    return CuteForwardPlan.of(rows, cols, entry, resident)


# --- FP8 output (tilenorm.kernels.cutile_row_norm_fp8) -------------------------------------


@dataclass(frozen=True)
class CuteFp8ForwardPlan(CuteRowPlan):
    """The CuTe DSL FP8-output row kernel's launch; program ``p`` writes amax partial ``p``
    (per-tensor scalings). ``recompute_t``: the kernel's variant that reads the weight again
    and recomputes t = x * w at each use instead of holding both across the row."""

    recompute_t: bool = False
    #: The kernel's ``column_amax``: per-program column amaxes for a per-row scaling's copy.
    column_amax: bool = False
    #: The kernel's ``clamp``: each value clamped to +-fp8_max before the conversion.
    clamp: bool = False
    #: The kernel's ``shared_ring`` (FP8 x): x's ring of ``stages`` rows in shared memory.
    shared_ring: bool = False

    def describe(self) -> str:
        return (f"CuTe DSL, {self._launch()}"
                + (", t = x * w recomputed at each use" if self.recompute_t else "")
                + (", column amaxes kept" if self.column_amax else "")
                + (", clamped before the conversion" if self.clamp else "")
                + (", x's ring in shared memory" if self.shared_ring else ""))


#: FP8 x's elements in a 16-byte vector of the CuTe DSL FP8 row kernel: a group of its
#: multipliers must hold whole vectors (one multiplier a vector).
FP8_VECTOR = 16
#: Shared memory an SM holds for its CTAs, by compute capability major (the driver's
#: MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 228 KB on sm_90 and sm_100, 100 KB on sm_120), and
#: what it keeps of it a CTA (RESERVED_SHARED_MEMORY_PER_BLOCK).
SM_SHARED_BYTES = {9: 228 << 10, 10: 228 << 10, 12: 100 << 10}
RESERVED_SHARED_BYTES = 1 << 10


def _fp8_row_kernel_resident(plan: CuteFp8ForwardPlan, row_of_floats: bool,
                             arch: tuple[int, int], itemsize: int = 1) -> bool:
    """Whether ``plan``'s CTAs an SM fit an SM's shared memory, each with the warps' partials
    (16 bytes a warp) and, with ``row_of_floats``, a row of fp32 values (FP8 x's weight, a
    per-row scaling's column maxima): a CTA that cannot be resident leaves its programs of
    the persistent grid to a second wave (23-48% of copy, bench/NOTES.md #128). With
    ``shared_ring``, also the ring's ``stages`` rows of x (``itemsize`` bytes an element)
    and, for FP8 x, of a thread's fp32 multiplier for each of its vectors."""
    multipliers = 4 * (plan.cols // FP8_VECTOR) if itemsize == 1 else 0
    ring = plan.stages * (plan.cols * itemsize + multipliers)
    per_cta = (16 * (plan.threads // 32) + (4 * plan.cols if row_of_floats else 0)
               + (ring if plan.shared_ring else 0))
    shared = SM_SHARED_BYTES.get(arch[0], SM_SHARED_BYTES[9])
    return plan.ctas_per_sm * (per_cta + RESERVED_SHARED_BYTES) <= shared


def plan_cute_fp8_forward(rows: int, cols: int, *, itemsize: int, sm_count: int,
                          arch: tuple[int, int], scaling: str, max_offset: int | None = None,
                          group: int = 0, column_amax: bool = False,
                          device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                          ) -> CuteFp8ForwardPlan | None:
    """The CuTe DSL FP8-output row kernel for ``rows`` rows of ``cols`` 2-byte elements, or
    of FP8 x (``itemsize`` 1) with one multiplier per ``group`` elements, with the row
    kernel's ``scaling`` (a name of the kernel's ``SCALINGS``), or None where cuTile's runs:
    widths not in the FP8 settings' ``cute_forward`` table (for FP8 x
    ``cute_forward_fp8_input``, at its ``fp8_input_entry``, with x's ring in shared memory
    where ``fp8_input_shared_ring`` says), other element sizes, FP8 groups
    smaller than a 16-byte vector, offsets past 32 bits (the kernel indexes with 32), and
    entries whose CTAs an SM its shared memory cannot hold (``SM_SHARED_BYTES``; FP8 x's
    weight counted whether or not there is one).
    For 2-byte x the settings' ``cute_forward_recompute_t`` entry of the scaling and width,
    where there is one, takes the place of the scaling's ``forward_entry``, with
    ``recompute_t``, and the kernel clamps where the settings' ``cute_forward_clamp`` says.
    ``column_amax`` (a per-row scaling's transposed copy): only 2-byte x (the CuTe copy that
    takes them reads 2-byte x) at the widths of the settings' ``cute_forward_column_amax``,
    at the plan of row scaling without it, ``recompute_t`` included (the same launch config,
    so the row's sums of squares fold in the same order and q has the same bits:
    bench/NOTES.md #125), without ``clamp`` (untimed there; its q is the same bits either
    way). The FP8 settings are ``arch``'s and ``device_class``'s."""
    settings = fp8_settings_for(arch, device_class)
    if column_amax:
        if itemsize != 2 or scaling != "row" or cols not in settings.cute_forward_column_amax:
            return None
        plan = plan_cute_fp8_forward(rows, cols, itemsize=itemsize, sm_count=sm_count,
                                     arch=arch, scaling=scaling, max_offset=max_offset,
                                     device_class=device_class)
        if plan is None or not _fp8_row_kernel_resident(plan, True, arch, itemsize):
            return None
        return dataclasses.replace(plan, column_amax=True, clamp=False)
    if max_offset is None:
        max_offset = rows * cols - 1
    if rows < 1 or max_offset > MAX_INT32_OFFSET:
        return None
    if itemsize == 1:
        entry = settings.fp8_input_entry(scaling, cols)
        if entry is None or group < FP8_VECTOR or group % FP8_VECTOR:
            return None
        plan = dataclasses.replace(CuteFp8ForwardPlan.of(rows, cols, entry, sm_count),
                                   shared_ring=settings.fp8_input_shared_ring(scaling, cols))
        # The weight in shared memory but for MX (cute_row_norm_fp8.py): with one or not.
        return plan if _fp8_row_kernel_resident(plan, scaling != "mx", arch) else None
    recompute_t = settings.cute_forward_recompute_t.get(scaling, {}).get(cols)
    entry = recompute_t or settings.forward_entry(scaling, cols)
    if entry is None or itemsize != 2:
        return None
    plan = dataclasses.replace(CuteFp8ForwardPlan.of(rows, cols, entry, sm_count),
                               recompute_t=recompute_t is not None,
                               clamp=settings.forward_clamp(scaling, cols),
                               shared_ring=settings.forward_shared_ring(scaling, cols))
    return plan if _fp8_row_kernel_resident(plan, False, arch, itemsize) else None


@dataclass(frozen=True)
class CuteFp8TransposePlan:
    """The CuTe DSL transposed FP8 copy over (rows, cols): one CTA a tile of 128 rows by
    ``tile_cols`` columns, ``grid`` (column tiles, row tiles), ``ctas_per_sm`` resident CTAs
    an SM it is compiled for."""

    rows: int
    cols: int
    tile_cols: int
    ctas_per_sm: int
    #: y as the CuTe row kernel computes it, whose column amaxes a per-row scaling takes.
    weight_first: bool = False

    @property
    def grid(self) -> tuple[int, int]:
        return self.cols // self.tile_cols, cdiv(self.rows, CUTE_FP8_TRANSPOSE_ROWS)

    def describe(self) -> str:
        return (f"CuTe DSL, {CUTE_FP8_TRANSPOSE_ROWS}x{self.tile_cols} tiles, grid "
                f"{self.grid[0]}x{self.grid[1]}, {self.ctas_per_sm} CTAs an SM")


#: Rows of a tile of the CuTe transposed copy (cute_fp8_transpose.py's ``TILE_ROWS``), and the
#: multiple of 16 its row count must be (its ``ROW_MULTIPLE``: whole 16-byte runs of q_t).
CUTE_FP8_TRANSPOSE_ROWS = 128
CUTE_FP8_TRANSPOSE_ROW_MULTIPLE = 16


def plan_cute_fp8_transpose(rows: int, cols: int, *, itemsize: int, arch: tuple[int, int],
                            max_offset: int | None = None,
                            device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                            ) -> CuteFp8TransposePlan | None:
    """The CuTe DSL transposed copy for ``rows`` rows of ``cols`` ``itemsize``-byte
    elements, or None where cuTile's ``fp8_quantize_transposed`` runs: other element sizes
    than 2, row counts not a multiple of 16, widths no tile of the FP8 settings'
    ``cute_transpose`` divides, more row tiles than the grid's second dimension holds, and
    offsets past 32 bits (the kernel indexes with 32)."""
    if max_offset is None:
        max_offset = rows * cols - 1
    if (itemsize != 2 or rows < 1 or rows % CUTE_FP8_TRANSPOSE_ROW_MULTIPLE
            or cdiv(rows, CUTE_FP8_TRANSPOSE_ROWS) > MAX_GRID_Y
            or max_offset > MAX_INT32_OFFSET):
        return None
    for tile_cols, ctas_per_sm in fp8_settings_for(arch, device_class).cute_transpose:
        if cols % tile_cols == 0:
            return CuteFp8TransposePlan(rows, cols, int(tile_cols), int(ctas_per_sm))
    return None


def max_fp8_cols(direction: Direction, op: Op, itemsize: int, arch: tuple[int, int],
                 device_class: DeviceClass = DEFAULT_DEVICE_CLASS) -> int:
    """The widest row the FP8 kernels take: one single-pass tile (for FP8 x, a bf16 tile's
    width: the kernels hold the row in fp32 alike)."""
    return max_single_pass_cols(direction, op, max(itemsize, 2),
                                row_settings_for(arch, device_class))


def plan_fp8_row(rows: int, cols: int, *, itemsize: int, sm_count: int,
                 arch: tuple[int, int], direction: Direction, op: Op = "rms_norm",
                 max_offset: int | None = None, persistent: bool = False,
                 device_class: DeviceClass = DEFAULT_DEVICE_CLASS) -> RowNormPlan:
    """A single-pass plan of the FP8 row kernels (no split tiles): the bf16 norm's tile for
    ``itemsize``-byte x (FP8 x planned as 2-byte), with a persistent grid where
    ``persistent`` (kernels whose per-program amaxes a second kernel reads whole). Raises
    :class:`UnsupportedShape`, naming the limit, for rows wider than one tile."""
    settings = row_settings_for(arch, device_class)
    widest = max_fp8_cols(direction, op, itemsize, arch, device_class)
    if cols > widest:
        kind = "FP8 output" if direction == "forward" else "FP8 input's backward"
        raise UnsupportedShape(f"{kind}: rows of {cols} elements are wider than one tile; "
                               f"the {op} FP8 kernels take up to {widest}")
    plan = plan_row_norm(rows, cols, itemsize=max(itemsize, 2), sm_count=sm_count, arch=arch,
                         direction=direction, op=op, max_offset=max_offset, settings=settings)
    if persistent and plan.grid > sm_count * plan.occupancy:
        plan = dataclasses.replace(plan, grid=sm_count * plan.occupancy)
    return plan


@dataclass(frozen=True)
class BlockPlan:
    """The second pass of a per-tensor FP8 scaling over (rows, cols): ``tile_rows x
    tile_cols`` blocks, ``grid`` persistent programs; program ``p`` takes blocks ``p, p +
    grid, ...``, block ``b`` at row block ``b // col_blocks`` and column block
    ``b % col_blocks``."""

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int
    grid: int
    occupancy: int
    index_bits: int
    dependent_launch: bool

    @property
    def col_blocks(self) -> int:
        return cdiv(self.cols, self.tile_cols)

    @property
    def blocks(self) -> int:
        return cdiv(self.rows, self.tile_rows) * self.col_blocks

    def describe(self) -> str:
        return (f"{self.tile_rows}x{self.tile_cols} blocks, {self.blocks} blocks, persistent "
                f"grid {self.grid} (occupancy {self.occupancy})")


def plan_fp8_quantize(rows: int, cols: int, *, sm_count: int, arch: tuple[int, int],
                      dependent_launch: bool, max_offset: int | None = None,
                      column_blocks: bool = False,
                      device_class: DeviceClass = DEFAULT_DEVICE_CLASS) -> BlockPlan:
    """The second pass of a per-tensor FP8 scaling or the transposing pass of a per-row
    one, or with ``column_blocks`` that of "block" and "mx", whose tile holds whole 128 x 1
    blocks of each column; ``dependent_launch`` as its first pass's (it waits for that
    kernel's writes)."""
    s = fp8_settings_for(arch, device_class)
    if max_offset is None:
        max_offset = rows * cols - 1
    tile_rows, tile_cols = s.transpose_tile if column_blocks else s.quantize_tile
    blocks = cdiv(rows, tile_rows) * cdiv(cols, tile_cols)
    return BlockPlan(rows=rows, cols=cols, tile_rows=tile_rows, tile_cols=tile_cols,
                     grid=min(blocks, sm_count * s.quantize_occupancy),
                     occupancy=s.quantize_occupancy,
                     index_bits=64 if max_offset > MAX_INT32_OFFSET else 32,
                     dependent_launch=dependent_launch)


@dataclass(frozen=True)
class ColumnAmaxPlan:
    """The reduction of the row kernel's (partials, cols) column amaxes to one per column:
    ``grid`` programs of ``tile_cols`` columns each, taking ``tile_rows`` partial rows at a
    time."""

    partials: int
    cols: int
    tile_rows: int
    tile_cols: int
    grid: int
    dependent_launch: bool

    def describe(self) -> str:
        return (f"{self.partials}x{self.cols} column amaxes in {self.grid} programs of "
                f"{self.tile_cols} columns")


def plan_fp8_column_amax(partials: int, cols: int, *, arch: tuple[int, int],
                         dependent_launch: bool,
                         device_class: DeviceClass = DEFAULT_DEVICE_CLASS) -> ColumnAmaxPlan:
    """Each column's amax over ``partials`` per-program rows of the row kernel, before the
    transposed copy of a per-row scaling; ``dependent_launch`` as the row kernel's."""
    tile_rows, tile_cols = fp8_settings_for(arch, device_class).column_amax_tile
    tile_cols = min(tile_cols, next_pow2(cols))
    return ColumnAmaxPlan(partials=partials, cols=cols, tile_rows=tile_rows,
                          tile_cols=tile_cols, grid=cdiv(cols, tile_cols),
                          dependent_launch=dependent_launch)


@dataclass(frozen=True)
class MxSwizzlePlan:
    """The re-layout of (rows, groups) MX scales into 128 x 4 tiles: ``grid`` (row blocks of
    128, chunks of ``tiles`` tiles along the groups)."""

    rows: int
    groups: int
    tiles: int
    grid: tuple[int, int]
    dependent_launch: bool

    def describe(self) -> str:
        return (f"{self.rows}x{self.groups} MX scales to 128 x 4 tiles, grid "
                f"{self.grid[0]}x{self.grid[1]} of {self.tiles} tiles")


def plan_fp8_mx_swizzle(rows: int, groups: int, *, arch: tuple[int, int],
                        dependent_launch: bool,
                        device_class: DeviceClass = DEFAULT_DEVICE_CLASS) -> MxSwizzlePlan:
    """Rows of ``groups`` E8M0 scales into cuBLAS's 128 x 4 blocked layout, after the kernel
    that wrote them (``dependent_launch`` as its). Row blocks go along the grid's first
    dimension, which has room for any M; the chunks of a copy's scales (M / 1024 of them)
    along the second, whose limit caps M of a swizzled copy near 2**26."""
    column_tiles = cdiv(groups, 4)
    tiles = min(fp8_settings_for(arch, device_class).mx_swizzle_tiles,
                next_pow2(column_tiles))
    grid = (cdiv(rows, 128), cdiv(column_tiles, tiles))
    if grid[1] > MAX_GRID_Y:
        raise UnsupportedShape(f"{groups} MX scales a row take {grid[1]} programs of "
                               f"{tiles} 128 x 4 tiles in the swizzle's grid; CUDA allows "
                               f"{MAX_GRID_Y}")
    return MxSwizzlePlan(rows=rows, groups=groups, tiles=tiles, grid=grid,
                         dependent_launch=dependent_launch)
