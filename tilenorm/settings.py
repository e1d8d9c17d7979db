"""Measured launch settings of the row-norm kernels, per GPU architecture and device class.

Every number here was chosen by a measurement that ``bench/NOTES.md`` records, on an H200
(sm_90) unless it says otherwise; :mod:`tilenorm.planner` turns them into launch plans. They
are part of what a GPU validation record pins (:mod:`tilenorm.validation`): a change here
changes what the kernels are launched with, so it needs a GPU run before the kernels count as
stable again.

The H100 and the H200 are both sm_90 with 132 SMs, but the H200 moves ~1.4x the bytes a
second (copy 4186 against 2953 GB/s, #38), and where the fastest launch differs between them
the H100 has its own table (:data:`SM90_H100`). A device's class (:func:`device_class`)
picks the table. Architectures without settings of their own (Blackwell, sm_100/sm_120) take
the H200's until they are measured there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

#: (widest tile_cols, occupancy, worker warps, persistent): the first entry whose width
#: reaches a single-pass tile's applies.
Hint = tuple[int, int, "int | None", bool]


#: Columns a CTA of the cluster forward holds (#75).
CLUSTER_SLICE_COLS = 16384
#: The bytes of rows a two-pass forward's CTAs an SM keep in L1 between the passes, x's and,
#: with a fused residual, the residual's: on an H200 128 KB an SM ran at 101-103% of copy,
#: 256 KB (a residual at 32768 columns, two CTAs an SM) at 87% (#138).
TWO_PASS_L1_BYTES = 192 << 10


def _cluster_forward(cols: int) -> tuple[int, int, int, int]:
    """The cluster forward's entry for ``cols`` columns: (threads, rows a CTA, CTAs per SM,
    cluster), ``cols / CLUSTER_SLICE_COLS`` CTAs a row (#75)."""
    return (256, 1, 4, cols // CLUSTER_SLICE_COLS)


#: The CuTe DSL kernels a settings table routes: the forward (a row a CTA, or across a
#: cluster), the row backward and the cluster backward.
CuteKernel = Literal["forward", "backward", "cluster_backward"]


@dataclass(frozen=True, eq=False)
class RowNormSettings:
    """One architecture's settings. Compared and hashed by identity: plans are cached per
    settings object. Per-direction tables are keyed ``[direction][op]``."""

    #: The widest row, in bytes of x, kept whole in one tile; wider rows are walked in chunks.
    #: LayerNorm holds more per element (the centered row, dbias) and spills sooner (#16).
    max_single_pass_bytes: dict = field(default_factory=lambda: {
        "forward": {"rms_norm": 65536, "layer_norm": 32768},
        "backward": {"rms_norm": 32768, "layer_norm": 16384},
    })
    #: (rows, cols) of the tile for rows wider than the single-pass limit. The forward walks a
    #: row in chunks of it, twice (the second pass reads the row back from L2). The backward
    #: is column split: a program owns one column block of a strided set of rows, so every SM
    #: streams however few rows there are (#35: 1.8 -> 2.5 TB/s at 4096 x 32768).
    chunk_tile: dict = field(default_factory=lambda: {"forward": (1, 4096),
                                                      "backward": (1, 4096)})
    #: Narrower rows are padded to this many columns: 16 bf16 elements are one 32-byte sector.
    min_tile_cols: int = 16
    #: Elements per single-pass (rows, heads, cols) tile: narrow rows are packed up to this.
    tile_elements: dict = field(default_factory=lambda: {"forward": 8192, "backward": 4096})
    #: Single-pass hints (:data:`Hint`) per direction and op. Occupancy is the resident
    #: programs per SM the kernel is compiled for; worker warps its num_worker_warps hint
    #: (None: the compiler's choice). Occupancy 1 with 8 warps gives each thread twice the
    #: registers: the widest tiles stop spilling (#13). A forward that is not persistent gives
    #: every row tile its own program: for narrow rows, four 16 KB tiles in flight per SM beat
    #: a loop over tiles (#15). The backward is always persistent: its partial buffer has a
    #: row per program; 8 warps lift its 4096-element tiles from 512 columns up (LayerNorm's
    #: only at 4096), but slow the narrowest ones where the data sits in L2 (#17). Split rows
    #: look up their span, the sum of their two pieces: 5120 and 6144 have entries (#29).
    single_pass_hints: dict = field(default_factory=lambda: {
        "forward": {
            "rms_norm": ((2048, 4, None, False), (4096, 2, 8, True), (6144, 4, 4, True),
                         (8192, 2, None, True), (32768, 1, 8, True)),
            "layer_norm": ((2048, 4, None, False), (4096, 2, 8, True), (8192, 2, None, True),
                           (32768, 1, 8, True))},
        "backward": {
            "rms_norm": ((256, 2, None, True), (4096, 2, 8, True), (5120, 2, None, True),
                         (6144, 2, 8, True), (16384, 1, 8, True)),
            "layer_norm": ((2048, 2, None, True), (4096, 2, 8, True), (6144, 2, None, True),
                           (16384, 1, 8, True))},
    })
    #: Tiles of several heads look here first: a program per tile measured slower (#15).
    multi_head_hints: dict = field(default_factory=lambda: {
        "forward": ((2048, 1, 8, True),), "backward": ()})
    #: Single-pass hints of calls of at least so many rows (rows x heads), looked up before
    #: ``single_pass_hints``, per direction and op: ((min rows, :data:`Hint`), ...). The
    #: RMSNorm backward at 128 columns at occupancy 4 with 4 warps (a 528-row partial
    #: buffer) on an H200, bf16: 4022 / 3842 GB/s against 3829 / 3694 at 1M / 512K rows,
    #: 3518 against 3746 at 256K and 2229 against 3066 at 32K rows, where the larger
    #: buffer's reduction is a larger share of the call (#135).
    many_rows_hints: dict = field(default_factory=lambda: {
        "forward": {}, "backward": {"rms_norm": ((524288, (128, 4, 4, True)),)}})
    #: (occupancy, worker warps) of the chunked forward and the column-split backward.
    chunked_hints: dict = field(default_factory=lambda: {"forward": (2, None),
                                                         "backward": (2, None)})
    #: Single-pass rows at most ``split_max_fill`` of their power-of-two tile (5120 of 8192)
    #: are split into two power-of-two pieces (4096 + 1024) instead of padded, from this
    #: padded width on, per direction and op. An op absent is never split: the split
    #: LayerNorm forward lost to the padded one at 3000, 5120 and 6144, and so did the RMSNorm
    #: forward at 3000 (#29).
    min_split_tile_cols: dict = field(default_factory=lambda: {
        "forward": {"rms_norm": 8192},
        "backward": {"rms_norm": 2048, "layer_norm": 2048}})
    #: (numerator, denominator): a row is split when it fills at most this fraction of its
    #: padded power-of-two tile; the second piece is the power of two covering the rest (#32).
    split_max_fill: tuple[int, int] = (3, 4)
    #: Tile of the fixed-order dgamma reduction over the partial buffer (#20).
    reduce_tile: tuple[int, int] = (64, 64)
    #: From this compute capability on, the dgamma/dbeta reduction is launched as a
    #: programmatic dependent of the backward kernel, and so are the row kernels whose rows
    #: are a whole number of 16-element groups, up to a width: with a ragged row tileiras 13.4
    #: builds a different pipeline around the grid-dependency instructions, and the backward
    #: at N = 1000 never finished on an H200 (#25, #27); wider rows gain nothing and the
    #: backward loses 5% at 16384, 27% at 131072 (#30).
    dependent_launch_arch: tuple[int, int] = (9, 0)
    dependent_launch_cols_multiple: int = 16
    dependent_launch_max_cols: int = 8192
    #: Backwards the CuTe DSL kernel runs instead of cuTile's, per op and row width:
    #: (threads, stages, CTAs per SM). Each thread holds ``stages`` rows of its 16-byte
    #: vectors, so the next rows' loads are in flight while a row is reduced, which a cuTile
    #: loop cannot do: LayerNorm at 32768 x 4096 on an H200, 90.0% -> 98.2% of copy bandwidth
    #: for the row kernel (#38). RMSNorm at 8192 columns on an H200: (512, 2, 1) 94% of copy
    #: against cuTile's 89% (the other layouts 56-79%, #122); at 1024, (128, 4, 4) 95% against
    #: cuTile's 93% (Quack's 95%), at 7168, (448, 2, 1) 89% against 87% (#125). Widths absent
    #: here were not measured to gain.
    cute_backward: dict = field(default_factory=lambda: {
        "layer_norm": {4096: (256, 2, 2)},
        "rms_norm": {1024: (128, 4, 4), 7168: (448, 2, 1), 8192: (512, 2, 1)}})
    #: {op: widths} of ``cute_backward`` whose kernel keeps its ring in shared memory
    #: (``shared_ring``, cute_row_norm_backward.py): no load of its loop on a register
    #: scoreboard (#132). On an H200 RMSNorm at 7168 97% of copy against the register
    #: ring's 88%, at 8192 96 against 93%; at 1024 94 against 96%, LayerNorm at 4096 95
    #: against 97% (#133).
    cute_backward_shared_ring: dict = field(default_factory=lambda: {
        "rms_norm": (7168, 8192)})
    #: {op: widths} of ``cute_cluster_backward`` (2-byte x) whose kernel stages each row's
    #: rstd (and mean) with the row (``stage_stats``, cute_cluster_norm_backward.py) rather
    #: than loading them right before their use, a memory latency a row (#132). On an H200
    #: RMSNorm at 131072 84% of copy against 77%, LayerNorm at 65536 / 131072 82 / 79%
    #: against 78 / 69%; RMSNorm at 32768 / 65536 and LayerNorm at 32768 1-3% slower (#134).
    cute_cluster_backward_staged_stats: dict = field(default_factory=lambda: {
        "rms_norm": (131072,), "layer_norm": (65536, 131072)})
    #: Backwards of rows too wide for one CTA that a cluster of CTAs holds, reading x and dy
    #: once, per op and width: (CTAs a cluster, threads, row stages in shared memory, CTAs per
    #: SM), the weight in registers. Through the op on an H100 (bf16, % of copy, the
    #: partial buffer's column sum included), RMSNorm 96 / 95 / 88% at 32768 / 65536 /
    #: 131072, LayerNorm 86 / 84 / 75%, where the two-pass column-split backward held ~60%
    #: (#87; 32768's (2, 512, 2, 1) was the probe's best, #81). Every width is past
    #: ``max_single_pass_bytes["backward"]``: the cluster kernel replaces the column split,
    #: nothing else. LayerNorm takes RMSNorm's entries but at 131072, where 512 threads a CTA
    #: run at 69% of an H200's copy against 256's 64% (RMSNorm there: 75 against 76%, #122).
    #: RMSNorm at 16384 columns runs across 2 CTAs: 92% of an H100's copy where cuTile's
    #: one-pass backward runs at 84% (#95), 93% against 86% on an H200 (#98). At 12288
    #: columns (RMSNorm, LayerNorm) and LayerNorm's 16384, rows past cuTile's one-pass limit,
    #: 2 CTAs a row: on an H100 RMSNorm 94% against 89%, LayerNorm 91 / 90% against the
    #: column split's 60 / 61% (#106, untimed on an H200).
    cute_cluster_backward: dict = field(default_factory=lambda: {
        "rms_norm": {12288: (2, 256, 2, 2), 16384: (2, 256, 2, 2), 32768: (2, 512, 2, 1),
                     65536: (8, 256, 2, 2), 131072: (8, 256, 2, 1)},
        "layer_norm": {12288: (2, 256, 2, 2), 16384: (2, 256, 2, 2), 32768: (2, 512, 2, 1),
                       65536: (8, 256, 2, 2), 131072: (8, 512, 2, 1)}})
    #: Forwards the CuTe DSL kernel runs instead of cuTile's, per op and row width:
    #: (threads, rows a CTA, CTAs per SM) of its one-shot grid, each CTA loading its rows
    #: whole before reducing them, the hardware handing CTAs to SMs as they free up: 99.5-99.8%
    #: of copy bandwidth on an H100 where cuTile's persistent forward sits at 94% (#65);
    #: 5120 one row a CTA and 32768 RMSNorm only: more rows, threads or LayerNorm's fp32
    #: weight and bias beside them spill and fall below cuTile (#69). Wider rows, and
    #: LayerNorm's at 32768, run the cluster forward: entries (threads, rows a CTA, CTAs per
    #: SM, cluster), each row across ``cluster`` CTAs of 16384 columns each, 256 threads, one
    #: row a CTA, 4 CTAs an SM (Quack's shape): through the op on an H100 RMSNorm 100-101% of
    #: copy at 65536 and 131072, LayerNorm (fp32 weight and bias) 92 / 92 / 86% at 32768 /
    #: 65536 / 131072 (#79, #89), where cuTile's chunked forward reads every row twice at 66%
    #: (#75). Measured beside these on an H100 and then an H200 (#95, #98): RMSNorm at 7168
    #: columns one row a CTA of 128 threads (H200 98% of copy, cuTile's 92%); at 16384 a row
    #: across 2 CTAs (H200 98%, one CTA 89%), at 32768 too (H200 97%, one CTA 92%);
    #: LayerNorm at 32768 two rows a cluster of 4, reading the parameters once for both
    #: (H200 79% against 77%; the H100's entry, :data:`SM90_H100`). At 12288 columns a row
    #: across 2 CTAs: on an H100 RMSNorm 100% against cuTile's 92%, LayerNorm 91% against
    #: 89% (#106, untimed on an H200); at LayerNorm's 7168 the CuTe forward spills or loses
    #: (50-96% against cuTile's 96%). LayerNorm at 32768 / 65536 / 131072 runs the persistent
    #: cluster forward: entries of five, (threads, rows a group, CTAs an SM, cluster, ring of
    #: row groups), the clusters the device holds at once each taking every so many row
    #: groups, the fp32 parameters staged once a CTA where the one-shot grid reads them from
    #: L2 for every row group (#101, #123): bf16 x with fp32 weight and bias on an H200 at
    #: 88-90 / 84-85 / 88-89% of copy where the one-shot entries ran at 79-81 / 74-75 /
    #: 65-66% (#125). A residual call runs the one-shot forward (``residual_entry``).
    #: RMSNorm at 512 and 1024 columns, ~32 KB of loads in flight an SM: on an H200 98 / 99%
    #: of copy against cuTile's 94 / 94% (at 256 within 1%: not taken; #122); at 2048 one
    #: row a CTA of 128 threads, 16 CTAs an SM, 99% against cuTile's 97%, and at 7168 one row
    #: a CTA of 224 threads (4 vectors a thread) 99% against (128, 1, 4)'s 98% (#135).
    #: Widths absent here were not measured to gain.
    cute_forward: dict = field(default_factory=lambda: {
        "rms_norm": {512: (64, 2, 16), 1024: (128, 2, 8), 2048: (128, 1, 16),
                     4096: (128, 2, 4), 5120: (128, 1, 4), 7168: (224, 1, 4), 8192: (256, 2, 2),
                     12288: (256, 1, 4, 2), 16384: (256, 1, 4, 2), 32768: _cluster_forward(32768),
                     65536: _cluster_forward(65536), 131072: _cluster_forward(131072)},
        "layer_norm": {4096: (128, 2, 4), 5120: (128, 1, 4), 8192: (256, 2, 2),
                       12288: (256, 1, 4, 2), 16384: (512, 2, 1),
                       32768: (256, 1, 2, 4, 2), 65536: (256, 2, 1, 8, 3),
                       131072: (256, 1, 1, 8, 2)}})
    #: Forwards of 2-byte x that walk each row twice, one row a CTA
    #: (:class:`~tilenorm.kernels.cute_row_norm_forward.TwoPassRowNormForward`), per op and
    #: width: (threads, 16-byte vectors a thread a step, CTAs per SM). Where a width is
    #: here it takes the calls ``cute_forward`` would, residual ones where the rows of x and
    #: the residual an SM holds fit L1 (:data:`TWO_PASS_L1_BYTES`). On an H200, RMSNorm
    #: 99-101% of copy against the one-shot entries' 97-98% at 4096-32768, the offset
    #: and the residual alike (but the residual at 32768); LayerNorm 76-89% against 91-101%,
    #: so it has none (#138).
    cute_forward_two_pass: dict = field(default_factory=lambda: {
        "rms_norm": {4096: (256, 1, 8), 5120: (320, 1, 6), 7168: (448, 1, 4),
                     8192: (512, 1, 4), 32768: (1024, 1, 2)},
        "layer_norm": {}})
    #: ``cute_forward`` and ``cute_cluster_backward`` for 4-byte x (fp32; the tables above
    #: are 2-byte x's, bf16 and fp16). Each entry is the 2-byte entry of twice the width: the
    #: same bytes a row, a CTA, a thread and in shared memory, four elements to a 16-byte
    #: vector where 2-byte x has eight; 131072 columns (262144 has no 2-byte entry) a row
    #: across 8 CTAs of 512 threads, 2 an SM, each staging a 64 KB slice. LayerNorm's one-row
    #: cluster entries keep fewer CTAs an SM, (512, 1, 2, 4) at 32768 and (256, 1, 3, 8) at
    #: 65536: at 4 an SM its fp32 weight and bias spill 1-2 stores on sm_90a, and so does a
    #: residual at (512, 1, 2, 4) for 65536. On an H100, fp32 against cuTile's (% of copy,
    #: forward / backward): bench/NOTES.md #104. Widths with no 2-byte entry of twice the
    #: width (256-2048, 5120, 7168, 12288) from fp32 variants on an H100 (#106): the forward
    #: 0.6-6% ahead of cuTile's (RMSNorm 5120 104% against 98%), and the backwards of
    #: LayerNorm at 5120-12288 and 131072 and RMSNorm at 12288 across a cluster, 88-99% of
    #: copy against the column split's 56-60%. RMSNorm's at 12288 a row across 2 CTAs of 512
    #: threads, one an SM: 100% of copy against 98% across 3 of 256 (#112).
    cute_forward_fp32: dict = field(default_factory=lambda: {
        "rms_norm": {256: (64, 2, 16), 512: (128, 2, 8), 1024: (128, 2, 8), 2048: (256, 1, 4),
                     4096: (256, 2, 2), 5120: (256, 1, 4), 7168: (128, 1, 4),
                     8192: (256, 1, 4, 2), 12288: (256, 1, 4, 4), 16384: (256, 1, 4, 2),
                     32768: (256, 1, 4, 4), 65536: (256, 1, 4, 8), 131072: (512, 1, 2, 8)},
        "layer_norm": {2048: (256, 1, 4), 4096: (256, 2, 2), 5120: (256, 1, 2),
                       7168: (256, 1, 2), 8192: (512, 2, 1), 12288: (256, 1, 4, 2),
                       16384: (256, 2, 4, 4), 32768: (512, 1, 2, 4), 65536: (256, 1, 3, 8),
                       131072: (512, 1, 2, 8)}})
    cute_cluster_backward_fp32: dict = field(default_factory=lambda: {
        "rms_norm": {7168: (2, 128, 2, 2), 12288: (2, 512, 2, 1), 16384: (2, 512, 2, 1),
                     32768: (8, 256, 2, 2), 65536: (8, 256, 2, 1), 131072: (8, 512, 1, 1)},
        "layer_norm": {5120: (2, 128, 2, 2), 7168: (2, 128, 2, 2), 8192: (2, 256, 2, 2),
                       12288: (3, 256, 2, 2), 16384: (2, 512, 2, 1), 32768: (8, 256, 2, 2),
                       65536: (8, 256, 2, 1), 131072: (8, 512, 1, 1)}})

    def cluster_backward_stage_stats(self, op: str, cols: int, itemsize: int) -> bool:
        """Whether the cluster backward of ``op`` at ``cols`` columns of ``itemsize``-byte x
        stages each row's rstd (and mean) with the row (``cute_cluster_backward_staged_stats``,
        2-byte x's entries)."""
        return itemsize == 2 and cols in self.cute_cluster_backward_staged_stats.get(op, ())

    def cute_table(self, kernel: CuteKernel, itemsize: int) -> dict:
        """The CuTe DSL table of ``kernel`` for ``itemsize``-byte x, ``{op: {cols: entry}}``:
        2-byte x (bf16, fp16) and 4-byte x (fp32) have their own; the row backward has no
        4-byte one (no entry measured to gain), and other sizes none (empty)."""
        two_byte, four_byte = {
            "forward": (self.cute_forward, self.cute_forward_fp32),
            "backward": (self.cute_backward, {}),
            "cluster_backward": (self.cute_cluster_backward, self.cute_cluster_backward_fp32),
        }[kernel]
        return {2: two_byte, 4: four_byte}.get(itemsize, {})


#: Hopper at the H200's memory bandwidth: the settings above as measured, on an H200 where
#: no other device is named. The default for every device not of another class.
SM90 = RowNormSettings()

#: RMSNorm forward widths whose CuTe entry only an H200 measured (#122, #135): the H100's
#: cuTile forward is at 99-100% of its copy there (#65, #103).
_H200_ONLY_FORWARD = (512, 1024, 2048)

#: Hopper at the H100's bandwidth: the H200's settings but where the H100 measured another
#: choice or none. Every backward keeps cuTile's where the H200 runs the CuTe row backward:
#: LayerNorm's at 4096 columns runs at 94% of copy on an H100 where cuTile's runs at 101%
#: (#38), RMSNorm's at 1024, 7168 and 8192 are the H200's alone (#122, #125); LayerNorm's
#: cluster backward at 131072 keeps 256 threads, the layout the H100 measured (#87). The
#: RMSNorm forward at 32768 columns keeps one CTA a row, measured on the H100 (93.5-101.5%
#: of copy, #69; the cluster one is untimed there). The RMSNorm cluster forward at 65536
#: columns holds two rows a cluster of 8: 102% of an H100's copy against 99% (#95), level
#: on an H200 (96% both, #98). The LayerNorm forward at 32768 / 65536 / 131072 keeps the
#: one-shot cluster forward: 97 / 93 / 88% of an H100's copy with fp32 weight and bias,
#: where the first persistent kernel ran slower at every width (#103). What the H200's
#: persistent entries (#125) win back is the H200's own loss: the one-shot grid reads the
#: fp32 parameters from L2 every row group, and the H200 reached the H100's bytes a second
#: there, not its share of copy (#98, #101); the rebuilt kernel (#123) is untimed on an
#: H100. fp32 at 16384 columns takes the 2-byte entry of 32768, one CTA a row. The cluster
#: backward's staged stats are the H200's alone (#134, untimed on an H100), and so are the
#: 128-column backward of many rows and the 224-thread forward at 7168 (#135; the H100
#: measured (128, 1, 4) at 100% of its copy there, #90), and the two-pass forward (#138).
SM90_H100 = dataclasses.replace(
    SM90,
    cute_backward={},
    cute_cluster_backward_staged_stats={},
    many_rows_hints={"forward": {}, "backward": {}},
    cute_forward_two_pass={"rms_norm": {}, "layer_norm": {}},
    cute_cluster_backward={**SM90.cute_cluster_backward,
                           "layer_norm": {**SM90.cute_cluster_backward["layer_norm"],
                                          131072: (8, 256, 2, 1)}},
    cute_forward={**SM90.cute_forward,
                  "rms_norm": {**{cols: entry for cols, entry
                                  in SM90.cute_forward["rms_norm"].items()
                                  if cols not in _H200_ONLY_FORWARD},
                               7168: (128, 1, 4), 32768: (512, 1, 1), 65536: (256, 2, 4, 8)},
                  "layer_norm": {**SM90.cute_forward["layer_norm"], 32768: (256, 2, 4, 4),
                                 65536: _cluster_forward(65536),
                                 131072: _cluster_forward(131072)}},
    cute_forward_fp32={**SM90.cute_forward_fp32,
                       "rms_norm": {**SM90.cute_forward_fp32["rms_norm"], 16384: (512, 1, 1)}})

#: What picks a device's tables: the Hopper part they were measured on.
DeviceClass = Literal["h200", "h100"]
#: Every class, the default first. Each has its tables, and the ahead-of-time builds cover
#: every entry of every class's.
DEVICE_CLASSES: tuple[DeviceClass, ...] = ("h200", "h100")
DEFAULT_DEVICE_CLASS: DeviceClass = "h200"

#: Peak DRAM bandwidth, bytes a second, of the H100 SXM: 5120-bit HBM3 at 2619 MHz, two
#: transfers a clock (its datasheet's 3.35 TB/s).
H100_PEAK_BANDWIDTH = 2 * 2619 * 10**6 * 5120 // 8


def device_class(arch: tuple[int, int], memory_bandwidth: int) -> DeviceClass:
    """The class of a device of compute capability ``arch`` and peak DRAM bandwidth
    ``memory_bandwidth`` (bytes a second, 0 where unknown): "h100" for sm_90 at most at the
    H100 SXM's bandwidth (the H100 SXM and PCIe, the H800), "h200" for every other device:
    the H200, and the parts measured on neither (H100 NVL, H20, GH200, Blackwell) keep the
    tables measured first.

    Keyed on bandwidth because it is what separates the two measured choices (#38: "routing
    on memory bandwidth is the fix"), from two driver attributes that name the memory, not
    the product: not the device name, which each variant spells its own way, nor the total
    memory, which under MIG is a slice's (an H200 slice holds less than an H100)."""
    if tuple(arch) == (9, 0) and 0 < memory_bandwidth <= H100_PEAK_BANDWIDTH:
        return "h100"
    return DEFAULT_DEVICE_CLASS


T = TypeVar("T")


class DeviceTables(Generic[T]):
    """One kind of settings a device class, and the settings under measurement that replace
    them inside :meth:`measuring` (the benchmarks' ``--variants``)."""

    def __init__(self, tables: dict[DeviceClass, T]):
        self._tables = tables
        self._measuring: T | None = None

    def lookup(self, device_class: DeviceClass) -> T:
        if self._measuring is not None:
            return self._measuring
        if device_class not in self._tables:
            raise ValueError(f"device_class must be one of {DEVICE_CLASSES}, "
                             f"got {device_class!r}")
        return self._tables[device_class]

    @contextlib.contextmanager
    def measuring(self, settings: T) -> Iterator[None]:
        """Plans made inside take ``settings`` on every architecture and device."""
        previous, self._measuring = self._measuring, settings
        try:
            yield
        finally:
            self._measuring = previous


_HOPPER = DeviceTables({"h200": SM90, "h100": SM90_H100})


def settings_for(arch: tuple[int, int], device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                 ) -> RowNormSettings:
    """The settings for compute capability ``arch`` on a device of ``device_class``
    (:func:`device_class`): Hopper's of the class for every architecture until another one
    is measured; inside :func:`measuring`, the settings under measurement."""
    return _HOPPER.lookup(device_class)


#: Plans made inside ``measuring(settings)`` take ``settings``: for benchmarks that compare
#: settings through the ops (``bench/bench_norm_ops.py --variants``).
measuring = _HOPPER.measuring
