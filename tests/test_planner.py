"""The planner's invariants, checked exhaustively over a grid of problem sizes."""

import itertools

import pytest

from tilenorm.planner import (
    UnsupportedShape,
    max_single_pass_cols,
    next_pow2,
    plan_row_norm,
)
from tilenorm.settings import SM90, settings_for

MULTI_HEAD_HINTS = SM90.multi_head_hints
SINGLE_PASS_HINTS = SM90.single_pass_hints
TILE_ELEMENTS = SM90.tile_elements

ROWS = [1, 2, 3, 15, 16, 17, 255, 1000, 32768, 100003]
COLS = [1, 7, 16, 64, 127, 128, 1000, 1024, 4096, 5120, 8192, 8193, 16384, 65536, 262144]
SMS = [1, 7, 132, 148]


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def assert_each_column_once(p):
    """Every column of every row tile is covered by exactly one program of ``p``."""
    spans = {t: [] for t in range(p.row_tiles)}
    for prog in range(p.grid):
        for t in p.program_row_tiles(prog):
            spans[t].append(p.program_cols(prog))
    for t, ranges in spans.items():
        ranges.sort(key=lambda r: r.start)
        assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]] and \
            ranges[-1].stop == p.cols, f"row tile {t}: each column once"


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("sm_count", SMS)
@pytest.mark.parametrize("op,itemsize", [("rms_norm", 2), ("layer_norm", 2), ("rms_norm", 4)])
def test_every_row_and_column_covered_exactly_once(direction, sm_count, op, itemsize):
    widest = max_single_pass_cols(direction, op, itemsize)
    for rows, cols in itertools.product(ROWS, COLS):
        p = plan_row_norm(rows, cols, itemsize=itemsize, sm_count=sm_count, arch=(9, 0),
                          direction=direction, op=op)
        assert p.column_split == (direction == "backward" and not p.single_pass)
        if p.column_split:  # a program per column tile at least, persistent over rows
            assert p.grid == p.row_groups * p.col_tiles and 1 <= p.row_groups <= p.row_tiles
            assert p.grid <= max(sm_count * p.occupancy, p.col_tiles)
            assert p.partial_shape == (p.row_groups, 1, cols)
        else:
            assert 1 <= p.grid <= p.row_tiles, "grid never exceeds the number of tiles"
            assert p.grid <= sm_count * p.occupancy or (
                direction == "forward" and p.grid == p.row_tiles), "persistent but forward"
            assert p.partial_shape == (p.grid, 1, cols)
        if not p.column_split:
            seen = [t for prog in range(p.grid) for t in p.program_row_tiles(prog)]
            assert sorted(seen) == list(range(p.row_tiles)), "each row tile once"
        elif p.row_tiles * p.col_tiles <= 1 << 15:
            assert_each_column_once(p)
        if rows * cols <= 1 << 24:
            covered = [r for t in range(p.row_tiles) for r, _ in p.tile_vectors(t)]
            assert covered == list(range(rows)), "each row once"
        assert p.span_cols - min(p.tile_cols, p.split_cols or p.tile_cols) < cols <= p.span_cols
        assert is_pow2(p.tile_rows) and is_pow2(p.tile_cols) and p.tile_heads == 1
        assert p.split_cols == 0 or (is_pow2(p.split_cols) and p.split_cols <= p.tile_cols // 2
                                     and p.single_pass), "a second piece only in one pass"
        assert p.tile_rows * (p.tile_cols + p.split_cols) <= max(TILE_ELEMENTS[direction], widest)
        assert p.single_pass == (cols <= widest)
        assert p.reduce_grid * p.reduce_tile[1] >= cols > (p.reduce_grid - 1) * p.reduce_tile[1]
        assert p.index_bits == (64 if rows * cols > 2**31 else 32)


@pytest.mark.parametrize("heads", [1, 2, 5, 8, 40, 64, 128])
@pytest.mark.parametrize("cols", [64, 128, 256, 1000])
@pytest.mark.parametrize("per_head", [False, True])
def test_heads_tiles_cover_every_vector_once(heads, cols, per_head):
    for rows, sm_count in ((1, 132), (3, 7), (1000, 132), (4096, 5)):
        p = plan_row_norm(rows, cols, heads=heads, per_head_weight=per_head, itemsize=2,
                          sm_count=sm_count, arch=(9, 0), direction="backward")
        assert is_pow2(p.tile_heads) and p.tile_rows * p.tile_heads * p.tile_cols <= \
            TILE_ELEMENTS["backward"]
        vectors = [v for t in range(p.row_tiles) for v in p.tile_vectors(t)]
        assert sorted(vectors) == [(r, h) for r in range(rows) for h in range(heads)]
        if per_head:
            assert p.grid % p.head_tiles == 0, "each program stays on one head tile"
            assert p.partial_shape == (p.grid // p.head_tiles, heads, cols)
            slots = {(p.partial_slot(q), q % p.head_tiles) for q in range(p.grid)}
            assert len(slots) == p.grid, "no two programs share a partial slot"
        else:
            assert p.partial_shape == (p.grid, 1, cols)


def test_partial_buffer_bytes_stay_small():
    p = plan_row_norm(4096, 65536, itemsize=2, sm_count=132, arch=(9, 0),
                      direction="backward")
    assert p.column_split and p.partial_shape == (16, 1, 65536) and p.grid == 256
    p = plan_row_norm(1 << 18, 128, itemsize=2, sm_count=132, arch=(9, 0),
                      direction="backward")
    assert p.partial_shape == (264, 1, 128)


@pytest.mark.parametrize("device_class", ["h200", "h100"])
def test_many_rows_hints_apply_from_their_row_count(device_class):
    """A many-rows hint takes calls of at least its rows (x heads), before the width's."""
    s = settings_for((9, 0), device_class)
    for op, entries in s.many_rows_hints["backward"].items():
        for min_rows, (widest, occupancy, warps, persistent) in entries:
            kwargs = dict(itemsize=2, sm_count=132, arch=(9, 0), direction="backward",
                          op=op, settings=s)
            many = plan_row_norm(min_rows, widest, **kwargs)
            assert (many.occupancy, many.worker_warps) == (occupancy, warps)
            assert many.grid == min(many.row_tiles, 132 * occupancy) and persistent
            heads = plan_row_norm(min_rows // 4, widest, heads=4, **kwargs)
            assert (heads.occupancy, heads.worker_warps) == (occupancy, warps)
            fewer = plan_row_norm(min_rows - 1, widest, **kwargs)
            _, occupancy, warps, _ = next(h for h in s.single_pass_hints["backward"][op]
                                          if fewer.tile_cols <= h[0])
            assert (fewer.occupancy, fewer.worker_warps) == (occupancy, warps)
    if device_class == "h200":
        p = plan_row_norm(1 << 20, 128, itemsize=2, sm_count=132, arch=(9, 0),
                          direction="backward", settings=s)
        assert p.partial_shape == (528, 1, 128)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_launch_hints_cover_every_single_pass_width(direction, op):
    hints = SINGLE_PASS_HINTS[direction][op]
    widths = [hint[0] for hint in hints]
    widest = max_single_pass_cols(direction, op, 2)
    assert widths == sorted(widths) and widths[-1] >= widest
    for cols in (16, 1024, 4096, widest):
        p = plan_row_norm(1 << 16, cols, itemsize=2, sm_count=132, arch=(9, 0),
                          direction=direction, op=op)
        _, occupancy, warps, persistent = next(h for h in hints if p.tile_cols <= h[0])
        assert (p.occupancy, p.worker_warps) == (occupancy, warps)
        assert p.grid == (min(p.row_tiles, 132 * occupancy) if persistent else p.row_tiles)
        assert persistent or direction == "forward", "the backward's partial rows are programs"


def test_tiles_of_several_heads_stay_persistent():
    p = plan_row_norm(4096, 128, heads=32, itemsize=2, sm_count=132, arch=(9, 0),
                      direction="forward")
    assert p.tile_heads > 1 and p.grid < p.row_tiles
    assert (p.occupancy, p.worker_warps) == MULTI_HEAD_HINTS["forward"][0][1:3]
    plain = plan_row_norm(4096 * 32, 128, itemsize=2, sm_count=132, arch=(9, 0),
                          direction="forward")
    assert plain.grid == plain.row_tiles, "one head per vector: a program per row tile"


def test_widest_backward_tiles_run_one_program_per_sm_with_8_warps():
    p = plan_row_norm(32768, 8192, itemsize=2, sm_count=132, arch=(9, 0),
                      direction="backward")
    assert (p.occupancy, p.worker_warps, p.grid) == (1, 8, 132)
    assert "8 worker warps" in p.describe()


def test_layer_norm_and_fp32_rows_go_to_chunks_sooner():
    def single(cols, op="rms_norm", itemsize=2, direction="backward"):
        return plan_row_norm(1024, cols, itemsize=itemsize, sm_count=132, arch=(9, 0),
                             direction=direction, op=op).single_pass

    assert single(16384) and not single(16384, "layer_norm") and single(8192, "layer_norm")
    assert not single(16384, itemsize=4) and single(8192, itemsize=4)
    assert single(32768, direction="forward") and not single(32768, "layer_norm", 2, "forward")
    with pytest.raises(ValueError, match="op must be"):
        single(128, "group_norm")


@pytest.mark.parametrize("rows,cols,itemsize", [(0, 128, 2), (4, 0, 2), (4, 128, 8)])
def test_unsupported_problems_raise(rows, cols, itemsize):
    with pytest.raises(UnsupportedShape):
        plan_row_norm(rows, cols, itemsize=itemsize, sm_count=132, arch=(9, 0),
                      direction="forward")


def test_64_bit_offsets_only_past_2_pow_31():
    p = plan_row_norm(32768, 65536, itemsize=2, sm_count=132, arch=(9, 0), direction="forward")
    assert p.rows * p.cols == 2**31 and p.index_bits == 32
    p = plan_row_norm(32769, 65536, itemsize=2, sm_count=132, arch=(9, 0), direction="forward")
    assert p.index_bits == 64
    p = plan_row_norm(16, 1024, itemsize=2, sm_count=132, arch=(9, 0), direction="forward",
                      max_offset=2**31)
    assert p.index_bits == 64, "a strided operand reaching past 2^31 - 1 needs 64 bits"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="sm_count"):
        plan_row_norm(4, 4, itemsize=2, sm_count=0, arch=(9, 0), direction="forward")
    with pytest.raises(ValueError, match="direction"):
        plan_row_norm(4, 4, itemsize=2, sm_count=1, arch=(9, 0), direction="sideways")


@pytest.mark.parametrize("heads,per_head", [(1, False), (3, False), (3, True), (40, True)])
def test_column_split_backward_covers_every_vector_and_column_once(heads, per_head):
    """Wide rows: each (vector, column) is folded by exactly one program, each program writes
    its own partial slot (of its head, with per-head weights), every slot is written."""
    for rows, cols, sm_count in ((1, 20000, 132), (7, 65536, 5), (100, 40000, 132)):
        p = plan_row_norm(rows, cols, heads=heads, per_head_weight=per_head, itemsize=2,
                          sm_count=sm_count, arch=(9, 0), direction="backward")
        assert p.column_split and p.tile_rows == p.tile_heads == 1
        assert p.grid == p.row_groups * heads * p.col_tiles
        assert_each_column_once(p)
        if per_head:
            for prog in range(p.grid):
                assert {t % heads for t in p.program_row_tiles(prog)} <= \
                    {prog // p.col_tiles % heads}, "one head per program"
        slots = {(p.partial_slot(q), q // p.col_tiles % heads, q % p.col_tiles)
                 for q in range(p.grid)}
        assert len(slots) == p.grid, "no two programs share a partial slot and column tile"
        expected_slots = p.row_groups if per_head else p.row_groups * heads
        assert p.partial_shape == (expected_slots, heads if per_head else 1, cols)
        assert {s for s, _, _ in slots} == set(range(expected_slots)), "every slot written"


def test_describe_names_tile_grid_and_partial_buffer():
    text = plan_row_norm(32768, 4096, itemsize=2, sm_count=132, arch=(9, 0),
                         direction="backward").describe()
    assert "tile 1x4096" in text and "persistent grid 264" in text, text
    assert "partial buffer 264x4096 fp32" in text


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_dependent_launch_from_hopper_on_and_only_for_whole_16_element_rows(direction):
    """Programmatic dependent launch needs sm_90; a row kernel takes it only when its rows are
    whole 16-element groups (a ragged row hung the backward, NOTES #25) of at most 8192 (wider
    backwards were slower, #30), the reduction always."""
    for arch, cols in itertools.product([(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)], COLS):
        p = plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=arch, direction=direction)
        hopper = arch >= (9, 0)
        assert p.dependent_launch == (hopper and cols % 16 == 0 and cols <= 8192), (arch, cols)
        assert p.dependent_reduce == (hopper and direction == "backward"), (arch, cols)
        assert ("programmatic dependent launch" in p.describe()) == p.dependent_launch


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_rows_far_from_a_power_of_two_split_into_two_pieces(direction, op):
    """5120 is 4096 + 1024 rather than 8192 with 3072 padding columns where the split measured
    faster: every backward from 2048-wide tiles, the RMSNorm forward from 8192. A row within a
    quarter of its power of two, several heads, or narrow rows keep the one padded tile."""
    def plan(cols, heads=1):
        return plan_row_norm(4096, cols, heads=heads, itemsize=2, sm_count=132, arch=(9, 0),
                             direction=direction, op=op)

    split_widths = {5120: (4096, 1024), 6144: (4096, 2048), 3000: (2048, 1024)}
    if direction == "forward":
        split_widths = {5120: (4096, 1024), 6144: (4096, 2048)} if op == "rms_norm" else {}
    for cols in (5120, 6144, 3000):
        pieces = (plan(cols).tile_cols, plan(cols).split_cols)
        assert pieces == split_widths.get(cols, (next_pow2(cols), 0)), (cols, pieces)
    for cols, heads in ((7168, 1), (8192, 1), (4096, 1), (1280, 4), (5120, 2), (1000, 1)):
        assert plan(cols, heads).split_cols == 0, (cols, heads)
    if 5120 in split_widths:
        assert "x4096+1024" in plan(5120).describe()
        hints = SINGLE_PASS_HINTS[direction][op]
        assert (plan(5120).occupancy, plan(5120).worker_warps) == next(
            h[1:3] for h in hints if h[0] >= 5120), "split rows take the hints of their span"


def test_every_architecture_has_settings_and_a_variant_plans_apart():
    """Blackwell takes Hopper's settings until measured; a settings variant (a tune round)
    plans with its own values, not with a cached plan of the default's."""
    import dataclasses

    for arch in ((9, 0), (10, 0), (12, 0)):
        assert settings_for(arch) is SM90
    wide_tiles = dataclasses.replace(SM90, tile_elements={"forward": 16384, "backward": 4096})
    default = plan_row_norm(4096, 1024, itemsize=2, sm_count=132, arch=(9, 0),
                            direction="forward")
    variant = plan_row_norm(4096, 1024, itemsize=2, sm_count=132, arch=(9, 0),
                            direction="forward", settings=wide_tiles)
    assert (default.tile_rows, variant.tile_rows) == (8, 16)


def test_cute_row_plans_take_even_rings_only():
    """The CuTe row kernels reduce consecutive rows in alternating shared-memory slots: an odd
    ring would put the last row and the next ring's first in one slot. Every table entry is
    even, in every device class's tables; an odd or single-row one is refused."""
    from tilenorm.planner import CuteRowPlan
    from tilenorm.settings import DEVICE_CLASSES
    from tilenorm.settings_fp8 import fp8_settings_for

    entries = []
    for device_class in DEVICE_CLASSES:
        fp8 = fp8_settings_for((9, 0), device_class)
        entries += list(fp8.cute_forward.values()) + list(fp8.cute_forward_fp8_input.values())
        entries += [e for table in fp8.cute_forward_fp8_input_scaling.values()
                    for e in table.values()]
        entries += [e for table in fp8.cute_forward_recompute_t.values()
                    for e in table.values()]
        entries += [e for table in settings_for((9, 0), device_class).cute_backward.values()
                    for e in table.values()]
    for threads, stages, ctas in entries:
        assert CuteRowPlan.of(4096, 4096, (threads, stages, ctas), 132).stages == stages
    for stages in (1, 3, 5):
        with pytest.raises(ValueError, match="even"):
            CuteRowPlan.of(4096, 4096, (128, stages, 4), 132)
