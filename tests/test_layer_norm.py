"""LayerNorm: the public API, the reference path, and (marked gpu) the cuTile kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tilenorm
from tests.kernel_harness import (
    DGAMMA_TOL_FP32,
    check_kernels,
    check_launch_modes_agree,
    fresh_generator,
    rel,
)
from tilenorm.launch import cute
from tilenorm.settings import SM90
from tilenorm.testing import float64_norm

gpu = pytest.mark.gpu


def float64_layer_norm(x, w, b, eps, dy):
    """(y, dx, dw, db) of the float64 reference (tilenorm.testing)."""
    ref = float64_norm(x, w, b, eps, layer_norm=True, dy=dy)
    return ref.y, ref.dx, ref.dweight, ref.dbias


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 64), (17, 1000)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                       (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
def test_reference_matches_float64_autograd(shape, dtype, tol, affine):
    g, seed = fresh_generator()
    x = (3 + torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    n = shape[-1]
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).requires_grad_() \
        if affine != "none" else None
    b = torch.randn(n, generator=g).to(dtype).requires_grad_() if affine == "weight+bias" \
        else None
    dy = torch.randn(shape, generator=g).to(dtype)
    y = tilenorm.layer_norm(x, w, b, eps=1e-5)
    y.backward(dy)
    y64, dx64, dw64, db64 = float64_layer_norm(x, w, b, 1e-5, dy)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y.double() - y64).norm() <= tol * max(y64.norm(), 1), seed
    if n > 1:  # N = 1: y and dx are exactly 0 up to eps effects
        assert rel(x.grad, dx64) <= tol, seed
    if w is not None and n > 1:
        assert rel(w.grad, dw64) <= tol, seed
    if b is not None:
        assert rel(b.grad, db64) <= tol, seed


@pytest.mark.parametrize("kwargs", [
    dict(normalized_shape=64),
    dict(normalized_shape=(64,), eps=1e-6),
    dict(normalized_shape=[4, 16], elementwise_affine=False),
    dict(normalized_shape=32, bias=False),
    dict(normalized_shape=[2, 16]),
    dict(normalized_shape=32, dtype=torch.float64),
])
def test_module_is_a_drop_in_for_torch_nn_layernorm(kwargs):
    ours, theirs = tilenorm.LayerNorm(**kwargs), torch.nn.LayerNorm(**kwargs)
    assert isinstance(ours, torch.nn.LayerNorm)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert (ours.normalized_shape, ours.eps, ours.elementwise_affine) == (
        theirs.normalized_shape, theirs.eps, theirs.elementwise_affine)
    g, _ = fresh_generator()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    ours.load_state_dict(theirs.state_dict())
    shape = (3, 5, *theirs.normalized_shape)
    x = torch.randn(shape, generator=g, dtype=kwargs.get("dtype", torch.float32))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), theirs(x2)
    torch.testing.assert_close(y1, y2)
    dy = torch.randn(shape, generator=g, dtype=x.dtype)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad)
    for p1, p2 in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad)


def test_module_rejects_wrong_trailing_shape():
    with pytest.raises(ValueError, match="normalized_shape"):
        tilenorm.LayerNorm(64)(torch.randn(2, 32))


def test_compiles_fullgraph_on_cpu_forward_and_backward():
    g, _ = fresh_generator()
    x, w, b, dy = (torch.randn(4, 8, 64, generator=g), torch.randn(64, generator=g),
                   torch.randn(64, generator=g), torch.randn(4, 8, 64, generator=g))
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled = torch.compile(lambda x, w, b: tilenorm.layer_norm(x, w, b), fullgraph=True)
    y = compiled(*ours)
    y.backward(dy)
    y_ref = F.layer_norm(theirs[0], (64,), theirs[1], theirs[2], 1e-5)
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref)
    for a, b_ in zip(ours, theirs, strict=True):  # mean and rstd must not be confused
        torch.testing.assert_close(a.grad, b_.grad)


def test_residual_prenorm_returns_the_sum():
    g, _ = fresh_generator()
    x, r = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    y, h = tilenorm.layer_norm(x, residual=r, prenorm=True)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (64,)))


@pytest.mark.parametrize("heads,has_weight,has_bias", [
    (1, True, True), (1, True, False), (1, False, True), (4, True, False), (4, True, True)])
def test_backward_hands_each_partial_group_to_its_output(heads, has_weight, has_bias):
    """The launch path (no GPU): the backward kernel's dgamma and dbeta partial operands are
    the groups of one partial buffer, and the reduction gets the buffer and the outputs."""
    from tilenorm.launch import cutile
    from tilenorm.planner import plan_row_norm
    from tilenorm.pytorch.calls import BackwardCall, NormSpec

    cols, rows = 47, 1000  # an odd width: the groups are padded to 16 bytes
    plan = plan_row_norm(rows, cols, heads=heads, per_head_weight=heads > 1, itemsize=2,
                         sm_count=4, arch=(9, 0), direction="backward", op="layer_norm")
    groups = has_weight + has_bias
    buffer = cutile.PartialBuffer.of(plan, groups)
    partial = torch.empty(buffer.shape)
    param_shape = (heads, cols) if heads > 1 else (cols,)
    dweight = torch.empty(param_shape) if has_weight else None
    dbias = torch.empty(param_shape) if has_bias else None
    seen = {}

    def row(stream, *args):
        seen["row"] = args
        return True

    def reduce(stream, *args):
        seen["reduce"] = args
        return True

    class RowKernel:  # a single-kernel backward (not column split)
        first = None

    call = BackwardCall(spec=NormSpec("layer_norm", True, 1, heads > 1), decision=None,
                        features=None, x_dtype=torch.float32, residual_dtype=None,
                        device=torch.device("cpu"), shape3=(rows, heads, cols), plan=plan,
                        row_kernel=RowKernel(), launch_row=row, launch_reduce=reduce,
                        groups=groups, partial=buffer)
    h = torch.empty(rows, heads, cols)
    call._launch(0, h, h, dweight, torch.empty(rows, heads), torch.empty(rows, heads), None,
                 h, None, partial, dweight, dbias, 0.0)
    pointers = seen["row"][:-1]  # the offset last
    expected = [partial[:, g].data_ptr() for g in range(groups)]
    assert list(pointers[-groups:]) == expected
    assert all(p % 16 == 0 for p in expected), "every group 16-byte aligned"
    assert seen["reduce"] == (partial.data_ptr(),
                              *[t.data_ptr() for t in (dweight, dbias) if t is not None])


# --- cuTile kernels (GPU) ----------------------------------------------------------------

DTYPE_CASES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
               (torch.float16, torch.float16), (torch.float32, torch.float32)]
NS = [1, 7, 64, 128, 1000, 3000, 4096, 5120, 6144, 8192, 16384, 20000, 65536]


@gpu
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_CASES,
                         ids=[f"{str(a)[6:]}-w{str(b)[6:]}" for a, b in DTYPE_CASES])
def test_kernels_match_float64(n, x_dtype, w_dtype):
    m = 1000 if n <= 16384 else 130
    check_kernels(m, 1, n, x_dtype=x_dtype, w_dtype=w_dtype, layer_norm=True, has_bias=True,
                  eps=1e-5, repeats=2)


@gpu
@pytest.mark.parametrize("n", [128, 1000, 4096, 5120, 20000])
@pytest.mark.parametrize("case", ["no affine", "weight only", "bias only", "residual",
                                  "residual fp32", "fp32 in bf16 out"])
def test_feature_kernels_match_float64(case, n):
    kw = {
        "no affine": dict(has_weight=False, has_bias=False),
        "weight only": dict(has_bias=False),
        # dbias alone is the partial buffer's first group (PartialBuffer)
        "bias only": dict(has_weight=False),
        "residual": dict(res_dtype=torch.bfloat16),
        "residual fp32": dict(res_dtype=torch.float32),
        "fp32 in bf16 out": dict(x_dtype=torch.float32, out_dtype=torch.bfloat16),
    }[case]
    check_kernels(555, 1, n, layer_norm=True, **{"has_bias": True, **kw}, eps=1e-5)


@gpu
@pytest.mark.parametrize("m,n", [(32768, 4096), (1000, 1000), (64, 16384)])
def test_dependent_launches_match_ordinary_launches(m, n):
    """dgamma and dbeta reduced after a dependent backward: as planned, back to back and from
    a CUDA graph, bit for bit what ordinary launches give."""
    check_launch_modes_agree(m, 1, n, layer_norm=True)


@gpu
def test_large_mean_keeps_the_variance_exact():
    """Rows with mean 1000 and std 1: a one-pass E[x^2] - E[x]^2 would lose the variance."""
    g, _ = fresh_generator("cuda")
    for n in (4096, 65536):
        x = (1000 + torch.randn(64, 1, n, generator=g, device="cuda")).float()
        # fp32 holds x to 6e-5 absolute at 1000, which bounds y's accuracy at ~1e-4.
        check_kernels(64, 1, n, x_dtype=torch.float32, layer_norm=True, has_bias=True,
                      eps=1e-5, x=x, tol=2e-4)


@gpu
def test_public_op_and_module_match_torch():
    g, seed = fresh_generator("cuda")
    with tilenorm.experimental():
        ours = tilenorm.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
        theirs = torch.nn.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5, generator=g)
            theirs.bias.uniform_(-0.5, 0.5, generator=g)
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(2, 512, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        assert tilenorm.explain(x, ours.weight, bias=ours.bias, layer_norm=True).uses_kernel
        dy = torch.randn_like(x)
        y64, dx64, dw64, db64 = float64_layer_norm(x, theirs.weight, theirs.bias, 1e-5, dy)
        xg = x.clone().requires_grad_()
        y = ours(xg)
        y.backward(dy)
        assert rel(y, y64) <= 1e-2 and rel(xg.grad, dx64) <= 1e-2, seed
        assert rel(ours.weight.grad, dw64) <= 1e-2 and rel(ours.bias.grad, db64) <= 1e-2, seed


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("n", [n for n in sorted(SM90.cute_cluster_backward["layer_norm"])
                               if n >= 32768])
def test_wide_rows_run_the_cluster_backward_and_match_float64(n, cluster_launches):
    """bf16 x with fp32 weight and bias (mixed precision's LayerNorm, bench_norm_ops'
    layer_norm) at the widths a cluster of CTAs holds a row (issue 20), rows off zero mean,
    more rows than clusters with a ragged end: the backward launches the cluster kernel, dx,
    dweight and dbias match float64, a second backward bit for bit."""
    g, seed = fresh_generator("cuda")
    x = (3 + torch.randn(101, n, generator=g, device="cuda")).to(torch.bfloat16)
    w = 1 + 0.5 * torch.randn(n, generator=g, device="cuda")
    b = 0.5 * torch.randn(n, generator=g, device="cuda")
    dy = torch.randn_like(x)
    grads = []
    with tilenorm.experimental():
        for _ in range(2):
            leaves = [t.detach().requires_grad_() for t in (x, w, b)]
            tilenorm.layer_norm(*leaves, eps=1e-5).backward(dy)
            grads.append([t.grad for t in leaves])
    assert len(cluster_launches) == 2 and all(p.cols == n for p in cluster_launches)
    assert all(p.clusters < x.shape[0] for p in cluster_launches)
    _, dx64, dw64, db64 = float64_layer_norm(x, w, b, 1e-5, dy)
    dx, dw, db = grads[0]
    assert rel(dx, dx64) <= 1e-2, seed
    assert rel(dw, dw64) <= DGAMMA_TOL_FP32 and rel(db, db64) <= DGAMMA_TOL_FP32, seed
    for first, again in zip(*grads, strict=True):
        assert torch.equal(first, again), seed


@gpu
def test_torch_compile_fullgraph_matches_float64():
    g, seed = fresh_generator("cuda")
    x = torch.randn(8, 512, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(1024, generator=g, device="cuda")).requires_grad_()
    b = (0.5 * torch.randn(1024, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    with tilenorm.experimental():
        compiled = torch.compile(lambda x, w, b: tilenorm.layer_norm(x, w, b), fullgraph=True)
        xg = x.clone().requires_grad_()
        compiled(xg, w, b).backward(dy)
        y = compiled(x, w, b)
    y64, dx64, dw64, db64 = float64_layer_norm(x, w, b, 1e-5, dy)
    assert rel(y, y64) <= 1e-2 and rel(xg.grad, dx64) <= 1e-2, seed
    assert rel(w.grad, dw64) <= DGAMMA_TOL_FP32 and rel(b.grad, db64) <= DGAMMA_TOL_FP32, seed
