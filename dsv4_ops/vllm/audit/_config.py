"""A stand-in ``VllmConfig`` for vLLM's warmup-key expansion (``get_warmup_keys(vllm_config=...)``),
and the target platform those expansions see.

Plain attributes for the serve command of the audited path (TP=8, PP=1, no speculative
decoding, fp8_ds_mla cache, block 256 for V4 and 128 for V4.1, as vLLM resolves them on sm_8x, bf16) and the model geometry of the public configs
(DSV4_FACTS.md); ``attention_config`` is vLLM's own ``AttentionConfig()`` (the defaults of a
plain ``vllm serve``: indexer K cache "auto" = fp8). ``compress_ratios`` is a per-layer list
(MTP included) with the ratios each model's layers take (V4: 0/4/128; V4.1: 0/1/2); warmup
keys depend only on the set of values, the layer order here is illustrative. A field vLLM reads
that is missing here raises AttributeError, and the audit reports the kernel as unknown with
that error.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace as NS

_V4_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]          # 43 layers + 1 MTP
_V41_RATIOS = [0, 0] + [1, 2] * 19 + [0]                 # 40 layers + 1 MTP

_HF = {
    "v4": dict(model_type="deepseek_v4", hidden_size=4096, num_attention_heads=64, head_dim=512,
               qk_rope_head_dim=64, q_lora_rank=1024, kv_lora_rank=512, o_groups=8, index_n_heads=64,
               index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4, rms_norm_eps=1e-6,
               num_nextn_predict_layers=1, num_hidden_layers=43, compress_ratios=_V4_RATIOS),
    "v41": dict(model_type="deepseek_v41", hidden_size=5120, num_attention_heads=64, head_dim=512,
                qk_rope_head_dim=64, q_lora_rank=1280, kv_lora_rank=512, o_groups=8, index_n_heads=32,
                index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4, rms_norm_eps=1e-6,
                num_nextn_predict_layers=1, num_hidden_layers=40, candidate_topk_blocks=64,
                candidate_block_size=64, compress_ratios=_V41_RATIOS,
                kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36]),
    # DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2 config.json facts, the issue's list; transformers'
    # DeepseekV32Config defaults agree) and GLM-5 (transformers 5.20 GlmMoeDsaConfig defaults):
    # MLA with the latent absorbed (q/k 576 = kv_lora 512 + rope 64, v 512), the DSA indexer.
    "v32": dict(model_type="deepseek_v32", hidden_size=7168, num_attention_heads=128, kv_lora_rank=512,
                q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64,
                index_head_dim=128, index_topk=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
                n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, moe_intermediate_size=2048,
                intermediate_size=18432, n_group=8, topk_group=4, vocab_size=129280, rms_norm_eps=1e-6,
                max_position_embeddings=163840),
    "glm5": dict(model_type="glm_moe_dsa", hidden_size=6144, num_attention_heads=64, kv_lora_rank=512,
                 q_lora_rank=2048, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32,
                 index_head_dim=128, index_topk=2048, num_hidden_layers=78, num_nextn_predict_layers=1,
                 n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, moe_intermediate_size=2048,
                 intermediate_size=12288, n_group=1, topk_group=1, vocab_size=154880, rms_norm_eps=1e-5,
                 max_position_embeddings=202752),
}


# V3.2 / GLM-5: the MLA + indexer caches take vLLM's 64-token kernel block (indexer backend:
# get_supported_kernel_block_sizes -> [64] on CUDA); the default `vllm serve` cache is "auto" (bf16).
BLOCK_SIZE = {"v4": 256, "v41": 128, "v32": 64, "glm5": 64}
CACHE_DTYPE = {"v4": "fp8_ds_mla", "v41": "fp8_ds_mla", "v32": "auto", "glm5": "auto"}


def _attention_config():
    try:
        from vllm.config.attention import AttentionConfig

        return AttentionConfig()
    except Exception:  # noqa: BLE001 - another vLLM: a stub with the documented default
        return NS(sparse_mla_prefill_workspace_factor=None, indexer_sparse_logits=False,
                  indexer_tp_shard_min_rows=65536, indexer_kv_dtype="auto",
                  resolve_indexer_kv_dtype=lambda default: default)


def vllm_config(model: str):
    import torch

    hf = NS(**_HF[model])
    return NS(
        model_config=NS(hf_config=hf, hf_text_config=hf, max_model_len=65536, dtype=torch.bfloat16),
        scheduler_config=NS(max_num_batched_tokens=8192, max_num_seqs=256),
        # the KV block size vLLM resolves for the model's backends on sm_8x (doctor.resolved_block_size:
        # V4 256; V4.1 128, its sparse-MLA and indexer backends take 64 on sm_90 and 128 elsewhere)
        cache_config=NS(block_size=BLOCK_SIZE[model], cache_dtype=CACHE_DTYPE[model]),
        parallel_config=NS(tensor_parallel_size=8, pipeline_parallel_size=1, decode_context_parallel_size=1,
                           prefill_context_parallel_size=1,
                           cp_kv_cache_interleave_size=1, pcp_shard_decode_requests=False),
        speculative_config=None, num_speculative_tokens=0,
        compilation_config=NS(cudagraph_mode=None),
        kernel_config=NS(enable_jit_warmup=True),
        attention_config=_attention_config(),
    )


# SMs of the reference GPU of each target (A100 SXM: 108; A40 / RTX A6000: 84).
SM_COUNT = {80: 108, 86: 84}


@contextlib.contextmanager
def target_platform(arch: int):
    """vLLM's ``current_platform`` answers as an sm_<arch> GPU would while warmup keys are
    expanded (``get_device_capability()`` is None on a CPU machine, which makes some kernels
    return no keys; PDL is sm_90+), and on a machine without CUDA
    ``torch.cuda.get_device_properties`` reports the reference GPU's SM count."""
    from vllm.platforms import current_platform as cp
    from vllm.platforms.interface import DeviceCapability

    import torch

    cap = DeviceCapability(major=arch // 10, minor=arch % 10)
    names = ("get_device_capability", "is_arch_support_pdl", "has_device_capability", "is_device_capability_family")
    saved = {k: cp.__dict__[k] for k in names if k in cp.__dict__}
    cp.get_device_capability = lambda device_id=0: cap
    cp.is_arch_support_pdl = lambda: arch >= 90
    # the classmethods read cls.get_device_capability (the platform class's, not this instance's)
    cp.has_device_capability = lambda capability, device_id=0: (
        cap >= capability if isinstance(capability, tuple) else cap.to_int() >= capability)
    cp.is_device_capability_family = lambda capability, device_id=0: cap.to_int() // 10 == capability // 10
    real_props = torch.cuda.get_device_properties
    if not torch.cuda.is_available():  # SM count for split-K heuristics (mHC TileLang warmup keys)
        torch.cuda.get_device_properties = lambda device=None: NS(
            multi_processor_count=SM_COUNT.get(arch, 108), major=cap.major, minor=cap.minor,
            name=f"dsv4_ops audit target sm_{arch}")
    try:
        yield
    finally:
        torch.cuda.get_device_properties = real_props
        for k in names:
            if k in saved:
                setattr(cp, k, saved[k])
            else:
                cp.__dict__.pop(k, None)
