"""A tiny random DeepSeek-V3.2 checkpoint written by transformers (its own config class and
``save_pretrained``: the original checkpoint's tensor names, per-expert weights), so vLLM reads
it with its own loader and the float64 oracle is transformers' ``DeepseekV32ForCausalLM`` on
the very same (bf16-rounded) weights.
"""

from __future__ import annotations

import tempfile

import torch

# Geometry: V3.2's attention shape (MLA: kv_lora 512 + rope 64 = the 576-wide key, v = the
# 512-d latent after absorption) with few heads/layers. index_topk >= every sequence the
# driver runs, so the sparse path selects every causal key (the indexer's choice cannot
# differ from the oracle's on near-ties; the choice itself is checked separately).
V32_CONFIG = dict(
    vocab_size=512, hidden_size=256, intermediate_size=128, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8,
    kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
    index_topk=128, index_head_dim=128, index_n_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    # what V3.2's config.json says and transformers' config class does not model (vLLM reads them)
    topk_method="noaux_tc", scoring_func="sigmoid",
)


# GLM-5 (``glm_moe_dsa``, served by the same vLLM class): its own head split (q/k nope 192,
# v 256 before absorption; the cached latent is still 512 + 64), and a shared-indexer layer:
# layer 1 has no indexer and attends over layer 0's top-k. transformers reads
# ``indexer_types``, vLLM ``index_topk_pattern`` (F: full, S: shared); both are written.
GLM5_CONFIG = dict(V32_CONFIG, qk_nope_head_dim=192, v_head_dim=256, rms_norm_eps=1e-5,
                   indexer_types=["full", "shared"], index_topk_pattern="FS")
FAMILIES = {"v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", V32_CONFIG),
            "glm5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", GLM5_CONFIG)}


def _classes(family: str):
    import transformers

    cfg_name, model_name, cfg = FAMILIES[family]
    return getattr(transformers, cfg_name), getattr(transformers, model_name), cfg


def init_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights at scales that keep activations O(1) (HF's 0.02 init would make every
    logit ~0 and the comparison vacuous)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            val = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
        elif "norm" in name and name.endswith("weight"):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            val = 0.1 * torch.randn(p.shape, generator=g)
        p.data.copy_(val.to(p.dtype))


def write(family: str = "v32", seed: int = 0) -> str:
    """Write the checkpoint (bf16 safetensors + config.json); returns its directory."""
    config_cls, model_cls, cfg = _classes(family)
    config = config_cls(**cfg)
    torch.manual_seed(seed)
    model = model_cls(config)
    init_weights(model, seed)
    model = model.to(torch.bfloat16)
    d = tempfile.mkdtemp(prefix="dsv4_e2e_v32_")
    model.save_pretrained(d, safe_serialization=True)
    return d


def fp8_ds_mla_roundtrip(latent: torch.Tensor) -> torch.Tensor:
    """What the 656-byte record keeps of a latent row [..., 512]: bf16, then per 128-dim tile a
    power-of-two scale 2**ceil(log2(max(amax / 448, 1e-4))) and E4M3 codes (RNE, saturating),
    decoded back (dsv4_ops/layout.py; written here from that description with torch's own E4M3)."""
    x = latent.to(torch.bfloat16).double()
    t = x.view(*x.shape[:-1], x.shape[-1] // 128, 128)
    amax = t.abs().amax(-1, keepdim=True).float()
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448.0, min=1e-4)))).double()
    codes = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (codes * scale).view_as(x).to(latent.dtype)


def oracle(model_dir: str, fp8_latent: bool = False, family: str = "v32"):
    """transformers' model on the checkpoint's weights, in float64 (eval mode). fp8_latent: the
    attention's KV latent (kv_a_layernorm's output) goes through the fp8_ds_mla record's
    rounding, as every key and value vLLM reads from that cache does. Each router's output goes
    through ``_route_hook`` (margins; vLLM's choice where ``oracle_logits`` is given one)."""
    import functools

    _, model_cls, _ = _classes(family)
    m = model_cls.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager",
                                               attn_implementation="eager")
    m._route_margins, m._routes, m._forced_routes, m._route_cut = [], {}, {}, 0.0
    for i, layer in enumerate(m.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(functools.partial(_route_hook, m, i))
    if fp8_latent:
        for layer in m.model.layers:
            layer.self_attn.kv_a_layernorm.register_forward_hook(lambda mod, inp, out: fp8_ds_mla_roundtrip(out))
    return m.eval()


def _route_hook(model, layer: int, gate, inp, out):
    logits, _, own = out
    margin = route_margin(gate, logits)
    model._route_margins.append(margin)
    forced = model._forced_routes.get(layer)
    if forced is None:
        model._routes[layer] = dict(own=own, used=own, margin=margin, logits=logits,
                                    taken=torch.zeros_like(margin, dtype=torch.bool))
        return None
    weights, ids, taken = force_route(gate, logits, own, forced, margin, model._route_cut)
    model._routes[layer] = dict(own=own, used=ids, margin=margin, logits=logits, taken=taken)
    return logits, weights, ids


def force_route(gate, router_logits: torch.Tensor, own: torch.Tensor, forced: torch.Tensor, margin: torch.Tensor,
                cut: float):
    """The oracle's routing teacher-forced where its choice is a near-tie: a token whose margin is
    at most ``cut`` and whose vLLM choice is known (``forced`` [T, k], rows of -1 unknown) takes
    vLLM's experts, weighed as the router weighs its own (the uncorrected sigmoid scores of the
    chosen experts, renormalised, times routed_scaling_factor); every other token keeps ``own``.
    Returns (weights [T, k], ids [T, k], taken [T] bool)."""
    taken = (forced >= 0).all(-1) & (margin <= cut)
    ids = torch.where(taken[:, None], forced.to(own.device, own.dtype), own)
    scores = router_logits.view(-1, router_logits.shape[-1]).sigmoid()
    weights = scores.gather(1, ids)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor, ids, taken


def route_margin(gate, router_logits: torch.Tensor) -> torch.Tensor:
    """Per token, how far the choice is from flipping: the gap between the last chosen and the
    first unchosen bias-corrected routing score (sigmoid + e_score_correction_bias, the key
    noaux_tc selects by) among the experts of the kept groups, and with more groups than
    ``topk_group`` also the gap between the last kept and the first dropped group's score (the
    sum of its top two keys), as vLLM's grouped_topk selects."""
    s = router_logits.double().sigmoid().view(-1, router_logits.shape[-1]) + gate.e_score_correction_bias.double()
    T, E = s.shape
    G, kg = gate.num_group, gate.topk_group
    group_gap = torch.full((T,), float("inf"), dtype=s.dtype)
    if G > kg:
        group = s.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
        srt = group.sort(dim=-1, descending=True)
        group_gap = srt.values[:, kg - 1] - srt.values[:, kg]
        keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, srt.indices[:, :kg], True)
        s = s.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    top = s.topk(gate.top_k + 1, dim=-1).values
    return torch.minimum(top[:, gate.top_k - 1] - top[:, gate.top_k], group_gap)


def oracle_logits(model, tokens, forced=None, cut: float = 0.0):
    """float64 logits [len(tokens), vocab] of one request's full causal forward (no cache), and
    per position the smallest routing margin over the MoE layers (route_margin). ``forced``
    {MoE layer: vLLM's experts [len(tokens), k], -1 rows unknown}: the oracle takes them where
    its margin is at most ``cut`` (force_route); ``model._routes`` then holds per layer the
    oracle's own choice, the one it used, the margins and the router logits."""
    model._route_margins.clear()
    model._routes = {}
    model._forced_routes, model._route_cut = forced or {}, cut
    try:
        with torch.no_grad():
            ids = torch.tensor([tokens], dtype=torch.int64)
            logits = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        model._forced_routes = {}
    margin = torch.stack(model._route_margins).min(0).values if model._route_margins else \
        torch.full((len(tokens),), float("inf"), dtype=torch.float64)
    return logits, margin
