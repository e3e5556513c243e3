"""One sparse-prefill launch at the prefill benchmark's shape (s_q 4096, K 640, random workload) for Nsight
Compute: a warm-up launch (compiles), then the launch to profile (``--launch-skip 1
--launch-count 1``). benchmarks/device/sparse_prefill.sh runs it under ncu for the fastest
2-D and the fastest split-d config of the benchmark's H = 64 rows (``--pick``).

    python benchmarks/sparse_prefill_ncu.py --config 32,4 [--H 64]
    python benchmarks/sparse_prefill_ncu.py --pick RESULTS.json   # prints "bh,i" lines to profile
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pick(path: str) -> None:
    """The fastest 2-D and the fastest split-d config at H = 64, random workload, H200 smem."""
    from dsv4_ops.csrc_triton import sparse_prefill as pk

    rows = [r for r in json.load(open(path))["rows"]
            if r["H"] == 64 and r["workload"] == "random" and r["kernel"].startswith("prefill bh")
            and "A100" not in r["kernel"] and isinstance(r.get("us"), float)]
    best = {}
    for r in rows:
        bh, i = int(r["kernel"].split()[1][2:]), int(r["kernel"].split("#")[1])
        kind = "split" if pk.CANDIDATES[bh][i].get("SPLIT") else "2d"
        if kind not in best or r["us"] < best[kind][0]:
            best[kind] = (r["us"], bh, i)
    for kind in sorted(best):
        print(f"{best[kind][1]},{best[kind][2]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="block_h,i of CANDIDATES")
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--pick", help="results JSON of bench_sparse_prefill.py")
    a = p.parse_args()
    if a.pick:
        pick(a.pick)
        return 0
    import torch

    import bench_sparse_prefill as b
    from dsv4_ops import sparse_prefill

    bh, i = (int(x) for x in a.config.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, kv, idx, lens = b.random_case(a.H, g)
    sink = torch.randn(a.H, device="cuda", generator=g)
    out = torch.empty_like(q)
    for _ in range(2):
        sparse_prefill.sparse_mla_prefill(q, kv, idx, lens, sink, b.SM_SCALE, out=out, config=(bh, i))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
