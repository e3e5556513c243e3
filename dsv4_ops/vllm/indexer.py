"""The sparse-attention indexer on sm_8x: replacements of vLLM's indexer steps (0.33.0, 0.34.0).

Every function here has the exact signature of the vLLM function it replaces and calls only
``torch.ops.dsv4_ampere.*`` and torch (CPU tensors run through the ops' CPU references). vLLM is
never imported at module level.

| vLLM call site | replacement |
|---|---|
| ``deepseek_v4[1].attention.fused_indexer_q_rope_quant`` (CuTeDSL e4m3 cvt / Triton fp8) | ``fused_indexer_q_rope_quant`` -> ``indexer_q_quant`` |
| ``deepseek_v41.attention.indexer_k_norm_rope_store`` (Triton fp8) | ``indexer_k_norm_rope_store``: k_norm + RoPE in torch, store through ``indexer_k_insert`` |
| ``sparse_attn_indexer.fp8_fp4_mqa_logits`` (DeepGEMM, sm_90+) | ``fp8_fp4_mqa_logits`` -> ``mqa_logits(..., max_seqlen_k)`` |
| ``sparse_attn_indexer.fp8_fp4_paged_mqa_logits`` (DeepGEMM) | ``fp8_fp4_paged_mqa_logits`` -> ``paged_mqa_logits`` |
| ``v1.attention.backends.mla.indexer.get_paged_mqa_logits_metadata`` (DeepGEMM) | zeros of DeepGEMM's shape (the decode kernel needs no schedule) |
| ``sparse_attn_indexer.pack_seq_triton`` on an fp8 Q (Triton fp8 pointer) | the same kernel on the uint8 bytes (pad byte 0) |

Not replaced here: V4's indexer compressor (``_FUSED_KV_COMPRESS_NORM_ROPE_INSERT_INDEXER_TRITON_KERNEL``,
head 128), see the module's report.
"""

from __future__ import annotations

from typing import Optional

import torch

from .o_proj import gptj_rotate_tail
from .table import Patch, per_model, since, until

_E4M3 = torch.float8_e4m3fn


def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
                               index_weights_head_scale, use_fp4=False, weights_out_dtype=torch.float32):
    """vLLM's FP8 path: returns (q float8_e4m3fn [T, H, 128], weights fp32 [T, H]), bit-identical
    to vLLM's CUDA kernel (see dsv4_ops.indexer). use_fp4 (MXFP4, sm_100 only) raises."""
    if use_fp4 or weights_out_dtype != torch.float32:
        raise NotImplementedError("dsv4_ops: the MXFP4 indexer (use_fp4=True / bf16 weights) needs sm_100")
    q, w = torch.ops.dsv4_ampere.indexer_q_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                                                 float(index_weights_softmax_scale),
                                                 float(index_weights_head_scale))
    return q.view(_E4M3), w


def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
                              kv_slot_mapping, compress_ratio, use_fp4_cache):
    """V4.1 indexer K store: for each token i < kv_slot_mapping.numel() with slot >= 0 and
    (positions[i] + 1) % compress_ratio == 0: k = bf16(k_pre * rsqrt(mean(k_pre^2) + eps) * w),
    GPT-J RoPE on dims 64..127 at position (pos // ratio) * ratio in fp32, bf16, then
    ``indexer_k_insert`` (per-row fp32 power-of-two scale, RNE E4M3) into k_cache
    [num_blocks, block_size, 132]. No host sync."""
    if use_fp4_cache:
        raise NotImplementedError("dsv4_ops: the MXFP4 indexer cache needs sm_100")
    n = kv_slot_mapping.numel()
    if n == 0:
        return
    pos = positions[:n].to(torch.int64)
    k = k_pre[:n].to(torch.float32)
    var = (k * k).mean(dim=1, keepdim=True)
    k = (k * torch.rsqrt(var + rms_norm_eps) * rms_norm_weight.to(torch.float32)).to(torch.bfloat16).float()
    cs = cos_sin_cache[torch.div(pos, compress_ratio, rounding_mode="floor") * compress_ratio].to(torch.float32)
    k = gptj_rotate_tail(k, cs[:, :64], inverse=False).to(torch.bfloat16)
    slots = kv_slot_mapping.reshape(-1).to(torch.int64)
    slots = torch.where((pos + 1) % compress_ratio == 0, slots, -1)
    torch.ops.dsv4_ampere.indexer_k_insert(k, k_cache, slots, k_cache.shape[1])


def _fp32_logits_only(logits_dtype) -> None:
    if logits_dtype != torch.float32:
        raise NotImplementedError(
            f"dsv4_ops (sm_8x): indexer logits in {logits_dtype} are DeepGEMM's SM100 form; the sm_8x indexer "
            "scores in float32 (vLLM's default there): leave --attention-config.indexer_logits_dtype at auto "
            "or float32")


def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k, logits_dtype=torch.float32):
    """DeepGEMM's prefill logits, compressed form: fp32 [M, max_seqlen_k], column j = key
    cu_seqlen_ks[m] + j; the tail past ke - ks is -inf (DeepGEMM leaves it unwritten).
    logits_dtype (vLLM 0.34+): float32 only (bfloat16 is refused at startup and here)."""
    _fp32_logits_only(logits_dtype)
    values, q_scale = q
    if q_scale is not None:
        raise NotImplementedError("dsv4_ops: MX-scaled (MXFP4/MXFP8) indexer Q needs sm_100")
    k, k_scale = kv
    if k.dtype != _E4M3 and k.dtype != torch.uint8:
        raise NotImplementedError(f"dsv4_ops: indexer K of dtype {k.dtype} (MXFP4?) needs sm_100")
    return torch.ops.dsv4_ampere.mqa_logits(values, weights, k, k_scale.reshape(-1), cu_seqlen_ks, cu_seqlen_ke,
                                            int(max_seqlen_k))


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
                             logits_dtype=torch.float32, indices: Optional[torch.Tensor] = None):
    """DeepGEMM's decode logits: fp32 [B * next_n, max_model_len] (-inf past each row's
    context). schedule_metadata is ignored (the kernel schedules from static shapes).
    logits_dtype (vLLM 0.34+): float32 only."""
    _fp32_logits_only(logits_dtype)
    values, q_scale = q
    if q_scale is not None or indices is not None:
        raise NotImplementedError("dsv4_ops: MX-scaled Q and varlen decode (indices) are sm_100 paths")
    if context_lens.dim() == 2 and context_lens.stride(-1) != 1:
        context_lens = context_lens.contiguous()
    return torch.ops.dsv4_ampere.paged_mqa_logits(values, kv_cache, weights, context_lens, block_tables,
                                                  int(max_model_len))


def fp8_fp4_paged_mqa_logits_v033(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                                  max_model_len, indices: Optional[torch.Tensor] = None):
    """vLLM 0.33's signature of ``fp8_fp4_paged_mqa_logits`` (no logits_dtype: float32)."""
    return fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                                    max_model_len, indices=indices)


def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, indices=None):
    """Zeros of DeepGEMM's metadata shape [num_sms + 1, 2] int32: the builder copies it into
    its buffer; paged_mqa_logits does not read it."""
    return torch.zeros((int(num_sms) + 1, 2), dtype=torch.int32, device=context_lens.device)


def pack_seq_triton_bytes(original):
    """Wraps vLLM's ``pack_seq_triton``: an fp8 input is packed as its uint8 bytes with pad
    byte 0 (E4M3 +0.0; padded rows are masked by context_lens downstream) and viewed back."""
    def pack_seq_triton(x, lengths, pad_value=-float("inf"), block_t=64, block_d=64):
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            out = original(x.view(torch.uint8), lengths, pad_value=0, block_t=block_t, block_d=block_d)
            return out.view(x.dtype)
        return original(x, lengths, pad_value=pad_value, block_t=block_t, block_d=block_d)

    pack_seq_triton.__wrapped__ = original
    return pack_seq_triton


_SAI = "vllm.model_executor.layers.sparse_attn_indexer"
# Modules that import these names but are not on the DSv4 sm_8x path: V4.1's opt-in sm_100
# "latency_specialized" decode and GLM-5-Next's indexer (another model).
_SPEC_DECODE = "vllm.models.deepseek_v41.nvidia.specialized_decode.attention.indexer"
_GLM = "vllm.models.glm5next.nvidia.sparse_indexer"
_MQA_PARAMS = ("q", "kv", "weights", "cu_seqlen_ks", "cu_seqlen_ke", "max_seqlen_k")
_PAGED_PARAMS = ("q", "kv_cache", "weights", "context_lens", "block_tables", "schedule_metadata", "max_model_len")
_META_PARAMS = ("context_lens", "block_size", "num_sms", "indices")
_Q_PARAMS = ("positions", "index_q", "index_q_cos_sin_cache", "index_weights", "index_weights_softmax_scale",
             "index_weights_head_scale", "use_fp4", "weights_out_dtype")

PATCHES = per_model(
    "attention", "fused_indexer_q_rope_quant", _Q_PARAMS,
    "indexer Q RoPE + FP8 quant: CuTeDSL cvt.rn.satfinite.e4m3x2.f32 (sm_89+) or Triton tl.float8e4nv",
    fused_indexer_q_rope_quant, known_non_callers=(_SPEC_DECODE,)) + (
    Patch("vllm.models.deepseek_v41.attention", "indexer_k_norm_rope_store",
          ("k_pre", "positions", "cos_sin_cache", "rms_norm_weight", "rms_norm_eps", "k_cache", "kv_slot_mapping",
           "compress_ratio", "use_fp4_cache"),
          "V4.1 indexer K store: Triton tl.float8e4nv (sm_89+)", indexer_k_norm_rope_store, model="v41"),
    Patch(_SAI, "fp8_fp4_mqa_logits", _MQA_PARAMS,
          "prefill indexer logits: DeepGEMM (sm_90/sm_100 only)", fp8_fp4_mqa_logits, known_non_callers=(_GLM,),
          versions=until("0.33.0")),
    Patch(_SAI, "fp8_fp4_mqa_logits", _MQA_PARAMS + ("logits_dtype",),
          "prefill indexer logits: DeepGEMM (sm_90/sm_100 only); float32 logits (bfloat16 is SM100's, refused)",
          fp8_fp4_mqa_logits, known_non_callers=(_GLM,), versions=since("0.34.0")),
    Patch(_SAI, "fp8_fp4_paged_mqa_logits", _PAGED_PARAMS + ("indices",),
          "decode indexer logits: DeepGEMM (sm_90/sm_100 only)", fp8_fp4_paged_mqa_logits_v033,
          known_non_callers=(_SPEC_DECODE, _GLM), versions=until("0.33.0")),
    Patch(_SAI, "fp8_fp4_paged_mqa_logits", _PAGED_PARAMS + ("logits_dtype", "indices"),
          "decode indexer logits: DeepGEMM (sm_90/sm_100 only); float32 logits", fp8_fp4_paged_mqa_logits,
          known_non_callers=(_SPEC_DECODE, _GLM), versions=since("0.34.0")),
    Patch("vllm.v1.attention.backends.mla.indexer", "get_paged_mqa_logits_metadata", _META_PARAMS,
          "DeepGEMM decode schedule (sm_90/sm_100 only), built for every batch with decode rows",
          get_paged_mqa_logits_metadata, known_non_callers=(_SPEC_DECODE,)),
    # vLLM 0.34's indexer binds it by name for its varlen decode rows (the chunk_decode path, capability
    # family 100 only): patched there too, so that no binding of DeepGEMM's schedule is left.
    Patch(_SAI, "get_paged_mqa_logits_metadata", _META_PARAMS,
          "DeepGEMM decode schedule bound by name in the indexer (varlen decode rows, sm_100 chunk_decode)",
          get_paged_mqa_logits_metadata, known_non_callers=(_SPEC_DECODE,), versions=since("0.34.0")),
    Patch(_SAI, "pack_seq_triton", ("x", "lengths", "pad_value", "block_t", "block_d"),
          "ragged decode Q packing: Triton kernel with a float8_e4m3fn pointer (sm_89+)",
          pack_seq_triton_bytes, wraps=True, known_non_callers=(_GLM,)),
)
