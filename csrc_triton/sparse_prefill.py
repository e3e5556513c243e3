"""Sparse MLA prefill (FlashMLA ``flash_mla_sparse_fwd``'s job): op ``sparse_mla_prefill``.

One program per (query, head group): the group's BLOCK_H heads are the M dimension of every
tl.dot, so each gathered key row (512 latent dims, both key and value of every head: MQA) is
loaded once per program and reused by all of its heads. No split: at prefill T x groups fill
the SMs, so out and lse (sink folded in) are written in the epilogue, no partials, no merge.

The 512-d latent is handled as 4 chunks of 128 dims (``C = 128``): q as 4 [BLOCK_H, 128]
operands, 4 fp32 accumulators [BLOCK_H, 128], and each key block as 4 [BLOCK_N, 128] tiles
loaded once and used twice (scores q_c k_c^T summed over c, then p @ v_c). Key rows are
gathered by index. The key-block loop is ``tl.range(num_stages=NUM_STAGES)``: with 16-byte
alignment hints (tl.multiple_of) the gathered rows become cp.async copies into shared memory.
IDX_AHEAD = False loads a block's indices in its own iteration, which makes the gather an
indirect load and leaves the pipeliner one key buffer (load, then wait, then compute);
IDX_AHEAD = True carries the next index block across iterations so NUM_STAGES - 1 key blocks
are in flight. ``_sparse_mla_prefill_splitd_kernel`` is the same attention with the chunks
on the leading axis of 3-D dots, one chunk a warp (its comment block says why). (A register
prefetch of the next block's key rows was measured 1.8-2.3x slower than the pipeliner on the
H200 and removed: benchmarks/results/sparse_prefill.md of commit 338b453, "pf" rows.)

Semantics (= dsv4_ops.reference.ref_sparse_mla_decode): positions j < min(topk_length[t], K)
with 0 <= indices[t, j] < N are the valid keys; scores (q . k) * sm_scale with fp32
accumulation of bf16 (fp16 under the interpreter) operands; p cast to the kv dtype for p @ v
(fp32 accumulate); the per-head sink is a logit in the denominator with no value (a NaN sink is
no sink). A head with no valid key gets out 0 and lse = sink (-inf without one), never NaN.
Invalid key rows are loaded as zeros (masked), so workspace garbage (NaN/inf rows) never meets
a zero probability.
"""

import triton
import triton.language as tl

HEAD_DIM = 512
CHUNK = 128  # latent dims a chunk


# Sizes are not specialized (value 1, divisibility by 16): one compile serves every T, H, K, N.
@triton.jit(do_not_specialize=["H", "K", "N", "G"])
def _sparse_mla_prefill_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, sink_ptr, o_ptr, lse_ptr,
    H, K, N, G, sm_scale,
    stride_q_t, stride_q_h, stride_kv_n, stride_indices_t, stride_o_t, stride_o_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, IDX_AHEAD: tl.constexpr,
    HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Grid (T * G,): program pid runs head group g = pid % G of query t = pid // G (the
    groups of one query are adjacent, so their key reads meet in L2). q [T, H, 512] and out
    [T, H, 512] with row strides (dims unit-stride); kv [N, 512] rows of stride stride_kv_n;
    indices [T, K] rows of stride stride_indices_t; lse fp32 [T, H] contiguous."""
    C: tl.constexpr = 128
    # Row strides are multiples of 8 elements and the bases 16-byte aligned (the launcher
    # checks; Triton would specialize on it at launch, the hints make the AOT compile the same
    # 16-byte vector loads).
    stride_q_t = tl.multiple_of(stride_q_t, 8)
    stride_q_h = tl.multiple_of(stride_q_h, 8)
    stride_kv_n = tl.multiple_of(stride_kv_n, 8)
    stride_o_t = tl.multiple_of(stride_o_t, 8)
    stride_o_h = tl.multiple_of(stride_o_h, 8)
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_t = (pid // G).to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    o_c = tl.arange(0, C)  # [C]
    p_q = tl.multiple_of(q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h, 16)[:, None] + o_c[None, :]
    b_q0 = tl.load(p_q, mask=m_h[:, None], other=0.0)  # [BLOCK_H, C] each
    b_q1 = tl.load(p_q + C, mask=m_h[:, None], other=0.0)
    b_q2 = tl.load(p_q + 2 * C, mask=m_h[:, None], other=0.0)
    b_q3 = tl.load(p_q + 3 * C, mask=m_h[:, None], other=0.0)

    k_len = K
    if HAS_TOPK_LENGTH:
        k_len = tl.minimum(tl.maximum(tl.load(topk_length_ptr + pid_t), 0), K)
    n_blocks = (k_len + BLOCK_N - 1) // BLOCK_N

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running denominator
    b_a0 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    b_a1 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    p_idx = indices_ptr + pid_t * stride_indices_t
    o_b = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if IDX_AHEAD:
        b_idx_n = tl.load(p_idx + o_b, mask=o_b < k_len, other=-1)
    for blk in tl.range(0, n_blocks, num_stages=NUM_STAGES):
        if IDX_AHEAD:
            # The index block is loop-carried (loaded one iteration ahead), so the key-row gather
            # is no indirect load of this iteration and the pipeliner keeps NUM_STAGES - 1 key
            # blocks in flight (TTGIR: 2 buffers at NUM_STAGES 3, against 1 without).
            b_idx = b_idx_n
            o_n1 = (blk + 1) * BLOCK_N + o_b
            b_idx_n = tl.load(p_idx + o_n1, mask=o_n1 < k_len, other=-1)
        else:
            o_n = blk * BLOCK_N + o_b
            b_idx = tl.load(p_idx + o_n, mask=o_n < k_len, other=-1)
        m_n = (b_idx >= 0) & (b_idx < N)
        p_row = tl.multiple_of(kv_ptr + tl.where(m_n, b_idx, 0).to(tl.int64) * stride_kv_n, 16)
        p_kv = p_row[:, None] + o_c[None, :]
        b_k0 = tl.load(p_kv, mask=m_n[:, None], other=0.0)  # [BLOCK_N, C] each: once for all heads
        b_k1 = tl.load(p_kv + C, mask=m_n[:, None], other=0.0)
        b_k2 = tl.load(p_kv + 2 * C, mask=m_n[:, None], other=0.0)
        b_k3 = tl.load(p_kv + 3 * C, mask=m_n[:, None], other=0.0)
        b_s = tl.dot(b_q0, tl.trans(b_k0))  # [BLOCK_H, BLOCK_N] fp32
        b_s = tl.dot(b_q1, tl.trans(b_k1), b_s)
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s)
        b_s = tl.dot(b_q3, tl.trans(b_k3), b_s)
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]; 0 where invalid
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_pv = b_p.to(b_k0.dtype)
        b_a0 = tl.dot(b_pv, b_k0, b_a0 * b_alpha[:, None])
        b_a1 = tl.dot(b_pv, b_k1, b_a1 * b_alpha[:, None])
        b_a2 = tl.dot(b_pv, b_k2, b_a2 * b_alpha[:, None])
        b_a3 = tl.dot(b_pv, b_k3, b_a3 * b_alpha[:, None])
        b_m = b_m_new

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * 0.6931471805599453, float("-inf"))
    b_scale = 1.0 / b_l_safe  # [BLOCK_H]
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=float("-inf")).to(tl.float32)
        b_sink = tl.where(b_sink == b_sink, b_sink, float("-inf"))  # a NaN sink is no sink
        b_max = tl.maximum(b_lse, b_sink)
        b_max_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
        b_den = tl.exp(b_lse - b_max_safe) + tl.exp(b_sink - b_max_safe)
        b_tot = tl.where(b_den > 0.0, b_max_safe + tl.log(tl.where(b_den > 0.0, b_den, 1.0)), float("-inf"))
        # out = (sum p v / l) * exp(lse_keys - lse_total); 0 where no key (acc is 0 there)
        b_scale = tl.where(has_key, tl.exp(b_lse - tl.where(has_key, b_tot, 0.0)) / b_l_safe, 0.0)
        b_lse = b_tot
    row_o = pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H]
    p_o = tl.multiple_of(o_ptr + row_o, 16)[:, None] + o_c[None, :]
    ty = o_ptr.dtype.element_ty
    tl.store(p_o, (b_a0 * b_scale[:, None]).to(ty), mask=m_h[:, None])
    tl.store(p_o + C, (b_a1 * b_scale[:, None]).to(ty), mask=m_h[:, None])
    tl.store(p_o + 2 * C, (b_a2 * b_scale[:, None]).to(ty), mask=m_h[:, None])
    tl.store(p_o + 3 * C, (b_a3 * b_scale[:, None]).to(ty), mask=m_h[:, None])
    tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)


# The split-d variant: the same arithmetic with the 512 latent dims as SPLIT chunks on a
# leading batch axis of 3-D tl.dots. Triton's mma layout for a batched dot puts the warps on
# the batch axis (TTGIR: warpsPerCTA [num_warps, 1, 1]), so with num_warps == SPLIT each warp
# owns one d-chunk of q, of the key block and of the accumulator: the partial scores of its
# chunk (q_c k_c^T, no MMA recomputed or replicated), one cross-warp sum (tl.sum over the
# chunk axis, through shared memory) to the full scores, softmax on every warp, then p @ v_c
# into its own chunk of the output. The 2-D kernel above instead spreads the key columns of
# every dot over the warps (warpsPerCTA [1, num_warps]), so every warp reads all of q from
# shared memory each block, and a block narrower than 8 x num_warps keys runs each score MMA
# on 2-4 warps at once.

@triton.jit(do_not_specialize=["H", "K", "N", "G"])
def _sparse_mla_prefill_splitd_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, sink_ptr, o_ptr, lse_ptr,
    H, K, N, G, sm_scale,
    stride_q_t, stride_q_h, stride_kv_n, stride_indices_t, stride_o_t, stride_o_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, IDX_AHEAD: tl.constexpr,
    HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
):
    """_sparse_mla_prefill_kernel's arguments and semantics, the latent as SPLIT chunks of
    512 // SPLIT dims (launched with num_warps == SPLIT: one chunk a warp)."""
    C: tl.constexpr = 512 // SPLIT
    stride_q_t = tl.multiple_of(stride_q_t, 8)
    stride_q_h = tl.multiple_of(stride_q_h, 8)
    stride_kv_n = tl.multiple_of(stride_kv_n, 8)
    stride_o_t = tl.multiple_of(stride_o_t, 8)
    stride_o_h = tl.multiple_of(stride_o_h, 8)
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_t = (pid // G).to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_s = tl.arange(0, SPLIT)
    o_c = tl.arange(0, C)
    p_q = (tl.multiple_of(q_ptr + pid_t * stride_q_t + o_h.to(tl.int64) * stride_q_h, 16)[None, :, None]
           + (o_s * C)[:, None, None] + o_c[None, None, :])
    b_q = tl.load(p_q, mask=m_h[None, :, None], other=0.0)  # [SPLIT, BLOCK_H, C]

    k_len = K
    if HAS_TOPK_LENGTH:
        k_len = tl.minimum(tl.maximum(tl.load(topk_length_ptr + pid_t), 0), K)
    n_blocks = (k_len + BLOCK_N - 1) // BLOCK_N

    qk_scale = sm_scale * 1.4426950408889634
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([SPLIT, BLOCK_H, C], dtype=tl.float32)  # chunk-major accumulator
    p_idx = indices_ptr + pid_t * stride_indices_t
    o_b = tl.arange(0, BLOCK_N)
    if IDX_AHEAD:
        b_idx_n = tl.load(p_idx + o_b, mask=o_b < k_len, other=-1)
    for blk in tl.range(0, n_blocks, num_stages=NUM_STAGES):
        if IDX_AHEAD:
            b_idx = b_idx_n
            o_n1 = (blk + 1) * BLOCK_N + o_b
            b_idx_n = tl.load(p_idx + o_n1, mask=o_n1 < k_len, other=-1)
        else:
            o_n = blk * BLOCK_N + o_b
            b_idx = tl.load(p_idx + o_n, mask=o_n < k_len, other=-1)
        m_n = (b_idx >= 0) & (b_idx < N)
        p_row = tl.multiple_of(kv_ptr + tl.where(m_n, b_idx, 0).to(tl.int64) * stride_kv_n, 16)
        p_kv = p_row[None, :, None] + (o_s * C)[:, None, None] + o_c[None, None, :]
        b_k = tl.load(p_kv, mask=m_n[None, :, None], other=0.0)  # [SPLIT, BLOCK_N, C]
        b_sp = tl.dot(b_q, tl.trans(b_k, (0, 2, 1)))  # [SPLIT, BLOCK_H, BLOCK_N] partial scores
        b_s = tl.sum(b_sp, 0)  # [BLOCK_H, BLOCK_N]: the cross-warp sum over the chunks
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_p = tl.exp2(b_s - b_m_safe[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        # every chunk's p @ v_c takes the same p (broadcast on the chunk axis, no copy in memory)
        b_p3 = tl.broadcast_to(b_p.to(b_k.dtype)[None, :, :], (SPLIT, BLOCK_H, BLOCK_N))
        b_acc = tl.dot(b_p3, b_k, b_acc * b_alpha[None, :, None])
        b_m = b_m_new

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * 0.6931471805599453, float("-inf"))
    b_scale = 1.0 / b_l_safe
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + o_h, mask=m_h, other=float("-inf")).to(tl.float32)
        b_sink = tl.where(b_sink == b_sink, b_sink, float("-inf"))
        b_max = tl.maximum(b_lse, b_sink)
        b_max_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
        b_den = tl.exp(b_lse - b_max_safe) + tl.exp(b_sink - b_max_safe)
        b_tot = tl.where(b_den > 0.0, b_max_safe + tl.log(tl.where(b_den > 0.0, b_den, 1.0)), float("-inf"))
        b_scale = tl.where(has_key, tl.exp(b_lse - tl.where(has_key, b_tot, 0.0)) / b_l_safe, 0.0)
        b_lse = b_tot
    row_o = pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h
    p_o = tl.multiple_of(o_ptr + row_o, 16)[None, :, None] + (o_s * C)[:, None, None] + o_c[None, None, :]
    ty = o_ptr.dtype.element_ty
    tl.store(p_o, (b_acc * b_scale[None, :, None]).to(ty), mask=m_h[None, :, None])
    tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)


# Launch configs per head-group size (BLOCK_H), as plain data. CANDIDATES: every config the
# benchmark times (benchmarks/bench_sparse_prefill.py), each spill-free on sm_80 and sm_86 and
# within sm_86's 99 KB of shared memory (AOT table, `python -m dsv4_ops.aot`); PREFILL_CONFIG:
# the one the launcher runs (measured, below). "IDX_AHEAD": the index block loop-carried (the
# kernel doc); "SPLIT": the split-d kernel with that many chunks (num_warps == SPLIT).
# Registers / shared memory (sm_80, triton 3.8 AOT, topk_length and sink):
#   bh16: bn64 w4 s2 184 / 84 KB; bn64 w4 s2 ia 190; bn32 w4 s3 ia 185 / 81 KB;
#         split4 bn32 w4 s3 ia 226 / 82 KB; split4 bn16 w4 s4 ia 168 / 66 KB
#   bh32: bn16 w4 s2 224 / 49 KB; bn16 w4 s4 ia 226 / 81 KB; bn32 w4 s2 255 / 66 KB;
#         bn32 w4 s3 ia 255 / 98 KB; split4 bn16 w4 s3 ia 250 / 66 KB; split4 bn16 w4 s4 ia 250 / 82 KB
#   bh64: bn16 w8 s3 ia 239 / 98 KB; split8 bn16 w8 s3 ia 252 / 96 KB
# split8 (64-dim chunks): the TTGIR (3.8) has NO cp.async and no multi-buffering for its key
# rows (the score and PV operands get different shared layouts for 128-byte chunk rows, so the
# pipeliner leaves the gather a plain load + store); kept once (bh64: all 64 heads in one
# program, keys gathered once a query) to measure that, split8 bh32 x bn32 dropped.
# Probed and rejected (AOT): bh64 at 16 warps (spills), bh64 x bn32 / bn64 and bh32 x bn64 (over
# sm_86's 99 KB), split4 bh32 x bn32 and bh16 x bn64 (224 / 600 B spilled), 2-D bh16 bn64 w8
# (8 B spilled). 2-D blocks narrower than 8 x num_warps keys (bh32 bn16 w4, bh64 bn16 w8)
# replicate the score MMAs over 2-4 warps (warpsPerCTA [1, num_warps]); kept as the measured
# baselines. Without the 16-byte alignment hints (multiple_of) every load was a 2-byte
# ld.global and nothing but the indices was pipelined. The kernels hold no fp8: both variants
# share these.
CANDIDATES = {
    16: ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
         {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "IDX_AHEAD": True},
         {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "IDX_AHEAD": True},
         {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "IDX_AHEAD": True, "SPLIT": 4},
         {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4, "IDX_AHEAD": True, "SPLIT": 4}),
    32: ({"BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
         {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4, "IDX_AHEAD": True},
         {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
         {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "IDX_AHEAD": True},
         {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3, "IDX_AHEAD": True, "SPLIT": 4},
         {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4, "IDX_AHEAD": True, "SPLIT": 4}),
    64: ({"BLOCK_N": 16, "num_warps": 8, "num_stages": 3, "IDX_AHEAD": True},
         {"BLOCK_N": 16, "num_warps": 8, "num_stages": 3, "IDX_AHEAD": True, "SPLIT": 8}),
}
# Measured (H200, portable, DISABLE_MMA_V3=1 so every dot is mma.sync as on sm_80; s_q 4096,
# K 640, random workload; benchmarks/results/sparse_prefill.md, commit 49cd565), each also with
# the SM's shared memory cut to an A100's 164 KB ("A100 smem"):
#   H = 64: bh32 bn32 w4 s2 1955 us (A100 smem 1939), bn32 s3 ia 1967 (2673: one CTA a SM),
#           bn16 w4 s2 (old dispatch) 3384, bn16 s4 ia 3155, split4 3589-3600, bh64 5111,
#           bh64 split8 9704; H = 128 bh32 bn32 w4 s2 3870 (old 6561).
#   H = 8:  bh16 bn64 s2 ia 497 (A100 smem 719), bn32 s3 ia 651 (650), bn64 s2 (old dispatch)
#           551 (852), split4 1005-1128.
# The launcher runs what is fastest with an A100's shared memory: bh16 bn32 s3 ia (H <= 16;
# on an H200 bn64 s2 ia is 24% faster, but its two 84 KB CTAs do not fit an A100 SM) and bh32
# bn32 w4 s2 (H > 16, as 32-row groups). Split-d lost: ncu shows 48% of its shared-memory
# wavefronts are bank conflicts (the cross-warp reduction), against 1% for the 2-D kernel.
PREFILL_CONFIG = {16: CANDIDATES[16][2], 32: CANDIDATES[32][2]}
# The head group each H runs with: the smallest listed BLOCK_H >= H, else the last (H = 64 is
# two 32-row groups, H = 128 four).
BLOCK_H_STEPS = (16, 32)
MAX_BLOCK_H = BLOCK_H_STEPS[-1]


def block_h_for(H: int) -> int:
    """Rows of a head group for H heads (BLOCK_H_STEPS)."""
    for bh in BLOCK_H_STEPS:
        if int(H) <= bh:
            return bh
    return MAX_BLOCK_H


def kernel_for(cfg):
    """The jit function a config launches: the split-d kernel when it names a SPLIT."""
    return _sparse_mla_prefill_splitd_kernel if cfg.get("SPLIT") else _sparse_mla_prefill_kernel


def config_label(block_h: int, cfg) -> str:
    """Short name of a config (benchmark tables, AOT labels): bh32 bn16 w4 s3 ia split4."""
    return (f"bh{block_h} bn{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
            f"{' ia' if cfg.get('IDX_AHEAD') else ''}{' split' + str(cfg['SPLIT']) if cfg.get('SPLIT') else ''}")
