"""The indexer's decode logits (``paged_mqa_logits``, next_n 1, 32K compressed tokens a request) at an
A100's SM counts: 132, 112 and 104 SMs of the H200 through driver green contexts, DSV4_AMPERE_SMS = the
granted count (the logits plan their tiles a program for it), every call in-graph on the green stream.

Columns (us): ours (20 calls a graph, median), floor = max(bytes, MMA, launch):
  bytes_us  B x CTX x (132 B of K row + 4 B of logits) + q + weights at the copy rate measured in the same
            green context (bench_decode_sms.copy_gbs);
  mma_us    2 x B x H x 128 x CTX flops at MMA_TFLOPS_132 x SMs / 132 (mma.sync under DISABLE_MMA_V3=1,
            bench_decode_sms's rate);
  launch_us one launch (0.9 us);
per_sm: the compiled kernel's programs an SM (the driver's occupancy, what the plan takes), programs: the
grid the plan launched (dispatch.indexer.wave_plan), waves: programs over per_sm x SMs; base_us: the
shipped config without PROGRAMS_PER_SM (the plan with no SM count:
~TARGET_PROGRAMS programs, capped tiles a program), same run; and the logits checked against the op's
PyTorch reference on a slice (every B row, the first 4 pages).
--sweep N,...: the same calls with the plan's programs an SM forced to each N (the plan for a residency
the kernel does not have: fewer programs, or more waves of them), rows named sweep_<N>_us.
Usage: python benchmarks/bench_indexer_sms.py --out DIR [--sms 132,112,104] [--shapes B:H,...] [--sweep 4,...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_sms import LAUNCH_US, MMA_TFLOPS_132, _Ctx, copy_gbs  # noqa: E402
from bench_indexer import CTX, BS, decode_inputs  # noqa: E402
from common import write_results  # noqa: E402

from dsv4_ops import _host_plan, dispatch, indexer, reference  # noqa: E402
from dsv4_ops.tools.timing import graph_us  # noqa: E402

SHAPES = ((64, 64), (8, 64), (64, 32), (1, 64))
CHECK_PAGES = 4


def check(q, cache, w, bt):
    """Max |ours - reference| / max |reference| over every row's first CHECK_PAGES pages."""
    n = CHECK_PAGES * BS
    args = (q, cache, w, torch.full((q.shape[0], 1), n, dtype=torch.int32, device=q.device),
            bt[:, :CHECK_PAGES].contiguous(), n)
    got = indexer.paged_mqa_logits(*args, block_size=BS).double()
    want = reference.ref_paged_mqa_logits(*args, block_size=BS).double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="indexer_sms")
    ap.add_argument("--sms", default="132,112,104")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--sweep", default="")
    ns = ap.parse_args()
    sweep = [int(x) for x in ns.sweep.split(",") if x]
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    shapes = [tuple(int(x) for x in s.split(":")) for s in ns.shapes.split(",")] if ns.shapes else SHAPES
    ctxs = [_Ctx(int(n)) for n in ns.sms.split(",")]
    gbs = {}
    for c in ctxs:
        with c.reentered():
            gbs[c.sms] = copy_gbs()
    print("copy GB/s by SMs:", {k: round(v) for k, v in gbs.items()}, flush=True)
    rows = []
    for B, H in shapes:
        (q, cache, w, ctx, bt), (nbytes, flops) = decode_inputs(B, H)
        for c in ctxs:
            row = {"B": B, "H": H, "ctx": CTX, "SMs": c.sms}
            try:
                with c.reentered():
                    _host_plan.clear()
                    row["rel_err"] = "%.2g" % check(q, cache, w, bt)
                    row["ours_us"] = graph_us(lambda: indexer.paged_mqa_logits(q, cache, w, ctx, bt, CTX, block_size=BS))
                    cfg = dispatch.indexer.paged_config(H)
                    row["per_sm"] = [v for k, v in indexer._RESIDENT.items()
                                     if dict(k[2]).get("BLOCK_N") == cfg["BLOCK_N"] and
                                     dict(k[2]).get("H_BLOCK") == max(16, 1 << (H - 1).bit_length())][-1]
                    tpp = dispatch.indexer.paged_tiles_per_program(B, CTX, cfg, c.sms, row["per_sm"])
                    row["programs"] = B * -(-(-(-CTX // cfg["BLOCK_N"])) // tpp)
                    row["waves"] = -(-row["programs"] // (row["per_sm"] * c.sms))
                    base = {k: v for k, v in cfg.items() if k != "PROGRAMS_PER_SM"}
                    row["base_us"] = graph_us(lambda: indexer.paged_mqa_logits(q, cache, w, ctx, bt, CTX, block_size=BS,
                                                                               config=base))
                    real = indexer._resident
                    try:
                        for n in sweep:
                            indexer._resident = lambda *a, n=n: n
                            _host_plan.clear()
                            row[f"sweep_{n}_us"] = graph_us(
                                lambda: indexer.paged_mqa_logits(q, cache, w, ctx, bt, CTX, block_size=BS))
                    finally:
                        indexer._resident = real
            except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
                row["error"] = repr(exc)[:200]
            row["bytes_us"] = nbytes / (gbs[c.sms] * 1e3)
            row["mma_us"] = flops / (MMA_TFLOPS_132 * c.sms / 132 * 1e6)
            row["launch_us"] = LAUNCH_US
            row["floor_us"] = max(row["bytes_us"], row["mma_us"], row["launch_us"])
            if "ours_us" in row:
                row["ours/floor"] = row["ours_us"] / row["floor_us"]
            print(row, flush=True)
            rows.append(row)
        write_results(ns.name, ns.out, rows, ["B", "H", "ctx", "SMs", "ours_us", "floor_us", "ours/floor", "per_sm",
                                              "programs", "waves", "base_us", "bytes_us", "mma_us", "launch_us", "rel_err"]
                      + [f"sweep_{n}_us" for n in sweep] + ["error"],
                      notes=(f"{os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3')}, "
                             f"SMs by driver green contexts, DSV4_AMPERE_SMS = SMs; copy GB/s by SMs "
                             f"{({k: round(v) for k, v in gbs.items()})}; 20 calls a graph, median; floors: module doc."))


if __name__ == "__main__":
    main()
