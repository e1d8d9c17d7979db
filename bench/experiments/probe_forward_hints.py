"""Probe of cuTile load/store hints on a plain 2-D RMSNorm forward (bench/NOTES.md, #9):
load ``latency``, TMA on or off for loads and stores, ``num_worker_warps`` and occupancy.
Prints one JSON line per variant with GB/s and the error against fp32 torch per shape.

    python bench/experiments/probe_forward_hints.py [max variants]

One-off (added at ebef680): its kernel is its own, not tilenorm's, so it still runs as it
did; the result is NOTES #9, its lead (TMA-free stores) #10.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import cuda.tile as ct
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tilenorm.benchmark import graph_ms  # noqa: E402

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO
SHAPES = [(32768, 4096), (1 << 20, 128), (16384, 8192), (65536, 1024)]
TILE_ELEMENTS = 8192


def make_kernel_fn(latency, tma_load, tma_store):
    def rms_forward_probe(x, w, y, rstd, eps: float, inv_n: float, TILE_M: ConstInt,
                          TILE_N: ConstInt):
        row_tiles = ct.num_tiles(x, axis=0, shape=(TILE_M, TILE_N))
        wt = ct.load(w, index=(0,), shape=(TILE_N,), padding_mode=ZERO).astype(ct.float32)
        wt = wt.reshape((1, TILE_N))
        for t in range(ct.bid(0), row_tiles, ct.num_blocks(0)):
            xt = ct.load(x, index=(t, 0), shape=(TILE_M, TILE_N), padding_mode=ZERO,
                         latency=latency, allow_tma=tma_load).astype(ct.float32)
            r = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * inv_n + eps)
            ct.store(y, index=(t, 0), tile=(xt * r * wt).astype(y.dtype), allow_tma=tma_store)
            ct.store(rstd, index=(t,), tile=r.reshape((TILE_M,)))

    return rms_forward_probe


def measure(kernel, occupancy: int, m: int, n: int) -> tuple[int, float]:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(m, device="cuda")
    tile_m = max(1, TILE_ELEMENTS // n)
    grid = (min(-(-m // tile_m), 132 * occupancy), 1, 1)

    def launch():
        ct.launch(torch.cuda.current_stream().cuda_stream, grid, kernel,
                  (x, w, y, rstd, 1e-6, 1.0 / n, tile_m, n))

    launch()
    ref = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6) * w.float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    return round(2 * m * n * 2 / graph_ms(launch) / 1e6), err


def main() -> None:
    variants = list(itertools.product((None, 10), (None, False), (None, False),
                                      ((2, None), (2, 8), (4, None), (1, 8), (2, 4))))
    if len(sys.argv) > 1:
        variants = variants[:int(sys.argv[1])]
    for latency, tma_load, tma_store, (occupancy, warps) in variants:
        hints = {"occupancy": occupancy}
        if warps:
            hints["num_worker_warps"] = warps
        kernel = ct.kernel(make_kernel_fn(latency, tma_load, tma_store), **hints)
        row = {"latency": latency, "tma_load": tma_load, "tma_store": tma_store, **hints}
        for m, n in SHAPES:
            row[f"{m}x{n}"], row[f"err {n}"] = measure(kernel, occupancy, m, n)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
