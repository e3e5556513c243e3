"""The fused paged decode against the current decode step, in-graph. < 120 s on an H200.

    python benchmarks/bench_decode_paged_chunk64.py --out DIR [--quick]

Writes decode_fused.{json,md} under DIR: for T in {1, 4, 16, 64, 128, 256} x H in {8, 16, 64,
128}, K = 512 top-k + 128 window (and the draft's K = 128 + 128 at a few shapes):
  step_us        the workspace step as it was before this op (dsv4_decode_gather +
                 sparse_mla_decode; DSV4_AMPERE_DECODE_KERNEL = tiles below T = 64, heads
                 from T = 64: the old auto), the same-run baseline
  auto_us        dsv4_decode_attention under DSV4_AMPERE_DECODE_KERNEL=auto (this commit's)
  fused_us       dsv4_decode_fused_out with dispatch.decode.fused_plan's split count
  best_fused_us  the fastest of a few balanced split counts (best_splits)
  pipe_us        H <= 16: the PIPELINE form (csrc_triton.decode.paged_chunk64.FUSED_PIPELINE_CONFIG:
                 the next block's records loaded during this block's MMAs; not dispatched
                 yet) at its plan's split count (pipe_splits)
  floor_us       max(unique record bytes T*K*584 + q + out at the same run's copy rate,
                 in-graph launches: 1 (one split) or 2 x ~0.9 us)
  max_diff       max |fused - step| of the bf16 outputs (both are checked against the
                 float64 reference by tests/test_decode_paged_chunk64.py)
Caches: 2 x 1,048,576-slot pages of 64 (612 MB, beyond the 60 MB L2), random valid slots.
Every time: benchmarks.common.time_graph_us (20 calls in one CUDA graph, median of replays).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, parse_args, time_graph_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import dispatch, dsv4_decode, paged_decode  # noqa: E402
from dsv4_ops.csrc_triton.decode import paged_chunk64 as _pk  # noqa: E402
from dsv4_ops.layout import RECORD_BYTES, vllm_page_bytes  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
BS = 64
NBLK = 16384  # 1M slots a cache
TS = (1, 4, 16, 64, 128, 256)
HS = (8, 16, 64, 128)
DRAFT = [(1, 8), (64, 64)]  # K1 = 128 (the draft's K = 256)
SPLITS = (1, 2, 3, 4, 5, 10, 20, 40)
LAUNCH_US = 0.9


def make_cache(seed):
    ops = torch.ops.dsv4_ampere
    cache = torch.zeros(NBLK, vllm_page_bytes(BS), dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = NBLK * BS
    for lo in range(0, n, 1 << 18):
        rows = torch.randn(min(1 << 18, n - lo), D, device="cuda", generator=g).to(torch.bfloat16)
        ops.kv_cache_insert(rows, cache, torch.arange(lo, lo + rows.shape[0], device="cuda"), BS)
    return cache


def old_auto(T):
    return "heads" if T >= dispatch.decode.AUTO_HEADS_MIN_T else "tiles"


def measure(cc, cw, T, H, K1, gbs, replays, sweep, sms):
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H + K1)
    cap = NBLK * BS
    topk = torch.randint(0, cap, (T, K1), device="cuda", generator=g, dtype=torch.int32)
    swa = torch.randint(0, cap, (T, 128), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device="cuda", generator=g)
    ws = torch.empty(T * (K1 + 128), D, dtype=torch.bfloat16, device="cuda")
    K = K1 + 128
    row = {"T": T, "H": H, "K": K}

    def step():
        return dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS, workspace=ws)

    try:
        os.environ[dispatch.decode.ENV_VAR] = old_auto(T)
        ref_out = step()[0]
        row["step_us"] = time_graph_us(step, replays)
        os.environ[dispatch.decode.ENV_VAR] = "auto"
        row["auto_us"] = time_graph_us(step, replays)
        os.environ.pop(dispatch.decode.ENV_VAR, None)
        plan = dispatch.decode.fused_plan(T, H, K, sms)
        row["plan_splits"] = plan.splits

        def fused(s):
            return lambda: paged_decode.dsv4_decode_fused(q, cc, topk, None, BS, cw, swa, None, BS, sink, SM_SCALE, s)

        out = fused(plan.splits)()[0]
        row["max_diff"] = (out.float() - ref_out.float()).abs().max().item()
        row["fused_us"] = time_graph_us(fused(plan.splits), replays)
        best = (row["fused_us"], plan.splits)
        if sweep:
            nb = -(-K // plan.block_n)
            for s in SPLITS:
                if s != plan.splits and s <= nb:
                    best = min(best, (time_graph_us(fused(s), max(10, replays // 2)), s))
        row["best_fused_us"], row["best_splits"] = best
        if H <= 16:
            default = _pk.FUSED_CONFIG[16]
            _pk.FUSED_CONFIG[16] = _pk.FUSED_PIPELINE_CONFIG[16]
            dispatch.decode.fused_plan.cache_clear()
            try:
                hp = dispatch.decode.fused_plan(T, H, K, sms)
                h_out = fused(hp.splits)()[0]
                row["pipe_diff"] = (h_out.float() - ref_out.float()).abs().max().item()
                row["pipe_splits"] = hp.splits
                row["pipe_us"] = time_graph_us(fused(hp.splits), replays)
                row["step/pipe"] = row["step_us"] / row["pipe_us"]
            finally:
                _pk.FUSED_CONFIG[16] = default
                dispatch.decode.fused_plan.cache_clear()
        row["step/fused"] = row["step_us"] / row["fused_us"]
        row["step/best"] = row["step_us"] / row["best_fused_us"]
        row["step/auto"] = row["step_us"] / row["auto_us"]
        nbytes = T * K * RECORD_BYTES + 2 * T * H * D * 2
        row["floor_us"] = max(nbytes / (gbs * 1e3), LAUNCH_US * (1 if plan.splits == 1 else 2))
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
        row["error"] = repr(exc)[:200]
        traceback.print_exc()
    finally:
        os.environ.pop(dispatch.decode.ENV_VAR, None)
    print(row, flush=True)
    return row


def main():
    args = parse_args(__doc__.splitlines()[0])
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    replays = 10 if args.quick else 30
    gbs = copy_bandwidth_gbs(256 << 20)
    sms = dispatch.device.num_sms(torch.cuda.current_device())
    cc, cw = make_cache(1), make_cache(2)
    rows = []
    cols = ["T", "H", "K", "step_us", "auto_us", "plan_splits", "fused_us", "best_fused_us", "best_splits",
            "step/fused", "step/best", "step/auto", "pipe_splits", "pipe_us", "step/pipe", "floor_us", "max_diff",
            "pipe_diff", "error"]
    shapes = [(T, H, 512) for T in TS for H in HS] + [(T, H, 128) for T, H in DRAFT]
    for T, H, K1 in shapes:
        rows.append(measure(cc, cw, T, H, K1, gbs, replays, not args.quick, sms))
        write_results("decode_fused", args.out, rows, cols,  # after every row: a timeout keeps what ran
                      notes=f"{os.environ.get('DSV4_AMPERE_IMPL')}, {sms} SMs, int32 slots, sink, no lengths; step = "
                            f"the workspace step (old auto: tiles below T = 64, heads from 64); auto = this "
                            f"commit's DSV4_AMPERE_DECODE_KERNEL=auto; floor: record bytes at the same run's copy rate "
                            f"{gbs:.0f} GB/s or the in-graph launches.")
    print(f"bench_decode_paged_chunk64: {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
