"""What :func:`tilenorm.transformers.apply` and :func:`~tilenorm.transformers.apply_to`
patched, and what they left alone and why."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Skipped:
    """A module (or class) left as transformers wrote it.

    ``expected`` marks what is so by design (a family whose layers have no add-then-norm, a
    module of no supported family); the others were refused because they could not be
    verified (an unknown forward source, hooks or wrappers on the instance), and
    :func:`~tilenorm.transformers.apply` warns about them.
    """

    path: str
    what: str
    reason: str
    expected: bool = False


@dataclass
class Report:
    """Counts of what computes with tilenorm now, and every module or class skipped.

    ``norm_modules`` counts the norms over the hidden size (and OLMo2's q/k norms over all
    heads), ``per_head_norms`` the q_norm/k_norm modules applied to each head's vector,
    ``fused_layers`` the decoder layers whose residual add and following norm are one
    tilenorm call, ``fused_across`` the norms fed by the add that ends a layer (the next
    layer's input norm, the model's final norm) computed in one call with that add by a model
    whose loop carries (output, residual) pairs, ``classes`` the classes replaced in their
    modeling modules by :func:`~tilenorm.transformers.apply_to`.
    """

    target: str
    families: list[str] = field(default_factory=list)
    norm_modules: int = 0
    per_head_norms: int = 0
    fused_layers: int = 0
    fused_across: int = 0
    classes: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def refused(self) -> list[Skipped]:
        """The skipped entries that are not so by design."""
        return [s for s in self.skipped if not s.expected]

    def skip(self, path: str, what: str, reason: str, expected: bool = False) -> None:
        self.skipped.append(Skipped(path, what, reason, expected))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def __str__(self) -> str:
        families = ", ".join(self.families) or "no supported family"
        lines = [f"tilenorm.transformers: {self.target} ({families})"]
        if self.classes:
            lines.append(f"  classes patched: {', '.join(self.classes)}")
        else:
            lines.append(f"  computed by tilenorm: {self.norm_modules} norm modules, "
                         f"{self.per_head_norms} per-head q/k norms")
            lines.append(f"  residual add fused with the following norm: {self.fused_layers} "
                         f"decoder layers")
            if self.fused_across:
                lines.append(f"  add ending a layer fused with the next norm: "
                             f"{self.fused_across} norms (the next layers' input norms, the "
                             f"final norm)")
        groups: dict[tuple[str, str, bool], list[str]] = {}
        for s in self.skipped:
            groups.setdefault((s.what, s.reason, s.expected), []).append(s.path)
        if groups:
            lines.append("  not patched:")
        for (what, reason, expected), paths in groups.items():
            shown = ", ".join(paths[:3]) + (f", ... ({len(paths)} in all)"
                                            if len(paths) > 3 else "")
            tag = "" if expected else "refused: "
            lines.append(f"    {what} x{len(paths)} [{shown}]: {tag}{reason}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)
