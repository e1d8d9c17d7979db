"""FP8-output norms (tilenorm.fp8): the API and the reference path on the CPU, the planner's
FP8 plans, and (marked gpu) the cuTile kernels against the float64 reference."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest
import torch

import tilenorm
from tilenorm import testing
from tilenorm.launch import cute
from tilenorm.planner import (
    MAX_INT32_OFFSET,
    UnsupportedShape,
    plan_cute_fp8_forward,
    plan_fp8_column_amax,
    plan_fp8_mx_swizzle,
    plan_fp8_quantize,
    plan_fp8_row,
)
from tilenorm.pytorch import reference
from tilenorm.pytorch.calls import DTYPE_NAMES
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
                            layer_norm=b is not None, transpose=out.data_t is not None, **kw)


def _check_quantized(q, scale_inv, y, terms, ref_amax, ref_scale_inv, scaling, fp8_dtype,
                     scale_tol):
    """q is float64 ``y`` rounded to FP8 at q's own scales; the scales are the op's functions
    of the float64 amax (fp32 y's amax differs from it by rounding only), in its layout."""
    assert fp8_rounding_excess(q, scale_inv, scaling, y, fp8_dtype, terms) <= 1
    if scaling == "mx":
        assert scale_inv.shape == ref_scale_inv.shape
        k = scale_inv.view(torch.uint8).int().cpu()
        k_ref = ref_scale_inv.view(torch.uint8).int()
        # A block's k may differ only where its amax sits on a power-of-two boundary.
        near = (ref_amax.float() / reference.fp8_max(fp8_dtype)).log2()
        near = (near - near.round()).abs() < 1e-5
        assert ((k == k_ref) | near).all()
    else:
        assert scale_inv.shape == ref_scale_inv.shape
        assert _strides(scale_inv) == _strides(ref_scale_inv)
        assert rel_error(scale_inv.cpu(), ref_scale_inv) <= scale_tol


def _strides(t: torch.Tensor) -> tuple:
    """The layout: strides of the dimensions longer than 1 (a unit dimension's stride is
    arbitrary: an (M, 1) block scale may say 1 or M there)."""
    return tuple(st for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)


def check_against_float64(out, ref, scaling, fp8_dtype, scale_tol=1e-5):
    """q, and the transposed copy where there is one, are the float64 reference rounded to
    FP8 at their own scales; the scales are the op's functions of the float64 amax of their
    groups; the per-tensor scale_inv is exactly the op's function of the amax it returns,
    and the per-tensor copy is q's transpose with the same scale."""
    _check_quantized(out.data, out.scale_inv, ref.norm.y, ref.terms, ref.amax, ref.scale_inv,
                     scaling, fp8_dtype, scale_tol)
    if scaling in ("tensor", "delayed"):
        assert rel_error(out.amax.cpu(), ref.amax) <= 1e-5
        if scaling == "tensor":
            exact = 1.0 / reference.scale_from_amax(out.amax.cpu(), fp8_dtype)
            assert torch.equal(out.scale_inv.cpu(), exact)
    if out.data_t is None:
        return
    n = out.data.shape[-1]
    assert out.data_t.shape == (n, out.data.numel() // max(n, 1))
    if scaling in ("tensor", "delayed"):
        assert out.scale_inv_t is out.scale_inv
        assert torch.equal(out.data_t.view(torch.uint8),
                           out.data.reshape(-1, n).t().view(torch.uint8))
    else:
        y_t = ref.norm.y.reshape(-1, n).t()
        _check_quantized(out.data_t, out.scale_inv_t, y_t, ref.terms.t(), ref.amax_t,
                         ref.scale_inv_t, scaling, fp8_dtype, scale_tol)


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
        assert out.data_t.shape == (256, 9) and out.scale_inv_t is out.scale_inv
        assert torch.equal(out.data_t.view(torch.uint8), out.data.t().view(torch.uint8))


@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("rows,cols", [(7, 256), (200, 128), (300, 512)])
def test_transposed_copy_with_scales_along_m_matches_float64(scaling, fp8_dtype, op, rows,
                                                              cols):
    """The (N, M) copy of a per-row, per-block or MX scaling: scales along M (per column of
    y, per 128 x 1 or 32 x 1 block, the last one short where M is not a multiple), q_t the
    float64 y^T rounded at them; q itself as without the copy."""
    g, seed = fresh_generator()
    x, w, b = _inputs(g, rows, cols, layer_norm=op == "layer_norm")
    out = _forward(x, w, b, scaling, fp8_dtype, transpose=True)
    check_against_float64(out, _reference(x, w, b, scaling, fp8_dtype, out), scaling,
                          fp8_dtype)
    plain = _forward(x, w, b, scaling, fp8_dtype)
    assert torch.equal(out.data.view(torch.uint8), plain.data.view(torch.uint8)), seed
    assert plain.data_t is None and plain.scale_inv_t is None


def test_transposed_scale_layouts_are_what_gemms_take():
    """The copy is the weight-gradient GEMM's operand over M: torch._scaled_mm takes its
    rowwise scale as (N, 1) (as ``a``; ``.t()`` as ``b``), its 1 x 128 blocks along M as
    (N, M / 128) with strides (1, N) (``a``, and ``b`` in scaled_mm v2; ``.t()``, (M / 128,
    N) contiguous, for ``b`` in _scaled_mm), and MX's as (N, M / 32) E8M0 before the 128 x 4
    swizzle."""
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 300, 256)
    expected = {"row": ((256, 1), (1, 1), torch.float32),
                "block": ((256, 3), (1, 256), torch.float32),
                "mx": ((256, 10), (10, 1), torch.float8_e8m0fnu)}
    for scaling, (shape, strides, dtype) in expected.items():
        out = _forward(x, w, None, scaling, transpose=True)
        assert out.data_t.shape == (256, 300) and out.data_t.is_contiguous()
        t = out.scale_inv_t
        assert (t.shape, t.stride(), t.dtype) == (shape, strides, dtype), scaling
    dequantized = out.dequantize_t()
    assert dequantized.shape == (256, 300) and dequantized.isfinite().all()


@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_transposed_copy_keeps_nan_in_its_column(scaling):
    """A NaN in x makes its row of y NaN: that column of q_t quantizes to NaN, every scale
    stays finite and every other element is the float64 reference (NaN skipped)."""
    g, seed = fresh_generator()
    x, w, _ = _inputs(g, 160, 256)
    x[37, 5] = float("nan")
    w[9] = 0  # a column of y all zero: scale_inv 1, q 0
    out = _forward(x, w, None, scaling, transpose=True)
    q_t = out.data_t.float()
    assert q_t[:, 37].isnan().all() and not q_t[:, :37].isnan().any(), seed
    s = testing.fp8_scales_per_element(out.scale_inv_t, scaling, 256, 160)
    assert s.isfinite().all()
    others = [m for m in range(160) if m != 37]  # y of the NaN row is NaN in column 9 too
    assert (q_t[9, others] == 0).all() and (s[9] == 1).all()
    check_against_float64(out, _reference(x, w, None, scaling, E4M3, out), scaling, E4M3)


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


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_scale_is_the_correctly_rounded_quotient(fp8_dtype):
    """fp8_max / amax rounded once, as the kernels' fp32 division (the per-tensor scale_inv
    is compared bit for bit on the GPU)."""
    g, seed = fresh_generator()
    amax = torch.rand(100_000, generator=g) * 1e3 + 1e-3
    exact = (reference.fp8_max(fp8_dtype) / amax.double()).float()
    assert torch.equal(reference.scale_from_amax(amax, fp8_dtype), exact), seed


@functools.cache
def _torch_blocked() -> dict:
    """torch's own ``to_blocked`` and ``from_blocked``: the MX scale layout its tests give
    ``torch._scaled_mm`` on Blackwell, and its element-by-element reading of cuBLAS's
    definition. Compiled from the installed torch/testing/_internal/common_quantized.py, as
    importing that module needs torch's test harness (expecttest)."""
    path = Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    wanted = [node for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef)
              and node.name in ("ceil_div", "to_blocked", "from_blocked")]
    assert len(wanted) == 3, f"{path} no longer defines to_blocked and from_blocked"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """torch's ``to_blocked`` of (rows, groups) scales: the layout's bytes, flat."""
    return _torch_blocked()["to_blocked"](scales.view(torch.uint8))


def _row_major(out):
    """A swizzled MX output with its scales back in rows (the checks' layout)."""
    n = out.data.shape[-1]
    m = out.data.numel() // n
    scale_inv_t = out.scale_inv_t
    if scale_inv_t is not None:
        scale_inv_t = reference.unswizzle_mx_scales(scale_inv_t.cpu(), n, -(-m // 32))
    return out._replace(scale_inv=reference.unswizzle_mx_scales(out.scale_inv.cpu(), m,
                                                                n // 32),
                        scale_inv_t=scale_inv_t, mx_layout="row_major")


@pytest.mark.parametrize("rows,groups", [(128, 4), (300, 10), (1, 1), (256, 8), (129, 5)])
def test_mx_swizzle_is_torchs_to_blocked(rows, groups):
    """reference.swizzle_mx_scales is torch's ``to_blocked`` (cuBLAS's 1-D block scaling
    factors), padding 0 included, in the padded 2-D shape; unswizzle_mx_scales is its
    ``from_blocked``."""
    g, _ = fresh_generator()
    scales = torch.randint(0, 255, (rows, groups), generator=g, dtype=torch.uint8)
    blocked = reference.swizzle_mx_scales(scales.view(torch.float8_e8m0fnu))
    assert blocked.dtype == torch.float8_e8m0fnu and blocked.is_contiguous()
    assert blocked.shape == (-(-rows // 128) * 128, -(-groups // 4) * 4)
    assert torch.equal(blocked.view(torch.uint8).flatten(), _to_blocked(scales))
    back = reference.unswizzle_mx_scales(blocked, rows, groups)
    assert torch.equal(back.view(torch.uint8), scales)
    from_blocked = _torch_blocked()["from_blocked"]
    assert torch.equal(from_blocked(torch.empty(rows, 32 * groups), blocked.view(torch.uint8)
                                    .flatten(), 32), scales)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("rows,cols", [(7, 256), (300, 320), (128, 4096)])
def test_swizzled_mx_scales_are_the_row_major_ones_re_laid(op, rows, cols):
    """mx_layout="swizzled": q as without it, scale_inv and the copy's scale_inv_t torch's
    ``to_blocked`` of the row-major ones; dequantizing reads them back."""
    g, seed = fresh_generator()
    x, w, b = _inputs(g, rows, cols, layer_norm=op == "layer_norm")
    out = _forward(x, w, b, "mx", transpose=True, mx_layout="swizzled")
    plain = _forward(x, w, b, "mx", transpose=True)
    assert out.mx_layout == "swizzled" and plain.mx_layout == "row_major"
    assert torch.equal(_bits(out.data), _bits(plain.data))
    assert torch.equal(_bits(out.data_t), _bits(plain.data_t))
    for got, row_major in ((out.scale_inv, plain.scale_inv),
                           (out.scale_inv_t, plain.scale_inv_t)):
        assert got.dtype == torch.float8_e8m0fnu and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8).flatten(), _to_blocked(row_major)), seed
    assert torch.equal(out.dequantize(), plain.dequantize())
    assert torch.equal(out.dequantize_t(), plain.dequantize_t())
    norm = tilenorm.fp8.rms_norm if b is None else \
        lambda *a, **kw: tilenorm.fp8.layer_norm(*a, bias=b, **kw)
    y = norm(x, w, scaling="mx", mx_layout="swizzled")
    assert y.mx_layout == "swizzled"
    assert torch.equal(y.dequantize(), norm(x, w, scaling="mx").dequantize())
    check_against_float64(_row_major(out), _reference(x, w, b, "mx", E4M3, out), "mx", E4M3)


def test_scaled_mm_shape_checks_take_the_swizzled_mx_scales():
    """torch._scaled_mm's own checks (on the meta device) take the swizzled scales of q, for
    the GEMM that reads q (y @ w^T), and of the copy, for the one that contracts over M
    (dy^T @ y), where M and N / 32 are not multiples of 128 and 4; they refuse the row-major
    ones."""
    g, _ = fresh_generator()
    m, n, out_features = 288, 320, 256
    x, w, _ = _inputs(g, m, n)
    out = _forward(x, w, None, "mx", transpose=True, mx_layout="swizzled")
    weight_q, weight_s, _, _, _ = reference.fp8_quantize(
        torch.randn(out_features, n, generator=g), "mx", E4M3)
    dy_t_q, dy_t_s, _, _, _ = reference.fp8_quantize(
        torch.randn(out_features, m, generator=g), "mx", E4M3)

    def scaled_mm(a, b, scale_a, scale_b):
        a, b, scale_a, scale_b = (t.to("meta") for t in (a, b, scale_a, scale_b))
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.bfloat16)

    forward = scaled_mm(out.data, weight_q.t(), out.scale_inv,
                        reference.swizzle_mx_scales(weight_s))
    assert forward.shape == (m, out_features)
    wgrad = scaled_mm(dy_t_q, out.data_t.t(), reference.swizzle_mx_scales(dy_t_s),
                      out.scale_inv_t)
    assert wgrad.shape == (out_features, n)
    plain = _forward(x, w, None, "mx")
    with pytest.raises(RuntimeError, match="scale_a should have"):
        scaled_mm(plain.data, weight_q.t(), plain.scale_inv,
                  reference.swizzle_mx_scales(weight_s))


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


class Fp8GemmStandIn(torch.autograd.Function):
    """An FP8 GEMM's shape of use: reads the FP8 data and scales, returns a bf16 gradient."""

    @staticmethod
    def forward(ctx, a):
        return a.dequantize(torch.float32)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16)


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

    (Fp8GemmStandIn.apply(y) * dy.float()).sum().backward()
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
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="row", mx_layout="swizzled"),
     ValueError, "MX scales"),
    (lambda x, w: tilenorm.fp8.rms_norm(x, w, scaling="mx", mx_layout="blocked"),
     ValueError, "mx_layout must"),
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


# --- torch.compile (CPU: the reference path inside the custom ops) ---------------------------


def _fp8_step(x, w, b, r, dy, scaling, scale, x_scale_inv, group_size, mx_layout):
    """A norm (with a fused residual where r is given) whose FP8 output a GEMM stand-in
    reads, a loss of it (and of h), and every output the op made."""
    kw = dict(scaling=scaling, scale=scale, transpose=True, x_scale_inv=x_scale_inv,
              group_size=group_size, mx_layout=mx_layout)
    if r is not None:
        kw.update(residual=r, prenorm=True)
    out = tilenorm.fp8.rms_norm(x, w, **kw) if b is None else \
        tilenorm.fp8.layer_norm(x, w, b, **kw)
    y, h = out if r is not None else (out, None)
    loss = (Fp8GemmStandIn.apply(y) * dy).sum()
    if h is not None:
        loss = loss + h.float().sum()
    return loss, y.fp8, y.scale_inv, y.amax, y.fp8_t, y.scale_inv_t, h


def check_compiled_matches_eager(scaling: str, case: str, device: str, row_counts, cols):
    """torch.compile(fullgraph=True, dynamic=True) of :func:`_fp8_step` against eager, for
    row counts that change between calls: forward outputs and gradients bit-identical."""
    g, seed = fresh_generator(device)
    torch.compiler.reset()  # the other cases' graphs of _fp8_step count as recompiles
    compiled = torch.compile(_fp8_step, fullgraph=True, dynamic=True)
    for rows in row_counts:
        x, w, b = _inputs(g, rows, cols, device=device, layer_norm=case == "layer_norm")
        r = torch.randn(rows, cols, generator=g, device=device).to(torch.bfloat16) \
            if "residual" in case else None
        x_scale_inv = group_size = None
        if case == "fp8 x":
            x = x.to(E4M3)
            group_size = 16
            x_scale_inv = torch.rand(rows, cols // 16, generator=g, device=device) + 0.5
        dy = torch.randn(rows, cols, generator=g, device=device)
        scale = torch.tensor([20.0], device=device) if scaling == "delayed" else None
        leaves = [t for t in (x, w, b, r) if t is not None and t.dtype not in (E4M3, E5M2)]
        results = []
        for fn in (_fp8_step, compiled):
            for t in leaves:
                t.requires_grad_().grad = None
            out = fn(x, w, b, r, dy, scaling, scale, x_scale_inv, group_size,
                     "swizzled" if "swizzled" in case else "row_major")
            out[0].backward()
            results.append((out, [t.grad for t in leaves]))
        (eager, eager_grads), (got, got_grads) = results
        for a, c in zip(eager[1:], got[1:], strict=True):
            assert (a is None) == (c is None), (rows, seed)
            if a is not None:
                assert a.shape == c.shape and a.dtype == c.dtype and torch.equal(
                    _bits(a), _bits(c)), (rows, seed)
        for a, c in zip(eager_grads, got_grads, strict=True):
            assert torch.equal(a, c), (rows, seed)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("case", ["rms", "rms residual", "layer_norm", "fp8 x"])
def test_compiled_fullgraph_matches_eager(scaling, case):
    """The custom ops in the graph and the Float8NormTensor built around them, on the
    reference path inside the ops."""
    check_compiled_matches_eager(scaling, case, "cpu", (40, 72), 256)


def test_compiled_fullgraph_with_swizzled_mx_scales_matches_eager():
    check_compiled_matches_eager("mx", "rms swizzled", "cpu", (40, 200), 320)


def test_compiled_launch_level_ops_match_eager():
    """rms_norm_forward / layer_norm_forward and the FP8-input backward in a compiled graph
    return what eager returns (Float8NormOutput's views included)."""
    g, _ = fresh_generator()
    x = torch.randn(24, 512, generator=g).to(E4M3)
    s = torch.rand(24, 512 // 32, generator=g) + 0.5
    w, b = torch.rand(512, generator=g) + 0.5, torch.randn(512, generator=g)
    dy = torch.randn(24, 512, generator=g).to(torch.bfloat16)

    def launch_level(x, s, w, b, dy):
        out = tilenorm.fp8.layer_norm_forward(x, w, b, scaling="block", transpose=True,
                                              x_scale_inv=s, group_size=32)
        grads = tilenorm.fp8.layer_norm_backward(dy, x, w, b, out.mean, out.rstd,
                                                 x_scale_inv=s, group_size=32)
        return out, grads

    eager, eager_grads = launch_level(x, s, w, b, dy)
    got, got_grads = torch.compile(launch_level, fullgraph=True)(x, s, w, b, dy)
    def layout(t):  # a dimension of one element has any stride
        return t.shape, [st for size, st in zip(t.shape, t.stride(), strict=True) if size > 1]

    for a, c in zip(eager, got, strict=True):
        if isinstance(a, torch.Tensor):
            assert layout(a) == layout(c) and a.dtype == c.dtype
            assert torch.equal(_bits(a), _bits(c))
        else:
            assert a == c
    for a, c in zip(eager_grads, got_grads, strict=True):
        assert torch.equal(a, c)


def test_compiled_without_grad_returns_the_float8_norm_tensor():
    g, _ = fresh_generator()
    x, w, _ = _inputs(g, 33, 256)

    @torch.compile(fullgraph=True)
    def quantize(x, w):
        with torch.no_grad():
            return tilenorm.fp8.rms_norm(x, w, scaling="mx", transpose=True)

    got, eager = quantize(x, w), tilenorm.fp8.rms_norm(x, w, scaling="mx", transpose=True)
    assert isinstance(got, tilenorm.fp8.Float8NormTensor) and got.dtype == torch.bfloat16
    for name in ("fp8", "scale_inv", "fp8_t", "scale_inv_t"):
        assert torch.equal(_bits(getattr(got, name)), _bits(getattr(eager, name))), name
    assert got.scale_inv.dtype == torch.float8_e8m0fnu


def test_compiled_graph_holds_the_fp8_custom_ops():
    """The ops reach the graph as tilenorm::fp8_norm_fwd and the bf16 norms' norm_bwd, with
    no graph break (fullgraph) and nothing of the reference path traced into it."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    x = torch.randn(8, 256).to(torch.bfloat16).requires_grad_()
    w = torch.ones(256, requires_grad=True)
    step = torch.compile(lambda x, w: Fp8GemmStandIn.apply(
        tilenorm.fp8.rms_norm(x, w, scaling="row")).sum(), backend=backend, fullgraph=True)
    step(x, w).backward()
    forward = "\n".join(gm.code for gm in backend.fw_graphs)
    backward = "\n".join(gm.code for gm in backend.bw_graphs)
    assert "tilenorm.fp8_norm_fwd" in forward and "amax" not in forward
    assert "tilenorm.norm_bwd" in backward


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


def test_cute_fp8_forward_plans_only_the_measured_widths():
    from tilenorm.kernels.cute_row_norm_fp8 import SCALINGS as KERNEL_SCALINGS
    from tilenorm.settings_fp8 import SM90_FP8

    def plan(rows, cols, scaling="row", itemsize=2, **kw):
        return plan_cute_fp8_forward(rows, cols, itemsize=itemsize, sm_count=132, arch=(9, 0),
                                     scaling=scaling, **kw)

    assert SM90_FP8.cute_forward, "the table the GPU tests below exercise"
    for cols in SM90_FP8.cute_forward:
        for scaling in KERNEL_SCALINGS:
            recompute_t = SM90_FP8.cute_forward_recompute_t.get(scaling, {}).get(cols)
            threads, stages, ctas = recompute_t or SM90_FP8.forward_entry(scaling, cols)
            assert cols % (8 * threads) == 0 and threads % 16 == 0, "whole 16-byte vectors"
            for rows in (1, 100, 132 * ctas, 65536):
                p = plan(rows, cols, scaling)
                assert p.grid == min(rows, 132 * ctas) and (p.threads, p.stages) == (threads,
                                                                                    stages)
                assert p.recompute_t == (recompute_t is not None)
                assert p.clamp == SM90_FP8.forward_clamp(scaling, cols)
                covered = sorted(r for g in range(p.grid) for r in p.program_rows(g))
                assert covered == list(range(rows)), "every row once"
            assert plan(64, cols, scaling, itemsize=4) is None
            assert plan(64, cols, scaling, max_offset=MAX_INT32_OFFSET + 1) is None
    assert plan(64, 5120) is None


def test_cute_fp8_recompute_t_runs_where_it_was_measured():
    """Block, row and MX scaling at 16384 columns take the kernel's ``recompute_t`` at
    (256, 2, 2) on an H200 (#78, #122), block scaling only on an H100; the per-tensor
    scalings and the other widths keep the kernel that holds t. A per-row scaling's copy
    takes the plan of row scaling without it, ``recompute_t`` included, with the column
    maxima: the same launch config, so q has the same bits (bench/NOTES.md #125)."""
    from tilenorm.settings_fp8 import SM90_FP8

    def plan(scaling, cols=16384, **kw):
        return plan_cute_fp8_forward(4096, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                     scaling=scaling, **kw)

    assert SM90_FP8.cute_forward_recompute_t == {
        scaling: {16384: (256, 2, 2)} for scaling in ("block", "row", "mx")}
    for scaling in ("block", "row", "mx"):
        p = plan(scaling)
        assert p.recompute_t and (p.threads, p.stages, p.ctas_per_sm, p.grid) == (256, 2, 2,
                                                                                  264)
        assert "recomputed" in p.describe()
        assert plan(scaling, device_class="h100").recompute_t == (scaling == "block")
    for p in (plan("amax"), plan("delayed"), plan("block", cols=8192), plan("row", cols=8192)):
        assert not p.recompute_t and "recomputed" not in p.describe()
    for device_class in ("h200", "h100"):
        for cols in (8192, 16384):
            plain = plan("row", cols, device_class=device_class)
            copy = plan("row", cols, device_class=device_class, column_amax=True)
            assert copy.column_amax and not copy.clamp, (device_class, cols)
            assert dataclasses.replace(copy, column_amax=False, clamp=plain.clamp) == plain
    copy = plan("row", column_amax=True)
    assert copy.recompute_t and (copy.threads, copy.stages, copy.ctas_per_sm) == (256, 2, 2)
    assert not plan("row", column_amax=True, device_class="h100").recompute_t


def test_cute_fp8_clamp_runs_where_it_was_measured():
    """The H200's row kernel of 2-byte x clamps before the conversion at row scaling's 4096
    and 8192 columns and MX's 2048 and 8192 (bench/NOTES.md #125), whatever the row count;
    not the row kernel keeping a per-row copy's column amaxes (untimed with it: the same
    bits), nor FP8 x (untimed)."""
    from tilenorm.settings_fp8 import SM90_FP8

    assert SM90_FP8.cute_forward_clamp == {"row": (4096, 8192), "mx": (2048, 8192)}
    for scaling, widths in SM90_FP8.cute_forward_clamp.items():
        for cols in widths:
            for rows in (1, 1040, 65536):
                p = plan_cute_fp8_forward(rows, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                          scaling=scaling)
                assert p.clamp and not p.recompute_t and "clamped" in p.describe()
                assert (p.threads, p.stages, p.ctas_per_sm) == SM90_FP8.forward_entry(
                    scaling, cols)
            fp8_x = plan_cute_fp8_forward(1040, cols, itemsize=1, sm_count=132, arch=(9, 0),
                                          scaling=scaling, group=16)
            assert not fp8_x.clamp and "clamped" not in fp8_x.describe()
    for cols in (4096, 8192):
        copy = plan_cute_fp8_forward(1040, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                     scaling="row", column_amax=True)
        assert copy.column_amax and not copy.clamp
    for scaling, cols in (("row", 2048), ("mx", 4096), ("block", 4096), ("delayed", 8192),
                          ("row", 16384), ("mx", 16384)):
        p = plan_cute_fp8_forward(1040, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                  scaling=scaling)
        assert not p.clamp, (scaling, cols)


def test_cute_fp8_row_kernel_entries_are_resident_by_shared_memory():
    """Every CuTe FP8 row kernel entry of every device class's tables plans on sm_90, its
    CTAs an SM within an SM's shared memory (FP8 x's fp32 weight, the column maxima); an
    entry whose CTAs cannot all be resident leaves the width to cuTile's kernel, as on
    sm_120's 100 KB: four CTAs of FP8 x at 16384 columns (a 64 KB weight each, #128's
    23-48% variants), but for MX, whose weight stays in registers."""
    from tilenorm import settings_fp8
    from tilenorm.kernels.cute_row_norm_fp8 import SCALINGS as KERNEL_SCALINGS
    from tilenorm.settings import DEVICE_CLASSES
    from tilenorm.settings_fp8 import SM90_FP8, fp8_settings_for

    def plan(cols, scaling, itemsize=1, arch=(9, 0), column_amax=False, device_class="h200"):
        return plan_cute_fp8_forward(4096, cols, itemsize=itemsize, sm_count=132, arch=arch,
                                     scaling=scaling, group=128 if itemsize == 1 else 0,
                                     column_amax=column_amax, device_class=device_class)

    for device_class in DEVICE_CLASSES:
        f = fp8_settings_for((9, 0), device_class)
        for scaling in KERNEL_SCALINGS:
            for cols in f.cute_forward_fp8_input:
                assert plan(cols, scaling, device_class=device_class), (scaling, cols)
            for cols in f.cute_forward:
                assert plan(cols, scaling, 2, device_class=device_class), (scaling, cols)
        for cols in f.cute_forward_column_amax:
            assert plan(cols, "row", 2, column_amax=True, device_class=device_class), cols
    wide = dataclasses.replace(SM90_FP8, cute_forward_fp8_input={16384: (256, 2, 4)},
                               cute_forward_fp8_input_scaling={})
    with settings_fp8.measuring(wide):
        assert plan(16384, "row") is None and plan(16384, "block") is None
        assert plan(16384, "mx") is not None
    assert plan(16384, "row", arch=(12, 0)) is None  # two CTAs of 65 KB
    assert plan(4096, "row", arch=(12, 0)) is not None
    assert plan(16384, "row", 2, arch=(12, 0), column_amax=True) is None
    # The ring in shared memory counts its rows: FP8 x at 16384 (512, 2, 2) holds 64 KB of
    # weight and 2 x 20 KB of x and multipliers a CTA, two an SM; four rows of ring do not fit.
    ring = dataclasses.replace(SM90_FP8, cute_forward_fp8_input_shared_ring={"row": (16384,)},
                               cute_forward_shared_ring={"block": (8192,)})
    with settings_fp8.measuring(ring):
        assert plan(16384, "row").shared_ring and not plan(16384, "block").shared_ring
        assert plan(8192, "block", 2).shared_ring and not plan(8192, "row", 2).shared_ring
    deep = dataclasses.replace(ring, cute_forward_fp8_input_scaling={"row": {16384: (512, 4, 2)}})
    with settings_fp8.measuring(deep):
        assert plan(16384, "row") is None


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_ring_in_shared_memory_refuses_what_it_cannot_copy():
    from cutlass import BFloat16, Float8E4M3FN

    from tilenorm.kernels.cute_row_norm_fp8 import RowNormFp8Forward

    def kernel(dtype, scaling, group, **kw):
        return RowNormFp8Forward(dtype, BFloat16, Float8E4M3FN, 448.0, 4096, 128, 4, 4,
                                 scaling, False, group=group, shared_ring=True, **kw)

    assert kernel(Float8E4M3FN, "row", 128).shared_ring
    assert kernel(BFloat16, "block", 0).shared_ring
    for dtype, scaling, group, kw in ((Float8E4M3FN, "block", 128, {}),
                                      (BFloat16, "row", 0, {"recompute_t": True})):
        with pytest.raises(ValueError, match="ring in shared memory"):
            kernel(dtype, scaling, group, **kw)


def test_cute_fp8_input_forward_plans_its_own_table_for_whole_vector_groups():
    """FP8 x takes the settings' ``cute_forward_fp8_input`` entry of its width, or
    ``cute_forward_fp8_input_scaling``'s of its scaling there (never ``recompute_t``, which
    widens 2-byte words) where a group of its multipliers is whole
    16-byte vectors of x (16 elements or more); smaller groups, and widths outside the
    table, keep cuTile's kernel."""
    from tilenorm.kernels.cute_row_norm_fp8 import SCALINGS as KERNEL_SCALINGS
    from tilenorm.settings_fp8 import SM90_FP8

    def plan(cols, scaling="row", group=16, rows=1037):
        return plan_cute_fp8_forward(rows, cols, itemsize=1, sm_count=132, arch=(9, 0),
                                     scaling=scaling, group=group)

    assert SM90_FP8.cute_forward_fp8_input, "the table the GPU tests below exercise"
    assert set(SM90_FP8.cute_forward_fp8_input_scaling) <= set(KERNEL_SCALINGS)
    for widths in SM90_FP8.cute_forward_fp8_input_scaling.values():
        assert set(widths) <= set(SM90_FP8.cute_forward_fp8_input), "a width of the table"
    for cols in SM90_FP8.cute_forward_fp8_input:
        for scaling in KERNEL_SCALINGS:
            threads, stages, ctas = SM90_FP8.cute_forward_fp8_input_scaling.get(
                scaling, {}).get(cols, SM90_FP8.cute_forward_fp8_input[cols])
            assert SM90_FP8.fp8_input_entry(scaling, cols) == (threads, stages, ctas)
            assert cols % (16 * threads) == 0 and threads % 32 == 0, "whole 16-byte vectors"
            for group in (16, 32, 128):
                p = plan(cols, scaling, group)
                assert (p.threads, p.stages, p.ctas_per_sm) == (threads, stages, ctas)
                assert p.grid == min(1037, 132 * ctas) and not p.recompute_t
            for group in (0, 1, 8):
                assert plan(cols, scaling, group) is None
        assert plan_cute_fp8_forward(64, cols, itemsize=1, sm_count=132, arch=(9, 0),
                                     scaling="row", group=16,
                                     max_offset=MAX_INT32_OFFSET + 1) is None
    assert plan(5120) is None
    # No column amaxes for FP8 x: the CuTe copy that takes them reads 2-byte x.
    for cols in SM90_FP8.cute_forward_column_amax:
        assert plan_cute_fp8_forward(1040, cols, itemsize=1, sm_count=132, arch=(9, 0),
                                     scaling="row", group=16, column_amax=True) is None
        assert plan_cute_fp8_forward(1040, cols, itemsize=2, sm_count=132, arch=(9, 0),
                                     scaling="row", column_amax=True).column_amax


def test_cute_fp8_input_row_amax_folds_give_the_same_bits():
    """The CuTe row kernel's folds of a row's max|t| (cute_row_norm_fp8.py), emulated in NumPy
    (bench/experiments/fp8_input_sass.py): FP8 x's (from +0, the warp's and the warps' maxima
    one ``redux.sync.max.u32`` each of the bits), 2-byte x's (from |t[0]| and warp 0's
    partial) and folds from 0, over rows with NaN, infinities, subnormals and rstd NaN or
    infinite: the same sum of squares, scale and program amax bits, and the same max|t| but
    for a row whose every |t| is NaN (bench/NOTES.md #124)."""
    import numpy as np

    from bench.experiments.fp8_input_sass import emulate_folds

    assert emulate_folds(np.random.default_rng(0)) == 3000


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("x_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_input_decision_takes_the_cute_row_kernel_where_it_covers_the_call(x_dtype):
    """RMSNorm of FP8 x without a residual, groups of 16 or more: the CuTe row kernel (its
    FP8-input table), with cuTile's second pass where one runs and cuTile's FP8-input
    backward. A residual, LayerNorm, a group of 8 or a row-scaled transposed copy keep
    cuTile's row kernel."""
    from tilenorm import dispatch
    from tilenorm.device import DeviceInfo

    h100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, arch=(9, 0),
                      l2_bytes=50 << 20)

    def plan(scaling="row", transpose=False, op="rms_norm", residual=False, group=16):
        dtypes = (x_dtype, "bfloat16") + (("bfloat16",) if residual else ())
        p = dispatch.Fp8Problem(op, "cuda", 0, dtypes, 4096, 4096, scaling, transpose,
                                residual, 4096 * 4096 - 1, True, group=group)
        return dispatch._cute_fp8_forward(p, h100)

    for scaling in ("tensor", "delayed", "row", "block", "mx"):
        for group in (16, 128):
            p = plan(scaling, group=group)
            assert p is not None and (p.threads, p.stages) == (128, 4) and not p.recompute_t
    assert plan("block", transpose=True) is not None
    assert plan(residual=True) is None and plan(op="layer_norm") is None
    assert plan(group=8) is None
    # A row-scaled copy: no CuTe copy of FP8 x to take the row kernel's column amaxes.
    assert plan("row", transpose=True) is None
    p = dispatch.Fp8Problem("rms_norm", "cuda", 0, (x_dtype, "bfloat16"), 4096, 4096, "row",
                            True, False, 4096 * 4096 - 1, True, group=16)
    assert dispatch._cute_fp8_transpose(p, h100) is None
    assert dispatch._cute_fp8_forward(p, h100, column_amax=True) is None


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float8_e4m3fn"])
def test_fp8_decision_routes_each_x_with_a_copy_along_m(x_dtype, scaling, monkeypatch):
    """The whole decision for a transposed copy with scales along M, 1040 rows (a multiple
    of 16) of 4096 columns: 2-byte x takes the CuTe row kernel (with column amaxes for
    "row") and the CuTe copy; FP8 x takes cuTile's ``fp8_quantize_transposed`` (the CuTe
    copy reads 2-byte x), after the CuTe FP8-input row kernel for "block" and "mx" and
    after cuTile's row kernel, whose y its column amaxes are of, for "row"."""
    from tilenorm import dispatch
    from tilenorm.device import DeviceInfo

    h100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, arch=(9, 0),
                      l2_bytes=50 << 20)
    monkeypatch.setattr(dispatch, "device_info", lambda index: h100)
    dispatch.decide_fp8.cache_clear()
    fp8_x = x_dtype != "bfloat16"
    d = dispatch.decide_fp8(dispatch.Fp8Problem(
        "rms_norm", "cuda", 0, (x_dtype, "bfloat16"), 1040, 4096, scaling, True, False,
        1040 * 4096 - 1, True, group=16 if fp8_x else 0))
    dispatch.decide_fp8.cache_clear()
    copy = ("fp8_quantize_transposed",) if fp8_x else (dispatch.CUTE_FP8_TRANSPOSE_NAME,)
    if fp8_x and scaling == "row":
        row = ("norm_fwd_fp8_single",)
    else:
        row = (dispatch.CUTE_FP8_FORWARD_NAME,)
    columns = ("fp8_column_amax",) if scaling == "row" else ()
    forward = row + columns + copy  # FP8 x's backward kernels follow
    assert d.kernels[:len(forward)] == forward, str(d)
    assert (d.cute_transpose is None) == fp8_x and (d.quantize is None) == (not fp8_x)
    if d.cute_forward is not None:
        assert d.cute_forward.column_amax == (scaling == "row")
        assert d.column_amax is None or d.column_amax.partials == d.cute_forward.grid
    if d.cute_transpose is not None:
        assert d.cute_transpose.weight_first == (scaling == "row")


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("device_class", ["h200", "h100"])
@pytest.mark.parametrize("weight", ["bfloat16", None, "float32"])
@pytest.mark.parametrize("cols", [2048, 4096, 8192, 16384])
def test_row_scaled_copy_keeps_column_amaxes_in_the_cute_row_kernel(cols, weight,
                                                                     device_class,
                                                                     monkeypatch):
    """A per-row scaling's copy of 2-byte x at every width of the CuTe row kernel's table, on
    either device class: the CuTe row kernel keeping column amaxes at the scaling's own
    plan (the one q takes without the copy, the H200's ``recompute_t`` at 16384 included,
    bench/NOTES.md #125), the fixed-order reduction, the CuTe copy
    taking y as that kernel computes it; at 16384 too (cuTile's row kernel held the H200's
    copy at 54% of copy there, bench/NOTES.md #120). An fp32 weight keeps cuTile's row
    kernel, whose column amaxes are of cuTile's y, and the copy takes that y."""
    from tests.kernel_harness import H100, H200
    from tilenorm import dispatch
    from tilenorm.settings_fp8 import fp8_settings_for

    monkeypatch.setattr(dispatch, "device_info", lambda index: {"h100": H100,
                                                                "h200": H200}[device_class])
    dtypes = ("bfloat16",) + (() if weight is None else (weight,))
    problem = dispatch.Fp8Problem("rms_norm", "cuda", 0, dtypes, 1040, cols, "row", True,
                                  False, 1040 * cols - 1, True)
    dispatch.decide_fp8.cache_clear()
    try:
        d = dispatch.decide_fp8(problem)
        plain = dispatch.decide_fp8(dataclasses.replace(problem, transpose=False))
    finally:
        dispatch.decide_fp8.cache_clear()
    if weight == "float32":
        assert d.cute_forward is None and d.kernels[0] == "norm_fwd_fp8_single", str(d)
        assert d.cute_transpose is None or not d.cute_transpose.weight_first, str(d)
        return
    assert d.kernels == (dispatch.CUTE_FP8_FORWARD_NAME, "fp8_column_amax",
                         dispatch.CUTE_FP8_TRANSPOSE_NAME), str(d)
    f = d.cute_forward
    settings = fp8_settings_for((9, 0), device_class)
    recompute_t = settings.cute_forward_recompute_t.get("row", {}).get(cols)
    entry = recompute_t or settings.forward_entry("row", cols)
    assert (f.threads, f.stages, f.ctas_per_sm) == entry and f.column_amax, str(d)
    assert f.recompute_t == (recompute_t is not None), str(d)
    # Without the clamp where q alone takes it (the H200's 4096 and 8192): untimed with the
    # column amaxes, and the same bits either way.
    assert not f.clamp, str(d)
    assert dataclasses.replace(f, column_amax=False, clamp=plain.cute_forward.clamp) == (
        plain.cute_forward), str(plain)
    assert d.column_amax.partials == f.grid and d.column_amax.cols == cols
    assert d.cute_transpose.weight_first and d.quantize is None, str(d)


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_kernel_takes_a_group_with_fp8_x_only():
    import cutlass

    from tilenorm.kernels.cute_row_norm_fp8 import RowNormFp8Forward

    bf16, e4m3 = cutlass.BFloat16, cutlass.Float8E4M3FN
    for x, group in ((bf16, 16), (e4m3, 0), (e4m3, 8), (e4m3, 24)):
        with pytest.raises(ValueError, match="group"):
            RowNormFp8Forward(x, bf16, e4m3, 448.0, 4096, 128, 4, 4, "row", False,
                              group=group)
    kernel = RowNormFp8Forward(e4m3, bf16, e4m3, 448.0, 4096, 128, 4, 4, "block", False,
                               group=128)
    assert (kernel.vec, kernel.reps, kernel.block_lanes) == (16, 2, 8)
    with pytest.raises(ValueError, match="2-byte x only"):
        RowNormFp8Forward(e4m3, bf16, e4m3, 448.0, 4096, 128, 4, 4, "row", False,
                          column_amax=True, group=16)


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("scaling,transpose", [("block", False), ("block", True),
                                               ("tensor", False), ("delayed", True),
                                               ("row", False)])
def test_fp8_decision_passes_the_row_kernels_scaling_to_the_plan(scaling, transpose):
    """The CuTe plan is chosen by what the row kernel writes: a per-tensor scaling with a
    second pass writes amaxes only ("amax"), whose entry is not block's, row's or MX's (the
    H200's, whose ``recompute_t`` entries at 16384 are theirs alone)."""
    from tests.kernel_harness import H200
    from tilenorm import dispatch
    from tilenorm.settings_fp8 import SM90_FP8

    p = dispatch.Fp8Problem("rms_norm", "cuda", 0, ("bfloat16", "bfloat16"), 4096, 16384,
                            scaling, transpose, False, 4096 * 16384 - 1, True)
    assert p.row_scaling == ("amax" if scaling == "tensor" or (scaling == "delayed"
                                                              and transpose) else scaling)
    plan = dispatch._cute_fp8_forward(p, H200)
    assert plan.recompute_t == (p.row_scaling in SM90_FP8.cute_forward_recompute_t)
    assert plan.recompute_t == (scaling in ("block", "row"))


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_every_cute_fp8_variant_builds_for_hopper_and_blackwell():
    for key in cute.aot_fp8_keys(all_dtypes=True):
        for arch in cute.AOT_ARCHS:
            assert callable(cute.compile_fp8_forward(key, arch)), (key, arch)


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cute_fp8_conversions_saturate(tmp_path, arch):
    """The CuTe FP8 kernels leave saturation to the conversion (cute_row_norm_fp8.py): every
    fp32 -> FP8 conversion in their SASS is F2FP.SATFINITE, for both formats, the row kernel
    of 2-byte and of FP8 x, block scaling and the transposed copy; without it a value past
    the format's range would become NaN (E4M3) or an infinity (E5M2)."""
    import re

    from bench.kernel_resources import cubin_resources, find_cuobjdump, keeping_cubins

    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    row = functools.partial(cute.Fp8ForwardKey, None)
    builds = [
        (cute.compile_fp8_forward, row("bfloat16", "bfloat16", fmt, scaling, False, 4096,
                                       128, 4, 4))
        for fmt in ("float8_e4m3fn", "float8_e5m2") for scaling in ("row", "block", "mx")]
    builds += [
        (cute.compile_fp8_forward, row("float8_e4m3fn", "bfloat16", "float8_e4m3fn", "row",
                                       False, 4096, 128, 4, 4, group=128)),
        (cute.compile_fp8_forward, row("bfloat16", "bfloat16", "float8_e4m3fn", "block",
                                       False, 16384, 256, 2, 2, recompute_t=True))]
    builds += [(cute.compile_fp8_transpose,
                cute.Fp8TransposeKey("bfloat16", "bfloat16", fmt, "block", False, 4096, 128, 3))
               for fmt in ("float8_e4m3fn", "float8_e5m2")]
    for n, (compile_, key) in enumerate(builds):
        folder = tmp_path / str(n)
        folder.mkdir()
        with keeping_cubins(str(folder)):
            compile_(key, arch)
        _, sass = cubin_resources(next(folder.rglob("*.cubin")), tool)
        fmt = "E4M3" if key.fp8_dtype == "float8_e4m3fn" else "E5M2"
        to_fp8 = re.findall(rf"F2FP\S*\.{fmt}\.F32\S*", sass)
        assert to_fp8, (key, "no conversion to FP8 found")
        assert all(".SATFINITE." in op for op in to_fp8), (key, set(to_fp8))


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cute_fp8_clamp_is_two_nan_keeping_clamps_an_element(tmp_path, arch):
    """The kernel's ``clamp`` (the variant ``cute_fp8_probe.py --variant clamp`` times,
    bench/NOTES.md #125) at the H200's row and MX entries of 4096 columns, (128, 4, 4): two
    ``FMNMX.NAN`` more an element (4 rows of 32 elements a thread), NaN-propagating, so a
    NaN stays NaN into the conversion; not one plain ``FMNMX`` more (it returns the number,
    +-fp8_max, for a NaN) and the same conversions, every one SATFINITE."""
    import re

    from bench.experiments import cute_fp8_probe, fp8_block_sass
    from bench.kernel_resources import cubin_resources, find_cuobjdump, keeping_cubins

    assert cute_fp8_probe.variant_of(cute.Fp8ForwardKey(
        None, "bfloat16", "bfloat16", "float8_e4m3fn", "row", False, 4096, 128, 4, 4),
        "clamp").clamp
    assert fp8_block_sass.VARIANTS == {"clamp": True, "no-clamp": False}
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    for scaling in ("row", "mx"):
        sass = {}
        for clamp in (False, True):
            key = cute.Fp8ForwardKey(None, "bfloat16", "bfloat16", "float8_e4m3fn", scaling,
                                     False, 4096, 128, 4, 4, clamp=clamp)
            folder = tmp_path / f"{scaling}-{clamp}"
            folder.mkdir()
            with keeping_cubins(str(folder)):
                cute.compile_fp8_forward(key, arch)
            sass[clamp] = cubin_resources(next(folder.rglob("*.cubin")), tool)[1]

        nan_keeping, plain, to_fp8 = ({clamp: re.findall(pattern, text)
                                       for clamp, text in sass.items()}
                                      for pattern in (r"\bFMNMX\.NAN\b", r"\bFMNMX\b(?!\.NAN)",
                                                      r"F2FP\S*\.E4M3\.F32\S*"))
        assert len(nan_keeping[True]) - len(nan_keeping[False]) == 2 * 4 * 4096 // 128, scaling
        assert len(plain[True]) == len(plain[False]), scaling
        assert len(to_fp8[True]) == len(to_fp8[False]) > 0, scaling
        assert all(".SATFINITE." in op for op in to_fp8[True]), set(to_fp8[True])


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_recompute_t_entries_fit_their_registers_on_hopper(tmp_path):
    """What the settings' ``cute_forward_recompute_t`` entries are for: the kernel without
    spills at sm_90a (no local-memory stores or loads) where the kernel that holds t spills,
    for bf16 x with no weight, a bf16 weight and E5M2 (what was timed, #78). Left out as
    they still spill there (issue 19): a 4-byte weight, the offset, fp16 x."""
    keys = [key for key in cute.aot_fp8_keys() if key.recompute_t and key.dtype == "bfloat16"
            and key.weight_dtype != "float32" and not key.has_offset]
    assert keys
    for key, r in _hopper_resources(keys, tmp_path):
        assert (r["stack"], r["spill_stores"], r["spill_loads"]) == (0, 0, 0), (key, r)


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_clamped_entries_spill_no_more_than_without_on_hopper(tmp_path):
    """The row kernel with ``clamp`` at the entries the tables clamp (the H200's row 4096
    and 8192, MX 2048 and 8192), every feature set built ahead of time: no local memory at
    sm_90a with a 2-byte weight or none; with an fp32 weight, which spills without the clamp
    too (row 4096: 6 stores, 48 loads), no more than without it."""
    keys = [key for key in cute.aot_fp8_keys(all_dtypes=True) if key.clamp]
    assert {(key.scaling, key.cols) for key in keys} == {("row", 4096), ("row", 8192),
                                                         ("mx", 2048), ("mx", 8192)}
    for n, (key, r) in enumerate(_hopper_resources(keys, tmp_path / "clamp")):
        if key.weight_dtype != "float32":
            assert (r["stack"], r["spill_stores"], r["spill_loads"]) == (0, 0, 0), (key, r)
            continue
        [(_, without)] = _hopper_resources([dataclasses.replace(key, clamp=False)],
                                           tmp_path / f"without-{n}")
        assert r["spill_stores"] <= without["spill_stores"], (key, r, without)
        assert r["spill_loads"] <= without["spill_loads"], (key, r, without)


def _hopper_resources(keys, tmp_path):
    """(key, registers / stack / spills read off its cubin) of each FP8 row kernel variant
    of ``keys`` compiled for sm_90a; skips without cuobjdump."""
    from bench.kernel_resources import cubin_resources, find_cuobjdump, keeping_cubins

    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    for n, key in enumerate(keys):
        folder = tmp_path / str(n)
        folder.mkdir(parents=True)
        with keeping_cubins(str(folder)):
            cute.compile_fp8_forward(key, "sm_90a")
        yield key, cubin_resources(next(folder.rglob("*.cubin")), tool)[0]


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_column_amax_entries_spill_little_on_hopper(tmp_path):
    """The row kernel keeping a per-row copy's column amaxes, at each class's entries, bf16
    x with a bf16 weight or none: the column maxima folded as each product is made
    (``_quantize_keeping_column_maxima``) leave it spill-free at 2048 and 4096 and without
    a weight, and at most 6 spill stores a trip at 8192 and 16384 (folding them after the
    row's quantization spilled 4 at 4096 and 16 at 16384, bench/NOTES.md #120); the H200's
    ``recompute_t`` kernel at 16384, t recomputed a rep at a time beside the maxima, none
    (#125)."""
    keys = [key for key in cute.aot_fp8_keys() if key.column_amax and key.dtype == "bfloat16"]
    assert {key.cols for key in keys} == {2048, 4096, 8192, 16384}
    assert any(key.recompute_t for key in keys)
    for key, r in _hopper_resources(keys, tmp_path):
        most = 0 if key.weight_dtype is None or key.cols <= 4096 or key.recompute_t else 6
        assert r["spill_stores"] <= most, (key, r)


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_input_entries_do_not_spill_on_hopper(tmp_path):
    """The row kernel of FP8 x at its table's entries, every scaling and feature set built
    ahead of time: no local memory at sm_90a. Its loop keeps the fp32 weight in shared memory
    but for MX scaling, and 64-bit per-thread addresses but for block scaling, which spill
    with them (bench/NOTES.md #124). Row scaling's own entries on the H200
    (``cute_forward_fp8_input_scaling``), at 64 registers a thread, spill a few words in
    some feature sets (at 16384 the timed one too) and ran faster than every entry that does
    not (#128): at most 8 words, a stack of at most 32 bytes."""
    from tilenorm.settings import DEVICE_CLASSES
    from tilenorm.settings_fp8 import fp8_settings_for

    tables = [fp8_settings_for((9, 0), c).cute_forward_fp8_input_scaling
              for c in DEVICE_CLASSES]
    own = {(scaling, cols, entry) for table in tables for scaling, widths in table.items()
           for cols, entry in widths.items()}
    keys = [key for key in cute.aot_fp8_keys(all_dtypes=True) if key.group]
    assert {key.scaling for key in keys} == {"amax", "delayed", "row", "block", "mx"}
    for key, r in _hopper_resources(keys, tmp_path):
        local = (r["stack"], r["spill_stores"], r["spill_loads"])
        if (key.scaling, key.cols, (key.threads, key.stages, key.ctas_per_sm)) in own:
            assert local[0] <= 32 and max(local[1:]) <= 8, (key, r)
        else:
            assert local == (0, 0, 0), (key, r)


def test_cute_fp8_builds_are_of_every_row_count():
    """The ahead-of-time builds compile what the ops launch: one kernel a width and feature
    set for every row count (``Fp8ForwardKey.rows`` None)."""
    assert {key.rows for key in cute.aot_fp8_keys(all_dtypes=True)} == {None}


@pytest.mark.parametrize("column_blocks", [False, True])
def test_fp8_quantize_plan_covers_every_block_once(column_blocks):
    p = plan_fp8_quantize(1000, 4100, sm_count=132, arch=(9, 0), dependent_launch=False,
                          column_blocks=column_blocks)
    covered = [b for program in range(p.grid) for b in range(program, p.blocks, p.grid)]
    assert sorted(covered) == list(range(p.blocks))
    assert p.blocks == -(-1000 // p.tile_rows) * -(-4100 // p.tile_cols)
    # Whole groups of FP8 x's multipliers; whole 128 x 1 and 32 x 1 blocks of a column.
    assert p.tile_cols % tilenorm.pytorch.fp8.MAX_GROUP_SIZE == 0
    if column_blocks:
        assert p.tile_rows % 128 == 0


@pytest.mark.parametrize("cols", [16, 100, 128, 4096, 5000, 32768])
def test_fp8_column_amax_plan_covers_every_column_once(cols):
    p = plan_fp8_column_amax(264, cols, arch=(9, 0), dependent_launch=True)
    assert p.grid * p.tile_cols >= cols > (p.grid - 1) * p.tile_cols
    assert p.tile_cols & (p.tile_cols - 1) == 0 and p.tile_rows & (p.tile_rows - 1) == 0


@pytest.mark.parametrize("rows,groups", [(1, 1), (300, 10), (4096, 128), (65536, 1024)])
def test_fp8_mx_swizzle_plan_covers_every_tile_once(rows, groups):
    """A program per 128 rows and ``tiles`` 128 x 4 tiles: every tile of the padded scales,
    a power of two of them a program (the tile of bytes it loads)."""
    p = plan_fp8_mx_swizzle(rows, groups, arch=(9, 0), dependent_launch=True)
    column_tiles = -(-groups // 4)
    assert p.grid[0] == -(-rows // 128)
    assert p.grid[1] * p.tiles >= column_tiles > (p.grid[1] - 1) * p.tiles
    assert p.tiles & (p.tiles - 1) == 0


def test_fp8_mx_swizzle_plan_stays_within_the_grid():
    """The copy's scales of M rows take M / 1024 programs along the grid's second
    dimension: past CUDA's limit the op takes the reference path."""
    plan_fp8_mx_swizzle(128, 65535 * 32, arch=(9, 0), dependent_launch=False)
    with pytest.raises(UnsupportedShape, match="65535"):
        plan_fp8_mx_swizzle(128, 65535 * 32 + 1, arch=(9, 0), dependent_launch=False)


# --- kernels (GPU) -------------------------------------------------------------------------

def _poison(t: torch.Tensor, pattern: int) -> None:
    """Fill ``t`` with poison ``pattern`` (0 or 1): NaN bytes, then a finite pattern. Outputs
    that may hold NaN (a NaN input's row or block) are checked by two runs, each poisoned
    differently, coming out bit-identical: no element can keep both poisons."""
    if t.dtype in (E4M3, E5M2, torch.uint8):
        t.view(torch.uint8).fill_((0xFF, 0x35)[pattern])  # NaN in FP8 and E8M0; then finite
    else:
        t.fill_((float("nan"), -12345.0)[pattern])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in its logical order (NaN compares equal to itself): flat, as viewing a
    wider dtype as bytes takes a dimension with unit stride."""
    return t.reshape(-1).view(torch.uint8)


def run_kernels(op, x, w, b, scaling, fp8_dtype=E4M3, repeats=3, **kw):
    """The op's prepared kernels on poisoned outputs: every output written, ``repeats``
    reruns (one at least) bit-identical. Returns the result."""
    from tilenorm.pytorch import fp8 as fp8_ops

    if scaling == "delayed" and "scale" not in kw:
        kw["scale"] = torch.tensor([20.0], device=x.device)
    scale, residual = kw.pop("scale", None), kw.pop("residual", None)
    x_scale_inv, group_size = kw.pop("x_scale_inv", None), kw.pop("group_size", None)
    eps = kw.pop("eps", 1e-6 if op == "rms_norm" else 1e-5)
    with tilenorm.experimental():
        p = fp8_ops._prepared(op, x, w, b, residual, eps, kw.pop("offset", 0.0), scaling,
                              fp8_dtype, scale, kw.pop("transpose", False), x_scale_inv,
                              group_size, False, kw.pop("residual_dtype", None),
                              kw.pop("mx_layout", "row_major"))
    assert not kw, kw
    call = p.call
    assert call.decision.uses_kernel, str(call.decision)
    runs = []
    for n in range(max(2, 1 + repeats)):  # two poisons at least: every element written
        out = call.outputs()
        for t in out.values():
            _poison(t, n % 2)
        call.launch(out, x, w, b, residual, x_scale_inv, scale, p.eps, p.offset)
        runs.append(out)
    torch.cuda.synchronize()
    first = runs[0]
    for name, t in first.items():
        for again in runs[1:]:
            assert torch.equal(_bits(t), _bits(again[name])), (
                f"{name} differs between runs: unwritten (poisoned) elements or a race")
    return call.result(first)


GPU_SHAPES = [(1000, 4096), (257, 128), (4097, 2048), (333, 5120), (64, 16384)]


@gpu
@pytest.mark.parametrize("rows,cols", GPU_SHAPES)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_kernels_match_float64(op, fp8_dtype, scaling, rows, cols):
    g, seed = fresh_generator("cuda")
    x, w, b = _inputs(g, rows, cols, device="cuda", layer_norm=op == "layer_norm")
    out = run_kernels(op, x, w, b, scaling, fp8_dtype)
    ref = _reference(x.cpu(), w.cpu(), b if b is None else b.cpu(), scaling, fp8_dtype, out)
    check_against_float64(out, ref, scaling, fp8_dtype)
    assert rel_error(out.rstd.cpu(), ref.norm.rstd) <= 1e-5, seed


@gpu
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("cols", [1000, 3000])
def test_kernels_on_rows_no_power_of_two(scaling, cols):
    g, _ = fresh_generator("cuda")
    x, w, _ = _inputs(g, 999, cols, device="cuda")
    out = run_kernels("rms_norm", x, w, None, scaling)
    check_against_float64(out, _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out),
                          scaling, E4M3)


@gpu
@pytest.mark.parametrize("case", ["residual bf16", "residual fp32 stream", "offset",
                                  "fp32 x", "fp16 x", "no weight", "bf16 weight"])
@pytest.mark.parametrize("scaling", ["tensor", "delayed", "row", "block"])
@pytest.mark.parametrize("transpose", [False, True])
def test_feature_kernels_match_float64(case, scaling, transpose):
    g, seed = fresh_generator("cuda")
    dtype = {"fp32 x": torch.float32, "fp16 x": torch.float16}.get(case, torch.bfloat16)
    x, w, _ = _inputs(g, 1000, 4096, dtype=dtype, device="cuda")
    kw = {}
    if case == "no weight":
        w = None
    elif case == "bf16 weight":
        w = w.to(torch.bfloat16)
    elif case == "offset":
        kw["offset"] = 1.0
    elif case.startswith("residual"):
        kw["residual"] = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16)
        kw["residual_dtype"] = torch.float32 if "fp32" in case else None
    out = run_kernels("rms_norm", x, w, None, scaling, transpose=transpose, **dict(kw))
    h = x.cpu()
    if "residual" in kw:
        h = (x.float() + kw["residual"].float()).to(kw["residual_dtype"] or torch.bfloat16)
        assert torch.equal(out.h, h), seed
        h = h.cpu()
    ref = float64_fp8_norm(h, None if w is None else w.cpu(), scaling=scaling,
                           fp8_dtype=E4M3, offset=kw.get("offset", 0.0),
                           scale=torch.tensor([20.0]) if scaling == "delayed" else None,
                           transpose=transpose)
    check_against_float64(out, ref, scaling, E4M3)


@gpu
@pytest.mark.parametrize("scaling", ["tensor", "delayed"])
@pytest.mark.parametrize("rows,cols", [(1000, 4096), (4099, 2048), (70, 16384)])
def test_transposed_copy_is_q_transposed_on_gpu(scaling, rows, cols):
    g, _ = fresh_generator("cuda")
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    out = run_kernels("rms_norm", x, w, None, scaling, transpose=True)
    assert torch.equal(out.data_t.view(torch.uint8), out.data.t().view(torch.uint8))
    check_against_float64(out, _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out),
                          scaling, E4M3)


@gpu
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("rows,cols", GPU_SHAPES + [(4133, 4096), (100, 256)])
def test_transposed_copy_with_scales_along_m_on_gpu(op, fp8_dtype, scaling, rows, cols):
    """The row kernel, the column-amax reduction ("row") and the transposing kernel on
    poisoned outputs, reruns bit-identical: the dequantized (N, M) copy is the float64 y^T
    within FP8 rounding at its own scales, the scales are the op's functions of the float64
    amax along M (M not a multiple of 128 or 32 included), and q is as without the copy up to
    fp32 rounding."""
    g, seed = fresh_generator("cuda")
    x, w, b = _inputs(g, rows, cols, device="cuda", layer_norm=op == "layer_norm")
    out = run_kernels(op, x, w, b, scaling, fp8_dtype, transpose=True)
    ref = _reference(x.cpu(), w.cpu(), b if b is None else b.cpu(), scaling, fp8_dtype, out)
    check_against_float64(out, ref, scaling, fp8_dtype)
    plain = run_kernels(op, x, w, b, scaling, fp8_dtype, repeats=0)
    _same_up_to_fp32_rounding(out, plain, fp8_dtype, seed)


def _same_up_to_fp32_rounding(out, plain, fp8_dtype, seed) -> None:
    """q and its scales with the transposed copy against those without it. The row kernel
    that also keeps column amaxes is other code, whose fp32 y may round differently in its
    last bit (NOTES.md #51): a scale may move by a few ulps and an element of y at an FP8
    rounding boundary by one FP8 step, rarely; anything more is a defect."""
    if out.scale_inv.dtype == torch.float32:
        s, s0 = out.scale_inv.cpu(), plain.scale_inv.cpu()
        assert ((s - s0).abs() <= 4 * torch.finfo(torch.float32).eps * s0.abs()).all(), seed
    else:  # MX's power-of-two exponents: the same unless an amax sits on 2^k * fp8_max
        assert torch.equal(_bits(out.scale_inv), _bits(plain.scale_inv)), seed
    q, q0 = out.data.float().cpu(), plain.data.float().cpu()
    moved = q != q0
    assert moved.float().mean() <= 1e-3, seed
    assert ((q - q0).abs()[moved] <= testing.fp8_step(q0[moved], fp8_dtype)).all(), seed


#: (rows, cols, device class, weight dtype) of the CuTe route of a row-scaled copy: every width
#: of the row kernel's table on each class's entries, with and without a weight, 1040 rows
#: (a multiple of 16 and of no grid), and fewer rows than the grid at 16384.
CUTE_ROW_COPY_CASES = [(1040, cols, device_class, weight)
                       for cols in (2048, 4096, 8192, 16384) for device_class in ("h200", "h100")
                       for weight in (torch.bfloat16, None)] + [(48, 16384, "h200",
                                                                 torch.bfloat16)]


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("rows,cols,device_class,weight", CUTE_ROW_COPY_CASES)
def test_row_scaled_copy_on_the_cute_route_is_bit_exact_on_gpu(rows, cols, device_class,
                                                               weight, decide_as_class):
    """A per-row scaling's copy on the CuTe route (row kernel keeping column amaxes, their
    reduction, the CuTe copy; bench/NOTES.md #120) on poisoned outputs, reruns bit-identical:
    q and its scales are the bytes of the run without the copy (the same row kernel, which
    only adds the column maxima), and q, q_t and both scales are, bit for bit, y = (x * w) *
    rstd in fp32 from the kernels' own rstd quantized as the reference path quantizes it
    (the columns' amaxes over all rows, correctly rounded divisions, saturation, RNE).
    A route that computes y in another order (cuTile's row kernel: (x * rstd) * w), takes
    an amax over part of the rows or leaves an element unwritten fails."""
    from tilenorm.dispatch import CUTE_FP8_FORWARD_NAME, CUTE_FP8_TRANSPOSE_NAME

    decide_as_class(device_class)
    g, seed = fresh_generator("cuda")
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    w = None if weight is None else w.to(weight)
    with tilenorm.experimental():
        decision = tilenorm.fp8.explain(x, w, scaling="row", transpose=True)
    assert decision.kernels == (CUTE_FP8_FORWARD_NAME, "fp8_column_amax",
                                CUTE_FP8_TRANSPOSE_NAME), str(decision)
    out = run_kernels("rms_norm", x, w, None, "row", transpose=True)
    plain = run_kernels("rms_norm", x, w, None, "row", repeats=0)
    for got, want in ((out.data, plain.data), (out.scale_inv, plain.scale_inv),
                      (out.rstd, plain.rstd)):
        assert torch.equal(_bits(got), _bits(want)), seed
    t = x.float().cpu() if w is None else x.float().cpu() * w.float().cpu()
    y = t * out.rstd.cpu().reshape(rows, 1)
    q, scale_inv, _, q_t, scale_inv_t = reference.fp8_quantize(y, "row", E4M3, transpose=True)
    for got, want in ((out.data, q), (out.scale_inv, scale_inv), (out.data_t, q_t),
                      (out.scale_inv_t, scale_inv_t)):
        assert got.shape == want.shape, seed
        assert torch.equal(_bits(got.cpu().contiguous()), _bits(want.contiguous())), seed


@gpu
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("rows,cols", [(1000, 4096), (4097, 2048), (257, 128), (333, 5120),
                                       (100, 4128), (64, 16384)])
def test_swizzled_mx_scales_on_gpu(rows, cols, transpose):
    """The swizzle kernel after the row (and transposing) kernels, on poisoned outputs,
    reruns bit-identical: every byte of the 128 x 4 tiles, padding included, is the
    reference re-layout of the row-major scales the same kernels write."""
    g, seed = fresh_generator("cuda")
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    out = run_kernels("rms_norm", x, w, None, "mx", transpose=transpose,
                      mx_layout="swizzled")
    plain = run_kernels("rms_norm", x, w, None, "mx", transpose=transpose, repeats=0)
    assert torch.equal(_bits(out.data), _bits(plain.data)), seed
    pairs = [(out.scale_inv, plain.scale_inv)]
    if transpose:
        pairs.append((out.scale_inv_t, plain.scale_inv_t))
    for got, row_major in pairs:
        expected = reference.swizzle_mx_scales(row_major.cpu())
        assert got.shape == expected.shape and torch.equal(_bits(got.cpu()), _bits(expected))
    check_against_float64(_row_major(out), _reference(x.cpu(), w.cpu(), None, "mx", E4M3,
                                                      out), "mx", E4M3)


def _scaled_mm_mx_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


@gpu
@pytest.mark.skipif(not _scaled_mm_mx_supported(),
                    reason="torch._scaled_mm with MX scales needs Blackwell (sm_100)")
@pytest.mark.parametrize("m", [1024, 1000])
def test_scaled_mm_takes_the_swizzled_mx_scales(m):
    """Blackwell's MXFP8 GEMM reads q with the kernels' swizzled scales (M a multiple of
    128 or not): its product is that of the dequantized operands, up to bf16 rounding (a
    scale read from the wrong place is off by powers of two)."""
    g, seed = fresh_generator("cuda")
    k, n = 4096, 2048
    x, w, _ = _inputs(g, m, k, device="cuda")
    out = run_kernels("rms_norm", x, w, None, "mx", repeats=0, mx_layout="swizzled")
    b_q, b_scale, _, _, _ = reference.fp8_quantize(
        torch.randn(n, k, generator=g, device="cuda"), "mx", E4M3)
    product = torch._scaled_mm(out.data, b_q.t(), scale_a=out.scale_inv,
                               scale_b=reference.swizzle_mx_scales(b_scale),
                               out_dtype=torch.bfloat16)
    expected = (out.dequantize(torch.float64)
                @ tilenorm.fp8.dequantize(b_q, b_scale, "mx", torch.float64).t())
    assert rel_error(product, expected) <= 1e-2, seed


def _check_nan_row_and_zero_column(out, scaling, rows, cols, seed) -> None:
    """The copy of y with x[417] holding a NaN and column 10 of y all zero: column 417 of
    the copy NaN and no other, every scale finite, row 10 of the copy 0 at scale_inv 1."""
    q_t = out.data_t.float().cpu()
    others = [m for m in range(rows) if m != 417]
    assert q_t[:, 417].isnan().all() and not q_t[:, others].isnan().any(), seed
    s = testing.fp8_scales_per_element(out.scale_inv_t.cpu(), scaling, cols, rows)
    assert s.isfinite().all()
    assert (q_t[10, others] == 0).all() and (s[10] == 1).all()


@gpu
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_transposed_copy_keeps_nan_in_its_column_on_gpu(scaling):
    g, seed = fresh_generator("cuda")
    rows, cols = 1000, 4096
    x, w, b = _inputs(g, rows, cols, device="cuda", layer_norm=True)
    x[417, 3] = float("nan")
    w[9] = 0  # a column of y that is the bias alone
    b[10], w[10] = 0, 0  # and one all zero: scale_inv 1, q 0
    out = run_kernels("layer_norm", x, w, b, scaling, transpose=True, repeats=1)
    _check_nan_row_and_zero_column(out, scaling, rows, cols, seed)
    ref = _reference(x.cpu(), w.cpu(), b.cpu(), scaling, E4M3, out)
    check_against_float64(out, ref, scaling, E4M3)


@gpu
@pytest.mark.parametrize("scaling", ["tensor", "delayed", "row", "block", "mx"])
def test_padding_rows_stay_out_of_every_amax_on_gpu(scaling):
    """One LayerNorm row in tiles of many: a padding row normalizes to the bias, here far
    larger than any of the row's y, and must count in no amax (per tensor, per column, per
    128 x 1 or 32 x 1 block)."""
    g, seed = fresh_generator("cuda")
    x, w, b = _inputs(g, 1, 256, device="cuda", layer_norm=True)
    x_hat = testing.float64_norm(x, None, None, 1e-5, layer_norm=True).y[0, 0]
    b[0] = 50.0
    w[0] = float(-40.0 / x_hat)  # y[0, 0] = 10: the bias is 5 times the column's amax
    out = run_kernels("layer_norm", x, w, b, scaling, transpose=True, repeats=1)
    ref = _reference(x.cpu(), w.cpu(), b.cpu(), scaling, E4M3, out)
    assert float(ref.amax.max()) < 40, seed
    check_against_float64(out, ref, scaling, E4M3)


@gpu
@pytest.mark.parametrize("group_size", [16, 128])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "mx"])
@pytest.mark.parametrize("transpose", [False, True])
def test_fp8_input_kernels_match_float64(group_size, op, scaling, transpose):
    g, seed = fresh_generator("cuda")
    rows, cols = 1000, 4096
    _, w, b = _inputs(g, rows, cols, device="cuda", layer_norm=op == "layer_norm")
    x = (torch.randn(rows, cols, generator=g, device="cuda") * 4).to(E4M3)
    s = torch.rand(rows, cols // group_size, generator=g, device="cuda") + 0.5
    dy = torch.randn(rows, cols, generator=g, device="cuda").to(torch.bfloat16)
    kw = dict(x_scale_inv=s, group_size=group_size)
    out = run_kernels(op, x, w, b, scaling, transpose=transpose, **dict(kw))
    cpu = dict(x_scale_inv=s.cpu(), group_size=group_size)
    ref = _reference(x.cpu(), w.cpu(), b if b is None else b.cpu(), scaling, E4M3, out,
                     dy=dy.cpu(), **cpu)
    check_against_float64(out, ref, scaling, E4M3)
    runs = []
    with tilenorm.experimental():
        for _ in range(3):
            if b is None:
                runs.append(tilenorm.fp8.rms_norm_backward(dy, x, w, out.rstd, **kw))
            else:
                runs.append(tilenorm.fp8.layer_norm_backward(dy, x, w, b, out.mean, out.rstd,
                                                             **kw))
    for again in runs[1:]:
        for t, u in zip(runs[0], again, strict=True):
            assert torch.equal(t, u), f"the backward differs between runs; seed {seed}"
    dx, dw = runs[0][:2]
    assert rel_error(dx, ref.norm.dx) <= GRAD_TOL, seed
    assert rel_error(dw, ref.norm.dweight) <= DGAMMA_TOL_FP32, seed
    if b is not None:
        assert rel_error(runs[0][2], ref.norm.dbias) <= DGAMMA_TOL_FP32, seed


@gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_zero_rows_saturation_and_nan_on_gpu(scaling):
    g, _ = fresh_generator("cuda")
    x, w, _ = _inputs(g, 512, 4096, device="cuda")
    x[7] = 0
    clean = run_kernels("rms_norm", x, w, None, scaling, repeats=0)
    assert (clean.data[7].float() == 0).all()
    s = testing.fp8_scales_per_element(clean.scale_inv.cpu(), scaling, 512, 4096)
    assert s.isfinite().all()
    if scaling in ("row", "block", "mx"):
        assert (s[7] == 1).all()
    x[100, 5] = float("nan")
    dirty = run_kernels("rms_norm", x, w, None, scaling, repeats=0)
    assert dirty.data[100].float().isnan().all()
    rows = [r for r in range(512) if r != 100]
    if scaling != "tensor":
        assert torch.equal(dirty.data[rows].view(torch.uint8), clean.data[rows].view(torch.uint8))
    assert testing.fp8_scales_per_element(dirty.scale_inv.cpu(), scaling, 512, 4096)[
        rows].isfinite().all()
    for fp8_dtype in (E4M3, E5M2):
        hot = run_kernels("rms_norm", x, w, None, "delayed", fp8_dtype, repeats=0,
                          scale=torch.tensor([1e6], device="cuda"))
        q = hot.data[rows].float()
        assert q.isfinite().all() and q.abs().max() == reference.fp8_max(fp8_dtype)


@gpu
def test_kernels_and_reference_path_quantize_alike():
    """The kernels and the torch reference path compute y in fp32 in different orders: their
    q may differ only where y sits on a rounding boundary, by one FP8 step."""
    g, _ = fresh_generator("cuda")
    x, w, _ = _inputs(g, 2048, 4096, device="cuda")
    for scaling in SCALINGS:
        out = run_kernels("rms_norm", x, w, None, scaling, repeats=0)
        ref = _forward(x.cpu(), w.cpu(), None, scaling)
        q, q_ref = out.data.cpu().float(), ref.data.float()
        differ = q != q_ref
        assert differ.float().mean() < 1e-3, scaling
        step = testing.fp8_step(q_ref[differ], E4M3)
        assert ((q[differ] - q_ref[differ]).abs() <= step * 1.001).all(), scaling


@gpu
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
@pytest.mark.parametrize("residual", [False, True])
def test_autograd_on_gpu_matches_float64_and_reruns_bit_identical(scaling, residual):
    g, seed = fresh_generator("cuda")
    x, w, _ = _inputs(g, 2048, 4096, device="cuda")
    r = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16) if residual \
        else None
    dy = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16)
    grads = []
    with tilenorm.experimental():
        for _ in range(3):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            rs = None if r is None else r.clone().requires_grad_()
            y = tilenorm.fp8.rms_norm(xs, ws, scaling=scaling, residual=rs)
            assert y.dtype == torch.bfloat16 and y.fp8.dtype == E4M3
            torch.autograd.backward(y, dy)
            grads.append((xs.grad, ws.grad) + (() if rs is None else (rs.grad,)))
    for again in grads[1:]:
        for t, u in zip(grads[0], again, strict=True):
            assert torch.equal(t, u), f"gradients differ between runs; seed {seed}"
    ref = testing.float64_norm(x, w, residual=r, dy=dy)
    assert rel_error(grads[0][0], ref.dx) <= GRAD_TOL, seed
    if not residual:
        assert rel_error(grads[0][1], ref.dweight) <= DGAMMA_TOL_FP32, seed


def _scaled_mm_rowwise_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) and \
        hasattr(torch, "_scaled_mm")


@gpu
@pytest.mark.skipif(not _scaled_mm_rowwise_supported(),
                    reason="torch._scaled_mm with rowwise scales needs sm_90")
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_scaled_mm_of_the_fp8_output_is_the_gemm_of_the_norm(scaling):
    """q and scale_inv fed to torch._scaled_mm give the GEMM of the normalized input within
    FP8 error: the layouts are the ones it takes."""
    g, seed = fresh_generator("cuda")
    m, k, n = 1024, 4096, 2048
    x, w, _ = _inputs(g, m, k, device="cuda")
    out = run_kernels("rms_norm", x, w, None, scaling, repeats=0)
    b = torch.randn(n, k, generator=g, device="cuda") / k ** 0.5
    b_q, scale_b, _, _, _ = reference.fp8_quantize(b, scaling, E4M3)  # b's scaling as a's
    if scaling == "row":
        scale_b = scale_b.reshape(1, n)
    product = torch._scaled_mm(out.data, b_q.t(), scale_a=out.scale_inv, scale_b=scale_b,
                               out_dtype=torch.bfloat16)
    expected = testing.float64_norm(x, w).y @ b.double().t()
    assert rel_error(product, expected) <= 0.06, seed


@gpu
@pytest.mark.skipif(not _scaled_mm_rowwise_supported(),
                    reason="torch._scaled_mm with rowwise scales needs sm_90")
def test_scaled_mm_of_the_transposed_copy_is_the_weight_gradient():
    """dW = dY^T X as torch._scaled_mm(dY^T, X^T^T) with the transposed copy of the norm
    output and its per-column scales (``scale_inv_t.t()``, (1, N)): the layouts are the
    ones it takes for the operand that contracts over M."""
    g, seed = fresh_generator("cuda")
    m, k, n = 2048, 4096, 1024
    x, w, _ = _inputs(g, m, k, device="cuda")
    out = run_kernels("rms_norm", x, w, None, "row", transpose=True, repeats=0)
    dy = torch.randn(m, n, generator=g, device="cuda")
    dy_t, scale_dy, _, _, _ = reference.fp8_quantize(dy.t().contiguous(), "row", E4M3)
    product = torch._scaled_mm(dy_t, out.data_t.t(), scale_a=scale_dy,
                               scale_b=out.scale_inv_t.t(), out_dtype=torch.bfloat16)
    expected = dy.double().t() @ testing.float64_norm(x, w).y
    assert rel_error(product, expected) <= 0.06, seed


@gpu
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("case", ["rms", "rms residual", "layer_norm", "fp8 x"])
def test_compiled_fullgraph_on_gpu_matches_eager(scaling, case):
    """The kernels inside the custom ops of a compiled graph: every output and gradient as
    eager's, bit for bit."""
    with tilenorm.experimental():
        check_compiled_matches_eager(scaling, case, "cuda", (1000, 2053), 4096)


@gpu
def test_compiled_fullgraph_with_swizzled_mx_scales_on_gpu_matches_eager():
    with tilenorm.experimental():
        check_compiled_matches_eager("mx", "rms swizzled", "cuda", (1000, 2053), 4096)


@gpu
def test_explain_on_gpu_names_the_fp8_kernels():
    # 5120 columns: no CuTe DSL row kernel (the next test has those)
    x = torch.randn(4096, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(5120, device="cuda")
    with tilenorm.experimental():
        text = str(tilenorm.fp8.explain(x, w, scaling="tensor", transpose=True))
        row = str(tilenorm.fp8.explain(x, w, scaling="row", transpose=True))
        mx = str(tilenorm.fp8.explain(x, w, scaling="mx", transpose=True,
                                      mx_layout="swizzled"))
    assert "norm_fwd_fp8_single, fp8_quantize_normed" in text and "quantize:" in text
    # The copies with scales along M: the CuTe DSL pass (rows a multiple of 16) where the
    # DSL is installed, cuTile's otherwise.
    copy = ("TransposedFp8Quantize (CuTe DSL)" if cute.available()
            else "fp8_quantize_transposed")
    assert f"norm_fwd_fp8_single, fp8_column_amax, {copy}" in row
    assert "columns:" in row
    assert (f"norm_fwd_fp8_single, {copy}, fp8_swizzle_mx_scales, "
            "fp8_swizzle_mx_scales") in mx and "swizzle:" in mx


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("cols,device_class", [(2048, "h200"), (4096, "h200"), (4096, "h100"),
                                               (8192, "h200"), (8192, "h100"), (16384, "h200")])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_cute_row_kernel_runs_and_matches_float64(scaling, cols, device_class,
                                                  decide_as_class):
    """The widths of the FP8 settings' ``cute_forward`` table take the CuTe DSL row kernel
    (and a row-scaled transposed copy cuTile's, which keeps column amaxes, as 1037 rows are
    no multiple of 16 for the CuTe copy); rows not a multiple of the grid, poisoned outputs,
    reruns bit-identical (``run_kernels``). Each device class's entry, on any GPU (the
    classes differ at 8192, and at 4096 for row and MX scaling; the H200's kernel clamps
    for row scaling at 4096 and 8192 and MX at 2048 and 8192)."""
    from tilenorm.dispatch import CUTE_FP8_FORWARD_NAME
    from tilenorm.settings_fp8 import fp8_settings_for

    decide_as_class(device_class)
    g, seed = fresh_generator("cuda")
    x, w, _ = _inputs(g, 1037, cols, device="cuda")
    with tilenorm.experimental():
        decision = tilenorm.fp8.explain(x, w, scaling=scaling)
        copied = tilenorm.fp8.explain(x, w, scaling=scaling, transpose=True)
    assert decision.cute_forward is not None and CUTE_FP8_FORWARD_NAME in decision.kernels
    settings = fp8_settings_for((9, 0), device_class)
    entry = (settings.cute_forward_recompute_t.get(scaling, {}).get(cols)
             or settings.forward_entry(scaling, cols))
    f = decision.cute_forward
    assert (f.threads, f.stages, f.ctas_per_sm) == entry, str(decision)
    assert f.clamp == settings.forward_clamp(scaling, cols), str(decision)
    assert (copied.cute_forward is None) == (scaling == "row"), str(copied)
    out = run_kernels("rms_norm", x, w, None, scaling)
    ref = _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out)
    check_against_float64(out, ref, scaling, E4M3)
    assert rel_error(out.rstd.cpu(), ref.norm.rstd) <= 1e-5, seed


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("scaling", SCALINGS)
def test_cute_row_kernel_compiles_once_for_every_row_count(scaling):
    """Token counts vary from one training step to the next: the CuTe row kernel of a width
    and feature set compiles once and serves every row count (bench/NOTES.md #109),
    each call within float64 of its reference and its reruns bit-identical."""
    g, seed = fresh_generator("cuda")
    compiled = None
    for rows in (1037, 100, 4133):
        x, w, _ = _inputs(g, rows, 4096, device="cuda")
        with tilenorm.experimental():
            assert tilenorm.fp8.explain(x, w, scaling=scaling).cute_forward is not None
        out = run_kernels("rms_norm", x, w, None, scaling)
        ref = _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out)
        check_against_float64(out, ref, scaling, E4M3)
        misses = cute.compiled_fp8_forward.cache_info().misses
        assert compiled is None or misses == compiled, (rows, "compiled again", seed)
        compiled = misses


def _fp8_x(g, rows, cols, x_dtype, group, device="cuda"):
    """FP8 x as a previous layer's quantization leaves it: values spread over the format's
    range (not zeros), and one fp32 multiplier per group in [0.5, 1.5)."""
    x = (torch.randn(rows, cols, generator=g, device=device) * 8).to(x_dtype)
    s = torch.rand(rows, cols // group, generator=g, device=device) + 0.5
    return x, s


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("cols,x_dtype,group,scaling", [
    *((4096, x_dtype, group, scaling) for x_dtype in (E4M3, E5M2) for group in (16, 128)
      for scaling in SCALINGS),
    *((cols, E4M3, group, "row") for cols in (2048, 8192, 16384) for group in (16, 128)),
    (16384, E5M2, 128, "block"), (2048, E4M3, 16, "mx")])
def test_cute_row_kernel_reads_fp8_x_and_matches_float64(cols, x_dtype, group, scaling):
    """FP8 x at the widths of the FP8 settings' ``cute_forward_fp8_input`` table takes the
    CuTe DSL row kernel (and cuTile's second pass, for per-tensor current scaling): q, its
    scales, amax and rstd against float64 of the dequantized x; an odd row count (not a
    multiple of the grid), poisoned outputs, three reruns bit-identical (``run_kernels``)."""
    from tilenorm.dispatch import CUTE_FP8_FORWARD_NAME

    g, seed = fresh_generator("cuda")
    rows = 1037
    x, s = _fp8_x(g, rows, cols, x_dtype, group)
    w = 1 + 0.5 * torch.randn(cols, generator=g, device="cuda")
    kw = dict(x_scale_inv=s, group_size=group)
    with tilenorm.experimental():
        decision = tilenorm.fp8.explain(x, w, scaling=scaling, **kw)
    assert decision.cute_forward is not None and CUTE_FP8_FORWARD_NAME in decision.kernels, \
        str(decision)
    out = run_kernels("rms_norm", x, w, None, scaling, repeats=3, **kw)
    ref = _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out, x_scale_inv=s.cpu(),
                     group_size=group)
    check_against_float64(out, ref, scaling, E4M3)
    assert rel_error(out.rstd.cpu(), ref.norm.rstd) <= 1e-5, seed


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("group", [16, 128])
@pytest.mark.parametrize("scaling", ["row", "block", "mx", "delayed"])
def test_cute_row_kernel_of_fp8_x_keeps_nan_in_its_row(scaling, group):
    """A NaN multiplier of one group (and a NaN byte of x in another row) makes its row's y
    NaN: that row's q is FP8 NaN throughout; every other row's q and scales are the bits of
    the clean run, and every scale stays finite."""
    g, _ = fresh_generator("cuda")
    rows, cols = 515, 4096
    x, s = _fp8_x(g, rows, cols, E4M3, group)
    w = 1 + 0.5 * torch.randn(cols, generator=g, device="cuda")
    kw = dict(x_scale_inv=s, group_size=group)
    with tilenorm.experimental():
        assert tilenorm.fp8.explain(x, w, scaling=scaling, **kw).cute_forward is not None
    clean = run_kernels("rms_norm", x, w, None, scaling, repeats=0, **kw)
    s_nan, x_nan = s.clone(), x.clone()
    s_nan[100, 3] = float("nan")
    x_nan.view(torch.uint8)[300, 77] = 0x7F  # E4M3 NaN
    dirty = run_kernels("rms_norm", x_nan, w, None, scaling, repeats=1,
                        x_scale_inv=s_nan, group_size=group)
    for row in (100, 300):
        assert dirty.data[row].float().isnan().all(), row
        assert dirty.rstd[row].isnan()
    others = [r for r in range(rows) if r not in (100, 300)]
    assert torch.equal(dirty.data[others].view(torch.uint8),
                       clean.data[others].view(torch.uint8))
    assert torch.equal(dirty.rstd[others], clean.rstd[others])
    if scaling == "delayed":  # the amax skips the NaN rows
        assert dirty.amax.isfinite() and dirty.amax <= clean.amax
    else:
        scales = testing.fp8_scales_per_element(dirty.scale_inv.cpu(), scaling, rows, cols)
        assert scales.isfinite().all()
        assert torch.equal(scales[others], testing.fp8_scales_per_element(
            clean.scale_inv.cpu(), scaling, rows, cols)[others])


#: Weight, FP8 format and Gemma offset of each case of the recompute-t tests below.
RECOMPUTE_T_CASES = {"bf16 weight": (torch.bfloat16, E4M3, 0.0),
                     "fp32 weight": (torch.float32, E4M3, 0.0),
                     "no weight": (None, E4M3, 0.0),
                     "e5m2": (torch.bfloat16, E5M2, 0.0),
                     "offset": (torch.float32, E4M3, 1.0)}


def _cute_fp8_launch(key, x, w, offset: float, grid: int, pattern: int,
                     scale: float = 20.0) -> dict:
    """``key``'s kernel launched directly on x (and w) with outputs poisoned by
    ``pattern`` (delayed scaling at ``scale``); the outputs, by name."""
    rows, cols = x.shape
    dev = x.device
    out = {"q": torch.empty(rows, cols, dtype=torch.uint8, device=dev),
           "rstd": torch.empty(rows, device=dev)}
    if key.scaling == "amax":
        del out["q"]
    if key.scaling == "row":
        out["q_scale"] = torch.empty(rows, 1, device=dev)
    elif key.scaling == "block":
        out["q_scale"] = torch.empty(cols // 128, rows, device=dev).t()
    elif key.scaling == "mx":
        out["q_scale"] = torch.empty(rows, cols // 32, dtype=torch.uint8, device=dev)
    if key.scaling in ("amax", "delayed"):
        out["amax"] = torch.empty(grid, device=dev)
    for t in out.values():
        _poison(t, pattern)
    scale = torch.tensor([scale], device=dev) if key.scaling == "delayed" else None
    fn = cute.compiled_fp8_forward(key, torch.cuda.get_device_capability())
    fn(x, None, w, scale, out.get("q"), out.get("q_scale"), out["rstd"], out.get("amax"), 1e-6,
       offset, grid)
    return out


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("config", [(256, 2, 2), (512, 4, 1)])
@pytest.mark.parametrize("scaling", ["row", "block", "mx", "delayed", "amax"])
@pytest.mark.parametrize("case", sorted(c for c, (_, _, offset) in RECOMPUTE_T_CASES.items()
                                         if offset == 0.0))
def test_cute_fp8_recompute_t_gives_the_bits_of_the_kernel_holding_t(case, scaling, config):
    """``recompute_t`` does the same fp32 operations on the same values as the kernel that
    holds the weight and t (widening a 2-byte float is exact): every output the same bits
    at the same launch configuration, 16384 columns, rows not a multiple of the grid,
    outputs poisoned differently for each kernel. Not with the Gemma offset: there the two
    kernels' x * w + x * offset round differently (an H100 run at b2d144f differed in every
    scaling and configuration), and the offset case is held to float64 by
    ``test_block_scaling_at_16384_columns_recomputes_t_and_matches_float64``."""
    g, seed = fresh_generator("cuda")
    rows, cols = 1037, 16384
    weight_dtype, fp8_dtype, offset = RECOMPUTE_T_CASES[case]
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    w = None if weight_dtype is None else w.to(weight_dtype)
    sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(rows, sm_count * config[2])
    key = cute.Fp8ForwardKey(None, "bfloat16", None if w is None else DTYPE_NAMES[w.dtype],
                             DTYPE_NAMES[fp8_dtype], scaling, offset != 0.0, cols, *config)
    held = _cute_fp8_launch(key, x, w, offset, grid, 0)
    recomputed = _cute_fp8_launch(dataclasses.replace(key, recompute_t=True), x, w, offset,
                                  grid, 1)
    torch.cuda.synchronize()
    assert held["rstd"].isfinite().all(), "rstd left unwritten"
    for name, t in held.items():
        assert torch.equal(_bits(t), _bits(recomputed[name])), (name, seed)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scaling,cols", [("row", 4096), ("row", 8192), ("mx", 2048),
                                          ("mx", 8192), ("delayed", 4096), ("block", 4096)])
def test_cute_fp8_clamp_gives_the_bits_of_the_kernel_without_it(scaling, cols, fp8_dtype):
    """The kernel's ``clamp`` changes no bit: the conversion saturates by itself, and the
    clamp keeps NaN (``FMNMX.NAN``). Every output of the kernel with it and without it the
    same bits at the H200's entry of the scaling and width (its clamped ones, and delayed
    scaling with a scale that saturates most of q, where the clamp acts), a bf16 weight,
    rows not a multiple of the grid, outputs poisoned differently for each kernel, over x
    with a NaN (its row's q all NaN), infinities, values near the bf16 maximum and tiny
    rows."""
    from tilenorm.settings_fp8 import SM90_FP8

    g, seed = fresh_generator("cuda")
    rows = 1037
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    w = w.to(torch.bfloat16)
    x[5, 7] = float("nan")
    x[9, 100], x[11, 3] = float("inf"), float("-inf")
    x[13, :64] = 3.0e38
    x[17] *= 1e-30
    sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    config = SM90_FP8.forward_entry(scaling, cols)
    key = cute.Fp8ForwardKey(None, "bfloat16", "bfloat16", DTYPE_NAMES[fp8_dtype], scaling,
                             False, cols, *config)
    grid = min(rows, sm_count * config[2])
    scale = 1e6 if scaling == "delayed" else 20.0
    plain = _cute_fp8_launch(key, x, w, 0.0, grid, 0, scale)
    clamped = _cute_fp8_launch(dataclasses.replace(key, clamp=True), x, w, 0.0, grid, 1,
                               scale)
    torch.cuda.synchronize()
    assert plain["q"][5].view(fp8_dtype).float().isnan().all(), seed
    assert plain["q"][20:].view(fp8_dtype).float().isfinite().all(), seed
    for name, t in plain.items():
        assert torch.equal(_bits(t), _bits(clamped[name])), (name, seed)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("rows", [1037, 100])
@pytest.mark.parametrize("case", [*sorted(RECOMPUTE_T_CASES), "transpose"])
def test_block_scaling_at_16384_columns_recomputes_t_and_matches_float64(case, rows):
    """Block scaling at 16384 columns runs the CuTe kernel's ``recompute_t`` at (256, 2, 2)
    (tilenorm/settings_fp8.py, #78), with every weight dtype (or none), E5M2, the offset,
    and the transposed copy (cuTile's second pass): q against float64 at its own scales,
    three runs on poisoned outputs bit-identical, and (but with the offset, whose x * w +
    x * offset the compile may contract into an FMA) every scale exactly the kernels'
    function of the fp32 block amax max|x * w| * rstd."""
    g, seed = fresh_generator("cuda")
    cols = 16384
    weight_dtype, fp8_dtype, offset = RECOMPUTE_T_CASES.get(case, (torch.bfloat16, E4M3, 0.0))
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    w = None if weight_dtype is None else w.to(weight_dtype)
    transpose = case == "transpose"
    with tilenorm.experimental():
        decision = tilenorm.fp8.explain(x, w, scaling="block", fp8_dtype=fp8_dtype,
                                        transpose=transpose)
    plan = decision.cute_forward
    assert plan is not None and plan.recompute_t, str(decision)
    assert (plan.threads, plan.stages, plan.ctas_per_sm) == (256, 2, 2)
    out = run_kernels("rms_norm", x, w, None, "block", fp8_dtype, repeats=2,
                      transpose=transpose, offset=offset)
    ref = _reference(x.cpu(), None if w is None else w.cpu(), None, "block", fp8_dtype, out,
                     offset=offset)
    check_against_float64(out, ref, "block", fp8_dtype)
    assert rel_error(out.rstd.cpu(), ref.norm.rstd) <= 1e-5, seed
    if offset == 0.0:
        t = x.cpu().float() if w is None else x.cpu().float() * w.cpu().float()
        amax = t.abs().reshape(rows, cols // 128, 128).amax(-1) * out.rstd.cpu()[:, None]
        scale = reference.scale_from_amax(amax, fp8_dtype)
        assert torch.equal(out.scale_inv.cpu(), torch.ones_like(scale) / scale), seed


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_row_kernel_takes_a_delayed_scale_of_any_one_element_shape():
    g, _ = fresh_generator("cuda")
    x, w, _ = _inputs(g, 300, 4096, device="cuda")
    outs = [tilenorm.fp8.rms_norm_forward(x, w, scaling="delayed", scale=s)
            for s in (torch.tensor(20.0, device="cuda"), torch.tensor([[20.0]], device="cuda"),
                      torch.tensor([20.0], device="cuda"))]
    with tilenorm.experimental():
        assert tilenorm.fp8.explain(x, w, scaling="delayed").cute_forward is not None
    for out in outs[:2]:
        assert torch.equal(out.data.view(torch.uint8), outs[2].data.view(torch.uint8))


def test_cute_fp8_kernel_refuses_an_odd_ring():
    """Consecutive rows reduce in two shared-memory slots by their place in the ring: an odd
    ring would put its last row and the next ring's first in one slot (a race)."""
    if not cute.available():
        pytest.skip("CuTe DSL not installed")
    import cutlass

    from tilenorm.kernels.cute_row_norm_fp8 import RowNormFp8Forward

    bf16, e4m3 = cutlass.BFloat16, cutlass.Float8E4M3FN
    for stages in (1, 3, 5):
        with pytest.raises(ValueError, match="even"):
            RowNormFp8Forward(bf16, bf16, e4m3, 448.0, 4096, 128, stages, 4, "row", False)
    RowNormFp8Forward(bf16, bf16, e4m3, 448.0, 4096, 128, 4, 4, "row", False)


# --- the CuTe DSL transposed copy (tilenorm/kernels/cute_fp8_transpose.py) -----------------


def test_cute_fp8_transpose_plans_whole_tiles_of_rows_a_multiple_of_16():
    from tilenorm.planner import plan_cute_fp8_transpose

    p = plan_cute_fp8_transpose(1040, 4096, itemsize=2, arch=(9, 0))
    assert (p.tile_cols, p.ctas_per_sm, p.grid) == (128, 3, (32, 9))
    assert "128x128 tiles" in p.describe()
    p = plan_cute_fp8_transpose(64, 2112, itemsize=2, arch=(9, 0))  # 64-column tiles
    assert (p.tile_cols, p.grid) == (64, (33, 1))
    for rows, cols, itemsize in ((1000, 4096, 2), (1040, 4096, 4), (1040, 2100, 2)):
        assert plan_cute_fp8_transpose(rows, cols, itemsize=itemsize, arch=(9, 0)) is None
    assert plan_cute_fp8_transpose(1 << 20, 4096, itemsize=2, arch=(9, 0)) is None  # offsets
    assert plan_cute_fp8_transpose(65536 * 128 + 16, 128, itemsize=2, arch=(9, 0)) is None


@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_fp8_decision_takes_the_cute_transposed_copy_where_it_covers_the_call(scaling):
    """RMSNorm of 2-byte x without a residual, rows a multiple of 16: the CuTe DSL copy in
    place of cuTile's ``fp8_quantize_transposed``; LayerNorm, a residual, fp32 or FP8 x,
    other row counts and the per-tensor scalings keep cuTile's."""
    from tilenorm import dispatch, settings_fp8
    from tilenorm.device import DeviceInfo
    from tilenorm.settings_fp8 import SM90_FP8

    h100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, arch=(9, 0),
                      l2_bytes=50 << 20)

    def problem(op="rms_norm", dtypes=("bfloat16", "bfloat16"), rows=1040, transpose=True,
                residual=False, scaling=scaling):
        return dispatch.Fp8Problem(op, "cuda", 0, dtypes, rows, 4096, scaling, transpose,
                                   residual, rows * 4096 - 1, True)

    plan = dispatch._cute_fp8_transpose(problem(), h100)
    assert plan is not None and plan.grid == (32, 9) and not plan.weight_first
    # A per-row scaling's column amaxes: the CuTe row kernel keeps them where the CuTe copy
    # follows it at a width of the settings' cute_forward_column_amax.
    row = dispatch._cute_fp8_forward(problem(), h100, column_amax=True)
    assert (row is not None and row.column_amax) == (scaling == "row")
    if scaling == "row":
        assert dispatch._cute_fp8_forward(problem(), h100) is None
        assert "column amaxes kept" in row.describe()
        # A width the table leaves out keeps cuTile's row kernel for the column amaxes.
        narrower = dataclasses.replace(SM90_FP8, cute_forward_column_amax=(2048,))
        with settings_fp8.measuring(narrower):
            assert dispatch._cute_fp8_forward(problem(), h100, column_amax=True) is None
        fp32_weight = problem(dtypes=("bfloat16", "float32"))
        assert dispatch._cute_fp8_forward(fp32_weight, h100, column_amax=True) is None
    assert dispatch._cute_fp8_transpose(problem(dtypes=("float16", "float32")), h100)
    for other in (problem(op="layer_norm"), problem(residual=True), problem(rows=1000),
                  problem(transpose=False), problem(dtypes=("float32", "float32")),
                  problem(dtypes=("float8_e4m3fn", "bfloat16")), problem(scaling="tensor")):
        assert dispatch._cute_fp8_transpose(other, h100) is None, other


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_every_cute_fp8_transpose_variant_builds_for_hopper_and_blackwell():
    keys = cute.aot_fp8_transpose_keys(all_dtypes=True)
    assert {k.scaling for k in keys} == {"row", "block", "mx"}
    for key in keys:
        for arch in cute.AOT_ARCHS:
            assert callable(cute.compile_fp8_transpose(key, arch)), (key, arch)


@pytest.mark.aot
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
def test_cute_fp8_transpose_fits_its_ctas_an_sm_on_hopper(tmp_path):
    """What the settings' ``cute_transpose`` entries compile for: each tile's CTAs an SM
    within the register file, with 16-byte loads of x and stores of q_t, and no local
    memory but block scaling's one 4-byte slot (a register saved around the division's
    slow-path call, once a tile)."""
    from bench.kernel_resources import cubin_resources, find_cuobjdump, keeping_cubins
    from tilenorm.kernels.cute_fp8_transpose import THREAD_ROWS, TILE_ROWS
    from tilenorm.settings_fp8 import SM90_FP8

    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    cases = [(s, t, False) for s in ("row", "block", "mx") for t in SM90_FP8.cute_transpose]
    for n, (scaling, (tile_cols, ctas), weight_first) in enumerate(
            cases + [("row", SM90_FP8.cute_transpose[0], True)]):
        key = cute.Fp8TransposeKey("bfloat16", "bfloat16", "float8_e4m3fn", scaling, False,
                                   4096, tile_cols, ctas, weight_first)
        folder = tmp_path / str(n)
        folder.mkdir()
        with keeping_cubins(str(folder)):
            cute.compile_fp8_transpose(key, "sm_90a")
        r, _ = cubin_resources(next(folder.rglob("*.cubin")), tool)
        threads = tile_cols // 8 * TILE_ROWS // THREAD_ROWS
        assert r["registers"] * threads * ctas <= 65536, (key, r)
        assert r["spill_stores"] <= (scaling == "block") and r["stack"] <= 8, (key, r)


def _without_cute_transpose(monkeypatch):
    """Decisions and prepared calls made afresh, with cuTile's transposing pass."""
    from tilenorm import dispatch
    from tilenorm.pytorch import calls

    monkeypatch.setattr(dispatch, "_cute_fp8_transpose", lambda p, info: None)
    dispatch.decide_fp8.cache_clear()
    calls.clear()


def _forget_fp8_plans():
    from tilenorm import dispatch
    from tilenorm.pytorch import calls

    dispatch.decide_fp8.cache_clear()
    calls.clear()


#: (rows, cols) the CuTe transposed copy takes: a last row tile of 16 rows, a tile of 64
#: rows alone, 64-column tiles (2112: not "block", whose blocks are 128 columns), 16 rows.
CUTE_TRANSPOSE_SHAPES = [(1040, 4096), (4096, 2048), (64, 16384), (2064, 2112), (16, 8192)]


def _copy_of_fp32_y(x, w, rstd, scaling, fp8_dtype, weight_first: bool):
    """(q_t, scale_inv_t) of y computed in fp32 by torch in the kernel's order ((x * rstd)
    * w, or with ``weight_first`` (x * w) * rstd: elementwise IEEE products, no FMA), then
    quantized along M by the reference path (correctly rounded quotients, as the kernels')."""
    xf, r = x.float(), rstd.reshape(-1, 1)
    y = xf * r
    if w is not None:
        y = (xf * w.float()) * r if weight_first else y * w.float()
    return reference.quantize_along_rows(y.t().contiguous(), scaling, fp8_dtype)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("weight", ["fp32", "bf16", "none"])
@pytest.mark.parametrize("rows,cols", CUTE_TRANSPOSE_SHAPES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_cute_transposed_copy_has_the_bits_of_its_fp32_math(scaling, fp8_dtype, rows, cols,
                                                            weight, monkeypatch):
    """The CuTe DSL copy on poisoned outputs, three reruns bit-identical (``run_kernels``):
    q_t and its scales the bits of its fp32 math done by torch (:func:`_copy_of_fp32_y`),
    and against float64 at its own scales. Where it takes cuTile's math ((x * rstd) * w:
    block, MX, and a per-row scaling after cuTile's row kernel), also the bits of cuTile's
    ``fp8_quantize_transposed``; where a per-row scaling takes the CuTe row kernel's column
    amaxes (``weight_first``), q and its scales the bits of that kernel without the copy."""
    from tilenorm.dispatch import CUTE_FP8_TRANSPOSE_NAME

    if scaling == "block" and cols % 128:
        pytest.skip("block scaling takes whole 128-column blocks")
    g, seed = fresh_generator("cuda")
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    w = {"fp32": w, "bf16": w.to(torch.bfloat16), "none": None}[weight]
    try:
        _forget_fp8_plans()
        with tilenorm.experimental():
            decision = tilenorm.fp8.explain(x, w, scaling=scaling, fp8_dtype=fp8_dtype,
                                            transpose=True)
        assert CUTE_FP8_TRANSPOSE_NAME in decision.kernels, str(decision)
        assert decision.quantize is None and "copy:" in str(decision)
        weight_first = decision.cute_transpose.weight_first
        assert weight_first == (decision.cute_forward is not None and scaling == "row")
        out = run_kernels("rms_norm", x, w, None, scaling, fp8_dtype, transpose=True)
        q_t, scale_inv_t = _copy_of_fp32_y(x, w, out.rstd, scaling, fp8_dtype, weight_first)
        assert torch.equal(_bits(out.data_t), _bits(q_t)), seed
        assert torch.equal(_bits(out.scale_inv_t), _bits(scale_inv_t)), seed
        ref = _reference(x.cpu(), None if w is None else w.cpu(), None, scaling, fp8_dtype,
                         out)
        check_against_float64(out, ref, scaling, fp8_dtype)
        if weight_first:
            other = run_kernels("rms_norm", x, w, None, scaling, fp8_dtype, repeats=1)
            names = ("data", "scale_inv", "rstd")
        else:
            _without_cute_transpose(monkeypatch)
            with tilenorm.experimental():
                assert "fp8_quantize_transposed" in tilenorm.fp8.explain(
                    x, w, scaling=scaling, fp8_dtype=fp8_dtype, transpose=True).kernels
            other = run_kernels("rms_norm", x, w, None, scaling, fp8_dtype, repeats=1,
                                transpose=True)
            names = ("data_t", "scale_inv_t", "data", "scale_inv", "rstd")
    finally:
        _forget_fp8_plans()
    for name in names:
        assert torch.equal(_bits(getattr(out, name)), _bits(getattr(other, name))), (
            name, seed)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("case", ["offset", "swizzled", "fp16 x"])
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_cute_transposed_copy_features_match_float64(scaling, case):
    """The Gemma offset (whose x * rstd * w + x * rstd * offset the compilers may contract
    differently: float64 decides, not cuTile's bits), MX scales swizzled after the copy, and
    fp16 x with an fp16 weight."""
    from tilenorm.dispatch import CUTE_FP8_TRANSPOSE_NAME

    if case == "swizzled" and scaling != "mx":
        pytest.skip("only MX scales are swizzled")
    g, seed = fresh_generator("cuda")
    rows, cols = 2064, 4096
    dtype = torch.float16 if case == "fp16 x" else torch.bfloat16
    x, w, _ = _inputs(g, rows, cols, dtype=dtype, device="cuda")
    if case == "fp16 x":
        w = w.to(torch.float16)
    kw = {"offset": 1.0} if case == "offset" else {}
    if case == "swizzled":
        kw["mx_layout"] = "swizzled"
    with tilenorm.experimental():
        decision = tilenorm.fp8.explain(x, w, scaling=scaling, transpose=True,
                                        mx_layout=kw.get("mx_layout", "row_major"))
    assert CUTE_FP8_TRANSPOSE_NAME in decision.kernels, str(decision)
    out = run_kernels("rms_norm", x, w, None, scaling, transpose=True, **dict(kw))
    kw.pop("mx_layout", None)
    ref = _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out, **kw)
    if case == "swizzled":
        rows_t = tilenorm.fp8.dequantize(out.data_t, out.scale_inv_t, "mx", torch.float64,
                                         "swizzled")
        plain = run_kernels("rms_norm", x, w, None, scaling, transpose=True, repeats=0)
        assert torch.equal(rows_t, plain.dequantize_t(torch.float64)), seed
        out = plain
    check_against_float64(out, ref, scaling, E4M3)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_cute_transposed_copy_keeps_nan_in_its_column(scaling):
    """A NaN in x makes its row of y NaN: that column of the copy is NaN and every scale
    stays finite (each amax skips NaN); an all-zero column of y gets scale_inv 1 and q 0."""
    from tilenorm.dispatch import CUTE_FP8_TRANSPOSE_NAME

    g, seed = fresh_generator("cuda")
    rows, cols = 1040, 4096
    x, w, _ = _inputs(g, rows, cols, device="cuda")
    x[417, 3] = float("nan")
    w[10] = 0
    with tilenorm.experimental():
        assert CUTE_FP8_TRANSPOSE_NAME in tilenorm.fp8.explain(
            x, w, scaling=scaling, transpose=True).kernels
    out = run_kernels("rms_norm", x, w, None, scaling, transpose=True, repeats=1)
    _check_nan_row_and_zero_column(out, scaling, rows, cols, seed)
    check_against_float64(out, _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out),
                          scaling, E4M3)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("rows", [1000, 1048, 4133])
@pytest.mark.parametrize("scaling", ["row", "block", "mx"])
def test_transposed_copy_of_rows_not_a_multiple_of_16_takes_cutiles_pass(scaling, rows):
    from tilenorm.dispatch import CUTE_FP8_TRANSPOSE_NAME

    g, _ = fresh_generator("cuda")
    x, w, _ = _inputs(g, rows, 4096, device="cuda")
    with tilenorm.experimental():
        kernels = tilenorm.fp8.explain(x, w, scaling=scaling, transpose=True).kernels
    assert (CUTE_FP8_TRANSPOSE_NAME in kernels) == (rows % 16 == 0), kernels
    out = run_kernels("rms_norm", x, w, None, scaling, transpose=True)
    check_against_float64(out, _reference(x.cpu(), w.cpu(), None, scaling, E4M3, out),
                          scaling, E4M3)


def _with_and_without_ring(field, scaling, cols, x, w, kernel_scaling=None, **kw):
    """The FP8 forward of ``x`` at ``scaling`` with the row kernel's ring in registers, then
    in shared memory (the FP8 settings' ``field`` at the kernel's scaling, ``scaling`` unless
    given, and ``cols``): the two outputs."""
    from tilenorm import dispatch, settings_fp8
    from tilenorm.pytorch import calls

    outs = []
    for ring in ((), (cols,)):
        probe = dataclasses.replace(settings_fp8.SM90_FP8,
                                    **{field: {kernel_scaling or scaling: ring}})
        dispatch.decide_fp8.cache_clear()  # decisions and prepared calls cached by problem
        calls.clear()
        try:
            with tilenorm.experimental(), settings_fp8.measuring(probe):
                d = tilenorm.fp8.explain(x, w, scaling=scaling, **{
                    k: v for k, v in kw.items() if k != "scale"})
                assert d.cute_forward is not None, str(d)
                assert d.cute_forward.shared_ring == bool(ring), str(d)
                outs.append(tilenorm.fp8.rms_norm_forward(x, w, scaling=scaling, **kw))
        finally:
            dispatch.decide_fp8.cache_clear()
            calls.clear()
    return outs


def _same_bits(a, b, seed):
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), seed
    # The scales as int32 words: a 0-d (per-tensor) or strided (per-row) float tensor views
    # only as a type of its own size.
    assert torch.equal(a.scale_inv.view(torch.int32), b.scale_inv.view(torch.int32)), seed
    assert torch.equal(a.rstd, b.rstd), seed
    assert (a.amax is None) == (b.amax is None) and (a.amax is None
                                                      or torch.equal(a.amax, b.amax)), seed


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("group", [16, 128])
@pytest.mark.parametrize("cols", [2048, 4096, 8192, 16384])
def test_fp8_x_ring_in_shared_memory_has_the_register_rings_bits(cols, group):
    """``shared_ring`` (x's bytes and multipliers by cp.async) against the register ring at
    each width's row-scaling entry: q, its scales and rstd bit for bit, on fresh FP8 x of a
    row count that is no multiple of the grid."""
    g, seed = fresh_generator("cuda")
    x, s = _fp8_x(g, 1037, cols, E4M3, group)
    w = 1 + 0.5 * torch.randn(cols, generator=g, device="cuda")
    _same_bits(*_with_and_without_ring("cute_forward_fp8_input_shared_ring", "row", cols, x,
                                       w, x_scale_inv=s, group_size=group), seed)


@gpu
@pytest.mark.skipif(not cute.available(), reason="CuTe DSL not installed")
@pytest.mark.parametrize("scaling", ["row", "block", "mx", "delayed", "amax"])
@pytest.mark.parametrize("cols", [2048, 4096, 8192, 16384])
def test_ring_in_shared_memory_has_the_register_rings_bits(cols, scaling):
    """The same for bf16 x (``cute_forward_shared_ring``), every scaling the row kernel
    takes at each width but where its entry recomputes t (which keeps the register ring)."""
    from tilenorm.settings_fp8 import SM90_FP8

    if cols in SM90_FP8.cute_forward_recompute_t.get(scaling, {}):
        pytest.skip("recompute_t's entry keeps the register ring")
    g, seed = fresh_generator("cuda")
    x = torch.randn(1037, cols, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(cols, generator=g, device="cuda")).to(torch.bfloat16)
    kw = {"scale": torch.tensor([20.0], device="cuda")} if scaling == "delayed" else {}
    # The kernel's amax scaling is the first pass of the per-tensor current scaling.
    public = "tensor" if scaling == "amax" else scaling
    _same_bits(*_with_and_without_ring("cute_forward_shared_ring", public, cols, x, w,
                                       kernel_scaling=scaling, **kw), seed)
