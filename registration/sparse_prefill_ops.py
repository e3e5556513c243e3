"""dsv4_ampere::sparse_mla_prefill: sparse MLA prefill attention with sink into a caller's out
(FlashMLA ``flash_mla_sparse_fwd``'s job; returns lse).

CUDA runs the launcher (dsv4_ops.sparse_prefill: the prefill kernel, or the split-KV decode
kernels where a few queries do not fill the SMs); the CPU runs the float64 reference; the fake
allocates exactly what the launcher allocates (lse fp32 [T, H]).
"""

import torch

from dsv4_ops import reference, sparse_prefill
from .library import OpDef


def _sparse_mla_prefill_cuda(q, kv, indices, topk_length, sink, sm_scale, out):
    return sparse_prefill.sparse_mla_prefill(q, kv, indices, topk_length, sink, sm_scale, out=out)[1]


def _sparse_mla_prefill_cpu(q, kv, indices, topk_length, sink, sm_scale, out):
    sparse_prefill._checked(q, kv, indices, topk_length, sink, out)
    o, lse = reference.ref_sparse_mla_decode(q, kv, indices, topk_length, sink, sm_scale)
    out.copy_(o)
    return lse.contiguous()


def _sparse_mla_prefill_fake(q, kv, indices, topk_length, sink, sm_scale, out):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


OPS = (
    OpDef("sparse_mla_prefill",
          "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? sink, float sm_scale,"
          " Tensor(a!) out) -> Tensor",
          cuda=_sparse_mla_prefill_cuda, cpu=_sparse_mla_prefill_cpu, fake=_sparse_mla_prefill_fake),
)
