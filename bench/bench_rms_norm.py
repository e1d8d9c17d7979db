"""RMSNorm benchmark: tilenorm beside every available peer, in one process.

    python bench/bench_rms_norm.py                      # the full sweep, bf16
    python bench/bench_rms_norm.py --shapes 32768x4096,131072x1024 --dtype float16

For each provider and shape: kernel time under CUDA-graph replay and eager time with host
overhead, forward and backward (dx and dweight, reduction included), as GB/s of the bytes the
op must move; the relative error against a float64 reference; host microseconds per call on a
tiny shape; and the device-to-device copy bandwidth of the same run. Writes a table to stdout,
bench/results/<device>-<date>.json and a PNG plot beside it.

Every provider does the same work: the forward writes y and rstd (the training forward), the
backward reads x, dy, weight and the forward's rstd (or mean-free equivalent) and writes dx
and dweight.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from tilenorm.pytorch import reference  # noqa: E402

SWEEP_N = [128, 256, 512, 1024, 2048, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072]
LATENCY_SHAPES = [(32768, 128), (4096, 4096)]
SWEEP_BYTES = 256 << 20
EPS = 1e-6


def sweep_shapes() -> list[tuple[int, int]]:
    """x of at least 256 MB in bf16 for every N of the sweep, then the latency shapes."""
    return [(max(1, SWEEP_BYTES // (2 * n)), n) for n in SWEEP_N] + LATENCY_SHAPES


class Provider:
    name = "provider"

    def prepare(self, x, w, dy) -> common.Prepared:
        raise NotImplementedError


class Tilenorm(Provider):
    name = "tilenorm"

    def __init__(self):
        import tilenorm

        self.fwd, self.bwd = tilenorm.rms_norm_forward, tilenorm.rms_norm_backward

    def prepare(self, x, w, dy):
        _, _, rstd = self.fwd(x, w, EPS)

        def bwd():
            dx, _, dw = self.bwd(dy, x, w, rstd)
            return dx, dw

        return common.Prepared(lambda: self.fwd(x, w, EPS), bwd,
                               lambda: (self.fwd(x, w, EPS)[0], *bwd()))


class TorchCompile(Provider):
    """torch.compile of the reference forward (y, rstd) and backward (dx, dweight), compiled
    per shape (recompile limit raised so no shape falls back to eager)."""

    name = "torch.compile"

    def __init__(self):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 1024
        torch._dynamo.config.recompile_limit = 1024
        def fwd(x, w):
            y, _, _, rstd = reference.norm_forward(x, w, None, EPS)
            return y, rstd

        def bwd(dy, x, w, rstd):
            dx, _, dw, _ = reference.norm_backward(dy, None, x, w, None, None, rstd)
            return dx, dw

        self.fwd = torch.compile(fwd, dynamic=False)
        self.bwd = torch.compile(bwd, dynamic=False)

    def prepare(self, x, w, dy):
        _, rstd = self.fwd(x, w)
        return common.Prepared(lambda: self.fwd(x, w), lambda: self.bwd(dy, x, w, rstd),
                               lambda: (self.fwd(x, w)[0], *self.bwd(dy, x, w, rstd)))


class TorchEager(Provider):
    """torch.nn.functional.rms_norm and its autograd backward."""

    name = "torch eager"

    def prepare(self, x, w, dy):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        n = x.shape[-1]
        y = torch.nn.functional.rms_norm(xg, (n,), wg, EPS)

        def bwd():
            return torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)

        return common.Prepared(lambda: torch.nn.functional.rms_norm(xg, (n,), wg, EPS), bwd,
                               lambda: (torch.nn.functional.rms_norm(xg, (n,), wg, EPS), *bwd()))


class Quack(Provider):
    """quack.rmsnorm.rmsnorm_fwd (storing rstd) and rmsnorm_bwd."""

    name = "quack"

    def __init__(self):
        from quack.rmsnorm import rmsnorm_bwd, rmsnorm_fwd

        self.fwd, self.bwd = rmsnorm_fwd, rmsnorm_bwd

    def prepare(self, x, w, dy):
        _, _, rstd = self.fwd(x, w, eps=EPS, store_rstd=True)

        def fwd():
            return self.fwd(x, w, eps=EPS, store_rstd=True)

        def bwd():
            return self.bwd(x, w, dy, rstd)[:2]

        return common.Prepared(fwd, bwd, lambda: (fwd()[0], *bwd()))


class _Liger(Provider):
    """Liger's rms_norm_forward / rms_norm_backward ("llama" casting, dy not overwritten)."""

    module = ""

    def __init__(self):
        import importlib

        ops = importlib.import_module(self.module)
        self.fwd, self.bwd = ops.rms_norm_forward, ops.rms_norm_backward

    def prepare(self, x, w, dy):
        _, x2d, rstd, block, warps, casting = self.fwd(x, w, EPS, 0.0, "llama", None)

        def fwd():
            return self.fwd(x, w, EPS, 0.0, "llama", None)

        def bwd():
            return self.bwd(dy, x2d, w, rstd, 0.0, casting, block, warps, False, None)

        return common.Prepared(fwd, bwd, lambda: (fwd()[0], *bwd()))


class LigerTriton(_Liger):
    name = "liger"
    module = "liger_kernel.ops.rms_norm"


class LigerCutile(_Liger):
    name = "liger cuTile"
    module = "liger_kernel.ops.cutile.ops.rms_norm"


class TileGym(Provider):
    """tilegym.ops.cutile.rms_norm: its forward, and its standalone persistent backward."""

    name = "tilegym"

    def __init__(self):
        import importlib

        # the package re-exports a function named rms_norm over the module of that name
        self.ops = importlib.import_module("tilegym.ops.cutile.rms_norm")

    def prepare(self, x, w, dy):
        n = x.shape[-1]
        rstd = self.ops.compute_rms_norm_rstd_torch(x, EPS)

        def fwd():
            return self.ops.rms_norm(x, (n,), w, EPS)

        def bwd():
            return self.ops.rms_norm_backward(x, dy, w, rstd)

        return common.Prepared(fwd, bwd, lambda: (fwd(), *bwd()))


PROVIDERS: dict[str, Callable[[], Provider]] = {
    "tilenorm": Tilenorm,
    "quack": Quack,
    "liger": LigerTriton,
    "liger cuTile": LigerCutile,
    "tilegym": TileGym,
    "torch.compile": TorchCompile,
    "torch eager": TorchEager,
}


def bytes_moved(m: int, n: int, itemsize: int, w_itemsize: int) -> tuple[int, int]:
    """(forward, backward) bytes that must move: fwd reads x, w and writes y, rstd; bwd reads
    x, dy, w, rstd and writes dx, dweight."""
    fwd = 2 * m * n * itemsize + n * w_itemsize + 4 * m
    bwd = 3 * m * n * itemsize + 2 * n * w_itemsize + 4 * m
    return fwd, bwd


def measure(provider: Provider, m: int, n: int, dtype: torch.dtype, modes: list[str]
            ) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(m * 131 + n)
    x = torch.randn(m, n, generator=g, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, generator=g, device="cuda", dtype=dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    prepared = provider.prepare(x, w, dy)
    y, dx, dw = prepared.outputs()
    # y and dx on the first rows, dweight over every row: float64 (tilenorm.testing).
    err = common.float64_errors({"y": y, "dx": dx, "dweight": dw}, x, w, eps=EPS, dy=dy,
                                rows=slice(0, max(1, (1 << 24) // n)))
    fwd_err = err["y"]
    bwd_err = max(err["dx"], err["dweight"])
    del y, dx, dw
    fwd_bytes, bwd_bytes = bytes_moved(m, n, x.element_size(), w.element_size())
    return common.timed_rows(prepared, fwd_bytes, bwd_bytes, modes, {
        "op": "rms_norm", "dtype": str(dtype)[6:], "M": m, "N": n, "provider": provider.name,
        "fwd_err": fwd_err, "bwd_err": bwd_err})


def overhead(provider: Provider, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1024)
    x = torch.randn(256, 1024, generator=g, device="cuda", dtype=dtype)
    dy = torch.randn(256, 1024, generator=g, device="cuda", dtype=dtype)
    prepared = provider.prepare(x, torch.ones(1024, device="cuda", dtype=dtype), dy)
    return {"op": "rms_norm", "provider": provider.name,
            "fwd_host_us": common.host_us(prepared.fwd),
            "bwd_host_us": common.host_us(prepared.bwd)}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if r["op"] == "rms_norm" and r["mode"] == "graph"
            and r["N"] in SWEEP_N and (r["M"], r["N"]) not in LATENCY_SHAPES]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, key, title in ((axes[0], "fwd_gbps", "forward"), (axes[1], "bwd_gbps", "backward")):
        for name in sorted({r["provider"] for r in rows}):
            pts = sorted((r["N"], r[key]) for r in rows if r["provider"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(record["copy_gbps"], color="k", linestyle="--", label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (row width); M x N >= 256 MB")
        ax.set_title(f"RMSNorm {title}, {record['device']}, CUDA-graph kernel time")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help="comma-separated MxN list (default: the sweep)")
    parser.add_argument("--providers", help="comma-separated subset of: " + ", ".join(PROVIDERS))
    common.add_run_args(parser)
    args = parser.parse_args(argv)
    dtype = common.DTYPES[args.dtype]
    shapes = common.parse_shapes(args.shapes) if args.shapes else sweep_shapes()
    modes = args.modes.split(",")

    providers, absent = [], {}
    for name in (args.providers.split(",") if args.providers else PROVIDERS):
        try:
            providers.append(PROVIDERS[name]())
        except Exception as e:  # a missing peer is reported, not fatal
            absent[name] = f"{type(e).__name__}: {e}"
    for name, why in absent.items():
        print(f"absent: {name}: {why}")

    record = common.new_record(args)
    record["absent"] = absent
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a convenience
        def tqdm(it, **_):
            return it

    # Host overhead first: a peer whose graph capture fails later cannot disturb it.
    for provider in providers:
        try:
            record["overhead"].append(overhead(provider, dtype))
        except Exception as e:
            record["failures"].append({"provider": provider.name, "overhead": True,
                                       "error": f"{type(e).__name__}: {e}"})
    jobs = [(p, s) for s in shapes for p in providers]
    for provider, (m, n) in tqdm(jobs, desc="rms_norm sweep", file=sys.stderr):
        try:
            record["rows"] += measure(provider, m, n, dtype, modes)
        except Exception as e:
            record["failures"].append({"provider": provider.name, "M": m, "N": n,
                                       "error": f"{type(e).__name__}: {e}"[:500]})
            traceback.print_exc(limit=2)
        torch.cuda.empty_cache()
        if args.out:  # a run cut short still leaves what it measured
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    path = common.write_record(record, args.out)
    try:
        plot(record, path.with_suffix(".png"))
    except Exception as e:
        print(f"plot skipped: {type(e).__name__}: {e}")
    common.print_table(record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
