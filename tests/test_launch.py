"""The launch layer: operand layouts, the signatures the lean launch compiles, and (GPU) that
launching from raw pointers runs exactly what cuTile's own launch runs."""

from __future__ import annotations

import pytest
import torch

from tilenorm.launch import cutile
from tilenorm.launch.cutile import NormFeatures
from tilenorm.launch.driver import ArrayLayout, DriverLaunch, signature
from tilenorm.layout import contiguous_strides
from tilenorm.planner import plan_row_norm
from tilenorm.pytorch.calls import DTYPE_NAMES, NormSpec, kernel_view, operand_views, placeholders
from tilenorm.testing import fresh_generator

gpu = pytest.mark.gpu


@pytest.mark.parametrize("shape,strides,disjoint", [
    ((4, 8), (8, 1), True), ((4, 8), (16, 2), True), ((4, 8), (0, 1), False),
    ((4, 8), (4, 1), False), ((1, 8), (0, 1), True), ((3, 1, 5), (5, 0, 1), True)])
def test_layout_knows_when_elements_overlap(shape, strides, disjoint):
    assert ArrayLayout("float32", shape, strides).disjoint is disjoint


@pytest.mark.parametrize("shape,strides,dims,heads,expected", [
    ((6, 40), (40, 1), 1, False, ((6, 1, 40), (40, 0, 1))),
    ((2, 3, 40), (120, 40, 1), 1, False, ((6, 1, 40), (40, 0, 1))),
    ((2, 3, 40), (120, 40, 1), 2, False, ((2, 1, 120), (120, 0, 1))),
    ((2, 3, 40), (240, 80, 1), 2, False, None),  # the trailing two do not fold
    ((5, 4, 16), (192, 16, 1), 1, True, ((5, 4, 16), (192, 16, 1))),  # q of a fused qkv
])
def test_kernel_view_folds_what_strides_allow(shape, strides, dims, heads, expected):
    t = torch.empty_strided(shape, strides)
    assert kernel_view(t, dims, heads) == expected


def _heads_first(b, s, h, d):
    """(B, S, H, D) values in (B, H, S, D) storage: the attention's gradient layout."""
    return torch.empty(b, h, s, d).transpose(1, 2)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("lead,others,shape3,copied", [
    # An h of (B, S, H, D) with a gradient laid out heads first: one factoring for both.
    (torch.empty(1, 32, 8, 64), [_heads_first(1, 32, 8, 64)], (32, 8, 64), []),
    (torch.empty(1, 32, 8, 64), [_heads_first(1, 32, 8, 64), torch.empty(1, 32, 8, 64)],
     (32, 8, 64), []),
    # With a batch the gradient folds into no (rows, heads) view: it is copied.
    (torch.empty(2, 32, 8, 64), [_heads_first(2, 32, 8, 64)], None, [1]),
    (torch.empty(4, 64), [torch.empty(4, 64), None], None, []),
])
def test_operand_views_index_every_operand_alike(per_head, lead, others, shape3, copied):
    """Every operand is read through one (rows, heads, cols) shape; each one's strides in it
    address the element its logical index names (a compiled Qwen3's q/k-norm gradients were
    read through h's factoring once, bench/NOTES.md #44)."""
    spec = NormSpec("rms_norm", False, 1, per_head)
    got_shape3, strides, offsets = operand_views(spec, lead, *others)
    if shape3 is not None:
        assert got_shape3 == shape3
    operands = [lead, *others]
    assert [i for i, (t, st) in enumerate(zip(operands, strides, strict=True))
            if t is not None and st is None] == copied
    for t, st in zip(operands, strides, strict=True):
        if t is None or st is None:
            continue
        values = torch.arange(t.numel(), dtype=torch.float32).view(t.shape)
        laid = torch.empty_strided(t.shape, t.stride()).copy_(values)
        seen = laid.as_strided(got_shape3, st, laid.storage_offset())
        assert torch.equal(seen.reshape(t.shape), values)
    assert len(offsets) == sum(t is not None for t in operands)


def _bound_kernels():
    fwd = plan_row_norm(1000, 1024, itemsize=2, sm_count=132, arch=(9, 0),
                        direction="forward")
    bwd = plan_row_norm(1000, 1024, itemsize=2, sm_count=132, arch=(9, 0),
                        direction="backward")
    return cutile.bind_forward(fwd, NormFeatures()), cutile.bind_reduce(bwd, 1)


def test_signature_keeps_runtime_scalars_and_bakes_constants():
    """eps, offset and 1/N stay fp32 parameters, as in cuTile's own launch; tile sizes and
    feature flags are compile-time constants."""
    from cuda.tile.compilation import ConstantConstraint, ScalarConstraint

    forward, reduce = _bound_kernels()
    x = ArrayLayout("bfloat16", (1000, 1, 1024), (1024, 1024, 1))
    stat = ArrayLayout("float32", (1000, 1), (1, 1))
    ph = ArrayLayout("float32", (1,), (1,))
    sig = signature(forward, (x, ph, ph, ph, x, ph, ph, stat))
    kinds = [type(c) for c in sig.parameters[8:]]
    assert kinds[:3] == [ScalarConstraint] * 3  # eps, offset, 1/N
    assert set(kinds[3:]) == {ConstantConstraint}
    assert sig.symbol.startswith("norm_fwd_single")
    assert signature(reduce, (ArrayLayout("float32", (8, 1, 1024),
                                          contiguous_strides((8, 1, 1024))), ph, ph)
                     ).symbol.startswith("column_sums")


def test_lean_launch_compiles_each_layout_once_on_the_cpu():
    from tilenorm.launch.driver import compiled_cubin

    forward, reduce = _bound_kernels()
    x = ArrayLayout("bfloat16", (1000, 1, 1024), (1024, 1024, 1))
    stat = ArrayLayout("float32", (1000, 1), (1, 1))
    ph = ArrayLayout("float32", (1,), (1,))
    layouts = (x, ph, ArrayLayout("bfloat16", (1, 1, 1024), (1024, 1024, 1)), ph, x, ph, ph,
               stat)
    symbol, cubin = compiled_cubin(forward, layouts, (9, 0))
    assert cubin[:4] == b"\x7fELF" and symbol.encode() in cubin
    assert compiled_cubin(forward, layouts, (9, 0))[1] is cubin, "compiled once"
    assert compiled_cubin(forward, layouts, (10, 0))[1] != cubin


def test_a_weight_offset_is_compiled_into_the_forward_it_prepares():
    """A nonzero offset must reach the kernel as HAS_OFFSET (else the kernel ignores it)."""
    from tilenorm.pytorch import calls, functional
    from tilenorm.pytorch.calls import NormSpec

    x, w = torch.randn(4, 64), torch.randn(64)
    spec = NormSpec("rms_norm", False)
    assert calls.build_forward(spec, x, w, None, None, None, None, True).features.has_offset
    assert not calls.forward_call(spec, x, w, None, None, None, None, False).features.has_offset
    assert calls.forward_call(spec, x, w, None, None, None, None, True).features.has_offset
    prepared = functional._prepared("rms_norm", x, w, None, None, 1e-6, 1.0, None, False,
                                    False, None, None)
    assert prepared.call.features.has_offset and prepared.offset == 1.0


# --- GPU ---------------------------------------------------------------------------------


def _native_and_driver(bound, arrays, scalars):
    """Outputs of cuTile's own launch and of the lean launch on the same inputs."""
    device = torch.device("cuda", torch.cuda.current_device())
    ph = placeholders(device)
    outs = []
    for lean in (False, True):
        tensors = {k: (v.clone() if k in ("y", "rstd") else v) for k, v in arrays.items()}
        stream = torch.cuda.current_stream().cuda_stream
        if lean:
            layouts, fixed, pointers = [], {}, []
            for i, name in enumerate(bound.arrays):
                t = tensors.get(name)
                if t is None:
                    layouts.append(ArrayLayout("float32", (1,), (1,)))
                    fixed[i] = ph[i].data_ptr()
                else:
                    layouts.append(ArrayLayout(DTYPE_NAMES[t.dtype], tuple(t.shape),
                                               t.stride()))
                    pointers.append(t.data_ptr())
            launcher = DriverLaunch(bound, tuple(layouts), torch.cuda.current_device(),
                                    torch.cuda.get_device_capability(),
                                    fixed_arrays=fixed)
            assert launcher.launch(stream, *pointers, *scalars)
        else:
            args = [tensors.get(name, ph[i]) for i, name in enumerate(bound.arrays)]
            bound.launch(stream, *args, *scalars)
        torch.cuda.synchronize()
        outs.append(tensors)
    return outs


@gpu
@pytest.mark.parametrize("m,n", [(1000, 1000), (4096, 4096), (3, 5120), (64, 20000)])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_lean_launch_equals_cutile_launch_bit_for_bit(m, n, layer_norm):
    from cuda.tile.compilation import CallingConvention, KernelSignature

    g, seed = fresh_generator("cuda")
    info = torch.cuda.get_device_properties(0)
    plan = plan_row_norm(m, n, itemsize=2, sm_count=info.multi_processor_count,
                         arch=torch.cuda.get_device_capability(), direction="forward",
                         op="layer_norm" if layer_norm else "rms_norm")
    f = NormFeatures(layer_norm=layer_norm, has_bias=layer_norm)
    bound = cutile.bind_forward(plan, f)
    x = torch.randn(m, 1, n, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, 1, n, generator=g, device="cuda", dtype=torch.float32)
    arrays = dict(x=x, weight=w, y=torch.full_like(x, float("nan")),
                  rstd=torch.full((m, 1), float("nan"), device="cuda"))
    if layer_norm:
        arrays.update(bias=torch.randn_like(w), mean=torch.full((m, 1), float("nan"),
                                                                device="cuda"))
    native, lean = _native_and_driver(bound, arrays, (1e-6, 0.0))
    for name in ("y", "rstd"):
        assert not lean[name].isnan().any(), seed
        assert torch.equal(native[name], lean[name]), (name, seed)
    # The constraints cuTile derives from these tensors are the ones the lean launch compiles.
    ph = placeholders(x.device)
    args = [arrays.get(name, ph[i]) for i, name in enumerate(bound.arrays)]
    jit = KernelSignature.from_kernel_args(bound.kernel, bound.args(*args, 1e-6, 0.0),
                                           CallingConvention.cutile_python_v2())
    layouts = tuple(ArrayLayout(DTYPE_NAMES[t.dtype], tuple(t.shape), t.stride())
                    for t in args)
    assert jit.parameters == signature(bound, layouts).parameters


@gpu
def test_lean_launch_declines_unaligned_storage():
    plan = plan_row_norm(1000, 1024, itemsize=2, sm_count=132, arch=(9, 0),
                         direction="forward")
    forward = cutile.bind_forward(plan, NormFeatures(has_weight=False))
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1000 * 1024 + 8, device="cuda", dtype=torch.bfloat16)
    layouts = (ArrayLayout("bfloat16", (1000, 1, 1024), (1024, 1024, 1)),) + tuple(
        ArrayLayout("float32", (1,), (1,)) for _ in range(3)) + (
        ArrayLayout("bfloat16", (1000, 1, 1024), (1024, 1024, 1)),) + tuple(
        ArrayLayout("float32", (1,), (1,)) for _ in range(2)) + (
        ArrayLayout("float32", (1000, 1), (1, 1)),)
    ph = placeholders(device)
    launcher = DriverLaunch(forward, layouts, torch.cuda.current_device(),
                            torch.cuda.get_device_capability(),
                            fixed_arrays={i: ph[i].data_ptr() for i in (1, 2, 3, 5, 6)})
    y = torch.empty(1000, 1024, device="cuda", dtype=torch.bfloat16)
    rstd = torch.empty(1000, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    assert not launcher.launch(stream, x[1:].data_ptr(), y.data_ptr(), rstd.data_ptr(),
                               1e-6, 0.0)
    assert launcher.launch(stream, x.data_ptr(), y.data_ptr(), rstd.data_ptr(), 1e-6, 0.0)


@gpu
def test_a_thread_that_has_not_touched_cuda_prepares_and_launches():
    """Autograd runs backward on a thread of its own: preparing a new layout there must find
    the device's context (the lean launch loads its kernel into it)."""
    import threading

    import tilenorm

    g, seed = fresh_generator("cuda")
    x = torch.randn(333, 1, 640, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(640, generator=g, device="cuda", dtype=torch.bfloat16)
    out, errors = {}, []

    def work():
        try:
            with tilenorm.experimental():
                out["y"] = tilenorm.rms_norm_forward(x, w)[0]
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    from tilenorm.testing import float64_norm, rel_error

    assert rel_error(out["y"], float64_norm(x, w).y) <= 1e-2, seed
