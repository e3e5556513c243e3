"""Launch the decode v3-form kernels once each at a few shapes, for ``ncu``.

    ncu --clock-control none -k regex:_dsv4_decode_v --launch-skip-before-match 0 \
        --section WarpStateStats ... python benchmarks/ncu_decode_paged.py T:H:config,...

Each (T, H, config) runs twice (the first launch compiles and warms; ncu profiles both, the
report keeps the names) over the benchmark's 1M-slot caches (random valid int32 slots, sink,
K = 512 + 128), at the plan's split count. Prints the plan of each so the report can be read.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_ops  # noqa: E402,F401
from bench_decode_paged import BS, NBLK, SM_SCALE, make_cache  # noqa: E402
from dsv4_ops import dispatch, paged_decode  # noqa: E402


def main():
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    cc, cw = make_cache(1), make_cache(2)
    sms = dispatch.device.num_sms(torch.cuda.current_device())
    for spec in sys.argv[1].split(","):
        T, H, name = spec.split(":")
        T, H = int(T), int(H)
        g = torch.Generator(device="cuda").manual_seed(T * 1000 + H)
        topk = torch.randint(0, NBLK * BS, (T, 512), device="cuda", generator=g, dtype=torch.int32)
        swa = torch.randint(0, NBLK * BS, (T, 128), device="cuda", generator=g, dtype=torch.int32)
        q = torch.randn(T, H, 512, device="cuda", generator=g).to(torch.bfloat16)
        sink = torch.randn(H, device="cuda", generator=g)
        plan = dispatch.decode.plan_step(T, H, 640, sms, config=name)
        print(f"ncu case T={T} H={H} config={name} plan={plan}", flush=True)
        for _ in range(2):
            paged_decode.dsv4_decode_fused(q, cc, topk, None, BS, cw, swa, None, BS, sink, SM_SCALE, plan.splits,
                                           config=name)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
