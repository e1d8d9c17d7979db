"""Patching models and classes: each patched module's class becomes a subclass of its own
class, created once per class, whose ``forward`` is tilenorm's (a norm) or the fused rewrite
of the installed forward (a decoder layer).

A subclass rather than a ``forward`` set on the instance: transformers 5.23 wraps a
``GradientCheckpointingLayer``'s ``forward`` for activation checkpointing when the class is
created (``__init_subclass__``), which an instance attribute would bypass and a subclass gets
again; and :func:`reset` only has to put each module's class back. The subclass keeps the
original's name, so ``_no_split_modules``, ``isinstance`` checks, parameters and
``state_dict`` keys are unchanged.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from tilenorm.transformers import norms, rewrite
from tilenorm.transformers.families import (
    ACROSS_LAYERS,
    FAMILIES,
    NEOX_PARALLEL,
    NORM_SOURCES,
    Family,
)
from tilenorm.transformers.report import Report

_ORIGINAL = "_tilenorm_original"
_PER_HEAD_NAMES = ("q_norm", "k_norm")


def original_class(cls: type) -> type:
    """The transformers (or torch) class that ``cls`` patches, or ``cls`` itself."""
    return cls.__dict__.get(_ORIGINAL, cls)


def _subclass(cls: type, forward: Callable) -> type:
    return type(cls.__name__, (cls,), {
        "forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__, _ORIGINAL: cls})


@dataclass(frozen=True)
class _Norm:
    """A norm class as verified: its kind and tilenorm subclass, or why not."""

    original: type
    kind: norms.NormKind | None = None
    patched: type | None = None
    reason: str = ""

    @property
    def classes(self) -> tuple[type, ...]:
        return (self.original,) if self.patched is None else (self.original, self.patched)


_norm_cache: dict[tuple, _Norm] = {}
_layer_cache: dict[tuple, type | str] = {}


def _norm_class(cls: type) -> _Norm:
    """Verify a norm class (by its forward's source) and make its tilenorm subclass."""
    methods = tuple(cls.__dict__.get(name) for name in ("forward", "_norm"))
    key = (cls, *methods)
    if key in _norm_cache:
        return _norm_cache[key]
    if cls is torch.nn.LayerNorm:
        kind: norms.NormKind | None = norms.LAYER_NORM
        reason = ""
    elif any(hasattr(f, "__wrapped__") for f in methods):
        kind, reason = None, f"{cls.__qualname__}.forward is wrapped (the wrapper would be lost)"
    else:
        try:
            text = "".join(rewrite.source(f) for f in methods if f is not None)
            digest = rewrite.digest(text)
            kind = NORM_SOURCES[digest][0] if digest in NORM_SOURCES else None
            reason = "" if kind else (
                f"{cls.__qualname__}.forward (source digest {digest}) is not a norm verified "
                f"for tilenorm (transformers {transformers.__version__})")
        except rewrite.Unsupported as e:
            kind, reason = None, str(e)
    found = _Norm(cls, kind, _subclass(cls, kind.forward) if kind else None, reason)
    _norm_cache[key] = found
    return found


def _is_checkpoint_wrapper(func: Callable) -> bool:
    """Whether ``func`` is the wrapper transformers >= 5.23 puts around each
    ``GradientCheckpointingLayer`` subclass's forward (and puts around a tilenorm subclass's
    too). ``functools.wraps`` gives it the wrapped function's names; its code keeps its own."""
    code = getattr(func, "__code__", None)
    layers = sys.modules.get("transformers.modeling_layers")
    return (code is not None and layers is not None
            and code.co_name == "forward_with_checkpointing"
            and code.co_filename == getattr(layers, "__file__", None))


def _unwrapped(forward: Callable) -> Callable:
    """The forward as written, below transformers' checkpointing wrapper; raise
    :class:`rewrite.Unsupported` if any other wrapper is not one of its source's decorators
    (a wrapper the fused forward would lose)."""
    wrappers, inner = [], forward
    while hasattr(inner, "__wrapped__"):
        if not _is_checkpoint_wrapper(inner):
            wrappers.append(inner)
        inner = inner.__wrapped__
    if not inspect.isfunction(inner) or len(wrappers) != rewrite.decorators(inner):
        raise rewrite.Unsupported(f"{inner.__qualname__} is wrapped by something that is not "
                                  f"in its source")
    return inner


def _layer_class(family: Family, cls: type, norm: _Norm) -> type | str:
    """The fused subclass of a decoder layer class, or why there is none."""
    forward = cls.__dict__.get("forward")
    key = (cls, forward, norm)
    if key in _layer_cache:
        return _layer_cache[key]
    if norm.kind is None:
        found: type | str = f"its norm class is not verified: {norm.reason}"
    elif forward is None:
        found = f"{cls.__qualname__} does not define forward itself"
    else:
        try:
            inner = _unwrapped(forward)
            digest = rewrite.digest(rewrite.source(inner))
            if digest not in family.layers:
                raise rewrite.Unsupported(
                    f"{cls.__qualname__}.forward (source digest {digest}) is not one verified "
                    f"for tilenorm (transformers {transformers.__version__}; verified: "
                    f"{', '.join(sorted(set(family.layers.values())))})")
            add_norm = norms.make_add_norm(norm.kind, norm.classes)
            found = _subclass(cls, rewrite.fuse(inner, family.fused, add_norm))
        except rewrite.Unsupported as e:
            found = str(e)
    _layer_cache[key] = found
    return found


def _family_classes(family: Family) -> tuple[type, _Norm] | None:
    """The family's original layer class and verified norm class, from its modeling module
    when that is imported (None otherwise: no model of the family exists yet)."""
    module = sys.modules.get(family.module)
    if module is None:
        return None
    layer = original_class(getattr(module, family.layer))
    norm = torch.nn.LayerNorm if family.norm is None else getattr(module, family.norm)
    return layer, _norm_class(original_class(norm))


def _index() -> dict[type, tuple[Family, str]]:
    """Original class -> (family, "layer" or "norm") for the imported families."""
    found: dict[type, tuple[Family, str]] = {}
    for family in FAMILIES.values():
        classes = _family_classes(family)
        if classes is not None:
            found[classes[0]] = (family, "layer")
            if family.norm is not None:
                found[classes[1].original] = (family, "norm")
    return found


def _family_of(module: torch.nn.Module, parent: torch.nn.Module | None,
               index: dict[type, tuple[Family, str]]) -> tuple[Family, str] | None:
    """(family, "layer" or "norm") of a module, or None. A ``torch.nn.LayerNorm`` is a norm
    of the family (with ``norm=None``) whose modeling module defines its parent."""
    cls = original_class(type(module))
    if cls is torch.nn.LayerNorm and parent is not None:
        owner = original_class(type(parent)).__module__
        return next(((f, "norm") for f in FAMILIES.values()
                     if f.norm is None and f.module == owner), None)
    return index.get(cls)


def _subclassed(module: torch.nn.Module, index: dict[type, tuple[Family, str]]) -> type | None:
    """The family class that ``module``'s class derives from without being it (a class
    FSDP2 or another library made), or None."""
    return next((c for c in type(module).__mro__[1:] if c in index), None)


def _patch_norm(report: Report, path: str, name: str, module: torch.nn.Module,
                parent: torch.nn.Module | None) -> None:
    weight = getattr(module, "weight", None)
    per_head = (name in _PER_HEAD_NAMES and weight is not None and parent is not None
                and getattr(parent, "head_dim", None) == weight.shape[-1])
    what = "per-head norm" if per_head else "norm"
    cls = type(module)
    if original_class(cls) is not cls:
        pass  # patched already (by apply or a class-level patch)
    elif "forward" in module.__dict__:
        return report.skip(path, what, "its forward is replaced on the instance (hooks of "
                                       "another library?)")
    else:
        norm = _norm_class(cls)
        if norm.patched is None:
            return report.skip(path, what, norm.reason)
        module.__class__ = norm.patched
    if per_head:
        report.per_head_norms += 1
        report.note("per-head q/k norms run the family's own forward inside a graph "
                    "torch.compile traces, where inductor fuses them with RoPE")
    else:
        report.norm_modules += 1


def _patch_layer(report: Report, path: str, layer: torch.nn.Module, family: Family) -> None:
    if not family.fused:
        return report.skip(path, "residual fusion", family.no_fusion, expected=True)
    if getattr(layer, "use_parallel_residual", False):
        return report.skip(path, "residual fusion", NEOX_PARALLEL, expected=True)
    cls = type(layer)
    if original_class(cls) is cls:
        if "forward" in layer.__dict__:
            return report.skip(path, "residual fusion", "its forward is replaced on the "
                                                        "instance (hooks of another library?)")
        _, norm = _family_classes(family)
        for name in family.fused:
            child = getattr(layer, name, None)
            if child is None or original_class(type(child)) is not norm.original:
                return report.skip(path, "residual fusion",
                                   f"{name} is a {type(child).__name__}, not "
                                   f"{norm.original.__name__}")
        patched = _layer_class(family, cls, norm)
        if isinstance(patched, str):
            return report.skip(path, "residual fusion", patched)
        layer.__class__ = patched
    report.fused_layers += 1
    report.note(ACROSS_LAYERS)


def apply(model: torch.nn.Module, *, norms: bool = True, residual: bool = True) -> Report:
    """Make a built transformers model compute its norms with tilenorm, in place.

    Args:
        model: any ``torch.nn.Module`` holding a supported family's modules: a
            ``*ForCausalLM``, its base model, a PEFT wrapper, a multimodal model around a
            supported text model. Modules of other families are left alone.
        norms: every norm module of a supported family runs tilenorm with the family's
            semantics (dtype rules, Gemma's ``1 + w``), per-head q/k norms included.
        residual: decoder layers whose residual add feeds a norm do both in one tilenorm call
            (``h = residual + out`` then ``norm(h)``), through a forward rewritten from the
            installed transformers' own source and used only where that source was verified.

    Returns:
        A :class:`Report`; ``print`` it. Nothing is raised for what cannot be patched: it is
        skipped, listed in the report, and a warning says so (and when no supported family
        is found). :func:`reset` restores the model. ``copy.deepcopy`` keeps the patches;
        pickling a whole patched model (``torch.save(model)``) needs :func:`reset` first, as
        the patched classes are not importable (``state_dict`` is unaffected).
    """
    report = Report(type(model).__name__)
    index = _index()
    parents: dict[int, tuple[str, torch.nn.Module]] = {}
    for module in model.modules():
        for name, child in module.named_children():
            parents.setdefault(id(child), (name, module))
    for path, module in model.named_modules():
        name, parent = parents.get(id(module), ("", None))
        entry = _family_of(module, parent, index)
        if entry is None:
            base = _subclassed(module, index)
            if base is not None:
                report.skip(path, index[base][1], f"its class {type(module).__name__} "
                            f"derives from {base.__name__} without being it (a wrapper class "
                            f"such as FSDP2's: apply tilenorm before wrapping)")
            elif "Norm" in type(module).__name__:
                report.skip(path, "norm", f"{type(module).__name__} is not a norm of a "
                                          f"supported family", expected=True)
            continue
        family, role = entry
        if family.title not in report.families:
            report.families.append(family.title)
        # what is patched already is counted whatever the flags: apply never unpatches
        patched = original_class(type(module)) is not type(module)
        if role == "norm" and (norms or patched):
            _patch_norm(report, path, name, module, parent)
        elif role == "layer" and (residual or patched):
            _patch_layer(report, path, module, family)
    if not report.families:
        warnings.warn(f"tilenorm.transformers.apply: no supported model family in "
                      f"{type(model).__name__}; nothing was patched "
                      f"(supported: {', '.join(FAMILIES)}).\n{report}", stacklevel=2)
    elif report.refused:
        warnings.warn(f"tilenorm.transformers.apply: {len(report.refused)} modules of "
                      f"{type(model).__name__} were left unpatched.\n{report}", stacklevel=2)
    return report


def reset(model: torch.nn.Module) -> None:
    """Put every module of ``model`` patched by :func:`apply` (or built from classes patched
    by :func:`apply_to`) back to its transformers class. Parameters, buffers and the state
    dict are the same objects throughout; only the modules' classes change."""
    for module in model.modules():
        original = type(module).__dict__.get(_ORIGINAL)
        if original is not None:
            module.__class__ = original


#: (modeling module, class name) -> the class there before apply_to.
_class_patches: dict[tuple[str, str], type] = {}


def _replace(module, name: str, cls: type, report: Report) -> None:
    _class_patches.setdefault((module.__name__, name), getattr(module, name))
    setattr(module, name, cls)
    report.classes.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}")


def apply_to(family: str, *, norms: bool = True, residual: bool = True) -> Report:
    """Patch a family's classes in its modeling module, so that models built afterwards
    (``from_pretrained``, ``from_config``) compute with tilenorm from the start.

    The modeling module's names for the norm class and the decoder layer class are replaced
    by the same tilenorm subclasses :func:`apply` uses; models built before are unaffected
    (:func:`apply` them). :func:`reset_classes` restores the module; :func:`reset` restores
    a model built in between. GPT-NeoX's norms are ``torch.nn.LayerNorm`` itself, which is
    not replaced process-wide: only its layers are patched here, :func:`apply` does the norms.

    Args:
        family: one of :data:`FAMILIES` (``"llama"``, ``"qwen3"``, ``"gemma3"``, ...).
        norms, residual: as in :func:`apply`.
    """
    if family not in FAMILIES:
        raise ValueError(f"apply_to: unknown family {family!r}; supported: "
                         f"{', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    module = importlib.import_module(spec.module)
    report = Report(spec.module, [spec.title])
    layer, norm = _family_classes(spec)
    if norms:
        if spec.norm is None:
            report.skip(f"{spec.module}", "norm class", "the norms are torch.nn.LayerNorm; "
                        "apply(model) patches a built model's", expected=True)
        elif norm.patched is None:
            report.skip(f"{spec.module}.{spec.norm}", "norm class", norm.reason)
        else:
            _replace(module, spec.norm, norm.patched, report)
    if residual:
        patched = _layer_class(spec, layer, norm) if spec.fused else spec.no_fusion
        if isinstance(patched, str):
            report.skip(f"{spec.module}.{spec.layer}", "layer class", patched,
                        expected=not spec.fused)
        else:
            _replace(module, spec.layer, patched, report)
            report.note(ACROSS_LAYERS)
    if report.refused:
        warnings.warn(f"tilenorm.transformers.apply_to: not everything was patched.\n{report}",
                      stacklevel=2)
    return report


def reset_classes() -> None:
    """Undo every :func:`apply_to`: the modeling modules get their classes back."""
    for (name, attr), cls in _class_patches.items():
        setattr(sys.modules[name], attr, cls)
    _class_patches.clear()
