"""DeepSeek-V3.2 / GLM-5 (vLLM 0.33.0 ``vllm.models.deepseek_v32``) on sm_8x: the model-level rows.

vLLM serves ``DeepseekV32ForCausalLM`` and ``GlmMoeDsaForCausalLM`` with one model class on CUDA
(``deepseek_v32/__init__.py`` binds both names to ``nvidia.model.DeepseekV32ForCausalLM``).
Its attention layer (``deepseek_v32/attention.py``, ``DeepseekV32Attention(MLAAttention)``)
calls two fused Triton launchers of ``deepseek_v32/common/kernels.py`` that store
``tl.float8e4nv`` (dead below sm_89, whatever they compute):

| vLLM 0.33.0 call (``deepseek_v32.attention``) | what it does | replacement here |
|---|---|---|
| ``fused_norm_rope`` (``_fused_norm_rope_kernel``) | q / kv RMSNorm, k_pe RoPE, MLA cache insert (bf16 or 656-byte fp8_ds_mla), indexer K LayerNorm + RoPE + FP8 insert (132-byte records), top-k buffer fill | torch + ``dsv4_ampere.v32_kv_insert`` + ``dsv4_ampere.indexer_k_insert`` |
| ``fused_q`` (``_fused_q_kernel``, or CuTeDSL ``fused_q_cutedsl`` when it accepts the shapes) | q_pe RoPE; indexer Q RoPE + per-(token, head) UE8M0 FP8 quant, weights scaled | torch + ``dsv4_ampere.e4m3_encode`` |

Everything else on the attention's path is vLLM's own: the MLA backend the selector picks on
sm_8x is ``dsv4_ops.vllm.v32_backend`` (registered by the plugin), and the indexer op is
``sparse_attn_indexer``, whose DeepGEMM calls the ``indexer`` rows already replace for V4.

Numerics against vLLM's kernels (sm_90 reference):
- RMSNorm / LayerNorm / RoPE: fp32, as the kernels; the sums are in torch's order, so results
  can differ from Triton's tree reduction by an ulp before the bf16/fp8 rounding.
- The fp8 caches are quantized from the fp32 norm / RoPE results, as the fused Triton writer
  quantizes its fp32 registers (``v32_kv_insert`` and ``indexer_k_insert`` take fp32 rows; a
  bf16 step first rounded ~1.5% of the codes twice, one E4M3 step off). The bf16 cache and the
  RoPE dims are rounded once to bf16, as there. Indexer Q is quantized from fp32 exactly as the
  kernel does (RNE, no bf16 step). Checked byte for byte against vLLM's own kernel run under
  the Triton interpreter (``tests/test_v32_writer.py``).

No host sync, static shapes: the functions capture into CUDA graphs. vLLM is never imported.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import v32_backend
from .table import Patch, Reads

_E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
# MLA cache dtypes the replacement writes ("auto"/"bfloat16": [kv_c | k_pe] bf16 rows; fp8_ds_mla:
# the 656-byte record). vLLM's other formats (plain fp8, nvfp4_ds_mla) raise.
MLA_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``(x * rsqrt(mean(x^2) + eps)) * w`` over the last dim (the kernels' ``_rms_norm``)."""
    x = x.float()
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w.float()


def _cos_sin(cache: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [T, half] of ``cos_sin_cache[positions]`` ([cos | sin] halves)."""
    cs = cache.index_select(0, positions.to(torch.int64)).float()
    half = cache.shape[-1] // 2
    return cs[:, :half], cs[:, half:]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved pairs 2i, 2i+1) rotation of the whole last dim, fp32. x [T, ..., 2h];
    cos/sin [T, h] (broadcast over the middle dims)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x = x.float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def _rope_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The indexer's RoPE on the FIRST ``2 * half`` dims of x (fp32 [T, ..., D]); the rest pass
    through. NeoX (split halves) by default (DeepSeek-V3.2), interleaved when ``interleave``
    (``indexer_rope_interleave``, GLM)."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half:]
    if interleave:
        rot = rope_interleaved(rot, cos, sin)
    else:
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        c, s = cos.reshape(shape), sin.reshape(shape)
        a, b = rot[..., :half], rot[..., half:]
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * w.float() + b.float()


def _check_mla_cache_dtype(mla_kv_cache_dtype: str) -> None:
    if mla_kv_cache_dtype not in MLA_CACHE_DTYPES:
        raise NotImplementedError(
            f"dsv4_ops (sm_8x): MLA kv-cache dtype {mla_kv_cache_dtype!r} is not supported for DeepSeek-V3.2/GLM-5; "
            f"use one of {MLA_CACHE_DTYPES} (--kv-cache-dtype fp8_ds_mla for the 656-byte fp8 record)")


def fused_norm_rope(positions, q_c, q_rms_norm_w, q_rms_eps, kv_c, kv_rms_norm_w, kv_rms_eps, k_pe,
                    k_rope_cos_sin_cache, index_k, index_k_layer_norm_w, index_k_layer_norm_bias,
                    index_k_layer_norm_eps, index_k_rope_cos_sin_cache, topk_indices_buffer, slot_mapping=None,
                    indexer_slot_mapping=None, indexer_k_cache=None, indexer_cache_shuffled=False, mla_kv_cache=None,
                    mla_kv_cache_dtype="auto", mla_k_scale=None, has_indexer=True, index_rope_interleave=False,
                    q_c_out=None, kv_c_out=None, k_pe_out=None, index_k_out=None, skip_scale=False):
    """vLLM's ``deepseek_v32.common.kernels.fused_norm_rope`` (same arguments), on sm_8x.

    positions int64 [T]; q_c bf16 [T, q_lora]; kv_c bf16 [T, 512]; k_pe bf16 [T, 64];
    index_k bf16 [T, 128] or None; topk_indices_buffer int32 [>= T, K]. Returns q_c_out
    (RMSNorm of q_c). Writes: kv_c_out / k_pe_out (normed kv_c, GPT-J-roped k_pe) when given;
    the MLA cache row of each token with slot_mapping[t] >= 0 (``v32_kv_insert``); with the
    indexer: topk_indices_buffer[:T] = -1, index_k LayerNorm + RoPE (first 64 dims, NeoX or
    interleaved) into index_k_out when given and into the indexer K cache ([num_blocks,
    block_size, 132], ``indexer_k_insert``) at indexer_slot_mapping (or slot_mapping) for the
    tokens whose MLA slot is >= 0 (the kernel skips the others).
    """
    T = positions.shape[0]
    if q_c_out is None:
        q_c_out = torch.empty_like(q_c)
    q_c_out.copy_(_rms_norm(q_c, q_rms_norm_w, q_rms_eps))

    cos, sin = _cos_sin(k_rope_cos_sin_cache, positions)
    kv32 = _rms_norm(kv_c, kv_rms_norm_w, kv_rms_eps)
    kv_n = kv32.to(kv_c.dtype)
    pe = rope_interleaved(k_pe.reshape(T, -1), cos, sin).to(k_pe.dtype)
    if kv_c_out is not None:
        kv_c_out.copy_(kv_n)
    if k_pe_out is not None:
        k_pe_out.copy_(pe.view(k_pe_out.shape))
    write_caches = slot_mapping is not None and (mla_kv_cache is not None or indexer_k_cache is not None)
    if mla_kv_cache is not None and slot_mapping is not None and mla_kv_cache.numel() > 0:
        _check_mla_cache_dtype(mla_kv_cache_dtype)
        # fp8_ds_mla is quantized from the fp32 norm, as vLLM's kernel does from its registers
        fp8 = mla_kv_cache_dtype == "fp8_ds_mla"
        torch.ops.dsv4_ampere.v32_kv_insert(kv32 if fp8 else kv_n, pe, mla_kv_cache, slot_mapping[:T])

    if not has_indexer:
        return q_c_out
    topk_indices_buffer[:T].fill_(-1)
    if index_k is None:
        return q_c_out
    icos, isin = _cos_sin(index_k_rope_cos_sin_cache, positions)
    k = _layer_norm(index_k, index_k_layer_norm_w, index_k_layer_norm_bias, index_k_layer_norm_eps)
    k = _rope_head(k, icos, isin, bool(index_rope_interleave))
    if index_k_out is not None:
        index_k_out.copy_(k)
    if indexer_k_cache is not None and write_caches:
        if indexer_cache_shuffled:
            raise NotImplementedError("dsv4_ops (sm_8x): the shuffled indexer-K layout is a ROCm reader's")
        isl = (slot_mapping if indexer_slot_mapping is None else indexer_slot_mapping)[:T].to(torch.int64)
        isl = torch.where(slot_mapping[:T] >= 0, isl, torch.full_like(isl, -1))
        torch.ops.dsv4_ampere.indexer_k_insert(k.float().contiguous(), indexer_k_cache, isl, indexer_k_cache.shape[1])
    return q_c_out


def ue8m0_quant(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) power-of-two FP8 quant of fp32 x: scale = 2**ceil(log2(max(amax, 1e-4)
    / 448)); codes = E4M3(x / scale) (RNE, exact division) as float8_e4m3fn. Returns
    (codes, scale fp32 of shape x.shape[:-1])."""
    amax = x.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-4) / FP8_MAX)))
    codes = torch.ops.dsv4_ampere.e4m3_encode((x / scale.unsqueeze(-1)).float(), True)
    return codes.view(_E4M3), scale


def fused_q(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope, q_scale, index_weights,
            index_weights_softmax_scale, index_weights_head_scale, has_indexer=True, index_rope_interleave=False,
            quantize_mqa=True):
    """vLLM's ``deepseek_v32.common.kernels.fused_q`` (same arguments), bf16-query path, on sm_8x.

    positions int64 [T]; q_pe bf16 [T, H, 64]; index_q bf16 [T, Hi, 128] or None; index_weights
    [T, Hi]. Returns (index_q_fp8 float8_e4m3fn [T, Hi, 128], index_weights_out fp32 [T, Hi],
    q_pe_out bf16 [T, H, 64] GPT-J-roped). index_q: RoPE (first 64 dims, NeoX or interleaved)
    in fp32, one UE8M0 scale per (token, head) (``ue8m0_quant``); weights_out = weights * scale *
    softmax_scale * head_scale. quantize_mqa=True (the fp8-query FlashInfer path, sm_90+) raises:
    the sm_8x backend reads a bf16 query.
    """
    if quantize_mqa:
        raise NotImplementedError("dsv4_ops (sm_8x): the fp8 MLA query (quantize_mqa=True) is FlashInfer sparse "
                                  "MLA's (sm_90+); the sm_8x backend takes a bf16 query")
    cos, sin = _cos_sin(q_pe_cos_sin_cache, positions)
    q_pe_out = rope_interleaved(q_pe, cos, sin).to(q_pe.dtype)
    if not has_indexer or index_q is None:
        dev = q_pe.device
        return (torch.empty((1, 1, 1), dtype=_E4M3, device=dev), torch.empty((1, 1), dtype=torch.float32, device=dev),
                q_pe_out)
    icos, isin = _cos_sin(index_q_cos_sin_cache, positions)
    x = _rope_head(index_q.float(), icos, isin, bool(index_rope_interleave))
    codes, scale = ue8m0_quant(x)
    w = index_weights.float() * scale
    w = w * float(index_weights_softmax_scale)
    w = w * float(index_weights_head_scale)
    return codes, w, q_pe_out


def _attention_module() -> str:
    return "vllm.models.deepseek_v32.attention"


_NORM_ROPE_PARAMS = ("positions", "q_c", "q_rms_norm_w", "q_rms_eps", "kv_c", "kv_rms_norm_w", "kv_rms_eps", "k_pe",
                     "k_rope_cos_sin_cache", "index_k", "index_k_layer_norm_w", "index_k_layer_norm_bias",
                     "index_k_layer_norm_eps", "index_k_rope_cos_sin_cache", "topk_indices_buffer", "slot_mapping",
                     "indexer_slot_mapping", "indexer_k_cache", "indexer_cache_shuffled", "mla_kv_cache",
                     "mla_kv_cache_dtype", "mla_k_scale", "has_indexer", "index_rope_interleave", "q_c_out",
                     "kv_c_out", "k_pe_out", "index_k_out", "skip_scale")
_FUSED_Q_PARAMS = ("positions", "q_pe", "q_pe_cos_sin_cache", "index_q", "index_q_cos_sin_cache", "ql_nope", "q_scale",
                   "index_weights", "index_weights_softmax_scale", "index_weights_head_scale", "has_indexer",
                   "index_rope_interleave", "quantize_mqa")
_REGISTRY = "vllm.v1.attention.backends.registry"
_MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
_SPARSE_MLA = "vllm.model_executor.layers.attention.sparse_mla_attention"
# ROCm's V3.2 module imports both names too (its own platform, never on NVIDIA).
_ROCM = ("vllm.models.deepseek_v32.amd.rocm",)


def _rows():
    return (
        Patch(_attention_module(), "fused_norm_rope", _NORM_ROPE_PARAMS,
              "V3.2/GLM-5 q/kv norm + RoPE + MLA and indexer-K cache inserts: Triton tl.float8e4nv (sm_89+)",
              fused_norm_rope, model="v32", known_non_callers=_ROCM),
        Patch(_attention_module(), "fused_q", _FUSED_Q_PARAMS,
              "V3.2/GLM-5 q_pe RoPE + indexer Q FP8 quant: Triton tl.float8e4nv / CuTeDSL e4m3 cvt (sm_89+)",
              fused_q, model="v32", known_non_callers=_ROCM),
        # The attention backend (dsv4_ops.vllm.v32_backend): registered through vLLM's backend registry,
        # and the one method of vLLM's sparse-MLA base it implements; the rest of the base is kept.
        Patch(_REGISTRY, "register_backend", ("backend", "class_path", "is_mamba"),
              "V3.2/GLM-5 sparse MLA: FlashMLA-sparse, FlashInfer-sparse and FA-sparse are gated to sm_90/sm_100 "
              f"(no valid backend on sm_80); the plugin registers {v32_backend.BACKEND_NAME} as the class of "
              f"AttentionBackendEnum.{v32_backend.OVERRIDDEN_MEMBER} on sm_8x (checked: first sparse entry of the "
              "sm_80/86 priority list)", v32_backend.install, kind="hook", model="v32"),
        Patch(_MLA_ATTENTION, "_canonicalize_sparse_mla_kv_cache_dtype", ("attn_backend", "kv_cache_dtype"),
              "V3.2/GLM-5 --kv-cache-dtype fp8 / fp8_e4m3: vLLM names fp8_ds_mla only for FLASHMLA_SPARSE (by "
              f"backend name); {v32_backend.BACKEND_NAME} gets the same mapping (other backends: vLLM's answer)",
              v32_backend.canonical_kv_cache_dtype, wraps=True, model="v32"),
        Patch(_SPARSE_MLA, "SparseMLACommonImpl._forward_mqa_kernel",
              ("q", "kv_cache", "topk_indices", "valid_counts", "layer", "block_size", "is_decode"),
              "sparse MLA d_qk 576 / d_v 512 over the physical top-k rows: dsv4_ampere.v32_sparse_mla_decode / "
              "_prefill (either cache format)", v32_backend.forward_mqa_kernel, kind="override", model="v32",
              reads=(Reads(_SPARSE_MLA, "SparseMLACommonImpl",
                           ("scale", "need_to_return_lse_for_decode", "kv_lora_rank", "qk_rope_head_dim",
                            "topk_indices_buffer", "index_group", "dcp_world_size")),
                     Reads(_SPARSE_MLA, "SparseMLACommonMetadata",
                           ("block_size", "num_decode_tokens", "block_table", "req_id_per_token")))),
        Patch(_SPARSE_MLA, "SparseMLACommonImpl.forward_mqa", ("q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
              "kept: vLLM's logical -> physical top-k remap (index group, int Triton), then _forward_mqa_kernel",
              kind="kept", model="v32"),
        Patch(_SPARSE_MLA, "SparseMLACommonMetadataBuilder.build",
              ("common_prefix_len", "common_attn_metadata", "fast_build"),
              "kept: the sparse-MLA metadata (decode/prefill split, token -> request map)", kind="kept", model="v32"),
    )


PATCHES = _rows()
