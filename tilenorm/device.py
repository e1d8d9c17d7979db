"""Device properties through cuda-python's driver bindings (no GPU needed to import)."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    sm_count: int
    arch: tuple[int, int]
    l2_bytes: int

    @property
    def sm(self) -> str:
        return f"sm_{self.arch[0]}{self.arch[1]}"


def _check(result):
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver call failed: {err.name}: {text.decode()}")
    return values[0] if len(values) == 1 else values


@functools.cache
def device_info(index: int) -> DeviceInfo:
    """Properties of CUDA device ``index`` (as numbered under CUDA_VISIBLE_DEVICES)."""
    from cuda.bindings import driver

    _check(driver.cuInit(0))
    dev = _check(driver.cuDeviceGet(index))
    attr = driver.CUdevice_attribute

    def get(a):
        return _check(driver.cuDeviceGetAttribute(a, dev))

    name = _check(driver.cuDeviceGetName(256, dev)).split(b"\0", 1)[0].decode()
    return DeviceInfo(
        index=index,
        name=name,
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        arch=(get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
              get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        l2_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
    )
