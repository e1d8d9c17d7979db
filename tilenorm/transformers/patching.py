"""Patching models and classes: each patched module's class becomes a subclass of its own
class, created once per class, whose ``forward`` is tilenorm's (a norm) or the fused rewrite
of the installed forward (a decoder layer).

For the Llama-shaped families on the transformers versions verified, the base model class is
patched too: its loop over the layers carries (output, residual) pairs, so that the add ending
each layer is fused with the next layer's input norm and the last with the final norm
(:func:`tilenorm.transformers.rewrite.loop_across`). A layer then returns the pair, which
nothing else may see: each call checks (:func:`_across_check`) that no hook observes a layer
and no hidden state is recorded, and computes as written otherwise.

A subclass rather than a ``forward`` set on the instance: transformers 5.23 wraps a
``GradientCheckpointingLayer``'s ``forward`` for activation checkpointing when the class is
created (``__init_subclass__``), which an instance attribute would bypass and a subclass gets
again; and :func:`reset` only has to put each module's class back. The subclass keeps the
original's name, so ``_no_split_modules``, ``isinstance`` checks, parameters and
``state_dict`` keys are unchanged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import transformers

from tilenorm.transformers import norms, rewrite
from tilenorm.transformers.families import (
    ACROSS_LAYERS,
    ACROSS_LAYERS_PER_CALL,
    FAMILIES,
    NEOX_PARALLEL,
    NORM_SOURCES,
    Family,
)
from tilenorm.transformers.report import Report

_ORIGINAL = "_tilenorm_original"
#: Marks a decoder-layer class whose forward takes and returns (output, residual) pairs when
#: a patched model's loop asks (the keyword argument rewrite.ACROSS).
_PAIRS = "_tilenorm_pairs"
_PER_HEAD_NAMES = ("q_norm", "k_norm")
#: What a model records from its decoder layers' outputs (``_can_record_outputs``).
_HIDDEN_STATES = "hidden_states"


def original_class(cls: type) -> type:
    """The transformers (or torch) class that ``cls`` patches, or ``cls`` itself."""
    return cls.__dict__.get(_ORIGINAL, cls)


_tokens = itertools.count()


def _subclass(cls: type, forward: Callable, **markers: bool) -> type:
    """The tilenorm subclass of ``cls`` with ``forward``. It has its own string as
    :data:`norms.EXACT`, and ``markers`` (what the class itself can do, such as :data:`_PAIRS`);
    a class derived from it afterwards (a user's subclass, FSDP2's wrapper class) gets None for
    the first in its own ``__dict__`` and False for the markers it does not set itself, so
    that exact-class checks can read them through an instance, which torch.compile resolves
    from the guard it has on the instance's type (``type(module).__dict__`` in traced code
    adds a guard that each module's class is the others')."""

    def __init_subclass__(sub: type, **kwargs) -> None:
        super(patched, sub).__init_subclass__(**kwargs)
        setattr(sub, norms.EXACT, None)
        for name in markers:
            if name not in sub.__dict__:
                setattr(sub, name, False)

    token = f"{cls.__module__}.{cls.__qualname__}#{next(_tokens)}"
    patched = type(cls.__name__, (cls,), {
        "forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__, _ORIGINAL: cls, norms.EXACT: token,
        "__init_subclass__": __init_subclass__, **markers})
    return patched


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
_model_cache: dict[tuple, type | str] = {}


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
    found = _Norm(cls, kind, _subclass(cls, kind.forward_of(cls)) if kind else None, reason)
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


def _verified(cls: type, forward: Callable, verified: Mapping[str, str], what: str
              ) -> tuple[types.FunctionType, str]:
    """``forward`` as written and its source digest; raise :class:`rewrite.Unsupported` unless
    the digest is one of ``verified`` (for ``what``)."""
    inner = _unwrapped(forward)
    digest = rewrite.digest(rewrite.source(inner))
    if digest not in verified:
        raise rewrite.Unsupported(
            f"{cls.__qualname__}.forward (source digest {digest}) is not one verified for "
            f"{what} (transformers {transformers.__version__}; verified: "
            f"{', '.join(sorted(set(verified.values())))})")
    return inner, digest


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
            inner, digest = _verified(cls, forward, family.layers, "tilenorm")
            add_norm = norms.make_add_norm(norm.kind, norm.classes)
            within = rewrite.fuse(inner, family.fused, add_norm)
            if digest in family.layers_across:
                across = rewrite.fuse_across(inner, family.fused, family.entry, add_norm)
                found = _subclass(cls, _pairs_forward(within, across), **{_PAIRS: True})
            else:
                found = _subclass(cls, within)
        except rewrite.Unsupported as e:
            found = str(e)
    _layer_cache[key] = found
    return found


def _pairs_forward(within: Callable, across: Callable) -> Callable:
    """A layer's forward: ``within`` (the fused layer, signature and result as written) unless
    a patched model's loop passes ``_tilenorm_across=True`` with the residual as the second
    positional argument, then ``across``, which returns (output, residual)."""

    @functools.wraps(within)
    def forward(self, *args, _tilenorm_across: bool = False, **kwargs):
        return (across if _tilenorm_across else within)(self, *args, **kwargs)

    return forward


def _capture_hook_code() -> types.CodeType | None:
    """The code of the forward hook transformers (5.x) installs on decoder layers to record
    hidden states (``output_capturing_hook``), or None."""
    module = sys.modules.get("transformers.utils.output_capturing")
    install = getattr(getattr(module, "install_output_capuring_hook", None), "__code__", None)
    return next((c for c in getattr(install, "co_consts", ()) if isinstance(c, types.CodeType)
                 and c.co_name == "output_capturing_hook"), None)


def _across_check(capture: types.CodeType | None, collector, layer_class: type
                  ) -> Callable[..., bool]:
    """The per-call check of a patched model's forward: whether its layers may exchange
    (output, residual) pairs. Not when a layer's output or input is observed: hooks on a
    layer (transformers' hidden-state recorder, ``capture``, excepted: it records only while
    ``collector`` holds a hidden-state list, and then the call computes as written), global
    hooks, a forward replaced on the instance, or a layer that is not a pairs-capable class
    itself (a subclass made after patching, a wrapper such as a checkpoint wrapper).

    A pairs-capable class is a tilenorm subclass of ``layer_class`` marked :data:`_PAIRS`
    (False in a class derived from it afterwards, see :func:`_subclass`), read through the
    layer; the instance check first, as a wrapper's ``__getattr__`` may forward the marker of
    the layer it wraps."""
    any_global_hook = norms.any_global_hook

    def across_layers(model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> bool:
        if any_global_hook():
            return False
        recording = collector.get()
        if recording is not None and _HIDDEN_STATES in recording:
            return False
        for layer in layers:
            if (not (isinstance(layer, layer_class) and getattr(layer, _PAIRS, False))
                    or layer._forward_pre_hooks or layer._backward_hooks
                    or layer._backward_pre_hooks or "forward" in layer.__dict__):
                return False
            for hook in layer._forward_hooks.values():
                if capture is None or getattr(hook, "__code__", None) is not capture:
                    return False
        return True

    return across_layers


def _records_only_hidden_states(cls: type, layer: type) -> bool:
    """Whether ``cls._can_record_outputs`` records nothing but hidden states from ``layer``:
    the one record the per-call check knows to be inactive."""
    for key, specs in (getattr(cls, "_can_record_outputs", None) or {}).items():
        for spec in specs if isinstance(specs, list) else [specs]:
            target = getattr(spec, "target_class", spec)
            named = isinstance(spec, str) or getattr(spec, "class_name", None) is not None
            hits = named or (isinstance(target, type) and issubclass(layer, target))
            if hits and key != _HIDDEN_STATES:
                return False
    return True


def _model_class(family: Family, cls: type, layer: type, norm: _Norm) -> type | str:
    """The subclass of a base model class whose loop carries (output, residual) pairs, or why
    there is none."""
    forward = cls.__dict__.get("forward")
    key = (cls, forward, layer, norm)
    if key in _model_cache:
        return _model_cache[key]
    collector = getattr(sys.modules.get("transformers.utils.output_capturing"),
                        "_active_collector", None)
    if norm.kind is None:
        found: type | str = f"its norm class is not verified: {norm.reason}"
    elif forward is None:
        found = f"{cls.__qualname__} does not define forward itself"
    elif collector is None:
        found = ("transformers.utils.output_capturing._active_collector is missing: whether "
                 "a call records hidden states cannot be told")
    elif not _records_only_hidden_states(cls, layer):
        found = (f"{cls.__qualname__} records outputs other than hidden states from its "
                 f"layers")
    else:
        try:
            inner, _ = _verified(cls, forward, family.models, "fusion across layers "
                                 "(each layer's last add stays a separate add)")
            add_norm = norms.make_add_norm(norm.kind, norm.classes)
            check = _across_check(_capture_hook_code(), collector, layer)
            found = _subclass(cls, rewrite.loop_across(inner, add_norm, check))
        except rewrite.Unsupported as e:
            found = str(e)
    _model_cache[key] = found
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


def _model_of(family: Family) -> type | None:
    """The family's original base model class, if it can fuse across layers."""
    module = sys.modules.get(family.module)
    if module is None or family.model is None:
        return None
    return original_class(getattr(module, family.model))


def _index() -> dict[type, tuple[Family, str]]:
    """Original class -> (family, "layer", "norm" or "model") for the imported families."""
    found: dict[type, tuple[Family, str]] = {}
    for family in FAMILIES.values():
        classes = _family_classes(family)
        if classes is not None:
            found[classes[0]] = (family, "layer")
            if family.norm is not None:
                found[classes[1].original] = (family, "norm")
            model = _model_of(family)
            if model is not None:
                found[model] = (family, "model")
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


def _patch_model(report: Report, path: str, model: torch.nn.Module, family: Family) -> int:
    """Make a base model's loop carry (output, residual) pairs; the number of its layers
    whose adds are fused across layers."""
    what = "fusion across layers"
    layers = list(model.layers[:getattr(model.config, "num_hidden_layers", None)])
    cls = type(model)
    layer, norm = _family_classes(family)
    if not all(type(m).__dict__.get(_PAIRS, False) for m in layers):
        reason = (f"the decoder layers are not all patched with a forward verified for it "
                  f"(transformers {transformers.__version__}; verified: "
                  f"{', '.join(sorted(set(family.layers_across.values())))})")
        report.skip(path, what, reason, expected=True)
        return 0
    if original_class(cls) is cls:
        if "forward" in model.__dict__:
            report.skip(path, what, "its forward is replaced on the instance")
            return 0
        patched = _model_class(family, cls, layer, norm)
        if isinstance(patched, str):
            report.skip(path, what, patched, expected=True)
            return 0
        model.__class__ = patched
    fed = [getattr(m, family.entry, None) for m in layers[1:]] + [getattr(model, "norm", None)]
    report.fused_across += sum(n is not None and original_class(type(n)) is norm.original
                               for n in fed) if layers else 0
    report.note(ACROSS_LAYERS_PER_CALL)
    return len(layers)


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
            For Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE on transformers 5.5-5.24 the base
            model's loop is rewritten too, so that the add ending each layer is one call with
            the next layer's input norm (the last with the final norm); a call requesting
            hidden states, or whose layers have hooks, computes as transformers wrote it.

    Returns:
        A :class:`Report`; ``print`` it. Nothing is raised for what cannot be patched: it is
        skipped, listed in the report, and a warning says so (and when no supported family
        is found). :func:`reset` restores the model. ``copy.deepcopy`` keeps the patches;
        pickling a whole patched model (``torch.save(model)``) needs :func:`reset` first, as
        the patched classes are not importable (``state_dict`` is unaffected).
    """
    report = Report(type(model).__name__)
    index = _index()
    models: list[tuple[str, torch.nn.Module, Family]] = []
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
        elif role == "model" and (residual or patched):
            models.append((path, module, family))
    # after the layers: a model fuses across its layers only when all of them are patched
    paired = sum(_patch_model(report, *entry) for entry in models)
    if report.fused_layers > paired:
        report.note(ACROSS_LAYERS)
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
    model = _model_of(spec)
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
            across = (_model_class(spec, model, layer, norm) if model is not None
                      and patched.__dict__.get(_PAIRS, False) else ACROSS_LAYERS)
            if isinstance(across, str):
                report.note(across)
            else:
                _replace(module, spec.model, across, report)
                report.note(ACROSS_LAYERS_PER_CALL)
    if report.refused:
        warnings.warn(f"tilenorm.transformers.apply_to: not everything was patched.\n{report}",
                      stacklevel=2)
    return report


def reset_classes() -> None:
    """Undo every :func:`apply_to`: the modeling modules get their classes back."""
    for (name, attr), cls in _class_patches.items():
        setattr(sys.modules[name], attr, cls)
    _class_patches.clear()
