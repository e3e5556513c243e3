"""The paged fp8 KV-cache record of DeepSeek-V4 (``fp8_ds_mla``): the only place it is written down.

One token is a 584-byte record: a 576-byte data row and an 8-byte scale row.

    data row (576 B)                                        scale row (8 B)
    +-------------------------------+-------------------+   +----+----+-...-+----+-----+
    | 448 x E4M3 (NoPE dims 0..447) | 64 x bf16 (RoPE   |   | s0 | s1 | ... | s6 | pad |
    | byte d = dim d                | dims 448..511),   |   +----+----+-...-+----+-----+
    |                               | little-endian     |    UE8M0 scale of dims 64g..64g+63
    +-------------------------------+-------------------+    pad byte = 0

A page (one row of ``cache``, uint8 ``[num_blocks, page_bytes]``) holds ``block_size``
tokens: all data rows of the block first, then all scale rows, then unused bytes up to
``page_bytes = cache.stride(0)`` (vLLM rounds it up to a multiple of 576):

    byte 0                      block_size*576               block_size*584     page_bytes
    | data[0] | data[1] | ... | data[bs-1] | sc[0] | sc[1] | ... | sc[bs-1] | (unused) |

Slot ``s`` lives in block ``b = s // block_size`` at position ``p = s % block_size``:
    data row  at ``b * page_bytes + p * DATA_BYTES``
    scale row at ``b * page_bytes + block_size * DATA_BYTES + p * SCALE_BYTES``
All of this is int64 arithmetic: ``b * page_bytes`` passes 2**31 near block 2065 of a real
cache (page_bytes 1 MiB: block 2048).

UE8M0 (per 64-dim group of NoPE dims): ``e = ceil(log2(max(amax, 1e-4) / 448))``, byte
``e + 127``, value ``2**(byte - 127)``; stored codes ``e4m3(clamp(x / 2**e, -448, 448))``.
For bf16 input, ``e`` lies in [UE8M0_MIN_EXP, 120], so bytes lie in [105, 247].

This is vLLM 0.33.0's record, byte for byte (see dsv4_ops/kv_cache.py for the line-by-line
comparison with ``quantize_and_insert_k_cache``).
"""

from __future__ import annotations

import torch

HEAD_DIM = 512  # latent K/V dims of one token
NOPE_DIM = 448  # dims 0..447: E4M3 with UE8M0 scales
ROPE_DIM = 64  # dims 448..511: bf16, stored raw
QUANT_GROUP = 64  # dims per UE8M0 scale
NUM_SCALES = NOPE_DIM // QUANT_GROUP  # 7
ROPE_BYTES = ROPE_DIM * 2  # 128
DATA_BYTES = NOPE_DIM + ROPE_BYTES  # 576: one data row
SCALE_BYTES = NUM_SCALES + 1  # 8: 7 scales + 1 zero pad byte
RECORD_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAD_BYTE = 0
PAGE_ALIGN = DATA_BYTES  # vLLM rounds a page up to a multiple of this

E4M3_MAX = 448.0
UE8M0_BIAS = 127
AMAX_FLOOR = 1e-4
# ceil(log2(1e-4 / 448)) = ceil(-22.09) = -22: the exponent of an all-zero (or tiny) group.
UE8M0_MIN_EXP = -22

assert NUM_SCALES * QUANT_GROUP == NOPE_DIM and NOPE_DIM + ROPE_DIM == HEAD_DIM


def min_page_bytes(block_size: int) -> int:
    """Smallest page that holds ``block_size`` records: ``block_size * 584``."""
    return int(block_size) * RECORD_BYTES


def vllm_page_bytes(block_size: int) -> int:
    """The page vLLM allocates: ``block_size * 584`` rounded up to a multiple of 576."""
    return -(-min_page_bytes(block_size) // PAGE_ALIGN) * PAGE_ALIGN


def page_bytes(cache: torch.Tensor) -> int:
    """Bytes from one block to the next: ``cache.stride(0)``."""
    return int(cache.stride(0))


def capacity(cache: torch.Tensor, block_size: int) -> int:
    """Number of slots: ``num_blocks * block_size``; valid slots are ``0 <= s < capacity``."""
    return int(cache.shape[0]) * int(block_size)


def data_offset(slot: int, block_size: int, page: int) -> int:
    """Byte offset (from the cache's first byte) of slot's 576-byte data row."""
    return (slot // block_size) * page + (slot % block_size) * DATA_BYTES


def scale_offset(slot: int, block_size: int, page: int) -> int:
    """Byte offset (from the cache's first byte) of slot's 8-byte scale row."""
    return (slot // block_size) * page + block_size * DATA_BYTES + (slot % block_size) * SCALE_BYTES


def check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if min_page_bytes(block_size) >= 2**31:
        raise ValueError(f"block_size: {block_size} * {RECORD_BYTES} bytes does not fit an int32 page offset")


def check_cache(cache, block_size) -> None:
    """ValueError unless ``cache`` is a uint8 ``[num_blocks, page_bytes]`` paged cache whose
    rows hold ``block_size`` records (``cache.shape[1] >= block_size * 584``), with
    contiguous bytes in a row (``stride(1) == 1``), rows that do not overlap, and an even
    page stride and start (the bf16 RoPE dims are read and written as 2-byte words)."""
    check_block_size(block_size)
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"cache: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise ValueError(f"cache: expected dtype uint8, got {str(cache.dtype).replace('torch.', '')}")
    if cache.dim() != 2:
        raise ValueError(f"cache: expected 2 dims [num_blocks, page_bytes], got shape {tuple(cache.shape)}")
    check_pages("cache", cache, block_size, RECORD_BYTES, 2, "must be even: RoPE dims are 2-byte bf16 values")


def check_pages(name: str, flat, block_size: int, record_bytes: int, align: int, why: str) -> None:
    """ValueError naming ``name`` unless the uint8 [num_blocks, page_bytes] view holds
    ``block_size`` records of ``record_bytes`` a page, pages contiguous and not overlapping,
    page stride and storage offset multiples of ``align`` (``why`` says what needs it)."""
    num_blocks, row_bytes = flat.shape
    if row_bytes > 1 and flat.stride(1) != 1:
        raise ValueError(f"{name}: expected stride(1) == 1 (bytes of a page contiguous), got strides {flat.stride()}")
    need = block_size * record_bytes
    if row_bytes < need:
        raise ValueError(f"{name}: pages of {row_bytes} bytes are too small for block_size {block_size} "
                         f"(need >= {block_size} * {record_bytes} = {need})")
    if num_blocks > 1 and flat.stride(0) < row_bytes:
        raise ValueError(f"{name}: rows overlap (stride(0) {flat.stride(0)} < {row_bytes} bytes a page)")
    if (num_blocks > 1 and flat.stride(0) % align) or flat.storage_offset() % align:
        raise ValueError(f"{name}: page_bytes (stride(0) {flat.stride(0)}) and the storage offset "
                         f"({flat.storage_offset()}) {why}")


# ---- indexer cache ----
# The sparse-attention indexer's paged K cache (vLLM 0.33.0, FP8 path below sm_100), one
# compressed token a row: 128 E4M3 bytes (dims 0..127) and one fp32 scale 2**e (4 bytes,
# little-endian), e = ceil(log2(max(amax, 1e-4) / 448)) over the row. A page (one row of
# ``cache``, uint8 ``[num_blocks, page_bytes]``; vLLM allocates ``[num_blocks, block_size,
# 132]`` with a possibly padded ``stride(0)``) holds ``block_size`` rows, data rows first:
#
#     byte 0                    block_size*128             block_size*132      page_bytes
#     | data[0] | ... | data[bs-1] | sc[0] | ... | sc[bs-1] | (unused) |
#
# Slot s: block b = s // block_size, position p = s % block_size; data at
# ``b * page_bytes + p * 128``, scale at ``b * page_bytes + block_size * 128 + p * 4``
# (int64 arithmetic). ``block_size`` counts compressed rows (V4: 256 tokens / ratio 4 = 64).
INDEXER_HEAD_DIM = 128  # dims of one indexer key / query head
INDEXER_DATA_BYTES = 128  # E4M3 bytes of one row
INDEXER_SCALE_BYTES = 4  # one fp32 scale
INDEXER_RECORD_BYTES = INDEXER_DATA_BYTES + INDEXER_SCALE_BYTES  # 132
INDEXER_ROPE_DIM = 64  # Q side: GPT-J RoPE on dims 64..127 (the last 64)
INDEXER_NOPE_DIM = INDEXER_HEAD_DIM - INDEXER_ROPE_DIM  # 64


def indexer_min_page_bytes(block_size: int) -> int:
    """Smallest indexer page holding ``block_size`` rows: ``block_size * 132``."""
    return int(block_size) * INDEXER_RECORD_BYTES


def indexer_data_offset(slot: int, block_size: int, page: int) -> int:
    """Byte offset of slot's 128 E4M3 bytes."""
    return (slot // block_size) * page + (slot % block_size) * INDEXER_DATA_BYTES


def indexer_scale_offset(slot: int, block_size: int, page: int) -> int:
    """Byte offset of slot's fp32 scale."""
    return (slot // block_size) * page + block_size * INDEXER_DATA_BYTES + (slot % block_size) * INDEXER_SCALE_BYTES


def indexer_cache_pages(cache, block_size=None, name: str = "cache"):
    """(2-D uint8 ``[num_blocks, page_bytes]`` view, block_size) of an indexer cache given as
    uint8 or float8 ``[num_blocks, page_bytes]`` (block_size required), ``[num_blocks,
    block_size, 132]`` or ``[num_blocks, block_size, 1, 132]`` (vLLM's views; block_size
    taken from shape[1], and must equal the one given if any). ValueError naming ``name``
    on anything else: wrong dtype, rows that overlap, non-contiguous page bytes, pages too
    small for block_size rows, a page stride or start that is not 4-byte aligned (scales
    are read as fp32)."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{name}: expected dtype uint8 (or float8_e4m3fn bytes), got {str(cache.dtype).replace('torch.', '')}")
    if cache.dtype != torch.uint8:
        cache = cache.view(torch.uint8)
    if cache.dim() in (3, 4):
        if cache.shape[-1] != INDEXER_RECORD_BYTES or (cache.dim() == 4 and cache.shape[2] != 1):
            raise ValueError(f"{name}: expected [num_blocks, block_size, 132] or [num_blocks, block_size, 1, 132], "
                             f"got shape {tuple(cache.shape)}")
        bs = int(cache.shape[1])
        if block_size is not None and int(block_size) != bs:
            raise ValueError(f"block_size: {block_size} does not match {name}.shape[1] = {bs}")
        if cache.shape[0] > 0 and bs > 0 and (cache.stride(-1) != 1 or (bs > 1 and cache.stride(1) != INDEXER_RECORD_BYTES)):
            raise ValueError(f"{name}: expected the {bs} rows of a page contiguous, got strides {cache.stride()}")
        flat = torch.as_strided(cache, (cache.shape[0], bs * INDEXER_RECORD_BYTES), (cache.stride(0), 1))
        block_size = bs
    elif cache.dim() == 2:
        if block_size is None or block_size == 0:
            if cache.shape[1] % INDEXER_RECORD_BYTES:
                raise ValueError(f"{name}: a 2-D cache of {cache.shape[1]}-byte pages needs block_size "
                                 f"(or pass it as [num_blocks, block_size, 132])")
            block_size = cache.shape[1] // INDEXER_RECORD_BYTES
        flat = cache
    else:
        raise ValueError(f"{name}: expected 2, 3 or 4 dims, got shape {tuple(cache.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    check_pages(name, flat, block_size, INDEXER_RECORD_BYTES, 4, "must be multiples of 4: scales are fp32")
    if indexer_min_page_bytes(block_size) >= 2**31:
        raise ValueError(f"block_size: {block_size} rows do not fit an int32 page offset")
    return flat, block_size


# ---- DeepSeek-V3.2 / GLM-5 MLA cache (vLLM 0.33.0 ``fp8_ds_mla`` at 656 bytes, and ``auto``) ----
# One token is one 656-byte record, laid out token by token (unlike V4's data-rows-then-
# scale-rows pages). vLLM allocates the cache as uint8 ``[num_blocks, block_size, 656]``
# (FlashMLA views it as ``[num_pages, 64, 1, 656]``); ``stride(0)`` may be padded
# (vLLM's ``block_stride_alignment``), a record is ``stride(1) == 656`` bytes:
#
#     byte 0                          512          528                              656
#     +-------------------------------+------------+--------------------------------+
#     | 512 x E4M3 NoPE codes         | 4 x fp32   | 64 x bf16 RoPE dims (raw),     |
#     | byte d = latent dim d         | scale of   | little-endian; dim 512 + r at  |
#     |                               | dims       | bytes 528 + 2r, 529 + 2r       |
#     |                               | 128g..+127 |                                |
#     +-------------------------------+------------+--------------------------------+
#
# Slot s (vLLM's slot_mapping: block_id * block_size + pos) lives at
#     ``(s // block_size) * stride(0) + (s % block_size) * 656``  (int64 arithmetic).
# FlashMLA's sparse indices use the same number when pages are 64-token views of an
# unpadded cache (``page * 64 + offset``).
#
# The writer (vLLM 0.33.0 ``concat_and_cache_mla(kv_c, k_pe, cache, slot_mapping,
# "fp8_ds_mla", scale)`` -> ``concat_and_cache_ds_mla_kernel``; facts read from the
# sm_90 SASS of the shipped ``_C_stable_libtorch.abi3.so``, and equal to FlashMLA's
# ``tests/quant.py`` V32_FP8Sparse quantizer), per 128-dim tile g of kv_c (bf16):
#     amax  = max |x| over the tile (fp32)
#     s     = max(amax / 448, 1e-4)                (IEEE fp32 division, fmaxf)
#     scale = 2 ** ceil(log2(s))                   (exp2f(ceilf(log2f(s)))): a power of two
#     store the fp32 scale at bytes 512 + 4g; codes e4m3(satfinite(x / scale)) (RNE,
#     saturating at +-448)
# For bf16 amax, ``amax / 448`` is never within 0.4% of a power of two unless exactly on
# one (nearest: amax = 1.7578 * 2**m, 225/224 of one), so ceil(log2f(.)) equals the exact ceil(log2(.)): e = max(E - 8 + (mant > 1.75),
# V32_MIN_EXP) with amax = mant * 2**E, i.e. V4's UE8M0 exponent with a floor of -13
# (ceil(log2(1e-4)) = -13) instead of -22. RoPE dims are copied raw. The ``scale``
# argument of concat_and_cache_mla is unused on this path. Slots < 0 are skipped.
# ``auto`` (and ``bfloat16``): bf16 ``[num_blocks, block_size, 576]``, a token's row is
# ``cat(kv_c[512], k_pe[64])``, a plain copy.
V32_NOPE_DIM = 512  # latent (kv_lora_rank) dims: E4M3, one fp32 scale per 128
V32_ROPE_DIM = 64  # RoPE dims: bf16, stored raw
V32_HEAD_DIM_QK = V32_NOPE_DIM + V32_ROPE_DIM  # 576: q and k width
V32_HEAD_DIM_V = V32_NOPE_DIM  # 512: v is the latent
V32_TILE = 128  # NoPE dims per fp32 scale
V32_NUM_TILES = V32_NOPE_DIM // V32_TILE  # 4
V32_SCALE_OFFSET = V32_NOPE_DIM  # 512: the 4 fp32 scales (16 bytes)
V32_ROPE_OFFSET = V32_SCALE_OFFSET + 4 * V32_NUM_TILES  # 528: the 64 bf16 RoPE dims
V32_RECORD_BYTES = V32_ROPE_OFFSET + 2 * V32_ROPE_DIM  # 656
V32_SCALE_FLOOR = 1e-4  # applied to amax / 448 (not to amax, as V4 does)
# ceil(log2(1e-4)) = ceil(-13.29) = -13: the exponent of an all-zero (or tiny) tile.
V32_MIN_EXP = -13
V32_KV_CACHE_DTYPES = ("fp8_ds_mla", "auto")  # the two records above (auto: bf16 rows of 576)

assert V32_RECORD_BYTES == 656 and V32_NUM_TILES * V32_TILE == V32_NOPE_DIM


def v32_record_offset(slot: int, block_size: int, block_stride: int, record_stride: int) -> int:
    """Byte (fp8_ds_mla) or element (auto) offset of slot's record from the cache's start."""
    return (slot // block_size) * block_stride + (slot % block_size) * record_stride


def v32_cache_pages(kv_cache, name: str = "kv_cache"):
    """(3-D view ``[num_blocks, block_size, D]``, format) of a V3.2 MLA cache.

    Accepts uint8 / float8_e4m3fn ``[num_blocks, block_size, 656]`` (format
    ``"fp8_ds_mla"``; returned as uint8) and bf16 ``[num_blocks, block_size, 576]``
    (``"auto"``), or either with a head dim of 1 (``[num_blocks, block_size, 1, D]``).
    The records of a block must be contiguous (stride(1) == D, stride(-1) == 1), blocks
    must not overlap, and fp8 block strides and starts must be 4-byte aligned (the scales
    are read as fp32). Anything else raises ValueError naming ``name``: a cache format
    that is not recognised is never guessed.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(kv_cache).__name__}")
    c = kv_cache
    if c.dim() == 4:
        if c.shape[2] != 1:
            raise ValueError(f"{name}: a 4-D cache must be [num_blocks, block_size, 1, D], got {tuple(c.shape)}")
        c = c.select(2, 0)
    if c.dim() != 3:
        raise ValueError(f"{name}: expected [num_blocks, block_size, 656] (fp8_ds_mla, uint8) or "
                         f"[num_blocks, block_size, 576] (auto, bfloat16), got shape {tuple(kv_cache.shape)}")
    if c.dtype in (torch.uint8, torch.float8_e4m3fn) and c.shape[-1] == V32_RECORD_BYTES:
        fmt, width, align = "fp8_ds_mla", V32_RECORD_BYTES, 4
        if c.dtype != torch.uint8:
            c = c.view(torch.uint8)
    elif c.dtype == torch.bfloat16 and c.shape[-1] == V32_HEAD_DIM_QK:
        fmt, width, align = "auto", V32_HEAD_DIM_QK, 1
    else:
        raise ValueError(f"{name}: not a V3.2 MLA cache: expected uint8 [..., 656] (fp8_ds_mla) or bfloat16 "
                         f"[..., 576] (auto), got {str(c.dtype).replace('torch.', '')} {tuple(kv_cache.shape)}")
    nb, bs = int(c.shape[0]), int(c.shape[1])
    if nb and bs:
        if c.stride(2) != 1 or (bs > 1 and c.stride(1) != width):
            raise ValueError(f"{name}: expected the records of a block contiguous (strides (*, {width}, 1)), "
                             f"got strides {tuple(c.stride())}")
        if nb > 1 and c.stride(0) < bs * width:
            raise ValueError(f"{name}: blocks overlap (stride(0) {c.stride(0)} < {bs} * {width})")
        if (nb > 1 and c.stride(0) % align) or c.storage_offset() % align:
            raise ValueError(f"{name}: block stride ({c.stride(0)}) and storage offset ({c.storage_offset()}) "
                             f"must be multiples of {align}: the fp32 scales are read as 4-byte words")
    return c, fmt
