"""The planner's invariants, checked exhaustively over a grid of problem sizes."""

import itertools

import pytest

from tilenorm.planner import (
    MAX_SINGLE_PASS_COLS,
    TILE_ELEMENTS,
    UnsupportedShape,
    kernel_configs,
    plan_row_norm,
)

ROWS = [1, 2, 3, 15, 16, 17, 255, 1000, 32768, 100003]
COLS = [1, 7, 16, 64, 127, 128, 1000, 1024, 4096, 5120, 8192, 8193, 16384, 65536, 262144]
SMS = [1, 7, 132, 148]


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("sm_count", SMS)
def test_every_row_and_column_covered_exactly_once(direction, sm_count):
    for rows, cols in itertools.product(ROWS, COLS):
        if rows * cols > 2**31:
            continue
        p = plan_row_norm(rows, cols, itemsize=2, sm_count=sm_count, arch=(9, 0),
                          direction=direction)
        assert 1 <= p.grid <= p.row_tiles, "grid never exceeds the number of tiles"
        assert p.grid <= sm_count * p.occupancy
        seen = [t for prog in range(p.grid) for t in p.program_row_tiles(prog)]
        assert sorted(seen) == list(range(p.row_tiles)), "each row tile once"
        covered = [r for t in range(p.row_tiles) for r in p.tile_row_range(t)]
        assert covered == list(range(rows)), "each row once"
        assert (p.col_tiles - 1) * p.tile_cols < cols <= p.col_tiles * p.tile_cols
        assert is_pow2(p.tile_rows) and is_pow2(p.tile_cols)
        assert p.tile_rows * p.tile_cols <= max(TILE_ELEMENTS[direction],
                                                MAX_SINGLE_PASS_COLS[direction])
        assert p.single_pass == (cols <= MAX_SINGLE_PASS_COLS[direction])
        assert p.partial_shape == (p.grid, p.col_tiles * p.tile_cols)
        assert p.reduce_grid * p.reduce_tile[1] >= p.partial_shape[1] > \
            (p.reduce_grid - 1) * p.reduce_tile[1]
        assert (p.single_pass, p.tile_rows, p.tile_cols, p.occupancy) in kernel_configs(
            direction)


def test_partial_buffer_bytes_stay_small():
    p = plan_row_norm(4096, 65536, itemsize=2, sm_count=132, arch=(9, 0),
                      direction="backward")
    assert p.partial_shape == (p.grid, 65536) and p.grid <= 132 * p.occupancy
    p = plan_row_norm(1 << 20, 128, itemsize=2, sm_count=132, arch=(9, 0),
                      direction="backward")
    assert p.partial_shape == (264, 128)


@pytest.mark.parametrize("rows,cols,itemsize", [(0, 128, 2), (4, 0, 2), (2**16, 2**15 + 1, 2),
                                                (4, 128, 8)])
def test_unsupported_problems_raise(rows, cols, itemsize):
    with pytest.raises(UnsupportedShape):
        plan_row_norm(rows, cols, itemsize=itemsize, sm_count=132, arch=(9, 0),
                      direction="forward")


def test_exactly_2_pow_31_elements_fit_32_bit_offsets():
    p = plan_row_norm(32768, 65536, itemsize=2, sm_count=132, arch=(9, 0), direction="forward")
    assert p.rows * p.cols == 2**31


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="sm_count"):
        plan_row_norm(4, 4, itemsize=2, sm_count=0, arch=(9, 0), direction="forward")
    with pytest.raises(ValueError, match="direction"):
        plan_row_norm(4, 4, itemsize=2, sm_count=1, arch=(9, 0), direction="sideways")


def test_describe_names_tile_grid_and_partial_buffer():
    text = plan_row_norm(32768, 4096, itemsize=2, sm_count=132, arch=(9, 0),
                         direction="backward").describe()
    assert "tile 1x4096" in text and "persistent grid 264" in text, text
    assert "partial buffer 264x4096 fp32" in text
