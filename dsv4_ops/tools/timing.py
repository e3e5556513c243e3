"""CUDA-graph timing of a GPU call: what ``dsv4-ops tune`` and benchmarks/bench_decode_sms.py time with."""

from __future__ import annotations

from typing import Callable


def graph_us(fn: Callable[[], object], replays: int = 20, inner: int = 20) -> float:
    """Median microseconds of one fn() in a CUDA graph of ``inner`` calls captured and replayed on the
    current stream (under a green context: its stream, so the replays stay on its SMs); ``replays``
    timed replays after 3 untimed ones. fn runs twice eagerly first (compiles, allocator warm-up)."""
    import torch

    s = torch.cuda.current_stream()
    fn()
    fn()
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(inner):
            fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record(s)
        g.replay()
        end.record(s)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    times.sort()
    return times[len(times) // 2]
