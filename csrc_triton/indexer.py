"""The DeepSeek sparse-attention indexer on sm_8x: K-cache insert, Q RoPE + quant, logits.

Indexer cache layout: ``dsv4_ops.layout`` (section "indexer cache"): per page the
``block_size`` 128-byte E4M3 rows, then their fp32 scales ``2**e``.

Logits (both kernels): ``logit[m, n] = k_scale[n] * sum_h w[m, h] * relu(<q[m, h], k[n]>)``
with q and k E4M3 codes decoded in registers (``codec.e4m3_to_f32``) to fp16, which holds
every E4M3 value exactly, and ``tl.dot`` in fp16 with fp32 accumulation (mma.sync on sm_80):
each product of two E4M3 values is exact, only the fp32 sums round. Positions that are not
valid (outside ``[ks, ke)``, past the context, or whose page id is outside
``[0, num_blocks)``) are never read and get ``-inf``.
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

from .codec import e4m3_to_f32, f32_to_e4m3
from .kv_cache import ue8m0_exponent

HEAD_DIM = tl.constexpr(_L.INDEXER_HEAD_DIM)  # 128
DATA_BYTES = tl.constexpr(_L.INDEXER_DATA_BYTES)  # 128
SCALE_BYTES = tl.constexpr(_L.INDEXER_SCALE_BYTES)  # 4
NOPE_DIM = tl.constexpr(_L.INDEXER_NOPE_DIM)  # 64: Q dims 0..63 pass through
HALF_ROPE = tl.constexpr(_L.INDEXER_ROPE_DIM // 2)  # 32 (cos, sin) pairs
UE8M0_BIAS = tl.constexpr(_L.UE8M0_BIAS)


@triton.jit
def _pow2_f32(b_e):
    """int32 block of exponents e in [-126, 127] -> float32 2**e, exact (built from bits)."""
    return ((b_e + UE8M0_BIAS) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(b_x):
    """float32 block -> float32 block rounded to bfloat16, round half to even (integer bit
    work: faithful under the interpreter, whose fp32->bf16 cast truncates). NaN: unspecified."""
    b_bits = b_x.to(tl.uint32, bitcast=True)
    b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & 0xFFFF0000
    return b_bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n_tokens"])  # data-dependent count: one specialization
def _indexer_k_insert_kernel(
    k_ptr,  # bf16 or fp32 [N, 128], row stride stride_k_0, dims contiguous
    cache_ptr,  # uint8 [num_blocks, page_bytes]
    slot_ptr,  # int64 or int32 [n_tokens]
    n_tokens,
    stride_k_0,
    page_bytes,
    block_size,
    capacity,  # num_blocks * block_size
    MODE: tl.constexpr,  # codec.ENCODE_EXACT (portable) or ENCODE_NATIVE
    TOKENS: tl.constexpr,  # rows per program
):
    """Grid (cdiv(n_tokens, TOKENS),): each program quantizes TOKENS key rows into their
    128 E4M3 bytes + fp32 scale 2**e. A slot outside [0, capacity) loads and stores nothing."""
    o_t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    m_t = o_t < n_tokens
    b_slot = tl.load(slot_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    m_valid = m_t & (b_slot >= 0) & (b_slot < capacity)
    b_slot = tl.where(m_valid, b_slot, 0)
    b_blk = b_slot // block_size
    b_pos = b_slot % block_size
    o_data = b_blk * page_bytes + b_pos * DATA_BYTES  # [TOKENS] int64
    o_scale = b_blk * page_bytes + block_size * DATA_BYTES + b_pos * SCALE_BYTES

    o_d = tl.arange(0, HEAD_DIM)  # [128]
    b_x = tl.load(k_ptr + (o_t * stride_k_0)[:, None] + o_d[None, :], mask=m_valid[:, None],
                  other=0.0).to(tl.float32)  # [TOKENS, 128]
    b_e = ue8m0_exponent(tl.max(tl.abs(b_x), axis=1))  # [TOKENS] int32, in [-22, 120]
    b_codes = f32_to_e4m3(b_x * _pow2_f32(-b_e)[:, None], MODE)  # exact scaling: a power of two
    tl.store(cache_ptr + o_data[:, None] + o_d[None, :], b_codes, mask=m_valid[:, None])
    p_scale = (cache_ptr + o_scale).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(p_scale, _pow2_f32(b_e), mask=m_valid)


@triton.jit
def _indexer_q_quant_kernel(
    pos_ptr,  # int64/int32 [T]
    q_ptr,  # bf16 [T, H, 128], strides (stride_q_t, stride_q_h, 1)
    cs_ptr,  # fp32/bf16 [max_pos, 64]: 32 cos then 32 sin, row stride stride_cs
    w_ptr,  # bf16/fp32 [T, H], strides (stride_w_t, stride_w_h)
    q_out_ptr,  # uint8 [T, H, 128] contiguous
    w_out_ptr,  # fp32 [T, H], row stride stride_wo_t, heads contiguous
    n_heads,
    stride_q_t,
    stride_q_h,
    stride_cs,
    stride_w_t,
    stride_w_h,
    stride_wo_t,
    w_scale,  # fp32: softmax_scale * head_scale, rounded once to fp32
    MODE: tl.constexpr,  # codec.ENCODE_EXACT (portable) or ENCODE_NATIVE
    HEADS: tl.constexpr,  # heads per program (power of two)
):
    """Grid (T, cdiv(H, HEADS)): each program ropes, scales and encodes HEADS heads of one token.

    Dims 64..127: GPT-J (interleaved) RoPE, even' = x0*cos - x1*sin, odd' = x0*sin + x1*cos
    (separate fp32 products and one add each: launch with enable_fp_fusion=False), then
    rounded to bf16 (RNE). e = ceil(log2(max(amax, 1e-4) / 448)) over the head's 128 values,
    codes = e4m3(value * 2**-e) (RNE), weight' = (w * w_scale) * 2**e.
    """
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    m_h = o_h < n_heads
    o_d = tl.arange(0, HEAD_DIM)  # [128]
    m_rope = o_d >= NOPE_DIM
    o_i = tl.where(m_rope, (o_d - NOPE_DIM) // 2, 0)  # pair index of each dim
    b_pos = tl.load(pos_ptr + t).to(tl.int64)
    b_cos = tl.load(cs_ptr + b_pos * stride_cs + o_i, mask=m_rope, other=1.0).to(tl.float32)  # [128]
    b_sin = tl.load(cs_ptr + b_pos * stride_cs + HALF_ROPE + o_i, mask=m_rope, other=0.0).to(tl.float32)

    p_row = q_ptr + t * stride_q_t + (o_h * stride_q_h)[:, None]  # [HEADS, 1]
    b_x = tl.load(p_row + o_d[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)  # [HEADS, 128]
    b_p = tl.load(p_row + (o_d ^ 1)[None, :], mask=m_h[:, None] & m_rope[None, :], other=0.0).to(tl.float32)
    # even d: x*cos + (-partner)*sin == x*cos - partner*sin; odd d: x*cos + partner*sin.
    b_p = tl.where((o_d % 2 == 0)[None, :], -b_p, b_p)
    b_rot = _round_bf16(b_x * b_cos[None, :] + b_p * b_sin[None, :])
    b_v = tl.where(m_rope[None, :], b_rot, b_x)  # [HEADS, 128]; NoPE dims untouched (signed zeros too)

    b_e = ue8m0_exponent(tl.max(tl.abs(b_v), axis=1))  # [HEADS] int32
    b_codes = f32_to_e4m3(b_v * _pow2_f32(-b_e)[:, None], MODE)
    p_out = q_out_ptr + (t * n_heads + o_h.to(tl.int64))[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(p_out, b_codes, mask=m_h[:, None])

    b_w = tl.load(w_ptr + t * stride_w_t + o_h * stride_w_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + t * stride_wo_t + o_h, (b_w * w_scale) * _pow2_f32(b_e), mask=m_h)


@triton.jit
def _mqa_logits_kernel(
    q_ptr,  # uint8 E4M3 [M, H, 128], strides (stride_q_m, stride_q_h, 1)
    w_ptr,  # fp32 [M, H], strides (stride_w_m, stride_w_h)
    k_ptr,  # uint8 E4M3 [N, 128], row stride stride_k_n
    k_scale_ptr,  # fp32 [N]
    ks_ptr,  # int32 [M]
    ke_ptr,  # int32 [M]
    out_ptr,  # fp32 [M, out_cols], row stride stride_out_m
    M,
    N,
    n_heads,
    out_cols,
    stride_q_m,
    stride_q_h,
    stride_w_m,
    stride_w_h,
    stride_k_n,
    stride_out_m,
    COMPRESSED: tl.constexpr,  # False: column n is key n; True: column j is key ks[m] + j
    NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_M), cdiv(max(N, out_cols), BLOCK_N)): one program scores BLOCK_M
    query rows against keys [pid_n * BLOCK_N, +BLOCK_N), looping over heads with one
    [BLOCK_M, 128] x [128, BLOCK_N] fp16 dot each; a tile outside every row's [ks, ke) only
    writes -inf. COMPRESSED also writes -inf to columns [ke - ks, out_cols) of its column tile.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_r = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of this tile (int32 local offsets below)
    o_m = pid_m.to(tl.int64) * BLOCK_M + o_r
    m_m = o_m < M
    b_ks = tl.maximum(tl.load(ks_ptr + o_m, mask=m_m, other=0), 0)
    b_ke = tl.minimum(tl.load(ke_ptr + o_m, mask=m_m, other=0), N)
    n0 = pid_n * BLOCK_N
    o_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key ids
    m_n = o_n < N
    lo = tl.min(tl.where(m_m & (b_ks < b_ke), b_ks, N), axis=0)
    hi = tl.max(tl.where(m_m & (b_ks < b_ke), b_ke, 0), axis=0)
    o_d = tl.arange(0, HEAD_DIM)

    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        # Tile bases in int64, offsets inside a tile in int32: keeps the [rows, 128] offset
        # tensors small (64-bit pointer tensors held across the head loop spill).
        p_k = k_ptr + n0.to(tl.int64) * stride_k_n
        b_kt = tl.load(p_k + (tl.arange(0, BLOCK_N) * stride_k_n)[None, :] + o_d[:, None], mask=m_n[None, :], other=0)
        b_kt = e4m3_to_f32(b_kt, NATIVE).to(tl.float16)  # [128, BLOCK_N], exact
        p_q0 = q_ptr + pid_m.to(tl.int64) * BLOCK_M * stride_q_m
        o_q = (o_r * stride_q_m)[:, None] + o_d[None, :]  # [BLOCK_M, 128] int32
        p_w0 = w_ptr + pid_m.to(tl.int64) * BLOCK_M * stride_w_m
        o_w = o_r * stride_w_m
        for h in range(0, n_heads):
            b_q = tl.load((p_q0 + h * stride_q_h) + o_q, mask=m_m[:, None], other=0)
            b_q = e4m3_to_f32(b_q, NATIVE).to(tl.float16)  # [BLOCK_M, 128]
            b_s = tl.dot(b_q, b_kt)  # [BLOCK_M, BLOCK_N] fp32, exact products
            b_w = tl.load((p_w0 + h * stride_w_h) + o_w, mask=m_m, other=0.0)  # [BLOCK_M]
            b_acc += tl.maximum(b_s, 0.0) * b_w[:, None]
        b_acc = b_acc * tl.load(k_scale_ptr + o_n, mask=m_n, other=0.0)[None, :]
    m_valid = m_m[:, None] & (o_n[None, :] >= b_ks[:, None]) & (o_n[None, :] < b_ke[:, None])
    b_out = tl.where(m_valid, b_acc, float("-inf"))
    out_base = out_ptr + pid_m.to(tl.int64) * BLOCK_M * stride_out_m
    p_out = out_base + (o_r * stride_out_m)[:, None]
    if COMPRESSED:
        o_col = o_n[None, :] - b_ks[:, None]  # [BLOCK_M, BLOCK_N]
        tl.store(out_base + ((o_r * stride_out_m)[:, None] + o_col), b_out, mask=m_valid & (o_col < out_cols))
        o_c = n0 + tl.arange(0, BLOCK_N)  # -inf tail [ke - ks, out_cols) of this program's column tile
        m_tail = m_m[:, None] & (o_c[None, :] >= (b_ke - b_ks)[:, None]) & (o_c[None, :] < out_cols)
        tl.store(p_out + o_c[None, :], tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=m_tail)
    else:
        tl.store(p_out + o_n[None, :], b_out, mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,  # uint8 E4M3 [B * next_n, H, 128], strides (stride_q_r, stride_q_h, 1)
    w_ptr,  # fp32 [B * next_n, H], strides (stride_w_r, stride_w_h)
    cache_ptr,  # uint8 [num_blocks, page_bytes]: indexer pages (dsv4_ops.layout)
    ctx_ptr,  # int32 [B] or [B * next_n] (CTX_PER_ROW)
    bt_ptr,  # int32 [B, bt_cols], row stride stride_bt_b
    out_ptr,  # fp32 [B * next_n, max_ctx], row stride stride_out_r
    next_n,
    n_heads,
    max_ctx,
    num_blocks,
    bt_cols,
    block_size,
    page_bytes,
    stride_q_r,
    stride_q_h,
    stride_w_r,
    stride_w_h,
    stride_bt_b,
    stride_out_r,
    tiles_per_prog,
    CTX_PER_ROW: tl.constexpr,  # context_lens [B, next_n] (one length per row) vs [B]
    NATIVE: tl.constexpr,
    H_BLOCK: tl.constexpr,  # power of two >= max(H, 16)
    BLOCK_N: tl.constexpr,  # keys per tile
):
    """Grid (B * next_n, cdiv(cdiv(max_ctx, BLOCK_N), tiles_per_prog)): one program holds one
    query row's [H, 128] Q in registers and scores tiles_per_prog tiles of BLOCK_N keys, each
    with one [H, 128] x [128, BLOCK_N] fp16 dot; relu, weights and the head sum follow, then
    the keys' scales. Row r = b * next_n + j sees keys [0, L): L = context_lens[b, j], or
    context_lens[b] - next_n + j + 1 (causal) for 1-D context_lens; capped at max_ctx.
    """
    r = tl.program_id(0).to(tl.int64)
    b = r // next_n
    if CTX_PER_ROW:
        b_len = tl.load(ctx_ptr + r)
    else:
        b_len = tl.load(ctx_ptr + b) - next_n + 1 + (r % next_n).to(tl.int32)
    b_len = tl.minimum(b_len, max_ctx)

    o_h = tl.arange(0, H_BLOCK)
    m_h = o_h < n_heads
    o_d = tl.arange(0, HEAD_DIM)
    b_q = tl.load(q_ptr + r * stride_q_r + (o_h * stride_q_h)[:, None] + o_d[None, :], mask=m_h[:, None], other=0)
    b_q = e4m3_to_f32(b_q, NATIVE).to(tl.float16)  # [H_BLOCK, 128], exact
    b_w = tl.load(w_ptr + r * stride_w_r + o_h * stride_w_h, mask=m_h, other=0.0)  # [H_BLOCK] fp32
    p_bt = bt_ptr + b * stride_bt_b
    p_out = out_ptr + r * stride_out_r
    tile0 = tl.program_id(1) * tiles_per_prog
    for t in range(0, tiles_per_prog):
        n0 = (tile0 + t) * BLOCK_N
        o_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        if n0 < b_len:
            b_bi = o_n // block_size
            m_in = (o_n < b_len) & (b_bi < bt_cols)
            b_blk = tl.load(p_bt + b_bi, mask=m_in, other=-1).to(tl.int64)
            m_k = m_in & (b_blk >= 0) & (b_blk < num_blocks)
            b_blk = tl.where(m_k, b_blk, 0)
            b_p = o_n % block_size
            o_page = b_blk * page_bytes  # [BLOCK_N] int64
            b_kt = tl.load(cache_ptr + (o_page + b_p * DATA_BYTES)[None, :] + o_d[:, None], mask=m_k[None, :], other=0)
            b_kt = e4m3_to_f32(b_kt, NATIVE).to(tl.float16)  # [128, BLOCK_N]
            p_sc = (cache_ptr + o_page + block_size * DATA_BYTES + b_p * SCALE_BYTES).to(
                tl.pointer_type(tl.float32), bitcast=True)
            b_sc = tl.load(p_sc, mask=m_k, other=0.0)  # [BLOCK_N]
            b_s = tl.dot(b_q, b_kt)  # [H_BLOCK, BLOCK_N] fp32
            b_l = tl.sum(tl.maximum(b_s, 0.0) * b_w[:, None], axis=0) * b_sc
            b_l = tl.where(m_k, b_l, float("-inf"))
        else:
            b_l = tl.full([BLOCK_N], float("-inf"), tl.float32)
        tl.store(p_out + o_n, b_l, mask=o_n < max_ctx)


# ---- v2 kernels (docs/journal/notes.md "Indexer v2") ----------------------------------------


@triton.jit
def _e4m3_to_f16(b_codes, NATIVE: tl.constexpr, BITS: tl.constexpr):
    """uint8 E4M3 block -> fp16 block, exact: the value itself (NATIVE, cvt from fp8e4nv) or
    the value * 2**-8 (portable: E4M3 and fp8e4b15 bits read as fp16 differ only by the 8-bit
    exponent bias gap, so the code moved into fp16 bits is value * 2**-8, subnormals included).
    Portable decodes by the fp8e4b15 -> fp16 cast (a bit move on the GPU) or, BITS (the
    interpreter, whose fp8e4b15 -> fp16 cast flushes subnormals), by the same bit move spelled
    out. Callers scale results by f16_unscale(NATIVE) per dot operand."""
    if NATIVE:
        b_val = b_codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif BITS:
        b_c = b_codes.to(tl.uint16)
        b_val = (((b_c & 0x7F) << 7) | ((b_c & 0x80) << 8)).to(tl.float16, bitcast=True)
    else:
        b_val = b_codes.to(tl.float8e4b15, bitcast=True).to(tl.float16)
    return b_val


@triton.jit
def _dot_unscale(NATIVE: tl.constexpr):
    """The factor that undoes _e4m3_to_f16's 2**-8 on both operands of a dot: 2**16 or 1."""
    if NATIVE:
        f = 1.0
    else:
        f = 65536.0
    return f


@triton.jit
def _indexer_q_quant_pairs_kernel(
    pos_ptr, q_ptr, cs_ptr, w_ptr, q_out_ptr, w_out_ptr, n_heads,
    stride_q_t, stride_q_h, stride_cs, stride_w_t, stride_w_h, stride_wo_t, w_scale,
    MODE: tl.constexpr,
    HEADS: tl.constexpr,
):
    """_indexer_q_quant_kernel (same arguments, grid and bits) with the RoPE partners taken
    by splitting one contiguous [HEADS, 128] load into its (even, odd) halves instead of a
    second, uncoalesced, xor-indexed load. Pair p = 32 + i (dims 64 + 2i, 65 + 2i) ropes
    with (cos[i], sin[i]): even' = x0*cos - x1*sin, odd' = x0*sin + x1*cos (separate fp32
    products, enable_fp_fusion=False), rounded to bf16."""
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    m_h = o_h < n_heads
    o_d = tl.arange(0, HEAD_DIM)
    o_p = tl.arange(0, HEAD_DIM // 2)  # [64] pair index
    m_rope = o_p >= NOPE_DIM // 2
    o_i = tl.where(m_rope, o_p - NOPE_DIM // 2, 0)
    b_pos = tl.load(pos_ptr + t).to(tl.int64)
    b_cos = tl.load(cs_ptr + b_pos * stride_cs + o_i, mask=m_rope, other=1.0).to(tl.float32)  # [64]
    b_sin = tl.load(cs_ptr + b_pos * stride_cs + HALF_ROPE + o_i, mask=m_rope, other=0.0).to(tl.float32)

    p_row = q_ptr + t * stride_q_t + (o_h * stride_q_h)[:, None]
    b_x = tl.load(p_row + o_d[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)  # [HEADS, 128]
    b_x0, b_x1 = tl.split(tl.reshape(b_x, [HEADS, HEAD_DIM // 2, 2]))  # [HEADS, 64] each
    b_r0 = _round_bf16(b_x0 * b_cos[None, :] - b_x1 * b_sin[None, :])
    b_r1 = _round_bf16(b_x0 * b_sin[None, :] + b_x1 * b_cos[None, :])
    b_v0 = tl.where(m_rope[None, :], b_r0, b_x0)
    b_v1 = tl.where(m_rope[None, :], b_r1, b_x1)

    b_amax = tl.maximum(tl.max(tl.abs(b_v0), axis=1), tl.max(tl.abs(b_v1), axis=1))
    b_e = ue8m0_exponent(b_amax)  # [HEADS]
    b_inv = _pow2_f32(-b_e)[:, None]
    b_codes = tl.reshape(tl.join(f32_to_e4m3(b_v0 * b_inv, MODE), f32_to_e4m3(b_v1 * b_inv, MODE)),
                         [HEADS, HEAD_DIM])
    p_out = q_out_ptr + (t * n_heads + o_h.to(tl.int64))[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(p_out, b_codes, mask=m_h[:, None])

    b_w = tl.load(w_ptr + t * stride_w_t + o_h * stride_w_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + t * stride_wo_t + o_h, (b_w * w_scale) * _pow2_f32(b_e), mask=m_h)


@triton.jit
def _mqa_store_row(p_row, b_l, o_n, m_n, b_ks, b_ke, n0, out_cols, COMPRESSED: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Store one query row's logits b_l [BLOCK_N] of keys o_n (already -inf outside [ks, ke))."""
    if COMPRESSED:
        o_col = o_n - b_ks
        tl.store(p_row + o_col, b_l, mask=(o_n >= b_ks) & (o_n < b_ke) & (o_col < out_cols))
        o_c = n0 + tl.arange(0, BLOCK_N)
        tl.store(p_row + o_c, tl.full([BLOCK_N], float("-inf"), tl.float32),
                 mask=(o_c >= b_ke - b_ks) & (o_c < out_cols))
    else:
        tl.store(p_row + o_n, b_l, mask=m_n)


@triton.jit(do_not_specialize=["M"])  # data-dependent count: one specialization
def _mqa_logits_v2_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, ks_ptr, ke_ptr, out_ptr,
    M, N, n_heads, out_cols,
    stride_q_m, stride_q_h, stride_w_m, stride_w_h, stride_k_n, stride_out_m,
    COMPRESSED: tl.constexpr,
    NATIVE: tl.constexpr,
    BITS: tl.constexpr,  # interpreter: bit-move portable decode (see _e4m3_to_f16)
    H_BLOCK: tl.constexpr,  # power of two >= max(H, 16): the MMA's N dim
    BLOCK_M: tl.constexpr,  # query rows a program walks
    BLOCK_N: tl.constexpr,  # keys: the MMA's M dim
):
    """Same arguments and output as _mqa_logits_kernel. Grid (cdiv(max(N, out_cols),
    BLOCK_N), cdiv(M, BLOCK_M)), key tiles fastest (the programs of one query block run
    together and share its Q in L2). A program decodes its [BLOCK_N, 128] key tile once and
    keeps it as the MMA's A operand; per query row m it does ONE dot with all heads,
    [BLOCK_N, 128] x [128, H] (q[m] transposed), then relu, * w[m, :] and the head sum
    (inside a warp's rows), and writes the row's BLOCK_N logits. A tile outside every
    row's [ks, ke) only writes -inf."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    o_k = tl.arange(0, BLOCK_N)
    o_n = n0 + o_k
    m_n = o_n < N
    o_d = tl.arange(0, HEAD_DIM)
    o_h = tl.arange(0, H_BLOCK)
    m_h = o_h < n_heads
    m0 = pid_m * BLOCK_M
    o_r = m0 + tl.arange(0, BLOCK_M)
    m_r = o_r < M
    b_ks = tl.maximum(tl.load(ks_ptr + o_r, mask=m_r, other=0), 0)
    b_ke = tl.minimum(tl.load(ke_ptr + o_r, mask=m_r, other=0), N)
    lo = tl.min(tl.where(m_r & (b_ks < b_ke), b_ks, N), axis=0)
    hi = tl.max(tl.where(m_r & (b_ks < b_ke), b_ke, 0), axis=0)
    m_end = tl.minimum(m0 + BLOCK_M, M)
    m0_64 = pid_m.to(tl.int64) * BLOCK_M
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        p_k = k_ptr + n0.to(tl.int64) * stride_k_n
        b_k = tl.load(p_k + (o_k * stride_k_n)[:, None] + o_d[None, :], mask=m_n[:, None], other=0)
        b_k = _e4m3_to_f16(b_k, NATIVE, BITS)  # [BLOCK_N, 128]
        b_sc = tl.load(k_scale_ptr + o_n, mask=m_n, other=0.0)
        o_qt = o_d[:, None] + (o_h * stride_q_h)[None, :]  # [128, H_BLOCK] int32
        for i in range(0, m_end - m0):
            m64 = m0_64 + i
            r_ks = tl.maximum(tl.load(ks_ptr + m64), 0)
            r_ke = tl.minimum(tl.load(ke_ptr + m64), N)
            b_qt = tl.load(q_ptr + m64 * stride_q_m + o_qt, mask=m_h[None, :], other=0)
            b_qt = _e4m3_to_f16(b_qt, NATIVE, BITS)  # [128, H_BLOCK]
            b_w = tl.load(w_ptr + m64 * stride_w_m + o_h * stride_w_h, mask=m_h, other=0.0)
            b_s = tl.dot(b_k, b_qt)  # [BLOCK_N, H_BLOCK] fp32
            # unscale before the key scale (2**16 * k_scale could overflow; the sum cannot)
            b_l = (tl.sum(tl.maximum(b_s, 0.0) * b_w[None, :], axis=1) * _dot_unscale(NATIVE)) * b_sc
            b_l = tl.where((o_n >= r_ks) & (o_n < r_ke), b_l, float("-inf"))
            _mqa_store_row(out_ptr + m64 * stride_out_m, b_l, o_n, m_n, r_ks, r_ke, n0, out_cols,
                           COMPRESSED, BLOCK_N)
    else:
        for i in range(0, m_end - m0):
            m64 = m0_64 + i
            r_ks = tl.maximum(tl.load(ks_ptr + m64), 0)
            r_ke = tl.minimum(tl.load(ke_ptr + m64), N)
            _mqa_store_row(out_ptr + m64 * stride_out_m, tl.full([BLOCK_N], float("-inf"), tl.float32), o_n, m_n,
                           r_ks, r_ke, n0, out_cols, COMPRESSED, BLOCK_N)


@triton.jit(do_not_specialize=["tiles_per_prog"])  # data-dependent count: one specialization
def _paged_mqa_logits_v2_kernel(
    q_ptr, w_ptr, cache_ptr, ctx_ptr, bt_ptr, out_ptr,
    next_n, n_heads, max_ctx, num_blocks, bt_cols, block_size, page_bytes,
    stride_q_r, stride_q_h, stride_w_r, stride_w_h, stride_bt_b, stride_out_r, tiles_per_prog,
    CTX_PER_ROW: tl.constexpr,
    NATIVE: tl.constexpr,
    BITS: tl.constexpr,  # interpreter: bit-move portable decode (see _e4m3_to_f16)
    H_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Same arguments, grid and output as _paged_mqa_logits_kernel, with the keys as the
    MMA's M dim: per tile ONE dot [BLOCK_N, 128] (gathered key rows, contiguous 128-byte
    loads, decoded straight to fp16) x [128, H] (this row's Q, transposed, decoded once and
    held), then relu, * w and the head sum along the accumulator's rows (no cross-warp
    reduction over heads). The tiles inside the row's context run in a loop without a
    branch (pipelinable); the rest of the program's tiles only write -inf."""
    r = tl.program_id(0).to(tl.int64)
    b = r // next_n
    if CTX_PER_ROW:
        b_len = tl.load(ctx_ptr + r)
    else:
        b_len = tl.load(ctx_ptr + b) - next_n + 1 + (r % next_n).to(tl.int32)
    b_len = tl.minimum(b_len, max_ctx)

    o_h = tl.arange(0, H_BLOCK)
    m_h = o_h < n_heads
    o_d = tl.arange(0, HEAD_DIM)
    b_qt = tl.load(q_ptr + r * stride_q_r + o_d[:, None] + (o_h * stride_q_h)[None, :], mask=m_h[None, :], other=0)
    b_qt = _e4m3_to_f16(b_qt, NATIVE, BITS)  # [128, H_BLOCK]
    b_w = tl.load(w_ptr + r * stride_w_r + o_h * stride_w_h, mask=m_h, other=0.0)
    p_bt = bt_ptr + b * stride_bt_b
    p_out = out_ptr + r * stride_out_r
    tile0 = tl.program_id(1) * tiles_per_prog
    o_k = tl.arange(0, BLOCK_N)
    n_live = tl.minimum(tl.maximum(b_len - tile0 * BLOCK_N + (BLOCK_N - 1), 0) // BLOCK_N, tiles_per_prog)
    for t in range(0, n_live):
        o_n = (tile0 + t) * BLOCK_N + o_k
        b_bi = o_n // block_size
        m_in = (o_n < b_len) & (b_bi < bt_cols)
        b_blk = tl.load(p_bt + b_bi, mask=m_in, other=-1).to(tl.int64)
        m_k = m_in & (b_blk >= 0) & (b_blk < num_blocks)
        b_blk = tl.where(m_k, b_blk, 0)
        b_p = o_n % block_size
        o_page = b_blk * page_bytes
        b_k = tl.load(cache_ptr + (o_page + b_p * DATA_BYTES)[:, None] + o_d[None, :], mask=m_k[:, None], other=0)
        b_k = _e4m3_to_f16(b_k, NATIVE, BITS)  # [BLOCK_N, 128]
        p_sc = (cache_ptr + o_page + block_size * DATA_BYTES + b_p * SCALE_BYTES).to(
            tl.pointer_type(tl.float32), bitcast=True)
        b_sc = tl.load(p_sc, mask=m_k, other=0.0)
        b_s = tl.dot(b_k, b_qt)  # [BLOCK_N, H_BLOCK] fp32
        b_l = (tl.sum(tl.maximum(b_s, 0.0) * b_w[None, :], axis=1) * _dot_unscale(NATIVE)) * b_sc
        tl.store(p_out + o_n, tl.where(m_k, b_l, float("-inf")), mask=o_n < max_ctx)
    for t in range(n_live, tiles_per_prog):
        o_n = (tile0 + t) * BLOCK_N + o_k
        tl.store(p_out + o_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=o_n < max_ctx)


# ---- v3 kernels (docs/journal/notes.md, "Indexer v3") ------------------------------


@triton.jit
def _paged_tile_blocks(p_bt, o_n, b_lim, bt_cols, block_size, num_blocks):
    """Page ids (int64, 0 where masked) and the mask of one tile's context positions o_n."""
    b_bi = o_n // block_size
    m_in = (o_n < b_lim) & (b_bi < bt_cols)
    b_blk = tl.load(p_bt + b_bi, mask=m_in, other=-1).to(tl.int64)
    m_k = m_in & (b_blk >= 0) & (b_blk < num_blocks)
    return tl.where(m_k, b_blk, 0), m_k


@triton.jit
def _paged_tile_keys(cache_ptr, o_n, b_blk, m_k, o_d, block_size, page_bytes):
    """One tile's raw key codes [BLOCK_N, 128] (uint8) and fp32 scales [BLOCK_N]."""
    b_p = o_n % block_size
    o_page = b_blk * page_bytes
    b_k = tl.load(cache_ptr + (o_page + b_p * DATA_BYTES)[:, None] + o_d[None, :], mask=m_k[:, None], other=0)
    p_sc = (cache_ptr + o_page + block_size * DATA_BYTES + b_p * SCALE_BYTES).to(
        tl.pointer_type(tl.float32), bitcast=True)
    return b_k, tl.load(p_sc, mask=m_k, other=0.0)


@triton.jit
def _paged_tile_logits(b_k, b_sc, b_qt, b_w, NATIVE: tl.constexpr, BITS: tl.constexpr):
    """One tile's logits [BLOCK_N] from its raw codes, scales, Q^T [128, H] and weights."""
    b_s = tl.dot(_e4m3_to_f16(b_k, NATIVE, BITS), b_qt)  # [BLOCK_N, H_BLOCK] fp32
    return (tl.sum(tl.maximum(b_s, 0.0) * b_w[None, :], axis=1) * _dot_unscale(NATIVE)) * b_sc


@triton.jit(do_not_specialize=["tiles_per_prog"])  # data-dependent count: one specialization
def _paged_mqa_logits_v3_kernel(
    q_ptr, w_ptr, cache_ptr, ctx_ptr, bt_ptr, out_ptr,
    next_n, n_heads, max_ctx, num_blocks, bt_cols, block_size, page_bytes,
    stride_q_r, stride_q_h, stride_w_r, stride_w_h, stride_bt_b, stride_out_r, tiles_per_prog,
    CTX_PER_ROW: tl.constexpr,
    NATIVE: tl.constexpr,
    BITS: tl.constexpr,  # interpreter: bit-move portable decode (see _e4m3_to_f16)
    H_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CODES_AHEAD: tl.constexpr,  # also hold the next tile's codes in flight (else page ids only)
    PAIRS: tl.constexpr,  # (without CODES_AHEAD) two tiles an iteration, both tiles' rows loaded at once
):
    """_paged_mqa_logits_v2_kernel (same arguments, grid, math and output) with the gathered
    loads software-pipelined in the source: the page ids of tile t + 2 are loaded during tile
    t (loop-carried), so a tile's 132-byte rows load as soon as it starts, without waiting
    on the block table; CODES_AHEAD also keeps the raw codes and scales of tile t + 1 in
    flight while tile t is decoded, multiplied and reduced (more registers); PAIRS takes two
    tiles an iteration, issuing both tiles' row loads before either is scored (no
    loop-carried codes, so their layout stays the coalesced one). Loads are masked to the program's own live tiles
    (positions < min(context, end of its tile range)): nothing past them is read."""
    r = tl.program_id(0).to(tl.int64)
    b = r // next_n
    if CTX_PER_ROW:
        b_len = tl.load(ctx_ptr + r)
    else:
        b_len = tl.load(ctx_ptr + b) - next_n + 1 + (r % next_n).to(tl.int32)
    b_len = tl.minimum(b_len, max_ctx)

    o_h = tl.arange(0, H_BLOCK)
    m_h = o_h < n_heads
    o_d = tl.arange(0, HEAD_DIM)
    b_qt = tl.load(q_ptr + r * stride_q_r + o_d[:, None] + (o_h * stride_q_h)[None, :], mask=m_h[None, :], other=0)
    b_qt = _e4m3_to_f16(b_qt, NATIVE, BITS)  # [128, H_BLOCK]
    b_w = tl.load(w_ptr + r * stride_w_r + o_h * stride_w_h, mask=m_h, other=0.0)
    p_bt = bt_ptr + b * stride_bt_b
    p_out = out_ptr + r * stride_out_r
    tile0 = tl.program_id(1) * tiles_per_prog
    o_k = tl.arange(0, BLOCK_N)
    n_live = tl.minimum(tl.maximum(b_len - tile0 * BLOCK_N + (BLOCK_N - 1), 0) // BLOCK_N, tiles_per_prog)
    b_lim = tl.minimum(b_len, (tile0 + tiles_per_prog) * BLOCK_N)
    n_base = tile0 * BLOCK_N
    # prologue: page ids of tiles 0 and 1 (and, CODES_AHEAD, the codes of tile 0)
    b_blk, m_k = _paged_tile_blocks(p_bt, n_base + o_k, b_lim, bt_cols, block_size, num_blocks)
    b_blk1, m_k1 = _paged_tile_blocks(p_bt, n_base + BLOCK_N + o_k, b_lim, bt_cols, block_size, num_blocks)
    if CODES_AHEAD:
        b_k, b_sc = _paged_tile_keys(cache_ptr, n_base + o_k, b_blk, m_k, o_d, block_size, page_bytes)
        for t in range(0, n_live):
            o_n = n_base + t * BLOCK_N + o_k
            # in flight during this tile's work: codes of tile t + 1, page ids of tile t + 2
            b_k_nx, b_sc_nx = _paged_tile_keys(cache_ptr, o_n + BLOCK_N, b_blk1, m_k1, o_d, block_size, page_bytes)
            b_blk2, m_k2 = _paged_tile_blocks(p_bt, o_n + 2 * BLOCK_N, b_lim, bt_cols, block_size, num_blocks)
            b_l = _paged_tile_logits(b_k, b_sc, b_qt, b_w, NATIVE, BITS)
            tl.store(p_out + o_n, tl.where(m_k, b_l, float("-inf")), mask=o_n < max_ctx)
            b_k, b_sc, m_k = b_k_nx, b_sc_nx, m_k1
            b_blk1, m_k1 = b_blk2, m_k2
    elif PAIRS:
        n_end = (tile0 + n_live) * BLOCK_N  # this program's live positions end here
        for t in range(0, n_live, 2):
            o_n = n_base + t * BLOCK_N + o_k
            o_n2 = o_n + BLOCK_N
            # both tiles' rows in flight at once (their page ids are known), and the page ids
            # of tiles t + 2, t + 3 while these two are scored
            b_k, b_sc = _paged_tile_keys(cache_ptr, o_n, b_blk, m_k, o_d, block_size, page_bytes)
            b_k2, b_sc2 = _paged_tile_keys(cache_ptr, o_n2, b_blk1, m_k1, o_d, block_size, page_bytes)
            b_blk, m_kn = _paged_tile_blocks(p_bt, o_n + 2 * BLOCK_N, b_lim, bt_cols, block_size, num_blocks)
            b_blk1, m_kn1 = _paged_tile_blocks(p_bt, o_n + 3 * BLOCK_N, b_lim, bt_cols, block_size, num_blocks)
            b_l = _paged_tile_logits(b_k, b_sc, b_qt, b_w, NATIVE, BITS)
            tl.store(p_out + o_n, tl.where(m_k, b_l, float("-inf")), mask=o_n < max_ctx)
            b_l2 = _paged_tile_logits(b_k2, b_sc2, b_qt, b_w, NATIVE, BITS)
            tl.store(p_out + o_n2, tl.where(m_k1, b_l2, float("-inf")), mask=(o_n2 < max_ctx) & (o_n2 < n_end))
            m_k, m_k1 = m_kn, m_kn1
    else:
        for t in range(0, n_live):
            o_n = n_base + t * BLOCK_N + o_k
            # page ids of tile t + 2 in flight; this tile's rows load at once (ids known)
            b_blk2, m_k2 = _paged_tile_blocks(p_bt, o_n + 2 * BLOCK_N, b_lim, bt_cols, block_size, num_blocks)
            b_k, b_sc = _paged_tile_keys(cache_ptr, o_n, b_blk, m_k, o_d, block_size, page_bytes)
            b_l = _paged_tile_logits(b_k, b_sc, b_qt, b_w, NATIVE, BITS)
            tl.store(p_out + o_n, tl.where(m_k, b_l, float("-inf")), mask=o_n < max_ctx)
            b_blk, m_k = b_blk1, m_k1
            b_blk1, m_k1 = b_blk2, m_k2
    for t in range(n_live, tiles_per_prog):
        o_n = n_base + t * BLOCK_N + o_k
        tl.store(p_out + o_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=o_n < max_ctx)


@triton.jit(do_not_specialize=["M"])  # data-dependent count: one specialization
def _mqa_logits_v3_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, ks_ptr, ke_ptr, out_ptr,
    M, N, n_heads, out_cols,
    stride_q_m, stride_q_h, stride_w_m, stride_w_h, stride_k_n, stride_out_m,
    COMPRESSED: tl.constexpr,
    NATIVE: tl.constexpr,
    BITS: tl.constexpr,  # interpreter: bit-move portable decode (see _e4m3_to_f16)
    H_BLOCK: tl.constexpr,  # power of two >= max(H, 16)
    ROWS: tl.constexpr,  # query rows a dot: the MMA's N dim is ROWS * H_BLOCK
    BLOCK_M: tl.constexpr,  # query rows a program walks (a multiple of ROWS)
    BLOCK_N: tl.constexpr,  # keys: the MMA's M dim
):
    """_mqa_logits_v2_kernel (same arguments, grid and output) with ROWS query rows in one
    dot: the decoded key tile [BLOCK_N, 128] (A operand, decoded once a program) times the
    [128, ROWS * H_BLOCK] codes of ROWS rows (column r * H_BLOCK + h = head h of row r), so
    the MMA's N dim is 128 at H = 64 (ROWS 2) or H = 32 (ROWS 4) instead of H; then relu,
    * w, the head sum per row (a [BLOCK_N, ROWS, H_BLOCK] view) and a [BLOCK_N, ROWS] store.
    Same products, same fp32 accumulation per (key, head), same -inf masks."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    o_k = tl.arange(0, BLOCK_N)
    o_n = n0 + o_k
    m_n = o_n < N
    o_d = tl.arange(0, HEAD_DIM)
    o_c = tl.arange(0, ROWS * H_BLOCK)  # dot column: row o_c // H_BLOCK, head o_c % H_BLOCK
    o_ch = o_c % H_BLOCK
    o_cr = o_c // H_BLOCK
    m_ch = o_ch < n_heads
    o_rr = tl.arange(0, ROWS)
    m0 = pid_m * BLOCK_M
    o_r = m0 + tl.arange(0, BLOCK_M)
    m_r = o_r < M
    b_ks = tl.maximum(tl.load(ks_ptr + o_r, mask=m_r, other=0), 0)
    b_ke = tl.minimum(tl.load(ke_ptr + o_r, mask=m_r, other=0), N)
    lo = tl.min(tl.where(m_r & (b_ks < b_ke), b_ks, N), axis=0)
    hi = tl.max(tl.where(m_r & (b_ks < b_ke), b_ke, 0), axis=0)
    m_end = tl.minimum(m0 + BLOCK_M, M)
    m0_64 = pid_m.to(tl.int64) * BLOCK_M
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        p_k = k_ptr + n0.to(tl.int64) * stride_k_n
        b_k = tl.load(p_k + (o_k * stride_k_n)[:, None] + o_d[None, :], mask=m_n[:, None], other=0)
        b_k = _e4m3_to_f16(b_k, NATIVE, BITS)  # [BLOCK_N, 128]
        b_sc = tl.load(k_scale_ptr + o_n, mask=m_n, other=0.0)
        o_qt = o_d[:, None] + (o_cr * stride_q_m + o_ch * stride_q_h)[None, :]  # [128, ROWS * H_BLOCK] int32
        o_wc = o_cr * stride_w_m + o_ch * stride_w_h
        for i in range(0, m_end - m0, ROWS):
            m64 = m0_64 + i
            m_rows = (i + o_rr) < (m_end - m0)  # [ROWS]
            r_ks = tl.maximum(tl.load(ks_ptr + m64 + o_rr, mask=m_rows, other=0), 0)
            r_ke = tl.minimum(tl.load(ke_ptr + m64 + o_rr, mask=m_rows, other=0), N)
            m_c = m_ch & ((i + o_cr) < (m_end - m0))
            b_qt = tl.load(q_ptr + m64 * stride_q_m + o_qt, mask=m_c[None, :], other=0)
            b_qt = _e4m3_to_f16(b_qt, NATIVE, BITS)  # [128, ROWS * H_BLOCK]
            b_w = tl.load(w_ptr + m64 * stride_w_m + o_wc, mask=m_c, other=0.0)
            b_s = tl.dot(b_k, b_qt)  # [BLOCK_N, ROWS * H_BLOCK] fp32
            b_p = tl.reshape(tl.maximum(b_s, 0.0) * b_w[None, :], [BLOCK_N, ROWS, H_BLOCK])
            b_l = (tl.sum(b_p, axis=2) * _dot_unscale(NATIVE)) * b_sc[:, None]  # [BLOCK_N, ROWS]
            _mqa_store_rows(out_ptr, m64, b_l, o_n, m_n, r_ks, r_ke, m_rows, n0, out_cols, stride_out_m,
                            COMPRESSED, BLOCK_N, ROWS)
    else:
        for i in range(0, m_end - m0, ROWS):
            m64 = m0_64 + i
            m_rows = (i + o_rr) < (m_end - m0)
            r_ks = tl.maximum(tl.load(ks_ptr + m64 + o_rr, mask=m_rows, other=0), 0)
            r_ke = tl.minimum(tl.load(ke_ptr + m64 + o_rr, mask=m_rows, other=0), N)
            _mqa_store_rows(out_ptr, m64, tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32), o_n, m_n, r_ks,
                            r_ke, m_rows, n0, out_cols, stride_out_m, COMPRESSED, BLOCK_N, ROWS)


@triton.jit
def _mqa_store_rows(out_ptr, m64, b_l, o_n, m_n, r_ks, r_ke, m_rows, n0, out_cols, stride_out_m,
                    COMPRESSED: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Store ROWS query rows' logits b_l [BLOCK_N, ROWS] of keys o_n (rows m64 + r, m_rows
    valid); -inf outside each row's [ks, ke) (and the compressed -inf tail)."""
    o_rr = tl.arange(0, ROWS)
    m_cell = (o_n[:, None] >= r_ks[None, :]) & (o_n[:, None] < r_ke[None, :])  # [BLOCK_N, ROWS]
    b_l = tl.where(m_cell, b_l, float("-inf"))
    p_rows = out_ptr + (m64 + o_rr) * stride_out_m  # [ROWS]
    if COMPRESSED:
        o_col = o_n[:, None] - r_ks[None, :]
        tl.store(p_rows[None, :] + o_col, b_l, mask=m_cell & (o_col < out_cols) & m_rows[None, :])
        o_t = (n0 + tl.arange(0, BLOCK_N))[:, None]  # -inf tail [ke - ks, out_cols) of this column tile
        tl.store(p_rows[None, :] + o_t, tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32),
                 mask=(o_t >= (r_ke - r_ks)[None, :]) & (o_t < out_cols) & m_rows[None, :])
    else:
        tl.store(p_rows[None, :] + o_n[:, None], b_l, mask=m_n[:, None] & m_rows[None, :])


# Launch configs as plain data (same on every capability; no run-time autotune).
# "KERNEL" picks the kernel variant: 1 = the first kernels above, 2 = the v2 kernels
# (q quant: 2 = the pairs kernel), 3 = the v3 kernels (decode, prefill). benchmarks/sweep_indexer.py times every row of
# *_CANDIDATES on the GPU and prints the dict to ship; every candidate row AOT-compiles for
# sm_80 and sm_86 without spills (`python -m dsv4_ops.aot --candidates`).
# Shipped: the best of the H200 sweep (portable, in-graph; benchmarks/results/sweep_indexer.md):
# k insert 1.51x the byte floor (was 2.16x), q quant 1.86x (3.0x), prefill 2.7-2.8x the flop
# floor (4.6x), decode B=64 H=32 2.06x (3.87x), H=64 3.76x (4.40x). Issue 18 (same-run,
# benchmarks/results/indexer_candidates.md): decode H=64 2.46x (PAGED_CONFIG_WIDE), compressed
# prefill 2.67x at H=64, 3.03x at H=32 (v3).
K_INSERT_CONFIG = {"TOKENS": 32, "num_warps": 4}
Q_QUANT_CONFIG = {"KERNEL": 2, "HEADS": 32, "num_warps": 4}
MQA_CONFIG = {"KERNEL": 2, "BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}  # full [M, N] output
# compressed [M, max_seqlen_k] output (what vLLM's prefill uses)
# Issue 18 (H200, portable, same run; benchmarks/results/indexer_candidates.md): v3 with 2 rows
# a dot at H = 64 / 4 at H = 32: 0.99x / 0.92x the time of v2 {"KERNEL": 2, "BLOCK_M": 32,
# "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}, which stays selectable.
MQA_COMPRESSED_CONFIG = {"KERNEL": 3, "BLOCK_M": 32, "BLOCK_N": 64, "DOT_N": 128, "num_warps": 4, "num_stages": 2}
# decode, H_BLOCK <= 32 (V4.1's 32 heads): v2, 64 keys x 2 warps (the v3 candidates were
# 0.99-1.19x its time at B = 8 / 64 there)
# Planned in waves of resident programs (PROGRAMS_PER_SM: the plan asks the driver for the compiled
# kernel's programs an SM, 8 on the H200's compile; 5 is sm_80's, 185 registers x 2 warps, where it
# cannot ask; dispatch.indexer.wave_plan).
PAGED_CONFIG = {"KERNEL": 2, "BLOCK_N": 64, "num_warps": 2, "num_stages": 2,
                "TARGET_PROGRAMS": 864,  # without an SM count (the interpreter): ~8 programs an SM on 108 SMs
                "MAX_TILES_PER_PROGRAM": 64, "PROGRAMS_PER_SM": 5}
# decode, H_BLOCK >= 64 (V4's 64 heads): v3 (page ids two tiles ahead), 128 keys x 4
# warps, 2 programs an SM x the SM count: 0.75 / 0.70 / 0.66x the time of PAGED_CONFIG at
# B = 1 / 8 / 64 on the H200 (258 -> 170 us at B = 64, 32K keys). Caveat: 4 warps lower
# tl.dot to wgmma on the H200 (mma.sync with 2 warps, and always on sm_80), so the A100 gain
# is not measured; v2 at the same 128 x 4 geometry (also wgmma) was 289 us.
PAGED_CONFIG_WIDE = {"KERNEL": 3, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "TARGET_PROGRAMS": 432,
                     "MAX_TILES_PER_PROGRAM": 64, "PROGRAMS_PER_SM": 2}

K_INSERT_CANDIDATES = [
    {"TOKENS": t, "num_warps": w} for t, w in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8))
]
Q_QUANT_CANDIDATES = [dict(Q_QUANT_CONFIG)] + [
    {"KERNEL": 2, "HEADS": h, "num_warps": w} for h, w in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8))
]
MQA_CANDIDATES = [dict(MQA_COMPRESSED_CONFIG),  # (benchmarks/results/indexer_candidates.md)
                  {"KERNEL": 2, "BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}] + [  # (MQA_CONFIG, 64 x 8 warps, spills compressed on sm_86)
    {"KERNEL": 2, "BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
    for m, n, w, st in ((16, 128, 4, 2), (32, 128, 4, 2), (64, 128, 4, 2), (32, 128, 8, 2), (64, 256, 8, 2),
                        (32, 64, 4, 2), (64, 128, 8, 3))
] + [  # v3, ROWS = DOT_N / H_BLOCK query rows a dot (DOT_N 128: 2 rows at H = 64, 4 at H = 32;
    # BLOCK_N 128 x DOT_N 128 spills 8-24 B at H = 32 on sm_80/86, so those two are H = 64 candidates only)
    {"KERNEL": 3, "BLOCK_M": m, "BLOCK_N": n, "DOT_N": dn, "num_warps": w, "num_stages": 2}
    for m, n, dn, w in ((32, 64, 128, 4), (32, 128, 128, 8), (32, 128, 64, 4))
]
NEW_MQA_CANDIDATES = MQA_CANDIDATES[-3:]  # timed beside the v2 config by benchmarks/bench_indexer.py
PAGED_CANDIDATES = [dict(PAGED_CONFIG), dict(PAGED_CONFIG_WIDE)] + [
    {"KERNEL": 2, "BLOCK_N": n, "num_warps": w, "num_stages": st, "TARGET_PROGRAMS": tp,
     "MAX_TILES_PER_PROGRAM": 64}
    # (64 keys x 4 warps spills 24 B on sm_86: not a candidate)
    for n, w, st, tp in ((64, 2, 2, 864), (128, 4, 2, 864), (128, 4, 2, 432), (128, 4, 3, 432), (128, 8, 2, 432),
                         (128, 8, 3, 864), (256, 8, 2, 432), (64, 2, 3, 1728))
] + [  # v3 (page ids two tiles ahead) and the wave plan (the compiled kernel's programs an SM x the SM
    # count; PROGRAMS_PER_SM where the driver cannot be asked)
    # (CODES_AHEAD, the next tile's codes in flight too, spills at H = 64: sm_80 108 B, sm_86 72-112 B)
    {"KERNEL": k, "BLOCK_N": n, "num_warps": w, "num_stages": 2, "TARGET_PROGRAMS": tp, "MAX_TILES_PER_PROGRAM": 64,
     **({"PROGRAMS_PER_SM": pps} if pps else {})}
    # (v2, 64 x 2 warps, the wave plan: PAGED_CONFIG itself)
    for k, n, w, tp, pps in ((3, 64, 2, 864, 0), (3, 64, 2, 864, 5), (3, 128, 4, 432, 2))
]
NEW_PAGED_CANDIDATES = PAGED_CANDIDATES[-3:]  # timed beside the v2 PAGED_CONFIG by benchmarks/bench_indexer.py
