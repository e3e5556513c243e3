"""The balanced split of a decode step's key blocks over its partial slots (the paged_f16dot kernel's
BALANCED form and the merge's): FlashMLA's tile-scheduler metadata for a static grid, made on the
device by one small planning kernel a launch and read as one word a program.

A decode step of T tokens planned at S splits has P = T * S partial slots (the grid's programs per head
group, fixed by the shapes: CUDA graphs replay it). Without balance every token takes S of them, so a
batch of one long context among short ones runs as long as the long token's S programs. Balanced, from
the tokens' lengths on the device (no host sync): token t of nb_t key blocks (cdiv(k1, BLOCK_N) +
cdiv(k2, BLOCK_N), its clamped top-k and window lengths, as the kernel loops) takes

    n_t = min(1 + floor(nb_t * (P - T) / W), max(nb_t, 1), MAX_SPLITS),   W = sum_t nb_t

consecutive slots (first_t = n_0 + ... + n_{t-1}), its blocks split evenly over them
(split s: blocks [s * nb_t / n_t, (s + 1) * nb_t / n_t)). sum_t n_t <= T + (P - T) = P, so the slots
suffice. A batch of equal tokens gets n_t = S (the unbalanced plan exactly); a ragged one gives the long
tokens more slots and the short ones fewer.

The plan: int32 words [P + T] (``plan_words``):
  [0, P)      slot p: (t << 12) | (s << 6) | (n_t - 1), or -1 for a slot no token uses;
  [P, P + T)  token t: (first_t << 6) | (n_t - 1)      (the merge's rows).
t < 2 ** 19 (the launcher checks T). The attention program and the merge each read one word. Whatever
lengths the plan was made from, a token's slots cover all of its blocks (the kernel splits the blocks
it counts itself over the plan's n_t), so the plan sets only the balance, never the result.
"""

import triton
import triton.language as tl

from .tiles import MAX_SPLITS as _MAX_SPLITS

MAX_SPLITS = tl.constexpr(_MAX_SPLITS)  # a token's partials at most (the merge loads up to this many)
MAX_TOKENS = 1 << 19  # the words' token field


def plan_words(T: int, S: int) -> int:
    """int32 words of the plan of T tokens at S splits."""
    return T * S + T


@triton.jit
def _token_blocks(o_t, m_t, topk_len_ptr, swa_len_ptr, K1, K2, BLOCK_N: tl.constexpr,
                  HAS_TOPK_LEN: tl.constexpr, HAS_SWA_LEN: tl.constexpr):
    """Key blocks of the tokens o_t (int32 [CHUNK], mask m_t): cdiv(k1, BLOCK_N) + cdiv(k2, BLOCK_N) with
    k1 / k2 the token's clamped lengths, as the kernel's own loop counts them; 0 where m_t is false."""
    k1 = tl.zeros_like(o_t) + K1
    if HAS_TOPK_LEN:
        k1 = tl.minimum(tl.maximum(tl.load(topk_len_ptr + o_t, mask=m_t, other=0).to(tl.int32), 0), K1)
    k2 = tl.zeros_like(o_t) + K2
    if HAS_SWA_LEN:
        k2 = tl.minimum(tl.maximum(tl.load(swa_len_ptr + o_t, mask=m_t, other=0).to(tl.int32), 0), K2)
    return tl.where(m_t, (k1 + BLOCK_N - 1) // BLOCK_N + (k2 + BLOCK_N - 1) // BLOCK_N, 0)


@triton.jit
def _balance_plan_kernel(topk_len_ptr, swa_len_ptr, plan_ptr, T, S, K1, K2, BLOCK_N: tl.constexpr,
                         HAS_TOPK_LEN: tl.constexpr, HAS_SWA_LEN: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (1,): write the plan words [T * S + T] (module doc) of the lengths (int32/int64 [>= T] or
    None), K1 / K2 the top-k / window widths, BLOCK_N the attention kernel's key block."""
    W = 0
    for c in range(0, T, CHUNK):
        o_t = c + tl.arange(0, CHUNK)
        W += tl.sum(_token_blocks(o_t, o_t < T, topk_len_ptr, swa_len_ptr, K1, K2, BLOCK_N, HAS_TOPK_LEN,
                                  HAS_SWA_LEN), 0)
    W = tl.maximum(W, 1).to(tl.int64)
    P = T * S
    extra = (P - T).to(tl.int64)
    o_j = tl.arange(0, MAX_SPLITS)  # [MAX_SPLITS] a token's splits
    carry = 0
    for c in range(0, T, CHUNK):
        o_t = c + tl.arange(0, CHUNK)
        m_t = o_t < T
        nb = _token_blocks(o_t, m_t, topk_len_ptr, swa_len_ptr, K1, K2, BLOCK_N, HAS_TOPK_LEN, HAS_SWA_LEN)
        # 1 + the token's share of the T * (S - 1) slots beyond one a token, at most one a block and MAX_SPLITS
        n = 1 + (nb.to(tl.int64) * extra // W).to(tl.int32)
        n = tl.minimum(tl.minimum(n, tl.maximum(nb, 1)), MAX_SPLITS)
        n = tl.where(m_t, n, 0)
        first = tl.cumsum(n, 0) + carry - n  # [CHUNK]
        tl.store(plan_ptr + P + o_t, (first << 6) | (n - 1), mask=m_t)
        word = (o_t[:, None] << 12) | (o_j[None, :] << 6) | (n[:, None] - 1)  # [CHUNK, MAX_SPLITS]
        tl.store(plan_ptr + first[:, None] + o_j[None, :], word, mask=m_t[:, None] & (o_j[None, :] < n[:, None]))
        carry += tl.sum(n, 0)
    for c in range(carry, P, CHUNK):  # slots no token uses
        o_p = c + tl.arange(0, CHUNK)
        tl.store(plan_ptr + o_p, tl.full([CHUNK], -1, tl.int32), mask=o_p < P)


@triton.jit
def slot_of(plan_ptr, slot):
    """(t, s, n_t, live) of partial slot ``slot`` from its plan word (t = 0, n_t = 1, live False for a slot
    no token uses)."""
    w = tl.load(plan_ptr + slot)
    live = w >= 0
    return tl.maximum(w >> 12, 0), (w >> 6) & 63, (w & 63) + 1, live


@triton.jit
def token_rows(plan_ptr, P, t):
    """(first_t, n_t) of token t: its partials are slots first_t .. first_t + n_t - 1."""
    w = tl.load(plan_ptr + P + t)
    return w >> 6, (w & 63) + 1
