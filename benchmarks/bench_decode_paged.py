"""The paged decode of mode v3 (batched regime) against today's decode step, in-graph. < 200 s on an H200.

    python benchmarks/bench_decode_paged.py --out DIR [--quick] [--configs a,b,...] [--name decode_paged_f16dot]
                                         [--shapes T:H:K1,...] [--no-pipe] [--sms 108]

Writes decode_v3.{json,md} under DIR: for T in {1, 4, 16, 64, 128, 256} x H in {8, 16, 64,
128}, K = 512 top-k + 128 window (and the draft's K = 128 + 128 at a few shapes):
  step_us        dsv4_decode_attention under DSV4_AMPERE_DECODE_KERNEL=auto before this work
                 (workspace gather + tiles / heads, or v1 fused at T = 4, H <= 16): the
                 same-run baseline (AUTO_V3_WINDOWS emptied while it is timed)
  auto_us        the same composite under auto with this commit's AUTO_V3_WINDOWS (step/auto)
  pipe_us        H <= 16: the v1 fused kernel's PIPELINE form (paged_chunk64.
                 FUSED_PIPELINE_CONFIG, never measured before) at its plan's split count
  <cfg>_us       the v3 form with launch config <cfg> (dispatch.decode.v3_config: paged_chunk128.
                 V3_CANDIDATES, or paged_f16dot.V4_CANDIDATES, the fp16-dot kernel: k* one
                 scale a key, g* per-group P), the best of a few split counts around its
                 plan's (<cfg>_S)
  best_v3_us     the fastest v3 entry (best_cfg, best_S); step/v3 = step_us / best_v3_us
  floor_us       max(record bytes T*K*584 + q + out at the same run's copy rate,
                 mma flops 4*T*H16*K*512 at MMA_TFLOPS (H16 = H padded to 16), 1 launch)
  err_<cfg>      relative Frobenius error of <cfg>'s out (plan split) against the float64
                 reference of the same inputs (ref_dsv4_decode_fused); 'FAIL' when
                 testing.assert_attention_close rejects it (the tests' tolerances)
Caches: 2 x 1,048,576-slot pages of 64 (612 MB, beyond the 60 MB L2), random valid slots,
int32, sink, no lengths. Every time: benchmarks.common.time_graph_us (20 calls in one CUDA
graph, median of replays).
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
from dsv4_ops import _host_plan, dispatch, dsv4_decode, paged_decode, reference  # noqa: E402
from dsv4_ops.csrc_triton.decode import paged_chunk64 as _pk  # noqa: E402
from dsv4_ops.layout import RECORD_BYTES, vllm_page_bytes  # noqa: E402
from dsv4_ops.testing import assert_attention_close  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
BS = 64
NBLK = 16384  # 1M slots a cache
TS = (1, 4, 16, 64, 128, 256)
HS = (8, 16, 64, 128)
DRAFT = [(1, 8), (16, 16), (64, 64), (128, 128)]  # K1 = 128 (the draft's K = 256)
LAUNCH_US = 0.9
MMA_TFLOPS = 600.0  # mma.sync bf16 on the H200 (no wgmma at M = 16 / 32), a guide
DEFAULT_CONFIGS = ("h16n32w4", "h16n16w4", "h16n32w8", "h32n32w8", "h16n16w4p", "h32n16w8p")


def make_cache(seed):
    ops = torch.ops.dsv4_ampere
    cache = torch.zeros(NBLK, vllm_page_bytes(BS), dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = NBLK * BS
    for lo in range(0, n, 1 << 18):
        rows = torch.randn(min(1 << 18, n - lo), D, device="cuda", generator=g).to(torch.bfloat16)
        ops.kv_cache_insert(rows, cache, torch.arange(lo, lo + rows.shape[0], device="cuda"), BS)
    return cache


def split_choices(plan_s, nb, T):
    out = [plan_s]
    for s in ((1, 2, 3) if T >= 64 else (max(1, plan_s // 2), plan_s * 2)):
        if s <= min(nb, 64) and s not in out:
            out.append(s)
    return out


def measure(cc, cw, T, H, K1, gbs, replays, sms, configs, pipe):
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H + K1)
    cap = NBLK * BS
    topk = torch.randint(0, cap, (T, K1), device="cuda", generator=g, dtype=torch.int32)
    swa = torch.randint(0, cap, (T, 128), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device="cuda", generator=g)
    ws = torch.empty(T * (K1 + 128), D, dtype=torch.bfloat16, device="cuda")
    K = K1 + 128
    row = {"T": T, "H": H, "K": K}
    try:
        saved = dispatch.windows.AUTO_V3_WINDOWS, dispatch.windows.AUTO_V3_SMEM_WINDOWS
        dispatch.windows.AUTO_V3_WINDOWS = dispatch.windows.AUTO_V3_SMEM_WINDOWS = ()
        _host_plan.clear()
        os.environ[dispatch.decode.ENV_VAR] = "auto"

        def step():
            return dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS, workspace=ws)

        step()
        row["step_us"] = time_graph_us(step, replays)
        dispatch.windows.AUTO_V3_WINDOWS, dispatch.windows.AUTO_V3_SMEM_WINDOWS = saved
        _host_plan.clear()  # the recorded launch plans of the step run are not keyed on the windows
        row["auto_us"] = time_graph_us(step, replays)
        row["step/auto"] = row["step_us"] / row["auto_us"]
        os.environ.pop(dispatch.decode.ENV_VAR, None)
        want, want_lse = reference.ref_dsv4_decode_fused(q, cc, topk, None, BS, cw, swa, None, BS, sink, SM_SCALE,
                                                         out_dtype=torch.float64)

        def check(out, lse):
            diff = (out.double() - want).norm().item() / max(want.norm().item(), 1e-30)
            try:
                assert_attention_close(out, lse, want, want_lse)
            except AssertionError:
                return "FAIL %.2g" % diff
            return "%.2g" % diff

        if H <= 16 and pipe:
            default = _pk.FUSED_CONFIG[16]
            _pk.FUSED_CONFIG[16] = _pk.FUSED_PIPELINE_CONFIG[16]
            dispatch.decode.fused_plan.cache_clear()
            try:
                hp = dispatch.decode.fused_plan(T, H, K, sms)
                fn = lambda: paged_decode.dsv4_decode_fused(q, cc, topk, None, BS, cw, swa, None, BS, sink,  # noqa: E731
                                                            SM_SCALE, hp.splits, form="v1")
                row["err_pipe"] = check(*fn())
                row["pipe_S"] = hp.splits
                row["pipe_us"] = time_graph_us(fn, replays)
            finally:
                _pk.FUSED_CONFIG[16] = default
                dispatch.decode.fused_plan.cache_clear()
        best = None
        for name in configs:
            cfg = dispatch.decode.v3_config(name)
            if cfg["BLOCK_H"] > 16 and H <= 16:
                continue  # padding 8 / 16 heads to 32 rows: never faster than a 16-row group
            plan = dispatch.decode.v3_plan(T, H, K, sms, 0, name)
            nb = -(-K // plan.block_n)

            def fn(s, name=name):
                return lambda: paged_decode.dsv4_decode_fused(q, cc, topk, None, BS, cw, swa, None, BS, sink, SM_SCALE,
                                                              s, form="v3", config=name)

            row[f"err_{name}"] = check(*fn(plan.splits)())
            res = min((time_graph_us(fn(s), replays), s) for s in split_choices(plan.splits, nb, T))
            row[f"{name}_us"], row[f"{name}_S"] = res
            if best is None or res[0] < best[0]:
                best = (res[0], name, res[1])
        if best:
            row["best_v3_us"], row["best_cfg"], row["best_S"] = best
            row["step/v3"] = row["step_us"] / best[0]
        nbytes = T * K * RECORD_BYTES + 2 * T * H * D * 2
        h16 = max(16, -(-H // 16) * 16)
        row["floor_us"] = max(nbytes / (gbs * 1e3), 4.0 * T * h16 * K * D / (MMA_TFLOPS * 1e6), LAUNCH_US)
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
        row["error"] = repr(exc)[:200]
        traceback.print_exc()
    finally:
        os.environ.pop(dispatch.decode.ENV_VAR, None)
    print(row, flush=True)
    return row


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--no-pipe", action="store_true", help="skip the v1 PIPELINE column")
    ap.add_argument("--name", default="decode_v3", help="results file stem (decode_v4 for the fp16-dot round)")
    ap.add_argument("--shapes", default="", help="T:H:K1,... instead of the grid")
    ap.add_argument("--sms", type=int, default=0,
                    help="run in a green context of this many SMs (108: an A100's), plans made for it")
    ns, rest = ap.parse_known_args()
    sys.argv = [sys.argv[0]] + (["--out", ns.out] if ns.out else []) + (["--quick"] if ns.quick else [])
    args = parse_args(__doc__.splitlines()[0])
    configs = [c for c in ns.configs.split(",") if c]
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    replays = 10 if args.quick else 20
    gbs = copy_bandwidth_gbs(256 << 20)
    sms = ns.sms or dispatch.device.num_sms(torch.cuda.current_device())
    cc, cw = make_cache(1), make_cache(2)
    rows = []
    cols = (["T", "H", "K", "step_us", "auto_us", "step/auto", "pipe_us", "pipe_S"] + [f"{c}_us" for c in configs]
            + [f"{c}_S" for c in configs]
            + ["best_v3_us", "best_cfg", "best_S", "step/v3", "floor_us", "err_pipe"] + [f"err_{c}" for c in configs]
            + ["error"])
    shapes = [(T, H, 512) for T in TS for H in HS] + [(T, H, 128) for T, H in DRAFT]
    if args.quick:
        shapes = [(1, 8, 512), (64, 64, 512), (128, 8, 512)]
    if ns.shapes:
        shapes = [tuple(int(x) for x in sh.split(":")) for sh in ns.shapes.split(",")]
    green = f" (a green context of {sms} SMs on this GPU)" if ns.sms else ""

    def sweep():
        for T, H, K1 in shapes:
            rows.append(measure(cc, cw, T, H, K1, gbs, replays, sms, configs, not ns.no_pipe))
            write_results(ns.name, args.out, rows, cols,  # after every row: a timeout keeps what ran
                          notes=f"{os.environ.get('DSV4_AMPERE_IMPL')}, {sms} SMs{green}, int32 slots, sink, no "
                                f"lengths; step = the decode step of DSV4_AMPERE_DECODE_KERNEL=auto before v3; "
                                f"<cfg>_us: the v3 kernel, best of a few split counts (<cfg>_S); floor: record bytes "
                                f"at the copy rate {gbs:.0f} GB/s (all SMs), mma flops at {MMA_TFLOPS:.0f} TFLOP/s or "
                                f"one launch; err: vs float64.")
            if time.time() - t0 > float(os.environ.get("BENCH_BUDGET_S", "1e9")):
                print("bench_decode_paged: time budget reached, stopping")
                break

    in_green_context(sms, sweep) if ns.sms else sweep()
    print(f"bench_decode_paged: {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
