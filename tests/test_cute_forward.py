"""The CuTe DSL row-norm forward (tilenorm/kernels/cute_row_norm_forward.py): its plan, its
ahead-of-time build for Hopper and Blackwell, the decision that picks it, and (GPU) its outputs
against float64."""

import dataclasses

import pytest
import torch

import tilenorm
from tests.kernel_harness import (
    DGAMMA_TOL_FP32,
    H100,
    OUT_TOL,
    SMEM_PER_SM,
    SMEM_RESERVED,
    STAT_TOL,
    check_graph_replay_matches_eager,
    fresh_generator,
    poisoned,
    rel,
)
from tilenorm import dispatch
from tilenorm.device import device_info
from tilenorm.launch import cute
from tilenorm.planner import CuteForwardPlan, is_persistent, plan_cute_forward, plan_row_norm
from tilenorm.settings import (
    CLUSTER_SLICE_COLS,
    DEFAULT_DEVICE_CLASS,
    DEVICE_CLASSES,
    SM90,
    settings_for,
)
from tilenorm.testing import float64_norm

gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
CUTE_FORWARD = SM90.cute_forward
#: The default class's settings without its two-pass forward: the one-shot and cluster
#: entries it keeps for the H100 class, planned where the two-pass table has their widths.
ONE_SHOT_SM90 = dataclasses.replace(
    SM90, cute_forward_two_pass={op: {} for op in SM90.cute_forward})
#: Every class's table: the ahead-of-time builds cover each.
TABLES = {c: settings_for((9, 0), c).cute_forward for c in DEVICE_CLASSES}
WIDTHS = sorted({cols for t in TABLES.values() for widths in t.values() for cols in widths})
#: The narrowest width every class's table routes for every op (the H200 alone routes
#: RMSNorm's 512 and 1024).
SHARED = min(set.intersection(*(set(widths) for t in TABLES.values() for widths in t.values())))
OPS = sorted(CUTE_FORWARD)
#: (op, width) pairs the table routes.
ROUTED = [(op, cols) for op in OPS for cols in sorted(CUTE_FORWARD[op])]
#: (device class, op, width) of each distinct entry: the default class's, then those another
#: class's table has otherwise, planned with that class's table.
CLASS_ROUTED = [(DEFAULT_DEVICE_CLASS, op, cols) for op, cols in ROUTED] + [
    (c, op, cols) for c in DEVICE_CLASSES if c != DEFAULT_DEVICE_CLASS
    for op in OPS for cols in sorted(TABLES[c][op])
    if TABLES[c][op][cols] != CUTE_FORWARD[op].get(cols)]
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
#: Every class's table for 4-byte x (fp32), and its (device class, op, width) entries as
#: CLASS_ROUTED holds 2-byte x's.
TABLES_FP32 = {c: settings_for((9, 0), c).cute_forward_fp32 for c in DEVICE_CLASSES}
FP32_ROUTED = [(DEFAULT_DEVICE_CLASS, op, cols) for op in sorted(SM90.cute_forward_fp32)
               for cols in sorted(SM90.cute_forward_fp32[op])] + [
    (c, op, cols) for c in DEVICE_CLASSES if c != DEFAULT_DEVICE_CLASS
    for op in sorted(TABLES_FP32[c]) for cols in sorted(TABLES_FP32[c][op])
    if TABLES_FP32[c][op][cols] != SM90.cute_forward_fp32[op].get(cols)]


#: (op, width) pairs the table routes to the cluster forward: entries of four, (threads,
#: 1 row, CTAs per SM, cluster).
CLUSTER_ROUTED = [(op, cols) for op, cols in ROUTED if len(CUTE_FORWARD[op][cols]) == 4]
#: (op, width) pairs the table routes to the persistent cluster forward: entries of five,
#: (threads, rows a group, CTAs an SM, cluster, ring of row groups).
PERSISTENT_ROUTED = [(op, cols) for op, cols in ROUTED if is_persistent(CUTE_FORWARD[op][cols])]
#: Clusters the planner is told a device holds at once, in plans made without a device.
RESIDENT_CLUSTERS = 31


def _resident(cluster, threads, ctas_per_sm):
    return RESIDENT_CLUSTERS


@pytest.mark.parametrize("rows", [1, 2, 3, 131, 264, 265, 1023, 32768, 100003])
def test_plan_gives_every_row_to_one_cta_or_cluster(rows):
    """One-shot entries a CTA or cluster a row group; persistent ones (a fifth element) the
    row groups over the clusters resident at once, or one a group where they are fewer (the
    two-pass forward, a row a CTA, aside: test_a_two_pass_entry_takes_its_width_one_row_a_cta)."""
    for op, widths in CUTE_FORWARD.items():
        for cols, (threads, rows_per_cta, ctas, *rest) in widths.items():
            if rows * cols > 2**31:
                continue  # past 32-bit offsets: no plan (test_plan_only_where_measured)
            cluster = rest[0] if rest else 1
            stages = rest[1] if len(rest) > 1 else 0
            p = plan_cute_forward(rows, cols, itemsize=2, arch=(9, 0), op=op,
                                  settings=ONE_SHOT_SM90, resident_clusters=_resident)
            assert (p.threads, p.rows_per_cta, p.ctas_per_sm, p.cluster, p.stages) == (
                threads, rows_per_cta, ctas, cluster, stages)
            groups = -(-rows // rows_per_cta)
            assert p.grid == (min(groups, RESIDENT_CLUSTERS) if stages else groups) * cluster
            seen = sorted(r for cta in range(0, p.grid, cluster) for r in p.program_rows(cta))
            assert seen == list(range(rows))
            assert all(len(p.program_rows(cta)) for cta in range(p.grid)), "no idle CTA"
            for cta in range(p.grid):  # a cluster's CTAs share its rows
                assert p.program_rows(cta) == p.program_rows(cta - cta % cluster)


def test_cluster_entries_split_a_row_into_equal_slices():
    """The cluster forward covers the widths one CTA cannot hold whole (#75) and those where
    it measured faster than one CTA (RMSNorm's 16384 and 32768, #95, #98; 12288, #106):
    each CTA of 256 threads holds an equal slice of at most 16384 columns, 4 CTAs an SM, one
    or two rows a cluster. LayerNorm's from 32768 run the persistent cluster forward (#125):
    slices of at most 16384 columns too, each entry one the GPU tests run
    (``PERSISTENT_ENTRIES``)."""
    assert set(CLUSTER_ROUTED) == {("rms_norm", 12288), ("layer_norm", 12288),
                                   ("rms_norm", 16384), ("rms_norm", 32768),
                                   ("rms_norm", 65536), ("rms_norm", 131072)}
    for op, cols in CLUSTER_ROUTED:
        threads, rows, ctas, cluster = CUTE_FORWARD[op][cols]
        assert (threads, ctas) == (256, 4) and rows in (1, 2), (op, cols)
        assert cols % cluster == 0 and cols // cluster <= CLUSTER_SLICE_COLS, (op, cols)
    assert set(PERSISTENT_ROUTED) == {("layer_norm", 32768), ("layer_norm", 65536),
                                      ("layer_norm", 131072)}
    for op, cols in PERSISTENT_ROUTED:
        entry = CUTE_FORWARD[op][cols]
        assert (cols, entry) in PERSISTENT_ENTRIES, (op, cols)
        assert cols % entry[3] == 0 and cols // entry[3] <= CLUSTER_SLICE_COLS, (op, cols)


def test_a_cluster_of_several_rows_takes_each_row_once():
    """With ``rows_per_cta`` R a cluster holds R rows: the grid covers every row once, a
    short last group included."""
    plan = CuteForwardPlan.of(11, 65536, (256, 2, 3, 4))
    assert (plan.grid, plan.cluster, plan.rows_per_cta) == (24, 4, 2)
    taken = [r for program in range(0, plan.grid, plan.cluster)
             for r in plan.program_rows(program)]
    assert taken == list(range(11))
    assert all(plan.program_rows(p) == plan.program_rows(p - p % 4) for p in range(plan.grid))
    assert "2 rows across a cluster of 4 CTAs" in plan.describe()


#: Entries of the persistent cluster forward, the H200 table's and the others measured
#: (bench/NOTES.md #101, #123, #125): (threads, rows a group, CTAs an SM, cluster, ring of
#: row groups), LayerNorm's fp32 parameters staged once: (cols, entry).
PERSISTENT_ENTRIES = [(32768, (256, 1, 2, 4, 2)), (65536, (256, 1, 2, 8, 2)),
                      (131072, (256, 1, 1, 8, 3)), (32768, (256, 1, 1, 2, 3)),
                      (65536, (256, 2, 1, 8, 3)), (131072, (256, 1, 1, 8, 2))]


@pytest.mark.parametrize("rows", [1, 3, 131, 1023, 100003])
@pytest.mark.parametrize(("cols", "entry"), PERSISTENT_ENTRIES, ids=str)
def test_a_persistent_plan_takes_each_row_once_in_resident_clusters(rows, cols, entry):
    """The persistent plan: the clusters the device holds at once (or fewer, one a row
    group), every row to one cluster, a cluster's CTAs sharing their rows; its entry
    round-trips; a residual call runs the one-shot cluster forward."""
    from tilenorm.planner import residual_entry

    plan = CuteForwardPlan.of(rows, cols, entry, 31)
    threads, group, ctas, cluster, _ = entry
    assert plan.persistent and plan.entry == entry
    assert plan.grid // cluster == min(-(-rows // group), 31)
    taken = sorted(r for p in range(0, plan.grid, cluster) for r in plan.program_rows(p))
    assert taken == list(range(rows))
    assert all(plan.program_rows(p) == plan.program_rows(p - p % cluster)
               for p in range(plan.grid))
    assert "persistent" in plan.describe()
    assert residual_entry(cols, entry) == (256, 1, 4, cols // CLUSTER_SLICE_COLS)


def test_a_persistent_plan_refuses_what_the_kernel_cannot_run():
    """A persistent entry names its ring of row groups, a count: #101's ``True`` is none."""
    with pytest.raises(ValueError, match="co-resident"):
        CuteForwardPlan.of(100, 65536, (256, 1, 2, 8, 2))
    for entry in ((256, 1, 2, 8, True), (256, 1, 2, 8, 0), (256, 1, 2, 1, 2)):
        with pytest.raises(ValueError, match="a ring of 1 or more row groups"):
            CuteForwardPlan.of(100, 65536, entry, 30)


def test_the_planner_sizes_a_persistent_grid_by_the_clusters_the_device_holds():
    """plan_cute_forward asks ``resident_clusters`` for a persistent entry's shape only (the
    H200's LayerNorm at 65536; the H100's one-shot entry there asks nothing), and leaves the
    row to another forward where the device holds none of its clusters."""
    cols = 65536
    entry = CUTE_FORWARD["layer_norm"][cols]
    assert is_persistent(entry)
    asked = []

    def resident(cluster, threads, ctas):
        asked.append((cluster, threads, ctas))
        return 29

    kwargs = dict(itemsize=2, arch=(9, 0), op="layer_norm")
    plan = plan_cute_forward(4096, cols, resident_clusters=resident, **kwargs)
    assert plan.persistent and plan.grid == 29 * entry[3] and plan.entry == entry
    assert asked == [(entry[3], entry[0], entry[2])]
    assert plan_cute_forward(4096, cols, resident_clusters=lambda *shape: 0, **kwargs) is None
    plan_cute_forward(4096, 12288, resident_clusters=resident, **kwargs)  # one-shot entry
    plan = plan_cute_forward(4096, cols, resident_clusters=resident, device_class="h100",
                             **kwargs)
    assert not plan.persistent and len(asked) == 1


@needs_cute
@pytest.mark.parametrize(("cols", "entry"), PERSISTENT_ENTRIES, ids=str)
def test_a_persistent_entry_fits_its_ctas_in_shared_memory(cols, entry):
    """The ring of row groups of x's slices, LayerNorm's fp32 weight and bias staged: the
    entry's CTAs an SM fit."""
    import cutlass

    from tilenorm.kernels.cute_cluster_norm_forward import PersistentClusterRowNormForward

    threads, group, ctas, cluster, stages = entry
    kernel = PersistentClusterRowNormForward(cutlass.BFloat16, cutlass.Float32, cols, threads,
                                             group, cluster, stages, ctas, True, True, False)
    assert (kernel.shared_bytes() + SMEM_RESERVED) * ctas <= SMEM_PER_SM


@needs_cute
def test_every_cluster_entry_fits_its_ctas_in_shared_memory():
    """Each class's cluster entries fit their CTAs an SM in shared memory (x's slices of the
    entry's rows staged, LayerNorm with fp32 parameters), or the launch would hold fewer
    than the compile kept registers for. A residual doubles what is staged: at the 4 CTAs an
    SM of one row a cluster 3 fit (the kernel module's docstring)."""
    import cutlass

    from tilenorm.kernels.cute_cluster_norm_forward import ClusterRowNormForward

    tables = [(cutlass.BFloat16, t) for t in TABLES.values()]
    tables += [(cutlass.Float32, t) for t in TABLES_FP32.values()]
    for dtype, table in tables:
        for op, widths in table.items():
            for cols, entry in widths.items():
                if len(entry) != 4:
                    continue
                threads, rows, ctas, cluster = entry
                layer_norm = op == "layer_norm"
                kernel = ClusterRowNormForward(
                    dtype, cutlass.Float32, cols, threads, rows, cluster, ctas,
                    layer_norm, layer_norm, False, False)
                assert (kernel.shared_bytes() + SMEM_RESERVED) * ctas <= SMEM_PER_SM, (
                    op, cols, entry)


@pytest.mark.parametrize(("device_class", "op", "cols"), CLASS_ROUTED)
def test_decision_names_the_kernel_it_launches(device_class, op, cols):
    """The decision (``explain``'s text) names the two-pass forward where the class's two-pass
    table has the width, the cluster forward where a row spans a cluster (the persistent one
    too, its plan saying so), RowNormForward elsewhere; the key a call compiles carries the
    cluster and the ring."""
    rows = 1000
    kwargs = dict(itemsize=2, sm_count=132, arch=(9, 0), op=op)
    plan = plan_cute_forward(rows, cols, itemsize=2, arch=(9, 0), op=op,
                             device_class=device_class, resident_clusters=_resident)
    decision = dispatch.Decision(
        op=op, reason="", family=dispatch.CUTILE_NORM, device=H100,
        forward=plan_row_norm(rows, cols, direction="forward", **kwargs),
        backward=plan_row_norm(rows, cols, direction="backward", **kwargs),
        cute_forward=plan)
    two_pass = settings_for((9, 0), device_class).cute_forward_two_pass[op].get(cols)
    entry = two_pass or TABLES[device_class][op][cols]
    cluster = two_pass is None and len(entry) >= 4
    name = (dispatch.CUTE_TWO_PASS_FORWARD_NAME if two_pass else
            dispatch.CUTE_CLUSTER_FORWARD_NAME if cluster else dispatch.CUTE_FORWARD_NAME)
    assert decision.kernels[0] == name and bool(plan.step) == bool(two_pass)
    others = {dispatch.CUTE_FORWARD_NAME, dispatch.CUTE_CLUSTER_FORWARD_NAME,
              dispatch.CUTE_TWO_PASS_FORWARD_NAME} - {name}
    assert not others & set(decision.kernels)
    assert f"kernels:  {name}" in str(decision) and f"x's dtype, {name}:" in str(decision)
    assert ("cluster" in plan.describe()) == cluster
    assert ("persistent" in plan.describe()) == is_persistent(entry)
    key = cute.ForwardKey.of(plan, "bfloat16", "bfloat16", False, op == "layer_norm", False,
                             False)
    assert key.cluster == (entry[3] if cluster else 1)
    assert key.rows_per_cta == entry[1]
    assert key.stages == (entry[4] if is_persistent(entry) else 0)


def test_plan_only_where_measured():
    cols = SHARED

    def plan(rows=100, cols=cols, itemsize=2, op=OPS[0], **kw):
        return plan_cute_forward(rows, cols, itemsize=itemsize, arch=(9, 0), op=op, **kw)

    assert plan() and plan(op="layer_norm")
    assert plan(cols=cols + 8) is None
    assert plan(cols=min(WIDTHS) // 2) is None
    assert plan(itemsize=4).entry == plan(cols=2 * cols).entry, "2-byte x's of twice the width"
    assert plan(itemsize=4, cols=3072) is None, "a width the fp32 table does not list"
    assert plan(itemsize=1) is None and plan(itemsize=8) is None
    assert plan(heads=2) is None
    assert plan(rows=0) is None
    rows = 2**31 // cols
    assert plan(rows=rows)
    assert plan(rows=rows + 1) is None
    assert plan(rows=10, max_offset=2**31) is None


#: Rows of the shared narrowest width whose bf16 x is the smallest the CuTe forward takes.
MIN_ROWS = dispatch.CUTE_FORWARD_MIN_BYTES // (2 * SHARED)


@needs_cute
def test_decision_picks_it_only_for_its_dtypes_sizes_and_when_allowed(monkeypatch):
    cols = SHARED
    last = MIN_ROWS * cols - 1

    def pick(dtypes, max_offset=last, allow=True, op="rms_norm", rows=MIN_ROWS):
        p = dispatch.Problem(op, "cuda", 0, dtypes, rows, 1, cols, False, max_offset, allow)
        return dispatch._cute_forward(p, H100)

    assert pick(("bfloat16", "float32"))
    assert pick(("bfloat16",), rows=MIN_ROWS - 1) is None, "a small x keeps the C++ path"
    assert pick(("float16", "float16", "float16"), op="layer_norm")
    assert pick(("bfloat16", "float16")) is None
    assert pick(("float32", "float32"))
    assert pick(("float32", "bfloat16")) is None, "parameters in x's dtype or fp32"
    assert pick(("bfloat16",), max_offset=2**31) is None
    monkeypatch.setattr(dispatch.validation, "is_stable", lambda family: False)
    assert pick(("bfloat16",), allow=False) is None
    assert pick(("bfloat16",), allow=True)


def test_forward_kernel_takes_it_only_where_the_call_allows():
    cols = SHARED
    decision = dispatch.Decision(
        op="rms_norm", reason="", family=dispatch.CUTILE_NORM,
        forward=plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                              direction="forward", op="rms_norm"),
        backward=plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                               direction="backward", op="rms_norm"),
        cute_forward=plan_cute_forward(1000, cols, itemsize=2, arch=(9, 0), op="rms_norm"))
    plain = dict(same_dtypes=True, bias_without_weight=False, dense=True, residual=False)
    assert dispatch.forward_kernel(decision, dispatch.ForwardFacts(**plain)) \
        is decision.cute_forward
    for change in (dict(same_dtypes=False), dict(bias_without_weight=True),
                   dict(dense=False)):
        facts = dispatch.ForwardFacts(**{**plain, **change})
        assert dispatch.forward_kernel(decision, facts) is decision.forward, change
    assert dispatch.cute_forward_name(decision.cute_forward) in decision.kernels


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_a_residual_call_takes_one_row_a_cluster_where_the_table_holds_several(device_class):
    """Every class's entries of several rows a cluster, and its persistent entries (which
    take no residual), run a residual call at one row a one-shot cluster of 16384-column
    slices (#95), a variant the ahead-of-time builds hold, and so do its two-pass entries
    whose rows and residual rows overflow L1 (#138); a call without one, and every other
    entry, runs the table's plan, whose variant they hold too."""
    keys = set(cute.aot_forward_keys(all_dtypes=True))
    for op, widths in TABLES[device_class].items():
        for cols in widths:
            plan = plan_cute_forward(1000, cols, itemsize=2, arch=(9, 0), op=op,
                                     device_class=device_class, resident_clusters=_resident)
            row_plans = {d: plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                          direction=d, op=op) for d in ("forward", "backward")}
            decision = dispatch.Decision(
                op=op, reason="", family=dispatch.CUTILE_NORM, device=H100,
                forward=row_plans["forward"], backward=row_plans["backward"], cute_forward=plan)
            facts = dispatch.ForwardFacts.of("bfloat16", "bfloat16", "bfloat16", None,
                                             "bfloat16", "bfloat16", dense=True)
            assert facts.residual
            chosen = dispatch.forward_kernel(decision, facts)
            assert dispatch.forward_kernel(decision, dataclasses.replace(
                facts, residual=False)) is plan
            if plan.persistent or plan.cluster > 1 and plan.rows_per_cta > 1 or (
                    plan.step and plan.with_residual() != plan):
                assert (chosen.rows_per_cta, chosen.cluster, chosen.threads,
                        chosen.persistent) == (1, cols // 16384, 256, False), (op, cols)
                assert chosen.grid == 1000 * chosen.cluster
                assert f"forward with a fused residual: {chosen.describe()}" in str(decision)
            else:
                assert chosen is plan and "fused residual:" not in str(decision)
            key = cute.ForwardKey.of(chosen, "bfloat16", "bfloat16", False,
                                     op == "layer_norm", False, True)
            assert key in keys, key
            key = cute.ForwardKey.of(plan, "bfloat16", "bfloat16", False,
                                     op == "layer_norm", False, False)
            assert key in keys, key


def test_call_facts_take_the_kernel_only_for_what_it_runs():
    """The operand facts a prepared forward derives (``calls.forward_facts``): the CuTe DSL
    forward runs y, h and the parameters in x's dtype (parameters also fp32), contiguous x and
    residual, a bias only with a weight of its dtype."""
    from tilenorm.pytorch.calls import forward_facts

    bf16, fp32 = torch.bfloat16, torch.float32
    x = torch.randn(4, 64, dtype=bf16)
    r = torch.randn(4, 64, dtype=bf16)
    w = torch.randn(64, dtype=bf16)

    def runs(x=x, w=w, b=None, r=None, out=bf16, h=None, copies=False):
        h = h if h is not None else (None if r is None else r.dtype)
        facts = forward_facts(x, w, b, r, out, h, copies)
        return facts.same_dtypes and facts.dense and not facts.bias_without_weight

    assert runs()
    assert runs(r=r) and runs(w=w.float()) and runs(w=w.float(), b=w.float())
    assert runs(w=None) and runs(w=w[::2].repeat(2)), "a weight is copied if need be"
    assert not runs(out=fp32), "autocast's fp32 y"
    assert not runs(r=r.float()) and not runs(r=r, h=fp32), "an fp32 residual stream"
    assert not runs(w=w.half()) and not runs(b=w.float()), "other parameter dtypes"
    assert not runs(w=None, b=w), "a bias without a weight"
    assert not runs(x=torch.randn(64, 4, dtype=bf16).t()), "strided x"
    assert not runs(r=torch.randn(64, 4, dtype=bf16).t()), "a transposed residual"
    assert not runs(r=torch.randn(1, 64, dtype=bf16).expand(4, 64)), "a broadcast residual"
    assert not runs(copies=True)


def test_kernel_refuses_what_it_cannot_run():
    if not cute.available():
        pytest.skip("CuTe DSL not installed")
    import cutlass

    from tilenorm.kernels.cute_row_norm_forward import RowNormForward

    bf16 = cutlass.BFloat16
    with pytest.raises(ValueError, match="vectors"):
        RowNormForward(bf16, bf16, 4100, 128, 2, 4, False, False, False, False)
    with pytest.raises(ValueError, match="rows_per_cta"):
        RowNormForward(bf16, bf16, 4096, 128, 0, 4, False, False, False, False)
    with pytest.raises(ValueError, match="needs a weight"):
        RowNormForward(bf16, None, 4096, 128, 2, 4, True, True, False, False)
    with pytest.raises(ValueError, match="needs a weight"):
        RowNormForward(bf16, None, 4096, 128, 2, 4, False, False, True, False)


def test_cluster_kernel_refuses_what_it_cannot_run():
    if not cute.available():
        pytest.skip("CuTe DSL not installed")
    import cutlass

    from tilenorm.kernels.cute_cluster_norm_forward import ClusterRowNormForward

    bf16 = cutlass.BFloat16
    features = (False, False, False, False)
    assert ClusterRowNormForward(bf16, bf16, 65536, 256, 1, 4, 4, *features).reps == 8
    with pytest.raises(ValueError, match="slices"):
        ClusterRowNormForward(bf16, bf16, 65536, 256, 1, 3, 4, *features)
    with pytest.raises(ValueError, match="slices"):
        ClusterRowNormForward(bf16, bf16, 65536 + 2048, 256, 1, 8, 4, *features)
    with pytest.raises(ValueError, match="rows_per_cta"):
        ClusterRowNormForward(bf16, bf16, 65536, 256, 0, 4, 4, *features)
    with pytest.raises(ValueError, match="needs a weight"):
        ClusterRowNormForward(bf16, None, 65536, 256, 1, 4, 4, True, True, False, False)


@pytest.mark.aot
@needs_cute
def test_every_variant_builds_for_hopper_and_blackwell(tmp_path):
    """Every variant builds for both architectures; the cluster forwards' (x staged in
    shared memory, 64 registers a thread at 4 CTAs an SM; the persistent one's ring) spill
    nothing on sm_90a: every one of them is routed, none restricted (cuobjdump, where
    installed)."""
    from bench.kernel_resources import cubin_resources, find_cuobjdump

    tool = find_cuobjdump()
    keys = cute.aot_forward_keys(all_dtypes=True)
    assert {k.cols for k in keys} == set(WIDTHS) | {
        cols for t in TABLES_FP32.values() for widths in t.values() for cols in widths}
    for dtypes, tables in ((("bfloat16", "float16"), TABLES), (("float32",), TABLES_FP32)):
        for persistent in (False, True):
            assert {(op, k.cols) for k in keys if k.persistent == persistent
                    and k.cluster > 1 and not k.has_residual and k.dtype in dtypes
                    for op in ["layer_norm" if k.layer_norm else "rms_norm"]} == {
                (op, cols) for t in tables.values() for op, widths in t.items()
                for cols, entry in widths.items()
                if len(entry) >= 4 and is_persistent(entry) == persistent}
    for i, key in enumerate(keys):
        for arch in cute.AOT_ARCHS:
            cubins = tmp_path / f"{i}-{arch}"
            keep = str(cubins) if tool and key.cluster > 1 and arch == "sm_90a" else None
            assert callable(cute.compile_forward(key, arch, cubin_dir=keep)), (key, arch)
            if keep:
                found = cubin_resources(next(cubins.rglob("*.cubin")), tool)[0]
                assert found["spill_stores"] == found["spill_loads"] == found["stack"] == 0, (
                    key, found)


#: Every feature set of the persistent cluster forward, at each of its entries.
PERSISTENT_VARIANTS = [
    cute.ForwardKey("bfloat16", w, bias, op == "layer_norm", offset, False, cols,
                    *entry)
    for cols, entry in PERSISTENT_ENTRIES
    for op, w, bias, offset in (("layer_norm", "float32", True, False),
                                ("layer_norm", "bfloat16", True, False),
                                ("layer_norm", None, False, False),
                                ("rms_norm", "float32", False, False),
                                ("rms_norm", "bfloat16", False, True),
                                ("rms_norm", None, False, False))]


@pytest.mark.aot
@needs_cute
def test_persistent_variants_build_for_hopper_and_blackwell_without_spills(tmp_path):
    from bench.kernel_resources import cubin_resources, find_cuobjdump

    tool = find_cuobjdump()
    for i, key in enumerate(PERSISTENT_VARIANTS):
        for arch in cute.AOT_ARCHS:
            cubins = tmp_path / f"{i}-{arch}"
            keep = str(cubins) if tool and arch == "sm_90a" else None
            assert callable(cute.compile_forward(key, arch, cubin_dir=keep)), (key, arch)
            if keep:
                found = cubin_resources(next(cubins.rglob("*.cubin")), tool)[0]
                assert found["spill_stores"] == found["spill_loads"] == found["stack"] == 0, (
                    key, found)


class _Lanes:
    """A value in each of a warp's 32 lanes, for tracing the lane combine on a CPU."""

    def __init__(self, items):
        self.items = list(items)

    def _map(self, other, op):
        others = other.items if isinstance(other, _Lanes) else [other] * len(self.items)
        return _Lanes(op(a, b) for a, b in zip(self.items, others, strict=True))

    def __add__(self, other):
        return self._map(other, lambda a, b: a + b)

    def __mul__(self, other):
        return self._map(other, lambda a, b: a * b)

    def __mod__(self, other):
        return self._map(other, lambda a, b: a % b)


class _Sum(tuple):
    """A term of a sum, by its tree: ``a + b`` is ``("+", a, b)``, not a number."""

    def __add__(self, other):
        return _Sum(("+", self, other))


@needs_cute
@pytest.mark.parametrize(("cols", "entry"), PERSISTENT_ENTRIES, ids=str)
def test_the_lane_combine_adds_the_one_shot_kernels_tree(cols, entry, monkeypatch):
    """The persistent kernel's combine (``_lane_sum`` ranked), traced over a warp's lanes
    with every shuffle reading its source lane, gives every lane the very tree of adds the
    one-shot kernel's ``_fixed_order_sum`` builds: the same bits from the same slots."""
    import cutlass
    import cutlass.cute as dsl

    from tilenorm.kernels.cute_cluster_norm_forward import PersistentClusterRowNormForward

    threads, group, ctas, cluster, stages = entry
    kernel = PersistentClusterRowNormForward(cutlass.BFloat16, cutlass.Float32, cols, threads,
                                             group, cluster, stages, ctas, True, True, False)
    monkeypatch.setattr(dsl.arch, "shuffle_sync",
                        lambda value, lane: _Lanes([value.items[lane]] * len(value.items)))
    tree = kernel._fixed_order_sum(lambda slot: _Sum(("slot", slot)))
    traced = kernel._lane_sum(lambda slots: _Lanes(_Sum(("slot", s)) for s in slots.items),
                              _Lanes(range(32)), ranked=True)
    assert all(lane == tree for lane in traced.items)
    assert str(tree).count("slot") == cluster * kernel.warps


class _Op(tuple):
    """A value by the operations that made it: ``a * b`` is ``("*", a, b)``."""

    def __mul__(self, other):
        return _Op(("*", self, other))

    def __add__(self, other):
        return _Op(("+", self, other))


class _Param:
    """A parameter vector in registers or shared memory, for tracing ``_affine``: what it
    loads is ``_Op((name,))``."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, index):
        return self

    def load(self):
        return self

    def to(self, dtype):
        return _Op((self.name,))


def _adds_of_two_products(value) -> list:
    """``value``'s adds whose operands are both products: a compiler fuses either one."""
    if not isinstance(value, _Op) or len(value) < 2:
        return []
    products = [a for a in value[1:] if isinstance(a, _Op) and a[0] == "*"]
    found = [value] if value[0] == "+" and len(products) == 2 else []
    return found + [add for a in value[1:] for add in _adds_of_two_products(a)]


@needs_cute
@pytest.mark.parametrize("key", PERSISTENT_VARIANTS[:6], ids=lambda key: _variant_id(key))
def test_both_cluster_forwards_leave_y_no_add_of_two_products(key, monkeypatch):
    """y's affine step (``_affine``), traced on a CPU for each feature set in the one-shot
    and the persistent kernel: with the offset one explicit ``fma(n, w, n * offset)``, no
    add of two products left for a compiler to fuse either one of (from ``n * w + n *
    offset`` the two kernels' sm_90a compiles fuse different ones, and their y differs in
    the last bit: the GPU's bit-for-bit test)."""
    import cutlass
    import cutlass.cute as dsl

    from tilenorm.kernels.cute_cluster_norm_forward import (
        ClusterRowNormForward,
        PersistentClusterRowNormForward,
    )

    monkeypatch.setattr(dsl.math, "fma", lambda a, b, c: _Op(("fma", a, b, c)))
    dtypes = {None: None, "bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}
    w_dtype = dtypes[key.weight_dtype]
    features = (key.layer_norm, key.has_bias, key.has_offset)
    kernels = [ClusterRowNormForward(cutlass.BFloat16, w_dtype, key.cols, key.threads,
                                     key.rows_per_cta, key.cluster, key.ctas_per_sm,
                                     *features, False),
               PersistentClusterRowNormForward(cutlass.BFloat16, w_dtype, key.cols,
                                               key.threads, key.rows_per_cta, key.cluster,
                                               key.stages, key.ctas_per_sm, *features)]
    n, w, b, offset = _Op(("n",)), _Op(("w",)), _Op(("b",)), _Op(("offset",))
    if key.weight_dtype is None:
        expected = n
    elif key.has_offset:
        expected = _Op(("fma", n, w, n * offset))
    else:
        expected = n * w + b if key.has_bias else n * w
    for kernel in kernels:
        y = type(kernel)._affine.__wrapped__(kernel, n, 0, _Param("w"), _Param("w"),
                                            _Param("b"), offset)
        assert y == expected, type(kernel).__name__
        assert not _adds_of_two_products(y)


def test_the_persistent_kernel_takes_no_residual():
    key = dataclasses.replace(PERSISTENT_VARIANTS[0], has_residual=True)
    with pytest.raises(ValueError, match="no residual"):
        cute.compile_forward(key, "sm_90a")


# --- GPU --------------------------------------------------------------------------------


def check_forward(m, n, op="rms_norm", dtype=torch.bfloat16, w_dtype=torch.bfloat16,
                  has_weight=True, has_bias=False, has_residual=False, offset=0.0,
                  x_mean=None, device_class=DEFAULT_DEVICE_CLASS, entry=None, two_pass=None):
    """The kernel on poisoned outputs against float64: every element of y, h, mean and rstd
    written and accurate, a rerun bit-identical. x is standard normal plus ``x_mean``, a
    number (default 0.5 for LayerNorm, 0 for RMSNorm) or a tensor of one a column. The
    kernel is ``device_class``'s table entry, whatever this GPU's class, or ``entry`` (a
    table entry's tuple) where given, or the two-pass forward of entry ``two_pass``."""
    from tilenorm.device import device_info, max_active_clusters

    layer_norm = op == "layer_norm"
    eps = 1e-5 if layer_norm else 1e-6
    g, seed = fresh_generator("cuda")
    if x_mean is None:
        x_mean = 0.5 if layer_norm else 0.0
    x = (torch.randn(m, n, generator=g, device="cuda") + x_mean).to(dtype)
    r = torch.randn(m, n, generator=g, device="cuda").to(dtype) if has_residual else None
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(w_dtype) if has_weight \
        else None
    b = torch.randn(n, generator=g, device="cuda").to(w_dtype) if has_bias else None
    info = device_info(torch.cuda.current_device())
    resident = (max_active_clusters(info.index, entry[3], entry[0], entry[2])
                if entry is not None and is_persistent(entry) else None)
    plan = (CuteForwardPlan.of(m, n, entry, resident) if entry is not None else
            CuteForwardPlan.two_pass(m, n, two_pass) if two_pass is not None else
            plan_cute_forward(m, n, itemsize=dtype.itemsize, arch=info.arch, op=op,
                              device_class=device_class,
                              resident_clusters=lambda *shape: max_active_clusters(
                                  info.index, *shape)))
    if has_residual and entry is None and two_pass is None:
        plan = plan.with_residual()  # the plan a residual call runs (dispatch.forward_kernel)
    fn = cute.compiled_forward(cute.ForwardKey.of(
        plan, NAMES[dtype], None if w is None else NAMES[w.dtype], has_bias, layer_norm,
        offset != 0, has_residual), torch.cuda.get_device_capability())
    runs = []
    for _ in range(2):
        y = poisoned((m, n), dtype)
        h = poisoned((m, n), dtype) if has_residual else None
        mean = poisoned((m,), torch.float32) if layer_norm else None
        rstd = poisoned((m,), torch.float32)
        fn(x, r, w, b, y, h, mean, rstd, eps, offset, plan.grid)
        torch.cuda.synchronize()
        runs.append([t for t in (y, h, mean, rstd) if t is not None])
    for got, again in zip(*runs, strict=True):
        assert not got.isnan().any(), f"every element written (seed {seed})"
        assert torch.equal(got, again), f"rerun bit-identical (seed {seed})"
    y, *rest = runs[0]
    ref = float64_norm(x, w, b, eps, layer_norm=layer_norm, offset=offset, residual=r)
    # A bf16/fp16 residual stream rounds h, which the statistics then describe.
    stat_tol = OUT_TOL[dtype] if has_residual else STAT_TOL
    assert rel(y, ref.y) <= OUT_TOL[dtype], seed
    if has_residual:
        assert torch.equal(rest.pop(0), (x.float() + r.float()).to(dtype)), seed
    if layer_norm:
        assert rel(rest.pop(0), ref.mean) <= stat_tol, seed
    assert rel(rest.pop(0), ref.rstd) <= stat_tol, seed


#: Elements of the largest x the GPU tests take: their float64 reference of 32769 x 32768
#: beside the other workers' tests ran out of an 80 GB GPU (bench/NOTES.md #65).
MAX_TEST_ELEMENTS = 8193 * 32768


@gpu
@needs_cute
@pytest.mark.parametrize(("device_class", "op", "n"), CLASS_ROUTED)
@pytest.mark.parametrize("m", [1, 3, 1000, 8193])
def test_matches_float64(m, device_class, op, n):
    check_forward(min(m, MAX_TEST_ELEMENTS // n), n, op, device_class=device_class)


@gpu
@needs_cute
@pytest.mark.parametrize(("device_class", "op", "n"), FP32_ROUTED)
@pytest.mark.parametrize("m", [3, 1000])
def test_fp32_matches_float64(m, device_class, op, n):
    """fp32 x and parameters at every entry of the fp32 table, LayerNorm with a bias."""
    check_forward(min(m, MAX_TEST_ELEMENTS // (2 * n)), n, op, dtype=torch.float32,
                  w_dtype=torch.float32, has_bias=op == "layer_norm",
                  device_class=device_class)


#: Elements of x in a cluster variant's test: 255 rows at 131072 (4 waves of resident
#: clusters). 1023 rows there (11 GB with the float64 reference) beside the large tests of
#: other workers ran out of an 80 GB GPU.
CLUSTER_TEST_ELEMENTS = 1 << 25

#: Every bf16 and fp32 variant the cluster forward's entries build
#: (:func:`cute.aot_forward_keys`).
CLUSTER_VARIANTS = [k for k in cute.aot_forward_keys() if k.cluster > 1]


def _variant_id(key) -> str:
    op = "layer_norm" if key.layer_norm else "rms_norm"
    return (f"{op}-{key.dtype}-{key.cols}-w_{key.weight_dtype}" + "-bias" * key.has_bias
            + "-offset" * key.has_offset + "-residual" * key.has_residual
            + f"-{key.rows_per_cta}x{key.cluster}" + f"-ring{key.stages}" * key.persistent)


@gpu
@needs_cute
@pytest.mark.parametrize("key", CLUSTER_VARIANTS, ids=_variant_id)
def test_cluster_forward_variants_match_float64(key):
    """Every variant of every class's cluster entries, as built (a residual's at the entry
    a residual call runs), on a row count that is no multiple of anything (2^k - 1) and
    spans several waves of resident clusters (at most 132 SMs x 4 CTAs / cluster of them: 66
    at 131072): a cluster's CTAs share their row's statistics, every slice written, reruns
    bit-identical."""
    names = {v: k for k, v in NAMES.items()}
    check_forward(min(1023, CLUSTER_TEST_ELEMENTS // key.cols - 1), key.cols,
                  "layer_norm" if key.layer_norm else "rms_norm", dtype=names[key.dtype],
                  w_dtype=names.get(key.weight_dtype, torch.bfloat16),
                  has_weight=key.weight_dtype is not None, has_bias=key.has_bias,
                  has_residual=key.has_residual, offset=1.0 if key.has_offset else 0.0,
                  entry=_entry(key))


#: (device class, width) of every class's LayerNorm entries across a cluster, one-shot or
#: persistent.
LAYER_NORM_CLUSTER_ROUTED = [(c, n) for c, op, n in CLASS_ROUTED
                             if op == "layer_norm" and len(TABLES[c][op][n]) >= 4]


@gpu
@needs_cute
@pytest.mark.parametrize(("device_class", "n"), LAYER_NORM_CLUSTER_ROUTED)
def test_cluster_layer_norm_of_a_large_mean_keeps_the_variance_exact(device_class, n):
    """Rows of mean 1000 and std 1: each warp sums the squares of its elements about its own
    mean before the cluster combines them (a one-pass E[x^2] - E[x]^2 would lose the
    variance)."""
    check_forward(300, n, "layer_norm", has_bias=True, x_mean=1000.0,
                  device_class=device_class)


@gpu
@needs_cute
@pytest.mark.parametrize(("device_class", "n"), LAYER_NORM_CLUSTER_ROUTED)
def test_cluster_layer_norm_combines_the_warps_means_exactly(device_class, n):
    """Rows of mean over 1000 whose variance lies almost all between the warps: column means
    step by 8 from one 256-column block to the next, 8 blocks a period (the blocks a CTA's 8
    warps take in turn: 32 lanes of 8 bf16), and by 64 from one cluster CTA's slice to the
    next, under noise of std 1. The combine's n_w * (mean_i - mean)^2 terms carry the
    variance here, checked against float64."""
    cluster = TABLES[device_class]["layer_norm"][n][3]
    cols = torch.arange(n, device="cuda")
    x_mean = 1000.0 + 8 * ((cols // 256) % 8) + 64 * (cols * cluster // n)
    check_forward(300, n, "layer_norm", has_bias=True, x_mean=x_mean,
                  device_class=device_class)


#: Cluster forward entries of several rows a cluster, the settings' candidates for the
#: parameters read once for every row of a CTA (bench/NOTES.md #89): (cols, entry).
MULTI_ROW_ENTRIES = [(32768, (256, 2, 3, 2)), (65536, (256, 2, 3, 4)),
                     (65536, (256, 4, 3, 8)), (131072, (256, 2, 2, 8))]


@gpu
@needs_cute
@pytest.mark.parametrize(("n", "entry"), MULTI_ROW_ENTRIES, ids=str)
@pytest.mark.parametrize("case", ["ln fp32 weight and bias", "ln residual", "rms fp32 weight",
                                  "rms bf16 weight"])
def test_cluster_forward_of_several_rows_matches_float64(n, entry, case):
    """A cluster of R rows: each row's statistics and outputs as float64's on a row count
    that leaves the last cluster short (rows past the end loaded, reduced, never stored:
    the poisoned outputs would show a stray write), reruns bit-identical."""
    op = "layer_norm" if case.startswith("ln") else "rms_norm"
    kwargs = {"ln fp32 weight and bias": dict(w_dtype=torch.float32, has_bias=True),
              "ln residual": dict(has_residual=True, has_bias=True),
              "rms fp32 weight": dict(w_dtype=torch.float32),
              "rms bf16 weight": dict()}[case]
    rows = min(255, CLUSTER_TEST_ELEMENTS // n - 1)
    assert rows % entry[1]
    check_forward(rows, n, op, entry=entry, **kwargs)


@gpu
@needs_cute
@pytest.mark.parametrize("key", PERSISTENT_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("rows", [3, 1023])
def test_persistent_cluster_forward_matches_float64(key, rows):
    """Every persistent variant: fewer rows than clusters (clusters that take none) and
    several row groups a cluster (every ring slot and exchange set, both mbarrier phases, a
    last trip short, a last group of rows past the end), every element written, reruns
    bit-identical."""
    names = {v: k for k, v in NAMES.items()}
    check_forward(min(rows, CLUSTER_TEST_ELEMENTS // key.cols - 1), key.cols,
                  "layer_norm" if key.layer_norm else "rms_norm",
                  w_dtype=names.get(key.weight_dtype, torch.bfloat16),
                  has_weight=key.weight_dtype is not None, has_bias=key.has_bias,
                  offset=1.0 if key.has_offset else 0.0, entry=_entry(key))


def _entry(key) -> tuple[int, ...]:
    """The settings entry of a forward variant."""
    entry = (key.threads, key.rows_per_cta, key.ctas_per_sm, key.cluster)
    return (*entry, key.stages) if key.persistent else entry


@gpu
@needs_cute
@pytest.mark.parametrize("key", PERSISTENT_VARIANTS, ids=_variant_id)
def test_persistent_and_one_shot_cluster_forwards_agree_bit_for_bit(key):
    """The persistent kernel's lane combine is the one-shot kernel's tree over the same
    pushed values (:meth:`ClusterRowKernel._lane_sum`, ``ranked``), and every other step
    the same arithmetic: y, mean and rstd equal ``ClusterRowNormForward``'s at the same
    (threads, cluster), bit for bit, on rows off zero mean whose warps' means differ."""
    from tilenorm.device import device_info, max_active_clusters

    names = {v: k for k, v in NAMES.items()}
    n = key.cols
    m = min(1023, CLUSTER_TEST_ELEMENTS // n - 1)
    g, seed = fresh_generator("cuda")
    x = (torch.randn(m, n, generator=g, device="cuda") + 0.5
         + torch.arange(n, device="cuda") % 4096 / 1024).to(torch.bfloat16)
    w_dtype = names.get(key.weight_dtype, torch.bfloat16)
    w = ((1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(w_dtype)
         if key.weight_dtype is not None else None)
    b = torch.randn(n, generator=g, device="cuda").to(w_dtype) if key.has_bias else None
    eps, offset = (1e-5, 0.0) if key.layer_norm else (1e-6, 1.0 if key.has_offset else 0.0)
    info = device_info(torch.cuda.current_device())
    one_shot = dataclasses.replace(key, stages=0)
    outputs = []
    for k in (key, one_shot):
        entry = _entry(k)
        resident = (max_active_clusters(info.index, k.cluster, k.threads, k.ctas_per_sm)
                    if k.persistent else None)
        plan = CuteForwardPlan.of(m, n, entry, resident)
        fn = cute.compiled_forward(k, torch.cuda.get_device_capability())
        y = poisoned((m, n), torch.bfloat16)
        mean = poisoned((m,), torch.float32) if key.layer_norm else None
        rstd = poisoned((m,), torch.float32)
        fn(x, None, w, b, y, None, mean, rstd, eps, offset, plan.grid)
        torch.cuda.synchronize()
        outputs.append([t for t in (y, mean, rstd) if t is not None])
    for persistent, reference in zip(*outputs, strict=True):
        assert not persistent.isnan().any(), f"every element written (seed {seed})"
        assert torch.equal(persistent, reference), f"the one-shot kernel's bits (seed {seed})"


@gpu
@needs_cute
@pytest.mark.parametrize(("cols", "entry"), PERSISTENT_ENTRIES, ids=str)
def test_persistent_layer_norm_of_a_large_mean_keeps_the_variance_exact(cols, entry):
    check_forward(300, cols, "layer_norm", has_bias=True, w_dtype=torch.float32,
                  x_mean=1000.0, entry=entry)


@gpu
@needs_cute
def test_public_op_runs_a_persistent_entry_and_a_residual_call_the_one_shot(monkeypatch):
    """Under settings that route LayerNorm at 65536 to the persistent kernel (as a variant
    run does), the op's decision names it, it runs and its output matches float64; a call
    with a residual runs the one-shot cluster forward."""
    from tilenorm.pytorch.calls import ForwardCall
    from tilenorm.settings import measuring

    ran = []
    run_cute = ForwardCall._run_cute
    monkeypatch.setattr(ForwardCall, "_run_cute",
                        lambda self, *a: ran.append(self.cute.persistent) or run_cute(self, *a))

    cols, entry = PERSISTENT_ENTRIES[1]
    table = {**SM90.cute_forward, "layer_norm": {**SM90.cute_forward["layer_norm"],
                                                 cols: entry}}
    probe = dataclasses.replace(SM90, cute_forward=table)
    g, seed = fresh_generator("cuda")
    x = (torch.randn(1100, cols, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    r = torch.randn(1100, cols, generator=g, device="cuda").to(torch.bfloat16)
    w = 1 + 0.5 * torch.randn(cols, generator=g, device="cuda")
    b = torch.randn(cols, generator=g, device="cuda")
    from tilenorm.pytorch import calls

    dispatch.decide.cache_clear()  # decisions and prepared calls are cached by problem
    calls.clear()
    try:
        with tilenorm.experimental(), measuring(probe):
            decision = tilenorm.explain(x, w, bias=b, layer_norm=True)
            assert decision.cute_forward is not None and decision.cute_forward.persistent
            y = tilenorm.layer_norm(x, w, b, eps=1e-5)
            y_r, h = tilenorm.layer_norm(x, w, b, eps=1e-5, residual=r, prenorm=True)
    finally:
        dispatch.decide.cache_clear()
        calls.clear()
    assert ran == [True, False], "the persistent kernel, then the one-shot with a residual"
    ref = float64_norm(x, w, b, 1e-5, layer_norm=True)
    assert rel(y, ref.y) <= OUT_TOL[torch.bfloat16], seed
    ref_r = float64_norm(x, w, b, 1e-5, layer_norm=True, residual=r)
    assert rel(y_r, ref_r.y) <= OUT_TOL[torch.bfloat16], seed
    assert torch.equal(h, (x.float() + r.float()).to(torch.bfloat16)), seed


FEATURES = {
    "fp16": dict(dtype=torch.float16, w_dtype=torch.float16),
    "fp32 weight": dict(w_dtype=torch.float32),
    "no weight": dict(has_weight=False),
    "residual": dict(has_residual=True),
    "offset": dict(offset=1.0, has_residual=True),
    "bias": dict(has_bias=True),
    "fp32 weight and bias, residual": dict(w_dtype=torch.float32, has_bias=True,
                                           has_residual=True),
}


@gpu
@needs_cute
@pytest.mark.parametrize(("device_class", "op", "n"), CLASS_ROUTED)
@pytest.mark.parametrize("case", sorted(FEATURES))
def test_features_match_float64(case, device_class, op, n):
    if FEATURES[case].get("has_bias") and op != "layer_norm":
        pytest.skip("RMSNorm takes no bias")
    check_forward(555, n, op, device_class=device_class, **FEATURES[case])


@gpu
@needs_cute
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("narrowest", [True, False], ids=["narrowest", "65536"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_public_op_runs_it_and_matches_float64(op, compiled, narrowest, dtype, monkeypatch):
    """The op runs the kernel (x of the smallest size it takes, past what inductor keeps
    under compile) with a fused residual add, RowNormForward at the narrowest width and
    the cluster forward at 65536, in bf16 and fp32; y, h and the gradients of x, the
    residual and the weight match float64."""
    from tilenorm.pytorch.calls import ForwardCall

    table = TABLES[device_info(torch.cuda.current_device()).device_class][op]
    n = min(table) if narrowest else 65536
    ran = []
    run_cute = ForwardCall._run_cute
    monkeypatch.setattr(ForwardCall, "_run_cute",
                        lambda self, *a: ran.append(self.cute) or run_cute(self, *a))
    g, seed = fresh_generator("cuda")
    layer_norm = op == "layer_norm"
    eps = 1e-5 if layer_norm else 1e-6
    shape = (4, dispatch.CUTE_FORWARD_MIN_BYTES // (dtype.itemsize * n) // 4, n)
    x = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    r = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    dy, dh = (torch.randn(shape, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    norm = tilenorm.layer_norm if layer_norm else tilenorm.rms_norm
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    with tilenorm.experimental():
        decision = tilenorm.explain(x, w, r, layer_norm=layer_norm)
        assert decision.cute_forward is not None
        assert (decision.cute_forward.cluster > 1) == (n == 65536)

        def fn(x, r, w):
            return norm(x, w, eps=eps, residual=r, prenorm=True)
        if compiled:
            fn = torch.compile(fn, fullgraph=True)
        y, h = fn(*leaves)
        torch.autograd.backward((y, h), (dy, dh))
    assert ran, "the CuTe DSL forward ran"
    ref = float64_norm(x, w, None, eps, layer_norm=layer_norm, residual=r, dy=dy, dh=dh)
    assert rel(y, ref.y) <= OUT_TOL[dtype], seed
    assert torch.equal(h, x + r), seed
    # dweight sums every row's terms: fp32's partial buffer takes DGAMMA_TOL_FP32.
    tols = (OUT_TOL[dtype],) * 2 + (max(OUT_TOL[dtype], DGAMMA_TOL_FP32),)
    for got, want, tol in zip((t.grad for t in leaves), (ref.dx, ref.dresidual, ref.dweight),
                              tols, strict=True):
        assert rel(got, want) <= tol, seed


@gpu
@needs_cute
def test_unaligned_storage_takes_the_cutile_forward_and_matches_float64():
    """A view that starts 2 bytes into its storage fails the kernel's 16-byte loads: the call
    runs cuTile's forward instead, on the same prepared call."""
    g, seed = fresh_generator("cuda")
    n = SHARED
    flat = torch.randn(MIN_ROWS * n + 1, generator=g, device="cuda").to(torch.bfloat16)
    x = flat[1:].view(MIN_ROWS, n)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    assert x.is_contiguous() and x.data_ptr() % 16
    with tilenorm.experimental():
        y = tilenorm.rms_norm(x, w)
        y_aligned = tilenorm.rms_norm(x.clone(), w)
    ref = float64_norm(x, w, None, 1e-6)
    assert rel(y, ref.y) <= OUT_TOL[torch.bfloat16], seed
    assert rel(y_aligned, ref.y) <= OUT_TOL[torch.bfloat16], seed


@gpu
@needs_cute
def test_cuda_graph_replay_matches_eager_bit_for_bit():
    """The kernel launches on torch's current stream, so a CUDA graph captures it."""
    g, _ = fresh_generator("cuda")
    n = SHARED
    x = torch.randn(MIN_ROWS, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    with tilenorm.experimental():
        check_graph_replay_matches_eager(lambda: tilenorm.layer_norm_forward(x, w, b))


# --- the two-pass forward (TwoPassRowNormForward, bench/NOTES.md #136) ----------------------

#: (width, entry) of the two-pass forward: the probe's spill-free layouts of plain RMSNorm
#: (#136), one of several steps a thread and one of two vectors a step.
TWO_PASS_ENTRIES = [(7168, (448, 1, 4)), (8192, (512, 1, 4)), (32768, (1024, 1, 2)),
                    (4096, (128, 2, 8))]
#: Every feature set at each entry, bf16 x.
TWO_PASS_VARIANTS = [key for cols, entry in TWO_PASS_ENTRIES for op in OPS
                     for key in cute.forward_feature_keys("bfloat16", op, cols,
                                                          cute.two_pass_launch(entry))]


def _two_pass_settings(entries):
    return dataclasses.replace(SM90, cute_forward_two_pass={
        "rms_norm": dict(entries), "layer_norm": dict(entries)})


@pytest.mark.parametrize("rows", [1, 3, 1000])
def test_a_two_pass_entry_takes_its_width_one_row_a_cta(rows):
    settings = _two_pass_settings([(8192, (512, 1, 4))])
    for op in OPS:
        p = plan_cute_forward(rows, 8192, itemsize=2, arch=(9, 0), op=op, settings=settings)
        assert (p.step, p.threads, p.ctas_per_sm, p.grid, p.cluster) == (1, 512, 4, rows, 1)
        assert [list(p.program_rows(cta)) for cta in range(p.grid)] == [[r] for r in
                                                                         range(rows)]
        assert p.with_residual() == p, "the two-pass kernel takes the residual itself"
        assert p.entry == (512, 1, 4) and CuteForwardPlan.two_pass(rows, 8192, p.entry) == p
        assert dispatch.cute_forward_name(p) == dispatch.CUTE_TWO_PASS_FORWARD_NAME
        assert "two-pass" in p.describe()
        key = cute.ForwardKey.of(p, "bfloat16", "bfloat16", False, op == "layer_norm", False,
                                 False)
        assert key.step == 1 and key.cluster == 1 and not key.persistent
    # Other widths, 4-byte x, several heads and 64-bit offsets keep the other tables.
    other = plan_cute_forward(1000, 4096, itemsize=2, arch=(9, 0), op="rms_norm",
                              settings=settings)
    assert other is not None and other.step == 0
    for kwargs in ({"itemsize": 4}, {"itemsize": 2, "heads": 2},
                   {"itemsize": 2, "max_offset": 1 << 31}):
        p = plan_cute_forward(rows, 8192, arch=(9, 0), op="rms_norm", settings=settings,
                              **kwargs)
        assert p is None or p.step == 0, kwargs


def test_the_shipped_tables_route_the_two_pass_forward_where_it_was_measured_ahead():
    """The H200's RMSNorm at 4096-32768 (#138); LayerNorm and the H100 keep the others."""
    h200 = settings_for((9, 0), "h200").cute_forward_two_pass
    assert sorted(h200["rms_norm"]) == [4096, 5120, 7168, 8192, 32768] and not h200["layer_norm"]
    assert not any(settings_for((9, 0), "h100").cute_forward_two_pass.values())
    for op in OPS:
        p = plan_cute_forward(4096, 8192, itemsize=2, arch=(9, 0), op=op, device_class="h200")
        assert p.step == (op == "rms_norm"), op


def test_a_two_pass_residual_call_runs_where_its_rows_fit_l1():
    """x's and the residual's rows of an SM's CTAs stay in L1 between the passes, or the
    call takes one row a cluster (#138: the residual at 32768 columns ran at 87% of copy)."""
    from tilenorm.settings import TWO_PASS_L1_BYTES

    for cols, entry in settings_for((9, 0), "h200").cute_forward_two_pass["rms_norm"].items():
        p = CuteForwardPlan.two_pass(1000, cols, entry)
        fits = 2 * 2 * cols * entry[2] <= TWO_PASS_L1_BYTES
        assert (p.with_residual() == p) == fits, cols
        if not fits:
            assert p.with_residual().entry == (256, 1, 4, cols // 16384)
    assert CuteForwardPlan.two_pass(1000, 32768, (1024, 1, 2)).with_residual().step == 0
    with pytest.raises(ValueError, match="TWO_PASS_L1_BYTES"):
        CuteForwardPlan.two_pass(1000, 16384, (512, 1, 4)).with_residual()


@needs_cute
def test_the_two_pass_kernel_refuses_what_it_cannot_run():
    import cutlass

    from tilenorm.kernels.cute_row_norm_forward import TwoPassRowNormForward

    bf16 = cutlass.BFloat16
    features = (False, False, False, False)
    assert TwoPassRowNormForward(bf16, bf16, 8192, 512, 2, 4, *features).step == 2
    with pytest.raises(ValueError, match="steps"):
        TwoPassRowNormForward(bf16, bf16, 7168, 128, 2, 16, *features)  # 7 vectors a thread
    with pytest.raises(ValueError, match="steps"):
        TwoPassRowNormForward(bf16, bf16, 8192, 512, 0, 4, *features)
    with pytest.raises(ValueError, match="whole"):
        TwoPassRowNormForward(bf16, bf16, 8200, 512, 1, 4, *features)


@pytest.mark.aot
@needs_cute
def test_two_pass_variants_build_for_hopper_and_blackwell(tmp_path):
    """Every two-pass variant builds for both architectures; plain RMSNorm (no residual, no
    LayerNorm) fits 32 registers without spilling on sm_90a at every entry (#136)."""
    from bench.kernel_resources import cubin_resources, find_cuobjdump

    tool = find_cuobjdump()
    for i, key in enumerate(TWO_PASS_VARIANTS):
        for arch in cute.AOT_ARCHS:
            cubins = tmp_path / f"{i}-{arch}"
            plain = not (key.layer_norm or key.has_residual)
            keep = str(cubins) if tool and plain and arch == "sm_90a" else None
            assert callable(cute.compile_forward(key, arch, cubin_dir=keep)), (key, arch)
            if keep:
                found = cubin_resources(next(cubins.rglob("*.cubin")), tool)[0]
                assert found["spill_stores"] == found["spill_loads"] == found["stack"] == 0, (
                    key, found)


@gpu
@needs_cute
@pytest.mark.parametrize("key", TWO_PASS_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("m", [1, 1023])
def test_two_pass_forward_variants_match_float64(key, m):
    names = {v: k for k, v in NAMES.items()}
    check_forward(m, key.cols, "layer_norm" if key.layer_norm else "rms_norm",
                  dtype=names[key.dtype], w_dtype=names.get(key.weight_dtype, torch.bfloat16),
                  has_weight=key.weight_dtype is not None, has_bias=key.has_bias,
                  has_residual=key.has_residual, offset=1.0 if key.has_offset else 0.0,
                  two_pass=(key.threads, key.step, key.ctas_per_sm))


@gpu
@needs_cute
@pytest.mark.parametrize("cols", [cols for cols, _ in TWO_PASS_ENTRIES])
def test_two_pass_layer_norm_of_a_large_mean_keeps_the_variance_exact(cols):
    """Rows of mean 1000: the variance is summed about the mean, in a pass of its own."""
    entry = dict(TWO_PASS_ENTRIES)[cols]
    check_forward(255, cols, "layer_norm", x_mean=1000.0, two_pass=entry)
