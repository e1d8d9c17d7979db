"""Benchmark of the ops beyond plain RMSNorm, beside every peer that has the same op, in one
process:

    layer_norm          LayerNorm with fp32 weight and bias (Quack requires fp32 parameters)
    rms_norm_offset     Gemma's RMSNorm, y = x_hat * (1 + w)
    rms_norm_residual   fused residual add: h = x + r, y = RMSNorm(h), returns (y, h); the
                        backward takes dy and dh and returns dx (= dresidual) and dweight
    rms_norm_per_head   QK-norm: x of shape (M, H, D) = (M, 32, N / 32), weight (D,)

    python bench/bench_norm_ops.py                          # every op at 32768 x 4096, bf16
    python bench/bench_norm_ops.py --ops layer_norm --shapes 32768x4096,8192x8192

Same measurements and record as bench_rms_norm.py (rows carry ``op``); a provider without a
backward for an op is timed for its forward only (bwd_gbps null).

``--variants`` compares launch settings instead of providers: a JSON list of objects of
:class:`tilenorm.settings.RowNormSettings` fields replacing the device's own (width keys as
strings, tuples as lists), each timed through tilenorm's ops (provider ``tilenorm v<i>``,
its plan in the row), e.g. the cluster backward's entry for LayerNorm at 131072::

    python bench/bench_norm_ops.py --ops layer_norm --shapes 1024x131072 --experimental \
        --variants '[{}, {"cute_cluster_backward": {"layer_norm": {"131072": [8, 512, 2, 1]}}}]'

A table field replaced this way is replaced whole (every op and width of it), so a variant
names every entry the measured shapes need. ``--ops rms_norm`` (plain RMSNorm) serves the
variants of RMSNorm's own entries.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from tilenorm.pytorch import reference  # noqa: E402

EPS = 1e-6
HEADS = 32


@dataclass
class Problem:
    """One op's inputs at one shape; x is (M, N), or (M, H, N / H) per head."""

    op: str
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    b: torch.Tensor | None = None
    r: torch.Tensor | None = None
    dh: torch.Tensor | None = None

    @property
    def offset(self) -> float:
        return 1.0 if self.op == "rms_norm_offset" else 0.0

    @property
    def rows2d(self) -> torch.Tensor:
        return self.x.view(-1, self.x.shape[-1])


def make_problem(op: str, m: int, n: int, dtype: torch.dtype) -> Problem:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)

    def randn(*shape, dt=dtype, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device="cuda")).to(dt)

    shape = (m, HEADS, n // HEADS) if op == "rms_norm_per_head" else (m, n)
    d = shape[-1]
    if op == "layer_norm":
        return Problem(op, randn(*shape), randn(d, dt=torch.float32, scale=0.5, shift=1),
                       randn(*shape), b=randn(d, dt=torch.float32, scale=0.5))
    p = Problem(op, randn(*shape), randn(d, scale=0.5, shift=0 if op.endswith("offset") else 1),
                randn(*shape))
    if op == "rms_norm_residual":
        p.r, p.dh = randn(*shape), randn(*shape)
    return p


def bytes_moved(p: Problem) -> tuple[int, int]:
    """(forward, backward) bytes that must move, from each op's inputs and outputs."""
    mn, rows = p.x.numel() * p.x.element_size(), p.x.numel() // p.x.shape[-1]
    params = p.w.numel() * p.w.element_size() * (2 if p.b is not None else 1)
    stats = 4 * rows * (2 if p.op == "layer_norm" else 1)
    if p.op == "rms_norm_residual":  # fwd: x, r -> y, h; bwd: dy, dh, h -> dx (= dresidual)
        return 4 * mn + params + stats, 4 * mn + 2 * params + stats
    return 2 * mn + params + stats, 3 * mn + 2 * params + stats


def _eps(p: Problem) -> float:
    return 1e-5 if p.op == "layer_norm" else EPS


# --- providers: prepare(problem) -> Prepared, or raise NotImplementedError --------------------


def tilenorm_provider(p: Problem) -> common.Prepared:
    import tilenorm

    if p.op == "layer_norm":
        _, _, mean, rstd = tilenorm.layer_norm_forward(p.x, p.w, p.b, _eps(p))

        def fwd():
            return tilenorm.layer_norm_forward(p.x, p.w, p.b, _eps(p))

        def bwd():
            return tilenorm.layer_norm_backward(p.dy, p.x, p.w, p.b, mean, rstd)

        return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))
    kw = dict(offset=p.offset, residual=p.r)
    _, h, rstd = tilenorm.rms_norm_forward(p.x, p.w, EPS, **kw)
    back = dict(offset=p.offset, dh=p.dh, x_dtype=p.x.dtype,
                residual_dtype=None if p.r is None else p.r.dtype)

    def fwd():
        return tilenorm.rms_norm_forward(p.x, p.w, EPS, **kw)

    def bwd():
        return tilenorm.rms_norm_backward(p.dy, h, p.w, rstd, **back)

    return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))


def quack_provider(p: Problem) -> common.Prepared:
    from quack.rmsnorm import layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd

    if p.op == "layer_norm":
        _, rstd, mean = layernorm_fwd(p.x, p.w, p.b, _eps(p), return_rstd=True,
                                      return_mean=True)

        def fwd():
            return layernorm_fwd(p.x, p.w, p.b, _eps(p), return_rstd=True, return_mean=True)

        def bwd():
            return layernorm_bwd(p.x, p.w, p.dy, rstd, mean, has_bias=True)

        return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))
    x, dy = p.rows2d, p.dy.view(-1, p.x.shape[-1])
    r = None if p.r is None else p.r.view_as(x)
    dh = None if p.dh is None else p.dh.view_as(x)
    kw = dict(residual=r, eps=EPS, store_rstd=True, weight_offset=p.offset)
    _, h, rstd = rmsnorm_fwd(x, p.w, **kw)

    def fwd():
        return rmsnorm_fwd(x, p.w, **kw)

    def bwd():
        return rmsnorm_bwd(h, p.w, dy, rstd, dresidual_out=dh, has_residual=r is not None,
                           weight_offset=p.offset)

    return common.Prepared(fwd, bwd, lambda: (fwd()[0].view_as(p.x), bwd()[0].view_as(p.x)))


def liger_provider(p: Problem) -> common.Prepared:
    if p.op == "layer_norm":
        from liger_kernel.ops.layer_norm import layer_norm_backward, layer_norm_forward

        _, _, mean, rstd, _, _ = layer_norm_forward(p.x, p.w, p.b, _eps(p))

        def fwd():
            return layer_norm_forward(p.x, p.w, p.b, _eps(p))

        def bwd():
            return layer_norm_backward(p.dy, p.x, p.w, p.b, mean, rstd)

        return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))
    if p.op == "rms_norm_residual":
        from liger_kernel.ops.fused_add_rms_norm import (
            fused_add_rms_norm_backward,
            fused_add_rms_norm_forward,
        )

        _, s, rstd, block, warps, stages, casting = fused_add_rms_norm_forward(
            p.x, p.r, p.w, EPS, 0.0, "llama")

        def fwd():
            return fused_add_rms_norm_forward(p.x, p.r, p.w, EPS, 0.0, "llama")

        def bwd():
            return fused_add_rms_norm_backward(p.dy, p.dh, s, p.w, rstd, 0.0, casting, block,
                                               warps, stages, False)

        return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))
    from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward

    casting = "gemma" if p.op == "rms_norm_offset" else "llama"
    _, x2d, rstd, block, warps, casting_id = rms_norm_forward(p.x, p.w, EPS, p.offset, casting,
                                                              None)

    def fwd():
        return rms_norm_forward(p.x, p.w, EPS, p.offset, casting, None)

    def bwd():
        return rms_norm_backward(p.dy, x2d, p.w, rstd, p.offset, casting_id, block, warps,
                                 False, None)

    return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0].view_as(p.x)))


def tilegym_provider(p: Problem) -> common.Prepared:
    if p.op != "layer_norm":
        raise NotImplementedError(f"TileGym has no {p.op} with a backward")
    from tilegym.ops.cutile.layer_norm import layer_norm

    def fwd():
        return layer_norm(p.x, 1, 2, p.w, p.b, _eps(p))

    return common.Prepared(fwd, None, lambda: (fwd(), None))  # TileGym's backward raises


def _reference_pair(p: Problem):
    layer_norm = p.op == "layer_norm"

    def fwd(x, w, b, r):
        y, h, mean, rstd = reference.norm_forward(x, w, b, _eps(p), layer_norm=layer_norm,
                                                  offset=p.offset, residual=r)
        return y, h, mean, rstd

    def bwd(dy, dh, h, w, b, mean, rstd):
        return reference.norm_backward(dy, dh, h, w, b, mean, rstd, offset=p.offset)

    return fwd, bwd


def torch_compile_provider(p: Problem) -> common.Prepared:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.recompile_limit = 1024
    fwd_fn, bwd_fn = _reference_pair(p)
    fwd_c, bwd_c = torch.compile(fwd_fn, dynamic=False), torch.compile(bwd_fn, dynamic=False)
    _, h, mean, rstd = fwd_c(p.x, p.w, p.b, p.r)
    h = p.x if p.r is None else h

    def fwd():
        return fwd_c(p.x, p.w, p.b, p.r)

    def bwd():
        return bwd_c(p.dy, p.dh, h, p.w, p.b, mean, rstd)

    return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))


def torch_eager_provider(p: Problem) -> common.Prepared:
    """Torch's own kernels; its LayerNorm takes parameters in x's dtype only (a bf16
    ``nn.LayerNorm``), so the fp32 parameters are cast once, outside the timed calls."""
    x = p.x.detach().requires_grad_()
    cast = p.x.dtype if p.op == "layer_norm" else None
    w = p.w.detach().to(cast).requires_grad_()
    b = None if p.b is None else p.b.detach().to(cast).requires_grad_()
    n = x.shape[-1]

    def fwd():
        if p.op == "layer_norm":
            return F.layer_norm(x, (n,), w, b, _eps(p)), x
        h = x if p.r is None else x + p.r
        return F.rms_norm(h, (n,), w + p.offset if p.offset else w, EPS), h

    y, h = fwd()
    leaves = tuple(t for t in (x, w, b) if t is not None)

    def bwd():
        outs, grads = (y, h), (p.dy, p.dh)
        if p.dh is None:
            outs, grads = (y,), (p.dy,)
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    return common.Prepared(fwd, bwd, lambda: (fwd()[0], bwd()[0]))


PROVIDERS: dict[str, Callable[[Problem], common.Prepared]] = {
    "tilenorm": tilenorm_provider,
    "quack": quack_provider,
    "liger": liger_provider,
    "tilegym": tilegym_provider,
    "torch.compile": torch_compile_provider,
    "torch eager": torch_eager_provider,
}
OPS = ("layer_norm", "rms_norm_offset", "rms_norm_residual", "rms_norm_per_head")


def measure(op: str, name: str, m: int, n: int, dtype: torch.dtype, modes: list[str]
            ) -> list[dict]:
    p = make_problem(op, m, n, dtype)
    prepared = PROVIDERS[name](p)
    y, dx = prepared.outputs()
    # float64 (tilenorm.testing) on the first rows: y, and dx (= dresidual) through h.
    err = common.float64_errors(
        {"y": y, "dx": dx}, p.x, p.w, p.b, _eps(p), layer_norm=op == "layer_norm",
        offset=p.offset, residual=p.r, dy=p.dy, dh=p.dh, rows=slice(0, max(1, (1 << 22) // n)))
    fwd_err, bwd_err = err["y"], err.get("dx")
    del y, dx
    fwd_bytes, bwd_bytes = bytes_moved(p)
    return common.timed_rows(prepared, fwd_bytes, bwd_bytes, modes, {
        "op": op, "dtype": str(dtype)[6:], "M": m, "N": n,
        "heads": HEADS if op == "rms_norm_per_head" else 1, "provider": name,
        "fwd_err": fwd_err, "bwd_err": bwd_err})


def measure_variants(op: str, m: int, n: int, dtype: torch.dtype, modes: list[str],
                     variants: list[dict], failures: list[dict]) -> list[dict]:
    """tilenorm's op under each settings variant (the device's settings with the variant's
    fields replaced), the plan that ran in each row; a variant that fails is recorded in
    ``failures`` and the others still run."""
    import tilenorm
    from bench.tune_norm import measuring_variant

    rows = []
    for i, variant in enumerate(variants):
        try:
            with measuring_variant(variant):
                p = make_problem(op, m, n, dtype)
                plan = str(tilenorm.explain(p.x, p.w, p.r, bias=p.b,
                                            layer_norm=op == "layer_norm",
                                            per_head=op == "rms_norm_per_head"))
                print(f"v{i} {op} {m}x{n}:\n{plan}", flush=True)
                del p
                for row in measure(op, "tilenorm", m, n, dtype, modes):
                    rows.append({**row, "provider": f"tilenorm v{i}", "variant": variant,
                                 "plan": plan})
        except Exception as e:
            failures.append({"op": op, "M": m, "N": n, "variant": i,
                             "error": f"{type(e).__name__}: {e}"[:400]})
            traceback.print_exc(limit=2)
            torch.cuda.empty_cache()
    return rows


def overhead(op: str, name: str, dtype: torch.dtype) -> dict:
    prepared = PROVIDERS[name](make_problem(op, 256, 1024, dtype))
    return {"op": op, "provider": name, "fwd_host_us": common.host_us(prepared.fwd),
            "bwd_host_us": None if prepared.bwd is None else common.host_us(prepared.bwd)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--shapes", default="32768x4096", help="comma-separated MxN list")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--variants", type=json.loads,
                        help="JSON list of settings variants to compare (tilenorm only)")
    common.add_run_args(parser)
    args = parser.parse_args(argv)
    dtype = common.DTYPES[args.dtype]
    shapes = common.parse_shapes(args.shapes)
    record = common.new_record(args)
    if args.variants is not None:
        record["variants"] = args.variants
        for op in args.ops.split(","):
            for m, n in shapes:
                record["rows"] += measure_variants(op, m, n, dtype, args.modes.split(","),
                                                   args.variants, record["failures"])
                torch.cuda.empty_cache()
        path = common.write_record(record, args.out)
        common.print_table(record)
        print(f"wrote {path}")
        return
    for op in args.ops.split(","):
        for name in args.providers.split(","):
            for m, n in shapes:
                try:
                    record["rows"] += measure(op, name, m, n, dtype, args.modes.split(","))
                except Exception as e:  # an absent peer or op is reported, not fatal
                    record["failures"].append({"op": op, "provider": name, "M": m, "N": n,
                                               "error": f"{type(e).__name__}: {e}"[:400]})
                    if not isinstance(e, (ImportError, NotImplementedError)):
                        traceback.print_exc(limit=2)
                torch.cuda.empty_cache()
            try:
                record["overhead"].append(overhead(op, name, dtype))
            except Exception as e:
                record["failures"].append({"op": op, "provider": name, "overhead": True,
                                           "error": f"{type(e).__name__}: {e}"[:400]})
    path = common.write_record(record, args.out)
    common.print_table(record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
