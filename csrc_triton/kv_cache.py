"""Paged fp8 KV cache (584-byte ``fp8_ds_mla`` records): quantize-and-insert, gather+dequantize.

The record layout comes from ``dsv4_ops.layout`` (data rows of a block, then its scale rows).
Both kernels do all block/slot/page arithmetic in int64 and mask every slot outside
``[0, capacity)`` inside the kernel: such a slot loads nothing and writes nothing (insert) or
writes a zero row (gather).
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from .codec import e4m3_to_f32, f32_to_e4m3

# Layout constants as Triton globals (taken from dsv4_ops.layout, never retyped here).
NOPE_DIM = tl.constexpr(_L.NOPE_DIM)
ROPE_DIM = tl.constexpr(_L.ROPE_DIM)
HEAD_DIM = tl.constexpr(_L.HEAD_DIM)
QUANT_GROUP = tl.constexpr(_L.QUANT_GROUP)
NUM_SCALES = tl.constexpr(_L.NUM_SCALES)
GROUPS = tl.constexpr(_L.HEAD_DIM // _L.QUANT_GROUP)  # 8: 7 NoPE groups + the RoPE group
DATA_BYTES = tl.constexpr(_L.DATA_BYTES)
SCALE_BYTES = tl.constexpr(_L.SCALE_BYTES)
UE8M0_BIAS = tl.constexpr(_L.UE8M0_BIAS)
UE8M0_MIN_EXP = tl.constexpr(_L.UE8M0_MIN_EXP)

assert _L.SCALE_BYTES == _L.HEAD_DIM // _L.QUANT_GROUP  # the scale row is one byte per group


@triton.jit
def ue8m0_exponent(b_amax):
    """float32 block of group amax values (>= 0) -> int32 block of UE8M0 exponents.

    e = ceil(log2(max(amax, 1e-4) / 448)), exactly, with integer operations: for
    amax = m * 2**E (m in [1, 2)), amax <= 448 * 2**e = 1.75 * 2**(e + 8) holds first at
    e = E - 8 when m <= 1.75 and at e = E - 7 otherwise; the 1e-4 floor is e >= -22.
    (1.75 is mantissa field 0x600000.) Zero and fp32 subnormals give <= -22, so the floor.
    """
    b_bits = b_amax.to(tl.int32, bitcast=True)
    b_exp = ((b_bits >> 23) & 0xFF) - 127
    b_e = b_exp - 8 + ((b_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(b_e, UE8M0_MIN_EXP)


@triton.jit
def ue8m0_to_f32(b_byte):
    """uint8 block of UE8M0 bytes -> float32 2**(byte - 127), exact for all 256 bytes.

    Built from bits: byte b >= 1 is the fp32 exponent field; byte 0 is 2**-127 (an fp32
    subnormal, 0x00400000); byte 255 is +inf. The writer only produces bytes in [105, 247].
    """
    b_b = b_byte.to(tl.int32)
    b_bits = tl.where(b_b == 0, 0x00400000, b_b << 23)
    return b_bits.to(tl.float32, bitcast=True)


@triton.jit
def _record_offsets(slot_ptr, o_i, n, page_bytes, block_size, capacity):
    """Slots of entries o_i (int64 [B]) -> (valid [B], data-row byte offset [B], scale-row byte
    offset [B]), all int64. An entry past n or a slot outside [0, capacity) is invalid; its
    offsets point at slot 0 and must be masked by the caller."""
    m_i = o_i < n
    b_slot = tl.load(slot_ptr + o_i, mask=m_i, other=-1).to(tl.int64)
    m_valid = m_i & (b_slot >= 0) & (b_slot < capacity)
    b_slot = tl.where(m_valid, b_slot, 0)
    b_blk = b_slot // block_size
    b_pos = b_slot % block_size
    o_data = b_blk * page_bytes + b_pos * DATA_BYTES
    o_scale = b_blk * page_bytes + block_size * DATA_BYTES + b_pos * SCALE_BYTES
    return m_valid, o_data, o_scale


@triton.jit(do_not_specialize=["n_tokens"])  # data-dependent count: one specialization
def _kv_cache_insert_kernel(
    kv_ptr,  # bf16 [N, 512], row stride stride_kv_0, dims contiguous
    cache_ptr,  # uint8 [num_blocks, page_bytes]
    slot_ptr,  # int64 or int32 [n_tokens]
    n_tokens,
    stride_kv_0,
    page_bytes,
    block_size,
    capacity,  # num_blocks * block_size
    MODE: tl.constexpr,  # csrc_triton.codec.ENCODE_EXACT (portable) or ENCODE_NATIVE
    TOKENS: tl.constexpr,  # tokens per program
):
    """Grid (cdiv(n_tokens, TOKENS),): each program quantizes TOKENS kv rows into their records.

    A token whose slot is outside [0, capacity) (slot < 0: padding) loads and stores nothing.
    """
    o_t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    m_valid, o_data, o_scale = _record_offsets(slot_ptr, o_t, n_tokens, page_bytes, block_size, capacity)

    o_g = tl.arange(0, GROUPS)  # [8]
    o_d = tl.arange(0, QUANT_GROUP)  # [64]
    o_dim = o_g[:, None] * QUANT_GROUP + o_d[None, :]  # [8, 64]: dims 0..511
    m_v3 = m_valid[:, None, None]
    m_nope = m_v3 & (o_g[None, :, None] < NUM_SCALES)  # [TOKENS, 8, 1]

    # NoPE: [TOKENS, 8, 64] with group 7 (the RoPE dims) masked off.
    p_kv = kv_ptr + (o_t * stride_kv_0)[:, None, None] + o_dim[None, :, :]
    b_x = tl.load(p_kv, mask=m_nope, other=0.0).to(tl.float32)  # [TOKENS, 8, 64]
    b_amax = tl.max(tl.abs(b_x), axis=2)  # [TOKENS, 8]
    b_e = ue8m0_exponent(b_amax)  # [TOKENS, 8] int32
    b_inv = ((127 - b_e) << 23).to(tl.float32, bitcast=True)  # 2**-e, e in [-22, 121]
    b_codes = f32_to_e4m3(b_x * b_inv[:, :, None], MODE)  # exact: power-of-two scale
    tl.store(cache_ptr + o_data[:, None, None] + o_dim[None, :, :], b_codes, mask=m_nope)

    # Scale row: bytes e + 127 for groups 0..6, the pad byte 0 at 7. [TOKENS, 8]
    b_sbyte = tl.where(o_g[None, :] < NUM_SCALES, b_e + UE8M0_BIAS, 0).to(tl.uint8)
    tl.store(cache_ptr + o_scale[:, None] + o_g[None, :], b_sbyte, mask=m_valid[:, None])

    # RoPE: 64 bf16 values copied as 16-bit words to data bytes 448..575. [TOKENS, 64]
    o_r = tl.arange(0, ROPE_DIM)
    p_src = kv_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + (o_t * stride_kv_0 + NOPE_DIM)[:, None] + o_r[None, :]
    b_rope = tl.load(p_src, mask=m_valid[:, None], other=0)
    p_dst = (cache_ptr + o_data + NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)
    tl.store(p_dst[:, None] + o_r[None, :], b_rope, mask=m_valid[:, None])


@triton.jit(do_not_specialize=["n"])  # data-dependent count: one specialization
def _kv_cache_gather_kernel(
    cache_ptr,  # uint8 [num_blocks, page_bytes]
    slot_ptr,  # int64 or int32 [n], any order, repeats allowed
    out_ptr,  # bf16 [n, 512], row stride stride_out_0, dims contiguous
    n,
    stride_out_0,
    page_bytes,
    block_size,
    capacity,  # num_blocks * block_size
    NATIVE: tl.constexpr,  # E4M3 decode through fp8e4nv (sm_89+) instead of fp8e4b15
    ROWS: tl.constexpr,  # output rows per program
):
    """Grid (cdiv(n, ROWS),): each program dequantizes the records of ROWS slots into bf16 rows.

    Row i is e4m3(code[d]) * 2**(scale[d // 64] - 127) for d < 448, then the raw bf16 RoPE
    dims; a slot outside [0, capacity) reads nothing and gives a zero row.
    """
    o_i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    m_i = o_i < n
    m_valid, o_data, o_scale = _record_offsets(slot_ptr, o_i, n, page_bytes, block_size, capacity)
    o_row = o_i * stride_out_0  # [ROWS] int64

    o_g = tl.arange(0, GROUPS)[None, :, None]  # [1, 8, 1]
    o_d = tl.arange(0, QUANT_GROUP)[None, None, :]  # [1, 1, 64]
    m_nope = m_valid[:, None, None] & (o_g < NUM_SCALES)  # [ROWS, 8, 1]
    m_out = m_i[:, None, None] & (o_g < NUM_SCALES)

    # NoPE: [ROWS, 8, 64] codes (group 7 masked), one scale per [row, group].
    b_codes = tl.load(cache_ptr + o_data[:, None, None] + o_g * QUANT_GROUP + o_d, mask=m_nope, other=0)
    b_sbyte = tl.load(cache_ptr + o_scale[:, None, None] + o_g, mask=m_nope, other=0)  # [ROWS, 8, 1]
    b_val = e4m3_to_f32(b_codes, NATIVE) * ue8m0_to_f32(b_sbyte)  # [ROWS, 8, 64] fp32, exact
    b_val = tl.where(m_nope, b_val, 0.0)
    tl.store(out_ptr + o_row[:, None, None] + o_g * QUANT_GROUP + o_d, b_val.to(tl.bfloat16), mask=m_out)

    # RoPE: 64 bf16 values copied as 16-bit words. [ROWS, 64]
    o_r = tl.arange(0, ROPE_DIM)[None, :]
    p_src = (cache_ptr + o_data + NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)
    b_rope = tl.load(p_src[:, None] + o_r, mask=m_valid[:, None], other=0)
    p_dst = out_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + (o_row + NOPE_DIM)[:, None] + o_r
    tl.store(p_dst, b_rope, mask=m_i[:, None])


# Launch configs as plain data (same on sm_80/86 and newer): memory-bound, small tiles.
INSERT_CONFIG = {"TOKENS": 4, "num_warps": 2}  # benchmarks/results/kv_cache_configs.md; 16 spills on sm_80
GATHER_CONFIG = {"ROWS": 16, "num_warps": 4}  # benchmarks/results/kv_cache_configs.md


@triton.jit(do_not_specialize=["T"])  # data-dependent count: one specialization
def _dsv4_decode_gather_kernel(
    cc_ptr,  # uint8 [num_blocks_c, page_c]: the compressed cache
    topk_ptr,  # int32/int64 [T, K1] compressed slots, row stride stride_topk_t
    topk_len_ptr,  # int32 [T] or None: top-k entries j >= topk_len[t] are ignored
    cw_ptr,  # uint8 [num_blocks_w, page_w]: the sliding-window cache
    swa_ptr,  # int32/int64 [T, K2] window slots, row stride stride_swa_t
    swa_len_ptr,  # int32 [T] or None: window entries j >= swa_len[t] are ignored
    ws_ptr,  # bf16 [>= T*(K1+K2), 512] workspace, contiguous
    idx_ptr,  # int32 [T, K1 + K2] contiguous: the attention indices (rows of ws, -1: none)
    T, K1, K2, stride_topk_t, stride_swa_t,
    page_c, bs_c, cap_c, page_w, bs_w, cap_w,
    NATIVE: tl.constexpr, ROWS: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_SWA_LEN: tl.constexpr,
):
    """Grid (cdiv(T*K1, ROWS) + cdiv(T*K2, ROWS),): both gathers of a DSv4 decode step and
    its index build in one launch. Programs [0, cdiv(T*K1, ROWS)) take ROWS compressed rows
    (workspace row r = t*K1 + j), the rest ROWS window rows (row T*K1 + t*K2 + j). Each row is
    dequantized as in _kv_cache_gather_kernel (zero for an unused entry) and its index
    (the row, or -1 when the slot is outside [0, capacity) or j >= the token's length) goes
    to indices[t, j] (window: column K1 + j)."""
    pid = tl.program_id(0)
    n_prog_c = (T * K1 + ROWS - 1) // ROWS
    is_c = pid < n_prog_c  # scalar: this program gathers compressed rows (else window rows)
    is_w = pid >= n_prog_c
    # Scalars of this program's cache, selected without control flow (operand types may differ).
    p_cache = tl.where(is_c, cc_ptr, cw_ptr)
    page = tl.where(is_c, page_c, page_w).to(tl.int64)
    bs = tl.where(is_c, bs_c, bs_w).to(tl.int64)
    cap = tl.where(is_c, cap_c, cap_w).to(tl.int64)
    k_part = tl.where(is_c, K1, K2)
    o_r = tl.where(is_c, pid, pid - n_prog_c).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] rows of the part
    m_r = o_r < T * k_part
    o_t = o_r // tl.maximum(k_part, 1)  # [ROWS] token
    o_j = o_r - o_t * k_part  # [ROWS] entry of the token
    b_sc = tl.load(topk_ptr + o_t * stride_topk_t + o_j, mask=m_r & is_c, other=-1).to(tl.int64)
    b_sw = tl.load(swa_ptr + o_t * stride_swa_t + o_j, mask=m_r & is_w, other=-1).to(tl.int64)
    b_slot = tl.where(is_c, b_sc, b_sw)  # [ROWS]
    m_use = m_r
    if HAS_TOPK_LEN:
        b_len = tl.load(topk_len_ptr + o_t, mask=m_r & is_c, other=0)
        m_use = m_use & (is_w | (o_j < b_len))
    if HAS_SWA_LEN:
        b_len_w = tl.load(swa_len_ptr + o_t, mask=m_r & is_w, other=0)
        m_use = m_use & (is_c | (o_j < b_len_w))
    o_ws = tl.where(is_c, o_r, T * K1 + o_r)  # [ROWS] workspace row
    o_col = tl.where(is_c, o_j, K1 + o_j)  # [ROWS] column of indices
    m_valid = m_use & (b_slot >= 0) & (b_slot < cap)  # [ROWS]
    b_slot = tl.where(m_valid, b_slot, 0)
    b_blk = b_slot // bs
    b_pos = b_slot % bs
    o_data = b_blk * page + b_pos * DATA_BYTES  # [ROWS] int64
    o_scale = b_blk * page + bs * DATA_BYTES + b_pos * SCALE_BYTES
    tl.store(idx_ptr + o_t * (K1 + K2) + o_col, tl.where(m_valid, o_ws, -1).to(tl.int32), mask=m_r)

    o_row = o_ws * HEAD_DIM  # [ROWS] int64 element offset of the workspace row
    o_g = tl.arange(0, GROUPS)[None, :, None]  # [1, 8, 1]
    o_d = tl.arange(0, QUANT_GROUP)[None, None, :]  # [1, 1, 64]
    m_nope = m_valid[:, None, None] & (o_g < NUM_SCALES)  # [ROWS, 8, 1]
    m_out = m_r[:, None, None] & (o_g < NUM_SCALES)
    b_codes = tl.load(p_cache + o_data[:, None, None] + o_g * QUANT_GROUP + o_d, mask=m_nope, other=0)
    b_sbyte = tl.load(p_cache + o_scale[:, None, None] + o_g, mask=m_nope, other=0)  # [ROWS, 8, 1]
    b_val = e4m3_to_f32(b_codes, NATIVE) * ue8m0_to_f32(b_sbyte)  # [ROWS, 8, 64] fp32, exact
    b_val = tl.where(m_nope, b_val, 0.0)
    tl.store(ws_ptr + o_row[:, None, None] + o_g * QUANT_GROUP + o_d, b_val.to(tl.bfloat16), mask=m_out)

    o_rr = tl.arange(0, ROPE_DIM)[None, :]  # [1, 64]
    p_src = (p_cache + o_data + NOPE_DIM).to(tl.pointer_type(tl.uint16), bitcast=True)
    b_rope = tl.load(p_src[:, None] + o_rr, mask=m_valid[:, None], other=0)  # [ROWS, 64]
    p_dst = ws_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + (o_row + NOPE_DIM)[:, None] + o_rr
    tl.store(p_dst, b_rope, mask=m_r[:, None])


DECODE_GATHER_CONFIG = {"ROWS": 8, "num_warps": 4}  # 16 rows x 4 warps spills up to 436 B on sm_80 (AOT)
