"""dsv4_ampere::indexer_k_insert, indexer_q_quant, mqa_logits, paged_mqa_logits (the
sparse-attention indexer; layouts and semantics: dsv4_ops.indexer, dsv4_ops.layout).

E4M3 arguments may be uint8 or float8_e4m3fn tensors of the same bytes. Trailing optional
arguments beyond the issue's schemas: ``indexer_q_quant(..., bool use_fp4=False)`` (vLLM's
``fused_indexer_q_rope_quant`` argument list; True raises), ``mqa_logits(...,
int max_seqlen_k=-1)`` (>= 0: DeepGEMM's compressed [M, max_seqlen_k] output) and
``paged_mqa_logits(..., int block_size=0)`` (needed only for a 2-D padded page view).
"""

import torch

from dsv4_ops import indexer, layout, reference
from .library import OpDef

D = layout.INDEXER_HEAD_DIM


def _k_insert_cuda(k, cache, slot_mapping, block_size):
    indexer.indexer_k_insert(k, cache, slot_mapping, block_size)


def _k_insert_cpu(k, cache, slot_mapping, block_size):
    indexer.check_k_insert_args(k, cache, slot_mapping, block_size)
    reference.ref_indexer_k_insert(k, cache, slot_mapping, block_size)


def _k_insert_fake(k, cache, slot_mapping, block_size):
    return None


def _q_quant_cuda(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4=False):
    return indexer.indexer_q_quant(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale,
                                   use_fp4)


def _q_quant_cpu(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4=False):
    if use_fp4:
        raise NotImplementedError("indexer_q_quant: the MXFP4 indexer path (use_fp4=True) needs sm_100")
    indexer.check_q_quant_args(positions, index_q, cos_sin_cache, index_weights)
    q, w = reference.ref_indexer_q_quant(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale)
    return q.contiguous(), w.contiguous()


def _q_quant_fake(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4=False):
    T, H = index_q.shape[0], index_q.shape[1]
    return (index_q.new_empty((T, H, D), dtype=torch.uint8), index_q.new_empty((T, H), dtype=torch.float32))


def _mqa_cuda(q, weights, k, k_scale, ks, ke, max_seqlen_k=-1):
    return indexer.mqa_logits(q, weights, k, k_scale, ks, ke, max_seqlen_k)


def _mqa_cpu(q, weights, k, k_scale, ks, ke, max_seqlen_k=-1):
    indexer.check_mqa_args(q, weights, k, k_scale, ks, ke, max_seqlen_k)
    return reference.ref_mqa_logits(q, weights, k, k_scale, ks, ke, max_seqlen_k)


def _mqa_fake(q, weights, k, k_scale, ks, ke, max_seqlen_k=-1):
    cols = k.shape[0] if max_seqlen_k < 0 else max_seqlen_k
    return q.new_empty((q.shape[0], cols), dtype=torch.float32)


def _paged_cuda(q, kv_cache, weights, context_lens, block_table, max_context_len, block_size=0):
    return indexer.paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, block_size)


def _paged_cpu(q, kv_cache, weights, context_lens, block_table, max_context_len, block_size=0):
    indexer.check_paged_args(q, kv_cache, weights, context_lens, block_table, max_context_len, block_size)
    return reference.ref_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                          block_size)


def _paged_fake(q, kv_cache, weights, context_lens, block_table, max_context_len, block_size=0):
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len), dtype=torch.float32)


OPS = (
    OpDef("indexer_k_insert", "(Tensor k, Tensor(a!) cache, Tensor slot_mapping, int block_size) -> ()",
          cuda=_k_insert_cuda, cpu=_k_insert_cpu, fake=_k_insert_fake),
    OpDef("indexer_q_quant",
          "(Tensor positions, Tensor index_q, Tensor index_q_cos_sin_cache, Tensor index_weights, "
          "float index_weights_softmax_scale, float index_weights_head_scale, bool use_fp4=False) -> (Tensor, Tensor)",
          cuda=_q_quant_cuda, cpu=_q_quant_cpu, fake=_q_quant_fake),
    OpDef("mqa_logits",
          "(Tensor q, Tensor weights, Tensor k, Tensor k_scale, Tensor ks, Tensor ke, int max_seqlen_k=-1) -> Tensor",
          cuda=_mqa_cuda, cpu=_mqa_cpu, fake=_mqa_fake),
    OpDef("paged_mqa_logits",
          "(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, int max_context_len, "
          "int block_size=0) -> Tensor",
          cuda=_paged_cuda, cpu=_paged_cpu, fake=_paged_fake),
)
