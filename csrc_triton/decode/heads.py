"""Sparse MLA decode, "all heads of a token in one program" (the ``heads`` specialization).

MQA: one latent row (512 dims) is both the key and the value of every head, so one program
per (token, split, head group) loads each block of BLOCK_N keys x 512 dims ONCE and scores
all BLOCK_H heads of its group against it with one tl.dot (BLOCK_H = the token's heads padded
to a power of two >= 16, the M of mma.sync; at most 32 (registers, see HEADS_CONFIG), so
H = 64 is two groups and H = 128 four). The
split-KV tile kernel (csrc_triton.decode.tiles) instead re-reads every key cdiv(H, 16) times.

Two epilogues (constexpr DIRECT):
  DIRECT = False  partials o_part fp32 [T, H, S, D] (normalised by the split's own sum) and
                  lse_part fp32 [T, H, S] in the layout of csrc_triton.decode.tiles, merged by
                  csrc_triton.decode.merge (the split partition here is in BLOCK_N-key blocks, which
                  the merge does not depend on).
  DIRECT = True   S must be 1: the sink is folded in and the final out (bf16 [T, H, D], row
                  strides stride_o_t / stride_o_h) and lse fp32 [T, H] are written, so the
                  merge launch and the partial bytes go away.
A head with no valid key gets out 0 and lse = sink (-inf without a sink), never NaN.

Partition of the key axis: positions j < k_len = min(topk_length[t], K) form
nb = cdiv(k_len, BLOCK_N) blocks; split s takes blocks [floor(s*nb/S), floor((s+1)*nb/S)).
Scores tl.dot(q, k^T) take bf16 (fp16 under the interpreter) operands with fp32 accumulate;
p is cast to the KV dtype for p @ v (fp32 accumulate), as in the tile kernel.
"""

import triton
import triton.language as tl

HEAD_DIM = 512


@triton.jit(do_not_specialize=["N"])  # data-dependent count: one specialization
def _sparse_mla_heads_kernel(
    q_ptr, kv_ptr, indices_ptr, topk_length_ptr, sink_ptr, o_ptr, lse_ptr,
    H, K, N, S, G, sm_scale,
    stride_q_t, stride_q_h, stride_kv_n, stride_indices_t, stride_o_t, stride_o_h,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
):
    """Grid (T * S * G,): program pid runs head group g = pid % G of token t = pid // (S*G)
    over the key blocks of split s = (pid // G) % S (the groups of one token are adjacent, so
    their key reads meet in L2). DIRECT: o_ptr/lse_ptr are out bf16 [T, H, D] / lse fp32
    [T, H] (S == 1); else o_part fp32 [T, H, S, D] / lse_part fp32 [T, H, S] contiguous."""
    pid = tl.program_id(0)
    pid_g = pid % G
    pid_s = (pid // G) % S
    pid_t = (pid // (G * S)).to(tl.int64)

    o_h = pid_g * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    o_d = tl.arange(0, D)  # [D]
    p_q = q_ptr + pid_t * stride_q_t + o_h[:, None].to(tl.int64) * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None], other=0.0)  # [BLOCK_H, D]

    k_len = K
    if HAS_TOPK_LENGTH:
        k_len = tl.minimum(tl.maximum(tl.load(topk_length_ptr + pid_t), 0), K)
    n_blocks = (k_len + BLOCK_N - 1) // BLOCK_N
    blk_lo = (pid_s * n_blocks) // S
    blk_hi = ((pid_s + 1) * n_blocks) // S

    qk_scale = sm_scale * 1.4426950408889634  # scores in the log2 domain
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)  # running denominator
    b_acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    # The same loop as csrc_triton.decode.tiles.split_online_softmax, written out: through the
    # shared helper the 16-head specializations spill 8 B on sm_86 (255 registers).
    p_idx = indices_ptr + pid_t * stride_indices_t
    for blk in range(blk_lo, blk_hi):
        o_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        b_idx = tl.load(p_idx + o_n, mask=o_n < k_len, other=-1)
        m_n = (b_idx >= 0) & (b_idx < N)
        b_row = tl.where(m_n, b_idx, 0).to(tl.int64)
        b_kv = tl.load(kv_ptr + b_row[:, None] * stride_kv_n + o_d[None, :],
                       mask=m_n[:, None], other=0.0)  # [BLOCK_N, D]: once for all heads
        b_s = tl.dot(b_q, tl.trans(b_kv)) * qk_scale  # [BLOCK_H, BLOCK_N] fp32
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no valid key yet: no NaN
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BLOCK_H, BLOCK_N]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_kv.dtype), b_kv)
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
        b_o = b_acc * b_scale[:, None]
        row_o = pid_t * stride_o_t + o_h.to(tl.int64) * stride_o_h  # [BLOCK_H]
        tl.store(o_ptr + row_o[:, None] + o_d[None, :], b_o.to(o_ptr.dtype.element_ty), mask=m_h[:, None])
        tl.store(lse_ptr + pid_t * H + o_h, b_lse, mask=m_h)
    else:
        b_o = b_acc / b_l_safe[:, None]  # [BLOCK_H, D]; 0 where the split saw no valid key
        row = (pid_t * H + o_h.to(tl.int64)) * S + pid_s  # [BLOCK_H] row of [T, H, S]
        tl.store(lse_ptr + row, b_lse, mask=m_h)
        tl.store(o_ptr + row[:, None] * D + o_d[None, :], b_o, mask=m_h[:, None])


# Launch configs per head-group size (BLOCK_H), as plain data; chosen from the AOT table
# (`python -m dsv4_ops.aot`): no spills on sm_80/86 and within sm_86's 99 KB of shared memory.
# Probed and rejected (sm_80, triton 3.6): 16 x 64 keys x 4 warps spills 968 B, x 8 warps
# needs 115 KB of smem; 64 heads x 32 keys spills 944 B at 8 warps and 996 B at 16 warps
# (a [64, 512] fp32 accumulator + q is ~190 registers a thread at 8 warps). So H = 64 runs
# as two 32-row groups (keys read twice, not four times) and H = 128 as four.
# The kernel holds no fp8: both variants share these.
MAX_BLOCK_H = 32
HEADS_CONFIG = {
    16: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    32: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
}


def block_h_for(H: int) -> int:
    """Rows of a head group: H padded to a power of two >= 16, at most MAX_BLOCK_H."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(max(int(H), 1))))
