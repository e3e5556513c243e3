"""The plans of the workspace ops (``sparse_mla_decode`` / ``sparse_mla_split`` over a gathered bf16
workspace, and the composite's workspace step): which of the two workspace kernels runs, with how many
splits, and whether the step gathers in one launch. Static shapes only, no host sync.

    decision                  resolver            wrapper                decides from
    kernel + splits           resolve_workspace   workspace_plan         the mode, AUTO_HEADS_MIN_T, int32 indices;
                                                                         tile_splits / auto_heads_splits
    gather in one launch      resolve_gather      gather_in_one_launch   FUSED_GATHER_MAX_ROWS
    batch invariance          batch_invariant_plan                       DSV4_AMPERE_BATCH_INVARIANT

Kernels (csrc_triton.decode):

    kernel   runs                                          splits by                     tests
    tiles    sparse_mla_split; sparse_mla_decode below     tile_splits (pinned table)    test_decode_splits.py
             AUTO_HEADS_MIN_T (and int64 indices)
    heads    sparse_mla_decode from AUTO_HEADS_MIN_T, and  auto_heads_splits (measured)  test_decode_gather/heads.py
             every T under DSV4_AMPERE_BATCH_INVARIANT=1

      tiles  the split-KV tile kernel (16-head tiles x 16-key blocks, every key re-read
             cdiv(H, 16) times) + the merge
      heads  one program per (token, split, head group of BLOCK_H <= 32 rows) reads each key
             block once for its group; one split writes the final out + lse in its epilogue

The heads split count under a forced ``heads`` mode minimises a cost model (constants: H200
guesses, NOT measured; refit from bench_decode_kernels.py):

    programs  P = T * G * S                 (G = cdiv(H, BLOCK_H) head groups)
    waves     w = cdiv(P, SMs * PROGRAMS_PER_SM)
    block     t_blk = max(BLOCK_LATENCY_US, bytes of a key block / bandwidth share,
                          mma flops of a block / per-SM rate)
    time(S) = w * (PROGRAM_US + cdiv(nb, S) * t_blk)
              + [S > 1] * (MERGE_LAUNCH_US + 2 * T*H*S*512*4 B / BANDWIDTH)

so the merge's partial bytes are counted, not a program-count target. Only balanced split
counts (those that shorten the longest split) are candidates; S = 1 has no merge.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

from .. import envs
from ..layout import HEAD_DIM
from ..csrc_triton.decode import heads as _hk
from ..csrc_triton.decode.tiles import MAX_SPLITS, PARTITION_N
from ..csrc_triton.decode.tiles import SPLIT_CONFIG as _SPLIT_CONFIG
from . import device as _device

ENV_VAR = envs.DECODE_KERNEL
MODES = envs.DECODE_MODES

# Cost-model constants (H200 guesses; refit from bench_decode_kernels.py).
BANDWIDTH_BPS = 4.0e12  # device bytes/s a full grid reaches on the gathered workspace
MMA_FLOPS_PER_SM = 5.0e12  # mma.sync bf16 flop/s of one SM (~660 TFLOP/s / 132)
BLOCK_LATENCY_US = 0.35  # one pipelined key block of one program, latency-bound
PROGRAM_US = 1.5  # q load, epilogue, program start
MERGE_LAUNCH_US = 1.2  # the merge kernel's in-graph launch + its fixed latency
PROGRAMS_PER_SM = {16: 2, 32: 1}  # co-resident heads programs an SM (smem/regs, AOT table)

# Where auto picks heads, and with how many splits: measured, not modelled (H200, portable,
# in-graph, K = 640; benchmarks/results/decode_kernels.md, the same within 1% at 108 SMs).
# From T = 64 heads with these splits beats tiles 1.04-1.29x (T=64 H=8: 20.7 vs 26.6 us;
# T=128 H=8: 34.8 vs 44.9 us); at T <= 8 tiles wins at every H. The cost model above
# mispredicts (its splits were 1.2-2.6x slower than the best measured), so auto does not use it.
AUTO_HEADS_MIN_T = 64



def auto_heads_splits(T: int, H: int, sms: int) -> int:
    """The measured best heads split count for T >= AUTO_HEADS_MIN_T. One 16-head group: the
    key loop is long, so 3-4 splits while T programs leave the SMs idle (T = 64, 128), one
    split once T alone fills them twice over (sparse prefill, s_q = 4096, H = 8: 583 us at
    S = 1 vs 762 at S = 3, benchmarks/results/sparse_prefill.md). 32-head groups: 2 (also
    best at s_q = 4096, H = 64 and 128)."""
    if H <= 16:
        if T >= 2 * sms:
            return 1
        return 4 if T < 96 else 3
    return 2



@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One decode attention launch plan (workspace kernels here; the paged kernels in dispatch.decode):
    kernel 'tiles' | 'heads' | 'v3' (the paged op: ``config`` names paged_chunk128 or paged_f16dot);
    splits S; block_h / block_n / groups of the kernel's programs; direct: S == 1 (no merge);
    config: the paged launch config; balanced: the paged splits follow the tokens' lengths
    (csrc_triton.decode.balance); why: which rules decided (not part of equality)."""

    kernel: str
    splits: int
    block_h: int
    block_n: int
    groups: int
    direct: bool
    config: str = ""  # the paged launch config, so plans of different kernels differ
    balanced: bool = False
    why: str = dataclasses.field(default="", compare=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the tiles kernel's split count ----
# programs    W  = T * cdiv(H, BLOCK_H)                (BLOCK_H = 16 heads a program holds)
# key blocks  nb = cdiv(K, PARTITION_N)                (16 keys a block)
# target      C  = 128 if W <= 8, 256 if W <= 32, else 512   (programs in all)
# blocks/split b = ceil(nb * W / C)   -> splits = cdiv(nb, b), at most MAX_SPLITS
# Balanced rounding: a split count is only worth what its longest split costs (ceil(nb / S)
# key blocks), so the smallest S with that longest split is taken: at nb = 40, S = 40, 20, 14,
# 10, 8, 7, 6, 5, 4, 3, 2, 1 are the only counts returned. The target grows with W because at
# small W the merge and the per-program q load dominate, and at large W more programs hide
# the gather latency. Fitted to the H200 sweep of the portable kernel
# (benchmarks/results/attention_split_sweep.md): the 14 pinned shapes of
# tests/test_decode_splits.py land within 5% of the best count measured there. Not tuned
# on an A100 (108 SMs instead of 132): the pinned table is the thing to re-measure there.
TILE_BLOCK_H = _SPLIT_CONFIG["portable"]["BLOCK_H"]
TARGET_STEPS = ((8, 128), (32, 256))  # (largest W, programs in all) steps of the target
TARGET_LARGE = 512


def tile_max_splits(K: int) -> int:
    """The largest tiles split count worth launching for K key positions (>= 1)."""
    return max(1, min(_cdiv(int(K), PARTITION_N), MAX_SPLITS))


def target_programs(programs: int) -> int:
    """Programs in all the tiles split kernel should launch, for W = T * cdiv(H, 16)."""
    for bound, target in TARGET_STEPS:
        if programs <= bound:
            return target
    return TARGET_LARGE


def tile_splits(T: int, H: int, K: int) -> int:
    """Tiles splits for T tokens, H query heads and K key positions a token (static shapes)."""
    w = max(1, int(T)) * _cdiv(max(1, int(H)), TILE_BLOCK_H)
    nb = _cdiv(max(1, int(K)), PARTITION_N)
    per_split = max(1, _cdiv(nb * w, target_programs(w)))  # key blocks of the longest split
    return max(1, min(_cdiv(nb, per_split), tile_max_splits(K)))


@functools.lru_cache(maxsize=4096)
def tile_splits_cached(T: int, H: int, K: int) -> int:
    """tile_splits, memoised (static shapes repeat every step)."""
    return tile_splits(T, H, K)



# ---- the heads kernel over the workspace ----


def balanced_splits(nb: int) -> list:
    """Split counts that each shorten the longest split (ceil(nb / S)), ascending, <= MAX_SPLITS."""
    out = sorted({_cdiv(nb, b) for b in range(1, nb + 1)})
    return [s for s in out if s <= MAX_SPLITS] or [1]


def heads_time_us(T: int, H: int, K: int, sms: int, S: int) -> float:
    """The cost model of the heads kernel + merge (module doc), microseconds."""
    bh = _hk.block_h_for(H)
    bn = _hk.HEADS_CONFIG[bh]["BLOCK_N"]
    groups = _cdiv(H, bh)
    nb = _cdiv(max(K, 1), bn)
    programs = T * groups * S
    slots = sms * PROGRAMS_PER_SM[bh]
    waves = _cdiv(programs, slots)
    active = min(programs, slots)
    t_bytes = bn * HEAD_DIM * 2 * active / BANDWIDTH_BPS * 1e6
    t_mma = 4.0 * bh * bn * HEAD_DIM / (MMA_FLOPS_PER_SM / PROGRAMS_PER_SM[bh]) * 1e6
    t_blk = max(BLOCK_LATENCY_US, t_bytes, t_mma)
    t = waves * (PROGRAM_US + _cdiv(nb, S) * t_blk)
    if S > 1:
        t += MERGE_LAUNCH_US + 2.0 * T * H * S * HEAD_DIM * 4 / BANDWIDTH_BPS * 1e6
    return t


def heads_splits(T: int, H: int, K: int, sms: int) -> int:
    """The split count of the heads kernel minimising heads_time_us (ties: fewer splits)."""
    bh = _hk.block_h_for(H)
    nb = _cdiv(max(K, 1), _hk.HEADS_CONFIG[bh]["BLOCK_N"])
    return min(balanced_splits(nb), key=lambda s: (heads_time_us(T, H, K, sms, s), s))


def _auto_is_heads(T: int, H: int) -> bool:
    return T >= AUTO_HEADS_MIN_T


def heads_plan(T: int, H: int, K: int, sms: int, splits: int = 0) -> DecodePlan:
    bh = _hk.block_h_for(H)
    s = splits or heads_splits(T, H, K, sms)
    return DecodePlan("heads", s, bh, _hk.HEADS_CONFIG[bh]["BLOCK_N"], _cdiv(H, bh), s == 1)


def tiles_plan(T: int, H: int, K: int, splits: int = 0) -> DecodePlan:
    s = splits or tile_splits(T, H, K)
    return DecodePlan("tiles", s, 16, PARTITION_N, _cdiv(H, 16), False)


def plan(T: int, H: int, K: int, sms: int, kernel_mode: str = "auto", splits: int = 0) -> DecodePlan:
    """The decode plan for T tokens, H heads, K key positions on a device of ``sms`` SMs.
    kernel_mode: auto | tiles | heads (see the module doc); splits 0 = the kernel's own
    choice, else forced (1..MAX_SPLITS). Memoised: static shapes repeat every step.
    With DSV4_AMPERE_BATCH_INVARIANT=1 the heads plan ignores T (``batch_invariant_plan``)."""
    if kernel_mode == "heads" and batch_invariant():
        return batch_invariant_plan(H, K, splits)
    return _plan(T, H, K, sms, kernel_mode, splits)


@functools.lru_cache(maxsize=4096)
def _plan(T: int, H: int, K: int, sms: int, kernel_mode: str = "auto", splits: int = 0) -> DecodePlan:
    if kernel_mode not in MODES:
        raise ValueError(f"kernel_mode: expected one of {', '.join(MODES)}, got {kernel_mode!r}")
    if kernel_mode == "auto" and _auto_is_heads(T, H):
        bn = _hk.HEADS_CONFIG[_hk.block_h_for(H)]["BLOCK_N"]
        nb = _cdiv(max(K, 1), bn)
        return heads_plan(T, H, K, sms, splits or min(auto_heads_splits(T, H, sms), nb, MAX_SPLITS))
    if kernel_mode == "heads":
        return heads_plan(T, H, K, sms, splits)
    return tiles_plan(T, H, K, splits)


_WHY_HEADS_FORCED = "mode heads"
_WHY_HEADS_AUTO = "auto: T >= AUTO_HEADS_MIN_T (benchmarks/results/decode_kernels.md)"
_WHY_TILES_FORCED = "mode tiles"
_WHY_TILES_AUTO = "auto: T < AUTO_HEADS_MIN_T (benchmarks/results/decode_kernels.md)"
_WHY_TILES_INT64 = "the heads kernel takes int32 indices only: tiles"


def resolve_workspace(kernel_mode: str, T: int, H: int, K: int, int32_indices: bool, device_index: int,
                      splits: int = 0) -> Tuple[DecodePlan, str]:
    """(the plan of the workspace step's attention, why): heads in mode heads, or in auto from
    AUTO_HEADS_MIN_T, with int32 indices; tiles otherwise (splits 0: tile_splits). Mode
    v3 needs the paged caches: over a workspace it is auto. ``device_index``: the
    tensors' get_device() (-1: NO_DEVICE_SMS)."""
    if kernel_mode == "v3":
        kernel_mode = "auto"
    if kernel_mode == "heads" or (kernel_mode == "auto" and T >= AUTO_HEADS_MIN_T):
        if int32_indices:
            p = plan(T, H, K, _device.num_sms_at(device_index), kernel_mode, splits)
            if p.kernel == "heads":
                return p, (_WHY_HEADS_FORCED if kernel_mode == "heads" else _WHY_HEADS_AUTO)
        why = _WHY_TILES_INT64
    else:
        why = _WHY_TILES_FORCED if kernel_mode == "tiles" else _WHY_TILES_AUTO
    return _tiles_plan_cached(T, H, K, splits), why


@functools.lru_cache(maxsize=4096)
def _tiles_plan_cached(T: int, H: int, K: int, splits: int) -> DecodePlan:
    return tiles_plan(T, H, K, splits)


def workspace_plan(kernel_mode: str, T: int, H: int, K: int, int32_indices: bool, device_index: int,
                   splits: int = 0) -> DecodePlan:
    """resolve_workspace's plan."""
    return resolve_workspace(kernel_mode, T, H, K, int32_indices, device_index, splits)[0]



# Workspace rows up to which the one-launch gather (both caches + indices) is used; above it,
# two gathers and the index kernel. H200, portable, in-graph (benchmarks/results/host_cost.md):
# T=4 x 640 rows: fused 4.6 us vs ~7 us for three launches; T=64: fused 34 us vs ~20 us (the
# fused kernel runs 8 rows a program to avoid sm_80 spills, the plain gather 16).
FUSED_GATHER_MAX_ROWS = 8192


def resolve_gather(rows: int) -> Tuple[bool, str]:
    """(whether the workspace step gathers in one launch, dsv4_decode_gather, why): up to
    FUSED_GATHER_MAX_ROWS workspace rows; above, two kv_cache_gather_into + dsv4_decode_indices."""
    if rows <= FUSED_GATHER_MAX_ROWS:
        return True, "rows <= FUSED_GATHER_MAX_ROWS: one launch"
    return False, "rows > FUSED_GATHER_MAX_ROWS: two gathers and the index kernel"


def gather_in_one_launch(rows: int) -> bool:
    """resolve_gather's answer (FUSED_GATHER_MAX_ROWS read at each call)."""
    return rows <= FUSED_GATHER_MAX_ROWS



# ---- batch invariance: DSV4_AMPERE_BATCH_INVARIANT=1 ----
# Default plans depend on T (tiles below AUTO_HEADS_MIN_T, split counts from T), so a
# token's bits depend on how many tokens share its batch. With the switch on, every T runs
# the heads kernel with a split count fixed by (H, K) alone: a token's output no longer
# depends on the rest of the batch (int32 indices: int64 runs the tiles as always).
BATCH_INVARIANT_ENV = envs.BATCH_INVARIANT


def batch_invariant() -> bool:
    """True when DSV4_AMPERE_BATCH_INVARIANT is 1 / true / on (read at each call)."""
    return envs.get(BATCH_INVARIANT_ENV)


def batch_invariant_mode(m: str) -> str:
    """The decode mode under the switch: heads (auto and heads); tiles and v3 plan from T,
    so asking for them too is a ValueError."""
    if m not in ("auto", "heads"):
        raise ValueError(f"{BATCH_INVARIANT_ENV}=1 runs the heads kernel; {ENV_VAR}={m} cannot be batch-invariant "
                         f"(unset it or use auto / heads)")
    return "heads"


def batch_invariant_plan(H: int, K: int, splits: int = 0) -> DecodePlan:
    """The heads plan for every T: the measured split count of T in [64, 96)
    (``auto_heads_splits``: 4 for H <= 16, 2 above), capped by the key blocks; splits > 0
    forces a count (the caller's, fixed as well)."""
    nb = _cdiv(max(K, 1), _hk.HEADS_CONFIG[_hk.block_h_for(H)]["BLOCK_N"])
    return heads_plan(AUTO_HEADS_MIN_T, H, K, 0, splits or min(4 if H <= 16 else 2, nb, MAX_SPLITS))
