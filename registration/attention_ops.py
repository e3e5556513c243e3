"""dsv4_ampere::sparse_mla_split, merge_splits, sparse_mla_decode, dsv4_decode_indices, and the
out= forms merge_splits_out and sparse_mla_decode_out (write a caller's buffer, return lse),
and dsv4_decode_gather (both decode gathers + the index build, one launch), and
dsv4_decode_fused_out (the whole decode step read straight from the paged caches).

CUDA runs the Triton launchers (dsv4_ops.attention; dsv4_ops.paged_decode for the fused op) through recorded launch plans
(dsv4_ops._host_plan.planned: the launcher's checks and plan run once per input layout, later
calls with the same layout re-allocate and re-launch what it launched); the CPU runs the
pure-PyTorch references; the fakes allocate exactly what the launchers allocate.
"""

import torch

from dsv4_ops import attention, paged_decode, reference
from dsv4_ops._host_plan import planned
from .library import OpDef

D = attention.HEAD_DIM


def _sparse_mla_split_fake(q, kv, indices, topk_length, sm_scale, num_splits):
    T, H = q.shape[0], q.shape[1]
    return (q.new_empty((T, H, num_splits, D), dtype=torch.float32),
            q.new_empty((T, H, num_splits), dtype=torch.float32))


def _sparse_mla_split_cpu(q, kv, indices, topk_length, sm_scale, num_splits):
    attention.check_splits(num_splits)
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


def _dsv4_decode_indices_cpu(topk_slots, topk_length, swa_slots, compressed_capacity, swa_capacity):
    attention.check_decode_indices_args(topk_slots, topk_length, swa_slots)
    return reference.ref_decode_indices(topk_slots, topk_length, swa_slots, compressed_capacity, swa_capacity)


def _merge_splits_out_cuda(o_part, lse_part, sink, out):
    return attention.merge_splits(o_part, lse_part, sink, out=out)[1]


def _merge_splits_out_cpu(o_part, lse_part, sink, out):
    attention._check_out(out, o_part.shape[0], o_part.shape[1], o_part)
    o, lse = reference.ref_merge_splits(o_part, lse_part, sink)
    out.copy_(o)
    return lse.contiguous()


def _merge_splits_out_fake(o_part, lse_part, sink, out):
    return o_part.new_empty((o_part.shape[0], o_part.shape[1]), dtype=torch.float32)


def _sparse_mla_decode_out_cuda(q, kv, indices, topk_length, sink, sm_scale, num_splits, out):
    return attention.sparse_mla_decode(q, kv, indices, topk_length, sink, sm_scale, num_splits, out=out)[1]


def _sparse_mla_decode_out_cpu(q, kv, indices, topk_length, sink, sm_scale, num_splits, out):
    attention._check_out(out, q.shape[0], q.shape[1], q)
    o, lse = reference.ref_sparse_mla_decode(q, kv, indices, topk_length, sink, sm_scale)
    out.copy_(o)
    return lse.contiguous()


def _sparse_mla_decode_out_fake(q, kv, indices, topk_length, sink, sm_scale, num_splits, out):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def _dsv4_decode_gather_cpu(compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots,
                            swa_length, swa_block_size, workspace):
    attention._decode_gather_slow_checks(compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                                        swa_slots, swa_length, swa_block_size, workspace)
    return reference.ref_dsv4_decode_gather(compressed_cache, topk_slots, topk_length, compressed_block_size,
                                            swa_cache, swa_slots, swa_length, swa_block_size, workspace)


def _dsv4_decode_gather_fake(compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots,
                             swa_length, swa_block_size, workspace):
    return topk_slots.new_empty((topk_slots.shape[0], topk_slots.shape[1] + swa_slots.shape[1]), dtype=torch.int32)


def _dsv4_decode_fused_out_cuda(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                                swa_slots, swa_length, swa_block_size, sink, sm_scale, num_splits, out):
    return paged_decode.dsv4_decode_fused(q, compressed_cache, topk_slots, topk_length, compressed_block_size,
                                          swa_cache, swa_slots, swa_length, swa_block_size, sink, sm_scale,
                                          num_splits, out=out)[1]


def _dsv4_decode_fused_out_cpu(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                               swa_slots, swa_length, swa_block_size, sink, sm_scale, num_splits, out):
    paged_decode.check_fused_args(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                                  swa_slots, swa_length, swa_block_size, sink, out)
    if num_splits:
        attention.check_splits(num_splits)
    o, lse = reference.ref_dsv4_decode_fused(q, compressed_cache, topk_slots, topk_length, compressed_block_size,
                                             swa_cache, swa_slots, swa_length, swa_block_size, sink, sm_scale)
    out.copy_(o)
    return lse.contiguous()


def _dsv4_decode_fused_out_fake(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                                swa_slots, swa_length, swa_block_size, sink, sm_scale, num_splits, out):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


OPS = (
    OpDef("sparse_mla_split",
          "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, float sm_scale, int num_splits)"
          " -> (Tensor, Tensor)",
          cuda=planned(attention.sparse_mla_split), cpu=_sparse_mla_split_cpu, fake=_sparse_mla_split_fake),
    OpDef("merge_splits", "(Tensor o_part, Tensor lse_part, Tensor? sink) -> (Tensor, Tensor)",
          cuda=planned(attention.merge_splits), cpu=_merge_splits_cpu, fake=_merge_splits_fake),
    OpDef("sparse_mla_decode",
          "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? sink, float sm_scale,"
          " int num_splits=0) -> (Tensor, Tensor)",
          cuda=planned(_sparse_mla_decode_cuda), cpu=_sparse_mla_decode_cpu, fake=_sparse_mla_decode_fake),
    OpDef("dsv4_decode_indices",
          "(Tensor topk_slots, Tensor? topk_length, Tensor swa_slots, int compressed_capacity,"
          " int swa_capacity) -> Tensor",
          cuda=planned(attention.dsv4_decode_indices), cpu=_dsv4_decode_indices_cpu, fake=_dsv4_decode_indices_fake),
    OpDef("merge_splits_out", "(Tensor o_part, Tensor lse_part, Tensor? sink, Tensor(a!) out) -> Tensor",
          cuda=planned(_merge_splits_out_cuda), cpu=_merge_splits_out_cpu, fake=_merge_splits_out_fake),
    OpDef("sparse_mla_decode_out",
          "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? sink, float sm_scale,"
          " int num_splits, Tensor(a!) out) -> Tensor",
          cuda=planned(_sparse_mla_decode_out_cuda), cpu=_sparse_mla_decode_out_cpu, fake=_sparse_mla_decode_out_fake),
    OpDef("dsv4_decode_gather",
          "(Tensor compressed_cache, Tensor topk_slots, Tensor? topk_length, int compressed_block_size,"
          " Tensor swa_cache, Tensor swa_slots, Tensor? swa_length, int swa_block_size, Tensor(a!) workspace)"
          " -> Tensor",
          cuda=planned(attention.dsv4_decode_gather), cpu=_dsv4_decode_gather_cpu, fake=_dsv4_decode_gather_fake),
    OpDef("dsv4_decode_fused_out",
          "(Tensor q, Tensor compressed_cache, Tensor topk_slots, Tensor? topk_length, int compressed_block_size,"
          " Tensor swa_cache, Tensor swa_slots, Tensor? swa_length, int swa_block_size, Tensor? sink,"
          " float sm_scale, int num_splits, Tensor(a!) out) -> Tensor",
          cuda=planned(_dsv4_decode_fused_out_cuda), cpu=_dsv4_decode_fused_out_cpu, fake=_dsv4_decode_fused_out_fake),
)
