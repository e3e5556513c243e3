"""Shared benchmark harness: timing, stamping, and the JSON + Markdown + PNG writers.

Every benchmark writes benchmarks/results/<name>.{json,md,png} (or under --out) stamped with
GPU, torch, triton, commit and date, and quotes ratios against a baseline timed in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from typing import Callable, Dict, List, Optional, Sequence

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=RESULTS_DIR, help="folder for the JSON/Markdown/PNG results")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (smoke test)")
    return p.parse_args()


def stamp() -> Dict[str, str]:
    import triton

    # The device tool copies the working tree with stale git metadata: pass the commit in
    # (DSV4_BENCH_COMMIT=$(git rev-parse --short HEAD), plus "+dirty" for uncommitted edits).
    commit = os.environ.get("DSV4_BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "capability": "sm_%d%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "-",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "impl": os.environ.get("DSV4_AMPERE_IMPL", "auto"),
    }


def time_us(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median microseconds of fn(), events-timed by triton.testing.do_bench (L2 flushed)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_graph_us(fn: Callable[[], object], replays: int = 50, inner: int = 20) -> float:
    """Median microseconds of one fn() inside a CUDA graph that captured it ``inner`` times.

    Repeating the call inside one graph measures what a kernel costs inside a captured model
    step (the ~0.9 us in-graph launch gap included), not the host's cudaGraphLaunch latency,
    which timing a single-call graph between two events would add (~8 us here). L2 is warm.
    """
    from dsv4_ops.testing import capture_graph

    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():
        g, _ = capture_graph(lambda: [fn() for _ in range(inner)])
    else:  # a green-context stream (in_green_context): captured on it, so the replays stay on its SMs
        for _ in range(2):
            fn()
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            [fn() for _ in range(inner)]
    for _ in range(3):
        g.replay()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int) -> float:
    """Device copy of nbytes (read + written = 2 * nbytes) in GB/s, median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3


def markdown_table(rows: List[Dict[str, object]], columns: Sequence[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1000 else (f"{v:.0f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, out_dir: str, rows: List[Dict[str, object]], columns: Sequence[str],
                  notes: str = "", plot: Optional[Callable[[str], None]] = None) -> str:
    """Write <name>.json and <name>.md (and <name>.png via plot(path)); return the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    meta = stamp()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "notes": notes}, f, indent=1)
    header = ", ".join(f"{k} {v}" for k, v in meta.items())
    md = f"### {name}\n\n{header}\n\n{markdown_table(rows, columns)}\n"
    if notes:
        md += f"\n{notes}\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    if plot is not None:
        try:
            plot(os.path.join(out_dir, f"{name}.png"))
        except ImportError:
            pass
    print(md)
    return md


def in_green_context(sms: int, fn: Callable[[], object]):
    """fn() run on ``sms`` SMs of the current device: a driver green-context stream made current
    (benchmarks/green_ctx.GreenStream; torch 2.11's GreenContext.set_context() does not confine
    kernels), DSV4_AMPERE_SMS set to the granted count so plans are made for it. Raises
    green_ctx.GreenContextError where the work cannot be confined. CUDA graphs must be captured
    on the current stream (``torch.cuda.graph(g, stream=torch.cuda.current_stream())``) for
    their replays to stay on those SMs."""
    from green_ctx import GreenStream

    with GreenStream(sms):
        return fn()
