"""Sparse prefill (the replacement of FlashMLA's ``flash_mla_sparse_fwd``: ``sparse_mla_decode``
over the gathered bf16 workspace), issue 12's goal shape: s_q = 4096 queries, K = 640 keys a
query, H in {8, 64, 128}. Target: < 60 s on an H200.

    python benchmarks/bench_sparse_prefill.py --out DIR

Floors, from the same run: flops 4 * s_q * H * K * 512 (QK^T and PV) at the rate of a cuBLAS
bf16 GEMM of the same flops; bytes of the unique workspace rows + q + out at the copy rate
(each query's 640 keys are random rows of an N = 16384-row workspace, so the L2 serves most
re-reads; the per-key byte count s_q * K * 1 KiB is reported too). Goal: within 2.5x of the
flop floor at H = 64 and 1.5x of the byte floor at H = 8. Both decode kernels (tiles, heads)
and what auto picks, in-graph (benchmarks.common.time_graph_us).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, parse_args, time_graph_us, time_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import attention, decode_plan  # noqa: E402

D, S_Q, K, N = 512, 4096, 640, 16384
SM_SCALE = D ** -0.5


def gemm_tflops(flops: float) -> float:
    """cuBLAS bf16 rate of a square GEMM with about ``flops`` flops, TFLOP/s."""
    n = max(256, int(round((flops / 2) ** (1 / 3) / 256)) * 256)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_us(lambda: a @ b)
    return 2 * n ** 3 / us / 1e6


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(1 << 30)
    rows = []
    for H in (8, 64, 128):
        q = torch.randn(S_Q, H, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        kv = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = torch.randint(0, N, (S_Q, K), device="cuda", dtype=torch.int32, generator=g)
        sink = torch.randn(H, device="cuda", generator=g)
        flops = 4.0 * S_Q * H * K * D
        rate = gemm_tflops(flops)
        flop_us = flops / rate / 1e6
        unique_bytes = N * D * 2 + 2 * S_Q * H * D * 2
        byte_us = unique_bytes / copy_gbs / 1e3
        key_bytes_us = (S_Q * K * D * 2 + 2 * S_Q * H * D * 2) / copy_gbs / 1e3
        for kernel in ("auto", "tiles", "heads"):
            row = dict(H=H, kernel=kernel, s_q=S_Q, K=K, flop_floor_us=flop_us, byte_floor_us=byte_us,
                       per_key_bytes_us=key_bytes_us, cublas_tflops=rate)
            try:
                plan = decode_plan.plan(S_Q, H, K, decode_plan.num_sms(0), kernel)
                row["plan"] = f"{plan.kernel} S={plan.splits}"
                us = time_graph_us(lambda: attention.sparse_mla_decode(q, kv, idx, None, sink, SM_SCALE, 0,
                                                                       kernel=kernel), inner=5)
                row.update(us=us, x_flop_floor=us / flop_us, x_byte_floor=us / byte_us,
                           tflops=flops / us / 1e6)
            except Exception as exc:  # noqa: BLE001 - one failing case must not stop the table
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                traceback.print_exc()
            rows.append(row)
            print(row, flush=True)
    cols = ["H", "kernel", "plan", "us", "tflops", "cublas_tflops", "flop_floor_us", "x_flop_floor", "byte_floor_us",
            "x_byte_floor", "per_key_bytes_us", "error"]
    notes = (f"Portable unless DSV4_AMPERE_IMPL says otherwise; copy {copy_gbs:.0f} GB/s (read + written) and the "
             "cuBLAS bf16 rate measured in this run. Goal (issue 12): <= 2.5x the flop floor at H = 64, <= 1.5x the "
             "byte floor at H = 8.")
    print(write_results("sparse_prefill", args.out, rows, cols, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
