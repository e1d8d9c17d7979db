"""What runs for a given input: a kernel family with its launch plans, or the reference path,
and why. :func:`tilenorm.explain` shows the same decision the ops act on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tilenorm import cute, validation
from tilenorm.device import DeviceInfo, device_info
from tilenorm.planner import (
    CuteBackwardPlan,
    RowNormPlan,
    UnsupportedShape,
    plan_cute_backward,
    plan_row_norm,
)
from tilenorm.validation import CUTE_NORM, KernelFamily

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Route:
    """The decision for one (op, device, dtypes, shape): readable through ``str()``."""

    op: str
    reason: str
    family: KernelFamily | None = None
    kernels: tuple[str, ...] = ()
    forward: RowNormPlan | None = None
    backward: RowNormPlan | None = None
    device: DeviceInfo | None = None
    #: The CuTe DSL backward that runs instead of ``backward`` where a call allows it (no
    #: residual gradient, dx in x's dtype): ``backward`` stays the plan for the other calls.
    cute_backward: CuteBackwardPlan | None = None

    @property
    def uses_kernel(self) -> bool:
        return self.family is not None

    @property
    def status(self) -> str:
        if self.family is None:
            return "torch reference"
        families = (self.family,) + ((CUTE_NORM,) if self.cute_backward else ())
        return "; ".join(f"{family.name} {_family_status(family)}" for family in families)

    def __str__(self) -> str:
        if not self.uses_kernel:
            return f"{self.op}: torch reference path, because {self.reason}"
        lines = [
            f"{self.op}: {self.family.language} kernels ({self.family.name}) on "
            f"{self.device.name} ({self.device.sm}, {self.device.sm_count} SMs)",
            f"  status:   {self.status}",
            f"  kernels:  {', '.join(self.kernels)}",
            f"  forward:  {self.forward.describe()}",
            f"  backward: {self.backward.describe()}",
        ]
        if self.cute_backward:
            lines.append(f"  backward without a residual gradient (CuTe DSL): "
                         f"{self.cute_backward.describe()}")
        lines.append(f"  why:      {self.reason}")
        return "\n".join(lines)


def _family_status(family: KernelFamily) -> str:
    record = validation.validation_record(family)
    if record is None:
        return "experimental (not validated on a GPU at this source)"
    return (f"stable (validated on {record['device']}, {record['date']}, "
            f"commit {record['commit']})")


def _cute_backward(op: str, dtypes: tuple[torch.dtype, ...], rows: int, heads: int, cols: int,
                   max_offset: int, sm_count: int, allow_experimental: bool
                   ) -> CuteBackwardPlan | None:
    """The CuTe DSL backward where the planner has one for the shape, x's dtype is that of
    every other operand or fp32, and the kernels may run (installed; validated or allowed)."""
    if not (validation.is_stable(CUTE_NORM) or allow_experimental) or not cute.available():
        return None
    if any(d not in (dtypes[0], torch.float32) for d in dtypes[1:]):
        return None
    return plan_cute_backward(rows, cols, itemsize=dtypes[0].itemsize, sm_count=sm_count,
                              op=op, heads=heads, max_offset=max_offset)


def _reference(op: str, reason: str) -> Route:
    return Route(op=op, reason=reason)


@functools.lru_cache(maxsize=1024)
def route_problem(op: str, family: KernelFamily,
                  kernel_names: Callable[[RowNormPlan, RowNormPlan, CuteBackwardPlan | None],
                                         tuple[str, ...]],
                  device: torch.device, dtypes: tuple[torch.dtype, ...], rows: int, heads: int,
                  cols: int, per_head_weight: bool, max_offset: int,
                  allow_experimental: bool) -> Route:
    """The route for normalizing ``rows x heads`` vectors of ``cols`` elements on ``device``.
    ``dtypes`` lists every operand's dtype (x first); ``max_offset`` is the largest element
    offset any operand reaches; ``kernel_names`` names the kernels that run the forward and
    backward plans (and the CuTe DSL backward, where there is one)."""
    if device.type != "cuda":
        return _reference(op, f"x is on {device}; the kernels run on CUDA devices")
    odd = [d for d in dtypes if d not in KERNEL_DTYPES]
    if odd:
        return _reference(op, f"an operand is {odd[0]}; the kernels take bfloat16, float16 "
                              f"and float32")
    if rows * heads * cols == 0:
        return _reference(op, "x is empty: there is nothing to launch")
    stable = validation.is_stable(family)
    if not stable and not allow_experimental:
        return _reference(
            op, f"the {family.language} kernels ({family.name}) are experimental (not yet "
                f"validated on a GPU at this source) and experimental kernels are off; "
                f"enable them with TILENORM_EXPERIMENTAL=1, tilenorm.set_experimental(True) "
                f"or `with tilenorm.experimental():`")
    info = device_info(device.index)
    try:
        fwd, bwd = (plan_row_norm(rows, cols, heads=heads, per_head_weight=per_head_weight,
                                  itemsize=dtypes[0].itemsize, sm_count=info.sm_count,
                                  arch=info.arch, direction=d, max_offset=max_offset, op=op)
                    for d in ("forward", "backward"))
    except UnsupportedShape as e:
        return _reference(op, str(e))
    reason = ("validated kernels cover this case" if stable
              else "experimental kernels are enabled")
    cute_bwd = _cute_backward(op, dtypes, rows, heads, cols, max_offset, info.sm_count,
                              allow_experimental)
    return Route(op=op, reason=reason, family=family, kernels=kernel_names(fwd, bwd, cute_bwd),
                 forward=fwd, backward=bwd, device=info, cute_backward=cute_bwd)
