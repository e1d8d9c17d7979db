"""No GPU: the CuTe FP8 row kernel's block / MX scale paths read off their sm_90a SASS
(bench/NOTES.md #58, #100, #114, #117): per scaling, width and source tree, the registers,
stack, spill stores / loads, the static instruction counts of the main loop (the backward
branch of the largest span: the persistent row loop, ``stages`` rows unrolled) and of the
whole kernel, the loop's stall cycles (the sum of each instruction's stall count from its
control bits: a warp's fixed-latency issue cycles a trip, variable-latency waits not
counted), and the counts of the kinds that differ between block scaling and row scaling. The
table's configurations for the H200 (``settings_fp8.SM90_FP8``), bf16 x, a bf16 weight,
E4M3, a runtime row count (``Fp8ForwardKey.rows`` None, as the ops compile since f59fa69) or
for the trees ``--static-rows`` names (every tree without a list) the bench shapes' (x of
256 MiB: 2**27 // cols rows, as the ops compiled before f59fa69).

    python bench/experiments/fp8_block_sass.py [--widths 2048,4096,8192]
        [--scalings row,block,mx] [--trees this,f313ab5=../f313ab5]
        [--static-rows [f313ab5,...]] [--sass-dir DIR]   # also keep each variant's SASS
        [--variants clamp,no-clamp]   # also the kernel's clamp set / cleared, this tree
    python bench/experiments/fp8_block_sass.py --emulate   # the CPU bit-identity checks

``--trees`` compiles each kernel from the named source trees (``git worktree add
scratch/f313ab5 f313ab5``; paths from the working directory), each in a process of its own
that imports that tree's tilenorm, e.g. from a worktree beside them in scratch/, the commits
around the runtime row count (#117)::

    --trees f313ab5=../f313ab5,24efec4=../main-24efec4,f59fa69=../f59fa69,this
    --static-rows f313ab5,24efec4

``--emulate`` checks, in NumPy over random and edge-case values (zeros, -0, subnormals, NaN,
infinities, the FP8 maximum, every rep of a group equal), that the reduce-scatter of the
block amaxes (``_scattered_block_amax``) gives every lane bit for bit the amax the per-rep
butterfly (``_block_amax``) gives, and that the segment shuffles (``_group_shuffle``) read
the lane the full-warp index ``lane - lane % block_lanes + g`` reads (PTX ``shfl.sync.idx``:
``j = (lane & segmask) | (b & ~segmask)``), for every group width and ``g``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: Opcode kinds printed (counts in the main loop), the rest summed under "other".
KINDS = ("SHFL.BFLY", "SHFL.IDX", "FMNMX.NAN", "FMNMX", "FSEL", "FMUL", "FFMA", "MUFU", "FCHK",
         "CALL", "BSSY", "STG", "LDS", "F2FP", "ISETP", "LOP3", "LEA")
_INS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*")
_CONTROL = re.compile(r"^\s+/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
ROOT = Path(__file__).resolve().parents[2]
#: ``--variants``: name -> the kernel's ``clamp`` in place of the route's (#117, #125).
VARIANTS = {"clamp": True, "no-clamp": False}


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, text) of every instruction."""
    out = []
    for line in sass.splitlines():
        m = _INS.match(line)
        if m:
            text = m[2].strip()
            if text.startswith("@"):
                text = text.split(None, 1)[1]
            out.append((int(m[1], 16), text.split()[0], text))
    return out


def stalls(sass: str) -> dict[int, int]:
    """Each instruction's stall count (cycles before the warp's next issue), by address: bits
    41-44 of the upper word of its 128-bit encoding, which cuobjdump prints on the line
    after the instruction (Volta to Blackwell control bits)."""
    out = {}
    lines = sass.splitlines()
    for line, upper in zip(lines, lines[1:], strict=False):
        m, c = _INS.match(line), _CONTROL.match(upper)
        if m and c:
            out[int(m[1], 16)] = (int(c[1], 16) >> 41) & 0xF
    return out


def main_loop(ins: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions between the target of the backward branch of the largest span and
    that branch: the kernel's persistent row loop."""
    best = None
    for addr, op, text in ins:
        m = re.search(r"0x([0-9a-f]+)\s*$", text)
        target = int(m[1], 16) if op.startswith("BRA") and m else addr
        if target < addr and (best is None or addr - target > best[1] - best[0]):
            best = (target, addr)
    return [i for i in ins if best[0] <= i[0] <= best[1]]


def kinds(ins) -> collections.Counter:
    counts = collections.Counter()
    for _, op, _ in ins:
        # FMNMX.NAN (the kernel's clamp, NaN kept: #117, #125) before plain FMNMX
        kind = next((k for k in KINDS if op == k or op.startswith(k + ".")), "other")
        counts[kind] += 1
    return counts


def compile_sass(scaling: str, cols: int, tree: str | None = None, rows: int | None = None,
                 x: str = "bfloat16", group: int = 0, variant: str | None = None,
                 config: tuple[int, int, int] | None = None) -> tuple[dict, str]:
    """Resources and SASS of the row kernel of bf16 (or FP8, ``group``) x and a bf16 weight
    at ``scaling`` and ``cols`` as the planner routes it on an H200 (its table's entry, or
    ``recompute_t``'s, and its ``clamp``; ``config``, (threads, stages, CTAs per SM), in its
    place), compiled from ``tree`` (a source tree, in a process of its own; None: this one)
    for ``rows`` (None: any count); ``variant`` a name of :data:`VARIANTS`, the kernel's
    ``clamp`` as it says in the route's place."""
    spec = {"scaling": scaling, "cols": cols, "rows": rows, "x": x, "group": group,
            "variant": variant, "config": config}
    if tree is not None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            subprocess.run([sys.executable, __file__, "--compile", json.dumps(spec), "--tree",
                            str(Path(tree).resolve()), "--out", str(out)], check=True,
                           cwd=tree)
            done = json.loads(out.read_text())
        return done["resources"], done["sass"]
    return _compile_here(**spec)


def _compile_here(scaling: str, cols: int, rows: int | None, x: str, group: int,
                  variant: str | None = None, config: list[int] | None = None
                  ) -> tuple[dict, str]:
    from bench.kernel_resources import cubin_resources, cuobjdump, keeping_cubins
    from tilenorm.launch import cute
    from tilenorm.settings_fp8 import SM90_FP8

    cute.available()
    # The planner's route (plan_cute_fp8_forward): recompute_t's entry where it has one, the
    # clamp where the table has it (trees before the clamp have neither table nor flag).
    recompute_t = None if group else SM90_FP8.cute_forward_recompute_t.get(scaling, {}).get(cols)
    if config is None:
        config = (SM90_FP8.fp8_input_entry(scaling, cols) if group
                  else recompute_t or SM90_FP8.forward_entry(scaling, cols))
    routed = hasattr(SM90_FP8, "forward_clamp") and not group and SM90_FP8.forward_clamp(
        scaling, cols)
    clamp = VARIANTS[variant] if variant else routed
    # The ring in shared memory where the table has it (trees before it have neither).
    ring = hasattr(SM90_FP8, "forward_shared_ring") and (
        SM90_FP8.fp8_input_shared_ring(scaling, cols) if group
        else SM90_FP8.forward_shared_ring(scaling, cols))
    key = cute.Fp8ForwardKey(rows, x, "bfloat16", "float8_e4m3fn", scaling, False, cols,
                             *config, recompute_t=recompute_t is not None,
                             **({"group": group} if group else {}),
                             **({"clamp": True} if clamp else {}),
                             **({"shared_ring": True} if ring else {}))
    with tempfile.TemporaryDirectory() as tmp:
        with keeping_cubins(tmp):
            cute.compile_fp8_forward(key, "sm_90a")
        return cubin_resources(sorted(Path(tmp).rglob("*.cubin"))[0], cuobjdump())


def static_labels(arg: str | None) -> list[str] | None:
    """``--static-rows``: None (every tree at a runtime count), [] (every tree at the shapes'
    counts) or the labels of the trees compiled at the shapes' counts."""
    return None if arg is None else [label for label in arg.split(",") if label]


def parse_trees(arg: str) -> dict[str, str | None]:
    """``label=path,...`` (a bare label: this tree) -> {label: path or None}."""
    trees = {}
    for item in arg.split(","):
        label, _, path = item.partition("=")
        trees[label] = None if path in ("", ".") else path
    return trees


def rows_of(label: str, cols: int, static: list[str] | None) -> int | None:
    """The row count tree ``label`` compiles for: the bench shapes' at ``cols`` (bench_fp8.py:
    x of 256 MiB in bf16) where ``static`` names it (or is empty: every tree), else None."""
    return 2 ** 27 // cols if static is not None and (not static or label in static) else None


def report(widths, scalings, trees: dict, static: list[str] | None,
           sass_dir: str | None, variants: list[str] = ()) -> None:
    """The table; ``variants`` (names of :data:`VARIANTS`, compiled from this tree,
    labelled by name) after the trees of each width and scaling."""
    head = (f"{'cols':>5} {'scaling':>7} {'tree':>10} {'regs':>4} {'stack':>5} "
            f"{'STL/LDL':>7} {'total':>5} {'loop':>5} {'stall':>5} "
            + " ".join(f"{k:>9}" for k in KINDS) + f" {'other':>5}")
    print(head)
    for cols in widths:
        for scaling in scalings:
            runs = [(label, tree, None) for label, tree in trees.items()]
            runs += [(name, None, name) for name in variants]
            for label, tree, variant in runs:
                r, sass = compile_sass(scaling, cols, tree, rows_of(label, cols, static),
                                       variant=variant)
                if sass_dir:
                    Path(sass_dir).mkdir(parents=True, exist_ok=True)
                    (Path(sass_dir) / f"{label}-{scaling}-{cols}.sass").write_text(sass)
                loop = main_loop(parse_sass(sass))
                stall = stalls(sass)
                c = kinds(loop)
                print(f"{cols:>5} {scaling:>7} {label:>10} {r['registers']:>4} {r['stack']:>5} "
                      f"{r['spill_stores']:>3}/{r['spill_loads']:<3} "
                      f"{len(parse_sass(sass)):>5} {len(loop):>5} "
                      f"{sum(stall[a] for a, _, _ in loop):>5} "
                      + " ".join(f"{c[k]:>9}" for k in KINDS) + f" {c['other']:>5}", flush=True)


# --- CPU emulation of the changed arithmetic -------------------------------------------

def fmax(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PTX ``max.f32`` (fmaxf): the number where one operand is NaN; +0 over -0."""
    return np.fmax(a, b)


def thread_amax(t: np.ndarray) -> np.ndarray:
    """(lanes, reps, vec) fp32 -> (lanes, reps): fmax from 0 over |t| in element order."""
    m = np.zeros(t.shape[:2], np.float32)
    for e in range(t.shape[2]):
        m = fmax(m, np.abs(t[:, :, e]))
    return m


def bfly(v: np.ndarray, offset: int) -> np.ndarray:
    return v[np.arange(32) ^ offset]


def butterfly_amaxes(t: np.ndarray, lanes: int) -> np.ndarray:
    """(32, reps): every lane's amax of every rep, a butterfly a rep (``_block_amax``)."""
    m = thread_amax(t)
    out = []
    for r in range(m.shape[1]):
        v = m[:, r]
        offset = lanes // 2
        while offset:
            v = fmax(v, bfly(v, offset))
            offset //= 2
        out.append(v)
    return np.stack(out, 1)


def scattered_amax(t: np.ndarray, lanes: int) -> np.ndarray:
    """(32,): each lane's value from ``_scattered_block_amax``, step for step."""
    reps = t.shape[1]
    m = thread_amax(t)
    vals = [m[:, r] for r in range(reps)]
    lane = np.arange(32)
    for level in range(lanes.bit_length() - 1):
        offset = lanes >> (level + 1)
        half = reps >> (level + 1)
        if half > 0:
            upper = (lane & offset) != 0
            kept = []
            for i in range(half):
                send = np.where(upper, vals[i], vals[i + half])
                keep = np.where(upper, vals[i + half], vals[i])
                kept.append(fmax(keep, bfly(send, offset)))
            vals = kept
        else:
            vals = [fmax(vals[0], bfly(vals[0], offset))]
    return vals[0]


def shfl_idx_source(lane: int, b: int, c: int) -> int:
    """PTX ``shfl.sync.idx``'s source lane for lane ``lane``, operands ``b`` and ``c``."""
    segmask = (c >> 8) & 0x1F
    cval = c & 0x1F
    max_lane = (lane & segmask) | (cval & ~segmask & 0x1F)
    j = (lane & segmask) | (b & ~segmask & 0x1F)
    return j if j <= max_lane else lane


def _cases(rng: np.random.Generator, reps: int, vec: int):
    shape = (32, reps, vec)
    special = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 448.0, -448.0, 449.0,
                        1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38, 1.0],
                       np.float32)
    yield np.zeros(shape, np.float32)
    yield np.full(shape, np.nan, np.float32)
    yield np.full(shape, -0.0, np.float32)
    for _ in range(3000):
        kind = rng.integers(6)
        if kind == 0:
            t = rng.standard_normal(shape).astype(np.float32)
        elif kind == 1:  # subnormals and tiny normals
            t = (rng.standard_normal(shape) * 1e-39).astype(np.float32)
        elif kind == 2:  # random bit patterns: every exponent, NaNs, infinities
            t = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(
                np.float32)
        elif kind == 3:  # a sprinkle of the special values
            t = rng.standard_normal(shape).astype(np.float32) * np.float32(448)
            mask = rng.random(shape) < 0.2
            t[mask] = rng.choice(special, mask.sum())
        elif kind == 4:  # few distinct values: ties between lanes and reps
            t = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 2.0, np.nan], np.float32), shape)
        else:  # one large element a block, the rest small (the amax from one lane)
            t = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
            t[rng.integers(32), rng.integers(reps), rng.integers(vec)] = rng.choice(special)
        yield t


def emulate() -> None:
    rng = np.random.default_rng(0)
    checked = 0
    # (block_lanes, reps, vec): bf16 x (vec 8: block 16 lanes, MX 4) and FP8 x (vec 16:
    # block 8, MX 2), at the reps of the tables' widths (1, 2, 4; 8 with recompute_t).
    for lanes, reps, vec in ((16, 1, 8), (16, 2, 8), (16, 4, 8), (16, 8, 8), (16, 16, 8),
                             (4, 1, 8), (4, 2, 8), (4, 4, 8), (8, 2, 16), (8, 4, 16),
                             (2, 1, 16), (2, 2, 16), (32, 4, 4)):
        spread = lanes // reps
        for t in _cases(rng, reps, vec):
            want = butterfly_amaxes(t, lanes)  # (32, reps)
            got = scattered_amax(t, lanes)  # (32,)
            lane = np.arange(32)
            mine = want[lane, (lane % lanes) // spread]
            if not np.array_equal(got.view(np.uint32), mine.view(np.uint32)):
                raise SystemExit(f"scatter differs at lanes {lanes}, reps {reps}")
            # Lane g of a group ends with rep g // spread's amax: the segment shuffle of
            # lane r * spread hands every lane rep r's, as the butterfly gave it.
            c = ((32 - lanes) << 8) | 0x1F
            for r in range(reps):
                src = np.array([shfl_idx_source(int(x), r * spread, c) for x in lane])
                if not np.array_equal(src, lane - lane % lanes + r * spread):
                    raise SystemExit(f"segment shuffle differs at lanes {lanes}, rep {r}")
                if not np.array_equal(got[src].view(np.uint32),
                                      want[:, r].view(np.uint32)):
                    raise SystemExit(f"handed-on amax differs at lanes {lanes}, rep {r}")
            checked += 1
    # The lean block path (reps not a power of two) hands rep g's scale from lane g of the
    # group: the segment shuffle's source for every lane of every group width and g.
    for lanes in (2, 4, 8, 16, 32):
        c = ((32 - lanes) << 8) | 0x1F
        for g in range(lanes):
            for lane in range(32):
                if shfl_idx_source(lane, g, c) != lane - lane % lanes + g:
                    raise SystemExit(f"segment shuffle differs at lanes {lanes}, g {g}")
    print(f"bit-identical: {checked} (lanes, reps) cases of 32 lanes, every lane and rep; "
          "segment shuffles read lane - lane % lanes + g for every width and g")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="2048,4096,8192")
    parser.add_argument("--scalings", default="row,block,mx")
    parser.add_argument("--trees", default="this", help="label=path,... (default: this tree)")
    parser.add_argument("--static-rows", nargs="?", const="",
                        help="tree labels compiled for the shapes' row count (none: every tree)")
    parser.add_argument("--sass-dir")
    parser.add_argument("--variants", default="",
                        help="clamp, no-clamp: the kernel's clamp set or cleared in the "
                             "route's place, compiled from this tree and reported after "
                             "the trees")
    parser.add_argument("--emulate", action="store_true")
    # One compile in another tree (compile_sass's child process).
    parser.add_argument("--compile", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile:
        sys.path.insert(0, args.tree)  # that tree's tilenorm and bench, not this one's
        r, sass = _compile_here(**json.loads(args.compile))
        Path(args.out).write_text(json.dumps({"resources": r, "sass": sass}))
        return
    if args.emulate:
        emulate()
        return
    report([int(w) for w in args.widths.split(",")], args.scalings.split(","),
           parse_trees(args.trees), static_labels(args.static_rows), args.sass_dir,
           [name for name in args.variants.split(",") if name])


if __name__ == "__main__":
    main()
