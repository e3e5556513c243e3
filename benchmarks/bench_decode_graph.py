"""Eager us/call of the decode step replayed from a private CUDA graph vs called directly.

    python benchmarks/bench_decode_graph.py --out DIR [--quick]

Rows per (variant, T, H), K = 512 top-k + 128 window, block size 64, eager tight loop of N
calls synchronised once at the end (bench_host_cost.eager_us):
- ``direct``: ``dsv4_ops.vllm.attention.ampere_decode`` (what ``_forward_decode`` calls);
- ``graph (keyed)``: ``decode_graph.graphed`` of ``ampere_decode``: key build + lookup + replay, the
  path ``DSV4_AMPERE_DECODE_GRAPHS=1`` takes (after its one capture);
- ``bare replay``: ``CUDAGraph.replay()`` of the same graph (the floor of the graph path);
- ``key only``: the key build alone (host Python, no GPU work);
plus ``first_call_ms`` (eager + capture + instantiate, once per key) and the cache's
hits / captures (a graph row with captures != 1 means the replay path was not measured).
Floors and predictions: docs/journal/notes.md, "private CUDA graph of the decode step".
Writes decode_graph.{json,md} under DIR.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host_cost import eager_us  # noqa: E402
from common import parse_args, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops.layout import min_page_bytes  # noqa: E402
from dsv4_ops.vllm import attention as vattn  # noqa: E402
from dsv4_ops.vllm import decode_graph as dg  # noqa: E402

D, K1, K2, BS = 512, 512, 128, 64
VARIANTS = ("portable", "native")


def make_args(T, H, seed=0):
    """Positional ampere_decode arguments (random record bytes: values matter only for speed)."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for nb in (256, 64):
        c = torch.randint(0, 120, (nb, min_page_bytes(BS)), generator=g, dtype=torch.uint8)
        caches.append(c.view(nb, BS, -1).cuda())
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")
    swa = torch.randint(0, 64 * BS, (T, 1, K2), generator=g, dtype=torch.int32).cuda()
    topk = torch.randint(0, 256 * BS, (T, 1, K1), generator=g, dtype=torch.int32).cuda()
    swa_lens = torch.full((T,), K2, dtype=torch.int32, device="cuda")
    topk_lens = torch.full((T,), K1, dtype=torch.int32, device="cuda")
    sink = torch.randn(H, generator=g).cuda()
    return [q, out, caches[1], swa, swa_lens, BS, caches[0], topk, topk_lens, BS, sink, D ** -0.5]


def bench(args):
    rows = []
    n = 200 if args.quick else 500
    sync = torch.cuda.synchronize
    for v in VARIANTS:
        if v == "native" and torch.cuda.get_device_capability() < (8, 9):
            continue
        os.environ["DSV4_AMPERE_IMPL"] = v
        for T in (1, 8, 64):
            for H in (8, 64):
                base = {"variant": v, "T": T, "H": H}
                try:
                    a = make_args(T, H, seed=T + H)
                    cache = dg.GraphCache(name=f"bench T{T} H{H}")
                    vattn.ampere_decode(*a)  # compile outside the first-call timer
                    sync()
                    t0 = time.perf_counter()
                    dg.graphed(cache, vattn.ampere_decode, *a)
                    sync()
                    first_ms = (time.perf_counter() - t0) * 1e3
                    graph = next(iter(cache.graphs.values()))
                    paths = {
                        "direct": lambda: vattn.ampere_decode(*a),
                        "graph (keyed)": lambda: dg.graphed(cache, vattn.ampere_decode, *a),
                        "bare replay": graph.replay,
                        "key only": lambda: dg.args_key(a) + (dg.context_key(0),),
                    }
                except Exception as exc:  # noqa: BLE001 - one failing shape must not hide the others
                    traceback.print_exc()
                    rows.append({**base, "path": "setup", "error": repr(exc)[:120]})
                    continue
                for name, fn in paths.items():
                    row = {**base, "path": name}
                    try:
                        row["eager_us"] = eager_us(fn, n, sync)
                        if name == "graph (keyed)":
                            row["first_call_ms"] = first_ms
                            row["hits"], row["captures"] = cache.stats["hits"], cache.stats["captures"]
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = repr(exc)[:120]
                        traceback.print_exc()
                    rows.append(row)
                direct = next((r.get("eager_us") for r in rows[-4:] if r["path"] == "direct"), None)
                for r in rows[-4:]:
                    if direct and r.get("eager_us") and r["path"] != "direct":
                        r["direct/path"] = direct / r["eager_us"]
    os.environ.pop("DSV4_AMPERE_IMPL", None)
    write_results("decode_graph", args.out, rows,
                  ["variant", "T", "H", "path", "eager_us", "direct/path", "first_call_ms", "hits", "captures",
                   "error"],
                  notes="eager_us: N calls back to back, one synchronize at the end, per call (best of 3). "
                        "graph (keyed): DSV4_AMPERE_DECODE_GRAPHS's path (key + lookup + replay); bare replay: "
                        "CUDAGraph.replay() alone; key only: host Python of the key. K1 = 512, K2 = 128. "
                        "Goal: whole step at T = 1, H = 8 <= 40 us eager.")
    return rows


def main():
    args = parse_args(__doc__.splitlines()[0])
    if not torch.cuda.is_available():
        print("bench_decode_graph: needs a CUDA GPU; nothing to do")
        return 0
    try:
        bench(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
