"""sm_8x writers of the compressed 512-d KV cache (584-byte ``fp8_ds_mla`` records).

vLLM 0.33.0 writes this cache with kernels that cannot run on sm_80:
- V4: ``DeepseekCompressor._compress_norm_rope_store`` calls the CuTeDSL
  ``_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL`` for head_dim 512 on every CUDA GPU
  (``cvt.rn.satfinite.e4m3x2.f32``: sm_89+ PTX). Its Triton twin
  ``_fused_kv_compress_norm_rope_insert_sparse_attn`` (``fused_compress_quant_cache.py``,
  L151-346) uses ``tl.float8e4nv`` (sm_89+ in Triton 3.8).
- V4.1: ``DeepseekV41Compressor.insert_cache`` calls Triton ``rope_quant_insert`` ->
  ``_rope_quant_insert_kernel`` (``tl.float8e4nv``).

The functions here reproduce the math of those kernels in static-shape torch (no host
sync: the compressor runs inside CUDA-graph-captured regions under the v2 model runner)
and write the records with ``torch.ops.dsv4_ampere.kv_cache_insert``, the byte-exact
portable encoder of the same record (dsv4_ops.layout).

Per written token t (a "boundary" token: ``(position + 1) % ratio == 0``, its state slot
and its cache slot both >= 0), following the Triton kernel line by line:
  window  = positions p - W + 1 .. p, W = (1 + overlap) * ratio; entries before 0 masked
  kv, sc  = state rows of the window; entry j reads dims [j >= ratio] * 512 + 0..511 of the
            kv half and of the score half (``state_width`` columns further)
  c       = sum_j softmax_j(sc) * kv                                   fp32 [512]
  normed  = c * rsqrt(mean(c^2) + eps) * w                             fp32 [512]
  record  = NoPE dims 0..447: bf16(normed) quantized (UE8M0, E4M3);
            RoPE dims 448..511: bf16(GPT-J RoPE of normed at (p // ratio) * ratio)
The kv_cache_insert quantizes from the bf16 row, which is exactly the Triton kernel's
``normed.to(bf16).to(fp32)`` quantization input.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import layout
from .o_proj import gptj_rotate_tail
from .table import V4, V41, Patch

# Rows of [W, 512] fp32 state gathered at once (x2 for kv and score): bounds the
# temporary memory of a long prefill (16 MiB a buffer), independent of W.
_STATE_ROWS_PER_CHUNK = 8192


def as_paged_2d(cache: torch.Tensor, what: str = "kv_cache") -> torch.Tensor:
    """uint8 [num_blocks, block_size, 584] (vLLM's view) -> [num_blocks, block_size * 584]
    with the same page stride (``stride(0)``); a 2-D cache is returned as is.

    NotImplementedError for the V4.1 MXFP8 (528 B) / NVFP4 (288 B) records: vLLM selects
    them only on sm_100 (``_use_v41_mxfp8_kv_record``), so an sm_8x run never sees them.
    """
    if cache.dtype != torch.uint8:
        raise NotImplementedError(
            f"dsv4_ops: {what} has dtype {cache.dtype}; the sm_8x path supports only the fp8_ds_mla "
            "uint8 cache (plain bf16 / per-tensor fp8 rows are FlashInfer's layouts)")
    if cache.dim() == 2:
        return cache
    if cache.dim() != 3 or cache.shape[-1] != layout.RECORD_BYTES:
        raise NotImplementedError(
            f"dsv4_ops: {what} of shape {tuple(cache.shape)}: the sm_8x path reads only the "
            f"{layout.RECORD_BYTES}-byte fp8_ds_mla record")
    return cache.view(cache.shape[0], cache.shape[1] * cache.shape[2])


def _rope_rows(normed: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               compress_ratio: int) -> torch.Tensor:
    """bf16 [N, 512] cache rows from fp32 normed latents: NoPE as is, RoPE dims rotated at
    the group's first position ``(p // ratio) * ratio``."""
    cpos = torch.div(positions, compress_ratio, rounding_mode="floor") * compress_ratio
    cs = cos_sin_cache[cpos.clamp(min=0)].to(torch.float32)  # [N, 64]
    return gptj_rotate_tail(normed, cs, inverse=False).to(torch.bfloat16)


def _boundary_slots(kv_slots: torch.Tensor, positions: torch.Tensor, compress_ratio: int,
                    state_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [N]: the cache slot of each boundary token, -1 for every other token."""
    ok = (kv_slots >= 0) & (torch.remainder(positions + 1, compress_ratio) == 0)
    if state_slots is not None:
        ok = ok & (state_slots >= 0)
    return torch.where(ok, kv_slots.to(torch.int64), torch.full_like(kv_slots, -1, dtype=torch.int64))


def _compress_chunk(state_cache, block_table, req, pos, block_size, state_width, head_dim,
                    compress_ratio, overlap, weight, eps) -> torch.Tensor:
    """fp32 [n, head_dim] RMS-normed softmax-pooled latents of n tokens (see module doc)."""
    W = (1 + int(overlap)) * compress_ratio
    tok = torch.arange(W, device=pos.device)
    p = pos[:, None] - W + 1 + tok[None, :]  # [n, W]
    valid = p >= 0
    pc = p.clamp(min=0)
    bidx = torch.div(pc, block_size, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
    blocks = block_table[req[:, None].to(torch.int64), bidx].to(torch.int64)
    blocks = torch.where(valid, blocks, torch.zeros_like(blocks)).clamp(0, state_cache.shape[0] - 1)
    offs = torch.remainder(pc, block_size)
    cols = ((tok >= compress_ratio).to(torch.int64) * head_dim)[:, None] + torch.arange(
        head_dim, device=pos.device)[None, :]  # [W, head_dim]
    b3, o3, c3 = blocks[:, :, None], offs[:, :, None], cols[None, :, :]
    kv = state_cache[b3, o3, c3].to(torch.float32)  # [n, W, head_dim]
    score = state_cache[b3, o3, c3 + state_width].to(torch.float32)
    score = score.masked_fill(~valid[:, :, None], float("-inf"))
    kv = kv.masked_fill(~valid[:, :, None], 0.0)
    pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1)  # [n, 512]
    rrms = torch.rsqrt(pooled.pow(2).mean(dim=-1, keepdim=True) + eps)
    return pooled * rrms * weight.to(torch.float32)


def compress_norm_rope_store_ampere(
    state_cache: torch.Tensor,
    num_actual: int,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    state_width: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    k_cache_metadata: Any,
    pdl_kwargs: dict,
    head_dim: int,
    rope_head_dim: int,
    compress_ratio: int,
    overlap: bool,
    use_fp4_cache: bool,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    quant_block: int,
    token_stride: int,
    scale_dim: int,
    store_full_kv: bool = False,
    store_full_fp8: bool = False,
    fp8_scale: Optional[torch.Tensor] = None,
) -> None:
    """Drop-in for vLLM's ``_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL(...)`` (same keywords).

    state_cache fp32 [num_state_blocks, block_size, 2 * state_width] (kv half, then score
    half); positions int64 [>= num_actual]; slot_mapping / token_to_req_indices int
    [num_actual] (state slots, request of each token); block_table int [reqs, blocks] of
    the state cache; kv_cache uint8 [num_blocks, tokens_per_block, 584];
    ``k_cache_metadata.slot_mapping`` int [num_actual]: the compressed-cache slot of each
    token. Writes the 584-byte records of the boundary tokens in place.
    """
    del pdl_kwargs, quant_block, token_stride, scale_dim, fp8_scale
    if store_full_kv or store_full_fp8:
        raise NotImplementedError("dsv4_ops: plain-row compressed caches (store_full_kv, FlashInfer's layout) "
                                  "are not implemented on sm_8x; use the fp8_ds_mla cache")
    if head_dim != layout.HEAD_DIM or rope_head_dim != layout.ROPE_DIM or use_fp4_cache:
        raise NotImplementedError(f"dsv4_ops: compressed cache writer supports head_dim 512 / rope 64 / fp8, got "
                                  f"head_dim={head_dim}, rope_head_dim={rope_head_dim}, fp4={use_fp4_cache}")
    if kv_cache.dim() != 3:
        raise ValueError("compressed kv_cache: expected vLLM's 3-D [num_blocks, tokens_per_block, 584] view")
    cache2d = as_paged_2d(kv_cache, "compressed kv_cache")

    def store(rows, slots):
        torch.ops.dsv4_ampere.kv_cache_insert(rows, cache2d, slots, kv_cache.shape[1])

    _compress_norm_rope(store, state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                        block_size, state_width, cos_sin_cache, k_cache_metadata, head_dim, compress_ratio, overlap,
                        rms_norm_weight, rms_norm_eps)


def _compress_norm_rope(store, state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                        block_size, state_width, cos_sin_cache, k_cache_metadata, head_dim, compress_ratio, overlap,
                        rms_norm_weight, rms_norm_eps) -> None:
    """Compress, RMS-norm and rotate the boundary tokens in chunks of state rows, then
    ``store(bf16 rows [n, head_dim], int64 slots [n])`` (-1: not a boundary token)."""
    n = int(num_actual)
    if n == 0 or positions.numel() == 0:
        return
    pos = positions[:n].to(torch.int64)
    slots = _boundary_slots(k_cache_metadata.slot_mapping[:n], pos, compress_ratio, slot_mapping[:n])
    W = (1 + int(overlap)) * compress_ratio
    chunk = max(1, _STATE_ROWS_PER_CHUNK // W)
    for start in range(0, n, chunk):  # static: n and W come from shapes and config
        end = min(n, start + chunk)
        normed = _compress_chunk(state_cache, block_table, token_to_req_indices[start:end], pos[start:end],
                                 block_size, state_width, head_dim, compress_ratio, overlap,
                                 rms_norm_weight, rms_norm_eps)
        store(_rope_rows(normed, pos[start:end], cos_sin_cache, compress_ratio), slots[start:end].contiguous())


def compress_norm_rope_store_indexer_ampere(
    state_cache: torch.Tensor,
    num_actual: int,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    state_width: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    k_cache_metadata: Any,
    pdl_kwargs: dict,
    head_dim: int,
    rope_head_dim: int,
    compress_ratio: int,
    overlap: bool,
    use_fp4_cache: bool,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    quant_block: int,
    token_stride: int,
    scale_dim: int,
) -> None:
    """Drop-in for V4's ``compress_norm_rope_store_triton`` on CUDA, where it only serves the
    indexer compressor (head 128; head 512 goes to the CuTeDSL kernel): the same compress,
    RMS norm and GPT-J RoPE of the last 64 dims as the head-512 writer, rounded to bf16,
    then ``indexer_k_insert`` (fp32 power-of-two scale, RNE E4M3) into kv_cache uint8
    [num_blocks, tokens_per_block, 132]. Replaces ``_fused_kv_compress_norm_rope_insert_indexer_attn``
    (``tl.float8e4nv``, sm_89+)."""
    del pdl_kwargs, quant_block, token_stride, scale_dim
    if use_fp4_cache:
        raise NotImplementedError("dsv4_ops: the MXFP4 indexer cache is sm_100-only; sm_8x stores fp8")
    if head_dim != 128 or rope_head_dim != layout.ROPE_DIM:
        raise NotImplementedError(f"dsv4_ops: the sm_8x compressor writer for the indexer cache takes head_dim 128 "
                                  f"/ rope 64 (head 512 is compress_norm_rope_store_ampere), got {head_dim}/"
                                  f"{rope_head_dim}")

    def store(rows, slots):
        torch.ops.dsv4_ampere.indexer_k_insert(rows, kv_cache, slots, kv_cache.shape[1])

    _compress_norm_rope(store, state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                        block_size, state_width, cos_sin_cache, k_cache_metadata, head_dim, compress_ratio, overlap,
                        rms_norm_weight, rms_norm_eps)


def rope_quant_insert_ampere(
    latent: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
    fp8_scale: Optional[torch.Tensor] = None,
) -> None:
    """Drop-in for V4.1's ``rope_quant_insert`` on the 584-byte record (same arguments).

    latent bf16 [>= N, 512] (already RMS-normed by ``fused_save_compress_norm``);
    positions int64 [>= N]; kv_cache uint8 [num_blocks, tokens_per_block, 584];
    slot_mapping int [N]. Boundary tokens get ``NoPE = latent[:448]`` quantized and
    ``RoPE = rotate(latent[448:])`` at ``(p // ratio) * ratio`` (``_rope_quant_insert_kernel``,
    L376-423).
    """
    del fp8_scale
    n = slot_mapping.numel()
    if n == 0:
        return
    cache2d = as_paged_2d(kv_cache, "compressed kv_cache")
    pos = positions[:n].to(torch.int64)
    rows = _rope_rows(latent[:n].to(torch.float32), pos, cos_sin_cache, compress_ratio)
    slots = _boundary_slots(slot_mapping.reshape(-1), pos, compress_ratio)
    torch.ops.dsv4_ampere.kv_cache_insert(rows, cache2d, slots, kv_cache.shape[1])


_COMPRESSOR_PARAMS = ("state_cache", "num_actual", "token_to_req_indices", "positions", "slot_mapping", "block_table",
                      "block_size", "state_width", "cos_sin_cache", "kv_cache", "k_cache_metadata", "pdl_kwargs",
                      "head_dim", "rope_head_dim", "compress_ratio", "overlap", "use_fp4_cache", "rms_norm_weight",
                      "rms_norm_eps", "quant_block", "token_stride", "scale_dim", "store_full_kv", "store_full_fp8",
                      "fp8_scale")

PATCHES = (
    Patch(f"{V4}.nvidia.ops.sparse_attn_compress_cutedsl", "_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL",
          _COMPRESSOR_PARAMS,
          "compressed 512-d cache writer: CuTeDSL (cvt.rn.satfinite.e4m3x2.f32, sm_89+) on every CUDA GPU",
          compress_norm_rope_store_ampere, model="v4"),
    Patch(f"{V4}.compressor", "compress_norm_rope_store_triton", _COMPRESSOR_PARAMS[:-3],
          "V4 indexer compressor (head 128): _fused_kv_compress_norm_rope_insert_indexer_attn uses tl.float8e4nv "
          "(sm_89+); the compressor module binds this launcher by name", compress_norm_rope_store_indexer_ampere,
          model="v4"),
    Patch(f"{V41}.compressor", "rope_quant_insert",
          ("latent", "positions", "cos_sin_cache", "kv_cache", "slot_mapping", "compress_ratio", "fp8_scale"),
          "V4.1 compressed cache writer: Triton tl.float8e4nv (sm_89+)", rope_quant_insert_ampere, model="v41"),
)
