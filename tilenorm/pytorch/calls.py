"""Prepared calls: what a forward or a backward with one layout of operands runs, computed
once and looked up by the operands' layout after that.

A layout is every operand's shape, strides, dtype and device plus the call's options. The
first call with a layout checks the operands, asks :mod:`tilenorm.dispatch` what runs, works
out each operand's (rows, heads, cols) view and binds the kernels to raw-pointer launchers
(:mod:`tilenorm.launch.driver`); a later call allocates its outputs, reads the data pointers
and launches: no views, no checks, no argument inspection (bench/NOTES.md #39).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tilenorm import _experimental, dispatch
from tilenorm._experimental import experimental_enabled
from tilenorm.arguments import dres_apart
from tilenorm.dispatch import BackwardFacts, Decision, ForwardFacts, Problem
from tilenorm.launch import cutile
from tilenorm.launch.cutile import NormFeatures
from tilenorm.launch.driver import ArrayLayout, DriverLaunch
from tilenorm.layout import contiguous_strides, max_offset, view_3d, view_strides
from tilenorm.planner import (
    CuteBackwardPlan,
    CuteClusterBackwardPlan,
    CuteForwardPlan,
    RowNormPlan,
)
from tilenorm.pytorch import native, reference

#: Layouts remembered; past this the cache starts over (a long-running job with ever new
#: shapes must not grow without bound).
MAX_CALLS = 4096
_CALLS: dict = {}

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float32: "float32", torch.float64: "float64",
               torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
               torch.uint8: "uint8"}


def lookup(key):
    """What was prepared for ``key``, or None."""
    return _CALLS.get(key)


def store(key, prepared) -> None:
    if len(_CALLS) >= MAX_CALLS:
        _CALLS.clear()
    _CALLS[key] = prepared


def clear() -> None:
    """Forget every prepared call."""
    _CALLS.clear()
    forget_cached_calls()


def _nothing(*arguments) -> None:
    return None


#: An eager call's arguments to its result when the same arguments were seen before, else
#: None (the C++ path's ``cached_call``, NOTES #42, once that is loaded); with
#: ``remember_call`` to add a prepared call and ``forget_cached_calls`` to drop them all.
cached_call = remember_call = forget_cached_calls = _nothing
_experimental.on_change.append(clear)


def cached(key, build):
    """The prepared call for ``key``, built by ``build()`` the first time."""
    found = _CALLS.get(key)
    if found is None:
        found = build()
        store(key, found)
    return found


def meta(t: torch.Tensor | None):
    """A tensor's layout as a cache key."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def python_layouts(*operands) -> tuple:
    """The operands' layouts as one cache key (AttributeError for a non-tensor)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                 for t in operands)


#: The operands' layouts as one cache key: :func:`python_layouts`, or the C++ path's
#: ``layout_key`` (a quarter of the host time, NOTES #40) once that is loaded.
layouts = python_layouts


# --- layouts -------------------------------------------------------------------------------


def _fold_trailing(shape: tuple[int, ...], strides: tuple[int, ...], dims: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, strides) with the last ``dims`` dimensions folded into one, or None when their
    strides do not allow a view."""
    if dims == 1:
        return shape, strides
    inner = list(zip(shape[-dims:], strides[-dims:], strict=True))
    for (size, stride), (size_in, stride_in) in zip(inner, inner[1:], strict=False):
        if size != 1 and stride != stride_in * size_in:
            return None
    return shape[:-dims] + (math.prod(shape[-dims:]),), strides[:-dims] + (strides[-1],)


def kernel_view(t: torch.Tensor, dims: int, keep_heads: bool
                ) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """(shape, strides) of ``t`` as (rows, heads, cols) with its last ``dims`` dimensions as
    the columns, or None when it takes a contiguous copy."""
    folded = _fold_trailing(tuple(t.shape), t.stride(), dims)
    if folded is None:
        return None
    return view_3d(*folded, keep_heads=keep_heads)


def _layout(dtype: torch.dtype, shape3, strides3=None) -> ArrayLayout:
    strides3 = contiguous_strides(shape3) if strides3 is None else strides3
    return ArrayLayout(DTYPE_NAMES[dtype], tuple(shape3), view_strides(shape3, strides3))


def flat_strided(p: torch.Tensor | None) -> bool:
    """Whether ``p`` (a weight or bias of ``normalized_shape``) is one strided vector when
    flattened: each dimension's stride is the next one's times its size (size-1 dimensions
    aside)."""
    if p is None or p.dim() <= 1:
        return True
    step = None
    for size, stride in zip(reversed(p.shape), reversed(p.stride()), strict=True):
        if size == 1:
            continue
        if step is not None and stride != step:
            return False
        step = stride * size
    return True


def _vector_stride(p: torch.Tensor) -> int:
    """The element stride of a :func:`flat_strided` weight or bias read as one vector."""
    return next((st for size, st in zip(reversed(p.shape), reversed(p.stride()), strict=True)
                 if size != 1), 1)


def _param_layout(p: torch.Tensor, heads: int, cols: int) -> ArrayLayout:
    """A weight or bias, (N,) or (H, N), as the kernels' (1, H or 1, N)."""
    last = p.stride(-1) if heads > 1 else _vector_stride(p)
    row = p.stride(0) if heads > 1 else cols * last
    return ArrayLayout(DTYPE_NAMES[p.dtype], (1, heads, cols),
                       view_strides((1, heads, cols), (heads * row, row, last)))


#: Stand-ins for the operands a compiled variant never touches (no weight, no residual, ...),
#: by slot: one buffer per slot, so that no two kernel arguments alias.
_PLACEHOLDER = ArrayLayout("float32", (1,), (1,))
_PLACEHOLDERS: dict = {}
#: At least as many as any kernel has array parameters (13).
_PLACEHOLDER_COUNT = 16


class _DriverMemory:
    """Device memory from the CUDA driver (``cuMemAlloc``), outside torch's caching allocator,
    seen by torch through ``__cuda_array_interface__``; never freed."""

    def __init__(self, address: int, count: int):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4",
                                         "data": (address, False), "version": 3}


def placeholders(device: torch.device) -> tuple[torch.Tensor, ...]:
    found = _PLACEHOLDERS.get(device)
    if found is None:
        # From the driver, not torch's allocator: they live as long as the process, and a
        # first call inside torch.compile's CUDA graphs (cudagraph trees) allocates from the
        # graphs' private pool, which must hold nothing that outlives them.
        from cuda.bindings import driver

        with torch.cuda.device(device):  # its primary context current on this thread
            torch.cuda.init()
            error, address = driver.cuMemAlloc(_PLACEHOLDER_COUNT * 16)
            if error != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"tilenorm: cuMemAlloc of the placeholders failed: {error}")
        found = _PLACEHOLDERS[device] = tuple(
            torch.as_tensor(_DriverMemory(int(address) + 16 * i, 1), device=device)
            for i in range(_PLACEHOLDER_COUNT))
    return found


def tensor_launcher(bound: cutile.BoundKernel, arrays: dict) -> Callable[..., None]:
    """``bound`` ready to launch as the ops launch it, for tests and benchmarks that pick
    their own plans: compiled for the layouts of ``arrays`` (tensors by the kernel's array
    names; absent or None ones get placeholders) and launched from their raw pointers. The
    returned function takes the runtime scalars and launches on the current stream (read per
    call, so that graph capture records it)."""
    device = torch.device("cuda", torch.cuda.current_device())
    tensors = {name: t for name, t in arrays.items() if t is not None}
    launcher = driver_launch(bound, {name: ArrayLayout(DTYPE_NAMES[t.dtype], tuple(t.shape),
                                                        t.stride())
                                      for name, t in tensors.items()},
                              device, torch.cuda.get_device_capability(device))
    if launcher is None:
        raise ValueError(f"{bound.name}: an operand overlaps itself")
    pointers = [tensors[name].data_ptr() for name in bound.arrays if name in tensors]

    def launch(*scalars: float) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        if not launcher.launch(stream, *pointers, *scalars):
            raise RuntimeError(f"{bound.name}: operands not 16-byte aligned")

    return launch


def _on_device(device: torch.device):
    """cuTile's own launch and the driver's loads act on the current context: x's device."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def driver_launch(bound: cutile.BoundKernel, layouts: dict, device: torch.device,
                   arch: tuple[int, int]) -> DriverLaunch | None:
    """``bound`` ready to launch from pointers: ``layouts`` maps the arrays it reads or
    writes to their layouts; the others are placeholders. None where a layout overlaps
    itself (cuTile's own launch compiles for that)."""
    ph = placeholders(device)
    fixed = {i: ph[i % len(ph)].data_ptr() for i, name in enumerate(bound.arrays)
             if name not in layouts}
    arrays = tuple(layouts.get(name, _PLACEHOLDER) for name in bound.arrays)
    if not all(a.disjoint for a in arrays):
        return None
    with _on_device(device):
        return DriverLaunch(bound, arrays, device.index, arch, fixed_arrays=fixed)


# --- forward -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormSpec:
    """The op and how its operands are read: LayerNorm or RMSNorm, over the last ``dims``
    dimensions, with one weight per head (``per_head``: x is (..., H, N), the weight
    (H, N))."""

    op: str
    layer_norm: bool
    dims: int = 1
    per_head: bool = False


@dataclass
class ForwardCall:
    """A forward with one operand layout: the decision, and either the reference path or the
    kernels with their launchers (the CuTe DSL kernel where the decision allows it for
    aligned operands, else cuTile's)."""

    spec: NormSpec
    decision: Decision
    features: NormFeatures
    out_dtype: torch.dtype
    h_dtype: torch.dtype | None
    out_shape: torch.Size
    stat_shape: torch.Size
    device: torch.device
    shape3: tuple[int, int, int] = (0, 0, 0)
    copy_x: bool = False
    copy_residual: bool = False
    bound: cutile.BoundKernel | None = None
    launch: object = None
    #: y is allocated like x (x dense and contiguous, y in x's dtype): the cheapest allocation.
    y_like_x: bool = False
    #: The backward calls of this forward's saved operands, by the gradients' layouts.
    backward_calls: dict = field(default_factory=dict)
    #: The C++ prepared call (:mod:`tilenorm.pytorch.native`), None where the Python path
    #: runs; :meth:`native_autograd` gives it its backwards.
    native: object = None
    native_backward: bool | None = None
    #: The CuTe DSL forward's plan, compiled-variant key and kernel (compiled at its first
    #: call), where it runs.
    cute: CuteForwardPlan | None = None
    cute_key: object = None
    cute_fn: object = None

    def native_autograd(self, x, weight, bias, offset: float):
        """The C++ call with the backwards of its outputs' dense gradients attached (built
        the first time autograd needs them), or None where the backward takes the Python
        path (the CuTe DSL kernel, copies)."""
        if self.native_backward is None:
            self.native_backward = self._attach_backward(x, weight, bias, offset)
        return self.native if self.native_backward else None

    def _attach_backward(self, x, weight, bias, offset: float) -> bool:
        if self.native is None:
            return False

        def dense(dtype):
            return torch.empty(self.out_shape, dtype=dtype, device="meta")

        h = x if self.h_dtype is None else dense(self.h_dtype)
        gradients = [None] if self.h_dtype is None else [None, dense(self.h_dtype)]
        natives = [build_backward(self.spec, dense(self.out_dtype), dh, h, weight, bias, offset,
                                  x.dtype, self.h_dtype, device=self.device).native
                   for dh in gradients]
        if any(n is None for n in natives):
            return False
        native.module().attach_backward(self.native, natives[0], natives[-1])
        return True

    def run(self, x, weight, bias, residual, eps: float, offset: float):
        """(y, h, mean, rstd); h is x without a residual, mean None for RMSNorm; mean and
        rstd have x's shape without the normalized dimensions."""
        if self.native is not None:
            out = native.module().forward(self.native, x, weight, bias, residual, eps, offset)
            if out is not None:
                return out
        if not self.decision.uses_kernel:
            return reference.norm_forward(x, weight, bias, eps, layer_norm=self.spec.layer_norm,
                                          offset=offset, residual=residual,
                                          residual_dtype=self.h_dtype, out_dtype=self.out_dtype,
                                          dims=self.spec.dims)
        if self.cute is not None and not (
                x.data_ptr() | (0 if residual is None else residual.data_ptr())) & 15:
            return self._run_cute(x, weight, bias, residual, eps, offset)
        dev = self.device
        y = torch.empty_like(x) if self.y_like_x else torch.empty(
            self.out_shape, dtype=self.out_dtype, device=dev)
        rstd = torch.empty(self.stat_shape, dtype=torch.float32, device=dev)
        mean = (torch.empty(self.stat_shape, dtype=torch.float32, device=dev)
                if self.features.layer_norm else None)
        h = (torch.empty(self.out_shape, dtype=self.h_dtype, device=dev)
             if residual is not None else None)
        xs = x.reshape(self.shape3) if self.copy_x else x
        rs = residual.reshape(self.shape3) if self.copy_residual else residual
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        pointers = [xs.data_ptr()]
        if rs is not None:
            pointers.append(rs.data_ptr())
        if weight is not None:
            pointers.append(weight.data_ptr())
        if bias is not None:
            pointers.append(bias.data_ptr())
        pointers.append(y.data_ptr())
        if h is not None:
            pointers.append(h.data_ptr())
        if mean is not None:
            pointers.append(mean.data_ptr())
        pointers.append(rstd.data_ptr())
        if self.launch is None or not self.launch(stream, *pointers, eps, offset):
            self._launch_through_cutile(stream, xs, rs, weight, bias, y, h, mean, rstd, eps,
                                        offset)
        return y, (x if h is None else h), mean, rstd

    def _run_cute(self, x, weight, bias, residual, eps: float, offset: float):
        """The CuTe DSL forward on (rows, cols) views of contiguous x (and residual)."""
        from tilenorm.launch import cute

        rows, cols = self.cute.rows, self.cute.cols
        dev = self.device
        y = torch.empty_like(x)
        h = None if residual is None else torch.empty_like(x)
        rstd = torch.empty(self.stat_shape, dtype=torch.float32, device=dev)
        mean = (torch.empty(self.stat_shape, dtype=torch.float32, device=dev)
                if self.features.layer_norm else None)
        with _on_device(dev):
            fn = self.cute_fn
            if fn is None:
                fn = self.cute_fn = cute.compiled_forward(self.cute_key,
                                                          self.decision.device.arch)
            fn(x.view(rows, cols), None if residual is None else residual.view(rows, cols),
               None if weight is None else _aligned(weight).view(cols),
               None if bias is None else _aligned(bias).view(cols), y.view(rows, cols),
               None if h is None else h.view(rows, cols),
               None if mean is None else mean.view(rows), rstd.view(rows), eps, offset,
               self.cute.grid)
        return y, (x if h is None else h), mean, rstd

    def _launch_through_cutile(self, stream, x, residual, weight, bias, y, h, mean, rstd, eps,
                               offset):
        """cuTile's own launch, on (rows, heads, cols) views: for operands whose storage is not
        16-byte aligned (cuTile compiles a variant for them) or that overlap themselves."""
        shape3, ph = self.shape3, placeholders(self.device)
        cols = shape3[2]
        views = [x.view(shape3) if x.dim() != 3 or x.shape != shape3 else x,
                 ph[0] if residual is None else _as_shape3(residual, shape3),
                 ph[1] if weight is None else weight.view(1, -1, cols),
                 ph[2] if bias is None else bias.view(1, -1, cols),
                 y.view(shape3), ph[3] if h is None else h.view(shape3),
                 ph[4] if mean is None else mean.view(shape3[:2]), rstd.view(shape3[:2])]
        with _on_device(self.device):
            self.bound.launch(stream, *views, float(eps), float(offset))


def _as_shape3(t: torch.Tensor, shape3) -> torch.Tensor:
    try:
        return t.view(shape3)
    except RuntimeError:  # strides that do not fold like x's: the kernels read a copy
        return t.reshape(shape3)


def problem(spec: NormSpec, x: torch.Tensor, shape3, offsets: list[int],
            dtypes: tuple[torch.dtype, ...], device: torch.device | None = None,
            params: tuple = ()) -> Problem:
    """The problem of a call over x (or h) with these weight and bias (``params``)."""
    device = x.device if device is None else device
    return Problem(op=spec.op, device_type=device.type, device_index=device.index,
                   dtypes=tuple(DTYPE_NAMES.get(d, str(d)) for d in dtypes),
                   rows=shape3[0], heads=shape3[1], cols=shape3[2],
                   per_head_weight=spec.per_head, max_offset=max(offsets),
                   allow_experimental=experimental_enabled(),
                   flat_params=spec.per_head or all(flat_strided(t) for t in params))


def shape3_of(spec: NormSpec, x: torch.Tensor
              ) -> tuple[tuple[int, int, int], tuple[int, int, int] | None, int]:
    """(the (rows, heads, cols) shape of x, the strides of that view (None: the kernels read
    a contiguous copy), the largest offset of what they read)."""
    view = kernel_view(x, spec.dims, spec.per_head)
    if view is None:
        cols = math.prod(x.shape[x.dim() - spec.dims:])
        heads = x.shape[-2] if spec.per_head else 1
        shape3 = (x.numel() // (heads * cols) if cols and heads else 0, heads, cols)
        return shape3, None, x.numel() - 1
    return view[0], view[1], max_offset(*view)


def _strides_as(t: torch.Tensor, shape3: tuple[int, int, int]) -> tuple[int, ...] | None:
    """The strides of ``t`` viewed as ``shape3``, or None where no view has that shape."""
    try:
        return tuple(t.view(shape3).stride())
    except RuntimeError:
        return None


def operand_views(spec: NormSpec, lead: torch.Tensor, *others: torch.Tensor | None
                  ) -> tuple[tuple[int, int, int], list, list[int]]:
    """(the (rows, heads, cols) shape the kernels index every operand by, each operand's
    strides in it (None: the kernels read a contiguous copy, or the operand is absent), the
    largest offset each present operand is read at).

    Every operand must factor its rows into (rows, heads) alike: a gradient laid out
    (B, H, S, D) views as (S, H, D) where its h of (B, S, H, D) views as (S * H, 1, D), and
    read with the other's shape it addresses the wrong rows. The lead (x, or h) sets the shape
    unless another operand's own view is one that every operand can take (a compiled graph's
    gradients come in such layouts): then that one, and nothing is copied."""
    operands = (lead, *others)
    own = [None if t is None else kernel_view(t, spec.dims, spec.per_head) for t in operands]

    def strides_in(shape3):
        return [None if t is None else v[1] if v is not None and v[0] == shape3
                else _strides_as(t, shape3) for t, v in zip(operands, own, strict=True)]

    for view in own:
        if view is None:
            continue
        strides = strides_in(view[0])
        if all(s is not None for s, t in zip(strides, operands, strict=True) if t is not None):
            shape3 = view[0]
            break
    else:
        shape3, lead_strides, _ = shape3_of(spec, lead)
        strides = [lead_strides] + strides_in(shape3)[1:]
    offsets = [t.numel() - 1 if st is None else max_offset(shape3, st)
               for t, st in zip(operands, strides, strict=True) if t is not None]
    return shape3, strides, offsets


def forward_facts(x, weight, bias, residual, out_dtype: torch.dtype,
                  residual_dtype: torch.dtype | None, copies: bool) -> ForwardFacts:
    """What the CuTe DSL forward needs of a call's operands (:func:`dispatch.forward_kernel`);
    ``copies``: the kernels would read x or the residual from a contiguous copy."""
    def name(dtype: torch.dtype | None) -> str | None:
        return None if dtype is None else DTYPE_NAMES.get(dtype, str(dtype))

    def of(t: torch.Tensor | None) -> str | None:
        return None if t is None else name(t.dtype)

    return ForwardFacts.of(
        of(x), name(out_dtype), of(weight), of(bias), of(residual), name(residual_dtype),
        dense=not copies and x.is_contiguous()
        and (residual is None or residual.is_contiguous()))


def build_forward(spec: NormSpec, x, weight, bias, residual, out_dtype, residual_dtype,
                  has_offset: bool) -> ForwardCall:
    """The prepared forward for these (already checked) operands; h is stored in
    ``residual_dtype``, default the residual's dtype."""
    if residual is not None and residual_dtype is None:
        residual_dtype = residual.dtype
    shape3, (x_strides, r_strides), offsets = operand_views(spec, x, residual)
    copy_x = x_strides is None
    copy_residual = residual is not None and r_strides is None
    dtypes = tuple(t.dtype for t in (x, weight, bias, residual) if t is not None)
    dtypes += tuple(d for d in (out_dtype, residual_dtype) if d is not None)
    decision = dispatch.decide(problem(spec, x, shape3, offsets, dtypes,
                                       params=(weight, bias)))
    features = NormFeatures(layer_norm=spec.layer_norm, has_weight=weight is not None,
                            per_head_weight=spec.per_head, has_bias=bias is not None,
                            has_residual=residual is not None, has_offset=has_offset)
    stat_shape = tuple(x.shape[:x.dim() - spec.dims])
    call = ForwardCall(spec=spec, decision=decision, features=features,
                       out_dtype=out_dtype or x.dtype, h_dtype=residual_dtype,
                       out_shape=tuple(x.shape), stat_shape=stat_shape, device=x.device,
                       shape3=shape3, copy_x=copy_x, copy_residual=copy_residual,
                       y_like_x=x.is_contiguous() and (out_dtype or x.dtype) == x.dtype)
    if not decision.uses_kernel:
        return call
    facts = forward_facts(x, weight, bias, residual, call.out_dtype, residual_dtype,
                          copy_x or copy_residual)
    chosen = dispatch.forward_kernel(decision, facts)
    if isinstance(chosen, CuteForwardPlan):
        from tilenorm.launch import cute

        call.cute = chosen
        call.cute_key = cute.ForwardKey.of(
            chosen, DTYPE_NAMES[x.dtype], None if weight is None else DTYPE_NAMES[weight.dtype],
            bias is not None, spec.layer_norm, has_offset, residual is not None)
    # cuTile's forward also runs the calls whose storage is not 16-byte aligned (known only
    # per call).
    call.bound = cutile.bind_forward(decision.forward, features)
    heads, cols = shape3[1], shape3[2]
    layouts = {"x": _layout(x.dtype, shape3, x_strides),
               "y": _layout(call.out_dtype, shape3),
               "rstd": _layout(torch.float32, shape3[:2])}
    if residual is not None:
        layouts["residual"] = _layout(residual.dtype, shape3, r_strides)
        layouts["residual_out"] = _layout(residual_dtype, shape3)
    if spec.layer_norm:
        layouts["mean"] = _layout(torch.float32, shape3[:2])
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            layouts[name] = _param_layout(p, heads if spec.per_head else 1, cols)
    launcher = driver_launch(call.bound, layouts, x.device, decision.device.arch)
    if launcher is not None:
        call.launch = launcher.launch
        cpp = native.module()
        if cpp is not None and not (copy_x or copy_residual or call.cute):
            call.native = cpp.make_forward(
                launcher.recipe, list(call.out_shape), list(stat_shape), call.out_dtype,
                spec.layer_norm, residual_dtype, call.y_like_x)
    return call


def _launch_or_none(bound, layouts, device, arch):
    launcher = driver_launch(bound, layouts, device, arch)
    return None if launcher is None else launcher.launch


# --- backward ------------------------------------------------------------------------------


@dataclass
class BackwardCall:
    """A backward with one operand layout: the cuTile kernels (with the CuTe DSL kernel where
    the decision allows it for aligned operands), or the reference path."""

    spec: NormSpec
    decision: Decision
    features: NormFeatures
    x_dtype: torch.dtype
    residual_dtype: torch.dtype | None
    device: torch.device
    shape3: tuple[int, int, int] = (0, 0, 0)
    #: Which operands the kernels read from contiguous copies: dy, h, dres_in, dy2, dy3.
    copy: tuple[bool, ...] = (False,) * 5
    plan: RowNormPlan | None = None
    cute: CuteBackwardPlan | CuteClusterBackwardPlan | None = None
    row_kernel: cutile.BoundKernel | None = None
    launch_first: object = None
    launch_row: object = None
    reduce: cutile.BoundKernel | None = None
    launch_reduce: object = None
    groups: int = 0
    partial: cutile.PartialBuffer | None = None
    split: bool = False
    cute_reduce: object = None
    #: dx is allocated like h (h contiguous, dx in h's dtype): the cheapest allocation.
    dx_like_h: bool = False
    #: The C++ prepared call (:mod:`tilenorm.pytorch.native`), None where the Python path
    #: runs (the CuTe DSL kernel).
    native: object = None

    def run(self, dy, dres_in, h, weight, bias, mean, rstd, offset: float, dy_more=()):
        """(dx, dres, dweight, dbias): dres (the residual's gradient) is dx itself when the
        residual has x's dtype, None without a residual. y's gradient is dy plus each of
        ``dy_more`` (as many as the call was built for)."""
        if self.native is not None:
            out = native.module().backward(self.native, dy, dres_in, h, weight, bias, mean,
                                           rstd, offset, *dy_more)
            if out is not None:
                return out
        if not self.decision.uses_kernel:
            dx, dh, dweight, dbias = reference.norm_backward(
                dy, dres_in, h, weight, bias, mean, rstd, offset=offset, x_dtype=self.x_dtype,
                dims=self.spec.dims, dy_more=tuple(dy_more))
            dres = None if self.residual_dtype is None else dh.to(self.residual_dtype)
            return dx, dres, dweight, dbias
        dev = self.device
        if self.cute is not None and not (
                h.data_ptr() | dy.data_ptr() | (0 if dres_in is None else dres_in.data_ptr())
                ) & 15:
            if isinstance(self.cute, CuteClusterBackwardPlan):
                return self._run_cute_cluster(dy, dres_in, h, weight, bias, mean, rstd,
                                              offset)
            return self._run_cute(dy, h, weight, bias, mean, rstd)
        dx = torch.empty_like(h) if self.dx_like_h else torch.empty(
            h.shape, dtype=self.x_dtype, device=dev)
        dres = torch.empty(h.shape, dtype=self.residual_dtype, device=dev) \
            if self.split else None
        dweight = None if weight is None else torch.empty_like(
            weight, memory_format=torch.contiguous_format)
        dbias = None if bias is None else torch.empty_like(
            bias, memory_format=torch.contiguous_format)
        partial = torch.empty(self.partial.shape, dtype=torch.float32, device=dev) \
            if self.groups else None
        operands = (dy, h, dres_in, *dy_more)
        dy, h, dres_in, *dy_more = (t.reshape(self.shape3) if copy and t is not None else t
                                    for t, copy in zip(operands, self.copy, strict=False))
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        self._launch(stream, [dy, *dy_more], h, weight, mean, rstd, dres_in, dx, dres,
                     partial, dweight, dbias, offset)
        if self.residual_dtype is not None and not self.split:
            dres = dx
        return dx, dres, dweight, dbias

    def _launch(self, stream, dys, h, weight, mean, rstd, dres_in, dx, dres, partial, dweight,
                dbias, offset):
        row_sums = None
        if self.row_kernel.first is not None:
            row_sums = torch.empty(self.shape3[:2] + self.row_kernel.workspace,
                                   dtype=torch.float32, device=self.device)
        p_w = p_b = None
        if partial is not None:
            base = partial.data_ptr()
            p_w = base if dweight is not None else None
            p_b = base + self.partial.group_offset(int(dweight is not None)) \
                if dbias is not None else None
        common = [t.data_ptr() for t in dys] + [h.data_ptr()]
        if weight is not None:
            common.append(weight.data_ptr())
        if mean is not None:
            common.append(mean.data_ptr())
        common.append(rstd.data_ptr())
        launched = True
        if row_sums is not None:
            launched = self.launch_first is not None and self.launch_first(
                stream, *common, row_sums.data_ptr(), offset)
        row = common + ([row_sums.data_ptr()] if row_sums is not None else [])
        if dres_in is not None:
            row.append(dres_in.data_ptr())
        row.append(dx.data_ptr())
        if dres is not None:
            row.append(dres.data_ptr())
        row += [p for p in (p_w, p_b) if p is not None]
        launched = launched and self.launch_row is not None and self.launch_row(
            stream, *row, offset)
        if not launched:
            self._launch_through_cutile(stream, dys, h, weight, mean, rstd, dres_in, dx, dres,
                                        partial, dweight, dbias, offset)
        elif partial is not None:
            outs = [t.data_ptr() for t in (dweight, dbias) if t is not None]
            if not self.launch_reduce(stream, partial.data_ptr(), *outs):
                self._reduce_through_cutile(
                    stream, partial.as_strided(*self.partial.reduced()), dweight, dbias)

    def _launch_through_cutile(self, stream, dys, h, weight, mean, rstd, dres_in, dx, dres,
                               partial, dweight, dbias, offset):
        """cuTile's own launches on views, for storage that is not 16-byte aligned."""
        shape3, ph = self.shape3, placeholders(self.device)
        stat = shape3[:2]
        weight3 = ph[1] if weight is None else weight.view(1, -1, shape3[2])
        mean2 = ph[4] if mean is None else mean.view(stat)
        h3 = _as_shape3(h, shape3)
        dy3 = [_as_shape3(t, shape3) for t in dys] + [ph[8], ph[9]][len(dys) - 1:]
        partial_w = partial_b = None
        if partial is not None:
            shape, strides = self.partial.group()
            size = self.partial.group_size
            groups = [partial.as_strided(shape, strides, g * size)
                      for g in range(self.groups)]
            partial_w = groups[0] if dweight is not None else None
            partial_b = groups[-1] if dbias is not None else None
        stats = (rstd.view(stat),)
        kernel = self.row_kernel
        with _on_device(self.device):
            if kernel.first is not None:
                row_sums = torch.empty(stat + kernel.workspace, dtype=torch.float32,
                                       device=self.device)
                kernel.first.launch(stream, *dy3, h3, weight3, mean2, stats[0], row_sums,
                                    float(offset))
                stats = (stats[0], row_sums)
            kernel.launch(stream, *dy3, h3, weight3, mean2, *stats,
                          ph[0] if dres_in is None else _as_shape3(dres_in, shape3),
                          dx.view(shape3), ph[3] if dres is None else dres.view(shape3),
                          ph[5] if dweight is None else partial_w,
                          ph[6] if dbias is None else partial_b, float(offset))
        if partial is not None:
            self._reduce_through_cutile(
                stream, partial.as_strided(*self.partial.reduced()), dweight, dbias)

    def _reduce_through_cutile(self, stream, flat, dweight, dbias):
        """cuTile's own launch of the reduction over ``flat``, the partial buffer as
        (slots, groups, heads * cols)."""
        outs = [t.view(-1) for t in (dweight, dbias) if t is not None]
        with _on_device(self.device):
            self.reduce.launch(stream, flat, outs[0],
                               outs[-1] if self.groups == 2 else placeholders(self.device)[7])

    def _run_cute(self, dy, h, weight, bias, mean, rstd):
        """The CuTe DSL backward on (rows, cols) views; its partial buffer is reduced by
        cuTile's fixed-order kernel."""
        from tilenorm.launch import cute

        rows, cols = self.cute.rows, self.cute.cols
        dev = self.device
        dx = torch.empty(h.shape, dtype=h.dtype, device=dev)
        dweight = None if weight is None else torch.empty_like(
            weight, memory_format=torch.contiguous_format)
        dbias = None if bias is None else torch.empty_like(
            bias, memory_format=torch.contiguous_format)
        partial = torch.empty((self.cute.partial_rows, self.groups, cols),
                              dtype=torch.float32, device=dev) if self.groups else None
        key = cute.BackwardKey.of(self.cute, DTYPE_NAMES[h.dtype],
                                  None if weight is None else DTYPE_NAMES[weight.dtype],
                                  bias is not None, mean is not None)
        with _on_device(dev):
            fn = cute.compiled_backward(key, self.decision.device.arch)
            fn(h.view(rows, cols), dy.view(rows, cols),
               None if weight is None else _aligned(weight),
               None if mean is None else mean.reshape(rows), rstd.reshape(rows),
               dx.view(rows, cols), partial, self.cute.grid)
            if partial is not None:
                stream = torch._C._cuda_getCurrentRawStream(dev.index)
                outs = [t.data_ptr() for t in (dweight, dbias) if t is not None]
                if not self.cute_reduce(stream, partial.data_ptr(), *outs):
                    self._reduce_through_cutile(stream, partial, dweight, dbias)
        return dx, None, dweight, dbias

    def _run_cute_cluster(self, dy, dres_in, h, weight, bias, mean, rstd, offset: float):
        """The CuTe DSL cluster backward on (rows, cols) views, the residual's gradient (in
        x's dtype, the decision made sure) dx itself; its partial buffer is reduced by
        cuTile's fixed-order kernel."""
        from tilenorm.launch import cute

        plan, dev = self.cute, self.device
        rows, cols = plan.rows, plan.cols
        dx = torch.empty(h.shape, dtype=h.dtype, device=dev)
        dweight, dbias = (None if t is None else torch.empty_like(
            t, memory_format=torch.contiguous_format) for t in (weight, bias))
        partial = torch.empty((plan.partial_rows, self.groups, cols), dtype=torch.float32,
                              device=dev) if self.groups else None
        key = cute.ClusterBackwardKey.of(
            plan, DTYPE_NAMES[h.dtype], None if weight is None else DTYPE_NAMES[weight.dtype],
            weight is not None and offset != 0, dres_in is not None, mean is not None,
            bias is not None)
        with _on_device(dev):
            fn = cute.compiled_cluster_backward(key, self.decision.device.arch)
            fn(h.view(rows, cols), dy.view(rows, cols),
               None if weight is None else _aligned(weight).view(cols),
               None if mean is None else mean.reshape(rows), rstd.reshape(rows),
               None if dres_in is None else dres_in.view(rows, cols), dx.view(rows, cols),
               partial, float(offset), plan.grid)
            if partial is not None:
                stream = torch._C._cuda_getCurrentRawStream(dev.index)
                outs = [t.data_ptr() for t in (dweight, dbias) if t is not None]
                if not self.cute_reduce(stream, partial.data_ptr(), *outs):
                    self._reduce_through_cutile(stream, partial, dweight, dbias)
        return dx, None if self.residual_dtype is None else dx, dweight, dbias


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with contiguous, 16-byte aligned storage (a copy only when it is not)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def build_backward(spec: NormSpec, dy, dres_in, h, weight, bias, offset: float,
                   x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
                   device: torch.device | None = None, dy_more: tuple = ()) -> BackwardCall:
    """The prepared backward over the normalized input ``h`` (x, or the residual stream of a
    fused residual add) for these (already checked) operands. ``device``: where it runs,
    default h's (the forward prepares its outputs' backwards from meta tensors). y's
    gradient is dy plus each of ``dy_more`` (at most two: a compiled graph's parts,
    :mod:`tilenorm.pytorch.graph_passes`), added up in the kernel."""
    device = h.device if device is None else device
    if len(dy_more) >= cutile.MAX_DY_TERMS:
        raise ValueError(f"y's gradient in {len(dy_more) + 1} parts; the kernels add up at "
                         f"most {cutile.MAX_DY_TERMS}")
    shape3, strides, offsets = operand_views(spec, h, dy, dres_in, *dy_more)
    h_strides, dy_strides, dres_strides, *more_strides = strides
    copy = (dy_strides is None, h_strides is None, dres_in is not None and dres_strides is None,
            *(st is None for st in more_strides))
    copy += (False,) * (5 - len(copy))
    dtypes = tuple(t.dtype for t in (h, weight, bias) if t is not None)
    # The forward's decision: its problem is h's (x, or the residual stream).
    decision = dispatch.decide(problem(spec, h, shape3, offsets[:1], dtypes, device,
                                       params=(weight, bias)))
    features = NormFeatures(layer_norm=spec.layer_norm, has_weight=weight is not None,
                            per_head_weight=spec.per_head, has_bias=bias is not None,
                            has_offset=offset != 0)
    split = dres_apart(x_dtype, residual_dtype)
    call = BackwardCall(spec=spec, decision=decision, features=features, x_dtype=x_dtype,
                        residual_dtype=residual_dtype, device=device, shape3=shape3,
                        copy=copy, split=split,
                        dx_like_h=h.is_contiguous() and h.dtype == x_dtype)
    if not decision.uses_kernel:
        return call
    groups = (weight is not None) + (bias is not None)
    call.groups = groups
    dense = (not any(copy) and h.is_contiguous() and dy.is_contiguous()
             and (dres_in is None or dres_in.is_contiguous()))
    facts = dict(has_residual=residual_dtype is not None, has_dres_in=dres_in is not None,
                 has_offset=offset != 0,
                 same_dtypes=(x_dtype == h.dtype == dy.dtype
                              and (dres_in is None or dres_in.dtype == x_dtype)),
                 max_offset=max(offsets), dy_terms=1 + len(dy_more), dres_apart=split)
    chosen = dispatch.backward_kernel(decision, BackwardFacts(dense_aligned=dense, **facts))
    # Unaligned storage is known only per call: the plan for it is the one without the CuTe
    # DSL kernel.
    plan = dispatch.backward_kernel(decision, BackwardFacts(dense_aligned=False, **facts))
    arch = decision.device.arch
    if isinstance(chosen, CuteBackwardPlan | CuteClusterBackwardPlan):
        call.cute = chosen
        if groups:
            reduce = cutile.bind_reduce(decision.backward, groups)
            call.cute_reduce = _launch_or_none(reduce, {
                "partial": ArrayLayout("float32", (chosen.partial_rows, groups, shape3[2]),
                                       contiguous_strides((chosen.partial_rows, groups,
                                                           shape3[2]))),
                **_reduce_outputs(weight, bias)}, device, arch)
    call.plan = plan
    call.partial = cutile.PartialBuffer.of(plan, groups)
    call.row_kernel = cutile.bind_backward(plan, features, dres_in is not None, split,
                                           1 + len(dy_more))
    heads, cols = shape3[1], shape3[2]
    layouts = {name: _layout(t.dtype, shape3, st) for name, t, st in
               zip(("dy2", "dy3"), dy_more, more_strides, strict=False)}
    layouts |= {"dy": _layout(dy.dtype, shape3, dy_strides),
               "h": _layout(h.dtype, shape3, h_strides),
               "rstd": _layout(torch.float32, shape3[:2]),
               "dx": _layout(x_dtype, shape3)}
    if weight is not None:
        layouts["weight"] = _param_layout(weight, heads if spec.per_head else 1, cols)
    if spec.layer_norm:
        layouts["mean"] = _layout(torch.float32, shape3[:2])
    if dres_in is not None:
        layouts["dres_in"] = _layout(dres_in.dtype, shape3, dres_strides)
    if split:
        layouts["dres"] = _layout(residual_dtype, shape3)
    partial_layout = ArrayLayout("float32", *call.partial.group())
    if weight is not None:
        layouts["partial_w"] = partial_layout
    if bias is not None:
        layouts["partial_b"] = partial_layout
    first = call.row_kernel.first
    if first is not None:  # written by the first kernel, read by the row kernel
        layouts["row_sums"] = _layout(torch.float32, shape3[:2] + call.row_kernel.workspace)
    launchers = [None if first is None else driver_launch(first, layouts, device, arch),
                 driver_launch(call.row_kernel, layouts, device, arch), None]
    if groups:
        call.reduce = cutile.bind_reduce(plan, groups)
        launchers[2] = driver_launch(call.reduce, {
            "partial": ArrayLayout("float32", *call.partial.reduced()),
            **_reduce_outputs(weight, bias)}, device, arch)
    call.launch_first, call.launch_row, call.launch_reduce = (
        None if d is None else d.launch for d in launchers)
    needed = [d for d, used in zip(launchers, (first is not None, True, groups > 0),
                                   strict=True) if used]
    cpp = native.module()
    if cpp is not None and call.cute is None and None not in needed:
        first_d, row_d, reduce_d = launchers
        call.native = cpp.make_backward(
            row_d.recipe, None if first_d is None else first_d.recipe,
            None if reduce_d is None else reduce_d.recipe,
            list(shape3[:2] + call.row_kernel.workspace) if first is not None else [],
            math.prod(call.partial.shape) if groups else 0,
            call.partial.group_offset(int(weight is not None)), x_dtype, residual_dtype,
            split, call.dx_like_h, list(shape3), list(copy), 1 + len(dy_more))
    return call


def forward_call(spec: NormSpec, x, weight, bias, residual, out_dtype, residual_dtype,
                 has_offset: bool) -> ForwardCall:
    """The prepared forward for these operands' layout (operands checked by the caller); the
    weight offset is compiled in only where it is not 0."""
    key = ("forward", spec, meta(x), meta(weight), meta(bias), meta(residual), out_dtype,
           residual_dtype, has_offset, experimental_enabled())
    return cached(key, lambda: build_forward(spec, x, weight, bias, residual, out_dtype,
                                             residual_dtype, has_offset))


def backward_call(spec: NormSpec, dy, dres_in, h, weight, bias, offset: float,
                  x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
                  dy_more: tuple = ()) -> BackwardCall:
    """The prepared backward for these operands' layout (operands checked by the caller)."""
    key = ("backward", spec, meta(dy), meta(dres_in), meta(h), meta(weight), meta(bias),
           offset != 0, x_dtype, residual_dtype, experimental_enabled(),
           *(meta(t) for t in dy_more))
    return cached(key, lambda: build_backward(spec, dy, dres_in, h, weight, bias, offset,
                                              x_dtype, residual_dtype, dy_more=dy_more))


def _reduce_outputs(weight, bias) -> dict:
    outs = [t for t in (weight, bias) if t is not None]
    return {name: ArrayLayout(DTYPE_NAMES[t.dtype], (t.numel(),), (1,))
            for name, t in zip(("out_a", "out_b"), outs, strict=False)}

