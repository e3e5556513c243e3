"""Long context, one layer at a time: where a 32K / 128K / 256K-token request spends its
indexer and attention time. < 110 s on an H200 (a wall-clock guard skips the rest).

    DSV4_AMPERE_IMPL=portable python benchmarks/bench_long_context.py --out DIR [--budget-s 100]
    python benchmarks/bench_long_context.py --dry     # CPU: tiny shapes, each call once, no timing

Layers (geometry: /work/shared/DSV4_FACTS.md, dsv4_ops/vllm/audit/_config.py; attention heads
per rank at TP = 8: 64 / 8 = 8; the indexer is replicated, every rank runs all its heads):
  v4-c4a     V4 C4A: compress ratio 4, indexer 64 heads x 128, top-k 512 + window 128
  v41-r2     V4.1 index source of ratio 2: indexer 32 heads, top-k 512 + window 128
  v4-c128a   V4 C128A: ratio 128, no indexer; attends every compressed entry + window 128
  v41-r1     V4.1 index source of ratio 1 (a full-length compressed cache), last (costliest)
Calls, as vLLM 0.33.0 makes them (models/deepseek_v4[1]/nvidia/flashmla.py, model_executor/
layers/sparse_attn_indexer.py), through torch.ops.dsv4_ampere.* only:
  prefill   one 8192-token chunk at the end of the context; compressed keys Nc = ctx / ratio
    q quant      indexer_q_quant, 8192 tokens x H heads
    k insert     indexer_k_insert of the chunk's 8192 / ratio new compressed keys
    k gather     stand-in (torch) for vLLM's C++ cp_gather_indexer_k_quant_cache: the
                 request's Nc indexer rows to contiguous [Nc, 128] codes + [Nc] scales
    logits       mqa_logits, compressed output, rows cut as vLLM cuts them
                 (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512: rows * Nc * 4 <= 512 MiB)
    top-k        torch.topk(512) over each row block: a stand-in for vLLM's C++
                 top_k_per_row_prefill (not on the H200), reported as its own row
    kv gather    kv_cache_gather_into of the Nc compressed records + the chunk's 8192 + 127
                 window records into one bf16 workspace (vLLM's dequantize_and_gather_k_cache)
    attention    sparse_mla_decode (the sparse prefill; flash_mla_sparse_fwd's replacement),
                 8192 queries x 8 heads x K = 512 + 128 keys (C128A: Nc + 128), sink
  decode    B in {1, 16, 64} requests at the context, one token each
    logits       paged_mqa_logits over Nc keys a request (max_model_len = the context)
    top-k        torch.topk(512) over [B, Nc]
    attention    dsv4_decode.dsv4_decode_attention (what the plugin's decode calls), 8 heads,
                 512 top-k slots (C128A: Nc) + 128 window slots, sink
Timing: prefill rows by do_bench (median, L2 flushed), decode rows in one CUDA graph (20
calls, median of replays: benchmarks.common.time_graph_us). Floors beside every row, both
from this run: bytes (each input read once, each output written once) at the copy rate, and
flops at the cuBLAS bf16 rate of a square GEMM of about the same flops (sm_80 has no fp8
MMA: the honest floor is the fp16/bf16 tensor-core rate); floor = max of the two.
Extrapolation (labelled as such in the output): each row's A100 time = H200 time x (A100
floor / H200 floor), the A100 floor from 2.0 TB/s and 312 TFLOP/s bf16 (the same fraction of
the floor on both chips); per layer and op a least-squares line a + b * ctx over the three
contexts; a whole prefill of C tokens = the sum over its C / 8192 chunks (chunk i at context
8192 * (i + 1)), times the model's layer counts (V4: 21 C4A + 20 C128A; V4.1: 8 indexer
layers, 19 + 19 attention layers of ratio 1 and 2; SWA-only layers, MoE, GEMMs and
all-reduce left out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

D_IDX, D_ATT = 128, 512
TOPK, WINDOW = 512, 128
CHUNK = 8192
ATT_HEADS = 8  # 64 query heads / TP 8
LOGITS_BUDGET = 512 << 20  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default
A100_GBS, A100_TFLOPS = 2000.0, 312.0
LAYERS = [  # name, model, ratio, indexer heads (0: none), model KV block size
    ("v4-c4a", "V4", 4, 64, 256),
    ("v41-r2", "V4.1", 2, 32, 128),
    ("v4-c128a", "V4", 128, 0, 256),
    ("v41-r1", "V4.1", 1, 32, 128),
]
CONTEXTS = (32768, 131072, 262144)
BATCHES = (1, 16, 64)
ATT_CACHE_SLOTS = 1 << 20  # compressed / window attention caches: 1M records (612 MB, >> L2)
# whole-model layer counts for the extrapolation (dsv4_ops/vllm/audit/_config.py ratios)
MODEL_LAYERS = {
    "V4": {"indexer": {"v4-c4a": 21}, "attention": {"v4-c4a": 21, "v4-c128a": 20}},
    "V4.1": {"indexer": {"v41-r1": 8}, "attention": {"v41-r1": 19, "v41-r2": 19}},
}
INDEXER_OPS = ("q quant", "k insert", "k gather", "logits", "top-k")
ATTENTION_OPS = ("kv gather", "attention")


class Timer:
    """Timing and floors of one run (GPU), or one call of each function (--dry, CPU)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.rates = {}
        if dry:
            self.copy_gbs = 100.0
        else:
            from common import copy_bandwidth_gbs

            self.copy_gbs = copy_bandwidth_gbs(256 << 20)

    def prefill(self, fn) -> float:
        if self.dry:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        from common import time_us

        return time_us(fn, warmup_ms=10, rep_ms=100)

    def decode(self, fn) -> float:
        if self.dry:
            return self.prefill(fn)
        from common import time_graph_us

        return time_graph_us(fn, replays=20)

    def rate(self, flops: float) -> float:
        """cuBLAS bf16 TFLOP/s of a square GEMM of about ``flops`` (n in 1024..8192, cached)."""
        if self.dry:
            return 100.0
        from common import time_us

        n = min(8192, max(1024, 1 << round(math.log2(max(flops / 2, 1.0)) / 3)))
        if n not in self.rates:
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            self.rates[n] = 2 * n ** 3 / time_us(lambda: torch.mm(a, b)) / 1e6
        return self.rates[n]

    def row(self, rows, base, op, us, nbytes, flops, note=""):
        byte_us = nbytes / self.copy_gbs / 1e3
        rate = self.rate(flops) if flops else 0.0
        flop_us = flops / rate / 1e6 if flops else 0.0
        floor = max(byte_us, flop_us)
        a100_floor = max(nbytes / A100_GBS / 1e3, flops / A100_TFLOPS / 1e6)
        r = dict(base, op=op, us=us, MB=nbytes / 1e6, GFLOP=flops / 1e9, **{"cuBLAS TFLOP/s": rate},
                 **{"byte floor us": byte_us, "flop floor us": flop_us, "x floor": us / floor if floor else None,
                    "bound": "flops" if flop_us > byte_us else "bytes",
                    "A100 us (extrapolated)": us * a100_floor / floor if floor else None}, note=note)
        rows.append(r)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)


def codes(shape, dev, g):
    c = torch.randint(0, 256, shape, device=dev, dtype=torch.int32, generator=g)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)


def indexer_cache(n_rows, ibs, dev, g):
    """Indexer pages [cdiv(n_rows, ibs), ibs * 132]: random finite codes, scales 2**-6."""
    nb = -(-n_rows // ibs)
    cache = codes((nb, ibs * 132), dev, g)
    cache[:, ibs * D_IDX:].view(torch.float32).fill_(1.0 / 64)
    return cache


def att_caches(dev, slots, g):
    from dsv4_ops.layout import vllm_page_bytes

    bs = 64
    nb = slots // bs
    out = []
    for _ in range(2):  # compressed, window: random bytes with finite UE8M0 scales
        c = torch.randint(0, 256, (nb, vllm_page_bytes(bs)), device=dev, dtype=torch.int32, generator=g)
        c = torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)
        data = c[:, :bs * 576].view(nb, bs, 576)
        data[:, :, 449::2] &= 0xBF  # RoPE bf16 high bytes: exponent < 128, finite
        c[:, bs * 576:bs * 584] = 120  # 2**-7 scales
        out.append(c)
    return out, bs


def prefill_case(tm, rows, base, layer, ctx, dev, caches, g, ops):
    name, model, ratio, H, model_bs = layer
    T = CHUNK
    nc = ctx // ratio
    pos = torch.arange(ctx - T, ctx, device=dev)
    if H:
        ibs = model_bs // ratio
        # q quant
        q = (torch.randn(T, H, D_IDX, device=dev, generator=g)).to(torch.bfloat16)
        ang = torch.rand(ctx, 32, device=dev, generator=g) * 6.3
        cs = torch.cat([ang.cos(), ang.sin()], 1)
        wq = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        us = tm.prefill(lambda: ops.indexer_q_quant(pos, q, cs, wq, D_IDX ** -0.5, H ** -0.5))
        tm.row(rows, base, "q quant", us, T * H * (2 * D_IDX + D_IDX + 4 + 2) + T * 8, 0)
        qc, wts = ops.indexer_q_quant(pos, q, cs, wq, D_IDX ** -0.5, H ** -0.5)
        del q, cs, ang
        # k insert: the chunk's new compressed keys into the request's pages
        icache = indexer_cache(nc, ibs, dev, g)
        nb = icache.shape[0]
        bt = torch.randperm(nb, device=dev, generator=g).to(torch.int32)
        n_new = T // ratio
        knew = torch.randn(n_new, D_IDX, device=dev, generator=g).to(torch.bfloat16)
        jpos = torch.arange(nc - n_new, nc, device=dev)
        kslots = bt[jpos // ibs].to(torch.int64) * ibs + jpos % ibs
        ins_cache = icache.clone()
        us = tm.prefill(lambda: ops.indexer_k_insert(knew, ins_cache, kslots, ibs))
        tm.row(rows, base, "k insert", us, n_new * (2 * D_IDX + 132), 0)
        del ins_cache

        # k gather (torch stand-in for cp_gather_indexer_k_quant_cache)
        def k_gather():
            pages = icache.index_select(0, bt.to(torch.int64))
            kq = pages[:, :ibs * D_IDX].reshape(-1, D_IDX)[:nc]
            ks_ = pages[:, ibs * D_IDX:].contiguous().view(torch.float32).reshape(-1)[:nc]
            return kq.contiguous(), ks_

        us = tm.prefill(k_gather)
        tm.row(rows, base, "k gather", us, 2 * nc * 132, 0, "torch stand-in (vLLM: a C++ kernel)")
        kq, ksc = k_gather()
        del icache
        # logits, rows cut by the 512 MiB budget
        ke_all = ((pos + 1) // ratio).to(torch.int32)
        ks_all = torch.zeros(T, dtype=torch.int32, device=dev)
        step = max(1, min(T, (LOGITS_BUDGET // 4) // nc))
        cuts = [(r0, min(T, r0 + step)) for r0 in range(0, T, step)]

        def logits_all():
            for r0, r1 in cuts:
                ops.mqa_logits(qc[r0:r1], wts[r0:r1], kq, ksc, ks_all[r0:r1], ke_all[r0:r1], nc)

        pairs = float((ke_all - ks_all).sum())
        us = tm.prefill(logits_all)
        tm.row(rows, base, "logits", us, T * H * (D_IDX + 4) + nc * 132 + T * nc * 4, 2.0 * H * D_IDX * pairs,
               f"{len(cuts)} row block(s) of {step}")
        # top-k over the first block's logits, once per block
        lg = ops.mqa_logits(qc[:step], wts[:step], kq, ksc, ks_all[:step], ke_all[:step], nc)
        k_top = min(TOPK, nc)

        def topk_all():
            for r0, r1 in cuts:
                torch.topk(lg[:r1 - r0], k_top, dim=1)

        us = tm.prefill(topk_all)
        tm.row(rows, base, "top-k", us, T * nc * 4 + T * k_top * 8, 0, "torch.topk stand-in (vLLM: C++ top-k)")
        del lg, kq, ksc, qc, wts
    # kv gather: Nc compressed records + the chunk's window records, into one workspace
    (ccache, wcache), abs_ = caches
    cap = ccache.shape[0] * abs_
    n_win = T + WINDOW - 1
    cslots = torch.randint(0, cap, (nc,), device=dev, generator=g, dtype=torch.int64)
    wslots = torch.randint(0, cap, (n_win,), device=dev, generator=g, dtype=torch.int64)
    ws = torch.empty(nc + n_win, D_ATT, dtype=torch.bfloat16, device=dev)

    def kv_gather():
        ops.kv_cache_gather_into(ccache, cslots, abs_, ws, 0)
        ops.kv_cache_gather_into(wcache, wslots, abs_, ws, nc)

    us = tm.prefill(kv_gather)
    tm.row(rows, base, "kv gather", us, (nc + n_win) * (584 + 2 * D_ATT), 0)
    kv_gather()
    # sparse prefill attention: top-k (C128A: every compressed entry) + window
    k1 = nc if not H else min(TOPK, nc)
    i = torch.arange(T, device=dev)
    if H:
        top = torch.randint(0, nc, (T, k1), device=dev, generator=g, dtype=torch.int32)
    else:
        top = torch.arange(k1, device=dev, dtype=torch.int32).expand(T, k1)
    win = (nc + i[:, None] + torch.arange(WINDOW, device=dev)[None, :]).to(torch.int32)
    idx = torch.cat([top, win], 1).contiguous()
    K = idx.shape[1]
    qa = (torch.randn(T, ATT_HEADS, D_ATT, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    sink = torch.randn(ATT_HEADS, device=dev, generator=g)
    out = torch.empty_like(qa)
    us = tm.prefill(lambda: ops.sparse_mla_decode_out(qa, ws, idx, None, sink, D_ATT ** -0.5, 0, out))
    uniq = min(nc + n_win, T * K)
    tm.row(rows, base, "attention", us, uniq * 2 * D_ATT + 2 * T * ATT_HEADS * D_ATT * 2 + T * K * 4,
           4.0 * T * ATT_HEADS * K * D_ATT, f"K = {K}")


def decode_case(tm, rows, base, layer, ctx, B, dev, caches, g, ops):
    from dsv4_ops import dsv4_decode

    name, model, ratio, H, model_bs = layer
    nc = ctx // ratio
    if H:
        ibs = model_bs // ratio
        icache = indexer_cache(B * nc, ibs, dev, g)
        pages = -(-nc // ibs)
        bt = torch.randperm(icache.shape[0], device=dev, generator=g)[:B * pages].view(B, pages).to(torch.int32)
        q = codes((B, 1, H, D_IDX), dev, g)
        w = torch.randn(B, H, device=dev, generator=g)
        cl = torch.full((B,), nc, dtype=torch.int32, device=dev)
        us = tm.decode(lambda: ops.paged_mqa_logits(q, icache, w, cl, bt, nc, ibs))
        tm.row(rows, base, "logits", us, B * nc * (132 + 4) + q.numel() + w.numel() * 4, 2.0 * B * H * D_IDX * nc)
        lg = ops.paged_mqa_logits(q, icache, w, cl, bt, nc, ibs)
        del icache
        k_top = min(TOPK, nc)
        us = tm.decode(lambda: torch.topk(lg, k_top, dim=1))
        tm.row(rows, base, "top-k", us, B * nc * 4 + B * k_top * 8, 0, "torch.topk stand-in (vLLM: C++ top-k)")
        del lg
    (ccache, wcache), abs_ = caches
    cap = ccache.shape[0] * abs_
    k1 = min(TOPK, nc) if H else nc
    top = torch.randint(0, cap, (B, k1), device=dev, generator=g, dtype=torch.int32)
    swa = torch.randint(0, cap, (B, WINDOW), device=dev, generator=g, dtype=torch.int32)
    qa = (torch.randn(B, ATT_HEADS, D_ATT, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    sink = torch.randn(ATT_HEADS, device=dev, generator=g)
    ws = torch.empty(B * (k1 + WINDOW), D_ATT, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(qa)
    us = tm.decode(lambda: dsv4_decode.dsv4_decode_attention(qa, ccache, top, wcache, swa, sink, D_ATT ** -0.5,
                                                             abs_, abs_, workspace=ws, out=out))
    K = k1 + WINDOW
    tm.row(rows, base, "attention", us, B * K * 584 + 2 * B * ATT_HEADS * D_ATT * 2,
           4.0 * B * ATT_HEADS * K * D_ATT, f"K = {K}")


def fit_line(xs, ys):
    n = len(xs)
    if n == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def extrapolate(rows, chunk, contexts_out):
    """Whole-prefill A100 seconds over the model's indexer + attention layers (see module doc)."""
    out = []
    for model, kinds in MODEL_LAYERS.items():
        for C in contexts_out:
            chunks = [chunk * (i + 1) for i in range(C // chunk)]
            total, parts, missing = 0.0, {}, []
            for part, ops_ in (("indexer", INDEXER_OPS), ("attention", ATTENTION_OPS)):
                for lname, count in kinds[part].items():
                    pts = {}
                    for r in rows:
                        if r.get("phase") == "prefill" and r.get("layer") == lname and r.get("op") in ops_ \
                                and r.get("A100 us (extrapolated)") is not None:
                            pts[r["ctx"]] = pts.get(r["ctx"], 0.0) + r["A100 us (extrapolated)"]
                    if not pts:
                        missing.append(f"{lname} {part}")
                        continue
                    a, b = fit_line(sorted(pts), [pts[c] for c in sorted(pts)])
                    s = count * sum(max(0.0, a + b * c) for c in chunks) / 1e6
                    parts[f"{lname} {part} x{count}"] = s
                    total += s
            out.append({"model": model, "context": C, "TTFT part s (A100 TP8, extrapolated)": total,
                        "parts s": {k: round(v, 3) for k, v in parts.items()}, "missing": missing})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; --dry: none)")
    p.add_argument("--budget-s", type=float, default=100.0, help="skip the cases left past this wall time")
    p.add_argument("--dry", action="store_true", help="CPU, tiny shapes, each call once (no timing)")
    args = p.parse_args()
    t0 = time.time()
    import dsv4_ops  # noqa: F401  (registers torch.ops.dsv4_ampere)

    ops = torch.ops.dsv4_ampere
    dry = args.dry or not torch.cuda.is_available()
    global CHUNK
    if dry:
        dev, contexts, batches, chunk, slots = "cpu", (2048, 4096), (1, 2), 512, 1 << 12
        CHUNK = chunk
    else:
        dev, contexts, batches, chunk, slots = "cuda", CONTEXTS, BATCHES, CHUNK, ATT_CACHE_SLOTS
    g = torch.Generator(device=dev).manual_seed(0)
    tm = Timer(dry)
    caches = att_caches(dev, slots, g)
    rows, skipped = [], []
    cols = ["layer", "phase", "ctx", "B", "op", "us", "byte floor us", "flop floor us", "x floor", "bound",
            "A100 us (extrapolated)", "MB", "GFLOP", "cuBLAS TFLOP/s", "note"]

    out_dir = args.out or (None if dry else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))

    def write():
        if out_dir is None:
            return
        from common import markdown_table, stamp

        ext = extrapolate(rows, chunk, (131072, 262144) if not dry else (4096,))
        meta = stamp()
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "long_context.json"), "w") as f:
            json.dump({"meta": meta, "copy_gbs": tm.copy_gbs, "cublas_tflops": tm.rates, "rows": rows,
                       "extrapolation": ext, "skipped": skipped}, f, indent=1)
        md = [f"### long_context\n\n{', '.join(f'{k} {v}' for k, v in meta.items())}\n",
              f"Copy {tm.copy_gbs:.0f} GB/s (read + written) and cuBLAS bf16 "
              f"{', '.join(f'{n}: {r:.0f}' for n, r in sorted(tm.rates.items()))} TFLOP/s (square n) in this run. "
              "prefill: one 8192-token chunk at the end of the context; decode: B requests, one token each; "
              "floors = bytes at the copy rate, flops at the cuBLAS bf16 rate; x floor = us / max(floors).\n",
              markdown_table(rows, cols), "",
              "**Extrapolation (not a measurement)**: A100 per row = H200 us x A100 floor (2.0 TB/s, 312 TFLOP/s "
              "bf16) / H200 floor; per layer a least-squares line over the contexts, summed over the C / 8192 "
              "chunks of one prefill and the model's indexer + attention layers at TP = 8 (every rank runs the "
              "whole indexer and 8 attention heads); MoE, GEMMs, all-reduce and SWA-only layers are not in it.\n",
              "| model | context | indexer + attention s (A100 TP8, extrapolated) | parts (s) | missing |",
              "|---|---|---|---|---|"]
        md += [f"| {e['model']} | {e['context']} | {e['TTFT part s (A100 TP8, extrapolated)']:.2f} | "
               f"{'; '.join(f'{k} {v}' for k, v in e['parts s'].items())} | {', '.join(e['missing'])} |" for e in ext]
        if skipped:
            md.append(f"\nSkipped past the {args.budget_s:.0f} s budget: {'; '.join(skipped)}")
        with open(os.path.join(out_dir, "long_context.md"), "w") as f:
            f.write("\n".join(md) + "\n")

    for layer in LAYERS:
        for ctx in contexts:
            cases = [("prefill", None)] + [("decode", B) for B in batches]
            for phase, B in cases:
                label = f"{layer[0]} {phase} ctx={ctx}" + (f" B={B}" if B else "")
                if time.time() - t0 > args.budget_s:
                    skipped.append(label)
                    continue
                base = {"layer": layer[0], "model": layer[1], "phase": phase, "ctx": ctx, "B": B or chunk}
                try:
                    if phase == "prefill":
                        prefill_case(tm, rows, base, layer, ctx, dev, caches, g, ops)
                    else:
                        decode_case(tm, rows, base, layer, ctx, B, dev, caches, g, ops)
                except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
                    traceback.print_exc()
                    rows.append(dict(base, op="FAILED", note=repr(exc)[:200]))
                if not dry:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            write()  # after every (layer, context): a timeout keeps what ran
    ext = extrapolate(rows, chunk, (131072, 262144) if not dry else (4096,))
    for e in ext:
        print(e)
    print(f"bench_long_context: {time.time() - t0:.1f} s, {len(rows)} rows, {len(skipped)} skipped")
    return 1 if any(r.get("op") == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
