"""DeepSeek-V4 decode attention in one call: gather the top-k compressed slots and the
sliding-window slots from their two fp8_ds_mla caches into one bf16 workspace, then run
split-KV sparse MLA with the sink.

Workspace layout (bf16 [R >= T*(K1+K2), 512], rows):
  [0, T*K1)              compressed top-k rows, token-major (row t*K1 + j = topk_slots[t, j])
  [T*K1, T*(K1+K2))      window rows, token-major (row T*K1 + t*K2 + j = swa_slots[t, j])
indices[t] = concat(t*K1 + j, T*K1 + t*K2 + j), with -1 where the slot is invalid (< 0 or
>= num_blocks * block_size of its cache, where the gather wrote a zero row that must not be
attended) or, for the top-k part, j >= topk_length[t].

Everything here calls ``torch.ops.dsv4_ampere.*`` on static shapes: no host sync, so the
composite captures into a CUDA graph and traces under ``torch.compile(fullgraph=True)``.
Five kernels a step: two gathers, the index build, split, merge.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import check_tensor
from .csrc_triton import sparse_mla as _sk

SLOT_DTYPES = (torch.int32, torch.int64)


def _check_slots(name: str, slots: torch.Tensor, T: Optional[int] = None) -> None:
    check_tensor(name, slots, dtypes=SLOT_DTYPES, ndim=2)
    if T is not None and slots.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows (one per token), got shape {tuple(slots.shape)}")


def ref_decode_indices(topk_slots: torch.Tensor, topk_length: Optional[torch.Tensor], swa_slots: torch.Tensor,
                       compressed_capacity: int, swa_capacity: int) -> torch.Tensor:
    """Pure-PyTorch index build (the CPU implementation): int32 [T, K1 + K2]."""
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]
    dev = topk_slots.device
    t = torch.arange(T, device=dev, dtype=torch.int64)[:, None]
    j1 = torch.arange(K1, device=dev, dtype=torch.int64)[None, :]
    j2 = torch.arange(K2, device=dev, dtype=torch.int64)[None, :]
    sc, sw = topk_slots.to(torch.int64), swa_slots.to(torch.int64)
    ok_c = (sc >= 0) & (sc < compressed_capacity)
    if topk_length is not None:
        ok_c = ok_c & (j1 < topk_length.to(torch.int64)[:, None])
    ok_w = (sw >= 0) & (sw < swa_capacity)
    idx_c = torch.where(ok_c, t * K1 + j1, -1)
    idx_w = torch.where(ok_w, T * K1 + t * K2 + j2, -1)
    return torch.cat([idx_c, idx_w], dim=1).to(torch.int32).contiguous()


def decode_indices(topk_slots: torch.Tensor, topk_length: Optional[torch.Tensor], swa_slots: torch.Tensor,
                   compressed_capacity: int, swa_capacity: int, impl: Optional[str] = None) -> torch.Tensor:
    """Workspace indices int32 [T, K1 + K2] (layout in the module doc); one kernel on CUDA.

    topk_slots int32/int64 [T, K1]; swa_slots int32/int64 [T, K2]; topk_length int [T] or None;
    capacities = num_blocks * block_size of each cache. impl: 'kernel' (default on CUDA; on
    CPU tensors it needs the Triton interpreter) or 'reference' (default elsewhere).
    """
    _check_slots("topk_slots", topk_slots)
    T, K1 = topk_slots.shape
    _check_slots("swa_slots", swa_slots, T)
    K2 = swa_slots.shape[1]
    if swa_slots.device != topk_slots.device:
        raise ValueError(f"swa_slots: expected a tensor on {topk_slots.device}, got {swa_slots.device}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=SLOT_DTYPES, ndim=1, device=topk_slots.device)
        if topk_length.shape[0] != T:
            raise ValueError(f"topk_length: expected shape ({T},), got {tuple(topk_length.shape)}")
    if impl is None:
        impl = "kernel" if topk_slots.device.type == "cuda" else "reference"
    if impl not in ("kernel", "reference"):
        raise ValueError(f"impl: expected 'kernel' or 'reference', got {impl!r}")
    if impl == "reference":
        return ref_decode_indices(topk_slots, topk_length, swa_slots, compressed_capacity, swa_capacity)
    if topk_length is not None:
        topk_length = topk_length.clamp(max=K1).to(torch.int32).contiguous()
    topk_slots = topk_slots if topk_slots.stride(-1) == 1 else topk_slots.contiguous()
    swa_slots = swa_slots if swa_slots.stride(-1) == 1 else swa_slots.contiguous()
    indices = torch.empty((T, K1 + K2), dtype=torch.int32, device=topk_slots.device)
    cfg = _sk.INDICES_CONFIG
    if T and K1 + K2:
        grid = (T, -(-(K1 + K2) // cfg["BLOCK"]))
        _sk._dsv4_decode_indices_kernel[grid](
            topk_slots, topk_length, swa_slots, indices, T, K1, K2,
            int(compressed_capacity), int(swa_capacity), topk_slots.stride(0), swa_slots.stride(0),
            BLOCK=cfg["BLOCK"], HAS_TOPK_LENGTH=topk_length is not None, num_warps=cfg["num_warps"])
    return indices


def _capacity(name: str, cache: torch.Tensor, block_size: int) -> int:
    check_tensor(name, cache, dtypes=(torch.uint8,), ndim=2)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{name}_block_size: expected a positive int, got {block_size!r}")
    return cache.shape[0] * block_size


def dsv4_decode_attention(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                          swa_cache: torch.Tensor, swa_slots: torch.Tensor, sink: Optional[torch.Tensor],
                          sm_scale: float, compressed_block_size: int, swa_block_size: int,
                          topk_length: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                          num_splits: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """One DSv4 decode attention step.

    q bf16 [T, H, 512]; compressed_cache, swa_cache uint8 [num_blocks, page_bytes] (584-byte
    fp8_ds_mla records, see dsv4_ops.layout); topk_slots int [T, K1] slots of the compressed
    cache (-1: none); swa_slots int [T, K2] slots of the window cache (-1: none); sink float
    [H] or None; topk_length int [T] or None (top-k entries j >= topk_length[t] are ignored);
    workspace bf16 [>= T*(K1+K2), 512] contiguous or None (allocated); num_splits 0 = heuristic.
    Returns out bf16 [T, H, 512], lse fp32 [T, H].
    """
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndim=3)
    T = q.shape[0]
    _check_slots("topk_slots", topk_slots, T)
    _check_slots("swa_slots", swa_slots, T)
    cap_c = _capacity("compressed_cache", compressed_cache, compressed_block_size)
    cap_w = _capacity("swa_cache", swa_cache, swa_block_size)
    K1, K2 = topk_slots.shape[1], swa_slots.shape[1]
    rows = T * (K1 + K2)
    if workspace is None:
        workspace = torch.empty((rows, q.shape[2]), dtype=torch.bfloat16, device=q.device)
    else:
        check_tensor("workspace", workspace, dtypes=(torch.bfloat16,), ndim=2, device=q.device, contiguous=True)
        if workspace.shape[0] < rows or workspace.shape[1] != q.shape[2]:
            raise ValueError(f"workspace: expected at least ({rows}, {q.shape[2]}), got {tuple(workspace.shape)}")
    ops = torch.ops.dsv4_ampere
    if T * K1:
        ops.kv_cache_gather_into(compressed_cache, topk_slots, compressed_block_size, workspace, 0)
    if T * K2:
        ops.kv_cache_gather_into(swa_cache, swa_slots, swa_block_size, workspace, T * K1)
    indices = ops.dsv4_decode_indices(topk_slots, topk_length, swa_slots, cap_c, cap_w)
    return ops.sparse_mla_decode(q, workspace, indices, None, sink, sm_scale, num_splits)
