"""``torch.library.opcheck`` for every registered op: schema, fake (meta) vs the real kernel
(shapes, dtypes, strides, aliasing), and the compiled-vs-eager dispatch.

``SAMPLES`` maps every op of ``dsv4_ops.registration.all_ops()`` to a factory
``device -> [(case id, args), ...]``; a new op without an entry fails
``test_every_registered_op_has_samples`` by name. On the CPU the op runs its reference
(opcheck then checks the fake against the reference); the GPU-marked test runs the same
samples on CUDA tensors, so the fakes are checked against the Triton launchers. Inputs are
drawn on the CPU from seeded generators and then moved, so both devices see the same values.
"""

from typing import Callable, Dict, List, Tuple

import pytest
import torch

from dsv4_ops import layout, reference
from dsv4_ops.registration import all_ops, op_names
from dsv4_ops.testing import rng

D = layout.HEAD_DIM
SM_SCALE = D ** -0.5
Cases = List[Tuple[str, tuple]]


def _to(device, *args) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _codes(shape, seed: int) -> torch.Tensor:
    """Random E4M3 codes without the NaN codes 0x7F / 0xFF (opcheck compares with NaN != NaN)."""
    c = torch.randint(0, 256, shape, generator=rng(seed), dtype=torch.int64)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)


# ---- codec -----------------------------------------------------------------------------

def _e4m3_decode(device) -> Cases:
    return [("codes", _to(device, _codes((5, 33), 1)))]


def _e4m3_encode(device) -> Cases:
    x = torch.randn(7, 19, generator=rng(2)) * 100
    return [(f"{str(dt).replace('torch.', '')}-{'exact' if exact else 'fast'}", _to(device, x.to(dt), exact))
            for dt in (torch.float32, torch.bfloat16, torch.float16) for exact in (True, False)]


# ---- KV cache ----------------------------------------------------------------------------

def _kv_rows(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, D, generator=rng(seed)) * 3).to(torch.bfloat16)


def _filled_cache(num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """A cache of valid records at every slot (no NaN codes)."""
    cache = torch.zeros(num_blocks, layout.vllm_page_bytes(block_size), dtype=torch.uint8)
    cap = num_blocks * block_size
    reference.ref_kv_cache_insert(_kv_rows(cap, seed), cache, torch.arange(cap), block_size)
    return cache


def _slots(cap: int, shape, seed: int, dtype=torch.int64) -> torch.Tensor:
    """Slots in [-2, cap + 2): some invalid on both sides."""
    return torch.randint(-2, cap + 2, shape, generator=rng(seed)).to(dtype)


def _kv_cache_insert(device) -> Cases:
    bs = 8
    cache = torch.zeros(3, layout.vllm_page_bytes(bs), dtype=torch.uint8)
    slots = torch.randperm(24, generator=rng(3))[:10]
    slots[4] = -1
    return [("i64", _to(device, _kv_rows(10, 4), cache, slots, bs)),
            ("i32", _to(device, _kv_rows(10, 4), cache.clone(), slots.to(torch.int32), bs))]


def _kv_cache_gather(device) -> Cases:
    bs = 8
    cache = _filled_cache(3, bs, 5)
    return [("i64", _to(device, cache, _slots(24, (3, 4), 6), bs)),
            ("i32", _to(device, cache, _slots(24, (2, 6), 7, torch.int32), bs))]


def _kv_cache_gather_into(device) -> Cases:
    bs = 8
    ws = torch.zeros(20, D, dtype=torch.bfloat16)
    return [("offset5", _to(device, _filled_cache(3, bs, 8), _slots(24, (3, 4), 9), bs, ws, 5))]


# ---- attention ---------------------------------------------------------------------------

def _attn(T=2, H=8, K=40, N=64, seed=10):
    g = rng(seed)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(N, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(-2, N + 2, (T, K), generator=g).to(torch.int32)
    tl = torch.randint(1, K + 1, (T,), generator=g).to(torch.int32)
    sink = torch.randn(H, generator=g)
    return q, kv, idx, tl, sink


def _partials(S=3, seed=11):
    q, kv, idx, tl, sink = _attn(seed=seed)
    o_part, lse_part = reference.ref_sparse_mla_split(q, kv, idx, tl, SM_SCALE, S)
    return o_part, lse_part, sink


def _sparse_mla_split(device) -> Cases:
    q, kv, idx, tl, _ = _attn()
    return [("len-S3", _to(device, q, kv, idx, tl, SM_SCALE, 3)),
            ("nolen-S1", _to(device, q, kv, idx.long(), None, SM_SCALE, 1))]


def _merge_splits(device) -> Cases:
    o_part, lse_part, sink = _partials()
    return [("sink", _to(device, o_part, lse_part, sink)), ("nosink", _to(device, o_part, lse_part, None))]


def _sparse_mla_decode(device) -> Cases:
    q, kv, idx, tl, sink = _attn()
    return [("len-sink-auto", _to(device, q, kv, idx, tl, sink, SM_SCALE, 0)),
            ("nolen-nosink-S2", _to(device, q, kv, idx, None, None, SM_SCALE, 2))]


def _merge_splits_out(device) -> Cases:
    o_part, lse_part, sink = _partials(seed=12)
    out = torch.zeros(o_part.shape[0], o_part.shape[1], D, dtype=torch.bfloat16)
    return [("sink", _to(device, o_part, lse_part, sink, out))]


def _sparse_mla_decode_out(device) -> Cases:
    q, kv, idx, tl, sink = _attn(seed=13)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    return [("len-sink-S2", _to(device, q, kv, idx, tl, sink, SM_SCALE, 2, out)),
            ("nolen-nosink-auto", _to(device, q, kv, idx, None, None, SM_SCALE, 0, out.clone()))]


def _decode_slots(T=3, K1=37, K2=11, cap_c=50, cap_w=20, seed=14):
    g = rng(seed)
    topk = torch.randint(-3, cap_c + 3, (T, K1), generator=g).to(torch.int32)
    swa = torch.randint(-3, cap_w + 3, (T, K2), generator=g).to(torch.int32)
    tl = torch.randint(0, K1 + 1, (T,), generator=g).to(torch.int32)
    return topk, tl, swa


def _dsv4_decode_indices(device) -> Cases:
    topk, tl, swa = _decode_slots()
    return [("len", _to(device, topk, tl, swa, 50, 20)), ("nolen-i64", _to(device, topk.long(), None, swa.long(), 50, 20))]


def _dsv4_decode_gather(device) -> Cases:
    bc, bw = 16, 8
    cc, cw = _filled_cache(4, bc, 15), _filled_cache(3, bw, 16)
    topk, tl, swa = _decode_slots(cap_c=4 * bc, cap_w=3 * bw, seed=17)
    T, K1, K2 = topk.shape[0], topk.shape[1], swa.shape[1]
    ws = torch.zeros(T * (K1 + K2) + 3, D, dtype=torch.bfloat16)
    swa_len = torch.full((T,), K2 - 2, dtype=torch.int32)
    return [("len", _to(device, cc, topk, tl, bc, cw, swa, swa_len, bw, ws)),
            ("nolen", _to(device, cc, topk, None, bc, cw, swa, None, bw, ws.clone()))]


def _dsv4_decode_fused_out(device) -> Cases:
    bc, bw = 16, 8
    cc, cw = _filled_cache(4, bc, 18), _filled_cache(3, bw, 19)
    topk, tl, swa = _decode_slots(cap_c=4 * bc, cap_w=3 * bw, seed=20)
    T, H = topk.shape[0], 5
    g = rng(21)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    out = torch.zeros(T, H, D, dtype=torch.bfloat16)
    swa_len = torch.full((T + 1,), swa.shape[1] - 3, dtype=torch.int64)
    return [("len-sink-S2", _to(device, q, cc, topk, tl, bc, cw, swa, swa_len, bw, sink, SM_SCALE, 2, out)),
            ("nolen-nosink-plan", _to(device, q, cc, topk.long(), None, bc, cw, swa.long(), None, bw, None, SM_SCALE, 0,
                                      out.clone()))]


# ---- indexer -----------------------------------------------------------------------------

IDX_D = layout.INDEXER_HEAD_DIM


def _indexer_k(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, IDX_D, generator=rng(seed)) * 2).to(torch.bfloat16)


def _indexer_cache(num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """vLLM-shaped indexer cache [num_blocks, block_size, 132] with valid rows at every slot."""
    cache = torch.zeros(num_blocks, block_size, layout.INDEXER_RECORD_BYTES, dtype=torch.uint8)
    cap = num_blocks * block_size
    reference.ref_indexer_k_insert(_indexer_k(cap, seed), cache, torch.arange(cap), block_size)
    return cache


def _indexer_k_insert(device) -> Cases:
    bs = 4
    cache = torch.zeros(2, bs, layout.INDEXER_RECORD_BYTES, dtype=torch.uint8)
    slots = torch.tensor([3, 0, -1, 7, 9, 5])  # 9 >= capacity 8: skipped
    return [("i64", _to(device, _indexer_k(6, 20), cache, slots, bs))]


def _indexer_q_quant(device) -> Cases:
    g = rng(21)
    T, H, max_pos = 3, 4, 16
    positions = torch.randint(0, max_pos, (T,), generator=g)
    q = (torch.randn(T, H, IDX_D, generator=g) * 3).to(torch.bfloat16)
    ang = torch.rand(max_pos, 32, generator=g) * 6.28
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1)
    w = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return [("fp32-cache", _to(device, positions, q, cos_sin, w, IDX_D ** -0.5, H ** -0.5))]


def _mqa_logits(device) -> Cases:
    g = rng(22)
    M, H, N = 5, 4, 40
    q, k = _codes((M, H, IDX_D), 23), _codes((N, IDX_D), 24)
    weights = torch.randn(M, H, generator=g)
    k_scale = torch.rand(N, generator=g) + 0.5
    ks = torch.randint(0, 10, (M,), generator=g).to(torch.int32)
    ke = (ks + torch.randint(0, 25, (M,), generator=g)).clamp(max=N).to(torch.int32)
    return [("full", _to(device, q, weights, k, k_scale, ks, ke, -1)),
            ("compressed", _to(device, q, weights, k, k_scale, ks, ke, 24))]


def _paged_mqa_logits(device) -> Cases:
    g = rng(25)
    B, next_n, H, bs, nb = 2, 2, 4, 4, 6
    q = _codes((B, next_n, H, IDX_D), 26)
    cache = _indexer_cache(nb, bs, 27)
    weights = torch.randn(B * next_n, H, generator=g)
    context_lens = torch.tensor([9, 14], dtype=torch.int32)
    block_table = torch.tensor([[5, 0, 3, -1], [1, 2, 4, 0]], dtype=torch.int32)
    return [("ctx-per-request", _to(device, q, cache, weights, context_lens, block_table, 16))]


# ---- Engram ------------------------------------------------------------------------------

def _engram_lookup(device) -> Cases:
    g = rng(28)
    rows, dim, qb = 20, 256, 32
    weight = _codes((rows, dim), 29)
    scales = torch.randint(118, 134, (rows, dim // qb), generator=g).to(torch.uint8)
    T, total_heads, local_heads, head_start, vocab_start = 3, 6, 4, 4, 100
    ids = torch.randint(vocab_start - 3, vocab_start + rows + 3, (T, total_heads), generator=g).to(torch.int32)
    out_bf16 = torch.zeros(T, local_heads, dim, dtype=torch.bfloat16)
    out_packed = torch.zeros(T, local_heads, dim + dim // qb, dtype=torch.uint8)
    sorted_ids = torch.randint(-1, rows + 1, (7,), generator=g)
    sorted_dst = torch.randperm(T * local_heads, generator=g)[:7]
    common = (vocab_start, vocab_start + rows, head_start, total_heads)
    return [("bf16", _to(device, weight, scales, ids, out_bf16, *common)),
            ("packed", _to(device, weight, scales, ids, out_packed, *common)),
            ("sorted", _to(device, weight, scales, sorted_ids, out_bf16.clone(), *common, sorted_dst))]


def _sparse_mla_prefill(device) -> Cases:
    """dsv4_ampere::sparse_mla_prefill (writes out, returns lse): with and without
    topk_length / sink, -1 and >= N indices, an empty batch."""
    cases = []
    for T, H, with_len, with_sink in ((3, 8, True, True), (2, 24, False, False), (0, 8, True, True)):
        g = rng(100 + T + H)
        n, k = 40, 30
        q = torch.randn(max(T, 1), H, D, generator=g).to(torch.bfloat16)[:T]
        kv = torch.randn(n, D, generator=g).to(torch.bfloat16)
        idx = torch.randint(-1, n + 2, (T, k), generator=g, dtype=torch.int32)
        lens = torch.randint(0, k + 1, (T,), generator=g, dtype=torch.int32)
        sink = torch.randn(H, generator=g)
        args = (q, kv, idx, lens if with_len else None, sink if with_sink else None, SM_SCALE,
                torch.zeros(T, H, D, dtype=torch.bfloat16))
        cases.append((f"T{T}-H{H}", _to(device, *args)))
    return cases


SAMPLES: Dict[str, Callable[[str], Cases]] = {
    "e4m3_decode": _e4m3_decode,
    "e4m3_encode": _e4m3_encode,
    "kv_cache_insert": _kv_cache_insert,
    "kv_cache_gather": _kv_cache_gather,
    "kv_cache_gather_into": _kv_cache_gather_into,
    "sparse_mla_split": _sparse_mla_split,
    "merge_splits": _merge_splits,
    "sparse_mla_decode": _sparse_mla_decode,
    "dsv4_decode_indices": _dsv4_decode_indices,
    "merge_splits_out": _merge_splits_out,
    "sparse_mla_decode_out": _sparse_mla_decode_out,
    "dsv4_decode_gather": _dsv4_decode_gather,
    "dsv4_decode_fused_out": _dsv4_decode_fused_out,
    "indexer_k_insert": _indexer_k_insert,
    "indexer_q_quant": _indexer_q_quant,
    "mqa_logits": _mqa_logits,
    "paged_mqa_logits": _paged_mqa_logits,
    "engram_lookup": _engram_lookup,
    "sparse_mla_prefill": _sparse_mla_prefill,
}
# the V3.2 / GLM-5 ops' factories live beside their tests (tests/ is on sys.path)
from test_v32_ops import V32_OPCHECK_SAMPLES  # noqa: E402

SAMPLES.update(V32_OPCHECK_SAMPLES)


def test_every_registered_op_has_samples():
    missing = [op for op in op_names() if op not in SAMPLES]
    assert not missing, f"ops without opcheck samples (add a factory to SAMPLES in {__name__}): {missing}"
    stale = sorted(set(SAMPLES) - set(op_names()))
    assert not stale, f"SAMPLES names ops that are not registered: {stale}"


def _run_opcheck(op_name: str, device: str) -> None:
    op = getattr(torch.ops.dsv4_ampere, op_name).default
    cases = SAMPLES[op_name](device)
    assert cases, f"{op_name}: the factory gave no sample"
    failed = []
    for case_id, args in cases:
        try:
            torch.library.opcheck(op, args)
        except Exception as exc:  # noqa: BLE001 - report every case, then fail
            failed.append(f"{op_name}[{case_id}] on {device}: {type(exc).__name__}: {str(exc)[:600]}")
    assert not failed, "\n".join(failed)


_REGISTERED = [op.name for op in all_ops()]
_WITH_SAMPLES = [name for name in _REGISTERED if name in SAMPLES]


@pytest.mark.parametrize("op_name", _WITH_SAMPLES)
def test_opcheck_cpu(op_name):
    """opcheck on CPU tensors: the fake against the reference (the op's CPU impl)."""
    _run_opcheck(op_name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", _WITH_SAMPLES)
def test_opcheck_cuda(monkeypatch, op_name):
    """opcheck on CUDA tensors: the fake against the Triton launcher. The portable variant
    (what sm_8x runs) only: both variants allocate the same outputs, and the numerics of
    each variant are checked by the area tests."""
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    _run_opcheck(op_name, "cuda")
