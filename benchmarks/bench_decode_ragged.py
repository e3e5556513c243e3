"""The decode on batches whose tokens attend different key counts (issue 28 item 1: what a step plan that
balances the step's (token, key block) work over the SMs could gain over the per-token split).

    python benchmarks/bench_decode_ragged.py --out DIR [--sms 132,104] [--shapes T:H,...] [--p2 DIR]

Every token has 512 top-k + 128 window columns (the buffers vLLM hands the decode); the lengths say how many
it attends. Per shape (T tokens, H heads) and SM count, three batches of the same shapes:
  full     every token 512 + 128 keys (long contexts)
  ragged   one token in 8 at 512 + 128 keys, the others at 32 + 128 (contexts of ~128 tokens: C4A's
           top-k is capped by the compressed length); mean 220 keys a token
  even     every token at the ragged batch's mean: 92 + 128 = 220 keys (the same total work spread evenly:
           about what a balanced plan of the ragged batch could reach with these kernels)
ours: dsv4_decode.dsv4_decode_attention under auto (the plugin's call; its plan sees shapes, never lengths),
P2 (when a local copy is present, never committed): direct_dual_sparse_attention with the same lengths over
bf16 buffers. ragged / even is the most a balanced plan could gain here. Every output is checked against
float64 (reference.ref_dsv4_decode_fused with the lengths; P2's: bench_decode_sms.ref_bf16). 20 calls a CUDA
graph on a driver green context's stream, median of the replays; DSV4_AMPERE_SMS = the SM count.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_sms import BS, D, NBLK, SM_SCALE, _Ctx, load_p2, make_caches, ref_bf16  # noqa: E402
from common import write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import _host_plan, dispatch, dsv4_decode, reference  # noqa: E402
from dsv4_ops.testing import assert_attention_close  # noqa: E402
from dsv4_ops.tools.timing import graph_us  # noqa: E402

K1, K2 = 512, 128
SHAPES = ((64, 8), (128, 8), (256, 8), (64, 64), (128, 64))
LONG_EVERY = 8  # one token in 8 long
SHORT_TOPK = 32
EVEN_TOPK = (K1 + (LONG_EVERY - 1) * SHORT_TOPK) // LONG_EVERY  # 92: the ragged batch's mean top-k


def lengths(T: int, mix: str) -> torch.Tensor:
    """Top-k lengths int32 [T] of a batch mix (module doc); the window is always 128."""
    if mix == "full":
        return torch.full((T,), K1, dtype=torch.int32)
    if mix == "even":
        return torch.full((T,), EVEN_TOPK, dtype=torch.int32)
    out = torch.full((T,), SHORT_TOPK, dtype=torch.int32)
    out[::LONG_EVERY] = K1
    return out


def step_inputs(T: int, H: int):
    """One step's inputs, seeded by (T, H): top-k slots int32 [T, K1], window slots int32 [T, K2] (random
    slots of the caches), q bf16 [T, H, 512], sink fp32 [H], window lengths int32 [T] (all K2)."""
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H)
    cap = NBLK * BS
    topk = torch.randint(0, cap, (T, K1), device="cuda", generator=g, dtype=torch.int32)
    swa = torch.randint(0, cap, (T, K2), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device="cuda", generator=g)
    swa_len = torch.full((T,), K2, dtype=torch.int32, device="cuda")
    return topk, swa, q, sink, swa_len


def measure(T, H, caches, ctxs, p2, replays, step=False):
    (cc, bc), (cw, bw) = caches
    topk, swa, q, sink, swa_len = step_inputs(T, H)
    rows = []
    for mix in ("full", "ragged", "even"):
        tl_ = lengths(T, mix).cuda()
        want, want_lse = reference.ref_dsv4_decode_fused(q, cc, topk, tl_, BS, cw, swa, swa_len, BS, sink, SM_SCALE,
                                                         out_dtype=torch.float64)
        p2_want = ref_bf16(q, bc, topk, bw, swa, sink, tl_) if p2 is not None else None
        for gs in ctxs:
            row = {"T": T, "H": H, "mix": mix, "keys": round(float(tl_.float().mean()) + K2, 1), "SMs": gs.sms}
            try:
                with gs.reentered():
                    _host_plan.clear()
                    os.environ[dispatch.decode.ENV_VAR] = "auto"

                    def ours():
                        return dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS,
                                                                 topk_length=tl_, swa_length=swa_len)

                    out, lse = ours()
                    try:
                        assert_attention_close(out, lse, want, want_lse)
                        row["err"] = "%.2g" % ((out.double() - want).norm() / want.norm()).item()
                    except AssertionError:
                        row["err"] = "FAIL"
                    row["ours_us"] = graph_us(ours, replays)
                    if step:  # one step dict a graph of 20 calls: one plan for 20 layers of a type
                        calls, plans = [0], {}

                        def ours_step():
                            if calls[0] < 2 or (calls[0] - 2) % 20 == 0:  # graph_us: 2 eager calls, then 20
                                plans.clear()
                            calls[0] += 1
                            return dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS,
                                                                     topk_length=tl_, swa_length=swa_len,
                                                                     step_plans=plans)

                        row["ours_step_us"] = graph_us(ours_step, replays)
                    if p2 is not None:
                        def p2_call():
                            return p2(q, bc, topk, tl_, bw, swa, swa_len, SM_SCALE, sink)

                        d = ((p2_call()[0].double() - p2_want).norm() / p2_want.norm()).item()
                        row["p2_err"] = ("FAIL %.2g" if d > 1e-2 else "%.2g") % d
                        row["p2_us"] = graph_us(p2_call, replays)
                        row["ours/p2"] = row["ours_us"] / row["p2_us"]
            except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
                row["error"] = repr(exc)[:200]
                traceback.print_exc()
            finally:
                os.environ.pop(dispatch.decode.ENV_VAR, None)
            print(row, flush=True)
            rows.append(row)
    by = {(r["mix"], r["SMs"]): r for r in rows}
    for gs in ctxs:  # the most a balanced plan could gain: ragged over even, same run
        rg, ev = by.get(("ragged", gs.sms), {}), by.get(("even", gs.sms), {})
        if "ours_us" in rg and "ours_us" in ev:
            rg["ragged/even"] = rg["ours_us"] / ev["ours_us"]
            if "p2_us" in rg and "p2_us" in ev:
                rg["p2 ragged/even"] = rg["p2_us"] / ev["p2_us"]
    return rows


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="decode_ragged")
    ap.add_argument("--sms", default="132,104")
    ap.add_argument("--shapes", default="", help="T:H,... instead of SHAPES")
    ap.add_argument("--p2", default=os.environ.get("DSV4_P2_DIR", ""))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--step-plans", action="store_true",
                    help="also time ours with one step dict a graph of 20 calls (ours_step_us: the balanced plan "
                         "made once for 20 layers, DSV4_AMPERE_DECODE_BALANCE=1)")
    ns = ap.parse_args()
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    p2 = load_p2(ns.p2)
    print(f"P2: {'from ' + ns.p2 if p2 else 'absent, skipped'}", flush=True)
    ctxs = [_Ctx(int(n)) for n in ns.sms.split(",")]
    caches = make_caches(p2 is not None)
    shapes = [tuple(int(x) for x in s.split(":")) for s in ns.shapes.split(",")] if ns.shapes else SHAPES
    rows = []
    cols = ["T", "H", "mix", "keys", "SMs", "ours_us", "ours_step_us", "p2_us", "ours/p2", "ragged/even", "p2 ragged/even", "err",
            "p2_err", "error"]
    for T, H in shapes:
        rows += measure(T, H, caches, ctxs, p2, ns.replays, ns.step_plans)
        write_results(ns.name, ns.out, rows, cols,
                      notes=(f"{os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3')}, "
                             "SMs by driver green contexts, DSV4_AMPERE_SMS = SMs; 512 + 128 key columns a token, "
                             f"lengths by mix (module doc); P2 {'timed' if p2 else 'absent'}; 20 calls a graph, median."))
    print(f"bench_decode_ragged: {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
