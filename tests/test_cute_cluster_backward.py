"""The CuTe DSL cluster RMSNorm / LayerNorm backward
(tilenorm/kernels/cute_cluster_norm_backward.py): its plan, its ahead-of-time build for Hopper
and Blackwell (and its registers at sm_90a), the decision that picks it, and (GPU) its
outputs against float64, through the kernel and through the ops."""

import dataclasses
import re
import tempfile
from pathlib import Path

import pytest
import torch

import tilenorm
from tests.kernel_harness import (
    DGAMMA_TOL_FP32,
    H100,
    OUT_TOL,
    SMEM_PER_SM,
    SMEM_RESERVED,
    check_graph_replay_matches_eager,
    fresh_generator,
    poisoned,
    rel,
)
from tilenorm import dispatch
from tilenorm.launch import cute
from tilenorm.planner import CuteClusterBackwardPlan, plan_cute_cluster_backward
from tilenorm.settings import DEVICE_CLASSES, SM90, SM90_H100, settings_for
from tilenorm.testing import float64_norm, row_blocks

gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
TABLE = SM90.cute_cluster_backward
#: The table for 4-byte x (fp32).
TABLE_FP32 = SM90.cute_cluster_backward_fp32
WIDTHS = sorted({cols for widths in TABLE.values() for cols in widths})
#: (op, width) of every entry: LayerNorm's table need not hold RMSNorm's widths.
ENTRIES = [(op, cols) for op in sorted(TABLE) for cols in sorted(TABLE[op])]
#: Registers of an SM (sm_90, sm_100).
REGS_PER_SM = 65536


def made_up_residency(cluster, threads, ctas_per_sm):
    """Clusters co-resident on a made-up H100: two of eight CTAs a GPC, per CTA an SM."""
    return 16 * ctas_per_sm


def plan(rows, cols=None, itemsize=2, op="rms_norm", resident=made_up_residency,
         **kw):
    cols = min(TABLE[op]) if cols is None else cols
    return plan_cute_cluster_backward(rows, cols, itemsize=itemsize, arch=(9, 0), op=op,
                                      resident_clusters=resident, **kw)


# --- plan and decision (CPU) ------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 31, 32, 33, 1023, 2048, 16383])
@pytest.mark.parametrize("resident", [1, 5, 32])
def test_plan_gives_every_row_to_one_cluster(rows, resident):
    for op, widths in TABLE.items():
        for cols, (cluster, threads, stages, ctas) in widths.items():
            p = plan(rows, cols, op=op, resident=lambda *shape: resident)
            assert p.clusters == min(rows, resident) == p.partial_rows
            assert p.grid == p.clusters * cluster
            assert (p.cluster, p.threads, p.stages, p.ctas_per_sm) == (cluster, threads,
                                                                     stages, ctas)
            seen = sorted(r for k in range(p.clusters) for r in p.cluster_rows(k))
            assert seen == list(range(rows))
            assert all(len(p.cluster_rows(k)) for k in range(p.clusters)), "no idle cluster"


@pytest.mark.parametrize("op", sorted(TABLE))
def test_plan_only_where_measured_and_asks_residency_only_then(op):
    asked = []

    def resident(*shape):
        asked.append(shape)
        return 32

    cols = min(TABLE[op])
    assert plan(100, op=op, resident=resident)
    cluster, threads, _, ctas = TABLE[op][cols]
    assert asked == [(cluster, threads, ctas)]
    for refused in (dict(cols=cols + 8), dict(itemsize=1), dict(itemsize=8), dict(heads=2),
                    dict(max_offset=2**31)):
        assert plan(100, op=op, resident=resident, **refused) is None, refused
    rows = 2**31 // cols
    assert plan(rows, op=op, resident=resident)
    assert plan(rows + 1, op=op, resident=resident) is None
    assert len(asked) == 2
    for width in WIDTHS:  # 4-byte x: its own table
        fp32 = plan(100, width, itemsize=4, op=op)
        entry = TABLE_FP32[op].get(width)
        assert (fp32 is None) == (entry is None), width
        assert fp32 is None or (fp32.cluster, fp32.threads, fp32.stages,
                                fp32.ctas_per_sm) == entry
    assert plan(100, op=op, resident=lambda *shape: 0) is None, "no such cluster fits"
    with pytest.raises(ValueError):
        CuteClusterBackwardPlan.of(100, cols, TABLE[op][cols], 0)


def test_layer_norm_takes_rms_norms_entries_but_where_measured():
    """LayerNorm's widths are RMSNorm's and its entries RMSNorm's (untimed for LayerNorm: the
    settings say so) but at 131072, timed for LayerNorm on an H200 (#122); at the shared
    entries its plan is the same launch, its stats staged where its own table says."""
    layer_norm, rms_norm = TABLE["layer_norm"], TABLE["rms_norm"]
    assert layer_norm.keys() <= rms_norm.keys()
    assert {cols for cols in layer_norm if layer_norm[cols] != rms_norm[cols]} == {131072}
    for cols in layer_norm:
        if layer_norm[cols] == rms_norm[cols]:
            ln, rms = plan(1000, cols, op="layer_norm"), plan(1000, cols, op="rms_norm")
            assert dataclasses.replace(ln, stage_stats=rms.stage_stats) == rms
            assert ln.stage_stats == SM90.cluster_backward_stage_stats("layer_norm", cols, 2)


@needs_cute
def test_rstd_staged_with_the_row_where_the_table_says():
    """``cute_cluster_backward_staged_stats``, 2-byte x alone: the plan and its ahead-of-time
    variants take ``stage_stats`` at the table's ops and widths and nowhere else (fp32 x
    and a table without them, nowhere)."""
    from tilenorm.settings import measuring

    staged = {(op, cols) for op, widths in SM90.cute_cluster_backward_staged_stats.items()
              for cols in widths}
    assert staged and staged <= set(ENTRIES)
    unstaged = dataclasses.replace(SM90, cute_cluster_backward_staged_stats={})
    for op, cols in ENTRIES:
        p = plan(1024, cols, op=op)
        assert p.stage_stats == ((op, cols) in staged), (op, cols)
        assert ("rstd staged with the row" in p.describe()) == p.stage_stats
        assert not plan(1024, cols, op=op, settings=unstaged).stage_stats
    for op, widths in TABLE_FP32.items():
        for cols in widths:
            assert not plan(1024, cols, itemsize=4, op=op).stage_stats, (op, cols)
    keys = [k for k in cute.aot_cluster_backward_keys(all_dtypes=True) if k.stage_stats]
    assert {("layer_norm" if k.layer_norm else "rms_norm", k.cols) for k in keys} == staged
    assert {k.dtype for k in keys} == {"bfloat16", "float16"}
    with measuring(unstaged):
        assert not plan(1024, max(TABLE["rms_norm"])).stage_stats


def test_settings_entries_fit_the_kernel():
    """Each entry builds the kernel of its heaviest variant (the kernel checks the cluster
    size, whole 16-byte vectors of its threads a CTA, a warp per cluster CTA to push the row
    sums), whose shared memory (x, dy and a residual's gradient staged) lets ``ctas_per_sm``
    CTAs an SM hold."""
    import cutlass

    from tilenorm.kernels.cute_cluster_norm_backward import ClusterRowNormBackward

    for op, widths in TABLE.items():
        for cols, (cluster, threads, stages, ctas) in widths.items():
            kernel = ClusterRowNormBackward(
                cutlass.BFloat16, cutlass.Float32, cols, cluster, threads, stages, ctas,
                layer_norm=op == "layer_norm", has_bias=op == "layer_norm",
                has_dres_in=True)
            assert (kernel.shared_bytes() + SMEM_RESERVED) * ctas <= SMEM_PER_SM, (op, cols)


@needs_cute
def test_lanes_add_every_pushed_slot_once():
    """Every variant's row sums over its cluster * warps slots: runs of adjacent slots, one a
    lane of a power-of-two group of at most a warp, that cover the slots exactly (a butterfly
    over a group that is not a power of two, or runs past the slots, would add some twice or
    read unwritten ones)."""
    for key in cute.aot_cluster_backward_keys():
        kernel = key.kernel()
        group, per = kernel.lane_runs()
        assert group & (group - 1) == 0 and group <= 32, key
        assert group * per == kernel.cluster * kernel.warps, key


@needs_cute
def test_the_cluster_size_limit_is_one_check_for_forward_and_backward():
    """Both cluster kernels split a row by one method, which refuses clusters past the
    portable size (and slices that are not whole vectors)."""
    import cutlass

    from tilenorm.kernels.cute_cluster_norm_backward import ClusterRowNormBackward
    from tilenorm.kernels.cute_cluster_norm_forward import ClusterRowNormForward
    from tilenorm.kernels.cute_cluster_rows import MAX_PORTABLE_CLUSTER, ClusterRowKernel

    assert (ClusterRowNormForward._split_row is ClusterRowNormBackward._split_row
            is ClusterRowKernel._split_row)
    bf16, too_big = cutlass.BFloat16, 2 * MAX_PORTABLE_CLUSTER
    cols = too_big * 8 * 512
    with pytest.raises(ValueError, match="portable"):
        ClusterRowNormBackward(bf16, bf16, cols, too_big, 512, 2, 1)
    with pytest.raises(ValueError, match="portable"):
        ClusterRowNormForward(bf16, bf16, cols, 512, 1, too_big, 1, False, False, False,
                              False)
    for widths in TABLE.values():
        assert all(config[0] <= MAX_PORTABLE_CLUSTER for config in widths.values())


#: Widths where the cluster backward replaces cuTile's one-pass backward, not the column
#: split: measured to gain there (the settings cite the numbers).
REPLACES_ONE_PASS = {("rms_norm", 12288), ("rms_norm", 16384)}


def test_cluster_widths_are_the_column_split_widths_it_replaces():
    """The cluster backward wins at exactly its table's widths: each is past the single-pass
    limit (the cuTile backward there is the two-pass column split it replaces) or a width
    measured to beat cuTile's one-pass backward, none is a one-CTA CuTe backward's width,
    and the widths beside them get no cluster plan."""
    from tilenorm.planner import plan_row_norm

    for op, widths in TABLE.items():
        limit = SM90.max_single_pass_bytes["backward"][op] // 2
        for cols in widths:
            cutile = plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                   direction="backward", op=op)
            if (op, cols) in REPLACES_ONE_PASS:
                assert cols <= limit and cutile.col_tiles == 1, (op, cols)
            else:
                assert cols > limit and cutile.col_tiles > 1, (op, cols)
            assert cols not in SM90.cute_backward.get(op, {}), (op, cols)
            assert plan(1000, cols, op=op)
            for beside in (cols // 2 + cols // 4, cols + cols // 2):
                if beside not in widths:
                    assert plan(1000, beside, op=op) is None, (op, beside)


@needs_cute
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_decision_picks_it_for_wide_rows(monkeypatch, op):
    monkeypatch.setattr(dispatch, "max_active_clusters",
                        lambda index, *shape: made_up_residency(*shape))

    narrowest = min(TABLE[op])

    def pick(dtypes=("bfloat16", "bfloat16"), cols=narrowest, allow=True, max_offset=None):
        rows = 1000
        p = dispatch.Problem(op, "cuda", 0, dtypes, rows, 1, cols, False,
                             rows * cols - 1 if max_offset is None else max_offset, allow)
        return dispatch._cute_backward(p, H100)

    for cols, entry in SM90_H100.cute_cluster_backward[op].items():
        chosen = pick(cols=cols)
        assert isinstance(chosen, CuteClusterBackwardPlan), cols
        assert (chosen.cluster, chosen.threads, chosen.stages, chosen.ctas_per_sm) == entry
        assert chosen.clusters == made_up_residency(chosen.cluster, chosen.threads,
                                                    chosen.ctas_per_sm)
    assert isinstance(pick(("bfloat16", "float32")), CuteClusterBackwardPlan)
    assert isinstance(pick(("bfloat16", "float32", "float32")), CuteClusterBackwardPlan)
    assert isinstance(pick(("bfloat16",)), CuteClusterBackwardPlan)
    assert pick(("bfloat16", "float16")) is None
    fp32 = pick(("float32", "float32"), cols=min(TABLE_FP32[op]))
    assert (fp32.cluster, fp32.threads, fp32.stages,
            fp32.ctas_per_sm) == TABLE_FP32[op][min(TABLE_FP32[op])]
    assert pick(("float32", "bfloat16"), cols=min(TABLE_FP32[op])) is None
    assert pick(max_offset=2**31) is None
    assert not isinstance(pick(cols=narrowest + 1024), CuteClusterBackwardPlan)
    monkeypatch.setattr(dispatch.validation, "is_stable", lambda family: False)
    assert pick(allow=False) is None


@needs_cute
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("cols", [16384, 24576, 32768, 49152, 65536, 131072])
def test_decide_on_a_fake_h100_runs_it_at_exactly_its_widths(monkeypatch, op, cols):
    """The whole decision, on a made-up H100 with the kernels allowed: the cluster backward
    at its table's widths (in the decision's kernels and its text), the two-pass column
    split or a single-pass backward elsewhere."""
    monkeypatch.setattr(dispatch, "device_info", lambda index: H100)
    monkeypatch.setattr(dispatch, "max_active_clusters",
                        lambda index, *shape: made_up_residency(*shape))
    dispatch.decide.cache_clear()
    try:
        decision = dispatch.decide(dispatch.Problem(
            op, "cuda", 0, ("bfloat16", "bfloat16"), 1000, 1, cols, False, 1000 * cols - 1,
            True))
    finally:
        dispatch.decide.cache_clear()
    clustered = isinstance(decision.cute_backward, CuteClusterBackwardPlan)
    assert clustered == (cols in SM90_H100.cute_cluster_backward[op]), decision
    assert (dispatch.CUTE_CLUSTER_BACKWARD_NAME in decision.kernels) == clustered
    if clustered:
        # cuTile's fallback: the column split where a row is past one tile (not at 16384)
        limit = SM90.max_single_pass_bytes["backward"][op] // 2
        assert decision.backward.column_split == (cols > limit), decision
        assert dispatch.CUTE_CLUSTER_BACKWARD_NAME in str(decision)


def test_decision_names_the_cluster_kernel():
    from tilenorm.planner import plan_row_norm

    cols = WIDTHS[0]
    decision = dispatch.Decision(
        op="rms_norm", reason="experimental kernels are enabled", family=dispatch.CUTILE_NORM,
        forward=plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                              direction="forward"),
        backward=plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                               direction="backward"),
        cute_backward=plan(1000), device=H100)
    assert dispatch.CUTE_CLUSTER_BACKWARD_NAME in decision.kernels
    assert dispatch.CUTE_BACKWARD_NAME not in decision.kernels
    text = str(decision)
    chosen = decision.cute_backward
    assert dispatch.CUTE_CLUSTER_BACKWARD_NAME in text, text
    assert f"cluster of {chosen.cluster} CTAs" in text, text
    assert (f"persistent grid {chosen.clusters} clusters" in text
            and f"partial buffer {chosen.clusters}x" in text), text


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_backward_kernel_takes_it_with_a_residual_and_an_offset(op):
    """Unlike the row backward, the cluster backward adds the gradient that reached h and
    the weight offset; a residual's gradient in another dtype than x's it does not write."""
    from tilenorm.planner import plan_row_norm

    decision = dispatch.Decision(
        op=op, reason="",
        backward=plan_row_norm(1000, min(TABLE[op]), itemsize=2, sm_count=132, arch=(9, 0),
                               direction="backward", op=op),
        cute_backward=plan(1000, op=op))
    plain = dict(has_residual=False, has_dres_in=False, has_offset=False, same_dtypes=True,
                 dense_aligned=True, max_offset=0)
    for allowed in ({}, dict(has_residual=True), dict(has_residual=True, has_dres_in=True),
                    dict(has_offset=True)):
        facts = dispatch.BackwardFacts(**{**plain, **allowed})
        assert dispatch.backward_kernel(decision, facts) is decision.cute_backward, allowed
    for change in (dict(has_residual=True, dres_apart=True), dict(same_dtypes=False),
                   dict(dense_aligned=False), dict(dy_terms=2)):
        facts = dispatch.BackwardFacts(**{**plain, **change})
        assert dispatch.backward_kernel(decision, facts) is decision.backward, change


@needs_cute
def test_kernel_refuses_shapes_it_cannot_hold():
    import cutlass

    from tilenorm.kernels.cute_cluster_norm_backward import ClusterRowNormBackward

    bf16 = cutlass.BFloat16
    for bad in (dict(cols=65536 + 8), dict(cluster=16), dict(cluster=3), dict(stages=0),
                dict(threads=128, cols=8 * 8 * 128),
                dict(has_offset=True, weight_dtype=None)):
        kw = dict(dtype=bf16, weight_dtype=bf16, cols=65536, cluster=8, threads=256,
                  stages=2, ctas_per_sm=2) | bad
        with pytest.raises(ValueError):
            ClusterRowNormBackward(**kw)


@pytest.mark.aot
@needs_cute
def test_every_variant_builds_for_hopper_and_blackwell():
    keys = cute.aot_cluster_backward_keys(all_dtypes=True)
    for dtypes, table in ((("bfloat16", "float16"), "cute_cluster_backward"),
                          (("float32",), "cute_cluster_backward_fp32")):
        assert {(k.layer_norm, k.cols) for k in keys if k.dtype in dtypes} == {
            (op == "layer_norm", cols) for c in DEVICE_CLASSES
            for op, widths in getattr(settings_for((9, 0), c), table).items()
            for cols in widths}
    layer_norm = [k for k in keys if k.layer_norm]
    assert {(k.weight_dtype, k.has_bias, k.has_dres_in) for k in layer_norm
            if k.dtype == "bfloat16" and k.cols == min(TABLE["layer_norm"])} == {
        (w, b, d) for w in (None, "bfloat16", "float32") for b in (False, True)
        for d in (False, True)}
    assert not any(k.has_offset for k in layer_norm)
    for key in keys:
        for arch in cute.AOT_ARCHS:
            assert callable(cute.compile_cluster_backward(key, arch)), (key, arch)


#: Spill stores a variant may have at sm_90a (cuobjdump, static counts): none for the timed
#: RMSNorm variants (a weight in x's dtype, or none). The heavier ones hold more fp32
#: registers a thread (an fp32 weight; LayerNorm's dbias beside dweight) in 128 (two CTAs of
#: 256 threads an SM, or one of 512) or 255: the compiler spills a few scalars, 1-5 stores
#: (16 bytes of stack at most) before the row loop and a load or two a row beside the
#: mbarrier wait. A row's body has no loop but that wait (its vector loops are unrolled),
#: so each runs at most once a row, beside the thread's 32-64 16-byte loads of it. The most,
#: 5, are bf16 LayerNorm's at 131072 columns with an fp32 weight, a bias and a residual's
#: gradient (23 of the 210 variants spill, 29 before the instruction cuts of
#: bench/NOTES.md #119; fp32 LayerNorm's at 131072, 6 then, timed at 88% of copy, #106).
MAX_SPILL_STORES, MAX_STACK = 5, 16


def allowed_spill_stores(key) -> int:
    timed = not key.layer_norm and key.weight_dtype in (None, key.dtype)
    return 0 if timed else MAX_SPILL_STORES


@pytest.mark.aot
@needs_cute
def test_routed_variants_do_not_spill_at_sm_90a():
    """Every routed variant's sm_90a cubin read by cuobjdump: spill stores within
    :func:`allowed_spill_stores`, registers that let ``ctas_per_sm`` CTAs an SM hold, and
    shared memory that does."""
    from bench.kernel_resources import cubin_resources, find_cuobjdump

    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    for key in cute.aot_cluster_backward_keys():
        with tempfile.TemporaryDirectory() as tmp:
            cute.compile_cluster_backward(key, "sm_90a", cubin_dir=tmp)
            cubin, = Path(tmp).rglob("*.cubin")
            found, sass = cubin_resources(cubin, tool)
        stores = len(re.findall(r"\bSTL\b", sass))
        assert stores == found["spill_stores"] <= allowed_spill_stores(key), (key, found)
        assert found["stack"] <= (MAX_STACK if allowed_spill_stores(key) else 0), (key, found)
        assert found["registers"] * key.threads * key.ctas_per_sm <= REGS_PER_SM, (key, found)
        shared = found["shared"] + key.kernel().shared_bytes()
        assert shared * key.ctas_per_sm <= SMEM_PER_SM, (key, shared)


# --- GPU --------------------------------------------------------------------------------


NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _plan(rows, cols, op="rms_norm", itemsize=2):
    from tilenorm.device import device_info, max_active_clusters

    info = device_info(torch.cuda.current_device())
    return plan_cute_cluster_backward(
        rows, cols, itemsize=itemsize, arch=info.arch, op=op,
        resident_clusters=lambda *shape: max_active_clusters(info.index, *shape))


def _reference(x, w, b, eps, dy, offset, dres, layer_norm):
    """float64 dx, dweight and dbias, fp32 mean and rstd, a block of rows at a time (x up
    to 256 MB)."""
    m, n = x.shape
    dx = torch.empty(m, n, dtype=torch.float64, device=x.device)
    dweight, dbias = (None if t is None else torch.zeros(n, dtype=torch.float64,
                                                         device=x.device) for t in (w, b))
    mean = torch.empty(m, dtype=torch.float64, device=x.device) if layer_norm else None
    rstd = torch.empty(m, dtype=torch.float64, device=x.device)
    for block in row_blocks(m, n):
        ref = float64_norm(x[block], w, b, eps, layer_norm=layer_norm, offset=offset,
                           dy=dy[block], dh=None if dres is None else dres[block])
        dx[block], rstd[block] = ref.dx, ref.rstd
        if layer_norm:
            mean[block] = ref.mean
        if w is not None:
            dweight += ref.dweight
        if b is not None:
            dbias += ref.dbias
        del ref
    return dx, dweight, dbias, None if mean is None else mean.float(), rstd.float()


def check_cluster_backward(m, n, op="rms_norm", dtype=torch.bfloat16, w_dtype=torch.bfloat16,
                           bias=False, offset=0.0, residual=False, eps=1e-6, reruns=3,
                           repeat_slices=False, stage_stats=False):
    """The kernel on poisoned dx and partial buffer against float64: every dx element and
    partial slot written, dx, dweight and dbias accurate, reruns bit-identical (with
    ``stage_stats`` the last rerun by the kernel that stages rstd and mean with the row:
    the same values by another path, so the same bits). With
    ``repeat_slices`` every operand repeats every ``n / cluster`` columns, so that every CTA
    of a cluster holds the same slice: their dx and partial-buffer slices must then repeat
    bit for bit, which they do only if every CTA adds the pushed row sums to the same bits."""
    layer_norm = op == "layer_norm"
    g, seed = fresh_generator("cuda")
    plan = _plan(m, n, op, dtype.itemsize)
    width = n // plan.cluster if repeat_slices else n

    def columns(*rows, scale=1.0, shift=0.0, to=dtype):
        """randn of ``width`` columns (repeated to ``n``), ``scale * . + shift``, in ``to``."""
        t = scale * torch.randn(*rows, width, generator=g, device="cuda") + shift
        return t.repeat(*[1] * len(rows), n // width).to(to)

    x = columns(m)
    if layer_norm:  # rows off zero mean, so that the centering matters
        x = (x + torch.randn(m, 1, generator=g, device="cuda").to(dtype)).to(dtype)
    dy = columns(m)
    w = None if w_dtype is None else columns(scale=0.5, shift=1 - offset, to=w_dtype)
    b = None if not bias else columns(scale=0.5, to=w_dtype or dtype)
    dres = columns(m) if residual else None
    ref_dx, ref_dw, ref_db, mean, rstd = _reference(x, w, b, eps, dy, offset, dres,
                                                    layer_norm)
    assert plan.clusters <= m and plan.grid == plan.clusters * plan.cluster
    key = cute.ClusterBackwardKey.of(plan, NAMES[dtype],
                                     None if w is None else NAMES[w.dtype], offset != 0,
                                     residual, layer_norm, bias)
    fns = [cute.compiled_cluster_backward(k, torch.cuda.get_device_capability())
           for k in [key] * (reruns - stage_stats)
           + [dataclasses.replace(key, stage_stats=True)] * stage_stats]
    outputs = []
    for fn in fns:
        dx = poisoned((m, n), dtype)
        partial = (poisoned((plan.partial_rows, key.groups, n), torch.float32) if key.groups
                   else None)
        fn(x, dy, w, mean, rstd, dres, dx, partial, offset, plan.grid)
        torch.cuda.synchronize()
        outputs.append((dx, partial))
    dx, partial = outputs[0]
    assert not dx.isnan().any(), f"every dx element written (seed {seed})"
    assert rel(dx, ref_dx) <= OUT_TOL[dtype], seed
    for dx2, partial2 in outputs[1:]:
        assert torch.equal(dx, dx2), f"rerun bit-identical (seed {seed})"
        assert partial is None or torch.equal(partial, partial2), f"bit-identical ({seed})"
    if partial is not None:
        assert not partial.isnan().any(), f"every partial slot written (seed {seed})"
        sums = partial.double().sum(0)
        for group, ref in enumerate(r for r in (ref_dw, ref_db) if r is not None):
            assert rel(sums[group], ref) <= DGAMMA_TOL_FP32, (group, seed)
    if repeat_slices:
        slices = dx.view(m, plan.cluster, width)
        assert torch.equal(slices, slices[:, :1].expand_as(slices)), f"dx (seed {seed})"
        if partial is not None:
            slices = partial.view(plan.partial_rows, key.groups, plan.cluster, width)
            assert torch.equal(slices, slices[:, :, :1].expand_as(slices)), seed
    return plan


@gpu
@needs_cute
@pytest.mark.parametrize("op,n", ENTRIES)
@pytest.mark.parametrize("m", ["1", "3", "1023", "clusters", "2 clusters + 1", "2048"])
def test_matches_float64(m, n, op):
    """Row counts: one, fewer than the clusters, ragged, as many as the clusters (one row
    each) and past them (clusters take several, a trip of two rows left half full)."""
    clusters = _plan(2**31 // n, n, op).clusters
    rows = {"clusters": clusters, "2 clusters + 1": 2 * clusters + 1}.get(m) or int(m)
    p = check_cluster_backward(rows, n, op, w_dtype=torch.bfloat16,
                               bias=op == "layer_norm")
    assert p.clusters == min(rows, clusters)


@gpu
@needs_cute
@pytest.mark.parametrize("op,n", [(op, n) for op in sorted(TABLE_FP32)
                                  for n in sorted(TABLE_FP32[op])])
@pytest.mark.parametrize("m", ["3", "clusters", "2 clusters + 1"])
def test_fp32_matches_float64(m, n, op):
    """fp32 x, dy and parameters at every entry of the fp32 table (LayerNorm with a bias):
    as many rows as the clusters, and past them."""
    clusters = _plan(2**31 // n, n, op, 4).clusters
    rows = {"clusters": clusters, "2 clusters + 1": 2 * clusters + 1}.get(m) or int(m)
    p = check_cluster_backward(rows, n, op, dtype=torch.float32, w_dtype=torch.float32,
                               bias=op == "layer_norm")
    assert p.clusters == min(rows, clusters)


@gpu
@needs_cute
@pytest.mark.parametrize("op,n", ENTRIES)
@pytest.mark.parametrize("case", ["plain", "residual"])
def test_rstd_staged_with_the_row_gives_the_same_bits(op, n, case):
    check_cluster_backward(1023, n, op, bias=op == "layer_norm", residual=case == "residual",
                           stage_stats=True)


@gpu
@needs_cute
@pytest.mark.parametrize("op,n", ENTRIES)
def test_every_cta_of_a_cluster_gets_the_same_row_sums(op, n):
    """Slices repeated across the cluster (LayerNorm with fp32 weight and bias), rows past
    the clusters: each CTA's dx and dweight (and dbias) slices are the others' bit for bit
    (:meth:`ClusterRowKernel._push_sums_lanes`)."""
    layer_norm = op == "layer_norm"
    rows = 2 * _plan(2**31 // n, n, op).clusters + 1
    check_cluster_backward(rows, n, op, w_dtype=torch.float32 if layer_norm else torch.bfloat16,
                           bias=layer_norm, eps=1e-5 if layer_norm else 1e-6,
                           repeat_slices=True)


#: Each case's features: RMSNorm's, then LayerNorm's (with or without weight and bias,
#: parameters in x's dtype or fp32, a residual's gradient).
FEATURES = {
    "fp16": dict(dtype=torch.float16, w_dtype=torch.float16),
    "fp32 weight": dict(w_dtype=torch.float32),
    "no weight": dict(w_dtype=None),
    "gemma offset": dict(offset=1.0),
    "residual": dict(residual=True),
    "gemma offset, fp32 weight, residual": dict(offset=1.0, w_dtype=torch.float32,
                                                residual=True),
    "layer norm": dict(op="layer_norm"),
    "layer norm, bias": dict(op="layer_norm", bias=True),
    "layer norm, no weight": dict(op="layer_norm", w_dtype=None),
    "layer norm, bias only": dict(op="layer_norm", w_dtype=None, bias=True),
    "layer norm, fp32 weight and bias": dict(op="layer_norm", w_dtype=torch.float32,
                                             bias=True),
    "layer norm, fp16, bias": dict(op="layer_norm", dtype=torch.float16,
                                   w_dtype=torch.float16, bias=True),
    "layer norm, bias, residual": dict(op="layer_norm", bias=True, residual=True),
    "layer norm, fp32 weight and bias, residual": dict(op="layer_norm", bias=True,
                                                       w_dtype=torch.float32, residual=True),
}


@gpu
@needs_cute
@pytest.mark.parametrize("case,n", [
    (case, n) for case, features in FEATURES.items()
    for n in sorted(TABLE[features.get("op", "rms_norm")])])
def test_features_match_float64(case, n):
    check_cluster_backward(555, n, **FEATURES[case])


@gpu
@needs_cute
@pytest.mark.parametrize("case,n", [
    (case, n) for case in ("plain", "gemma residual", "layer norm", "layer norm residual",
                           "fp32", "layer norm fp32")
    for n in sorted((TABLE_FP32 if case.endswith("fp32") else TABLE)[
        "layer_norm" if case.startswith("layer norm") else "rms_norm"])])
def test_public_op_runs_it_and_matches_float64_bit_for_bit(case, n, cluster_launches):
    """Through autograd: the decision names the cluster kernel, dx, dweight (and dbias:
    reduced by column_sums) match float64 and a second backward bit for bit; with a fused
    residual the residual's gradient is dx. fp32 x and parameters at the fp32 table's
    widths."""
    g, seed = fresh_generator("cuda")
    m = 1023
    layer_norm = case.startswith("layer norm")
    residual = case.endswith("residual")
    dtype = torch.float32 if case.endswith("fp32") else torch.bfloat16
    eps = 1e-5 if layer_norm else 1e-6
    x = torch.randn(m, n, generator=g, device="cuda", dtype=dtype)
    w = (0.5 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    b = (0.5 * torch.randn(n, generator=g, device="cuda")).to(dtype) if layer_norm else None
    r = torch.randn_like(x) if residual else None
    offset = 1.0 if case == "gemma residual" else 0.0
    dy = torch.randn_like(x)
    grads = []
    with tilenorm.experimental():
        decision = tilenorm.explain(x, w, bias=b, layer_norm=layer_norm)
        assert isinstance(decision.cute_backward, CuteClusterBackwardPlan), decision
        assert dispatch.CUTE_CLUSTER_BACKWARD_NAME in str(decision)
        for _ in range(2):
            leaves = [t.detach().requires_grad_() for t in (x, w, b, r) if t is not None]
            xl, wl, *rest = leaves
            bl = rest.pop(0) if layer_norm else None
            rl = rest.pop(0) if residual else None
            if layer_norm:
                y = tilenorm.layer_norm(xl, wl, bl, eps=eps, residual=rl, prenorm=residual)
            else:
                y = tilenorm.rms_norm(xl, wl, eps=eps, offset=offset, residual=rl,
                                      prenorm=residual)
            (y[0] if residual else y).backward(dy)
            grads.append([t.grad for t in leaves])
    assert len(cluster_launches) == 2, "the backward did not run the cluster kernel"
    assert all(p.cols == n for p in cluster_launches)
    ref = float64_norm(x, w, b, eps=eps, layer_norm=layer_norm, offset=offset, residual=r,
                       dy=dy)
    want = [ref.dx, ref.dweight] + ([ref.dbias] if layer_norm else []) + (
        [ref.dresidual] if residual else [])
    # dweight and dbias sum every row's terms: fp32's take DGAMMA_TOL_FP32.
    tols = [OUT_TOL[dtype]] + [max(OUT_TOL[dtype], DGAMMA_TOL_FP32)] * (1 + layer_norm) + (
        [OUT_TOL[dtype]] if residual else [])
    for got, expected, tol in zip(grads[0], want, tols, strict=True):
        assert rel(got, expected) <= tol, seed
    for first, again in zip(*grads, strict=True):
        assert torch.equal(first, again), seed


@gpu
@needs_cute
def test_launch_level_op_adds_the_gradient_of_h(cluster_launches):
    """``rms_norm_backward`` with ``dh`` (the gradient that reached h of a fused residual
    add): dx and dresidual are one tensor, dh added."""
    g, seed = fresh_generator("cuda")
    n = WIDTHS[0]
    x = torch.randn(300, n, generator=g, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    with tilenorm.experimental():
        _, h, rstd = tilenorm.rms_norm_forward(x, w, residual=r)
        dx, dres, dw = tilenorm.rms_norm_backward(dy, h, w, rstd, dh=dh, x_dtype=x.dtype,
                                                  residual_dtype=r.dtype)
    assert cluster_launches, "the backward did not run the cluster kernel"
    ref = float64_norm(x, w, eps=1e-6, residual=r, dy=dy, dh=dh)
    assert dres is dx
    assert rel(dx, ref.dx) <= OUT_TOL[torch.bfloat16], seed
    assert rel(dw, ref.dweight) <= OUT_TOL[torch.bfloat16], seed


@gpu
@needs_cute
@pytest.mark.parametrize("n", sorted(TABLE["layer_norm"]))
def test_launch_level_layer_norm_with_fp32_parameters_and_dh(n, cluster_launches):
    """``layer_norm_backward`` with fp32 weight and bias and ``dh``: dx (and dresidual, the
    same tensor), dweight and dbias against float64 of the stored h, a few rows (not a
    multiple of the grid)."""
    g, seed = fresh_generator("cuda")
    x = torch.randn(37, n, generator=g, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = 1 + 0.5 * torch.randn(n, generator=g, device="cuda")
    b = 0.5 * torch.randn(n, generator=g, device="cuda")
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    with tilenorm.experimental():
        _, h, mean, rstd = tilenorm.layer_norm_forward(x, w, b, residual=r)
        dx, dres, dw, db = tilenorm.layer_norm_backward(
            dy, h, w, b, mean, rstd, dh=dh, x_dtype=x.dtype, residual_dtype=r.dtype)
    assert cluster_launches, "the backward did not run the cluster kernel"
    # The backward reads h as stored (bf16); against the exact x + r the bf16 rounding of h
    # alone moves dweight by ~2e-3, so the fp32 tolerance applies to the math from h.
    assert torch.equal(h, x + r)
    ref = float64_norm(h, w, b, eps=1e-5, layer_norm=True, dy=dy, dh=dh)
    assert dres is dx
    assert rel(dx, ref.dx) <= OUT_TOL[torch.bfloat16], seed
    assert rel(dw, ref.dweight) <= DGAMMA_TOL_FP32, seed
    assert rel(db, ref.dbias) <= DGAMMA_TOL_FP32, seed


@gpu
@needs_cute
def test_cuda_graph_replay_matches_eager_bit_for_bit(cluster_launches):
    """The kernel and its reduction launch on torch's current stream: a CUDA graph captures
    them."""
    g, _ = fresh_generator("cuda")
    n = WIDTHS[0]
    x = torch.randn(512, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    with tilenorm.experimental():
        _, h, rstd = tilenorm.rms_norm_forward(x, w)
        assert isinstance(tilenorm.explain(x, w).cute_backward, CuteClusterBackwardPlan)
        check_graph_replay_matches_eager(lambda: tilenorm.rms_norm_backward(dy, h, w, rstd))
    assert cluster_launches, "the backward did not run the cluster kernel"


@gpu
def test_max_active_clusters_is_what_the_device_holds():
    """The stand-in's count: positive, at most the SMs' CTAs over the cluster, no fewer at
    two CTAs an SM than at one."""
    from tilenorm.device import device_info, max_active_clusters

    info = device_info(torch.cuda.current_device())
    for cluster in (1, 2, 4, 8):
        one = max_active_clusters(info.index, cluster, 256, 1)
        two = max_active_clusters(info.index, cluster, 256, 2)
        assert 0 < one <= two <= 2 * info.sm_count // cluster, (cluster, one, two)
        assert one <= info.sm_count // cluster


@gpu
@needs_cute
def test_stand_in_counts_the_clusters_the_routed_kernels_hold():
    """The plan's cluster count (the empty stand-in's) is the driver's count for each routed
    kernel's own cubin (read as the probe reads it)."""
    from bench.experiments.cute_cluster_backward_probe import (
        Config,
        compile_kernel,
        make_kernel,
        max_clusters,
    )
    from tilenorm.device import max_active_clusters

    device = torch.cuda.current_device()
    for cols, (cluster, threads, stages, ctas) in TABLE["rms_norm"].items():
        config = Config(cluster, threads, stages, ctas)
        with tempfile.TemporaryDirectory() as tmp:
            fn = compile_kernel(cols, config, cubin_dir=tmp)
        found, source = max_clusters(fn, make_kernel(cols, config))
        assert source.startswith("cuOccupancyMaxActiveClusters"), source
        assert max_active_clusters(device, cluster, threads, ctas) == found, cols
