"""FP8-output norms (tilenorm.fp8): the API and the reference path on the CPU, the planner's
FP8 plans, and (marked gpu) the cuTile kernels against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import tilenorm
from tilenorm import testing
from tilenorm.planner import UnsupportedShape, plan_fp8_quantize, plan_fp8_row
from tilenorm.pytorch import reference
from tilenorm.testing import float64_fp8_norm, fp8_rounding_excess, fresh_generator, rel_error

gpu = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALINGS = ("tensor", "delayed", "row", "block", "mx")
#: bf16 gradients against float64.
GRAD_TOL = 1e-2
DGAMMA_TOL_FP32 = 1e-3


def _inputs(g, rows, cols, dtype=torch.bfloat16, device="cpu", layer_norm=False):
    x = torch.randn(rows, cols, generator=g, device=device).to(dtype)
    if layer_norm:
        x += 3.0  # a mean far from 0 exercises the centered variance
    w = (1 + 0.5 * torch.randn(cols, generator=g, device=device))
    b = 0.5 * torch.randn(cols, generator=g, device=device) if layer_norm else None
    return x, w, b


def _forward(x, w, b, scaling, fp8_dtype=E4M3, **kw):
    if scaling == "delayed" and "scale" not in kw:
        kw["scale"] = torch.tensor([20.0], device=x.device)
    if b is not None:
        return tilenorm.fp8.layer_norm_forward(x, w, b, scaling=scaling, fp8_dtype=fp8_dtype,
                                               **kw)
    return tilenorm.fp8.rms_norm_forward(x, w, scaling=scaling, fp8_dtype=fp8_dtype, **kw)


def _reference(x, w, b, scaling, fp8_dtype, out, **kw):
    scale = kw.pop("scale", torch.tensor([20.0]) if scaling == "delayed" else None)
    return float64_fp8_norm(x, w, b, kw.pop("eps", 1e-6 if b is None else 1e-5),
                            scaling=scaling, fp8_dtype=fp8_dtype, scale=scale,
                            layer_norm=b is not None, **kw)


def check_against_float64(out, ref, scaling, fp8_dtype, scale_tol=1e-5):
    """q is the float64 reference rounded to FP8 at q's own scales; the scales are the op's
    functions of the float64 amax (fp32 y's amax differs from it by rounding only); the
    per-tensor scale_inv is exactly the op's function of the amax it returns."""
    assert fp8_rounding_excess(out.data, out.scale_inv, scaling, ref.norm.y, fp8_dtype) <= 1
    if scaling == "mx":
        k = out.scale_inv.view(torch.uint8).int().cpu()
        k_ref = ref.scale_inv.view(torch.uint8).int()
        # A block's k may differ only where its amax sits on a power-of-two boundary.
        near = (ref.amax.float() / reference.fp8_max(fp8_dtype)).log2()
        near = (near - near.round()).abs() < 1e-5
        assert ((k == k_ref) | near).all()
    else:
        assert out.scale_inv.shape == ref.scale_inv.shape
        assert out.scale_inv.stride() == ref.scale_inv.stride()
        assert rel_error(out.scale_inv.cpu(), ref.scale_inv) <= scale_tol
    if scaling in ("tensor", "delayed"):
        assert rel_error(out.amax.cpu(), ref.amax) <= 1e-5
        if scaling == "tensor":
            exact = 1.0 / reference.scale_from_amax(out.amax.cpu(), fp8_dtype)
            assert torch.equal(out.scale_inv.cpu(), exact)


# --- reference path (CPU) ------------------------------------------------------------------


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("rows,cols", [(7, 256), (33, 1024)])
def test_reference_path_matches_float64(scaling, fp8_dtype, op, rows, cols):
    g, seed = fresh_generator()
    x, w, b = _inputs(g, rows, cols, layer_norm=op == "layer_norm")
    out = _forward(x, w, b, scaling, fp8_dtype)
    assert out.data.dtype == fp8_dtype and out.data.shape == x.shape, seed
    ref = _reference(x, w, b, scaling, fp8_dtype, out)
    check_against_float64(out, ref, scaling, fp8_dtype)


def test_scale_layouts_are_what_gemms_take():
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 6, 512)
    x = x.reshape(2, 3, 512)
    layouts = {"tensor": ((), torch.float32), "row": ((6, 1), torch.float32),
               "block": ((6, 4), torch.float32), "mx": ((6, 16), torch.float8_e8m0fnu)}
    for scaling, (shape, dtype) in layouts.items():
        out = _forward(x, w, None, scaling)
        assert out.scale_inv.shape == shape and out.scale_inv.dtype == dtype
        assert out.data.shape == x.shape
    # torch._scaled_mm's BlockWise1x128: (M, K / 128), M contiguous.
    assert _forward(x, w, None, "block").scale_inv.stride() == (1, 6)


def test_transposed_copy_is_q_transposed():
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 9, 256)
    for scaling in ("tensor", "delayed"):
        out = _forward(x, w, None, scaling, transpose=True)
        assert out.data_t.shape == (256, 9)
        assert torch.equal(out.data_t.view(torch.uint8), out.data.t().view(torch.uint8))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_zero_groups_get_scale_inv_one_and_zero_q(scaling):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    x[1] = torch.randn(256).to(torch.bfloat16)
    out = _forward(x, torch.ones(256), None, scaling,
                   **({"scale": torch.tensor([1.0])} if scaling == "delayed" else {}))
    q = out.data.float()
    assert not q.isnan().any() and (q[[0, 2, 3]] == 0).all()
    s = testing.fp8_scales_per_element(out.scale_inv, scaling, 4, 256)
    assert s.isfinite().all()
    if scaling in ("row", "block", "mx"):
        assert (s[[0, 2, 3]] == 1).all()
    all_zero = _forward(torch.zeros(3, 256), None, None, scaling,
                        **({"scale": torch.tensor([1.0])} if scaling == "delayed" else {}))
    assert (all_zero.data.float() == 0).all() and all_zero.dequantize().isfinite().all()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_delayed_scaling_saturates_instead_of_overflowing(fp8_dtype):
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 8, 256)
    out = _forward(x, w, None, "delayed", fp8_dtype, scale=torch.tensor([1e6]))
    q = out.data.float()
    top = reference.fp8_max(fp8_dtype)
    assert q.isfinite().all() and q.abs().max() == top
    assert out.scale_inv.item() == pytest.approx(1e-6)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_nan_stays_in_its_row(scaling):
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 6, 256)
    clean = _forward(x, w, None, scaling)
    x[3, 17] = float("nan")
    dirty = _forward(x, w, None, scaling)
    q, q0 = dirty.data.float(), clean.data.float()
    assert q[3].isnan().all()
    rows = [0, 1, 2, 4, 5]
    if scaling == "tensor":  # the amax of the other rows sets the scale
        y = testing.float64_norm(x[rows], w).y
        assert dirty.amax.item() == pytest.approx(reference.amax_skipping_nan(y).item(),
                                                  rel=1e-5)
        assert dirty.scale_inv.isfinite()
    else:
        assert torch.equal(q[rows], q0[rows])
        s = testing.fp8_scales_per_element(dirty.scale_inv, scaling, 6, 256)
        assert s.isfinite().all()


def test_mx_exponent_is_exact_at_power_of_two_boundaries():
    for fp8_dtype in (E4M3, E5M2):
        top = reference.fp8_max(fp8_dtype)
        for k in (-20, -3, 0, 1, 7, 30):
            at = torch.tensor([top * 2.0 ** k])
            above = torch.nextafter(at, torch.tensor([float("inf")]))
            assert reference.mx_exponent(at, fp8_dtype).item() == k
            assert reference.mx_exponent(above, fp8_dtype).item() == k + 1
        assert reference.mx_exponent(torch.tensor([0.0]), fp8_dtype).item() == 0
        assert reference.mx_exponent(torch.tensor([1e-45]), fp8_dtype).item() == -127


@pytest.mark.parametrize("group_size", [16, 128])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_fp8_input_forward_and_backward_match_float64(group_size, op):
    g, seed = fresh_generator()
    rows, cols = 10, 512
    _, w, b = _inputs(g, rows, cols, layer_norm=op == "layer_norm")
    x = torch.randn(rows, cols, generator=g).to(E4M3)
    s = torch.rand(rows, cols // group_size, generator=g) + 0.5
    dy = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    kw = dict(x_scale_inv=s, group_size=group_size)
    out = _forward(x, w, b, "row", **kw)
    ref = _reference(x, w, b, "row", E4M3, out, dy=dy, **kw)
    check_against_float64(out, ref, "row", E4M3)
    if b is None:
        dx, dw = tilenorm.fp8.rms_norm_backward(dy, x, w, out.rstd, **kw)
    else:
        dx, dw, db = tilenorm.fp8.layer_norm_backward(dy, x, w, b, out.mean, out.rstd, **kw)
        assert rel_error(db, ref.norm.dbias) <= DGAMMA_TOL_FP32, seed
    assert dx.dtype == torch.bfloat16
    assert rel_error(dx, ref.norm.dx) <= GRAD_TOL, seed
    assert rel_error(dw, ref.norm.dweight) <= DGAMMA_TOL_FP32, seed


@pytest.mark.parametrize("residual_dtype", [None, torch.float32])
def test_fused_residual_stores_h_and_quantizes_its_norm(residual_dtype):
    g, seed = fresh_generator()
    x, w, _ = _inputs(g, 12, 256)
    r = torch.randn(12, 256, generator=g).to(torch.bfloat16)
    out = _forward(x, w, None, "block", residual=r, residual_dtype=residual_dtype)
    h = (x.float() + r.float()).to(residual_dtype or torch.bfloat16)
    assert torch.equal(out.h, h)
    ref = float64_fp8_norm(h, w, scaling="block", fp8_dtype=E4M3)
    check_against_float64(out, ref, "block", E4M3)


def test_autograd_gradient_arrives_in_the_nominal_dtype():
    """The FP8 output is a Float8NormTensor of x's dtype: a consumer's bf16 gradient reaches
    the norm's backward as is (quantization passes it through)."""
    g, seed = fresh_generator()
    x, w, _ = _inputs(g, 8, 256)
    r = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    r.requires_grad_()
    dy = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    y, h = tilenorm.fp8.rms_norm(x, w, scaling="row", residual=r, prenorm=True)
    assert isinstance(y, tilenorm.fp8.Float8NormTensor) and y.dtype == torch.bfloat16
    assert y.fp8.dtype == E4M3 and y.scale_inv.shape == (8, 1)

    class Consumer(torch.autograd.Function):  # an FP8 GEMM's shape of use
        @staticmethod
        def forward(ctx, a):
            return a.dequantize(torch.float32)

        @staticmethod
        def backward(ctx, grad):
            return grad.to(torch.bfloat16)

    (Consumer.apply(y) * dy.float()).sum().backward()
    ref = testing.float64_norm(x, w, residual=r, dy=dy)
    assert rel_error(x.grad, ref.dx) <= GRAD_TOL, seed
    assert rel_error(r.grad, ref.dresidual) <= GRAD_TOL, seed
    # dgamma of the h the op stored (bf16: the residual's dtype)
    assert rel_error(w.grad, testing.float64_norm(h, w, dy=dy).dweight) <= DGAMMA_TOL_FP32, \
        seed


def test_float8_norm_tensor_reads_as_its_dequantized_value():
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 4, 128)
    y = tilenorm.fp8.rms_norm(x, w, scaling="tensor")
    expected = tilenorm.fp8.dequantize(y.fp8, y.scale_inv, "tensor", torch.bfloat16)
    assert torch.equal(y + 0, expected) and torch.equal(y.detach().dequantize(), expected)
    assert "Float8NormTensor" in repr(y)


@pytest.mark.parametrize("call,exc,words", [
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="per-row"), ValueError, "scaling must"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", fp8_dtype=torch.bfloat16),
     TypeError, "fp8_dtype"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="delayed"), ValueError, "scale"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", scale=torch.ones(1)),
     ValueError, "delayed"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", transpose=True), ValueError,
     "per-tensor"),
    (lambda x, w: tilenorm.fp8.rms_norm(x[:, :96], w[:96], scaling="block"), ValueError,
     "multiple of 128"),
    (lambda x, w: tilenorm.fp8.rms_norm(x[:, :48], w[:48], scaling="mx"), ValueError,
     "multiple of 32"),
    (lambda x, w: tilenorm.fp8.rms_norm(x.to(E4M3), w, scaling="row"), ValueError,
     "group_size"),
    (lambda x, w: tilenorm.fp8.rms_norm(x.to(E4M3), w, scaling="row", group_size=24,
                                        x_scale_inv=torch.ones(4, 10)), ValueError,
     "power of"),
    (lambda x, w: tilenorm.fp8.rms_norm(x.to(E4M3), w, scaling="row", group_size=16,
                                        x_scale_inv=torch.ones(4, 8)), ValueError,
     "x_scale_inv"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", group_size=16), ValueError,
     "FP8 x"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w[:8], scaling="row"), ValueError, "weight"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", prenorm=True), ValueError,
     "residual"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", eps=-1.0), ValueError, "eps"),
    (lambda x, w: tilenorm.fp8.rms_norm(x.to(E4M3).requires_grad_(), w, scaling="row",
                                        group_size=16, x_scale_inv=torch.ones(4, 16)),
     ValueError, "gradient"),
])
def test_bad_input_raises_clear_error(call, exc, words):
    x, w = torch.randn(4, 256), torch.ones(256)
    with pytest.raises(exc, match=words):
        call(x, w)


def test_empty_input_gives_empty_outputs():
    for scaling in SCALINGS:
        out = _forward(torch.randn(0, 256), torch.ones(256), None, scaling)
        assert out.data.shape == (0, 256)


def test_explain_names_the_reference_path_on_cpu():
    text = str(tilenorm.fp8.explain(torch.randn(4, 256), torch.ones(256), scaling="tensor"))
    assert "reference path" in text and "cpu" in text


# --- planner -------------------------------------------------------------------------------


def test_fp8_row_plans_are_single_pass_and_persistent_where_asked():
    for cols in (16, 128, 1000, 4096, 5120, 16384, 32768):
        for persistent in (False, True):
            p = plan_fp8_row(65536, cols, itemsize=2, sm_count=132, arch=(9, 0),
                             direction="forward", persistent=persistent)
            assert p.single_pass and not p.split_cols and p.tile_cols >= cols
            if persistent:
                assert p.grid <= 132 * p.occupancy
    with pytest.raises(UnsupportedShape, match="up to 32768"):
        plan_fp8_row(64, 32769, itemsize=2, sm_count=132, arch=(9, 0), direction="forward")
    with pytest.raises(UnsupportedShape, match="up to 16384"):
        plan_fp8_row(64, 16385, itemsize=1, sm_count=132, arch=(9, 0), direction="backward")


def test_fp8_quantize_plan_covers_every_block_once():
    p = plan_fp8_quantize(1000, 4100, sm_count=132, arch=(9, 0), dependent_launch=False)
    covered = [b for program in range(p.grid) for b in range(program, p.blocks, p.grid)]
    assert sorted(covered) == list(range(p.blocks))
    assert p.blocks == -(-1000 // p.tile_rows) * -(-4100 // p.tile_cols)


# --- kernels (GPU) -------------------------------------------------------------------------
