"""dsv4_ampere::sparse_mla_split, merge_splits, sparse_mla_decode and dsv4_decode_indices.

CUDA runs the Triton launchers (dsv4_ops.attention, dsv4_ops.dsv4_decode); the CPU runs the
pure-PyTorch references; the fakes allocate exactly what the launchers allocate.
"""

import torch

from dsv4_ops import attention, dsv4_decode, reference
from .library import define_op

D = attention.HEAD_DIM


def _sparse_mla_split_fake(q, kv, indices, topk_length, sm_scale, num_splits):
    T, H = q.shape[0], q.shape[1]
    return (q.new_empty((T, H, num_splits, D), dtype=torch.float32),
            q.new_empty((T, H, num_splits), dtype=torch.float32))


def _sparse_mla_split_cpu(q, kv, indices, topk_length, sm_scale, num_splits):
    attention._check_splits(num_splits)
    return reference.ref_sparse_mla_split(q, kv, indices, topk_length, sm_scale, num_splits)


def _merge_splits_fake(o_part, lse_part, sink):
    T, H = o_part.shape[0], o_part.shape[1]
    return (o_part.new_empty((T, H, D), dtype=torch.bfloat16),
            o_part.new_empty((T, H), dtype=torch.float32))


def _merge_splits_cpu(o_part, lse_part, sink):
    out, lse = reference.ref_merge_splits(o_part, lse_part, sink)
    return out.contiguous(), lse.contiguous()


def _sparse_mla_decode_fake(q, kv, indices, topk_length, sink, sm_scale, num_splits=0):
    T, H = q.shape[0], q.shape[1]
    return (q.new_empty((T, H, D), dtype=torch.bfloat16), q.new_empty((T, H), dtype=torch.float32))


def _sparse_mla_decode_cpu(q, kv, indices, topk_length, sink, sm_scale, num_splits=0):
    out, lse = reference.ref_sparse_mla_decode(q, kv, indices, topk_length, sink, sm_scale)
    return out.contiguous(), lse.contiguous()


def _sparse_mla_decode_cuda(q, kv, indices, topk_length, sink, sm_scale, num_splits=0):
    return attention.sparse_mla_decode(q, kv, indices, topk_length, sink, sm_scale, num_splits)


def _dsv4_decode_indices_fake(topk_slots, topk_length, swa_slots, compressed_capacity, swa_capacity):
    return topk_slots.new_empty((topk_slots.shape[0], topk_slots.shape[1] + swa_slots.shape[1]), dtype=torch.int32)


def register() -> None:
    define_op("sparse_mla_split",
              "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, float sm_scale, int num_splits)"
              " -> (Tensor, Tensor)",
              cuda=attention.sparse_mla_split, cpu=_sparse_mla_split_cpu, fake=_sparse_mla_split_fake)
    define_op("merge_splits", "(Tensor o_part, Tensor lse_part, Tensor? sink) -> (Tensor, Tensor)",
              cuda=attention.merge_splits, cpu=_merge_splits_cpu, fake=_merge_splits_fake)
    define_op("sparse_mla_decode",
              "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? sink, float sm_scale,"
              " int num_splits=0) -> (Tensor, Tensor)",
              cuda=_sparse_mla_decode_cuda, cpu=_sparse_mla_decode_cpu, fake=_sparse_mla_decode_fake)
    define_op("dsv4_decode_indices",
              "(Tensor topk_slots, Tensor? topk_length, Tensor swa_slots, int compressed_capacity,"
              " int swa_capacity) -> Tensor",
              cuda=dsv4_decode.decode_indices, cpu=dsv4_decode.ref_decode_indices,
              fake=_dsv4_decode_indices_fake)
