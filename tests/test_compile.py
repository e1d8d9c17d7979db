"""torch.compile in every mode and torch.export, over a model built of tilenorm modules and
ops: forward and backward equal to eager, for row counts that change between calls."""

from __future__ import annotations

import pytest
import torch

import tilenorm
from tilenorm.testing import fresh_generator, rel_error

gpu = pytest.mark.gpu


class Block(torch.nn.Module):
    """RMSNorm module, a fused residual add, per-head QK-norm and a LayerNorm module."""

    def __init__(self, n=64, heads=4, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm = tilenorm.RMSNorm(n, eps=1e-6, **kw)
        self.post = tilenorm.RMSNorm(n, **kw)  # eps=None: torch's rule
        self.q_norm = torch.nn.Parameter(torch.rand(heads, n // heads, **kw) + 0.5)
        self.proj = torch.nn.Linear(n, n, **kw)
        self.out = tilenorm.LayerNorm(n, **kw)
        self.heads = heads

    def forward(self, x, residual):
        y = self.norm(x)
        y, h = tilenorm.rms_norm(self.proj(y), self.post.weight, None, residual=residual,
                                 prenorm=True)
        q = y.unflatten(-1, (self.heads, -1))
        q = tilenorm.rms_norm(q, self.q_norm, per_head=True).flatten(-2)
        return self.out(q) + h


def _run(model, batch, g, device, dtype):
    x = torch.randn(batch, 7, 64, generator=g, device=device).to(dtype).requires_grad_()
    r = torch.randn(batch, 7, 64, generator=g, device=device).to(dtype).requires_grad_()
    out = model(x, r)
    out.backward(torch.randn(out.shape, generator=g, device=device).to(dtype))
    return out, x, r


def check_compiled_matches_eager(device, dtype, tol, **compile_kw):
    g, seed = fresh_generator(device)
    model = Block(device=device, dtype=dtype)
    compiled = torch.compile(model, fullgraph=True, **compile_kw)
    for batch in (3, 5, 11):
        state = g.get_state()
        out, x, r = _run(compiled, batch, g, device, dtype)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        g.set_state(state)
        ref, x_ref, r_ref = _run(model, batch, g, device, dtype)
        for got, want in ((out, ref), (x.grad, x_ref.grad), (r.grad, r_ref.grad),
                          *zip(grads, [p.grad for p in model.parameters()], strict=True)):
            assert rel_error(got, want) <= tol, (batch, seed)
        model.zero_grad()


@pytest.mark.parametrize("dynamic", [True, None])
def test_fullgraph_compile_on_cpu_for_changing_row_counts(dynamic):
    check_compiled_matches_eager("cpu", torch.float32, 1e-5, dynamic=dynamic)


def test_max_autotune_on_cpu():
    check_compiled_matches_eager("cpu", torch.float32, 1e-5, dynamic=True,
                                 mode="max-autotune-no-cudagraphs")


def test_export_keeps_the_custom_ops_and_runs():
    g, _ = fresh_generator()
    model = Block()
    x, r = torch.randn(4, 7, 64, generator=g), torch.randn(4, 7, 64, generator=g)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (x, r), dynamic_shapes=({0: batch}, {0: batch}))
    ops = [n.target for n in program.graph.nodes if "tilenorm" in str(n.target)]
    assert len(ops) == 4, ops
    for rows in (4, 9):
        x, r = torch.randn(rows, 7, 64, generator=g), torch.randn(rows, 7, 64, generator=g)
        torch.testing.assert_close(program.module()(x, r), model(x, r))


def test_compiled_call_still_rejects_bad_eps():
    """Under torch.compile eps may be symbolic when traced: the custom op checks it."""
    x = torch.randn(4, 64)
    for eps in (-1.0, float("nan")):
        with pytest.raises((ValueError, RuntimeError), match="eps"):
            torch.compile(lambda x, e: tilenorm.rms_norm(x, eps=e), fullgraph=True,
                          dynamic=True)(x, eps)
        torch._dynamo.reset()


def _traced_ops(fn, *args, **compile_kw):
    """The call targets of the graph torch.compile traces of ``fn(*args)``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, **compile_kw)(*args)
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("layer_norm", [False, True])
def test_small_norms_are_left_to_inductor_up_to_the_threshold(layer_norm, monkeypatch):
    """A norm whose x is known to fit COMPILED_INDUCTOR_MAX_BYTES when traced is torch
    operations in the graph; a larger one, or one of a symbolic size, is the custom op."""
    from tilenorm import dispatch

    g, _ = fresh_generator()
    x, r = torch.randn(4, 7, 64, generator=g), torch.randn(4, 7, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    if layer_norm:
        def fn(x, r, w):
            return tilenorm.layer_norm(x, w, w, residual=r, prenorm=True)
    else:
        def fn(x, r, w):
            return tilenorm.rms_norm(x, w, offset=1.0, residual=r, prenorm=True)
    x_bytes = x.numel() * x.element_size()
    for limit, dynamic, held in ((x_bytes, None, False), (x_bytes - 1, None, True),
                                 (x_bytes, True, True)):
        monkeypatch.setattr(dispatch, "COMPILED_INDUCTOR_MAX_BYTES", limit)
        ops = _traced_ops(fn, x, r, w, dynamic=dynamic)
        assert ("tilenorm.norm_fwd" in ops) == held, (limit, dynamic, ops)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_small_norm_under_compile_matches_eager_with_bad_scalars_still_rejected(dtype, tol):
    """Left to inductor, forward and backward equal eager mode's, dtypes included (h in the
    residual's dtype, y in x's); a bad eps or an offset without a weight raises as in eager
    mode."""
    g, seed = fresh_generator()

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, r, dy, dh = (rand(3, 5, 64) for _ in range(4))
    w = (torch.rand(64, generator=g) + 0.5).requires_grad_()
    x.requires_grad_(), r.requires_grad_()

    def fn(x, r, w):
        return tilenorm.rms_norm(x, w, 1e-5, offset=0.5, residual=r, prenorm=True)

    assert "tilenorm.norm_fwd" not in _traced_ops(fn, x, r, w)
    results = []
    for call in (torch.compile(fn, fullgraph=True), fn):
        torch._dynamo.reset()
        y, h = call(x, r, w)
        assert (y.dtype, h.dtype) == (dtype, dtype)
        torch.autograd.backward([y, h], [dy, dh])
        results.append([y, h] + [t.grad.clone() for t in (x, r, w)])
        for t in (x, r, w):
            t.grad = None
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype and rel_error(got, want) <= tol, seed
    with pytest.raises((ValueError, RuntimeError), match="eps"):
        torch.compile(lambda x: tilenorm.rms_norm(x, eps=-1.0), fullgraph=True)(x)
    with pytest.raises((ValueError, RuntimeError), match="offset"):
        torch.compile(lambda x: tilenorm.rms_norm(x, offset=1.0), fullgraph=True)(x)


@gpu
@pytest.mark.parametrize("mode,dynamic", [(None, True), ("reduce-overhead", None),
                                          ("max-autotune", None), ("max-autotune", True)])
def test_compile_modes_on_gpu_run_the_kernels(mode, dynamic, compiled_as_custom_ops):
    with tilenorm.experimental():
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
        assert tilenorm.explain(x).uses_kernel
        check_compiled_matches_eager("cuda", torch.bfloat16, 1e-2, mode=mode, dynamic=dynamic)


@gpu
def test_compiled_graphs_run_seen_calls_in_cpp_and_match_the_python_path(
        compiled_as_custom_ops):
    """A compiled graph's tilenorm ops go to the C++ kernels for CUDA tensors: the Python
    implementation runs for the first call of each set of arguments only, and the results are
    the Python implementation's, bit for bit."""
    from tilenorm.pytorch import custom_ops, native

    cpp = native.module()
    assert cpp is not None
    for op in ("tilenorm::norm_fwd", "tilenorm::norm_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    python_calls = []

    def counted(run):
        def fallback(*args):
            python_calls.append(run.__name__)
            return run(*args)
        return fallback

    _, seed = fresh_generator()

    def steps(model):
        g = torch.Generator(device="cuda").manual_seed(seed)
        outs = []
        for _ in range(3):
            out, x, r = _run(model, 5, g, "cuda", torch.bfloat16)
            outs.append([out, x.grad, r.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        return outs

    torch._dynamo.reset()
    model = Block(device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    cpp.set_op_fallbacks(counted(custom_ops.run_forward), counted(custom_ops.run_backward))
    try:
        ours = steps(compiled)
    finally:
        cpp.set_op_fallbacks(custom_ops.run_forward, custom_ops.run_backward)
    # Block makes 4 forward calls and 4 backward calls a step, each with its own arguments.
    assert python_calls.count("run_forward") == 4 and python_calls.count("run_backward") == 4
    torch._dynamo.reset()
    with native.disabled():
        theirs = steps(torch.compile(model, fullgraph=True))
    for step_ours, step_theirs in zip(ours, theirs, strict=True):
        for a, b in zip(step_ours, step_theirs, strict=True):
            assert torch.equal(a, b), seed


@gpu
@pytest.mark.parametrize("layer_norm,residual", [(False, False), (False, True), (True, False)])
def test_ops_differentiate_in_cpp_for_cuda_tensors(layer_norm, residual):
    """For CUDA tensors the ops' autograd is the C++ one (the custom op's Python autograd costs
    host time in every compiled call, bench/NOTES.md #44): a NormOpBackward on every output
    under grad mode, none under no_grad, and gradients of y and h as the float64 reference's."""
    from tilenorm.testing import float64_norm

    g, seed = fresh_generator("cuda")

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype).requires_grad_()

    x, dy, dh = rand(6, 5, 256), rand(6, 5, 256), rand(6, 5, 256)
    w = rand(256, dtype=torch.float32)
    b = rand(256, dtype=torch.float32) if layer_norm else None
    r = rand(6, 5, 256) if residual else None
    args = (x, w, b, r, 1e-5, 0.0, layer_norm, 1, False, None, None)
    with torch.no_grad():
        assert all(t.grad_fn is None for t in torch.ops.tilenorm.norm_fwd(*args))
    y, h, _, _ = outs = torch.ops.tilenorm.norm_fwd(*args)
    assert {t.grad_fn.name() for t in outs} == {"tilenorm::NormOpBackward"}
    torch.autograd.backward([y, h] if residual else [y], [dy, dh] if residual else [dy])
    ref = float64_norm(x, w, b, 1e-5, layer_norm=layer_norm, residual=r, dy=dy,
                       dh=dh if residual else None)
    for got, want in ((y, ref.y), (x.grad, ref.dx), (w.grad, ref.dweight),
                      *(((b.grad, ref.dbias),) if layer_norm else ()),
                      *(((h, ref.h), (r.grad, ref.dresidual)) if residual else ())):
        assert rel_error(got, want) <= 1e-2, seed


@gpu
def test_cuda_graphs_of_compile_from_a_fresh_process():
    """mode="reduce-overhead" (cudagraph trees) when a process's first tilenorm call happens
    inside the compiled region: nothing tilenorm keeps was allocated from the graphs' private
    memory pool, and the results match eager."""
    code = """
import torch, tilenorm
from tilenorm import dispatch
dispatch.COMPILED_INDUCTOR_MAX_BYTES = -1  # the custom ops, however small
from tests.test_compile import Block, _run
from tilenorm.testing import fresh_generator, rel_error
model = Block(device="cuda", dtype=torch.bfloat16)
compiled = torch.compile(model, mode="reduce-overhead")
g, seed = fresh_generator("cuda")
for _ in range(4):
    state = g.get_state()
    out, x, r = _run(compiled, 5, g, "cuda", torch.bfloat16)
    got = [out.clone(), x.grad, r.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    g.set_state(state)
    ref, x, r = _run(model, 5, g, "cuda", torch.bfloat16)
    want = [ref, x.grad, r.grad] + [p.grad for p in model.parameters()]
    model.zero_grad()
    assert all(rel_error(a, b) <= 1e-2 for a, b in zip(got, want, strict=True)), seed
print("ok")
"""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
