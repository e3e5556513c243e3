"""dsv4_ampere::kv_cache_insert, dsv4_ampere::kv_cache_gather, dsv4_ampere::kv_cache_gather_into."""

import torch

from dsv4_ops import kv_cache, layout, reference
from .library import OpDef


def _kv_cache_insert_cuda(kv, cache, slot_mapping, block_size):
    kv_cache.kv_cache_insert(kv, cache, slot_mapping, block_size)


def _kv_cache_insert_cpu(kv, cache, slot_mapping, block_size):
    kv_cache.check_insert_args(kv, cache, slot_mapping, block_size)
    reference.ref_kv_cache_insert(kv, cache, slot_mapping, block_size)


def _kv_cache_insert_fake(kv, cache, slot_mapping, block_size):
    return None


def _kv_cache_gather_cuda(cache, slots, block_size):
    return kv_cache.kv_cache_gather(cache, slots, block_size)


def _kv_cache_gather_cpu(cache, slots, block_size):
    kv_cache.check_gather_args(cache, slots, block_size)
    return reference.ref_kv_cache_gather(cache, slots, block_size)


def _kv_cache_gather_fake(cache, slots, block_size):
    return torch.empty(tuple(slots.shape) + (layout.HEAD_DIM,), dtype=torch.bfloat16, device=cache.device)


def _kv_cache_gather_into_cuda(cache, slots, block_size, out, row_offset):
    kv_cache.kv_cache_gather(cache, slots, block_size, out=out, row_offset=row_offset)


def _kv_cache_gather_into_cpu(cache, slots, block_size, out, row_offset):
    kv_cache.check_gather_args(cache, slots, block_size)
    kv_cache.check_out(out, cache, slots.numel(), row_offset)
    rows = reference.ref_kv_cache_gather(cache, slots, block_size).reshape(-1, layout.HEAD_DIM)
    out[row_offset:row_offset + rows.shape[0]] = rows


def _kv_cache_gather_into_fake(cache, slots, block_size, out, row_offset):
    return None


OPS = (
    OpDef("kv_cache_insert", "(Tensor kv, Tensor(a!) cache, Tensor slot_mapping, int block_size) -> ()",
          cuda=_kv_cache_insert_cuda, cpu=_kv_cache_insert_cpu, fake=_kv_cache_insert_fake),
    OpDef("kv_cache_gather", "(Tensor cache, Tensor slots, int block_size) -> Tensor",
          cuda=_kv_cache_gather_cuda, cpu=_kv_cache_gather_cpu, fake=_kv_cache_gather_fake),
    OpDef("kv_cache_gather_into",
          "(Tensor cache, Tensor slots, int block_size, Tensor(a!) out, int row_offset) -> ()",
          cuda=_kv_cache_gather_into_cuda, cpu=_kv_cache_gather_into_cpu, fake=_kv_cache_gather_into_fake),
)
