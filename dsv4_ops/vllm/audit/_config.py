"""A stand-in ``VllmConfig`` for vLLM's warmup-key expansion (``get_warmup_keys(vllm_config=...)``).

Only plain attributes: the serve command of the audited path (TP=8, PP=1, no speculative
decoding, fp8_ds_mla cache, block 256, bf16) and the model geometry of the public configs
(DSV4_FACTS.md; V4.1 values not read from a checkpoint). A field vLLM reads that is missing
here raises AttributeError, and the audit reports the kernel as unknown with that error.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

_HF = {
    "v4": dict(model_type="deepseek_v4", hidden_size=4096, num_attention_heads=64, head_dim=512,
               qk_rope_head_dim=64, q_lora_rank=1024, kv_lora_rank=512, o_groups=8, index_n_heads=64,
               index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4, rms_norm_eps=1e-6,
               num_nextn_predict_layers=1, num_hidden_layers=43),
    "v41": dict(model_type="deepseek_v41", hidden_size=5120, num_attention_heads=64, head_dim=512,
                qk_rope_head_dim=64, q_lora_rank=1280, kv_lora_rank=512, o_groups=8, index_n_heads=32,
                index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4, rms_norm_eps=1e-6,
                num_nextn_predict_layers=1, num_hidden_layers=40, candidate_topk_blocks=64,
                candidate_block_size=64),
}


def vllm_config(model: str):
    import torch

    hf = NS(**_HF[model])
    return NS(
        model_config=NS(hf_config=hf, hf_text_config=hf, max_model_len=65536, dtype=torch.bfloat16),
        scheduler_config=NS(max_num_batched_tokens=8192, max_num_seqs=256),
        cache_config=NS(block_size=256, cache_dtype="fp8_ds_mla"),
        parallel_config=NS(tensor_parallel_size=8, pipeline_parallel_size=1, decode_context_parallel_size=1,
                           prefill_context_parallel_size=1,
                           cp_kv_cache_interleave_size=1, pcp_shard_decode_requests=False),
        speculative_config=None, num_speculative_tokens=0,
        compilation_config=NS(cudagraph_mode=None),
        attention_config=NS(sparse_mla_prefill_workspace_factor=1, indexer_sparse_logits=False,
                            indexer_tp_shard_min_rows=0, resolve_indexer_kv_dtype=lambda *a, **k: torch.uint8),
    )
