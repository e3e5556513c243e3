"""Which config the decode indexer (paged MQA logits, csrc_triton.indexer) launches with, and how
many key tiles one program scores: static shapes only, no host sync.

    decision            function                  decides from
    paged config        paged_config              H (PAGED_CONFIG_WIDE from H_BLOCK 64: V4; else PAGED_CONFIG: V4.1)
    tiles a program     paged_tiles_per_program   rows, max_context_len, the config, SMs (device.num_sms),
                        (wave_plan)               programs a SM (the compiled kernel's, device.resident_programs):
                                                  least waves x (tiles a program + PROGRAM_TILES)
    rows a dot          mqa_rows_per_dot          H and the config's DOT_N (KERNEL 3)
"""

from __future__ import annotations

import functools
from typing import Optional

import triton

from ..csrc_triton import indexer as _k


def mqa_rows_per_dot(H: int, config: dict) -> int:
    """KERNEL 3: query rows one dot takes, so that ROWS * H_BLOCK = config's DOT_N (a power of
    two, at least 1 row)."""
    h_block = max(16, triton.next_power_of_2(H))
    return max(1, config.get("DOT_N", 128) // h_block)


def paged_config(H: int) -> dict:
    """The shipped decode config for H heads: PAGED_CONFIG_WIDE from H_BLOCK 64 (V4), else
    PAGED_CONFIG (V4.1's 32 heads)."""
    return _k.PAGED_CONFIG_WIDE if max(16, triton.next_power_of_2(H)) >= 64 else _k.PAGED_CONFIG


# The wave plan's time model (a program's start, q load and epilogue, in key tiles' time): the
# H200 sweep of B = 64, 32K keys (benchmarks/results/indexer_sms_summary.md) fits 0-0.5 tiles for
# PAGED_CONFIG_WIDE; 1 leans the plan to fewer, longer programs where waves tie.
PROGRAM_TILES = 1
# Wave counts the plan's search visits at most (it stops earlier once no more waves can win).
MAX_WAVE_STEPS = 1024


def paged_tiles_per_program(rows: int, max_context_len: int, config: Optional[dict] = None,
                            sms: Optional[int] = None, per_sm: Optional[int] = None) -> int:
    """Key tiles one program scores. When the config has PROGRAMS_PER_SM and ``sms`` (the device's
    SM count) is given: the wave plan (``wave_plan``) over slots = sms * per_sm programs resident at
    once. per_sm: programs of the compiled kernel resident an SM (the driver's occupancy,
    ``device.resident_programs``: 8 of PAGED_CONFIG on the H200's compile, 5 on sm_80's); the config's
    PROGRAMS_PER_SM when not given. Else (no SM count: the interpreter, the warm set's keys): rows *
    tiles spread over ~TARGET_PROGRAMS programs, at most MAX_TILES_PER_PROGRAM tiles each. Static
    shapes only: the same for every replay of a captured graph."""
    cfg = config or _k.PAGED_CONFIG
    tiles = triton.cdiv(max_context_len, cfg["BLOCK_N"])
    if sms and "PROGRAMS_PER_SM" in cfg:
        return wave_plan(max(rows, 1), max(tiles, 1), sms * (per_sm or cfg["PROGRAMS_PER_SM"]))
    return max(1, min(cfg["MAX_TILES_PER_PROGRAM"], rows * tiles // cfg["TARGET_PROGRAMS"], tiles))


def wave_cost(rows: int, tiles: int, slots: int, tpp: int) -> int:
    """The modelled time of ``tpp`` tiles a program, in key tiles' time: waves (rows * cdiv(tiles,
    tpp) programs over ``slots`` resident at once) x (tpp + PROGRAM_TILES)."""
    return triton.cdiv(rows * triton.cdiv(tiles, tpp), slots) * (tpp + PROGRAM_TILES)


@functools.lru_cache(maxsize=4096)
def wave_plan(rows: int, tiles: int, slots: int) -> int:
    """Tiles a program of least ``wave_cost`` (ties: fewer programs). Each wave count w has one
    candidate, the fewest tiles a program whose grid fits w waves (cols = w * slots // rows
    programs a row); the search runs from the fewest waves up and stops where w waves cannot beat
    the best (w * PROGRAM_TILES + rows * tiles / slots, the model's floor at w waves). Not capped
    by MAX_TILES_PER_PROGRAM: a cap that splits a row past its share of a wave adds a partial wave.
    B = 64, 32K keys, PAGED_CONFIG_WIDE (2 an SM): one wave on 132 SMs (256 programs of 64 tiles);
    two on 112 (448 of 37: 0.87x one wave's time, measured); four on 104 (832 of 20: 0.93x)."""
    best = None
    w = triton.cdiv(rows, slots)  # the fewest waves: one program a row
    for _ in range(MAX_WAVE_STEPS):
        cols = min(tiles, max(1, w * slots // rows))
        tpp = triton.cdiv(tiles, cols)
        key = (wave_cost(rows, tiles, slots, tpp), rows * triton.cdiv(tiles, tpp))
        if best is None or key < best[0]:
            best = (key, tpp)
        if cols == tiles or w * PROGRAM_TILES + rows * tiles / slots >= best[0][0]:
            break
        w = max(w + 1, triton.cdiv(rows * (cols + 1), slots))  # the next wave count with more columns
    return best[1]
