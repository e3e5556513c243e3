"""The DeepSeek-V4 decode step's plan: which kernel runs, with which launch config and how many
splits, from static shapes and device facts only (no host sync).

One planner, ``plan_step``, makes every decision of a paged decode launch and says why; the
composite (dsv4_ops.dsv4_decode), the paged op (dsv4_ops.paged_decode through paged_plan) and the
warm set all ask it. Its decisions, one function each:

    decision                        function        decides from
    mode                            resolve_mode    DSV4_AMPERE_DECODE_KERNEL, DSV4_AMPERE_BATCH_INVARIANT
    paged op or workspace step      resolve_route   the mode
    launch config                   resolve_config  the caller's config, DSV4_AMPERE_DECODE_CONFIG, the
                                                    device's decode table (dispatch.tables), CONFIG_WINDOWS
                                                    (dispatch.windows), V3_COST on the plan's SMs, the
                                                    caches' alignment and block sizes
    split count                     v3_splits       the table's count, else least V3_COST time
    partials cap                    split_cap       PAGED_PARTIALS_MAX_BYTES
    balanced splits                 balanced        DSV4_AMPERE_DECODE_BALANCE, lengths, int32 slots
    (cost model)                    v3_cost_us, v3_resident

The two kernels of the paged op (csrc_triton.decode), both reading the 584-byte fp8 records by slot:

    kernel          configs                  reads                         tests
    paged_chunk128  h... (V3_UNALIGNED over    any 2-byte aligned records    test_decode_paged.py
                    unaligned caches)        (16-byte vectors when ALIGN)
    paged_f16dot    kh... (benchmark-only    16-byte aligned pages,        test_decode_paged.py
                    gh / sh / wh)            power-of-two block sizes

The workspace step (gather to bf16, then ``sparse_mla_decode``) runs only when asked (modes tiles /
heads, batch invariance); its kernels and splits are dispatch.workspace's.

    DSV4_AMPERE_DECODE_KERNEL = auto | v3 | tiles | heads   (read at each call; default auto)
      auto, v3  the paged op
      tiles     the workspace step with the tiles kernel; heads: with the heads kernel
    DSV4_AMPERE_DECODE_CONFIG = <config name>   (read at each call; default unset)
      forces the paged op's launch config
"""

from __future__ import annotations

import functools
from typing import Tuple

from .. import envs
from ..layout import HEAD_DIM
from ..csrc_triton.decode import paged_chunk128 as _vk
from ..csrc_triton.decode.balance import MAX_TOKENS as _BALANCE_MAX_TOKENS
from ..csrc_triton.decode.tiles import MAX_SPLITS
from . import device as _device
from . import tables as _tables
from . import windows as _windows
from .configs import config_fits, is_f16dot, v3_config
from .workspace import DecodePlan, balanced_splits, batch_invariant, batch_invariant_mode

ENV_VAR = envs.DECODE_KERNEL
CONFIG_ENV = envs.DECODE_CONFIG
MODES = envs.DECODE_MODES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> bool:
    return not n & (n - 1)


# ---- the mode and the route ----


def resolve_mode() -> Tuple[str, str]:
    """(the decode mode, why): DSV4_AMPERE_DECODE_KERNEL (ValueError on an unknown value), or
    heads under DSV4_AMPERE_BATCH_INVARIANT=1 (ValueError for a mode that plans from T)."""
    m = envs.get(ENV_VAR)
    if batch_invariant():
        return batch_invariant_mode(m), f"{envs.BATCH_INVARIANT}=1 runs the heads kernel"
    return m, (f"{ENV_VAR}={m}" if envs.is_set(ENV_VAR) else f"{ENV_VAR} unset: auto")


def mode() -> str:
    """resolve_mode's mode."""
    m = envs.get(ENV_VAR)
    return batch_invariant_mode(m) if batch_invariant() else m


def resolve_route(kernel_mode: str) -> Tuple[str, str]:
    """(the composite's route, why): 'paged' (the paged op) in modes auto and v3, 'workspace'
    (gather + sparse_mla_decode) in modes tiles and heads. Auto never takes the workspace step: its
    bf16 workspace is T x K x 1 KiB a call, allocated inside the attention call that vLLM's memory
    profile skips, and K grows with max_model_len."""
    if kernel_mode not in MODES:
        raise ValueError(f"decode mode: expected one of {', '.join(MODES)}, got {kernel_mode!r}")
    if kernel_mode in ("tiles", "heads"):
        return "workspace", f"mode {kernel_mode}: the workspace step"
    return "paged", f"mode {kernel_mode}: the paged op"


def route(kernel_mode: str) -> str:
    """resolve_route's route."""
    return resolve_route(kernel_mode)[0]


# ---- the launch config ----

# The cost of a paged launch on the SMs a plan counts on (device.num_sms: DSV4_AMPERE_SMS or the
# device's), microseconds for one launch and its merge. Least squares over the sweep of
# benchmarks/results/decode_sms_call1.md (H200, portable, mma.sync, 132 / 112 / 104 SMs through driver green
# contexts, the 5 dispatched configs x balanced split counts <= 20, T <= 64, K 640: median error 4%, p90
# 13%, its pick within 1.19x of the sweep's best at every shape):
#   programs P = T * cdiv(H, BLOCK_H) * S, r resident an SM, waves w = cdiv(P, r * SMs),
#   key blocks of a split b = cdiv(cdiv(K, BLOCK_N), S), partials MB = T * H * S * 512 * 4 * 2 / 1e6
#   time = w * (us a program + b * us a key block) + [S > 1] * (V3_MERGE_US + V3_MERGE_US_PER_MB * MB)
# A grid one wave deep on 132 SMs is two on 104 (T = 128, H = 8 at S = 2): the waves term is what
# keeps the 132-SM counts from falling off a cliff at 104; the per-program and merge terms keep the
# count from running to 20 splits of one block.
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
# The measured window's config (CONFIG_WINDOWS, measured at 132 SMs) is kept unless another config's
# modelled time is this much shorter on the plan's SM count.
V3_CONFIG_MARGIN = 1.15
# Split counts of configs outside V3_COST (benchmark candidates): the balanced count with the fewest
# key blocks on the busiest SM, this many programs resident an SM (v3_splits).
V3_RESIDENT_PER_SM = 2


_UNALIGNED_CONFIG = _vk.V3_UNALIGNED[0]


def _chunk128_config(T: int, H: int) -> str:
    """paged_chunk128's config for the shape: 16-key blocks for one token at H <= 16, else 32."""
    return "h16n16w4" if T <= 1 and H <= 16 else "h16n32w4"


def _window_config(T: int, H: int, K: int, smem: int) -> Tuple[str, str]:
    for row in _windows.CONFIG_WINDOWS:
        t_lo, t_hi, h_lo, h_hi, k, name = row
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k and config_fits(name, smem):
            return name, f"CONFIG_WINDOWS row {row}"
    name = _chunk128_config(T, H)
    return name, f"no window: paged_chunk128's {name}"


@functools.lru_cache(maxsize=4096)
def _sm_config(T: int, H: int, K: int, sms: int, smem: int, window: str) -> Tuple[str, str]:
    """The window's config unless another V3_COST config that fits ``smem`` is modelled more than
    V3_CONFIG_MARGIN faster on ``sms`` SMs at its own best split count (BLOCK_H 32 only for H > 16)."""
    if window not in V3_COST:
        return window, ""

    def best_cost(name: str) -> float:  # at the count it would run: v3_splits, capped as plan_step caps
        cfg = v3_config(name)
        s = v3_splits(T, H, K, sms, cfg["BLOCK_H"], cfg["BLOCK_N"], name, smem)
        return v3_cost_us(T, H, K, sms, name, min(s, split_cap(T, H)), smem)

    cands = [n for n in V3_COST if config_fits(n, smem) and (v3_config(n)["BLOCK_H"] <= 16 or H > 16)]
    best = min(cands, key=lambda n: (best_cost(n), n))
    keep = best_cost(window)
    if keep <= V3_CONFIG_MARGIN * best_cost(best):
        return window, ""
    return best, f"; on {sms} SMs V3_COST models {best} {keep / best_cost(best):.2f}x faster"


def resolve_config(T: int, H: int, K: int, smem: int = -1, config: str = "", block_sizes: Tuple[int, ...] = (),
                   sms: int = 0, aligned: bool = True) -> Tuple[str, str]:
    """(the paged op's launch config, why), first rule that applies: the caller's ``config``
    (benchmarks, tests); DSV4_AMPERE_DECODE_CONFIG when set (ValueError naming it on an unknown
    config); for ``sms`` > 0 the current device's decode table entry (dispatch.tables: measured by
    dsv4-ops tune); the first CONFIG_WINDOWS row holding (T, H, K) whose config fits ``smem`` bytes a
    block (-1: the current device's), else paged_chunk128's 16-key config for one token at H <= 16 and
    its 32-key config elsewhere; for ``sms`` > 0 another V3_COST config where the model on that many
    SMs says so (_sm_config). Over caches that are not 16-byte aligned (``aligned`` False) every plan
    runs paged_chunk128's unaligned config (V3_UNALIGNED: 2-byte reads, spill-free with ALIGN off);
    a paged_f16dot config over ``block_sizes`` that are not all powers of two (it takes them as
    shifts) runs paged_chunk128's config for the shape."""
    smem = smem if smem >= 0 else _device.smem_per_block(-1)
    if config:
        name, why = config, "the caller's config"
    elif envs.raw(CONFIG_ENV):
        name = envs.raw(CONFIG_ENV)
        try:
            v3_config(name)
        except KeyError:
            raise ValueError(f"{CONFIG_ENV}: no paged decode config named {name!r} (paged_chunk128."
                             f"V3_CANDIDATES, paged_f16dot.V4_CANDIDATES)") from None
        why = f"forced by {CONFIG_ENV}"
    else:
        entry = _tables.lookup(T, H, K, sms) if sms > 0 else None
        if entry is not None:  # measured on this device at this SM count (dsv4-ops tune)
            name, why = entry.config, f"decode table {entry.why}"
        else:
            name, why = _window_config(T, H, K, smem)
            if sms > 0:
                name, more = _sm_config(T, H, K, sms, smem, name)
                why += more
    if not aligned and name != _UNALIGNED_CONFIG:
        return _UNALIGNED_CONFIG, (f"{name} ({why}) over caches that are not 16-byte aligned: paged_chunk128's "
                                   f"{_UNALIGNED_CONFIG} (ALIGN off)")
    if block_sizes and not all(_pow2(b) for b in block_sizes) and is_f16dot(v3_config(name)):
        return _chunk128_config(T, H), (f"{name} ({why}) takes power-of-two block sizes only, got "
                                        f"{tuple(block_sizes)}: paged_chunk128")
    return name, why


# ---- the split count ----


def v3_resident(config: str, smem: int = -1) -> int:
    """Programs of a V3_COST config resident an SM on a device of ``smem`` bytes of shared memory a
    block (-1: the current device's, smem_per_block): V3_COST's count (registers: the same on sm_80,
    sm_86 and sm_90) or fewer where the shared memory holds fewer blocks (device.blocks_by_smem)."""
    smem = smem if smem >= 0 else _device.smem_per_block(-1)
    return max(1, min(V3_COST[config][0], _device.blocks_by_smem(V3_SHARED_BYTES[config], smem)))


def v3_cost_us(T: int, H: int, K: int, sms: int, config: str, splits: int, smem: int = -1) -> float:
    """The modelled microseconds of a paged launch with ``config`` (a V3_COST name) at ``splits`` splits
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
    """Split count of a paged launch on ``sms`` SMs (of ``smem`` bytes a block, -1: the current
    device's). A V3_COST config: the balanced count of least v3_cost_us (ties: fewer splits). Any other
    config (benchmark candidates): 64-key blocks at most one program an SM, snapped down; smaller
    blocks the balanced count minimising cdiv(programs * S, V3_RESIDENT_PER_SM * sms) * cdiv(nb, S)."""
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


# The paged op allocates its split partials in the call (o_part fp32 [T, H, S, 512] + lse_part
# fp32 [T, H, S]), outside vLLM's memory profile. The plan caps S so that they stay under
# PAGED_PARTIALS_MAX_BYTES: small batches keep their planned splits, large T (many programs
# already) runs fewer or one.
PAGED_PARTIALS_MAX_BYTES = 16 << 20


def split_cap(T: int, H: int) -> int:
    """The most splits whose partials fit: the largest S >= 1 with T * H * S * (512 + 1) * 4
    bytes <= PAGED_PARTIALS_MAX_BYTES."""
    return max(1, PAGED_PARTIALS_MAX_BYTES // (max(T * H, 1) * (HEAD_DIM + 1) * 4))


def balanced(direct: bool, has_lengths: bool, int32_slots: bool, T: int = 1) -> bool:
    """Whether a paged_f16dot launch balances its splits over the tokens' key lengths
    (csrc_triton.decode.balance): when DSV4_AMPERE_DECODE_BALANCE=1 (off by default: the planning launch
    costs equal batches more than it saves, benchmarks/results/decode_balance.md), it splits (not
    direct), reads lengths (a batch without them is uniform), its slots are int32 (vLLM's; the forms the
    AOT check compiles), T fits the plan words' token field and batch invariance is off (balanced, a
    token's splits depend on the others')."""
    return (not direct and has_lengths and int32_slots and T < _BALANCE_MAX_TOKENS
            and bool(envs.get(envs.DECODE_BALANCE)) and not batch_invariant())


# ---- the planner ----


def plan_step(T: int, H: int, K: int, sms: int, smem: int = -1, block_sizes: Tuple[int, ...] = (),
              splits: int = 0, config: str = "", lengths: bool = False, int32_slots: bool = True,
              aligned: bool = True) -> DecodePlan:
    """The paged op's plan (kernel 'v3') for T tokens, H heads, K = K1 + K2 key positions a token on
    ``sms`` SMs of ``smem`` bytes of shared memory a block (-1: the current device's), caches of
    ``block_sizes`` (``aligned``: both caches' addresses and page strides are multiples of 16 bytes):
    the launch config (resolve_config; ``config`` forces one), the split count (the
    caller's ``splits``, else the decode table's where its entry names this config, else v3_splits,
    capped at split_cap) and whether the splits follow the tokens' lengths (balanced: ``lengths``
    given, int32 slots, paged_f16dot). ``why`` says which rules decided."""
    smem = smem if smem >= 0 else _device.smem_per_block(-1)
    name, why = resolve_config(T, H, K, smem, config, block_sizes, sms, aligned)
    cfg = v3_config(name)
    bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
    if splits:
        s, swhy = splits, "the caller's splits"
    else:
        entry = _tables.lookup(T, H, K, sms) if sms > 0 else None
        if entry is not None and entry.config == name and entry.splits:
            s, swhy = entry.splits, "the decode table's splits"
        else:
            s, swhy = v3_splits(T, H, K, sms, bh, bn, name, smem), f"v3_splits on {sms} SMs"
        cap = split_cap(T, H)
        if s > cap:
            s, swhy = cap, swhy + f", capped at {cap} (PAGED_PARTIALS_MAX_BYTES)"
    bal = is_f16dot(cfg) and balanced(s == 1, lengths, int32_slots, T)
    return DecodePlan("v3", s, bh, bn, _cdiv(H, bh), s == 1, name, bal,
                      f"config {name}: {why}; S = {s}: {swhy}" + ("; balanced" if bal else ""))
