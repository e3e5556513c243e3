"""Sparse MLA prefill (``sparse_mla_prefill``, what the plugin's prefill runs) at an A100's SM counts: ours and
P2 (when a local copy is present) on 132 and 104 SMs of the H200 through driver green contexts,
DSV4_AMPERE_SMS = the granted count, same inputs, every call in a CUDA graph on the green stream.

    python benchmarks/bench_prefill_sms.py --out DIR [--sms 132,104] [--heads 8,16,64,128] [--sq 4096] [--p2 DIR]

Inputs: q bf16 [s_q, H, 512], the gathered workspace kv bf16 [N = 65536, 512] (beyond the L2), indices int32
[s_q, K = 640] random rows of kv, sink [H], sm_scale 512^-0.5; P2 = ``direct_sparse_attention`` of
Qeeweew/deepseek-v4-a100-sglang (Apache-2.0, read from --p2 DIR/attention.py, never committed) on the same
tensors, autotuned before capture; P2 dual = its ``direct_dual_sparse_attention`` (the entry its decode uses, with
its own autotune table) with the first TOPK index columns as one buffer's and the rest as the other's.
Columns (us; 5 calls a graph, median of the replays): ours_us, p2_us, p2/ours (>= 1.25 is the issue's goal),
p2dual_us, p2dual/ours;
flop_floor_us = 4 s_q H K 512 flops at MMA_TFLOPS_132 x SMs / 132 (mma.sync; bench_decode_sms's guide rate);
err / p2_err: max |out - float64| / max |float64| over the first CHECK_ROWS tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_sms import MMA_TFLOPS_132, _Ctx, load_p2  # noqa: E402
from common import write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import sparse_prefill  # noqa: E402
from dsv4_ops.csrc_triton import sparse_prefill as pk  # noqa: E402
from dsv4_ops.tools.timing import graph_us  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
N_KV = 65536
K = 640
TOPK = 512  # the top-k columns of the K (the rest: the window)
CHECK_ROWS = 32


def ref_rows(q, kv, idx, sink, rows):
    """float64 attention with sink for the first ``rows`` tokens: [rows, H, 512]."""
    qd, kd = q[:rows].double(), kv[idx[:rows].long()].double()  # [r, H, D], [r, K, D]
    s = torch.einsum("thd,tkd->thk", qd, kd) * SM_SCALE
    m = torch.maximum(s.amax(-1), sink.double()[None, :])
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink.double()[None, :] - m)
    return torch.einsum("thk,tkd->thd", p, kd) / den[..., None]


def rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def time_into(row: dict, name: str, call, q, want) -> None:
    """Time ``call(output, lse)`` (a P2 entry or a candidate config) into row[name + '_us'] (called once
    outside the capture: P2 autotunes there) and check its output against ``want`` (float64, the first
    CHECK_ROWS tokens) into row[name + '_err']."""
    try:
        out = torch.empty(q.shape[0], q.shape[1], D, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device="cuda")
        call(out, lse)  # autotunes outside the capture
        torch.cuda.current_stream().synchronize()
        row[f"{name}_us"] = graph_us(lambda: call(out, lse), replays=10, inner=5)
        call(out, lse)
        row[f"{name}_err"] = "%.2g" % rel(out[:CHECK_ROWS], want)
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
        row[f"{name}_error"] = repr(exc)[:200]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="prefill_sms")
    ap.add_argument("--sms", default="132,104")
    ap.add_argument("--heads", default="8,16,64,128")
    ap.add_argument("--sq", type=int, default=4096)
    ap.add_argument("--p2", default=os.environ.get("DSV4_P2_DIR", ""))
    ap.add_argument("--configs", default="", help="candidate configs timed beside ours, bh:i,... "
                    "(csrc_triton.sparse_prefill.CANDIDATES[bh][i]; heads > bh run as bh-row groups)")
    ns = ap.parse_args()
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    p2 = load_p2(ns.p2, "direct_sparse_attention")
    p2_dual = load_p2(ns.p2, "direct_dual_sparse_attention")
    print("P2:", "present" if p2 else "absent (skipped)", flush=True)
    ctxs = [_Ctx(int(n)) for n in ns.sms.split(",")]
    configs = [tuple(int(x) for x in c.split(":")) for c in ns.configs.split(",") if c]
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    kv = torch.randn(N_KV, D, device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    for H in (int(h) for h in ns.heads.split(",")):
        q = torch.randn(ns.sq, H, D, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randint(0, N_KV, (ns.sq, K), device="cuda", generator=g, dtype=torch.int32)
        sink = torch.randn(H, device="cuda", generator=g)
        lengths = torch.full((ns.sq,), K, dtype=torch.int32, device="cuda")
        want = ref_rows(q, kv, idx, sink, CHECK_ROWS)
        flops = 4.0 * ns.sq * H * K * D
        for c in ctxs:
            row = {"s_q": ns.sq, "H": H, "K": K, "SMs": c.sms}
            with c.reentered():
                try:
                    out = torch.empty(ns.sq, H, D, dtype=torch.bfloat16, device="cuda")
                    def ours():
                        return sparse_prefill.sparse_mla_prefill(q, kv, idx, None, sink, SM_SCALE, out=out)
                    row["ours_us"] = graph_us(ours, replays=10, inner=5)
                    ours()
                    row["err"] = "%.2g" % rel(out[:CHECK_ROWS], want)
                except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
                    row["error"] = repr(exc)[:200]
                for bh, i in configs:
                    name = "cfg_" + pk.config_label(bh, pk.CANDIDATES[bh][i]).replace(" ", "_")
                    time_into(row, name, lambda o, l, cfg=(bh, i): sparse_prefill.sparse_mla_prefill(
                        q, kv, idx, None, sink, SM_SCALE, out=o, config=cfg), q, want)
                if p2 is not None:
                    time_into(row, "p2", lambda o, l: p2(q, kv, idx, lengths, SM_SCALE, attn_sink=sink, output=o, lse=l),
                              q, want)
                if p2_dual is not None:  # the top-k and window columns as P2's two buffers (both the workspace)
                    k1 = torch.full_like(lengths, TOPK)
                    k2 = torch.full_like(lengths, K - TOPK)
                    time_into(row, "p2dual", lambda o, l: p2_dual(q, kv, idx[:, :TOPK], k1, kv, idx[:, TOPK:], k2,
                                                                  SM_SCALE, attn_sink=sink, output=o, lse=l), q, want)
            row["flop_floor_us"] = flops / (MMA_TFLOPS_132 * c.sms / 132 * 1e6)
            if "ours_us" in row:
                row["ours/floor"] = row["ours_us"] / row["flop_floor_us"]
                for name in ("p2", "p2dual"):
                    if f"{name}_us" in row:
                        row[f"{name}/ours"] = row[f"{name}_us"] / row["ours_us"]
            print(row, flush=True)
            rows.append(row)
        write_results(ns.name, ns.out, rows, ["s_q", "H", "K", "SMs", "ours_us", "p2_us", "p2/ours", "p2dual_us",
                                              "p2dual/ours", "flop_floor_us", "ours/floor", "err", "p2_err",
                                              "p2dual_err", "error", "p2_error", "p2dual_error"]
                      + sorted({k for r in rows for k in r if k.startswith("cfg_")}),
                      notes=(f"{os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3')}, "
                             f"SMs by driver green contexts, DSV4_AMPERE_SMS = SMs; kv [{N_KV}, 512] bf16, random "
                             f"int32 indices, sink; 5 calls a graph, median of 10 replays; floors: module doc."))


if __name__ == "__main__":
    main()
