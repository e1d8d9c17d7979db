"""The PyTorch ops: RMSNorm and LayerNorm with autograd, their launch-level forward and
backward, and ``explain``.

An eager call looks its operands' layout up in :mod:`tilenorm.pytorch.calls`; the first call
with a layout checks every argument and prepares the kernels, later ones only launch. Under
``torch.compile`` the ops are the ``tilenorm::norm_fwd`` / ``norm_bwd`` custom ops
(:mod:`tilenorm.pytorch.custom_ops`), except for norms small enough that inductor's own fused
code is faster: those are traced as the reference math
(:func:`tilenorm.dispatch.compiled_by_inductor`).

Semantics follow torch's: ``torch.nn.functional.rms_norm`` / ``layer_norm`` normalize over
the trailing ``normalized_shape`` dimensions (the weight's shape), y has x's dtype whatever
the parameters' dtype, ``eps=None`` is ``torch.finfo(float32).eps`` (float64's for float64
input), and under CUDA autocast the outputs are float32 where torch's are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tilenorm import dispatch
from tilenorm.arguments import LAYER_NORM, RMS_NORM, normalized_dims
from tilenorm.pytorch import calls, checks, native, reference
from tilenorm.pytorch.autograd import NormFunction
from tilenorm.pytorch.calls import NormSpec

#: torch's rms_norm runs in float32 under CUDA autocast from 2.12 on; layer_norm always.
_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_AUTOCASTS_TO_FP32 = {RMS_NORM: _TORCH_VERSION >= (2, 12), LAYER_NORM: True}

ShapeLike = int | Sequence[int] | torch.Size


def default_eps(dtype: torch.dtype) -> float:
    """``eps=None``: the epsilon of the computation dtype, as torch's RMSNorm (2.7 on)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _autocast_out_dtype(op: str, x: torch.Tensor) -> torch.dtype | None:
    """float32 where torch's op under CUDA autocast returns float32 (None: x's dtype)."""
    if x.is_cuda and _AUTOCASTS_TO_FP32[op] and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return None


class _Prepared:
    """A layout's forward call with the options it was checked with."""

    __slots__ = ("call", "eps", "offset", "prenorm")

    def __init__(self, call, eps, offset, prenorm):
        self.call, self.eps, self.offset, self.prenorm = call, eps, offset, prenorm


def _check_operands(op, x, weight, bias, residual, normalized_shape, per_head, prenorm,
                    out_dtype, residual_dtype) -> int:
    """Every check of a call's arguments but eps and offset; the normalized dimensions."""
    checks.check_x(op, x)
    checks.check_flag(op, "per_head", per_head)
    checks.check_flag(op, "prenorm", prenorm)
    checks.check_param(op, "weight", weight, x)
    checks.check_param(op, "bias", bias, x)
    dims = normalized_dims(op, x, weight, bias, normalized_shape, per_head)
    checks.check_residual(op, residual, x)
    checks.check_dtype(op, "out_dtype", out_dtype)
    checks.check_dtype(op, "residual_dtype", residual_dtype)
    if residual_dtype is not None and residual is None:
        raise ValueError(f"{op}: residual_dtype is the dtype of the residual stream; it needs "
                         f"a residual")
    if prenorm and residual is None:
        raise ValueError(f"{op}: prenorm=True returns (y, x + residual); it needs a residual")
    return dims


def _prepare(op, x, weight, bias, residual, eps, offset, normalized_shape, per_head, prenorm,
             out_dtype, residual_dtype) -> _Prepared:
    """Check a call's arguments and prepare its forward (the first call of a layout)."""
    dims = _check_operands(op, x, weight, bias, residual, normalized_shape, per_head, prenorm,
                           out_dtype, residual_dtype)
    eps = checks.check_eps(op, default_eps(x.dtype) if eps is None else eps)
    offset = checks.check_offset(op, offset, weight)
    spec = NormSpec(op, op == LAYER_NORM, dims, per_head)
    call = calls.build_forward(spec, x, weight, bias, residual, out_dtype, residual_dtype,
                               offset != 0)
    return _Prepared(call, eps, offset, prenorm)


def _prepared(op, x, weight, bias, residual, eps, offset, normalized_shape, per_head, prenorm,
              out_dtype, residual_dtype) -> _Prepared:
    """The prepared call for these arguments: looked up by their layout (the hot path: no
    checks), or checked and prepared the first time."""
    try:
        key = (op, calls.layouts(x, weight, bias, residual), eps, offset, normalized_shape,
               per_head, prenorm, out_dtype, residual_dtype, calls.experimental_enabled())
        found = calls.lookup(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable normalized_shape
        found = key = None
    if found is None:
        found = _prepare(op, x, weight, bias, residual, eps, offset, normalized_shape,
                         per_head, prenorm, out_dtype, residual_dtype)
        if key is not None:
            calls.store(key, found)
    return found


def _apply(op, x, weight, bias, eps, normalized_shape, per_head, offset, residual, prenorm,
           residual_dtype, out_dtype):
    """The ops' eager path. Written for host time (bench/NOTES.md #40, #42): arguments seen
    before go straight to their prepared call's C++ twin (``calls.cached_call``), which runs
    the no_grad forward or the forward with its autograd node; the first call checks and
    prepares here, and the Python path is the fallback (no compiler, unaligned operands,
    copies, the CuTe DSL backward)."""
    if torch.compiler.is_compiling():
        return _traced(op, x, weight, bias, eps, normalized_shape, per_head, offset, residual,
                       prenorm, residual_dtype, out_dtype)
    out = calls.cached_call(op, x, weight, bias, eps, normalized_shape, per_head, offset,
                            residual, prenorm, residual_dtype, out_dtype)
    if out is not None:
        return out
    arguments = (op, x, weight, bias, eps, normalized_shape, per_head, offset, residual,
                 prenorm, residual_dtype, out_dtype)
    if out_dtype is None and isinstance(x, torch.Tensor):
        out_dtype = _autocast_out_dtype(op, x)
    p = _prepared(op, x, weight, bias, residual, eps, offset, normalized_shape, per_head,
                  prenorm, out_dtype, residual_dtype)
    call = p.call
    if call.native is not None:
        calls.remember_call(*arguments, call.native, p.eps, p.offset)
    if not (torch.is_grad_enabled() and (
            x.requires_grad or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad)
            or (residual is not None and residual.requires_grad))):
        y, h = call.run(x, weight, bias, residual, p.eps, p.offset)[:2]
    elif call.decision.uses_kernel:
        cpp = call.native_autograd(x, weight, bias, p.offset)
        out = None if cpp is None else native.module().apply(cpp, x, weight, bias, residual,
                                                              p.eps, p.offset)
        if out is None:
            out = NormFunction.apply(p, x, weight, bias, residual)
        y, h = (out, x) if residual is None else out
    else:
        y, h = reference.norm(x, weight, bias, p.eps, layer_norm=call.spec.layer_norm,
                              offset=p.offset, residual=residual, residual_dtype=call.h_dtype,
                              out_dtype=call.out_dtype, dims=call.spec.dims)
    return (y, h) if prenorm else y


def _to_inductor(x: torch.Tensor, weight: torch.Tensor | None, eps, offset) -> bool:
    """Whether a traced norm is left to inductor: x's size provably small enough when traced
    (:func:`tilenorm.dispatch.compiled_by_inductor`: static shapes, or dynamic dimensions
    bounded that far; ``torch.export`` alike), eps known to be finite and >= 0, the offset
    finite, and zero without a weight. A size that may be larger keeps the custom op (a guard
    on it would bound the shapes the graph takes), and so do symbolic and bad scalars, which
    the op checks when it runs."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return (known(dispatch.compiled_by_inductor(x.numel() * x.element_size()))
            and known(eps >= 0) and known(eps < math.inf)
            and known(offset > -math.inf) and known(offset < math.inf)
            and (weight is not None or known(offset == 0)))


def _traced(op, x, weight, bias, eps, normalized_shape, per_head, offset, residual, prenorm,
            residual_dtype, out_dtype):
    """Under ``torch.compile``: the checks that hold for symbolic shapes and scalars here,
    the numeric ones on eps and offset inside the custom op. A small norm is traced as the
    reference math instead, for inductor to fuse (:func:`_to_inductor`)."""
    dims = _check_operands(op, x, weight, bias, residual, normalized_shape, per_head, prenorm,
                           out_dtype, residual_dtype)
    if out_dtype is None:
        out_dtype = _autocast_out_dtype(op, x)
    if eps is None:
        eps = default_eps(x.dtype)
    if _to_inductor(x, weight, eps, offset):
        y, h = reference.norm(x, weight, bias, eps, layer_norm=op == LAYER_NORM, offset=offset,
                              residual=residual, residual_dtype=residual_dtype,
                              out_dtype=out_dtype, dims=dims)
        return (y, h) if prenorm else y
    y, h, _, _ = torch.ops.tilenorm.norm_fwd(x, weight, bias, residual, eps, offset,
                                             op == LAYER_NORM, dims, per_head, out_dtype,
                                             residual_dtype)
    return (y, h) if prenorm else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6,
             *, normalized_shape: ShapeLike | None = None, per_head: bool = False,
             offset: float = 0.0, residual: torch.Tensor | None = None, prenorm: bool = False,
             residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm: ``y = h / sqrt(mean(h^2) + eps) * (offset + weight)`` with ``h = x`` (or
    ``x + residual``), the mean over the normalized dimensions.

    Args:
        x: the input, of any shape ``(..., *normalized_shape)`` and any strides; bfloat16,
            float16, float32 or float64.
        weight: None, or a tensor of ``normalized_shape``; with ``per_head=True`` one of shape
            (H, N) for x of shape (..., H, N). Any floating dtype on x's device; y keeps x's
            dtype (the product is taken in float32, float64 for float64 operands).
        eps: added to the mean square; ``None`` is ``torch.finfo(torch.float32).eps``
            (float64's for float64 x), torch's rule. Finite and >= 0.
        normalized_shape: the trailing dimensions to normalize over, as in
            ``torch.nn.functional.rms_norm``; default the weight's shape, else the last
            dimension.
        per_head: normalize each of x's last-dimension vectors with the weight row of its
            head: the QK-norm of attention with a weight per head. x (..., H, N) is read in
            place, strided slices of a fused qkv projection included.
        offset: the weight is used as ``offset + weight``: Gemma's ``1 + w`` is
            ``offset=1.0``; computed in float32. Needs a weight.
        residual: a tensor of x's shape: the op normalizes ``h = x + residual``, summed in
            float32 and stored in ``residual_dtype`` (default the residual's dtype).
        prenorm: with a residual, return ``(y, h)`` so that h carries the residual stream.
        residual_dtype: the dtype h is stored in (needs a residual).
        out_dtype: y's dtype; default x's (float32 under CUDA autocast on torch >= 2.12, as
            torch's rms_norm).

    Returns:
        y, or ``(y, h)`` with ``prenorm=True``.

    Differentiable in x, weight and residual (including the gradient that reaches h). CUDA
    tensors in bfloat16/float16/float32 run the kernels when they are stable or experimental
    kernels are enabled; everything else takes the torch reference path with the same
    semantics (:func:`explain` says which and why). Bad arguments raise ``TypeError`` or
    ``ValueError`` naming the argument.
    """
    return _apply(RMS_NORM, x, weight, None, eps, normalized_shape, per_head, offset,
                  residual, prenorm, residual_dtype, out_dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float | None = 1e-5, *,
               normalized_shape: ShapeLike | None = None,
               residual: torch.Tensor | None = None, prenorm: bool = False,
               residual_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm: ``y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias`` (biased
    variance, as ``torch.nn.functional.layer_norm``) over the normalized dimensions.

    Args:
        x: the input, of any shape ``(..., *normalized_shape)`` and strides.
        weight, bias: None or tensors of ``normalized_shape``, any floating dtype on x's
            device; y keeps x's dtype.
        eps: added to the variance; ``None`` as in :func:`rms_norm`. Finite and >= 0.
        normalized_shape: as in ``torch.nn.functional.layer_norm``; default the weight's (or
            bias's) shape, else the last dimension.
        residual, prenorm, residual_dtype: a fused residual add, as in :func:`rms_norm`.
        out_dtype: y's dtype; default x's (float32 under CUDA autocast, as torch's).

    Returns:
        y, or ``(y, h)`` with ``prenorm=True``. Differentiable in x, weight, bias and residual.
    """
    return _apply(LAYER_NORM, x, weight, bias, eps, normalized_shape, False, 0.0, residual,
                  prenorm, residual_dtype, out_dtype)


# --- launch level --------------------------------------------------------------------------


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None,
                     eps: float | None = 1e-6, *, normalized_shape: ShapeLike | None = None,
                     per_head: bool = False, offset: float = 0.0,
                     residual: torch.Tensor | None = None,
                     residual_dtype: torch.dtype | None = None,
                     out_dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward without autograd, for frameworks that keep their own graph: ``(y, h,
    rstd)``. h is x without a residual; rstd is float32 (float64 for float64 x) of x's shape
    without the normalized dimensions. Arguments as in :func:`rms_norm`."""
    p = _prepared(RMS_NORM, x, weight, None, residual, eps, offset, normalized_shape,
                  per_head, False, out_dtype, residual_dtype)
    y, h, _, rstd = p.call.run(x, weight, None, residual, p.eps, p.offset)
    return y, h, rstd


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, eps: float | None = 1e-5, *,
                       normalized_shape: ShapeLike | None = None,
                       residual: torch.Tensor | None = None,
                       residual_dtype: torch.dtype | None = None,
                       out_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward without autograd: ``(y, h, mean, rstd)``; see :func:`rms_norm_forward`."""
    p = _prepared(LAYER_NORM, x, weight, bias, residual, eps, 0.0, normalized_shape, False,
                  False, out_dtype, residual_dtype)
    return p.call.run(x, weight, bias, residual, p.eps, p.offset)


def _backward(op, dy, dh, h, weight, bias, mean, rstd, offset, normalized_shape, per_head,
              x_dtype, residual_dtype):
    try:
        key = ("launch backward", op, calls.layouts(dy, dh, h, weight, bias, mean, rstd),
               offset, normalized_shape, per_head, x_dtype, residual_dtype,
               calls.experimental_enabled())
        found = calls.lookup(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable normalized_shape
        found = key = None
    if found is None:
        found = _prepare_backward(op, dy, dh, h, weight, bias, mean, rstd, offset,
                                  normalized_shape, per_head, x_dtype, residual_dtype)
        if key is not None:
            calls.store(key, found)
    call, offset = found
    return call.run(dy, dh, h, weight, bias, mean, rstd, offset)


def _prepare_backward(op, dy, dh, h, weight, bias, mean, rstd, offset, normalized_shape,
                      per_head, x_dtype, residual_dtype):
    """Check a launch-level backward's operands against h and prepare it."""
    checks.check_x(op, h)
    checks.check_flag(op, "per_head", per_head)
    checks.check_param(op, "weight", weight, h)
    checks.check_param(op, "bias", bias, h)
    dims = normalized_dims(op, h, weight, bias, normalized_shape, per_head)
    checks.check_dtype(op, "x_dtype", x_dtype)
    checks.check_dtype(op, "residual_dtype", residual_dtype)
    offset = checks.check_offset(op, offset, weight)
    for name, t in (("dy", dy), ("dh", dh)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != h.shape
                              or t.device != h.device):
            raise ValueError(f"{op}: {name} must be a tensor of h's shape {tuple(h.shape)} on "
                             f"{h.device}")
    stat_shape = h.shape[:h.dim() - dims]
    stat_dtype = reference.compute_dtype(h.dtype)
    for name, t in (("rstd", rstd), ("mean", mean)):
        if (t is not None or name == "rstd" or op == LAYER_NORM) and (
                not isinstance(t, torch.Tensor) or t.shape != stat_shape
                or t.dtype != stat_dtype or t.device != h.device or not t.is_contiguous()):
            raise ValueError(f"{op}: {name} must be the forward's: contiguous, of shape "
                             f"{tuple(stat_shape)} and dtype {stat_dtype} on {h.device}")
    spec = NormSpec(op, op == LAYER_NORM, dims, per_head)
    call = calls.build_backward(spec, dy, dh, h, weight, bias, offset, x_dtype or h.dtype,
                                residual_dtype)
    return call, offset


def rms_norm_backward(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor, *, normalized_shape: ShapeLike | None = None,
                      per_head: bool = False, offset: float = 0.0,
                      dh: torch.Tensor | None = None, x_dtype: torch.dtype | None = None,
                      residual_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward from :func:`rms_norm_forward`'s h and rstd: ``(dx, dresidual, dweight)``.
    With a fused residual pass ``residual_dtype`` (the residual input's dtype), ``x_dtype``
    (x's dtype, default h's) and ``dh``, the gradient that reached h directly (or None);
    dresidual is None without a residual, dweight None without a weight."""
    return _backward(RMS_NORM, dy, dh, h, weight, None, None, rstd, offset, normalized_shape,
                     per_head, x_dtype, residual_dtype)[:3]


def layer_norm_backward(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, *,
                        normalized_shape: ShapeLike | None = None,
                        dh: torch.Tensor | None = None, x_dtype: torch.dtype | None = None,
                        residual_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                   torch.Tensor | None]:
    """The backward from :func:`layer_norm_forward`'s h, mean and rstd: ``(dx, dresidual,
    dweight, dbias)``; ``dh``, ``x_dtype`` and ``residual_dtype`` as in
    :func:`rms_norm_backward`."""
    return _backward(LAYER_NORM, dy, dh, h, weight, bias, mean, rstd, 0.0, normalized_shape,
                     False, x_dtype, residual_dtype)


def explain(x: torch.Tensor, weight: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
            layer_norm: bool = False, normalized_shape: ShapeLike | None = None,
            per_head: bool = False, out_dtype: torch.dtype | None = None,
            residual_dtype: torch.dtype | None = None) -> dispatch.Decision:
    """What :func:`rms_norm` (with ``layer_norm=True``, :func:`layer_norm`) decides to run for
    these operands, and why: the kernels and their launch plans, or the reference path.
    Print it (``str()``) for a report; arguments as in the op."""
    op = LAYER_NORM if layer_norm else RMS_NORM
    return _prepared(op, x, weight, bias, residual, None, 0.0, normalized_shape, per_head,
                     False, out_dtype, residual_dtype).call.decision
