"""Split-KV sparse MLA decode: the per-split kernel (op ``sparse_mla_split``).

Partial layout (what ``merge_splits`` reads; written down here and in dsv4_ops.attention)
  o_part   float32 [T, H, S, D]  the split's softmax-normalised output, sum_j p_j v_j / l_s
  lse_part float32 [T, H, S]     the split's log-sum-exp (natural log) of its scores
  A split with no valid key writes o = 0 and lse = -inf.

Partition of the key axis (static per token, no host sync)
  The key positions of token t that can be valid are j < k_len = min(topk_length[t], K)
  (K without topk_length). They form nb = cdiv(k_len, PARTITION_N) blocks of PARTITION_N
  positions; split s of S takes blocks [floor(s * nb / S), floor((s + 1) * nb / S)), so
  split sizes differ by at most one block and no split is empty while S <= nb.

Heads are tiled BLOCK_H at a time (16: the M of mma.sync); fewer heads (H = 1, 8) are
masked inside the tile, never padded in memory. Scores tl.dot(q, k^T) take bf16 operands
and accumulate in fp32; p is cast to the KV dtype for p @ v (fp32 accumulate).
"""

import triton
import triton.language as tl

HEAD_DIM = 512
# Key-block granularity of the partition; part of the partial layout's contract.
PARTITION_N = 16
# Largest split count a launcher accepts (merge loads next_pow2(S) rows per program).
MAX_SPLITS = 64

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def split_online_softmax(q_ptr, kv_ptr, indices_ptr, topk_length_ptr, pid_t, pid_s, o_h, m_h, K, N, S, sm_scale,
                         stride_q_t, stride_q_h, stride_kv_n, stride_indices_t,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_TOPK_LENGTH: tl.constexpr):
    """Online softmax of the heads o_h (mask m_h) of token pid_t over the key blocks of split
    pid_s of S (BLOCK_N keys a block, each loaded once for all BLOCK_H heads). Returns
    (b_m [BLOCK_H] running max in the log2 domain, b_l [BLOCK_H] denominator, b_acc
    [BLOCK_H, D] unnormalised sum of p * v); b_l = 0 where the split saw no valid key."""
    o_d = tl.arange(0, D)  # [D]
    p_q = q_ptr + pid_t * stride_q_t + o_h[:, None].to(tl.int64) * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None], other=0.0)  # [BLOCK_H, D]

    k_len = K
    if HAS_TOPK_LENGTH:
        k_len = tl.minimum(tl.maximum(tl.load(topk_length_ptr + pid_t), 0), K)
    n_blocks = (k_len + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * n_blocks) // S
    blk_hi = ((pid_s + 1) * n_blocks) // S

    qk_scale = sm_scale * LOG2E  # scores in the log2 domain
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running denominator
    b_acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    p_idx = indices_ptr + pid_t * stride_indices_t
    for blk in range(blk_lo, blk_hi):
        o_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        b_idx = tl.load(p_idx + o_n, mask=o_n < k_len, other=-1)
        m_n = (b_idx >= 0) & (b_idx < N)
        b_row = tl.where(m_n, b_idx, 0).to(tl.int64)
        b_kv = tl.load(kv_ptr + b_row[:, None] * stride_kv_n + o_d[None, :],
                       mask=m_n[:, None], other=0.0)  # [BLOCK_N, D]: once for all BLOCK_H heads
        b_s = tl.dot(b_q, tl.trans(b_kv)) * qk_scale  # [BLOCK_H, BLOCK_N] fp32
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_kv.dtype), b_kv)
        b_m = b_m_new
    return b_m, b_l, b_acc


@triton.jit(do_not_specialize=["N"])  # data-dependent count: one specialization
def _sparse_mla_split_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, o_part_ptr, lse_part_ptr,
    H, K, N, S, sm_scale,
    stride_q_t, stride_q_h, stride_kv_n, stride_indices_t,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TOPK_LENGTH: tl.constexpr,
):
    """Grid (T, cdiv(H, BLOCK_H), S): one program runs an online softmax for BLOCK_H heads of
    one token over the key blocks of one split, and writes o_part/lse_part rows (t, h, s)."""
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)

    o_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    o_d = tl.arange(0, D)  # [D]
    b_m, b_l, b_acc = split_online_softmax(q_ptr, kv_ptr, indices_ptr, topk_length_ptr, pid_t, pid_s, o_h, m_h,
                                           K, N, S, sm_scale, stride_q_t, stride_q_h, stride_kv_n,
                                           stride_indices_t, D, BLOCK_H, BLOCK_N, HAS_TOPK_LENGTH)

    has_key = b_l > 0.0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_o = b_acc / b_l_safe[:, None]  # [BLOCK_H, D]; 0 where the split saw no valid key
    b_lse = tl.where(has_key, (b_m + tl.log2(b_l_safe)) * LN2, float("-inf"))
    row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
    tl.store(lse_part_ptr + row, b_lse, mask=m_h)
    tl.store(o_part_ptr + row[:, None] * D + o_d[None, :], b_o, mask=m_h[:, None])


# Launch configs as plain data, per kernel variant (the attention kernels hold no fp8, so the
# variants share them). Fits sm_86's 99 KB of shared memory a block; see `python -m dsv4_ops.aot`.
SPLIT_CONFIG = {
    "portable": {"BLOCK_H": 16, "BLOCK_N": PARTITION_N, "num_warps": 4, "num_stages": 2},
    "native": {"BLOCK_H": 16, "BLOCK_N": PARTITION_N, "num_warps": 4, "num_stages": 2},
}


@triton.jit(do_not_specialize=["T"])  # data-dependent count: one specialization
def _dsv4_decode_indices_kernel(
    topk_slots_ptr, topk_length_ptr, swa_slots_ptr, indices_ptr,
    T, K1, K2, cap_c, cap_w, stride_topk_t, stride_swa_t,
    BLOCK: tl.constexpr, HAS_TOPK_LENGTH: tl.constexpr,
):
    """Grid (T, cdiv(K1 + K2, BLOCK)): indices of the DSv4 decode workspace for one token.

    Workspace rows: [0, T*K1) the compressed top-k rows token-major, [T*K1, T*(K1+K2)) the
    window rows. indices[t, j] = t*K1 + j (j < K1) or T*K1 + t*K2 + j - K1, and -1 where the
    slot is invalid (< 0 or >= the cache's capacity) or j >= topk_length[t] (j < K1 only):
    the gather wrote a zero row there, which must not be attended.
    """
    pid_t = tl.program_id(0).to(tl.int64)
    o_j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m_c = o_j < K1
    m_w = (o_j >= K1) & (o_j < K1 + K2)
    b_sc = tl.load(topk_slots_ptr + pid_t * stride_topk_t + o_j, mask=m_c, other=-1).to(tl.int64)
    b_sw = tl.load(swa_slots_ptr + pid_t * stride_swa_t + (o_j - K1), mask=m_w, other=-1).to(tl.int64)
    ok_c = m_c & (b_sc >= 0) & (b_sc < cap_c)
    if HAS_TOPK_LENGTH:
        ok_c = ok_c & (o_j < tl.load(topk_length_ptr + pid_t))
    ok_w = m_w & (b_sw >= 0) & (b_sw < cap_w)
    b_row = tl.where(m_c, pid_t * K1 + o_j, T * K1 + pid_t * K2 + (o_j - K1))
    b_idx = tl.where(ok_c | ok_w, b_row, -1)
    tl.store(indices_ptr + pid_t * (K1 + K2) + o_j, b_idx.to(tl.int32), mask=o_j < K1 + K2)


INDICES_CONFIG = {"BLOCK": 1024, "num_warps": 4}
