"""DSv4 sparse-MLA decode v3, read straight from the paged fp8 caches (op ``dsv4_decode_fused_out``).

Contract (shared with csrc_triton.decode.paged_f16dot): a token's keys are its K1 top-k slots of
the compressed cache then its K2 window slots, in BLOCK_N-key blocks (top-k blocks first); a slot
outside [0, capacity) of its cache or past the token's length is not attended; DIRECT writes out +
lse with the sink, else fp32 partials per split for the merge. Structure, built for the batched
regime:

* the 512 latent dims as 4 chunks of 128 instead of 8 of 64: per key block 4 decoded
  [BLOCK_N, 128] tiles, scores = 4 dots of K = 128, 4 accumulators [BLOCK_H, 128]
  (16 dots a block instead of 32, half the layout conversions). Chunks 0-2 are NoPE dims
  128c..128c+127 (two UE8M0 groups each: the scale is chosen per column, lo / hi 64);
  chunk 3 is NoPE dims 384..447 (scale 6) followed by the 64 bf16 RoPE dims, built from two
  half-masked loads of the same record row.
* the scales of a record as 4 uint16 words (scale pairs, the 8-byte scale row; 2-byte
  alignment is what check_cache guarantees), not 7 byte loads.
* the key-block loop software-pipelined by hand when PIPE (loop-carried prefetch: every raw
  byte of block i + 1, whose slots came one iteration earlier, and the slots of block i + 2
  are loaded before the decode and the dots of block i), so one overlapped round trip a
  block instead of a chain of dependent ones.

Decode (exact, as the gather): E4M3 code -> fp32 (portable: the fp8e4b15
bit reinterpretation, x 256 folded into the scale) x 2**(byte - 127) -> q's dtype (bf16;
fp16 under the interpreter, whose bf16 tl.dot is wrong). No fp8 pointer; the portable path
holds no fp8 dtype conversion instruction (checked by the AOT table).
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from ..kv_cache import ue8m0_to_f32

HEAD_DIM = _L.HEAD_DIM
CHUNK = 128
_NOPE_DIM = tl.constexpr(_L.NOPE_DIM)
_DATA_BYTES = tl.constexpr(_L.DATA_BYTES)
_SCALE_BYTES = tl.constexpr(_L.SCALE_BYTES)

assert _L.NOPE_DIM == 3 * CHUNK + 64 and _L.ROPE_DIM == 64 and _L.SCALE_BYTES == 8


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
def _load_raw(m_n, p_cache, o_data, o_scale, ALIGN: tl.constexpr):
    """Every raw byte of a key block: codes uint8 [BLOCK_N, 128] of chunks 0-2, chunk 3's
    codes (columns < 64, else 0) and RoPE bits uint16 (columns >= 64, else 0), and the 4
    scale-pair words uint16 [BLOCK_N]; rows with m_n false load nothing (0).
    ALIGN: both caches start at a 16-byte boundary and their page strides are multiples of
    16 (vLLM's pages are multiples of 576), so data rows are 16-byte aligned (vector loads)
    and scale rows 8-byte aligned (one 8-byte load a record)."""
    o_e = tl.arange(0, 128)
    p_row = p_cache + o_data  # [BLOCK_N] pointers to the data rows
    if ALIGN:
        p_row = tl.multiple_of(p_row, 16)
    m_2 = m_n[:, None]
    b_c0 = tl.load(p_row[:, None] + o_e[None, :], mask=m_2, other=0)
    b_c1 = tl.load(p_row[:, None] + 128 + o_e[None, :], mask=m_2, other=0)
    b_c2 = tl.load(p_row[:, None] + 256 + o_e[None, :], mask=m_2, other=0)
    lo = o_e[None, :] < 64
    b_c3 = tl.load(p_row[:, None] + 384 + o_e[None, :], mask=m_2 & lo, other=0)
    p_rope = (p_row + _NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)  # [BLOCK_N]
    if ALIGN:
        p_rope = tl.multiple_of(p_rope, 16)
    b_r3 = tl.load(p_rope[:, None] + (o_e[None, :] - 64), mask=m_2 & (o_e[None, :] >= 64), other=0)
    if ALIGN:
        p_sc = tl.multiple_of((p_cache + o_scale).to(tl.pointer_type(tl.uint64), bitcast=True), 8)
        b_s8 = tl.load(p_sc, mask=m_n, other=0)  # [BLOCK_N]: the 8 scale bytes, little-endian
        b_w0 = (b_s8 & 0xFFFF).to(tl.uint16)
        b_w1 = ((b_s8 >> 16) & 0xFFFF).to(tl.uint16)
        b_w2 = ((b_s8 >> 32) & 0xFFFF).to(tl.uint16)
        b_w3 = ((b_s8 >> 48) & 0xFFFF).to(tl.uint16)
    else:
        p_sc = (p_cache + o_scale).to(tl.pointer_type(tl.uint16), bitcast=True)  # [BLOCK_N]
        b_w0 = tl.load(p_sc, mask=m_n, other=0)
        b_w1 = tl.load(p_sc + 1, mask=m_n, other=0)
        b_w2 = tl.load(p_sc + 2, mask=m_n, other=0)
        b_w3 = tl.load(p_sc + 3, mask=m_n, other=0)
    return b_c0, b_c1, b_c2, b_c3, b_r3, b_w0, b_w1, b_w2, b_w3


@triton.jit
def _decode(b_codes, b_w, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """codes uint8 [BLOCK_N, 128] of two UE8M0 groups, scale pair word uint16 [BLOCK_N]
    (low byte: columns < 64, high byte: columns >= 64) -> [BLOCK_N, 128] in DTYPE, exact."""
    o_e = tl.arange(0, 128)
    b_lo = ue8m0_to_f32((b_w & 0xFF).to(tl.uint8))
    b_hi = ue8m0_to_f32((b_w >> 8).to(tl.uint8))
    if NATIVE:
        b_val = b_codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:  # fp8e4b15 reads the code as E4M3 / 256: the 256 goes into the scale
        b_val = b_codes.to(tl.float8e4b15, bitcast=True).to(tl.float32)
        b_lo = b_lo * 256.0
        b_hi = b_hi * 256.0
    b_f = tl.where(o_e[None, :] < 64, b_lo[:, None], b_hi[:, None])
    return (b_val * b_f).to(DTYPE)


@triton.jit
def _decode3(b_c3, b_r3, b_w3, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """Chunk 3: NoPE dims 384..447 (columns < 64, scale 6) then the RoPE dims (bf16 bits)."""
    o_e = tl.arange(0, 128)
    b_nope = _decode(b_c3, b_w3, NATIVE, DTYPE)
    b_rope = b_r3.to(tl.bfloat16, bitcast=True).to(DTYPE)
    return tl.where(o_e[None, :] < 64, b_nope, b_rope)


@triton.jit
def _block_step(b_q0, b_q1, b_q2, b_q3, b_m, b_l, b_a0, b_a1, b_a2, b_a3, m_n,
                b_c0, b_c1, b_c2, b_c3, b_r3, b_w0, b_w1, b_w2, b_w3, qk_scale,
                BLOCK_H: tl.constexpr, NATIVE: tl.constexpr, DTYPE: tl.constexpr):
    """One key block of the online softmax from its raw bytes (4 score dots, 4 p @ v dots)."""
    b_k0 = _decode(b_c0, b_w0, NATIVE, DTYPE)  # [BLOCK_N, 128] each
    b_s = tl.dot(b_q0, tl.trans(b_k0))  # [BLOCK_H, BLOCK_N] fp32
    b_k1 = _decode(b_c1, b_w1, NATIVE, DTYPE)
    b_s = tl.dot(b_q1, tl.trans(b_k1), b_s)
    b_k2 = _decode(b_c2, b_w2, NATIVE, DTYPE)
    b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
    b_k3 = _decode3(b_c3, b_r3, b_w3, NATIVE, DTYPE)
    b_s = tl.dot(b_q3, tl.trans(b_k3), b_s)
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
    return b_m_new, b_l, b_a0, b_a1, b_a2, b_a3


@triton.jit
def _q_chunk(p_q, m_h, C: tl.constexpr):
    o_e = tl.arange(0, 128)
    return tl.load(p_q[:, None] + C * 128 + o_e[None, :], mask=m_h[:, None], other=0.0)


@triton.jit
def _store_chunk(p_o, b_acc, b_scale, m_h, C: tl.constexpr):
    o_e = tl.arange(0, 128)
    b_o = b_acc * b_scale[:, None]
    tl.store(p_o[:, None] + C * 128 + o_e[None, :], b_o.to(p_o.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def _dsv4_decode_v3_kernel(
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
    PIPE: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (T * S * G,): program pid runs head group g = pid % G of token t = pid // (S*G)
    over the key blocks [s * nb // S, (s + 1) * nb // S) of split s = (pid // G) % S (nb: the
    token's top-k then window blocks within its lengths), decoding every key once for the group. DIRECT: o_ptr/lse_ptr are out bf16
    [T, H, 512] / lse fp32 [T, H] (S == 1, sink folded in); else o_part fp32 [T, H, S, 512]
    / lse_part fp32 [T, H, S] contiguous (merged by csrc_triton.decode.merge)."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    p_qrow = q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h  # [BLOCK_H]
    b_q0 = _q_chunk(p_qrow, m_h, 0)  # [BLOCK_H, 128] each
    b_q1 = _q_chunk(p_qrow, m_h, 1)
    b_q2 = _q_chunk(p_qrow, m_h, 2)
    b_q3 = _q_chunk(p_qrow, m_h, 3)
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
    b_a0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)  # unnormalised p @ v, dims 128c..128c+127
    b_a1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    if PIPE:
        s_m, s_cache, s_data, s_scale = _block_slots(blk_lo, blk_lo < blk_hi, nb1, k1, k2, p_tk, p_sw, cc_ptr,
                                                     cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w, BLOCK_N)
        b_c0, b_c1, b_c2, b_c3, b_r3, b_w0, b_w1, b_w2, b_w3 = _load_raw(s_m, s_cache, s_data, s_scale, ALIGN)
        m_n = s_m
        s_m, s_cache, s_data, s_scale = _block_slots(blk_lo + 1, blk_lo + 1 < blk_hi, nb1, k1, k2, p_tk, p_sw,
                                                     cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w,
                                                     BLOCK_N)
        for blk in range(blk_lo, blk_hi):
            # the next block's raw bytes (its slots are known) and the block after's slots:
            # consumed only in the next iteration, so they cannot sink next to their uses
            n_c0, n_c1, n_c2, n_c3, n_r3, n_w0, n_w1, n_w2, n_w3 = _load_raw(s_m, s_cache, s_data, s_scale, ALIGN)
            n_m = s_m
            s_m, s_cache, s_data, s_scale = _block_slots(blk + 2, blk + 2 < blk_hi, nb1, k1, k2, p_tk, p_sw,
                                                         cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w,
                                                         cap_w, BLOCK_N)
            b_m, b_l, b_a0, b_a1, b_a2, b_a3 = _block_step(
                b_q0, b_q1, b_q2, b_q3, b_m, b_l, b_a0, b_a1, b_a2, b_a3, m_n,
                b_c0, b_c1, b_c2, b_c3, b_r3, b_w0, b_w1, b_w2, b_w3, qk_scale, BLOCK_H, NATIVE, DTYPE)
            b_c0, b_c1, b_c2, b_c3, b_r3, m_n = n_c0, n_c1, n_c2, n_c3, n_r3, n_m
            b_w0, b_w1, b_w2, b_w3 = n_w0, n_w1, n_w2, n_w3
    else:
        for blk in range(blk_lo, blk_hi):
            m_n, p_cache, o_data, o_scale = _block_slots(
                blk, True, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w,
                BLOCK_N)
            b_c0, b_c1, b_c2, b_c3, b_r3, b_w0, b_w1, b_w2, b_w3 = _load_raw(m_n, p_cache, o_data, o_scale, ALIGN)
            b_m, b_l, b_a0, b_a1, b_a2, b_a3 = _block_step(
                b_q0, b_q1, b_q2, b_q3, b_m, b_l, b_a0, b_a1, b_a2, b_a3, m_n,
                b_c0, b_c1, b_c2, b_c3, b_r3, b_w0, b_w1, b_w2, b_w3, qk_scale, BLOCK_H, NATIVE, DTYPE)

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


# Launch configs per head-group size, as plain data (AOT table: no spills on sm_80/86,
# within sm_86's 99 KB); both variants share them. Candidates measured by
# benchmarks/bench_decode_paged.py (V3_CANDIDATES; suffix p = hand-pipelined, s3 = 3 stages).
V3_CANDIDATES = {
    "h16n32w4p": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PIPE": True},
    "h16n32w8p": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "PIPE": True},
    "h32n32w8p": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "PIPE": True},
    "h16n32w4": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PIPE": False},
    "h32n32w8": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PIPE": False},
    "h64n16w8p": {"BLOCK_H": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "PIPE": True},
    "h16n16w4p": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PIPE": True},
    "h32n16w8p": {"BLOCK_H": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "PIPE": True},
    "h16n32w4s3": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "PIPE": False},
    "h16n64w4": {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "PIPE": False},
    "h16n16w4": {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "PIPE": False},
    "h32n16w8": {"BLOCK_H": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2, "PIPE": False},
    "h16n32w8": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "PIPE": False},
    "h64n16w8": {"BLOCK_H": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2, "PIPE": False},
    "h16n64w8": {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "PIPE": False},
    "h32n64w8": {"BLOCK_H": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "PIPE": False},
    "h16n32w2": {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2, "PIPE": False},
    "h16n64w4s3": {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PIPE": False},
    "h32n32w8s3": {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "PIPE": False},
}
# The configs dispatch.decode.resolve_config can pick over aligned caches (and the AOT table lists); the other
# candidates are benchmark-only (reached through dsv4_decode_fused(config=...)).
V3_DISPATCHED = ("h16n32w4", "h16n16w4")
# The config the plan runs over caches that are not 16-byte aligned (ALIGN off: byte and 2-byte
# loads): the one spill-free with ALIGN off on sm_80 and sm_86 (AOT: h16n32w4 spills 1.8-2.2 KB a
# thread there, h16n16w4 up to 72 B, h16n32w8 nothing at 255 registers x 8 warps).
V3_UNALIGNED = ("h16n32w8",)
MAX_BLOCK_H = 32


def block_h_for(H: int) -> int:
    """Rows of a head group: H padded to a power of two >= 16, at most MAX_BLOCK_H."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(max(int(H), 1))))
