"""No GPU: the CuTe FP8 row kernel's main loop with FP8 x (E4M3 bytes and one fp32 multiplier
a group) against 2-byte x, read off its sm_90a SASS: registers, spills, the static
instruction count of the main loop (the persistent row loop, ``stages`` rows unrolled:
``fp8_block_sass.main_loop``) and its stall cycles (``fp8_block_sass.stalls``), and that
loop's instructions attributed to what they do, by a register data-flow walk of the loop
(twice round, so values loaded in one trip and used in the next are traced). A bf16 weight,
E4M3 q, row scaling (``--scalings``: others, bf16 x's), a runtime row count (or the bench
shapes', ``--static-rows`` as fp8_block_sass.py's), the H200 tables' (threads, stages, CTAs
per SM):
``cute_forward_fp8_input`` for FP8 x (``--entries``, as bench_fp8.py's variants of that
table, in their place), ``forward_entry`` for bf16 x; from this source tree or from others
(``--trees``, as ``fp8_block_sass.py``'s: the loops of old commits, bench/NOTES.md #117).

    python bench/experiments/fp8_input_sass.py [--widths 4096,8192] [--x fp8,bf16]
        [--group 128] [--scalings row,mx] [--trees this,f313ab5=scratch/f313ab5]
        [--static-rows [f313ab5,...]] [--sass-dir DIR]
        [--entries '{"4096": [128, 6, 4]}']
    python bench/experiments/fp8_input_sass.py --emulate   # the CPU bit-identity checks

Categories: ``convert`` (FP8 -> f16x2 -> fp32: F2FP.F16.E4M3.UNPACK_B, HADD2.F32),
``widen x`` / ``widen w`` (bf16 -> fp32 by shift / permute), ``dequant`` (fp32(x) times
its multiplier), ``x*w``, ``sum sq`` (the FFMA chain), ``amax t`` (max |t|), ``quantize``
(t * rstd * scale, the clamp where the route has it, the saturating conversion and its
byte packing), ``reduce`` (warp shuffles and ``REDUX``, shared memory, the barrier, the
cross-warp sums), ``rstd, scale`` (rsqrt, the IEEE divisions with their checks and
slow-path calls), the loads and stores (``load w``: the fp32 weight read from shared memory
each row), and the integer work that forms each load's and store's address
(``addr: x``, ``addr: mult``, ...; ``addr: row`` where a value feeds several), ``control``
(branches, predicates, the rest).

``--emulate`` checks in NumPy that the exactness arguments of the kernel's FP8-x arithmetic
hold for every E4M3 byte (see :func:`emulate`).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.fp8_block_sass import (  # noqa: E402
    compile_sass,
    main_loop,
    parse_sass,
    parse_trees,
    rows_of,
    stalls,
    static_labels,
)

CATEGORIES = ("convert", "widen x", "widen w", "dequant", "x*w", "sum sq", "amax t",
              "quantize", "reduce", "rstd, scale", "load x", "load mult", "load w", "store q",
              "store rstd/scale", "addr: x", "addr: mult", "addr: q", "addr: rstd/scale",
              "addr: row", "control")
_REG = re.compile(r"\b(U?R\d+|U?RZ)\b")


def _regs(operand: str, width: int = 1) -> list[str]:
    m = _REG.search(operand)
    if not m or m[1] in ("RZ", "URZ"):
        return []
    kind = "UR" if m[1].startswith("UR") else "R"
    n = int(m[1][len(kind):])
    return [f"{kind}{n + i}" for i in range(width)]


def _width(op: str) -> int:
    for suffix, w in ((".128", 4), (".64", 2), (".WIDE", 2)):
        if suffix in op:
            return w
    return 1


def split(text: str) -> tuple[str, list[str], list[str]]:
    """(opcode, destination registers, source registers) of one instruction."""
    op, _, rest = text.partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest else []
    base = op.split(".")[0]
    if base in ("STG", "STS", "ST", "BRA", "CALL", "BAR", "BSSY", "BSYNC", "EXIT", "RET",
                "WARPSYNC", "NOP", "FCHK", "ISETP", "FSETP", "UISETP", "PLOP3") or not operands:
        dests, srcs = [], operands
    elif base == "SHFL":
        dests, srcs = _regs(operands[1]), operands[2:]
    else:
        dests, srcs = _regs(operands[0], _width(op) if base in ("LDG", "LDS", "LDC", "IMAD")
                            else 1), operands[1:]
    src_regs = []
    for o in srcs:
        # a memory operand's address register is 64-bit ([R8.64]) for global accesses
        src_regs += _regs(o, 2 if ".64]" in o else 1)
    if base in ("STG", "STS"):
        src_regs += _regs(operands[-1], _width(op))
    return op, dests, src_regs


def attribute(loop: list[tuple[int, str, str]]) -> collections.Counter:
    """The count of each category (:func:`categories`) in ``loop``."""
    return collections.Counter(categories(loop))


def categories(loop: list[tuple[int, str, str]]) -> list[str]:
    """Each loop instruction's category, from what its operands carry (register tags set by
    the instructions that wrote them; the loop walked twice so a value loaded for a later
    trip is tagged when used), and the address slices of the loads and stores."""
    parsed = [split(text) for _, _, text in loop]
    defined = {d for _, ds, _ in parsed for d in ds}
    tags: dict[str, str] = {}
    writer: dict[str, int] = {}  # the instruction that last wrote each register
    weight_loads: set[int] = set()  # the LDS whose values x * w takes
    cats: list[str] = [""] * len(parsed)
    for _ in range(2):
        for i, (op, dests, srcs) in enumerate(parsed):
            base = op.split(".")[0]
            st = [tags.get(s, "live-in" if s not in defined else "") for s in srcs]
            text = loop[i][2]
            if base in ("PRMT", "SHF", "IMAD", "LOP3") and st:
                st = st[:1]  # a permute's merge operand carries none of the value
            cat, tag = "", ""
            if base == "LDG":
                cat, tag = ("load x", "xraw") if ".128" in op else ("load mult", "mult")
            elif base == "F2FP" and "UNPACK" in op:
                cat, tag = "convert", "f16"
            elif base == "HADD2" and ".F32" in op and "f16" in st:
                cat, tag = "convert", "x"
            elif base == "F2FP":
                cat, tag = "quantize", "q"
            elif base in ("SHF", "IMAD", "PRMT", "LOP3") and "xraw" in st and (
                    "0x10000" in text or "0x7632" in text or "0x10," in text
                    or "0xffff0000" in text):
                cat, tag = "widen x", ("xraw" if "0x7632" in text else "x")
            elif base in ("SHF", "IMAD", "PRMT", "LOP3") and ("live-in" in st or "wraw" in st) \
                    and ("0x10000" in text or "0x7632" in text or "0x10," in text
                         or "0xffff0000" in text):
                cat, tag = "widen w", ("wraw" if "0x7632" in text else "w")
            elif base == "PRMT" and "q" in st:
                cat, tag = "quantize", "q"
            elif base == "FMUL" and "mult" in st and "x" in st:
                cat, tag = "dequant", "xd"
            elif base == "FMUL" and ("x" in st or "xd" in st) and (
                    "w" in st or "live-in" in st or "lds" in st):
                cat, tag = "x*w", "t"
                weight_loads |= {writer[r] for r, g in zip(srcs, st, strict=True)
                                 if g == "lds" and r in writer}
            elif base == "FMUL" and "t" in st:
                cat, tag = "quantize", "y1"
            elif base == "FMUL" and "y1" in st:
                cat, tag = "quantize", "y"
            elif op.startswith("FMNMX.NAN") and "y" in st:
                cat, tag = "quantize", "y"  # the kernel's clamp to +-fp8_max (#125)
            elif base == "FFMA" and ("sq" in st or (len(srcs) >= 2 and srcs[0] == srcs[1]
                                                    and st[0] in ("x", "xd"))):
                cat, tag = "sum sq", "sq"
            elif base == "FMNMX" and op == "FMNMX" and ("t" in st or "amax" in st) and (
                    "|" in text):
                cat, tag = "amax t", "amax"
            elif base == "LDS":  # the reduction's, or the weight's (below)
                cat, tag = "reduce", "lds"
            elif base in ("SHFL", "STS", "BAR", "REDUX") or (
                    base in ("FADD", "FMNMX") and op in ("FADD", "FMNMX")) or (
                    base == "MOV" and st == ["red"]):
                cat, tag = "reduce", "red"
            elif base in ("MUFU", "FCHK", "FSETP", "FSEL", "FFMA", "FMUL", "CALL", "BSSY",
                          "BSYNC", "FADD") or op.startswith("FMNMX.NAN"):
                cat, tag = "rstd, scale", "scale"
            elif base == "STG":
                cat = "store q" if ".128" in op or ".64" in op else "store rstd/scale"
            for d in dests:
                tags[d] = tag
                writer[d] = i
            cats[i] = cat
    for i in weight_loads:
        cats[i] = "load w"
    # Address slices: the integer instructions each load's or store's address depends on.
    users: dict[int, set[str]] = collections.defaultdict(set)
    last_def: dict[str, int] = {}
    defs_before: list[dict[str, int]] = []
    for i, (_, dests, _) in enumerate(parsed * 2):
        defs_before.append(dict(last_def))
        for d in dests:
            last_def[d] = i
    n = len(parsed)
    for i in range(n, 2 * n):
        op, _, _ = parsed[i - n]
        c = cats[i - n]
        if c not in ("load x", "load mult", "store q", "store rstd/scale"):
            continue
        kind = {"load x": "addr: x", "load mult": "addr: mult", "store q": "addr: q",
                "store rstd/scale": "addr: rstd/scale"}[c]
        text = loop[i - n][2]
        addr = re.findall(r"\[([^\]]*)\]", text)
        stack = [(r, i) for r in (_regs(addr[-1], 2 if ".64" in addr[-1] else 1)
                                   if addr else [])]
        seen = set()
        while stack:
            r, at = stack.pop()
            j = defs_before[at].get(r)
            if j is None or j in seen:
                continue
            seen.add(j)
            k = j % n
            if cats[k]:
                continue
            users[k].add(kind)
            stack += [(s, j) for s in parsed[k][2]]
    for i, c in enumerate(cats):
        if not c:
            u = users.get(i)
            cats[i] = (next(iter(u)) if len(u) == 1 else "addr: row") if u else "control"
    return cats


def report(widths, xs, group: int, scalings, trees: dict, static: list[str] | None,
           sass_dir: str | None, entries: dict | None = None) -> None:
    """The table; ``entries`` {cols: (threads, stages, CTAs per SM)} in place of the FP8-x
    table's."""
    rows = []
    for cols in widths:
        for x in xs:
            for scaling in scalings if x == "bf16" else ["row"]:
                config = (entries or {}).get(cols) if x == "fp8" else None
                for label, tree in trees.items():
                    r, sass = compile_sass(
                        scaling, cols, tree, rows_of(label, cols, static),
                        "float8_e4m3fn" if x == "fp8" else "bfloat16", group if x == "fp8" else 0,
                        config=config)
                    at = f"{cols}:{','.join(map(str, config))}" if config else str(cols)
                    name = " ".join(n for n in (label if len(trees) > 1 else "", x,
                                                scaling if len(scalings) > 1 else "", at)
                                    if n)
                    if sass_dir:
                        Path(sass_dir).mkdir(parents=True, exist_ok=True)
                        (Path(sass_dir) / f"{name.replace(' ', '-')}.sass").write_text(sass)
                    loop = main_loop(parse_sass(sass))
                    stall = sum(stalls(sass)[a] for a, _, _ in loop)
                    rows.append((name, r, len(loop), stall, attribute(loop)))
    width = max(11, *(len(name) + 2 for name, *_ in rows))
    print(f"{'':18}" + "".join(f"{name:>{width}}" for name, *_ in rows))
    for label, get in (("registers", lambda r, n, st: r["registers"]),
                       ("spills (st/ld)", lambda r, n, st: f"{r['spill_stores']}/"
                                                           f"{r['spill_loads']}"),
                       ("loop", lambda r, n, st: n), ("stall cycles", lambda r, n, st: st)):
        print(f"{label:18}" + "".join(f"{get(r, n, st)!s:>{width}}" for _, r, n, st, _ in rows))
    for cat in CATEGORIES:
        print(f"  {cat:16}" + "".join(f"{c[cat]:>{width}}" for *_, c in rows))


# --- CPU emulation of the dequantization --------------------------------------------------

#: Every E4M3 (fn) byte's value: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no
#: infinities, S.1111.111 NaN.
def e4m3_values() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0)) * sign
    v[(b & 0x7F) == 0x7F] = np.nan
    return v


def multipliers(rng: np.random.Generator, n: int) -> np.ndarray:
    """fp32 multipliers: random bit patterns over every exponent (subnormals, the largest
    finite, infinities, NaN), typical scale_inv values, powers of two, and the edges."""
    edges = np.array([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38,
                      3.4028235e38, -3.4028235e38, np.inf, -np.inf, np.nan, 2.0 ** -126,
                      2.0 ** -149, 2.0 ** 127, 1 / 448, 448.0, 3.0, 0.1], np.float32)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    typical = (np.abs(rng.standard_normal(n)) * 2.0 ** rng.integers(-30, 30, n)).astype(
        np.float32) / np.float32(448)
    pow2 = np.ldexp(np.float32(1), rng.integers(-149, 128, n)).astype(np.float32)
    return np.concatenate([edges, bits, typical, pow2]).astype(np.float32)


def emulate() -> None:
    """Over every E4M3 byte times many fp32 multipliers: (1) every E4M3 value is an f16 and
    an fp32 exactly (so cvt.rn.f16x2.e4m3x2 then f16 -> fp32 is the exact widening), and
    the product fp32(x) * s rounded once to fp32 (NumPy float32 multiply: IEEE
    round-to-nearest-even, subnormals kept, as PTX mul.rn.f32 without .ftz) is the same
    bits however the multiplier reaches the multiply; (2) the row kernel's folds of the sum
    of squares and max|t| give the same outputs (:func:`emulate_folds`)."""
    v = e4m3_values()
    finite = ~np.isnan(v)
    as_f16 = v.astype(np.float16)
    assert np.array_equal(as_f16[finite].astype(np.float64), v[finite]), "E4M3 -> f16"
    assert np.array_equal(v.astype(np.float32)[finite].astype(np.float64), v[finite])
    x32 = as_f16.astype(np.float32)  # the kernel's widening: e4m3 -> f16 -> f32
    rng = np.random.default_rng(0)
    s = multipliers(rng, 20000)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = x32[:, None] * s[None, :]
    # The exact product in float64 (4 + 24 significant bits fit 53) rounded once to fp32.
    with np.errstate(over="ignore", invalid="ignore"):
        ref = (x32.astype(np.float64)[:, None] * s.astype(np.float64)[None, :]).astype(
            np.float32)
    same = (prod.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(prod) & np.isnan(ref))
    assert same.all(), "fp32(x) * s is not the once-rounded exact product"
    cases = emulate_folds(rng)
    print(f"folds from 0, from warp 0 / |t[0]| (2-byte x) and as unsigned maxima (FP8 x): "
          f"{cases} rows, the same sum, scale and program amax bits")
    print(f"bit-identical: {prod.size} products ({v.size} E4M3 bytes x {s.size} "
          f"multipliers), fp32 multiply = exact product rounded once")


#: The row kernel's folds of a row's max|t|: ``zero`` every fold from 0, ``first`` 2-byte
#: x's (the thread's from |t[0]|, the warps' from warp 0's partial, fmax throughout),
#: ``unsigned`` FP8 x's (the thread's fmax from +0, the warp's and the warps' maxima one
#: ``redux.sync.max.u32`` each of the bits, lane i reading warp i % warps's partial).
FOLDS = ("zero", "first", "unsigned")


def _redux_max(v: np.ndarray, axis: int) -> np.ndarray:
    """``redux.sync.max.u32`` over ``axis`` of fp32 values, as the kernel's ``_warp_max``
    takes them (+0, positive numbers, +inf: no NaN, no sign bit)."""
    bits = v.view(np.uint32)
    assert (bits <= np.float32(np.inf).view(np.uint32)).all(), "a NaN or a sign bit"
    return bits.max(axis=axis).view(np.float32)


def fold_outputs(t: np.ndarray, rstd: np.float32, fold: str) -> tuple:
    """(sum of squares, scale, fmax(0, amax), amax, max|t|) of one row of t ((warps, 32,
    per_thread) fp32, x = t here) as the row kernel folds them (:data:`FOLDS`); the sum of
    squares is folded from 0 for ``zero``, else from warp 0's partial."""
    f32 = np.float32
    warps = t.shape[0]
    sq = np.full(t.shape[:2], f32(0), f32)
    for i in range(t.shape[2]):
        sq = (sq + t[:, :, i] * t[:, :, i]).astype(f32)  # the FFMA chain from +0
    m = np.abs(t[:, :, 0]) if fold == "first" else np.zeros(t.shape[:2], f32)
    for i in range(1 if fold == "first" else 0, t.shape[2]):
        m = np.fmax(m, np.abs(t[:, :, i]))
    for off in (16, 8, 4, 2, 1):  # the warps' butterflies
        lane = np.arange(32) ^ off
        sq = (sq + sq[:, lane]).astype(f32)
        if fold != "unsigned":
            m = np.fmax(m, m[:, lane])
    ws, wm = sq[:, 0], m[:, 0]
    if fold == "unsigned":
        wm = _redux_max(m, 1)
    total, tmax = (f32(0), f32(0)) if fold == "zero" else (ws[0], wm[0])
    for w in range(0 if fold == "zero" else 1, warps):
        total = f32(total + ws[w])
        if fold != "unsigned":
            tmax = np.fmax(tmax, wm[w])
    if fold == "unsigned":
        tmax = _redux_max(wm[np.arange(32) % warps], 0)
    amax = f32(tmax * rstd)
    scale = f32(1)
    if amax > 0 and amax <= f32(FLOAT32_MAX):
        scale = min(f32(f32(448) / amax), f32(FLOAT32_MAX))
    return total, scale, np.fmax(f32(0), amax), amax, tmax


FLOAT32_MAX = 3.4028234663852886e38


def _same(u, v) -> bool:
    u, v = np.float32(u), np.float32(v)
    return bool(u.view(np.uint32) == v.view(np.uint32) or (np.isnan(u) and np.isnan(v)))


def emulate_folds(rng: np.random.Generator, rows: int = 3000) -> int:
    """The row folds (:data:`FOLDS`) over ``rows`` random rows with zeros, -0, NaN (whole
    threads, warps, rows of it), infinities, subnormals, and rstd NaN and infinite: the same
    sum of squares, scale and program amax (fmax(0, amax), delayed's and amax's running
    maximum) bits; and the same max|t| and amax bits unless every |t| of the row is NaN,
    where ``first`` ends with max|t| NaN and ``unsigned`` with +0 (amax 0 * rstd)."""
    cases = 0
    for _ in range(rows):
        warps, per = int(rng.choice([1, 2, 4, 8, 16])), int(rng.choice([8, 16, 32, 64]))
        kind = rng.integers(5)
        t = rng.standard_normal((warps, 32, per)).astype(np.float32)
        if kind == 1:
            t[rng.random(t.shape) < 0.3] = np.nan
        elif kind == 2:  # whole threads / warps / the row NaN
            pick = rng.integers(3)
            if pick == 0:
                t[rng.integers(warps), rng.integers(32)] = np.nan
            elif pick == 1:
                t[rng.integers(warps)] = np.nan
            else:
                t[:] = np.nan
        elif kind == 3:
            t = rng.choice(np.array([0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf, 448.0, np.nan],
                                    np.float32), t.shape)
        elif kind == 4:
            t = (t * np.float32(1e-40)).astype(np.float32)
        rstd = np.float32(rng.choice([1.0, 0.5, 1e30, np.inf, np.nan, -np.inf]))
        with np.errstate(all="ignore"):
            out = {fold: fold_outputs(t, rstd, fold) for fold in FOLDS}
        all_nan = bool(np.isnan(t).all())
        for fold in FOLDS:
            for n, (u, v) in enumerate(zip(out["first"], out[fold], strict=True)):
                if (n < 3 or not all_nan) and not _same(u, v):
                    raise SystemExit(f"{fold} folds differ: {out['first']} {out[fold]}")
        if all_nan and not (np.isnan(out["first"][4]) and _same(out["unsigned"][4], 0.0)):
            raise SystemExit(f"a row all NaN: max|t| {out['first'][4]}, {out['unsigned'][4]}")
        cases += 1
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="4096,8192")
    parser.add_argument("--x", default="fp8,bf16")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--scalings", default="row")
    parser.add_argument("--trees", default="this", help="label=path,... (default: this tree)")
    parser.add_argument("--static-rows", nargs="?", const="",
                        help="tree labels compiled for the shapes' row count (none: every tree)")
    parser.add_argument("--sass-dir")
    parser.add_argument("--entries", default="{}",
                        help='FP8 x\'s (threads, stages, CTAs per SM) by width, JSON: '
                             '\'{"4096": [128, 6, 4]}\'')
    parser.add_argument("--emulate", action="store_true")
    args = parser.parse_args()
    if args.emulate:
        emulate()
        return
    report([int(w) for w in args.widths.split(",")], args.x.split(","), args.group,
           args.scalings.split(","), parse_trees(args.trees), static_labels(args.static_rows),
           args.sass_dir, {int(c): tuple(v) for c, v in json.loads(args.entries).items()})


if __name__ == "__main__":
    main()
