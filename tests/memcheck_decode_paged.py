"""The fused paged decode with adversarial slots, for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck python tests/memcheck_decode_paged.py

Each tensor gets its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1) and pages are sized
exactly (no slack after the last record), so a read past a cache is an error the sanitizer
reports. Slots: out of range, negative, int32 / int64 extremes, repeated; lengths negative
and past K; an empty window cache. Both variants (native on sm_89+; MEMCHECK_VARIANTS=portable
for one), seven forms (csrc_triton.decode.paged_chunk128's configs h16n16w4 / h16n32w4, the fp16-dot
kernel csrc_triton.decode.paged_f16dot in both PV modes, configs kh16n32w4 / gh16n32w4, and its
64-key configs kh16n64w8 / kh32n64w8 (the latter needs 108 KB of shared memory), all over 16-byte
aligned caches, and ``unaligned``: the caches 2 bytes into their allocations, where the plan runs
paged_chunk128 without 16-byte reads; MEMCHECK_FORMS=h16n32w4,unaligned for a subset), direct and
split; exits non-zero when a result differs from the float64 reference.
"""

import os
import sys

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from dsv4_ops import layout, paged_decode, paged_plan, reference  # noqa: E402
from dsv4_ops.testing import assert_attention_close  # noqa: E402


def cache(bs, nb, seed):
    c = torch.zeros(nb, layout.min_page_bytes(bs), dtype=torch.uint8)
    rows = torch.randn(nb * bs, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    reference.ref_kv_cache_insert(rows, c, torch.arange(nb * bs), bs)
    return c.cuda()


def shifted(c):
    """The same pages 2 bytes into their own allocation (address not 16-byte aligned, nothing after)."""
    buf = torch.empty(c.numel() + 2, dtype=torch.uint8, device=c.device)
    v = buf[2:].view(c.shape)
    v.copy_(c)
    return v


def main() -> int:
    variants = ["portable"] + (["native"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    if os.environ.get("MEMCHECK_VARIANTS"):  # e.g. portable (a short device call)
        variants = [v for v in variants if v in os.environ["MEMCHECK_VARIANTS"].split(",")]
    g = torch.Generator().manual_seed(0)
    T, H, K1, K2 = 3, 8, 40, 12
    cc, cw = cache(16, 3, 1), cache(8, 2, 2)
    cw_empty = torch.empty(0, layout.min_page_bytes(8), dtype=torch.uint8, device="cuda")
    bad = 0
    for dtype in (torch.int64, torch.int32):
        info = torch.iinfo(dtype)
        ext = torch.tensor([info.min, info.max, -1, 48, 47, 0, 2 ** 31 - 1, -(2 ** 31)], dtype=torch.int64)
        topk = torch.randint(-4, 52, (T, K1), generator=g)
        topk[0, :8] = ext
        topk[1] = 47  # the last slot, repeated
        swa = torch.randint(-4, 20, (T, K2), generator=g)
        swa[2, :4] = torch.tensor([info.max, info.min, 16, 15])
        topk, swa = topk.to(dtype).cuda(), swa.to(dtype).cuda()
        tl = torch.tensor([K1 + 100, -5, 17], dtype=dtype, device="cuda")
        sl = torch.tensor([3, K2 + 9, -1], dtype=dtype, device="cuda")
        q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).cuda()
        sink = torch.randn(H, generator=g).cuda()
        for variant in variants:
            forms = ("h16n16w4", "h16n32w4", "kh16n32w4", "gh16n32w4", "kh16n64w8", "kh32n64w8", "unaligned")
            if os.environ.get("MEMCHECK_FORMS"):
                forms = [f for f in forms if f in os.environ["MEMCHECK_FORMS"].split(",")]
            for form in forms:
                for window, lens in ((cw, (tl, sl)), (cw_empty, (None, None))):
                    for splits in (1, 3):
                        c1, c2 = (shifted(cc), shifted(window)) if form == "unaligned" else (cc, window)
                        assert paged_plan.paged_aligned(c1, c2) == (form != "unaligned")
                        args = (q, c1, topk, lens[0], 16, c2, swa, lens[1], 8, sink, 512 ** -0.5)
                        out, lse = paged_decode.dsv4_decode_fused(*args, splits, variant=variant,
                                                                  config="" if form == "unaligned" else form)
                        want, want_lse = reference.ref_dsv4_decode_fused(
                            *[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], out_dtype=torch.float64)
                        try:
                            assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)
                        except AssertionError as exc:
                            print(f"FAIL {variant} {form} {dtype} S={splits} empty={window is cw_empty}: {exc}")
                            bad += 1
    torch.cuda.synchronize()
    print("memcheck_decode_paged:", "OK" if bad == 0 else f"{bad} mismatches", "variants", variants)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
