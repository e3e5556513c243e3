"""Insert + gather with adversarial slots, for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck python tests/memcheck_kv_cache.py

Each tensor gets its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so a read or write
past the cache is an error the sanitizer reports. Both variants (native on sm_89+); exits
non-zero when a kernel result differs from the reference.
"""

import os
import sys

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from dsv4_ops import kv_cache, layout  # noqa: E402
from dsv4_ops.reference import ref_kv_cache_gather, ref_kv_cache_insert  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    variants = ["portable"] + (["native"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    bad = 0
    for variant in variants:
        for bs, nb in ((64, 3), (1, 5), (16, 1)):
            cap = bs * nb
            page = layout.min_page_bytes(bs)  # exactly sized pages: no slack after the last record
            cache = torch.randint(0, 256, (nb, page), dtype=torch.uint8, device="cuda")
            n = cap + 8
            kv = (torch.randn(n, 512, device="cuda") * 10).to(torch.bfloat16)
            slots = torch.cat([torch.randperm(cap, device="cuda"),
                               torch.tensor([-1, -5, cap, cap + 1, 2**31, 2**40, -(2**40), 2**63 - 1],
                                            device="cuda")])
            c_ref = cache.clone()
            for dtype in (torch.int64, torch.int32):
                s = slots if dtype == torch.int64 else slots.clamp(-(2**31), 2**31 - 1).to(torch.int32)
                c_k = cache.clone()
                kv_cache.kv_cache_insert(kv, c_k, s, bs, variant=variant)
                ref_kv_cache_insert(kv, c_ref, slots, bs)
                if not torch.equal(c_k, c_ref):
                    print(f"FAIL insert {variant} bs={bs} {dtype}")
                    bad += 1
                g = s[torch.randperm(s.numel(), device="cuda")].repeat(3)
                out = kv_cache.kv_cache_gather(c_ref, g.view(3, -1), bs, variant=variant)
                ws = torch.full((g.numel() + 10, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
                kv_cache.kv_cache_gather(c_ref, g, bs, out=ws, row_offset=10, variant=variant)
                ref = ref_kv_cache_gather(c_ref, g, bs)
                if not (torch.equal(out.view(-1, 512).view(torch.int16), ref.view(torch.int16))
                        and torch.equal(ws[10:].view(torch.int16), ref.view(torch.int16))):
                    print(f"FAIL gather {variant} bs={bs} {dtype}")
                    bad += 1
        # an empty cache: every slot invalid, nothing read
        empty = torch.empty(0, layout.min_page_bytes(64), dtype=torch.uint8, device="cuda")
        z = kv_cache.kv_cache_gather(empty, torch.tensor([0, 1, -1], device="cuda"), 64, variant=variant)
        kv_cache.kv_cache_insert(kv[:3], empty, torch.tensor([0, 1, -1], device="cuda"), 64, variant=variant)
        if int(z.view(torch.int16).count_nonzero()) != 0:
            print(f"FAIL empty-cache gather {variant}")
            bad += 1
    torch.cuda.synchronize()
    print("memcheck_kv_cache:", "OK" if bad == 0 else f"{bad} mismatches", "variants", variants)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
