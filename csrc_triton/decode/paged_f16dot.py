"""DSv4 sparse-MLA decode v4: the v3 read with the decode folded into the dots (op ``dsv4_decode_fused_out``).

The same contract as csrc_triton.decode.paged_chunk128 (key positions, validity, the partition into
BLOCK_N-key blocks, DIRECT / partial epilogues, fp32 partials; the launcher picks it through a
V4_CANDIDATES config), a different inner loop (the per-key-block cost of v3 was the
decode arithmetic, not the bytes or the MMA):

* No per-code arithmetic. An E4M3 byte s eeee mmm (bias 7) is, as fp16 bits (bias 15),
  ``(b & 0x80) << 8 | (b & 0x7F) << 7``: the same value times 2**-8 exactly, normals and
  subnormals alike (``code_to_f16``: two masks, two shifts, an or on 16-bit lanes; no fp8
  dtype, no float instruction). The NoPE codes of a record stay in that form for both dots.
* Scores: one fp16 dot per UE8M0 group (7 of K = 64, independent accumulators: no serial
  mma chain) and one bf16 dot of the 64 RoPE dims; s = (sum_g acc_g * 2**(byte_g - 127)) *
  rf + acc_rope * qk_scale: 8 FMAs an element of the [BLOCK_H, BLOCK_N] tile. q's NoPE dims
  go to fp16 with a per-row power-of-two prescale 2**e (e from the row's max |q| so every
  value is below 2**15 < 65504; at most 2**24 up): exact for bf16 values in range (11 > 8
  mantissa bits), folded back into rf = qk_scale * 2**(8 - e).
* P @ V: per group g, p' = p * 2**(byte_g - 127) / c_g with c_g a per-row power of two >= the
  row's max of p * 2**(byte_g - 127) in the block (so p' <= 1 and the row's largest p' >= 1/2:
  fp16's 10 mantissa bits, more than bf16's 7), one fp16 dot with the codes, accumulated as
  acc_g = acc_g * alpha + dot * (2**8 c_g) in fp32; the RoPE dims as a bf16 dot of p.
* Rows: 64 dims a group, so every load and dot tile is [BLOCK_N, 64] (7 code tiles + the
  RoPE tile), the scales one 8-byte load a record (ALIGN: 16-byte aligned pages, which the
  launcher requires for this form as for v3). Block sizes are powers of two (vLLM's 64; the
  launcher runs v3 otherwise), passed as shifts: no 64-bit division for the record offsets.

* STREAM (configs sh...): no key group stays live across the softmax: each is read and decoded
  for its score dot, then read (an L1 hit) and decoded again for its P @ V dot, q's groups re-read
  each block; the registers go to the accumulators of wide head groups (32-64 heads a program, each
  key tile shared by all of them). PV_KEY's arithmetic otherwise.
* WIDE_PV (configs wh..., with STREAM): every P @ V dot 128 columns wide (groups in pairs; group 6
  and the RoPE dims each beside 64 zero columns, 1/8 more P @ V MMA), the score dots in 32-dim halves:
  Triton's chained-dot layout is then [1, num_warps] at 64 heads ([num_warps, 1], its choice for
  [64, 64] dots, holds every accumulator row twice at 8 warps).

Under the Triton interpreter q is fp16 (its bf16 tl.dot is wrong): the RoPE dot runs in q's
dtype there. NATIVE (sm_89+) uses the same exact integer decode (no fp8 dtype either way).
"""

import os

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from ..kv_cache import ue8m0_to_f32
from .balance import slot_of

HEAD_DIM = _L.HEAD_DIM
GROUP = 64
_NOPE_DIM = tl.constexpr(_L.NOPE_DIM)
_DATA_BYTES = tl.constexpr(_L.DATA_BYTES)
_SCALE_BYTES = tl.constexpr(_L.SCALE_BYTES)
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # read at import, as Triton does

assert _L.NOPE_DIM == 7 * GROUP and _L.ROPE_DIM == GROUP and _L.SCALE_BYTES == 8 and _L.QUANT_GROUP == GROUP


@triton.jit
def code_to_f16(b_codes):
    """uint8 E4M3 codes -> fp16 value * 2**-8, exact for every code but the two NaNs (0x7F, 0xFF
    read as +-1.75: the writer never stores them). Compiled: Triton's fp8e4b15 -> fp16
    conversion, a bit shuffle of 4 codes at a time (sign | (b & 0x7F) << 7: no fp8 instruction);
    under the interpreter, whose e4b15 conversion mangles subnormals, the same bits from
    integer ops (tests check both against every code)."""
    if _INTERPRET:
        b = b_codes.to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    else:
        return b_codes.to(tl.float8e4b15, bitcast=True).to(tl.float16)


@triton.jit
def _pow2_ceil(b_x):
    """fp32 [..] >= 0 -> (2**k, 2**-k), 2**k the smallest power of two >= x (x itself when it is
    one: a unit that is already a power of two stays, block after block), clamped to normal
    fp32; x = 0 gives (2**-126, 2**126)."""
    b_bits = b_x.to(tl.int32, bitcast=True)
    b_k = ((b_bits >> 23) & 0xFF) + ((b_bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent of 2**k
    b_k = tl.minimum(tl.maximum(b_k, 1), 253)
    return (b_k << 23).to(tl.float32, bitcast=True), ((254 - b_k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _row_prescale(b_amax):
    """Row max |q| fp32 [BLOCK_H] -> (2**e, 2**(8 - e)): q * 2**e < 2**15, e <= 24."""
    b_e = (b_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2**(E - 126)
    b_k = tl.minimum(141 - b_e, 24)  # q * 2**k < 2**15
    b_k = tl.maximum(b_k, -100)
    b_up = ((b_k + 127) << 23).to(tl.float32, bitcast=True)
    b_back = ((135 - b_k) << 23).to(tl.float32, bitcast=True)
    return b_up, b_back


@triton.jit
def _block_rows(blk, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, sh_c, cap_c, page_w, sh_w, cap_w,
                BLOCK_N: tl.constexpr):
    """paged_chunk128._block_slots for power-of-two block sizes given as shifts sh = log2(bs):
    page = slot >> sh, position = slot & (bs - 1), no 64-bit division (ptxas expands each
    div.s64 into a long sequence, recomputed for every layout the offsets are used in)."""
    is_c = blk < nb1  # scalar: a top-k block (else a window block)
    o_j = tl.where(is_c, blk, blk - nb1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_sc = tl.load(p_tk + o_j, mask=is_c & (o_j < k1), other=-1).to(tl.int64)
    b_sw = tl.load(p_sw + o_j, mask=(blk >= nb1) & (o_j < k2), other=-1).to(tl.int64)
    b_slot = tl.where(is_c, b_sc, b_sw)  # [BLOCK_N]
    p_cache = tl.where(is_c, cc_ptr, cw_ptr)
    page = tl.where(is_c, page_c, page_w).to(tl.int64)
    sh = tl.where(is_c, sh_c, sh_w).to(tl.int64)
    cap = tl.where(is_c, cap_c, cap_w).to(tl.int64)
    m_n = (b_slot >= 0) & (b_slot < cap)  # [BLOCK_N]
    b_slot = tl.minimum(tl.maximum(b_slot, 0), cap - 1)  # rows with m_n false load nothing
    b_pg = b_slot >> sh
    b_pos = b_slot & ((1 << sh) - 1)
    o_data = b_pg * page + b_pos * _DATA_BYTES  # [BLOCK_N] int64
    o_scale = b_pg * page + (_DATA_BYTES << sh) + b_pos * _SCALE_BYTES
    return m_n, p_cache, o_data, o_scale


@triton.jit
def _q_group(p_q, m_h, g: tl.constexpr):
    o_e = tl.arange(0, 64)
    return tl.load(p_q[:, None] + g * 64 + o_e[None, :], mask=m_h[:, None], other=0.0)


@triton.jit
def _codes(p_row, m_2, g: tl.constexpr):
    """Raw codes uint8 [BLOCK_N, 64] of group g (rows with m_2 false: 0)."""
    o_e = tl.arange(0, 64)
    return tl.load(p_row[:, None] + g * 64 + o_e[None, :], mask=m_2, other=0)


@triton.jit
def _key_group(b_c, b_eg, b_emax):
    """PV_KEY: codes of group g -> fp16 value * 2**-8 * 2**(e_g - e_max) (the key's own scale
    ratio, a power of two <= 1; exact unless below fp16's 2**-24, i.e. 2**-25 of the key's
    largest group value)."""
    b_d = tl.maximum(b_eg - b_emax, -126)  # <= 0
    b_r = ((b_d + 127) << 23).to(tl.float32, bitcast=True).to(tl.float16)  # [BLOCK_N]
    return code_to_f16(b_c) * b_r[:, None]


@triton.jit
def _group_f16(b_c, m_2):
    """Not PV_KEY: codes of group g -> fp16 value * 2**-8 (the select keeps the decode in the
    load layout, so both dots read one decoded tile)."""
    return tl.where(m_2, code_to_f16(b_c), 0.0)


@triton.jit
def _byte(b_s8, g: tl.constexpr):
    """Scale byte g of the 8 little-endian scale bytes uint64 [BLOCK_N] -> int32."""
    return ((b_s8 >> (8 * g)) & 0xFF).to(tl.int32)


@triton.jit
def _scale(b_s8, g: tl.constexpr):
    """Scale g of the 8 little-endian scale bytes uint64 [BLOCK_N] -> fp32 2**(byte - 127)."""
    return ue8m0_to_f32(((b_s8 >> (8 * g)) & 0xFF).to(tl.uint8))


@triton.jit
def _pv(b_p, b_f, b_k, b_a, b_alpha):
    """One group's P @ V: p' = p * f / c (c a per-row power of two), fp16 dot, into acc."""
    b_pf = b_p * b_f[None, :]
    b_c, b_inv = _pow2_ceil(tl.max(b_pf, 1))
    b_d = tl.dot((b_pf * b_inv[:, None]).to(tl.float16), b_k)
    return b_a * b_alpha + b_d * (b_c * 256.0)[:, None]


@triton.jit
def _stream_score(p_q, m_h, b_up, p_row, m_2, b_s8, b_emax, g: tl.constexpr):
    """STREAM: q's NoPE group g (re-read, prescaled to fp16) times the key group g (codes read
    and decoded here): fp32 [BLOCK_H, BLOCK_N], in the units of PV_KEY's scores."""
    b_q = (_q_group(p_q, m_h, g).to(tl.float32) * b_up[:, None]).to(tl.float16)
    b_k = _key_group(_codes(p_row, m_2, g), _byte(b_s8, g), b_emax)
    return tl.dot(b_q, tl.trans(b_k))


@triton.jit
def _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a, b_ratio, g: tl.constexpr):
    """STREAM: group g's P @ V with the key group read and decoded again (an L1 hit: the codes
    were read for the scores of this block), into acc rescaled by ratio."""
    b_k = _key_group(_codes(p_row, m_2, g), _byte(b_s8, g), b_emax)
    return tl.dot(b_pp, b_k, b_a * b_ratio)


@triton.jit
def _half_score(p_q, m_h, b_up, p_row, m_2, b_s8, b_emax, g: tl.constexpr, h: tl.constexpr):
    """WIDE_PV: the score dot of dims 32h..32h+31 of group g (q's half re-read, the key's half read
    and decoded): [BLOCK_H, 32] q tiles, half the registers of a group's A operand that every warp
    of the [1, num_warps] layout holds."""
    o_e = tl.arange(0, 32)
    b_q = tl.load(p_q[:, None] + g * 64 + h * 32 + o_e[None, :], mask=m_h[:, None], other=0.0)
    b_q = (b_q.to(tl.float32) * b_up[:, None]).to(tl.float16)
    b_c = tl.load(p_row[:, None] + g * 64 + h * 32 + o_e[None, :], mask=m_2, other=0)
    b_k = _key_group(b_c, _byte(b_s8, g), b_emax)
    return tl.dot(b_q, tl.trans(b_k))


@triton.jit
def _wide_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a, b_ratio, g: tl.constexpr, PAIR: tl.constexpr):
    """WIDE_PV: P @ V over 128 columns: key groups g and g + 1 (PAIR), or group g and 64 zero
    columns, read and decoded here, into acc [BLOCK_H, 128] rescaled by ratio."""
    o_c = tl.arange(0, 128)
    m_c = m_2 & ((o_c < 64) | PAIR)[None, :]
    b_c = tl.load(p_row[:, None] + g * 64 + o_c[None, :], mask=m_c, other=0)  # [BLOCK_N, 128] codes
    if PAIR:
        b_eg = tl.where((o_c < 64)[None, :], _byte(b_s8, g)[:, None], _byte(b_s8, g + 1)[:, None])
    else:
        b_eg = _byte(b_s8, g)[:, None] + 0 * o_c[None, :]
    b_d = tl.maximum(b_eg - b_emax[:, None], -126)
    b_r = ((b_d + 127) << 23).to(tl.float32, bitcast=True).to(tl.float16)
    return tl.dot(b_pp, code_to_f16(b_c) * b_r, b_a * b_ratio)


@triton.jit
def _store_cols(p_o, b_acc, b_scale, m_h, d0: tl.constexpr, NCOL: tl.constexpr):
    """WIDE_PV: the first NCOL columns of acc [BLOCK_H, 128] * scale to dims d0.. of each row."""
    o_c = tl.arange(0, 128)
    b_o = b_acc * b_scale[:, None]
    tl.store(p_o[:, None] + d0 + o_c[None, :], b_o.to(p_o.dtype.element_ty), mask=m_h[:, None] & (o_c < NCOL)[None, :])


@triton.jit
def _dsv4_decode_v4_kernel(
    q_ptr,  # bf16 [T, H, 512], dims contiguous
    cc_ptr,  # uint8 [num_blocks_c, page_c]: the compressed cache
    topk_ptr,  # int32/int64 [T, K1] compressed slots, row stride stride_topk_t
    topk_len_ptr,  # int32/int64 [>= T] or None
    cw_ptr,  # uint8 [num_blocks_w, page_w]: the sliding-window cache
    swa_ptr,  # int32/int64 [T, K2] window slots, row stride stride_swa_t
    swa_len_ptr,  # int32/int64 [>= T] or None
    sink_ptr,  # fp32 [H] or None (DIRECT only)
    o_ptr, lse_ptr,
    plan_ptr,  # int32 plan words (csrc_triton.decode.balance) or None (BALANCED only)
    H, K1, K2, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_topk_t, stride_swa_t, stride_o_t, stride_o_h,
    page_c, bs_c, cap_c, page_w, bs_w, cap_w,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_SWA_LEN: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
    ALIGN: tl.constexpr, PV_KEY: tl.constexpr, STREAM: tl.constexpr = False, WIDE_PV: tl.constexpr = False,
    BALANCED: tl.constexpr = False,
):
    """Grid (T * S * G,) as paged_chunk128: program pid runs head group g = pid % G of token
    t = pid // (S*G) over the key blocks of split s = (pid // G) % S. DIRECT: out bf16 [T, H,
    512] / lse fp32 [T, H] (S == 1, sink folded in); else o_part fp32 [T, H, S, 512] /
    lse_part fp32 [T, H, S] contiguous (merged by csrc_triton.decode.merge). BALANCED (not DIRECT):
    program pid runs head group pid % G of partial slot pid // G as the plan words at plan_ptr say
    (csrc_triton.decode.balance), its partials written as rows [T * S, H] (merged by the merge's
    balanced form)."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)
    n_splits = S
    live = True
    if BALANCED:
        # live False: a slot no token uses runs no key block; its row is never merged
        t_b, pid_s, n_splits, live = slot_of(plan_ptr, pid // G)
        pid_t = t_b.to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    p_qrow = q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h  # [BLOCK_H]
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    b_q0 = _q_group(p_qrow, m_h, 0).to(tl.float32)  # [BLOCK_H, 64] each
    b_q1 = _q_group(p_qrow, m_h, 1).to(tl.float32)
    b_q2 = _q_group(p_qrow, m_h, 2).to(tl.float32)
    b_q3 = _q_group(p_qrow, m_h, 3).to(tl.float32)
    b_q4 = _q_group(p_qrow, m_h, 4).to(tl.float32)
    b_q5 = _q_group(p_qrow, m_h, 5).to(tl.float32)
    b_q6 = _q_group(p_qrow, m_h, 6).to(tl.float32)
    b_qr = _q_group(p_qrow, m_h, 7)  # the RoPE dims, q's dtype
    b_amax = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.abs(b_q0), 1), tl.max(tl.abs(b_q1), 1)),
                                   tl.maximum(tl.max(tl.abs(b_q2), 1), tl.max(tl.abs(b_q3), 1))),
                        tl.maximum(tl.maximum(tl.max(tl.abs(b_q4), 1), tl.max(tl.abs(b_q5), 1)),
                                   tl.max(tl.abs(b_q6), 1)))
    b_up, b_back = _row_prescale(b_amax)
    b_q0 = (b_q0 * b_up[:, None]).to(tl.float16)
    b_q1 = (b_q1 * b_up[:, None]).to(tl.float16)
    b_q2 = (b_q2 * b_up[:, None]).to(tl.float16)
    b_q3 = (b_q3 * b_up[:, None]).to(tl.float16)
    b_q4 = (b_q4 * b_up[:, None]).to(tl.float16)
    b_q5 = (b_q5 * b_up[:, None]).to(tl.float16)
    b_q6 = (b_q6 * b_up[:, None]).to(tl.float16)

    k1 = K1
    if HAS_TOPK_LEN:
        k1 = tl.minimum(tl.maximum(tl.load(topk_len_ptr + pid_t).to(tl.int32), 0), K1)
    k2 = K2
    if HAS_SWA_LEN:
        k2 = tl.minimum(tl.maximum(tl.load(swa_len_ptr + pid_t).to(tl.int32), 0), K2)
    nb1 = (k1 + BLOCK_N - 1) // BLOCK_N
    nb = nb1 + (k2 + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * nb) // n_splits
    blk_hi = ((pid_s + 1) * nb) // n_splits
    if BALANCED:
        blk_hi = tl.where(live, blk_hi, blk_lo)
    p_tk = topk_ptr + pid_t * stride_topk_t
    p_sw = swa_ptr + pid_t * stride_swa_t

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_rf = (b_back * qk_scale)[:, None]  # NoPE scores: undo 2**-8 of the codes and q's 2**e
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running denominator
    b_a0 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)  # unnormalised p @ v, dims 64g..64g+63
    b_a1 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a4 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a5 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_a6 = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    b_ar = tl.zeros([BLOCK_H, 64], dtype=tl.float32)
    if WIDE_PV:  # 128-column accumulators: dims 0-127, 128-255, 256-383, 384-447 (+ 64 zero), RoPE (+ 64 zero)
        b_w0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
        b_w1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
        b_w2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
        b_w3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
        b_wr = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    b_u = tl.zeros([BLOCK_H], dtype=tl.float32)  # PV_KEY: NoPE acc units (true = acc * u * 2**8)
    o_e = tl.arange(0, 64)
    for blk in range(blk_lo, blk_hi):
        # bs_c / bs_w hold log2 of the (power-of-two) block sizes: the launcher runs v3 otherwise
        m_n, p_cache, o_data, o_scale = _block_rows(
            blk, nb1, k1, k2, p_tk, p_sw, cc_ptr, cw_ptr, page_c, bs_c, cap_c, page_w, bs_w, cap_w, BLOCK_N)
        p_row = p_cache + o_data  # [BLOCK_N] pointers to the data rows
        if ALIGN:
            p_row = tl.multiple_of(p_row, 16)
        m_2 = m_n[:, None]
        b_c0 = _codes(p_row, m_2, 0)  # [BLOCK_N, 64] uint8 each
        b_c1 = _codes(p_row, m_2, 1)
        b_c2 = _codes(p_row, m_2, 2)
        b_c3 = _codes(p_row, m_2, 3)
        b_c4 = _codes(p_row, m_2, 4)
        b_c5 = _codes(p_row, m_2, 5)
        b_c6 = _codes(p_row, m_2, 6)
        p_rope = (p_row + _NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)  # [BLOCK_N]
        if ALIGN:
            p_rope = tl.multiple_of(p_rope, 16)
        b_kr = tl.load(p_rope[:, None] + o_e[None, :], mask=m_2, other=0).to(tl.bfloat16, bitcast=True).to(DTYPE)
        if ALIGN:
            p_sc = tl.multiple_of((p_cache + o_scale).to(tl.pointer_type(tl.uint64), bitcast=True), 8)
            b_s8 = tl.load(p_sc, mask=m_n, other=0)  # [BLOCK_N]: the 8 scale bytes, little-endian
        else:
            p_s2 = (p_cache + o_scale).to(tl.pointer_type(tl.uint16), bitcast=True)
            b_s8 = tl.load(p_s2, mask=m_n, other=0).to(tl.uint64)
            b_s8 = b_s8 | (tl.load(p_s2 + 1, mask=m_n, other=0).to(tl.uint64) << 16)
            b_s8 = b_s8 | (tl.load(p_s2 + 2, mask=m_n, other=0).to(tl.uint64) << 32)
            b_s8 = b_s8 | (tl.load(p_s2 + 3, mask=m_n, other=0).to(tl.uint64) << 48)
        if WIDE_PV:  # q's RoPE dims re-read too, in 32-dim halves (no [BLOCK_H, 64] A operand held)
            o_h32 = tl.arange(0, 32)
            b_rope = tl.dot(tl.load(p_qrow[:, None] + 448 + o_h32[None, :], mask=m_h[:, None], other=0.0),
                            tl.trans(tl.load(p_rope[:, None] + o_h32[None, :], mask=m_2, other=0)
                                     .to(tl.bfloat16, bitcast=True).to(DTYPE)))
            b_rope += tl.dot(tl.load(p_qrow[:, None] + 480 + o_h32[None, :], mask=m_h[:, None], other=0.0),
                             tl.trans(tl.load(p_rope[:, None] + 32 + o_h32[None, :], mask=m_2, other=0)
                                      .to(tl.bfloat16, bitcast=True).to(DTYPE)))
            b_rope = b_rope * qk_scale
        else:
            b_rope = tl.dot(b_qr, tl.trans(b_kr)) * qk_scale
        if STREAM:
            # 64 heads a program: the 8 [64, 64] fp32 accumulators take the registers, so no key
            # group (nor q) stays live across the softmax: each group is read, decoded and dotted
            # for the scores, then read and decoded again for P @ V
            b_emax = tl.maximum(tl.maximum(tl.maximum(_byte(b_s8, 0), _byte(b_s8, 1)),
                                           tl.maximum(_byte(b_s8, 2), _byte(b_s8, 3))),
                                tl.maximum(tl.maximum(_byte(b_s8, 4), _byte(b_s8, 5)), _byte(b_s8, 6)))
            b_F = ue8m0_to_f32(b_emax.to(tl.uint8))
            if WIDE_PV:
                b_s = _half_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 0, 0)
                for _g in tl.static_range(7):
                    for _h in tl.static_range(2):
                        if _g + _h > 0:
                            b_s += _half_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, _g, _h)
            else:
                b_s = _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 0)
                b_s += _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 1)
                b_s += _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 2)
                b_s += _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 3)
                b_s += _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 4)
                b_s += _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 5)
                b_s += _stream_score(p_qrow, m_h, b_up, p_row, m_2, b_s8, b_emax, 6)
            b_s = (b_s * b_rf) * b_F[None, :] + b_rope
        elif PV_KEY:
            # every group as fp16 value * 2**-8 / 2**(e_max - 127): one scale a key (F)
            b_e0 = _byte(b_s8, 0)  # [BLOCK_N] int32 each
            b_e1 = _byte(b_s8, 1)
            b_e2 = _byte(b_s8, 2)
            b_e3 = _byte(b_s8, 3)
            b_e4 = _byte(b_s8, 4)
            b_e5 = _byte(b_s8, 5)
            b_e6 = _byte(b_s8, 6)
            b_emax = tl.maximum(tl.maximum(tl.maximum(b_e0, b_e1), tl.maximum(b_e2, b_e3)),
                                tl.maximum(tl.maximum(b_e4, b_e5), b_e6))
            b_F = ue8m0_to_f32(b_emax.to(tl.uint8))  # [BLOCK_N] 2**(e_max - 127)
            b_k0 = _key_group(b_c0, b_e0, b_emax)  # [BLOCK_N, 64] fp16 each
            b_k1 = _key_group(b_c1, b_e1, b_emax)
            b_k2 = _key_group(b_c2, b_e2, b_emax)
            b_k3 = _key_group(b_c3, b_e3, b_emax)
            b_k4 = _key_group(b_c4, b_e4, b_emax)
            b_k5 = _key_group(b_c5, b_e5, b_emax)
            b_k6 = _key_group(b_c6, b_e6, b_emax)
            # scores: 7 independent fp16 group dots (no serial mma chain), then the key scale
            b_s = ((tl.dot(b_q0, tl.trans(b_k0)) + tl.dot(b_q1, tl.trans(b_k1)))
                   + (tl.dot(b_q2, tl.trans(b_k2)) + tl.dot(b_q3, tl.trans(b_k3))))
            b_s += ((tl.dot(b_q4, tl.trans(b_k4)) + tl.dot(b_q5, tl.trans(b_k5)))
                    + tl.dot(b_q6, tl.trans(b_k6)))
            b_s = (b_s * b_rf) * b_F[None, :] + b_rope
        else:
            b_f0 = _scale(b_s8, 0)  # [BLOCK_N] fp32 each
            b_f1 = _scale(b_s8, 1)
            b_f2 = _scale(b_s8, 2)
            b_f3 = _scale(b_s8, 3)
            b_f4 = _scale(b_s8, 4)
            b_f5 = _scale(b_s8, 5)
            b_f6 = _scale(b_s8, 6)
            b_k0 = _group_f16(b_c0, m_2)  # [BLOCK_N, 64] fp16 each: value * 2**-8
            b_k1 = _group_f16(b_c1, m_2)
            b_k2 = _group_f16(b_c2, m_2)
            b_k3 = _group_f16(b_c3, m_2)
            b_k4 = _group_f16(b_c4, m_2)
            b_k5 = _group_f16(b_c5, m_2)
            b_k6 = _group_f16(b_c6, m_2)
            # scores: 7 independent fp16 group dots, each times its scales
            b_s = tl.dot(b_q0, tl.trans(b_k0)) * b_f0[None, :]
            b_s += tl.dot(b_q1, tl.trans(b_k1)) * b_f1[None, :]
            b_s += tl.dot(b_q2, tl.trans(b_k2)) * b_f2[None, :]
            b_s += tl.dot(b_q3, tl.trans(b_k3)) * b_f3[None, :]
            b_s += tl.dot(b_q4, tl.trans(b_k4)) * b_f4[None, :]
            b_s += tl.dot(b_q5, tl.trans(b_k5)) * b_f5[None, :]
            b_s += tl.dot(b_q6, tl.trans(b_k6)) * b_f6[None, :]
            b_s = b_s * b_rf + b_rope
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))

        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)[:, None]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N], in [0, 1]
        b_l = b_l * tl.reshape(b_alpha, [BLOCK_H]) + tl.sum(b_p, 1)
        b_m = b_m_new
        if PV_KEY or STREAM:
            # p' = p F / u (u: the NoPE accumulators' per-row unit, the power of two at or above
            # both max p F of this block and the old unit times alpha: p' <= 1 in fp16's 10
            # mantissa bits); the accumulators (in units of u) rescaled by alpha u_old / u <= 1.
            # (A unit strictly above would double every block: p' underflowed after ~20 blocks.)
            b_pf = b_p * b_F[None, :]
            b_ua = b_u * tl.reshape(b_alpha, [BLOCK_H])
            b_u, b_uinv = _pow2_ceil(tl.maximum(b_ua, tl.max(b_pf, 1)))  # powers of two
            b_ratio = (b_ua * b_uinv)[:, None]  # <= 1
            b_pp = (b_pf * b_uinv[:, None]).to(tl.float16)
        if WIDE_PV:
            b_w0 = _wide_pv(b_pp, p_row, m_2, b_s8, b_emax, b_w0, b_ratio, 0, True)
            b_w1 = _wide_pv(b_pp, p_row, m_2, b_s8, b_emax, b_w1, b_ratio, 2, True)
            b_w2 = _wide_pv(b_pp, p_row, m_2, b_s8, b_emax, b_w2, b_ratio, 4, True)
            b_w3 = _wide_pv(b_pp, p_row, m_2, b_s8, b_emax, b_w3, b_ratio, 6, False)
        elif STREAM:
            b_a0 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a0, b_ratio, 0)
            b_a1 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a1, b_ratio, 1)
            b_a2 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a2, b_ratio, 2)
            b_a3 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a3, b_ratio, 3)
            b_a4 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a4, b_ratio, 4)
            b_a5 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a5, b_ratio, 5)
            b_a6 = _stream_pv(b_pp, p_row, m_2, b_s8, b_emax, b_a6, b_ratio, 6)
        elif PV_KEY:
            b_a0 = tl.dot(b_pp, b_k0, b_a0 * b_ratio)
            b_a1 = tl.dot(b_pp, b_k1, b_a1 * b_ratio)
            b_a2 = tl.dot(b_pp, b_k2, b_a2 * b_ratio)
            b_a3 = tl.dot(b_pp, b_k3, b_a3 * b_ratio)
            b_a4 = tl.dot(b_pp, b_k4, b_a4 * b_ratio)
            b_a5 = tl.dot(b_pp, b_k5, b_a5 * b_ratio)
            b_a6 = tl.dot(b_pp, b_k6, b_a6 * b_ratio)
        else:
            b_a0 = _pv(b_p, b_f0, b_k0, b_a0, b_alpha)
            b_a1 = _pv(b_p, b_f1, b_k1, b_a1, b_alpha)
            b_a2 = _pv(b_p, b_f2, b_k2, b_a2, b_alpha)
            b_a3 = _pv(b_p, b_f3, b_k3, b_a3, b_alpha)
            b_a4 = _pv(b_p, b_f4, b_k4, b_a4, b_alpha)
            b_a5 = _pv(b_p, b_f5, b_k5, b_a5, b_alpha)
            b_a6 = _pv(b_p, b_f6, b_k6, b_a6, b_alpha)
        if WIDE_PV:
            # the RoPE dims beside 64 zero columns: every P @ V dot 128 wide, so Triton lays the MMA
            # out as [1, num_warps] (no warp holds another's rows at 64 heads)
            o_c = tl.arange(0, 128)
            b_krw = tl.load(p_rope[:, None] + o_c[None, :], mask=m_2 & (o_c < 64)[None, :], other=0)
            b_krw = b_krw.to(tl.bfloat16, bitcast=True).to(DTYPE)
            b_wr = tl.dot(b_p.to(DTYPE), b_krw, b_wr * b_alpha)
        else:
            b_ar = tl.dot(b_p.to(DTYPE), b_kr, b_ar * b_alpha)

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
        if BALANCED:
            row = (pid // G).to(tl.int64) * H + o_h.to(tl.int64)  # [BLOCK_H] row of [T * S, H]
        else:
            row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
        p_o = o_ptr + row * 512
        tl.store(lse_ptr + row, b_lse, mask=m_h)
    b_ns = b_scale
    if PV_KEY or STREAM:
        b_ns = b_scale * (b_u * 256.0)
    if WIDE_PV:
        _store_cols(p_o, b_w0, b_ns, m_h, 0, 128)
        _store_cols(p_o, b_w1, b_ns, m_h, 128, 128)
        _store_cols(p_o, b_w2, b_ns, m_h, 256, 128)
        _store_cols(p_o, b_w3, b_ns, m_h, 384, 64)
        _store_cols(p_o, b_wr, b_scale, m_h, 448, 64)
    else:
        _store_group(p_o, b_a0, b_ns, m_h, 0)
        _store_group(p_o, b_a1, b_ns, m_h, 1)
        _store_group(p_o, b_a2, b_ns, m_h, 2)
        _store_group(p_o, b_a3, b_ns, m_h, 3)
        _store_group(p_o, b_a4, b_ns, m_h, 4)
        _store_group(p_o, b_a5, b_ns, m_h, 5)
        _store_group(p_o, b_a6, b_ns, m_h, 6)
        _store_group(p_o, b_ar, b_scale, m_h, 7)


@triton.jit
def _store_group(p_o, b_acc, b_scale, m_h, g: tl.constexpr):
    o_e = tl.arange(0, 64)
    b_o = b_acc * b_scale[:, None]
    tl.store(p_o[:, None] + g * 64 + o_e[None, :], b_o.to(p_o.dtype.element_ty), mask=m_h[:, None])


# Launch configs (AOT table: no spills on sm_80/86 for the dispatched ones), measured by
# benchmarks/bench_decode_paged.py beside the v3 configs. Names: k = PV_KEY (one scale a key in
# the dots), g = per-group P (PV_KEY False); h heads, n keys a block, w warps, s stages.
V4_CANDIDATES = {
    f"{pre}h{bh}n{bn}w{w}" + ("" if st == 2 else f"s{st}"): {
        "BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "PV_KEY": key}
    for key, pre in ((True, "k"), (False, "g"))
    for bh, bn, w, st in ((16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 4, 2), (16, 16, 4, 2), (16, 32, 8, 2),
                          (32, 32, 4, 2), (32, 32, 8, 2), (64, 16, 8, 2), (64, 32, 8, 2), (16, 64, 8, 2),
                          (32, 64, 8, 2), (32, 16, 4, 2), (16, 32, 4, 1), (16, 128, 8, 2))}
# Register-capped forms (suffix r<N>: ptxas maxnreg N) for more co-resident programs an SM
# (registers, not shared memory, bind at 255): AOT sm_80 spills: kh16n16w4r168 8 B (3 an SM),
# kh16n32w4r168 328 B (3), kh16n32w8r128 44 B (2 x 8 warps), kh16n16w4r128 256 B (4).
for _name, _base, _reg in (("kh16n16w4r168", "kh16n16w4", 168), ("kh16n32w4r168", "kh16n32w4", 168),
                           ("kh16n32w8r128", "kh16n32w8", 128), ("kh16n16w4r128", "kh16n16w4", 128)):
    V4_CANDIDATES[_name] = dict(V4_CANDIDATES[_base], maxnreg=_reg)
# Streamed forms (prefix s: PV_KEY with STREAM, each key group read and decoded for the scores and
# again for P @ V, q re-read: no key tile live across the softmax), for wide head groups. AOT sm_80:
# sh32n32w4 / sh32n32w8 255 registers, 0 spills, 70 KB (fits sm_86's 99 KB, and two a block on an
# A100's 163 KB); 64 heads a program spills at every block shape and warp count tried (sh64n16w8:
# 13 KB, sh64n32w8: 16 KB, sh64n16w4: 19 KB; without STREAM kh64n32w8 10 KB, kh64n32w16 11 KB):
# benchmark candidates only (benchmarks/results/decode_sms_heads.md).
for _bh, _bn, _w in ((32, 32, 4), (32, 32, 8), (32, 16, 4), (64, 16, 8), (64, 32, 8), (16, 64, 8), (16, 64, 4),
                     (16, 128, 8)):
    V4_CANDIDATES[f"sh{_bh}n{_bn}w{_w}"] = {"BLOCK_H": _bh, "BLOCK_N": _bn, "num_warps": _w, "num_stages": 2,
                                            "PV_KEY": True, "STREAM": True}
# Wide P @ V (prefix w: STREAM with every P @ V dot 128 columns wide, the RoPE and the last NoPE group
# beside 64 zero columns, the score dots in 32-dim halves) for 64 heads a program: Triton then lays the
# chained MMAs out as [1, 8] instead of [8, 1] (which holds every 64-row accumulator twice: 13-16 KB of
# spills for sh64...). AOT sm_80: wh64n16w8 255 registers, 1548 B of spills, 86 KB; wh64n32w8 1652 B,
# 119 KB: benchmark candidates only, not measured yet (benchmarks/results/decode_sms_heads_prediction.md).
for _bh, _bn, _w in ((64, 32, 8), (64, 16, 8)):
    V4_CANDIDATES[f"wh{_bh}n{_bn}w{_w}"] = {"BLOCK_H": _bh, "BLOCK_N": _bn, "num_warps": _w, "num_stages": 2,
                                            "PV_KEY": True, "STREAM": True, "WIDE_PV": True}
# The configs dispatch.decode.resolve_config can pick (listed for the AOT compile).
V4_DISPATCHED = ("kh16n32w4", "kh16n64w8", "kh32n64w8")
# Shared memory a block of a config takes where it is over sm_86's 99 KiB, bytes (the AOT
# table's sm_80 figure, tests/test_decode_paged.py checks it): such a config is compiled only for
# the archs that hold it (aot.KernelSpec.archs) and dispatched only on a device whose blocks may
# opt into it (dispatch.windows.CONFIG_WINDOWS, dispatch.configs.config_fits).
V4_SMEM_BYTES = {"kh32n64w8": 108544}
