"""Pure-PyTorch references: the contract every kernel is tested against.

Written for clarity, not speed; they run on any device and are the CPU implementations of
the ``dsv4_ampere`` ops.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import layout as _kvl

E4M3_MAX = _kvl.E4M3_MAX
E4M3_NAN_CODE = 0x7F
E4M3_MAX_CODE = 0x7E

# ---------------------------------------------------------------------------------------
# E4M3 codec (ops e4m3_decode, e4m3_encode)
# ---------------------------------------------------------------------------------------


def ref_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32: sign, 4-bit exponent (bias 7), 3-bit mantissa; 0x7F/0xFF NaN."""
    c = codes.to(torch.int64)
    exp = (c >> 3) & 0xF
    mant = (c & 0x7).to(torch.float64)
    subnormal = mant * 2.0 ** -9
    normal = (8.0 + mant) * torch.pow(2.0, (exp - 10).to(torch.float64))
    mag = torch.where(exp == 0, subnormal, normal)
    mag = torch.where((c & 0x7F) == E4M3_NAN_CODE, torch.full_like(mag, float("nan")), mag)
    return torch.where((c & 0x80) != 0, -mag, mag).to(torch.float32)


def _e4m3_magnitudes(device) -> torch.Tensor:
    """float64 [127]: the value of codes 0x00..0x7E, ascending."""
    return ref_e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8, device=device)).to(torch.float64)


def ref_e4m3_encode(x: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """float32/bfloat16/float16 -> uint8 E4M3 codes, saturating at +-448.

    Nearest of the 127 magnitudes; ties go to the even code (exact=True, torch's rounding)
    or away from zero (exact=False, the e4b15 trick). NaN: 0x7F | sign (exact) or 0x7E |
    sign (fast: the e4b15 path saturates NaN).
    """
    xd = x.to(torch.float64)
    neg = torch.signbit(xd)
    nan = torch.isnan(xd)
    a = xd.abs().nan_to_num(0.0).clamp(max=E4M3_MAX)
    table = _e4m3_magnitudes(x.device)
    hi = torch.searchsorted(table, a.contiguous()).clamp(max=E4M3_MAX_CODE)
    lo = (hi - 1).clamp(min=0)
    d_lo = a - table[lo]
    d_hi = table[hi] - a
    tie_to_hi = (hi % 2 == 0) if exact else torch.ones_like(hi, dtype=torch.bool)
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & tie_to_hi), hi, lo)
    code = torch.where(nan, torch.full_like(code, E4M3_NAN_CODE if exact else E4M3_MAX_CODE), code)
    code = torch.where(neg, code | 0x80, code)
    return code.to(torch.uint8)


# ---------------------------------------------------------------------------------------
# Sparse MLA decode with attention sink (ops sparse_mla_split, merge_splits,
# sparse_mla_decode). Shapes: q [T, H, D], kv [N, D], indices [T, K], D = 512.
# ---------------------------------------------------------------------------------------

ATTN_PARTITION_N = 16  # key-block granularity of the split partition (csrc_triton.decode.tiles)


def ref_sink_logits(sink, H: int, device) -> torch.Tensor:
    """float64 [H] sink logits as the attention uses them. Non-finite sinks: -inf (and None)
    is no sink; NaN counts as no sink too (a logit with no value adds nothing to the
    denominator; it never turns the row into NaN); +inf takes the whole mass: out 0 and, as
    for a row without keys, lse -inf (the denominator inf/inf is not formed)."""
    if sink is None:
        return torch.full((H,), float("-inf"), dtype=torch.float64, device=device)
    sk = sink.to(torch.float64)
    return torch.where(torch.isnan(sk), torch.full_like(sk, float("-inf")), sk)


def _ref_attn_valid(indices: torch.Tensor, topk_length, n_rows: int) -> torch.Tensor:
    """bool [T, K]: 0 <= indices < N and j < topk_length[t]."""
    valid = (indices >= 0) & (indices < n_rows)
    if topk_length is not None:
        j = torch.arange(indices.shape[1], device=indices.device)
        valid = valid & (j[None, :] < topk_length.to(torch.int64)[:, None])
    return valid


def _ref_attn_scores(q, kv, indices, valid, sm_scale, dtype):
    """(scores [T, H, K] with -inf where invalid, gathered kv [T, K, D]), in ``dtype``."""
    # Invalid positions read an appended zero row (kv may have no rows at all).
    kv_z = torch.cat([kv.to(dtype), kv.new_zeros((1, kv.shape[1]), dtype=dtype)])
    rows = torch.where(valid, indices.to(torch.int64), torch.full_like(indices, kv.shape[0], dtype=torch.int64))
    kv_g = kv_z[rows]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.to(dtype), kv_g) * sm_scale
    return s.masked_fill(~valid[:, None, :], float("-inf")), kv_g


def ref_sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, topk_length,
                          sink, sm_scale: float, out_dtype: torch.dtype = torch.bfloat16):
    """Sparse MLA with sink (README, "Attention semantics"), computed in float64.

    q [T, H, D]; kv [N, D]; indices int [T, K]; topk_length int [T] or None; sink float [H] or
    None. Returns out [T, H, D] in ``out_dtype`` (bf16, the op's dtype) and lse float32 [T, H].
    """
    T, H = q.shape[0], q.shape[1]
    valid = _ref_attn_valid(indices, topk_length, kv.shape[0])
    s, kv_g = _ref_attn_scores(q, kv, indices, valid, sm_scale, torch.float64)  # [T, H, K]
    sk = ref_sink_logits(sink, H, q.device)
    m = torch.maximum(s.amax(dim=-1) if s.shape[-1] else torch.full((T, H), float("-inf"), dtype=torch.float64,
                                                                     device=q.device), sk[None, :])
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])  # [T, H, K]; 0 where invalid
    den = p.sum(-1) + torch.exp(sk[None, :] - m_safe)
    den_safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("thk,tkd->thd", p / den_safe[..., None], kv_g)
    lse = torch.where(den > 0, m_safe + torch.log(den_safe), torch.full_like(den, float("-inf")))
    return out.to(out_dtype), lse.to(torch.float32)


def ref_split_bounds(indices: torch.Tensor, topk_length, num_splits: int):
    """int64 [T, S] start and end key positions of every split (the kernel's partition)."""
    T, K = indices.shape
    k_len = torch.full((T,), K, dtype=torch.int64, device=indices.device)
    if topk_length is not None:
        k_len = topk_length.to(torch.int64).clamp(0, K)
    nb = (k_len + ATTN_PARTITION_N - 1) // ATTN_PARTITION_N  # [T]
    s = torch.arange(num_splits + 1, dtype=torch.int64, device=indices.device)
    edges = (s[None, :] * nb[:, None]) // num_splits * ATTN_PARTITION_N  # [T, S + 1]
    return edges[:, :-1], edges[:, 1:]


def ref_sparse_mla_split(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, topk_length,
                         sm_scale: float, num_splits: int):
    """Per-split partials in the kernel's layout, computed in float64.

    Returns o_part float32 [T, H, S, D] (normalised per split) and lse_part float32 [T, H, S];
    an empty split has o = 0, lse = -inf.
    """
    T, H, D = q.shape
    valid = _ref_attn_valid(indices, topk_length, kv.shape[0])
    lo, hi = ref_split_bounds(indices, topk_length, num_splits)
    j = torch.arange(indices.shape[1], device=indices.device)
    o_part = torch.zeros((T, H, num_splits, D), dtype=torch.float32, device=q.device)
    lse_part = torch.full((T, H, num_splits), float("-inf"), dtype=torch.float32, device=q.device)
    for sp in range(num_splits):
        in_split = valid & (j[None, :] >= lo[:, sp:sp + 1]) & (j[None, :] < hi[:, sp:sp + 1])
        # A split is plain attention over its keys with no sink.
        o, lse = ref_sparse_mla_decode(q, kv, torch.where(in_split, indices.to(torch.int64), -1),
                                       None, None, sm_scale, out_dtype=torch.float32)
        o_part[:, :, sp] = o
        lse_part[:, :, sp] = lse
    return o_part, lse_part


def ref_merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, sink, out_dtype: torch.dtype = torch.bfloat16):
    """LSE merge with sink, in float64: out [T, H, D] (``out_dtype``), lse float32 [T, H]."""
    lse = lse_part.to(torch.float64)  # [T, H, S]
    H = lse.shape[1]
    sk = ref_sink_logits(sink, H, lse.device)
    m = torch.maximum(lse.amax(dim=-1), sk[None, :])  # [T, H]
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe[..., None])  # [T, H, S]
    den = w.sum(-1) + torch.exp(sk[None, :] - m_safe)
    den_safe = torch.where(den > 0, den, torch.ones_like(den))
    o = torch.where(w[..., None] > 0, o_part.to(torch.float64), torch.zeros((), dtype=torch.float64,
                                                                             device=lse.device))
    out = (o * (w / den_safe[..., None])[..., None]).sum(2)
    lse_out = torch.where(den > 0, m_safe + torch.log(den_safe), torch.full_like(den, float("-inf")))
    return out.to(out_dtype), lse_out.to(torch.float32)


# ---------------------------------------------------------------------------------------
# Paged fp8 KV cache (ops kv_cache_insert, kv_cache_gather): records of dsv4_ops.layout
# ---------------------------------------------------------------------------------------



def ref_ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int64 UE8M0 exponents e = ceil(log2(max(amax, 1e-4) / 448)), exact on every device.

    Through frexp, not log2: CUDA's float64 log2 is off by an ulp at some powers of two
    (log2(2**-13) > -13 was seen on an H200), which moves the ceiling by one.
    """
    a = amax.to(torch.float64).clamp(min=_kvl.AMAX_FLOOR) / _kvl.E4M3_MAX  # exact: a power of two times 1.75
    mant, exp = torch.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    return (exp - (mant == 0.5).to(exp.dtype)).to(torch.int64)


def ref_pack_records(kv: torch.Tensor) -> torch.Tensor:
    """bf16 [M, 512] -> uint8 [M, 584]: each row's 576-byte data row then its 8-byte scale row."""
    m = kv.shape[0]
    nope = kv[:, :_kvl.NOPE_DIM].to(torch.float64).reshape(m, _kvl.NUM_SCALES, _kvl.QUANT_GROUP)
    e = ref_ue8m0_exponent(nope.abs().amax(dim=-1))  # [M, 7]
    q = (nope / torch.exp2(e.to(torch.float64))[..., None]).clamp(-_kvl.E4M3_MAX, _kvl.E4M3_MAX)
    codes = ref_e4m3_encode(q).reshape(m, _kvl.NOPE_DIM)
    rope = kv[:, _kvl.NOPE_DIM:].contiguous().view(torch.uint8)  # [M, 128], little-endian bf16
    scales = torch.cat([(e + _kvl.UE8M0_BIAS).to(torch.uint8),
                        torch.full((m, 1), _kvl.PAD_BYTE, dtype=torch.uint8, device=kv.device)], dim=1)
    return torch.cat([codes, rope, scales], dim=1)


def ref_unpack_records(records: torch.Tensor) -> torch.Tensor:
    """uint8 [M, 584] -> bf16 [M, 512]: codes * 2**(scale - 127) in float32, RoPE dims raw."""
    m = records.shape[0]
    codes = records[:, :_kvl.NOPE_DIM]
    sbytes = records[:, _kvl.DATA_BYTES:_kvl.DATA_BYTES + _kvl.NUM_SCALES]
    scale = torch.exp2(sbytes.to(torch.float32) - _kvl.UE8M0_BIAS)  # [M, 7]
    vals = ref_e4m3_decode(codes).reshape(m, _kvl.NUM_SCALES, _kvl.QUANT_GROUP) * scale[..., None]
    rope = records[:, _kvl.NOPE_DIM:_kvl.DATA_BYTES].contiguous().view(torch.bfloat16)  # [M, 64]
    return torch.cat([vals.reshape(m, _kvl.NOPE_DIM).to(torch.bfloat16), rope], dim=1)


def _ref_record_columns(slots: torch.Tensor, block_size: int):
    """Block index [S, 1] and the 576 data + 8 scale byte columns [S, 584] of each slot."""
    blk = torch.div(slots, block_size, rounding_mode="floor")
    pos = slots - blk * block_size
    ar_d = torch.arange(_kvl.DATA_BYTES, device=slots.device)
    ar_s = torch.arange(_kvl.SCALE_BYTES, device=slots.device)
    cols = torch.cat([(pos * _kvl.DATA_BYTES)[:, None] + ar_d,
                      (block_size * _kvl.DATA_BYTES + pos * _kvl.SCALE_BYTES)[:, None] + ar_s], dim=1)
    return blk[:, None], cols


def ref_kv_cache_insert(kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                        block_size: int) -> None:
    """Write the 584-byte record of kv[i] (bf16 [N, 512]) at slot slot_mapping[i] ([M], M <= N)
    of cache (uint8 [num_blocks, page_bytes]), in place; slots outside
    [0, num_blocks * block_size) are skipped. Record: dsv4_ops.layout."""
    slots = slot_mapping.to(torch.int64)
    keep = (slots >= 0) & (slots < _kvl.capacity(cache, block_size))
    if not bool(keep.any()):
        return
    records = ref_pack_records(kv[:slots.shape[0]][keep])
    blk, cols = _ref_record_columns(slots[keep], block_size)
    cache[blk, cols] = records


def ref_kv_cache_gather(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """bf16 slots.shape + (512,): the dequantized record of each slot (any shape, int32/int64);
    a slot outside [0, num_blocks * block_size) gives a zero row."""
    flat = slots.reshape(-1).to(torch.int64)
    out = torch.zeros((flat.numel(), _kvl.HEAD_DIM), dtype=torch.bfloat16, device=cache.device)
    valid = (flat >= 0) & (flat < _kvl.capacity(cache, block_size))
    if bool(valid.any()):
        blk, cols = _ref_record_columns(flat[valid], block_size)
        out[valid] = ref_unpack_records(cache[blk, cols])
    return out.view(tuple(slots.shape) + (_kvl.HEAD_DIM,))


def ref_decode_indices(topk_slots: torch.Tensor, topk_length: Optional[torch.Tensor], swa_slots: torch.Tensor,
                       compressed_capacity: int, swa_capacity: int) -> torch.Tensor:
    """DSv4 decode workspace indices int32 [T, K1 + K2] (layout: dsv4_ops.dsv4_decode).

    Top-k column j of token t -> row t*K1 + j, window column j -> row T*K1 + t*K2 + j; -1
    where the slot is outside [0, capacity) or (top-k part) j >= topk_length[t].
    """
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]
    dev = topk_slots.device
    t = torch.arange(T, device=dev, dtype=torch.int64)[:, None]
    j1 = torch.arange(K1, device=dev, dtype=torch.int64)[None, :]
    j2 = torch.arange(K2, device=dev, dtype=torch.int64)[None, :]
    sc, sw = topk_slots.to(torch.int64), swa_slots.to(torch.int64)
    ok_c = (sc >= 0) & (sc < compressed_capacity)
    if topk_length is not None:
        ok_c = ok_c & (j1 < topk_length.to(torch.int64)[:, None])
    ok_w = (sw >= 0) & (sw < swa_capacity)
    idx_c = torch.where(ok_c, t * K1 + j1, -1)
    idx_w = torch.where(ok_w, T * K1 + t * K2 + j2, -1)
    return torch.cat([idx_c, idx_w], dim=1).to(torch.int32).contiguous()


# ---- decode gather (one launch: both gathers + the index build) ----


def ref_dsv4_decode_gather(compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                           topk_length: Optional[torch.Tensor], compressed_block_size: int,
                           swa_cache: torch.Tensor, swa_slots: torch.Tensor, swa_length: Optional[torch.Tensor],
                           swa_block_size: int, workspace: torch.Tensor) -> torch.Tensor:
    """Op ``dsv4_decode_gather``: writes workspace rows [0, T*(K1+K2)) (layout:
    dsv4_ops.dsv4_decode) and returns the indices int32 [T, K1 + K2].

    Row t*K1 + j = record of topk_slots[t, j] and row T*K1 + t*K2 + j = record of
    swa_slots[t, j]: a zero row (and index -1) where the slot is outside [0, capacity) or the
    entry is past the token's length (topk_length[t] / swa_length[t], the first T values
    read; None: no limit).
    """
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]

    def masked(slots, length, K):
        slots = slots.to(torch.int64)
        if length is None:
            return slots
        j = torch.arange(K, device=slots.device)[None, :]
        return torch.where(j < length[:T].to(torch.int64)[:, None], slots, -1)

    sc, sw = masked(topk_slots, topk_length, K1), masked(swa_slots, swa_length, K2)
    rows = torch.cat([ref_kv_cache_gather(compressed_cache, sc, compressed_block_size).reshape(-1, _kvl.HEAD_DIM),
                      ref_kv_cache_gather(swa_cache, sw, swa_block_size).reshape(-1, _kvl.HEAD_DIM)])
    workspace[:rows.shape[0]] = rows.to(workspace.dtype)
    return ref_decode_indices(sc, None, sw, _kvl.capacity(compressed_cache, compressed_block_size),
                              _kvl.capacity(swa_cache, swa_block_size))


def ref_dsv4_decode_fused(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                          topk_length: Optional[torch.Tensor], compressed_block_size: int, swa_cache: torch.Tensor,
                          swa_slots: torch.Tensor, swa_length: Optional[torch.Tensor], swa_block_size: int,
                          sink, sm_scale: float, out_dtype: torch.dtype = torch.bfloat16):
    """Op ``dsv4_decode_fused_out`` (one decode step read from the paged caches): the rows and
    indices of ``ref_dsv4_decode_gather``, then ``ref_sparse_mla_decode`` over them (float64).
    Returns out [T, H, 512] in ``out_dtype`` and lse float32 [T, H]."""
    T = topk_slots.shape[0]
    ws = torch.zeros(T * (topk_slots.shape[1] + swa_slots.shape[1]), _kvl.HEAD_DIM, dtype=torch.float64,
                     device=q.device)
    idx = ref_dsv4_decode_gather(compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                                 swa_slots, swa_length, swa_block_size, ws)
    return ref_sparse_mla_decode(q, ws, idx, None, sink, sm_scale, out_dtype=out_dtype)


# ---- engram ----


def ref_engram_lookup(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                      vocab_start: int, vocab_end: int, head_start: int, total_heads: int,
                      sorted_dst: Optional[torch.Tensor] = None) -> None:
    """Op ``engram_lookup`` (semantics: ``dsv4_ops.engram``), written into ``out`` in place.

    weight uint8/float8_e4m3fn [R, D]; scales uint8 [R, D // Q]; ids int [T, >= total_heads]
    (sorted: [n] local rows and sorted_dst [n] output rows); out bf16 [T', L, D] (value =
    e4m3 * 2**(byte - 127), byte 0 -> 0) or uint8 [T', L, D + D // Q] (code bytes, scale
    bytes). Rows not owned (id outside [vocab_start, vocab_end), past the table, or head >=
    total_heads) are zeros.
    """
    codes = weight.view(torch.uint8) if weight.dtype == torch.float8_e4m3fn else weight
    n_tab, dim = codes.shape
    n_local = out.shape[1]
    if sorted_dst is not None:
        local = ids.to(torch.int64)
        dst = sorted_dst.to(torch.int64)
        keep = (dst >= 0) & (dst < ids.shape[0])
        local, dst = local[keep], dst[keep]
    else:
        T = ids.shape[0]
        heads = head_start + torch.arange(n_local, device=ids.device)
        col_ok = heads < total_heads
        gid = torch.full((T, n_local), -1, dtype=torch.int64, device=ids.device)
        gid[:, col_ok] = ids[:, heads[col_ok]].to(torch.int64)
        local = torch.where(col_ok[None, :], gid - vocab_start, -1).reshape(-1)
        dst = torch.arange(T * n_local, device=ids.device)
    owned = (local >= 0) & (local < min(vocab_end - vocab_start, n_tab))
    row = torch.where(owned, local, 0)
    c = codes[row]  # [n, D] uint8
    s = scales[row]  # [n, D // Q] uint8
    if out.dtype == torch.uint8:
        rows = torch.cat([c, s], dim=1)
    else:
        q = dim // scales.shape[1]
        scale = (s.to(torch.int32) << 23).view(torch.float32).repeat_interleave(q, dim=1)
        rows = (ref_e4m3_decode(c) * scale).to(torch.bfloat16)
    rows = torch.where(owned[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    out[dst // n_local, dst % n_local] = rows


# ---------------------------------------------------------------------------------------
# ---- indexer ----
# Sparse-attention indexer (ops indexer_k_insert, indexer_q_quant, mqa_logits,
# paged_mqa_logits); cache layout: dsv4_ops.layout, section "indexer cache".
# ---------------------------------------------------------------------------------------


def _ref_codes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of E4M3 bytes given as uint8 or float8_e4m3fn."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _ref_pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """float32 2**e of int64 exponents (exact for |e| <= 126)."""
    return torch.exp2(e.to(torch.float64)).to(torch.float32)


def ref_indexer_pack_rows(k: torch.Tensor):
    """bf16 or fp32 [N, 128] -> (uint8 codes [N, 128], float32 scales [N]): e = UE8M0 exponent of the
    row amax, codes e4m3(k / 2**e) (RNE), scale 2**e."""
    x = k.to(torch.float64)
    e = ref_ue8m0_exponent(x.abs().amax(dim=1))
    codes = ref_e4m3_encode((x / torch.exp2(e.to(torch.float64))[:, None]).clamp(-E4M3_MAX, E4M3_MAX))
    return codes, _ref_pow2_f32(e)


def ref_indexer_k_insert(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """Write the indexer row of k[i] (bf16 or fp32 [N, 128]) at slot slot_mapping[i] ([M], M <= N) of the
    indexer cache (any form ``layout.indexer_cache_pages`` takes), in place; slots outside
    [0, num_blocks * block_size) are skipped."""
    flat, block_size = _kvl.indexer_cache_pages(cache, block_size)
    slots = slot_mapping.to(torch.int64)
    keep = (slots >= 0) & (slots < flat.shape[0] * block_size)
    if not bool(keep.any()):
        return
    codes, scales = ref_indexer_pack_rows(k[:slots.shape[0]][keep])
    s = slots[keep]
    blk = torch.div(s, block_size, rounding_mode="floor")
    pos = s - blk * block_size
    d = torch.arange(_kvl.INDEXER_DATA_BYTES, device=s.device)
    flat[blk[:, None], (pos * _kvl.INDEXER_DATA_BYTES)[:, None] + d] = codes
    c = torch.arange(_kvl.INDEXER_SCALE_BYTES, device=s.device)
    flat[blk[:, None], (block_size * _kvl.INDEXER_DATA_BYTES + pos * _kvl.INDEXER_SCALE_BYTES)[:, None] + c] = \
        scales.contiguous().view(torch.uint8).view(-1, _kvl.INDEXER_SCALE_BYTES)


def ref_indexer_read_rows(cache: torch.Tensor, block_size, blk: torch.Tensor, pos: torch.Tensor):
    """(uint8 codes [..., 128], float32 scales [...]) of rows (blk, pos) of an indexer cache;
    blk and pos int64 of one shape, all valid."""
    flat, block_size = _kvl.indexer_cache_pages(cache, block_size)
    d = torch.arange(_kvl.INDEXER_DATA_BYTES, device=flat.device)
    c = torch.arange(_kvl.INDEXER_SCALE_BYTES, device=flat.device)
    codes = flat[blk[..., None], (pos * _kvl.INDEXER_DATA_BYTES)[..., None] + d]
    sb = flat[blk[..., None], (block_size * _kvl.INDEXER_DATA_BYTES + pos * _kvl.INDEXER_SCALE_BYTES)[..., None] + c]
    return codes, sb.contiguous().view(torch.float32).squeeze(-1)


def ref_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 rounded to bfloat16 (round half to even)."""
    return x.to(torch.bfloat16).to(torch.float32)


def ref_indexer_q_quant(positions: torch.Tensor, index_q: torch.Tensor, cos_sin_cache: torch.Tensor,
                        index_weights: torch.Tensor, softmax_scale: float, head_scale: float):
    """The FP8 path of vLLM 0.33.0's fused_indexer_q_rope_quant, in its CUDA kernel's (CuTeDSL
    ``IndexerQFp8Kernel``) rounding sequence, every step an IEEE fp32 operation:

    - dims 64 + 2i, 65 + 2i (i < 32): x0' = x0*cos_i - x1*sin_i, x1' = x0*sin_i + x1*cos_i
      (products rounded, then the sum), rounded to bf16 (RNE); dims 0..63 unchanged;
    - e = ceil(log2(max(amax, 1e-4) / 448)) over the head's 128 values (exact integer);
    - codes = e4m3(value * 2**-e) (RNE; |value * 2**-e| <= 448 by construction);
    - weights_out = (float32(w) * float32(softmax_scale * head_scale)) * 2**e.
    Returns (uint8 [T, H, 128], float32 [T, H]).
    """
    T, H, Dq = index_q.shape
    x = index_q.to(torch.float32)
    cs = cos_sin_cache.to(torch.float32)[positions.to(torch.int64)]  # [T, 64]
    half = _kvl.INDEXER_ROPE_DIM // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x0 = x[..., _kvl.INDEXER_NOPE_DIM::2]
    x1 = x[..., _kvl.INDEXER_NOPE_DIM + 1::2]
    r0 = ref_round_bf16(x0 * cos - x1 * sin)
    r1 = ref_round_bf16(x0 * sin + x1 * cos)
    v = x.clone()
    v[..., _kvl.INDEXER_NOPE_DIM::2] = r0
    v[..., _kvl.INDEXER_NOPE_DIM + 1::2] = r1
    e = ref_ue8m0_exponent(v.abs().amax(dim=-1))  # [T, H]
    codes = ref_e4m3_encode(v.to(torch.float64) / torch.exp2(e.to(torch.float64))[..., None])
    scale = torch.tensor(softmax_scale * head_scale, dtype=torch.float32)
    w = (index_weights.to(torch.float32) * scale) * _ref_pow2_f32(e)
    return codes, w


def ref_mqa_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int = -1) -> torch.Tensor:
    """float64 prefill indexer logits, returned as float32: out[m, n] = k_scale[n] *
    sum_h weights[m, h] * relu(<q[m, h], k[n]>) for ks[m] <= n < ke[m], -inf elsewhere;
    [M, N], or [M, max_seqlen_k] with column j = key ks[m] + j when max_seqlen_k >= 0."""
    qf = ref_e4m3_decode(_ref_codes(q)).to(torch.float64)  # [M, H, 128]
    kf = ref_e4m3_decode(_ref_codes(k)).to(torch.float64)  # [N, 128]
    M, H, _ = qf.shape
    N = kf.shape[0]
    w = weights.to(torch.float64)
    acc = torch.zeros((M, N), dtype=torch.float64, device=qf.device)
    for h in range(H):
        acc += (qf[:, h] @ kf.T).clamp(min=0) * w[:, h:h + 1]
    acc *= k_scale.reshape(-1).to(torch.float64)[None, :]
    n = torch.arange(N, device=qf.device)[None, :]
    valid = (n >= ks.to(torch.int64)[:, None]) & (n < ke.to(torch.int64)[:, None])
    full = torch.where(valid, acc, float("-inf")).to(torch.float32)
    if max_seqlen_k < 0:
        return full
    j = torch.arange(max_seqlen_k, device=qf.device)[None, :]
    key = ks.to(torch.int64).clamp(min=0)[:, None] + j
    ok = (key < ke.to(torch.int64)[:, None]) & (key < N)
    return torch.where(ok, full.gather(1, key.clamp(max=max(N - 1, 0))) if N else full.new_zeros(key.shape),
                       float("-inf"))


def ref_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                         block_size: int = 0) -> torch.Tensor:
    """float64 decode indexer logits over the paged indexer cache, returned as float32
    [B * next_n, max_context_len]. Row r = b * next_n + j sees context positions n < L_r,
    L_r = context_lens[b, j] ([B, next_n]) or context_lens[b] - next_n + j + 1 ([B]); position
    n is key row n % block_size of page block_table[b, n // block_size]; -inf where n >= L_r,
    the block-table column is past its end, or the page id is outside [0, num_blocks)."""
    flat, block_size = _kvl.indexer_cache_pages(kv_cache, block_size or None, "kv_cache")
    qc = _ref_codes(q)
    B, next_n, H, _ = qc.shape
    dev = qc.device
    n = torch.arange(max_context_len, device=dev, dtype=torch.int64)
    if context_lens.dim() == 2:
        L = context_lens.to(torch.int64).reshape(B * next_n)
    else:
        L = (context_lens.to(torch.int64)[:, None] - next_n + 1 + torch.arange(next_n, device=dev)[None, :]).reshape(-1)
    col = torch.div(n, block_size, rounding_mode="floor")  # [C]
    in_table = col < block_table.shape[1]
    blk = torch.where(in_table[None, :], block_table.to(torch.int64)[:, col.clamp(max=max(block_table.shape[1] - 1, 0))]
                      if block_table.shape[1] else torch.full((B, n.numel()), -1, device=dev, dtype=torch.int64), -1)
    page_ok = (blk >= 0) & (blk < flat.shape[0])  # [B, C]
    codes, scales = ref_indexer_read_rows(flat, block_size, torch.where(page_ok, blk, 0),
                                          (n - col * block_size)[None, :].expand(B, -1))
    kf = ref_e4m3_decode(codes).to(torch.float64)  # [B, C, 128]
    qf = ref_e4m3_decode(qc).to(torch.float64).reshape(B, next_n, H, -1)
    s = torch.einsum("bjhd,bcd->bjhc", qf, kf).clamp(min=0)  # [B, next_n, H, C]
    logit = (s * weights.to(torch.float64).reshape(B, next_n, H, 1)).sum(dim=2) * scales.to(torch.float64)[:, None, :]
    valid = page_ok[:, None, :] & (n[None, None, :] < L.reshape(B, next_n, 1))
    return torch.where(valid, logit, float("-inf")).reshape(B * next_n, max_context_len).to(torch.float32)

# ---------------------------------------------------------------------------------------
# DeepSeek-V3.2 / GLM-5 MLA (ops v32_kv_insert, v32_kv_gather(_into), v32_sparse_mla_decode(_out),
# v32_sparse_mla_prefill(_out))
# ---------------------------------------------------------------------------------------
#
# Cache layouts: ``dsv4_ops.layout`` (V3.2 section: the 656-byte ``fp8_ds_mla`` record, the bf16
# ``auto`` rows of 576). Written for clarity, not speed; any device.
#
# - ``ref_v32_kv_insert``: vLLM 0.33.0's ``concat_and_cache_mla`` as its C++ computes it (fp32
#   amax / 448, floor 1e-4, ``2 ** ceil(log2(.))``, a division, a saturating RNE cast), with
#   torch's float8 cast; independent of the kernel's integer exponent and fp8-free codec.
# - ``ref_v32_kv_gather``: e4m3 * fp32 scale rounded to bf16, RoPE raw; invalid slot: zeros.
# - ``ref_v32_sparse_mla``: attention over bf16 rows [N, 576] (d_qk 576, d_v 512, no sink),
#   in ``compute_dtype`` (float64 for the tests' oracle); FlashMLA ``tests/ref.py`` semantics
#   except that a token with no valid key gets lse = -inf (FlashMLA reports +inf).
# - ``ref_v32_sparse_mla_decode``: the same over the paged cache by slot (gather, then attend).




def _slots_valid(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    return (slots >= 0) & (slots < capacity)


def v32_quantize_rows(kv_c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 (or fp32) kv_c [N, 512] -> (codes uint8 [N, 512], scales fp32 [N, 4]) exactly as vLLM
    0.33.0's concat_and_cache_ds_mla_kernel (and, for fp32 rows, its fused norm + RoPE writer,
    which takes amax * (1 / 448): the same exponent unless amax / 448 is within an fp32 ulp of a
    power of two): per 128-dim tile s = max(amax / 448, 1e-4) (fp32),
    scale = 2 ** ceil(log2(s)), codes = e4m3(satfinite(x / scale)), round to nearest even."""
    x = kv_c.to(torch.float32).reshape(-1, _kvl.V32_NUM_TILES, _kvl.V32_TILE)
    amax = x.abs().amax(dim=-1)  # [N, 4]
    s = torch.clamp_min(amax / torch.tensor(E4M3_MAX, dtype=torch.float32), _kvl.V32_SCALE_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(s)))  # fp32 power of two
    q = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # satfinite, then the RNE cast
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, _kvl.V32_NOPE_DIM)
    return codes, scale


def ref_v32_kv_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write the records of tokens 0..M-1 (M = slot_mapping.numel()) in place.

    kv_c bf16 [N, 512] (fp32 too for fp8_ds_mla), k_pe bf16 [N, 64] (or [N, 1, 64]); kv_cache as accepted by
    ``layout.v32_cache_pages``. A slot < 0 or >= num_blocks * block_size is skipped.
    fp8_ds_mla: bytes [0, 512) codes, [512, 528) the 4 fp32 scales, [528, 656) k_pe raw.
    auto: the row cat(kv_c, k_pe).
    """
    c, fmt = _kvl.v32_cache_pages(kv_cache)
    nb, bs, _ = c.shape
    m = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64).reshape(-1)
    ok = _slots_valid(slots, nb * bs)
    tok = torch.nonzero(ok).reshape(-1)
    if tok.numel() == 0:
        return
    s = slots[tok]
    blk, pos = s // bs, s % bs
    x = kv_c[:m][tok]
    pe = k_pe.reshape(k_pe.shape[0], -1)[:m][tok]
    if fmt == "auto":
        c[blk, pos] = torch.cat([x, pe], dim=-1).to(torch.bfloat16)
        return
    codes, scale = v32_quantize_rows(x)
    rec = torch.cat([codes, scale.contiguous().view(torch.uint8).reshape(-1, 16),
                     pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1, 2 * _kvl.V32_ROPE_DIM)], dim=-1)
    c[blk, pos] = rec


def v32_dequantize_records(rec: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] records -> bf16 [..., 576]: e4m3(code) * fp32 scale of its tile
    (rounded once to bf16), then the 64 raw bf16 RoPE dims."""
    lead = rec.shape[:-1]
    r = rec.reshape(-1, _kvl.V32_RECORD_BYTES)
    codes = r[:, :_kvl.V32_NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = r[:, _kvl.V32_SCALE_OFFSET:_kvl.V32_ROPE_OFFSET].contiguous().view(torch.float32)  # [n, 4]
    nope = (codes.reshape(-1, _kvl.V32_NUM_TILES, _kvl.V32_TILE) * scale[..., None]).reshape(-1, _kvl.V32_NOPE_DIM)
    rope = r[:, _kvl.V32_ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=-1).reshape(*lead, _kvl.V32_HEAD_DIM_QK)


def ref_v32_kv_gather(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """bf16 slots.shape + (576,): the dequantized record of each slot (any shape, order,
    repeats); an invalid slot (< 0 or >= num_blocks * block_size) gives a zero row."""
    c, fmt = _kvl.v32_cache_pages(kv_cache)
    nb, bs, _ = c.shape
    flat = slots.to(torch.int64).reshape(-1)
    ok = _slots_valid(flat, nb * bs)
    s = torch.where(ok, flat, torch.zeros_like(flat))
    out = torch.zeros((flat.numel(), _kvl.V32_HEAD_DIM_QK), dtype=torch.bfloat16, device=c.device)
    if nb * bs and flat.numel():
        rec = c[s // bs, s % bs]
        rows = rec if fmt == "auto" else v32_dequantize_records(rec)
        out = torch.where(ok[:, None], rows, out)
    return out.reshape(tuple(slots.shape) + (_kvl.V32_HEAD_DIM_QK,))


def ref_v32_sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                       topk_length: Optional[torch.Tensor], sm_scale: float,
                       compute_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype = torch.bfloat16,
                       chunk: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over rows: q [T, H, 576], kv [N, 576], indices [T, K] rows of kv.

    valid(t, j) = 0 <= indices[t, j] < N and (topk_length is None or j < topk_length[t]);
    s = sm_scale * <q[t, h], kv[row]> over the 576 dims; out = softmax(s) @ kv[row, :512];
    lse = logsumexp(s) (natural log). No valid key: out 0, lse -inf. Repeats count each time.
    Returns out [T, H, 512] in out_dtype, lse float32 (or compute_dtype if float64) [T, H].
    Computed in compute_dtype, ``chunk`` tokens at a time (bounded memory)."""
    T, H = q.shape[0], q.shape[1]
    K = indices.shape[1]
    N = kv.shape[0]
    dv = _kvl.V32_HEAD_DIM_V
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros((T, H, dv), dtype=out_dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=lse_dtype, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    kvc = kv.to(compute_dtype)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        idx = indices[t0:t1].to(torch.int64)
        ok = (idx >= 0) & (idx < N)
        if topk_length is not None:
            ok &= torch.arange(K, device=idx.device)[None, :] < topk_length[t0:t1].to(torch.int64)[:, None]
        if K == 0 or N == 0:
            continue
        rows = kvc[torch.where(ok, idx, torch.zeros_like(idx))]  # [t, K, 576]
        s = torch.einsum("thd,tkd->thk", q[t0:t1].to(compute_dtype), rows) * sm_scale
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [t, H]
        has = l > float("-inf")
        p = torch.exp(s - torch.where(has, l, torch.zeros_like(l))[..., None])
        p = torch.where(has[..., None], p, torch.zeros_like(p))
        o = torch.einsum("thk,tkd->thd", p, rows[..., :dv])
        out[t0:t1] = o.to(out_dtype)
        lse[t0:t1] = l.to(lse_dtype)
    return out, lse


def ref_v32_sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                              topk_length: Optional[torch.Tensor], sm_scale: float,
                              compute_dtype: torch.dtype = torch.float32,
                              out_dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over the paged cache: indices [T, K] are slots (block * block_size + pos);
    a slot outside [0, num_blocks * block_size) is masked. The keys are the records
    dequantized to bf16 (ref_v32_kv_gather), then ref_v32_sparse_mla over them."""
    T, K = indices.shape
    c, _ = _kvl.v32_cache_pages(kv_cache)
    cap = c.shape[0] * c.shape[1]
    rows = ref_v32_kv_gather(kv_cache, indices.reshape(-1))  # [T*K, 576]
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < cap)
    local = torch.arange(T * K, device=indices.device, dtype=torch.int64).reshape(T, K)
    local = torch.where(ok, local, torch.full_like(local, -1))
    return ref_v32_sparse_mla(q, rows, local, topk_length, sm_scale, compute_dtype, out_dtype)
