"""Launchers of the paged fp8 KV-cache kernels (ops ``kv_cache_insert``, ``kv_cache_gather``,
``kv_cache_gather_into``).

Record layout: ``dsv4_ops.layout`` (584 bytes a token; a page holds its data rows, then its
scale rows). The reference (the oracle of every test) is ``reference.ref_kv_cache_insert`` /
``reference.ref_kv_cache_gather``.

Agreement with vLLM 0.33.0 (``vllm/models/deepseek_v4/common/ops/cache_utils.py``,
``quantize_and_insert_k_kernel`` L43-165 and its launcher ``quantize_and_insert_k_cache``
L168-230), which every sm_90 DeepSeek-V4 cache write of this record goes through:

- page stride: ``block_stride = k_cache.stride(0)`` (L198), as here (``page_bytes``);
  vLLM sizes pages as ``block_size * 584`` rounded up to a multiple of 576 (L183, L376-379).
- block and position: ``slot // cache_block_size``, ``slot % cache_block_size`` (L86-87);
  block offset in int64 (L94).
- data row at ``block * stride + pos * 576`` (L98, ``token_data_size = 448 + 2 * 64``, L210);
  the 448 E4M3 bytes first (L107, L146), the 64 bf16 RoPE values raw right after (L108,
  L161-165).
- scale row at ``block * stride + block_size * 576 + pos * 8`` (L102-104): 7 scale bytes
  (L152) and the pad byte 0 at index 7 (L155).
- scale: ``amax = max(|x|)`` over each 64-dim group (L123-124), ``max(amax, 1e-4)``
  (L125), ``exponent = ceil(log2(amax / 448))`` in fp32 (L129-131, ``fp8_max`` =
  ``torch.finfo(float8_e4m3fn).max``, L209), byte ``exponent + 127`` clamped to [0, 255]
  (L150-152). Here the same exponent is computed exactly with integer bit operations
  (``csrc_triton.kv_cache.ue8m0_exponent``). They agree for every bf16 amax: vLLM's
  fp32 path only matters where ``amax / 448`` is an exact power of two (amax = 1.75 *
  2**m); there ``div.full.f32`` (its ``/``, PTX checked with triton 3.6) returns 2**k or
  2**k * (1 - 2**-24) (MUFU.RCP of 448 is within 1 ulp), and libdevice ``log2f`` (its
  ``tl.log2``) is exact at powers of two and negative just below 1, so ``ceil`` gives k,
  the exact answer. Every other bf16 amax sits >= 6e-3 away from an integer log2. A GPU
  test (``test_gpu_exponent_matches_vllm_formula``) replays vLLM's fp32 formula on the
  device for all 32,639 positive finite bf16 amax values.
- codes: ``clamp(x / 2**exponent, -448, 448)`` cast to ``tl.float8e4nv`` (L135-143), i.e.
  the hardware's round-to-nearest-even, saturating cvt: here ``x * 2**-exponent`` (exact,
  like vLLM's division by a power of two), then ENCODE_NATIVE (the same cvt, sm_89+) or
  ENCODE_EXACT (integer RNE, bit-identical to it; the portable path of sm_80).
- differences, all on inputs vLLM never receives: vLLM skips only ``slot == -1`` (L83);
  here every slot outside ``[0, num_blocks * block_size)`` is skipped (no out-of-bounds
  write). NaN/inf inputs: unspecified scale and codes here (vLLM: undefined as well).
- duplicate valid slots in one insert: which token's record lands is unspecified (as in
  vLLM); bytes of two tokens may mix.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import layout
from ._checks import check_last_dim, check_tensor
from ._launch import fast
from .codec import encode_mode
from .csrc_triton import kv_cache as _k
from .dispatch import variant_for

SLOT_DTYPES = (torch.int64, torch.int32)
HEAD_DIM = layout.HEAD_DIM

_insert_kernel = fast(_k._kv_cache_insert_kernel)
_gather_kernel = fast(_k._kv_cache_gather_kernel)

# Caches whose layout passed layout.check_cache, by everything that check reads: the deep
# check runs once per (shape, strides, offset parity, block_size), not per call.
_CACHE_OK = set()


def check_cache(cache, block_size) -> None:
    """layout.check_cache, memoised on the layout key (ValueError naming the argument)."""
    if isinstance(cache, torch.Tensor):
        key = (cache.shape, cache.stride(), cache.storage_offset() & 1, cache.dtype, block_size)
        if key in _CACHE_OK:
            return
        layout.check_cache(cache, block_size)
        _CACHE_OK.add(key)
        return
    layout.check_cache(cache, block_size)


def check_insert_args(kv, cache, slot_mapping, block_size) -> None:
    """ValueError naming the bad argument of kv_cache_insert."""
    check_cache(cache, block_size)
    check_tensor("kv", kv, dtypes=(torch.bfloat16,), ndim=2, device=cache.device, device_of="cache")
    check_last_dim("kv", kv, layout.HEAD_DIM)
    if kv.stride(1) != 1:
        raise ValueError(f"kv: expected contiguous dims (stride(1) == 1), got strides {kv.stride()}")
    check_tensor("slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=cache.device, device_of="cache")
    if slot_mapping.shape[0] > kv.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for only {kv.shape[0]} kv rows")


def check_gather_args(cache, slots, block_size) -> None:
    """ValueError naming the bad argument of kv_cache_gather."""
    check_cache(cache, block_size)
    check_tensor("slots", slots, dtypes=SLOT_DTYPES, device=cache.device, device_of="cache")


def check_out(out, cache, n: int, row_offset) -> None:
    """ValueError unless out is a contiguous bf16 [R, 512] on cache's device holding rows
    row_offset .. row_offset + n - 1."""
    check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=2, device=cache.device, device_of="cache", contiguous=True)
    check_last_dim("out", out, layout.HEAD_DIM)
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or row_offset < 0:
        raise ValueError(f"row_offset: expected an int >= 0, got {row_offset!r}")
    if row_offset + n > out.shape[0]:
        raise ValueError(f"out: rows {row_offset}..{row_offset + n - 1} do not fit {out.shape[0]} rows")


def kv_cache_insert(kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                    variant: Optional[str] = None) -> None:
    """Quantize kv rows into their 584-byte records in the paged cache, in place.

    kv: bf16 [N, 512] (rows may be strided, dims contiguous). cache: uint8 [num_blocks,
    page_bytes], page_bytes = cache.stride(0) >= block_size * 584. slot_mapping: int64 (or
    int32) [M], M <= N: token i goes to slot slot_mapping[i] (vLLM's convention: M counts
    the tokens, kv may hold padding rows). A slot < 0 (or >= num_blocks * block_size) is
    skipped. variant: 'portable' / 'native'; None picks from the op table.
    Never syncs the host: CUDA-graph capturable.
    """
    check_insert_args(kv, cache, slot_mapping, block_size)
    n = slot_mapping.shape[0]
    if n == 0 or cache.shape[0] == 0:
        return
    variant = variant or variant_for(cache)
    slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
    cfg = _k.INSERT_CONFIG
    _insert_kernel(
        (-(-n // cfg["TOKENS"]),),
        (kv, cache, slots, n, kv.stride(0), cache.stride(0), block_size, cache.shape[0] * block_size),
        (encode_mode(True, variant), cfg["TOKENS"]),
        cfg["num_warps"])


def _launch_gather(cache, flat_slots, block_size, target, variant) -> None:
    n = flat_slots.numel()
    if n == 0:
        return
    variant = variant or variant_for(cache)
    cfg = _k.GATHER_CONFIG
    _gather_kernel(
        (-(-n // cfg["ROWS"]),),
        (cache, flat_slots, target, n, target.stride(0), cache.stride(0), block_size, cache.shape[0] * block_size),
        (variant == "native", cfg["ROWS"]),
        cfg["num_warps"])


def kv_cache_gather(cache: torch.Tensor, slots: torch.Tensor, block_size: int,
                    out: Optional[torch.Tensor] = None, row_offset: int = 0,
                    variant: Optional[str] = None) -> torch.Tensor:
    """Gather and dequantize the records of arbitrary slots.

    cache: uint8 [num_blocks, page_bytes] (see kv_cache_insert). slots: int32/int64, any
    shape, any order, repeats allowed. Returns bf16 slots.shape + (512,): row = the 448
    dequantized NoPE dims (e4m3 * 2**(scale - 127), exact in bf16) then the 64 raw RoPE
    dims; an invalid slot (< 0 or >= num_blocks * block_size) gives a zero row and is
    never read.
    out: bf16 [R, 512], contiguous: the rows go to out[row_offset : row_offset + n]
    (slots flattened in C order) and that view, shaped slots.shape + (512,), is returned;
    ValueError if they do not fit. Lets a decode step gather top-k rows and window rows
    into one workspace without a copy. Never syncs the host: CUDA-graph capturable.
    """
    check_gather_args(cache, slots, block_size)
    flat = slots.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    n = flat.numel()
    if out is None:
        res = torch.empty(tuple(slots.shape) + (HEAD_DIM,), dtype=torch.bfloat16, device=cache.device)
        _launch_gather(cache, flat, block_size, res.view(n, HEAD_DIM), variant)
        return res
    check_out(out, cache, n, row_offset)
    target = out if row_offset == 0 and n == out.shape[0] else out.narrow(0, row_offset, n)
    _launch_gather(cache, flat, block_size, target, variant)
    return target.view(tuple(slots.shape) + (HEAD_DIM,))


def aot_specs():
    """Every KV-cache kernel specialization a launcher can pick (see dsv4_ops.aot)."""
    from .aot import KernelSpec

    ins, gat = _k.INSERT_CONFIG, _k.GATHER_CONFIG
    specs = []
    for variant in ("portable", "native"):
        for slot_ty in ("i64", "i32"):
            specs.append(KernelSpec(
                "kv_cache_insert", f"insert[{variant},{slot_ty}]", _k._kv_cache_insert_kernel,
                {"kv_ptr": "*bf16", "cache_ptr": "*u8", "slot_ptr": f"*{slot_ty}", "n_tokens": "i32",
                 "stride_kv_0": "i32", "page_bytes": "i32", "block_size": "i32", "capacity": "i64",
                 "MODE": "constexpr", "TOKENS": "constexpr"},
                {"MODE": encode_mode(True, variant), "TOKENS": ins["TOKENS"]}, variant,
                num_warps=ins["num_warps"]))
            specs.append(KernelSpec(
                "kv_cache_gather", f"gather[{variant},{slot_ty}]", _k._kv_cache_gather_kernel,
                {"cache_ptr": "*u8", "slot_ptr": f"*{slot_ty}", "out_ptr": "*bf16", "n": "i32",
                 "stride_out_0": "i32", "page_bytes": "i32", "block_size": "i32", "capacity": "i64",
                 "NATIVE": "constexpr", "ROWS": "constexpr"},
                {"NATIVE": variant == "native", "ROWS": gat["ROWS"]}, variant,
                num_warps=gat["num_warps"]))
    return specs
