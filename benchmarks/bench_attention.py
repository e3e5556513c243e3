"""Split-KV sparse MLA decode benchmarks (H200; portable and native variants).

    python benchmarks/bench_attention.py --out DIR [--quick]

Writes (JSON + Markdown, PNG where noted) under DIR:
  attention_split_sweep   every split count 1..max at 14 shapes (T in 1..64, H in {64, 8},
                          K = 640), portable: best count, best us, the heuristic's count and
                          its time ratio to the best (goal <= 1.05)
  attention_decode        unsplit (num_splits = 1) vs the heuristic at H = 64, K = 640, split
                          and merge timed separately, both variants (+ PNG: us vs T; merge us
                          vs n_splits)
  attention_merge         merge us at n_splits in {2, 4, 8, 16, 32, 64} (goal: max <= 1.25 min)
  attention_heads         T = 1: H = 8 unpadded vs H = 64 padded
  attention_composite     the whole DSv4 decode (two gathers + indices + split + merge) at T = 1
                          vs the PyTorch reference (gather, einsum, softmax with sink, einsum)
Every time is the median of CUDA-graph replays (benchmarks.common.time_graph_us).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, time_graph_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import attention, dispatch  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
K = 640
TS = (1, 2, 4, 8, 16, 32, 64)
N_ROWS = 1 << 17  # 128 MiB of bf16 KV rows: beyond the 60 MB L2
VARIANTS = ("portable", "native")
DEVICE = "cuda"


def set_variant(v):
    os.environ["DSV4_AMPERE_IMPL"] = v


def make_inputs(T, H, k=K, n=N_ROWS, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(T, H, D, device=DEVICE, generator=g).to(torch.bfloat16)
    kv = torch.randn(n, D, device=DEVICE, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, n, (T, k), device=DEVICE, generator=g, dtype=torch.int32)
    sink = torch.randn(H, device=DEVICE, generator=g)
    return q, kv, idx, sink


def time_decode(q, kv, idx, sink, s, replays):
    return time_graph_us(lambda: attention.sparse_mla_decode(q, kv, idx, None, sink, SM_SCALE, s), replays)


def time_split_merge(q, kv, idx, sink, s, replays):
    split_us = time_graph_us(lambda: attention.sparse_mla_split(q, kv, idx, None, SM_SCALE, s), replays)
    o_part, lse_part = attention.sparse_mla_split(q, kv, idx, None, SM_SCALE, s)
    merge_us = time_graph_us(lambda: attention.merge_splits(o_part, lse_part, sink), replays)
    return split_us, merge_us


def bench_sweep(args, replays):
    set_variant("portable")
    rows = []
    kv_shared = make_inputs(1, 1)[1]
    for H in (64, 8):
        for T in TS:
            q, _, idx, sink = make_inputs(T, H, seed=T + H)
            heur = dispatch.workspace.tile_splits(T, H, K)
            top = dispatch.workspace.tile_max_splits(K)
            counts = range(1, top + 1)
            if args.quick:
                counts = sorted({1, 2, 4, 8, 16, 32, top, heur} & set(range(1, top + 1)))
            times = {s: time_decode(q, kv_shared, idx, sink, s, replays) for s in counts}
            best = min(times, key=times.get)
            rows.append({"T": T, "H": H, "K": K, "best_splits": best, "best_us": times[best],
                         "heuristic_splits": heur, "heuristic_us": times[heur],
                         "heuristic/best": times[heur] / times[best],
                         "within_5pct": times[heur] <= 1.05 * times[best],
                         "sweep_us": {str(s): round(t, 2) for s, t in times.items()}})
    write_results("attention_split_sweep", args.out, rows,
                  ["T", "H", "K", "best_splits", "best_us", "heuristic_splits", "heuristic_us", "heuristic/best",
                   "within_5pct"],
                  notes="Portable variant, sparse_mla_decode (split + merge) graph-replayed; every split count "
                        "1..max_splits(K). The JSON holds the whole sweep per shape (sweep_us). "
                        "Pinned table: tests/test_decode_splits.py.")
    return rows


def bench_decode(args, replays):
    rows, merge_rows = [], []
    for v in VARIANTS:
        set_variant(v)
        kv = make_inputs(1, 1)[1]
        for T in TS:
            q, _, idx, sink = make_inputs(T, 64, seed=T)
            heur = dispatch.workspace.tile_splits(T, 64, K)
            unsplit = time_decode(q, kv, idx, sink, 1, replays)
            split = time_decode(q, kv, idx, sink, heur, replays)
            s_us, m_us = time_split_merge(q, kv, idx, sink, heur, replays)
            u_s_us, u_m_us = time_split_merge(q, kv, idx, sink, 1, replays)
            rows.append({"variant": v, "T": T, "H": 64, "K": K, "splits": heur, "unsplit_us": unsplit,
                         "split_us": split, "speedup": unsplit / split, "split_kernel_us": s_us, "merge_us": m_us,
                         "unsplit_kernel_us": u_s_us, "unsplit_merge_us": u_m_us})
        # merge alone vs n_splits (T = 1, H = 64)
        for S in (2, 4, 8, 16, 32, 64):
            o_part = torch.randn(1, 64, S, D, device=DEVICE)
            lse_part = torch.randn(1, 64, S, device=DEVICE)
            sink = torch.randn(64, device=DEVICE)
            merge_rows.append({"variant": v, "T": 1, "H": 64, "n_splits": S,
                               "merge_us": time_graph_us(lambda: attention.merge_splits(o_part, lse_part, sink),
                                                         replays)})
    for v in VARIANTS:
        ms = [r["merge_us"] for r in merge_rows if r["variant"] == v]
        for r in merge_rows:
            if r["variant"] == v:
                r["vs_fastest"] = r["merge_us"] / min(ms)

    def plot(path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for v in VARIANTS:
            rs = [r for r in rows if r["variant"] == v]
            a.plot([r["T"] for r in rs], [r["unsplit_us"] for r in rs], "o--", label=f"unsplit ({v})")
            a.plot([r["T"] for r in rs], [r["split_us"] for r in rs], "o-", label=f"split, heuristic ({v})")
            ms = [r for r in merge_rows if r["variant"] == v]
            b.plot([r["n_splits"] for r in ms], [r["merge_us"] for r in ms], "o-", label=v)
        a.set_xscale("log", base=2)
        a.set_xlabel("tokens T (H = 64, K = 640)")
        a.set_ylabel("us (graph replay)")
        a.set_title("sparse MLA decode")
        a.legend()
        b.set_xscale("log", base=2)
        b.set_xlabel("n_splits (T = 1, H = 64)")
        b.set_ylabel("merge us")
        b.set_title("merge_splits")
        b.set_ylim(bottom=0)
        b.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    write_results("attention_decode", args.out, rows,
                  ["variant", "T", "splits", "unsplit_us", "split_us", "speedup", "split_kernel_us", "merge_us"],
                  notes="H = 64, K = 640; split + merge graph-replayed; goal: speedup >= 5.7 at T = 1 and > 1 "
                        "everywhere. split_kernel_us / merge_us: the two kernels timed separately.", plot=plot)
    write_results("attention_merge", args.out, merge_rows, ["variant", "n_splits", "merge_us", "vs_fastest"],
                  notes="merge_splits alone, T = 1, H = 64, with sink; goal: the largest within 1.25x of the "
                        "smallest.")
    return rows, merge_rows


def bench_heads(args, replays):
    rows = []
    for v in VARIANTS:
        set_variant(v)
        kv = make_inputs(1, 1)[1]
        res = {}
        for H in (8, 64):
            q, _, idx, sink = make_inputs(1, H, seed=H)
            if H == 64:  # the 8 real heads padded to 64, as FlashMLA would (padded sinks: -inf)
                sink[8:] = float("-inf")
            res[H] = time_decode(q, kv, idx, sink, 0, replays)
        rows.append({"variant": v, "T": 1, "K": K, "H8_unpadded_us": res[8], "H64_padded_us": res[64],
                     "speedup": res[64] / res[8], "splits_H8": dispatch.workspace.tile_splits(1, 8, K),
                     "splits_H64": dispatch.workspace.tile_splits(1, 64, K)})
    write_results("attention_heads", args.out, rows,
                  ["variant", "H8_unpadded_us", "H64_padded_us", "speedup", "splits_H8", "splits_H64"],
                  notes="T = 1, K = 640, heuristic splits: the per-rank heads at TP = 8 unpadded vs padded to 64.")
    return rows


def bench_composite(args, replays):
    from dsv4_ops import dsv4_decode
    from dsv4_ops.layout import min_page_bytes

    ops = torch.ops.dsv4_ampere
    rows = []
    T, H, K1, K2, bs = 1, 64, 512, 128, 64
    nblk_c, nblk_w = 2048, 64  # 131072 compressed slots (~75 MB of cache), 4096 window slots
    for v in VARIANTS:
        set_variant(v)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        caches = []
        for nb in (nblk_c, nblk_w):
            cache = torch.zeros(nb, min_page_bytes(bs), dtype=torch.uint8, device=DEVICE)
            n = nb * bs
            for start in range(0, n, 1 << 15):
                stop = min(n, start + (1 << 15))
                rows_bf16 = torch.randn(stop - start, D, device=DEVICE, generator=g).to(torch.bfloat16)
                ops.kv_cache_insert(rows_bf16, cache, torch.arange(start, stop, device=DEVICE), bs)
            caches.append(cache)
        cc, cw = caches
        q = torch.randn(T, H, D, device=DEVICE, generator=g).to(torch.bfloat16)
        sink = torch.randn(H, device=DEVICE, generator=g)
        topk = torch.randint(0, nblk_c * bs, (T, K1), device=DEVICE, generator=g, dtype=torch.int32)
        swa = torch.randint(0, nblk_w * bs, (T, K2), device=DEVICE, generator=g, dtype=torch.int32)
        ws = torch.empty(T * (K1 + K2), D, dtype=torch.bfloat16, device=DEVICE)
        cap_c, cap_w = nblk_c * bs, nblk_w * bs

        def ours():
            return dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, bs, bs, workspace=ws)

        def torch_ref():
            kvt = torch.cat([ops.kv_cache_gather(cc, topk, bs), ops.kv_cache_gather(cw, swa, bs)], 1).float()
            valid = torch.cat([(topk >= 0) & (topk < cap_c), (swa >= 0) & (swa < cap_w)], 1)
            s = torch.einsum("thd,tkd->thk", q.float(), kvt) * SM_SCALE
            s = s.masked_fill(~valid[:, None, :], float("-inf"))
            s = torch.cat([s, sink[None, :, None].expand(T, H, 1)], -1)
            p = torch.softmax(s, -1)
            lse = torch.logsumexp(s, -1)
            return torch.einsum("thk,tkd->thd", p[..., :-1], kvt).to(torch.bfloat16), lse

        o1, l1 = ours()
        o2, l2 = torch_ref()
        err = ((o1.float() - o2.float()).norm() / o2.float().norm()).item()
        ours_us = time_graph_us(ours, replays)
        ref_us = time_graph_us(torch_ref, replays)
        gather_us = time_graph_us(lambda: (ops.kv_cache_gather_into(cc, topk, bs, ws, 0),
                                           ops.kv_cache_gather_into(cw, swa, bs, ws, T * K1)), replays)
        rows.append({"variant": v, "T": T, "H": H, "K": K1 + K2, "ours_us": ours_us, "torch_ref_us": ref_us,
                     "speedup": ref_us / ours_us, "gathers_us": gather_us, "rel_err_vs_ref": err})
    write_results("attention_composite", args.out, rows,
                  ["variant", "T", "H", "K", "ours_us", "torch_ref_us", "speedup", "gathers_us", "rel_err_vs_ref"],
                  notes="Whole DSv4 decode attention at T = 1 (2 gathers + index build + split + merge) vs the "
                        "PyTorch reference (the same gathers, einsum, softmax with sink, einsum), both "
                        "CUDA-graph replayed in the same run. Goal: >= 4x.")
    return rows


def main():
    args = parse_args(__doc__.splitlines()[0])
    replays = 10 if args.quick else 30  # each replay runs the call 20 times (time_graph_us)
    failures = []
    for name, fn in (("sweep", bench_sweep), ("decode", bench_decode), ("heads", bench_heads),
                     ("composite", bench_composite)):
        try:
            fn(args, replays)
        except Exception:  # noqa: BLE001 - keep the other benchmarks' results
            failures.append(name)
            traceback.print_exc()
    os.environ.pop("DSV4_AMPERE_IMPL", None)
    if failures:
        print(f"FAILED benchmarks: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
