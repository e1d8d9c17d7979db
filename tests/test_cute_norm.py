"""The CuTe DSL row-norm backward (tilenorm/kernels/cute_row_norm_backward.py): its plan, its
ahead-of-time build for Hopper and Blackwell, the decision that picks it, and (GPU) its outputs
against float64."""

import dataclasses

import pytest
import torch

import tilenorm
from tests.kernel_harness import (
    DGAMMA_TOL_FP32,
    H100,
    H200,
    OUT_TOL,
    check_graph_replay_matches_eager,
    fresh_generator,
    poisoned,
    rel,
)
from tilenorm import dispatch
from tilenorm.launch import cute
from tilenorm.planner import plan_cute_backward
from tilenorm.settings import SM90
from tilenorm.testing import float64_norm

gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
CUTE_BACKWARD = SM90.cute_backward
#: (op, width) of every entry; LayerNorm's first width serves the tests of the routing.
CASES = [(op, cols) for op, widths in sorted(CUTE_BACKWARD.items()) for cols in sorted(widths)]
LN_WIDTH = min(CUTE_BACKWARD["layer_norm"])


@pytest.mark.parametrize("rows", [1, 2, 131, 264, 265, 32768, 100003])
@pytest.mark.parametrize("sm_count", [1, 7, 132, 148])
def test_plan_gives_every_row_to_one_program(rows, sm_count):
    for op, widths in CUTE_BACKWARD.items():
        for cols, (threads, stages, ctas) in widths.items():
            p = plan_cute_backward(rows, cols, itemsize=2, sm_count=sm_count, arch=(9, 0),
                                   op=op)
            assert p.grid == min(rows, sm_count * ctas) == p.partial_rows
            assert (p.threads, p.stages, p.ctas_per_sm) == (threads, stages, ctas)
            seen = sorted(r for prog in range(p.grid) for r in p.program_rows(prog))
            assert seen == list(range(rows))
            assert all(len(p.program_rows(prog)) for prog in range(p.grid)), "no idle program"


@pytest.mark.parametrize(("op", "cols"), CASES)
def test_plan_only_where_measured(op, cols):
    def plan(rows=100, cols=cols, itemsize=2, op=op, **kw):
        return plan_cute_backward(rows, cols, itemsize=itemsize, sm_count=kw.pop("sm_count", 132),
                                  arch=(9, 0), op=op, **kw)

    assert plan()
    assert plan(cols=cols + 8) is None
    assert plan(itemsize=4) is None
    assert plan(heads=2) is None
    other = "rms_norm" if op == "layer_norm" else "layer_norm"
    assert (plan(op=other) is None) == (cols not in CUTE_BACKWARD.get(other, {}))
    rows = 2**31 // cols
    assert plan(rows=rows)
    assert plan(rows=rows + 1) is None
    assert plan(rows=10, max_offset=2**31) is None
    with pytest.raises(ValueError):
        plan(sm_count=0)


@needs_cute
def test_decision_picks_it_only_for_its_dtypes_and_when_allowed(monkeypatch):
    """On an H200; an H100 keeps cuTile's backward at 4096 (#38)."""
    cols = LN_WIDTH
    last = 1000 * cols - 1

    def pick(dtypes, max_offset=last, allow=True, device=H200):
        p = dispatch.Problem("layer_norm", "cuda", 0, dtypes, 1000, 1, cols, False, max_offset,
                             allow)
        return dispatch._cute_backward(p, device)

    assert pick(("bfloat16", "float32", "float32"))
    assert pick(("bfloat16", "float32", "float32"), device=H100) is None
    assert pick(("bfloat16", "bfloat16"))
    assert pick(("bfloat16", "float16")) is None
    assert pick(("float32", "float32")) is None
    assert pick(("bfloat16",), max_offset=2**31) is None
    monkeypatch.setattr(dispatch.validation, "is_stable", lambda family: False)
    assert pick(("bfloat16",), allow=False) is None


def test_backward_kernel_takes_it_only_where_the_call_allows():
    decision = dispatch.Decision(
        op="layer_norm", reason="", backward=plan_row_norm_backward(),
        cute_backward=plan_cute_backward(1000, LN_WIDTH, itemsize=2, sm_count=132,
                                         arch=(9, 0), op="layer_norm"))
    plain = dict(has_residual=False, has_dres_in=False, has_offset=False, same_dtypes=True,
                 dense_aligned=True, max_offset=0)
    assert dispatch.backward_kernel(decision, dispatch.BackwardFacts(**plain)) \
        is decision.cute_backward
    for change in (dict(has_residual=True), dict(has_dres_in=True), dict(has_offset=True),
                   dict(same_dtypes=False), dict(dense_aligned=False)):
        facts = dispatch.BackwardFacts(**{**plain, **change})
        assert dispatch.backward_kernel(decision, facts) is decision.backward, change
    wide = dispatch.BackwardFacts(**{**plain, "dense_aligned": False, "max_offset": 2**31})
    assert dispatch.backward_kernel(decision, wide).index_bits == 64


def plan_row_norm_backward():
    from tilenorm.planner import plan_row_norm

    return plan_row_norm(1000, LN_WIDTH, itemsize=2, sm_count=132, arch=(9, 0),
                         direction="backward", op="layer_norm")


@pytest.mark.aot
@needs_cute
def test_every_variant_builds_for_hopper_and_blackwell():
    for key in cute.aot_keys(all_dtypes=True):
        for arch in cute.AOT_ARCHS:
            assert callable(cute.compile_backward(key, arch)), (key, arch)


# --- GPU --------------------------------------------------------------------------------


def _plan(rows, cols, op):
    from tilenorm.device import device_info

    info = device_info(torch.cuda.current_device())
    return plan_cute_backward(rows, cols, itemsize=2, sm_count=info.sm_count, arch=info.arch,
                              op=op, settings=SM90)


def check_backward(m, n, op="layer_norm", dtype=torch.bfloat16, w_dtype=torch.float32,
                   has_weight=True, has_bias=None, eps=1e-5, shared_ring=False):
    """The kernel on poisoned dx and partial buffer against float64: every dx element and
    partial slot written, dx / dgamma / dbeta accurate, a rerun bit-identical. A bias is
    LayerNorm's by default (RMSNorm has none). ``shared_ring``: the kernel with its ring in
    shared memory runs too, on the same inputs: RMSNorm's to the register ring's bits;
    LayerNorm's, whose arithmetic the compiler contracts differently there (13 of 4M dx
    elements differ, bench/NOTES.md #133), held to the same checks on its own."""
    layer_norm = op == "layer_norm"
    if has_bias is None:
        has_bias = layer_norm
    g, seed = fresh_generator("cuda")
    x = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(w_dtype) if has_weight \
        else None
    b = torch.randn(n, generator=g, device="cuda").to(w_dtype) if has_bias else None
    ref = float64_norm(x, w, b, eps, layer_norm=layer_norm, dy=dy)
    mean, rstd = (ref.mean.float() if layer_norm else None), ref.rstd.float()
    plan = _plan(m, n, op)
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    key = cute.BackwardKey.of(plan, names[dtype], None if w is None else names[w.dtype],
                              has_bias, layer_norm)
    kernels = [key] + [dataclasses.replace(key, shared_ring=True)] * shared_ring
    groups = int(has_weight) + int(has_bias)
    outputs = []
    for k in kernels:
        fn = cute.compiled_backward(k, torch.cuda.get_device_capability())
        runs = []
        for _ in range(2):
            dx = poisoned((m, n), dtype)
            partial = (poisoned((plan.partial_rows, groups, n), torch.float32) if groups
                       else None)
            fn(x, dy, w, mean, rstd, dx, partial, plan.grid)
            torch.cuda.synchronize()
            runs.append((dx, partial))
        (dx, partial), (dx2, partial2) = runs
        name = "the shared ring" if k.shared_ring else "the register ring"
        assert not dx.isnan().any(), f"{name}: every dx element written (seed {seed})"
        assert torch.equal(dx, dx2), f"{name}: rerun bit-identical (seed {seed})"
        assert rel(dx, ref.dx) <= OUT_TOL[dtype], (name, seed)
        if groups:
            assert not partial.isnan().any(), f"{name}: every partial slot (seed {seed})"
            assert torch.equal(partial, partial2), f"{name}: rerun bit-identical ({seed})"
            sums = partial.double().sum(0)
            refs = ([ref.dweight] if has_weight else []) + ([ref.dbias] if has_bias else [])
            for got, want in zip(sums, refs, strict=True):
                assert rel(got, want) <= DGAMMA_TOL_FP32, (name, seed)
        outputs.append(runs[0])
    if shared_ring and not layer_norm:
        (dx, partial), (dx_ring, partial_ring) = outputs
        assert torch.equal(dx_ring, dx), f"the shared ring's dx (seed {seed})"
        if groups:
            assert torch.equal(partial_ring, partial), f"its partials (seed {seed})"


@gpu
@needs_cute
@pytest.mark.parametrize(("op", "n"), CASES)
@pytest.mark.parametrize("m", [1, 7, 264, 1000, 32768])
def test_matches_float64(m, op, n):
    check_backward(m, n, op)


FEATURES = {"fp16": dict(dtype=torch.float16, w_dtype=torch.float16),
            "bf16 weight": dict(w_dtype=torch.bfloat16),
            "weight only": dict(has_bias=False),
            "bias only": dict(has_weight=False, has_bias=True),
            "no affine": dict(has_weight=False, has_bias=False)}


@gpu
@needs_cute
@pytest.mark.parametrize(("op", "n", "case"), [
    (op, n, case) for op, n in CASES for case in FEATURES
    if op == "layer_norm" or case not in ("weight only", "bias only")])
def test_features_match_float64(op, n, case):
    check_backward(555, n, op, **FEATURES[case])


@gpu
@needs_cute
@pytest.mark.parametrize(("op", "n"), CASES)
@pytest.mark.parametrize("m", [7, 1000, 32768])
def test_ring_in_shared_memory_has_the_register_rings_bits(m, op, n):
    check_backward(m, n, op, shared_ring=True)


def _float64_layer_norm(x, w, b, eps, dy):
    ref = float64_norm(x, w, b, eps, layer_norm=True, dy=dy)
    return ref.y, ref.dx, ref.dweight, ref.dbias


@gpu
@needs_cute
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_public_op_runs_it_and_matches_float64(compiled, decide_as_class):
    """With the H200's settings, on any GPU: the H100's keep cuTile's backward (#38)."""
    decide_as_class("h200")
    g, seed = fresh_generator("cuda")
    n = LN_WIDTH
    x = torch.randn(4, 300, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    with tilenorm.experimental():
        decision = tilenorm.explain(x, w, bias=b, layer_norm=True)
        assert decision.cute_backward is not None and "CuTe DSL" in str(decision)
        fn = tilenorm.layer_norm
        if compiled:
            fn = torch.compile(lambda x, w, b: tilenorm.layer_norm(x, w, b), fullgraph=True)
        xg = x.clone().requires_grad_()
        fn(xg, w, b).backward(dy)
    _, dx64, dw64, db64 = _float64_layer_norm(x, w, b, 1e-5, dy)
    assert rel(xg.grad, dx64) <= 1e-2, seed
    assert rel(w.grad, dw64) <= DGAMMA_TOL_FP32 and rel(b.grad, db64) <= DGAMMA_TOL_FP32, seed


@gpu
@needs_cute
@pytest.mark.parametrize("n", sorted(CUTE_BACKWARD["rms_norm"]))
def test_public_rms_norm_runs_it_and_matches_float64(n, decide_as_class):
    """RMSNorm's entries through the public op with the H200's settings (the H100's keep
    cuTile's backward): dx and dweight against float64, a second backward bit for bit."""
    decide_as_class("h200")
    g, seed = fresh_generator("cuda")
    x = torch.randn(3, 700, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    grads = []
    with tilenorm.experimental():
        decision = tilenorm.explain(x, w)
        assert decision.cute_backward is not None and "CuTe DSL" in str(decision)
        for _ in range(2):
            xg = x.clone().requires_grad_()
            w.grad = None
            tilenorm.rms_norm(xg, w).backward(dy)
            grads.append((xg.grad, w.grad))
    ref = float64_norm(x, w, None, 1e-6, dy=dy)
    (dx, dw), (dx2, dw2) = grads
    assert rel(dx, ref.dx) <= 1e-2 and rel(dw, ref.dweight) <= DGAMMA_TOL_FP32, seed
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2), seed


@gpu
@needs_cute
def test_cuda_graph_replay_matches_eager_bit_for_bit(decide_as_class):
    """The kernel launches on torch's current stream, so a CUDA graph captures it (the
    H200's settings route it)."""
    decide_as_class("h200")
    g, _ = fresh_generator("cuda")
    n = LN_WIDTH
    x = torch.randn(2048, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.5 * torch.randn(n, generator=g, device="cuda")
    b = torch.randn(n, generator=g, device="cuda")
    dy = torch.randn_like(x)
    with tilenorm.experimental():
        _, h, mean, rstd = tilenorm.layer_norm_forward(x, w, b)
        check_graph_replay_matches_eager(
            lambda: tilenorm.layer_norm_backward(dy, h, w, b, mean, rstd))


@gpu
@needs_cute
def test_strided_rows_take_the_cutile_backward_and_match_float64(decide_as_class):
    """Rows that are not contiguous fail the kernel's layout: the call runs cuTile's backward
    instead, on the same decision (the H200's settings, which route the kernel)."""
    decide_as_class("h200")
    g, seed = fresh_generator("cuda")
    n = LN_WIDTH
    x = torch.randn(300, n + 64, generator=g, device="cuda", dtype=torch.bfloat16)[:, :n]
    w = 1 + 0.5 * torch.randn(n, generator=g, device="cuda")
    b = torch.randn(n, generator=g, device="cuda")
    dy = torch.randn(300, n, generator=g, device="cuda", dtype=torch.bfloat16)
    assert not x.is_contiguous()
    with tilenorm.experimental():
        _, h, mean, rstd = tilenorm.layer_norm_forward(x, w, b)
        dx, _, dw, db = tilenorm.layer_norm_backward(dy, x, w, b, mean, rstd)
    _, dx64, dw64, db64 = _float64_layer_norm(x, w, b, 1e-5, dy)
    assert rel(dx, dx64) <= 1e-2, seed
    assert rel(dw, dw64) <= DGAMMA_TOL_FP32 and rel(db, db64) <= DGAMMA_TOL_FP32, seed
