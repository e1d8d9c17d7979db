"""The wrapper code inductor emits around custom-op calls (CPU, ``torch.compile``): the
statements whose host cost ``run.py`` times piece by piece. Each case compiles a small function
in a fresh inductor cache and prints the ``call`` function of every graph it compiled (the
wrapper; ``--full``: the whole module, kernels included). Cases (``--case``, comma-separated;
default all):

  tilenorm  two tilenorm RMSNorms with a linear layer after each, forward and backward: the
            ``torch.ops.tilenorm.norm_fwd`` / ``norm_bwd`` calls, the outputs' indexing and
            ``assert_size_stride`` checks, ``reinterpret_tensor`` on an input
  schemas   four ops with norm_bwd's arguments that differ in their schema: dy2 and dy3 with
            defaults (``Tensor? dy2=None``) or without, the ``needs_fixed_stride_order`` tag,
            x_dtype a ScalarType or an int: which calls get keyword arguments (torch 2.13:
            defaulted ones are passed as ``dy2=None, dy3=None`` unless the tag is set, when they
            are left out)
  rename    a lowering that keeps the fallback's IR but renames the callee to
            ``extern_kernels.ob_fast_bwd``: how a wrapper could call a fast C++ entry (run.py's
            METH_FASTCALL cases) in place of the OpOverload, without patching inductor's codegen

    python bench/experiments/op_call_cost/wrapper.py [--case tilenorm,schemas,rename] [--full]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch._inductor import ir, lowering
from torch._inductor.select_algorithm import extern_kernels
from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tilenorm.pytorch import functional  # noqa: E402

BWD_SCHEMA = ("(Tensor dy, Tensor? dres_in, Tensor h, Tensor? weight, Tensor? bias, "
              "Tensor? mean, Tensor rstd, float offset, SymInt dims, bool per_head, "
              "{x_dtype} x_dtype, ScalarType? residual_dtype, {tail}) "
              "-> (Tensor, Tensor, Tensor, Tensor)")
LIBRARIES = []  # a torch.library.Library's registrations last while the object does


def bwd_outputs(dy, dres_in, h, weight, bias, mean, rstd, offset, dims, per_head, x_dtype,
                residual_dtype, dy2=None, dy3=None):
    """RMSNorm's backward outputs, (dx, dres, dweight, dbias) with dres and dbias empty: the ops'
    kernel and fake alike."""
    return torch.empty_like(h), h.new_empty(0), torch.empty_like(weight), h.new_empty(0)


def define_bwd(namespace: str, name: str, x_dtype: str, tail: str, tags=()) -> None:
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(name + BWD_SCHEMA.format(x_dtype=x_dtype, tail=tail), tags=tags)
    lib.impl(name, bwd_outputs, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::{name}", bwd_outputs, lib=lib)
    LIBRARIES.append(lib)


class Block(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.ones(dim))
        self.w2 = torch.nn.Parameter(torch.ones(dim))
        self.l1 = torch.nn.Linear(dim, dim, bias=False)
        self.l2 = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        x = x + self.l1(functional.rms_norm(x, self.w1, 1e-6))
        return x + self.l2(functional.rms_norm(x, self.w2, 1e-6))


def tilenorm_case():
    torch.manual_seed(0)
    compiled = torch.compile(Block())
    x = torch.randn(4, 16, 64, requires_grad=True)

    def step():  # the backward graph is compiled at the first backward
        compiled(x).sum().backward()
    return step


def schemas_case():
    defaults, plain = "Tensor? dy2=None, Tensor? dy3=None", "Tensor? dy2, Tensor? dy3"
    define_bwd("kwt", "dflt", "ScalarType", defaults)
    define_bwd("kwt", "nodflt", "ScalarType", plain)
    define_bwd("kwt", "dflt_fso", "ScalarType", defaults, (torch.Tag.needs_fixed_stride_order,))
    define_bwd("kwt", "nodflt_int", "int", plain)
    ops = torch.ops.kwt

    def f(dy, h, w, rstd):
        common = (dy, None, h, w, None, None, rstd, 0.0, 1, False)
        a = ops.dflt(*common, torch.float32, None)
        b = ops.nodflt(*common, torch.float32, None, None, None)
        c = ops.dflt_fso(*common, torch.float32, None)
        d = ops.nodflt_int(*common, 6, None, None, None)  # 6: float32's ScalarType
        return a[0] + b[0] + c[0] + d[0], a[2] + b[2] + c[2] + d[2]

    compiled = torch.compile(f)
    args = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64), torch.randn(8)
    return lambda: compiled(*args)


def rename_case():
    define_bwd("kwl", "nb", "int", "Tensor? dy2, Tensor? dy3")
    op = torch.ops.kwl.nb.default
    # a stand-in for a C++ METH_FASTCALL entry: the wrapper calls it by this name
    extern_kernels.ob_fast_bwd = op
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    @lowering.register_lowering(op, type_promotion_kind=None)
    def _lower(*args, **kwargs):
        outs = fallback(*args, **kwargs)
        # the outputs are MultiOutputs of one FallbackKernel: rename that kernel's callee
        for out in outs:
            node = out
            while not isinstance(node, ir.MultiOutput) and hasattr(node, "data"):
                node = node.data
            if isinstance(node, ir.MultiOutput):
                node.inputs[0].set_python_kernel_name("extern_kernels.ob_fast_bwd")
                break
        return outs

    # as a fallback would be: the kernel gets its inputs in the strides the graph traced
    lowering.add_layout_constraint(op, lowering.constrain_to_fx_strides)

    def f(dy, h, w, rstd):
        out = op(dy * 2, None, h, w, None, None, rstd, 0.0, 1, False, 15, None, None, None)
        return out[0] + 1, out[2] * 3

    compiled = torch.compile(f)
    dy = torch.randn(64, 32)
    args = dy, torch.randn_like(dy), torch.randn(32), torch.randn(64)

    def run():
        with torch.no_grad():
            compiled(*args)
    return run


CASES = {"tilenorm": tilenorm_case, "schemas": schemas_case, "rename": rename_case}


def call_function(code: str) -> str:
    """The wrapper's ``call`` function, from its def to the next line as little indented."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def call("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent),
               len(lines))
    return "\n".join(lines[start:end]).rstrip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--full", action="store_true", help="print whole modules")
    args = parser.parse_args()
    names = args.case.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; cases: {', '.join(CASES)}")
    print(f"torch {torch.__version__}")
    for name in names:
        run = CASES[name]()
        with fresh_inductor_cache():  # a cache hit could skip the code generation
            _, codes = run_and_get_code(run)
        for k, code in enumerate(codes):
            print(f"\n=== {name}: graph {k + 1} of {len(codes)}")
            print(code if args.full else call_function(code))


if __name__ == "__main__":
    main()
