"""RMSNorm: the public API, the reference path, and (marked gpu) the cuTile kernels."""

from __future__ import annotations

import os

import pytest
import torch

import tilenorm
from tests import float64_reference as ref64
from tilenorm import reference
from tilenorm.cutile import rms_norm as cutile_rms_norm
from tilenorm.planner import plan_row_norm
from tilenorm.pytorch.routing import kernel_plan
from tilenorm.validation import CUTILE_RMS_NORM, is_stable

gpu = pytest.mark.gpu


def fresh_generator(device="cpu") -> tuple[torch.Generator, int]:
    """A generator with a fresh random seed (reported on failure): new inputs every check."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device=device).manual_seed(seed), seed


def float64_autograd(x, w, eps, dy):
    """y, dx, dw through float64 autograd of the textbook formula."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    if w64 is not None:
        y = y * w64
    y.backward(dy.double())
    return y.detach(), x64.grad, None if w64 is None else w64.grad


def rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# --- reference path (CPU) ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 64), (17, 1000)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12),
                                       (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_reference_matches_float64_autograd(shape, dtype, tol, with_weight):
    g, seed = fresh_generator()
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_() \
        if with_weight else None
    dy = torch.randn(shape, generator=g).to(dtype)
    y = tilenorm.rms_norm(x, w, eps=1e-5)
    y.backward(dy)
    y64, dx64, dw64 = float64_autograd(x, w, 1e-5, dy)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, y64) <= tol, seed
    if shape[-1] > 1:  # for N = 1 the exact dx is O(eps): no relative accuracy to ask for
        assert rel(x.grad, dx64) <= tol, seed
    if with_weight:
        assert rel(w.grad, dw64) <= tol, seed


def test_partial_buffer_fold_equals_direct_sum():
    """Simulate the backward's grid-stride partition and fixed-order fold on the CPU."""
    g, seed = fresh_generator()
    for rows, cols, sm_count in [(1000, 1000, 3), (37, 4096, 5), (5, 20000, 2), (4096, 16, 7)]:
        plan = plan_row_norm(rows, cols, itemsize=2, sm_count=sm_count, arch=(9, 0),
                             direction="backward")
        x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        dy = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        _, rstd = ref64.rms_norm_fwd(x, None, 1e-6)
        contribution = dy * x * rstd[:, None]
        partial = torch.full(plan.partial_shape, float("nan"), dtype=torch.float64)
        visited = []
        for program in range(plan.grid):
            acc = torch.zeros(plan.partial_shape[1], dtype=torch.float64)
            for tile in plan.program_row_tiles(program):
                for row in plan.tile_row_range(tile):
                    acc[:cols] += contribution[row]
                    visited.append(row)
            partial[program] = acc
        assert sorted(visited) == list(range(rows)), "every row folded exactly once"
        folded = torch.zeros(plan.partial_shape[1], dtype=torch.float64)
        for program in range(plan.grid):  # the column_sum kernel's fixed order
            folded += partial[program]
        torch.testing.assert_close(folded[:cols], contribution.sum(0), msg=str(seed))
        assert not folded[cols:].any(), "padding columns carry zeros"


# --- API (CPU) ---------------------------------------------------------------------------


@pytest.mark.parametrize("call,exc,words", [
    (lambda x, w: tilenorm.rms_norm(torch.tensor(1.0)), ValueError, "at least 1 dimension"),
    (lambda x, w: tilenorm.rms_norm(torch.ones(2, 4, dtype=torch.int32)), TypeError,
     "floating-point"),
    (lambda x, w: tilenorm.rms_norm(torch.ones(2, 4, dtype=torch.bool)), TypeError,
     "floating-point"),
    (lambda x, w: tilenorm.rms_norm([1.0, 2.0]), TypeError, "torch.Tensor"),
    (lambda x, w: tilenorm.rms_norm(x, torch.ones(5)), ValueError, "shape (8,)"),
    (lambda x, w: tilenorm.rms_norm(x, torch.ones(2, 8)), ValueError, "shape (8,)"),
    (lambda x, w: tilenorm.rms_norm(x, torch.ones(8, dtype=torch.int64)), TypeError, "weight"),
    (lambda x, w: tilenorm.rms_norm(x.bfloat16(), torch.ones(8, dtype=torch.float16)),
     TypeError, "weight must be torch.bfloat16 or torch.float32"),
    (lambda x, w: tilenorm.rms_norm(x, torch.ones(8, dtype=torch.float64)), TypeError,
     "weight must be torch.float32"),
    (lambda x, w: tilenorm.rms_norm(x, torch.ones(8, device="meta")), ValueError,
     "same device"),
    (lambda x, w: tilenorm.rms_norm(x, w, eps=-1.0), ValueError, "eps"),
    (lambda x, w: tilenorm.rms_norm(x, w, eps=float("nan")), ValueError, "eps"),
    (lambda x, w: tilenorm.rms_norm(x, w, eps="1e-6"), TypeError, "eps"),
    (lambda x, w: tilenorm.rms_norm(x, w=[1.0] * 8), TypeError, "unexpected keyword"),
    (lambda x, w: tilenorm.rms_norm(x, [1.0] * 8), TypeError, "weight must be a torch.Tensor"),
])
def test_bad_input_raises_clear_error(call, exc, words):
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(x, w)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (4, 0)])
def test_empty_input_gives_empty_output(shape):
    x = torch.randn(shape, requires_grad=True)
    w = torch.ones(shape[-1], requires_grad=True)
    y = tilenorm.rms_norm(x, w)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_non_contiguous_and_offset_inputs_on_reference_path():
    g, _ = fresh_generator()
    base = torch.randn(6, 9, 40, generator=g)
    for x in (base[:, :, ::2], base.transpose(0, 1), base.view(-1)[1:1 + 6 * 40].view(6, 40)):
        torch.testing.assert_close(tilenorm.rms_norm(x, eps=1e-6),
                                   reference.rms_norm(x.contiguous(), None, 1e-6))


@pytest.mark.parametrize("kwargs", [
    dict(normalized_shape=64),
    dict(normalized_shape=(64,), eps=1e-5),
    dict(normalized_shape=[4, 16], elementwise_affine=False),
    dict(normalized_shape=32, dtype=torch.float64),
])
def test_module_is_a_drop_in_for_torch_nn_rmsnorm(kwargs):
    ours, theirs = tilenorm.RMSNorm(**kwargs), torch.nn.RMSNorm(**kwargs)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert (ours.normalized_shape, ours.eps, ours.elementwise_affine) == (
        theirs.normalized_shape, theirs.eps, theirs.elementwise_affine)
    if theirs.weight is not None:
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
        ours.load_state_dict(theirs.state_dict())
    g, _ = fresh_generator()
    shape = (3, 5, *theirs.normalized_shape)
    x = torch.randn(shape, generator=g, dtype=kwargs.get("dtype", torch.float32))
    torch.testing.assert_close(ours(x), theirs(x))


def test_module_rejects_wrong_trailing_shape():
    with pytest.raises(ValueError, match="normalized_shape"):
        tilenorm.RMSNorm(64)(torch.randn(2, 32))


def test_compiles_fullgraph_on_cpu():
    g, _ = fresh_generator()
    x, w = torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    compiled = torch.compile(lambda x, w: tilenorm.rms_norm(x, w), fullgraph=True)
    torch.testing.assert_close(compiled(x, w), reference.rms_norm(x, w, 1e-6))


def test_custom_ops_have_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.float32)
        y, rstd = torch.ops.tilenorm.rms_norm_fwd(x, w, 1e-6)
        dx, dw = torch.ops.tilenorm.rms_norm_bwd(torch.empty_like(x), x, w, rstd)
        _, dw_none = torch.ops.tilenorm.rms_norm_bwd(torch.empty_like(x), x, None, rstd)
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype) == (x.shape, x.dtype, (2, 3),
                                                          torch.float32)
    assert (dx.shape, dw.shape, dw.dtype, dw_none.shape) == (x.shape, (64,), torch.float32,
                                                             (0,))


# --- cuTile kernels (GPU) ----------------------------------------------------------------

DTYPE_CASES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
               (torch.float16, torch.float16), (torch.float32, torch.float32)]
NS = [1, 7, 64, 127, 128, 1000, 1024, 4096, 5120, 8192, 16384, 65536]
MS = [1, 3, 1000, 32768]
OUT_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
RSTD_TOL = 1e-5
DGAMMA_TOL_FP32 = 1e-3
EPS = 1e-6


def _kernel_cases():
    for m in MS:
        for n in NS:
            for x_dtype, w_dtype in DTYPE_CASES:
                marks = [gpu]
                if m * n >= 1 << 26:  # a few GB each: one at a time, in one xdist worker
                    marks.append(pytest.mark.xdist_group("large"))
                yield pytest.param(m, n, x_dtype, w_dtype, marks=marks,
                                   id=f"{m}x{n}-{str(x_dtype)[6:]}-w{str(w_dtype)[6:]}")


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what} differs between runs"


@pytest.mark.parametrize("m,n,x_dtype,w_dtype", list(_kernel_cases()))
def test_kernels_match_float64(m, n, x_dtype, w_dtype):
    g, seed = fresh_generator("cuda")
    x = torch.randn(m, n, generator=g, device="cuda", dtype=x_dtype)
    dy = torch.randn(m, n, generator=g, device="cuda", dtype=x_dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(w_dtype)
    fwd, bwd = kernel_plan(x, "forward"), kernel_plan(x, "backward")

    y, rstd = cutile_rms_norm.forward(fwd, x, w, EPS, y=_poisoned((m, n), x_dtype),
                                      rstd=_poisoned((m,), torch.float32))
    dx, dw = cutile_rms_norm.backward(
        bwd, dy, x, w, rstd, dx=_poisoned((m, n), x_dtype),
        partial=_poisoned(bwd.partial_shape, torch.float32), dweight=_poisoned((n,), w_dtype))
    for name, t in (("y", y), ("rstd", rstd), ("dx", dx), ("dweight", dw)):
        assert not t.isnan().any(), f"{name} has unwritten (poisoned) elements; seed {seed}"

    for _ in range(2):  # runs 2 and 3 must repeat run 1 bit for bit
        y2, rstd2 = cutile_rms_norm.forward(fwd, x, w, EPS, y=_poisoned((m, n), x_dtype),
                                            rstd=_poisoned((m,), torch.float32))
        dx2, dw2 = cutile_rms_norm.backward(
            bwd, dy, x, w, rstd2, dx=_poisoned((m, n), x_dtype),
            partial=_poisoned(bwd.partial_shape, torch.float32),
            dweight=_poisoned((n,), w_dtype))
        for name, a, b in (("y", y, y2), ("rstd", rstd, rstd2), ("dx", dx, dx2),
                           ("dweight", dw, dw2)):
            _assert_same_bits(a, b, name)
        del y2, rstd2, dx2, dw2

    err = {k: ref64.RelError() for k in ("y", "rstd", "dx")}
    dw64 = torch.zeros(n, dtype=torch.float64, device="cuda")
    for rows in ref64.row_blocks(m, n):
        y64, rstd64 = ref64.rms_norm_fwd(x[rows], w, EPS)
        err["y"].add(y[rows], y64)
        err["rstd"].add(rstd[rows], rstd64)
        dx64, dw64_rows, scale = ref64.rms_norm_bwd(dy[rows], x[rows], w, EPS)
        # For N = 1 the exact dx is O(eps) (x_hat = +-1 to within eps): a cancellation fp32
        # cannot resolve relative to itself, so dx is measured against its terms' scale.
        err["dx"].add(dx[rows], dx64, scale if n == 1 else None)
        dw64 += dw64_rows
    tol = OUT_TOL[x_dtype]
    dw_tol = DGAMMA_TOL_FP32 if w_dtype == torch.float32 else OUT_TOL[w_dtype]
    errors = {k: e.value for k, e in err.items()}
    errors["dweight"] = rel(dw, dw64)
    limits = {"y": tol, "rstd": RSTD_TOL, "dx": tol, "dweight": dw_tol}
    failed = {k: v for k, v in errors.items() if not v <= limits[k]}
    assert not failed, f"relative errors {failed} over {limits}; seed {seed}"


@gpu
@pytest.mark.parametrize("n", [64, 1000, 4096, 20000])
def test_kernels_without_weight(n):
    g, seed = fresh_generator("cuda")
    x = torch.randn(300, n, generator=g, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, rstd = cutile_rms_norm.forward(kernel_plan(x, "forward"), x, None, EPS,
                                      y=_poisoned(x.shape, x.dtype))
    dx, dw = cutile_rms_norm.backward(kernel_plan(x, "backward"), dy, x, None, rstd,
                                      dx=_poisoned(x.shape, x.dtype))
    y64, dx64, _ = float64_autograd(x, None, EPS, dy)
    assert dw is None
    assert rel(y, y64) <= 1e-2 and rel(dx, dx64) <= 1e-2, seed


def _strided_inputs(g):
    base = torch.randn(64, 2 * 1000 + 8, generator=g, device="cuda", dtype=torch.bfloat16)
    flat = torch.randn(64 * 1000 + 1, generator=g, device="cuda", dtype=torch.bfloat16)
    cube = torch.randn(8, 16, 1000, generator=g, device="cuda", dtype=torch.bfloat16)
    return {
        "row stride": base[:, :1000],
        "column stride 2": base[:, :2000:2],
        "misaligned storage offset": flat[1:].view(64, 1000),
        "non-collapsible leading dims": cube.transpose(0, 1),
        "expanded (stride 0)": cube[:1].expand(8, 16, 1000),
    }


@gpu
@pytest.mark.parametrize("case", ["row stride", "column stride 2", "misaligned storage offset",
                                  "non-collapsible leading dims", "expanded (stride 0)"])
def test_public_op_on_strided_inputs(case):
    g, seed = fresh_generator("cuda")
    x = _strided_inputs(g)[case].detach().requires_grad_()
    w = (1 + 0.5 * torch.randn(1000, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype)
    with tilenorm.experimental():
        assert tilenorm.explain(x, w).uses_kernel
        y = tilenorm.rms_norm(x, w, eps=EPS)
        y.backward(dy)
    y64, dx64, dw64 = float64_autograd(x, w, EPS, dy)
    assert rel(y, y64) <= 1e-2 and rel(x.grad, dx64) <= 1e-2, seed
    assert rel(w.grad, dw64) <= DGAMMA_TOL_FP32, seed


@gpu
def test_public_op_and_module_match_torch():
    g, seed = fresh_generator("cuda")
    with tilenorm.experimental():
        ours = tilenorm.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
        theirs = torch.nn.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5, generator=g)
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(2, 512, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        assert "rms_norm_fwd_single" in str(tilenorm.explain(x, ours.weight))
        y64, _, _ = float64_autograd(x, theirs.weight, torch.finfo(torch.bfloat16).eps,
                                     torch.zeros_like(x))
        assert rel(ours(x), y64) <= 1e-2, seed
        assert rel(theirs(x), y64) <= 1e-2, seed


@gpu
def test_empty_and_large_leading_shapes_on_gpu():
    with tilenorm.experimental():
        x = torch.randn(0, 128, device="cuda", dtype=torch.bfloat16)
        assert tilenorm.rms_norm(x, torch.ones(128, device="cuda")).shape == (0, 128)


@gpu
def test_torch_compile_fullgraph_matches_reference():
    g, seed = fresh_generator("cuda")
    x = torch.randn(4, 256, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(1024, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype)
    with tilenorm.experimental():
        compiled = torch.compile(lambda x, w: tilenorm.rms_norm(x, w, 1e-6), fullgraph=True)
        xg = x.clone().requires_grad_()
        y = compiled(xg, w)
        y.backward(dy)
    y64, dx64, dw64 = float64_autograd(x, w, 1e-6, dy)
    assert rel(y, y64) <= 1e-2 and rel(xg.grad, dx64) <= 1e-2, seed
    assert rel(w.grad, dw64) <= DGAMMA_TOL_FP32, seed


@gpu
def test_cuda_graph_replay_matches_reference():
    g, seed = fresh_generator("cuda")
    x = torch.randn(1024, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(4096, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn_like(x)
    static_x = x.clone().requires_grad_()

    def step():
        y = tilenorm.rms_norm(static_x, w, 1e-6)
        return (y, *torch.autograd.grad(y, (static_x, w), dy))

    with tilenorm.experimental():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for _ in range(2):  # fresh inputs each replay
            with torch.no_grad():
                static_x.copy_(torch.randn(x.shape, generator=g, device="cuda",
                                           dtype=x.dtype))
            graph.replay()
            torch.cuda.synchronize()
            y64, dx64, dw64 = float64_autograd(static_x, w, 1e-6, dy)
            y, dx, dw = outs
            assert rel(y, y64) <= 1e-2 and rel(dx, dx64) <= 1e-2, seed
            assert rel(dw, dw64) <= DGAMMA_TOL_FP32, seed


@gpu
def test_flag_off_never_runs_experimental_kernels():
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with tilenorm.experimental(False):
        route = tilenorm.explain(x)
        assert route.uses_kernel == is_stable(CUTILE_RMS_NORM)
        torch.testing.assert_close(tilenorm.rms_norm(x), reference.rms_norm(x, None, 1e-6))
