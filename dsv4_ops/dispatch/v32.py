"""Which DeepSeek-V3.2 / GLM-5 sparse-MLA kernel form runs, with which config and how many
splits (csrc_triton.v32_attention): static shapes only, no host sync.

    decision        function          decides from
    form            resolve_form      DSV4_AMPERE_V32_FORM, record alignment, fp8 or bf16 rows,
                    (form_for)        H, T (auto_form: benchmarks/results/v32_decode.md, v32_prefill.md)
    config          config_of         the form and the head group (block_h_for(H)) or an f16 candidate
    splits          num_splits_for    T, H, K, SMs (one wave of programs: v32_decode.md)
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

from .. import envs
from ..csrc_triton import v32_attention as _ak

FORM_ENV = envs.V32_FORM  # w64 | w128 | f16 | auto (default); f16:<candidate> too
MAX_SPLITS = _ak.MAX_SPLITS


def auto_form(fp8: bool, H: int, T: int = 1) -> str:
    """auto's form, from benchmarks/results/v32_{decode,prefill}.md (H200, portable, mma.sync,
    K = 2048). fp8_ds_mla records: f16 at H <= 16 from T = 16 (benchmarks/results/v32_decode.md: T = 16 / 64
    / 128: 32.8 / 125 / 235 us against w128's 43.5 / 198 / 380, 1.33-1.62x), w128 at T = 1
    (10.1 vs 11.6 us; T 2..15 were not measured and keep w128) and at H > 16 (the best f16
    config, 16 heads x 32 keys x 4 warps, was within 3% of w128 at T 1..128: 216.7 vs 214.8 us
    at T = 16, 1727 vs 1771 at T = 128). bf16 rows (prefill, T = 1024): w64 at H <= 16 (1007 vs
    2032 us), w128 above (8751 vs 13151 us)."""
    if fp8:
        return "f16" if H <= 16 and T >= 16 else "w128"
    return "w128" if H > 16 else "w64"


def resolve_form(aligned: bool, form: Optional[str] = None, fp8: bool = True, H: int = 16,
                 T: int = 1) -> Tuple[str, str]:
    """(the kernel form, why): 'w64' (9 chunks of 64 dims), 'w128' (4 tiles of 128 + the 64 RoPE
    dims; aligned records only) or 'f16' (w128's tiles with the E4M3 codes as fp16 dot
    operands; aligned fp8_ds_mla records only; 'f16:<name>' picks a config of
    csrc_triton.v32_attention.F16_CANDIDATES). form / env DSV4_AMPERE_V32_FORM: w64 | w128 |
    f16[:name] | auto (None: the env, default auto). auto: auto_form(fp8, H, T) when aligned;
    f16 over bf16 rows runs auto's bf16 form; unaligned records: w64."""
    f = form or envs.raw(FORM_ENV)
    why = "the caller's form" if form else f"{FORM_ENV}={f}"
    base, _, cand = f.partition(":")
    if base not in ("auto",) + _ak.FORMS or (cand and (base != "f16" or cand not in _ak.F16_CANDIDATES)):
        raise ValueError(f"{FORM_ENV} / form: expected auto, w64, w128, f16 or f16:<one of "
                         f"{sorted(_ak.F16_CANDIDATES)}>, got {f!r}")
    if base == "auto":
        f = auto_form(fp8, H, T)
        why += " (auto_form: benchmarks/results/v32_decode.md, v32_prefill.md)"
    if f.startswith("f16") and not fp8:
        f = auto_form(False, H)
        why += "; f16 needs fp8 records: auto's bf16 form"
    if not aligned:
        return "w64", why + "; records not 16-byte aligned: w64"
    return f, why


def form_for(aligned: bool, form: Optional[str] = None, fp8: bool = True, H: int = 16, T: int = 1) -> str:
    """resolve_form's form."""
    return resolve_form(aligned, form, fp8, H, T)[0]


def config_of(form: str, bh: int) -> dict:
    if form.startswith("f16"):
        _, _, cand = form.partition(":")
        return _ak.F16_CANDIDATES[cand] if cand else _ak.F16_CONFIG[bh]
    return (_ak.V32_W128_CONFIG if form == "w128" else _ak.V32_ATTN_CONFIG)[bh]


def block_h_of(form: str, H: int) -> int:
    """Rows of a head group: block_h_for(H), or an f16 candidate's own BLOCK_H."""
    cfg = config_of(form, _ak.block_h_for(H))
    return cfg.get("BLOCK_H", _ak.block_h_for(H))


# One wave of programs: every attention config holds 45-65K registers a program (8 warps x
# 166-255 registers), so one program an SM is resident, and a split count that spills T * G *
# S past the SM count runs a second wave. Measured (benchmarks/results/v32_decode.md, H200,
# 132 SMs): the fastest split count of the sweep was floor(SMs / (T * G)) at all 5 shapes that
# split (64, 32~33, 8, 2, 2); a ceiling instead was up to 1.9x slower (T = 16, H = 16: 9 splits
# 82-94 us, 8 splits 44-48 us).


@functools.lru_cache(maxsize=4096)
def num_splits_for(T: int, H: int, K: int, sms: int, form: str = "w64") -> int:
    """Split count from static shapes: 1 when T * groups programs fill the SMs, else the most
    splits that still fit one wave (floor(sms / (T * groups))), at most one key block a split
    and MAX_SPLITS."""
    bh = block_h_of(form, H)
    cfg = config_of(form, _ak.block_h_for(H))
    groups = -(-H // bh)
    nb = max(1, -(-K // cfg["BLOCK_N"]))
    base = max(1, T * groups)
    slots = sms * cfg.get("PER_SM", 1)  # programs resident at once
    if base >= slots:
        return 1
    return max(1, min(MAX_SPLITS, nb, slots // base))
