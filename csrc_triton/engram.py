"""Engram row lookup (DeepSeek-V4.1): gather E4M3 table rows by hash id, dequantize to bf16
(or copy the packed bytes), reading the table as uint8 so the kernel builds for sm_80.

Table: ``weight`` uint8 [R, DIM] (E4M3 codes) and ``scales`` uint8 [R, DIM // QUANT_BLOCK]
(UE8M0 exponent bytes, one per QUANT_BLOCK values). Either may be a CUDA view of pinned host
memory (UVA): every row is read once, with 16-byte vector loads, so the PCIe link carries
only the row bytes. Output row ``r`` of token ``t = r // LOCAL_HEADS`` and local head
``r % LOCAL_HEADS`` is written as vLLM 0.33.0's ``_engram_lookup_kernel`` writes it.
"""

import triton
import triton.language as tl

from .codec import e4m3_to_f32


# Runtime sizes are not specialized (no recompile per batch, shard or table size).
@triton.jit(do_not_specialize=["vocab_start", "vocab_end", "n_table_rows", "num_rows", "ids_stride_t",
                               "ids_stride_h", "stride_out_t", "stride_out_h", "head_start", "local_heads",
                               "total_heads", "grid_size"])
def _engram_lookup_kernel(
    weight_ptr,  # uint8 [n_table_rows, DIM], row stride stride_w_0
    scales_ptr,  # uint8 [n_table_rows, DIM // QUANT_BLOCK], row stride stride_s_0
    ids_ptr,  # int32/int64 [T, >= total_heads] (strides stride_ids_t/h); SORTED: [num_rows] local rows
    dst_ptr,  # SORTED: int32/int64 [num_rows] output row of each entry; else unused
    out_ptr,  # bf16 [T, LOCAL_HEADS, DIM] or (PACKED) uint8 [T, LOCAL_HEADS, DIM + DIM // QUANT_BLOCK]
    vocab_start,  # int64: first global table row this shard owns
    vocab_end,  # int64: one past the last
    n_table_rows,  # int64: rows the table tensor holds (a row >= this is never read)
    num_rows,  # T * LOCAL_HEADS
    ids_stride_t,
    ids_stride_h,
    stride_w_0,
    stride_s_0,
    stride_out_t,
    stride_out_h,
    head_start,  # first global hash column of this shard
    local_heads,  # hash columns this shard writes per token (out.shape[1])
    total_heads,  # hash columns in the table (a padded column >= this writes zeros)
    grid_size,  # programs launched (persistent loop stride, in blocks of BLOCK_R rows)
    DIM: tl.constexpr,
    QUANT_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SORTED: tl.constexpr,
    PACKED: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """Grid (grid_size,), persistent: program p handles row blocks p, p + grid_size, ...
    (BLOCK_R output rows each). A row whose id is outside [vocab_start, vocab_end) (or past
    the table, or a padded head) writes zeros, as vLLM's kernel does."""
    NUM_SCALES: tl.constexpr = DIM // QUANT_BLOCK
    o_c = tl.arange(0, DIM)  # [DIM]
    o_s = tl.arange(0, NUM_SCALES)  # [NUM_SCALES]
    n_owned = tl.minimum(vocab_end - vocab_start, n_table_rows)
    for base in tl.range(tl.program_id(0) * BLOCK_R, num_rows, grid_size * BLOCK_R):
        o_r = base + tl.arange(0, BLOCK_R)  # [BLOCK_R] output rows
        m_r = o_r < num_rows
        if SORTED:
            b_local = tl.load(ids_ptr + o_r, mask=m_r, other=-1).to(tl.int64)
            b_dst = tl.load(dst_ptr + o_r, mask=m_r, other=0).to(tl.int64)
            m_dst = m_r & (b_dst >= 0) & (b_dst < num_rows)
            b_dst = tl.where(m_dst, b_dst, 0).to(tl.int32)  # < num_rows < 2**31: 32-bit division below
        else:
            b_head = head_start + o_r % local_heads
            b_tok = (o_r // local_heads).to(tl.int64)
            m_head = m_r & (b_head < total_heads)
            b_id = tl.load(ids_ptr + b_tok * ids_stride_t + b_head.to(tl.int64) * ids_stride_h,
                           mask=m_head, other=-1).to(tl.int64)
            b_local = tl.where(m_head, b_id - vocab_start, -1)
            b_dst = o_r
            m_dst = m_r
        m_own = m_dst & (b_local >= 0) & (b_local < n_owned)
        b_local = tl.where(m_own, b_local, 0)
        o_out = ((b_dst // local_heads).to(tl.int64) * stride_out_t
                 + (b_dst % local_heads).to(tl.int64) * stride_out_h)  # [BLOCK_R] int64
        b_codes = tl.load(weight_ptr + b_local[:, None] * stride_w_0 + o_c[None, :],
                          mask=m_own[:, None], other=0)  # [BLOCK_R, DIM] uint8
        if PACKED:
            b_sb = tl.load(scales_ptr + b_local[:, None] * stride_s_0 + o_s[None, :],
                           mask=m_own[:, None], other=0)  # [BLOCK_R, NUM_SCALES] uint8
            tl.store(out_ptr + o_out[:, None] + o_c[None, :], b_codes, mask=m_dst[:, None])
            tl.store(out_ptr + o_out[:, None] + DIM + o_s[None, :], b_sb, mask=m_dst[:, None])
        else:
            b_sb = tl.load(scales_ptr + b_local[:, None] * stride_s_0 + o_s[None, :],
                           mask=m_own[:, None], other=0)  # [BLOCK_R, NUM_SCALES] uint8
            # The UE8M0 byte is the fp32 exponent field (byte 0 gives 0.0, as in vLLM).
            b_scale = (b_sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            b_val = e4m3_to_f32(b_codes, NATIVE).reshape(BLOCK_R, NUM_SCALES, QUANT_BLOCK)
            b_val = (b_val * b_scale[:, :, None]).reshape(BLOCK_R, DIM)  # [BLOCK_R, DIM] fp32
            tl.store(out_ptr + o_out[:, None] + o_c[None, :], b_val.to(tl.bfloat16), mask=m_dst[:, None])


# Launch config as plain data: rows a program handles per step, warps, and the default
# persistent grid in programs per SM (80 registers, no spills, no shared memory on sm_80:
# 6 programs fit an SM; 4 leave room for the main stream while keeping enough row loads in
# flight to cover the PCIe round trip of a host table).
LOOKUP_CONFIG = {"BLOCK_R": 8, "num_warps": 4, "PROGRAMS_PER_SM": 4}
