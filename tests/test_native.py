"""The C++ host path (tilenorm.pytorch.native): it builds against the installed torch, refuses
what it cannot launch, and (GPU) computes exactly what the Python path computes, through its
own autograd node."""

from __future__ import annotations

import pytest
import torch

import tilenorm
from tests.kernel_harness import H100, H200
from tilenorm.launch.driver import LaunchRecipe
from tilenorm.planner import plan_cute_backward, plan_cute_cluster_backward
from tilenorm.pytorch import calls, functional, native
from tilenorm.testing import fresh_generator

gpu = pytest.mark.gpu


def _module():
    cpp = native.module()
    if cpp is None:
        pytest.fail("the C++ host path did not build (see the warning)")
    return cpp


def _recipe(arrays=(("x", 0), ("y", 8), ("rstd", 16)), scalars=(("eps", 24),)):
    return LaunchRecipe(kernel=1, grid=(1, 1, 1), dependent_launch=False, params=bytes(32),
                        param_offsets=(0, 8, 16, 24), arrays=arrays, scalars=scalars)


def test_builds_and_loads_against_the_installed_torch():
    cpp = _module()
    assert native.library_path().exists()
    assert {"make_forward", "make_backward", "attach_backward", "apply", "forward",
            "backward"} <= set(dir(cpp))


def test_a_recipe_naming_an_operand_no_call_fills_is_refused():
    with pytest.raises(RuntimeError, match="no prepared call fills: gamma"):
        _module().make_forward(_recipe(arrays=(("gamma", 0),)), [4, 8], [4], torch.float32,
                               False, None, True)


def test_unaligned_operands_launch_nothing_and_fall_back():
    """The kernels were compiled for 16-byte aligned operands: the C++ call returns None (the
    caller takes cuTile's own launch) before any launch is attempted."""
    call = _module().make_forward(_recipe(), [4, 8], [4], torch.float32, False, None, True)
    x = torch.empty(33)[1:].view(4, 8)
    assert x.data_ptr() % 16
    assert native.module().forward(call, x, None, None, None, 1e-6, 0.0) is None


def test_a_missing_compiler_means_the_python_path_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("TILENORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    native.module.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"C\+\+ host path is unavailable"):
            assert native.module() is None
    finally:
        native.module.cache_clear()


def test_arguments_the_cache_cannot_key_are_left_to_the_python_path():
    """remember_call refuses arguments of types its key does not encode (the Python path
    checks them and raises its own errors); arguments never seen are a miss."""
    cpp = _module()
    call = cpp.make_forward(_recipe(), [4, 8], [4], torch.float32, False, None, True)
    x = torch.empty(4, 8)
    good = ["rms_norm", x, None, None, 1e-6, (8,), False, 0.0, None, False, None, None]
    bad = {4: True, 5: (8.0,), 6: 1, 8: [x], 11: "bfloat16", 1: x.numpy()}
    for i, value in bad.items():
        args = list(good)
        args[i] = value
        assert not cpp.remember_call(*args, call, 1e-6, 0.0), i
        assert cpp.cached_call(*args) is None
    assert cpp.cached_call(*good) is None
    assert cpp.remember_call(*good, call, 1e-6, 0.0)
    cpp.forget_calls()


def test_disabled_gives_the_python_path():
    with native.disabled():
        assert native.module() is None
    assert native.module() is not None


# --- GPU ---------------------------------------------------------------------------------

#: Each case's backward is cuTile's, the C++ node's (a CuTe DSL backward takes the Python
#: path): "wide" is a width of two row pieces with no CuTe entry; the others' width is
#: :data:`WIDTH`, which neither device class routes to a CuTe DSL backward (the H200's
#: RMSNorm takes the CuTe row backward at 1024).
WIDTH = 2048
CASES = {
    "rms": dict(op="rms"),
    "rms offset, fp32 weight": dict(op="rms", offset=1.0, w_dtype=torch.float32),
    "rms residual": dict(op="rms", residual=torch.bfloat16),
    "rms fp32 residual stream": dict(op="rms", residual=torch.float32),
    "rms per head": dict(op="rms", per_head=True),
    "layer norm": dict(op="ln"),
    "layer norm residual": dict(op="ln", residual=torch.bfloat16),
    "rms fp16 wide": dict(op="rms", dtype=torch.float16, n=10240),
}


@pytest.mark.parametrize("device", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_case_backward_is_cutiles(case, device):
    """The GPU cases' premise, checked without one: no CuTe DSL backward (row or cluster)
    is tabled for their shapes on either device, so a table entry that would move one to
    the Python path fails here rather than on the GPU (#107)."""
    spec = CASES[case]
    rows, heads, cols = (120, 8, 128) if spec.get("per_head") else (291, 1, spec.get("n", WIDTH))
    op = {"rms": "rms_norm", "ln": "layer_norm"}[spec["op"]]
    shape = dict(itemsize=2, arch=device.arch, device_class=device.device_class, op=op,
                 heads=heads)
    assert plan_cute_cluster_backward(rows, cols, resident_clusters=lambda *_: 1,
                                      **shape) is None
    assert plan_cute_backward(rows, cols, sm_count=device.sm_count, **shape) is None


def _run(case, g, grads_of_h: bool):
    dtype = case.get("dtype", torch.bfloat16)
    n = case.get("n", WIDTH)
    shape = (3, 40, 8, 128) if case.get("per_head") else (3, 97, n)
    x = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    w_shape = shape[-2:] if case.get("per_head") else shape[-1:]
    w = torch.randn(w_shape, generator=g, device="cuda",
                    dtype=case.get("w_dtype", dtype))
    b = torch.randn(shape[-1], generator=g, device="cuda", dtype=dtype) \
        if case["op"] == "ln" else None
    r = torch.randn(shape, generator=g, device="cuda", dtype=case["residual"]) \
        if "residual" in case else None
    dy = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    dh = torch.randn(shape, generator=g, device="cuda", dtype=case["residual"]) \
        if r is not None and grads_of_h else None
    return x, w, b, r, dy, dh


def _step(case, x, w, b, r, dy, dh):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (x, w, b, r)]
    xl, wl, bl, rl = leaves
    if case["op"] == "ln":
        out = tilenorm.layer_norm(xl, wl, bl, residual=rl, prenorm=rl is not None)
    else:
        out = tilenorm.rms_norm(xl, wl, offset=case.get("offset", 0.0),
                                per_head=case.get("per_head", False), residual=rl,
                                prenorm=rl is not None)
    y, h = out if rl is not None else (out, None)
    outputs, grads = [y], [dy]
    if dh is not None:
        outputs.append(h)
        grads.append(dh)
    torch.autograd.backward(outputs, grads)
    return [y] + ([h] if h is not None else []) + [t.grad for t in leaves if t is not None]


@gpu
@pytest.mark.parametrize("grads_of_h", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_cpp_path_equals_the_python_path_bit_for_bit(case, grads_of_h):
    spec = CASES[case]
    if grads_of_h and "residual" not in spec:
        pytest.skip("h is x")
    g, seed = fresh_generator("cuda")
    operands = _run(spec, g, grads_of_h)
    calls.clear()
    ours = _step(spec, *operands)
    prepared = [p for p in calls._CALLS.values() if isinstance(p, functional._Prepared)]
    assert prepared and all(p.call.native_backward for p in prepared), \
        "the C++ autograd node ran"
    with native.disabled():
        theirs = _step(spec, *operands)
    for a, b in zip(ours, theirs, strict=True):
        assert not a.isnan().any(), seed
        assert torch.equal(a, b), seed


@gpu
def test_cpp_path_runs_its_own_node_and_frees_the_graph():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = tilenorm.rms_norm(x, w)
    assert y.grad_fn.name() == "tilenorm::NormBackward"
    y.backward(torch.randn_like(y))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(torch.randn_like(y))


@gpu
def test_arguments_seen_before_skip_the_python_path(monkeypatch):
    """The second call with the same arguments (with and without autograd, with a residual)
    goes from the C++ cache to the kernels: the Python preparation is not reached, and the
    result is the first call's."""
    g, seed = fresh_generator("cuda")
    x = torch.randn(64, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, generator=g, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    calls.clear()
    cases = [lambda: tilenorm.rms_norm(x, w), lambda: tilenorm.rms_norm(xg, wg),
             lambda: tilenorm.rms_norm(xg, wg, residual=r, prenorm=True),
             lambda: tilenorm.layer_norm(x, w, w)]
    first = [f() for f in cases]
    first += [f() for f in cases[1:3]]  # the backward is attached on a call with autograd

    def not_again(*args):
        raise AssertionError("prepared again")

    monkeypatch.setattr(functional, "_prepared", not_again)
    for f, a in zip(cases, first, strict=False):
        b = f()
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                        strict=True):
            assert torch.equal(u, v), seed
    assert tilenorm.rms_norm(xg, wg).grad_fn.name() == "tilenorm::NormBackward"


@gpu
def test_the_call_cache_tells_apart_every_argument_and_autocast(monkeypatch):
    """Each argument that changes what runs misses the C++ cache (the Python path prepares
    again) and gives what the Python path alone gives."""
    g, seed = fresh_generator("cuda")
    x = torch.randn(8, 16, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, generator=g, device="cuda", dtype=torch.bfloat16)
    base = dict(eps=1e-6)
    variants = [dict(eps=1e-5), dict(eps=None), dict(offset=1.0), dict(out_dtype=torch.float32),
                dict(normalized_shape=256),
                dict(residual=torch.randn_like(x)), dict(residual=torch.randn_like(x),
                                                         prenorm=True),
                dict(residual=torch.randn_like(x), residual_dtype=torch.float32)]
    variants += [dict(base, autocast=True), dict(base, transposed=True)]

    def run(v):
        v = dict(v)
        xv = x.transpose(0, 1) if v.pop("transposed", False) else x
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=v.pop("autocast", False)):
            out = tilenorm.rms_norm(xv, w, **v)
        return out if isinstance(out, tuple) else (out,)

    with native.disabled():
        theirs = [run(v) for v in variants]
    calls.clear()
    run(base)
    prepared = []
    real = functional._prepared

    def counting(*args):
        prepared.append(args)
        return real(*args)

    monkeypatch.setattr(functional, "_prepared", counting)
    run(base)
    assert not prepared, "the same arguments again: a hit"
    for v, expected in zip(variants, theirs, strict=True):
        before = len(prepared)
        ours = run(v)
        assert len(prepared) == before + 1, v
        for a, b in zip(ours, expected, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (v, seed)
    before = len(prepared)
    with tilenorm.experimental(not tilenorm.experimental_enabled()):
        tilenorm.rms_norm(x, w, **base)
    assert len(prepared) == before + 1


@gpu
def test_cpp_path_rejects_an_input_modified_in_place_after_the_forward():
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    h = x * 1
    y = tilenorm.rms_norm(h, w)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@gpu
def test_cpp_path_takes_gradients_of_any_layout():
    """A gradient that is not dense (a broadcast from sum(), a transposed view) is read
    through a dense copy: the same result as a dense gradient of the same values."""
    g, seed = fresh_generator("cuda")
    x = torch.randn(128, 512, generator=g, device="cuda", requires_grad=True)
    w = torch.randn(512, generator=g, device="cuda", requires_grad=True)
    tilenorm.rms_norm(x, w).sum().backward()
    expanded = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    tilenorm.rms_norm(x, w).backward(torch.ones(128, 512, device="cuda"))
    assert torch.equal(expanded[0], x.grad) and torch.equal(expanded[1], w.grad), seed
    dy = torch.randn(512, 128, generator=g, device="cuda")
    x.grad = w.grad = None
    tilenorm.rms_norm(x, w).backward(dy.t())
    transposed = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    tilenorm.rms_norm(x, w).backward(dy.t().contiguous())
    assert torch.equal(transposed[0], x.grad) and torch.equal(transposed[1], w.grad), seed


def test_layout_key_tells_apart_what_the_python_key_tells_apart():
    key = _module().layout_key
    x = torch.empty(4, 8)
    same = [torch.empty(4, 8), torch.empty(4, 8)]
    assert key(same[0], None) == key(same[1], None) == key(x, None)
    others = [x.t(), x.to(torch.bfloat16), torch.empty(8, 4), torch.empty(2, 4, 4),
              torch.empty(4, 16)[:, :8], torch.empty(4, 8, device="meta")]
    keys = {key(t, None) for t in others} | {key(x, None), key(x), key(x, x), key(None, x)}
    assert len(keys) == len(others) + 4
    with pytest.raises(TypeError):
        key(x, 3)
