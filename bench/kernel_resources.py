"""Registers, spills and shared memory of every kernel configuration the planner chooses, read
off the cubins on a machine without a GPU (bench/NOTES.md, #13). The kernels are exported ahead
of time (:mod:`tilenorm.launch.aot`) with the signature the ops' lean launch compiles for
contiguous tensors, so the code is the code that runs; ``cuobjdump`` reads the resource usage
and the SASS (pip: nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm).

    python bench/kernel_resources.py [--gpu-code sm_90] [--ops rms,layer_norm]
    python bench/kernel_resources.py --fp8        # the FP8-output kernels (tilenorm.fp8)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tilenorm.launch import aot  # noqa: E402


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH or from the nvidia-cuda-cuobjdump wheel; None where neither is."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13
    except ImportError:
        return None
    tool = Path(nvidia.cu13.__path__[0]) / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else None


def cuobjdump() -> str:
    tool = find_cuobjdump()
    if tool is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump "
                         "nvidia-cuda-nvdisasm")
    return tool


def cubin_resources(cubin: Path, tool: str) -> tuple[dict, str]:
    """Registers, stack and static shared bytes of a cubin file and its spill stores / loads
    (``STL`` / ``LDL`` in the SASS); and the SASS, for other counts."""
    # cuobjdump -sass runs nvdisasm, found on PATH: the wheels put it beside cuobjdump.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(tool).parent),
                                                  os.environ.get("PATH", "")])}
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True, env=env).stdout
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True, env=env).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    return ({"registers": int(m[1]), "stack": int(m[2]), "shared": int(m[3]),
             "spill_stores": len(re.findall(r"\bSTL\b", sass)),
             "spill_loads": len(re.findall(r"\bLDL\b", sass))}, sass)


@contextlib.contextmanager
def keeping_cubins(dump_dir: str) -> Iterator[None]:
    """Every ``cute.compile`` inside keeps its cubin in ``dump_dir`` (the launch module's
    compile takes no such option): the CuTe DSL kernels' cubins, for :func:`cubin_resources`."""
    from tilenorm.launch import cute as launch_cute

    launch_cute.available()  # puts the DSL's package folder on sys.path
    import cutlass.cute as dsl

    compile_ = dsl.compile

    def keeping(*args, options: str = "", **kwargs):
        return compile_(*args, options=f"{options} --keep-cubin --dump-dir {dump_dir}",
                        **kwargs)
    dsl.compile = keeping
    try:
        yield
    finally:
        dsl.compile = compile_


def resources(job: aot.ExportJob, gpu_code: str, tool: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(aot.export(job, gpu_code))
        f.flush()
        return cubin_resources(Path(f.name), tool)[0]


def fp8_jobs() -> list[tuple[aot.ExportJob, str]]:
    """(job, hints) of the FP8 kernels on every tile configuration: the row kernel with each
    scaling its tile takes and with the per-program column amaxes of a per-row copy, the
    second pass (current scaling, transposed), the transposed copies with scales along M,
    the column-amax reduction and the MX scale swizzle, the FP8-input backward."""
    from tilenorm.launch.cutile_fp8 import BLOCK_COLS

    out = []
    for plan in aot.fp8_plans("forward"):
        hints = f"occ {plan.occupancy}, warps {plan.worker_warps or '-'}"
        for scaling in ("amax", "delayed", "row", "block", "mx"):
            if plan.tile_cols >= BLOCK_COLS.get(scaling, 16):
                out.append((aot.fp8_row_job(plan, aot.Fp8Variant("rms", aot.FP8_RMS,
                                                                 scaling)), hints))
        out.append((aot.fp8_row_job(plan, aot.Fp8Variant("rms", aot.FP8_RMS,
                                                         column_amax=True)), hints))
    out.append((aot.fp8_quantize_job(aot.Fp8Variant("rms", aot.FP8_RMS), True, True),
                "second pass"))
    for scaling in ("row", "block", "mx"):
        out.append((aot.fp8_transposed_job(aot.Fp8Variant("rms", aot.FP8_RMS, scaling)),
                    "transposed copy"))
    out.append((aot.fp8_column_amax_job(264, 4096, True), "column amax"))
    out.append((aot.fp8_mx_swizzle_job(65536, 128, True), "mx swizzle"))
    for plan in aot.fp8_plans("backward"):
        variant = aot.Fp8Variant("rms group 16", aot.replace(aot.FP8_RMS, group=16))
        out.append((aot.fp8_backward_job(plan, variant),
                    f"occ {plan.occupancy}, warps {plan.worker_warps or '-'}"))
    return out


def _print(job: aot.ExportJob, hints: str, gpu_code: str, tool: str) -> None:
    r = resources(job, gpu_code, tool)
    flag = "  SPILLS" if r["stack"] else ""
    print(f"{job.label:>44} {hints:>18} {r['registers']:>5} {r['stack']:>6} "
          f"{r['shared']:>7} {r['spill_stores']:>3}/{r['spill_loads']:<4}{flag}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-code", default="sm_90")
    parser.add_argument("--ops", default="rms,layer_norm")
    parser.add_argument("--fp8", action="store_true", help="the FP8-output kernels instead")
    args = parser.parse_args()
    tool = cuobjdump()
    print(f"{'kernel':>44} {'hints':>18} {'regs':>5} {'stack':>6} {'smem':>7} {'STL/LDL':>8}")
    if args.fp8:
        for job, hints in fp8_jobs():
            _print(job, hints, args.gpu_code, tool)
        return
    for direction in ("forward", "backward"):
        for name in args.ops.split(","):
            v = aot.OP_VARIANTS[name]
            for plan in aot.plans(direction, aot.op_of(v)):
                for job in aot.plan_jobs(plan, v):
                    hints = f"occ {plan.occupancy}, warps {plan.worker_warps or '-'}"
                    _print(job, hints, args.gpu_code, tool)


if __name__ == "__main__":
    main()
