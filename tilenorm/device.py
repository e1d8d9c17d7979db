"""Device properties through cuda-python's driver bindings (no GPU needed to import)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tilenorm.settings import DeviceClass, device_class


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    sm_count: int
    arch: tuple[int, int]
    l2_bytes: int
    #: Peak DRAM bandwidth, bytes a second: the memory clock times the bus width, two
    #: transfers a clock; 0 where unknown (a device described without it).
    memory_bandwidth: int = 0

    @property
    def sm(self) -> str:
        return f"sm_{self.arch[0]}{self.arch[1]}"

    @property
    def device_class(self) -> DeviceClass:
        """Which measured tables the planner takes on this device
        (:func:`tilenorm.settings.device_class`)."""
        return device_class(self.arch, self.memory_bandwidth)


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
    try:  # memory clock in kHz, bus width in bits
        bandwidth = (2 * get(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) * 1000
                     * get(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) // 8)
    except RuntimeError:  # a driver that does not report them: the default tables
        bandwidth = 0
    return DeviceInfo(
        index=index,
        name=name,
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        arch=(get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
              get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        l2_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        memory_bandwidth=bandwidth,
    )


#: An empty kernel, loaded once per device as the stand-in whose cluster occupancy
#: :func:`max_active_clusters` asks the driver for (sm_90 PTX: the driver builds it for the
#: device, Blackwell included).
_STAND_IN_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry tilenorm_stand_in() { ret; }
\0"""


@functools.cache
def max_active_clusters(index: int, cluster: int, threads: int, ctas_per_sm: int) -> int:
    """Clusters of ``cluster`` CTAs of ``threads`` threads that device ``index`` holds at once
    at ``ctas_per_sm`` CTAs an SM (``cuOccupancyMaxActiveClusters``, which knows how the SMs
    are grouped). Asked of an empty stand-in kernel whose dynamic shared memory allows exactly
    ``ctas_per_sm`` CTAs an SM: a kernel compiled for that residency (``min_blocks_per_mp``)
    whose registers and shared memory allow it runs as the stand-in does, and the stand-in
    needs no compile of the kernel. Cached per device and shape: a call costs a dict look-up."""
    from cuda.bindings import driver

    _check(driver.cuInit(0))
    dev = _check(driver.cuDeviceGet(index))
    attr = driver.CUdevice_attribute

    def get(a):
        return _check(driver.cuDeviceGetAttribute(a, dev))

    per_sm = get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
    reserved = get(attr.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)
    most = get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    shared = min(most, per_sm // ctas_per_sm - reserved)
    context = _check(driver.cuDevicePrimaryCtxRetain(dev))
    try:
        _check(driver.cuCtxPushCurrent(context))
        try:
            library = _check(driver.cuLibraryLoadData(_STAND_IN_PTX, None, None, 0, None,
                                                      None, 0))
            try:
                func = _check(driver.cuKernelGetFunction(
                    _check(driver.cuLibraryGetKernel(library, b"tilenorm_stand_in"))))
                _check(driver.cuFuncSetAttribute(
                    func,
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared))
                config = driver.CUlaunchConfig()
                config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
                config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
                config.sharedMemBytes = shared
                dims = driver.CUlaunchAttribute()
                dims.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                value = driver.CUlaunchAttributeValue()
                value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster, 1, 1
                dims.value = value
                config.numAttrs = 1
                config.attrs = [dims]
                return _check(driver.cuOccupancyMaxActiveClusters(func, config))
            finally:
                _check(driver.cuLibraryUnload(library))
        finally:
            _check(driver.cuCtxPopCurrent())
    finally:
        _check(driver.cuDevicePrimaryCtxRelease(dev))
