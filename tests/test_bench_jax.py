"""bench/bench_jax.py on the CPU: the ``--smoke`` run through ``main(argv)`` (every JAX
provider, the float64 check, host microseconds, the record), and that each provider's programs
lower for CUDA to what its name says (tilenorm.jax to the FFI calls, the jnp reference not)."""

from __future__ import annotations

import json
import math

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402

from bench import bench_jax  # noqa: E402
from tests.test_jax_gpu import kernel_path_without_gpu  # noqa: E402, F401 (a fixture)
from tilenorm.jax import native  # noqa: E402


def test_smoke_run_records_every_jax_provider(tmp_path):
    """On JAX's default backend: the CPU here (and wherever test_jax.py was imported first);
    the GPU where this module runs alone on the GPU host."""
    out = tmp_path / "jax.json"
    returned = bench_jax.main(["--smoke", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["rows"] == returned["rows"]
    assert not record["failures"], record["failures"]
    on_gpu = jax.devices()[0].platform == "gpu"
    assert record["platform"] == jax.devices()[0].platform and record["copy_gbps"] > 0
    # Without a GPU for torch: recorded as absent with the reason, not failed.
    torch_side = on_gpu and bench_jax.torch.cuda.is_available()
    assert set(record["absent"]) == (set() if torch_side else {bench_jax.TORCH_SIDE})
    rows = {r["provider"]: r for r in record["rows"]}
    side = {bench_jax.TORCH_SIDE} if torch_side else set()
    assert set(rows) == set(bench_jax.JAX_PROVIDERS) | side
    for r in rows.values():
        assert (r["M"], r["N"], r["dtype"]) == (64, 256, "bfloat16")
        if r["provider"] != bench_jax.TORCH_SIDE:
            kernels = on_gpu and r["provider"] == "tilenorm.jax"
            assert r["ffi_calls"] == [native.FORWARD_TARGET, native.BACKWARD_TARGET] * kernels
        for key in ("fwd_ms", "step_ms", "fwd_gbps", "step_gbps"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["provider"], key)
        assert r["fwd_err"] <= 1e-2 and r["bwd_err"] <= 3e-2, r["provider"]
    assert {o["provider"] for o in record["overhead"]} == set(bench_jax.JAX_PROVIDERS)
    assert all(o["fwd_host_us"] > 0 and o["step_host_us"] > 0 for o in record["overhead"])


@pytest.mark.usefixtures("kernel_path_without_gpu")
@pytest.mark.parametrize("provider", bench_jax.JAX_PROVIDERS)
def test_provider_lowers_for_cuda_as_named(provider):
    native.register_targets()
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256,), jnp.bfloat16)
    norm = bench_jax.norm_fn(provider, jnp.bfloat16)
    with bench_jax.tracing(provider):
        fwd, step = (jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                     for fn, args in ((norm, (x, w)), (bench_jax.step_fn(norm), (x, w, x))))
    kernels = provider == "tilenorm.jax"
    assert (native.FORWARD_TARGET in fwd) == kernels
    assert (native.FORWARD_TARGET in step and native.BACKWARD_TARGET in step) == kernels


def test_torch_side_row_and_table(monkeypatch, capsys):
    """The torch side's code path on the CPU: CUDA-graph timing and the CUDA synchronize
    stood in for (tilenorm's torch ops take their reference path here)."""
    monkeypatch.setattr(bench_jax.common, "graph_ms", lambda fn: (fn(), 0.5)[1])
    monkeypatch.setattr(bench_jax.torch.cuda, "synchronize", lambda: None)
    settings = bench_jax.Settings(smoke=True)
    x, w, dy = bench_jax.inputs(64, 256, jnp.bfloat16)
    row = {"op": "rms_norm", "dtype": "bfloat16", "M": 64, "N": 256}
    ours = bench_jax.measure_jax("tilenorm.jax", x, w, dy, settings, row)
    side = bench_jax.measure_torch(x, w, dy, settings, row)
    assert (side["fwd_ms"], side["bwd_ms"], side["step_ms"]) == (0.5, 0.5, 1.0)
    assert side["fwd_b2b_ms"] > 0 and side["step_b2b_ms"] > 0
    # No CUDA device for torch's profiler here: no kernel time, and the table shows none.
    assert side["fwd_kernel_ms"] is side["step_kernel_ms"] is ours["fwd_kernel_ms"] is None
    assert not bench_jax.problems(side, "bfloat16", on_gpu=True)
    # On a GPU a tilenorm.jax row without its FFI calls measured the reference path.
    both = [native.FORWARD_TARGET, native.BACKWARD_TARGET]
    for calls, on_gpu, wrong in (([], True, 1), ([], False, 0), (both, True, 0)):
        assert len(bench_jax.problems({**ours, "ffi_calls": calls}, "bfloat16", on_gpu)) == wrong
    bench_jax.print_table({"device": "cpu", "dtype": "bfloat16", "copy_gbps": 10.0,
                           "rows": [ours, side], "overhead": [], "absent": {},
                           "failures": []})
    table = capsys.readouterr().out
    ratio = 100 * (ours["fwd_ms"] / 0.5 - 1)
    assert f"{ratio:+.1f}%" in table
    profiled = {"fwd_kernel_ms": 0.5, "step_kernel_ms": 1.0}
    bench_jax.print_table({"device": "cpu", "dtype": "bfloat16", "copy_gbps": 10.0,
                           "rows": [{**ours, "fwd_kernel_ms": 0.53, "step_kernel_ms": 0.99},
                                    {**side, **profiled}],
                           "overhead": [], "absent": {}, "failures": []})
    ours_line = next(line for line in capsys.readouterr().out.splitlines()
                     if "tilenorm.jax" in line)
    assert "+6.0%" in ours_line and "-1.0%" in ours_line


def test_gpu_us_sums_the_gpu_work_of_a_trace():
    """Kernels, memsets and copies count; host-side events and others do not."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "dur": 10.0}, {"ph": "X", "cat": "gpu_memset", "dur": 2.5},
        {"ph": "X", "cat": "gpu_memcpy", "dur": 1.5}, {"ph": "X", "cat": "cuda_runtime",
                                                        "dur": 100.0},
        {"ph": "X", "cat": "cpu_op", "dur": 50.0}, {"ph": "M", "cat": "kernel", "dur": 7.0},
        {"ph": "f", "cat": "ac2g"}]}
    assert bench_jax.gpu_us(trace) == 14.0
    assert bench_jax.gpu_us({}) == 0.0
    off = bench_jax.Settings(smoke=True, kernel_time=False)
    assert off.profiled_calls == 0 and bench_jax.kernel_ms(lambda: None, off) is None


def test_ffi_targets_name_the_cute_forward():
    """A forward that runs the CuTe kernel holds a ``cute_ffi.TARGET_PREFIX`` call, not
    cuTile's target: the row still counts as the kernel path (the H100 run at b22a35d
    flagged such rows as the reference path)."""

    class Compiled:
        def __init__(self, text: str):
            self.text = text

        def as_text(self) -> str:
            return self.text

    cute_target = bench_jax.cute_ffi.TARGET_PREFIX + "0123abcd"
    fwd = Compiled(f'custom_call_target="{cute_target}"')
    step = Compiled(f'"{cute_target}" "{native.BACKWARD_TARGET}"')
    calls = bench_jax.ffi_targets(fwd, step)
    assert calls == [cute_target, native.BACKWARD_TARGET]
    assert bench_jax.ffi_targets(Compiled(""), Compiled("")) == []
    # the cluster widths: the CuTe cluster backward's call, then cuTile's column sums
    backward = bench_jax.cute_ffi.BACKWARD_TARGET_PREFIX + "4567ef"
    step = Compiled(f'"{cute_target}" "{backward}" "{native.BACKWARD_TARGET}"')
    assert bench_jax.ffi_targets(fwd, step) == [cute_target, backward,
                                                native.BACKWARD_TARGET]
