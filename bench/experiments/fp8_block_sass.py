"""No GPU: the CuTe FP8 row kernel's block / MX scale paths read off their sm_90a SASS
(bench/NOTES.md #58, #100): per variant of ``RowNormFp8Forward``'s class switches, scaling
and width, the registers, stack, spill stores / loads and the static instruction counts of
the main loop (the backward branch of the largest span: the persistent row loop, ``stages``
rows unrolled) and of the whole kernel, with the counts of the kinds that differ between
block scaling and row scaling. The table's configurations (``settings_fp8.SM90_FP8``), bf16
x, a bf16 weight, E4M3, a runtime row count (``Fp8ForwardKey.rows`` None, as the ops
compile).

    python bench/experiments/fp8_block_sass.py [--widths 2048,4096,8192]
        [--scalings row,block,mx] [--variants before,scatter,scatter+segment]
        [--sass-dir DIR]      # also keep each variant's SASS there
    python bench/experiments/fp8_block_sass.py --emulate   # the CPU bit-identity checks

``--emulate`` checks, in NumPy over random and edge-case values (zeros, -0, subnormals, NaN,
infinities, the FP8 maximum, every rep of a group equal), that the reduce-scatter of the
block amaxes (``_scattered_block_amax``) gives every lane bit for bit the amax the per-rep
butterfly (``_block_amax``) gives, and that the segment shuffles (``_group_shuffle``) read
the lane the full-warp index ``lane - lane % block_lanes + g`` reads (PTX ``shfl.sync.idx``:
``j = (lane & segmask) | (b & ~segmask)``).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: Class switches of RowNormFp8Forward per variant (the kernel's defaults are the last).
VARIANTS = {
    "before": {"SCATTER_BLOCK_AMAX": False, "SEGMENT_SHUFFLES": False},
    "scatter": {"SCATTER_BLOCK_AMAX": True, "SEGMENT_SHUFFLES": False},
    "scatter+segment": {"SCATTER_BLOCK_AMAX": True, "SEGMENT_SHUFFLES": True},
}
#: Opcode kinds printed (counts in the main loop), the rest summed under "other".
KINDS = ("SHFL.BFLY", "SHFL.IDX", "FMNMX", "FSEL", "FMUL", "FFMA", "MUFU", "FCHK", "CALL",
         "BSSY", "STG", "LDS", "F2FP", "ISETP", "LOP3", "LEA")
_INS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*")


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
        kind = next((k for k in KINDS if op == k or op.startswith(k + ".")), "other")
        if kind == "FMNMX" and op.startswith("FMNMX.NAN"):
            kind = "other"
        counts[kind] += 1
    return counts


def compile_sass(scaling: str, cols: int, switches: dict) -> tuple[dict, str]:
    from bench.kernel_resources import cubin_resources, cuobjdump, keeping_cubins
    from tilenorm.launch import cute
    from tilenorm.settings_fp8 import SM90_FP8

    cute.available()
    from tilenorm.kernels.cute_row_norm_fp8 import RowNormFp8Forward

    saved = {k: getattr(RowNormFp8Forward, k) for k in switches}
    key = cute.Fp8ForwardKey(None, "bfloat16", "bfloat16", "float8_e4m3fn", scaling, False,
                             cols, *SM90_FP8.forward_entry(scaling, cols))
    try:
        for k, v in switches.items():
            setattr(RowNormFp8Forward, k, v)
        with tempfile.TemporaryDirectory() as tmp:
            with keeping_cubins(tmp):
                cute.compile_fp8_forward(key, "sm_90a")
            return cubin_resources(sorted(Path(tmp).rglob("*.cubin"))[0], cuobjdump())
    finally:
        for k, v in saved.items():
            setattr(RowNormFp8Forward, k, v)


def report(widths, scalings, variants, sass_dir: str | None) -> None:
    head = (f"{'cols':>5} {'scaling':>7} {'variant':>16} {'regs':>4} {'stack':>5} "
            f"{'STL/LDL':>7} {'total':>5} {'loop':>5} " + " ".join(f"{k:>9}" for k in KINDS)
            + f" {'other':>5}")
    print(head)
    for cols in widths:
        for scaling in scalings:
            for name in variants:
                if scaling == "row" and name != variants[-1]:
                    continue  # the switches touch block and MX only
                r, sass = compile_sass(scaling, cols, VARIANTS[name])
                if sass_dir:
                    Path(sass_dir).mkdir(parents=True, exist_ok=True)
                    (Path(sass_dir) / f"{scaling}-{cols}-{name}.sass").write_text(sass)
                ins = parse_sass(sass)
                loop = main_loop(ins)
                c = kinds(loop)
                print(f"{cols:>5} {scaling:>7} {name:>16} {r['registers']:>4} {r['stack']:>5} "
                      f"{r['spill_stores']:>3}/{r['spill_loads']:<3} {len(ins):>5} "
                      f"{len(loop):>5} " + " ".join(f"{c[k]:>9}" for k in KINDS)
                      + f" {c['other']:>5}", flush=True)


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
    print(f"bit-identical: {checked} (lanes, reps) cases of 32 lanes, every lane and rep")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="2048,4096,8192")
    parser.add_argument("--scalings", default="row,block,mx")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sass-dir")
    parser.add_argument("--emulate", action="store_true")
    args = parser.parse_args()
    if args.emulate:
        emulate()
        return
    report([int(w) for w in args.widths.split(",")], args.scalings.split(","),
           args.variants.split(","), args.sass_dir)


if __name__ == "__main__":
    main()
