"""The CuTe DSL cluster RMSNorm backward (tilenorm/kernels/cute_cluster_norm_backward.py): its
plan, its ahead-of-time build for Hopper and Blackwell (and its registers: no spills at
sm_90a), the decision that picks it, and (GPU) its outputs against float64, through the
kernel and through the ops."""

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
    check_graph_replay_matches_eager,
    fresh_generator,
    poisoned,
    rel,
)
from tilenorm import dispatch
from tilenorm.launch import cute
from tilenorm.planner import CuteClusterBackwardPlan, plan_cute_cluster_backward
from tilenorm.settings import SM90
from tilenorm.testing import float64_norm, row_blocks

gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
TABLE = SM90.cute_cluster_backward
WIDTHS = sorted({cols for widths in TABLE.values() for cols in widths})
#: Registers and shared memory of an SM (sm_90, sm_100), and what sm_90 reserves a CTA.
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED = 65536, 233472, 1024


def made_up_residency(cluster, threads, ctas_per_sm):
    """Clusters co-resident on a made-up H100: two of eight CTAs a GPC, per CTA an SM."""
    return 16 * ctas_per_sm


def plan(rows, cols=WIDTHS[0], itemsize=2, op="rms_norm", resident=made_up_residency,
         **kw):
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


def test_plan_only_where_measured_and_asks_residency_only_then():
    asked = []

    def resident(*shape):
        asked.append(shape)
        return 32

    cols = WIDTHS[0]
    assert plan(100, resident=resident)
    cluster, threads, _, ctas = TABLE["rms_norm"][cols]
    assert asked == [(cluster, threads, ctas)]
    for refused in (dict(cols=cols + 8), dict(itemsize=4), dict(heads=2),
                    dict(op="layer_norm"), dict(max_offset=2**31)):
        assert plan(100, resident=resident, **refused) is None, refused
    rows = 2**31 // cols
    assert plan(rows, resident=resident) and plan(rows + 1, resident=resident) is None
    assert len(asked) == 2
    with pytest.raises(ValueError):
        plan(100, resident=lambda *shape: 0)


def test_a_layer_norm_entry_is_refused_not_run_as_rms_norm():
    """The kernel computes RMSNorm's gradient and its key names no op: a LayerNorm entry
    (a tuning table, say) must not reach it."""
    tuned = dataclasses.replace(SM90, cute_cluster_backward={
        **SM90.cute_cluster_backward, "layer_norm": SM90.cute_cluster_backward["rms_norm"]})
    with pytest.raises(ValueError, match="RMSNorm's only"):
        plan_cute_cluster_backward(100, WIDTHS[0], itemsize=2, arch=(9, 0), op="layer_norm",
                                   resident_clusters=made_up_residency, settings=tuned)


def test_settings_entries_fit_the_kernel():
    """Each entry: a portable cluster, whole 16-byte vectors of its threads a CTA, a warp per
    cluster CTA to push the row sum, and CTAs per SM that its shared memory allows (with a
    residual's gradient staged too)."""
    for widths in TABLE.values():
        for cols, (cluster, threads, stages, ctas) in widths.items():
            assert 1 <= cluster <= 8 and cols % (cluster * 8 * threads) == 0
            assert threads // 32 >= cluster and stages >= 1
            per_cta = SMEM_PER_SM // ctas - SMEM_RESERVED
            rows = 3 * stages * (cols // cluster) * 2
            assert rows + 2 * cluster * threads // 32 * 4 * max(2, stages) + 64 <= per_cta


def test_cluster_widths_are_the_column_split_widths_it_replaces():
    """The cluster backward wins at exactly its table's widths: each is past the single-pass
    limit (the cuTile backward there is the two-pass column split it replaces), none is a
    one-CTA CuTe backward's width, and the widths beside them get no cluster plan."""
    from tilenorm.planner import plan_row_norm

    for op, widths in TABLE.items():
        limit = SM90.max_single_pass_bytes["backward"][op] // 2
        for cols in widths:
            assert cols > limit, (op, cols)
            cutile = plan_row_norm(1000, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                   direction="backward", op=op)
            assert cutile.col_tiles > 1, (op, cols)
            assert cols not in SM90.cute_backward.get(op, {}), (op, cols)
            assert plan(1000, cols, op=op)
            for beside in (cols // 2 + cols // 4, cols + cols // 2):
                if beside not in widths:
                    assert plan(1000, beside, op=op) is None, (op, beside)


@needs_cute
def test_decision_picks_it_for_wide_rms_norm_rows(monkeypatch):
    monkeypatch.setattr(dispatch, "max_active_clusters",
                        lambda index, *shape: made_up_residency(*shape))
    cols = WIDTHS[0]

    def pick(dtypes=("bfloat16", "bfloat16"), op="rms_norm", cols=cols, allow=True,
             max_offset=None):
        rows = 1000
        p = dispatch.Problem(op, "cuda", 0, dtypes, rows, 1, cols, False,
                             rows * cols - 1 if max_offset is None else max_offset, allow)
        return dispatch._cute_backward(p, H100)

    chosen = pick()
    assert isinstance(chosen, CuteClusterBackwardPlan)
    assert chosen.clusters == made_up_residency(chosen.cluster, chosen.threads,
                                                chosen.ctas_per_sm)
    assert isinstance(pick(("bfloat16", "float32")), CuteClusterBackwardPlan)
    assert isinstance(pick(("bfloat16",)), CuteClusterBackwardPlan)
    assert pick(("bfloat16", "float16")) is None
    assert pick(("float32", "float32")) is None
    assert pick(max_offset=2**31) is None
    assert not isinstance(pick(cols=cols + 1024), CuteClusterBackwardPlan)
    monkeypatch.setattr(dispatch.validation, "is_stable", lambda family: False)
    assert pick(allow=False) is None


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


def test_backward_kernel_takes_it_with_a_residual_and_an_offset():
    """Unlike the row backward, the cluster backward adds the gradient that reached h and
    the weight offset; a residual's gradient in another dtype than x's it does not write."""
    from tilenorm.planner import plan_row_norm

    decision = dispatch.Decision(
        op="rms_norm", reason="",
        backward=plan_row_norm(1000, WIDTHS[0], itemsize=2, sm_count=132, arch=(9, 0),
                               direction="backward"),
        cute_backward=plan(1000))
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
                dict(has_offset=True, weight_dtype=None),
                dict(weight_in="smem", weight_dtype=cutlass.Float32)):
        kw = dict(dtype=bf16, weight_dtype=bf16, cols=65536, cluster=8, threads=256,
                  stages=2, ctas_per_sm=2) | bad
        with pytest.raises(ValueError):
            ClusterRowNormBackward(**kw)


@pytest.mark.aot
@needs_cute
def test_every_variant_builds_for_hopper_and_blackwell():
    keys = cute.aot_cluster_backward_keys(all_dtypes=True)
    assert {k.cols for k in keys} == set(WIDTHS)
    for key in keys:
        for arch in cute.AOT_ARCHS:
            assert callable(cute.compile_cluster_backward(key, arch)), (key, arch)


#: The variants that spill at sm_90a: an fp32 weight (32 registers a thread at 4 vectors a
#: thread) in 128 registers (65536: two CTAs of 256 threads an SM, beside a residual's
#: gradient; 32768: one CTA of 512 threads): one store before the row loop and one load a
#: trip of two rows, not in the per-vector loops.
SPILLING = {("float32", True, 65536): 1, ("float32", False, 32768): 1,
            ("float32", True, 32768): 1}


@pytest.mark.aot
@needs_cute
def test_routed_variants_do_not_spill_at_sm_90a():
    """Every routed variant's sm_90a cubin read by cuobjdump: no spill stores (but the one
    :data:`SPILLING` names), registers that let ``ctas_per_sm`` CTAs an SM hold, and shared
    memory that does."""
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
        allowed = SPILLING.get((key.weight_dtype, key.has_dres_in, key.cols), 0)
        assert stores == found["spill_stores"] <= allowed, (key, found)
        assert found["registers"] * key.threads * key.ctas_per_sm <= REGS_PER_SM, (key, found)
        shared = found["shared"] + key.kernel().shared_bytes()
        assert shared * key.ctas_per_sm <= SMEM_PER_SM, (key, shared)


# --- GPU --------------------------------------------------------------------------------


NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _plan(rows, cols):
    from tilenorm.device import device_info, max_active_clusters

    info = device_info(torch.cuda.current_device())
    return plan_cute_cluster_backward(
        rows, cols, itemsize=2, arch=info.arch, op="rms_norm",
        resident_clusters=lambda *shape: max_active_clusters(info.index, *shape))


def _reference(x, w, eps, dy, offset, dres):
    """float64 dx and dweight, a block of rows at a time (x up to 256 MB)."""
    m, n = x.shape
    dx = torch.empty(m, n, dtype=torch.float64, device=x.device)
    dweight = None if w is None else torch.zeros(n, dtype=torch.float64, device=x.device)
    rstd = torch.empty(m, dtype=torch.float64, device=x.device)
    for block in row_blocks(m, n):
        ref = float64_norm(x[block], w, None, eps, offset=offset, dy=dy[block],
                           dh=None if dres is None else dres[block])
        dx[block], rstd[block] = ref.dx, ref.rstd
        if w is not None:
            dweight += ref.dweight
        del ref
    return dx, dweight, rstd.float()


def check_cluster_backward(m, n, dtype=torch.bfloat16, w_dtype=torch.bfloat16,
                           offset=0.0, residual=False, eps=1e-6, reruns=2):
    """The kernel on poisoned dx and partial buffer against float64: every dx element and
    partial slot written, dx and dweight accurate, reruns bit-identical."""
    g, seed = fresh_generator("cuda")
    x = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    w = (None if w_dtype is None
         else (0.5 * torch.randn(n, generator=g, device="cuda") + (1 - offset)).to(w_dtype))
    dres = torch.randn(m, n, generator=g, device="cuda").to(dtype) if residual else None
    ref_dx, ref_dw, rstd = _reference(x, w, eps, dy, offset, dres)
    plan = _plan(m, n)
    assert plan.clusters <= m and plan.grid == plan.clusters * plan.cluster
    fn = cute.compiled_cluster_backward(cute.ClusterBackwardKey.of(
        plan, NAMES[dtype], None if w is None else NAMES[w.dtype], offset != 0, residual))
    outputs = []
    for _ in range(reruns):
        dx = poisoned((m, n), dtype)
        partial = None if w is None else poisoned((plan.partial_rows, 1, n), torch.float32)
        fn(x, dy, w, rstd, dres, dx, partial, offset, plan.grid)
        torch.cuda.synchronize()
        outputs.append((dx, partial))
    dx, partial = outputs[0]
    assert not dx.isnan().any(), f"every dx element written (seed {seed})"
    assert rel(dx, ref_dx) <= OUT_TOL[dtype], seed
    for dx2, partial2 in outputs[1:]:
        assert torch.equal(dx, dx2), f"rerun bit-identical (seed {seed})"
        assert partial is None or torch.equal(partial, partial2), f"bit-identical ({seed})"
    if w is not None:
        assert not partial.isnan().any(), f"every partial slot written (seed {seed})"
        assert rel(partial.double().sum((0, 1)), ref_dw) <= DGAMMA_TOL_FP32, seed
    return plan


@gpu
@needs_cute
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("m", ["1", "3", "1023", "clusters", "2 clusters + 1", "2048"])
def test_matches_float64(m, n):
    """Row counts: one, fewer than the clusters, ragged, as many as the clusters (one row
    each) and past them (clusters take several, a trip of two rows left half full)."""
    clusters = _plan(2**31 // n, n).clusters
    rows = {"clusters": clusters, "2 clusters + 1": 2 * clusters + 1}.get(m) or int(m)
    p = check_cluster_backward(rows, n)
    assert p.clusters == min(rows, clusters)


@gpu
@needs_cute
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("case", ["fp16", "fp32 weight", "no weight", "gemma offset",
                                  "residual", "gemma offset, fp32 weight, residual"])
def test_features_match_float64(case, n):
    kw = {"fp16": dict(dtype=torch.float16, w_dtype=torch.float16),
          "fp32 weight": dict(w_dtype=torch.float32),
          "no weight": dict(w_dtype=None),
          "gemma offset": dict(offset=1.0),
          "residual": dict(residual=True),
          "gemma offset, fp32 weight, residual": dict(offset=1.0, w_dtype=torch.float32,
                                                      residual=True)}[case]
    check_cluster_backward(555, n, **kw)


@pytest.fixture
def cluster_launches(monkeypatch) -> list:
    """The cluster backward's launches from the torch call path: a call that fell back to
    cuTile (also accurate and deterministic) would pass every value check."""
    from tilenorm.pytorch.calls import BackwardCall

    launches = []
    run = BackwardCall._run_cute_cluster
    monkeypatch.setattr(BackwardCall, "_run_cute_cluster",
                        lambda self, *a: launches.append(self.cute) or run(self, *a))
    return launches


@gpu
@needs_cute
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("case", ["plain", "gemma residual"])
def test_public_op_runs_it_and_matches_float64_bit_for_bit(case, n, cluster_launches):
    """Through autograd: the decision names the cluster kernel, dx and dweight (reduced by
    column_sums) match float64 and a second backward bit for bit; with a fused residual the
    residual's gradient is dx."""
    g, seed = fresh_generator("cuda")
    m = 1023
    x = torch.randn(m, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (0.5 * torch.randn(n, generator=g, device="cuda")).to(torch.bfloat16)
    r = torch.randn_like(x) if case == "gemma residual" else None
    offset = 1.0 if case == "gemma residual" else 0.0
    dy = torch.randn_like(x)
    grads = []
    with tilenorm.experimental():
        decision = tilenorm.explain(x, w)
        assert isinstance(decision.cute_backward, CuteClusterBackwardPlan), decision
        assert dispatch.CUTE_CLUSTER_BACKWARD_NAME in str(decision)
        for _ in range(2):
            leaves = [t.detach().requires_grad_() for t in (x, w) + ((r,) if r is not None
                                                                     else ())]
            if r is None:
                y = tilenorm.rms_norm(leaves[0], leaves[1])
            else:
                y, _ = tilenorm.rms_norm(leaves[0], leaves[1], offset=offset,
                                         residual=leaves[2], prenorm=True)
            y.backward(dy)
            grads.append([t.grad for t in leaves])
    assert len(cluster_launches) == 2, "the backward did not run the cluster kernel"
    ref = float64_norm(x, w, eps=1e-6, offset=offset, residual=r, dy=dy)
    assert rel(grads[0][0], ref.dx) <= OUT_TOL[torch.bfloat16], seed
    assert rel(grads[0][1], ref.dweight) <= OUT_TOL[torch.bfloat16], seed
    if r is not None:
        assert rel(grads[0][2], ref.dresidual) <= OUT_TOL[torch.bfloat16], seed
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
