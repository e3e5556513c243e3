"""Which DeepSeek-V4 decode kernel runs, with which config and how many splits: static shapes
only, no host sync.

Every decision of a decode step is made here, from (T, H, K, SMs, shared memory, block sizes,
cache alignment) and the knobs, by one resolver each. A resolver returns ``(choice, reason)``
(the reason says which rule or knob decided, for logs and tests); the launchers call the thin
wrapper of the same name without ``resolve_`` where it is on a hot path.

    decision                      resolver                     wrapper            decides
    decode mode                   resolve_mode                 mode               DSV4_AMPERE_DECODE_KERNEL,
                                                                                  DSV4_AMPERE_BATCH_INVARIANT
    composite: paged op or step   resolve_route                route              mode, AUTO_FUSED_WINDOWS,
                                                                                  AUTO_V3_WINDOWS, AUTO_V3_SMEM_WINDOWS
    composite: v3 needs aligned   resolve_composite            uses_fused_op      the route + page strides % 16
    workspace gather              resolve_gather               gather_in_one_launch  FUSED_GATHER_MAX_ROWS
    workspace kernel + splits     resolve_workspace            workspace_plan     mode, AUTO_HEADS_MIN_T, int32
                                                                                  indices; tile_splits / auto_heads_splits
    paged op form (v1 / v3)       resolve_paged_form           paged_form         mode / auto_is_v3, cache alignment
    v3-form config                resolve_v3_config            v3_launch_config   caller's config, DSV4_AMPERE_DECODE_CONFIG,
                                                                                  the windows, power-of-two block sizes
    v3-form kernel                is_f16dot                                       PV_KEY in the config
    splits of each kernel         tile_splits, auto_heads_splits, heads_splits, fused_splits, v3_splits,
                                  batch_invariant_plan

Kernels (csrc_triton.decode):

    kernel          runs in                                 splits by                     tests
    tiles           workspace step, auto below              tile_splits (pinned table)    test_decode_splits.py
                    AUTO_HEADS_MIN_T (and int64 indices)
    heads           workspace step, auto from               auto_heads_splits (measured)  test_decode_gather/heads.py
                    AUTO_HEADS_MIN_T
    paged_chunk64   paged op form v1 (mode fused, auto in   fused_splits                  test_decode_paged_chunk64.py
                    AUTO_FUSED_WINDOWS, unaligned caches)
    paged_chunk128  paged op form v3, configs h...          v3_splits (busiest SM's keys) test_decode_paged.py
    paged_f16dot    paged op form v3, configs kh/gh...      v3_splits                     test_decode_paged.py

    DSV4_AMPERE_DECODE_KERNEL = auto | tiles | heads | fused | v3   (read at each call; default auto)
      tiles  the split-KV tile kernel (16-head tiles x 16-key blocks, every key re-read
             cdiv(H, 16) times) + the merge
      heads  one program per (token, split, head group of BLOCK_H <= 32 rows) reads each key
             block once for its group; one split writes the final out + lse in its epilogue
      fused  (the composite only) the paged op in form v1: paged_chunk64 reads the fp8 records by
             slot, no workspace and no gather launch; a direct sparse_mla_decode call treats it as auto
      v3     (the composite only) the paged op in form v3 (paged_chunk128 / paged_f16dot, by config)
      auto   tiles below T = 64, heads from T = 64 with measured split counts
             (benchmarks/results/decode_kernels.md); in the composite the v3 form where
             auto_is_v3 (benchmarks/results/decode_paged_chunk128.md, decode_paged_f16dot.md;
             16-byte aligned pages), else form v1 where auto_is_fused (decode_paged_chunk64.md)
    DSV4_AMPERE_DECODE_CONFIG = <config name>   (read at each call; default unset)
      forces the v3 form's launch config wherever the paged op runs form v3

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

import torch

from .. import envs
from ..layout import HEAD_DIM
from ..csrc_triton.decode import heads as _hk
from ..csrc_triton.decode import paged_chunk64 as _pk
from ..csrc_triton.decode.tiles import MAX_SPLITS, PARTITION_N
from ..csrc_triton.decode.tiles import SPLIT_CONFIG as _SPLIT_CONFIG
from . import device as _device
from . import tables as _tables
from .configs import config_fits, is_f16dot, v3_config  # noqa: F401 (names of this module too)
from . import windows as _windows

ENV_VAR = envs.DECODE_KERNEL
CONFIG_ENV = envs.DECODE_CONFIG
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
    """kernel 'tiles' or 'heads' (or 'fused' / 'v3'); splits S; block_h / block_n / groups of the
    kernel's programs (tiles: 16 heads x PARTITION_N keys); direct: S == 1 (no merge); config:
    the v3 form's launch config (its kernel: paged_chunk128 or paged_f16dot)."""

    kernel: str
    splits: int
    block_h: int
    block_n: int
    groups: int
    direct: bool
    config: str = ""  # v3 form: the launch config, so plans of different kernels differ


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


# ---- the mode ----


def resolve_mode() -> Tuple[str, str]:
    """(the decode mode, why): DSV4_AMPERE_DECODE_KERNEL (ValueError on an unknown value), or
    heads under DSV4_AMPERE_BATCH_INVARIANT=1 (ValueError for a mode that plans from T)."""
    m = envs.get(ENV_VAR)
    if batch_invariant():
        return batch_invariant_mode(m), f"{BATCH_INVARIANT_ENV}=1 runs the heads kernel"
    return m, (f"{ENV_VAR}={m}" if envs.is_set(ENV_VAR) else f"{ENV_VAR} unset: auto")


def mode() -> str:
    """The DSV4_AMPERE_DECODE_KERNEL value (ValueError on an unknown one)."""
    m = envs.get(ENV_VAR)
    return batch_invariant_mode(m) if batch_invariant() else m


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
    AUTO_HEADS_MIN_T, with int32 indices; tiles otherwise (splits 0: tile_splits). Modes fused
    and v3 need the paged caches: over a workspace they are auto. ``device_index``: the
    tensors' get_device() (-1: NO_DEVICE_SMS)."""
    if kernel_mode in ("fused", "v3"):
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


# ---- the paged kernel of form v1 (csrc_triton.decode.paged_chunk64) ----
# Programs aimed at per SM when T * groups alone does not fill the SMs. Measured
# (benchmarks/results/decode_paged_chunk64.md): the plan's count was the best of the sweep at
# T <= 4 with H <= 16 (20 splits); from T = 16 or H = 64 fewer splits measured faster (the
# kernel is slow there and not dispatched, so the table is left as it is).
FUSED_PROGRAMS_PER_SM = 2


def fused_splits(T: int, H: int, K: int, sms: int) -> int:
    """Split count of the fused kernel: enough programs for FUSED_PROGRAMS_PER_SM a SM, at
    most one key block a split, snapped up to a balanced count."""
    bh = _pk.block_h_for(H)
    nb = _cdiv(max(K, 1), _pk.FUSED_CONFIG[bh]["BLOCK_N"])
    want = min(nb, MAX_SPLITS, max(1, _cdiv(FUSED_PROGRAMS_PER_SM * sms, max(T, 1) * _cdiv(H, bh))))
    return min(s for s in balanced_splits(nb) + [nb] if s >= want) if want < nb else min(nb, MAX_SPLITS)


@functools.lru_cache(maxsize=4096)
def fused_plan(T: int, H: int, K: int, sms: int, splits: int = 0) -> DecodePlan:
    """The plan of the fused kernel for T tokens, H heads, K = K1 + K2 key positions on
    ``sms`` SMs; splits 0 = fused_splits, else forced (1..MAX_SPLITS)."""
    bh = _pk.block_h_for(H)
    s = splits or fused_splits(T, H, K, sms)
    return DecodePlan("fused", s, bh, _pk.FUSED_CONFIG[bh]["BLOCK_N"], _cdiv(H, bh), s == 1)


# ---- the v3 form (csrc_triton.decode.paged_chunk128 / paged_f16dot) ----
# Split counts of the 4-warp (32-key and smaller) configs outside V3_COST (benchmark candidates; the
# dispatched configs use the cost model below): the balanced count with the fewest key
# blocks on the busiest SM, two programs resident an SM (V3_RESIDENT_PER_SM), ties to fewer
# splits: time ~ cdiv(T * groups * S, 2 * SMs) * cdiv(nb, S). On the H200 (132 SMs) it gave the
# measured best count at every measured shape (benchmarks/results/decode_paged_chunk128.md,
# decode_paged_f16dot.md: T = 1..4: one block a split; T = 16, H <= 16: 10 of 20; T = 128: 2;
# T = 256: 1; K 256, T = 64, H = 64: 1) and S = 4 at T = 16, H = 64: 30.6 vs 39.1 us at S = 3
# (decode_paged_f16dot_splits.md).
V3_RESIDENT_PER_SM = 2
# The paged_chunk128 config that takes any block size: where a paged_f16dot config was chosen
# but the block sizes are not powers of two (that kernel takes them as shifts).
V3_ANY_BLOCK_SIZE_CONFIG = "h16n32w4"


def _smem_window(T: int, H: int, K: int, smem: int) -> str:
    """The AUTO_V3_SMEM_WINDOWS config for (T, H, K) that fits ``smem`` (-1: the current
    device's, smem_per_block), or ''."""
    for t_lo, t_hi, h_lo, h_hi, k, name in _windows.AUTO_V3_SMEM_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k:
            if config_fits(name, smem if smem >= 0 else _device.smem_per_block(-1)):
                return name
    return ""


def _v3_config_name(T: int, H: int, K: int, smem: int) -> Tuple[str, str]:
    big = _smem_window(T, H, K, smem)
    if big:
        return big, "AUTO_V3_SMEM_WINDOWS (its shared memory fits the device's)"
    for t_lo, t_hi, h_lo, h_hi, k, name in _windows.V3_CONFIG_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k:
            return name, f"V3_CONFIG_WINDOWS row {(t_lo, t_hi, h_lo, h_hi, k, name)}"
    if T <= 1 and H <= 16:
        return "h16n16w4", "no window: paged_chunk128, 16-key blocks for one token at H <= 16"
    return "h16n32w4", "no window: paged_chunk128, 32-key blocks"


def v3_config_name(T: int, H: int, K: int = 640, smem: int = -1) -> str:
    """The v3-form launch config the windows give for T tokens, H heads, K keys on a device of
    ``smem`` bytes of shared memory a block (-1: the current device's): an AUTO_V3_SMEM_WINDOWS
    config that fits, else the first V3_CONFIG_WINDOWS match, else the paged_chunk128 kernel's
    16-key config for one token at H <= 16 and its 32-key config elsewhere
    (paged_chunk128.V3_DISPATCHED)."""
    return _v3_config_name(T, H, K, smem)[0]


def _pow2(n: int) -> bool:
    return not n & (n - 1)


def resolve_v3_config(T: int, H: int, K: int, smem: int = -1, config: str = "",
                      block_sizes: Tuple[int, ...] = (), sms: int = 0) -> Tuple[str, str]:
    """(the v3 form's launch config, why), first rule that applies: the caller's ``config``
    (benchmarks, tests); DSV4_AMPERE_DECODE_CONFIG when set (ValueError naming it on an unknown
    config); for ``sms`` > 0 the current device's decode table entry (dispatch.tables: measured by
    dsv4-ops tune); v3_config_name (the windows), then, for ``sms`` > 0, v3_sm_config (another config
    where the cost model on that many SMs says so). Then a paged_f16dot config over ``block_sizes`` that
    are not all powers of two runs V3_ANY_BLOCK_SIZE_CONFIG (paged_f16dot takes them as shifts)."""
    if config:
        name, why = config, "the caller's config"
    else:
        forced = envs.raw(CONFIG_ENV)
        if forced:
            try:
                v3_config(forced)
            except KeyError:
                raise ValueError(f"{CONFIG_ENV}: no paged decode config named {forced!r} (paged_chunk128."
                                 f"V3_CANDIDATES, paged_f16dot.V4_CANDIDATES)") from None
            name, why = forced, f"forced by {CONFIG_ENV}"
        else:
            entry = _tables.lookup(T, H, K, sms) if sms > 0 else None
            if entry is not None:  # measured on this device at this SM count (dsv4-ops tune)
                name, why = entry.config, f"decode table {entry.why}"
            else:
                name, why = _v3_config_name(T, H, K, smem)
                if sms > 0:
                    name, more = v3_sm_config(T, H, K, sms, smem, name)
                    why += more
    if block_sizes and not all(_pow2(b) for b in block_sizes) and is_f16dot(v3_config(name)):
        return V3_ANY_BLOCK_SIZE_CONFIG, (f"{name} ({why}) takes power-of-two block sizes only, got "
                                          f"{tuple(block_sizes)}: {V3_ANY_BLOCK_SIZE_CONFIG}")
    return name, why


def v3_launch_config(T: int, H: int, K: int, smem: int = -1, config: str = "",
                     block_sizes: Tuple[int, ...] = (), sms: int = 0) -> str:
    """resolve_v3_config's config."""
    return resolve_v3_config(T, H, K, smem, config, block_sizes, sms)[0]


# The v3 form's cost on the SMs a plan counts on (device.num_sms: DSV4_AMPERE_SMS or the device's),
# microseconds for one launch and its merge. Least squares over the sweep of
# benchmarks/results/decode_sms_call1.md (H200, portable, mma.sync, 132 / 112 / 104 SMs through driver green
# contexts, the 5 dispatched configs x balanced split counts <= 20, T <= 64, K 640: median error 4%, p90
# 13%, its pick within 1.19x of the sweep's best at every shape):
#   programs P = T * cdiv(H, BLOCK_H) * S, r resident an SM, waves w = cdiv(P, r * SMs),
#   key blocks of a split b = cdiv(cdiv(K, BLOCK_N), S), partials MB = T * H * S * 512 * 4 * 2 / 1e6
#   time = w * (us a program + b * us a key block) + [S > 1] * (V3_MERGE_US + V3_MERGE_US_PER_MB * MB)
# A grid one wave deep on 132 SMs is two on 104 (T = 128, H = 8 at S = 2): the waves term is what
# made the 132-SM counts fall off a cliff at 104; the per-program and merge terms keep the count
# from running to 20 splits of one block (the busiest-SM count alone picked S = 20 at T = 128, H = 8
# on 104 SMs: 129 us against 75 at 112).
# config: (programs resident an SM by registers (v3_resident: fewer where shared memory binds), us a program,
# us a key block)
V3_COST = {
    "h16n16w4": (2, 2.04, 2.67),
    "h16n32w4": (2, 2.35, 3.83),
    "kh16n32w4": (2, 2.65, 3.51),
    "kh16n64w8": (1, 1.93, 5.30),
    "kh32n64w8": (1, 1.56, 6.57),
}
# Shared memory a block of each V3_COST config takes, bytes: the largest of its compiled
# specializations on sm_80 / sm_86 (the AOT table; tests/test_decode_paged.py holds it to the
# compile). Where the device's shared memory holds fewer blocks than V3_COST counts (sm_86's 100
# KB an SM: one kh16n32w4 or h16n32w4, not two), the model plans with that many (v3_resident).
V3_SHARED_BYTES = {
    "h16n16w4": 49536,
    "h16n32w4": 82688,
    "kh16n32w4": 54272,
    "kh16n64w8": 92160,
    "kh32n64w8": 108544,
}
V3_MERGE_US = 2.25
V3_MERGE_US_PER_MB = 0.41
# The measured window's config (V3_CONFIG_WINDOWS / AUTO_V3_SMEM_WINDOWS, all measured at 132 SMs) is
# kept unless another config's modelled time is this much shorter on the plan's SM count.
V3_CONFIG_MARGIN = 1.15


def v3_resident(config: str, smem: int = -1) -> int:
    """Programs of a V3_COST config resident an SM on a device of ``smem`` bytes of shared memory a
    block (-1: the current device's, smem_per_block): V3_COST's count (registers: the same on sm_80,
    sm_86 and sm_90) or fewer where the shared memory holds fewer blocks (device.blocks_by_smem)."""
    smem = smem if smem >= 0 else _device.smem_per_block(-1)
    return max(1, min(V3_COST[config][0], _device.blocks_by_smem(V3_SHARED_BYTES[config], smem)))


def v3_cost_us(T: int, H: int, K: int, sms: int, config: str, splits: int, smem: int = -1) -> float:
    """The modelled microseconds of the v3 form with ``config`` (a V3_COST name) at ``splits`` splits
    for T tokens, H heads, K keys on ``sms`` SMs of ``smem`` bytes of shared memory a block (-1: the
    current device's; the model above, its programs an SM from v3_resident)."""
    _, program_us, block_us = V3_COST[config]
    resident = v3_resident(config, smem)
    cfg = v3_config(config)
    nb = _cdiv(max(K, 1), cfg["BLOCK_N"])
    programs = max(T, 1) * _cdiv(H, cfg["BLOCK_H"]) * splits
    t = _cdiv(programs, resident * max(sms, 1)) * (program_us + _cdiv(nb, splits) * block_us)
    if splits > 1:
        t += V3_MERGE_US + V3_MERGE_US_PER_MB * max(T, 1) * H * splits * HEAD_DIM * 8 / 1e6
    return t


def v3_splits(T: int, H: int, K: int, sms: int, block_h: int, block_n: int, config: str = "",
              smem: int = -1) -> int:
    """Split count of the v3 form on ``sms`` SMs (of ``smem`` bytes a block, -1: the current device's).
    A V3_COST config: the balanced count of least v3_cost_us (ties: fewer splits). Any other config
    (benchmark candidates): 64-key blocks at most
    one program an SM, snapped down; smaller blocks the balanced count minimising
    cdiv(programs * S, V3_RESIDENT_PER_SM * sms) * cdiv(nb, S)."""
    nb = _cdiv(max(K, 1), block_n)
    cands = [s for s in balanced_splits(nb) if s <= nb] or [1]
    if config in V3_COST:
        return min(cands, key=lambda s: (v3_cost_us(T, H, K, sms, config, s, smem), s))
    programs = max(T, 1) * _cdiv(H, block_h)
    if block_n >= 64:
        want = max(1, min(nb, MAX_SPLITS, sms // programs))
        return max(s for s in cands + [1] if s <= want)
    slots = V3_RESIDENT_PER_SM * sms
    return min(cands, key=lambda s: (_cdiv(programs * s, slots) * _cdiv(nb, s), s))


def _v3_best_cost(T: int, H: int, K: int, sms: int, config: str, smem: int) -> float:
    """The config's modelled time at its own split count, capped as the composite caps it
    (composite_split_cap: S = 1 once T x H >= 4096), so the config is chosen for the splits it runs."""
    cfg = v3_config(config)
    s = v3_splits(T, H, K, sms, cfg["BLOCK_H"], cfg["BLOCK_N"], config, smem)
    return v3_cost_us(T, H, K, sms, config, min(s, composite_split_cap(T, H)), smem)


@functools.lru_cache(maxsize=4096)
def _v3_sm_config(T: int, H: int, K: int, sms: int, smem: int, window: str) -> Tuple[str, str]:
    if window not in V3_COST:
        return window, ""
    cands = [n for n in V3_COST if config_fits(n, smem) and (v3_config(n)["BLOCK_H"] <= 16 or H > 16)]
    best = min(cands, key=lambda n: (_v3_best_cost(T, H, K, sms, n, smem), n))
    keep = _v3_best_cost(T, H, K, sms, window, smem)
    if keep <= V3_CONFIG_MARGIN * _v3_best_cost(T, H, K, sms, best, smem):
        return window, ""
    return best, (f"; on {sms} SMs V3_COST models {best} "
                  f"{keep / _v3_best_cost(T, H, K, sms, best, smem):.2f}x faster")


def v3_sm_config(T: int, H: int, K: int, sms: int, smem: int, window: str) -> Tuple[str, str]:
    """(the config for ``sms`` SMs, why suffix): the window's config ``window`` unless another V3_COST
    config that fits ``smem`` bytes a block (-1: the current device's) is modelled more than
    V3_CONFIG_MARGIN faster at its own best split count (BLOCK_H 32 only for H > 16)."""
    return _v3_sm_config(T, H, K, sms, smem if smem >= 0 else _device.smem_per_block(-1), window)


def v3_plan(T: int, H: int, K: int, sms: int, splits: int = 0, config: str = "", smem: int = -1) -> DecodePlan:
    """The plan of the v3 form (kernel 'v3') on ``sms`` SMs of ``smem`` bytes of shared memory a block
    (-1: the current device's); config: a name to force one (benchmarks), else resolve_v3_config's for
    ``sms`` (DSV4_AMPERE_DECODE_CONFIG, the decode table, then the windows and v3_sm_config); splits 0 =
    the decode table's count where its entry names that config, else v3_splits."""
    name = config or v3_launch_config(T, H, K, smem, sms=sms)
    cfg = v3_config(name)
    bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
    if not splits:  # the decode table's count where its entry names this config (dispatch.tables)
        entry = _tables.lookup(T, H, K, sms) if sms > 0 else None
        splits = entry.splits if entry is not None and entry.config == name else 0
    s = splits or v3_splits(T, H, K, sms, bh, bn, name, smem)
    return DecodePlan("v3", s, bh, bn, _cdiv(H, bh), s == 1, name)


def balanced(direct: bool, has_lengths: bool, int32_slots: bool) -> bool:
    """Whether a paged fp16-dot decode launch balances its splits over the tokens' key lengths
    (csrc_triton.decode.balance): when DSV4_AMPERE_DECODE_BALANCE=1 (off by default: the planning launch
    costs equal batches more than it saves, benchmarks/results/decode_balance.md), it splits (not
    direct), reads lengths (a batch without them is uniform), its slots are int32 (vLLM's; the forms the
    AOT check compiles) and batch invariance is off (balanced, a token's splits depend on the others')."""
    return (not direct and has_lengths and int32_slots and bool(envs.get(envs.DECODE_BALANCE))
            and not batch_invariant())


# ---- the composite's route: the paged op or the workspace step ----


def auto_is_fused(T: int, H: int, K: int) -> bool:
    """Whether auto runs the fused kernel in the composite (AUTO_FUSED_WINDOWS holds T, H, K)."""
    return any(t_lo <= T <= t_hi and H <= h_max and K == k
               for t_lo, t_hi, h_max, k in _windows.AUTO_FUSED_WINDOWS)


def auto_is_v3(T: int, H: int, K: int, smem: int = -1) -> bool:
    """Whether auto runs the v3 form in the composite: a measured window holds T, H, K
    (AUTO_V3_WINDOWS, or AUTO_V3_SMEM_WINDOWS where its config fits ``smem`` bytes a block;
    -1: the current device's)."""
    return (any(t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k
                for t_lo, t_hi, h_lo, h_hi, k in _windows.AUTO_V3_WINDOWS)
            or bool(_windows.AUTO_V3_SMEM_WINDOWS and _smem_window(T, H, K, smem)))


def windows_identity() -> tuple:
    """The window tables' identities (a memo of a choice that reads them keys on this, so that
    it follows a test or benchmark that swaps one)."""
    return (id(_windows.AUTO_FUSED_WINDOWS), id(_windows.AUTO_V3_WINDOWS), id(_windows.AUTO_V3_SMEM_WINDOWS),
            id(_windows.V3_CONFIG_WINDOWS))


# Auto never takes the workspace step: its bf16 workspace is T x K x 1 KiB a call, allocated
# inside the attention call that vLLM's memory profile skips (profile_run: skip_attn), and K
# grows with max_model_len (V4's C128A top-k width reaches 8192 at 1M: 8.1 MiB a token). Where
# no measured window holds the shape, the paged op runs (form v3, paged_chunk128's config for
# the shape; v1 on unaligned caches): no workspace at any K.
AUTO_PAGED_WHY = "auto: no paged window holds the shape; the paged op (no workspace outside vLLM's memory profile)"


def resolve_route(kernel_mode: str, T: int, H: int, K: int, smem: int) -> Tuple[str, str]:
    """(the composite's route, why): 'fused' (the paged op), 'v3' (the paged op when both caches
    are 16-byte aligned, else the workspace step; resolve_composite), 'paged' (auto outside
    every window: the paged op, AUTO_PAGED_WHY) or 'workspace' (modes tiles / heads), for the
    mode, the static shapes and the device's shared memory a block (device.smem_per_block)."""
    if kernel_mode in ("fused", "v3"):
        return "fused", f"mode {kernel_mode}: the paged op"
    if kernel_mode == "auto":
        if auto_is_fused(T, H, K):
            return "fused", "auto: AUTO_FUSED_WINDOWS"
        if auto_is_v3(T, H, K, smem):
            return "v3", "auto: AUTO_V3_WINDOWS / AUTO_V3_SMEM_WINDOWS"
        return "paged", AUTO_PAGED_WHY
    return "workspace", f"mode {kernel_mode}: the workspace step"


def route(kernel_mode: str, T: int, H: int, K: int, smem: int) -> str:
    """resolve_route's route."""
    return resolve_route(kernel_mode, T, H, K, smem)[0]


# The paged op allocates its split partials in the call (o_part fp32 [T, H, S, 512] + lse_part
# fp32 [T, H, S]), outside vLLM's memory profile like a workspace would be. The composite caps
# S so that they stay under PAGED_PARTIALS_MAX_BYTES: small batches keep their planned splits,
# large T (many programs already) runs fewer or one.
PAGED_PARTIALS_MAX_BYTES = 16 << 20


def composite_split_cap(T: int, H: int) -> int:
    """The most splits whose partials fit: the largest S >= 1 with T * H * S * (512 + 1) * 4
    bytes <= PAGED_PARTIALS_MAX_BYTES."""
    return max(1, PAGED_PARTIALS_MAX_BYTES // (max(T * H, 1) * (HEAD_DIM + 1) * 4))


def composite_may_cap(T: int, H: int, K: int) -> bool:
    """Whether a plan of K keys could exceed composite_split_cap (no plan has more splits than
    16-key blocks): else composite_splits is 0 without planning."""
    return composite_split_cap(T, H) < _cdiv(max(K, 1), 16)


def composite_splits(T: int, H: int, K: int, sms: int, smem: int, form: str,
                     block_sizes: Tuple[int, ...] = ()) -> int:
    """The num_splits the composite passes to the paged op: 0 (the op's own plan) where that
    plan's count is within composite_split_cap, else the cap (at most MAX_SPLITS). ``form``: the
    op's form ('v3' / 'v1', paged_form)."""
    if not composite_may_cap(T, H, K):
        return 0
    cap = composite_split_cap(T, H)
    if form == "v3":
        planned = v3_plan(T, H, K, sms, 0, v3_launch_config(T, H, K, smem, "", block_sizes), smem).splits
    else:
        planned = fused_plan(T, H, K, sms).splits
    return 0 if planned <= cap else min(cap, MAX_SPLITS)


def cache_aligned(cache) -> bool:
    """The v3 form reads 16-byte vectors: the page stride is a multiple of 16 (vLLM's pages are
    multiples of 576 B). Else auto keeps the workspace step where it would run v3 (v1 is slower
    than the step at most of those shapes). The stride only (data_ptr and storage_offset break
    torch.compile(fullgraph=True), measured on the H200); the launcher checks the address
    itself (resolve_paged_form) and runs v1 on a misaligned one."""
    return isinstance(cache, torch.Tensor) and cache.dim() == 2 and cache.stride(0) % 16 == 0


def resolve_composite(choice: str, compressed_cache, swa_cache) -> Tuple[bool, str]:
    """(whether the composite calls the paged op, why), for a route: 'fused' always; 'v3' when
    both caches' page strides are multiples of 16 (cache_aligned), else the workspace step."""
    if choice in ("fused", "paged"):
        return True, f"route {choice}"
    if choice == "v3":
        if cache_aligned(compressed_cache) and cache_aligned(swa_cache):
            return True, "route v3, page strides 16-byte aligned"
        return False, "route v3 but a page stride is not a multiple of 16: the workspace step"
    return False, "route workspace"


def uses_fused_op(choice: str, compressed_cache, swa_cache) -> bool:
    """resolve_composite's answer."""
    return choice in ("fused", "paged") or (choice == "v3" and cache_aligned(compressed_cache)
                                            and cache_aligned(swa_cache))


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


# ---- the paged op's form ----


def fused_form(T: int, H: int, K: int, smem: int = -1) -> str:
    """The form the paged op takes for the mode and shapes: 'v3' under
    DSV4_AMPERE_DECODE_KERNEL=v3, and under auto everywhere but AUTO_FUSED_WINDOWS shapes that
    no v3 window holds (auto_is_v3, ``smem`` as there); else 'v1' (csrc_triton.decode.paged_chunk64).
    resolve_paged_form adds the caches' alignment."""
    m = envs.get(ENV_VAR)
    if m == "auto":  # v1 only where its window (and no v3 window) holds the shape; elsewhere v3
        return "v1" if auto_is_fused(T, H, K) and not auto_is_v3(T, H, K, smem) else "v3"
    return "v3" if m == "v3" else "v1"


def paged_aligned(compressed_cache, swa_cache) -> bool:
    """Both caches' addresses and page strides are multiples of 16 bytes (the v3 form's 16-byte
    vector reads)."""
    return not (compressed_cache.data_ptr() % 16 or swa_cache.data_ptr() % 16
                or compressed_cache.stride(0) % 16 or swa_cache.stride(0) % 16)


def resolve_paged_form(form, T: int, H: int, K: int, smem: int, compressed_cache, swa_cache) -> Tuple[str, str]:
    """(the paged op's form, why): the caller's ``form`` or, for None, fused_form; 'v3' runs only
    over 16-byte aligned caches (paged_aligned), anything else is 'v1' (paged_chunk64)."""
    if form is None:
        form = fused_form(T, H, K, smem)
        why = f"{ENV_VAR}={envs.get(ENV_VAR)}" + (": AUTO_V3_WINDOWS / AUTO_V3_SMEM_WINDOWS" if form == "v3" else "")
    else:
        why = "the caller's form"
    if form == "v3":
        if paged_aligned(compressed_cache, swa_cache):
            return "v3", why
        return "v1", why + "; a cache is not 16-byte aligned (address or page stride): v1"
    return "v1", why


def paged_form(form, T: int, H: int, K: int, smem: int, compressed_cache, swa_cache) -> str:
    """resolve_paged_form's form, without building the reason."""
    if form is None:
        form = fused_form(T, H, K, smem)
    return "v3" if form == "v3" and paged_aligned(compressed_cache, swa_cache) else "v1"


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
    """The decode mode under the switch: heads (auto and heads); tiles and fused plan from T,
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
