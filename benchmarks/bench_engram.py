"""Benchmark: Engram lookup (op ``engram_lookup``) from a pinned host table over UVA and from a
device table, against bandwidths measured in the same run.

A row: 256 E4M3 bytes + 8 UE8M0 bytes read (264 B; over PCIe the 8-byte scale read costs at
least a 32-byte sector, so ~288 B move), 512 bf16 bytes written on the device. Rows are
uniform random over the whole table (4 GiB host, 4 GiB device by default: far past the L2 and
the GPU's TLB reach, as the ~95 GiB V4.1 shards are).

Baselines, same run: (1) H2D copy (cudaMemcpy, DMA engine) of 256 MiB pinned -> device;
(2) UVA read by the SMs: an elementwise kernel streaming 256 MiB of the same pinned table
through its CUDA view (the floor a lookup kernel can reach: the PCIe link), and the same
kernel on exactly the bytes one lookup reads (the latency-bound floor at that size);
(3) a device copy (HBM). T = tokens, C = hash columns per rank (V4.1 assumption: 2-gram and
3-gram x 8 heads = 16 columns; 2 per rank at TP = 8).

Floors and predictions: docs/journal/notes.md ("Engram lookup").
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, parse_args, time_graph_us, time_us, write_results  # noqa: E402

from dsv4_ops import engram  # noqa: E402

DIM, QB = 256, 32
ROW_READ = DIM + DIM // QB  # 264
ROW_WRITE = 2 * DIM  # 512


def uva_stream_gbs(view_u8: torch.Tensor, nbytes: int) -> float:
    """GB/s of an SM kernel reading nbytes of a (UVA) uint8 view as int32 words and writing them."""
    src = view_u8[: nbytes - nbytes % 4].view(torch.int32)
    dst = torch.empty_like(src, device="cuda")
    us = time_us(lambda: torch.bitwise_not(src, out=dst), warmup_ms=10, rep_ms=100)
    return src.numel() * 4 / us / 1e3


def h2d_gbs(host_u8: torch.Tensor, nbytes: int) -> float:
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = host_u8[:nbytes]
    us = time_us(lambda: dst.copy_(src, non_blocking=True), warmup_ms=10, rep_ms=100)
    return nbytes / us / 1e3


def make_table(rows: int, pinned: bool):
    if pinned:
        w = torch.empty(rows, DIM, dtype=torch.uint8, pin_memory=True)
        s = torch.empty(rows, DIM // QB, dtype=torch.uint8, pin_memory=True)
        w.random_(0, 126)  # finite codes; random_ on host is fast enough for a few GiB
        s.fill_(127)
        return (w, s), (engram.pinned_cuda_view(w), engram.pinned_cuda_view(s))
    w = torch.randint(0, 126, (rows, DIM), dtype=torch.uint8, device="cuda")
    s = torch.full((rows, DIM // QB), 127, dtype=torch.uint8, device="cuda")
    return (w, s), (w, s)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    gib = float(os.environ.get("DSV4_ENGRAM_BENCH_GIB", "1" if args.quick else "4"))
    rows = int(gib * 2 ** 30) // ROW_READ
    token_counts = (1, 64) if args.quick else (1, 8, 64, 256, 2048)
    col_counts = (2, 16)
    out_rows = []
    base = {}
    try:
        base["device copy GB/s"] = copy_bandwidth_gbs(256 << 20)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    tables = {}
    for where in ("host", "device"):
        try:
            tables[where] = make_table(rows, pinned=where == "host")
        except Exception:  # noqa: BLE001 - a box that cannot pin this much still runs the device rows
            traceback.print_exc()
    if "host" in tables:
        (hw, _), (vw, _) = tables["host"]
        flat_host, flat_view = hw.view(-1), vw.view(-1)
        try:
            base["H2D copy GB/s"] = h2d_gbs(flat_host, 256 << 20)
            base["UVA read GB/s"] = uva_stream_gbs(flat_view, 256 << 20)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print("baselines:", {k: round(v, 1) for k, v in base.items()})
    gen = torch.Generator().manual_seed(0)
    for where, (_, (w, s)) in tables.items():
        for cols in col_counts:
            for T in token_counts:
                for variant in ("portable", "native"):
                    if variant == "native" and torch.cuda.get_device_capability() < (8, 9):
                        continue
                    try:
                        ids = torch.randint(0, rows, (T, cols), generator=gen, dtype=torch.int32).cuda()
                        out = torch.empty(T, cols, DIM, dtype=torch.bfloat16, device="cuda")

                        def run():
                            engram.engram_lookup(w, s, ids, out, 0, rows, 0, cols, variant=variant)

                        n = T * cols
                        us = time_us(run, warmup_ms=10, rep_ms=100)
                        g_us = time_graph_us(run) if T == 64 else float("nan")
                        row = {"table": where, "variant": variant, "T": T, "C": cols, "rows": n, "us": us,
                               "graph us": g_us, "Mrows/s": n / us, "GB/s read": n * ROW_READ / us / 1e3}
                        if where == "host" and "UVA read GB/s" in base:
                            row["% UVA read"] = 100 * row["GB/s read"] / base["UVA read GB/s"]
                            row["% same-size UVA"] = 100 * row["GB/s read"] / uva_stream_gbs(
                                tables["host"][1][0].view(-1), max(4096, n * ROW_READ))
                            row["% H2D"] = 100 * row["GB/s read"] / base.get("H2D copy GB/s", float("nan"))
                        if where == "device" and "device copy GB/s" in base:
                            moved = n * (ROW_READ + ROW_WRITE) / us / 1e3
                            row["% copy"] = 100 * moved / base["device copy GB/s"]
                        out_rows.append(row)
                        print(row, flush=True)
                    except Exception:  # noqa: BLE001 - one failing case must not stop the others
                        traceback.print_exc()
    notes = ("Baselines (same run): " + ", ".join(f"{k} {v:.1f}" for k, v in base.items()) +
             f". Table {gib:g} GiB a side; rows uniform random; GB/s read counts {ROW_READ} table bytes a row. "
             "'% UVA read': against the SM stream of 256 MiB of the pinned table; '% same-size UVA': against "
             "the same kernel reading as many bytes as the lookup; '% copy' (device table): bytes read + written "
             "against a device copy. 'graph us': inside a CUDA graph (T = 64 only).")
    cols = ["table", "variant", "T", "C", "rows", "us", "graph us", "Mrows/s", "GB/s read", "% UVA read",
            "% same-size UVA", "% H2D", "% copy"]
    write_results("engram", args.out, out_rows, cols, notes)


if __name__ == "__main__":
    main()
