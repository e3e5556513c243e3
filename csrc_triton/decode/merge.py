"""LSE merge of split-KV partials with the attention sink (op ``merge_splits``; and the balanced
partials of the paged kernel, ``_merge_balanced_kernel``).

Reads the partial layout of csrc_triton.decode.tiles (o_part fp32 [T, H, S, D], lse_part fp32
[T, H, S]) and writes out [T, H, D] (bf16) and lse fp32 [T, H]:
  M   = max(max_s lse_s, sink)          (sink = -inf without one)
  w_s = exp(lse_s - M),  den = sum_s w_s + exp(sink - M)
  out = sum_s w_s o_s / den,  lse = M + log(den)
M = -inf (no valid key, no finite sink) gives out 0 and lse -inf; a finite sink and no key
give out 0 and lse = sink. Never NaN.
"""

import functools

import triton
import triton.language as tl

from .balance import token_rows


@triton.jit
def _merge_splits_kernel(
    o_part_ptr, lse_part_ptr, sink_ptr, out_ptr, lse_ptr,
    H, S, stride_out_t, stride_out_h,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Grid (T * H, D // BLOCK_D): one program loads [BLOCK_S, BLOCK_D] of one (token, head)
    at once and reduces along the split axis in fp32; the d-block 0 program writes the lse.
    out is [T, H, D] with row strides stride_out_t / stride_out_h (dims contiguous), so a
    caller's output buffer (a slice of a larger one) is written in place."""
    pid_th = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    o_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    m_s = o_s < S
    b_lse = tl.load(lse_part_ptr + pid_th * S + o_s, mask=m_s, other=float("-inf"))  # [BLOCK_S]
    b_max = tl.max(b_lse, 0)
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + pid_th % H).to(tl.float32)
        b_sink = tl.where(b_sink == b_sink, b_sink, float("-inf"))  # a NaN sink is no sink
        b_max = tl.maximum(b_max, b_sink)
    b_max_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse - b_max_safe)  # [BLOCK_S]; 0 for empty splits and padding
    b_den = tl.sum(b_w, 0)
    if HAS_SINK:
        b_den += tl.exp(b_sink - b_max_safe)
    b_den_safe = tl.where(b_den > 0.0, b_den, 1.0)
    b_scale = b_w / b_den_safe  # [BLOCK_S]

    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    p_o = o_part_ptr + (pid_th * S + o_s[:, None]) * D + o_d[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    b_o = tl.where(b_scale[:, None] > 0.0, b_o, 0.0)  # weight 0 never meets a stray inf/NaN
    b_out = tl.sum(b_o * b_scale[:, None], 0)  # [BLOCK_D]
    p_out = out_ptr + (pid_th // H) * stride_out_t + (pid_th % H) * stride_out_h
    tl.store(p_out + o_d, b_out.to(out_ptr.dtype.element_ty))
    if pid_d == 0:
        b_res = tl.where(b_den > 0.0, b_max_safe + tl.log(b_den_safe), float("-inf"))
        tl.store(lse_ptr + pid_th, b_res)


@triton.jit
def _merge_balanced_kernel(
    o_part_ptr, lse_part_ptr, plan_ptr, sink_ptr, out_ptr, lse_ptr,
    H, P, stride_out_t, stride_out_h,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """_merge_splits_kernel over the partials of the paged kernel's BALANCED form: o_part fp32
    [P, H, D] / lse_part fp32 [P, H] rows by slot, token t's n_t partials at slots first_t .. as its
    plan word says (csrc_triton.decode.balance: plan_ptr int32 words, P = T * S slots). BLOCK_S rows a
    step (the plan's S rounded up: one step for a token of S partials, more for the long tokens of a
    ragged batch): one pass for M and den, one for the weighted sum. Grid (T * H, D // BLOCK_D)."""
    pid_th = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    h = pid_th % H
    first, n_t = token_rows(plan_ptr, P, pid_th // H)
    o_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    b_max = float("-inf")
    for c in range(0, n_t, BLOCK_S):
        m_s = c + o_s < n_t
        b_lse = tl.load(lse_part_ptr + (first + c + o_s).to(tl.int64) * H + h, mask=m_s, other=float("-inf"))
        b_max = tl.maximum(b_max, tl.max(b_lse, 0))
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + h).to(tl.float32)
        b_sink = tl.where(b_sink == b_sink, b_sink, float("-inf"))  # a NaN sink is no sink
        b_max = tl.maximum(b_max, b_sink)
    b_max_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_den = 0.0
    if HAS_SINK:
        b_den = tl.exp(b_sink - b_max_safe)
    o_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for c in range(0, n_t, BLOCK_S):
        m_s = c + o_s < n_t
        rows = (first + c + o_s).to(tl.int64) * H + h  # [BLOCK_S] rows of [P, H]
        b_w = tl.exp(tl.load(lse_part_ptr + rows, mask=m_s, other=float("-inf")) - b_max_safe)  # [BLOCK_S]
        b_den += tl.sum(b_w, 0)
        b_o = tl.load(o_part_ptr + rows[:, None] * D + o_d[None, :], mask=m_s[:, None], other=0.0)
        b_o = tl.where(b_w[:, None] > 0.0, b_o, 0.0)  # weight 0 never meets a stray inf/NaN
        b_acc += tl.sum(b_o * b_w[:, None], 0)
    b_den_safe = tl.where(b_den > 0.0, b_den, 1.0)
    p_out = out_ptr + (pid_th // H) * stride_out_t + h * stride_out_h
    tl.store(p_out + o_d, (b_acc / b_den_safe).to(out_ptr.dtype.element_ty))
    if pid_d == 0:
        b_res = tl.where(b_den > 0.0, b_max_safe + tl.log(b_den_safe), float("-inf"))
        tl.store(lse_ptr + pid_th, b_res)


@functools.lru_cache(maxsize=None)
def merge_config(n_splits: int, head_dim: int = 512) -> dict:
    """Launch config for S splits, as plain data: BLOCK_S = next_pow2(S), BLOCK_D such that a
    program holds at most 4096 fp32 values of o_part (no spills at 4 warps). Cached: the
    caller must not mutate the returned dict."""
    block_s = triton.next_power_of_2(max(int(n_splits), 1))
    block_d = max(32, min(head_dim, 4096 // block_s))
    return {"BLOCK_S": block_s, "BLOCK_D": block_d, "num_warps": 4, "num_stages": 1}
