"""Which config the decode indexer (paged MQA logits, csrc_triton.indexer) launches with, and how
many key tiles one program scores: static shapes only, no host sync.

    decision            function                  decides from
    paged config        paged_config              H (PAGED_CONFIG_WIDE from H_BLOCK 64: V4; else PAGED_CONFIG: V4.1)
    tiles a program     paged_tiles_per_program   rows, max_context_len, the config, SMs (device.num_sms),
                                                  programs a SM (the compiled kernel's, device.resident_programs)
    rows a dot          mqa_rows_per_dot          H and the config's DOT_N (KERNEL 3)
"""

from __future__ import annotations

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


def paged_tiles_per_program(rows: int, max_context_len: int, config: Optional[dict] = None,
                            sms: Optional[int] = None, per_sm: Optional[int] = None) -> int:
    """Key tiles one program scores: spreads rows * tiles over ~TARGET_PROGRAMS programs, or,
    when the config has PROGRAMS_PER_SM and ``sms`` (the device's SM count) is given, over
    ~sms * per_sm programs: one resident wave (static shapes only: the same for every replay of
    a captured graph). per_sm: programs of the compiled kernel resident an SM (the driver's
    occupancy, ``device.resident_programs``: 8 of PAGED_CONFIG on the H200's compile, 5 on
    sm_80's); the config's PROGRAMS_PER_SM when not given. The one-wave rule is not capped by
    MAX_TILES_PER_PROGRAM: a cap that splits a row into more programs than its share of the wave
    makes a second, partial wave (B = 64, 32K keys on 104-112 SMs: 256 programs of 64 tiles for
    208-224 slots, 1.7x the time of 132 SMs' one wave; uncapped, 192 programs of 86 tiles)."""
    cfg = config or _k.PAGED_CONFIG
    tiles = triton.cdiv(max_context_len, cfg["BLOCK_N"])
    if sms and "PROGRAMS_PER_SM" in cfg:  # rows * cdiv(tiles, tpp) <= sms * per_sm
        cols = max(1, sms * (per_sm or cfg["PROGRAMS_PER_SM"]) // max(rows, 1))
        return max(1, triton.cdiv(tiles, cols))  # cols >= 1: never more than tiles
    return max(1, min(cfg["MAX_TILES_PER_PROGRAM"], rows * tiles // cfg["TARGET_PROGRAMS"], tiles))
