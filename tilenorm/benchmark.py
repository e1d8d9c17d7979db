"""GPU timing helpers: copy bandwidth, CUDA-graph kernel time, eager time, host overhead.

Used by ``python -m tilenorm`` and by the benchmark suite under ``bench/``.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch


def copy_gbps(nbytes: int = 1 << 30, repeats: int = 50) -> float:
    """Device-to-device copy bandwidth, bytes read + written over time, timed with events
    (graph replay under-reports a copy this large: FINDINGS.md)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def graph_ms(fn, calls_per_graph: int = 10, repeats: int = 15) -> float:
    """Kernel time of one ``fn()`` under CUDA-graph replay: ``calls_per_graph`` calls captured
    back to back, replayed ``repeats`` times after a warm-up; median per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = _capture(fn, calls_per_graph)
    except torch.AcceleratorError as error:
        # torch's own norms fail the first capture of a process with
        # cudaErrorStreamCaptureInvalidated and capture at every later shape (bench/NOTES.md
        # #121): one retry; any other error, or a second failure, is the provider's.
        if "during capture" not in str(error):
            raise
        torch.cuda.synchronize()
        graph = _capture(fn, calls_per_graph)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    del graph
    return statistics.median(times)


def _capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def eager_ms(fn, calls: int = 10, repeats: int = 15) -> float:
    """Time of one eager ``fn()`` including its host overhead: events around ``calls`` calls
    issued back to back; median per call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def host_us(fn, calls: int = 3000, rounds: int = 5) -> float:
    """Host microseconds per call of ``fn()`` on a shape small enough that the host, not the
    GPU, is the bottleneck: the median over ``rounds`` rounds of the wall time of
    ``calls / rounds`` calls followed by one synchronize. Garbage is collected first, so a
    collection left over from earlier work does not land in one provider's rounds."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    per_round = max(1, calls // rounds)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        times.append(elapsed / per_round * 1e6)
    return statistics.median(times)
