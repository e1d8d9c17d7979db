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
