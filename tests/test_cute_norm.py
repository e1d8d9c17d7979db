"""The CuTe DSL row-norm backward (tilenorm/cute/norm.py): its plan, its ahead-of-time build
for Hopper and Blackwell, the route that picks it, and (GPU) its outputs against float64."""

import pytest
import torch

import tilenorm
from tests import float64_reference as ref64
from tests.kernel_harness import DGAMMA_TOL_FP32, OUT_TOL, fresh_generator, poisoned, rel
from tilenorm import cute
from tilenorm.planner import CUTE_BACKWARD, plan_cute_backward
from tilenorm.pytorch import routing

gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
WIDTHS = sorted({cols for widths in CUTE_BACKWARD.values() for cols in widths})


@pytest.mark.parametrize("rows", [1, 2, 131, 264, 265, 32768, 100003])
@pytest.mark.parametrize("sm_count", [1, 7, 132, 148])
def test_plan_gives_every_row_to_one_program(rows, sm_count):
    for op, widths in CUTE_BACKWARD.items():
        for cols, (threads, stages, ctas) in widths.items():
            p = plan_cute_backward(rows, cols, itemsize=2, sm_count=sm_count, op=op)
            assert p.grid == min(rows, sm_count * ctas) == p.partial_rows
            assert (p.threads, p.stages, p.ctas_per_sm) == (threads, stages, ctas)
            seen = sorted(r for prog in range(p.grid) for r in p.program_rows(prog))
            assert seen == list(range(rows))
            assert all(len(p.program_rows(prog)) for prog in range(p.grid)), "no idle program"


def test_plan_only_where_measured():
    cols = WIDTHS[0]
    assert plan_cute_backward(100, cols, itemsize=2, sm_count=132, op="layer_norm")
    assert plan_cute_backward(100, cols + 8, itemsize=2, sm_count=132, op="layer_norm") is None
    assert plan_cute_backward(100, cols, itemsize=4, sm_count=132, op="layer_norm") is None
    assert plan_cute_backward(100, cols, itemsize=2, sm_count=132, op="layer_norm",
                              heads=2) is None
    assert plan_cute_backward(100, cols, itemsize=2, sm_count=132, op="rms_norm") is None
    rows = 2**31 // cols
    assert plan_cute_backward(rows, cols, itemsize=2, sm_count=132, op="layer_norm")
    assert plan_cute_backward(rows + 1, cols, itemsize=2, sm_count=132, op="layer_norm") is None
    assert plan_cute_backward(10, cols, itemsize=2, sm_count=132, op="layer_norm",
                              max_offset=2**31) is None
    with pytest.raises(ValueError):
        plan_cute_backward(100, cols, itemsize=2, sm_count=0, op="layer_norm")


@needs_cute
def test_route_picks_it_only_for_its_dtypes_and_when_allowed(monkeypatch):
    bf16, fp32, fp16 = torch.bfloat16, torch.float32, torch.float16
    pick = routing._cute_backward
    cols = WIDTHS[0]
    last = 1000 * cols - 1
    assert pick("layer_norm", (bf16, fp32, fp32), 1000, 1, cols, last, 132, True)
    assert pick("layer_norm", (bf16, bf16), 1000, 1, cols, last, 132, True)
    assert pick("layer_norm", (bf16, fp16), 1000, 1, cols, last, 132, True) is None
    assert pick("layer_norm", (fp32, fp32), 1000, 1, cols, last, 132, True) is None
    assert pick("layer_norm", (bf16,), 1000, 1, cols, 2**31, 132, True) is None
    monkeypatch.setattr(routing.validation, "is_stable", lambda family: False)
    assert pick("layer_norm", (bf16,), 1000, 1, cols, last, 132, False) is None


@pytest.mark.aot
@needs_cute
def test_every_variant_builds_for_hopper_and_blackwell():
    from tilenorm.cute import norm as cute_norm

    for key in cute_norm.aot_keys(all_dtypes=True):
        for arch in cute_norm.AOT_ARCHS:
            assert callable(cute_norm.compile_backward(key, arch)), (key, arch)


# --- GPU --------------------------------------------------------------------------------


def _plan(rows, cols):
    from tilenorm.device import device_info

    info = device_info(torch.cuda.current_device())
    return plan_cute_backward(rows, cols, itemsize=2, sm_count=info.sm_count,
                              op="layer_norm")


def check_backward(m, n, dtype=torch.bfloat16, w_dtype=torch.float32, has_weight=True,
                   has_bias=True, eps=1e-5):
    """The kernel on poisoned dx and partial buffer against float64: every dx element and
    partial slot written, dx / dgamma / dbeta accurate, a rerun bit-identical."""
    from tilenorm.cute import norm as cute_norm

    g, seed = fresh_generator("cuda")
    x = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(w_dtype) if has_weight \
        else None
    b = torch.randn(n, generator=g, device="cuda").to(w_dtype) if has_bias else None
    _, _, mean, rstd = ref64.norm_fwd(x, w, b, eps, layer_norm=True)
    mean, rstd = mean.float(), rstd.float()
    plan = _plan(m, n)
    assert cute_norm.takes(x, dy), seed
    groups = int(has_weight) + int(has_bias)
    outputs = []
    for _ in range(2):
        dx = poisoned((m, n), dtype)
        partial = poisoned((plan.partial_rows, groups, n), torch.float32) if groups else None
        cute_norm.run_backward(plan, x, dy, w, b, mean, rstd, dx, partial)
        torch.cuda.synchronize()
        outputs.append((dx, partial))
    (dx, partial), (dx2, partial2) = outputs
    assert not dx.isnan().any(), f"every dx element written (seed {seed})"
    assert torch.equal(dx, dx2), f"rerun bit-identical (seed {seed})"
    dx64, dw64, db64, scale = ref64.norm_bwd(dy, x, w, eps, layer_norm=True)
    assert rel(dx, dx64) <= OUT_TOL[dtype], seed
    if groups:
        assert not partial.isnan().any(), f"every partial slot written (seed {seed})"
        assert torch.equal(partial, partial2), f"rerun bit-identical (seed {seed})"
        sums = partial.double().sum(0)
        refs = ([dw64] if has_weight else []) + ([db64] if has_bias else [])
        for got, want in zip(sums, refs, strict=True):
            assert rel(got, want) <= DGAMMA_TOL_FP32, seed


@gpu
@needs_cute
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("m", [1, 7, 264, 1000, 32768])
def test_matches_float64(m, n):
    check_backward(m, n)


@gpu
@needs_cute
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("case", ["fp16", "bf16 weight", "weight only", "bias only",
                                  "no affine"])
def test_features_match_float64(case, n):
    kw = {"fp16": dict(dtype=torch.float16, w_dtype=torch.float16),
          "bf16 weight": dict(w_dtype=torch.bfloat16),
          "weight only": dict(has_bias=False),
          "bias only": dict(has_weight=False),
          "no affine": dict(has_weight=False, has_bias=False)}[case]
    check_backward(555, n, **kw)


def _float64_layer_norm(x, w, b, eps, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = torch.nn.functional.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], eps)
    y.backward(dy.double())
    return y, *(t.grad for t in leaves)


@gpu
@needs_cute
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_public_op_runs_it_and_matches_float64(compiled):
    g, seed = fresh_generator("cuda")
    n = WIDTHS[0]
    x = torch.randn(4, 300, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    with tilenorm.experimental():
        route = tilenorm.explain(x, w, bias=b, layer_norm=True)
        assert route.cute_backward is not None and "CuTe DSL" in str(route)
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
def test_cuda_graph_replay_matches_eager_bit_for_bit():
    """The kernel launches on torch's current stream, so a CUDA graph captures it."""
    g, _ = fresh_generator("cuda")
    n = WIDTHS[0]
    x = torch.randn(2048, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.5 * torch.randn(n, generator=g, device="cuda")
    b = torch.randn(n, generator=g, device="cuda")
    dy = torch.randn_like(x)
    with tilenorm.experimental():
        _, h, mean, rstd = tilenorm.layer_norm_forward(x, w, b)
        eager = tilenorm.layer_norm_backward(dy, h, w, b, mean, rstd)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tilenorm.layer_norm_backward(dy, h, w, b, mean, rstd)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = tilenorm.layer_norm_backward(dy, h, w, b, mean, rstd)
        for t in captured:
            if t is not None:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


@gpu
@needs_cute
def test_strided_rows_take_the_cutile_backward_and_match_float64():
    """Rows that are not contiguous fail the kernel's layout (``takes``): the call runs
    cuTile's backward instead, on the same route."""
    from tilenorm.cute import norm as cute_norm

    g, seed = fresh_generator("cuda")
    n = WIDTHS[0]
    x = torch.randn(300, n + 64, generator=g, device="cuda", dtype=torch.bfloat16)[:, :n]
    w = 1 + 0.5 * torch.randn(n, generator=g, device="cuda")
    b = torch.randn(n, generator=g, device="cuda")
    dy = torch.randn(300, n, generator=g, device="cuda", dtype=torch.bfloat16)
    assert not cute_norm.takes(x, dy)
    with tilenorm.experimental():
        _, h, mean, rstd = tilenorm.layer_norm_forward(x, w, b)
        dx, _, dw, db = tilenorm.layer_norm_backward(dy, x, w, b, mean, rstd)
    dx64, dw64, db64, _ = ref64.norm_bwd(dy, x, w, 1e-5, layer_norm=True)
    assert rel(dx, dx64) <= 1e-2, seed
    assert rel(dw, dw64) <= DGAMMA_TOL_FP32 and rel(db, db64) <= DGAMMA_TOL_FP32, seed
