"""Per-kernel device time of one paged decode step (dsv4_decode.dsv4_decode_attention, the plugin's call), by
torch.profiler: which of the planning, attention and merge kernels a change moved. The inputs of
bench_decode_ragged (512 + 128 key columns a token, the same three batch mixes). Median of REPS calls a
kernel name, us. Whole GPU (no green context): a breakdown, not a speed claim.

usage: python benchmarks/profile_decode_kernels.py --shapes 64:8,128:8 [--reps 50]
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_ragged import lengths, step_inputs  # noqa: E402
from bench_decode_sms import BS, D, SM_SCALE, make_caches  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import dsv4_decode  # noqa: E402


def profile(T, H, caches, reps):
    (cc, _), (cw, _) = caches
    topk, swa, q, sink, swa_len = step_inputs(T, H)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")
    for mix in ("full", "ragged", "even"):
        tl_ = lengths(T, mix).cuda()

        def call():
            dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS, topk_length=tl_,
                                              swa_length=swa_len, out=out)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                call()
            torch.cuda.synchronize()
        times = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                times.setdefault(ev.name, []).append(ev.device_time)
        parts = "  ".join(f"{n[:40]} {statistics.median(v):.1f}" for n, v in sorted(times.items()))
        total = sum(statistics.median(v) for v in times.values())
        print(f"T={T} H={H} {mix:6s} sum {total:6.1f} us | {parts}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64:8,128:8")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    caches = make_caches(False)
    for s in a.shapes.split(","):
        T, H = (int(x) for x in s.split(":"))
        profile(T, H, caches, a.reps)


if __name__ == "__main__":
    main()
