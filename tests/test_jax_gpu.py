"""tilenorm.jax's CUDA kernel path (XLA FFI calls of the prepared launches): on the CPU, that
the FFI module builds, its targets register and a call lowered for CUDA holds the custom
calls, under vmap, checkpoint, shard_map and NamedSharding-ed operands too; on the GPU host
(``gpu``), values and gradients against the float64 reference, bit-identical reruns and the
torch side's results on the same inputs. tests/test_jax_kernel_path.py runs the kernel path
under JAX's transformations. Run these modules without tests/test_jax.py, which forces JAX's
CPU backend (the GPU tests then skip)."""

from __future__ import annotations

import os
import re

# Before jax starts a backend: on the GPU host JAX would otherwise take 75% of the GPU's
# memory from the torch tests beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tilenorm.jax as tj  # noqa: E402
from tilenorm import dispatch as kernel_dispatch  # noqa: E402
from tilenorm.device import DeviceInfo  # noqa: E402
from tilenorm.jax import kernels, native, sharding  # noqa: E402
from tilenorm.launch.driver import LaunchRecipe  # noqa: E402
from tilenorm.validation import CUTILE_NORM  # noqa: E402

# --- on the CPU ----------------------------------------------------------------------------


def test_ffi_module_builds_and_registers_its_targets():
    assert native.build().exists()
    native.register_targets()
    before = native.registered_calls()
    recipe = LaunchRecipe(kernel=0, grid=(1, 1, 1), dependent_launch=False, params=bytes(24),
                          param_offsets=(0, 8, 16), arrays=(("x", 0), ("y", 8)),
                          scalars=(("eps", 16),))
    table = {"x": 0, "y": 1}
    first = native.register_call([(recipe, table)], [native.Pointer(0), native.Pointer(1, 16)],
                                 [1e-6, 0.0], operands=1, results=1)
    second = native.register_call([(recipe, table)], [native.Pointer(0), native.Pointer(1)],
                                  [1e-6, 0.0], operands=1, results=1)
    assert second == first + 1 and native.registered_calls() == before + 2
    with pytest.raises(ValueError, match="rejected"):  # a pointer into no buffer
        native.register_call([(recipe, table)], [native.Pointer(0), native.Pointer(5)],
                             [1e-6, 0.0], operands=1, results=1)


def _fake_decision(problem):
    """A kernel decision for a made-up H100, so that a CUDA lowering takes the kernel path
    on a machine without a GPU."""
    device = DeviceInfo(index=0, name="test device", sm_count=132, arch=(9, 0), l2_bytes=1 << 25)
    plans = [kernel_dispatch.plan_row_norm(problem.rows, problem.cols, heads=problem.heads,
                                           per_head_weight=problem.per_head_weight,
                                           itemsize=2, sm_count=132, arch=(9, 0), direction=d,
                                           op=problem.op) for d in ("forward", "backward")]
    return kernel_dispatch.Decision(op=problem.op, reason="test", family=CUTILE_NORM,
                                    forward=plans[0], backward=plans[1], device=device)


def _unlaunchable_recipe(bound, layouts, decision):
    """A recipe with the kernel's array names and no kernel: lowering registers it, nothing
    ever launches it (preparing a real one loads a cubin on the GPU)."""
    names = bound.arrays
    return LaunchRecipe(kernel=0, grid=(1, 1, 1), dependent_launch=False,
                        params=bytes(8 * len(names) + 8),
                        param_offsets=tuple(8 * i for i in range(len(names) + 1)),
                        arrays=tuple((name, 8 * i) for i, name in enumerate(names)),
                        scalars=(("eps", 8 * len(names)),))


@pytest.fixture
def kernel_path_without_gpu(monkeypatch):
    monkeypatch.setattr(kernels, "launch_recipe", _unlaunchable_recipe)
    kernels._forward_recipes.cache_clear()
    kernels._backward_recipes.cache_clear()
    previous = tj.set_kernel_path(kernels.kernel_path(covers=_fake_decision))
    yield
    tj.set_kernel_path(previous)
    kernels._forward_recipes.cache_clear()
    kernels._backward_recipes.cache_clear()


def _lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("layer_norm", [False, True])
def test_call_lowered_for_cuda_holds_the_custom_calls(kernel_path_without_gpu, layer_norm):
    native.register_targets()
    x = jax.ShapeDtypeStruct((2, 3, 136), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((136,), jnp.float32)
    r = jax.ShapeDtypeStruct((2, 3, 136), jnp.bfloat16)

    def loss(x, w, r):
        if layer_norm:
            y, h = tj.layer_norm(x, w, w, residual=r, prenorm=True)
        else:
            y, h = tj.rms_norm(x, w, residual=r, prenorm=True, offset=1.0)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32))

    text = _lowered_for_cuda(jax.grad(loss, (0, 1, 2)), x, w, r)
    assert native.FORWARD_TARGET in text and native.BACKWARD_TARGET in text
    assert "call = " in text
    # The CPU lowering of the same function keeps the reference path.
    cpu = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, w, r).lower(
        lowering_platforms=("cpu",)).as_text()
    assert native.FORWARD_TARGET not in cpu


def test_vmapped_backward_lowers_with_a_weight_gradient_per_example(kernel_path_without_gpu):
    native.register_targets()
    x = jax.ShapeDtypeStruct((4, 5, 64), jnp.float16)
    w = jax.ShapeDtypeStruct((64,), jnp.float16)
    grad = jax.vmap(jax.grad(lambda x, w: jnp.sum(tj.rms_norm(x, w)), (0, 1)), (0, None))
    out = jax.eval_shape(grad, x, w)
    assert out[0].shape == (4, 5, 64) and out[1].shape == (4, 64)
    assert native.BACKWARD_TARGET in _lowered_for_cuda(grad, x, w)


def _one_device_mesh(explicit: bool = False) -> Mesh:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(np.array(jax.devices()[:1]), ("data",), axis_types=(kind,))


def _transformed(transform: str):
    """(function of (x, w, r, dy, dh) returning outputs and gradients, its operands, how
    many forward calls it lowers to) for a prenorm RMSNorm with Gemma's offset under one of
    JAX's transformations."""
    shape = (4, 6, 136)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(shape[-1:], jnp.float32)
    r = jax.ShapeDtypeStruct(shape, jnp.float32)
    args = [x, w, r, x, r]

    def norm(x, w, r):
        return tj.rms_norm(x, w, residual=r, prenorm=True, offset=1.0)

    forwards = 1
    if transform == "checkpoint":
        norm, forwards = jax.checkpoint(norm), 2  # the backward recomputes the forward
    elif transform == "shard_map-helper":
        def norm(x, w, r):  # noqa: F811
            return sharding.rms_norm(x, w, residual=r, prenorm=True, offset=1.0,
                                     mesh=_one_device_mesh(), spec=P("data"))
    elif transform == "shard_map-inside":
        plain = norm

        def norm(x, w, r):  # noqa: F811
            return jax.shard_map(plain, mesh=_one_device_mesh(),
                                 in_specs=(P("data"), P(), P("data")),
                                 out_specs=(P("data"), P("data")))(x, w, r)
    elif transform.startswith("named-sharding"):
        mesh = _one_device_mesh(explicit=transform.endswith("explicit"))
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
            mesh, P("data") if a.ndim == 3 else P())) for a in args]

    def step(x, w, r, dy, dh):
        out, vjp = jax.vjp(norm, x, w, r)
        return out, vjp((dy, dh))

    if transform == "vmap":  # per-example weight gradients
        step = jax.vmap(step, (0, None, 0, 0, 0))
    elif transform == "nested-vmap":
        step = jax.vmap(jax.vmap(step, (0, None, 0, 0, 0)), (0, None, 0, 0, 0))
    return step, args, forwards


@pytest.mark.parametrize("transform", [
    "jit", "vmap", "nested-vmap", "checkpoint", "shard_map-helper", "shard_map-inside",
    "named-sharding", "named-sharding-explicit"])
def test_transformed_calls_lower_to_the_custom_calls(kernel_path_without_gpu, transform):
    """What tests/test_jax_kernel_path.py runs on the GPU, lowered for CUDA here with the FFI
    calls themselves (the emulation there replaces them): shard_map's type checks included."""
    native.register_targets()
    step, args, forwards = _transformed(transform)
    text = _lowered_for_cuda(step, *args)
    assert text.count(f"custom_call @{native.FORWARD_TARGET}(") == forwards
    assert text.count(f"custom_call @{native.BACKWARD_TARGET}(") == 1
    out, grads = jax.eval_shape(step, *args)
    batch = {"vmap": args[0].shape[:1], "nested-vmap": args[0].shape[:2]}.get(transform, ())
    assert grads[1].shape == batch + args[1].shape  # dweight, per example under vmap
    if transform.startswith("shard_map"):  # dweight summed over the devices' rows
        assert re.search(r"psum.*axes=\('data',\)", str(jax.make_jaxpr(step)(*args)))


def test_kernel_path_is_installed_only_with_a_cuda_plugin():
    previous = tj.set_kernel_path(None)
    try:
        kernels.install_default()
        path = tj.kernel_path()
        installed = path is not None and path.forward is kernels.forward
        assert installed == (kernels.has_cuda_plugin() and
                             os.environ.get("TILENORM_NATIVE", "1") != "0")
    finally:
        tj.set_kernel_path(previous)


# --- on the GPU ----------------------------------------------------------------------------


def _cuda_device():
    try:
        return jax.devices("cuda")[0]
    except RuntimeError:
        return None


needs_cuda = pytest.mark.skipif(
    "_cuda_device() is None", reason="JAX has no CUDA backend in this process (test_jax.py "
                                     "forces the CPU one: run this module on its own)")
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
GRAD_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


def _on_gpu(t):
    return jax.device_put(t, _cuda_device())


def _rel(out, ref, scale=None) -> float:
    """:func:`tilenorm.testing.rel_error` of ``out`` (all finite) against ``ref`` (arrays or
    torch tensors), in float64."""
    torch = pytest.importorskip("torch")
    from tilenorm.testing import rel_error

    def t(a):
        if isinstance(a, torch.Tensor):
            return a.detach().double().cpu()
        return torch.from_numpy(np.asarray(a, np.float64))

    out = t(out)
    assert torch.isfinite(out).all()
    return rel_error(out, t(ref), None if scale is None else t(scale))


def _reference64(x, w, b, r, eps, layer_norm, offset, dy, dh):
    """tilenorm.testing.float64_norm on the same values (torch on the CPU)."""
    torch = pytest.importorskip("torch")
    from tilenorm.testing import float64_norm

    def t(a):
        return None if a is None else torch.from_numpy(np.asarray(a, np.float64))

    return float64_norm(t(x), t(w), t(b), eps, layer_norm=layer_norm, offset=offset,
                        residual=t(r), dy=t(dy), dh=t(dh))


CASES = [  # (shape, dtype, layer_norm, residual, per_head, offset)
    ((16, 4096), jnp.bfloat16, False, False, False, 0.0),
    ((3, 7, 1000), jnp.float16, False, True, False, 1.0),
    ((9, 333), jnp.float32, True, False, False, 0.0),
    ((5, 2, 8000), jnp.bfloat16, True, True, False, 0.0),
    ((6, 8, 128), jnp.bfloat16, False, False, True, 0.0),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape,dtype,layer_norm,residual,per_head,offset", CASES)
def test_kernel_path_values_and_gradients(shape, dtype, layer_norm, residual, per_head, offset):
    rng = np.random.default_rng(0)
    cols = shape[-1]
    pshape = shape[-2:] if per_head else (cols,)
    x = _on_gpu(jnp.asarray(rng.standard_normal(shape), dtype))
    r = _on_gpu(jnp.asarray(rng.standard_normal(shape), dtype)) if residual else None
    w = _on_gpu(jnp.asarray(1 + 0.3 * rng.standard_normal(pshape), jnp.float32))
    b = _on_gpu(jnp.asarray(0.1 * rng.standard_normal(pshape), jnp.float32)) \
        if layer_norm else None
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    eps = 1e-5

    def norm(x, w, b, r):
        if layer_norm:
            return tj.layer_norm(x, w, b, eps, residual=r)
        return tj.rms_norm(x, w, eps, residual=r, offset=offset, per_head=per_head)

    assert tj.explain(x, w, r, bias=b, layer_norm=layer_norm, per_head=per_head).uses_kernel
    y, vjp = jax.vjp(jax.jit(norm), x, w, b, r)
    grads = vjp(_on_gpu(dy))
    # float64_norm takes one weight for the last dimension: per head, w broadcast to x's
    # shape, its gradient summed per head below.
    w_ref = np.broadcast_to(np.asarray(w), shape) if per_head else np.asarray(w)
    ref = _reference64(x, w_ref, b, r, eps, layer_norm, offset, dy, None)
    assert _rel(y, ref.y) <= TOL[dtype]
    assert _rel(grads[0], ref.dx) <= GRAD_TOL[dtype]
    dw_ref = np.asarray(ref.dweight)
    if per_head:
        dw_ref = dw_ref.reshape((-1,) + pshape).sum(0)
    assert _rel(grads[1], dw_ref) <= GRAD_TOL[dtype]
    if layer_norm:
        assert _rel(grads[2], ref.dbias) <= GRAD_TOL[dtype]
    if residual:
        assert _rel(grads[3], ref.dresidual) <= GRAD_TOL[dtype]
    # Reruns of the compiled function are bit-identical (fixed-order weight reduction).
    again = vjp(_on_gpu(dy))
    for a, b_ in zip(grads, again, strict=True):
        if a is not None:
            assert np.array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.gpu
@needs_cuda
def test_kernel_path_matches_the_torch_kernels():
    torch = pytest.importorskip("torch")
    import tilenorm.pytorch as tt

    rng = np.random.default_rng(1)
    x64 = rng.standard_normal((64, 2048))
    w64 = 1 + 0.2 * rng.standard_normal(2048)
    dy64 = rng.standard_normal((64, 2048))
    xj, wj = (_on_gpu(jnp.asarray(a, jnp.bfloat16)) for a in (x64, w64))
    y, vjp = jax.vjp(jax.jit(lambda x, w: tj.rms_norm(x, w, 1e-6)), xj, wj)
    dx, dw = vjp(_on_gpu(jnp.asarray(dy64, jnp.bfloat16)))
    xt, wt = (torch.tensor(a, dtype=torch.bfloat16, device="cuda", requires_grad=True)
              for a in (x64, w64))
    yt = tt.rms_norm(xt, wt, 1e-6)
    yt.backward(torch.tensor(dy64, dtype=torch.bfloat16, device="cuda"))

    def same(a, t):
        return np.array_equal(np.asarray(a.astype(jnp.float32)), t.float().cpu().numpy())

    assert same(y, yt.detach()) and same(dx, xt.grad) and same(dw, wt.grad)
