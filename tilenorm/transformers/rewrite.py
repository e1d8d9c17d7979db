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

The caller checks the source's digest against the forwards read and verified for each
transformers version (:mod:`tilenorm.transformers.families`) before using the result.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import inspect
import linecache
import textwrap
import types
from collections.abc import Callable

ADD_NORM = "_tilenorm_add_norm"
NORMED = "_tilenorm_normed"
_MAKER = "_tilenorm_make_forward"


class Unsupported(Exception):
    """The forward is not one this module can rewrite; the message says why."""


def source(func: Callable) -> str:
    """The dedented source of ``func`` (decorators included), as ``inspect`` reads it."""
    try:
        return textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as e:
        raise Unsupported(f"the source of {func.__qualname__} cannot be read ({e})") from None


def decorators(func: Callable) -> int:
    """How many decorators ``func``'s source applies."""
    tree = ast.parse(source(func))
    return len(tree.body[0].decorator_list) if tree.body else 0


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


def fuse(func: types.FunctionType, norms: tuple[str, ...],
         add_norm: Callable) -> types.FunctionType:
    """``func`` (an undecorated forward; its own decorators are in its source and are applied
    again) with each add followed by a norm in ``norms`` replaced by ``add_norm``.

    Raises :class:`Unsupported` unless exactly the norms in ``norms`` are found, each once.
    """
    if func.__code__.co_freevars:
        raise Unsupported(f"{func.__qualname__} uses enclosing variables "
                          f"{func.__code__.co_freevars}")
    text = source(func)
    tree = ast.parse(text)
    fdef = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fdef, ast.FunctionDef) or not fdef.args.args:
        raise Unsupported(f"the source of {func.__qualname__} is not one method definition")
    taken = {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)}
    if taken & {ADD_NORM, NORMED}:
        raise Unsupported(f"{func.__qualname__} already uses the names tilenorm inserts")
    found: list[str] = []
    fdef.body = _rewrite_block(fdef.body, norms, fdef.args.args[0].arg, found)
    if sorted(found) != sorted(norms):
        raise Unsupported(f"{func.__qualname__}: expected an add followed by "
                          f"{', '.join(norms)}; found {', '.join(found) or 'none'}")
    maker = ast.FunctionDef(
        name=_MAKER,
        args=ast.arguments(posonlyargs=[], args=[ast.arg(ADD_NORM)], vararg=None,
                           kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[fdef, ast.Return(ast.Name(fdef.name, ast.Load()))], decorator_list=[],
        returns=None, type_comment=None, **({"type_params": []}
                                            if "type_params" in ast.FunctionDef._fields
                                            else {}))
    fused_text = ast.unparse(ast.fix_missing_locations(ast.Module([maker], type_ignores=[])))
    filename = f"<tilenorm fused {func.__module__}.{func.__qualname__}>"
    flags = func.__code__.co_flags & __future__.annotations.compiler_flag
    code = compile(fused_text, filename, "exec", flags=flags, dont_inherit=True)
    linecache.cache[filename] = (len(fused_text), None, fused_text.splitlines(True), filename)
    maker_code = next(c for c in code.co_consts
                      if isinstance(c, types.CodeType) and c.co_name == _MAKER)
    fused = types.FunctionType(maker_code, func.__globals__, _MAKER)(add_norm)
    fused.__module__ = func.__module__
    fused.__qualname__ = func.__qualname__
    return fused
