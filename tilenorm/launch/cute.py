"""The CuTe DSL kernels (:mod:`tilenorm.kernels.cute_row_norm_forward`,
:mod:`~tilenorm.kernels.cute_cluster_norm_forward`,
:mod:`~tilenorm.kernels.cute_row_norm_backward`,
:mod:`~tilenorm.kernels.cute_cluster_norm_backward`, :mod:`~tilenorm.kernels.cute_row_norm_fp8`,
:mod:`~tilenorm.kernels.cute_fp8_transpose`):
compiled per launch plan and called through TVM-FFI, which takes DLPack arrays (torch tensors
among them) and launches on the caller's current stream.

The DSL is an optional part of the install: :func:`available` says whether it imports, and
nothing here imports it before a kernel is compiled. It comes as ``nvidia-cutlass-dsl-libs-*``
wheels (the CUDA 13 libraries only); the ``nvidia-cutlass-dsl`` wheel, which tilenorm does not
require because it also pulls the CUDA 12 libraries, adds only a ``.pth`` file that puts the
DSL's package folder on ``sys.path``, so :func:`_dsl_on_path` does that itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from tilenorm.launch import cute_cache
from tilenorm.planner import (
    CuteBackwardPlan,
    CuteClusterBackwardPlan,
    CuteForwardPlan,
    residual_entry,
)
from tilenorm.settings import DEVICE_CLASSES, CuteKernel, RowNormSettings, settings_for

if TYPE_CHECKING:
    from tilenorm.settings_fp8 import Fp8Settings

#: What the kernels import: the CuTe DSL and the TVM-FFI path they are called through.
REQUIRED_MODULES = ("cutlass.cute", "tvm_ffi")


def _dsl_on_path() -> None:
    """Put the DSL's package folder (``nvidia_cutlass_dsl/dsl_packages``) on ``sys.path``
    where no ``.pth`` file did."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return
    for root in spec.submodule_search_locations:
        folder = os.path.join(root, "dsl_packages")
        if os.path.isdir(folder) and folder not in sys.path:
            sys.path.insert(0, folder)  # where the .pth file puts it


@functools.cache
def available() -> bool:
    """True when the DSL and TVM-FFI import."""
    _dsl_on_path()
    try:
        for module in REQUIRED_MODULES:
            importlib.import_module(module)
    except ImportError:
        return False
    return True


def _dtypes():
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
            "float32": cutlass.Float32}


def _require_dsl() -> None:
    if not available():
        raise RuntimeError("the CuTe DSL kernels need nvidia-cutlass-dsl-libs-cu13 and "
                           "apache-tvm-ffi")


def _fake(dtype, shape, stride, align: int):
    """A tensor the compile sees (no memory, no device): the kernel's operand layouts."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _compile(kernel, arch: str | None, *operands, cubin_dir: str | None = None):
    """``cute.compile`` of ``kernel`` over ``operands`` and TVM-FFI's stream (the caller's
    current one at a call), for ``arch`` without a GPU where given; the cubin kept in
    ``cubin_dir`` where given (for cuobjdump)."""
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    if cubin_dir:
        os.makedirs(cubin_dir, exist_ok=True)  # the DSL writes nothing to a missing folder
        options += f" --keep-cubin --dump-dir {cubin_dir}"
    return cute.compile(kernel, *operands, stream, options=options)


@dataclass(frozen=True)
class ForwardKey:
    """What selects a compiled variant of the forward; dtypes by name. The row count is not
    one of them: it only bounds which rows a CTA takes (one kernel for every row count).
    ``cluster`` > 1 selects the cluster forward
    (:class:`~tilenorm.kernels.cute_cluster_norm_forward.ClusterRowNormForward`): a row
    across that many CTAs, ``rows_per_cta`` rows a cluster."""

    dtype: str
    weight_dtype: str | None
    has_bias: bool
    layer_norm: bool
    has_offset: bool
    has_residual: bool
    cols: int
    threads: int
    rows_per_cta: int
    ctas_per_sm: int
    cluster: int = 1
    #: The persistent cluster forward's ring of row groups
    #: (:class:`~tilenorm.kernels.cute_cluster_norm_forward.PersistentClusterRowNormForward`);
    #: 0: the one-shot grid.
    stages: int = 0
    #: The two-pass forward's vectors a thread a step
    #: (:class:`~tilenorm.kernels.cute_row_norm_forward.TwoPassRowNormForward`, one row a
    #: CTA); 0: another forward.
    step: int = 0

    @property
    def persistent(self) -> bool:
        return self.stages > 0

    @classmethod
    def of(cls, plan: CuteForwardPlan, dtype: str, weight_dtype: str | None, has_bias: bool,
           layer_norm: bool, has_offset: bool, has_residual: bool) -> ForwardKey:
        return cls(dtype, weight_dtype, has_bias, layer_norm, has_offset, has_residual,
                   plan.cols, plan.threads, plan.rows_per_cta, plan.ctas_per_sm, plan.cluster,
                   plan.stages, plan.step)


def compile_forward(key: ForwardKey, arch: str | None = None, cubin_dir: str | None = None):
    """Compile ``key``'s kernel (``arch`` as in :func:`compile_backward`; the cubin kept in
    ``cubin_dir`` where given). The result is
    called as ``fn(x, residual, weight, bias, y, h, mean, rstd, eps, offset, grid)`` with
    DLPack arrays (None for the absent ones: residual and h together, mean for RMSNorm) on
    the current stream; x, residual, y and h are contiguous (rows, cols) in ``key.dtype``."""
    _require_dsl()
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    dtypes = _dtypes()
    dtype = dtypes[key.dtype]
    weight_dtype = None if key.weight_dtype is None else dtypes[key.weight_dtype]
    features = (key.layer_norm, key.has_bias, key.has_offset, key.has_residual)
    if key.persistent:
        if key.has_residual:
            raise ValueError(f"the persistent cluster forward takes no residual: {key}")
        from tilenorm.kernels.cute_cluster_norm_forward import PersistentClusterRowNormForward

        kernel = PersistentClusterRowNormForward(dtype, weight_dtype, key.cols, key.threads,
                                                 key.rows_per_cta, key.cluster, key.stages,
                                                 key.ctas_per_sm, *features[:3])
    elif key.step:
        from tilenorm.kernels.cute_row_norm_forward import TwoPassRowNormForward

        kernel = TwoPassRowNormForward(dtype, weight_dtype, key.cols, key.threads, key.step,
                                       key.ctas_per_sm, *features)
    elif key.cluster > 1:
        from tilenorm.kernels.cute_cluster_norm_forward import ClusterRowNormForward

        kernel = ClusterRowNormForward(dtype, weight_dtype, key.cols, key.threads,
                                       key.rows_per_cta, key.cluster, key.ctas_per_sm,
                                       *features)
    else:
        from tilenorm.kernels.cute_row_norm_forward import RowNormForward

        kernel = RowNormForward(dtype, weight_dtype, key.cols, key.threads, key.rows_per_cta,
                                key.ctas_per_sm, *features)
    rows = cute.sym_int()

    def row_major():
        return _fake(dtype, (rows, key.cols), (key.cols, 1), 16)

    x, y = row_major(), row_major()
    residual, h = (row_major(), row_major()) if key.has_residual else (None, None)
    weight, bias = (None if not present else _fake(weight_dtype, (key.cols,), (1,), 16)
                    for present in (key.weight_dtype is not None, key.has_bias))
    mean = _fake(Float32, (rows,), (1,), 4) if key.layer_norm else None
    rstd = _fake(Float32, (rows,), (1,), 4)
    return _compile(kernel, arch, x, residual, weight, bias, y, h, mean, rstd, Float32(1e-6),
                    Float32(0.0), Int32(1), cubin_dir=cubin_dir)


@dataclass(frozen=True)
class BackwardKey:
    """What selects a compiled variant of the kernel: dtypes by name ("bfloat16", ...). The
    row count is one of them: with it a runtime value, the loop's bounds cost the registers
    that two CTAs per SM leave, the kernel spills, and it runs at 87.5% of copy bandwidth
    instead of 97.8% (H200, bench/NOTES.md #38)."""

    rows: int
    dtype: str
    weight_dtype: str | None
    has_bias: bool
    layer_norm: bool
    cols: int
    threads: int
    stages: int
    ctas_per_sm: int
    #: The kernel's ``shared_ring``: the ring in shared memory, by ``cp.async``.
    shared_ring: bool = False

    @classmethod
    def of(cls, plan: CuteBackwardPlan, dtype: str, weight_dtype: str | None,
           has_bias: bool, layer_norm: bool) -> BackwardKey:
        return cls(plan.rows, dtype, weight_dtype, has_bias, layer_norm, plan.cols,
                   plan.threads, plan.stages, plan.ctas_per_sm, plan.shared_ring)

    @property
    def groups(self) -> int:
        """Gradient groups in the partial buffer: dgamma and/or dbeta."""
        return int(self.weight_dtype is not None) + int(self.has_bias)


def compile_backward(key: BackwardKey, arch: str | None = None):
    """Compile ``key``'s kernel; ``arch`` (e.g. ``"sm_90a"``) compiles without a GPU, for
    that architecture. The result is called as ``fn(h, dy, weight, mean, rstd, dx, partial,
    grid)`` with DLPack arrays (None for the absent ones) on the current stream."""
    _require_dsl()
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from tilenorm.kernels.cute_row_norm_backward import RowNormBackward

    dtypes = _dtypes()
    dtype = dtypes[key.dtype]
    weight_dtype = None if key.weight_dtype is None else dtypes[key.weight_dtype]
    kernel = RowNormBackward(dtype, weight_dtype, key.cols, key.threads, key.stages,
                             key.ctas_per_sm, key.layer_norm, key.has_bias, key.shared_ring)

    rows, slots = key.rows, cute.sym_int()
    # Rows contiguous, so that a row's offset is a multiple of a compile-time stride: a
    # runtime 64-bit stride costs the registers that keep two CTAs resident (#38).
    x, dy, dx = (_fake(dtype, (rows, key.cols), (key.cols, 1), 16) for _ in range(3))
    weight = None if weight_dtype is None else _fake(weight_dtype, (key.cols,), (1,), 16)
    mean = _fake(Float32, (rows,), (1,), 4) if key.layer_norm else None
    rstd = _fake(Float32, (rows,), (1,), 4)
    groups = key.groups
    partial = (_fake(Float32, (slots, groups, key.cols), (groups * key.cols, key.cols, 1), 16)
               if groups else None)
    return _compile(kernel, arch, x, dy, weight, mean, rstd, dx, partial, Int32(1))


@dataclass(frozen=True)
class ClusterBackwardKey:
    """What selects a compiled variant of the cluster backward
    (:mod:`tilenorm.kernels.cute_cluster_norm_backward`); dtypes by name. Neither the row
    count nor the cluster count is one of them: one kernel for every row count and grid
    (their loop bounds cost it no spills, #75)."""

    dtype: str
    weight_dtype: str | None
    has_offset: bool
    has_dres_in: bool
    cols: int
    cluster: int
    threads: int
    stages: int
    ctas_per_sm: int
    layer_norm: bool = False
    has_bias: bool = False
    #: The kernel's ``stage_stats``: each row's rstd (and mean) staged with the row.
    stage_stats: bool = False

    @classmethod
    def of(cls, plan: CuteClusterBackwardPlan, dtype: str, weight_dtype: str | None,
           has_offset: bool, has_dres_in: bool, layer_norm: bool = False,
           has_bias: bool = False) -> ClusterBackwardKey:
        return cls(dtype, weight_dtype, has_offset, has_dres_in, plan.cols, plan.cluster,
                   plan.threads, plan.stages, plan.ctas_per_sm, layer_norm, has_bias,
                   plan.stage_stats)

    @property
    def groups(self) -> int:
        """Gradient groups in the partial buffer: dweight and/or dbias."""
        return int(self.weight_dtype is not None) + int(self.has_bias)

    def kernel(self):
        """The kernel object of this variant (the DSL imported)."""
        _require_dsl()
        from tilenorm.kernels.cute_cluster_norm_backward import ClusterRowNormBackward

        dtypes = _dtypes()
        return ClusterRowNormBackward(
            dtypes[self.dtype], None if self.weight_dtype is None else dtypes[self.weight_dtype],
            self.cols, self.cluster, self.threads, self.stages, self.ctas_per_sm,
            self.layer_norm, self.has_bias, self.has_offset, self.has_dres_in,
            self.stage_stats)


def compile_cluster_backward(key: ClusterBackwardKey, arch: str | None = None,
                             cubin_dir: str | None = None):
    """Compile ``key``'s kernel (``arch`` as in :func:`compile_backward`; ``cubin_dir`` keeps
    its cubin there). The result is called as ``fn(h, dy, weight, mean, rstd, dres_in, dx,
    partial, offset, grid)`` with DLPack arrays (None for the absent ones: mean for RMSNorm)
    on the current stream: h, dy, dres_in and dx contiguous (rows, cols) in ``key.dtype``,
    ``partial`` (clusters, groups, cols) fp32, ``grid`` a multiple of ``key.cluster``."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    kernel = key.kernel()
    dtype, weight_dtype = kernel.dtype, kernel.weight_dtype
    rows, clusters, cols = cute.sym_int(), cute.sym_int(), key.cols
    h, dy, dx = (_fake(dtype, (rows, cols), (cols, 1), 16) for _ in range(3))
    dres_in = _fake(dtype, (rows, cols), (cols, 1), 16) if key.has_dres_in else None
    weight = None if weight_dtype is None else _fake(weight_dtype, (cols,), (1,), 16)
    mean = _fake(Float32, (rows,), (1,), 4) if key.layer_norm else None
    rstd = _fake(Float32, (rows,), (1,), 4)
    groups = key.groups
    partial = (_fake(Float32, (clusters, groups, cols), (groups * cols, cols, 1), 16)
               if groups else None)
    return _compile(kernel, arch, h, dy, weight, mean, rstd, dres_in, dx, partial,
                    Float32(0.0), Int32(1), cubin_dir=cubin_dir)


#: Architectures the ahead-of-time build targets: Hopper and Blackwell datacenter parts.
AOT_ARCHS = ("sm_90a", "sm_100a")
#: Row count of the ahead-of-time builds of the kernel compiled per row count (the row
#: backward), and of the FP8 transposed copy's plans whose tiles they list.
AOT_ROWS = 32768


_Key = TypeVar("_Key")


def _unique(keys: Iterable[_Key]) -> list[_Key]:
    """``keys`` in order, each once: device classes share most entries."""
    return list(dict.fromkeys(keys))


def _every_table() -> list[RowNormSettings]:
    """The settings of every device class (:data:`tilenorm.settings.DEVICE_CLASSES`): the
    ahead-of-time builds cover each class's entries."""
    return [settings_for((9, 0), device_class) for device_class in DEVICE_CLASSES]


def aot_keys(all_dtypes: bool = False) -> list[BackwardKey]:
    """Every variant the settings' CuTe DSL entries can run: each weight dtype (or none),
    with and without a bias, in bf16 (and fp16 with ``all_dtypes``), each with the
    ``shared_ring`` of its entry (``cute_backward_shared_ring``)."""
    dtypes = ("bfloat16", "float16") if all_dtypes else ("bfloat16",)
    return _unique(BackwardKey(AOT_ROWS, dtype, weight_dtype, has_bias, op == "layer_norm",
                               cols, *config,
                               shared_ring=cols in s.cute_backward_shared_ring.get(op, ()))
            for s in _every_table()
            for op, widths in s.cute_backward.items() for cols, config in widths.items()
            for dtype in dtypes for weight_dtype in (None, dtype, "float32")
            for has_bias in ((False, True) if op == "layer_norm" else (False,)))


def _entries(kernel: CuteKernel, all_dtypes: bool
             ) -> Iterator[tuple[RowNormSettings, str, str, int, tuple[int, ...]]]:
    """(the class's settings, x's dtype, op, width, entry) of every class's ``kernel``
    tables: the 2-byte one (bf16 x, and fp16 with ``all_dtypes``) and the 4-byte one (fp32
    x)."""
    for s in _every_table():
        for itemsize, dtypes in ((2, ("bfloat16", "float16") if all_dtypes else ("bfloat16",)),
                                 (4, ("float32",))):
            for op, widths in s.cute_table(kernel, itemsize).items():
                for cols, config in widths.items():
                    for dtype in dtypes:
                        yield s, dtype, op, cols, config


def aot_cluster_backward_keys(all_dtypes: bool = False) -> list[ClusterBackwardKey]:
    """Every variant the settings' cluster backward entries can run in bf16 and fp32 (and
    fp16 with ``all_dtypes``): each weight dtype (or none), with and without a residual's
    gradient added to dx; RMSNorm with and without the Gemma offset (which needs a weight),
    LayerNorm with and without a bias; each with the ``stage_stats`` of its entry."""
    return _unique(ClusterBackwardKey(dtype, weight_dtype, has_offset, has_dres_in, cols,
                                      *config, layer_norm=op == "layer_norm",
                                      has_bias=has_bias,
                                      stage_stats=s.cluster_backward_stage_stats(
                                          op, cols, 4 if dtype == "float32" else 2))
            for s, dtype, op, cols, config in _entries("cluster_backward", all_dtypes)
            for weight_dtype in (None, dtype, "float32")
            for has_offset in ((False, True) if op == "rms_norm" and weight_dtype
                               else (False,))
            for has_bias in ((False, True) if op == "layer_norm" else (False,))
            for has_dres_in in (False, True))


def aot_forward_keys(all_dtypes: bool = False) -> list[ForwardKey]:
    """Every variant the settings' CuTe DSL forward entries can run in bf16 and fp32 (and
    fp16 with ``all_dtypes``): each weight dtype (or none), with and without a residual (at
    the entry a residual call runs, :func:`tilenorm.planner.residual_entry`); LayerNorm with
    and without a bias, RMSNorm with and without the Gemma offset (which needs a weight);
    the cluster forward's entries with theirs; the two-pass forward's entries
    (``cute_forward_two_pass``) likewise."""
    two_pass = ((dtype, op, cols, entry) for s in _every_table()
                for op, widths in s.cute_forward_two_pass.items()
                for cols, entry in widths.items()
                for dtype in (("bfloat16", "float16") if all_dtypes else ("bfloat16",)))
    return _unique([*(key for _, dtype, op, cols, config in _entries("forward", all_dtypes)
                      for key in forward_feature_keys(dtype, op, cols, config,
                                                      residual_entry(cols, config))),
                    *(key for dtype, op, cols, entry in two_pass
                      for key in forward_feature_keys(dtype, op, cols,
                                                      two_pass_launch(entry)))])


def two_pass_launch(entry: tuple[int, int, int]) -> tuple[int, ...]:
    """A ``cute_forward_two_pass`` entry's :class:`ForwardKey` fields from ``threads`` on."""
    threads, step, ctas_per_sm = entry
    return (threads, 1, ctas_per_sm, 1, 0, step)


def forward_feature_keys(dtype: str, op: str, cols: int, launch: tuple[int, ...],
                         residual_launch: tuple[int, ...] | None = None
                         ) -> Iterator[ForwardKey]:
    """The forward's keys of every feature set of ``op`` at ``cols`` columns of ``dtype``
    x: each weight dtype (or none), LayerNorm with and without a bias, RMSNorm with and
    without the Gemma offset (which needs a weight), with and without a residual. Their
    fields from ``threads`` on are ``launch``, a residual's ``residual_launch`` (default
    ``launch``)."""
    for weight_dtype in (None, dtype, "float32"):
        for has_bias in (False, True) if op == "layer_norm" and weight_dtype else (False,):
            for has_offset in (False, True) if op == "rms_norm" and weight_dtype else (False,):
                for has_residual in (False, True):
                    fields = (residual_launch or launch) if has_residual else launch
                    yield ForwardKey(dtype, weight_dtype, has_bias, op == "layer_norm",
                                     has_offset, has_residual, cols, *fields)


#: Compiled variants kept loaded per process (each is a library of the disk cache, or a
#: JIT-compiled function where none can be built: :mod:`tilenorm.launch.cute_cache`).
MAX_COMPILED = 256


@functools.lru_cache(maxsize=MAX_COMPILED)
def compiled_forward(key: ForwardKey, arch: tuple[int, int]):
    """``key``'s kernel for ``arch``, the current GPU's compute capability (a process whose
    GPUs differ loads one for each): loaded from the disk cache, compiled into it first where
    absent (:func:`tilenorm.launch.cute_cache.load`)."""
    return cute_cache.load(key, arch, compile_forward)


@functools.lru_cache(maxsize=MAX_COMPILED)
def compiled_backward(key: BackwardKey, arch: tuple[int, int]):
    """``key``'s kernel for ``arch`` (as :func:`compiled_forward`)."""
    return cute_cache.load(key, arch, compile_backward)


@functools.lru_cache(maxsize=MAX_COMPILED)
def compiled_cluster_backward(key: ClusterBackwardKey, arch: tuple[int, int]):
    """``key``'s kernel for ``arch`` (as :func:`compiled_forward`)."""
    return cute_cache.load(key, arch, compile_cluster_backward)


def _fp8_dtypes():
    import cutlass

    return {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}



@dataclass(frozen=True)
class Fp8ForwardKey:
    """What selects a compiled variant of the FP8-output forward
    (:mod:`tilenorm.kernels.cute_row_norm_fp8`); dtypes by name. ``rows`` None, what the ops
    and the ahead-of-time build compile: one kernel for every row count, so training with
    varying token counts compiles once a width and feature set, not at each new count
    (0.6-2.4 s on an H100, bench/NOTES.md #63). Unlike :class:`BackwardKey`'s, a runtime row
    count leaves this kernel within its launch's register cap (it holds one tensor's ring,
    the backward two: #59), its spills changed in 16 of 165 variants, more in 4 (#109);
    block scaling timed within a point of the per-count kernel on an H100 (#63). An int
    compiles for that row count only (``bench/experiments/cute_fp8_probe.py
    --static-rows``)."""

    rows: int | None
    dtype: str
    weight_dtype: str | None
    fp8_dtype: str
    scaling: str
    has_offset: bool
    cols: int
    threads: int
    stages: int
    ctas_per_sm: int
    #: The kernel's ``recompute_t``: the weight and t = x * w not held across the row.
    recompute_t: bool = False
    #: The kernel's ``column_amax`` ("row"): per-program column amaxes for the copy.
    column_amax: bool = False
    #: FP8 x (``dtype`` an FP8 format): the elements one of ``x_scale_inv``'s multipliers
    #: covers; 0 for x that is not FP8.
    group: int = 0
    #: The kernel's ``clamp``: each value clamped to +-fp8_max before the (saturating)
    #: conversion, the same bits.
    clamp: bool = False
    #: The kernel's ``shared_ring`` (FP8 x): x's ring in shared memory, by ``cp.async``.
    shared_ring: bool = False


def compile_fp8_forward(key: Fp8ForwardKey, arch: str | None = None, *,
                        row_major_block_scales: bool = False):
    """Compile ``key``'s kernel (``arch`` as in :func:`compile_backward`). The result is
    called as ``fn(x, x_scale_inv, weight, scale, q, q_scale, rstd, amax_partial, eps,
    offset, grid)`` with DLPack arrays (None for the absent ones) on the current stream:
    FP8 x as its bytes, (rows, cols) uint8, with ``x_scale_inv`` (rows, cols / group) fp32
    row-major (None for other x); ``q`` (rows, cols) uint8 (the FP8 bytes), ``q_scale``
    (rows, 1)
    fp32 for "row", (rows, cols / 128) fp32 with strides (1, rows) for "block", (rows,
    cols / 32) uint8 for "mx"; ``amax_partial`` (grid,) fp32 for "amax" and "delayed", and
    with ``column_amax`` the (grid, cols) fp32 column amaxes.
    ``row_major_block_scales`` lays "block" scales out (rows, cols / 128) row-major instead:
    a measurement of what the GEMM layout's column-major stores cost (bench/NOTES.md #57),
    not a layout the ops return."""
    _require_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from tilenorm.kernels.cute_row_norm_fp8 import BLOCK_COLS, RowNormFp8Forward
    from tilenorm.launch.cutile_fp8 import FP8_MAX

    dtypes = _dtypes()
    fp8_dtypes = _fp8_dtypes()
    dtype = fp8_dtypes[key.dtype] if key.group else dtypes[key.dtype]
    weight_dtype = None if key.weight_dtype is None else dtypes[key.weight_dtype]
    fp8 = fp8_dtypes[key.fp8_dtype]
    kernel = RowNormFp8Forward(
        dtype, weight_dtype, fp8, FP8_MAX[key.fp8_dtype], key.cols, key.threads, key.stages,
        key.ctas_per_sm, key.scaling, key.has_offset, key.recompute_t, key.column_amax,
        key.group, key.clamp, key.shared_ring)

    rows = cute.sym_int() if key.rows is None else key.rows
    cols, slots = key.cols, cute.sym_int()
    # FP8 x as its bytes, as q: DLPack has no FP8 types everywhere.
    x = _fake(cutlass.Uint8 if key.group else dtype, (rows, cols), (cols, 1), 16)
    x_scale_inv = None
    if key.group:
        groups = cols // key.group
        x_scale_inv = _fake(Float32, (rows, groups), (groups, 1), 4)
    weight = None if weight_dtype is None else _fake(weight_dtype, (cols,), (1,), 16)
    scale = _fake(Float32, (1,), (1,), 4) if key.scaling == "delayed" else None
    # q as its bytes (uint8): DLPack has no FP8 types everywhere.
    q = None if key.scaling == "amax" else _fake(cutlass.Uint8, (rows, cols), (cols, 1), 16)
    if key.scaling == "row":
        q_scale = _fake(Float32, (rows, 1), (1, 1), 4)
    elif key.scaling == "block":
        blocks = cols // BLOCK_COLS["block"]
        q_scale = _fake(Float32, (rows, blocks),
                       (blocks, 1) if row_major_block_scales else (1, rows), 4)
    elif key.scaling == "mx":
        blocks = cols // BLOCK_COLS["mx"]
        q_scale = _fake(cutlass.Uint8, (rows, blocks), (blocks, 1), 1)
    else:
        q_scale = None
    rstd = _fake(Float32, (rows,), (1,), 4)
    amax = _fake(Float32, (slots,), (1,), 4) if key.scaling in ("amax", "delayed") else None
    if key.column_amax:
        amax = _fake(Float32, (slots, cols), (cols, 1), 16)
    return _compile(kernel, arch, x, x_scale_inv, weight, scale, q, q_scale, rstd, amax,
                    Float32(1e-6), Float32(0.0), Int32(1))


#: Groups of FP8 x's multipliers the ahead-of-time build covers: COAT's 16 and the largest.
FP8_INPUT_GROUPS = (16, 128)


def aot_fp8_keys(all_dtypes: bool = False) -> list[Fp8ForwardKey]:
    """The FP8-output row kernel's variants: every width of the FP8 settings' table with every
    scaling (at its ``forward_entry``) and weight dtype (or none), E4M3, in bf16; and the rest of
    the features (E5M2, the Gemma offset; fp16 x with ``all_dtypes``) at one scaling each. Each
    entry of its ``cute_forward_recompute_t`` table with ``recompute_t`` at its scaling: every
    weight dtype, E5M2, the offset (and fp16 x). Each of these with the ``clamp`` of its scaling
    and width (``forward_clamp``), as the planner routes them. At the widths of its
    ``cute_forward_column_amax``, row scaling with column amaxes at row scaling's entry
    (``recompute_t``'s where it has one), a 2-byte weight or none (an fp32 weight keeps
    cuTile's row kernel there), without ``clamp``. Each width of its
    ``cute_forward_fp8_input`` table with FP8 x, at each scaling's ``fp8_input_entry``: every
    scaling and group of :data:`FP8_INPUT_GROUPS`, E4M3, a bf16 weight; no weight, an fp32
    weight, E5M2 x and q, the offset (an fp16 weight with ``all_dtypes``) at one scaling each
    (no column amaxes: FP8 x's row-scaled copy keeps cuTile's kernels), each with the
    ``shared_ring`` of its scaling and width (``fp8_input_shared_ring``). The entries of every
    device class's FP8 settings (:data:`tilenorm.settings.DEVICE_CLASSES`)."""
    from tilenorm.settings_fp8 import fp8_settings_for

    return _unique(key for device_class in DEVICE_CLASSES
                   for key in _fp8_keys(fp8_settings_for((9, 0), device_class), all_dtypes))


def _fp8_keys(settings: Fp8Settings, all_dtypes: bool) -> list[Fp8ForwardKey]:
    """:func:`aot_fp8_keys` of one FP8 settings table."""
    from tilenorm.kernels.cute_row_norm_fp8 import SCALINGS

    keys = []
    for cols in settings.cute_forward:
        config = functools.partial(settings.forward_entry, cols=cols)
        clamp = functools.partial(settings.forward_clamp, cols=cols)
        ring = functools.partial(settings.forward_shared_ring, cols=cols)
        keys += [Fp8ForwardKey(None, "bfloat16", weight, "float8_e4m3fn", scaling, False,
                               cols, *config(scaling), clamp=clamp(scaling),
                               shared_ring=ring(scaling))
                 for scaling in SCALINGS for weight in (None, "bfloat16", "float32")]
        keys += [Fp8ForwardKey(None, "bfloat16", "bfloat16", "float8_e5m2", "row", False,
                               cols, *config("row"), clamp=clamp("row"),
                               shared_ring=ring("row")),
                 Fp8ForwardKey(None, "bfloat16", "float32", "float8_e4m3fn", "block", True,
                               cols, *config("block"), clamp=clamp("block"),
                               shared_ring=ring("block"))]
        if all_dtypes:
            keys.append(Fp8ForwardKey(None, "float16", "float16", "float8_e4m3fn", "mx",
                                      False, cols, *config("mx"), clamp=clamp("mx"),
                                      shared_ring=ring("mx")))
        if cols in settings.cute_forward_column_amax:  # a per-row scaling's copy
            recompute_t = settings.cute_forward_recompute_t.get("row", {}).get(cols)
            keys += [Fp8ForwardKey(None, x, weight, "float8_e4m3fn", "row", False, cols,
                                   *(recompute_t or config("row")),
                                   recompute_t=recompute_t is not None, column_amax=True,
                                   shared_ring=ring("row"))
                     for x, weight in (("bfloat16", None), ("bfloat16", "bfloat16"))
                     + ((("float16", "float16"),) if all_dtypes else ())]
    recompute_t_features = [  # (x, weight, FP8, offset)
        ("bfloat16", None, "float8_e4m3fn", False),
        ("bfloat16", "bfloat16", "float8_e4m3fn", False),
        ("bfloat16", "float32", "float8_e4m3fn", False),
        ("bfloat16", "bfloat16", "float8_e5m2", False),
        ("bfloat16", "float32", "float8_e4m3fn", True),
    ] + ([("float16", "float16", "float8_e4m3fn", False)] if all_dtypes else [])
    for scaling, widths in settings.cute_forward_recompute_t.items():
        for cols, config in widths.items():
            keys += [Fp8ForwardKey(None, x, weight, fp8, scaling, has_offset, cols, *config,
                                   recompute_t=True,
                                   clamp=settings.forward_clamp(scaling, cols))
                     for x, weight, fp8, has_offset in recompute_t_features]
    for cols in settings.cute_forward_fp8_input:
        config = functools.partial(settings.fp8_input_entry, cols=cols)
        ring = functools.partial(settings.fp8_input_shared_ring, cols=cols)
        keys += [Fp8ForwardKey(None, "float8_e4m3fn", "bfloat16", "float8_e4m3fn",
                               scaling, False, cols, *config(scaling), group=group,
                               shared_ring=ring(scaling))
                 for scaling in SCALINGS for group in FP8_INPUT_GROUPS]
        keys += [Fp8ForwardKey(None, "float8_e4m3fn", weight, "float8_e4m3fn", "row",
                               False, cols, *config("row"), group=16,
                               shared_ring=ring("row"))
                 for weight in (None, "float32")]
        keys += [Fp8ForwardKey(None, "float8_e5m2", "bfloat16", "float8_e5m2", "row",
                               False, cols, *config("row"), group=16,
                               shared_ring=ring("row")),
                 Fp8ForwardKey(None, "float8_e4m3fn", "float32", "float8_e4m3fn", "block",
                               True, cols, *config("block"), group=128,
                               shared_ring=ring("block"))]
        if all_dtypes:
            keys.append(Fp8ForwardKey(None, "float8_e4m3fn", "float16", "float8_e4m3fn",
                                      "mx", False, cols, *config("mx"), group=16,
                                      shared_ring=ring("mx")))
    return keys


@functools.lru_cache(maxsize=MAX_COMPILED)
def compiled_fp8_forward(key: Fp8ForwardKey, arch: tuple[int, int]):
    """``key``'s kernel for ``arch`` (as :func:`compiled_forward`)."""
    return cute_cache.load(key, arch, compile_fp8_forward)


@dataclass(frozen=True)
class Fp8TransposeKey:
    """What selects a compiled variant of the transposed FP8 copy
    (:mod:`tilenorm.kernels.cute_fp8_transpose`); dtypes by name. The row count is not one
    of them (a runtime multiple of 16)."""

    dtype: str
    weight_dtype: str | None
    fp8_dtype: str
    scaling: str
    has_offset: bool
    cols: int
    tile_cols: int
    ctas_per_sm: int
    #: y as the CuTe row kernel computes it, (x * w) * rstd: a per-row scaling's copy after
    #: that kernel's column amaxes.
    weight_first: bool = False


def compile_fp8_transpose(key: Fp8TransposeKey, arch: str | None = None,
                          cubin_dir: str | None = None):
    """Compile ``key``'s kernel (``arch`` and ``cubin_dir`` as in :func:`compile_forward`).
    The result is called as ``fn(x, weight, rstd, column_amax, q_t, q_t_scale, offset,
    row_tiles)`` with DLPack arrays (None for the absent weight, and column_amax but for
    "row") on the current stream: x (rows, cols) contiguous, rows a multiple of 16; rstd
    (rows,); column_amax (cols,) fp32; ``q_t`` (cols, rows) uint8 (the FP8 bytes);
    ``q_t_scale`` (cols, 1) fp32 for "row", (cols, cdiv(rows, 128)) fp32 with strides (1,
    cols) for "block", (cols, cdiv(rows, 32)) uint8 for "mx"; ``row_tiles`` cdiv(rows,
    128)."""
    _require_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from tilenorm.kernels.cute_fp8_transpose import ROW_MULTIPLE, TransposedFp8Quantize
    from tilenorm.launch.cutile_fp8 import FP8_MAX

    dtypes = _dtypes()
    dtype = dtypes[key.dtype]
    weight_dtype = None if key.weight_dtype is None else dtypes[key.weight_dtype]
    kernel = TransposedFp8Quantize(dtype, weight_dtype, _fp8_dtypes()[key.fp8_dtype],
                                   FP8_MAX[key.fp8_dtype], key.cols, key.tile_cols,
                                   key.ctas_per_sm, key.scaling, key.has_offset,
                                   key.weight_first)
    rows, cols, blocks = cute.sym_int(divisibility=ROW_MULTIPLE), key.cols, cute.sym_int()
    x = _fake(dtype, (rows, cols), (cols, 1), 16)
    weight = None if weight_dtype is None else _fake(weight_dtype, (cols,), (1,), 16)
    rstd = _fake(Float32, (rows,), (1,), 4)
    column_amax = _fake(Float32, (cols,), (1,), 4) if key.scaling == "row" else None
    q_t = _fake(cutlass.Uint8, (cols, rows), (rows, 1), 16)
    if key.scaling == "row":
        q_t_scale = _fake(Float32, (cols, 1), (1, 1), 4)
    elif key.scaling == "block":
        q_t_scale = _fake(Float32, (cols, blocks), (1, cols), 4)
    else:
        q_t_scale = _fake(cutlass.Uint8, (cols, blocks), (blocks, 1), 1)
    return _compile(kernel, arch, x, weight, rstd, column_amax, q_t, q_t_scale, Float32(0.0),
                    Int32(1), cubin_dir=cubin_dir)


def aot_fp8_transpose_keys(all_dtypes: bool = False) -> list[Fp8TransposeKey]:
    """The transposed FP8 copy's variants: at every width of the FP8 settings' row kernel
    table, each scaling with a bf16 weight, E4M3, bf16 x, at the width's planned tile (and
    ``weight_first`` for "row" where the row kernel keeps column amaxes); at 4096 the other
    features (no weight, an fp32 weight, E5M2, the offset; fp16 x with ``all_dtypes``). The
    widths and tiles of every device class's FP8 settings."""
    from tilenorm.kernels.cute_fp8_transpose import SCALINGS
    from tilenorm.planner import plan_cute_fp8_transpose
    from tilenorm.settings_fp8 import fp8_settings_for

    keys = []
    for device_class in DEVICE_CLASSES:
        settings = fp8_settings_for((9, 0), device_class)
        for cols in settings.cute_forward:
            plan = plan_cute_fp8_transpose(AOT_ROWS, cols, itemsize=2, arch=(9, 0),
                                           device_class=device_class)
            tile = (plan.tile_cols, plan.ctas_per_sm)
            keys += [Fp8TransposeKey("bfloat16", "bfloat16", "float8_e4m3fn", scaling, False,
                                     cols, *tile) for scaling in SCALINGS]
            if cols in settings.cute_forward_column_amax:  # after the CuTe row kernel's amaxes
                keys.append(Fp8TransposeKey("bfloat16", "bfloat16", "float8_e4m3fn", "row", False,
                                            cols, *tile, weight_first=True))
            if cols == 4096:
                keys += [Fp8TransposeKey("bfloat16", None, "float8_e4m3fn", "mx", False, cols,
                                         *tile),
                         Fp8TransposeKey("bfloat16", "float32", "float8_e4m3fn", "block", True,
                                         cols, *tile),
                         Fp8TransposeKey("bfloat16", "bfloat16", "float8_e5m2", "row", False,
                                         cols, *tile)]
                if all_dtypes:
                    keys.append(Fp8TransposeKey("float16", "float16", "float8_e4m3fn", "block",
                                                False, cols, *tile))
    return _unique(keys)


@functools.lru_cache(maxsize=MAX_COMPILED)
def compiled_fp8_transpose(key: Fp8TransposeKey, arch: tuple[int, int]):
    """``key``'s kernel for ``arch`` (as :func:`compiled_forward`)."""
    return cute_cache.load(key, arch, compile_fp8_transpose)
