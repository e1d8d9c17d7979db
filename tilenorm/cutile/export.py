"""Ahead-of-time compilation of every cuTile kernel variant the planner can choose.

Needs no GPU: ``cuda.tile.compilation.export_kernel`` runs the cuTile compiler (tileiras)
on the CPU. CI uses it to prove that each configuration builds for Hopper (sm_90) and
Blackwell (sm_100); ``python -m tilenorm`` does the same on a machine without a GPU.

The launch arguments come from the same builders the runtime uses
(:func:`tilenorm.cutile.rms_norm.forward_launch` and friends), with parameter constraints in
place of tensors, so the exported variants are the ones that run.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

import cuda.tile as ct
from cuda.tile.compilation import (
    ArrayConstraint,
    CallingConvention,
    KernelSignature,
    ScalarConstraint,
    export_kernel,
)

from tilenorm.cutile import rms_norm
from tilenorm.planner import (
    MAX_SINGLE_PASS_COLS,
    MIN_TILE_COLS,
    RowNormPlan,
    kernel_configs,
    plan_row_norm,
)

DTYPES = {"bfloat16": ct.bfloat16, "float16": ct.float16, "float32": ct.float32}
#: (x dtype, weight dtype) pairs the ops accept: the weight in x's dtype or in fp32.
DTYPE_PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
               ("bfloat16", "float32"), ("float16", "float32")]
GPU_CODES = ("sm_90", "sm_100")


@dataclass(frozen=True)
class ExportJob:
    label: str
    kernel: object
    signature: KernelSignature


def _array(dtype, ndim: int) -> ArrayConstraint:
    # The common case: innermost stride 1 and a 16-byte aligned base. Other layouts compile
    # other variants of the same code just in time.
    return ArrayConstraint(
        dtype, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=[],
        may_alias_internally=False, stride_constant=[None] * (ndim - 1) + [1],
        base_addr_divisible_by=16)


def representative_plans(direction) -> list[RowNormPlan]:
    """One plan per kernel configuration the planner can choose for ``direction``."""
    cols = [MIN_TILE_COLS]
    while cols[-1] < MAX_SINGLE_PASS_COLS[direction]:
        cols.append(cols[-1] * 2)
    cols.append(2 * MAX_SINGLE_PASS_COLS[direction])
    plans = [plan_row_norm(4096, n, itemsize=2, sm_count=132, arch=(9, 0), direction=direction)
             for n in cols]
    configs = {(p.single_pass, p.tile_rows, p.tile_cols, p.occupancy) for p in plans}
    assert configs == set(kernel_configs(direction)), "representative plans miss a config"
    return plans


def rms_norm_jobs() -> Iterator[ExportJob]:
    f32 = ScalarConstraint(ct.float32)
    cconv = CallingConvention.cutile_python_v2()
    for x_name, w_name in DTYPE_PAIRS:
        x_dt, w_dt = DTYPES[x_name], DTYPES[w_name]
        # Without a weight the weight's dtype is irrelevant; build that variant once per x.
        weight_options = [True] if x_name != w_name else [True, False]
        for has_weight in weight_options:
            w = _array(w_dt if has_weight else ct.float32, 1)
            suffix = f"{x_name}/{w_name if has_weight else 'no-weight'}"
            for plan in representative_plans("forward"):
                kernel, _, args = rms_norm.forward_launch(
                    plan, _array(x_dt, 2), w, _array(x_dt, 2), _array(ct.float32, 1),
                    f32, f32, has_weight)
                yield ExportJob(f"fwd {plan.tile_rows}x{plan.tile_cols} "
                                f"{'single' if plan.single_pass else 'chunked'} {suffix}",
                                kernel, KernelSignature(list(args), cconv))
            for plan in representative_plans("backward"):
                kernel, _, args = rms_norm.backward_launch(
                    plan, _array(x_dt, 2), _array(x_dt, 2), w, _array(ct.float32, 1),
                    _array(x_dt, 2), _array(ct.float32, 2), f32, has_weight)
                yield ExportJob(f"bwd {plan.tile_rows}x{plan.tile_cols} "
                                f"{'single' if plan.single_pass else 'chunked'} {suffix}",
                                kernel, KernelSignature(list(args), cconv))
    plan = representative_plans("backward")[0]
    for w_name in ("bfloat16", "float16", "float32"):
        kernel, _, args = rms_norm.reduce_launch(plan, _array(ct.float32, 2),
                                                 _array(DTYPES[w_name], 1))
        yield ExportJob(f"column_sum -> {w_name}", kernel, KernelSignature(list(args), cconv))


def export(job: ExportJob, gpu_code: str) -> bytes:
    """Compile ``job`` for ``gpu_code`` (e.g. "sm_90") and return the cubin."""
    out = io.BytesIO()
    export_kernel(job.kernel, [job.signature], out, gpu_code=gpu_code, output_format="cubin")
    return out.getvalue()
