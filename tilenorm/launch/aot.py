"""Ahead-of-time compilation of the cuTile kernel variants the planner and the ops choose.

Needs no GPU: ``cuda.tile.compilation.export_kernel`` runs the cuTile compiler (tileiras)
on the CPU. CI uses it to prove that each configuration builds for Hopper (sm_90) and
Blackwell (sm_100); ``python -m tilenorm`` does the same on a machine without a GPU.

The kernels are bound by the same functions the launchers use
(:func:`tilenorm.launch.cutile.bind_forward` and friends) and compiled for the signature the
lean launch compiles at run time (:func:`tilenorm.launch.driver.signature`), so the exported
variants are the ones that run. The jobs cover every tile configuration the planner can
choose (for RMSNorm and LayerNorm in bf16), and every feature and dtype combination the ops
accept on one single-pass, one split and one wide-row (chunked forward, column-split
backward) configuration. The FP8-output kernels (:func:`fp8_jobs`) likewise: every tile
configuration of the row kernel, every scaling, FP8 format and feature on two of them, the
second-pass kernels (per-tensor, and the transposed copies with scales along M), the
column-amax reduction, the MX scale swizzle and the FP8-input backward.
"""

from __future__ import annotations

import importlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace

import cuda.tile as ct
from cuda.tile.compilation import KernelSignature, export_kernel

from tilenorm.launch import cutile, cutile_fp8
from tilenorm.launch.cutile import BoundKernel, NormFeatures
from tilenorm.launch.cutile_fp8 import FP8_MAX, Fp8NormFeatures
from tilenorm.launch.driver import ArrayLayout, signature
from tilenorm.layout import contiguous_strides
from tilenorm.planner import (
    RowNormPlan,
    max_fp8_cols,
    max_single_pass_cols,
    plan_fp8_column_amax,
    plan_fp8_mx_swizzle,
    plan_fp8_quantize,
    plan_fp8_row,
    plan_row_norm,
)
from tilenorm.settings import DEVICE_CLASSES, settings_for

#: (x dtype, weight dtype) pairs built for every feature set: the weight in x's dtype or in
#: fp32 (other pairs compile just in time).
DTYPE_PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
               ("bfloat16", "float32"), ("float16", "float32")]
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
GPU_CODES = ("sm_90", "sm_100")


@dataclass(frozen=True)
class Variant:
    """One feature combination, with the dtypes of its operands."""

    label: str
    features: NormFeatures
    x: str = "bfloat16"
    weight: str = "bfloat16"
    out: str | None = None  # None: x's dtype
    residual: str | None = None  # the residual stream's dtype
    heads: int = 1
    index_bits: int = 32
    dy_terms: int = 1  # the backward's parts of y's gradient (dy, dy2, dy3)


@dataclass(frozen=True)
class ExportJob:
    label: str
    kernel: object
    signature: KernelSignature


def _dense(dtype: str, shape: tuple[int, ...]) -> ArrayLayout:
    return ArrayLayout(dtype, shape, contiguous_strides(shape))


def _job(label: str, bound: BoundKernel, layouts: dict) -> ExportJob:
    """``bound`` for operands of ``layouts`` (by name; the others placeholders), with the
    signature the lean launch compiles at run time."""
    placeholder = ArrayLayout("float32", (1,), (1,))
    arrays = tuple(layouts.get(name, placeholder) for name in bound.arrays)
    return ExportJob(label, bound.kernel, signature(bound, arrays))


def plans(direction, op: str = "rms_norm", heads: int = 1, per_head: bool = False,
          itemsize: int = 2) -> list[RowNormPlan]:
    """One plan per tile configuration the planner can choose for ``direction``, ``op`` and
    ``itemsize``-byte elements, on a device of any class."""
    by_config = {}
    for device_class in DEVICE_CLASSES:
        settings = settings_for((9, 0), device_class)
        widest = max_single_pass_cols(direction, op, itemsize, settings)
        cols = [settings.min_tile_cols]
        while cols[-1] < widest:
            cols.append(cols[-1] * 2)
        cols.append(2 * widest)
        # Rows just over, 5/8 and 3/4 of a power of two take split single-pass tiles: the
        # narrowest second piece (4096 + 16 for 4097), 4096 + 1024 for 5120, the widest
        # (4096 + 2048).
        cols += [w for n in cols if n <= widest for w in (n // 2 + 1, 5 * n // 8, 3 * n // 4)]
        # 65536 rows, and the row counts from which many_rows_hints apply.
        row_counts = [65536] + [rows for rows, _ in
                                settings.many_rows_hints[direction].get(op, ())]
        for rows in row_counts:
            for n in cols:
                p = plan_row_norm(rows // heads, n, heads=heads, per_head_weight=per_head,
                                  itemsize=itemsize, sm_count=132, arch=(9, 0),
                                  direction=direction, op=op, settings=settings)
                by_config.setdefault(p.config, p)
    return list(by_config.values())



def _partial_layouts(plan, f) -> dict[str, ArrayLayout]:
    """dgamma's and dbeta's partial sums: side by side in one buffer (PartialBuffer)."""
    partial = ArrayLayout("float32", *cutile.PartialBuffer.of(
        plan, max(1, f.has_weight + f.has_bias)).group())
    return {name: partial for name, has in (("partial_w", f.has_weight),
                                            ("partial_b", f.has_bias)) if has}

def plan_jobs(plan: RowNormPlan, v: Variant) -> Iterator[ExportJob]:
    f = v.features
    res = v.residual or "float32"
    rows3 = (plan.rows, plan.heads, plan.cols)
    layouts = {"rstd": _dense("float32", rows3[:2])}
    if f.layer_norm:
        layouts["mean"] = _dense("float32", rows3[:2])
    if f.has_weight:
        layouts["weight"] = _dense(v.weight, (1, plan.heads if f.per_head_weight else 1,
                                              plan.cols))
    kind = "single" if plan.single_pass else "column split" if plan.column_split else "chunked"
    name = (f"{kind} {plan.tile_rows}x{plan.tile_heads}"
            f"x{plan.tile_cols}{f'+{plan.split_cols}' if plan.split_cols else ''} {v.label}")
    if plan.direction == "forward":
        layouts.update(x=_dense(v.x, rows3), y=_dense(v.out or v.x, rows3))
        if f.has_bias:
            layouts["bias"] = layouts["weight"] if f.has_weight else _dense(
                v.weight, (1, 1, plan.cols))
        if f.has_residual:
            layouts.update(residual=_dense(res, rows3), residual_out=_dense(res, rows3))
        yield _job(f"fwd {name}", cutile.bind_forward(plan, f), layouts)
        return
    split = f.has_residual and v.residual != v.x
    bound = cutile.bind_backward(plan, f, f.has_residual, split, v.dy_terms)
    for part in ("dy", "dy2", "dy3")[:v.dy_terms]:
        layouts[part] = _dense(v.out or v.x, rows3)
    layouts.update(h=_dense(res if f.has_residual else v.x, rows3), dx=_dense(v.x, rows3))
    if f.has_residual:
        layouts["dres_in"] = _dense(res, rows3)
    if split:
        layouts["dres"] = _dense(res, rows3)
    layouts.update(_partial_layouts(plan, f))
    if bound.first is not None:
        layouts["row_sums"] = _dense("float32", rows3[:2] + bound.workspace)
        yield _job(f"bwd row sums {name}", bound.first, layouts)
    yield _job(f"bwd {name}", bound, layouts)


RMS = NormFeatures()
LAYER_NORM = NormFeatures(layer_norm=True, has_bias=True)
#: Each op's plain variant, built on every tile configuration the planner chooses for it.
OP_VARIANTS = {"rms": Variant("rms", RMS), "layer_norm": Variant("layer_norm", LAYER_NORM)}


def variants() -> list[Variant]:
    """Feature and dtype combinations built on one single-pass, one split and one wide-row
    configuration."""
    out = []
    for x_name, w_name in DTYPE_PAIRS:
        suffix = f"{x_name}/{w_name}"
        out += [Variant(f"rms {suffix}", RMS, x_name, w_name),
                Variant(f"layer_norm {suffix}", LAYER_NORM, x_name, w_name)]
        if x_name == w_name:
            out += [Variant(f"rms no-weight {x_name}", replace(RMS, has_weight=False), x_name,
                            w_name),
                    Variant(f"layer_norm no-affine {x_name}",
                            replace(LAYER_NORM, has_weight=False, has_bias=False), x_name,
                            w_name)]
    residual = replace(RMS, has_residual=True)
    out += [
        Variant("rms residual bf16", residual),
        Variant("rms residual fp32 stream", residual, residual="float32"),
        Variant("layer_norm residual bf16", replace(LAYER_NORM, has_residual=True)),
        Variant("rms fp32 in, bf16 out", RMS, "float32", "float32", out="bfloat16"),
        Variant("rms offset bf16", replace(RMS, has_offset=True)),
        Variant("rms offset fp32 weight", replace(RMS, has_offset=True), weight="float32"),
        Variant("rms bf16 64-bit offsets", RMS, index_bits=64),
        Variant("layer_norm bf16 64-bit offsets", LAYER_NORM, index_bits=64),
    ]
    return [replace(v, residual=v.residual or v.x) if v.features.has_residual else v
            for v in out]


def gradient_term_variants() -> list[Variant]:
    """Backward variants whose y gradient comes in parts (a compiled graph's, summed in the
    kernel), built on the same three configurations as :func:`variants`."""
    residual = replace(RMS, has_residual=True)
    return [Variant("rms 2 gradient terms", RMS, dy_terms=2),
            Variant("rms 3 gradient terms", RMS, dy_terms=3),
            Variant("rms residual 3 gradient terms", residual, residual="bfloat16", dy_terms=3),
            Variant("layer_norm 3 gradient terms", LAYER_NORM, dy_terms=3)]


def op_of(v: Variant) -> str:
    return "layer_norm" if v.features.layer_norm else "rms_norm"


def jobs() -> Iterator[ExportJob]:
    for direction in ("forward", "backward"):
        for v in OP_VARIANTS.values():
            for plan in plans(direction, op_of(v)):  # every tile configuration
                yield from plan_jobs(plan, v)
        for v in variants() + (gradient_term_variants() if direction == "backward" else []):
            chosen = plans(direction, op_of(v), itemsize=ITEMSIZE[v.x])
            single = [p for p in chosen if p.single_pass and not p.split_cols]
            split = [p for p in chosen if p.split_cols]
            wide = [p for p in chosen if not p.single_pass]
            for plan in (single[-1], *split[-1:], wide[0]):  # widest of each kernel kind
                yield from plan_jobs(replace(plan, index_bits=v.index_bits), v)
        for per_head in (False, True):  # QK-norm (8 heads of 128) and 2 heads of wide rows
            label = "per-head weight" if per_head else "shared weight"
            features = replace(RMS, per_head_weight=per_head)
            qk = plans(direction, heads=8, per_head=per_head)[3]
            yield from plan_jobs(qk, Variant(f"rms 8 heads {label}", features, heads=8))
            wide = [p for p in plans(direction, heads=2, per_head=per_head) if not p.single_pass]
            yield from plan_jobs(wide[0], Variant(f"rms 2 heads {label}", features, heads=2))
    yield from fp8_jobs()
    plan = plans("backward")[0]
    _, heads, cols = plan.partial_shape
    for groups in (1, 2):
        for w_name in ("bfloat16", "float16", "float32"):
            out = _dense(w_name, (heads * cols,))
            layouts = {"partial": ArrayLayout(
                "float32", *cutile.PartialBuffer.of(plan, groups).reduced()), "out_a": out}
            if groups == 2:
                layouts["out_b"] = out
            yield _job(f"column_sums {groups} -> {w_name}", cutile.bind_reduce(plan, groups),
                       layouts)


def export(job: ExportJob, gpu_code: str) -> bytes:
    """Compile ``job`` for ``gpu_code`` (e.g. "sm_90") and return the cubin."""
    out = io.BytesIO()
    export_kernel(job.kernel, [job.signature], out, gpu_code=gpu_code, output_format="cubin")
    return out.getvalue()


# --- variants recorded where they ran --------------------------------------------------------


def variant_record(bound: BoundKernel, layouts: tuple[ArrayLayout, ...],
                   arch: tuple[int, int]) -> str | None:
    """What :func:`tilenorm.launch.driver.compiled_cubin` compiles (``bound`` for arrays of
    ``layouts`` on compute capability ``arch``) as one line of JSON (keys sorted, so equal
    variants give equal lines) from which :func:`recorded_job` rebuilds the same export;
    None where it would not (a recording never fails the launch). The GPU suite records the
    variants its tests compile so that a machine without a GPU can build them into cuTile's
    cache before the next run (bench/experiments/gpu_suite_caches.py; bench/NOTES.md #118)."""
    fn = bound.source
    try:
        options = bound.kernel._compiler_options
        line = json.dumps({"kernel": f"{fn.__module__}:{fn.__name__}",
                           "occupancy": options.occupancy,
                           "worker_warps": options.num_worker_warps,
                           "index_bits": bound.index_bits, "constants": bound.constants,
                           "layouts": [[a.dtype, a.shape, a.strides] for a in layouts],
                           "arch": arch}, sort_keys=True, separators=(",", ":"))
        job, _ = recorded_job(line)
    except (TypeError, ValueError, AttributeError, ImportError, KeyError):
        return None
    same = (job.kernel is bound.kernel
            and job.signature.symbol == signature(bound, layouts).symbol)
    return line if same else None


def recorded_job(line: str) -> tuple[ExportJob, str]:
    """(the export, its GPU code) of a :func:`variant_record` line. A kernel function of
    :mod:`tilenorm.kernels` is compiled by :func:`tilenorm.launch.cutile.compiled`, or is a
    kernel itself (``column_sums``). ``AttributeError``, ``ImportError`` or ``KeyError``
    where the record names a kernel these sources no longer have."""
    record = json.loads(line)
    module, name = record["kernel"].split(":")
    found = getattr(importlib.import_module(module), name)
    if isinstance(found, ct.kernel):
        kernel, fn = found, found._pyfunc
    else:
        kernel, fn = cutile.compiled(found, record["occupancy"], record["index_bits"],
                                     record["worker_warps"]), found
    bound = BoundKernel(kernel, fn, cutile.ARRAYS[fn], (1, 1, 1), tuple(record["constants"]),
                        False, record["index_bits"])
    layouts = tuple(ArrayLayout(dtype, tuple(shape), tuple(strides))
                    for dtype, shape, strides in record["layouts"])
    sig = signature(bound, layouts)
    major, minor = record["arch"]
    return ExportJob(f"recorded {sig.symbol}", kernel, sig), f"sm_{major}{minor}"


# --- FP8 output ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Variant:
    """One FP8-output feature combination: the row kernel's scaling (a key of
    :data:`~tilenorm.launch.cutile_fp8.ROW_SCALINGS`), the FP8 format of q, and the dtypes
    of the other operands (x is ``fp8`` where ``features.group``)."""

    label: str
    features: Fp8NormFeatures
    scaling: str = "row"
    fp8: str = "float8_e4m3fn"
    x: str = "bfloat16"
    weight: str = "bfloat16"
    residual: str = "bfloat16"
    index_bits: int = 32
    #: The row kernel also keeps per-program column amaxes (a per-row scaling's transposed
    #: copy).
    column_amax: bool = False

    @property
    def x_dtype(self) -> str:
        return self.fp8 if self.features.group else self.x


def fp8_plans(direction, op: str = "rms_norm", itemsize: int = 2, min_cols: int = 16
              ) -> list[RowNormPlan]:
    """One FP8 row-kernel plan per tile configuration for rows of ``min_cols`` (a power of
    two) up to the widest; persistent forward grids (the per-tensor scalings' first pass). On
    a device of any class."""
    by_config = {}
    for device_class in DEVICE_CLASSES:
        widest = max_fp8_cols(direction, op, itemsize, (9, 0), device_class)
        cols = min_cols
        while cols <= widest:
            p = plan_fp8_row(65536, cols, itemsize=itemsize, sm_count=132, arch=(9, 0),
                             direction=direction, op=op, persistent=direction == "forward",
                             device_class=device_class)
            by_config.setdefault(p.config, p)
            cols *= 2
    return list(by_config.values())


def _fp8_common_layouts(rows: int, cols: int, v: Fp8Variant) -> dict:
    f = v.features
    layouts = {"rstd": _dense("float32", (rows,))}
    if f.layer_norm:
        layouts["mean"] = _dense("float32", (rows,))
    if f.has_weight:
        layouts["weight"] = _dense(v.weight, (1, cols))
    if f.has_bias:
        layouts["bias"] = _dense(v.weight, (1, cols))
    if f.group:
        layouts["x_scale_inv"] = _dense("float32", (rows, cols // f.group))
    return layouts


def _fp8_scale_layout(scaling: str, rows: int, cols: int) -> ArrayLayout:
    """q's scales as the ops allocate them (see tilenorm.pytorch.fp8)."""
    if scaling == "row":
        return _dense("float32", (rows, 1))
    if scaling == "block":  # torch._scaled_mm's BlockWise1x128: (M, N / 128), M contiguous
        return ArrayLayout("float32", (rows, cols // 128), (1, rows))
    return _dense("uint8", (rows, cols // 32))


def fp8_row_job(plan: RowNormPlan, v: Fp8Variant) -> ExportJob:
    f = v.features
    rows, cols = plan.rows, plan.cols
    layouts = _fp8_common_layouts(rows, cols, v)
    layouts["x"] = _dense(v.x_dtype, (rows, cols))
    if f.has_residual:
        layouts.update(residual=_dense(v.residual, (rows, cols)),
                       residual_out=_dense(v.residual, (rows, cols)))
    if v.scaling in ("amax", "delayed"):
        layouts["amax_partial"] = _dense("float32", (plan.grid,))
    if v.scaling == "delayed":
        layouts["scale"] = _dense("float32", (1,))
    if v.scaling != "amax":
        layouts["q"] = _dense(v.fp8, (rows, cols))
    if v.scaling in ("row", "block", "mx"):
        layouts["q_scale"] = _fp8_scale_layout(v.scaling, rows, cols)
    if v.column_amax:
        layouts["column_amax_partial"] = _dense("float32", (plan.grid, cols))
    bound = cutile_fp8.bind_fp8_forward(plan, f, v.scaling, FP8_MAX[v.fp8], v.column_amax)
    scaling = f"{v.scaling}+columns" if v.column_amax else v.scaling
    return _job(f"fp8 fwd {scaling} {plan.tile_rows}x{plan.tile_cols} {v.label}", bound,
                layouts)


def fp8_quantize_job(v: Fp8Variant, current: bool, transpose: bool) -> ExportJob:
    """The second pass after the first pass of 65536 x 4096 (264 programs on an H200)."""
    f = v.features
    first = fp8_plans("forward", itemsize=ITEMSIZE.get(v.x, 2))
    rows, cols, partials = 65536, 4096, 264
    plan = replace(plan_fp8_quantize(rows, cols, sm_count=132, arch=(9, 0),
                                     dependent_launch=first[0].dependent_launch),
                   index_bits=v.index_bits)
    layouts = _fp8_common_layouts(rows, cols, v)
    if f.has_residual:
        layouts.pop("x_scale_inv", None)
    h = v.residual if f.has_residual else v.x_dtype
    layouts.update(h=_dense(h, (rows, cols)), amax_partial=_dense("float32", (partials,)),
                   q=_dense(v.fp8, (rows, cols)), amax=_dense("float32", (1,)),
                   scale_inv=_dense("float32", (1,)))
    if not current:
        layouts["scale"] = _dense("float32", (1,))
    if transpose:
        layouts["q_t"] = _dense(v.fp8, (cols, rows))
    bound = cutile_fp8.bind_fp8_quantize(plan, f, partials, current, transpose,
                                         FP8_MAX[v.fp8])
    name = f"{'current' if current else 'delayed'}{' transposed' if transpose else ''}"
    return _job(f"fp8 quantize {name} {v.label}", bound, layouts)


def _fp8_transposed_scale_layout(scaling: str, rows: int, cols: int) -> ArrayLayout:
    """The transposed copy's scales as the ops allocate them (see tilenorm.pytorch.fp8)."""
    if scaling == "row":
        return _dense("float32", (cols, 1))
    if scaling == "block":  # (N, M / 128), N contiguous
        return ArrayLayout("float32", (cols, -(-rows // 128)), (1, cols))
    return _dense("uint8", (cols, -(-rows // 32)))


def fp8_transposed_job(v: Fp8Variant) -> ExportJob:
    """The transposed copy of ``v.scaling`` ("row", "block", "mx") after the row kernel of
    65536 x 4096."""
    f = v.features
    rows, cols = 65536, 4096
    first = fp8_plans("forward", itemsize=ITEMSIZE.get(v.x, 2))
    plan = replace(plan_fp8_quantize(rows, cols, sm_count=132, arch=(9, 0),
                                     dependent_launch=first[0].dependent_launch,
                                     column_blocks=v.scaling != "row"),
                   index_bits=v.index_bits)
    layouts = _fp8_common_layouts(rows, cols, v)
    if f.has_residual:
        layouts.pop("x_scale_inv", None)
    h = v.residual if f.has_residual else v.x_dtype
    layouts.update(h=_dense(h, (rows, cols)), q_t=_dense(v.fp8, (cols, rows)),
                   q_t_scale=_fp8_transposed_scale_layout(v.scaling, rows, cols))
    if v.scaling == "row":
        layouts["column_amax"] = _dense("float32", (cols,))
    bound = cutile_fp8.bind_fp8_quantize_transposed(plan, f, v.scaling, FP8_MAX[v.fp8])
    return _job(f"fp8 transposed {v.scaling} {v.label}", bound, layouts)


def fp8_column_amax_job(partials: int, cols: int, dependent: bool) -> ExportJob:
    plan = plan_fp8_column_amax(partials, cols, arch=(9, 0), dependent_launch=dependent)
    layouts = {"column_amax_partial": _dense("float32", (partials, cols)),
               "column_amax": _dense("float32", (cols,))}
    return _job(f"fp8 column amax {partials}x{cols}{' dependent' if dependent else ''}",
                cutile_fp8.bind_fp8_column_amax(plan), layouts)


def fp8_mx_swizzle_job(rows: int, groups: int, dependent: bool) -> ExportJob:
    plan = plan_fp8_mx_swizzle(rows, groups, arch=(9, 0), dependent_launch=dependent)
    blocked = (-(-rows // 128), -(-groups // 4), 32, 4, 4)
    layouts = {"scales": _dense("uint8", (rows, groups)), "blocked": _dense("uint8", blocked)}
    return _job(f"fp8 mx swizzle {rows}x{groups}{' dependent' if dependent else ''}",
                cutile_fp8.bind_fp8_mx_swizzle(plan), layouts)


def fp8_backward_job(plan: RowNormPlan, v: Fp8Variant) -> ExportJob:
    f = v.features
    rows, cols = plan.rows, plan.cols
    layouts = _fp8_common_layouts(rows, cols, v)
    layouts.update(dy=_dense(v.x, (rows, cols)), x=_dense(v.fp8, (rows, cols)),
                   dx=_dense(v.x, (rows, cols)))
    layouts.update(_partial_layouts(plan, f))
    bound = cutile_fp8.bind_fp8_input_backward(replace(plan, index_bits=v.index_bits), f)
    return _job(f"fp8 input bwd {plan.tile_rows}x{plan.tile_cols} {v.label}", bound, layouts)


FP8_RMS = Fp8NormFeatures()
FP8_LAYER_NORM = Fp8NormFeatures(layer_norm=True, has_bias=True)


def fp8_feature_variants() -> list[Fp8Variant]:
    """Feature and dtype combinations of the row kernel, each with per-row scales and as the
    first pass of a per-tensor scaling (every scaling has its own variants in
    :func:`fp8_jobs`)."""
    out = [Fp8Variant("layer_norm", FP8_LAYER_NORM),
           Fp8Variant("layer_norm no-affine", replace(FP8_LAYER_NORM, has_weight=False,
                                                      has_bias=False)),
           Fp8Variant("rms no-weight", replace(FP8_RMS, has_weight=False)),
           Fp8Variant("rms offset", replace(FP8_RMS, has_offset=True)),
           Fp8Variant("rms fp32 weight", FP8_RMS, weight="float32"),
           Fp8Variant("rms fp16", FP8_RMS, x="float16", weight="float16"),
           Fp8Variant("rms fp32", FP8_RMS, x="float32", weight="float32"),
           Fp8Variant("rms residual bf16", replace(FP8_RMS, has_residual=True)),
           Fp8Variant("rms residual fp32 stream", replace(FP8_RMS, has_residual=True),
                      residual="float32"),
           Fp8Variant("layer_norm residual bf16", replace(FP8_LAYER_NORM, has_residual=True)),
           Fp8Variant("rms 64-bit offsets", FP8_RMS, index_bits=64)]
    for group in (16, 128):
        out += [Fp8Variant(f"rms fp8 input group {group}", replace(FP8_RMS, group=group)),
                Fp8Variant(f"layer_norm fp8 input group {group}",
                           replace(FP8_LAYER_NORM, group=group)),
                Fp8Variant(f"rms fp8 input group {group} residual bf16",
                           replace(FP8_RMS, group=group, has_residual=True))]
    return out


def _typed(v: Fp8Variant) -> Fp8Variant:
    """``v`` labelled with its (x, q) dtypes: ``python -m tilenorm`` builds such variants only
    with ``--aot-all``, as the bf16 norms' dtype pairs."""
    return replace(v, label=f"{v.label} {v.x_dtype}/{v.fp8}")


def fp8_jobs() -> Iterator[ExportJob]:
    """Every FP8-output kernel configuration: the row kernel on every tile configuration
    (per-row scales, and with the per-program column amaxes), each scaling and FP8 format on
    the narrowest and widest tiles its blocks allow, each feature on 4096-column and the
    widest tiles; the second pass for both per-tensor scalings with and without the
    transpose; the transposed copies of the per-row, per-block and MX scalings and the
    column-amax reduction before the per-row one; the MX scale swizzle at every width of
    its tiles; the amax fold; the FP8-input backward on every tile configuration and each
    feature."""
    for plan in fp8_plans("forward"):
        yield fp8_row_job(plan, Fp8Variant("rms", FP8_RMS))
        yield fp8_row_job(plan, Fp8Variant("rms", FP8_RMS, column_amax=True))
    for scaling in ("amax", "delayed", "row", "block", "mx"):
        chosen = fp8_plans("forward", min_cols=cutile_fp8.BLOCK_COLS.get(scaling, 16))
        for fp8 in FP8_MAX:
            for plan in (chosen[0], chosen[-1]):
                yield fp8_row_job(plan, _typed(Fp8Variant("rms", FP8_RMS, scaling, fp8)))
    for v in map(_typed, fp8_feature_variants()):
        op = "layer_norm" if v.features.layer_norm else "rms_norm"
        chosen = fp8_plans("forward", op, ITEMSIZE[v.x], min_cols=4096)
        for plan in (chosen[0], chosen[-1]):
            plan = replace(plan, index_bits=v.index_bits)
            for scaling in ("row", "amax"):
                yield fp8_row_job(plan, replace(v, scaling=scaling))
            yield fp8_row_job(plan, replace(v, column_amax=True))
    typed_variants = list(map(_typed, fp8_feature_variants() + [
        Fp8Variant("rms", FP8_RMS, fp8="float8_e5m2")]))
    for v in typed_variants:
        for current in (True, False):
            for transpose in (False, True):
                yield fp8_quantize_job(v, current, transpose)
        for scaling in cutile_fp8.TRANSPOSED_SCALINGS:
            yield fp8_transposed_job(replace(v, scaling=scaling))
    for cols in (16, 32, 64, 4096):  # every tile width of the reduction
        for dependent in (False, True):
            yield fp8_column_amax_job(264, cols, dependent)
    yield fp8_column_amax_job(1, 4096, False)
    # 1, 2, 4 and 8 tiles a program (the copy of 300 rows has 10 groups).
    for rows, groups in ((65536, 4), (65536, 8), (4096, 10), (65536, 128)):
        for dependent in (False, True):
            yield fp8_mx_swizzle_job(rows, groups, dependent)
    for partials in (1, 264):
        for dependent in (False, True):
            bound = cutile_fp8.bind_fp8_amax_finish(partials, dependent)
            layouts = {"amax_partial": _dense("float32", (partials,)),
                       "scale": _dense("float32", (1,)), "amax": _dense("float32", (1,)),
                       "scale_inv": _dense("float32", (1,))}
            yield _job(f"fp8 amax finish {partials}{' dependent' if dependent else ''}",
                       bound, layouts)
    for plan in fp8_plans("backward"):
        yield fp8_backward_job(plan, Fp8Variant("rms group 16", replace(FP8_RMS, group=16)))
    backward_variants = [
        Fp8Variant("rms group 128", replace(FP8_RMS, group=128)),
        Fp8Variant("layer_norm group 16", replace(FP8_LAYER_NORM, group=16)),
        Fp8Variant("rms no-weight group 16", replace(FP8_RMS, has_weight=False, group=16)),
        Fp8Variant("rms offset group 16", replace(FP8_RMS, has_offset=True, group=16)),
        Fp8Variant("rms fp32 weight group 16", replace(FP8_RMS, group=16), weight="float32"),
        Fp8Variant("rms group 16", replace(FP8_RMS, group=16), fp8="float8_e5m2"),
        Fp8Variant("rms group 16 64-bit offsets", replace(FP8_RMS, group=16), index_bits=64)]
    for v in map(_typed, backward_variants):
        op = "layer_norm" if v.features.layer_norm else "rms_norm"
        chosen = fp8_plans("backward", op, min_cols=4096)
        for plan in (chosen[0], chosen[-1]):
            yield fp8_backward_job(plan, v)
