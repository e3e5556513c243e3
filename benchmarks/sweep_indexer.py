"""Sweep: every candidate launch config / kernel variant of the indexer ops, on this GPU.

For each row of csrc_triton/indexer.py's *_CANDIDATES lists and each case below it
  1. checks the candidate once against the float64 reference at a check shape (logits:
     max abs error <= 1e-5 of the largest |logit| and the same -inf mask; q quant and
     k insert: bytes identical), and
  2. times it in a CUDA graph (benchmarks/common.time_graph_us, in-graph, L2 warm) at the
     bench shape of benchmarks/bench_indexer.py, against the same-run floor.
Cases: decode (paged_mqa_logits) B=64/H=64, B=64/H=32, B=8/H=64, 32K context; prefill
(mqa_logits, compressed output) M=8192, H=64, causal <= 2048 keys (the best two are also
timed with the full [M, N] output); q quant 4096 x 64 heads; k insert 262144 rows.
Portable variant for every candidate; on sm_89+ the two best of each op are re-timed
native. A wall-clock guard (--budget-s, default 140) skips what is left past it.
Writes sweep_indexer.{json,md} under --out and prints the config lines to paste into
csrc_triton/indexer.py (the best correct candidate per op; decode: best geometric mean over
its cases). --aot (CPU, no GPU): AOT-compile every candidate for sm_80 and sm_86 instead.

Usage: python benchmarks/sweep_indexer.py --out DIR [--budget-s 140] | --aot
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dsv4_ops import indexer  # noqa: E402
from dsv4_ops.csrc_triton import indexer as K  # noqa: E402

D, BS, CTX = 128, 64, 32768


def aot_main() -> int:
    os.environ["TRITON_INTERPRET"] = "0"
    from dsv4_ops.aot import compile_spec

    bad = 0
    for spec in indexer.candidate_specs():
        for arch in (80, 86):
            r = compile_spec(spec, arch)
            ok = r.ok and not r.spill_bytes
            bad += not ok
            print(f"sm_{arch} {r.label:75s} regs {r.registers} spill {r.spill_bytes} smem {r.shared_bytes} "
                  f"{'ok' if ok else 'FAIL ' + (r.error or 'spills')}", flush=True)
    return 1 if bad else 0


def logits_ok(got, ref, rel=1e-5):
    if not torch.equal(torch.isneginf(got), torch.isneginf(ref)) or torch.isnan(got).any():
        return False, "inf mask"
    fin = torch.isfinite(ref)
    if not fin.any():
        return True, "0"
    tol = rel * ref[fin].abs().max().clamp(min=1e-30)
    err = (got[fin] - ref[fin]).abs().max()
    return bool(err <= tol), f"{(err / tol * rel).item():.1e}"


class Sweep:
    def __init__(self, budget_s):
        from common import copy_bandwidth_gbs

        self.t0 = time.time()
        self.budget_s = budget_s
        self.rows = []
        self.copy_gbs = copy_bandwidth_gbs(256 << 20)
        self.native = torch.cuda.get_device_capability() >= (8, 9)

    def left(self):
        return self.budget_s - (time.time() - self.t0)

    def run(self, op, case, cfg, variant, check, fn, floor_us, extra=None):
        """Check (once per op/cfg/variant, cached by the caller) and time one candidate."""
        from common import time_graph_us

        row = {"op": op, "case": case, "variant": variant, "config": repr(cfg)}
        if self.left() < 0:
            row["status"] = "skipped (budget)"
            self.rows.append(row)
            return row
        try:
            ok, err = check()
            row["ok"], row["err/tol"] = ok, err
            us = time_graph_us(fn, replays=15, inner=10)
            row.update({"us": us, "floor us": floor_us, "x floor": us / floor_us, "status": "ok" if ok else "WRONG"})
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not stop the sweep
            traceback.print_exc()
            row["status"] = f"FAILED {type(exc).__name__}"
        row.update(extra or {})
        self.rows.append(row)
        print(f"[{time.time() - self.t0:6.1f}s] {op:8s} {case:14s} {variant:8s} {row.get('us', float('nan')):8.1f} us "
              f"x{row.get('x floor', float('nan')):.2f} {row['status']} {cfg}", flush=True)
        return row


def codes(shape, gen=None):
    c = torch.randint(0, 256, shape, device="cuda", dtype=torch.int32)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)


def gemm_rate_tflops(flops):
    from bench_indexer import gemm_rate_tflops as g

    return g(flops)


# ---- decode ------------------------------------------------------------------------------------


def decode_check_case(H):
    from dsv4_ops.reference import ref_indexer_k_insert, ref_paged_mqa_logits

    g = torch.Generator().manual_seed(H)
    B, ctx_max = 8, 4096
    nb = B * (ctx_max // BS + 1) + 3
    cache = torch.randint(0, 256, (nb, BS * 132 + 192), generator=g).to(torch.uint8).cuda()
    view = torch.as_strided(cache, (nb, BS, 132), (cache.stride(0), 132, 1))
    k = (torch.randn(nb * BS, D, generator=g) * 3).to(torch.bfloat16).cuda()
    ref_indexer_k_insert(k, view, torch.arange(nb * BS, device="cuda"), BS)
    ctx = torch.randint(1, ctx_max + 1, (B,), generator=g, dtype=torch.int32)
    ctx[0], ctx[1] = ctx_max, 1
    maxb = ctx_max // BS + 1
    bt = torch.randperm(nb, generator=g)[:B * maxb].view(B, maxb).to(torch.int32)
    bt[3, 2] = 10 ** 6
    q = torch.randint(0, 256, (B, 1, H, D), generator=g)
    q = torch.where((q & 0x7F) == 0x7F, q - 1, q).to(torch.uint8).cuda()
    w = (torch.randn(B, H, generator=g) * 0.01).cuda()
    args = (q, view, w, ctx.cuda(), bt.cuda(), ctx_max + 100)
    return args, ref_paged_mqa_logits(*args)


def sweep_decode(sw: Sweep, variants=("portable",), cands=None):
    cands = cands if cands is not None else K.PAGED_CANDIDATES
    checks = {}
    out = []
    for H, B in ((64, 64), (32, 64), (64, 8)):
        if sw.left() < 0:
            break
        pages = CTX // BS
        nb = B * pages
        cache = codes((nb, BS * 132))
        cache.view(nb, -1)[:, BS * D:].view(torch.float32).fill_(1.0 / 64)
        bt = torch.randperm(nb, device="cuda", dtype=torch.int64).view(B, pages).to(torch.int32)
        q = codes((B, 1, H, D))
        w = torch.randn(B, H, device="cuda")
        ctx = torch.full((B, 1), CTX, dtype=torch.int32, device="cuda")
        nbytes = B * CTX * (132 + 4) + q.numel() + w.numel() * 4
        flops = 2.0 * B * H * D * CTX
        floor = max(nbytes / sw.copy_gbs / 1e3, flops / gemm_rate_tflops(flops) / 1e6)
        if H not in checks:
            checks[H] = decode_check_case(H)
        cargs, cref = checks[H]
        for v in variants:
            for cfg in cands:
                def check(cfg=cfg, v=v):
                    return logits_ok(indexer.paged_mqa_logits(*cargs, variant=v, config=cfg), cref)

                def fn(cfg=cfg, v=v):
                    return indexer.paged_mqa_logits(q, cache, w, ctx, bt, CTX, block_size=BS, variant=v, config=cfg)

                out.append(sw.run("decode", f"B={B},H={H}", cfg, v, check, fn, floor))
    return out


# ---- prefill ------------------------------------------------------------------------------------


def prefill_check_case(compressed):
    from dsv4_ops.reference import ref_mqa_logits

    g = torch.Generator().manual_seed(3)
    M, H, N = 1024, 64, 512
    q = torch.randint(0, 256, (M, H, D), generator=g)
    q = torch.where((q & 0x7F) == 0x7F, q - 1, q).to(torch.uint8).cuda()
    k = torch.randint(0, 256, (N, D), generator=g)
    k = torch.where((k & 0x7F) == 0x7F, k - 1, k).to(torch.uint8).cuda()
    w = (torch.randn(M, H, generator=g) * 1e-3).cuda()
    ksc = (2.0 ** torch.randint(-8, 0, (N,), generator=g).float()).cuda()
    m = torch.arange(M)
    ks = (m // 512 * 256).to(torch.int32).cuda()
    ke = (ks.cpu() + (m % 512) // 2 + 1).to(torch.int32).cuda()
    ke[7] = ks[7]
    args = (q, w, k, ksc, ks, ke, 300 if compressed else -1)
    return args, ref_mqa_logits(*args)


def sweep_prefill(sw: Sweep, variants=("portable",), cands=None, compressed=True):
    cands = cands if cands is not None else K.MQA_CANDIDATES
    from bench_indexer import PREFILL_N as N, prefill_inputs

    q, w, k, ksc, ks, ke, flops = prefill_inputs()
    floor = flops / gemm_rate_tflops(flops) / 1e6
    cargs, cref = prefill_check_case(compressed)
    cols = N if compressed else -1
    out = []
    for v in variants:
        for cfg in cands:
            def check(cfg=cfg, v=v):
                return logits_ok(indexer.mqa_logits(*cargs, variant=v, config=cfg), cref)

            def fn(cfg=cfg, v=v):
                return indexer.mqa_logits(q, w, k, ksc, ks, ke, cols, variant=v, config=cfg)

            out.append(sw.run("prefill", "compressed" if compressed else "full", cfg, v, check, fn, floor))
    return out


# ---- q quant / k insert -------------------------------------------------------------------------


def sweep_quant(sw: Sweep, variants=("portable",), q_cands=None, k_cands=None):
    from dsv4_ops.reference import ref_indexer_k_insert, ref_indexer_q_quant

    q_cands = q_cands if q_cands is not None else K.Q_QUANT_CANDIDATES
    k_cands = k_cands if k_cands is not None else K.K_INSERT_CANDIDATES
    g = torch.Generator().manual_seed(10)
    T, H = 4096, 64
    q = (torch.randn(T, H, D, generator=g) * torch.exp(torch.empty(T, H, 1).uniform_(-10, 10, generator=g)))
    q = q.to(torch.bfloat16).cuda()
    ang = torch.rand(65536, 32, generator=g) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], 1).cuda()
    pos = torch.randint(0, 65536, (T,), generator=g).cuda()
    wq = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    ref_q, ref_w = ref_indexer_q_quant(pos, q, cs, wq, D ** -0.5, H ** -0.5)
    qbytes = T * H * (2 * D + D + 4 + 2) + T * 8
    n = T * H
    k = (torch.randn(n, D, generator=g) * torch.exp(torch.empty(n, 1).uniform_(-8, 8, generator=g)))
    k = k.to(torch.bfloat16).cuda()
    nb = 2 * n // BS
    cache = torch.zeros(nb, BS * 132, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(nb * BS, generator=g)[:n].cuda()
    slots[:3] = torch.tensor([-1, nb * BS, 2 ** 40])
    want = cache.clone()
    ref_indexer_k_insert(k, want, slots, BS)
    kbytes = n * (2 * D + 132)
    out = []
    for v in variants:
        for cfg in q_cands:
            def qcheck(cfg=cfg, v=v):
                gq, gw = indexer.indexer_q_quant(pos, q, cs, wq, D ** -0.5, H ** -0.5, variant=v, config=cfg)
                ok = torch.equal(gq, ref_q) and torch.equal(gw.view(torch.int32), ref_w.view(torch.int32))
                return ok, "bytes"

            out.append(sw.run("q quant", f"T={T},H={H}", cfg, v, qcheck,
                              lambda cfg=cfg, v=v: indexer.indexer_q_quant(pos, q, cs, wq, D ** -0.5, H ** -0.5,
                                                                           variant=v, config=cfg),
                              qbytes / sw.copy_gbs / 1e3))
        for cfg in k_cands:
            def kcheck(cfg=cfg, v=v):
                got = torch.zeros_like(cache)
                indexer.indexer_k_insert(k, got, slots, BS, variant=v, config=cfg)
                return torch.equal(got, want), "bytes"

            out.append(sw.run("k insert", f"N={n}", cfg, v, kcheck,
                              lambda cfg=cfg, v=v: indexer.indexer_k_insert(k, cache, slots, BS, variant=v, config=cfg),
                              kbytes / sw.copy_gbs / 1e3))
    return out


# ---- selection ----------------------------------------------------------------------------------


def best_configs(rows, op, top=1):
    """Configs (repr) of op ranked by the geometric mean of their time over op's cases,
    among candidates correct and timed on every case (portable rows)."""
    good = [r for r in rows if r["op"] == op and r["variant"] == "portable"]
    cases = {r["case"] for r in good}
    by = {}
    for r in good:
        by.setdefault(r["config"], {})[r["case"]] = r
    score = {}
    for c, d in by.items():
        if set(d) == cases and all(r.get("status") == "ok" for r in d.values()):
            score[c] = math.exp(sum(math.log(r["us"]) for r in d.values()) / len(d))
    return sorted(score, key=score.get)[:top]


PASTE = {"decode": "PAGED_CONFIG", "prefill": "MQA_COMPRESSED_CONFIG", "q quant": "Q_QUANT_CONFIG",
         "k insert": "K_INSERT_CONFIG"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--budget-s", type=float, default=140.0)
    p.add_argument("--aot", action="store_true", help="AOT-compile every candidate for sm_80/86 (CPU) and exit")
    args = p.parse_args()
    if args.aot:
        sys.exit(aot_main())
    from common import write_results

    torch.manual_seed(0)
    sw = Sweep(args.budget_s)
    for name, fn in (("quant", lambda: sweep_quant(sw)), ("decode", lambda: sweep_decode(sw)),
                     ("prefill", lambda: sweep_prefill(sw))):
        try:
            fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            sw.rows.append({"op": name, "status": "FAILED"})
        torch.cuda.synchronize()
    # the two best prefill configs with the full output, then native re-timing of the two best of each op
    ev = eval  # configs are reprs of plain dicts of ints written by this script
    try:
        sweep_prefill(sw, cands=[dict(K.MQA_CONFIG)] + [ev(c) for c in best_configs(sw.rows, "prefill", 2)],
                      compressed=False)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if sw.native:
        for op, fn in (("decode", lambda c: sweep_decode(sw, ("native",), c)),
                       ("prefill", lambda c: sweep_prefill(sw, ("native",), c)),
                       ("q quant", lambda c: sweep_quant(sw, ("native",), c, [])),
                       ("k insert", lambda c: sweep_quant(sw, ("native",), [], c))):
            try:
                fn([ev(c) for c in best_configs(sw.rows, op, 2)])
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    lines = []
    for op, name in PASTE.items():
        best = best_configs(sw.rows, op)
        lines.append(f"{name} = {best[0]}" if best else f"# {op}: no candidate correct on every case")
    full = [r for r in sw.rows if r["op"] == "prefill" and r["case"] == "full" and r.get("status") == "ok"
            and r["variant"] == "portable"]
    if full:
        lines.append(f"MQA_CONFIG = {min(full, key=lambda r: r['us'])['config']}")
    paste = "\n".join(lines)
    print("\n# paste into csrc_triton/indexer.py (then run `python benchmarks/sweep_indexer.py --aot`):\n" + paste)
    write_results("sweep_indexer", args.out, sw.rows,
                  ["op", "case", "variant", "config", "us", "floor us", "x floor", "err/tol", "status"],
                  f"Copy bandwidth {sw.copy_gbs:.0f} GB/s (read + written), this run. In-graph times "
                  f"(time_graph_us, L2 warm). Sweep wall time {time.time() - sw.t0:.0f} s.\n\nBest (paste):\n\n"
                  "```python\n" + paste + "\n```")


if __name__ == "__main__":
    main()
