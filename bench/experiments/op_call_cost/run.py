"""The host cost of one compiled-graph custom-op call, taken apart on the CPU: what inductor's
Python wrapper pays per ``torch.ops.tilenorm.norm_fwd`` / ``norm_bwd`` call (the statements
``wrapper.py`` prints), and what each alternative form of the call would pay. In a host-bound
compiled step these calls' host time is the norms' cost, so this says which piece to cut: the
Python binding's argument parsing, the dispatcher, the kernel's own per-call work, or the
wrapper's statements around the call.

The kernels (``opbench.cpp``) do no compute and launch nothing: they return outputs, and are
registered at the CPU keys the way ``tilenorm/pytorch/native_calls.cpp`` registers its CUDA ones,
for twins of tilenorm's ops (namespace ``obpy``, same schemas, defined here with
``torch.library.custom_op``) and for variants of them (namespace ``ob``: other Autograd kernels,
fewer outputs or arguments, one argument of each type). What a kernel does before returning is
its mode (``opbench.set_mode``): 0 returns preallocated tensors; 1 four ``at::empty({0})``;
2 ``at::empty`` of real sizes; 3 = 2 + tilenorm's per-call key and shared-lock lookup; 4 = 3 with
outputs 1 and 3 as ``at::empty({0})`` placeholders (RMSNorm's backward: dres and dbias absent);
5 = 4 with those two undefined (None); 6 the lean ops' outputs after 3's key and lookup. Case
names carry their mode as ``[modeN]``. Tensors are bf16, 1024 x 512 (weight 512).

Each case is a Python statement timed in a loop (the empty loop's time subtracted) or a C++ loop
(``opbench.time_cpp``); all selected cases are timed once a round, interleaved, for ``--rounds``
rounds, in thread CPU time (the machine may be shared: wall time would count other processes'
slices), with the garbage collector off and grad mode off unless the case says "grad on". The
table gives the median and 25th percentile over rounds, in microseconds per call. Groups
(``--cases``, comma-separated; default all):

  cpp       C++ alone: the per-call key, lookup, allocations and stack, and whole calls through
            the dispatcher (``callBoxed``) per mode
  call      forms of the call from Python: the wrapper's (A: 12 positional + dy2=None, dy3=None by
            keyword), other argument forms, OpOverload and its raw ``_op``, the dispatcher's
            boxed entry by handle (G), other Autograd kernels and output counts
  levers    norm_bwd with all 14 arguments positional and the dtype as an int (S), and
            METH_FASTCALL C++ entries into the dispatcher (T) or straight into the kernel (U)
  alloc     modes 2 and 3: real-size outputs, then tilenorm's key and lookup
  wrapper   the op with only a Python implementation, the statements inductor emits around a call
            (indexing, ``assert_size_stride``, ``reinterpret_tensor``), and whole blocks as emitted
  grad      grad mode on, as outside a compiled region's no_grad
  fast      norm_fwd's fast entries, and placeholders returned as None (mode 5)
  unboxed   a boxed against an unboxed kernel, from Python and from C++
  lean      one configuration's minimal schemas against the 11- and 14-argument ones
  argtypes  what one argument of each schema type costs, through OpOverload and by handle

The extension is built once per source, torch build and compiler, with tilenorm's extension
flags, into ``tilenorm.pytorch.native.cache_root() / "op_call_cost"`` (outside the repository);
it needs a C++ compiler (``$CXX``, default ``c++``). ``results-cpu-torch2.13.txt`` holds a
recorded run. On a shared machine, pin the process to one core:

    taskset -c 1 python bench/experiments/op_call_cost/run.py [--cases call,levers] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.machinery
import importlib.util
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tilenorm.pytorch import native  # noqa: E402

SOURCE = Path(__file__).with_name("opbench.cpp")
MODULE = "opbench"
M, N = 1024, 512
DT = torch.bfloat16
ITERS = 300  # calls per timed Python loop
BWD_ARGS = "dy, None, h, w, None, None, rstd, 0.0, 1, False, DT, None"  # RMSNorm, no residual
FWD_ARGS = "x, w, None, None, 1e-06, 0.0, False, 1, False, None, None"
KW = "dy2=None, dy3=None"  # how the wrapper passes norm_bwd's defaulted arguments


# Twins of tilenorm's ops (tilenorm/pytorch/custom_ops.py): the same schemas, so the Python
# binding parses the same arguments; opbench.cpp registers their CPU and AutogradCPU kernels.
@torch.library.custom_op("obpy::norm_fwd", mutates_args=())
def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, eps: float, offset: float, layer_norm: bool,
             dims: int, per_head: bool, out_dtype: torch.dtype | None,
             residual_dtype: torch.dtype | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    raise AssertionError("opbench's C++ kernel expected")


@torch.library.custom_op("obpy::norm_bwd", mutates_args=())
def norm_bwd(dy: torch.Tensor, dres_in: torch.Tensor | None, h: torch.Tensor,
             weight: torch.Tensor | None, bias: torch.Tensor | None,
             mean: torch.Tensor | None, rstd: torch.Tensor, offset: float, dims: int,
             per_head: bool, x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
             dy2: torch.Tensor | None = None, dy3: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    raise AssertionError("opbench's C++ kernel expected")


# norm_bwd with only a Python implementation (tilenorm's ops without the C++ host path,
# TILENORM_NATIVE=0): it allocates RMSNorm's four outputs.
@torch.library.custom_op("obpy2::norm_bwd", mutates_args=())
def norm_bwd_python(dy: torch.Tensor, dres_in: torch.Tensor | None, h: torch.Tensor,
                    weight: torch.Tensor | None, bias: torch.Tensor | None,
                    mean: torch.Tensor | None, rstd: torch.Tensor, offset: float, dims: int,
                    per_head: bool, x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
                    dy2: torch.Tensor | None = None, dy3: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(h), torch.empty(0, dtype=dy.dtype), torch.empty_like(weight),
            torch.empty(0, dtype=dy.dtype))


def build(rebuild: bool = False) -> Path:
    """opbench.cpp compiled with tilenorm's extension flags (named opbench), once per source,
    torch build, Python and compiler."""
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__} {torch.version.git_version} {sys.version} "
               f"{native._compiler()}".encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = native.cache_root() / "op_call_cost" / f"{MODULE}-{key.hexdigest()[:16]}{suffix}"
    if target.exists() and not rebuild:
        return target
    flags = [f"-DTORCH_EXTENSION_NAME={MODULE}" if f.startswith("-DTORCH_EXTENSION_NAME=")
             else f for f in native._flags()]
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {SOURCE.name} into {target.parent}", file=sys.stderr, flush=True)
    done = subprocess.run([native._compiler(), str(SOURCE), "-o", str(target), *flags],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
    return target


def load(path: Path) -> ModuleType:
    """The extension's Python module; loading it registers its ops and kernels."""
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Case:
    name: str
    mode: int = 0
    stmt: str = ""  # a Python statement, run in the namespace that namespace() returns
    cpp: tuple[str, str, int] | None = None  # or opbench.time_cpp's (what, op name, iterations)
    grad: bool = False


def epilogue(result: str, op: str, second: int = 2) -> str:
    """The statements inductor emits after a call of `op` returning the tuple `result`, of
    which outputs 0 and `second` are used (RMSNorm's y and rstd, or dx and dweight)."""
    name = f"'torch.ops.tilenorm.{op}.default'"
    return (f"buf3 = {result}[0]\n"
            f"assert_size_stride(buf3, ({M}, {N}), ({N}, 1), {name})\n"
            f"buf5 = {result}[{second}]\n"
            f"assert_size_stride(buf5, ({N}, ), (1, ), {name})\n"
            f"del {result}")


def cpp_cases() -> list[Case]:
    cases = [Case(f"C++: {what}", cpp=(what, "", 20000))
             for what in ("key", "lookup", "key+lookup", "empty0", "empty", "empty_like",
                          "stack")]
    for mode in (0, 1, 2, 3, 4):
        for op in ("ob::bwd14", "ob::bwd14_nif", "ob::bwd14_ft", "ob::bwd14_rd", "ob::bwd14_2",
                   "ob::bwd14_1", "ob::t4", "obpy::norm_bwd"):
            # modes 2 and 3 only add allocation and lookup work: two ops show it
            if mode in (2, 3) and op not in ("ob::bwd14_nif", "obpy::norm_bwd"):
                continue
            cases.append(Case(f"C++ callBoxed [mode{mode}] {op}", mode,
                              cpp=("callboxed", op, 5000)))
    return cases


def call_cases() -> list[Case]:
    cases = []
    for mode in (0, 1, 4):
        p = f"[mode{mode}] "
        cases += [
            Case(p + "A inductor form: torch.ops.ob.bwd14_nif.default(12 pos, dy2=None, dy3=None)",
                 mode, f"buf0 = torch.ops.ob.bwd14_nif.default({BWD_ARGS}, {KW})"),
            Case(p + "A' tilenorm twin obpy.norm_bwd, inductor form",
                 mode, f"buf0 = torch.ops.obpy.norm_bwd.default({BWD_ARGS}, {KW})"),
            Case(p + "A'' tilenorm twin obpy.norm_fwd, inductor form (11 pos)",
                 mode, f"buf0 = torch.ops.obpy.norm_fwd.default({FWD_ARGS})"),
            Case(p + "B bwd14_nif 14 positional",
                 mode, f"buf0 = torch.ops.ob.bwd14_nif.default({BWD_ARGS}, None, None)"),
            Case(p + "C bwd14_nif 12 positional (defaults)",
                 mode, f"buf0 = torch.ops.ob.bwd14_nif.default({BWD_ARGS})"),
            Case(p + "D bound OpOverload, kwargs", mode, f"buf0 = op_nif({BWD_ARGS}, {KW})"),
            Case(p + "E bound OpOverload, 12 pos", mode, f"buf0 = op_nif({BWD_ARGS})"),
            Case(p + "F OpOverload._op, 12 pos", mode, f"buf0 = op_nif_raw({BWD_ARGS})"),
            Case(p + "G _dispatch_call_boxed(handle, 12 pos)",
                 mode, f"buf0 = call_boxed(handle_nif, {BWD_ARGS})"),
            Case(p + "G' _dispatch_call_boxed(handle, 12 pos, kwargs)",
                 mode, f"buf0 = call_boxed(handle_nif, {BWD_ARGS}, {KW})"),
            Case(p + "H bwd14 (no Autograd kernel: global fallback), 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14.default({BWD_ARGS})"),
            Case(p + "I bwd14_ft (AutogradCPU fallthrough), 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14_ft.default({BWD_ARGS})"),
            Case(p + "J bwd14_rd (AutogradCPU redispatch kernel), 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14_rd.default({BWD_ARGS})"),
            Case(p + "K bwd14_2 (2 outputs), 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14_2.default({BWD_ARGS})"),
            Case(p + "L bwd14_1 (1 output), 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14_1.default({BWD_ARGS})"),
            Case(p + "M fwd11 (no Autograd kernel)",
                 mode, f"buf0 = torch.ops.ob.fwd11.default({FWD_ARGS})"),
            Case(p + "N fwd11_rd (tilenorm-style redispatch)",
                 mode, f"buf0 = torch.ops.ob.fwd11_rd.default({FWD_ARGS})"),
            Case(p + "O t4 (4 tensors -> 4)",
                 mode, "buf0 = torch.ops.ob.t4.default(dy, h, w, rstd)"),
            Case(p + "P t4_1 (4 tensors -> 1)",
                 mode, "buf0 = torch.ops.ob.t4_1.default(dy, h, w, rstd)"),
            Case(p + "Q t1 (1 tensor -> 1)", mode, "buf0 = torch.ops.ob.t1.default(dy)"),
            Case(p + "R G-path t4 via _dispatch_call_boxed",
                 mode, "buf0 = call_boxed(handle_t4, dy, h, w, rstd)"),
        ]
    return cases


# norm_bwd's arguments all positional with x_dtype as its ScalarType's int (bf16: 15): what the
# Python binding parses fastest (levers 1 and 2)
LEVERS_ARGS = "dy, None, h, w, None, None, rstd, 0.0, 1, False, 15, None, None, None"


def levers_cases() -> list[Case]:
    cases = []
    for mode in (0, 1, 4):
        p = f"[mode{mode}] "
        cases += [
            Case(p + "S twin norm_bwd: 14 positional, dtype as int (levers 1+2)",
                 mode, f"buf0 = torch.ops.obpy.norm_bwd.default({LEVERS_ARGS})"),
            Case(p + "S' twin norm_bwd: 14 positional, dtype object",
                 mode, f"buf0 = torch.ops.obpy.norm_bwd.default({BWD_ARGS}, None, None)"),
            Case(p + "S'' twin norm_bwd: ._op, 14 positional, int dtype",
                 mode, f"buf0 = tn_bwd_raw({LEVERS_ARGS})"),
            Case(p + "T METH_FASTCALL C++ entry -> dispatcher (twin norm_bwd)",
                 mode, f"buf0 = fast_dispatch({BWD_ARGS})"),
            Case(p + "T' METH_FASTCALL C++ entry -> dispatcher, GIL released",
                 mode, f"buf0 = fast_dispatch_nogil({BWD_ARGS})"),
            Case(p + "U METH_FASTCALL C++ entry -> kernel directly (no dispatcher)",
                 mode, f"buf0 = fast_direct({BWD_ARGS})"),
        ]
    return cases


def alloc_cases() -> list[Case]:
    cases = []
    for mode in (2, 3):
        p = f"[mode{mode}] "
        cases += [
            Case(p + "A' tilenorm twin obpy.norm_bwd, inductor form",
                 mode, f"buf0 = torch.ops.obpy.norm_bwd.default({BWD_ARGS}, {KW})"),
            Case(p + "G _dispatch_call_boxed(handle, 12 pos)",
                 mode, f"buf0 = call_boxed(handle_nif, {BWD_ARGS})"),
        ]
    return cases


def wrapper_cases() -> list[Case]:
    name = "'torch.ops.tilenorm.norm_bwd.default'"
    cases = [
        Case("[python impl] obpy2.norm_bwd inductor form",
             stmt=f"buf0 = torch.ops.obpy2.norm_bwd.default({BWD_ARGS}, {KW})"),
        # the wrapper's statements alone, on existing tensors (buf0: a tuple of them)
        Case("wrapper: buf1 = buf0[0]", stmt="buf1 = buf0[0]"),
        Case("wrapper: assert_size_stride 2-D",
             stmt=f"assert_size_stride(h, ({M}, {N}), ({N}, 1), {name})"),
        Case("wrapper: assert_size_stride 1-D",
             stmt=f"assert_size_stride(w, ({N}, ), (1, ), {name})"),
        Case("wrapper: assert_size_stride 2-D, no name (2.11 input form)",
             stmt=f"assert_size_stride(h, ({M}, {N}), ({N}, 1))"),
        Case("wrapper: assert_alignment", stmt=f"assert_alignment(h, 16, {name})"),
        Case("wrapper: reinterpret_tensor",
             stmt=f"b = reinterpret_tensor(h, ({M}, {N}), ({N}, 1), 0)"),
        Case("wrapper: index x2 + assert x2 + del (norm_bwd epilogue)",
             stmt="b0 = buf0\n" + epilogue("b0", "norm_bwd")),
    ]
    dy_view = f"reinterpret_tensor(dy, ({M}, {N}), ({N}, 1), 0)"
    bwd_tail = "None, h, w, None, None, rstd, 0.0, 1, False, torch.bfloat16, None"
    for mode in (0, 4):
        # whole blocks as the wrapper emits them, from the call to the outputs' last use
        cases += [
            Case(f"[mode{mode}] whole norm_bwd block as emitted", mode,
                 f"buf2 = torch.ops.obpy.norm_bwd.default({dy_view}, {bwd_tail}, {KW})\n"
                 + epilogue("buf2", "norm_bwd") + "\ndel buf3, buf5"),
            Case(f"[mode{mode}] whole norm_fwd block as emitted", mode,
                 f"buf2 = torch.ops.obpy.norm_fwd.default({FWD_ARGS})\n"
                 + epilogue("buf2", "norm_fwd") + "\ndel buf3, buf5"),
            Case(f"[mode{mode}] norm_bwd block, levers 1+2 (14 positional, int dtype)", mode,
                 f"buf2 = torch.ops.obpy.norm_bwd.default({dy_view}, "
                 "None, h, w, None, None, rstd, 0.0, 1, False, 15, None, None, None)\n"
                 + epilogue("buf2", "norm_bwd") + "\ndel buf3, buf5"),
            Case(f"[mode{mode}] norm_bwd block via METH_FASTCALL entry + asserts", mode,
                 f"buf2 = fast_dispatch({dy_view}, {bwd_tail})\n"
                 + epilogue("buf2", "norm_bwd") + "\ndel buf3, buf5"),
            Case(f"[mode{mode}] norm_bwd block via _dispatch_call_boxed, no asserts", mode,
                 f"buf2 = call_boxed(handle_tn_bwd, dy, {bwd_tail})\n"
                 "buf3 = buf2[0]\nbuf5 = buf2[2]\ndel buf2\ndel buf3, buf5"),
        ]
    return cases


def grad_cases() -> list[Case]:
    return [
        Case("[mode0, grad on] bwd14_nif 12 pos",
             stmt=f"buf0 = torch.ops.ob.bwd14_nif.default({BWD_ARGS})", grad=True),
        Case("[mode0, grad on] obpy.norm_bwd inductor form",
             stmt=f"buf0 = torch.ops.obpy.norm_bwd.default({BWD_ARGS}, {KW})", grad=True),
        Case("[mode0, grad on] bwd14_ft 12 pos",
             stmt=f"buf0 = torch.ops.ob.bwd14_ft.default({BWD_ARGS})", grad=True),
    ]


def fast_cases() -> list[Case]:
    cases = []
    for mode in (0, 4):
        p = f"[mode{mode}] "
        cases += [
            Case(p + "A'' twin norm_fwd inductor form",
                 mode, f"buf0 = torch.ops.obpy.norm_fwd.default({FWD_ARGS})"),
            Case(p + "V norm_fwd METH_FASTCALL -> dispatcher",
                 mode, f"buf0 = fast_dispatch_fwd({FWD_ARGS})"),
            Case(p + "W norm_fwd METH_FASTCALL -> kernel",
                 mode, f"buf0 = fast_direct_fwd({FWD_ARGS})"),
            Case(p + "A' twin norm_bwd inductor form",
                 mode, f"buf0 = torch.ops.obpy.norm_bwd.default({BWD_ARGS}, {KW})"),
            Case(p + "U norm_bwd METH_FASTCALL -> kernel", mode, f"buf0 = fast_direct({BWD_ARGS})"),
        ]
    cases += [
        Case("[mode5] U norm_bwd METH_FASTCALL -> kernel, absent outputs as None",
             5, f"buf0 = fast_direct({BWD_ARGS})"),
        Case("[mode5] W norm_fwd METH_FASTCALL -> kernel, absent outputs as None",
             5, f"buf0 = fast_direct_fwd({FWD_ARGS})"),
    ]
    for mode in (4, 5):
        cases.append(Case(
            f"[mode{mode}] best block: norm_bwd FASTCALL->kernel + 2x(index+assert) + del", mode,
            "buf2 = fast_direct(dy, None, h, w, None, None, rstd, 0.0, 1, False, torch.bfloat16, "
            "None)\n" + epilogue("buf2", "norm_bwd") + "\ndel buf3, buf5"))
    return cases


def unboxed_cases() -> list[Case]:
    cases = []
    for mode in (0, 1):
        cases += [
            Case(f"[mode{mode}] boxed kernel bwd14_nif, 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14_nif.default({BWD_ARGS})"),
            Case(f"[mode{mode}] unboxed kernel bwd14_ub, 12 pos",
                 mode, f"buf0 = torch.ops.ob.bwd14_ub.default({BWD_ARGS})"),
        ]
        cases += [Case(f"C++ callBoxed [mode{mode}] {op}", mode, cpp=("callboxed", op, 5000))
                  for op in ("ob::bwd14_nif", "ob::bwd14_ub")]
    return cases


def lean_cases() -> list[Case]:
    bwd = f"buf2 = torch.ops.obpy.norm_bwd.default({BWD_ARGS}, {KW})"
    fwd = f"buf2 = torch.ops.obpy.norm_fwd.default({FWD_ARGS})"
    lean_bwd = "buf2 = torch.ops.ob.lean_bwd.default(dy, h, w, rstd)"
    lean_fwd = "buf2 = torch.ops.ob.lean_fwd.default(h, w, 1e-06)"
    tail = "\ndel buf3, buf5"
    return [
        Case("[mode4] current norm_bwd call (inductor form)", 4, bwd),
        Case("[mode6] lean_bwd(dy, x, w, rstd) -> (dx, dw)", 6, lean_bwd),
        Case("[mode4] current norm_fwd call (inductor form)", 4, fwd),
        Case("[mode6] lean_fwd(x, w, eps) -> (y, rstd)", 6, lean_fwd),
        Case("[mode4] current norm_bwd block (call + 2 index/assert + del)",
             4, f"{bwd}\n{epilogue('buf2', 'norm_bwd')}{tail}"),
        Case("[mode6] lean_bwd block", 6, f"{lean_bwd}\n{epilogue('buf2', 'lean_bwd', 1)}{tail}"),
        Case("[mode4] current norm_fwd block", 4, f"{fwd}\n{epilogue('buf2', 'norm_fwd')}{tail}"),
        Case("[mode6] lean_fwd block", 6, f"{lean_fwd}\n{epilogue('buf2', 'lean_fwd', 1)}{tail}"),
    ]


# (label, op a_<type>(Tensor a, <type> b), the argument b)
ARG_TYPES = [
    ("float 0.5", "a_float", "0.5"),
    ("SymInt 1", "a_SymInt", "1"),
    ("int 1", "a_int", "1"),
    ("bool False", "a_bool", "False"),
    ("ScalarType dtype", "a_ScalarType", "DT"),
    ("ScalarType int", "a_ScalarType", "15"),
    ("ScalarType? None", "a_ScalarTypeQ", "None"),
    ("ScalarType? dtype", "a_ScalarTypeQ", "DT"),
    ("Tensor? None", "a_TensorQ", "None"),
    ("Tensor? h", "a_TensorQ", "h"),
    ("float? None", "a_floatQ", "None"),
]


def argtypes_cases() -> list[Case]:
    cases = [Case("t1(h)", stmt="b = torch.ops.ob.t1.default(h)")]
    cases += [Case(label, stmt=f"b = torch.ops.ob.{op}.default(h, {arg})")
              for label, op, arg in ARG_TYPES]
    cases += [
        Case("ScalarType?=None omitted", stmt="b = torch.ops.ob.a_ScalarTypeQDNone.default(h)"),
        Case("ScalarType?=None kw b=None",
             stmt="b = torch.ops.ob.a_ScalarTypeQDNone.default(h, b=None)"),
    ]
    cases += [Case(f"boxed {label}", stmt=f"b = call_boxed(handle_{op}, h, {arg})")
              for label, op, arg in ARG_TYPES]
    return cases


GROUPS = {"cpp": cpp_cases, "call": call_cases, "levers": levers_cases, "alloc": alloc_cases,
          "wrapper": wrapper_cases, "grad": grad_cases, "fast": fast_cases,
          "unboxed": unboxed_cases, "lean": lean_cases, "argtypes": argtypes_cases}


def namespace(opbench: ModuleType) -> dict:
    """The globals the statements run in: the tensors, the wrapper's helpers, and the callables
    bound ahead (as a wrapper could bind them at module level)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(M, N, generator=g, dtype=DT)
    w = torch.randn(N, generator=g, dtype=DT)
    find = torch._C._dispatch_find_schema_or_throw
    guards = torch._C._dynamo.guards
    return dict(
        torch=torch, DT=DT, h=h, x=h, w=w,
        dy=torch.randn(M, N, generator=g, dtype=DT),
        rstd=torch.randn(M, generator=g, dtype=torch.float32),
        buf0=(h, h, w, w),
        assert_size_stride=guards.assert_size_stride, assert_alignment=guards.assert_alignment,
        reinterpret_tensor=guards._reinterpret_tensor,
        op_nif=torch.ops.ob.bwd14_nif.default, op_nif_raw=torch.ops.ob.bwd14_nif.default._op,
        tn_bwd_raw=torch.ops.obpy.norm_bwd.default._op,
        call_boxed=torch._C._dispatch_call_boxed,
        handle_nif=find("ob::bwd14_nif", ""), handle_t4=find("ob::t4", ""),
        handle_tn_bwd=find("obpy::norm_bwd", ""),
        **{f"handle_{op}": find(f"ob::{op}", "") for _, op, _ in ARG_TYPES},
        fast_dispatch=opbench.fast_dispatch, fast_dispatch_nogil=opbench.fast_dispatch_nogil,
        fast_direct=opbench.fast_direct, fast_dispatch_fwd=opbench.fast_dispatch_fwd,
        fast_direct_fwd=opbench.fast_direct_fwd)


def timer(case: Case, opbench: ModuleType, ns: dict):
    """A function of a call count n that makes n calls and returns thread CPU ns per call."""
    if case.cpp is not None:
        what, op, _ = case.cpp
        args = ns["dy"], ns["h"], ns["w"], ns["rstd"]
        return lambda n: opbench.time_cpp(what, n, *args, op)
    # the loop is compiled around the statement, so that the statement reads module globals as
    # the wrapper's do, and nothing but the loop stands between the calls
    src = ("def run(_n):\n    _t0 = _clock()\n    for _ in range(_n):\n"
           f"{textwrap.indent(case.stmt, ' ' * 8)}\n    return (_clock() - _t0) / _n\n")
    scope = dict(ns, _clock=time.thread_time_ns)
    exec(src, scope)
    return scope["run"]


def measure(cases: list[Case], opbench: ModuleType, rounds: int) -> list[list[float]]:
    """us per call of each case, one sample a round; rounds interleave the cases, so that a
    slow stretch of the machine touches them all alike."""
    ns = namespace(opbench)
    # every kernel's mode 0 returns these: RMSNorm's four outputs (dx, dres, dweight, dbias)
    opbench.set_static([torch.empty(M, N, dtype=DT), torch.empty(0, dtype=DT),
                        torch.empty(N, dtype=DT), torch.empty(0, dtype=DT)])
    timers = [timer(c, opbench, ns) for c in cases]
    empty = timer(Case("empty loop", stmt="pass"), opbench, ns)
    # warm up, and fail early on a statement that does not run
    for case, run in zip(cases, timers, strict=True):
        opbench.set_mode(case.mode)
        with torch.set_grad_enabled(case.grad):
            run(10 if case.cpp else 50)
    samples = [[] for _ in cases]
    gc.disable()
    try:
        for _ in range(rounds):
            loop_ns = empty(ITERS)
            for case, run, values in zip(cases, timers, samples, strict=True):
                opbench.set_mode(case.mode)
                with torch.set_grad_enabled(case.grad):
                    ns_per_call = run(case.cpp[2]) if case.cpp else run(ITERS) - loop_ns
                values.append(ns_per_call / 1000)
    finally:
        gc.enable()
    return samples


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="all",
                        help=f"comma-separated groups of {', '.join(GROUPS)}; default all")
    parser.add_argument("--rounds", type=int, default=101, help="samples per case")
    parser.add_argument("--quick", action="store_true", help="25 rounds")
    parser.add_argument("--rebuild", action="store_true", help="recompile opbench.cpp")
    args = parser.parse_args()
    groups = list(GROUPS) if args.cases == "all" else args.cases.split(",")
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown groups {unknown}; groups: {', '.join(GROUPS)}")
    rounds = 25 if args.quick else args.rounds
    torch.set_num_threads(1)
    opbench = load(build(args.rebuild))
    # groups may repeat another group's case under their own name, so that each group alone
    # holds its comparison; each row is timed separately
    selected = [(group, GROUPS[group]()) for group in groups]
    samples = iter(measure([c for _, cases in selected for c in cases], opbench, rounds))
    print(f"op_call_cost: torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} "
          f"torch thread; {rounds} rounds x {ITERS} calls (C++ loops: their own counts); "
          f"us per call, thread CPU time")
    print(f"{'median':>8} {'p25':>8}  case")
    for group, cases in selected:
        print(f"[{group}]")
        for case in cases:
            values = sorted(next(samples))
            print(f"{statistics.median(values):8.3f} {values[len(values) // 4]:8.3f}  "
                  f"{case.name}")


if __name__ == "__main__":
    main()
