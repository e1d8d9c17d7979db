"""The one place that decides what runs: for a forward, the CuTe DSL kernel, the cuTile plan
or the reference path; for a backward, the CuTe DSL kernel, the cuTile plan (re-planned with
64-bit offsets where a strided operand needs them) or the reference path; under
``torch.compile``, whether a norm is tilenorm's custom op or left to inductor
(:func:`compiled_by_inductor`).
:func:`tilenorm.explain` prints exactly these decisions. Framework-neutral: dtypes are named
("bfloat16", ...), devices are a kind and an index.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from tilenorm import validation
from tilenorm.device import DeviceInfo, device_info, max_active_clusters
from tilenorm.launch import cute
from tilenorm.launch.cutile import REDUCE_KERNEL_NAME, kernel_names
from tilenorm.planner import (
    MAX_INT32_OFFSET,
    BlockPlan,
    ColumnAmaxPlan,
    CuteBackwardPlan,
    CuteClusterBackwardPlan,
    CuteForwardPlan,
    CuteFp8ForwardPlan,
    CuteFp8TransposePlan,
    MxSwizzlePlan,
    Op,
    RowNormPlan,
    UnsupportedShape,
    plan_cute_backward,
    plan_cute_cluster_backward,
    plan_cute_forward,
    plan_cute_fp8_forward,
    plan_cute_fp8_transpose,
    plan_fp8_column_amax,
    plan_fp8_mx_swizzle,
    plan_fp8_quantize,
    plan_fp8_row,
    plan_row_norm,
)
from tilenorm.validation import (
    CUTE_NORM,
    CUTE_NORM_FP8,
    CUTILE_NORM,
    CUTILE_NORM_FP8,
    KernelFamily,
)

#: Element types the kernels take.
KERNEL_DTYPES = ("bfloat16", "float16", "float32")
#: FP8 formats the FP8-output kernels write (and read, as FP8 x).
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
            "float8_e5m2": 1}
#: The CuTe DSL kernels' names in decisions.
CUTE_FORWARD_NAME = "RowNormForward (CuTe DSL)"
CUTE_CLUSTER_FORWARD_NAME = "ClusterRowNormForward (CuTe DSL)"
CUTE_TWO_PASS_FORWARD_NAME = "TwoPassRowNormForward (CuTe DSL)"
CUTE_BACKWARD_NAME = "RowNormBackward (CuTe DSL)"
CUTE_CLUSTER_BACKWARD_NAME = "ClusterRowNormBackward (CuTe DSL)"


@dataclass(frozen=True)
class Problem:
    """One normalization as the kernels see it: ``rows x heads`` vectors of ``cols``
    elements. ``dtypes`` names every operand's and output's dtype, x's first;
    ``max_offset`` is the largest element offset any operand of the forward reaches."""

    op: Op
    device_type: str
    device_index: int | None
    dtypes: tuple[str, ...]
    rows: int
    heads: int
    cols: int
    per_head_weight: bool
    max_offset: int
    allow_experimental: bool
    #: The weight and bias (without a weight per head) are each one strided vector: the
    #: kernels read them so, and a multi-dimensional one whose strides do not flatten (a
    #: transposed 2-D weight) is not.
    flat_params: bool = True


@dataclass(frozen=True)
class ForwardFacts:
    """What one forward call brings beyond its problem: whether y, h (with a fused residual)
    and every parameter share x's dtype (parameters may also be fp32), whether a bias comes
    without a weight, and whether x and the residual are contiguous rows (``dense``; their
    storage's 16-byte alignment is checked at each call); whether a residual is added."""

    same_dtypes: bool
    bias_without_weight: bool
    dense: bool
    residual: bool

    @classmethod
    def of(cls, x: str, out: str, weight: str | None, bias: str | None,
           residual: str | None, h: str | None, dense: bool) -> ForwardFacts:
        """The facts from the call's dtypes by name (None for an absent operand; ``h`` the
        dtype h is stored in): the rule every framework's call applies."""
        return cls(same_dtypes=(out == x and (residual is None or residual == h == x)
                                and (weight is None or weight in (x, "float32"))
                                and (bias is None or weight is None or bias == weight)),
                   bias_without_weight=bias is not None and weight is None, dense=dense,
                   residual=residual is not None)


@dataclass(frozen=True)
class BackwardFacts:
    """What one backward call brings beyond its problem: whether the forward had a fused
    residual add, whether the gradient that reached its h is an input, a weight offset,
    whether dy, h, dx (and that gradient) share x's dtype, whether h and dy (and that
    gradient) are contiguous rows on 16-byte-aligned storage, the largest offset its operands
    reach, in how many parts y's gradient comes (a compiled graph's, which the cuTile kernels
    add up), and whether the residual's gradient is written apart from dx (a residual dtype
    other than x's)."""

    has_residual: bool
    has_dres_in: bool
    has_offset: bool
    same_dtypes: bool
    dense_aligned: bool
    max_offset: int
    dy_terms: int = 1
    dres_apart: bool = False


@dataclass(frozen=True)
class Decision:
    """What runs for one problem, and why (``str()`` it). ``forward`` and ``backward`` are
    the cuTile plans (None on the reference path); ``cute_forward`` and ``cute_backward`` the
    CuTe DSL plans that a call takes where :func:`forward_kernel` and
    :func:`backward_kernel` allow it."""

    op: str
    reason: str
    family: KernelFamily | None = None
    forward: RowNormPlan | None = None
    backward: RowNormPlan | None = None
    cute_backward: CuteBackwardPlan | CuteClusterBackwardPlan | None = None
    device: DeviceInfo | None = None
    cute_forward: CuteForwardPlan | None = None

    @property
    def uses_kernel(self) -> bool:
        return self.family is not None

    @property
    def kernels(self) -> tuple[str, ...]:
        """Every kernel the decision may launch, in launch order."""
        if not self.uses_kernel:
            return ()
        cute_forward = (cute_forward_name(self.cute_forward),) if self.cute_forward else ()
        cute_backward = (cute_backward_name(self.cute_backward),) if self.cute_backward else ()
        return (cute_forward + kernel_names(self.forward) + kernel_names(self.backward)
                + cute_backward + (REDUCE_KERNEL_NAME,))

    @property
    def status(self) -> str:
        if self.family is None:
            return "torch reference"
        families = (self.family,) + ((CUTE_NORM,) if self.cute_forward or self.cute_backward
                                     else ())
        return "; ".join(f"{family.name} {_family_status(family)}" for family in families)

    def __str__(self) -> str:
        if not self.uses_kernel:
            return f"{self.op}: reference path, because {self.reason}"
        lines = [
            f"{self.op}: {self.family.language} kernels ({self.family.name}) on "
            f"{_describe_device(self.device)}",
            f"  status:   {self.status}",
            f"  kernels:  {', '.join(self.kernels)}",
            f"  forward:  {self.forward.describe()}",
        ]
        if self.cute_forward:
            lines.append(f"  forward of contiguous, aligned rows in x's dtype, "
                         f"{cute_forward_name(self.cute_forward)}: "
                         f"{self.cute_forward.describe()}")
            with_residual = self.cute_forward.with_residual()
            if with_residual != self.cute_forward:
                lines.append(f"  forward with a fused residual: {with_residual.describe()}")
        lines.append(f"  backward: {self.backward.describe()}")
        if isinstance(self.cute_backward, CuteClusterBackwardPlan):
            lines.append(f"  backward of contiguous, aligned rows, the residual's gradient "
                         f"in x's dtype, {CUTE_CLUSTER_BACKWARD_NAME}: "
                         f"{self.cute_backward.describe()}")
        elif self.cute_backward:
            lines.append(f"  backward of contiguous, aligned rows without a fused residual "
                         f"or weight offset, {CUTE_BACKWARD_NAME}: "
                         f"{self.cute_backward.describe()}")
        lines.append(f"  why:      {self.reason}")
        return "\n".join(lines)


def cute_backward_name(plan: CuteBackwardPlan | CuteClusterBackwardPlan) -> str:
    """The CuTe DSL backward that ``plan`` launches: a row a CTA or a row a cluster."""
    return (CUTE_CLUSTER_BACKWARD_NAME if isinstance(plan, CuteClusterBackwardPlan)
            else CUTE_BACKWARD_NAME)


def cute_forward_name(plan: CuteForwardPlan) -> str:
    """The CuTe DSL forward kernel a plan launches: the cluster forward for a row held across
    a cluster of CTAs, the two-pass forward for a row walked twice, else the one-shot
    forward of rows a CTA."""
    if plan.step:
        return CUTE_TWO_PASS_FORWARD_NAME
    return CUTE_CLUSTER_FORWARD_NAME if plan.cluster > 1 else CUTE_FORWARD_NAME


def _describe_device(info: DeviceInfo) -> str:
    """The device as a decision names it, with the class whose settings it took."""
    return (f"{info.name} ({info.sm}, {info.sm_count} SMs; settings of device class "
            f"{info.device_class})")


def _family_status(family: KernelFamily) -> str:
    record = validation.validation_record(family)
    if record is None:
        return "experimental (not validated on a GPU at this source)"
    return (f"stable (validated on {record['device']}, {record['date']}, "
            f"commit {record['commit']})")


def _reference(op: str, reason: str) -> Decision:
    return Decision(op=op, reason=reason)


def _cute_may_run(p: Problem) -> bool:
    """The CuTe DSL kernels may run: installed, validated or allowed, and x's dtype that of
    every other operand or fp32 (a call then checks which is which, :class:`ForwardFacts`)."""
    return ((validation.is_stable(CUTE_NORM) or p.allow_experimental) and cute.available()
            and all(d in (p.dtypes[0], "float32") for d in p.dtypes[1:]))


def _resident_clusters(info: DeviceInfo) -> Callable[[int, int, int], int]:
    """``resident_clusters(cluster, threads, ctas_per_sm)`` of the planners: how many such
    clusters ``info``'s device holds at once (:func:`tilenorm.device.max_active_clusters`,
    looked up when asked)."""
    return lambda cluster, threads, ctas_per_sm: max_active_clusters(
        info.index, cluster, threads, ctas_per_sm)


def _cute_backward(p: Problem, info: DeviceInfo
                   ) -> CuteBackwardPlan | CuteClusterBackwardPlan | None:
    """The CuTe DSL backward where the planner has one for the shape and it may run: the
    cluster backward for rows too wide for one CTA, its grid the clusters co-resident on the
    device, else the row backward."""
    if not _cute_may_run(p):
        return None
    cluster_plan = plan_cute_cluster_backward(
        p.rows, p.cols, itemsize=ITEMSIZE[p.dtypes[0]], arch=info.arch,
        device_class=info.device_class, op=p.op, resident_clusters=_resident_clusters(info),
        heads=p.heads, max_offset=p.max_offset)
    if cluster_plan is not None:
        return cluster_plan
    return plan_cute_backward(p.rows, p.cols, itemsize=ITEMSIZE[p.dtypes[0]],
                              sm_count=info.sm_count, arch=info.arch,
                              device_class=info.device_class, op=p.op, heads=p.heads,
                              max_offset=p.max_offset)


#: The CuTe DSL forward runs from Python (TVM-FFI), without the C++ call path and autograd
#: node that the cuTile kernels have (#40, #42): a call of a smaller x keeps them. At 32 MiB
#: an eager CuTe call took 34.0 us for 24.8 us of kernel (H100, #65): below ~64 MiB the host
#: cost, not the 5% of bandwidth, decides the call's time.
CUTE_FORWARD_MIN_BYTES = 64 << 20


def _cute_forward(p: Problem, info: DeviceInfo) -> CuteForwardPlan | None:
    """The CuTe DSL forward where the planner has one for the shape, x holds at least
    :data:`CUTE_FORWARD_MIN_BYTES`, and it may run."""
    x_bytes = p.rows * p.heads * p.cols * ITEMSIZE[p.dtypes[0]]
    if x_bytes < CUTE_FORWARD_MIN_BYTES or not _cute_may_run(p):
        return None
    return plan_cute_forward(p.rows, p.cols, itemsize=ITEMSIZE[p.dtypes[0]], arch=info.arch,
                             device_class=info.device_class, op=p.op, heads=p.heads,
                             max_offset=p.max_offset, resident_clusters=_resident_clusters(info))


#: Under ``torch.compile``, a norm whose x holds at most this many bytes is traced as torch
#: operations (the reference math) for inductor to generate and fuse with the operations
#: around it, the residual add and the casts that follow, forward and backward. Up to 2 MiB
#: the kernels of either run at the launch floor (a compiled fused add-norm forward and
#: backward: 15 against 17 us of GPU time at 2 MiB, 14 against 30 at 4 MiB), while each
#: opaque custom-op call costs host time that inductor's fused code does not: the host-bound
#: compiled step went from 1.12x of HF's to a tie (bench/NOTES.md #61).
COMPILED_INDUCTOR_MAX_BYTES = 2 << 20


def compiled_by_inductor(x_bytes):
    """Whether a norm traced by a graph compiler with ``x_bytes`` bytes of x is left to the
    compiler's own fused code (see :data:`COMPILED_INDUCTOR_MAX_BYTES`) rather than held as
    tilenorm's op: a bool, or the framework's symbolic bool for a symbolic size, which the
    caller takes as True only where it is known to be."""
    return x_bytes <= COMPILED_INDUCTOR_MAX_BYTES


@functools.lru_cache(maxsize=4096)
def decide(p: Problem) -> Decision:
    """What runs for problem ``p``: kernels where they cover it and may run, else the
    reference path, with the reason."""
    if p.device_type != "cuda":
        return _reference(p.op, f"x is on {p.device_type}; the kernels run on CUDA devices")
    odd = [d for d in p.dtypes if d not in KERNEL_DTYPES]
    if odd:
        return _reference(p.op, f"an operand is {odd[0]}; the kernels take bfloat16, float16 "
                                f"and float32")
    if p.rows * p.heads * p.cols == 0:
        return _reference(p.op, "x is empty: there is nothing to launch")
    if not p.flat_params:
        return _reference(p.op, "the weight or bias has several dimensions whose strides do "
                                "not flatten to one strided vector, which is how the kernels "
                                "read it")
    family = CUTILE_NORM
    stable = validation.is_stable(family)
    if not stable and not p.allow_experimental:
        return _reference(
            p.op, f"the {family.language} kernels ({family.name}) are experimental (not yet "
                  f"validated on a GPU at this source) and experimental kernels are off; "
                  f"enable them with TILENORM_EXPERIMENTAL=1, tilenorm.set_experimental(True) "
                  f"or `with tilenorm.experimental():`")
    info = device_info(p.device_index)
    try:
        fwd, bwd = (plan_row_norm(p.rows, p.cols, heads=p.heads,
                                  per_head_weight=p.per_head_weight,
                                  itemsize=ITEMSIZE[p.dtypes[0]], sm_count=info.sm_count,
                                  arch=info.arch, device_class=info.device_class,
                                  direction=d, max_offset=p.max_offset, op=p.op)
                    for d in ("forward", "backward"))
    except UnsupportedShape as e:
        return _reference(p.op, str(e))
    reason = ("validated kernels cover this case" if stable
              else "experimental kernels are enabled")
    return Decision(op=p.op, reason=reason, family=family, forward=fwd, backward=bwd,
                    cute_backward=_cute_backward(p, info), device=info,
                    cute_forward=_cute_forward(p, info))


def forward_kernel(decision: Decision, call: ForwardFacts) -> CuteForwardPlan | RowNormPlan:
    """The kernel plan that runs one forward call of a decision that uses kernels: the CuTe
    DSL forward where it has a plan and the call allows it (y and h in x's dtype, parameters
    in x's dtype or fp32, no bias without a weight, contiguous rows), with a residual its
    ``with_residual`` plan; else the cuTile forward."""
    if (decision.cute_forward is not None and call.same_dtypes
            and not call.bias_without_weight and call.dense):
        return decision.cute_forward.with_residual() if call.residual else decision.cute_forward
    return decision.forward


def backward_kernel(decision: Decision, call: BackwardFacts
                    ) -> CuteBackwardPlan | CuteClusterBackwardPlan | RowNormPlan:
    """The kernel plan that runs one backward call of a decision that uses kernels: the CuTe
    DSL backward where it has a plan and the call allows it (dx in x's dtype, contiguous rows
    on 16-byte-aligned storage, y's gradient in one part; for the row backward no fused
    residual and no weight offset, for the cluster backward a residual's gradient only as dx
    itself), else the cuTile backward, with 64-bit offsets where the call's strided operands
    pass 2^31 - 1."""
    cute_plan = decision.cute_backward
    if (cute_plan is not None and call.same_dtypes and call.dense_aligned
            and call.dy_terms == 1):
        if isinstance(cute_plan, CuteClusterBackwardPlan):
            if not call.dres_apart:
                return cute_plan
        elif not call.has_residual and not call.has_dres_in and not call.has_offset:
            return cute_plan
    plan = decision.backward
    if plan.index_bits == 32 and call.max_offset > MAX_INT32_OFFSET:
        return dataclasses.replace(plan, index_bits=64)
    return plan


# --- FP8 output ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Problem:
    """One FP8-output normalization of ``rows`` rows of ``cols``: x's dtype first in
    ``dtypes`` (an FP8 format for FP8 x), then the weight's, bias's and residual's; the
    scaling (a key of ``tilenorm.launch.cutile_fp8.ROW_SCALINGS`` but "amax", or "tensor")
    whether the transposed copy is written and whether a residual is added."""

    op: Op
    device_type: str
    device_index: int | None
    dtypes: tuple[str, ...]
    rows: int
    cols: int
    scaling: str
    transpose: bool
    has_residual: bool
    max_offset: int
    allow_experimental: bool
    #: "swizzled": MX scales re-laid into 128 x 4 tiles after the kernels that write them.
    mx_layout: str = "row_major"
    #: FP8 x's elements a multiplier covers (``group_size``); 0 for other x.
    group: int = 0

    @property
    def fp8_input(self) -> bool:
        return self.dtypes[0] in FP8_DTYPES

    @property
    def fp8_backward(self) -> bool:
        """The backward re-reads FP8 x (with a fused residual it reads the stored h)."""
        return self.fp8_input and not self.has_residual

    @property
    def two_passes(self) -> bool:
        """Per-tensor current scaling, and any transposed copy: a statistics pass, then a
        quantizing pass over blocks."""
        return self.scaling == "tensor" or self.transpose

    @property
    def row_scaling(self) -> str:
        """What the row kernel writes (a key of ``ROW_SCALINGS``): per-tensor scalings whose
        second pass quantizes take its statistics pass ("amax"), the rest the scaling."""
        per_tensor = self.scaling in ("tensor", "delayed")
        return "amax" if self.two_passes and per_tensor else self.scaling

    @property
    def scales_along_rows(self) -> bool:
        """A transposed copy whose scales run along M (per row, per block, MX): its own
        pass after the row kernel, which writes q."""
        return self.transpose and self.scaling in ("row", "block", "mx")


@dataclass(frozen=True)
class Fp8Decision:
    """What runs for one FP8-output problem, and why (``str()`` it): the row kernel's plan
    (``forward``), the second pass's (``quantize``: per-tensor current scaling and
    transposed copies), the column-amax reduction's before the transposed copy of a per-row
    scaling (``column_amax``), the MX scale swizzles' (``swizzle`` of q's scales,
    ``swizzle_t`` of the copy's), and for FP8 x the backward's (``backward``; bf16 x takes
    the bf16 norms' backward, :func:`decide`). None of them on the reference path."""

    op: str
    reason: str
    scaling: str = ""
    family: KernelFamily | None = None
    forward: RowNormPlan | None = None
    quantize: BlockPlan | None = None
    column_amax: ColumnAmaxPlan | None = None
    swizzle: MxSwizzlePlan | None = None
    swizzle_t: MxSwizzlePlan | None = None
    backward: RowNormPlan | None = None
    device: DeviceInfo | None = None
    #: The CuTe DSL row kernel's plan where it runs instead of cuTile's ``forward``.
    cute_forward: CuteFp8ForwardPlan | None = None
    #: The CuTe DSL transposed copy's plan where it runs instead of cuTile's
    #: ``fp8_quantize_transposed`` (``quantize`` is then None).
    cute_transpose: CuteFp8TransposePlan | None = None

    @property
    def uses_kernel(self) -> bool:
        return self.family is not None

    @property
    def kernels(self) -> tuple[str, ...]:
        """Every kernel the forward (and an FP8-input backward) may launch, in order."""
        if not self.uses_kernel:
            return ()
        names = (CUTE_FP8_FORWARD_NAME if self.cute_forward else "norm_fwd_fp8_single",)
        if self.column_amax is not None:
            names += ("fp8_column_amax",)
        if self.cute_transpose is not None:
            names += (CUTE_FP8_TRANSPOSE_NAME,)
        elif self.quantize is not None:
            names += ("fp8_quantize_normed",) if self.scaling in ("tensor", "delayed") \
                else ("fp8_quantize_transposed",)
        elif self.scaling == "delayed":
            names += ("fp8_amax_finish",)
        names += ("fp8_swizzle_mx_scales",) * ((self.swizzle is not None)
                                               + (self.swizzle_t is not None))
        if self.backward is not None:
            names += ("norm_bwd_fp8_input_single", REDUCE_KERNEL_NAME)
        return names

    def __str__(self) -> str:
        if not self.uses_kernel:
            return f"{self.op} (FP8 output, {self.scaling}): reference path, because {self.reason}"
        lines = [
            f"{self.op} (FP8 output, {self.scaling}): {self.family.language} kernels "
            f"({self.family.name}) on {_describe_device(self.device)}",
            f"  status:   {self.family.name} {_family_status(self.family)}",
        ]
        if self.cute_forward is not None or self.cute_transpose is not None:
            lines.append(f"            {CUTE_NORM_FP8.name} {_family_status(CUTE_NORM_FP8)}")
        lines += [f"  kernels:  {', '.join(self.kernels)}",
                  f"  forward:  {(self.cute_forward or self.forward).describe()}"]
        if self.column_amax is not None:
            lines.append(f"  columns:  {self.column_amax.describe()}")
        if self.quantize is not None:
            lines.append(f"  quantize: {self.quantize.describe()}")
        if self.cute_transpose is not None:
            lines.append(f"  copy:     {self.cute_transpose.describe()}")
        for swizzle in (self.swizzle, self.swizzle_t):
            if swizzle is not None:
                lines.append(f"  swizzle:  {swizzle.describe()}")
        if self.backward is not None:
            lines.append(f"  backward: {self.backward.describe()}")
        else:
            lines.append("  backward: the bf16 norms' (cutile/norm), over h")
        lines.append(f"  why:      {self.reason}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=1024)
def decide_fp8(p: Fp8Problem) -> Fp8Decision:
    """What runs for FP8-output problem ``p``: kernels where they cover it and may run, else
    the reference path, with the reason."""
    def reference(reason: str) -> Fp8Decision:
        return Fp8Decision(op=p.op, reason=reason, scaling=p.scaling)

    if p.device_type != "cuda":
        return reference(f"x is on {p.device_type}; the kernels run on CUDA devices")
    odd = [d for d in p.dtypes[1:] if d not in KERNEL_DTYPES]
    if p.dtypes[0] not in KERNEL_DTYPES + FP8_DTYPES or odd:
        return reference(f"an operand is {(odd or p.dtypes)[0]}; the FP8 kernels take "
                         f"bfloat16, float16, float32 and FP8 x, and bfloat16, float16, "
                         f"float32 parameters and residuals")
    if p.rows * p.cols == 0:
        return reference("x is empty: there is nothing to launch")
    family = CUTILE_NORM_FP8
    stable = validation.is_stable(family)
    if not stable and not p.allow_experimental:
        return reference(
            f"the {family.language} kernels ({family.name}) are experimental (not yet "
            f"validated on a GPU at this source) and experimental kernels are off; enable "
            f"them with TILENORM_EXPERIMENTAL=1, tilenorm.set_experimental(True) or "
            f"`with tilenorm.experimental():`")
    info = device_info(p.device_index)
    itemsize = ITEMSIZE[p.dtypes[0]]
    try:
        forward = plan_fp8_row(p.rows, p.cols, itemsize=itemsize, sm_count=info.sm_count,
                               arch=info.arch, device_class=info.device_class,
                               direction="forward", op=p.op, max_offset=p.max_offset,
                               persistent=p.two_passes or p.scaling == "delayed")
        backward = None
        if p.fp8_backward:
            backward = plan_fp8_row(p.rows, p.cols, itemsize=itemsize,
                                    sm_count=info.sm_count, arch=info.arch,
                                    device_class=info.device_class, direction="backward",
                                    op=p.op, max_offset=p.max_offset)
        swizzle = swizzle_t = None
        if p.mx_layout == "swizzled":  # q's (M, N / 32) scales, then the copy's (N, M / 32)
            swizzle = plan_fp8_mx_swizzle(p.rows, p.cols // 32, arch=info.arch,
                                          dependent_launch=forward.dependent_launch,
                                          device_class=info.device_class)
            if p.transpose:
                swizzle_t = plan_fp8_mx_swizzle(p.cols, -(-p.rows // 32), arch=info.arch,
                                                dependent_launch=forward.dependent_launch,
                                                device_class=info.device_class)
    except UnsupportedShape as e:
        return reference(str(e))
    quantize = column_amax = None
    if p.two_passes:
        quantize = plan_fp8_quantize(p.rows, p.cols, sm_count=info.sm_count, arch=info.arch,
                                     device_class=info.device_class,
                                     dependent_launch=forward.dependent_launch,
                                     max_offset=p.max_offset,
                                     column_blocks=p.scales_along_rows and p.scaling != "row")
    cute_transpose = _cute_fp8_transpose(p, info)
    cute_forward = _cute_fp8_forward(p, info, column_amax=cute_transpose is not None)
    if p.scales_along_rows and p.scaling == "row":
        # The column amaxes: the CuTe row kernel's with the CuTe copy (which then computes y
        # as that kernel does), else cuTile's row kernel's, whose y both copies compute.
        if cute_forward is not None:
            cute_transpose = dataclasses.replace(cute_transpose, weight_first=True)
        partials = (cute_forward or forward).grid
        column_amax = plan_fp8_column_amax(partials, p.cols, arch=info.arch,
                                           dependent_launch=forward.dependent_launch,
                                           device_class=info.device_class)
    reason = ("validated kernels cover this case" if stable
              else "experimental kernels are enabled")
    if cute_forward is not None:
        reason += ("; the CuTe DSL row kernel keeps the next rows' loads in flight "
                   "(bench/NOTES.md #56)")
    if cute_transpose is not None:
        quantize = None
        reason += ("; the CuTe DSL transposed copy fits its registers where cuTile's pass "
                   "does not (bench/NOTES.md #60)")
    return Fp8Decision(op=p.op, reason=reason, scaling=p.scaling, family=family,
                       forward=forward, quantize=quantize, column_amax=column_amax,
                       swizzle=swizzle, swizzle_t=swizzle_t, backward=backward, device=info,
                       cute_forward=cute_forward, cute_transpose=cute_transpose)


#: What ``Fp8Decision.kernels`` calls the CuTe DSL FP8-output row kernel and transposed copy.
CUTE_FP8_FORWARD_NAME = "RowNormFp8Forward (CuTe DSL)"
CUTE_FP8_TRANSPOSE_NAME = "TransposedFp8Quantize (CuTe DSL)"


def _cute_fp8_forward(p: Fp8Problem, info: DeviceInfo, column_amax: bool = False
                      ) -> CuteFp8ForwardPlan | None:
    """The CuTe DSL row kernel where the planner has one for the width, x's element size
    (2-byte x, or FP8 x whose groups are whole 16-byte vectors) and group, the kernel covers
    the features (RMSNorm, no residual; ``decide_fp8`` has checked the parameters' dtypes),
    and it may run (installed; validated or allowed). A per-row scaling's transposed copy
    needs its column amaxes: only where ``column_amax`` (the CuTe copy runs after it: 2-byte
    x), the weight is not fp32 (whose fp32 copy and the column maxima spill:
    settings_fp8.py) and the planner keeps them at the width."""
    if not (validation.is_stable(CUTE_NORM_FP8) or p.allow_experimental):
        return None
    if p.op != "rms_norm" or p.has_residual or not cute.available():
        return None
    keeps_columns = p.scales_along_rows and p.scaling == "row"
    if keeps_columns and (not column_amax or "float32" in p.dtypes[1:]):
        return None
    return plan_cute_fp8_forward(p.rows, p.cols, itemsize=ITEMSIZE[p.dtypes[0]],
                                 sm_count=info.sm_count, arch=info.arch,
                                 device_class=info.device_class, scaling=p.row_scaling,
                                 max_offset=p.max_offset, group=p.group,
                                 column_amax=keeps_columns)


def _cute_fp8_transpose(p: Fp8Problem, info: DeviceInfo) -> CuteFp8TransposePlan | None:
    """The CuTe DSL transposed copy for a copy with scales along M where the planner has a
    tile for the shape (2-byte x, rows a multiple of 16), the kernel covers the features
    (RMSNorm of x itself: no residual, no FP8 x) and it may run (installed; validated or
    allowed)."""
    if not p.scales_along_rows or p.op != "rms_norm" or p.has_residual:
        return None
    if not (validation.is_stable(CUTE_NORM_FP8) or p.allow_experimental):
        return None
    if p.dtypes[0] not in ("bfloat16", "float16") or not cute.available():
        return None
    return plan_cute_fp8_transpose(p.rows, p.cols, itemsize=ITEMSIZE[p.dtypes[0]],
                                   arch=info.arch, device_class=info.device_class,
                                   max_offset=p.max_offset)
