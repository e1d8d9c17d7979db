"""bench/bench_fp8.py without a GPU: the bytes each case must move, and how a record's
targets are judged (issue 19's bars) and plotted."""

from __future__ import annotations

import pytest

from bench import bench_fp8


def test_bytes_moved_counts_each_operand_once_and_x_twice_where_designed():
    m, n = 1024, 4096
    # row: x (bf16), q, one fp32 scale per row, rstd
    assert bench_fp8.bytes_moved(m, n, 2, "row", False) == (2 * m * n + m * n + 8 * m,) * 2
    # block: N / 128 scales a row; mx: N / 32 one-byte scales a row
    assert bench_fp8.bytes_moved(m, n, 2, "block", False)[0] == 3 * m * n + 4 * m * 32 + 4 * m
    assert bench_fp8.bytes_moved(m, n, 2, "mx", False)[0] == 3 * m * n + m * 128 + 4 * m
    # per-tensor current: one pass moves x once, the design reads it twice
    one, design = bench_fp8.bytes_moved(m, n, 2, "tensor", False)
    assert one == 3 * m * n + 4 + 4 * m and design == one + 2 * m * n
    # a transposed copy writes q twice, with its scales along M, and reads x twice
    one, design = bench_fp8.bytes_moved(m, n, 2, "row", True)
    assert one == 2 * m * n + 2 * m * n + 4 * m + 4 * n + 4 * m and design == one + 2 * m * n
    # FP8 x: one byte a value and an fp32 multiplier per group of the row
    one, _ = bench_fp8.bytes_moved(m, n, 1, "row", False, group=128)
    assert one == m * n + 4 * m * 32 + m * n + 4 * m + 4 * m


def test_every_case_reads_x_of_256_mb_at_the_default_shapes():
    # issue 19: x >= 256 MB; FP8 x takes twice the rows of bf16 x's shape
    for shape in bench_fp8.DEFAULT_SHAPES.split(","):
        m, n = map(int, shape.split("x"))
        for case, (_, _, group) in bench_fp8.CASES.items():
            rows = bench_fp8.case_rows(m, case)
            assert rows * n * (1 if group else 2) == 256 << 20, (case, shape)


def _row(case, provider, gbps, own_pct, ms):
    return {"op": f"rms_norm_fp8_{case}", "case": case, "M": 8, "N": 4096, "mode": "graph",
            "provider": provider, "fwd_gbps": gbps, "own_bound_pct": own_pct, "fwd_ms": ms}


@pytest.mark.parametrize("case, gbps, own_pct, met", [
    ("row", 3700, 80.0, True),         # one pass: 3700 / 4000 = 92.5% >= 90%
    ("tensor", 2000, 86.0, True),      # its own bound: 86% >= 85%
    ("tensor", 3000, 84.0, False),
    ("row+t", 2500, 81.0, True),       # the design's bytes: 81% >= 80%
    ("block", 3500, 99.0, False),      # one pass: 87.5% < 90%, whatever the design says
])
def test_targets_hold_each_case_to_its_bar(case, gbps, own_pct, met):
    record = {"copy_gbps": 4000.0, "rows": [
        _row(case, "tilenorm fused", gbps, own_pct, 1.0),
        _row(case, "tilenorm + torch", 1000, 25.0, 2.0)], "failures": []}
    (t,) = bench_fp8.judge_targets(record)
    assert t["met"] is met
    assert t["speedup_vs_unfused"] == pytest.approx(2.0) and t["speedup_met"]


def test_speedup_below_the_bar_is_missed_and_the_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    fused = {**_row("mx", "tilenorm fused", 3800, 95.0, 1.0),
             "kernel_us": {"RowNormFp8Forward": 600.0, "TransposedFp8Quantize": 400.0}}
    record = {"copy_gbps": 4000.0, "device": "test", "rows": [
        fused, _row("mx", "tilenorm + torch", 3000, 75.0, 1.2),
        _row("mx", "torch.compile", 2000, 50.0, 1.9)], "failures": []}
    (t,) = bench_fp8.judge_targets(record)
    assert t["met"] and not t["speedup_met"]
    record["targets"] = [t]
    bench_fp8.print_summary(record)
    # --kernel-times: each kernel's share of a fused call, in launch order
    assert ("tilenorm fused: us a call: RowNormFp8Forward 600.0, TransposedFp8Quantize "
            "400.0") in capsys.readouterr().out
    bench_fp8.plot(record, tmp_path / "fp8.png")
    assert (tmp_path / "fp8.png").stat().st_size > 0


def test_variants_take_the_cute_width_tables_from_json():
    """``--variants`` replaces a CuTe DSL width table (JSON keys are strings) with int widths
    and tuple entries, as the settings hold them, so that the planner finds them."""
    from tilenorm.planner import plan_cute_fp8_forward
    from tilenorm.settings_fp8 import measuring

    v = bench_fp8.fp8_variant({"cute_forward_fp8_input": {"4096": [256, 4, 2]},
                               "cute_forward_recompute_t": {"block": {"8192": [256, 2, 2]}}})
    assert v.cute_forward_fp8_input == {4096: (256, 4, 2)}
    assert v.cute_forward_recompute_t == {"block": {8192: (256, 2, 2)}}
    with measuring(v):
        p = plan_cute_fp8_forward(1024, 4096, itemsize=1, sm_count=132, arch=(9, 0),
                                  scaling="row", group=128)
    assert (p.threads, p.stages, p.ctas_per_sm) == (256, 4, 2)


def test_variants_take_the_cute_copy_tables_from_json():
    """The transposed copy's tile list and the column-amax widths arrive as nested JSON
    lists: tuples of tuples and of ints, as the settings hold them."""
    from tilenorm.planner import plan_cute_fp8_transpose
    from tilenorm.settings_fp8 import measuring

    v = bench_fp8.fp8_variant({"cute_transpose": [[64, 6], [32, 8]],
                               "cute_forward_column_amax": [2048]})
    assert v.cute_transpose == ((64, 6), (32, 8)) and v.cute_forward_column_amax == (2048,)
    with measuring(v):
        p = plan_cute_fp8_transpose(1040, 4096, itemsize=2, arch=(9, 0))
    assert (p.tile_cols, p.ctas_per_sm) == (64, 6)
