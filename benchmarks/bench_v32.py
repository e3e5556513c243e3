"""DeepSeek-V3.2 / GLM-5 sparse MLA (ops v32_*), in-graph.

    python benchmarks/bench_v32.py --out DIR [--quick] [--compile-only] [--shapes TxH,...] [--no-prefill]

Writes under DIR:
  v32_decode.{json,md}   decode over the paged 656-byte fp8_ds_mla cache by slot, T in {1, 16,
                         64, 128} x H in {16 (TP8), 128 (TP1)}, K = 2048 random slots of a
                         1,048,576-slot cache (688 MB, beyond the 60 MB L2). One row per form:
      form         w128 (4 tiles of 128 + RoPE, codes decoded to bf16: auto's fp8 form before
                   the f16 form), f16 (E4M3 codes as fp16 dot operands, dispatched config),
                   f16:<name> (the other F16_CANDIDATES configs), ws (the workspace route:
                   v32_kv_gather of the T*K rows + v32_sparse_mla_prefill at w128's split count)
      splits, us   the heuristic's split count (num_splits_for) and its time
      unsplit_us   one split (no merge); best_us / best_splits: the fastest of {1, S/2, S, 2S}
      floor_us     max(bytes T*K*656 + q + out at the copy rate, FLOPs 2*T*H*K*1088 at the
                   cuBLAS bf16 matmul rate, launches 0.9 us each), rates measured in this run
      floor/best   the fraction of the floor reached by best_us; GB/s, TFLOP/s of best_us
      diff_vs_w128 max |out - out_w128| / max |out_w128|, same inputs (bf16 outputs)
  v32_prefill.{json,md}  sparse prefill over a bf16 workspace of 65,536 rows (75 MB): T = 1024
                         tokens x H in {16, 128}, K = 2048, forms w64 / w128 (us, floor_us as
                         above with T*K*1152 bytes), and the gather of the workspace from the
                         cache (gather_us, its floor at the copy rate).
--compile-only calls every timed case once (warms Triton's cache for a later timed run).
Every time: benchmarks.common.time_graph_us (20 calls in one CUDA graph, median of replays).
The same-run comparison with vLLM's ROCm Triton sparse decode needs vLLM, which the H200 image
does not have: not measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, time_graph_us, time_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import dispatch, v32  # noqa: E402
from dsv4_ops.csrc_triton import v32_attention as _ak  # noqa: E402
from dsv4_ops.dispatch.device import num_sms  # noqa: E402

QK, DV, REC = 576, 512, 656
SM_SCALE = 0.1352
BS = 64
NBLK = 16384  # 1M slots
TS = (1, 16, 64, 128)
HS = (16, 128)
K = 2048
LAUNCH_US = 0.9


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


# Decode forms timed at every shape: w128 (auto's form before the f16 form) and the f16 form at
# its dispatched config and every other F16_CANDIDATES config (w64 lost to w128 at every decode
# shape measured on 2026-12-01 and is not timed again).
DEC_FORMS = ("w128", "f16") + tuple(f"f16:{n}" for n in _ak.F16_CANDIDATES)


def _timer(compile_only):
    if compile_only:  # one call: compiles exactly the specializations the timed run uses
        def once(fn, replays):
            fn()
            torch.cuda.synchronize()
            return 0.0
        return once
    return time_graph_us


def _splits_to_try(S, nb, sweep):
    if not sweep:
        return [S]
    return sorted({1, S, max(1, S // 2), min(64, nb, 2 * S)})


def decode_rows(cache, T, H, gbs, tfl, replays, sweep, sms, compile_only=False):
    """One row per form at shape (T, H): time at the heuristic's split count, unsplit, the best
    of a small sweep, and the output's max difference from w128's (same inputs)."""
    tm = _timer(compile_only)
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H)
    cap = NBLK * BS
    idx = torch.randint(0, cap, (T, K), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(T, H, QK, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(T, H, DV, device="cuda", dtype=torch.bfloat16)
    nbytes = T * K * REC + T * H * (QK + DV) * 2
    flops = 2 * T * H * K * (QK + DV)
    rows, ref = [], None
    bh = _ak.block_h_for(H)
    for form in DEC_FORMS + ("ws",):
        if form.startswith("f16:") and dispatch.v32.config_of(form, bh) is dispatch.v32.config_of("f16", bh):
            continue  # the dispatched config, timed as "f16"
        row = {"T": T, "H": H, "K": K, "form": form}
        try:
            f = "w128" if form == "ws" else form
            S = dispatch.v32.num_splits_for(T, H, K, sms, f)
            nb = -(-K // dispatch.v32.config_of(f, bh)["BLOCK_N"])
            row["splits"] = S
            if form == "ws":
                ws = torch.empty(T * K, QK, dtype=torch.bfloat16, device="cuda")
                local = torch.arange(T * K, device="cuda", dtype=torch.int32).view(T, K)

                def run(s=S):
                    v32.v32_kv_gather(cache, idx.view(-1), out=ws)
                    return v32.v32_sparse_mla_prefill(q, ws, local, None, SM_SCALE, s, out=out)

                row["us"] = tm(run, replays)
                best = (row["us"], S)
            else:
                def dec(s, form=form):
                    return lambda: v32.v32_sparse_mla_decode(q, cache, idx, None, SM_SCALE, s, out=out, form=form)

                times = {}
                for s in _splits_to_try(S, nb, sweep):
                    times[s] = tm(dec(s), replays if s == S else max(10, replays // 2))
                row["us"] = times[S]
                row["unsplit_us"] = times.get(1, float("nan"))
                best = min((t, s) for s, t in times.items())
                dec(S)()
                o = out.float()
                if ref is None:
                    ref = o.clone()
                row["diff_vs_w128"] = float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            row["best_us"], row["best_splits"] = best
            row["floor_us"] = floor(nbytes, flops, 1 if best[1] == 1 else 2, gbs, tfl)
            row["floor/best"] = row["floor_us"] / max(best[0], 1e-9)
            row["GB/s"] = nbytes / max(best[0], 1e-9) / 1e3
            row["TFLOP/s"] = flops / max(best[0], 1e-9) / 1e6
        except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
            row["error"] = repr(exc)[:200]
            traceback.print_exc()
        print(row, flush=True)
        rows.append(row)
    return rows


DECODE_COLUMNS = ["T", "H", "K", "form", "splits", "us", "unsplit_us", "best_us", "best_splits", "floor_us",
                  "floor/best", "GB/s", "TFLOP/s", "diff_vs_w128", "error"]


def prefill_rows(cache, gbs, tfl, replays, compile_only=False):
    tm = _timer(compile_only)
    rows = []
    N, T = 65536, 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    slots = torch.randint(0, NBLK * BS, (N,), device="cuda", generator=g)
    ws = torch.empty(N, QK, dtype=torch.bfloat16, device="cuda")
    try:
        gather_us = tm(lambda: v32.v32_kv_gather(cache, slots, out=ws), replays)
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
                row[f"{form}_us"] = tm(
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true", help="fewer replays, no split sweep")
    p.add_argument("--compile-only", action="store_true", help="one call per timed case (warms the Triton cache)")
    p.add_argument("--shapes", default="", help="decode shapes TxH,TxH,... (default: all); 'none': no decode")
    p.add_argument("--no-prefill", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    replays = 10 if args.quick else 20
    co = args.compile_only
    gbs = 1.0 if co else copy_bandwidth_gbs(256 << 20)
    tfl = 1.0 if co else mm_tflops()
    sms = num_sms(torch.cuda.current_device())
    print(f"copy {gbs:.0f} GB/s, bf16 mm {tfl:.0f} TFLOP/s, {sms} SMs", flush=True)
    cache = make_cache(1)

    def notes():
        return (f"Same run: copy {gbs:.0f} GB/s, bf16 matmul {tfl:.0f} TFLOP/s (8192^3, cuBLAS), {sms} SMs. "
                f"DSV4_AMPERE_IMPL={os.environ.get('DSV4_AMPERE_IMPL')}, "
                f"DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3', '-')}. Wall {time.time() - t0:.0f} s.")

    if not args.no_prefill:
        prows = prefill_rows(cache, gbs, tfl, replays, co)
        if not co:
            write_results("v32_prefill", args.out, prows,
                          ["T", "H", "K", "N", "w64_us", "w128_us", "floor_us", "floor/us", "TFLOP/s", "gather_us",
                           "gather_floor_us", "error"], notes())
    if args.shapes == "none":
        return
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")] if args.shapes else \
        [(T, H) for T in TS for H in HS]
    rows = []
    for T, H in shapes:  # the tables are rewritten after every shape: a timeout keeps what was measured
        rows += decode_rows(cache, T, H, gbs, tfl, replays, not args.quick, sms, co)
        if not co:
            write_results("v32_decode", args.out, rows, DECODE_COLUMNS, notes())
    print(f"done {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
