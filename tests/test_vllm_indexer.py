"""dsv4_ops.vllm.indexer: each replacement called with vLLM-shaped CPU inputs (through the ops'
CPU implementations) against vLLM 0.33.0's own torch reference of the same step, and its
patch rows against the installed vLLM (symbols exist, parameter lists match)."""

import importlib
import inspect

import pytest
import torch

from dsv4_ops.reference import ref_indexer_k_insert, ref_indexer_q_quant, ref_indexer_read_rows
from dsv4_ops.testing import rng
from dsv4_ops.vllm import indexer as vi

vr = pytest.importorskip("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
E4M3 = torch.float8_e4m3fn


def codes(shape, seed):
    c = torch.randint(0, 256, shape, generator=rng(seed), dtype=torch.int64)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8).view(E4M3)


def vllm_indexer_cache(num_blocks, block_size, seed, pad=64):
    """vLLM's allocation: uint8 [num_blocks, block_size, 132] with a padded page stride,
    filled through the V4.1 replacement store."""
    page = block_size * 132 + pad
    base = torch.zeros(num_blocks, page, dtype=torch.uint8)
    cache = torch.as_strided(base, (num_blocks, block_size, 132), (page, 132, 1))
    n = num_blocks * block_size
    k = (torch.randn(n, 128, generator=rng(seed)) * 2).to(torch.bfloat16)
    ref_indexer_k_insert(k, cache, torch.arange(n), block_size)
    return cache


def test_q_quant_replacement():
    T, H = 5, 32
    g = rng(1)
    q = (torch.randn(T, H, 128, generator=g) * 3).to(torch.bfloat16)
    ang = torch.rand(16, 32, generator=g) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    pos = torch.randint(0, 16, (T,), generator=g)
    w = torch.randn(T, H, generator=g).to(torch.bfloat16)
    qf, wo = vi.fused_indexer_q_rope_quant(pos, q, cs, w, 128 ** -0.5, H ** -0.5)
    rq, rw = ref_indexer_q_quant(pos, q, cs, w, 128 ** -0.5, H ** -0.5)
    assert qf.dtype == E4M3 and qf.shape == (T, H, 128) and wo.dtype == torch.float32
    assert torch.equal(qf.view(torch.uint8), rq) and torch.equal(wo, rw)
    with pytest.raises(NotImplementedError):
        vi.fused_indexer_q_rope_quant(pos, q, cs, w, 1.0, 1.0, use_fp4=True)


def test_mqa_logits_replacement_vs_vllm_torch():
    """Prefill chunk of two requests (causal ragged [ks, ke)); vLLM's K workspace is fp8 [N, 128]
    + uint8 [N, 4] scales viewed as fp32 [N]."""
    M, H, N = 24, 16, 30
    q = codes((M, H, 128), 2)
    k = codes((N, 128), 3)
    scales_u8 = (2.0 ** torch.randint(-5, 5, (N, 1), generator=rng(4)).float()).view(torch.uint8)
    k_scale = scales_u8.view(torch.float32).squeeze(-1)
    w = torch.randn(M, H, generator=rng(5))
    m = torch.arange(M)
    ks = torch.where(m < 10, 0, 12).to(torch.int32)
    ke = torch.where(m < 10, m + 1, 12 + (m - 9)).to(torch.int32)
    max_k = int((ke - ks).max())
    ours = vi.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, max_k)
    theirs = vr.fp8_mqa_logits_torch(q, (k, k_scale), w, ks, ke)  # [M, N], bf16 head scores
    assert ours.shape == (M, max_k)
    for i in range(M):
        n = int(ke[i] - ks[i])
        a, b = ours[i, :n].double(), theirs[i, ks[i]:ke[i]].double()
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max().clamp(min=1e-30)))
        assert torch.isinf(ours[i, n:]).all()


@pytest.mark.parametrize("ctx_shape", ["B1", "B"])
def test_paged_logits_replacement_vs_vllm_torch(ctx_shape):
    B, H, bs, nb = 3, 64, 16, 9
    cache = vllm_indexer_cache(nb, bs, seed=6)
    kv = cache.unsqueeze(-2)  # what sparse_attn_indexer passes (kv_cache_as_quant_view)
    q = codes((B, 1, H, 128), 7)
    w = torch.randn(B, H, generator=rng(8))
    lens = torch.tensor([0, 17, 40], dtype=torch.int32)
    ctx = lens.unsqueeze(-1) if ctx_shape == "B1" else lens
    bt = torch.stack([torch.randperm(nb, generator=rng(9 + i))[:3] for i in range(B)]).to(torch.int32)
    meta = vi.get_paged_mqa_logits_metadata(ctx if ctx.dim() == 2 else ctx[:, None], 16, 132)
    assert meta.shape == (133, 2) and meta.dtype == torch.int32
    ours = vi.fp8_fp4_paged_mqa_logits((q, None), kv, w, ctx, bt, meta, 48)
    theirs = vr.fp8_paged_mqa_logits_torch(q, kv.contiguous(), w, ctx, bt, 48)  # its view needs dense pages
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    fin = torch.isfinite(ours)
    assert (ours[fin] - theirs[fin]).abs().max() <= 1e-5 * theirs[fin].abs().max()


def test_v41_k_store_replacement():
    """Boundary tokens only (ratio 2), slot -1 skipped; the stored rows decode to the bf16 key
    computed in torch the way vLLM's kernel does (k_norm -> bf16 -> RoPE -> bf16)."""
    n, bs, nb = 8, 4, 4
    g = rng(10)
    k_pre = torch.randn(n, 128, generator=g).to(torch.bfloat16)
    pos = torch.arange(n) + 3
    ang = torch.rand(32, 32, generator=g) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    wn = torch.rand(128, generator=g) + 0.5
    slots = torch.tensor([0, 1, 2, -1, 4, 5, 6, 7])
    base = torch.zeros(nb, bs * 132, dtype=torch.uint8)
    cache = base.view(nb, bs, 132)
    vi.indexer_k_norm_rope_store(k_pre, pos, cs, wn, 1e-6, cache, slots, 2, False)
    k = k_pre.float()
    k = (k * torch.rsqrt((k * k).mean(1, keepdim=True) + 1e-6) * wn).to(torch.bfloat16).float()
    c = cs[(pos // 2) * 2]
    want = k.clone()
    want[:, 64::2] = k[:, 64::2] * c[:, :32] - k[:, 65::2] * c[:, 32:]
    want[:, 65::2] = k[:, 65::2] * c[:, :32] + k[:, 64::2] * c[:, 32:]
    expect = torch.zeros_like(base)
    boundary = ((pos + 1) % 2 == 0) & (slots >= 0)
    ref_indexer_k_insert(want.to(torch.bfloat16), expect.view(nb, bs, 132), torch.where(boundary, slots, -1), bs)
    assert torch.equal(base, expect)
    s = slots[boundary]
    cds, scl = ref_indexer_read_rows(cache, bs, s // bs, s % bs)
    assert (scl > 0).all() and cds.shape == (int(boundary.sum()), 128)


def test_pack_seq_wrapper_packs_bytes():
    seen = {}

    def original(x, lengths, pad_value=-float("inf"), block_t=64, block_d=64):
        seen["dtype"], seen["pad"] = x.dtype, pad_value
        return x.reshape(1, *x.shape)

    fn = vi.pack_seq_triton_bytes(original)
    x = codes((4, 2, 128), 11)
    out = fn(x, torch.tensor([4]))
    assert seen == {"dtype": torch.uint8, "pad": 0} and out.dtype == E4M3
    fn(torch.zeros(4, 3), torch.tensor([4]))
    assert seen["dtype"] == torch.float32 and seen["pad"] == -float("inf")


def test_patch_rows_match_installed_vllm():
    from dsv4_ops.vllm.table import installed_release

    release = installed_release()
    rows = [row for row in vi.PATCHES if row.applies_to(release)]
    assert {r.qualname for r in rows} >= {r.qualname for r in vi.PATCHES if not r.versions}
    for row in rows:
        mod = importlib.import_module(row.module)
        obj = mod
        for part in row.symbol.split("."):
            obj = getattr(obj, part)
        params = tuple(p for p in inspect.signature(obj).parameters if p not in ("self", "cls"))
        assert params == row.params, row.qualname
        if not row.wraps:
            sig = inspect.signature(row.replacement).parameters
            mine = tuple(sig)
            # vLLM's parameters in its order; a later release's extra (defaulted) ones may follow
            assert mine[:len(row.params)] == row.params, f"{row.qualname}: replacement takes {mine}"
            extra = [n for n in mine[len(row.params):] if sig[n].default is inspect.Parameter.empty]
            assert not extra, f"{row.qualname}: replacement requires {extra}, which vLLM {release} does not pass"
