"""Launch settings of the FP8-output norm kernels (:mod:`tilenorm.kernels.cutile_row_norm_fp8`).

The row kernels take the bf16 norms' settings (:mod:`tilenorm.settings`) with the fields of
``row_overrides`` replaced: no split tiles (the FP8 kernels hold a row as one power-of-two
tile). The per-tensor scalings' second pass starts from the tile below. ``bench_fp8.py
--variants`` measures other values; like ``settings.py`` these are part of what a validation
record of the FP8 family pins.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from tilenorm.settings import (
    DEFAULT_DEVICE_CLASS,
    SM90,
    DeviceClass,
    DeviceTables,
    RowNormSettings,
    settings_for,
)


@dataclass(frozen=True, eq=False)
class Fp8Settings:
    """One architecture's settings; compared and hashed by identity, like
    :class:`RowNormSettings`."""

    #: :class:`RowNormSettings` fields the FP8 row kernels (forward and FP8 input's
    #: backward) take instead of the bf16 norms'.
    row_overrides: dict = field(default_factory=lambda: {
        "min_split_tile_cols": {"forward": {}, "backward": {}},
        # A row a tile, four programs an SM of 4 warps at 2048 and 4096: the row's second
        # reduction (its scale) wants more rows in flight than the bf16 forward's 4 x 2048
        # and 2 x 4096 tiles (#55).
        "tile_elements": {"forward": 2048, "backward": 4096},
        "single_pass_hints": {**SM90.single_pass_hints, "forward": {
            "rms_norm": ((4096, 4, 4, True), (6144, 4, 4, True),
                         (8192, 2, None, True), (32768, 1, 8, True)),
            "layer_norm": ((4096, 4, 4, True), (8192, 2, None, True),
                           (32768, 1, 8, True))}},
        # The bf16 backward's many-rows entry is its kernel's measurement, not FP8 input's.
        "many_rows_hints": {"forward": {}, "backward": {}}})
    #: (rows, cols) of the second pass's blocks: 128 columns of 64 rows, 8192 fp32 values of
    #: y, whose transpose stores 64-byte runs of 8-bit values.
    quantize_tile: tuple[int, int] = (64, 128)
    #: Resident programs per SM the second pass is compiled for.
    quantize_occupancy: int = 2
    #: (rows, cols) of the blocks of the transposed copies of "block" and "mx": 128 rows hold
    #: one 128 x 1 block or four 32 x 1 MX blocks of each column, 128 columns whole groups of
    #: FP8 x's multipliers. (128, 64) uses the same 128 registers and no stack on sm_90 but
    #: cannot hold a group of 128; "row"'s copy takes ``quantize_tile``.
    transpose_tile: tuple[int, int] = (128, 128)
    #: (partial rows, cols) a program of the column-amax reduction takes at a time; its
    #: programs own ``cols`` columns each.
    column_amax_tile: tuple[int, int] = (32, 128)
    #: 128 x 4 tiles of MX scales a program of the swizzle moves (128 x 32 bytes).
    mx_swizzle_tiles: int = 8
    #: The CuTe DSL row kernel (tilenorm/kernels/cute_row_norm_fp8.py), which keeps the next
    #: rows' loads in flight, per row width: (threads, stages, CTAs per SM). It runs instead
    #: of cuTile's for RMSNorm of 2-byte x (FP8 x: ``cute_forward_fp8_input``) without a
    #: residual, every scaling (a per-row scaling's transposed copy, whose column amaxes
    #: the row kernel keeps, only at ``cute_forward_column_amax``'s widths): H200, row
    #: scaling 65-73% -> 85-94% of copy (#56). Widths absent were not measured.
    cute_forward: dict = field(default_factory=lambda: {
        2048: (128, 4, 6), 4096: (128, 4, 4), 8192: (256, 4, 2), 16384: (512, 4, 1)})
    #: Per scaling of the row kernel (its ``SCALINGS``), widths that take the kernel's
    #: ``recompute_t`` (the weight and t = x * w not held across the row) at their own
    #: (threads, stages, CTAs per SM) instead of ``cute_forward``'s entry. Block scaling at
    #: 16384 columns: with bf16 x and no weight or a bf16 weight, two CTAs of 256 threads an
    #: SM fit 128 registers without spilling (the kernel without ``recompute_t`` spills
    #: there), 83.9% -> 90.0% of copy on an H100; row scaling and 8192 columns ran slower
    #: with it (#78). The entry takes every variant: an fp32 weight, the offset or fp16 x
    #: still spill a little here (2-40 stores against the old route's 3-74) and are untimed.
    #: On an H200 row and MX scaling at 16384 gain too: 92 / 90% of copy against (512, 4, 1)'s
    #: 89 / 88% (#122); a per-row scaling's transposed copy takes the same kernel with its
    #: column maxima (``plan_cute_fp8_forward``; on sm_90a without spills with a bf16 weight
    #: or none, bench/NOTES.md #125).
    cute_forward_recompute_t: dict = field(default_factory=lambda: {
        scaling: {16384: (256, 2, 2)} for scaling in ("block", "row", "mx")})
    #: Per scaling of the row kernel, widths of ``cute_forward`` that run at their own
    #: (threads, stages, CTAs per SM), the rest of the features as ``cute_forward``'s: where
    #: one device ranks the scalings' thread layouts otherwise (#95). On an H200 block
    #: scaling at 4096 columns (256, 4, 3) 91% of copy against (128, 4, 4)'s 90%, at 8192
    #: (512, 4, 1) 92% against (256, 4, 2)'s 90%; MX loses at both (87 / 74%, #135).
    cute_forward_scaling: dict = field(default_factory=lambda: {
        "block": {4096: (256, 4, 3), 8192: (512, 4, 1)}})
    #: Per scaling of the row kernel, widths of ``cute_forward`` whose kernel of 2-byte x
    #: takes the kernel's ``clamp`` (each value clamped to +-fp8_max before the saturating
    #: conversion: the same bits at two FMNMX.NAN an element). The H200, bf16 x and weight,
    #: E4M3, each scaling's entry, the clamp against the kernel without it: row scaling +4.5%
    #: at 4096 and +3.8% at 8192 columns, MX +4% at 2048 and +2-2.5% at 8192; row -2-3% at
    #: 2048 and MX -0.5% at 4096 keep the kernel without it (bench/NOTES.md #125). On
    #: sm_90a the clamped variants take at most 2 registers more than those without it and
    #: spill no more: none with a 2-byte weight or none. Block scaling loses with it at
    #: 4096, 8192 and 16384 (1-1.5%), MX at 16384 (5%, #135). Delayed and per-tensor
    #: scaling, row scaling at 16384, FP8 x and the row kernel keeping column amaxes (the
    #: same bits as the row kernel's either way) are untimed with it.
    cute_forward_clamp: dict = field(default_factory=lambda: {
        "row": (4096, 8192), "mx": (2048, 8192)})
    #: The CuTe DSL transposed copy of "row", "block" and "mx"
    #: (tilenorm/kernels/cute_fp8_transpose.py), which runs instead of cuTile's
    #: ``fp8_quantize_transposed`` (128 registers, 206 for "row": #60) for RMSNorm of 2-byte
    #: x without a residual and a row count that is a multiple of 16: (tile columns, CTAs
    #: per SM), the first whose columns divide the row width. 128-column tiles at three CTAs
    #: an SM take 80 registers on sm_90a (block scaling keeps one 4-byte spill a tile), at
    #: two 96 and none; neither is timed yet.
    cute_transpose: tuple = ((128, 3), (64, 6))
    #: Widths of ``cute_forward`` whose row kernel also keeps per-program column amaxes
    #: for a per-row scaling's copy (its ``column_amax``), with the CuTe copy after it, in
    #: place of cuTile's row kernel (which spills there, #60): every width of the table. A
    #: width left out runs cuTile's row kernel for the whole copy, as 16384 did on the H200
    #: until #120 (cuTile's program holds a 16384-column row and its column maxima: row+t at
    #: 54% of the H200's copy on the design's bytes, 70% of the H100's; the CuTe route 89%
    #: on the H100, #103). On sm_90a, with a bf16 weight, it spills 0 / 0 / 4 / 6 stores
    #: and 0 / 0 / 24 / 6 loads at 2048 / 4096 / 8192 / 16384 columns, none without a
    #: weight (the cuTile kernel 8 and 4 stores at 4096 and 8192, #60); an fp32 weight
    #: spills 10-12 stores and 96 loads (without column amaxes 0 and 8 stores at 2048 and
    #: 4096), so it keeps cuTile's row kernel (``dispatch``). The H200's numbers:
    #: bench/NOTES.md #120.
    cute_forward_column_amax: tuple = (2048, 4096, 8192, 16384)
    #: The same kernel reading FP8 x and its group multipliers (groups of 16 elements or
    #: more: one multiplier a 16-byte vector), per row width: (threads, stages, CTAs per
    #: SM). The cuTile FP8-input forward reaches 40-51% of copy on an H200 (record
    #: h200-2026-11-26-fp8-d10a729, case fp8x-row). ``cute_forward``'s entries, the thread
    #: layout measured there (#56): on an H100 row scaling 91.3% of copy at 4096, 88.7% at
    #: 8192 (cuTile's 68.8 / 72.7%, #88). On sm_90a every scaling, weight dtype (or none),
    #: FP8 format and group of 16 or 128 compiles to them without spills but the Gemma
    #: offset, which at 4096-16384 columns stores 6 registers (2-byte x's kernel with an fp32
    #: weight and the offset: 84). Spill-free for the offset too, to be timed: (256, 8, 2)
    #: at 4096 and (512, 8, 1) at 8192 (one vector a thread); 8 rows in registers at the
    #: table's thread counts spill. A per-row scaling's transposed copy of FP8 x keeps
    #: cuTile's row kernel: the CuTe copy reads 2-byte x only, and cuTile's copy takes the
    #: column amaxes of y as cuTile's row kernel computes it (``dispatch``).
    #: ``bench/bench_fp8.py --scalings fp8x-row --variants`` times other values.
    cute_forward_fp8_input: dict = field(default_factory=lambda: {
        2048: (128, 4, 6), 4096: (128, 4, 4), 8192: (256, 4, 2), 16384: (512, 4, 1)})
    #: {scaling: {cols: (threads, stages, CTAs per SM)}} in place of
    #: ``cute_forward_fp8_input``'s entry for FP8 x at that scaling. On the H200, with the
    #: weight's conflict-free layout (#128), row scaling ranks (64, 4, 8) 88-89% of copy at
    #: 2048 against (128, 4, 6)'s 80-81%, (256, 2, 4) 86-87% at 8192 against (256, 4, 2)'s
    #: 83-84%, (512, 2, 2) 81-82% at 16384 against (512, 4, 1)'s 73%; at 4096 (128, 4, 4)
    #: (88-90%) stays ahead of (128, 2, 8), (64, 4, 6) and (256, 4, 2). The other scalings
    #: keep the table's (untimed): at (256, 2, 4) and (512, 2, 2), 64 registers a thread,
    #: block and MX scaling spill 18-43 words, row scaling 0 and 2.
    cute_forward_fp8_input_scaling: dict = field(default_factory=lambda: {
        "row": {2048: (64, 4, 8), 8192: (256, 2, 4), 16384: (512, 2, 2)}})
    #: {scaling: widths} where the FP8-x row kernel keeps its ring (x's bytes and their
    #: multipliers) in shared memory (``shared_ring``, cute_row_norm_fp8.py): no load of its
    #: loop on a register scoreboard (bench/NOTES.md #132). On an H200 row scaling at 16384
    #: ~1% ahead of the register ring (3624 / 3628 against 3613 / 3570 GB/s, alternating in
    #: one process); at 2048-8192 the ring loses 1-4% (#133).
    cute_forward_fp8_input_shared_ring: dict = field(default_factory=lambda: {
        "row": (16384,)})
    #: The same for the row kernel of 2-byte x ({scaling: widths}; not with
    #: ``cute_forward_recompute_t``'s entries). On an H200, alternating in one process, MX at
    #: 4096 ~1% ahead (3678 / 3679 against 3639 / 3661 GB/s), block at 8192 too (3725 / 3776
    #: against 3711 / 3727); the other scalings and widths lose up to 9% or gain under 1%
    #: (#133).
    cute_forward_shared_ring: dict = field(default_factory=lambda: {
        "mx": (4096,), "block": (8192,)})

    def forward_entry(self, scaling: str, cols: int) -> tuple[int, int, int] | None:
        """The row kernel's (threads, stages, CTAs per SM) for 2-byte x of ``cols`` columns
        at ``scaling`` without ``recompute_t``: ``cute_forward_scaling``'s, else
        ``cute_forward``'s; None where the width is not in ``cute_forward``."""
        if cols not in self.cute_forward:
            return None
        return self.cute_forward_scaling.get(scaling, {}).get(cols, self.cute_forward[cols])

    def fp8_input_entry(self, scaling: str, cols: int) -> tuple[int, int, int] | None:
        """The row kernel's (threads, stages, CTAs per SM) for FP8 x of ``cols`` columns at
        ``scaling``: ``cute_forward_fp8_input_scaling``'s, else ``cute_forward_fp8_input``'s;
        None where the width is not in ``cute_forward_fp8_input``."""
        if cols not in self.cute_forward_fp8_input:
            return None
        return self.cute_forward_fp8_input_scaling.get(scaling, {}).get(
            cols, self.cute_forward_fp8_input[cols])

    def forward_shared_ring(self, scaling: str, cols: int) -> bool:
        """Whether the row kernel of 2-byte x at ``scaling`` and ``cols`` keeps its ring in
        shared memory (``cute_forward_shared_ring``; never with ``recompute_t``)."""
        return (cols in self.cute_forward_shared_ring.get(scaling, ())
                and cols not in self.cute_forward_recompute_t.get(scaling, {}))

    def fp8_input_shared_ring(self, scaling: str, cols: int) -> bool:
        """Whether the row kernel of FP8 x at ``scaling`` and ``cols`` keeps x's ring in
        shared memory (``cute_forward_fp8_input_shared_ring``)."""
        return cols in self.cute_forward_fp8_input_shared_ring.get(scaling, ())

    def forward_clamp(self, scaling: str, cols: int) -> bool:
        """Whether the row kernel of 2-byte x at ``scaling`` and ``cols`` takes ``clamp``
        (``cute_forward_clamp``)."""
        return cols in self.cute_forward_clamp.get(scaling, ())


#: Hopper at the H200's bandwidth (:data:`tilenorm.settings.SM90`), the default.
SM90_FP8 = Fp8Settings()
#: Hopper at the H100's (:data:`tilenorm.settings.SM90_H100`): the row kernel of 2-byte x at
#: 8192 columns at (512, 2, 2), where the H100 ranks row scaling (512, 2, 2) 96.2% of copy,
#: (256, 4, 2) 89.5% (the H200 80.8 / 93.7%) and block scaling (512, 2, 2) 92.8% beside the
#: op's (256, 4, 2) 93.2% (#82); the other scalings are untimed there. On
#: sm_90a (cuobjdump of the AOT variants, 64 registers a thread) it spills no more than
#: (256, 4, 2): none with a bf16 weight or none but the column amaxes' 2 stores (3 at
#: (256, 4, 2)), 2 stores with an fp32 weight (8 at (256, 4, 2) for row scaling). FP8 x
#: (``cute_forward_fp8_input``) keeps (256, 4, 2) at 8192, its own entry: (512, 2, 2) and
#: (512, 4, 1) ran at 75% and 68% of copy there against its 89% (#88, #95), and none of the
#: H200's ``cute_forward_fp8_input_scaling`` (#128, untimed on an H100). At 4096 columns
#: row and MX scaling run at (256, 4, 2), 97% and 96% of copy against (128, 4, 4)'s 90% and
#: 89%, where block scaling ranks them 88% and 90% and keeps (128, 4, 4) (#95). No
#: ``clamp`` and no ring in shared memory: timed on the H200 only (#125, #133).
#: ``recompute_t`` for block scaling only: row scaling at 16384 ran slower with it on an
#: H100 (#78), MX is untimed there.
SM90_FP8_H100 = dataclasses.replace(
    SM90_FP8, cute_forward={**SM90_FP8.cute_forward, 8192: (512, 2, 2)},
    cute_forward_fp8_input_scaling={},
    cute_forward_recompute_t={"block": {16384: (256, 2, 2)}},
    cute_forward_scaling={scaling: {4096: (256, 4, 2)} for scaling in ("row", "mx")},
    cute_forward_clamp={}, cute_forward_fp8_input_shared_ring={}, cute_forward_shared_ring={})
_HOPPER = DeviceTables({"h200": SM90_FP8, "h100": SM90_FP8_H100})


def fp8_settings_for(arch: tuple[int, int], device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                     ) -> Fp8Settings:
    """Hopper's of ``device_class`` (:func:`tilenorm.settings.device_class`) for every
    architecture until another one is measured; inside :func:`measuring`, the settings under
    measurement."""
    return _HOPPER.lookup(device_class)


#: Plans made inside ``measuring(settings)`` take ``settings``: for benchmarks that compare
#: settings through the ops (``bench/bench_fp8.py --variants``).
measuring = _HOPPER.measuring


@functools.cache
def _row_settings(fp8: Fp8Settings, base: RowNormSettings) -> RowNormSettings:
    return dataclasses.replace(base, **fp8.row_overrides)


def row_settings_for(arch: tuple[int, int], device_class: DeviceClass = DEFAULT_DEVICE_CLASS
                     ) -> RowNormSettings:
    """The bf16 norms' settings for ``arch`` and ``device_class`` with the FP8 settings'
    ``row_overrides``."""
    return _row_settings(fp8_settings_for(arch, device_class),
                         settings_for(arch, device_class))
