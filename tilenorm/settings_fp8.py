"""Launch settings of the FP8-output norm kernels (:mod:`tilenorm.kernels.cutile_row_norm_fp8`).

Not measured yet: the row kernels take the bf16 norms' settings (:mod:`tilenorm.settings`)
without split tiles (the FP8 kernels hold a row as one power-of-two tile), and the
per-tensor scalings' second pass starts from the tile below. A GPU run tunes them; like
``settings.py`` they are part of what a validation record of the FP8 family pins.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from tilenorm.settings import RowNormSettings, settings_for


@dataclass(frozen=True)
class Fp8Settings:
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


SM90_FP8 = Fp8Settings()


def fp8_settings_for(arch: tuple[int, int]) -> Fp8Settings:
    """Hopper's for every architecture until another one is measured."""
    return SM90_FP8


@functools.cache
def row_settings_for(arch: tuple[int, int]) -> RowNormSettings:
    """The bf16 norms' settings for ``arch`` with no split tiles."""
    base = settings_for(arch)
    return dataclasses.replace(base, min_split_tile_cols={"forward": {}, "backward": {}})
