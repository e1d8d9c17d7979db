"""The fused decoder-layer forward, built from the installed transformers' own source.

A family's decoder layer computes ``h = a + b`` and then normalizes h in consecutive
statements. :func:`fuse` parses the layer's ``forward`` as installed, replaces exactly those
statements with one call of ``add_norm(norm, a, b) -> (norm(a + b), a + b)`` and compiles the
result against the modeling module's globals. Everything else — the signature, defaults,
decorators, the calls into attention and MLP with their keyword arguments, the return value —
is the installed code itself, so the fused forward cannot drift from the version it replaces.
The two statement shapes rewritten (``T``, ``R``, ``S`` names; ``N``, ``M`` attributes of
self):

    T = a + b                      T, R = add_norm(self.N, a, b)
    R = T                    ->
    T = self.N(T)

    T = a + b                      _tilenorm_normed, T = add_norm(self.N, a, b)
    S = self.M(self.N(T))    ->    S = self.M(_tilenorm_normed)

Across layers (:func:`fuse_across`, :func:`loop_across`): the add that ends a layer feeds
the next layer's input norm, across the model's loop. The model's loop then carries the pair
(sublayer output, residual stream) unsummed, vLLM's way: a layer's forward takes the residual
as a second positional argument (so that activation checkpointing, which passes positional
arguments through, differentiates it), opens with the fused add and input norm (the first
layer, with no residual, normalizes its input as written), and returns the pair where it added
them; the model's final norm adds the last pair. The layer shapes rewritten (``P`` the forward's
first parameter, ``E`` the input norm; ``R``, ``T`` as above):

    R = P                          P, R = add_norm(self.E, _tilenorm_residual, P)
    P = self.E(P)            ->
    ...                            ...
    T = R + T                      return T, R
    return T

and the model's loop (``L`` the loop's layer, ``N`` the final norm), behind a per-call check
that nothing observes the layers' outputs:

    for L in self.layers[...]:               if _tilenorm_across_layers(self, self.layers[...]):
        T = L(T, **kw)                           _tilenorm_residual = None
    T = self.N(T)                    ->          for L in self.layers[...]:
                                                     T, _tilenorm_residual = L(
                                                         T, _tilenorm_residual, **kw,
                                                         _tilenorm_across=True)
                                                 T = add_norm(self.N, _tilenorm_residual, T)[0]
                                             else:
                                                 <the loop and the norm as written>

The caller checks the source's digest against the forwards read and verified for each
transformers version (:mod:`tilenorm.transformers.families`) before using the result.
"""

from __future__ import annotations
import __future__

import ast
import copy
import hashlib
import inspect
import linecache
import textwrap
import types
from collections.abc import Callable

ADD_NORM = "_tilenorm_add_norm"
NORMED = "_tilenorm_normed"
#: The residual stream a layer takes and returns unsummed across layers.
RESIDUAL = "_tilenorm_residual"
#: The keyword argument a model's loop passes its layers to take and return the pair.
ACROSS = "_tilenorm_across"
#: The per-call check a model's rewritten forward calls before its loop.
ACROSS_CHECK = "_tilenorm_across_layers"
_DOCSTRING = "_tilenorm_docstring"
_MAKER = "_tilenorm_make_forward"
_INSERTED = (ADD_NORM, NORMED, RESIDUAL, ACROSS, ACROSS_CHECK, _DOCSTRING)
#: Decorators that set a docstring and return the function itself (no wrapper): a rewritten
#: forward gets the original's docstring instead of generating one for a function defined
#: elsewhere.
_DOCSTRING_ONLY = ("auto_docstring",)


class Unsupported(Exception):
    """The forward is not one this module can rewrite; the message says why."""


def source(func: Callable) -> str:
    """The dedented source of ``func`` (decorators included), as ``inspect`` reads it."""
    try:
        return textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as e:
        raise Unsupported(f"the source of {func.__qualname__} cannot be read ({e})") from None


def _decorator_name(node: ast.expr) -> str | None:
    node = node.func if isinstance(node, ast.Call) else node
    return node.id if isinstance(node, ast.Name) else None


def decorators(func: Callable) -> int:
    """How many wrappers the decorators in ``func``'s source put around it."""
    tree = ast.parse(source(func))
    return len([d for d in tree.body[0].decorator_list
                if _decorator_name(d) not in _DOCSTRING_ONLY]) if tree.body else 0


def digest(text: str) -> str:
    """The short digest the verified-forward tables are keyed by."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _name(node: ast.AST, name: str | None = None) -> str | None:
    if isinstance(node, ast.Name) and (name is None or node.id == name):
        return node.id
    return None


def _self_call(node: ast.AST, self_name: str) -> tuple[str, ast.expr] | None:
    """``self.N(arg)`` with one positional argument: (N, arg)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and _name(node.func.value, self_name) and len(node.args) == 1
            and not node.keywords):
        return node.func.attr, node.args[0]
    return None


def _assign(stmt: ast.stmt) -> tuple[str, ast.expr] | None:
    """``T = value`` with a single plain name target."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = _name(stmt.targets[0])
        if target is not None:
            return target, stmt.value
    return None


def _call(norm: str, a: ast.expr, b: ast.expr, self_name: str) -> ast.Call:
    return ast.Call(func=ast.Name(ADD_NORM, ast.Load()),
                    args=[ast.Attribute(ast.Name(self_name, ast.Load()), norm, ast.Load()), a, b],
                    keywords=[])


def _pair(first: str, second: str) -> ast.Tuple:
    return ast.Tuple([ast.Name(first, ast.Store()), ast.Name(second, ast.Store())], ast.Store())


def _located(node: ast.Assign, like: ast.stmt) -> ast.Assign:
    node.type_comment = None
    return ast.fix_missing_locations(ast.copy_location(node, like))


def _stream(body: list[ast.stmt], i: int, norms: tuple[str, ...], self_name: str
            ) -> tuple[str, list[ast.stmt]] | None:
    """``T = a + b; R = T; T = self.N(T)`` at ``body[i]``: (N, its replacement)."""
    if i + 3 > len(body):
        return None
    first, second, third = (_assign(s) for s in body[i:i + 3])
    add = first[1]
    if not (second and third and _name(second[1], first[0]) and second[0] != first[0]
            and third[0] == first[0]):
        return None
    call = _self_call(third[1], self_name)
    if not (call and call[0] in norms and _name(call[1], first[0])):
        return None
    fused = ast.Assign([_pair(first[0], second[0])],
                       _call(call[0], add.left, add.right, self_name))
    return call[0], [_located(fused, body[i])]


def _nested(body: list[ast.stmt], i: int, norms: tuple[str, ...], self_name: str
            ) -> tuple[str, list[ast.stmt]] | None:
    """``T = a + b; S = self.M(self.N(T))`` at ``body[i]``: (N, its replacement)."""
    first = _assign(body[i])
    second = _assign(body[i + 1]) if i + 1 < len(body) else None
    outer = _self_call(second[1], self_name) if second else None
    inner = _self_call(outer[1], self_name) if outer else None
    if not (inner and inner[0] in norms and _name(inner[1], first[0])):
        return None
    add = first[1]
    fused = ast.Assign([_pair(NORMED, first[0])],
                       _call(inner[0], add.left, add.right, self_name))
    body[i + 1].value.args[0] = ast.Name(NORMED, ast.Load())
    return inner[0], [_located(fused, body[i]), body[i + 1]]


def _rewrite_block(body: list[ast.stmt], norms: tuple[str, ...], self_name: str,
                   found: list[str]) -> list[ast.stmt]:
    """``body`` with each add-then-norm replaced (in ``if`` branches too); the norms
    replaced are appended to ``found``."""
    out: list[ast.stmt] = []
    i = 0
    while i < len(body):
        stmt = body[i]
        first = _assign(stmt)
        if first and isinstance(first[1], ast.BinOp) and isinstance(first[1].op, ast.Add):
            for shape, length in ((_stream, 3), (_nested, 2)):
                match = shape(body, i, norms, self_name)
                if match:
                    found.append(match[0])
                    out.extend(match[1])
                    i += length
                    break
            else:
                out.append(stmt)
                i += 1
            continue
        if isinstance(stmt, ast.If):
            stmt.body = _rewrite_block(stmt.body, norms, self_name, found)
            stmt.orelse = _rewrite_block(stmt.orelse, norms, self_name, found)
        out.append(stmt)
        i += 1
    return out


def _parse(func: types.FunctionType) -> ast.FunctionDef:
    if func.__code__.co_freevars:
        raise Unsupported(f"{func.__qualname__} uses enclosing variables "
                          f"{func.__code__.co_freevars}")
    tree = ast.parse(source(func))
    fdef = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fdef, ast.FunctionDef) or not fdef.args.args:
        raise Unsupported(f"the source of {func.__qualname__} is not one method definition")
    taken = {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)}
    if taken & set(_INSERTED):
        raise Unsupported(f"{func.__qualname__} already uses the names tilenorm inserts")
    return fdef


def _fuse_within(func: types.FunctionType, fdef: ast.FunctionDef,
                 norms: tuple[str, ...]) -> None:
    found: list[str] = []
    fdef.body = _rewrite_block(fdef.body, norms, fdef.args.args[0].arg, found)
    if sorted(found) != sorted(norms):
        raise Unsupported(f"{func.__qualname__}: expected an add followed by "
                          f"{', '.join(norms)}; found {', '.join(found) or 'none'}")


def _compile(func: types.FunctionType, fdef: ast.FunctionDef, what: str,
             **names: Callable) -> types.FunctionType:
    """``fdef`` compiled against ``func``'s globals, ``names`` bound in a closure, its
    docstring-only decorators replaced by one that gives it ``func``'s docstring."""
    doc = func.__doc__

    def docstring(f):
        f.__doc__ = doc
        return f

    for i, node in enumerate(fdef.decorator_list):
        if _decorator_name(node) in _DOCSTRING_ONLY:
            fdef.decorator_list[i] = ast.Name(_DOCSTRING, ast.Load())
    names[_DOCSTRING] = docstring
    maker = ast.FunctionDef(
        name=_MAKER,
        args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in names], vararg=None,
                           kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[fdef, ast.Return(ast.Name(fdef.name, ast.Load()))], decorator_list=[],
        returns=None, type_comment=None, **({"type_params": []}
                                            if "type_params" in ast.FunctionDef._fields
                                            else {}))
    fused_text = ast.unparse(ast.fix_missing_locations(ast.Module([maker], type_ignores=[])))
    filename = f"<tilenorm {what} {func.__module__}.{func.__qualname__}>"
    flags = func.__code__.co_flags & __future__.annotations.compiler_flag
    code = compile(fused_text, filename, "exec", flags=flags, dont_inherit=True)
    linecache.cache[filename] = (len(fused_text), None, fused_text.splitlines(True), filename)
    maker_code = next(c for c in code.co_consts
                      if isinstance(c, types.CodeType) and c.co_name == _MAKER)
    fused = types.FunctionType(maker_code, func.__globals__, _MAKER)(*names.values())
    fused.__module__ = func.__module__
    fused.__qualname__ = func.__qualname__
    return fused


def fuse(func: types.FunctionType, norms: tuple[str, ...],
         add_norm: Callable) -> types.FunctionType:
    """``func`` (an undecorated forward; its own decorators are in its source and are applied
    again) with each add followed by a norm in ``norms`` replaced by ``add_norm``.

    Raises :class:`Unsupported` unless exactly the norms in ``norms`` are found, each once.
    """
    fdef = _parse(func)
    _fuse_within(func, fdef, norms)
    return _compile(func, fdef, "fused", **{ADD_NORM: add_norm})


def _stores(fdef: ast.FunctionDef, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(fdef)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)]


def fuse_across(func: types.FunctionType, norms: tuple[str, ...], entry: str,
                add_norm: Callable) -> types.FunctionType:
    """The forward of a layer inside a model loop that carries (output, residual) pairs:
    ``func`` fused as :func:`fuse` does, taking the residual stream as its second positional
    argument (None: the first layer), its input norm ``entry`` fused with the add that ended
    the previous layer, and returning the pair it would have added (module docstring).

    Raises :class:`Unsupported` unless the forward opens with ``R = P; P = self.entry(P)``,
    ends with ``T = R + T; return T``, and assigns R only there and in one fused add-norm.
    """
    fdef = _parse(func)
    _fuse_within(func, fdef, norms)
    self_name, params = fdef.args.args[0].arg, fdef.args.args
    body = fdef.body
    stream = params[1].arg if len(params) > 1 else None
    first, second = (_assign(s) for s in body[:2]) if len(body) > 3 else (None, None)
    call = _self_call(second[1], self_name) if second else None
    if not (first and _name(first[1], stream) and first[0] != stream and second[0] == stream
            and call and call[0] == entry and _name(call[1], stream)):
        raise Unsupported(f"{func.__qualname__}: expected `residual = {stream}` and "
                          f"`{stream} = self.{entry}({stream})` to open it")
    residual = first[0]
    last, ret = _assign(body[-2]), body[-1]
    add = last[1] if last else None
    if not (isinstance(add, ast.BinOp) and isinstance(add.op, ast.Add)
            and {_name(add.left), _name(add.right)} == {residual, last[0]}
            and isinstance(ret, ast.Return) and _name(ret.value, last[0])):
        raise Unsupported(f"{func.__qualname__}: expected it to end by returning the sum "
                          f"of {residual} and the MLP's output")
    fused_stores = [t for s in body if isinstance(s, ast.Assign)
                    and isinstance(s.value, ast.Call) and _name(s.value.func, ADD_NORM)
                    for t in ast.walk(s.targets[0]) if _name(t, residual)]
    if len(_stores(fdef, residual)) != 2 or len(fused_stores) != 1:
        raise Unsupported(f"{func.__qualname__}: {residual} is assigned other than where "
                          f"the layer opens and in one fused add-norm")
    opening = ast.Assign([_pair(stream, residual)],
                         _call(entry, ast.Name(RESIDUAL, ast.Load()),
                               ast.Name(stream, ast.Load()), self_name))
    closing = ast.Return(ast.Tuple([ast.Name(last[0], ast.Load()),
                                    ast.Name(residual, ast.Load())], ast.Load()))
    fdef.body = [_located(opening, body[0]), *body[2:-2],
                 ast.fix_missing_locations(ast.copy_location(closing, ret))]
    params.insert(2, ast.arg(RESIDUAL))
    return _compile(func, fdef, "fused across layers", **{ADD_NORM: add_norm})


def _layer_loop(body: list[ast.stmt], self_name: str) -> tuple[int, str, str] | None:
    """``for L in ...: T = L(T, **kw)`` then ``T = self.N(T)`` in ``body``: (index of the
    loop, T, N)."""
    for i, stmt in enumerate(body[:-1]):
        if not (isinstance(stmt, ast.For) and len(stmt.body) == 1 and not stmt.orelse):
            continue
        target = stmt.target
        if isinstance(target, ast.Tuple) and len(target.elts) == 2:
            target = target.elts[1]
        layer, assign, after = _name(target), _assign(stmt.body[0]), _assign(body[i + 1])
        call = assign[1] if assign else None
        if not (layer and isinstance(call, ast.Call) and _name(call.func, layer)
                and len(call.args) == 1 and _name(call.args[0], assign[0])
                and all(k.arg != ACROSS for k in call.keywords)):
            continue
        norm = _self_call(after[1], self_name) if after else None
        if norm and after[0] == assign[0] and _name(norm[1], assign[0]):
            return i, assign[0], norm[0]
    return None


def _layers_of(loop: ast.For, self_name: str) -> ast.expr | None:
    """The ``self.layers[...]`` a loop iterates over (itself, or through ``enumerate``)."""
    it = loop.iter
    if (isinstance(it, ast.Call) and _name(it.func, "enumerate") and len(it.args) == 1
            and not it.keywords):
        it = it.args[0]
    if (isinstance(it, ast.Subscript) and isinstance(it.value, ast.Attribute)
            and _name(it.value.value, self_name) and it.value.attr == "layers"):
        return it
    return None


def loop_across(func: types.FunctionType, add_norm: Callable,
                across: Callable) -> types.FunctionType:
    """A model's forward whose layer loop carries (output, residual) pairs when
    ``across(self, layers)`` says so for the call, and ends with the final norm's fused add
    (module docstring); as written otherwise.

    Raises :class:`Unsupported` unless the forward has one loop over ``self.layers[...]`` whose
    body is one call of the layer on the hidden state, followed by the final norm of it.
    """
    fdef = _parse(func)
    self_name = fdef.args.args[0].arg
    found = _layer_loop(fdef.body, self_name)
    layers = _layers_of(fdef.body[found[0]], self_name) if found else None
    if layers is None:
        raise Unsupported(f"{func.__qualname__}: expected a loop over self.layers calling "
                          f"each layer on the hidden state, then the final norm of it")
    i, stream, norm = found
    loop, after = fdef.body[i], fdef.body[i + 1]
    paired = copy.deepcopy(loop)
    call = paired.body[0].value
    call.args.append(ast.Name(RESIDUAL, ast.Load()))
    call.keywords.append(ast.keyword(ACROSS, ast.Constant(True)))
    paired.body[0].targets = [_pair(stream, RESIDUAL)]
    start = ast.Assign([ast.Name(RESIDUAL, ast.Store())], ast.Constant(None))
    final = ast.Assign([ast.Name(stream, ast.Store())], ast.Subscript(
        _call(norm, ast.Name(RESIDUAL, ast.Load()), ast.Name(stream, ast.Load()), self_name),
        ast.Constant(0), ast.Load()))
    check = ast.Call(ast.Name(ACROSS_CHECK, ast.Load()),
                     [ast.Name(self_name, ast.Load()), copy.deepcopy(layers)], [])
    branch = ast.If(check, [_located(start, loop), paired, _located(final, after)],
                    [loop, after])
    fdef.body[i:i + 2] = [ast.fix_missing_locations(ast.copy_location(branch, loop))]
    return _compile(func, fdef, "fused across layers",
                    **{ADD_NORM: add_norm, ACROSS_CHECK: across})
