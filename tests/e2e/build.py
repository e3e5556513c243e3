"""Build a tiny random-weight DeepSeek-V4.1 / V4 model with vLLM's own classes and bind its
KV caches with vLLM's own planner and binder (as ``EngineCore._initialize_kv_caches`` and the V2
runner's ``initialize_kv_cache`` do). Nothing here is hand-made except the config values.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

# Layer kinds: V4.1: SWA only (0), a ratio-2 kv + index source and a ratio-2 consumer
# (an index source reading the source's K cache), a ratio-1 kv + index source, an Engram layer.
V41_CONFIG = dict(
    architectures=["DeepseekV41LLMForCausalLM"], model_type="deepseek_v41",
    vocab_size=512, hidden_size=256, num_hidden_layers=5, num_attention_heads=8, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=64, o_groups=2, kv_lora_rank=512,
    index_n_heads=4, index_head_dim=128, index_topk=8, sliding_window=16,
    compress_ratios=[0, 2, 2, 1, 0], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 2, 3],
    candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=0,
    hc_mult=4, hc_sinkhorn_iters=4, hc_eps=1e-6, rms_norm_eps=1e-6,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
    intermediate_size=64, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", norm_topk_prob=True,
    swiglu_limit=10.0, num_hash_layers=0, hidden_act="silu", topk_method="noaux_tc", n_group=1, topk_group=1,
    max_position_embeddings=4096, rope_theta=10000.0, compress_rope_theta=40000.0,
    rope_scaling=None, num_nextn_predict_layers=0, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
)


# V4: layer 0 SWA only with hash MoE routing and the first-layer mHC (the DeepGEMM prenorm GEMM
# the plugin replaces), C4A (ratio 4, indexer + compressor) and C128A (ratio 128).
V4_CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
    vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=64, o_groups=2, num_key_value_heads=1,
    index_n_heads=4, index_head_dim=128, index_topk=8, sliding_window=16,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], num_hash_layers=1,
    hc_mult=4, hc_sinkhorn_iters=4, hc_eps=1e-6, rms_norm_eps=1e-6,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
    routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", norm_topk_prob=True, swiglu_limit=10.0,
    topk_method="noaux_tc", n_group=1, topk_group=1,
    hidden_act="silu", max_position_embeddings=4096, rope_theta=10000.0, compress_rope_theta=40000.0,
    num_nextn_predict_layers=0, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
)
CONFIGS = {"v41": V41_CONFIG, "v4": V4_CONFIG}

TEXT_MODELS = {"DeepseekV41LLMForCausalLM": "vllm.models.deepseek_v41.nvidia.model:DeepseekV41LLMForCausalLM"}


@dataclass
class Built:
    model: Any
    vllm_config: Any
    kv_cache_config: Any
    attn_groups: Any
    kernel_block_sizes: List[int]
    kv_caches: Dict[str, torch.Tensor]
    device: torch.device
    keep: List[Any] = field(default_factory=list)  # context managers that must stay entered


def write_config(cfg: dict) -> str:
    d = tempfile.mkdtemp(prefix="dsv4_e2e_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def make_vllm_config(model_dir: str, device: str, block_size=None, cache_dtype=None, tp: int = 1, pp: int = 1,
                     dp: int = 1, dp_rank: int = 0, ep: bool = False):
    """The real ``VllmConfig``; ``block_size`` / ``cache_dtype`` None = what vLLM resolves;
    ``tp`` / ``pp``: the tensor / pipeline parallel sizes (tests/e2e/multirank.py)."""
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig)

    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                     enforce_eager=True, max_model_len=1024, trust_remote_code=False, seed=0)
    cc_kwargs = {}
    if block_size is not None:
        cc_kwargs["block_size"] = block_size
    if cache_dtype is not None:
        cc_kwargs["cache_dtype"] = cache_dtype
    cc = CacheConfig(**cc_kwargs)
    sc = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=1024,
                         is_encoder_decoder=False)
    extra = {}
    if tp > 1 or pp > 1 or dp > 1:
        # every rank its own process, started by the test: no executor of vLLM's runs. Named, so
        # vLLM does not pick one by counting GPUs (none here); "external_launcher" (torchrun-style)
        # is refused with PP by the GPU runner's feature check, which this test does not use
        backend = "external_launcher" if pp == 1 else "mp"
        dp_kw = {}
        if dp > 1:
            # external_launcher takes the DP rank from torchrun's RANK (config/parallel.py)
            os.environ["RANK"] = str(dp_rank * tp * pp)
            dp_kw = dict(data_parallel_size=dp, data_parallel_rank=dp_rank, enable_expert_parallel=ep)
        extra["parallel_config"] = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                  distributed_executor_backend=backend, **dp_kw)
    return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device),
                      **extra)


def build(cfg: dict, device: str, num_blocks: int = 128, model_dir: str = None, cache_dtype: str = None,
          tp: int = 1, pp: int = 1, rank: int = 0, init_method: str = None, adjust=None,
          dp: int = 1, ep: bool = False) -> Built:
    """cfg: config.json values (random weights, ``init_weights``), or model_dir: a checkpoint
    directory read by vLLM's own loader (cfg then only names the architecture).
    tp / pp / rank / init_method: this process is rank ``rank`` of ``tp * pp`` (gloo at
    ``init_method``, e.g. tcp://127.0.0.1:PORT); dp / ep: vLLM's data_parallel_size and
    enable_expert_parallel (the world is tp * pp * dp, rank r's DP rank r // (tp * pp));
    adjust(vllm_config): a last change to the
    config before the distributed set-up (e.g. the Engram table in ordinary memory)."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.workspace import init_workspace_manager
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    if cfg["architectures"][0] not in ModelRegistry.get_supported_archs():
        # The text model of the V4.1 checkpoint (the VL wrapper's language_model), registered
        # under its own class name so the test needs no vision tower.
        ModelRegistry.register_model(cfg["architectures"][0], TEXT_MODELS[cfg["architectures"][0]])
    load = model_dir is not None
    model_dir = model_dir or write_config(cfg)
    vc = make_vllm_config(model_dir, device, cache_dtype=cache_dtype, tp=tp, pp=pp, dp=dp,
                          dp_rank=rank // (tp * pp), ep=ep)
    if adjust is not None:
        adjust(vc)
    ctx = set_current_vllm_config(vc)
    ctx.__enter__()
    from vllm.distributed import parallel_state

    # a process that already set up its one rank (the checkpoint writer, engine/checkpoints.py) keeps it
    if parallel_state._WORLD is None:
        init_distributed_environment(world_size=tp * pp * dp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=init_method or f"file://{tempfile.mktemp()}")
    if not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(tp, pp)
    try:
        vc.kernel_config.ir_op_priority.set_default()
    except Exception:  # noqa: BLE001
        pass
    dev = torch.device(device)
    model_cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architectures, vc.model_config)
    with set_default_torch_dtype(torch.bfloat16), dev:
        model = model_cls(vllm_config=vc, prefix="")
    if load:
        from vllm.model_executor.model_loader import get_model_loader

        get_model_loader(vc.load_config).load_weights(model, vc.model_config)
    else:
        init_weights(model)
    process_weights_after_loading(model, vc.model_config, dev)
    # vLLM's executor resolves the KV block size from the built model's backends (CUDA does not
    # override the Platform rule); this is what a plain `vllm serve` gets.
    Platform.update_block_size_for_backend.__func__(type(current_platform), vc)

    specs = attn_utils.get_kv_cache_spec(vc)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vc))]
    resolve_kv_cache_layout(vc, [layouts], list(specs.values()))
    groups = get_global_kv_cache_groups(vc, [specs])
    page = sum(g.kv_cache_spec.page_size_bytes for g in groups) if groups else 0
    (kv_cfg,) = get_kv_cache_configs(vc, [specs], [max(page, 1) * num_blocks * 4], groups)
    kv_cfg.kv_cache_layout = vc.cache_config.kv_cache_layout
    attn_groups, _cg, kernel_block_sizes = attn_utils.init_attn_backend(kv_cfg, vc, dev)
    init_workspace_manager(dev)
    kv_caches = attn_utils.init_kv_cache(vc.compilation_config.static_forward_context, kv_cfg, dev,
                                         kernel_block_sizes, vc,
                                         attn_groups=(g for gs in attn_groups for g in gs))
    return Built(model, vc, kv_cfg, attn_groups, kernel_block_sizes, kv_caches, dev, keep=[ctx])


def init_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights at scales that keep activations O(1) through a few layers."""
    g = torch.Generator().manual_seed(seed)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):   # hash routing table: distinct experts per token id
            E = int(b.max().item()) + 1 if b.numel() and b.max() > 0 else None
            n_exp = E or 8
            rows = torch.stack([torch.randperm(n_exp, generator=g)[: b.shape[1]] for _ in range(b.shape[0])])
            b.copy_(rows.to(b.dtype))
    for name, p in model.named_parameters():
        if name.endswith("tid2eid"):
            rows = torch.stack([torch.randperm(8, generator=g)[: p.shape[1]] for _ in range(p.shape[0])])
            p.data.copy_(rows.to(p.dtype))
            continue
        if p.dtype in (torch.bfloat16, torch.float16, torch.float32):
            if p.dim() >= 2:
                std = p.shape[-1] ** -0.5
                val = torch.randn(p.shape, generator=g) * std
            elif "norm" in name:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                val = 0.1 * torch.randn(p.shape, generator=g)
            p.data.copy_(val.to(p.dtype))
