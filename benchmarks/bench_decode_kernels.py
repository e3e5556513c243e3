"""Decode kernels, tiles vs heads, in-graph. Target: < 90 s on an H200.

    python benchmarks/bench_decode_kernels.py --out DIR [--quick]

Writes (JSON + Markdown) under DIR:
  decode_kernels        sparse_mla_decode at T in {1, 8, 64, 128} x H in {8, 16, 64, 128},
                        K = 640, portable: tiles (split heuristic) vs heads (dispatch.decode's
                        split count, and every balanced count: best_heads_us / best_splits),
                        with the byte floor (T*K*1024 + q + out at the same run's copy rate)
  decode_kernels_step   the whole step (dsv4_decode_attention: gather + decode) at T in
                        {1, 64, 128} x H in {8, 64} under DSV4_AMPERE_DECODE_KERNEL = auto,
                        tiles, heads
  decode_kernels_108sm  the kernels table's tiles/heads at 108 SMs (an A100's count) in a
                        torch.cuda.green_contexts green context, plans computed for 108 SMs;
                        skipped (one row saying why) where green contexts are unavailable
Every time: benchmarks.common.time_graph_us (20 calls in one CUDA graph, median of replays).
A failing case writes its error in the row and the others go on.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, in_green_context, parse_args, time_graph_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import attention, dispatch, dsv4_decode, reference  # noqa: E402
from dsv4_ops.layout import min_page_bytes  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
K = 640
TS = (1, 8, 64, 128)
HS = (8, 16, 64, 128)
N_ROWS = 1 << 17  # 128 MiB of bf16 rows: beyond the 60 MB L2


def make_inputs(T, H, n=N_ROWS, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, n, (T, K), device="cuda", generator=g, dtype=torch.int32)
    sink = torch.randn(H, device="cuda", generator=g)
    return q, idx, sink


def byte_floor_us(T, H, gbs):
    return (T * K * 1024 + 2 * T * H * D * 2) / (gbs * 1e3)


def kernel_rows(kv, sms, gbs, replays, sweep=True):
    rows = []
    for T in TS:
        for H in HS:
            row = {"T": T, "H": H, "K": K, "sms": sms}
            try:
                q, idx, sink = make_inputs(T, H)
                s_t = dispatch.workspace.tile_splits(T, H, K)
                row["tiles_splits"] = s_t
                row["tiles_us"] = time_graph_us(lambda: attention.sparse_mla_decode(
                    q, kv, idx, None, sink, SM_SCALE, s_t, kernel="tiles"), replays)
                p = dispatch.workspace.plan(T, H, K, sms, "heads")
                row["heads_splits"] = p.splits
                row["heads_us"] = time_graph_us(lambda: attention.sparse_mla_decode(
                    q, kv, idx, None, sink, SM_SCALE, p.splits, kernel="heads"), replays)
                row["tiles/heads"] = row["tiles_us"] / row["heads_us"]
                row["model_us"] = dispatch.workspace.heads_time_us(T, H, K, sms, p.splits)
                if sweep:
                    best = (row["heads_us"], p.splits)
                    for s in dispatch.workspace.balanced_splits(-(-K // p.block_n))[:5]:
                        if s != p.splits:
                            us = time_graph_us(lambda: attention.sparse_mla_decode(
                                q, kv, idx, None, sink, SM_SCALE, s, kernel="heads"), max(10, replays // 3))
                            best = min(best, (us, s))
                    row["best_heads_us"], row["best_splits"] = best
                row["floor_us"] = byte_floor_us(T, H, gbs)
            except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
                row["error"] = repr(exc)[:200]
                traceback.print_exc()
            rows.append(row)
            print(row, flush=True)
    return rows


def make_cache(bs, nblk, seed):
    """A paged fp8_ds_mla cache written by the reference insert (on the CPU, then moved)."""
    cache = torch.zeros(nblk, min_page_bytes(bs), dtype=torch.uint8)
    rows = torch.randn(nblk * bs, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    reference.ref_kv_cache_insert(rows, cache, torch.arange(nblk * bs), bs)
    return cache.cuda()


def step_rows(replays):
    rows = []
    bs, nblk = 64, 256  # 16K slots a cache
    cc, cw = make_cache(bs, nblk, 1), make_cache(bs, nblk, 2)
    g = torch.Generator(device="cuda").manual_seed(3)
    for T in (1, 64, 128):
        topk = torch.randint(0, bs * nblk, (T, 512), device="cuda", generator=g, dtype=torch.int32)
        swa = torch.randint(0, bs * nblk, (T, 128), device="cuda", generator=g, dtype=torch.int32)
        ws = torch.empty(T * 640, D, dtype=torch.bfloat16, device="cuda")
        for H in (8, 64):
            q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
            sink = torch.randn(H, device="cuda", generator=g)
            row = {"T": T, "H": H}
            for mode in dispatch.decode.MODES:
                os.environ[dispatch.decode.ENV_VAR] = mode
                try:
                    row[f"{mode}_us"] = time_graph_us(lambda: dsv4_decode.dsv4_decode_attention(
                        q, cc, topk, cw, swa, sink, SM_SCALE, bs, bs, workspace=ws), replays)
                except Exception as exc:  # noqa: BLE001
                    row[f"{mode}_error"] = repr(exc)[:200]
                    traceback.print_exc()
            os.environ.pop(dispatch.decode.ENV_VAR, None)
            rows.append(row)
            print(row, flush=True)
    return rows


def green_rows(kv, gbs, replays, sms=108):
    """The kernel table on `sms` SMs in a green context (common.in_green_context), or one row
    saying why not."""
    try:
        return in_green_context(sms, lambda: kernel_rows(kv, sms, gbs, replays, sweep=False))
    except RuntimeError as exc:
        return [{"sms": sms, "error": repr(exc)[:200]}]


def main():
    args = parse_args(__doc__.splitlines()[0])
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    replays = 10 if args.quick else 30
    gbs = copy_bandwidth_gbs(256 << 20)
    kv = torch.randn(N_ROWS, D, device="cuda").to(torch.bfloat16)
    sms = dispatch.device.num_sms(torch.cuda.current_device())
    cols = ["T", "H", "K", "sms", "tiles_splits", "tiles_us", "heads_splits", "heads_us", "tiles/heads",
            "model_us", "best_heads_us", "best_splits", "floor_us", "error"]
    write_results("decode_kernels", args.out, kernel_rows(kv, sms, gbs, replays, sweep=not args.quick), cols,
                  notes=f"portable, K = {K}, int32 indices, sink; heads splits from dispatch.decode (cost model), "
                        f"best_*: the fastest balanced count measured (<= 5 tried). floor: bytes at the "
                        f"same run's copy rate {gbs:.0f} GB/s.")
    write_results("decode_kernels_step", args.out, step_rows(replays),
                  ["T", "H", "auto_us", "tiles_us", "heads_us", "auto_error", "tiles_error", "heads_error"],
                  notes="dsv4_decode_attention (dsv4_decode_gather + sparse_mla_decode), K = 512 + 128, "
                        "under each DSV4_AMPERE_DECODE_KERNEL value.")
    if time.time() - t0 < 60:  # the budget: < 90 s in all
        try:
            rows = green_rows(kv, gbs, replays)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows = [{"sms": 108, "error": repr(exc)[:200]}]
        write_results("decode_kernels_108sm", args.out, rows, cols,
                      notes="108 SMs (A100 count) in a green context; plans computed for 108 SMs.")
    else:
        print("bench_decode_kernels: 108-SM table skipped (over 60 s already)")
    print(f"bench_decode_kernels: {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
