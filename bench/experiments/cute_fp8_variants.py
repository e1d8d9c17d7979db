"""Variants of the CuTe DSL FP8-output row kernel under measurement (not what the ops run):
subclasses of :class:`tilenorm.kernels.cute_row_norm_fp8.RowNormFp8Forward` that
``cute_fp8_probe.py --variant NAME`` compiles and times beside it (bench/NOTES.md #58). The
recompute-t variant (#74, #78) is the kernel's own ``recompute_t`` flag (``--variant
recompute-t``). None is under measurement now: #58's ``LeanBlockScales`` (one division a
row a lane for block scaling) is the kernel's block path since #100."""

from __future__ import annotations

#: Name -> kernel class, for ``cute_fp8_probe.py --variant``.
VARIANTS: dict[str, type] = {}
