import os

import pytest
import torch


def pytest_configure(config):
    """The CuTe DSL's package folder goes on ``sys.path`` in every process, xdist's controller
    too: a worker sends each warning by its category's module (``cutlass.base_dsl``'s own
    classes for the DSL's), which the controller imports to re-raise it, and a failed import
    there takes the whole run down.

    Where $TILENORM_CUTILE_RECORD names a file, each cuTile variant the tests compile for
    the lean launch is appended to it (tilenorm.launch.aot.variant_record; xdist workers
    share the file, a line at a time): the GPU suite's record, which a machine without a GPU
    builds into cuTile's cache for the next run (bench/experiments/gpu_suite_caches.py,
    bench/NOTES.md #118)."""
    from tilenorm.launch import cute

    cute.available()
    path = os.environ.get("TILENORM_CUTILE_RECORD")
    if not path:
        return
    from tilenorm.launch import aot, driver

    compiled_cubin, seen = driver.compiled_cubin, set()

    def recording(bound, layouts, arch):
        line = aot.variant_record(bound, layouts, arch)
        if line is not None and line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return compiled_cubin(bound, layouts, arch)

    driver.compiled_cubin = recording


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compiled_as_custom_ops(monkeypatch):
    """Under torch.compile every norm is tilenorm's custom op, however small (the tests' shapes
    are small enough to be left to inductor otherwise: tilenorm.dispatch.compiled_by_inductor)."""
    from tilenorm import dispatch

    monkeypatch.setattr(dispatch, "COMPILED_INDUCTOR_MAX_BYTES", -1)


@pytest.fixture
def cluster_launches(monkeypatch) -> list:
    """The cluster backward's launches from the torch call path: a call that fell back to
    cuTile (also accurate and deterministic) would pass every value check."""
    from tilenorm.pytorch.calls import BackwardCall

    launches = []
    run = BackwardCall._run_cute_cluster
    monkeypatch.setattr(BackwardCall, "_run_cute_cluster",
                        lambda self, *a: launches.append(self.cute) or run(self, *a))
    return launches


@pytest.fixture
def decide_as_class(monkeypatch):
    """``decide_as_class(device_class)``: the ops decide on this GPU with the settings of
    ``device_class`` (tilenorm.settings.device_class: the device's bandwidth stands in for
    that class's), so the entries of every class's tables run on any Hopper GPU. Decisions
    and prepared calls are forgotten before and after."""
    import dataclasses

    from tests.kernel_harness import BANDWIDTH
    from tilenorm import dispatch
    from tilenorm.device import device_info
    from tilenorm.pytorch import calls

    def forget():
        dispatch.decide.cache_clear()
        dispatch.decide_fp8.cache_clear()
        calls.clear()

    def use(device_class: str) -> None:
        def info(index):
            return dataclasses.replace(device_info(index),
                                       memory_bandwidth=BANDWIDTH[device_class])

        monkeypatch.setattr(dispatch, "device_info", info)
        forget()

    yield use
    forget()
