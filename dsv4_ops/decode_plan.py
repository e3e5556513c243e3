"""Which sparse-MLA decode kernel runs, with how many splits: static shapes only, no host sync.

The one home of the decode plan: every kernel choice and split count of a decode
step is decided here, from (T, H, K, SMs) alone, and each choice is pinned by a test:

    kernel  chosen by                               splits by                     tests
    tiles   auto below AUTO_HEADS_MIN_T             tile_splits (pinned table)    test_decode_splits.py
    heads   auto from AUTO_HEADS_MIN_T              auto_heads_splits (measured)  test_decode_gather/heads.py
    v1      auto_is_fused (AUTO_FUSED_WINDOWS)      fused_splits                  test_decode_paged_chunk64.py
    v3      auto_is_v3 (AUTO_V3_WINDOWS), first     v3_splits (busiest SM's keys) test_decode_paged.py
            config: v3_config_name (AUTO_V3_SMEM_WINDOWS where the device's shared memory
            holds the config, then V3_CONFIG_WINDOWS: the v4 fp16-dot kernel, paged_f16dot,
            where measured faster; else paged_chunk128)

(the composite asks auto_is_v3, then auto_is_fused; the fused op's form is fused_form).

    DSV4_AMPERE_DECODE_KERNEL = auto | tiles | heads | fused | v3   (read at each call; default auto)
      tiles  the split-KV tile kernel (csrc_triton.decode.tiles: 16-head tiles x 16-key
             blocks, every key re-read cdiv(H, 16) times) + the merge; splits from
             ``tile_splits`` below
      heads  csrc_triton.decode.heads: one program per (token, split, head group of
             BLOCK_H <= 32 rows) reads each key block once for its group; one split writes
             the final out + lse in its epilogue (no merge launch)
      v3     (the composite only) the fused op with csrc_triton.decode.paged_chunk128 (4 x 128-dim
             chunks, records prefetched a block ahead; ``v3_plan``)
      fused  (the composite dsv4_decode_attention only) csrc_triton.decode.paged_chunk64: the
             heads structure reading the paged fp8 records by slot, no workspace and no
             gather launch (op dsv4_decode_fused_out; ``fused_plan``); a direct
             sparse_mla_decode call treats it as auto
      auto   tiles below T = 64, heads from T = 64 with measured split counts
             (``AUTO_HEADS_MIN_T``, ``auto_heads_splits``: benchmarks/results/decode_kernels.md);
             in the composite, v3 where ``auto_is_v3`` says so (H <= 16 and a few more
             shapes, benchmarks/results/decode_paged_chunk128.md; 16-byte aligned pages), else v1
             fused where ``auto_is_fused`` (measured) says so

The heads split count minimises a cost model (constants: H200 guesses, NOT measured; refit
from bench_decode_kernels.py):

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

from . import envs
from .csrc_triton.decode import heads as _hk
from .csrc_triton.decode.tiles import MAX_SPLITS, PARTITION_N
from .csrc_triton.decode.tiles import SPLIT_CONFIG as _SPLIT_CONFIG

ENV_VAR = envs.DECODE_KERNEL
MODES = ("auto", "tiles", "heads", "fused", "v3")
HEAD_DIM = 512

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
    the v3 form's launch config (its kernel: v3 or v4)."""

    kernel: str
    splits: int
    block_h: int
    block_n: int
    groups: int
    direct: bool
    config: str = ""  # v3 form: the launch config (v3_config_name), so plans of different kernels differ


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

# ---- the tiles kernel's split count (was dsv4_ops.split_heuristic; that module re-exports) ----
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



def mode() -> str:
    """The DSV4_AMPERE_DECODE_KERNEL value (ValueError on an unknown one)."""
    m = envs.get(ENV_VAR)
    return batch_invariant_mode(m) if batch_invariant() else m


# Plans for this many SMs instead of the device's count: a green context or an MPS share runs
# on fewer SMs than the device properties report (benchmarks: 108, an A100's count, on the H200).
SMS_ENV = envs.SMS


def num_sms(device_index: int) -> int:
    """Streaming multiprocessors a plan counts on: DSV4_AMPERE_SMS when set (read at each
    call; the recorded launch plans keep what they were planned with), else the device's
    (cached; 108 on an A100, 132 on an H200)."""
    forced = envs.get(SMS_ENV)
    if forced is not None:
        return forced
    return _device_sms(device_index)


@functools.lru_cache(maxsize=16)
def _device_sms(device_index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


# Shared memory a block may opt into where no CUDA device is current (the CPU, the interpreter,
# fake tensors): an A100's, the arch the plan is written for.
DEFAULT_SMEM_BYTES = 163 * 1024
_SMEM: dict = {}  # device index -> bytes (a plain dict: traced code reads it as a constant)


def known_smem(device_index: int) -> int:
    """smem_per_block's cached figure for the device, or DEFAULT_SMEM_BYTES before it was asked:
    no device query (traced code: torch.compile reads it as a constant)."""
    return _SMEM.get(device_index, DEFAULT_SMEM_BYTES)


def smem_per_block(device_index: int = -1) -> int:
    """Bytes of shared memory a block may opt into on CUDA device ``device_index`` (cached; 163
    KiB on an A100, 99 KiB on sm_86, 227 KiB on an H200); -1 (a CPU tensor's index): the
    current CUDA device where CUDA is initialised, else DEFAULT_SMEM_BYTES."""
    got = _SMEM.get(device_index)
    if got is None:
        import torch

        if not torch.cuda.is_available():  # fake CUDA tensors on a CPU machine (the warm-set trace)
            return DEFAULT_SMEM_BYTES
        if device_index < 0:
            if not torch.cuda.is_initialized():
                return DEFAULT_SMEM_BYTES
            return smem_per_block(torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device_index)
        got = _SMEM[device_index] = int(getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SMEM_BYTES)
    return got


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


# ---- the fused paged decode (csrc_triton.decode.paged_chunk64) ----
# Programs aimed at per SM when T * groups alone does not fill the SMs. Measured
# (decode_paged_chunk64.md): the plan's count was the best of the sweep at T <= 4 with H <= 16 (20
# splits); from T = 16 or H = 64 fewer splits measured faster (the kernel is slow there and
# not dispatched, so the table is left as it is).
FUSED_PROGRAMS_PER_SM = 2


def fused_splits(T: int, H: int, K: int, sms: int) -> int:
    """Split count of the fused kernel: enough programs for FUSED_PROGRAMS_PER_SM a SM, at
    most one key block a split, snapped up to a balanced count."""
    from .csrc_triton.decode import paged_chunk64 as _pk

    bh = _pk.block_h_for(H)
    nb = _cdiv(max(K, 1), _pk.FUSED_CONFIG[bh]["BLOCK_N"])
    want = min(nb, MAX_SPLITS, max(1, _cdiv(FUSED_PROGRAMS_PER_SM * sms, max(T, 1) * _cdiv(H, bh))))
    return min(s for s in balanced_splits(nb) + [nb] if s >= want) if want < nb else min(nb, MAX_SPLITS)


@functools.lru_cache(maxsize=4096)
def fused_plan(T: int, H: int, K: int, sms: int, splits: int = 0) -> DecodePlan:
    """The plan of the fused kernel for T tokens, H heads, K = K1 + K2 key positions on
    ``sms`` SMs; splits 0 = fused_splits, else forced (1..MAX_SPLITS)."""
    from .csrc_triton.decode import paged_chunk64 as _pk

    bh = _pk.block_h_for(H)
    s = splits or fused_splits(T, H, K, sms)
    return DecodePlan("fused", s, bh, _pk.FUSED_CONFIG[bh]["BLOCK_N"], _cdiv(H, bh), s == 1)


# ---- decode v3 (csrc_triton.decode.paged_chunk128): the fused read, 4 x 128-dim chunks ----
# Split counts of the 4-warp (32-key and smaller) configs: the balanced count with the fewest key
# blocks on the busiest SM, two programs resident an SM (V3_RESIDENT_PER_SM), ties to fewer
# splits: time ~ cdiv(T * groups * S, 2 * SMs) * cdiv(nb, S). On the H200 (132 SMs) it gives the
# measured best count at every measured shape (decode_paged_chunk128.md, decode_paged_f16dot.md: T = 1..4: one block a
# split; T = 16, H <= 16: 10 of 20; T = 128: 2; T = 256: 1; K 256, T = 64, H = 64: 1) and S = 4 at
# T = 16, H = 64, where the earlier rule (~1 program an SM) gave 3: 30.6 vs 39.1 us
# (decode_paged_f16dot_splits.md, same call as the step's 37.9).
V3_RESIDENT_PER_SM = 2


def v3_config(name: str) -> dict:
    """The launch config of a v3-form name: paged_chunk128.V3_CANDIDATES (bf16 decode) or
    paged_f16dot.V4_CANDIDATES (fp16 dots; its configs carry PV_KEY). KeyError if neither."""
    from .csrc_triton.decode import paged_chunk128 as _vk
    from .csrc_triton.decode import paged_f16dot as _v4k

    cfg = _vk.V3_CANDIDATES.get(name) or _v4k.V4_CANDIDATES.get(name)
    if cfg is None:
        raise KeyError(f"no v3 / v4 decode config named {name!r}")
    return cfg


# Which v3-form config auto runs, from the H200 sweeps (benchmarks/results/decode_paged_f16dot.md, call 2
# same-run medians; decode_paged_chunk128.md before it). (T_lo, T_hi, H_lo, H_hi, K, config),
# first match wins; the v4 configs are csrc_triton.decode.paged_f16dot's fp16-dot kernel:
#   T 48..96, H <= 16, K 640: kh16n64w8 (64-key blocks, 8 warps; T = 64: 32.9 / 34.6 us vs v3's
#       42.2 / 44.1 at H = 8 / 16; at T = 16 and 128 it lost to kh16n32w4, so the window stays
#       around the one measured T)
#   T 16..256, H <= 16, K 640: kh16n32w4 (T = 16: 15.6 / 16.5 vs 16.0 / 17.1; T = 128: 58.7 /
#       61.2 vs 61.7 / 64.3; T = 256: 102 / 104 vs 111 / 112)
#   T = 1, H = 128, K 640: kh16n64w8 (11.8 vs the step's 13.1 and v3's 12.7)
#   T = 64, H = 64, K 256: kh16n32w4 (40.7 vs v3's 44.5)
#   T = 16, H = 64, K 640: kh16n32w4 at S = 4 (30.6 vs the step's 37.9, kh16n64w8 33.4, kh32n64w8
#       33.5; decode_paged_f16dot_splits.md)
#   else v3 (paged_chunk128): 16-key blocks for one token at H <= 16 (T = 1: 8.0 vs 9.2-9.3 at 32
#       keys, v3 or v4), 32-key blocks elsewhere (T = 4, H = 8: v3 9.6 vs v4 9.7).
# kh32n64w8 (108 KB of shared memory, over sm_86's 99 KB; 1.10-1.36x over the step at H = 64
# from T = 64 and at T = 4) runs only where it fits: AUTO_V3_SMEM_WINDOWS below, ahead of these.
V3_CONFIG_WINDOWS = (
    (48, 96, 1, 16, 640, "kh16n64w8"),
    (16, 256, 1, 16, 640, "kh16n32w4"),
    (16, 16, 64, 64, 640, "kh16n32w4"),
    (1, 1, 128, 128, 640, "kh16n64w8"),
    (64, 64, 64, 64, 256, "kh16n32w4"),
)


# Windows (T_lo, T_hi, H_lo, H_hi, K, config) where auto runs the v3 form with a config whose
# shared memory (paged_f16dot.V4_SMEM_BYTES) only some Ampere parts hold: taken where the
# device's blocks may opt into it (an A100: 163 KiB), else the shape keeps its other choice.
# From the H200 sweep (decode_paged_f16dot.md, 132 SMs, kh32n64w8 against the workspace step): H = 64, K 640:
# T = 4 14.5 vs 16.5 us, T = 64 74.2 vs 93.2, T = 128 150 vs 172, T = 256 295 vs 324 (T = 16
# even, T = 1 slower); K 256: T = 64, H = 64 32.5 vs 40.7 (kh16n32w4), T = 128, H = 128 132 vs 149.
AUTO_V3_SMEM_WINDOWS: tuple = ((4, 4, 64, 64, 640, "kh32n64w8"), (48, 256, 64, 64, 640, "kh32n64w8"),
                               (64, 64, 64, 64, 256, "kh32n64w8"), (128, 128, 128, 128, 256, "kh32n64w8"))


def config_fits(name: str, smem: int) -> bool:
    """Whether a v3-form config's shared memory fits ``smem`` bytes a block."""
    from .csrc_triton.decode import paged_f16dot as _v4k

    return _v4k.V4_SMEM_BYTES.get(name, 0) <= smem


def _smem_window(T: int, H: int, K: int, smem: int) -> str:
    """The AUTO_V3_SMEM_WINDOWS config for (T, H, K) that fits ``smem`` (-1: the current
    device's, smem_per_block), or ''."""
    for t_lo, t_hi, h_lo, h_hi, k, name in AUTO_V3_SMEM_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k:
            if config_fits(name, smem if smem >= 0 else smem_per_block(-1)):
                return name
    return ""


def v3_config_name(T: int, H: int, K: int = 640, smem: int = -1) -> str:
    """The v3-form launch config auto (and DSV4_AMPERE_DECODE_KERNEL=v3) runs for T tokens, H
    heads, K keys on a device of ``smem`` bytes of shared memory a block (-1: the current
    device's): an AUTO_V3_SMEM_WINDOWS config that fits, else the first V3_CONFIG_WINDOWS match,
    else the v3 kernel's 16-key config for one token at H <= 16 and its 32-key config elsewhere
    (paged_chunk128.V3_DISPATCHED)."""
    big = _smem_window(T, H, K, smem)
    if big:
        return big
    for t_lo, t_hi, h_lo, h_hi, k, name in V3_CONFIG_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k:
            return name
    return "h16n16w4" if T <= 1 and H <= 16 else "h16n32w4"


def v3_splits(T: int, H: int, K: int, sms: int, block_h: int, block_n: int) -> int:
    """Split count of the v3 form. 64-key blocks (8-warp programs, one an SM by registers): at
    most one program an SM, snapped down (measured: T = 64, H = 8: S = 2 beat 3; K 256, T = 64,
    H = 64: 1 beat 2). Smaller blocks: the balanced count minimising cdiv(programs * S,
    V3_RESIDENT_PER_SM * sms) * cdiv(nb, S), the fewest splits among equals (see above)."""
    nb = _cdiv(max(K, 1), block_n)
    programs = max(T, 1) * _cdiv(H, block_h)
    cands = [s for s in balanced_splits(nb) if s <= nb] or [1]
    if block_n >= 64:
        want = max(1, min(nb, MAX_SPLITS, sms // programs))
        return max(s for s in cands + [1] if s <= want)
    slots = V3_RESIDENT_PER_SM * sms
    return min(cands, key=lambda s: (_cdiv(programs * s, slots) * _cdiv(nb, s), s))


def v3_plan(T: int, H: int, K: int, sms: int, splits: int = 0, config: str = "") -> DecodePlan:
    """The plan of the v3 kernel (kernel 'v3'); config: a V3_CANDIDATES name to force one
    (benchmarks), else v3_config_name(T, H); splits 0 = v3_splits."""
    name = config or v3_config_name(T, H, K)
    cfg = v3_config(name)
    bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
    s = splits or v3_splits(T, H, K, sms, bh, bn)
    return DecodePlan("v3", s, bh, bn, _cdiv(H, bh), s == 1, name)


# Where auto runs the fused kernel in the composite: measured windows (T_lo, T_hi, H_max, K),
# benchmarks/results/decode_paged_chunk64.md (H200, portable, in-graph, same-run ratio against the
# workspace step): T = 4, H = 8 / 16, K = 640: 10.2 / 10.6 us against 12.1 / 12.5 (1.18x /
# 1.17x). Everywhere else it measured even (T = 1, H <= 16: 1.00-1.02x) or slower (0.26-0.99x
# from T = 16 or H = 64; the draft's K = 256: 0.96x at T = 1), so auto keeps the workspace
# there. Unmeasured shapes (T = 2, 3, 5..15) keep the workspace step too.
AUTO_FUSED_WINDOWS = ((4, 4, 16, 640),)


def auto_is_fused(T: int, H: int, K: int) -> bool:
    """Whether auto runs the fused kernel in the composite (a measured window holds T, H, K)."""
    return any(t_lo <= T <= t_hi and H <= h_max and K == k for t_lo, t_hi, h_max, k in AUTO_FUSED_WINDOWS)


# Where auto runs the v3 kernel (the fused op's other form): measured windows,
# benchmarks/results/decode_paged_chunk128.md (H200, portable, in-graph, same-run ratio against
# the step before it): H <= 16, K = 640 at every T measured (1, 4, 16, 64, 128, 256): 1.11-1.36x
# (T = 128, H = 8: 62.2 vs 81.4 us); the draft's K = 256 at T = 1 and 16: 1.27 / 1.45x; T = 1,
# H = 64: 1.15x (T = 1, H = 128: 1.02x, left out). From H = 64 at T >= 4 the step stays
# (v3 0.66-0.98x there), except the draft's K = 256 at T = 64, H = 64: 44.6-45.0 vs 48.8-49.0
# us in both H200 calls (1.09x). Between the measured T the ratio held at every point, so the
# window spans them; T > 256 (prefill-sized) keeps the step. Added with the v4 configs
# (decode_paged_f16dot.md): T = 1, H = 128 (kh16n64w8 11.8 vs the step's 13.1 us). With the split counts of
# the wave rule (v3_splits): T = 16, H = 64 (kh16n32w4 at S = 4: 30.6 vs 37.9 us, decode_paged_f16dot_splits.md).
# Windows (T_lo, T_hi, H_lo, H_hi, K).
AUTO_V3_WINDOWS = ((1, 256, 1, 16, 640), (1, 16, 1, 16, 256), (1, 1, 1, 64, 640), (64, 64, 64, 64, 256),
                   (1, 1, 128, 128, 640), (16, 16, 64, 64, 640))


def auto_is_v3(T: int, H: int, K: int, smem: int = -1) -> bool:
    """Whether auto runs the v3 kernel in the composite: a measured window holds T, H, K
    (AUTO_V3_WINDOWS, or AUTO_V3_SMEM_WINDOWS where its config fits ``smem`` bytes a block;
    -1: the current device's)."""
    return (any(t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k
                for t_lo, t_hi, h_lo, h_hi, k in AUTO_V3_WINDOWS)
            or bool(AUTO_V3_SMEM_WINDOWS and _smem_window(T, H, K, smem)))


def fused_form(T: int, H: int, K: int, smem: int = -1) -> str:
    """Which kernel op dsv4_decode_fused_out runs: 'v3' under DSV4_AMPERE_DECODE_KERNEL=v3 or
    where auto_is_v3 (``smem`` as there), else 'v1' (csrc_triton.decode.paged_chunk64)."""
    m = envs.get(ENV_VAR)
    return "v3" if m == "v3" or (m == "auto" and auto_is_v3(T, H, K, smem)) else "v1"


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
