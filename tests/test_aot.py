"""Every kernel configuration the planner can choose, and every feature and dtype combination
the ops accept, builds ahead of time for Hopper and Blackwell on a machine with no GPU."""

import pytest

from tilenorm.launch.aot import GPU_CODES, export, jobs

JOBS = list(jobs())


@pytest.mark.aot
@pytest.mark.parametrize("gpu_code", GPU_CODES)
@pytest.mark.parametrize("job", JOBS, ids=[j.label for j in JOBS])
def test_kernel_builds(job, gpu_code):
    cubin = export(job, gpu_code)
    assert cubin[:4] == b"\x7fELF", "a cubin is an ELF image"


def test_builds_with_the_compiler_beside_it_when_cuda_home_names_an_older_cuda(tmp_path):
    """CUDA_HOME naming an older CUDA (the GPU host's is 13.0, whose ptxas and libnvvm cannot
    build Tile IR 13.4) must not reach the compiler: tilenorm's dependencies install cuTile's
    compiler with the ptxas and libnvvm of its own release, and cuTile runs it without
    CUDA_HOME. Here CUDA_HOME's tools fail outright, and the build must not notice."""
    import importlib.metadata
    import os
    import subprocess
    import sys

    versions = {importlib.metadata.version(name)[:4] for name in
                ("nvidia-cuda-tileiras", "nvidia-cuda-nvcc", "nvidia-nvvm")}
    assert len(versions) == 1, f"the compiler wheels must be of one release: {versions}"
    old = tmp_path / "cuda-13.0"
    for tool in ("bin/ptxas", "bin/tileiras", "nvvm/bin/cicc"):
        path = old / tool
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\necho 'the old CUDA was used' >&2\nexit 5\n")
        path.chmod(0o755)
    (old / "nvvm" / "lib64").mkdir(parents=True)
    (old / "nvvm" / "lib64" / "libnvvm.so").write_text("not a library")
    env = {**os.environ, "CUDA_HOME": str(old), "CUDA_PATH": str(old),
           "CUDA_TILE_CACHE_DIR": "off"}
    code = ("from tilenorm.launch.aot import export, jobs\n"
            "print(len(export(next(iter(jobs())), 'sm_90')))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) > 0


def test_recorded_variants_rebuild_the_same_exports(monkeypatch):
    """A variant recorded where it ran (what the GPU suite records for the CPU to build into
    cuTile's cache, bench/NOTES.md #118) rebuilds the export it was: the same kernel and
    signature, for every kind of kernel the jobs bind (64-bit indexing, column_sums, FP8)."""
    from tilenorm.launch import aot

    bound_layouts = []
    real = aot.signature
    monkeypatch.setattr(aot, "signature", lambda bound, arrays: bound_layouts.append(
        (bound, arrays)) or real(bound, arrays))
    built = list(jobs())
    monkeypatch.undo()
    assert len(bound_layouts) == len(built)
    for (bound, arrays), job in zip(bound_layouts, built, strict=True):
        line = aot.variant_record(bound, arrays, (9, 0))
        assert line is not None, job.label
        rebuilt, gpu_code = aot.recorded_job(line)
        assert gpu_code == "sm_90"
        assert rebuilt.kernel is job.kernel, job.label
        assert rebuilt.signature.symbol == job.signature.symbol, job.label
