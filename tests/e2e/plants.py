"""Planted bugs for the e2e's bound margins (issue 29 item 2): each is a plausible mistake in the
plugin's attention glue, applied in the driver's process (``DSV4_E2E_MUTATE=<name>``, see
driver.mutate) and nowhere else. test_planted_bugs.py runs each and asserts the attention check
fails it by >= 5x its bound (max row error / bound).

- ``drop_sink``: the per-head sink logit is not passed (prefill and decode);
- ``scale_576``: the softmax scale from the q.k head dim of MLA (576) instead of V4's 512;
- ``window_short``: the decode's sliding window one key short (its length minus one);
- ``topk_no_ratio``: the decode's top-k entries mapped to cache slots with the block size in
  tokens instead of entries (block_size, not block_size // compress_ratio).
"""

from __future__ import annotations

import sys

PLANTS = ("drop_sink", "scale_576", "window_short", "topk_no_ratio")


def _rebind(name: str, good, bad) -> int:
    """Rebind every vLLM / dsv4_ops module's global ``name`` that is ``good`` to ``bad``."""
    n = 0
    for mod in list(sys.modules.values()):
        mname = getattr(mod, "__name__", "") or ""
        if (mname.startswith("vllm") or mname.startswith("dsv4_ops")) and getattr(mod, name, None) is good:
            setattr(mod, name, bad)
            n += 1
    return n


def plant(kind: str) -> str:
    import torch
    from dsv4_ops.vllm import attention as va

    if kind in ("drop_sink", "scale_576"):
        prefill, decode = va.flash_mla_sparse_fwd_ampere, va.ampere_decode
        factor = (512 / 576) ** 0.5

        def bad_prefill(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None):
            if kind == "drop_sink":
                attn_sink = None
            else:
                sm_scale = sm_scale * factor
            return prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)

        def bad_decode(*a, **k):
            a = list(a)
            if kind == "drop_sink":
                a[10] = torch.full_like(a[10], float("-inf"))
            else:
                a[11] = a[11] * factor
            return decode(*a, **k)

        n = _rebind("flash_mla_sparse_fwd", prefill, bad_prefill) + _rebind("flash_mla_sparse_fwd_ampere", prefill,
                                                                              bad_prefill)
        n += _rebind("ampere_decode", decode, bad_decode)
        return f"{kind} ({n} bindings)"
    if kind == "window_short":
        decode = va.ampere_decode

        def bad_decode(q, output, swa_cache, swa_indices, swa_lens, *a, **k):
            if swa_lens is not None:
                swa_lens = (swa_lens - 1).clamp(min=1)
            else:
                swa_indices = swa_indices[..., :-1]
            return decode(q, output, swa_cache, swa_indices, swa_lens, *a, **k)

        return f"{kind} ({_rebind('ampere_decode', decode, bad_decode)} bindings)"
    if kind == "topk_no_ratio":
        mixin = va._AmpereAttentionMixin
        good = mixin._decode_topk

        def bad_topk(self, swa_metadata, attn_metadata, num_decode_tokens):
            base = self._dsv4_ampere_base
            if not va._is_v41(base) and self.compress_ratio != va.C4A_RATIO:
                return good(self, swa_metadata, attn_metadata, num_decode_tokens)
            T = num_decode_tokens
            gi, lens = sys.modules[base.__module__].compute_global_topk_indices_and_lens(
                self.topk_indices_buffer[:T], swa_metadata.token_to_req_indices,
                attn_metadata.block_table[:swa_metadata.num_decodes],
                attn_metadata.block_size,            # the bug: not // self.compress_ratio
                swa_metadata.is_valid_token[:T])
            return gi.view(T, 1, -1), lens

        mixin._decode_topk = bad_topk
        return f"{kind} (1 bindings)"
    raise ValueError(f"unknown plant {kind!r}")
