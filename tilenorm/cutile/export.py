"""Ahead-of-time compilation of the cuTile kernel variants the planner and the ops choose.

Needs no GPU: ``cuda.tile.compilation.export_kernel`` runs the cuTile compiler (tileiras)
on the CPU. CI uses it to prove that each configuration builds for Hopper (sm_90) and
Blackwell (sm_100); ``python -m tilenorm`` does the same on a machine without a GPU.

The launch arguments come from the same builders the runtime uses
(:func:`tilenorm.cutile.norm.bind_forward` and friends), with parameter constraints in place
of tensors, so the exported variants are the ones that run. The jobs cover every tile
configuration the planner can choose (for RMSNorm and LayerNorm in bf16), and every feature
and dtype combination the ops accept on one single-pass, one split and one wide-row (chunked
forward, column-split backward) configuration.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, replace

import cuda.tile as ct
from cuda.tile.compilation import (
    ArrayConstraint,
    CallingConvention,
    KernelSignature,
    ScalarConstraint,
    export_kernel,
)

from tilenorm.cutile import norm
from tilenorm.cutile.norm import NormFeatures
from tilenorm.planner import MIN_TILE_COLS, RowNormPlan, max_single_pass_cols, plan_row_norm

DTYPES = {"bfloat16": ct.bfloat16, "float16": ct.float16, "float32": ct.float32}
#: (x dtype, weight dtype) pairs the ops accept: the weight in x's dtype or in fp32.
DTYPE_PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
               ("bfloat16", "float32"), ("float16", "float32")]
GPU_CODES = ("sm_90", "sm_100")
F32 = ScalarConstraint(ct.float32)


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


@dataclass(frozen=True)
class ExportJob:
    label: str
    kernel: object
    signature: KernelSignature


def _array(dtype, shape: tuple[int, ...], index_bits: int = 32,
           strides: tuple[int, ...] | None = None) -> ArrayConstraint:
    """The constraints cuTile's launcher derives from a tensor of ``shape`` and ``strides``
    (default: contiguous; read off its JIT signatures on the GPU host): unit strides and
    extents are constants, other strides divide into 16 bytes, extents divisible by 16 are
    marked, the base is 16-byte aligned. Layouts that differ compile their own variants just
    in time."""
    if strides is None:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    per_16_bytes = 128 // dtype.bitwidth
    return ArrayConstraint(
        dtype, len(shape), index_dtype=ct.int64 if index_bits == 64 else ct.int32,
        stride_lower_bound_incl=[None if s == 1 else 0 for s in strides], alias_groups=[],
        may_alias_internally=False,
        stride_constant=[1 if s == 1 else None for s in strides],
        shape_constant=[1 if d == 1 else None for d in shape],
        stride_divisible_by=[per_16_bytes if s % per_16_bytes == 0 else 1 for s in strides],
        shape_divisible_by=[16 if d % 16 == 0 else 1 for d in shape],
        base_addr_divisible_by=16)


PLACEHOLDER = (1,)


def plans(direction, op: str = "rms_norm", heads: int = 1, per_head: bool = False,
           itemsize: int = 2) -> list[RowNormPlan]:
    """One plan per tile configuration the planner can choose for ``direction``, ``op`` and
    ``itemsize``-byte elements."""
    widest = max_single_pass_cols(direction, op, itemsize)
    cols = [MIN_TILE_COLS]
    while cols[-1] < widest:
        cols.append(cols[-1] * 2)
    cols.append(2 * widest)
    # Rows just over, 5/8 and 3/4 of a power of two take split single-pass tiles: the narrowest
    # second piece (4096 + 16 for 4097), 4096 + 1024 for 5120, the widest (4096 + 2048).
    cols += [w for n in cols if n <= widest for w in (n // 2 + 1, 5 * n // 8, 3 * n // 4)]
    by_config = {}
    for n in cols:
        p = plan_row_norm(65536 // heads, n, heads=heads, per_head_weight=per_head,
                          itemsize=itemsize, sm_count=132, arch=(9, 0), direction=direction,
                          op=op)
        by_config.setdefault(p.config, p)
    return list(by_config.values())


def plan_jobs(plan: RowNormPlan, v: Variant) -> Iterator[ExportJob]:
    f, bits = v.features, v.index_bits
    x, w = DTYPES[v.x], DTYPES[v.weight]
    res = DTYPES[v.residual] if v.residual else ct.float32

    rows3 = (plan.rows, plan.heads, plan.cols)
    param3 = (1, plan.heads if f.per_head_weight else 1, plan.cols)

    def a3(dt, shape=rows3):
        return _array(dt, shape, bits)

    def opt(present, arr):
        return arr if present else _array(ct.float32, PLACEHOLDER)

    stat, weight = _array(ct.float32, rows3[:2], bits), opt(f.has_weight, a3(w, param3))
    # dgamma's and dbeta's partial sums lie side by side in one buffer (norm.partial_shape).
    _, rows, cols = norm.partial_shape(plan, max(1, f.has_weight + f.has_bias))
    partial = _array(ct.float32, plan.partial_shape, bits, strides=(rows * cols, cols, 1))
    kind = "single" if plan.single_pass else "column split" if plan.column_split else "chunked"
    name = (f"{kind} {plan.tile_rows}x{plan.tile_heads}"
            f"x{plan.tile_cols}{f'+{plan.split_cols}' if plan.split_cols else ''} {v.label}")
    if plan.direction == "forward":
        bound = norm.bind_forward(plan, f)
        args = bound.args(a3(x), opt(f.has_residual, a3(res)), weight,
                          opt(f.has_bias, a3(w, param3)), a3(DTYPES[v.out or v.x]),
                          opt(f.has_residual, a3(res)), opt(f.layer_norm, stat), stat, F32, F32)
    else:
        h = a3(res) if f.has_residual else a3(x)
        split = f.has_residual and v.residual != v.x
        bound = norm.bind_backward(plan, f, f.has_residual, split)
        dy, mean = a3(DTYPES[v.out or v.x]), opt(f.layer_norm, stat)
        stats = (stat,)
        if bound.first is not None:
            row_sums = _array(ct.float32, rows3[:2] + bound.workspace, bits)
            first = bound.first.args(dy, h, weight, mean, stat, row_sums, F32)
            yield ExportJob(f"{plan.direction[:3]} row sums {name}", bound.first.kernel,
                            KernelSignature(list(first), CallingConvention.cutile_python_v2()))
            stats = (stat, row_sums)
        args = bound.args(dy, h, weight, mean, *stats, opt(f.has_residual, a3(res)), a3(x),
                          opt(split, a3(res)), opt(f.has_weight, partial),
                          opt(f.has_bias, partial), F32)
    yield ExportJob(f"{plan.direction[:3]} {name}", bound.kernel,
                    KernelSignature(list(args), CallingConvention.cutile_python_v2()))


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


def op_of(v: Variant) -> str:
    return "layer_norm" if v.features.layer_norm else "rms_norm"


def jobs() -> Iterator[ExportJob]:
    for direction in ("forward", "backward"):
        for v in OP_VARIANTS.values():
            for plan in plans(direction, op_of(v)):  # every tile configuration
                yield from plan_jobs(plan, v)
        for v in variants():
            chosen = plans(direction, op_of(v), itemsize=DTYPES[v.x].bitwidth // 8)
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
    plan = plans("backward")[0]
    slots, heads, cols = plan.partial_shape
    for groups in (1, 2):
        for w_name in ("bfloat16", "float16", "float32"):
            out = _array(DTYPES[w_name], (heads * cols,))
            bound = norm.bind_reduce(plan, groups)
            args = bound.args(_array(ct.float32, (slots, groups, heads * cols)), out,
                              out if groups == 2 else _array(ct.float32, PLACEHOLDER))
            yield ExportJob(f"column_sums {groups} -> {w_name}", bound.kernel,
                            KernelSignature(list(args), CallingConvention.cutile_python_v2()))


def export(job: ExportJob, gpu_code: str) -> bytes:
    """Compile ``job`` for ``gpu_code`` (e.g. "sm_90") and return the cubin."""
    out = io.BytesIO()
    export_kernel(job.kernel, [job.signature], out, gpu_code=gpu_code, output_format="cubin")
    return out.getvalue()
