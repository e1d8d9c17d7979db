"""RMSNorm in JAX: tilenorm.jax beside XLA's fusion of the jnp reference and
flax.linen.RMSNorm, with the torch side's kernel time on the same inputs (issue 18).

    python bench/bench_jax.py                           # the RMSNorm sweep, bf16
    python bench/bench_jax.py --shapes 32768x4096 --dtype float16
    python bench/bench_jax.py --smoke                   # tiny, any backend (the CPU test)

Providers, each AOT-compiled with ``jax.jit`` for the shape and called through JAX's C++
dispatch:

  tilenorm.jax    tilenorm.jax.rms_norm: the kernel path (XLA FFI calls of the cuTile
                  kernels) where it covers the call; a row's ``ffi_calls`` lists the FFI
                  targets its compiled programs hold (both where the kernels ran)
  jnp-reference   the same op traced with the kernel path off: tilenorm.jax.reference (fp32
                  jnp, its own custom_vjp backward) as XLA fuses it
  flax.linen      flax.linen.RMSNorm (scale and y in --dtype), JAX autodiff for the backward
  tilenorm-torch  tilenorm.rms_norm_forward / rms_norm_backward on the same buffers (DLPack),
                  CUDA-graph kernel time as bench_rms_norm.py measures it (the target:
                  tilenorm.jax within 3% of it), and timed as the JAX calls are
                  (``*_b2b_ms``: what that timer adds to kernel time)

Two programs per provider and shape: ``fwd``, y = norm(x, w); ``step``, y, dx and dweight
of jax.vjp, the backward behind an optimization barrier so that it runs from the saved
residuals after the forward, as in training where dy depends on y (without it XLA may fuse
the two passes over x, which no training step can). The torch side's step is its forward
(y, rstd) plus its backward (dx, dweight).

Device time of a call: JAX gives no stream to put events on, so it is taken from the wall
clock of calls dispatched back to back: rounds of n and of 2n calls, each followed by one
block; ``(median(T_2n) - median(T_n)) / n`` cancels the fixed start and drain. That timer
spreads about 3% between runs of one kernel (bench/NOTES.md #91), so each row also has the
kernels' own time (``*_kernel_ms``): the durations CUPTI records for every kernel, memset and
copy the calls run, through torch's profiler, which records the whole process's kernels,
JAX's too; the torch side is profiled the same way, and its ratio (``vs torch, kernels``) is
the one issue 18's 3% bar is judged by. The sweep's
inputs are 256 MB (several times L2), so a call's kernels take longer than its dispatch and
the GPU, not the host, sets the pace. GB/s = bytes that must move / time (``fwd``: read x, w,
write y; ``step``: bench_rms_norm's forward + backward bytes), against the device-to-device
copy bandwidth of a jitted ``jnp.copy`` in the same run. Host microseconds per jitted call:
the wall time of dispatching many calls back to back without blocking, over their count, on
a 256 x 1024 shape whose kernels are shorter than the dispatch (interleaved rounds, median).

Every provider's outputs are checked once against the float64 reference of
:mod:`tilenorm.testing` (``bench.common.float64_errors``); an error over the GPU tests'
tolerance is listed under ``failures`` and the row kept. Writes
bench/results/<device>-<date>-jax-<commit>.json (or ``--out``) and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

# Before JAX starts a backend: by default it takes 75% of the GPU's memory, leaving torch
# (the float64 check, the torch side) too little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tilenorm  # noqa: E402
import tilenorm.jax as tj  # noqa: E402
from bench import bench_rms_norm, common  # noqa: E402
from tilenorm.jax import cute_ffi, native  # noqa: E402

EPS = bench_rms_norm.EPS
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
#: (y, gradients) relative-error limits against float64: tests/test_jax_gpu.py's.
TOL = {"bfloat16": (1e-2, 3e-2), "float16": (2e-3, 5e-3), "float32": (2e-6, 2e-5)}
JAX_PROVIDERS = ("tilenorm.jax", "jnp-reference", "flax.linen")
TORCH_SIDE = "tilenorm-torch"
HOST_SHAPE = (256, 1024)


class Settings:
    """How long each measurement runs; ``--smoke`` shrinks everything to prove the code
    paths on any backend."""

    def __init__(self, smoke: bool, kernel_time: bool = True):
        self.copy_bytes = (4 << 20) if smoke else (1 << 30)
        self.window_s = 0.0 if smoke else 5e-3  # wall time of the shorter timed window
        self.rounds = 2 if smoke else 5
        self.host_calls = 40 if smoke else 1000
        self.host_rounds = 2 if smoke else 11
        self.host_shape = (64, 256) if smoke else HOST_SHAPE
        #: Calls profiled for the kernels' own time; 0: not profiled (``--no-kernel-time``).
        self.profiled_calls = 0 if not kernel_time else 2 if smoke else 20


# --- timing ----------------------------------------------------------------------------------


def device_ms(call: Callable[[], object], settings: Settings,
              block: Callable[[object], object] = jax.block_until_ready) -> float:
    """Milliseconds of device time per ``call()``, from calls dispatched back to back (the
    module's docstring); ``n`` makes the shorter window last ``settings.window_s``.
    ``block(out)`` waits for a call's work."""
    for _ in range(3):
        block(call())
    start = time.perf_counter()
    block(call())
    n = max(3, min(200, math.ceil(settings.window_s / (time.perf_counter() - start))))
    gc.collect()
    windows: dict[int, list[float]] = {n: [], 2 * n: []}
    for _ in range(settings.rounds):
        for calls, times in windows.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = call()
            block(out)
            times.append(time.perf_counter() - start)
    short, long = (statistics.median(windows[k]) for k in (n, 2 * n))
    if long > short:
        return (long - short) / n * 1e3
    # Only where the host sets the pace (--smoke on the CPU): the whole window per call.
    return long / (2 * n) * 1e3


#: Trace categories of GPU work in torch's profiler (Kineto's chrome trace).
GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_us(trace: dict) -> float:
    """Microseconds of GPU work in a chrome trace (``torch.profiler``'s export): the sum of
    its kernels', memsets' and copies' durations."""
    return sum(e.get("dur", 0.0) for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES)


def kernel_ms(call: Callable[[], object], settings: Settings,
              block: Callable[[object], object] = jax.block_until_ready) -> float | None:
    """Milliseconds of GPU work per ``call()`` as CUPTI records it (:func:`gpu_us` of
    ``settings.profiled_calls`` calls, after a warm-up); None without a CUDA device for torch
    or where the profiler saw no GPU work; None too with ``--no-kernel-time``."""
    if not torch.cuda.is_available() or not settings.profiled_calls:
        return None
    for _ in range(3):
        block(call())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(settings.profiled_calls):
            out = call()
        block(out)
        torch.cuda.synchronize()
    # The exported trace, not prof.events() (compile_crossover.py's kernel_time): the trace
    # holds every record CUPTI delivered, whether or not a torch op launched it, as JAX's
    # kernels are not.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            us = gpu_us(json.load(f))
    return us / settings.profiled_calls / 1e3 if us > 0 else None


def host_us(calls: dict[tuple, Callable[[], object]], settings: Settings
            ) -> dict[tuple, float]:
    """Host microseconds per call of each of ``calls``: the wall time of dispatching
    ``host_calls / host_rounds`` calls without blocking, over their count; rounds interleaved
    across the calls so that a change of the host's state hits them alike; the median."""
    for call in calls.values():
        for _ in range(20):
            out = call()
        jax.block_until_ready(out)
    per_round = max(1, settings.host_calls // settings.host_rounds)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(settings.host_rounds):
        for name, call in calls.items():
            gc.collect()
            start = time.perf_counter()
            for _ in range(per_round):
                out = call()
            elapsed = time.perf_counter() - start
            jax.block_until_ready(out)
            times[name].append(elapsed / per_round * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_gbps(settings: Settings) -> float:
    """Device-to-device copy bandwidth of a jitted ``jnp.copy`` (bytes read + written over
    time), timed like the providers."""
    src = jax.random.randint(jax.random.key(0), (settings.copy_bytes,), 0, 255, jnp.uint8)
    copy = jax.jit(jnp.copy).lower(src).compile()
    return 2 * settings.copy_bytes / (device_ms(lambda: copy(src), settings) * 1e-3) / 1e9


# --- providers -------------------------------------------------------------------------------


@contextlib.contextmanager
def _kernel_path_off() -> Iterator[None]:
    """tilenorm.jax traces (and lowers) its reference path meanwhile."""
    previous = tj.set_kernel_path(None)
    try:
        yield
    finally:
        tj.set_kernel_path(previous)


def norm_fn(provider: str, dtype) -> Callable:
    """``(x, w) -> y`` of a JAX provider."""
    if provider == "flax.linen":
        import flax.linen as nn

        module = nn.RMSNorm(epsilon=EPS, dtype=dtype, param_dtype=dtype)
        return lambda x, w: module.apply({"params": {"scale": w}}, x)
    return lambda x, w: tj.rms_norm(x, w, EPS)


def step_fn(norm: Callable) -> Callable:
    """``(x, w, dy) -> (y, dx, dw)``: forward, then the backward from its saved residuals
    (the barrier: the module's docstring)."""

    def step(x, w, dy):
        y, vjp = jax.vjp(norm, x, w)
        y, vjp, dy = lax.optimization_barrier((y, vjp, dy))
        return (y, *vjp(dy))

    return step


def tracing(provider: str) -> contextlib.AbstractContextManager:
    """What a provider's programs are traced and compiled within: the jnp reference with the
    kernel path off."""
    return _kernel_path_off() if provider == "jnp-reference" else contextlib.nullcontext()


def compile_provider(provider: str, x, w, dy) -> tuple:
    """The provider's compiled ``fwd`` and ``step`` for these operands' shapes and dtypes."""
    norm = norm_fn(provider, x.dtype)
    with tracing(provider):
        fwd = jax.jit(norm).lower(x, w).compile()
        step = jax.jit(step_fn(norm)).lower(x, w, dy).compile()
    if provider == "jnp-reference" and ffi_targets(fwd, step):
        raise RuntimeError("the jnp reference was compiled with tilenorm's FFI calls")
    return fwd, step


def ffi_targets(fwd, step) -> list[str]:
    """tilenorm's FFI custom calls that the compiled programs hold: both where the kernel
    path runs the forward (cuTile's target, or a CuTe forward's ``cute_ffi.TARGET_PREFIX``)
    and the step's backward (the CuTe cluster backward's
    ``cute_ffi.BACKWARD_TARGET_PREFIX``, and cuTile's target: its kernels, or the column
    sums of the cluster backward's partial buffer)."""
    fwd_text, step_text = fwd.as_text(), step.as_text()
    cute_forward = re.search(re.escape(cute_ffi.TARGET_PREFIX) + r"\w+", fwd_text)
    cute_backward = re.search(re.escape(cute_ffi.BACKWARD_TARGET_PREFIX) + r"\w+", step_text)
    forward = [native.FORWARD_TARGET] if native.FORWARD_TARGET in fwd_text else []
    return (forward + ([cute_forward.group(0)] if cute_forward else [])
            + ([cute_backward.group(0)] if cute_backward else [])
            + [native.BACKWARD_TARGET] * (native.BACKWARD_TARGET in step_text))


# --- one shape -------------------------------------------------------------------------------


def inputs(m: int, n: int, dtype) -> tuple:
    """x, w, dy on JAX's default device: normal x and dy, w = 1 + 0.5 normal (no zeros)."""
    kx, kw, kdy = jax.random.split(jax.random.key(m * 131 + n), 3)
    x = jax.random.normal(kx, (m, n), dtype)
    w = (1 + 0.5 * jax.random.normal(kw, (n,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kdy, (m, n), dtype)
    return jax.block_until_ready((x, w, dy))


def fwd_bytes(m: int, n: int, itemsize: int) -> int:
    """What the forward alone must move: read x and w, write y."""
    return 2 * m * n * itemsize + n * itemsize


def step_bytes(m: int, n: int, itemsize: int) -> int:
    """A training step's forward (y, rstd) and backward (dx, dweight) bytes."""
    return sum(bench_rms_norm.bytes_moved(m, n, itemsize, itemsize))


def errors(y, dx, dw, x, w, dy) -> dict[str, float]:
    """Relative errors of y, dx, dweight against float64 (y and dx on the first rows,
    dweight over every row, as bench_rms_norm.py checks), on the outputs' own device."""
    t = [torch.from_dlpack(a) for a in (y, dx, dw, x, w, dy)]
    return common.float64_errors({"y": t[0], "dx": t[1], "dweight": t[2]}, t[3], t[4],
                                 eps=EPS, dy=t[5], rows=slice(0, max(1, (1 << 24) // x.shape[1])))


def measure_jax(provider: str, x, w, dy, settings: Settings, row: dict) -> dict:
    fwd, step = compile_provider(provider, x, w, dy)
    err = errors(fwd(x, w), *step(x, w, dy)[1:], x, w, dy)
    m, n = x.shape
    fwd_ms = device_ms(lambda: fwd(x, w), settings)
    step_ms = device_ms(lambda: step(x, w, dy), settings)
    return {**row, "provider": provider, "ffi_calls": ffi_targets(fwd, step),
            "fwd_ms": fwd_ms, "step_ms": step_ms,
            "fwd_kernel_ms": kernel_ms(lambda: fwd(x, w), settings),
            "step_kernel_ms": kernel_ms(lambda: step(x, w, dy), settings),
            "fwd_gbps": fwd_bytes(m, n, x.dtype.itemsize) / (fwd_ms * 1e-3) / 1e9,
            "step_gbps": step_bytes(m, n, x.dtype.itemsize) / (step_ms * 1e-3) / 1e9,
            "fwd_err": err["y"], "bwd_err": max(err["dx"], err["dweight"])}


def measure_torch(x, w, dy, settings: Settings, row: dict) -> dict:
    """The torch side on the same buffers: bench_rms_norm.py's tilenorm provider, timed by
    CUDA-graph replay (kernel time) and like the JAX calls (``*_b2b_ms``)."""
    xt, wt, dyt = (torch.from_dlpack(a) for a in (x, w, dy))
    prepared = bench_rms_norm.Tilenorm().prepare(xt, wt, dyt)
    y, dx, dw = prepared.outputs()
    err = common.float64_errors({"y": y, "dx": dx, "dweight": dw}, xt, wt, eps=EPS, dy=dyt,
                                rows=slice(0, max(1, (1 << 24) // xt.shape[1])))
    del y, dx, dw
    fwd_ms, bwd_ms = common.graph_ms(prepared.fwd), common.graph_ms(prepared.bwd)

    def synchronize(_):
        torch.cuda.synchronize()

    # Timed as the JAX calls are too: what that timer adds to kernel time, on the same
    # kernels.
    def step():
        return prepared.fwd(), prepared.bwd()

    like_jax = {"fwd_b2b_ms": device_ms(prepared.fwd, settings, synchronize),
                "step_b2b_ms": device_ms(step, settings, synchronize),
                "fwd_kernel_ms": kernel_ms(prepared.fwd, settings, synchronize),
                "step_kernel_ms": kernel_ms(step, settings, synchronize)}
    m, n = x.shape
    return {**row, "provider": TORCH_SIDE, "ffi_calls": None, "fwd_ms": fwd_ms,
            "step_ms": fwd_ms + bwd_ms, "bwd_ms": bwd_ms, **like_jax,
            "fwd_gbps": fwd_bytes(m, n, x.dtype.itemsize) / (fwd_ms * 1e-3) / 1e9,
            "step_gbps": step_bytes(m, n, x.dtype.itemsize) / ((fwd_ms + bwd_ms) * 1e-3) / 1e9,
            "fwd_err": err["y"], "bwd_err": max(err["dx"], err["dweight"])}


def problems(r: dict, dtype: str, on_gpu: bool) -> list[str]:
    """What is wrong with a row: outputs over the tolerance, or tilenorm.jax on a GPU
    compiled without its FFI calls (it measured the reference path)."""
    fwd_tol, bwd_tol = TOL[dtype]
    out = []
    if not (r["fwd_err"] <= fwd_tol and r["bwd_err"] <= bwd_tol):  # NaN fails
        out.append(f"relative error y {r['fwd_err']:.2e} (limit {fwd_tol}), gradients "
                   f"{r['bwd_err']:.2e} (limit {bwd_tol})")
    if r["provider"] == "tilenorm.jax" and on_gpu and len(r["ffi_calls"]) < 2:
        out.append("the reference path was measured, not the kernels (see decisions)")
    return out


# --- the run ---------------------------------------------------------------------------------


def sweep_shapes() -> list[tuple[int, int]]:
    """bench_rms_norm.py's sweep: x of 256 MB in bf16 at every width; not its latency
    shapes, which fit in L2."""
    return [(max(1, bench_rms_norm.SWEEP_BYTES // (2 * n)), n) for n in bench_rms_norm.SWEEP_N]


def device_slug(device) -> str:
    return device.device_kind.lower().replace("nvidia ", "").replace(" ", "-")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def overhead(providers: list[str], dtype, settings: Settings) -> list[dict]:
    """Host microseconds per jitted call of every JAX provider's fwd and step."""
    x, w, dy = inputs(*settings.host_shape, dtype)
    calls = {}
    for provider in providers:
        fwd, step = compile_provider(provider, x, w, dy)
        calls[provider, "fwd"] = lambda fwd=fwd: fwd(x, w)
        calls[provider, "step"] = lambda step=step: step(x, w, dy)
    us = host_us(calls, settings)
    return [{"provider": p, "shape": list(settings.host_shape), "fwd_host_us": us[p, "fwd"],
             "step_host_us": us[p, "step"]} for p in providers]


def print_table(record: dict) -> None:
    copy = record["copy_gbps"]
    torch_rows = {(r["M"], r["N"]): r for r in record["rows"] if r["provider"] == TORCH_SIDE}

    def gbps(v):
        return f"{v:6.0f} ({100 * v / copy:3.0f}%)"

    def vs_torch(r, key):
        t = torch_rows.get((r["M"], r["N"]))
        if t is None:
            return "-"
        # The torch row's own: its back-to-back time against its kernel time.
        mine = r[key.replace("_ms", "_b2b_ms")] if r is t else r[key]
        return f"{100 * (mine / t[key] - 1):+.1f}%"

    def vs_torch_kernels(r, key):
        t = torch_rows.get((r["M"], r["N"]))
        if t is None or r is t or not r.get(key) or not t.get(key):
            return "-"
        return f"{100 * (r[key] / t[key] - 1):+.1f}%"

    print(f"\n{record['device']}, {record['dtype']}, jnp.copy {copy:.0f} GB/s. GB/s (% of "
          f"copy); vs torch: time / {TORCH_SIDE}'s kernel time - 1 (its own row: its "
          f"back-to-back time); kernels: profiled GPU time / {TORCH_SIDE}'s - 1")
    print(f"{'M x N':>14} {'provider':>14} {'fwd':>13} {'step':>13} {'fwd ms':>8} "
          f"{'step ms':>8} {'vs torch':>15} {'kernels':>15} {'err y / grad':>15}")
    for r in record["rows"]:
        print(f"{r['M']:>7}x{r['N']:<6} {r['provider']:>14} {gbps(r['fwd_gbps'])} "
              f"{gbps(r['step_gbps'])} {r['fwd_ms']:8.3f} {r['step_ms']:8.3f} "
              f"{vs_torch(r, 'fwd_ms'):>7} {vs_torch(r, 'step_ms'):>7} "
              f"{vs_torch_kernels(r, 'fwd_kernel_ms'):>7} "
              f"{vs_torch_kernels(r, 'step_kernel_ms'):>7} "
              f"{r['fwd_err']:7.1e} {r['bwd_err']:7.1e}")
    for o in record["overhead"]:
        m, n = o["shape"]
        print(f"host us/jitted call at {m}x{n} {o['provider']:>14}: fwd {o['fwd_host_us']:.1f},"
              f" step {o['step_host_us']:.1f}")
    for name, why in record["absent"].items():
        print(f"absent: {name}: {why}")
    for f in record["failures"]:
        print(f"FAILED {f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help="comma-separated MxN list (default: the sweep; with "
                                         "--smoke 64x256)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--providers", default=",".join(JAX_PROVIDERS + (TORCH_SIDE,)),
                        help="comma-separated subset (default all)")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    parser.add_argument("--experimental", action="store_true",
                        help="let tilenorm run kernels not yet validated on a GPU")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny measurements on any backend: proves the code paths")
    parser.add_argument("--no-kernel-time", dest="kernel_time", action="store_false",
                        help="skip the profiled kernel time (torch's profiler in the process)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    settings = Settings(args.smoke, args.kernel_time)
    if args.experimental:
        tilenorm.set_experimental(True)
    dtype = DTYPES[args.dtype]
    shapes = (common.parse_shapes(args.shapes) if args.shapes
              else [(64, 256)] if args.smoke else sweep_shapes())
    wanted = args.providers.split(",")
    device = jax.devices()[0]

    absent: dict[str, str] = {}
    providers = [p for p in JAX_PROVIDERS if p in wanted]
    if "flax.linen" in providers:
        try:
            import flax.linen  # noqa: F401
        except ImportError as e:  # a missing peer is reported, not fatal
            absent["flax.linen"] = f"{type(e).__name__}: {e}"
            providers.remove("flax.linen")
    # The torch side shares the JAX buffers: it needs them on a GPU torch can reach.
    torch_side = TORCH_SIDE in wanted and device.platform == "gpu" and torch.cuda.is_available()
    if TORCH_SIDE in wanted and not torch_side:
        absent[TORCH_SIDE] = f"JAX runs on {device.platform}; the torch side needs CUDA"

    copy = copy_gbps(settings)
    print(f"{device.device_kind}: jnp.copy {copy:.0f} GB/s")
    record = {"device": device.device_kind, "platform": device.platform,
              "date": datetime.date.today().isoformat(), "commit": common.git_commit(),
              "dtype": args.dtype, "copy_gbps": copy,
              "torch_copy_gbps": common.copy_gbps() if torch_side else None,
              "versions": {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda13-plugin",
                                                     "jax-cuda12-plugin", "flax", "torch",
                                                     "cuda-tile")},
              "smoke": args.smoke, "rows": [], "overhead": [], "failures": [],
              "absent": absent, "decisions": {}}
    try:
        record["overhead"] = overhead(providers, dtype, settings)
    except Exception as e:
        record["failures"].append({"overhead": True, "error": f"{type(e).__name__}: {e}"[:500]})
        traceback.print_exc(limit=3)
    path = args.out or (common.RESULTS_DIR / f"{device_slug(device)}-{record['date']}-jax-"
                                             f"{record['commit']}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    for m, n in shapes:
        x, w, dy = inputs(m, n, dtype)
        decision = tj.explain(x, w)
        record["decisions"][f"{m}x{n}"] = str(decision)
        if device.platform == "gpu" and not decision.uses_kernel:
            print(f"WARNING: tilenorm.jax takes the reference path at {m}x{n}: "
                  f"{decision.reason}")
        row = {"op": "rms_norm", "dtype": args.dtype, "M": m, "N": n}
        for provider in providers + [TORCH_SIDE] * torch_side:
            try:
                if provider == TORCH_SIDE:
                    r = measure_torch(x, w, dy, settings, row)
                else:
                    r = measure_jax(provider, x, w, dy, settings, row)
            except Exception as e:
                record["failures"].append({"provider": provider, "M": m, "N": n,
                                           "error": f"{type(e).__name__}: {e}"[:500]})
                traceback.print_exc(limit=3)
                continue
            record["rows"].append(r)
            for problem in problems(r, args.dtype, device.platform == "gpu"):
                record["failures"].append({"provider": provider, "M": m, "N": n,
                                           "error": problem})
        del x, w, dy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        record["seconds"] = time.perf_counter() - began
        # After every shape: a run cut short still leaves what it measured.
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{m}x{n} done at {record['seconds']:.0f} s", file=sys.stderr)
    print(f"wrote {path}")
    print_table(record)
    return record


if __name__ == "__main__":
    main()
