"""No GPU: the persistent cluster forward's row loop read off its SASS (bench/NOTES.md #123):
per entry and feature set, the registers, stack, spill stores / loads, and the instructions of
the loop (``fp8_block_sass.main_loop``: the backward branch of the largest span) a thread
issues an element, the loop being ``max(2, stages)`` row groups unrolled; and the counts of
the kinds ``fp8_block_sass.KINDS`` names. The entries default to the variants of
``bench/experiments/variants/layer-norm-wide-h200.json``; the feature sets to LayerNorm with
fp32 weight and bias, bf16 x.

    python bench/experiments/cluster_forward_sass.py [--arch sm_90a]
        [--entries 32768:256,1,2,4,2;65536:256,1,2,8,2] [--features all] [--sass-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.fp8_block_sass import KINDS, kinds, main_loop, parse_sass  # noqa: E402

#: (cols, entry): layer-norm-wide-h200.json's persistent entries.
ENTRIES = ((32768, (256, 1, 2, 4, 2)), (65536, (256, 1, 2, 8, 2)), (131072, (256, 1, 1, 8, 3)),
           (32768, (256, 1, 1, 2, 3)), (65536, (256, 2, 1, 8, 3)), (131072, (256, 1, 1, 8, 2)),
           (32768, (256, 1, 2, 4, 3)), (65536, (256, 1, 2, 8, 3)), (131072, (512, 1, 1, 8, 2)))
#: name: (layer_norm, weight dtype, bias, offset).
FEATURES = {
    "ln w32 b32": (True, "float32", True, False),
    "ln w16 b16": (True, "bfloat16", True, False),
    "ln no affine": (True, None, False, False),
    "rms w32": (False, "float32", False, False),
    "rms w16 offset": (False, "bfloat16", False, True),
    "rms no weight": (False, None, False, False),
}


def loop_counts(cols: int, entry: tuple[int, ...], features: tuple, arch: str
                ) -> tuple[dict, str, list]:
    """Resources, SASS and the row loop's instructions of one persistent variant."""
    from bench.kernel_resources import cubin_resources, cuobjdump, keeping_cubins
    from tilenorm.launch import cute

    layer_norm, weight, bias, offset = features
    key = cute.ForwardKey("bfloat16", weight, bias, layer_norm, offset, False, cols, *entry)
    with tempfile.TemporaryDirectory() as tmp:
        with keeping_cubins(tmp):
            cute.compile_forward(key, arch)
        resources, sass = cubin_resources(sorted(Path(tmp).rglob("*.cubin"))[0], cuobjdump())
    return resources, sass, main_loop(parse_sass(sass))


def parse_entries(arg: str) -> list[tuple[int, tuple[int, ...]]]:
    """``cols:t,r,c,k,s;...`` -> [(cols, entry)]."""
    out = []
    for item in arg.split(";"):
        cols, _, entry = item.partition(":")
        out.append((int(cols), tuple(int(v) for v in entry.split(","))))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--entries", type=parse_entries, default=list(ENTRIES))
    ap.add_argument("--features", default="ln w32 b32",
                    help=f"comma-separated of {list(FEATURES)}, or all")
    ap.add_argument("--sass-dir", help="also keep each variant's SASS there")
    args = ap.parse_args(argv)
    names = list(FEATURES) if args.features == "all" else args.features.split(",")
    print(f"{'cols':>6} {'entry':>18} {'features':>14} {'regs':>4} {'stack':>5} {'STL/LDL':>7} "
          f"{'loop':>5} {'/elem':>6} " + " ".join(f"{k:>9}" for k in KINDS)
          + f" {'other':>5}")
    for cols, entry in args.entries:
        threads, rows, _, cluster, stages = entry
        elements = max(2, stages) * rows * cols // cluster // threads
        for name in names:
            r, sass, loop = loop_counts(cols, entry, FEATURES[name], args.arch)
            if args.sass_dir:
                Path(args.sass_dir).mkdir(parents=True, exist_ok=True)
                label = f"{cols}-{'-'.join(map(str, entry))}-{name.replace(' ', '-')}"
                (Path(args.sass_dir) / f"{label}.sass").write_text(sass)
            c = kinds(loop)
            print(f"{cols:>6} {','.join(map(str, entry)):>18} {name:>14} {r['registers']:>4} "
                  f"{r['stack']:>5} {r['spill_stores']:>3}/{r['spill_loads']:<3} "
                  f"{len(loop):>5} {len(loop) / elements:>6.2f} "
                  + " ".join(f"{c[k]:>9}" for k in KINDS) + f" {c['other']:>5}", flush=True)


if __name__ == "__main__":
    main()
