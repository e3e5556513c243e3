"""Indexer ops with adversarial inputs, for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck python tests/memcheck_indexer.py

Each tensor gets its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1) and pages are sized
exactly (block_size * 132, no slack), so any read or write past a buffer is reported.
Adversarial: slots < 0, >= capacity, +-2**40; block ids -1, num_blocks, 2**31 - 1; context
lengths past the block table's capacity and past max_context_len; ks > ke, ke > N. Both
variants (native on sm_89+); exits non-zero when a kernel result differs from the reference.
"""

import os
import sys

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from dsv4_ops import indexer  # noqa: E402
from dsv4_ops.reference import (ref_indexer_k_insert, ref_indexer_q_quant, ref_mqa_logits,  # noqa: E402
                                ref_paged_mqa_logits)


def same_logits(a, b) -> bool:
    if not torch.equal(torch.isinf(a), torch.isinf(b)) or torch.isnan(a).any():
        return False
    fin = torch.isfinite(b)
    return not fin.any() or bool((a[fin] - b[fin]).abs().max() <= 1e-5 * b[fin].abs().max().clamp(min=1e-30))


def main() -> int:
    g = torch.Generator().manual_seed(0)
    variants = ["portable"] + (["native"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    bad = []
    for variant in variants:
        for bs, nb in ((64, 3), (1, 5), (16, 1)):
            cap = bs * nb
            cache = torch.randint(0, 256, (nb, bs * 132), generator=g, dtype=torch.int64).to(torch.uint8).cuda()
            n = cap + 6
            k = (torch.randn(n, 128, generator=g) * 5).to(torch.bfloat16).cuda()
            slots = torch.cat([torch.randperm(cap, generator=g),
                               torch.tensor([-1, cap, cap + 1, 2**31 - 1, 2**40, -(2**40)])]).cuda()
            want = cache.clone()
            ref_indexer_k_insert(k, want, slots, bs)
            for dtype in (torch.int64, torch.int32):
                got = cache.clone()
                indexer.indexer_k_insert(k, got, slots.clamp(-(2**31), 2**31 - 1).to(dtype), bs, variant=variant)
                if not torch.equal(got, want):
                    bad.append(f"k_insert {variant} bs={bs} {dtype}")
            # paged logits: adversarial block tables and context lengths
            B, H = 4, 64
            q = torch.randint(0, 127, (B, 1, H, 128), generator=g, dtype=torch.int64).to(torch.uint8).cuda()
            w = torch.randn(B, H, generator=g).cuda()
            bt = torch.randint(0, nb, (B, 3), generator=g, dtype=torch.int64).to(torch.int32)
            bt[0, 1], bt[1, 0], bt[2, 2] = -1, nb, 2**31 - 1
            ctx = torch.tensor([3 * bs, 3 * bs + 50, 10**6, 0], dtype=torch.int32)  # past capacity and max
            max_len = 3 * bs + 70
            got = indexer.paged_mqa_logits(q, want, w, ctx.cuda(), bt.cuda(), max_len, block_size=bs, variant=variant)
            ref = ref_paged_mqa_logits(q, want, w, ctx.cuda(), bt.cuda(), max_len, block_size=bs)
            if not same_logits(got, ref):
                bad.append(f"paged {variant} bs={bs}")
        # prefill logits: ks > ke, ke > N, negative ks, compressed and full outputs
        M, H, N = 100, 16, 70
        q = torch.randint(0, 127, (M, H, 128), generator=g, dtype=torch.int64).to(torch.uint8).cuda()
        kk = torch.randint(0, 127, (N, 128), generator=g, dtype=torch.int64).to(torch.uint8).cuda()
        w = torch.randn(M, H, generator=g).cuda()
        ksc = torch.rand(N, generator=g).cuda()
        ks = torch.randint(-5, N + 5, (M,), generator=g, dtype=torch.int64).to(torch.int32).cuda()
        ke = (ks + torch.randint(-3, 40, (M,), generator=g, dtype=torch.int64).to(torch.int32).cuda())
        for cols in (-1, 33):
            got = indexer.mqa_logits(q, w, kk, ksc, ks, ke, cols, variant=variant)
            if not same_logits(got, ref_mqa_logits(q, w, kk, ksc, ks, ke, cols)):
                bad.append(f"mqa {variant} cols={cols}")
        # q quant with positions at the last row of the cos/sin cache
        T = 7
        qq = torch.randn(T, 32, 128, generator=g).to(torch.bfloat16).cuda()
        cs = torch.randn(T, 64, generator=g).cuda()
        pos = torch.arange(T).cuda()
        wq = torch.randn(T, 32, generator=g).to(torch.bfloat16).cuda()
        a = indexer.indexer_q_quant(pos, qq, cs, wq, 0.125, 0.5, variant=variant)
        b = ref_indexer_q_quant(pos, qq, cs, wq, 0.125, 0.5)
        if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
            bad.append(f"q_quant {variant}")
        # an empty cache: every block id invalid, nothing read
        empty = torch.empty(0, 64 * 132, dtype=torch.uint8, device="cuda")
        zq = torch.zeros(2, 1, 16, 128, dtype=torch.uint8, device="cuda")
        z = indexer.paged_mqa_logits(zq, empty, torch.ones(2, 16, device="cuda"),
                                     torch.tensor([5, 64], dtype=torch.int32, device="cuda"),
                                     torch.zeros(2, 1, dtype=torch.int32, device="cuda"), 80, block_size=64,
                                     variant=variant)
        if not torch.isinf(z).all():
            bad.append(f"empty-cache paged {variant}")
    torch.cuda.synchronize()
    print("memcheck_indexer:", "OK" if not bad else f"{len(bad)} mismatches: {bad}", "variants", variants)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
