"""DeepSeek-V3.2 / GLM-5 MLA cache kernels: insert (ops ``v32_kv_insert``) and gather +
dequantize (``v32_kv_gather``, ``v32_kv_gather_into``) of the 656-byte ``fp8_ds_mla`` records
and the bf16 ``auto`` rows of 576 (layouts: dsv4_ops.layout, V3.2 section).

Addressing (both formats): slot s -> record ``(s // block_size) * stride_blk + (s % block_size)
* stride_rec`` in int64 (bytes for fp8_ds_mla, bf16 elements for auto). A slot outside
``[0, capacity)`` loads nothing and writes nothing (insert) or writes a zero row (gather).

The fp8 path holds no fp8 pointer or fp8 dtype on the portable variant: codes are written
by csrc_triton.codec.f32_to_e4m3 (ENCODE_EXACT: integer bit work plus one fp32 add, RNE,
saturating) and read by e4m3_to_f32 (fp8e4b15 reinterpretation).
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from .codec import e4m3_to_f32, f32_to_e4m3
from .kv_cache import ue8m0_exponent

NOPE = tl.constexpr(_L.V32_NOPE_DIM)  # 512
ROPE = tl.constexpr(_L.V32_ROPE_DIM)  # 64
TILE = tl.constexpr(_L.V32_TILE)  # 128
TILES = tl.constexpr(_L.V32_NUM_TILES)  # 4
SCALE_OFF = tl.constexpr(_L.V32_SCALE_OFFSET)  # 512
ROPE_OFF = tl.constexpr(_L.V32_ROPE_OFFSET)  # 528
QK = tl.constexpr(_L.V32_HEAD_DIM_QK)  # 576
MIN_EXP = tl.constexpr(_L.V32_MIN_EXP)  # -13

assert _L.V32_MIN_EXP > _L.UE8M0_MIN_EXP  # ue8m0_exponent's own floor never binds here


@triton.jit
def _slot_records(slot_ptr, o_i, n, block_size, stride_blk, stride_rec, capacity):
    """Slots of entries o_i (int64 [B]) -> (valid [B], record offset int64 [B]). An entry past
    n or a slot outside [0, capacity) is invalid; its offset is slot 0's and must be masked."""
    m_i = o_i < n
    b_slot = tl.load(slot_ptr + o_i, mask=m_i, other=-1).to(tl.int64)
    m_valid = m_i & (b_slot >= 0) & (b_slot < capacity)
    b_slot = tl.where(m_valid, b_slot, 0)
    b_blk = b_slot // block_size
    return m_valid, b_blk * stride_blk + (b_slot - b_blk * block_size) * stride_rec


@triton.jit
def _v32_kv_insert_kernel(
    kv_c_ptr,  # bf16 [N, 512] (fp32 too when FP8), row stride stride_kvc, dims contiguous
    k_pe_ptr,  # bf16 [N, 64], row stride stride_kpe, dims contiguous
    cache_ptr,  # uint8 (FP8) or bf16 (auto) [num_blocks, block_size, 656 | 576]
    slot_ptr,  # int64 / int32 [n]
    n, stride_kvc, stride_kpe, block_size, stride_blk, stride_rec, capacity,
    FP8: tl.constexpr,  # True: fp8_ds_mla records; False: bf16 rows (auto)
    MODE: tl.constexpr,  # csrc_triton.codec.ENCODE_EXACT (portable) or ENCODE_NATIVE (FP8 only)
    TOKENS: tl.constexpr,  # tokens per program
):
    """Grid (cdiv(n, TOKENS),): each program writes the records of TOKENS tokens.

    FP8, per 128-dim tile: e = max(ceil(log2(amax / 448)), -13) exactly (integer bit work,
    equal to vLLM's exp2f(ceilf(log2f(max(amax / 448, 1e-4)))) for every bf16 amax; an fp32
    row is quantized as it is, as vLLM's fused norm + RoPE writer does), the
    fp32 scale 2**e at bytes 512 + 4*tile, codes e4m3(x * 2**-e) (exact scaling, RNE,
    saturating); RoPE dims copied as 16-bit words. auto: the 576 dims copied as 16-bit words.
    """
    o_t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    m_valid, o_rec = _slot_records(slot_ptr, o_t, n, block_size, stride_blk, stride_rec, capacity)
    o_r = tl.arange(0, ROPE)  # [64]
    p_pe = k_pe_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + (o_t * stride_kpe)[:, None] + o_r[None, :]
    b_pe = tl.load(p_pe, mask=m_valid[:, None], other=0)  # [TOKENS, 64] bf16 bits
    if FP8:
        o_g = tl.arange(0, TILES)  # [4]
        o_d = tl.arange(0, TILE)  # [128]
        o_dim = o_g[:, None] * TILE + o_d[None, :]  # [4, 128]
        m_v3 = m_valid[:, None, None]
        b_x = tl.load(kv_c_ptr + (o_t * stride_kvc)[:, None, None] + o_dim[None, :, :], mask=m_v3,
                      other=0.0).to(tl.float32)  # [TOKENS, 4, 128]
        b_e = tl.maximum(ue8m0_exponent(tl.max(tl.abs(b_x), axis=2)), MIN_EXP)  # [TOKENS, 4] int32
        b_inv = ((127 - b_e) << 23).to(tl.float32, bitcast=True)  # 2**-e, e in [-13, 120]
        b_codes = f32_to_e4m3(b_x * b_inv[:, :, None], MODE)  # [TOKENS, 4, 128] uint8
        tl.store(cache_ptr + o_rec[:, None, None] + o_dim[None, :, :], b_codes, mask=m_v3)
        b_scale = ((b_e + 127) << 23).to(tl.float32, bitcast=True)  # [TOKENS, 4] fp32 2**e
        p_sc = (cache_ptr + o_rec + SCALE_OFF).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(p_sc[:, None] + o_g[None, :], b_scale, mask=m_valid[:, None])
        p_dst = (cache_ptr + o_rec + ROPE_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
        tl.store(p_dst[:, None] + o_r[None, :], b_pe, mask=m_valid[:, None])
    else:
        o_n = tl.arange(0, NOPE)  # [512]
        p_src = kv_c_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + (o_t * stride_kvc)[:, None] + o_n[None, :]
        b_x = tl.load(p_src, mask=m_valid[:, None], other=0)  # [TOKENS, 512] bf16 bits
        p_row = cache_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + o_rec  # [TOKENS]
        tl.store(p_row[:, None] + o_n[None, :], b_x, mask=m_valid[:, None])
        tl.store(p_row[:, None] + NOPE + o_r[None, :], b_pe, mask=m_valid[:, None])


@triton.jit
def _v32_kv_gather_kernel(
    cache_ptr,  # uint8 (FP8) or bf16 (auto) [num_blocks, block_size, 656 | 576]
    slot_ptr,  # int64 / int32 [n], any order, repeats allowed
    out_ptr,  # bf16 [n, 576], row stride stride_out, dims contiguous
    n, stride_out, block_size, stride_blk, stride_rec, capacity,
    FP8: tl.constexpr, NATIVE: tl.constexpr,  # NATIVE: E4M3 decode through fp8e4nv (sm_89+)
    ROWS: tl.constexpr,  # output rows per program
):
    """Grid (cdiv(n, ROWS),): each program writes ROWS bf16 rows of 576: FP8, dims d < 512 are
    e4m3(code[d]) * scale[d // 128] (fp32, rounded once to bf16), then the raw RoPE words;
    auto, the row's 576 words. A slot outside [0, capacity) reads nothing: a zero row."""
    o_i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    m_i = o_i < n
    m_valid, o_rec = _slot_records(slot_ptr, o_i, n, block_size, stride_blk, stride_rec, capacity)
    o_row = o_i * stride_out  # [ROWS] int64
    o_r = tl.arange(0, ROPE)  # [64]
    p_out16 = out_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + o_row  # [ROWS]
    if FP8:
        o_g = tl.arange(0, TILES)  # [4]
        o_d = tl.arange(0, TILE)  # [128]
        o_dim = o_g[:, None] * TILE + o_d[None, :]  # [4, 128]
        m_v3 = m_valid[:, None, None]
        b_codes = tl.load(cache_ptr + o_rec[:, None, None] + o_dim[None, :, :], mask=m_v3, other=0)
        p_sc = (cache_ptr + o_rec + SCALE_OFF).to(tl.pointer_type(tl.float32), bitcast=True)
        b_scale = tl.load(p_sc[:, None] + o_g[None, :], mask=m_valid[:, None], other=0.0)  # [ROWS, 4]
        b_val = e4m3_to_f32(b_codes, NATIVE) * b_scale[:, :, None]  # [ROWS, 4, 128] fp32
        b_val = tl.where(m_v3, b_val, 0.0)
        tl.store(out_ptr + o_row[:, None, None] + o_dim[None, :, :], b_val.to(tl.bfloat16), mask=m_i[:, None, None])
        p_src = (cache_ptr + o_rec + ROPE_OFF).to(tl.pointer_type(tl.uint16), bitcast=True)
        b_pe = tl.load(p_src[:, None] + o_r[None, :], mask=m_valid[:, None], other=0)
    else:
        o_n = tl.arange(0, NOPE)  # [512]
        p_row = cache_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + o_rec  # [ROWS]
        b_x = tl.load(p_row[:, None] + o_n[None, :], mask=m_valid[:, None], other=0)  # [ROWS, 512]
        tl.store(p_out16[:, None] + o_n[None, :], b_x, mask=m_i[:, None])
        b_pe = tl.load(p_row[:, None] + NOPE + o_r[None, :], mask=m_valid[:, None], other=0)
    tl.store(p_out16[:, None] + NOPE + o_r[None, :], b_pe, mask=m_i[:, None])


# Launch configs as plain data (all capabilities; memory-bound, small tiles). Checked for
# spills on sm_80/86 by the AOT table (dsv4_ops.v32.aot_specs).
V32_INSERT_CONFIG = {"TOKENS": 2, "num_warps": 4}
V32_GATHER_CONFIG = {"ROWS": 8, "num_warps": 4}
