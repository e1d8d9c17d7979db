"""Launches a bound cuTile kernel from raw device pointers through the CUDA driver: the lean
path that keeps a call's host cost near the driver's own.

``cuda.tile``'s launch inspects every argument on every call (DLPack, specialization bits,
a key lookup): 7-12 us for a forward's 21 arguments on an H200 host (bench/NOTES.md #21).
Here all of that happens once per operand layout (dtypes, shapes, strides): the kernel is
compiled for the constraints cuTile's just-in-time path derives from such operands
(``export_kernel``, which shares cuTile's compiler, options and disk cache), loaded with
``cuLibraryLoadData``, and its parameter block (cuTile's calling convention: each array as a
64-bit base pointer then its shapes then its strides, in 32- or 64-bit integers; each scalar
in its own type; every parameter at its natural alignment) is filled in once. A call writes
the data pointers and runtime scalars into that block and calls ``cuLaunchKernelEx``.

The compiled code assumes what the layout promised, 16-byte aligned base addresses included:
a call whose pointers are not aligned launches nothing and returns False, and the caller takes
cuTile's own launch, which compiles for what it is given.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
from dataclasses import dataclass

import cuda.tile as ct
from cuda.tile.compilation import (
    ArrayConstraint,
    CallingConvention,
    ConstantConstraint,
    KernelSignature,
    ScalarConstraint,
    export_kernel,
)

from tilenorm.launch.cutile import BoundKernel

_TILE_DTYPES = {"bfloat16": ct.bfloat16, "float16": ct.float16, "float32": ct.float32,
                "float8_e4m3fn": ct.float8_e4m3fn, "float8_e5m2": ct.float8_e5m2,
                # MXFP8's E8M0 scales, stored as their bytes
                "uint8": ct.uint8}
#: cuda.h, CUlaunchAttributeID: programmatic dependent launch.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@dataclass(frozen=True)
class ArrayLayout:
    """An array operand as a kernel sees it: dtype name, shape and strides in elements."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def disjoint(self) -> bool:
        """No two elements share an address (cuTile compiles overlapping arrays apart)."""
        extent = 1
        for size, stride in sorted((d for d in zip(self.shape, self.strides, strict=True)
                                    if d[0] > 1), key=lambda d: d[1]):
            if stride < extent:
                return False
            extent = stride * size
        return True


def array_constraint(layout: ArrayLayout, index_bits: int) -> ArrayConstraint:
    """The constraints cuTile's launch derives from an array of this layout whose base
    address is 16-byte aligned: unit strides and extents are constants, other strides and
    extents are marked where they divide into 16 bytes and 16 elements."""
    dtype = _TILE_DTYPES[layout.dtype]
    per_16_bytes = 128 // dtype.bitwidth
    return ArrayConstraint(
        dtype, len(layout.shape), index_dtype=ct.int64 if index_bits == 64 else ct.int32,
        stride_lower_bound_incl=[None if s == 1 else 0 for s in layout.strides],
        alias_groups=[], may_alias_internally=False,
        stride_constant=[1 if s == 1 else None for s in layout.strides],
        shape_constant=[1 if d == 1 else None for d in layout.shape],
        stride_divisible_by=[per_16_bytes if s % per_16_bytes == 0 else 1
                             for s in layout.strides],
        shape_divisible_by=[16 if d % 16 == 0 else 1 for d in layout.shape],
        base_addr_divisible_by=16)


F32 = ScalarConstraint(ct.float32)


def _is_constant(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "Const" in text


def _scalars(bound: BoundKernel) -> tuple[int, tuple[float, ...]]:
    """(how many fp32 scalars a launch passes, the values of the bound's own fp32 scalars
    that follow them, such as 1/N). The bound's other values are ``ct.Constant``s."""
    fn = bound.source
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    trailing = names[len(names) - len(bound.constants):]
    runtime = len(names) - len(bound.arrays) - len(bound.constants)
    values = tuple(value for name, value in zip(trailing, bound.constants, strict=True)
                   if not _is_constant(fn.__annotations__[name]))
    return runtime, values


def signature(bound: BoundKernel, layouts: tuple[ArrayLayout, ...]) -> KernelSignature:
    """The kernel's signature for arrays of these layouts (in ``bound.arrays`` order): its
    runtime scalars as fp32 scalars, its ``ct.Constant`` parameters as the bound values (the
    signature cuTile's own launch derives from such operands)."""
    fn = bound.source
    trailing = fn.__code__.co_varnames[:fn.__code__.co_argcount][-len(bound.constants):]
    runtime, _ = _scalars(bound)
    params = [array_constraint(layout, bound.index_bits) for layout in layouts]
    params += [F32] * runtime
    for name, value in zip(trailing, bound.constants, strict=True):
        params.append(ConstantConstraint(value) if _is_constant(fn.__annotations__[name])
                      else F32)
    return KernelSignature(params, CallingConvention.cutile_python_v2()).with_mangled_symbol(
        fn.__name__)


#: Cubins by (kernel, mangled symbol, GPU code): the symbol spells out every constraint of
#: the signature, constants included. Bounded like the per-layout calls that hold them.
_CUBINS: dict = {}
MAX_CUBINS = 1024


def compiled_cubin(bound: BoundKernel, layouts: tuple[ArrayLayout, ...],
                   arch: tuple[int, int]) -> tuple[str, bytes]:
    """(entry symbol, cubin) of ``bound`` for arrays of ``layouts`` on compute capability
    ``arch``: cuTile's compiler with the kernel's own options and cuTile's disk cache. Runs
    without a GPU."""
    sig = signature(bound, layouts)
    gpu_code = f"sm_{arch[0]}{arch[1]}"
    key = (bound.kernel, sig.symbol, gpu_code)
    cubin = _CUBINS.get(key)
    if cubin is None:
        out = io.BytesIO()
        export_kernel(bound.kernel, [sig], out, gpu_code=gpu_code, output_format="cubin")
        if len(_CUBINS) >= MAX_CUBINS:
            _CUBINS.clear()
        cubin = _CUBINS[key] = out.getvalue()
    return sig.symbol, cubin


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte value union (its first member an int)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _driver():
    """libcuda through ctypes. ``cuLaunchKernelEx`` is called with the GIL held (PyDLL), so
    no other Python thread can rewrite a parameter block while the driver copies it."""
    vp, p = ctypes.c_void_p, ctypes.POINTER
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuLibraryLoadData.argtypes = [p(vp), ctypes.c_char_p, vp, vp, ctypes.c_uint, vp, vp,
                                     ctypes.c_uint]
    cu.cuLibraryGetKernel.argtypes = [p(vp), vp, ctypes.c_char_p]
    cu.cuKernelGetFunction.argtypes = [p(vp), vp]
    cu.cuKernelGetParamInfo.argtypes = [vp, ctypes.c_size_t, p(ctypes.c_size_t),
                                        p(ctypes.c_size_t)]
    cu.cuGetErrorString.argtypes = [ctypes.c_int, p(ctypes.c_char_p)]
    cu.cuDeviceGet.argtypes = [p(ctypes.c_int), ctypes.c_int]
    cu.cuDevicePrimaryCtxRetain.argtypes = [p(vp), ctypes.c_int]
    cu.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    cu.cuCtxPushCurrent_v2.argtypes = [vp]
    cu.cuCtxPopCurrent_v2.argtypes = [p(vp)]
    cu.cuCtxSetCurrent.argtypes = [vp]
    launch = ctypes.PyDLL("libcuda.so.1").cuLaunchKernelEx
    launch.argtypes = [vp, vp, vp, vp]
    launch.restype = ctypes.c_int
    return cu, launch


def _check(result: int, what: str) -> None:
    if result:
        text = ctypes.c_char_p()
        _driver()[0].cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {result}: "
                           f"{(text.value or b'unknown').decode()}")


@functools.lru_cache(maxsize=1024)
def _kernel_handle(cubin: bytes, symbol: str) -> tuple:
    """(CUlibrary, CUkernel) of ``symbol`` in ``cubin``, loaded once per process."""
    cu, _ = _driver()
    library, kernel = ctypes.c_void_p(), ctypes.c_void_p()
    _check(cu.cuLibraryLoadData(ctypes.byref(library), cubin, None, None, 0, None, None, 0),
           "cuLibraryLoadData")
    _check(cu.cuLibraryGetKernel(ctypes.byref(kernel), library, symbol.encode()),
           "cuLibraryGetKernel")
    return library, kernel


@contextlib.contextmanager
def _primary(device_index: int):
    """Device ``device_index``'s primary context (the one torch and cuTile use), retained for
    the block."""
    cu, _ = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(cu.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
           "cuDevicePrimaryCtxRetain")
    try:
        yield context
    finally:
        cu.cuDevicePrimaryCtxRelease_v2(device)


@contextlib.contextmanager
def _primary_context(device_index: int):
    """The device's primary context current on this thread for the block: a thread that has
    not touched CUDA yet (autograd's backward thread, say) has none."""
    cu, _ = _driver()
    with _primary(device_index) as context:
        _check(cu.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _check(cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


#: cuda.h: CUDA_ERROR_INVALID_CONTEXT.
_INVALID_CONTEXT = 201


def _make_primary_context_current(device_index: int) -> None:
    """Make the device's primary context current on this thread for good, as the CUDA
    runtime does on a thread's first runtime call: a launch on the legacy default stream
    takes the thread's current context."""
    with _primary(device_index) as context:
        _check(_driver()[0].cuCtxSetCurrent(context), "cuCtxSetCurrent")


@dataclass(frozen=True)
class LaunchRecipe:
    """A :class:`DriverLaunch` as plain data, for a launcher in another language (the C++
    one of :mod:`tilenorm.pytorch.native`): copy :attr:`params`, write each runtime pointer
    (64-bit) and fp32 scalar at its byte offset, and pass ``cuLaunchKernelEx`` the
    addresses of the parameters at :attr:`param_offsets` with the grid, block (1, 1, 1)
    and, where :attr:`dependent_launch`, programmatic stream serialization. The launch
    assumes what the layouts promised: 16-byte aligned pointers."""

    #: The ``CUkernel`` handle (context-independent, loaded with ``cuLibraryLoadData``).
    kernel: int
    grid: tuple[int, int, int]
    dependent_launch: bool
    #: The parameter block with the shapes, strides and fixed values written.
    params: bytes
    param_offsets: tuple[int, ...]
    #: (array name in the kernel's order, byte offset) of each runtime pointer.
    arrays: tuple[tuple[str, int], ...]
    #: (parameter name, byte offset) of each runtime fp32 scalar.
    scalars: tuple[tuple[str, int], ...]


def _fields(sig: KernelSignature, layouts: tuple[ArrayLayout, ...]) -> list[tuple]:
    """(field name, ctypes type, role) per kernel parameter; roles: ("ptr", i),
    ("dim", value) for a shape or stride, ("scalar", i)."""
    out, arrays, scalars = [], 0, 0
    for c in sig.parameters:
        if isinstance(c, ConstantConstraint):
            continue
        if isinstance(c, ArrayConstraint):
            index = ctypes.c_int64 if c.index_dtype.bitwidth == 64 else ctypes.c_int32
            layout = layouts[arrays]
            out.append((f"a{arrays}", ctypes.c_uint64, ("ptr", arrays)))
            out += [(f"a{arrays}_d{d}", index, ("dim", v))
                    for d, v in enumerate(layout.shape + layout.strides)]
            arrays += 1
        else:
            out.append((f"s{scalars}", ctypes.c_float, ("scalar", scalars)))
            scalars += 1
    return out


class DriverLaunch:
    """``bound``'s kernel compiled for arrays of ``layouts`` on GPU ``device_index`` of compute
    capability ``arch``, ready to launch from raw pointers. Arrays whose index is in
    ``fixed_arrays``
    and the scalars past the runtime ones (the bound's own, such as 1/N) are written once;
    :attr:`launch` takes ``(stream, *pointers, *scalars)`` for the rest, in order, and
    returns False, launching nothing, when a pointer is not 16-byte aligned."""

    def __init__(self, bound: BoundKernel, layouts: tuple[ArrayLayout, ...],
                 device_index: int, arch: tuple[int, int],
                 fixed_arrays: dict[int, int] | None = None,
                 fixed_scalars: dict[int, float] | None = None):
        if len(layouts) != len(bound.arrays):
            raise ValueError(f"{bound.name} takes {len(bound.arrays)} arrays, got "
                             f"{len(layouts)} layouts")
        if not all(layout.disjoint for layout in layouts):
            raise ValueError("overlapping arrays take cuTile's own launch")
        fixed_arrays, fixed_scalars = dict(fixed_arrays or {}), dict(fixed_scalars or {})
        self.symbol, self.cubin = compiled_cubin(bound, layouts, arch)
        cu, launch = _driver()
        self.library, self.kernel = _kernel_handle(self.cubin, self.symbol)
        fields = _fields(signature(bound, layouts), layouts)
        params_type = type("Params", (ctypes.Structure,),
                           {"_fields_": [(name, ty) for name, ty, _ in fields]})
        self.params = params = params_type()
        with _primary_context(device_index):
            function = ctypes.c_void_p()  # loads it into the context now, not mid-capture
            _check(cu.cuKernelGetFunction(ctypes.byref(function), self.kernel),
                   "cuKernelGetFunction")
            for index, (name, ty, _) in enumerate(fields):  # the driver's view of the layout
                offset, size = ctypes.c_size_t(), ctypes.c_size_t()
                _check(cu.cuKernelGetParamInfo(self.kernel, index, ctypes.byref(offset),
                                               ctypes.byref(size)), "cuKernelGetParamInfo")
                if (offset.value, size.value) != (getattr(params_type, name).offset,
                                                  ctypes.sizeof(ty)):
                    raise RuntimeError(f"{self.symbol}: parameter {index} is at "
                                       f"{offset.value}+{size.value} in the cubin, not where "
                                       f"cuTile's calling convention puts it")
        runtime, own = _scalars(bound)
        for pos, value in enumerate(own):
            fixed_scalars[runtime + pos] = value
        pointers, scalars = [], []
        runtime_arrays, runtime_scalars = [], []
        scalar_names = bound.source.__code__.co_varnames[len(bound.arrays):]
        for name, _, (role, value) in fields:
            if role == "dim":
                setattr(params, name, value)
            elif role == "ptr" and value in fixed_arrays:
                setattr(params, name, fixed_arrays[value])
            elif role == "scalar" and value in fixed_scalars:
                setattr(params, name, fixed_scalars[value])
            elif role == "ptr":
                pointers.append(name)
                runtime_arrays.append((bound.arrays[value], getattr(params_type, name).offset))
            else:
                scalars.append(name)
                runtime_scalars.append((scalar_names[value], getattr(params_type, name).offset))
        base = ctypes.addressof(params)
        self.kernel_params = (ctypes.c_void_p * len(fields))(
            *[base + getattr(params_type, name).offset for name, _, _ in fields])
        self.attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        gx, gy, gz = bound.grid
        dependent = bound.dependent_launch
        self.config = _LaunchConfig(gx, gy, gz, 1, 1, 1, 0, None,
                                    ctypes.pointer(self.attribute) if dependent else None,
                                    int(dependent))
        self.recipe = LaunchRecipe(
            kernel=self.kernel.value, grid=(gx, gy, gz), dependent_launch=bool(dependent),
            params=ctypes.string_at(base, ctypes.sizeof(params)),
            param_offsets=tuple(getattr(params_type, name).offset for name, _, _ in fields),
            arrays=tuple(runtime_arrays), scalars=tuple(runtime_scalars))
        # A function per layout, generated so that a call is straight-line code.
        args = ", ".join(["stream", *pointers, *scalars])
        aligned = f"    if ({' | '.join(pointers)}) & 15:\n        return False\n" \
            if pointers else ""
        body = "".join(f"    params.{name} = {name}\n" for name in pointers + scalars)
        source = (f"def launch({args}):\n{aligned}{body}"
                  f"    config.hStream = stream\n"
                  f"    result = cuLaunchKernelEx(config_address, kernel, kernel_params, None)\n"
                  f"    if result:\n        relaunch(result)\n"
                  f"    return True\n")
        self.device_index = device_index
        self._launch_ex = launch
        namespace = {"params": params, "config": self.config, "kernel": self.kernel,
                     "config_address": ctypes.addressof(self.config),
                     "kernel_params": self.kernel_params, "cuLaunchKernelEx": launch,
                     "relaunch": self._relaunch}
        exec(compile(source, f"<tilenorm launch {bound.name}>", "exec"), namespace)
        self.launch = namespace["launch"]

    def _relaunch(self, result: int) -> None:
        """After a failed launch (parameters as written): on a thread with no current context
        (autograd's backward thread, launching on the legacy default stream) make the
        device's primary context current and launch again; any other error raises."""
        if result == _INVALID_CONTEXT:
            _make_primary_context_current(self.device_index)
            result = self._launch_ex(ctypes.addressof(self.config), self.kernel,
                                     self.kernel_params, None)
        _check(result, "cuLaunchKernelEx")
