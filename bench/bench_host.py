"""Host overhead of every provider's norm calls, launch level and through autograd, in one
process (issue 16's host targets).

    python bench/bench_host.py                         # 256 x 1024 bf16, every op and provider
    python bench/bench_host.py --calls 300 --rounds 31 --ops rms_norm --providers tilenorm,torch

Ops: ``rms_norm``, ``layer_norm`` and ``rms_norm_residual`` (a fused residual add returning
(y, h), h = x + r; the backward takes dy and dh and gives gradients to x, r and the weight).
Levels and what one timed call is, per provider (every provider sees the same inputs):

  launch, fwd_us / bwd_us: the forward that saves the statistics, and the backward alone
    (dx, dweight, dbias, the dgamma reduction included) from that forward's outputs:
      tilenorm      rms_norm_forward / rms_norm_backward (residual: residual=r / dh=dh),
                    layer_norm_forward / layer_norm_backward
      torch eager   aten._fused_rms_norm / _fused_rms_norm_backward, aten.native_layer_norm
                    / native_layer_norm_backward (no residual op at this level)
      quack         quack.rmsnorm.rmsnorm_fwd(store_rstd=True) / rmsnorm_bwd (residual:
                    residual=r / dresidual_out=dh), layernorm_fwd / layernorm_bwd (fp32
                    weight and bias: Quack requires them; same values)
      liger         liger_kernel.ops rms_norm_forward / rms_norm_backward, layer_norm_*,
                    fused_add_rms_norm_* (as bench_rms_norm.py / bench_norm_ops.py call them)
      liger cuTile  liger_kernel.ops.cutile.ops.rms_norm (rms_norm only)
  module, fwd_us / fwd_bwd_us / no_grad_fwd_us: an autograd call with x (and r) leaves that
    require grad: the forward alone; a training step ``grads = None; y = m(x);
    y.backward(dy)`` (residual: ``torch.autograd.backward((y, h), (dy, dh))``); the forward
    under ``torch.no_grad()``:
      torch eager   torch.nn.RMSNorm, torch.nn.LayerNorm; residual: h = x + r,
                    F.rms_norm(h, ...), returning (y, h)
      tilenorm      tilenorm.RMSNorm, tilenorm.LayerNorm; residual:
                    tilenorm.rms_norm(x, w, residual=r, prenorm=True)
      quack         quack.rmsnorm.QuackRMSNorm (else quack.rmsnorm.rmsnorm); residual:
                    quack.rmsnorm.rmsnorm(x, w, residual=r, prenorm=True); no LayerNorm
      liger         LigerRMSNorm(in_place=False), LigerLayerNorm, LigerFusedAddRMSNorm

Timing: wall-clock microseconds per call, as tilenorm.benchmark.host_us measures them:
``--calls`` calls back to back with ``torch.cuda.synchronize()`` only before and after them
(few enough that the launch queue never fills: the host, not the GPU, sets the pace), the
median over ``--rounds`` rounds. Rounds are interleaved: round 1 of every timed call, then
round 2, ..., each round starting one call further along the list, so that a change of the
host's state (bench/NOTES.md #21, #26) hits every provider alike; garbage is collected before
each call's round. ``torch.empty_like(x)`` is timed the same way as a yardstick. Before any
timing every provider's outputs are checked once against the float64 reference of
:mod:`tilenorm.testing` (relative error <= 1e-2) on fresh random inputs: a provider that
fails is recorded and not timed.

Writes bench/results/<device>-<date>-host.json (or ``--out``) and prints the table and the
targets, PASS or FAIL, last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from tilenorm.testing import float64_norm, fresh_generator, rel_error  # noqa: E402

OPS = ("rms_norm", "layer_norm", "rms_norm_residual")
LEVELS = ("launch", "module")
PROVIDERS = ("torch eager", "tilenorm", "quack", "liger", "liger cuTile")
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5, "rms_norm_residual": 1e-6}
TOL = 1e-2
#: Parameter gradients in bf16 hold dgamma/dbeta rounded to bf16 after a sum over 256 rows:
#: torch's own bf16 LayerNorm measured 1.4e-2 on the CPU. A gate against wrong work, not an
#: accuracy claim (the kernels' accuracy is the GPU tests').
PARAM_TOL = 3e-2
DEVICE = "cuda"
#: Issue 16's targets at 256 x 1024 bf16: launch level in us; module level against torch.
LAUNCH_FWD_US, LAUNCH_BWD_US = 10.0, 15.0
NO_GRAD_VS_TORCH = 1.5


@dataclass
class Inputs:
    """One op's operands, shared by every provider (each takes its own leaves and copies)."""

    op: str
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    b: torch.Tensor | None = None
    r: torch.Tensor | None = None
    dh: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.x.shape[-1]

    @property
    def eps(self) -> float:
        return EPS[self.op]

    @property
    def layer_norm(self) -> bool:
        return self.op == "layer_norm"


def make_inputs(op: str, m: int, n: int, g: torch.Generator) -> Inputs:
    def randn(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, device=DEVICE)
                ).to(torch.bfloat16)

    p = Inputs(op, randn(m, n), randn(n, scale=0.5, shift=1.0), randn(m, n))
    if op == "layer_norm":
        p.x += 2.0  # a mean away from 0 exercises the centering
        p.b = randn(n, scale=0.5)
    if op == "rms_norm_residual":
        p.r, p.dh = randn(m, n), randn(m, n)
    return p


@dataclass
class Case:
    """One provider's calls for one op at one level; ``outputs()`` runs them once and returns
    what they computed, by the float64 reference's names (y, h, dx, dresidual, dweight,
    dbias; y_no_grad for the forward under no_grad)."""

    api: str
    outputs: Callable[[], dict]
    fwd: Callable[[], object]
    bwd: Callable[[], object] | None = None  # launch level: the backward alone
    step: Callable[[], object] | None = None  # module level: forward + backward
    no_grad_fwd: Callable[[], object] | None = None  # module level, run under no_grad


# --- launch level ---------------------------------------------------------------------------


def _launch_case(api, fwd, bwd, outputs_of) -> Case:
    """``fwd()`` and ``bwd(saved)`` with ``saved = fwd()``; ``outputs_of(fwd_out, bwd_out)``
    names the outputs."""
    saved = fwd()
    return Case(api, lambda: outputs_of(fwd(), bwd(saved)), fwd, lambda: bwd(saved))


def tilenorm_launch(p: Inputs) -> Case:
    import tilenorm

    if p.op == "layer_norm":
        return _launch_case(
            "tilenorm.layer_norm_forward / layer_norm_backward",
            lambda: tilenorm.layer_norm_forward(p.x, p.w, p.b, p.eps),
            lambda s: tilenorm.layer_norm_backward(p.dy, s[1], p.w, p.b, s[2], s[3]),
            lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[2], "dbias": b[3]})
    if p.op == "rms_norm_residual":
        return _launch_case(
            "tilenorm.rms_norm_forward(residual=r) / rms_norm_backward(dh=dh)",
            lambda: tilenorm.rms_norm_forward(p.x, p.w, p.eps, residual=p.r),
            lambda s: tilenorm.rms_norm_backward(p.dy, s[1], p.w, s[2], dh=p.dh,
                                                 x_dtype=p.x.dtype, residual_dtype=p.r.dtype),
            lambda f, b: {"y": f[0], "h": f[1], "dx": b[0], "dresidual": b[1],
                          "dweight": b[2]})
    return _launch_case(
        "tilenorm.rms_norm_forward / rms_norm_backward",
        lambda: tilenorm.rms_norm_forward(p.x, p.w, p.eps),
        lambda s: tilenorm.rms_norm_backward(p.dy, s[1], p.w, s[2]),
        lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[2]})


def torch_launch(p: Inputs) -> Case:
    aten, shape = torch.ops.aten, [p.n]
    if p.op == "rms_norm_residual":
        raise NotImplementedError("torch has no fused residual op at launch level")
    if p.op == "layer_norm":
        return _launch_case(
            "aten.native_layer_norm / native_layer_norm_backward",
            lambda: aten.native_layer_norm(p.x, shape, p.w, p.b, p.eps),
            lambda s: aten.native_layer_norm_backward(p.dy, p.x, shape, s[1], s[2], p.w, p.b,
                                                      [True, True, True]),
            lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[1], "dbias": b[2]})
    if not hasattr(aten, "_fused_rms_norm_backward"):
        raise NotImplementedError(f"torch {torch.__version__} has no aten._fused_rms_norm")
    return _launch_case(
        "aten._fused_rms_norm / _fused_rms_norm_backward",
        lambda: aten._fused_rms_norm(p.x, shape, p.w, p.eps),
        lambda s: aten._fused_rms_norm_backward(p.dy, p.x, shape, s[1], p.w, [True, True]),
        lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[1]})


def quack_launch(p: Inputs) -> Case:
    from quack.rmsnorm import layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd

    if p.op == "layer_norm":
        w32, b32 = p.w.float(), p.b.float()  # Quack's LayerNorm takes fp32 parameters only
        return _launch_case(
            "quack.rmsnorm.layernorm_fwd / layernorm_bwd (fp32 weight, bias)",
            lambda: layernorm_fwd(p.x, w32, b32, p.eps, return_rstd=True, return_mean=True),
            lambda s: layernorm_bwd(p.x, w32, p.dy, s[1], s[2], has_bias=True),
            lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[1], "dbias": b[2]})
    if p.op == "rms_norm_residual":
        return _launch_case(
            "quack.rmsnorm.rmsnorm_fwd(residual=r) / rmsnorm_bwd(dresidual_out=dh)",
            lambda: rmsnorm_fwd(p.x, p.w, residual=p.r, eps=p.eps, store_rstd=True),
            lambda s: rmsnorm_bwd(s[1], p.w, p.dy, s[2], dresidual_out=p.dh,
                                  has_residual=True),
            lambda f, b: {"y": f[0], "h": f[1], "dx": b[0], "dresidual": b[3],
                          "dweight": b[1]})
    return _launch_case(
        "quack.rmsnorm.rmsnorm_fwd(store_rstd=True) / rmsnorm_bwd",
        lambda: rmsnorm_fwd(p.x, p.w, eps=p.eps, store_rstd=True),
        lambda s: rmsnorm_bwd(p.x, p.w, p.dy, s[2]),
        lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[1]})


def _liger_rms_launch(p: Inputs, module: str, name: str) -> Case:
    ops = importlib.import_module(module)
    if p.op != "rms_norm":
        raise NotImplementedError(f"{name}: rms_norm only here")
    return _launch_case(
        f"{module}.rms_norm_forward / rms_norm_backward",
        lambda: ops.rms_norm_forward(p.x, p.w, p.eps, 0.0, "llama", None),
        lambda s: ops.rms_norm_backward(p.dy, s[1], p.w, s[2], 0.0, s[5], s[3], s[4], False,
                                        None),
        lambda f, b: {"y": f[0], "dx": b[0].view_as(p.x), "dweight": b[1]})


def liger_launch(p: Inputs) -> Case:
    if p.op == "layer_norm":
        from liger_kernel.ops.layer_norm import layer_norm_backward, layer_norm_forward

        return _launch_case(
            "liger_kernel.ops.layer_norm.layer_norm_forward / layer_norm_backward",
            lambda: layer_norm_forward(p.x, p.w, p.b, p.eps),
            lambda s: layer_norm_backward(p.dy, p.x, p.w, p.b, s[2], s[3]),
            lambda f, b: {"y": f[0], "dx": b[0], "dweight": b[1], "dbias": b[2]})
    if p.op == "rms_norm_residual":
        from liger_kernel.ops.fused_add_rms_norm import (
            fused_add_rms_norm_backward,
            fused_add_rms_norm_forward,
        )

        return _launch_case(
            "liger_kernel.ops.fused_add_rms_norm forward / backward",
            lambda: fused_add_rms_norm_forward(p.x, p.r, p.w, p.eps, 0.0, "llama"),
            lambda s: fused_add_rms_norm_backward(p.dy, p.dh, s[1], p.w, s[2], 0.0, s[6], s[3],
                                                  s[4], s[5], False),
            lambda f, b: {"y": f[0], "h": f[1], "dx": b[0], "dresidual": b[1],
                          "dweight": b[2]})
    return _liger_rms_launch(p, "liger_kernel.ops.rms_norm", "liger")


def liger_cutile_launch(p: Inputs) -> Case:
    return _liger_rms_launch(p, "liger_kernel.ops.cutile.ops.rms_norm", "liger cuTile")


# --- module level ---------------------------------------------------------------------------


def _param(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if t is None else torch.nn.Parameter(t.detach().clone())


def _module_params(module: torch.nn.Module, p: Inputs) -> dict[str, torch.nn.Parameter]:
    """Set the module's weight (and bias) to the inputs' values; the parameters by the
    reference's gradient names."""
    module.to(device=DEVICE, dtype=torch.bfloat16)
    params = {"dweight": module.weight}
    if getattr(module, "bias", None) is not None:
        params["dbias"] = module.bias
    with torch.no_grad():
        module.weight.copy_(p.w)
        if "dbias" in params:
            module.bias.copy_(p.b)
    return params


def _autograd_case(api: str, p: Inputs, call, params: dict) -> Case:
    """``call(x, r)`` (y, or (y, h) with a residual) on leaves that require grad."""
    x = p.x.detach().clone().requires_grad_()
    r = None if p.r is None else p.r.detach().clone().requires_grad_()
    leaves = {"dx": x, **({} if r is None else {"dresidual": r}), **params}
    tensors = tuple(leaves.values())

    def fwd():
        return call(x, r)

    def step():
        for t in tensors:
            t.grad = None
        out = call(x, r)
        if r is None:
            out.backward(p.dy)
        else:
            torch.autograd.backward(out, (p.dy, p.dh))

    def outputs():
        step()
        grads = {name: t.grad for name, t in leaves.items()}
        out = fwd()
        with torch.no_grad():
            out_no_grad = fwd()
        y, h = (out, None) if r is None else out
        return {"y": y.detach(), "h": None if h is None else h.detach(),
                "y_no_grad": out_no_grad if r is None else out_no_grad[0], **grads}

    return Case(api, outputs, fwd, step=step, no_grad_fwd=fwd)


def torch_module(p: Inputs) -> Case:
    if p.op == "rms_norm_residual":
        w = _param(p.w)

        def call(x, r):
            h = x + r
            return F.rms_norm(h, (p.n,), w, p.eps), h

        return _autograd_case("h = x + r; F.rms_norm(h, ...) -> (y, h)", p, call, {"dweight": w})
    if p.op == "layer_norm":
        m = torch.nn.LayerNorm(p.n, eps=p.eps)
        api = "torch.nn.LayerNorm"
    else:
        m = torch.nn.RMSNorm(p.n, eps=p.eps)
        api = "torch.nn.RMSNorm"
    params = _module_params(m, p)
    return _autograd_case(api, p, lambda x, r: m(x), params)


def tilenorm_module(p: Inputs) -> Case:
    import tilenorm

    if p.op == "rms_norm_residual":
        w = _param(p.w)
        return _autograd_case(
            "tilenorm.rms_norm(x, w, residual=r, prenorm=True)", p,
            lambda x, r: tilenorm.rms_norm(x, w, p.eps, residual=r, prenorm=True),
            {"dweight": w})
    if p.op == "layer_norm":
        m, api = tilenorm.LayerNorm(p.n, eps=p.eps), "tilenorm.LayerNorm"
    else:
        m, api = tilenorm.RMSNorm(p.n, eps=p.eps), "tilenorm.RMSNorm"
    params = _module_params(m, p)
    return _autograd_case(api, p, lambda x, r: m(x), params)


def quack_module(p: Inputs) -> Case:
    # The module itself: quack's package re-exports the rmsnorm function under the same name.
    q = importlib.import_module("quack.rmsnorm")

    if p.op == "layer_norm":
        raise NotImplementedError("Quack has no LayerNorm module or autograd function")
    if p.op == "rms_norm_residual":
        w = _param(p.w)
        return _autograd_case(
            "quack.rmsnorm.rmsnorm(x, w, residual=r, prenorm=True)", p,
            lambda x, r: q.rmsnorm(x, w, residual=r, eps=p.eps, prenorm=True),
            {"dweight": w})
    if hasattr(q, "QuackRMSNorm"):
        m = q.QuackRMSNorm(p.n, eps=p.eps)
        params = _module_params(m, p)
        return _autograd_case("quack.rmsnorm.QuackRMSNorm", p, lambda x, r: m(x), params)
    w = _param(p.w)
    return _autograd_case("quack.rmsnorm.rmsnorm (no QuackRMSNorm)", p,
                          lambda x, r: q.rmsnorm(x, w, eps=p.eps), {"dweight": w})


def liger_module(p: Inputs) -> Case:
    import liger_kernel.transformers as lt

    if p.op == "rms_norm_residual":
        m = lt.LigerFusedAddRMSNorm(p.n, eps=p.eps, in_place=False)
        params = _module_params(m, p)
        return _autograd_case("LigerFusedAddRMSNorm(in_place=False)", p, m, params)
    if p.op == "layer_norm":
        m, api = lt.LigerLayerNorm(p.n, eps=p.eps, bias=True), "LigerLayerNorm"
    else:
        # in_place=False: the default writes dx into dy, which the next step would read.
        m, api = lt.LigerRMSNorm(p.n, eps=p.eps, in_place=False), "LigerRMSNorm(in_place=False)"
    params = _module_params(m, p)
    return _autograd_case(api, p, lambda x, r: m(x), params)


BUILDERS: dict[tuple[str, str], Callable[[Inputs], Case]] = {
    ("launch", "tilenorm"): tilenorm_launch,
    ("launch", "torch eager"): torch_launch,
    ("launch", "quack"): quack_launch,
    ("launch", "liger"): liger_launch,
    ("launch", "liger cuTile"): liger_cutile_launch,
    ("module", "torch eager"): torch_module,
    ("module", "tilenorm"): tilenorm_module,
    ("module", "quack"): quack_module,
    ("module", "liger"): liger_module,
}
#: The import each provider needs: a failure is recorded once and the provider skipped.
IMPORTS = {"tilenorm": "tilenorm", "quack": "quack.rmsnorm", "liger": "liger_kernel",
           "liger cuTile": "liger_kernel.ops.cutile.ops.rms_norm"}


# --- checks and timing ----------------------------------------------------------------------


def check(case: Case, p: Inputs, ref) -> dict[str, float]:
    """Relative errors of every output the case computed against the float64 reference."""
    errors = {}
    for name, out in case.outputs().items():
        if out is None:
            continue
        expected = ref.y if name == "y_no_grad" else getattr(ref, name)
        errors[name] = rel_error(out.reshape(expected.shape), expected)
    torch.cuda.synchronize()
    return errors


@dataclass
class Timed:
    """One timed call: its row, which column, the callable, and its rounds (us per call)."""

    row: dict
    column: str
    fn: Callable[[], object]
    no_grad: bool = False
    rounds: list[float] = field(default_factory=list)


def time_interleaved(timed: list[Timed], calls: int, rounds: int, warmup: int) -> None:
    """Fill each entry's ``rounds``: round k of every entry before round k + 1 of any, the
    order rotated by one each round; garbage collected and the GPU synchronized before each
    entry's round, the wall time taken before the closing synchronize."""
    for t in timed:
        with torch.no_grad() if t.no_grad else contextlib.nullcontext():
            for _ in range(warmup):
                t.fn()
    torch.cuda.synchronize()
    for k in range(rounds):
        for t in timed[k % len(timed):] + timed[:k % len(timed)]:
            fn = t.fn
            gc.collect()
            torch.cuda.synchronize()
            with torch.no_grad() if t.no_grad else contextlib.nullcontext():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                elapsed = time.perf_counter() - start
            torch.cuda.synchronize()
            t.rounds.append(elapsed / calls * 1e6)
        print(f"round {k + 1}/{rounds}", file=sys.stderr, flush=True)


def _row(rows, op, level, provider) -> dict | None:
    return next((r for r in rows if (r["op"], r["level"], r["provider"]) == (op, level, provider)
                 ), None)


def targets(rows: list[dict]) -> list[dict]:
    """Issue 16's host targets against this run's rows."""
    out = []

    def add(name, value, limit):
        out.append({"target": name, "measured_us": value, "limit_us": limit,
                    "pass": None if value is None or limit is None else value <= limit})

    launch = _row(rows, "rms_norm", "launch", "tilenorm") or {}
    add("rms_norm_forward <= 10 us", launch.get("fwd_us"), LAUNCH_FWD_US)
    add("rms_norm_backward (with dgamma) <= 15 us", launch.get("bwd_us"), LAUNCH_BWD_US)
    for op, torch_name in (("rms_norm", "torch.nn.RMSNorm"), ("layer_norm", "torch.nn.LayerNorm"),
                           ("rms_norm_residual", "x + r, F.rms_norm")):
        ours = _row(rows, op, "module", "tilenorm") or {}
        theirs = _row(rows, op, "module", "torch eager") or {}
        limit = theirs.get("fwd_bwd_us")
        add(f"{op} module fwd+bwd <= {torch_name}", ours.get("fwd_bwd_us"), limit)
        limit = theirs.get("no_grad_fwd_us")
        add(f"{op} module no_grad fwd <= {NO_GRAD_VS_TORCH}x {torch_name}",
            ours.get("no_grad_fwd_us"), None if limit is None else NO_GRAD_VS_TORCH * limit)
    return out


def print_table(record: dict) -> None:
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"\n{record['device']}, {record['shape'][0]} x {record['shape'][1]} bf16, host us "
          f"per call (median of {record['rounds']} rounds of {record['calls']} calls); "
          f"torch.empty_like {us(record['empty_like_us'])} us")
    print(f"{'op':>18} {'level':>7} {'provider':>13} {'fwd':>7} {'bwd':>7} {'fwd+bwd':>8} "
          f"{'no_grad':>8}  api")
    for r in record["rows"]:
        print(f"{r['op']:>18} {r['level']:>7} {r['provider']:>13} {us(r['fwd_us']):>7} "
              f"{us(r['bwd_us']):>7} {us(r['fwd_bwd_us']):>8} {us(r['no_grad_fwd_us']):>8}  "
              f"{r['api']}")
    for name, why in record["absent"].items():
        print(f"absent: {name}: {why}")
    for f in record["failures"]:
        print(f"FAILED {f['op']} {f['level']} {f['provider']}: {f['error']}")
    print(f"\n{'target':>58} {'measured':>9} {'limit':>7}  result")
    for t in record["targets"]:
        result = "MISSING" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        print(f"{t['target']:>58} {us(t['measured_us']):>9} {us(t['limit_us']):>7}  {result}")


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for dist in ("quack-kernels", "liger-kernel", "cuda-tile", "nvidia-cutlass-dsl-libs-cu13"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per round (default 300)")
    parser.add_argument("--rounds", type=int, default=21,
                        help="rounds, interleaved; the median is recorded (default 21)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    parser.add_argument("--shape", default="256x1024", help="MxN (the targets are 256x1024)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    parser.add_argument("--experimental", action="store_true",
                        help="let tilenorm run kernels not yet validated on a GPU")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host.py times CUDA calls: run it on the GPU host")
    (m, n), = common.parse_shapes(args.shape)
    ops, levels = args.ops.split(","), args.levels.split(",")
    providers = args.providers.split(",")

    absent, failures, errors, paths = {}, [], [], {}
    for name in providers:
        module = IMPORTS.get(name)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # an absent peer is recorded, not fatal
            absent[name] = f"{type(e).__name__}: {e}"[:300]
    if "tilenorm" not in absent:
        import tilenorm

        if args.experimental:
            tilenorm.set_experimental(True)

    g, seed = fresh_generator(DEVICE)
    rows, timed = [], []
    x_yardstick = torch.randn(m, n, generator=g, device=DEVICE, dtype=torch.bfloat16)
    yardstick = Timed({}, "fwd_us", lambda: torch.empty_like(x_yardstick))
    timed.append(yardstick)
    for op in ops:
        p = make_inputs(op, m, n, g)
        ref = float64_norm(p.x, p.w, p.b, p.eps, layer_norm=p.layer_norm, residual=p.r,
                           dy=p.dy, dh=p.dh)
        if "tilenorm" not in absent:
            decision = tilenorm.explain(p.x, p.w, p.r, bias=p.b, layer_norm=p.layer_norm)
            paths[op] = str(decision)
            if not decision.uses_kernel:
                print(f"WARNING: tilenorm's {op} takes the reference path here "
                      f"({decision.reason}); --experimental runs unvalidated kernels")
        for level in levels:
            for name in providers:
                builder = BUILDERS.get((level, name))
                if builder is None or name in absent:
                    continue
                where = {"op": op, "level": level, "provider": name}
                try:
                    case = builder(p)
                    err = check(case, p, ref)
                except NotImplementedError as e:
                    absent[f"{name} {level} {op}"] = str(e)[:300]
                    continue
                except Exception as e:
                    failures.append({**where, "error": f"{type(e).__name__}: {e}"[:500]})
                    traceback.print_exc(limit=3)
                    continue
                errors.append({**where, "api": case.api, "errors": err})
                bad = {k: v for k, v in err.items()
                       if not v <= (PARAM_TOL if k in ("dweight", "dbias") else TOL)}
                if bad:
                    failures.append({**where, "error": f"relative errors {bad} over {TOL} "
                                                       f"({PARAM_TOL} for dweight, dbias): "
                                                       f"not timed"})
                    continue
                row = {**where, "api": case.api, "fwd_us": None, "bwd_us": None,
                       "fwd_bwd_us": None, "no_grad_fwd_us": None, "rounds_us": {}}
                rows.append(row)
                timed.append(Timed(row, "fwd_us", case.fwd))
                if case.bwd is not None:
                    timed.append(Timed(row, "bwd_us", case.bwd))
                if case.step is not None:
                    timed.append(Timed(row, "fwd_bwd_us", case.step))
                if case.no_grad_fwd is not None:
                    timed.append(Timed(row, "no_grad_fwd_us", case.no_grad_fwd, no_grad=True))
        del ref
    torch.cuda.synchronize()
    # What exists now (modules, compiled kernels, the imports) lives to the end: frozen, the
    # collection before each round walks only what the timed calls leave behind.
    gc.collect()
    gc.freeze()
    print(f"{len(timed)} calls to time, {args.rounds} rounds of {args.calls}", file=sys.stderr)
    time_interleaved(timed, args.calls, args.rounds, args.warmup)
    for t in timed[1:]:
        t.row[t.column] = statistics.median(t.rounds)
        t.row["rounds_us"][t.column] = [round(v, 3) for v in t.rounds]

    record = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "commit": common.git_commit(), "torch": torch.__version__,
              "versions": _versions(), "shape": [m, n], "dtype": "bfloat16",
              "calls": args.calls, "rounds": args.rounds, "seed": seed,
              "empty_like_us": statistics.median(yardstick.rounds),
              "empty_like_rounds_us": [round(v, 3) for v in yardstick.rounds],
              "tilenorm_decisions": paths, "absent": absent, "failures": failures,
              "errors": errors, "rows": rows}
    record["targets"] = targets(rows)
    path = args.out or (common.RESULTS_DIR / f"{common.device_slug()}-{record['date']}-host.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    print_table(record)


if __name__ == "__main__":
    main()
