"""dsv4_ampere::v32_* : the DeepSeek-V3.2 / GLM-5 MLA ops (656-byte fp8_ds_mla cache and the
bf16 auto cache; sparse MLA with d_qk 576, d_v 512, no sink).

CUDA runs the Triton launchers (dsv4_ops.v32); the CPU runs the pure-PyTorch references
(dsv4_ops.reference) after the launchers' argument checks; the fakes allocate exactly
what the launchers return.
"""

import torch

from dsv4_ops import layout, reference as ref, v32
from .library import OpDef

QK = layout.V32_HEAD_DIM_QK
DV = layout.V32_HEAD_DIM_V


# ---- v32_kv_insert ----
def _v32_kv_insert_cuda(kv_c, k_pe, kv_cache, slot_mapping):
    v32.v32_kv_insert(kv_c, k_pe, kv_cache, slot_mapping)


def _v32_kv_insert_cpu(kv_c, k_pe, kv_cache, slot_mapping):
    v32.check_insert_args(kv_c, k_pe, kv_cache, slot_mapping)
    ref.ref_v32_kv_insert(kv_c, k_pe, kv_cache, slot_mapping)


def _v32_kv_insert_fake(kv_c, k_pe, kv_cache, slot_mapping):
    return None


# ---- v32_kv_gather / v32_kv_gather_into ----
def _v32_kv_gather_cuda(kv_cache, slots):
    return v32.v32_kv_gather(kv_cache, slots)


def _v32_kv_gather_cpu(kv_cache, slots):
    v32.check_gather_args(kv_cache, slots)
    return ref.ref_v32_kv_gather(kv_cache, slots).contiguous()


def _v32_kv_gather_fake(kv_cache, slots):
    return kv_cache.new_empty(tuple(slots.shape) + (QK,), dtype=torch.bfloat16)


def _v32_kv_gather_into_cuda(kv_cache, slots, out, row_offset):
    v32.v32_kv_gather(kv_cache, slots, out=out, row_offset=row_offset)


def _v32_kv_gather_into_cpu(kv_cache, slots, out, row_offset):
    c, _ = v32.check_gather_args(kv_cache, slots)
    v32.check_gather_out(out, c, slots.numel(), row_offset)
    rows = ref.ref_v32_kv_gather(kv_cache, slots).reshape(-1, QK)
    out[row_offset:row_offset + rows.shape[0]] = rows


def _v32_kv_gather_into_fake(kv_cache, slots, out, row_offset):
    return None


# ---- v32_sparse_mla_decode (+ _out) ----
def _attn_fake(q):
    T, H = q.shape[0], q.shape[1]
    return q.new_empty((T, H, DV), dtype=torch.bfloat16), q.new_empty((T, H), dtype=torch.float32)


def _v32_decode_cuda(q, kv_cache, indices, topk_length, sm_scale, num_splits=0):
    return v32.v32_sparse_mla_decode(q, kv_cache, indices, topk_length, sm_scale, num_splits)


def _v32_decode_cpu(q, kv_cache, indices, topk_length, sm_scale, num_splits=0):
    v32.check_decode_args(q, kv_cache, indices, topk_length)
    v32.check_splits(num_splits)
    out, lse = ref.ref_v32_sparse_mla_decode(q, kv_cache, indices, topk_length, sm_scale)
    return out.contiguous(), lse.contiguous()


def _v32_decode_fake(q, kv_cache, indices, topk_length, sm_scale, num_splits=0):
    return _attn_fake(q)


def _v32_decode_out_cuda(q, kv_cache, indices, topk_length, sm_scale, num_splits, out):
    return v32.v32_sparse_mla_decode(q, kv_cache, indices, topk_length, sm_scale, num_splits, out=out)[1]


def _v32_decode_out_cpu(q, kv_cache, indices, topk_length, sm_scale, num_splits, out):
    v32.check_attn_out(out, q.shape[0], q.shape[1], q)
    o, lse = _v32_decode_cpu(q, kv_cache, indices, topk_length, sm_scale, num_splits)
    out.copy_(o)
    return lse


def _v32_decode_out_fake(q, kv_cache, indices, topk_length, sm_scale, num_splits, out):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


# ---- v32_sparse_mla_prefill (+ _out) ----
def _v32_prefill_cuda(q, kv, indices, topk_length, sm_scale):
    return v32.v32_sparse_mla_prefill(q, kv, indices, topk_length, sm_scale)


def _v32_prefill_cpu(q, kv, indices, topk_length, sm_scale):
    v32.check_prefill_args(q, kv, indices, topk_length)
    out, lse = ref.ref_v32_sparse_mla(q, kv, indices, topk_length, sm_scale)
    return out.contiguous(), lse.contiguous()


def _v32_prefill_fake(q, kv, indices, topk_length, sm_scale):
    return _attn_fake(q)


def _v32_prefill_out_cuda(q, kv, indices, topk_length, sm_scale, out):
    return v32.v32_sparse_mla_prefill(q, kv, indices, topk_length, sm_scale, out=out)[1]


def _v32_prefill_out_cpu(q, kv, indices, topk_length, sm_scale, out):
    v32.check_attn_out(out, q.shape[0], q.shape[1], q)
    o, lse = _v32_prefill_cpu(q, kv, indices, topk_length, sm_scale)
    out.copy_(o)
    return lse


def _v32_prefill_out_fake(q, kv, indices, topk_length, sm_scale, out):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


OPS = (
    OpDef("v32_kv_insert", "(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
          cuda=_v32_kv_insert_cuda, cpu=_v32_kv_insert_cpu, fake=_v32_kv_insert_fake),
    OpDef("v32_kv_gather", "(Tensor kv_cache, Tensor slots) -> Tensor",
          cuda=_v32_kv_gather_cuda, cpu=_v32_kv_gather_cpu, fake=_v32_kv_gather_fake),
    OpDef("v32_kv_gather_into", "(Tensor kv_cache, Tensor slots, Tensor(a!) out, int row_offset) -> ()",
          cuda=_v32_kv_gather_into_cuda, cpu=_v32_kv_gather_into_cpu, fake=_v32_kv_gather_into_fake),
    OpDef("v32_sparse_mla_decode",
          "(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, float sm_scale, int num_splits=0)"
          " -> (Tensor, Tensor)",
          cuda=_v32_decode_cuda, cpu=_v32_decode_cpu, fake=_v32_decode_fake),
    OpDef("v32_sparse_mla_decode_out",
          "(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, float sm_scale, int num_splits,"
          " Tensor(a!) out) -> Tensor",
          cuda=_v32_decode_out_cuda, cpu=_v32_decode_out_cpu, fake=_v32_decode_out_fake),
    OpDef("v32_sparse_mla_prefill",
          "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, float sm_scale) -> (Tensor, Tensor)",
          cuda=_v32_prefill_cuda, cpu=_v32_prefill_cpu, fake=_v32_prefill_fake),
    OpDef("v32_sparse_mla_prefill_out",
          "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, float sm_scale, Tensor(a!) out) -> Tensor",
          cuda=_v32_prefill_out_cuda, cpu=_v32_prefill_out_cpu, fake=_v32_prefill_out_fake),
)
