"""The engine run's stand-ins that the model e2e never reaches (CPU, seconds)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import standins  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_rope_insert_is_the_kv_half_of_the_fused_insert(seed):
    """``_C.fused_deepseek_v4_kv_rope_insert`` writes the cache bytes the q+kv insert writes
    (V4.1's decoder-replay KV write relies on it, bit for bit), touches no other slot, and
    skips negative slots."""
    standins.install(cpu=True)
    g = torch.Generator().manual_seed(seed)
    T, nb, bs = 7, 4, 8
    rec = standins.DATA_BYTES + standins.SCALE_BYTES
    kv = torch.randn(T, 512, generator=g).to(torch.bfloat16)
    q = torch.randn(T, 2, 512, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 64, (T,), generator=g)
    cs = torch.randn(64, 64, generator=g)
    # block 0 is vLLM's null block (BlockPool.null_block, never handed to a request): the writer sends
    # skipped rows there, so a valid slot never lies in it
    slots = torch.randperm((nb - 1) * bs, generator=g)[:T] + bs
    slots[3] = -1
    poison = torch.randint(0, 256, (nb, bs * rec), generator=g, dtype=torch.uint8)
    ref = poison.clone()
    torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, ref, slots, pos, cs, 0, 1e-6, bs)
    got = poison.clone().view(nb, bs, rec)
    torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, got, slots, pos, cs, bs, None, False)
    assert torch.equal(got.view(nb, -1), ref)
    assert not torch.equal(ref, poison)   # the writes happened (the comparison can fail)
    # exactly the data records of the non-negative slots changed (page: bs data records, then scales)
    d = standins.DATA_BYTES
    changed = {b * bs + p for b in range(nb) for p in range(bs)
               if not torch.equal(ref[b, p * d:(p + 1) * d], poison[b, p * d:(p + 1) * d])}
    assert changed == {int(x) for x in slots if x >= 0}
