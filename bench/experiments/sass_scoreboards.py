"""No GPU: which waits of a kernel's sm_90a SASS cover loads issued just before them. A global
load (``LDG``) sets one of a warp's six scoreboards (the control word's write barrier); an
instruction that needs its register waits for that scoreboard to drain, that is for every
load on it, not only the one it needs. Where ptxas puts every load of a register ring on one
scoreboard, the first use of a row loaded stages ago also waits for the loads of the row
just issued: a whole memory latency a trip that the ring was meant to hide
(bench/NOTES.md #132, read off ncu's stall samples of the FP8-x row kernel).

For each instruction that waits on a scoreboard, the loads set on it since its last wait (in
code order, which is the loop's order inside an unrolled trip): a wait right behind fresh
loads of the same scoreboard is the false dependency. Control word (high 64 bits of an
instruction, bits 41-61): stall (4 bits), yield, write barrier (3), read barrier (3), wait
mask (6), reuse (4); barrier 7 is none.

    python bench/experiments/fp8_input_sass.py --widths 16384 --x fp8 --sass-dir /tmp/s
    python bench/experiments/sass_scoreboards.py /tmp/s/fp8-16384.sass
    python bench/experiments/sass_scoreboards.py --backward 18724x7168   # the RMSNorm one
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/")
_WORD = re.compile(r"/\* (0x[0-9a-f]+) \*/")


def instructions(sass: str) -> list[tuple[int, str, int, int]]:
    """(address, text, write barrier or 7, wait mask) of each instruction of ``sass``
    (``cuobjdump -sass``: the control word on the line after each instruction)."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _LINE.match(line)
        word = _WORD.search(lines[i + 1])
        if m and word:
            control = int(word.group(1), 16) >> 41
            out.append((int(m.group(1), 16), m.group(2), (control >> 5) & 7,
                        (control >> 11) & 0x3F))
    return out


def fresh_waits(sass: str) -> list[tuple[int, str, int, list[int]]]:
    """(address, text, scoreboard, addresses of the loads it waits behind) for each wait on a
    scoreboard that global loads set since its previous wait."""
    pending: dict[int, list[int]] = {}
    out = []
    for address, text, write, wait in instructions(sass):
        for board in range(6):
            if wait >> board & 1:
                if pending.get(board):
                    out.append((address, text, board, pending[board]))
                pending[board] = []
        if text.lstrip("@!P0123456789T ").startswith("LDG") and write != 7:
            pending.setdefault(write, []).append(address)
    return out


def backward_sass(rows: int, cols: int) -> str:
    """The sm_90a SASS of the CuTe RMSNorm backward the planner takes for (rows, cols), bf16
    x and weight, on an H200."""
    from bench.kernel_resources import cubin_resources, cuobjdump, keeping_cubins
    from tilenorm.launch import cute
    from tilenorm.planner import plan_cute_backward

    cute.available()
    plan = plan_cute_backward(rows, cols, itemsize=2, sm_count=132, arch=(9, 0),
                              op="rms_norm")
    if plan is None:
        raise SystemExit(f"{rows}x{cols}: the CuTe backward does not take it")
    key = cute.BackwardKey.of(plan, "bfloat16", "bfloat16", False, False)
    with tempfile.TemporaryDirectory() as tmp:
        with keeping_cubins(tmp):
            cute.compile_backward(key, "sm_90a")
        return cubin_resources(sorted(Path(tmp).rglob("*.cubin"))[0], cuobjdump())[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sass", nargs="*", type=Path, help="cuobjdump -sass text files")
    parser.add_argument("--backward", help="ROWSxCOLS: compile the RMSNorm backward's")
    args = parser.parse_args()
    texts = [(str(p), p.read_text()) for p in args.sass]
    if args.backward:
        rows, cols = map(int, args.backward.split("x"))
        texts.append((f"backward {args.backward}", backward_sass(rows, cols)))
    for name, sass in texts:
        print(f"== {name}")
        for address, text, board, loads in fresh_waits(sass):
            print(f"  {address:05x} waits SB{board} behind {len(loads)} loads "
                  f"({', '.join(f'{a:05x}' for a in loads[-4:])}): {text[:56]}")


if __name__ == "__main__":
    main()
