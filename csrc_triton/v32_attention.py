"""DeepSeek-V3.2 / GLM-5 sparse MLA: d_qk = 576 (512 latent + 64 RoPE), d_v = 512, no sink
(ops ``v32_sparse_mla_decode``, ``v32_sparse_mla_prefill`` and their out= forms).

One kernel, two key sources (constexpr FP8):
  FP8   the paged 656-byte ``fp8_ds_mla`` records, read by slot (layout: dsv4_ops.layout):
        the 512 E4M3 codes decoded in registers (portable: fp8e4b15 reinterpretation of
        uint8 loads; no fp8 pointer), times the fp32 scale of their 128-dim tile, and the 64
        RoPE dims as raw bf16 words.
  bf16  rows of 576 (a prefill workspace, or the ``auto`` cache), read by row / slot.
Row r of the source sits at ``(r // block_size) * stride_blk + (r % block_size) * stride_rec``
(bytes for FP8, elements for bf16; a flat workspace passes block_size = its rows, so the
block term is 0); r is attended when ``0 <= r < capacity`` and its position j <
clamp(topk_length[t], 0, K) (K without topk_length). Repeats count each time.

Per key block of BLOCK_N keys, the 576 dims go as 9 chunks of 64 (chunks 0..7 NoPE, chunk c
with the scale of tile c // 2; chunk 8 RoPE): scores are the sum of 9 dots [BLOCK_H, 64] x
[64, BLOCK_N]; 8 accumulators [BLOCK_H, 64] take p @ chunk c (c < 8; v is the latent only).
Each key is decoded once for the BLOCK_H heads of a program's group.

Grid (T * S * G,): program pid runs head group g = pid % G of token t = pid // (S * G) over
the key blocks of split s = (pid // G) % S: nb = cdiv(k_len, BLOCK_N) blocks, split s takes
blocks [floor(s * nb / S), floor((s + 1) * nb / S)).
Epilogues (constexpr DIRECT): S == 1 writes out bf16 [T, H, 512] (row strides stride_o_t,
stride_o_h) and lse fp32 [T, H]; otherwise the partials o_part fp32 [T, H, S, 512] and lse_part
fp32 [T, H, S] (contiguous) of csrc_triton.decode.tiles's layout, merged by csrc_triton.decode.merge
(no sink). LSE is the natural log; no valid key: out 0, lse -inf.
Scores use q's dtype for both dots (bf16; fp16 under the interpreter, whose bf16 tl.dot is
wrong) with fp32 accumulation.
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from .codec import e4m3_to_f32

_C = tl.constexpr(64)  # dims of a chunk
_NOPE = tl.constexpr(_L.V32_NOPE_DIM)  # 512
_SCALE_OFF = tl.constexpr(_L.V32_SCALE_OFFSET)  # 512
_ROPE_OFF = tl.constexpr(_L.V32_ROPE_OFFSET)  # 528
HEAD_DIM_V = _L.V32_HEAD_DIM_V

assert _L.V32_TILE == 2 * 64 and _L.V32_ROPE_DIM == 64 and _L.V32_NOPE_DIM == 8 * 64


@triton.jit
def _key_chunk(kv_ptr, o_rec, m_n, C: tl.constexpr, FP8: tl.constexpr, NATIVE: tl.constexpr,
               DTYPE: tl.constexpr):
    """Dims [64*C, 64*C + 64) of BLOCK_N keys (record offsets o_rec [BLOCK_N]; rows with m_n
    false load nothing and give 0): [BLOCK_N, 64] in DTYPE."""
    o_e = tl.arange(0, _C)  # [64]
    if FP8:
        if C < 8:
            b_codes = tl.load(kv_ptr + (o_rec + C * _C)[:, None] + o_e[None, :], mask=m_n[:, None], other=0)
            p_sc = (kv_ptr + o_rec + (_SCALE_OFF + 4 * (C // 2))).to(tl.pointer_type(tl.float32), bitcast=True)
            b_sc = tl.load(p_sc, mask=m_n, other=0.0)  # [BLOCK_N] fp32
            b_k = (e4m3_to_f32(b_codes, NATIVE) * b_sc[:, None]).to(DTYPE)
        else:
            p_pe = (kv_ptr + o_rec + _ROPE_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
            b_bits = tl.load(p_pe[:, None] + o_e[None, :], mask=m_n[:, None], other=0)
            b_k = b_bits.to(tl.bfloat16, bitcast=True).to(DTYPE)
    else:
        b_k = tl.load(kv_ptr + (o_rec + C * _C)[:, None] + o_e[None, :], mask=m_n[:, None], other=0.0).to(DTYPE)
    return b_k


@triton.jit
def _q_chunk(p_q, m_h, C: tl.constexpr):
    """[BLOCK_H, 64] dims [64*C, 64*C + 64) of the group's q rows (p_q: [BLOCK_H] row pointers)."""
    o_e = tl.arange(0, _C)
    return tl.load(p_q[:, None] + C * _C + o_e[None, :], mask=m_h[:, None], other=0.0)


@triton.jit
def _store_chunk(p_o, b_acc, b_scale, m_h, C: tl.constexpr):
    """Rows p_o ([BLOCK_H] pointers) dims [64*C, 64*C + 64) = b_acc * b_scale, in p_o's dtype."""
    o_e = tl.arange(0, _C)
    b_o = b_acc * b_scale[:, None]
    tl.store(p_o[:, None] + C * _C + o_e[None, :], b_o.to(p_o.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def _v32_sparse_mla_kernel(
    q_ptr,  # bf16 [T, H, 576], dims contiguous
    kv_ptr,  # FP8: uint8 records; else bf16 rows of 576
    idx_ptr,  # int32 [T, K] rows / slots, row stride stride_idx_t, entries contiguous
    len_ptr,  # int32 [>= T] or None
    o_ptr, lse_ptr,  # DIRECT: bf16 [T, H, 512] / fp32 [T, H]; else fp32 [T, H, S, 512] / [T, H, S]
    H, K, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_idx_t, stride_o_t, stride_o_h,
    block_size, stride_blk, stride_rec, capacity,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, NATIVE: tl.constexpr,
    HAS_LEN: tl.constexpr, DIRECT: tl.constexpr,
):
    """Grid (T * S * G,): one (token, split, head group) a program; see the module doc."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    p_qrow = q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h  # [BLOCK_H]
    b_q0 = _q_chunk(p_qrow, m_h, 0)  # [BLOCK_H, 64] each
    b_q1 = _q_chunk(p_qrow, m_h, 1)
    b_q2 = _q_chunk(p_qrow, m_h, 2)
    b_q3 = _q_chunk(p_qrow, m_h, 3)
    b_q4 = _q_chunk(p_qrow, m_h, 4)
    b_q5 = _q_chunk(p_qrow, m_h, 5)
    b_q6 = _q_chunk(p_qrow, m_h, 6)
    b_q7 = _q_chunk(p_qrow, m_h, 7)
    b_q8 = _q_chunk(p_qrow, m_h, 8)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    k_len = K
    if HAS_LEN:
        k_len = tl.minimum(tl.maximum(tl.load(len_ptr + pid_t), 0), K)
    nb = (k_len + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * nb) // S
    blk_hi = ((pid_s + 1) * nb) // S
    p_idx = idx_ptr + pid_t * stride_idx_t

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running denominator
    b_a0 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)  # unnormalised p @ v, dims 64c..64c+63
    b_a1 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a4 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a5 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a6 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a7 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    for blk in range(blk_lo, blk_hi):
        o_j = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        b_r = tl.load(p_idx + o_j, mask=o_j < k_len, other=-1).to(tl.int64)
        m_n = (b_r >= 0) & (b_r < capacity)
        b_r = tl.minimum(tl.maximum(b_r, 0), capacity - 1)  # rows with m_n false load nothing
        b_blk = b_r // block_size
        o_rec = b_blk * stride_blk + (b_r - b_blk * block_size) * stride_rec  # [BLOCK_N] int64

        b_k0 = _key_chunk(kv_ptr, o_rec, m_n, 0, FP8, NATIVE, DTYPE)  # [BLOCK_N, 64]
        b_s = tl.dot(b_q0, tl.trans(b_k0))  # [BLOCK_H, BLOCK_N] fp32
        b_k1 = _key_chunk(kv_ptr, o_rec, m_n, 1, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q1, tl.trans(b_k1), b_s)
        b_k2 = _key_chunk(kv_ptr, o_rec, m_n, 2, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
        b_k3 = _key_chunk(kv_ptr, o_rec, m_n, 3, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q3, tl.trans(b_k3), b_s)
        b_k4 = _key_chunk(kv_ptr, o_rec, m_n, 4, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q4, tl.trans(b_k4), b_s)
        b_k5 = _key_chunk(kv_ptr, o_rec, m_n, 5, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q5, tl.trans(b_k5), b_s)
        b_k6 = _key_chunk(kv_ptr, o_rec, m_n, 6, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q6, tl.trans(b_k6), b_s)
        b_k7 = _key_chunk(kv_ptr, o_rec, m_n, 7, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q7, tl.trans(b_k7), b_s)
        b_k8 = _key_chunk(kv_ptr, o_rec, m_n, 8, FP8, NATIVE, DTYPE)  # RoPE: scores only
        b_s = tl.dot(b_q8, tl.trans(b_k8), b_s)

        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)[:, None]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]
        b_l = b_l * tl.reshape(b_alpha, [BLOCK_H]) + tl.sum(b_p, 1)
        b_p = b_p.to(DTYPE)
        b_a0 = tl.dot(b_p, b_k0, b_a0 * b_alpha)
        b_a1 = tl.dot(b_p, b_k1, b_a1 * b_alpha)
        b_a2 = tl.dot(b_p, b_k2, b_a2 * b_alpha)
        b_a3 = tl.dot(b_p, b_k3, b_a3 * b_alpha)
        b_a4 = tl.dot(b_p, b_k4, b_a4 * b_alpha)
        b_a5 = tl.dot(b_p, b_k5, b_a5 * b_alpha)
        b_a6 = tl.dot(b_p, b_k6, b_a6 * b_alpha)
        b_a7 = tl.dot(b_p, b_k7, b_a7 * b_alpha)
        b_m = b_m_new

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * 0.6931471805599453, float("-inf"))
    b_scale = 1.0 / b_l_safe  # rows without a key have acc 0: out 0
    if DIRECT:
        p_o = o_ptr + pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H] rows
        tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)
    else:
        row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
        p_o = o_ptr + row * 512
        tl.store(lse_ptr + row, b_lse, mask=m_h)
    _store_chunk(p_o, b_a0, b_scale, m_h, 0)
    _store_chunk(p_o, b_a1, b_scale, m_h, 1)
    _store_chunk(p_o, b_a2, b_scale, m_h, 2)
    _store_chunk(p_o, b_a3, b_scale, m_h, 3)
    _store_chunk(p_o, b_a4, b_scale, m_h, 4)
    _store_chunk(p_o, b_a5, b_scale, m_h, 5)
    _store_chunk(p_o, b_a6, b_scale, m_h, 6)
    _store_chunk(p_o, b_a7, b_scale, m_h, 7)


@triton.jit
def _rec_ptrs(kv_ptr, o_rec, FP8: tl.constexpr, ALIGN: tl.constexpr):
    """[BLOCK_N] pointers to the keys' records / rows; ALIGN: declared 16-byte aligned (the
    launcher checked the base and both strides), so the code and row loads become vectors."""
    p_rec = kv_ptr + o_rec
    if ALIGN:
        if FP8:
            p_rec = tl.multiple_of(p_rec, 16)
        else:
            p_rec = tl.multiple_of(p_rec, 8)  # bf16 elements: 16 bytes
    return p_rec


@triton.jit
def _key_tile(p_rec, m_n, C: tl.constexpr, FP8: tl.constexpr, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """NoPE dims [128*C, 128*C + 128) of BLOCK_N keys (one fp32 scale a row: tile C):
    [BLOCK_N, 128] in DTYPE; rows with m_n false give 0."""
    o_e = tl.arange(0, 128)
    if FP8:
        b_codes = tl.load(p_rec[:, None] + C * 128 + o_e[None, :], mask=m_n[:, None], other=0)
        p_sc = (p_rec + (_SCALE_OFF + 4 * C)).to(tl.pointer_type(tl.float32), bitcast=True)
        b_sc = tl.load(p_sc, mask=m_n, other=0.0)  # [BLOCK_N] fp32
        b_k = (e4m3_to_f32(b_codes, NATIVE) * b_sc[:, None]).to(DTYPE)
    else:
        b_k = tl.load(p_rec[:, None] + C * 128 + o_e[None, :], mask=m_n[:, None], other=0.0).to(DTYPE)
    return b_k


@triton.jit
def _key_rope(p_rec, m_n, FP8: tl.constexpr, DTYPE: tl.constexpr):
    """The 64 RoPE dims of BLOCK_N keys: [BLOCK_N, 64] in DTYPE."""
    o_e = tl.arange(0, 64)
    if FP8:
        p_pe = (p_rec + _ROPE_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
        b_bits = tl.load(p_pe[:, None] + o_e[None, :], mask=m_n[:, None], other=0)
        b_k = b_bits.to(tl.bfloat16, bitcast=True).to(DTYPE)
    else:
        b_k = tl.load(p_rec[:, None] + 512 + o_e[None, :], mask=m_n[:, None], other=0.0).to(DTYPE)
    return b_k


@triton.jit
def _q_tile(p_q, m_h, C: tl.constexpr):
    """[BLOCK_H, 128] dims [128*C, 128*C + 128) of the group's q rows."""
    o_e = tl.arange(0, 128)
    return tl.load(p_q[:, None] + C * 128 + o_e[None, :], mask=m_h[:, None], other=0.0)


@triton.jit
def _store_tile(p_o, b_acc, b_scale, m_h, C: tl.constexpr):
    o_e = tl.arange(0, 128)
    b_o = b_acc * b_scale[:, None]
    tl.store(p_o[:, None] + C * 128 + o_e[None, :], b_o.to(p_o.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def _v32_sparse_mla_w128_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, o_ptr, lse_ptr,
    H, K, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_idx_t, stride_o_t, stride_o_h,
    block_size, stride_blk, stride_rec, capacity,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, NATIVE: tl.constexpr,
    HAS_LEN: tl.constexpr, DIRECT: tl.constexpr, ALIGN: tl.constexpr,
):
    """_v32_sparse_mla_kernel's contract and grid, with the latent as 4 tiles of 128 dims (the
    fp8_ds_mla scale tiles: one fp32 scale a row and tile) plus the 64 RoPE dims: per key
    block 5 dots for the scores (4 of K = 128, 1 of K = 64) and 4 accumulators [BLOCK_H, 128],
    instead of 9 and 8 of 64 (fewer layout conversions; larger tiles). ALIGN: record pointers
    declared 16-byte aligned (vector loads; without it the sm_80 build spills)."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    p_qrow = q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h  # [BLOCK_H]
    b_q0 = _q_tile(p_qrow, m_h, 0)  # [BLOCK_H, 128] each
    b_q1 = _q_tile(p_qrow, m_h, 1)
    b_q2 = _q_tile(p_qrow, m_h, 2)
    b_q3 = _q_tile(p_qrow, m_h, 3)
    b_qr = _q_chunk(p_qrow, m_h, 8)  # [BLOCK_H, 64]: dims 512..575
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    k_len = K
    if HAS_LEN:
        k_len = tl.minimum(tl.maximum(tl.load(len_ptr + pid_t), 0), K)
    nb = (k_len + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * nb) // S
    blk_hi = ((pid_s + 1) * nb) // S
    p_idx = idx_ptr + pid_t * stride_idx_t

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_a0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)  # unnormalised p @ v, dims 128c..128c+127
    b_a1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    for blk in range(blk_lo, blk_hi):
        o_j = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        b_r = tl.load(p_idx + o_j, mask=o_j < k_len, other=-1).to(tl.int64)
        m_n = (b_r >= 0) & (b_r < capacity)
        b_r = tl.minimum(tl.maximum(b_r, 0), capacity - 1)  # rows with m_n false load nothing
        b_blk = b_r // block_size
        o_rec = b_blk * stride_blk + (b_r - b_blk * block_size) * stride_rec  # [BLOCK_N] int64

        p_rec = _rec_ptrs(kv_ptr, o_rec, FP8, ALIGN)  # [BLOCK_N]
        b_k0 = _key_tile(p_rec, m_n, 0, FP8, NATIVE, DTYPE)  # [BLOCK_N, 128]
        b_s = tl.dot(b_q0, tl.trans(b_k0))  # [BLOCK_H, BLOCK_N] fp32
        b_k1 = _key_tile(p_rec, m_n, 1, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q1, tl.trans(b_k1), b_s)
        b_k2 = _key_tile(p_rec, m_n, 2, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
        b_k3 = _key_tile(p_rec, m_n, 3, FP8, NATIVE, DTYPE)
        b_s = tl.dot(b_q3, tl.trans(b_k3), b_s)
        b_kr = _key_rope(p_rec, m_n, FP8, DTYPE)  # [BLOCK_N, 64]: scores only
        b_s = tl.dot(b_qr, tl.trans(b_kr), b_s)

        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)[:, None]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]
        b_l = b_l * tl.reshape(b_alpha, [BLOCK_H]) + tl.sum(b_p, 1)
        b_p = b_p.to(DTYPE)
        b_a0 = tl.dot(b_p, b_k0, b_a0 * b_alpha)
        b_a1 = tl.dot(b_p, b_k1, b_a1 * b_alpha)
        b_a2 = tl.dot(b_p, b_k2, b_a2 * b_alpha)
        b_a3 = tl.dot(b_p, b_k3, b_a3 * b_alpha)
        b_m = b_m_new

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * 0.6931471805599453, float("-inf"))
    b_scale = 1.0 / b_l_safe  # rows without a key have acc 0: out 0
    if DIRECT:
        p_o = o_ptr + pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H] rows
        tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)
    else:
        row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
        p_o = o_ptr + row * 512
        tl.store(lse_ptr + row, b_lse, mask=m_h)
    _store_tile(p_o, b_a0, b_scale, m_h, 0)
    _store_tile(p_o, b_a1, b_scale, m_h, 1)
    _store_tile(p_o, b_a2, b_scale, m_h, 2)
    _store_tile(p_o, b_a3, b_scale, m_h, 3)


# Launch configs per head-group size, as plain data (both variants; the native one differs
# only in the E4M3 decode instruction). Checked by the AOT table (dsv4_ops.v32.aot_specs:
# no spills on sm_80/86, within sm_86's 99 KB).
V32_ATTN_CONFIG = {
    16: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    32: {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2},
}
# The w128 form (_v32_sparse_mla_w128_kernel), ALIGN only (unaligned inputs run the w64 form):
# sm_80 AOT, ALIGN: 16 x 32 x 8 warps 176-178 regs, 0 spills, 63 KB; 32 x 32 x 8 warps 254
# regs, 0 spills, 81 KB (32 x 16 spills 68 B on sm_86; 16 x 32 x 4 warps 255 regs).
V32_W128_CONFIG = {
    16: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    32: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
}
FORMS = ("w64", "w128", "f16")
MAX_SPLITS = 64  # what csrc_triton.decode.merge / dsv4_ops.attention.merge_splits accept


def block_h_for(H: int) -> int:
    """Rows of a head group: 16 for H <= 16 (TP8: one group), else 32."""
    return 16 if H <= 16 else 32


# ---- the f16 form: E4M3 codes as fp16 operands, the scales applied to the score / P tiles ----


@triton.jit
def _codes_f16(b_codes, NATIVE: tl.constexpr, BITS: tl.constexpr):
    """uint8 E4M3 codes -> fp16, exact: value * 2**-8 (portable: the code's bits moved into
    fp16's, bias 7 vs 15; subnormals too) or the value itself (NATIVE, cvt from fp8e4nv).
    Portable on the GPU is the fp8e4b15 -> fp16 cast (a byte shuffle, no cvt); BITS spells
    the same bit move out (the interpreter's fp8e4b15 -> fp16 cast flushes subnormals)."""
    if NATIVE:
        b_val = b_codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif BITS:
        b_c = b_codes.to(tl.uint16)
        b_val = (((b_c & 0x7F) << 7) | ((b_c & 0x80) << 8)).to(tl.float16, bitcast=True)
    else:
        b_val = b_codes.to(tl.float8e4b15, bitcast=True).to(tl.float16)
    return b_val


@triton.jit
def _codes_unscale(NATIVE: tl.constexpr):
    """What undoes _codes_f16's factor: 2**8 (portable) or 1 (NATIVE)."""
    if NATIVE:
        f = 1.0
    else:
        f = 256.0
    return f


@triton.jit
def _pow2_floor(b_x):
    """(2**floor(log2 x), 2**-floor(log2 x)) of x >= 0 fp32, by exponent bits: exact powers of
    two (0 and fp32 subnormals give (0, 2**127): a product with the inverse stays finite)."""
    b_e = b_x.to(tl.uint32, bitcast=True) & 0x7F800000
    b_inv = (tl.maximum(254 - (b_e >> 23).to(tl.int32), 1).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    return b_e.to(tl.float32, bitcast=True), b_inv


@triton.jit
def _q_prescale(b_q0, b_q1, b_q2, b_q3):
    """Per row a power of two f with max |q_nope row| * f in [2**14, 2**15) (clamped to the fp32
    normal range): the row times f is exact in fp16 (bf16's 8 mantissa bits fit; values under
    2**-28 of the row max round into fp16 subnormals). Returns (f, 1 / f), [BLOCK_H] fp32."""
    b_am = tl.maximum(tl.maximum(tl.max(tl.abs(b_q0.to(tl.float32)), 1), tl.max(tl.abs(b_q1.to(tl.float32)), 1)),
                      tl.maximum(tl.max(tl.abs(b_q2.to(tl.float32)), 1), tl.max(tl.abs(b_q3.to(tl.float32)), 1)))
    b_e = (b_am.to(tl.uint32, bitcast=True) >> 23).to(tl.int32)  # biased exponent of the row max
    b_fe = tl.minimum(tl.maximum(268 - b_e, 1), 253)  # f = 2**(141 - e): the max lands in [2**14, 2**15)
    b_f = (b_fe.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    b_inv = ((254 - b_fe).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    return b_f, b_inv


@triton.jit
def _pv_group(b_a, b_p, b_sc, b_c16, b_alpha, UNSCALE):
    """acc * alpha + sum_n p[h, n] * scale[n] * value(code[n, :]) for one 128-dim scale group:
    the weights w = p * scale (fp32) divided by a per-row power of two m <= max_n w (so the
    row's largest weight lands in [1, 2): fp16 keeps 11 bits, what the row drops is < 2**-24
    of its largest term), one fp16 dot with the fp16 codes, times m (and UNSCALE, the codes'
    2**8) into the fp32 accumulator."""
    b_w = b_p * b_sc[None, :]  # [BLOCK_H, BLOCK_N] fp32
    b_m, b_minv = _pow2_floor(tl.max(b_w, 1))
    b_pw = (b_w * b_minv[:, None]).to(tl.float16)
    return b_a * b_alpha + tl.dot(b_pw, b_c16) * (b_m * UNSCALE)[:, None]


@triton.jit
def _load_idx_block(p_idx, blk, k_len, capacity, BLOCK_N: tl.constexpr):
    """(valid mask, clamped int64 rows) of key block blk: rows past k_len, < 0 or >= capacity are
    invalid (and clamped to a loadable row)."""
    o_j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    b_r = tl.load(p_idx + o_j, mask=o_j < k_len, other=-1).to(tl.int64)
    m_n = (b_r >= 0) & (b_r < capacity)
    return m_n, tl.minimum(tl.maximum(b_r, 0), capacity - 1)


@triton.jit
def _v32_sparse_mla_f16_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, o_ptr, lse_ptr,
    H, K, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_idx_t, stride_o_t, stride_o_h,
    block_size, stride_blk, stride_rec, capacity,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
    HAS_LEN: tl.constexpr, DIRECT: tl.constexpr, ALIGN: tl.constexpr, BITS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """_v32_sparse_mla_kernel's contract and grid over fp8_ds_mla records only, with the E4M3
    codes as fp16 dot operands (no per-code scale multiply, no cvt to fp32 and back):

    - scores: per 128-dim scale group g one fp16 dot q16_g . code16_g into its own fp32 tile
      (4 independent chains instead of one serial one), summed as sum_g s_g * scale_g[key]
      after the dots, times the row's q prescale (q16 = q * f exactly, f a power of two per
      row: _q_prescale), plus the RoPE dot (bf16 q . bf16 k_pe, unscaled).
    - P.V: per group (p * scale_g) / m_row in fp16 dotted with the fp16 codes, times m_row,
      into the group's fp32 accumulator (_pv_group).
    PREFETCH: the next block's slots are loaded one iteration ahead (loop-carried)."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)
    UNSCALE = _codes_unscale(NATIVE)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    p_qrow = q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h  # [BLOCK_H]
    b_q0 = _q_tile(p_qrow, m_h, 0)  # [BLOCK_H, 128] each, q's dtype
    b_q1 = _q_tile(p_qrow, m_h, 1)
    b_q2 = _q_tile(p_qrow, m_h, 2)
    b_q3 = _q_tile(p_qrow, m_h, 3)
    b_qr = _q_chunk(p_qrow, m_h, 8)  # [BLOCK_H, 64]: dims 512..575
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    b_f, b_finv = _q_prescale(b_q0, b_q1, b_q2, b_q3)
    b_q0 = (b_q0.to(tl.float32) * b_f[:, None]).to(tl.float16)
    b_q1 = (b_q1.to(tl.float32) * b_f[:, None]).to(tl.float16)
    b_q2 = (b_q2.to(tl.float32) * b_f[:, None]).to(tl.float16)
    b_q3 = (b_q3.to(tl.float32) * b_f[:, None]).to(tl.float16)

    k_len = K
    if HAS_LEN:
        k_len = tl.minimum(tl.maximum(tl.load(len_ptr + pid_t), 0), K)
    nb = (k_len + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * nb) // S
    blk_hi = ((pid_s + 1) * nb) // S
    p_idx = idx_ptr + pid_t * stride_idx_t

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_nope_scale = b_finv * (qk_scale * UNSCALE)  # [BLOCK_H]: undoes q's prescale and the codes' 2**-8
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_a0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    o_e = tl.arange(0, 128)
    o_r = tl.arange(0, 64)
    if PREFETCH:
        n_m, n_r = _load_idx_block(p_idx, blk_lo, k_len, capacity, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        if PREFETCH:
            m_n, b_r = n_m, n_r
            n_m, n_r = _load_idx_block(p_idx, blk + 1, k_len, capacity, BLOCK_N)
        else:
            m_n, b_r = _load_idx_block(p_idx, blk, k_len, capacity, BLOCK_N)
        b_blk = b_r // block_size
        o_rec = b_blk * stride_blk + (b_r - b_blk * block_size) * stride_rec  # [BLOCK_N] int64
        p_rec = _rec_ptrs(kv_ptr, o_rec, True, ALIGN)  # [BLOCK_N]
        m_2 = m_n[:, None]
        p_sc = (p_rec + _SCALE_OFF).to(tl.pointer_type(tl.float32), bitcast=True)
        b_sc0 = tl.load(p_sc, mask=m_n, other=0.0)  # [BLOCK_N] fp32 each
        b_sc1 = tl.load(p_sc + 1, mask=m_n, other=0.0)
        b_sc2 = tl.load(p_sc + 2, mask=m_n, other=0.0)
        b_sc3 = tl.load(p_sc + 3, mask=m_n, other=0.0)
        b_c0 = _codes_f16(tl.load(p_rec[:, None] + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        b_c1 = _codes_f16(tl.load(p_rec[:, None] + 128 + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        b_c2 = _codes_f16(tl.load(p_rec[:, None] + 256 + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        b_c3 = _codes_f16(tl.load(p_rec[:, None] + 384 + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        p_pe = (p_rec + _ROPE_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
        b_kr = tl.load(p_pe[:, None] + o_r[None, :], mask=m_2, other=0).to(tl.bfloat16, bitcast=True).to(DTYPE)

        b_s0 = tl.dot(b_q0, tl.trans(b_c0))  # [BLOCK_H, BLOCK_N] fp32, 4 independent chains
        b_s1 = tl.dot(b_q1, tl.trans(b_c1))
        b_s2 = tl.dot(b_q2, tl.trans(b_c2))
        b_s3 = tl.dot(b_q3, tl.trans(b_c3))
        b_sr = tl.dot(b_qr, tl.trans(b_kr))
        b_s = (b_s0 * b_sc0[None, :] + b_s1 * b_sc1[None, :] + b_s2 * b_sc2[None, :] + b_s3 * b_sc3[None, :])
        b_s = b_s * b_nope_scale[:, None] + b_sr * qk_scale

        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)[:, None]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]
        b_l = b_l * tl.reshape(b_alpha, [BLOCK_H]) + tl.sum(b_p, 1)
        b_a0 = _pv_group(b_a0, b_p, b_sc0, b_c0, b_alpha, UNSCALE)
        b_a1 = _pv_group(b_a1, b_p, b_sc1, b_c1, b_alpha, UNSCALE)
        b_a2 = _pv_group(b_a2, b_p, b_sc2, b_c2, b_alpha, UNSCALE)
        b_a3 = _pv_group(b_a3, b_p, b_sc3, b_c3, b_alpha, UNSCALE)
        b_m = b_m_new

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * 0.6931471805599453, float("-inf"))
    b_scale = 1.0 / b_l_safe  # rows without a key have acc 0: out 0
    if DIRECT:
        p_o = o_ptr + pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H] rows
        tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)
    else:
        row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
        p_o = o_ptr + row * 512
        tl.store(lse_ptr + row, b_lse, mask=m_h)
    _store_tile(p_o, b_a0, b_scale, m_h, 0)
    _store_tile(p_o, b_a1, b_scale, m_h, 1)
    _store_tile(p_o, b_a2, b_scale, m_h, 2)
    _store_tile(p_o, b_a3, b_scale, m_h, 3)


@triton.jit
def _q_tile_t(p_q, m_h, C: tl.constexpr):
    """[128, BLOCK_H]: q's dims [128*C, 128*C + 128) of the group's rows, transposed."""
    o_e = tl.arange(0, 128)
    return tl.load(p_q[None, :] + C * 128 + o_e[:, None], mask=m_h[None, :], other=0.0)


@triton.jit
def _pv_group_t(b_at, b_pt, b_sc, b_c16, b_alpha, UNSCALE):
    """_pv_group transposed: acc^T [128, BLOCK_H] * alpha + (codes^T @ (p^T * scale / m)) * m,
    p^T [BLOCK_N, BLOCK_H], m per head (column) a power of two <= the column's largest weight."""
    b_w = b_pt * b_sc[:, None]  # [BLOCK_N, BLOCK_H] fp32
    b_m, b_minv = _pow2_floor(tl.max(b_w, 0))
    b_pw = (b_w * b_minv[None, :]).to(tl.float16)
    return b_at * b_alpha + tl.dot(tl.trans(b_c16), b_pw) * (b_m * UNSCALE)[None, :]


@triton.jit
def _store_tile_t(p_o, b_at, b_scale, m_h, C: tl.constexpr):
    o_e = tl.arange(0, 128)
    b_o = b_at * b_scale[None, :]
    tl.store(p_o[None, :] + C * 128 + o_e[:, None], b_o.to(p_o.dtype.element_ty), mask=m_h[None, :])


@triton.jit
def _v32_sparse_mla_f16t_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, o_ptr, lse_ptr,
    H, K, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_idx_t, stride_o_t, stride_o_h,
    block_size, stride_blk, stride_rec, capacity,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
    HAS_LEN: tl.constexpr, DIRECT: tl.constexpr, ALIGN: tl.constexpr, BITS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """_v32_sparse_mla_f16_kernel (same arguments, contract and arithmetic) with every tile
    transposed: keys are the M of the score dot (S^T = codes @ q16^T, [BLOCK_N, BLOCK_H]) and
    the latent dims the M of P.V (O^T = codes^T @ P^T, [128, BLOCK_H] a group). q^T is then the
    B operand, split between the warps along N, instead of an A operand that every warp of an
    M = 16 dot holds whole (~128 registers a thread at 16 heads)."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)
    UNSCALE = _codes_unscale(NATIVE)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    p_qrow = q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h  # [BLOCK_H]
    b_q0 = _q_tile(p_qrow, m_h, 0)  # [BLOCK_H, 128]: for the prescale only
    b_q1 = _q_tile(p_qrow, m_h, 1)
    b_q2 = _q_tile(p_qrow, m_h, 2)
    b_q3 = _q_tile(p_qrow, m_h, 3)
    b_f, b_finv = _q_prescale(b_q0, b_q1, b_q2, b_q3)
    b_qt0 = (_q_tile_t(p_qrow, m_h, 0).to(tl.float32) * b_f[None, :]).to(tl.float16)  # [128, BLOCK_H]
    b_qt1 = (_q_tile_t(p_qrow, m_h, 1).to(tl.float32) * b_f[None, :]).to(tl.float16)
    b_qt2 = (_q_tile_t(p_qrow, m_h, 2).to(tl.float32) * b_f[None, :]).to(tl.float16)
    b_qt3 = (_q_tile_t(p_qrow, m_h, 3).to(tl.float32) * b_f[None, :]).to(tl.float16)
    o_r = tl.arange(0, 64)
    b_qrt = tl.load(p_qrow[None, :] + 512 + o_r[:, None], mask=m_h[None, :], other=0.0)  # [64, BLOCK_H]
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    k_len = K
    if HAS_LEN:
        k_len = tl.minimum(tl.maximum(tl.load(len_ptr + pid_t), 0), K)
    nb = (k_len + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * nb) // S
    blk_hi = ((pid_s + 1) * nb) // S
    p_idx = idx_ptr + pid_t * stride_idx_t

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_nope_scale = b_finv * (qk_scale * UNSCALE)  # [BLOCK_H]
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_a0 = tl.zeros([128, BLOCK_H], dtype=tl.float32)  # acc^T, dims 128c..128c+127
    b_a1 = tl.zeros([128, BLOCK_H], dtype=tl.float32)
    b_a2 = tl.zeros([128, BLOCK_H], dtype=tl.float32)
    b_a3 = tl.zeros([128, BLOCK_H], dtype=tl.float32)
    o_e = tl.arange(0, 128)
    if PREFETCH:
        n_m, n_r = _load_idx_block(p_idx, blk_lo, k_len, capacity, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        if PREFETCH:
            m_n, b_r = n_m, n_r
            n_m, n_r = _load_idx_block(p_idx, blk + 1, k_len, capacity, BLOCK_N)
        else:
            m_n, b_r = _load_idx_block(p_idx, blk, k_len, capacity, BLOCK_N)
        b_blk = b_r // block_size
        o_rec = b_blk * stride_blk + (b_r - b_blk * block_size) * stride_rec  # [BLOCK_N] int64
        p_rec = _rec_ptrs(kv_ptr, o_rec, True, ALIGN)  # [BLOCK_N]
        m_2 = m_n[:, None]
        p_sc = (p_rec + _SCALE_OFF).to(tl.pointer_type(tl.float32), bitcast=True)
        b_sc0 = tl.load(p_sc, mask=m_n, other=0.0)  # [BLOCK_N] fp32 each
        b_sc1 = tl.load(p_sc + 1, mask=m_n, other=0.0)
        b_sc2 = tl.load(p_sc + 2, mask=m_n, other=0.0)
        b_sc3 = tl.load(p_sc + 3, mask=m_n, other=0.0)
        b_c0 = _codes_f16(tl.load(p_rec[:, None] + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        b_c1 = _codes_f16(tl.load(p_rec[:, None] + 128 + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        b_c2 = _codes_f16(tl.load(p_rec[:, None] + 256 + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        b_c3 = _codes_f16(tl.load(p_rec[:, None] + 384 + o_e[None, :], mask=m_2, other=0), NATIVE, BITS)
        p_pe = (p_rec + _ROPE_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
        b_kr = tl.load(p_pe[:, None] + o_r[None, :], mask=m_2, other=0).to(tl.bfloat16, bitcast=True).to(DTYPE)

        b_s0 = tl.dot(b_c0, b_qt0)  # [BLOCK_N, BLOCK_H] fp32, 4 independent chains
        b_s1 = tl.dot(b_c1, b_qt1)
        b_s2 = tl.dot(b_c2, b_qt2)
        b_s3 = tl.dot(b_c3, b_qt3)
        b_sr = tl.dot(b_kr, b_qrt)
        b_s = (b_s0 * b_sc0[:, None] + b_s1 * b_sc1[:, None] + b_s2 * b_sc2[:, None] + b_s3 * b_sc3[:, None])
        b_s = b_s * b_nope_scale[None, :] + b_sr * qk_scale

        b_s = tl.where(m_n[:, None], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 0))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)[None, :]
        b_p = tl.exp2(b_s - b_m_safe[None, :])  # [BLOCK_N, BLOCK_H]
        b_l = b_l * tl.reshape(b_alpha, [BLOCK_H]) + tl.sum(b_p, 0)
        b_a0 = _pv_group_t(b_a0, b_p, b_sc0, b_c0, b_alpha, UNSCALE)
        b_a1 = _pv_group_t(b_a1, b_p, b_sc1, b_c1, b_alpha, UNSCALE)
        b_a2 = _pv_group_t(b_a2, b_p, b_sc2, b_c2, b_alpha, UNSCALE)
        b_a3 = _pv_group_t(b_a3, b_p, b_sc3, b_c3, b_alpha, UNSCALE)
        b_m = b_m_new

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * 0.6931471805599453, float("-inf"))
    b_scale = 1.0 / b_l_safe  # rows without a key have acc 0: out 0
    if DIRECT:
        p_o = o_ptr + pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H] rows
        tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)
    else:
        row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
        p_o = o_ptr + row * 512
        tl.store(lse_ptr + row, b_lse, mask=m_h)
    _store_tile_t(p_o, b_a0, b_scale, m_h, 0)
    _store_tile_t(p_o, b_a1, b_scale, m_h, 1)
    _store_tile_t(p_o, b_a2, b_scale, m_h, 2)
    _store_tile_t(p_o, b_a3, b_scale, m_h, 3)


# The f16 form's configs: F16_CONFIG per head-group size is what the launcher dispatches;
# F16_CANDIDATES are reachable by form "f16:<name>" (benchmarks).
# PER_SM: programs an SM holds at once (registers: 4 warps x 249-255 regs = 2 of the 64K; 8 warps
# x 229-255 = 1; sm_80 AOT, triton 3.8), which num_splits_for sizes one wave with.
F16_CANDIDATES = {
    "h16n32w4": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PREFETCH": False, "PER_SM": 2},
    "h16n32w4x": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PREFETCH": True, "PER_SM": 2},
    "h16n32w8": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PREFETCH": False},
    "h32n32w8": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PREFETCH": False},
    "h16n16w4": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "PREFETCH": False, "PER_SM": 2},
    # the transposed kernel (_v32_sparse_mla_f16t_kernel: keys / dims as the M of the dots)
    "t16n32w4": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PREFETCH": False, "PER_SM": 2,
                 "KT": True},
    "t16n32w8": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PREFETCH": False, "KT": True},
    # benchmark-only: registers capped at 128 for 2 programs an SM at 8 warps (sm_80 AOT: 120 B
    # of spills, so never dispatched; launched through Triton's own path with maxnreg)
    "h16n32w8r128": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PREFETCH": False, "PER_SM": 2,
                     "MAXNREG": 128},
}
# Measured (benchmarks/results/v32_decode.md, H200): 16 heads x 32 keys x 4
# warps was the fastest f16 config at every shape from T = 16 (H 16 and 128) and within 6% of
# the best at T = 1; 8-warp configs (1 program an SM) 1.4-1.9x slower, the register-capped
# 8-warp one (2 an SM, spills) 1.05-1.12x, the transposed kernel 1.01-1.06x, 16-key blocks
# 1.4-1.5x, the slot prefetch 1.00-1.03x; 32-head groups 1.12-1.74x slower. So every head count
# runs 16-head groups (at H = 128: 8 groups).
F16_CONFIG = {16: F16_CANDIDATES["h16n32w4"], 32: F16_CANDIDATES["h16n32w4"]}
