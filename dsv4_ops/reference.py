"""Pure-PyTorch references: the contract every kernel is tested against.

Written for clarity, not speed; they run on any device and are the CPU implementations of
the ``dsv4_ampere`` ops.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
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

ATTN_PARTITION_N = 16  # key-block granularity of the split partition (csrc_triton.sparse_mla)


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
    """Sparse MLA with sink (DESIGN.md, "Attention semantics"), computed in float64.

    q [T, H, D]; kv [N, D]; indices int [T, K]; topk_length int [T] or None; sink float [H] or
    None. Returns out [T, H, D] in ``out_dtype`` (bf16, the op's dtype) and lse float32 [T, H].
    """
    T, H = q.shape[0], q.shape[1]
    valid = _ref_attn_valid(indices, topk_length, kv.shape[0])
    s, kv_g = _ref_attn_scores(q, kv, indices, valid, sm_scale, torch.float64)  # [T, H, K]
    sk = (torch.full((H,), float("-inf"), dtype=torch.float64, device=q.device) if sink is None
          else sink.to(torch.float64))
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
    sk = (torch.full((H,), float("-inf"), dtype=torch.float64, device=lse.device) if sink is None
          else sink.to(torch.float64))
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

from . import layout as _kvl  # noqa: E402


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
