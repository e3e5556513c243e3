"""One-off GPU diagnosis: where kv_cache_insert and the reference disagree (bytes, regions)."""
import sys, os
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import dsv4_ops  # noqa
from dsv4_ops import kv_cache, layout as L, reference as R
import test_kv_cache as TK

for variant in ("portable", "native"):
    for block_size in (1, 64):
        nb = max(4, 4096 // block_size); cap = nb * block_size; n = min(cap, 3000)
        kv = TK.make_kv(n, device="cpu")
        slots = torch.randperm(cap)[:n]
        slots[torch.randperm(n)[:4]] = torch.tensor([-1, -5, cap, 2 ** 31 - 1])
        cache = TK.make_cache(nb, block_size, extra=64, device="cpu")
        c_cpu = cache.clone(); R.ref_kv_cache_insert(kv, c_cpu, slots, block_size)
        c_gref = cache.cuda().clone(); R.ref_kv_cache_insert(kv.cuda(), c_gref, slots.cuda(), block_size)
        c_k = cache.cuda().clone(); kv_cache.kv_cache_insert(kv.cuda(), c_k, slots.cuda(), block_size, variant=variant)
        torch.cuda.synchronize()
        for name, c in (("cuda-ref", c_gref.cpu()), ("kernel", c_k.cpu())):
            d = (c != c_cpu).nonzero()
            print(variant, block_size, name, "mismatches", len(d))
            for b, off in d[:6].tolist():
                data_end = block_size * 576
                if off < data_end:
                    p, within = divmod(off, 576); region = "nope" if within < 448 else "rope"
                else:
                    p, within = divmod(off - data_end, 8); region = "scale"
                slot = b * block_size + p
                tok = (slots == slot).nonzero().flatten().tolist()
                extra = ""
                if tok and region == "nope":
                    g = within // 64
                    grp = kv[tok[0], g * 64:(g + 1) * 64].float()
                    extra = f" x={kv[tok[0], within].item()!r} amax={grp.abs().max().item()!r}"
                print(f"   blk {b} off {off} {region} pos {p} byte {within} tok {tok}: cpu {c_cpu[b, off].item()} got {c[b, off].item()}{extra}")
