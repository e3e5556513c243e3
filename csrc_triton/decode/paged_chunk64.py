"""DSv4 sparse-MLA decode read straight from the paged fp8 caches (op ``dsv4_decode_fused_out``).

The ``heads`` kernel (csrc_triton.decode.heads) attends over a bf16 workspace that a
gather kernel first writes (1,024 B a key written, then read back). This kernel fuses the
gather, the index build and the attention: each program reads the 584-byte ``fp8_ds_mla``
records of its keys by slot (layout: dsv4_ops.layout), decodes the 448 E4M3 NoPE bytes in
registers with the portable codec (uint8 loads, fp8e4b15 bit reinterpretation; no fp8
pointer), scales them by their UE8M0 bytes, takes the 64 RoPE dims as raw bf16 words, and
scores the resulting [BLOCK_N, 512] tile against all BLOCK_H heads of its group at once.

Key positions of token t: the top-k part j < k1 = clamp(topk_length[t], 0, K1) of the
compressed cache, then the window part j < k2 = clamp(swa_length[t], 0, K2) of the window
cache. A position is attended when its slot lies in [0, capacity) of its cache (the
dsv4_decode_gather op's index semantics, without the workspace); repeats count each time.
Partition: the top-k part forms nb1 = cdiv(k1, BLOCK_N) blocks, the window part
nb2 = cdiv(k2, BLOCK_N) more; split s of S takes blocks [floor(s*nb/S), floor((s+1)*nb/S))
of nb = nb1 + nb2 (a block never mixes the two caches).

Epilogues as in the heads kernel (constexpr DIRECT): S == 1 folds the sink and writes out
bf16 [T, H, 512] (row strides stride_o_t / stride_o_h) and lse fp32 [T, H]; otherwise the
partials o_part fp32 [T, H, S, 512] / lse_part fp32 [T, H, S] of csrc_triton.decode.tiles,
merged by csrc_triton.decode.merge. Scores take q's dtype for both dots (bf16; fp16 under the
interpreter, whose bf16 tl.dot is wrong) with fp32 accumulation.
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from ..codec import e4m3_to_f32
from ..kv_cache import ue8m0_to_f32

HEAD_DIM = _L.HEAD_DIM
_NOPE_DIM = tl.constexpr(_L.NOPE_DIM)
_QUANT_GROUP = tl.constexpr(_L.QUANT_GROUP)
_NUM_SCALES = tl.constexpr(_L.NUM_SCALES)
_GROUPS = tl.constexpr(_L.HEAD_DIM // _L.QUANT_GROUP)  # 8: 7 NoPE groups + the RoPE group
_DATA_BYTES = tl.constexpr(_L.DATA_BYTES)
_SCALE_BYTES = tl.constexpr(_L.SCALE_BYTES)

assert _L.ROPE_DIM == _L.QUANT_GROUP  # the RoPE dims fill exactly the 8th 64-dim group


@triton.jit
def _load_chunk(p_cache, o_data, o_scale, m_n, C: tl.constexpr):
    """The raw bytes of NoPE chunk C of BLOCK_N records: (codes uint8 [BLOCK_N, 64], UE8M0
    bytes uint8 [BLOCK_N]); invalid rows load nothing (0)."""
    o_e = tl.arange(0, _QUANT_GROUP)  # [64]
    b_codes = tl.load(p_cache + (o_data + C * _QUANT_GROUP)[:, None] + o_e[None, :], mask=m_n[:, None], other=0)
    b_sbyte = tl.load(p_cache + o_scale + C, mask=m_n, other=0)  # [BLOCK_N]
    return b_codes, b_sbyte


@triton.jit
def _decode_chunk(b_codes, b_sbyte, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """E4M3 codes [BLOCK_N, 64] times their UE8M0 scales [BLOCK_N], in DTYPE (exact: a
    power of two times an E4M3 value)."""
    return (e4m3_to_f32(b_codes, NATIVE) * ue8m0_to_f32(b_sbyte)[:, None]).to(DTYPE)


@triton.jit
def _nope_chunk(p_cache, o_data, o_scale, m_n, C: tl.constexpr, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """NoPE dims [64*C, 64*C + 64) of BLOCK_N records, decoded: [BLOCK_N, 64] in DTYPE."""
    b_codes, b_sbyte = _load_chunk(p_cache, o_data, o_scale, m_n, C)
    return _decode_chunk(b_codes, b_sbyte, NATIVE, DTYPE)


@triton.jit
def _rope_bits(p_cache, o_data, m_n):
    """The RoPE dims [448, 512) of BLOCK_N records as bf16 bit patterns, uint16 [BLOCK_N, 64]."""
    o_e = tl.arange(0, _QUANT_GROUP)  # [64]
    p_rope = (p_cache + o_data + _NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)
    return tl.load(p_rope[:, None] + o_e[None, :], mask=m_n[:, None], other=0)


@triton.jit
def _rope_chunk(p_cache, o_data, m_n, DTYPE: tl.constexpr):
    """RoPE dims [448, 512) of BLOCK_N records: the raw bf16 words, [BLOCK_N, 64] in DTYPE."""
    o_e = tl.arange(0, _QUANT_GROUP)  # [64]
    p_rope = (p_cache + o_data + _NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)
    b_rope = tl.load(p_rope[:, None] + o_e[None, :], mask=m_n[:, None], other=0)
    return b_rope.to(tl.bfloat16, bitcast=True).to(DTYPE)


@triton.jit
def _q_chunk(p_q, m_h, C: tl.constexpr):
    """[BLOCK_H, 64] dims [64*C, 64*C + 64) of the group's q rows (p_q: [BLOCK_H] row pointers)."""
    o_e = tl.arange(0, _QUANT_GROUP)
    return tl.load(p_q[:, None] + C * _QUANT_GROUP + o_e[None, :], mask=m_h[:, None], other=0.0)


@triton.jit
def _store_chunk(p_o, b_acc, b_scale, m_h, C: tl.constexpr):
    """Rows p_o ([BLOCK_H] pointers) dims [64*C, 64*C + 64) = b_acc * b_scale, in p_o's dtype."""
    o_e = tl.arange(0, _QUANT_GROUP)
    b_o = b_acc * b_scale[:, None]
    tl.store(p_o[:, None] + C * _QUANT_GROUP + o_e[None, :], b_o.to(p_o.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def _block_slots(blk, live, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w,
                 BLOCK_N: tl.constexpr):
    """Key block blk of a token (top-k blocks first, then window blocks; nothing when not
    live): (valid [BLOCK_N], the block's cache, data-row and scale-row byte offsets [BLOCK_N]
    int64). A slot outside [0, capacity) of its cache is invalid and clamped into range."""
    is_c = blk < nb1  # scalar: a top-k block (else a window block)
    o_j = tl.where(is_c, blk, blk - nb1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_sc = tl.load(p_tk + o_j, mask=is_c & (o_j < k1) & live, other=-1).to(tl.int64)
    b_sw = tl.load(p_sw + o_j, mask=(blk >= nb1) & (o_j < k2) & live, other=-1).to(tl.int64)
    b_slot = tl.where(is_c, b_sc, b_sw)  # [BLOCK_N]
    p_cache = tl.where(is_c, cc_ptr, cw_ptr)
    page = tl.where(is_c, page_c, page_w).to(tl.int64)
    bs = tl.where(is_c, bs_c, bs_w).to(tl.int64)
    cap = tl.where(is_c, cap_c, cap_w).to(tl.int64)
    m_n = (b_slot >= 0) & (b_slot < cap)  # [BLOCK_N]
    # a clamp, not a select: triton 3.6 crashed on the select with int64 slots at 16 heads
    b_slot = tl.minimum(tl.maximum(b_slot, 0), cap - 1)  # rows with m_n false load nothing
    b_pg = b_slot // bs
    b_pos = b_slot - b_pg * bs
    o_data = b_pg * page + b_pos * _DATA_BYTES  # [BLOCK_N] int64
    o_scale = b_pg * page + bs * _DATA_BYTES + b_pos * _SCALE_BYTES
    return m_n, p_cache, o_data, o_scale


@triton.jit
def _load_block(m_n, p_cache, o_data, o_scale):
    """Every raw byte of a key block: 7 (codes [BLOCK_N, 64], scale bytes [BLOCK_N]) and the
    RoPE bits [BLOCK_N, 64]; rows with m_n false load nothing."""
    b_c0, b_e0 = _load_chunk(p_cache, o_data, o_scale, m_n, 0)
    b_c1, b_e1 = _load_chunk(p_cache, o_data, o_scale, m_n, 1)
    b_c2, b_e2 = _load_chunk(p_cache, o_data, o_scale, m_n, 2)
    b_c3, b_e3 = _load_chunk(p_cache, o_data, o_scale, m_n, 3)
    b_c4, b_e4 = _load_chunk(p_cache, o_data, o_scale, m_n, 4)
    b_c5, b_e5 = _load_chunk(p_cache, o_data, o_scale, m_n, 5)
    b_c6, b_e6 = _load_chunk(p_cache, o_data, o_scale, m_n, 6)
    b_r = _rope_bits(p_cache, o_data, m_n)
    return b_c0, b_e0, b_c1, b_e1, b_c2, b_e2, b_c3, b_e3, b_c4, b_e4, b_c5, b_e5, b_c6, b_e6, b_r


@triton.jit
def _pipelined_loop(b_q0, b_q1, b_q2, b_q3, b_q4, b_q5, b_q6, b_q7, b_m, b_l,
                    b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_a7,
                    blk_lo, blk_hi, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w,
                    qk_scale, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
                    DTYPE: tl.constexpr):
    """The key-block loop software-pipelined by hand: iteration blk computes block blk from
    raw bytes loaded by the previous iteration, after issuing the loads of block blk + 1's
    records (its slots came one iteration earlier) and of block blk + 2's slots. Loads
    consumed only in the next iteration cannot be sunk next to their uses, so their latency
    overlaps a block of decode and MMA. Same arithmetic as the plain loop."""
    s_m, s_cache, s_data, s_scale = _block_slots(blk_lo, blk_lo < blk_hi, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr,
                                                 page_c, bs_c, cap_c, page_w, bs_w, cap_w, BLOCK_N)
    b_c0, b_e0, b_c1, b_e1, b_c2, b_e2, b_c3, b_e3, b_c4, b_e4, b_c5, b_e5, b_c6, b_e6, b_r = _load_block(
        s_m, s_cache, s_data, s_scale)
    m_n = s_m
    s_m, s_cache, s_data, s_scale = _block_slots(blk_lo + 1, blk_lo + 1 < blk_hi, nb1, k1, k2, p_tk, p_sw, cc_ptr,
                                                 cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        # next block's records (slots known), the block after's slots: consumed next iteration
        n_c0, n_e0, n_c1, n_e1, n_c2, n_e2, n_c3, n_e3, n_c4, n_e4, n_c5, n_e5, n_c6, n_e6, n_r = _load_block(
            s_m, s_cache, s_data, s_scale)
        n_m = s_m
        s_m, s_cache, s_data, s_scale = _block_slots(blk + 2, blk + 2 < blk_hi, nb1, k1, k2, p_tk, p_sw, cc_ptr,
                                                     cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w, BLOCK_N)
        b_k0 = _decode_chunk(b_c0, b_e0, NATIVE, DTYPE)  # [BLOCK_N, 64] each
        b_s = tl.dot(b_q0, tl.trans(b_k0))  # [BLOCK_H, BLOCK_N] fp32
        b_k1 = _decode_chunk(b_c1, b_e1, NATIVE, DTYPE)
        b_s = tl.dot(b_q1, tl.trans(b_k1), b_s)
        b_k2 = _decode_chunk(b_c2, b_e2, NATIVE, DTYPE)
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
        b_k3 = _decode_chunk(b_c3, b_e3, NATIVE, DTYPE)
        b_s = tl.dot(b_q3, tl.trans(b_k3), b_s)
        b_k4 = _decode_chunk(b_c4, b_e4, NATIVE, DTYPE)
        b_s = tl.dot(b_q4, tl.trans(b_k4), b_s)
        b_k5 = _decode_chunk(b_c5, b_e5, NATIVE, DTYPE)
        b_s = tl.dot(b_q5, tl.trans(b_k5), b_s)
        b_k6 = _decode_chunk(b_c6, b_e6, NATIVE, DTYPE)
        b_s = tl.dot(b_q6, tl.trans(b_k6), b_s)
        b_k7 = b_r.to(tl.bfloat16, bitcast=True).to(DTYPE)
        b_s = tl.dot(b_q7, tl.trans(b_k7), b_s)
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
        b_c0, b_e0, b_c1, b_e1, b_c2, b_e2, b_c3, b_e3 = n_c0, n_e0, n_c1, n_e1, n_c2, n_e2, n_c3, n_e3
        b_c4, b_e4, b_c5, b_e5, b_c6, b_e6, b_r, m_n = n_c4, n_e4, n_c5, n_e5, n_c6, n_e6, n_r, n_m
    return b_m, b_l, b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_a7


@triton.jit
def _dsv4_decode_fused_kernel(
    q_ptr,  # bf16 [T, H, 512], dims contiguous
    cc_ptr,  # uint8 [num_blocks_c, page_c]: the compressed cache
    topk_ptr,  # int32/int64 [T, K1] compressed slots, row stride stride_topk_t
    topk_len_ptr,  # int32/int64 [>= T] or None
    cw_ptr,  # uint8 [num_blocks_w, page_w]: the sliding-window cache
    swa_ptr,  # int32/int64 [T, K2] window slots, row stride stride_swa_t
    swa_len_ptr,  # int32/int64 [>= T] or None
    sink_ptr,  # fp32 [H] or None (DIRECT only)
    o_ptr, lse_ptr,
    H, K1, K2, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_topk_t, stride_swa_t, stride_o_t, stride_o_h,
    page_c, bs_c, cap_c, page_w, bs_w, cap_w,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_SWA_LEN: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
    PIPELINE: tl.constexpr = False,
):
    """Grid (T * S * G,): program pid runs head group g = pid % G of token t = pid // (S*G)
    over the key blocks of split s = (pid // G) % S, decoding every key once for the group.
    DIRECT: o_ptr/lse_ptr are out bf16 [T, H, 512] / lse fp32 [T, H] (S == 1); else o_part
    fp32 [T, H, S, 512] / lse_part fp32 [T, H, S] contiguous.

    The 512 dims go as 8 chunks of 64 (the UE8M0 groups; chunk 7 = the RoPE dims): per key
    block 8 [BLOCK_N, 64] tiles are decoded (a few registers each), the scores are the sum
    of 8 dots [BLOCK_H, 64] x [64, BLOCK_N], and 8 accumulators [BLOCK_H, 64] take p @ tile.
    Without PIPELINE (the measured form) each chunk's load sits between the layout-conversion
    barriers of the dots (PTX: loads, bar.sync, ..., per chunk), so a block pays ~9 dependent
    global round trips. PIPELINE: ``_pipelined_loop`` (not dispatched until measured)."""
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
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    k1 = K1
    if HAS_TOPK_LEN:
        k1 = tl.minimum(tl.maximum(tl.load(topk_len_ptr + pid_t).to(tl.int32), 0), K1)
    k2 = K2
    if HAS_SWA_LEN:
        k2 = tl.minimum(tl.maximum(tl.load(swa_len_ptr + pid_t).to(tl.int32), 0), K2)
    nb1 = (k1 + BLOCK_N - 1) // BLOCK_N
    nb = nb1 + (k2 + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * nb) // S
    blk_hi = ((pid_s + 1) * nb) // S
    p_tk = topk_ptr + pid_t * stride_topk_t
    p_sw = swa_ptr + pid_t * stride_swa_t

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
    if PIPELINE:
        b_m, b_l, b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_a7 = _pipelined_loop(
            b_q0, b_q1, b_q2, b_q3, b_q4, b_q5, b_q6, b_q7, b_m, b_l, b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_a7,
            blk_lo, blk_hi, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w,
            qk_scale, BLOCK_H, BLOCK_N, NATIVE, DTYPE)
    else:
        for blk in range(blk_lo, blk_hi):
            m_n, p_cache, o_data, o_scale = _block_slots(
                blk, True, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w,
                BLOCK_N)

            b_k0 = _nope_chunk(p_cache, o_data, o_scale, m_n, 0, NATIVE, DTYPE)  # [BLOCK_N, 64] each
            b_s = tl.dot(b_q0, tl.trans(b_k0))  # [BLOCK_H, BLOCK_N] fp32
            b_k1 = _nope_chunk(p_cache, o_data, o_scale, m_n, 1, NATIVE, DTYPE)
            b_s = tl.dot(b_q1, tl.trans(b_k1), b_s)
            b_k2 = _nope_chunk(p_cache, o_data, o_scale, m_n, 2, NATIVE, DTYPE)
            b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
            b_k3 = _nope_chunk(p_cache, o_data, o_scale, m_n, 3, NATIVE, DTYPE)
            b_s = tl.dot(b_q3, tl.trans(b_k3), b_s)
            b_k4 = _nope_chunk(p_cache, o_data, o_scale, m_n, 4, NATIVE, DTYPE)
            b_s = tl.dot(b_q4, tl.trans(b_k4), b_s)
            b_k5 = _nope_chunk(p_cache, o_data, o_scale, m_n, 5, NATIVE, DTYPE)
            b_s = tl.dot(b_q5, tl.trans(b_k5), b_s)
            b_k6 = _nope_chunk(p_cache, o_data, o_scale, m_n, 6, NATIVE, DTYPE)
            b_s = tl.dot(b_q6, tl.trans(b_k6), b_s)
            b_k7 = _rope_chunk(p_cache, o_data, m_n, DTYPE)
            b_s = tl.dot(b_q7, tl.trans(b_k7), b_s)

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
    if DIRECT:
        b_scale = 1.0 / b_l_safe  # [BLOCK_H]
        if HAS_SINK:
            b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=float("-inf")).to(tl.float32)
            b_sink = tl.where(b_sink == b_sink, b_sink, float("-inf"))  # a NaN sink is no sink
            b_max = tl.maximum(b_lse, b_sink)
            b_max_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
            b_den = tl.exp(b_lse - b_max_safe) + tl.exp(b_sink - b_max_safe)
            b_tot = tl.where(b_den > 0.0, b_max_safe + tl.log(tl.where(b_den > 0.0, b_den, 1.0)),
                             float("-inf"))
            # out = (sum p v / l) * exp(lse_keys - lse_total); 0 where no key (acc is 0 there)
            b_scale = tl.where(has_key, tl.exp(b_lse - tl.where(has_key, b_tot, 0.0)) / b_l_safe, 0.0)
            b_lse = b_tot
        p_o = o_ptr + pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H] rows
        tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)
    else:
        b_scale = 1.0 / b_l_safe  # 0 rows where the split saw no valid key (acc is 0 there)
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


# Launch configs per head-group size (BLOCK_H <= 32), as plain data; checked by the AOT
# table (`python -m dsv4_ops.aot`: no spills on sm_80/86, within sm_86's 99 KB). Both
# variants share them (the native variant differs only in the E4M3 decode instruction).
MAX_BLOCK_H = 32
# Probed (sm_80, triton 3.8, i32 slots, both lengths, direct + sink): 16 heads x 32 keys at
# 4 warps spills 1280 B (16 keys: 56 B); 32 heads x 32 keys at 8 warps spills 64 B; 16 warps
# cap the registers at 128 and spill > 1 KB; 64-head groups spill > 10 KB. Spill-free:
FUSED_CONFIG = {
    16: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PIPELINE": False},
    32: {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2, "PIPELINE": False},
}


# The PIPELINE form (_pipelined_loop: the next block's records loaded during this block's
# MMAs), not dispatched until measured; benchmarks/bench_decode_paged_chunk64.py times it beside
# FUSED_CONFIG (column pipe_us).
FUSED_PIPELINE_CONFIG = {
    16: {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2, "PIPELINE": True},
}


def block_h_for(H: int) -> int:
    """Rows of a head group: H padded to a power of two >= 16, at most MAX_BLOCK_H."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(max(int(H), 1))))
