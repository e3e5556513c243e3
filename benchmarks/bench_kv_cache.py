"""Benchmark: paged fp8 KV cache gather (op 3) and insert, against a device copy of the same bytes.

Bytes a row: gather reads 584 (576 data + 8 scale) and writes 1024 (bf16 [512]) = 1608 B;
insert reads 1024 and writes 584 = 1608 B. Slots are random over a ~1.1 GB cache (~18x the
H200's 60 MB L2); timings are do_bench medians with the L2 flushed, plus CUDA-graph replay
for the 640-row (one decode token: 512 top-k + 128 window) latency.

Floors on an H200 (4.26 TB/s device copy, ~0.9 us a kernel in graph replay, 3.5 us a launch
outside a graph):
    rows      bytes      bandwidth floor   launch floor
    640       1.03 MB    0.24 us           0.9 us (graph) / 3.5 us (eager)
    16K       26.3 MB    6.2 us
    64K       105 MB     24.7 us
    1M        1.69 GB    396 us
Prediction: gather 75-85% of copy bandwidth at >= 64K rows (random 576-byte runs are whole
32-byte sectors; the 8-byte scale row costs a 32-byte sector, ~2% extra traffic); insert
65-80% (partial-sector scale writes). 640 rows: launch-bound, ~2 us in a graph, ~4 us eager.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, time_graph_us, time_us, write_results  # noqa: E402

from dsv4_ops import kv_cache, layout  # noqa: E402
from dsv4_ops.csrc_triton import kv_cache as kernels  # noqa: E402

BYTES_PER_ROW = layout.RECORD_BYTES + 2 * layout.HEAD_DIM  # 1608
BLOCK_SIZE = 64
CACHE_BYTES = 1 << 30


def copy_us(total_bytes: int) -> float:
    """A device copy moving total_bytes (half read, half written)."""
    half = max(total_bytes // 2, 1)
    src = torch.empty(half, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return time_us(lambda: dst.copy_(src))


def sweep_configs(cache, cap, sizes, out_dir):
    """Time every launch config (portable) at each row count; set the dicts to the config whose
    worst ratio to a device copy over ``sizes`` is best, and write kv_cache_configs.{json,md}.

    The launchers read INSERT_CONFIG / GATHER_CONFIG at every call, so updating them here is
    enough; csrc_triton/kv_cache.py is then edited by hand to the chosen values. Tiles that
    spill on sm_80 (TOKENS = 16: `python -m dsv4_ops.aot`) are left out.
    """
    grid = {"gather": (kernels.GATHER_CONFIG, "ROWS", (2, 4, 8, 16)),
            "insert": (kernels.INSERT_CONFIG, "TOKENS", (2, 4, 8))}
    rows = []
    for op, (table, key, per_prog) in grid.items():
        scores = {}
        for n in sizes:
            total = n * BYTES_PER_ROW
            c_us = copy_us(total)
            slots = torch.randint(0, cap, (n,), device="cuda")
            uniq = torch.randperm(cap, device="cuda")[:n]
            kv = torch.randn(n, layout.HEAD_DIM, device="cuda").to(torch.bfloat16)
            out = torch.empty(n, layout.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            for p in per_prog:
                for warps in (2, 4):
                    table.update({key: p, "num_warps": warps})
                    fn = ((lambda: kv_cache.kv_cache_gather(cache, slots, BLOCK_SIZE, out=out, variant="portable"))
                          if op == "gather" else
                          (lambda: kv_cache.kv_cache_insert(kv, cache, uniq, BLOCK_SIZE, variant="portable")))
                    us = time_us(fn)
                    scores.setdefault((p, warps), []).append(c_us / us)
                    rows.append({"op": op, "rows": n, "per program": p, "num_warps": warps, "us": us,
                                 "GB/s": total / us / 1e3, "vs copy": c_us / us})
        best = max(scores, key=lambda k: min(scores[k]))
        table.update({key: best[0], "num_warps": best[1]})
        for r in rows:
            if r["op"] == op:
                r["chosen"] = (r["per program"], r["num_warps"]) == best
        print(f"{op}: chosen {key}={best[0]}, num_warps={best[1]} (worst vs copy {min(scores[best]):.3f})", flush=True)
    write_results("kv_cache_configs", out_dir, rows,
                  ["op", "rows", "per program", "num_warps", "us", "GB/s", "vs copy", "chosen"],
                  "Portable variant; per-program rows (gather) or tokens (insert) and warps; 'chosen' has the "
                  "best worst-case ratio to a device copy over the row counts, and is what the main table ran.")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    page = layout.vllm_page_bytes(BLOCK_SIZE)
    num_blocks = CACHE_BYTES // page
    cap = num_blocks * BLOCK_SIZE
    cache = torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device="cuda")
    # fill every record with real data, so gather decodes what insert writes
    chunk = 1 << 18
    for start in range(0, cap, chunk):
        n = min(chunk, cap - start)
        kv = torch.randn(n, layout.HEAD_DIM, device="cuda").to(torch.bfloat16)
        kv_cache.kv_cache_insert(kv, cache, torch.arange(start, start + n, device="cuda"), BLOCK_SIZE)
    torch.cuda.synchronize()

    if not args.quick:
        sweep_configs(cache, cap, (65536, 1 << 20), args.out)
    variants = ["portable"] + (["native"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    row_counts = [640, 16384] if args.quick else [640, 16384, 65536, 1 << 20]
    rows = []
    for n in row_counts:
        total = n * BYTES_PER_ROW
        c_us = copy_us(total)
        c_gbs = total / c_us / 1e3
        slots = torch.randint(0, cap, (n,), device="cuda")
        uniq = torch.randperm(cap, device="cuda")[:n]
        kv = torch.randn(n, layout.HEAD_DIM, device="cuda").to(torch.bfloat16)
        out = torch.empty(n, layout.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        for variant in variants:
            def gather():
                kv_cache.kv_cache_gather(cache, slots, BLOCK_SIZE, out=out, row_offset=0, variant=variant)

            def insert():
                kv_cache.kv_cache_insert(kv, cache, uniq, BLOCK_SIZE, variant=variant)

            for op, fn in (("gather", gather), ("insert", insert)):
                us = time_us(fn)
                gbs = total / us / 1e3
                row = {"op": op, "variant": variant, "rows": n, "us": us, "GB/s": gbs,
                       "copy us": c_us, "copy GB/s": c_gbs, "vs copy": gbs / c_gbs}
                if n <= 640:
                    row["graph us"] = time_graph_us(fn)  # in-graph cost: what a decode step pays
                rows.append(row)
                print(row, flush=True)

    notes = (f"Cache: {num_blocks} blocks x {page} B (block_size {BLOCK_SIZE}, {cap} slots, "
             f"{num_blocks * page / 1e9:.2f} GB); random slots (gather: with repeats; insert: unique). "
             f"Bytes a row: {BYTES_PER_ROW} (584 read + 1024 written for gather, the reverse for insert); "
             "copy = torch copy_ of the same total bytes in the same run. 'graph us' = CUDA-graph replay "
             "(L2 warm). Goal: >= 0.70 of copy bandwidth at >= 64K rows.")

    def plot(path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for op in ("gather", "insert"):
            for variant in variants:
                pts = [(r["rows"], r["GB/s"]) for r in rows if r["op"] == op and r["variant"] == variant]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op} [{variant}]")
        cp = sorted({(r["rows"], r["copy GB/s"]) for r in rows})
        ax.plot([p[0] for p in cp], [p[1] for p in cp], "k--", label="device copy")
        ax.set_xscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("GB/s (1608 B a row)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    write_results("kv_cache", args.out, rows,
                  ["op", "variant", "rows", "us", "GB/s", "copy us", "copy GB/s", "vs copy", "graph us"],
                  notes=notes, plot=plot)


if __name__ == "__main__":
    main()
