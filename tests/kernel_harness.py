"""Runs the cuTile normalization kernels at launch level on poisoned outputs and checks every
output against the float64 reference: the shared body of the op tests' GPU kernel cases.

Kernels launch the way the ops launch them, from raw pointers through the lean driver path
(:class:`tilenorm.launch.driver.DriverLaunch`), with the plans the planner gives (or the
variants a test asks for)."""

from __future__ import annotations

import dataclasses

import torch

from tilenorm.device import DeviceInfo, device_info
from tilenorm.launch import cutile
from tilenorm.launch.cutile import BoundKernel, NormFeatures
from tilenorm.planner import plan_row_norm
from tilenorm.pytorch.calls import tensor_launcher
from tilenorm.settings import H100_PEAK_BANDWIDTH
from tilenorm.testing import RelError, float64_norm, fresh_generator, rel_error, row_blocks

#: Shared memory of an SM (sm_90, sm_100: 228 KiB), and what sm_90 reserves a CTA.
SMEM_PER_SM, SMEM_RESERVED = 233472, 1024
OUT_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
STAT_TOL = 1e-5
DGAMMA_TOL_FP32 = 1e-3
rel = rel_error
#: A peak DRAM bandwidth of each device class (tilenorm.settings.device_class), bytes a
#: second: the H100 SXM's, the H200's datasheet's 4.8 TB/s.
BANDWIDTH = {"h100": H100_PEAK_BANDWIDTH, "h200": 4800 * 10**9}
#: An H100's and an H200's properties, for deciding without one (the decisions need only
#: these).
H100 = DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, arch=(9, 0),
                  l2_bytes=50 << 20, memory_bandwidth=BANDWIDTH["h100"])
H200 = DeviceInfo(index=0, name="NVIDIA H200", sm_count=132, arch=(9, 0), l2_bytes=60 << 20,
                  memory_bandwidth=BANDWIDTH["h200"])


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def check_graph_replay_matches_eager(run) -> None:
    """``run()`` (launches on torch's current stream, returns a tuple of tensors or None) run
    eagerly, then captured in a CUDA graph (after a warm-up on a side stream) whose outputs
    are poisoned before the replay (all but a tensor both runs return, an input passed
    through): the replay's outputs equal the eager ones bit for bit."""
    eager = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for t, first in zip(captured, eager, strict=True):
        if t is not None and t is not first:
            t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


def plans(rows, heads, cols, itemsize, per_head, max_offset=None, op="rms_norm"):
    info = device_info(torch.cuda.current_device())
    return [plan_row_norm(rows, cols, heads=heads, per_head_weight=per_head, itemsize=itemsize,
                          sm_count=info.sm_count, arch=info.arch, direction=d,
                          max_offset=max_offset, op=op) for d in ("forward", "backward")]


def launch(bound: BoundKernel, arrays: dict[str, torch.Tensor], *scalars: float) -> None:
    """Launch ``bound`` on the current stream from the pointers of ``arrays`` (by name; the
    kernel's other arrays get placeholders), as the ops do."""
    tensor_launcher(bound, arrays)(*scalars)


def _run(fwd, bwd, f, x, w, b, r, dys, dh, eps, offset, out_dtype, res_dtype):
    m, heads, n = x.shape
    y = poisoned(x.shape, out_dtype)
    h_out = poisoned(x.shape, res_dtype) if r is not None else None
    mean = poisoned((m, heads), torch.float32) if f.layer_norm else None
    rstd = poisoned((m, heads), torch.float32)
    w3 = None if w is None else w.view(1, -1, n)
    b3 = None if b is None else b.view(1, -1, n)
    launch(cutile.bind_forward(fwd, f), dict(x=x, residual=r, weight=w3, bias=b3, y=y,
                                             residual_out=h_out, mean=mean, rstd=rstd),
           eps, offset)
    h = x if r is None else h_out
    dx = poisoned(x.shape, x.dtype)
    split = r is not None and res_dtype != x.dtype
    dres = poisoned(x.shape, res_dtype) if split else None
    dw = poisoned(w.shape, w.dtype) if w is not None else None
    db = poisoned(b.shape, b.dtype) if b is not None else None
    groups = (w is not None) + (b is not None)
    kernel = cutile.bind_backward(bwd, f, dh is not None, split, dy_terms=len(dys))
    buffer = cutile.PartialBuffer.of(bwd, groups)
    partial = poisoned(buffer.shape, torch.float32) if groups else None
    operands = dict(zip(("dy", "dy2", "dy3"), dys, strict=False))
    operands.update(h=h, weight=w3, mean=mean, rstd=rstd, dres_in=dh, dx=dx, dres=dres)
    if groups:
        parts = [partial.as_strided(*buffer.group(), g * buffer.group_size)
                 for g in range(groups)]
        operands.update(partial_w=parts[0] if w is not None else None,
                        partial_b=parts[-1] if b is not None else None)
    if kernel.first is not None:
        operands["row_sums"] = torch.empty((m, heads) + kernel.workspace, dtype=torch.float32,
                                           device="cuda")
        launch(kernel.first, operands, offset)
    launch(kernel, operands, offset)
    if groups:
        outs = [t.view(-1) for t in (dw, db) if t is not None]
        launch(cutile.bind_reduce(bwd, groups),
               dict(partial=partial.as_strided(*buffer.reduced()), out_a=outs[0],
                    out_b=outs[1] if groups == 2 else None))
    outs = {"y": y, "h": h_out, "mean": mean, "rstd": rstd, "dx": dx, "dres": dres,
            "dweight": dw, "dbias": db}
    return {k: v for k, v in outs.items() if v is not None}


def check_kernels(m, heads, n, *, x_dtype=torch.bfloat16, w_dtype=None, layer_norm=False,
                  has_weight=True, per_head=False, has_bias=False, offset=0.0,
                  res_dtype=None, out_dtype=None, eps=1e-6, repeats=1, x=None, tol=None,
                  dy_terms=1):
    """Forward and backward of one problem: no unwritten (NaN-poisoned) element, ``repeats``
    reruns bit-identical, every output within tolerance of float64 (``tol`` overrides the
    dtype's for y and the gradients). ``x`` may be given as a (m, heads, n) view with any
    strides. y's gradient comes as ``dy_terms`` arrays that the backward adds up."""
    g, seed = fresh_generator("cuda")
    w_dtype = w_dtype or x_dtype
    out_dtype = out_dtype or x_dtype
    f = NormFeatures(layer_norm=layer_norm, has_weight=has_weight, per_head_weight=per_head,
                     has_bias=has_bias, has_residual=res_dtype is not None,
                     has_offset=offset != 0.0)
    if x is None:
        x = torch.randn(m, heads, n, generator=g, device="cuda", dtype=x_dtype)
        if layer_norm:  # a mean far from 0 exercises the centered variance
            x += 3.0
    pshape = (heads, n) if per_head else (n,)
    w = (1 + 0.5 * torch.randn(pshape, generator=g, device="cuda")).to(w_dtype) \
        if has_weight else None
    b = (0.5 * torch.randn(pshape, generator=g, device="cuda")).to(w_dtype) \
        if has_bias else None
    r = torch.randn(x.shape, generator=g, device="cuda", dtype=res_dtype) \
        if res_dtype is not None else None
    dys = [torch.randn(x.shape, generator=g, device="cuda", dtype=out_dtype)
           for _ in range(dy_terms)]
    dy = sum(t.double() for t in dys)
    dh = torch.randn(x.shape, generator=g, device="cuda", dtype=res_dtype) \
        if res_dtype is not None else None
    fwd, bwd = plans(m, heads, n, x_dtype.itemsize, per_head,
                     op="layer_norm" if layer_norm else "rms_norm")
    args = (fwd, bwd, f, x, w, b, r, dys, dh, eps, offset, out_dtype, res_dtype)
    outs = _run(*args)
    for name, t in outs.items():
        assert not t.isnan().any(), f"{name} has unwritten (poisoned) elements; seed {seed}"
    for _ in range(repeats):
        again = _run(*args)
        for name, t in outs.items():
            assert torch.equal(t.view(torch.uint8), again[name].view(torch.uint8)), \
                f"{name} differs between runs; seed {seed}"
        del again

    err = {k: RelError() for k in outs if k not in ("dweight", "dbias")}
    dw64 = db64 = 0
    for rows in row_blocks(m, heads * n):
        rr = None if r is None else r[rows]
        ref = float64_norm(x[rows], w, b, eps, layer_norm=layer_norm, offset=offset,
                           residual=rr, dy=dy[rows], dh=None if dh is None else dh[rows])
        err["y"].add(outs["y"][rows], ref.y)
        err["rstd"].add(outs["rstd"][rows], ref.rstd)
        if layer_norm:
            err["mean"].add(outs["mean"][rows], ref.mean, ref.h.abs())
        if r is not None:
            err["h"].add(outs["h"][rows], ref.h)
        # For N = 1 the exact dx of RMSNorm is O(eps) (x_hat = +-1 to within eps): a
        # cancellation fp32 cannot resolve relative to itself, so dx is measured against
        # the scale of its terms, |w dy rstd|.
        scale = None
        if n == 1 and dh is None:
            scale = dy[rows].double() * (1.0 if w is None else (w.double() + offset)) \
                * ref.rstd.unsqueeze(-1)
        err["dx"].add(outs["dx"][rows], ref.dx, scale)
        if "dres" in outs:
            err["dres"].add(outs["dres"][rows], ref.dx)
        dw64 = dw64 + (0 if ref.dweight is None else ref.dweight)
        db64 = db64 + (0 if ref.dbias is None else ref.dbias)
    tol = tol or max(OUT_TOL[x_dtype], OUT_TOL[out_dtype], OUT_TOL.get(res_dtype, 0))
    # A bf16/fp16 residual stream rounds h, which the statistics then describe.
    stat_tol = max(STAT_TOL, OUT_TOL.get(res_dtype, 0))
    limits = {"y": tol, "h": tol, "mean": stat_tol, "rstd": stat_tol, "dx": tol, "dres": tol}
    errors = {k: e.value for k, e in err.items()}
    # bf16/fp16 weights hold dgamma rounded to their dtype; fp32 ones get it to 1e-3.
    param_tol = DGAMMA_TOL_FP32 if w_dtype == torch.float32 else OUT_TOL[w_dtype]
    if has_weight:
        errors["dweight"], limits["dweight"] = rel(outs["dweight"], dw64), param_tol
    if has_bias:
        errors["dbias"], limits["dbias"] = rel(outs["dbias"], db64), param_tol
    failed = {k: v for k, v in errors.items() if not v <= limits[k]}
    del outs
    torch.cuda.empty_cache()  # large cases share the GPU with other test workers
    assert not failed, f"relative errors {failed} over {limits}; seed {seed}; plans " \
                       f"{fwd.describe()} / {bwd.describe()}"
    return fwd, bwd


def _ordinary(plan):
    return dataclasses.replace(plan, dependent_launch=False, dependent_reduce=False)


def check_launch_modes_agree(m, heads, n, *, layer_norm=False, per_head=False, chain=3):
    """The planned launches (programmatic dependents on Hopper) give bit for bit what ordinary
    launches give on the same inputs: run once, ``chain`` times back to back without a sync,
    and replayed from a CUDA graph. Returns the plans."""
    g, seed = fresh_generator("cuda")
    f = NormFeatures(layer_norm=layer_norm, has_weight=True, per_head_weight=per_head,
                     has_bias=layer_norm, has_residual=False, has_offset=False)
    x = torch.randn(m, heads, n, generator=g, device="cuda", dtype=torch.bfloat16)
    pshape = (heads, n) if per_head else (n,)
    w = (1 + 0.5 * torch.randn(pshape, generator=g, device="cuda")).to(torch.bfloat16)
    b = (0.5 * torch.randn(pshape, generator=g, device="cuda")).to(torch.bfloat16) \
        if layer_norm else None
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    fwd, bwd = plans(m, heads, n, 2, per_head, op="layer_norm" if layer_norm else "rms_norm")

    def run(fwd_plan, bwd_plan):
        return _run(fwd_plan, bwd_plan, f, x, w, b, None, [dy], None, 1e-6, 0.0, x.dtype, None)

    expected = run(_ordinary(fwd), _ordinary(bwd))
    results = [run(fwd, bwd) for _ in range(chain)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(fwd, bwd)  # compiles and loads every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(fwd, bwd)
    for _ in range(2):
        graph.replay()
        results.append({k: v.clone() for k, v in captured.items()})
    for i, outs in enumerate(results):
        for name, t in expected.items():
            assert torch.equal(t.view(torch.uint8), outs[name].view(torch.uint8)), \
                f"{name} of run {i} differs from the ordinary launch; seed {seed}; plans " \
                f"{fwd.describe()} / {bwd.describe()}"
    return fwd, bwd
