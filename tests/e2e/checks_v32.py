"""Teacher-forced float64 check of every sparse-MLA call of a V3.2 run: the plugin backend's
``_forward_mqa_kernel`` is wrapped (not replaced); each call's q, cache and top-k indices are
kept and its output compared with softmax(scale * q.k) v over the valid entries, the keys decoded
from the cache BYTES by the decoder below (torch's own float8_e4m3fn, not this library's codec).
So a wrong kernel shows even where the fp8 cache's rounding hides it in the logits."""

from __future__ import annotations

from typing import List

import torch

NOPE, ROPE, TILE, REC = 512, 64, 128, 656


def decode_rows(kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float64 [..., 576] of flat cache rows (row r = block r // bs, position r % bs; the impl's
    physical indices with block size 1 over [num_blocks * bs] rows); -1 -> zeros."""
    c = kv_cache.squeeze(2) if kv_cache.dim() == 4 else kv_cache
    flat = c.reshape(-1, c.shape[-1])
    r = rows.clamp(min=0).long()
    if c.shape[-1] == NOPE + ROPE and c.dtype == torch.bfloat16:
        out = flat[r].double()
    else:
        b = flat.view(torch.uint8)[r]                                   # [..., 656] bytes
        codes = b[..., :NOPE].contiguous().view(torch.float8_e4m3fn).double()
        scale = b[..., NOPE:NOPE + 16].contiguous().view(torch.float32).double()   # [..., 4]
        nope = (codes.view(*codes.shape[:-1], NOPE // TILE, TILE) * scale[..., None]).flatten(-2)
        rope = b[..., NOPE + 16:REC].contiguous().view(torch.bfloat16).double()
        out = torch.cat((nope, rope), dim=-1)
    return torch.where((rows >= 0)[..., None], out, torch.zeros_like(out))


class MqaRecorder:
    def __init__(self):
        self.results: List[dict] = []

    def install(self, impl_cls) -> None:
        orig = impl_cls._forward_mqa_kernel
        rec = self

        def wrapped(self_, q, kv_cache, topk_indices, valid_counts, **kw):
            out, lse = orig(self_, q, kv_cache, topk_indices, valid_counts, **kw)
            rec.check(self_, q, kv_cache, topk_indices, out, kw)
            return out, lse

        impl_cls._forward_mqa_kernel = wrapped

    def check(self, impl, q, kv_cache, topk_indices, out, kw) -> None:
        qq = (torch.cat(q, -1) if isinstance(q, tuple) else q).double().cpu()
        T = qq.shape[0]
        idx = topk_indices[:T].cpu()
        cap = kv_cache.shape[0] * kv_cache.shape[1]
        bad = int(((idx >= cap) | (idx < -1)).sum())
        k = decode_rows(kv_cache.cpu(), idx)                           # [T, K, 576]
        s = torch.einsum("thd,tkd->thk", qq, k) * float(impl.scale)
        s = s.masked_fill(~(idx >= 0)[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        ref = torch.einsum("thk,tkd->thd", p, k[..., :NOPE])
        got = out.double().cpu()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        rel = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        self.results.append(dict(kind="mqa", decode=bool(kw.get("is_decode")), tokens=T,
                                 valid=int((idx >= 0).sum()), out_of_range=bad, cos=cos, rel_max=rel,
                                 cache=str(kv_cache.dtype), nonfinite=int((~torch.isfinite(got)).sum())))
