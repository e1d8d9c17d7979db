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
backward) configuration.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, replace

from cuda.tile.compilation import KernelSignature, export_kernel

from tilenorm.launch import cutile
from tilenorm.launch.cutile import BoundKernel, NormFeatures
from tilenorm.launch.driver import ArrayLayout, signature
from tilenorm.layout import contiguous_strides
from tilenorm.planner import RowNormPlan, max_single_pass_cols, plan_row_norm
from tilenorm.settings import SM90

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
    ``itemsize``-byte elements."""
    widest = max_single_pass_cols(direction, op, itemsize)
    cols = [SM90.min_tile_cols]
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
    # dgamma's and dbeta's partial sums lie side by side in one buffer (PartialBuffer).
    partial = ArrayLayout("float32", *cutile.PartialBuffer.of(
        plan, max(1, f.has_weight + f.has_bias)).group())
    if f.has_weight:
        layouts["partial_w"] = partial
    if f.has_bias:
        layouts["partial_b"] = partial
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
