"""The CuTe forward's heavy variants at the widths its table routes (issue 20, NOTES #69): fp32
parameters, bias and fused residual take registers beside a thread's x, and where the
compiler caps them (64 at 1024 threads a CTA, 128 at 512 or 4 CTAs of 128) they spill. Each
variant runs through the public op under every candidate launch configuration and under
cuTile's forward (the table entry removed), checked against float64 on poisoned outputs and
timed by CUDA-graph replay, in rounds, beside the copy bandwidth of the same run.

    python bench/experiments/cute_forward_variants.py --out R.json \\
        --configs '{"5120": [[128, 2, 4], [128, 1, 4]], "32768": [[1024, 1, 1], [512, 1, 1]]}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import tilenorm  # noqa: E402
from bench import common  # noqa: E402
from tilenorm import dispatch  # noqa: E402
from tilenorm.pytorch import calls  # noqa: E402
from tilenorm.pytorch.calls import ForwardCall  # noqa: E402
from tilenorm.settings import SM90  # noqa: E402

#: bf16 x of 256 MB: several times the L2.
X_BYTES = 256 << 20
#: name: (LayerNorm, parameter dtype, bias, Gemma offset, fused residual)
VARIANTS = {
    "rms w16": (False, torch.bfloat16, False, False, False),
    "rms w32": (False, torch.float32, False, False, False),
    "rms w32 offset residual": (False, torch.float32, False, True, True),
    "ln w16 b16": (True, torch.bfloat16, True, False, False),
    "ln w32 b32": (True, torch.float32, True, False, False),
    "ln w32 b32 residual": (True, torch.float32, True, False, True),
}


def route(cols: int, config: tuple[int, int, int] | None) -> None:
    """The CuTe forward at ``cols`` under ``config`` (None: cuTile's forward), every cached
    decision and prepared call dropped."""
    for widths in SM90.cute_forward.values():
        if config is None:
            widths.pop(cols, None)
        else:
            widths[cols] = tuple(config)
    dispatch.decide.cache_clear()
    calls.clear()


def case(n: int, variant: str, g: torch.Generator):
    """Operands of one variant at width ``n``, the op's launch (outputs poisoned first) and
    its bytes moved."""
    layer_norm, pdtype, has_bias, has_offset, has_residual = VARIANTS[variant]
    m = X_BYTES // (2 * n)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    r = (torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
         if has_residual else None)
    w = (1 + 0.5 * torch.randn(n, generator=g, device="cuda")).to(pdtype)
    b = (0.5 * torch.randn(n, generator=g, device="cuda")).to(pdtype) if has_bias else None
    eps = 1e-5 if layer_norm else 1e-6
    offset = 1.0 if has_offset else 0.0

    def launch():
        with torch.no_grad():
            if layer_norm:
                return tilenorm.layer_norm(x, w, b, eps=eps, residual=r,
                                           prenorm=has_residual)
            return tilenorm.rms_norm(x, w, eps=eps, offset=offset, residual=r,
                                     prenorm=has_residual)

    moved = (2 + 2 * has_residual) * m * n * 2 + (1 + has_bias) * n * w.element_size()

    def errors(out) -> dict:
        y, h = out if has_residual else (out, None)
        return common.float64_errors({"y": y, "h": h}, x, w, b, eps, layer_norm=layer_norm,
                                     offset=offset, residual=r)
    return launch, errors, moved, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", required=True,
                    help='JSON {width: [[threads, rows a CTA, CTAs an SM(, cluster)], ...]}')
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    configs = {int(k): [tuple(c) for c in v] for k, v in json.loads(args.configs).items()}
    copy = common.copy_gbps()
    record = {"device": torch.cuda.get_device_name(), "commit": common.git_commit(),
              "copy_gbps": copy, "x_bytes": X_BYTES, "rows": [], "failures": []}
    print(f"{record['device']}: copy {copy:.0f} GB/s", flush=True)
    ran = []
    run_cute = ForwardCall._run_cute
    ForwardCall._run_cute = lambda self, *a: ran.append(1) or run_cute(self, *a)
    g = torch.Generator(device="cuda").manual_seed(20)
    with tilenorm.experimental():
        for n, candidates in configs.items():
            for variant in args.variants.split(","):
                launch, errors, moved, m = case(n, variant, g)
                timed = []
                for config in [None, *candidates]:
                    name = "cutile" if config is None else "cute " + ",".join(map(str, config))
                    route(n, config)
                    ran.clear()
                    try:
                        errs = errors(launch())
                        if bool(ran) != (config is not None):
                            raise AssertionError(f"CuTe forward ran: {bool(ran)}")
                        torch.cuda.synchronize()
                        timed.append((name, config, errs, []))
                    except Exception as e:
                        record["failures"].append(f"{n} {variant} {name}: "
                                                  f"{type(e).__name__}: {e}")
                for _ in range(args.rounds):
                    for _, config, _, times in timed:
                        route(n, config)
                        times.append(common.graph_ms(launch))
                for name, _, errs, times in timed:
                    ms = sorted(times)[len(times) // 2]
                    gbps = moved / (ms * 1e-3) / 1e9
                    record["rows"].append({"M": m, "N": n, "variant": variant, "case": name,
                                           "ms": ms, "gbps": gbps,
                                           "pct_copy": 100 * gbps / copy, **errs})
                    print(f"{m:>6}x{n:<6} {variant:>24} {name:>14} {gbps:6.0f} GB/s "
                          f"{100 * gbps / copy:5.1f}%  y err {errs['y']:.1e}", flush=True)
                args.out.write_text(json.dumps(record, indent=1) + "\n")
                torch.cuda.empty_cache()
    for failure in record["failures"]:
        print("FAILED", failure)


if __name__ == "__main__":
    main()
