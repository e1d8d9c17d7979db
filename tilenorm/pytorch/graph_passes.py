"""An inductor post-grad pass that folds the sum of a norm output's gradients into ``norm_bwd``.

When a norm's output feeds several matmuls (an attention block's q/k/v projections, an MLP's
gate and up), the backward graph hands ``tilenorm::norm_bwd`` their sum: ``dy`` is
``add(add(view(mm), view(mm)), view(mm))``. ``norm_bwd`` is opaque to inductor, so inductor
writes that sum to memory in a pointwise kernel of its own before the call: one extra launch
and one extra pass over the hidden state per sum (23 launches a training step of an 8-layer
Llama, bench/NOTES.md #45), where inductor's own norm backward reads the terms in its
prologue. ``norm_bwd`` takes up to two further gradients, ``dy2`` and ``dy3``, that its
kernel adds to ``dy`` in float32; this pass rewrites

    norm_bwd(add(add(a, b), c), ...)   ->   norm_bwd(a, ..., dy2=b, dy3=c)

and drops the adds. It folds only terms that are in memory whatever happens: the outputs of
matmuls, convolutions, custom ops and graph inputs, behind free reshapes. A pointwise term
inductor would otherwise compute inside the add's kernel; folding it would make inductor
write it out, costing more than the add it saves.

:func:`install` puts the pass in ``torch._inductor.config.post_grad_custom_post_pass``, after
whatever pass was there (which it calls after its own work); :func:`uninstall` puts that back.
The custom ops' fake implementations install it the first time a graph holding them is traced
(:mod:`tilenorm.pytorch.custom_ops`), so that importing tilenorm does not import inductor.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.fx import Graph, Node

#: The most gradients ``norm_bwd`` takes: ``dy`` and the keyword arguments named here.
_EXTRA_DY = ("dy2", "dy3")
_MAX_TERMS = 1 + len(_EXTRA_DY)
#: ``norm_bwd``'s positional arguments, ``dy`` to ``residual_dtype``.
_NORM_BWD_ARGS = 12

#: The pass while :func:`install` has it in inductor's config, else None.
_installed: Any = None


@functools.cache
def _ops() -> tuple[frozenset, frozenset]:
    """(reshapes that cost nothing on a buffer, aten ops whose output is a buffer)."""
    aten = torch.ops.aten
    reshapes = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
    buffers = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                         aten.baddbmm.default, aten._scaled_mm.default,
                         aten.convolution.default})
    return reshapes, buffers


def _norm_bwd():
    return torch.ops.tilenorm.norm_bwd.default


def _accepts_extra_dy(op) -> bool:
    names = {argument.name for argument in op._schema.arguments}
    return all(name in names for name in _EXTRA_DY)


def _is_sum(node: Node) -> bool:
    """``a + b`` of two tensors of the graph, alpha 1."""
    return (node.op == "call_function" and node.target is torch.ops.aten.add.Tensor
            and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args)
            and set(node.kwargs) <= {"alpha"} and node.kwargs.get("alpha", 1) == 1)


def _uses(user: Node, node: Node) -> int:
    return sum(a is node for a in (*user.args, *user.kwargs.values()))


def _custom_op_output(node: Node) -> bool:
    """The output of an op outside aten and prims that inductor runs as an opaque kernel.
    Ops inductor lowers itself (quantized_decomposed's, for one) may be pointwise and fused."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("aten", "prims"):
        return False
    from torch._inductor import lowering

    return target not in lowering.lowerings or target in getattr(lowering, "fallbacks", ())


def _in_memory(node: Node) -> bool:
    """Whether inductor writes ``node`` to memory (or has it there) whether or not the add
    that reads it stays: graph inputs and the outputs of matmuls, convolutions and opaque
    custom ops, seen through reshapes (free on a buffer) and tuple indexing."""
    reshapes, buffers = _ops()
    while node.op == "call_function" and node.target in reshapes:
        node = node.args[0]
    if node.op == "placeholder":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        node = node.args[0]
        return node.op == "call_function" and _custom_op_output(node)
    return node.target in buffers or _custom_op_output(node)


def _same_tensor_type(node: Node, like: torch.Tensor) -> bool:
    """Same shape (provably, for symbolic shapes), dtype and device as ``like``."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype == like.dtype
            and val.device == like.device and statically_known_true(sym_eq(val.shape, like.shape)))


def _fold(node: Node) -> tuple[list[Node], list[Node]] | None:
    """(terms left to right, the adds that sum them, root first) of a ``norm_bwd`` node the
    pass rewrites, else None."""
    if node.op != "call_function" or node.target is not _norm_bwd():
        return None
    given = (*node.args[_NORM_BWD_ARGS:], *(node.kwargs.get(name) for name in _EXTRA_DY))
    if not node.args or any(t is not None for t in given):
        return None
    root = node.args[0]
    if not isinstance(root, torch.fx.Node) or not _is_sum(root):
        return None
    like = root.meta.get("val")
    if not isinstance(like, torch.Tensor):
        return None
    terms: list[Node] = []
    adds: list[Node] = []

    def walk(n: Node, user: Node) -> bool:
        if not _is_sum(n):
            terms.append(n)
            return len(terms) <= _MAX_TERMS
        # An add read elsewhere stays, and a sum of more terms than norm_bwd takes stays
        # too; with _MAX_TERMS - 1 adds at most, the walk is shallow.
        if n.users.keys() != {user} or _uses(user, n) != 1 or len(adds) == _MAX_TERMS - 1:
            return False
        adds.append(n)
        return walk(n.args[0], n) and walk(n.args[1], n)

    if not walk(root, node):
        return None
    if not all(_same_tensor_type(n, like) for n in (*adds, *terms)):
        return None
    if not all(_in_memory(term) for term in terms):
        return None
    return terms, adds


def fold_terms(node: Node) -> list[Node] | None:
    """The gradients the pass would hand ``norm_bwd`` node ``node`` as ``dy``, ``dy2`` (and
    ``dy3``), in the sum's left-to-right order; None where it leaves the node alone."""
    found = _fold(node)
    return None if found is None else found[0]


def fold_norm_bwd_sums(graph: Graph) -> int:
    """Rewrite every foldable ``norm_bwd`` in ``graph`` (see the module docstring); the number
    rewritten. Nothing happens where ``norm_bwd`` does not take ``dy2`` and ``dy3``."""
    op = _norm_bwd()
    if not _accepts_extra_dy(op):
        return 0
    folded = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is op]:
        found = _fold(node)
        if found is None:
            continue
        terms, adds = found
        node.args = (terms[0], *node.args[1:_NORM_BWD_ARGS])
        node.kwargs = {**node.kwargs, **dict(zip(_EXTRA_DY, terms[1:], strict=False))}
        for add in adds:  # root first: each has lost its only user when its turn comes
            graph.erase_node(add)
        folded += 1
    return folded


@functools.cache
def _source_hash(schema: str) -> bytes:
    """This file, the custom ops' definitions and norm_bwd's schema. The ops' fake
    implementations decide the shapes a compiled graph asserts, and inductor's graph cache
    does not key on them: with them in the pass's uuid, a cached graph from other ops' code is
    never reused."""
    ops = Path(__file__).with_name("custom_ops.py")
    return hashlib.sha256(Path(__file__).read_bytes() + ops.read_bytes()
                          + schema.encode()).digest()


def _as_passes(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@functools.cache
def pass_class() -> type:
    """The pass's class: a ``CustomGraphPass`` (inference-aware where torch has that, so that
    an inference-aware pass it chains learns ``is_inference``). Built on first use, as it
    imports ``torch._inductor``."""
    from torch._inductor import custom_graph_pass

    base = custom_graph_pass.CustomGraphPass
    inference_aware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)

    class FoldNormBwdSums(inference_aware or base):
        """:func:`fold_norm_bwd_sums`, then the passes in ``previous`` (what inductor's config
        held before), in order."""

        def __init__(self, previous: Any = None) -> None:
            self.previous = previous
            self._chained = _as_passes(previous)

        def __call__(self, graph: Graph, is_inference: bool = False) -> None:
            fold_norm_bwd_sums(graph)
            for chained in self._chained:
                if inference_aware is not None and isinstance(chained, inference_aware):
                    chained(graph, is_inference=is_inference)
                else:
                    chained(graph)

        def uuid(self) -> Any:
            # None where a chained pass has no uuid: inductor then skips its graph cache, as
            # it would with that pass installed alone.
            uuids = [p.uuid() if isinstance(p, base) else None for p in self._chained]
            if not all(uuids):
                return None
            own = _source_hash(str(_norm_bwd()._schema))
            return (own, *uuids) if uuids else own

    return FoldNormBwdSums


def _holds_pass(value) -> bool:
    return any(isinstance(p, pass_class()) for p in _as_passes(value))


def installed() -> bool:
    """Whether inductor's ``post_grad_custom_post_pass`` holds the pass."""
    if "torch._inductor.config" not in sys.modules:
        return False
    from torch._inductor import config

    return _holds_pass(config.post_grad_custom_post_pass)


def install() -> None:
    """Put the pass in ``torch._inductor.config.post_grad_custom_post_pass``; a pass already
    there (a callable, or a list or tuple of them) runs after it. Nothing happens if the config
    holds it already."""
    global _installed
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    if _holds_pass(current):
        return
    _installed = pass_class()(current)
    config.post_grad_custom_post_pass = _installed


def uninstall() -> None:
    """Undo :func:`install`: the config gets back the value it had before. If something else
    has replaced the pass in the config since, the config is left as it is."""
    global _installed
    if _installed is None:
        return
    from torch._inductor import config

    if config.post_grad_custom_post_pass is _installed:
        config.post_grad_custom_post_pass = _installed.previous
    _installed = None
