"""The v32_* ops with adversarial slots, for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck python tests/memcheck_v32.py

Every decode form (w64, w128, f16; the bf16 auto cache: w64, w128), split and unsplit.
Each tensor gets its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1) and every cache is
exactly sized (no slack after the last record), so a read or write past it is an error the
sanitizer reports. Slots: negative, = capacity, just past it, 2**31, 2**40, int64 max, the
last record; caches of one block, block size 1, a padded block stride; both formats (fp8_ds_mla,
auto); the variant of DSV4_AMPERE_IMPL. Exits non-zero when a result differs from the reference.
"""

import os
import sys

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a logic check under TRITON_INTERPRET=1
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import v32  # noqa: E402
from dsv4_ops import reference as R  # noqa: E402

QK = 576
QDT = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's bf16 tl.dot is wrong


# (format, blocks, block size, bytes / elements of padding after each block): one block, block
# size 1, vLLM's 64-record pages, a padded block stride (records then not 16-byte aligned: w64)
GEOMETRIES = (("fp8_ds_mla", 3, 64, 0), ("fp8_ds_mla", 5, 1, 0), ("fp8_ds_mla", 4, 8, 8),
              ("auto", 1, 16, 0), ("auto", 4, 8, 8))
FORMS = {"fp8_ds_mla": ("w64", "w128", "f16"), "auto": ("w64", "w128")}


def cache_of(fmt, nb, bs, pad):
    d = 656 if fmt == "fp8_ds_mla" else QK
    if fmt == "fp8_ds_mla":
        full = torch.randint(0, 256, (nb * (bs * d + pad) - pad,), dtype=torch.uint8, device=DEV)
    else:
        full = torch.randn(nb * (bs * d + pad) - pad, device=DEV).to(torch.bfloat16)
    # the last block ends at the allocation's last byte
    return torch.as_strided(full, (nb, bs, d), (bs * d + pad, d, 1))


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.uint8 else t.view(torch.int16)


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    for fmt, nb, bs, pad in GEOMETRIES:
        cap = nb * bs
        # every valid slot once (a repeated slot's record is unspecified), then invalid ones
        adv = torch.tensor([-1, -5, cap, cap + 1, 2**31, 2**40, -(2**40), 2**63 - 1], device=DEV)
        slots = torch.cat([torch.randperm(cap, device=DEV), adv])
        n = slots.numel()
        kv_c = (torch.randn(n, 512, device=DEV) * 10).to(torch.bfloat16)
        k_pe = torch.randn(n, 64, device=DEV).to(torch.bfloat16)
        cache = cache_of(fmt, nb, bs, pad)
        for dtype in (torch.int64, torch.int32):
            s = slots if dtype == torch.int64 else slots.clamp(-(2**31), 2**31 - 1).to(torch.int32)
            c_k = cache_of(fmt, nb, bs, pad)  # exactly sized, padded like cache
            c_k.copy_(cache)
            c_r = cache.clone()
            v32.v32_kv_insert(kv_c, k_pe, c_k, s)
            R.ref_v32_kv_insert(kv_c, k_pe, c_r, slots)
            if not torch.equal(bits(c_k), bits(c_r)):
                print(f"FAIL insert {fmt} nb={nb} bs={bs} pad={pad} {dtype}")
                bad += 1
            g = torch.cat([s[torch.randperm(n, device=DEV)], s[:1], s.new_tensor([cap - 1, 0])]).repeat(2)
            out = v32.v32_kv_gather(c_k, g)
            if not torch.equal(bits(out), bits(R.ref_v32_kv_gather(c_k, g))):
                print(f"FAIL gather {fmt} nb={nb} bs={bs} {dtype}")
                bad += 1
            K = min(48, g.numel() // 2)
            idx = g[: 2 * K].view(2, K)
            q = torch.randn(2, 16, QK, device=DEV).to(QDT)
            tl = torch.tensor([K, 7], device=DEV, dtype=torch.int32)
            ro, rl = R.ref_v32_sparse_mla_decode(q, c_k, idx, tl, 0.1, torch.float64)
            for form in FORMS[fmt]:  # unaligned records (pad 8) run w64 whatever the form
                for S in (1, 3):
                    o, lse = v32.v32_sparse_mla_decode(q, c_k, idx, tl, 0.1, S, form=form)
                    if torch.isnan(o).any() or (o.double() - ro.double()).abs().max() > 0.05 * max(1.0, float(ro.abs().max())):
                        print(f"FAIL decode {fmt} {form} nb={nb} bs={bs} {dtype} S={S}")
                        bad += 1
            ws = v32.v32_kv_gather(c_k, torch.arange(cap, device=DEV)).to(QDT)  # exactly cap rows
            i32 = idx.clamp(-(2**31), 2**31 - 1).to(torch.int32)
            o, lse = v32.v32_sparse_mla_prefill(q, ws, i32, tl, 0.1)
            ro, rl = R.ref_v32_sparse_mla(q, ws, i32, tl, 0.1, torch.float64)
            if torch.isnan(o).any() or (o.double() - ro.double()).abs().max() > 0.05 * max(1.0, float(ro.abs().max())):
                print(f"FAIL prefill {fmt} nb={nb} bs={bs} {dtype}")
                bad += 1
    # an empty cache: every slot invalid, nothing read or written
    for fmt, dt, d in (("fp8_ds_mla", torch.uint8, 656), ("auto", torch.bfloat16, QK)):
        empty = torch.empty(0, 64, d, dtype=dt, device=DEV)
        s = torch.tensor([0, 1, -1], device=DEV)
        z = v32.v32_kv_gather(empty, s)
        v32.v32_kv_insert(torch.zeros(3, 512, dtype=torch.bfloat16, device=DEV),
                          torch.zeros(3, 64, dtype=torch.bfloat16, device=DEV), empty, s)
        for form in FORMS[fmt]:
            o, lse = v32.v32_sparse_mla_decode(torch.ones(1, 16, QK, dtype=QDT, device=DEV), empty,
                                               s[None, :].to(torch.int32), None, 0.1, form=form)
            if int(z.view(torch.int16).count_nonzero()) or int(o.view(torch.int16).count_nonzero()) \
                    or not torch.all(lse == float("-inf")):
                print(f"FAIL empty cache {fmt} {form}")
                bad += 1
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("memcheck_v32:", "OK" if bad == 0 else f"{bad} mismatches", "impl", os.environ.get("DSV4_AMPERE_IMPL", "auto"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
