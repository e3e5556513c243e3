"""Benchmark: the sparse-attention indexer ops against same-run floors.

Floors (both measured in this run, on this GPU):
  bytes / copy bandwidth   (a device copy; read + written bytes, benchmarks/common.copy_bandwidth_gbs)
  flops / cuBLAS rate      (torch.mm bf16 of a square GEMM with the same flops, do_bench median)
Cases (portable and, on sm_89+, native):
  decode   paged_mqa_logits, B in {1, 8, 64}, next_n 1, H in {64, 32}, 32K compressed tokens a
           request, 64-row pages; bytes = K rows (132 B) + logits (4 B) + Q + weights;
           flops = 2 * B * H * 128 * 32768. Goal at B = 64: <= 1.6x max(floors).
  prefill  mqa_logits, M = 8192 queries, H = 64, causal ragged [0, (m+1)//4) over 2048 keys,
           compressed output [M, 2048] (what vLLM's prefill uses) and the full form;
           flops over the valid pairs. Goal: <= 2x the flop floor.
  q quant  indexer_q_quant, 4096 tokens x 64 heads (262144 rows of 128); bytes: 256 in + 128 + 4
           out a row, + weights. Goal >= 70% of copy bandwidth.
  k insert indexer_k_insert, 262144 rows to random slots; bytes: 256 in + 132 out a row. Goal >= 70%.
Floors and predictions: docs/journal/notes.md ("indexer"). Usage: python benchmarks/bench_indexer.py --out DIR
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, parse_args, time_graph_us, time_us, write_results  # noqa: E402

from dsv4_ops import dispatch, indexer  # noqa: E402

CTX = 32768
BS = 64
D = 128


def gemm_rate_tflops(flops: float) -> float:
    """cuBLAS bf16 rate (TFLOP/s) of a square GEMM doing about ``flops`` flops."""
    n = max(256, int(round((flops / 2) ** (1 / 3) / 128)) * 128)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_us(lambda: torch.mm(a, b))
    return 2 * n ** 3 / us / 1e6


def codes(shape):
    c = torch.randint(0, 256, shape, device="cuda", dtype=torch.int32)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)


def decode_inputs(B: int, H: int):
    """The decode case's inputs (B requests of CTX compressed tokens in shuffled 64-row pages, next_n 1)
    as (q, cache, weights, context_lens, block_table) and its (bytes, flops)."""
    pages = CTX // BS
    nb = B * pages
    cache = codes((nb, BS * 132))
    cache.view(nb, -1)[:, BS * D:].view(torch.float32).fill_(1.0 / 64)  # valid fp32 scales
    bt = torch.randperm(nb, device="cuda", dtype=torch.int64).view(B, pages).to(torch.int32)
    q = codes((B, 1, H, D))
    w = torch.randn(B, H, device="cuda")
    ctx = torch.full((B, 1), CTX, dtype=torch.int32, device="cuda")
    nbytes = B * CTX * (132 + 4) + q.numel() + w.numel() * 4
    return (q, cache, w, ctx, bt), (nbytes, 2.0 * B * H * D * CTX)


def bench_decode(rows, variants, copy_gbs, quick):
    for H in (64, 32):
        for B in ((1, 64) if quick else (1, 8, 64)):
            (q, cache, w, ctx, bt), (nbytes, flops) = decode_inputs(B, H)
            rate = gemm_rate_tflops(flops)
            floor = max(nbytes / copy_gbs / 1e3, flops / rate / 1e6)
            for v in variants:
                def fn():
                    return indexer.paged_mqa_logits(q, cache, w, ctx, bt, CTX, block_size=BS, variant=v)
                us = time_us(fn)
                g_us = time_graph_us(fn)
                rows.append({"case": "decode", "variant": v, "B": B, "H": H, "us": us, "graph us": g_us,
                             "GB/s": nbytes / us / 1e3, "TFLOP/s": flops / us / 1e6, "cuBLAS TFLOP/s": rate,
                             "floor us": floor, "x floor": us / floor})


PREFILL_M, PREFILL_H, PREFILL_N = 8192, 64, 2048


def prefill_inputs(H=PREFILL_H):
    """The prefill case (also swept by sweep_indexer.py): M = 8192 queries x H = 64 heads over a
    causal ragged [0, (m + 1) // 4) of N = 2048 compressed keys. Returns (q, w, k, k_scale, ks,
    ke, flops) with flops = 2 * H * 128 * (valid query-key pairs)."""
    M, N = PREFILL_M, PREFILL_N
    q = codes((M, H, D))
    k = codes((N, D))
    w = torch.randn(M, H, device="cuda") * 1e-2
    ksc = torch.full((N,), 1.0 / 64, device="cuda")
    m = torch.arange(M, device="cuda")
    ks = torch.zeros(M, dtype=torch.int32, device="cuda")
    ke = ((m + 1) // 4).to(torch.int32)
    return q, w, k, ksc, ks, ke, 2.0 * H * D * float((ke - ks).sum())


def bench_prefill(rows, variants, quick):
    M, H, N = PREFILL_M, PREFILL_H, PREFILL_N
    q, w, k, ksc, ks, ke, flops = prefill_inputs()
    rate = gemm_rate_tflops(flops)
    floor = flops / rate / 1e6
    for v in variants:
        for cols in ((N,) if quick else (N, -1)):
            us = time_us(lambda: indexer.mqa_logits(q, w, k, ksc, ks, ke, cols, variant=v))
            rows.append({"case": "prefill " + ("compressed" if cols >= 0 else "full"), "variant": v, "B": M, "H": H,
                         "us": us, "TFLOP/s": flops / us / 1e6, "cuBLAS TFLOP/s": rate, "floor us": floor,
                         "x floor": us / floor})


def short(cfg) -> str:
    keys = ("KERNEL", "BLOCK_M", "BLOCK_N", "DOT_N", "num_warps", "TARGET_PROGRAMS", "PROGRAMS_PER_SM")
    tags = ("v", "M", "N", "dotN", "w", "tp", "pps")
    return " ".join(f"{t}{cfg[k]}" for k, t in zip(keys, tags) if k in cfg)


# The decode / compressed-prefill configs shipped before the v3 indexer kernels: the same-run baseline.
V2_PAGED = {"KERNEL": 2, "BLOCK_N": 64, "num_warps": 2, "num_stages": 2, "TARGET_PROGRAMS": 864,
            "MAX_TILES_PER_PROGRAM": 64}
V2_MQA = {"KERNEL": 2, "BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}


def _frozen(cfg):
    return tuple(sorted(cfg.items()))


def bench_candidates(rows, copy_gbs):
    """Issue 18: the pre-issue-18 v2 decode / prefill configs (first row of each case, the
    baseline), the shipped ones ('shipped') and the new (v3, one-wave) candidates, portable,
    same run, same inputs; 'x v2' = us / the v2 baseline's us (< 1: faster); 'max rel
    diff' = max |candidate - v2| / max |v2| over finite logits (the GPU tests check every
    candidate against the float64 reference)."""
    from dsv4_ops.csrc_triton import indexer as K

    def diff(a, b):
        if not torch.equal(torch.isinf(a), torch.isinf(b)):
            return float("inf")
        fin = torch.isfinite(b)
        return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp(min=1e-30)) if fin.any() else 0.0

    for H in (64, 32):
        for B in (1, 8, 64):
            pages = CTX // BS
            nb = B * pages
            cache = codes((nb, BS * 132))
            cache.view(nb, -1)[:, BS * D:].view(torch.float32).fill_(1.0 / 64)
            bt = torch.randperm(nb, device="cuda", dtype=torch.int64).view(B, pages).to(torch.int32)
            q = codes((B, 1, H, D))
            w = torch.randn(B, H, device="cuda")
            ctx = torch.full((B,), CTX, dtype=torch.int32, device="cuda")
            nbytes = B * CTX * (132 + 4) + q.numel() + w.numel() * 4
            flops = 2.0 * B * H * D * CTX
            floor = max(nbytes / copy_gbs / 1e3, flops / gemm_rate_tflops(flops) / 1e6)
            base_us, base_out = None, None
            shipped = dispatch.indexer.paged_config(H)
            cands = [V2_PAGED] + [c for c in [shipped] + K.NEW_PAGED_CANDIDATES if c != V2_PAGED]
            for cfg in [dict(c) for c in dict.fromkeys(map(_frozen, cands))]:
                def fn(cfg=cfg):
                    return indexer.paged_mqa_logits(q, cache, w, ctx, bt, CTX, block_size=BS, variant="portable",
                                                    config=cfg)
                try:
                    out = fn()
                    us = time_graph_us(fn)
                except Exception as exc:  # noqa: BLE001
                    rows.append({"case": "decode", "config": short(cfg), "B": B, "H": H, "error": repr(exc)[:120]})
                    continue
                if base_us is None:
                    base_us, base_out = us, out
                rows.append({"case": "decode", "config": ("shipped " if cfg == shipped else "") + short(cfg),
                             "B": B, "H": H, "graph us": us, "floor us": floor, "x floor": us / floor,
                             "x v2": us / base_us, "max rel diff": diff(out, base_out)})
            del cache
    for H in (64, 32):
        q, w, k, ksc, ks, ke, flops = prefill_inputs(H)
        floor = flops / gemm_rate_tflops(flops) / 1e6
        base_us, base_out = None, None
        cands = [V2_MQA] + [c for c in [K.MQA_COMPRESSED_CONFIG] + K.NEW_MQA_CANDIDATES if c != V2_MQA]
        for cfg in [dict(c) for c in dict.fromkeys(map(_frozen, cands))]:
            def fn(cfg=cfg):
                return indexer.mqa_logits(q, w, k, ksc, ks, ke, PREFILL_N, variant="portable", config=cfg)
            try:
                out = fn()
                us = time_us(fn)
            except Exception as exc:  # noqa: BLE001
                rows.append({"case": "prefill compressed", "config": short(cfg), "B": PREFILL_M, "H": H,
                             "error": repr(exc)[:120]})
                continue
            if base_us is None:
                base_us, base_out = us, out
            rows.append({"case": "prefill compressed",
                         "config": ("shipped " if cfg == K.MQA_COMPRESSED_CONFIG else "") + short(cfg),
                         "B": PREFILL_M, "H": H, "us": us, "TFLOP/s": flops / us / 1e6, "floor us": floor,
                         "x floor": us / floor, "x v2": us / base_us, "max rel diff": diff(out, base_out)})


def bench_quant_insert(rows, variants, copy_gbs):
    T, H = 4096, 64
    q = torch.randn(T, H, D, device="cuda").to(torch.bfloat16)
    ang = torch.rand(65536, 32, device="cuda") * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    pos = torch.randint(0, 65536, (T,), device="cuda")
    wq = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    nbytes = T * H * (2 * D + D + 4 + 2) + T * 8
    n = T * H
    k = torch.randn(n, D, device="cuda").to(torch.bfloat16)
    nb = 2 * n // BS
    cache = torch.zeros(nb, BS * 132, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(nb * BS, device="cuda")[:n]
    kbytes = n * (2 * D + 132)
    for v in variants:
        us = time_us(lambda: indexer.indexer_q_quant(pos, q, cs, wq, D ** -0.5, H ** -0.5, variant=v))
        rows.append({"case": "q quant", "variant": v, "B": T, "H": H, "us": us, "GB/s": nbytes / us / 1e3,
                     "floor us": nbytes / copy_gbs / 1e3, "x floor": us / (nbytes / copy_gbs / 1e3)})
        us = time_us(lambda: indexer.indexer_k_insert(k, cache, slots, BS, variant=v))
        rows.append({"case": "k insert", "variant": v, "B": n, "H": 1, "us": us, "GB/s": kbytes / us / 1e3,
                     "floor us": kbytes / copy_gbs / 1e3, "x floor": us / (kbytes / copy_gbs / 1e3)})


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    variants = ["portable"] + (["native"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    copy_gbs = copy_bandwidth_gbs(256 << 20)
    rows, cand_rows = [], []
    for name, fn in (("decode", lambda: bench_decode(rows, variants, copy_gbs, args.quick)),
                     ("prefill", lambda: bench_prefill(rows, variants, args.quick)),
                     ("quant/insert", lambda: bench_quant_insert(rows, variants, copy_gbs))):
        try:  # one failing case must not stop the others
            fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"case": name, "variant": "FAILED"})
        torch.cuda.synchronize()
    write_results("indexer", args.out, rows,
                  ["case", "variant", "B", "H", "us", "graph us", "GB/s", "TFLOP/s", "cuBLAS TFLOP/s", "floor us",
                   "x floor"],
                  f"Copy bandwidth {copy_gbs:.0f} GB/s (read + written), measured in this run. floor = max(bytes / "
                  "copy bandwidth, flops / cuBLAS bf16 rate of a square GEMM of the same flops); B is the batch "
                  "(decode), the query count (prefill) or the token / row count (q quant / k insert).")
    try:  # after indexer.md is written: a timeout here keeps it
        bench_candidates(cand_rows, copy_gbs)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        cand_rows.append({"case": "candidates", "error": "FAILED"})
    write_results("indexer_candidates", args.out, cand_rows,
                  ["case", "config", "B", "H", "us", "graph us", "TFLOP/s", "floor us", "x floor", "x v2",
                   "max rel diff", "error"],
                  f"Issue 18: the pre-issue-18 v2 configs (first row of each case; 'x v2' is against it), the "
                  f"shipped ones and the new candidates (csrc_triton/indexer.py NEW_*_CANDIDATES), portable, "
                  f"same run and inputs; decode in-graph (20 calls a graph), prefill by do_bench; floors "
                  f"as in indexer.md (copy {copy_gbs:.0f} GB/s, same-run cuBLAS bf16). v = kernel, M/N = "
                  "BLOCK_M/BLOCK_N, dotN = rows x H_BLOCK a dot, w = warps, tp = TARGET_PROGRAMS, pps = "
                  "PROGRAMS_PER_SM x the SM count (one resident wave).")


if __name__ == "__main__":
    main()
