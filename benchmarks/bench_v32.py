"""DeepSeek-V3.2 / GLM-5 sparse MLA (ops v32_*), in-graph. ~40 s on an H200 after compiles.

    python benchmarks/bench_v32.py --out DIR [--quick]

Writes under DIR:
  v32_decode.{json,md}   decode over the paged 656-byte fp8_ds_mla cache by slot, T in {1, 16,
                         64, 128} x H in {16 (TP8), 128 (TP1)}, K = 2048 random slots of a
                         1,048,576-slot cache (688 MB, beyond the 60 MB L2):
      w64_us, w128_us   v32_sparse_mla_decode, form w64 (9 chunks of 64 dims) / w128 (4 tiles of
                   128 + RoPE), at the heuristic's split count (*_splits)
      *_unsplit_us the same kernel with one split (no merge): the same-run baseline
      *_best_us    the fastest of a few split counts (*_best_splits)
      ws_us        the workspace route: v32_kv_gather of the T*K rows + v32_sparse_mla_prefill
      floor/us, GB/s, TFLOP/s   of the faster form
      floor_us     max(bytes T*K*656 + q + out at the copy rate, FLOPs 2*T*H*K*1088 at the
                   bf16 matmul rate, launches 0.9 us each), rates measured in this run
      floor/us     the fraction of the floor reached
  v32_prefill.{json,md}  sparse prefill over a bf16 workspace of 65,536 rows (75 MB): T = 1024
                         tokens x H in {16, 128}, K = 2048 (us, floor_us as above with
                         T*K*1152 bytes), and the gather of the workspace from the cache
                         (gather_us, its floor at the copy rate).
Every time: benchmarks.common.time_graph_us (20 calls in one CUDA graph, median of replays).
The same-run comparison with vLLM's ROCm Triton sparse decode needs vLLM, which the H200 image
does not have: not measured here.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, parse_args, time_graph_us, time_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import v32  # noqa: E402
from dsv4_ops.decode_plan import num_sms  # noqa: E402

QK, DV, REC = 576, 512, 656
SM_SCALE = 0.1352
BS = 64
NBLK = 16384  # 1M slots
TS = (1, 16, 64, 128)
HS = (16, 128)
K = 2048
LAUNCH_US = 0.9
SWEEP = (1, 2, 4, 8, 16, 32, 64)


def mm_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_us(lambda: a @ b)
    return 2 * 8192 ** 3 / us / 1e6


def make_cache(seed):
    ops = torch.ops.dsv4_ampere
    cache = torch.empty(NBLK, BS, REC, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = NBLK * BS
    for lo in range(0, n, 1 << 18):
        m = min(1 << 18, n - lo)
        kv_c = torch.randn(m, 512, device="cuda", generator=g).to(torch.bfloat16)
        k_pe = torch.randn(m, 64, device="cuda", generator=g).to(torch.bfloat16)
        ops.v32_kv_insert(kv_c, k_pe, cache, torch.arange(lo, lo + m, device="cuda"))
    return cache


def floor(nbytes, flops, launches, gbs, tfl):
    return max(nbytes / (gbs * 1e3), flops / (tfl * 1e6), LAUNCH_US * launches)


def decode_row(cache, T, H, gbs, tfl, replays, sweep, sms):
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H)
    cap = NBLK * BS
    idx = torch.randint(0, cap, (T, K), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(T, H, QK, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(T, H, DV, device="cuda", dtype=torch.bfloat16)
    row = {"T": T, "H": H, "K": K}
    try:
        for form in ("w64", "w128"):
            S = v32.num_splits_for(T, H, K, sms, form)
            row[f"{form}_splits"] = S

            def dec(s, form=form):
                return lambda: v32.v32_sparse_mla_decode(q, cache, idx, None, SM_SCALE, s, out=out, form=form)

            row[f"{form}_us"] = time_graph_us(dec(S), replays)
            row[f"{form}_unsplit_us"] = time_graph_us(dec(1), replays) if S != 1 else row[f"{form}_us"]
            best = (row[f"{form}_us"], S)
            if sweep:
                for s in SWEEP:
                    if s not in (1, S) and s <= K // 16:
                        best = min(best, (time_graph_us(dec(s), max(10, replays // 2)), s))
            row[f"{form}_best_us"], row[f"{form}_best_splits"] = best
        row["us"] = min(row["w64_us"], row["w128_us"])
        S = row["w64_splits"]
        ws = torch.empty(T * K, QK, dtype=torch.bfloat16, device="cuda")
        local = torch.arange(T * K, device="cuda", dtype=torch.int32).view(T, K)

        def ws_route():
            v32.v32_kv_gather(cache, idx.view(-1), out=ws)
            return v32.v32_sparse_mla_prefill(q, ws, local, None, SM_SCALE, S, out=out)

        row["ws_us"] = time_graph_us(ws_route, replays)
        nbytes = T * K * REC + T * H * (QK + DV) * 2
        flops = 2 * T * H * K * (QK + DV)
        row["floor_us"] = floor(nbytes, flops, 1 if S == 1 else 2, gbs, tfl)
        row["floor/us"] = row["floor_us"] / row["us"]
        row["GB/s"] = nbytes / row["us"] / 1e3
        row["TFLOP/s"] = flops / row["us"] / 1e6
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
        row["error"] = repr(exc)[:200]
        traceback.print_exc()
    print(row, flush=True)
    return row


DECODE_COLUMNS = ["T", "H", "K", "w64_splits", "w64_us", "w64_unsplit_us", "w64_best_us", "w64_best_splits",
                  "w128_splits", "w128_us", "w128_unsplit_us", "w128_best_us", "w128_best_splits", "ws_us",
                  "floor_us", "floor/us", "GB/s", "TFLOP/s", "error"]


def prefill_rows(cache, gbs, tfl, replays):
    rows = []
    N, T = 65536, 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    slots = torch.randint(0, NBLK * BS, (N,), device="cuda", generator=g)
    ws = torch.empty(N, QK, dtype=torch.bfloat16, device="cuda")
    try:
        gather_us = time_graph_us(lambda: v32.v32_kv_gather(cache, slots, out=ws), replays)
        gfloor = N * (REC + QK * 2) / (gbs * 1e3)
    except Exception as exc:  # noqa: BLE001
        gather_us, gfloor = float("nan"), float("nan")
        traceback.print_exc()
    idx = torch.randint(0, N, (T, K), device="cuda", generator=g, dtype=torch.int32)
    for H in HS:
        row = {"T": T, "H": H, "K": K, "N": N, "gather_us": gather_us, "gather_floor_us": gfloor}
        try:
            q = torch.randn(T, H, QK, device="cuda", generator=g).to(torch.bfloat16)
            out = torch.empty(T, H, DV, device="cuda", dtype=torch.bfloat16)
            for form in ("w64", "w128"):
                row[f"{form}_us"] = time_graph_us(
                    lambda form=form: v32.v32_sparse_mla_prefill(q, ws, idx, None, SM_SCALE, out=out, form=form),
                    max(5, replays // 3))
            row["us"] = min(row["w64_us"], row["w128_us"])
            nbytes = T * K * QK * 2 + T * H * (QK + DV) * 2
            flops = 2 * T * H * K * (QK + DV)
            row["floor_us"] = floor(nbytes, flops, 1, gbs, tfl)
            row["floor/us"] = row["floor_us"] / row["us"]
            row["TFLOP/s"] = flops / row["us"] / 1e6
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:200]
            traceback.print_exc()
        print(row, flush=True)
        rows.append(row)
    return rows


def main():
    args = parse_args(__doc__.splitlines()[0])
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    replays = 10 if args.quick else 25
    gbs = copy_bandwidth_gbs(256 << 20)
    tfl = mm_tflops()
    sms = num_sms(torch.cuda.current_device())
    print(f"copy {gbs:.0f} GB/s, bf16 mm {tfl:.0f} TFLOP/s, {sms} SMs", flush=True)
    cache = make_cache(1)
    notes = (f"Same run: copy {gbs:.0f} GB/s, bf16 matmul {tfl:.0f} TFLOP/s (8192^3), {sms} SMs. "
             f"DSV4_AMPERE_IMPL={os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3', '-')}.")
    prows = prefill_rows(cache, gbs, tfl, replays)
    write_results("v32_prefill", args.out, prows,
                  ["T", "H", "K", "N", "w64_us", "w128_us", "floor_us", "floor/us", "TFLOP/s", "gather_us",
                   "gather_floor_us", "error"], notes)
    rows = []
    for T in TS:  # the tables are rewritten after every shape: a timeout keeps what was measured
        for H in HS:
            rows.append(decode_row(cache, T, H, gbs, tfl, replays, not args.quick, sms))
            notes = (f"Same run: copy {gbs:.0f} GB/s, bf16 matmul {tfl:.0f} TFLOP/s (8192^3), {sms} SMs. "
                     f"DSV4_AMPERE_IMPL={os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3', '-')}. "
                     f"Wall {time.time() - t0:.0f} s.")
            write_results("v32_decode", args.out, rows, DECODE_COLUMNS, notes)


if __name__ == "__main__":
    main()
