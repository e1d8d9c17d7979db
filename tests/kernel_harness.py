"""Runs the cuTile normalization kernels at launch level on poisoned outputs and checks every
output against float64: the shared body of the op tests' GPU kernel cases."""

from __future__ import annotations

import dataclasses
import os

import torch

from tests import float64_reference as ref64
from tilenorm.cutile import norm as cutile_norm
from tilenorm.cutile.norm import NormFeatures
from tilenorm.device import device_info
from tilenorm.planner import plan_row_norm

OUT_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
STAT_TOL = 1e-5
DGAMMA_TOL_FP32 = 1e-3


def fresh_generator(device="cpu") -> tuple[torch.Generator, int]:
    """A generator with a fresh random seed (reported on failure): new inputs every check."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device=device).manual_seed(seed), seed


def rel(out, ref) -> float:
    """Relative error; absolute where the exact result is 0 (LayerNorm's dweight at N = 1)."""
    diff = (out.double() - ref).norm()
    return (diff / ref.norm() if ref.norm() > 0 else diff).item()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def plans(rows, heads, cols, itemsize, per_head, max_offset=None):
    info = device_info(torch.cuda.current_device())
    return [plan_row_norm(rows, cols, heads=heads, per_head_weight=per_head, itemsize=itemsize,
                          sm_count=info.sm_count, arch=info.arch, direction=d,
                          max_offset=max_offset) for d in ("forward", "backward")]


def _run(fwd, bwd, f, x, w, b, r, dy, dh, eps, offset, out_dtype, res_dtype):
    m, heads, n = x.shape
    y = poisoned(x.shape, out_dtype)
    h_out = poisoned(x.shape, res_dtype) if r is not None else None
    mean = poisoned((m, heads), torch.float32) if f.layer_norm else None
    rstd = poisoned((m, heads), torch.float32)
    w3 = None if w is None else w.view(1, -1, n)
    b3 = None if b is None else b.view(1, -1, n)
    cutile_norm.forward(fwd, f, x=x, weight=w3, bias=b3, residual=r, y=y, residual_out=h_out,
                        mean=mean, rstd=rstd, eps=eps, offset=offset)
    h = x if r is None else h_out
    dx = poisoned(x.shape, x.dtype)
    dres = poisoned(x.shape, res_dtype) if r is not None and res_dtype != x.dtype else None
    dw = poisoned(w.shape, w.dtype) if w is not None else None
    db = poisoned(b.shape, b.dtype) if b is not None else None
    partial = cutile_norm.partial_buffer(bwd, dw, db, fill=float("nan"))
    cutile_norm.backward(bwd, f, dy=dy, h=h, weight=w3, mean=mean, rstd=rstd, dres_in=dh,
                         dx=dx, dres=dres, partial=partial, dweight=dw, dbias=db,
                         offset=offset)
    outs = {"y": y, "h": h_out, "mean": mean, "rstd": rstd, "dx": dx, "dres": dres,
            "dweight": dw, "dbias": db}
    return {k: v for k, v in outs.items() if v is not None}


def check_kernels(m, heads, n, *, x_dtype=torch.bfloat16, w_dtype=None, layer_norm=False,
                  has_weight=True, per_head=False, has_bias=False, offset=0.0,
                  res_dtype=None, out_dtype=None, eps=1e-6, repeats=1, x=None, tol=None):
    """Forward and backward of one problem: no unwritten (NaN-poisoned) element, ``repeats``
    reruns bit-identical, every output within tolerance of float64 (``tol`` overrides the
    dtype's for y and the gradients). ``x`` may be given as a (m, heads, n) view with any
    strides."""
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
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=out_dtype)
    dh = torch.randn(x.shape, generator=g, device="cuda", dtype=res_dtype) \
        if res_dtype is not None else None
    fwd, bwd = plans(m, heads, n, x_dtype.itemsize, per_head)
    args = (fwd, bwd, f, x, w, b, r, dy, dh, eps, offset, out_dtype, res_dtype)
    outs = _run(*args)
    for name, t in outs.items():
        assert not t.isnan().any(), f"{name} has unwritten (poisoned) elements; seed {seed}"
    for _ in range(repeats):
        again = _run(*args)
        for name, t in outs.items():
            assert torch.equal(t.view(torch.uint8), again[name].view(torch.uint8)), \
                f"{name} differs between runs; seed {seed}"
        del again

    err = {k: ref64.RelError() for k in outs if k not in ("dweight", "dbias")}
    dw64 = db64 = 0
    kw = dict(layer_norm=layer_norm, offset=offset)
    for rows in ref64.row_blocks(m, heads * n):
        rr = None if r is None else r[rows]
        y64, h64, mean64, rstd64 = ref64.norm_fwd(x[rows], w, b, eps, residual=rr, **kw)
        err["y"].add(outs["y"][rows], y64)
        err["rstd"].add(outs["rstd"][rows], rstd64)
        if layer_norm:
            err["mean"].add(outs["mean"][rows], mean64, h64.abs())
        if r is not None:
            err["h"].add(outs["h"][rows], h64)
        dx64, dw_rows, db_rows, scale = ref64.norm_bwd(
            dy[rows], x[rows], w, eps, residual=rr, dh=None if dh is None else dh[rows], **kw)
        # For N = 1 the exact dx of RMSNorm is O(eps) (x_hat = +-1 to within eps): a
        # cancellation fp32 cannot resolve relative to itself, so dx is measured against its
        # terms' scale.
        err["dx"].add(outs["dx"][rows], dx64, scale if n == 1 and dh is None else None)
        if "dres" in outs:
            err["dres"].add(outs["dres"][rows], dx64)
        dw64, db64 = dw64 + dw_rows, db64 + db_rows
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
    fwd, bwd = plans(m, heads, n, 2, per_head)

    def run(fwd_plan, bwd_plan):
        return _run(fwd_plan, bwd_plan, f, x, w, b, None, dy, None, 1e-6, 0.0, x.dtype, None)

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
