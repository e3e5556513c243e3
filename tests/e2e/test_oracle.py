"""The float64 oracle (tests/e2e/oracle.py) against transformers' DeepSeek-V4 modules.

transformers' deepseek_v4 up-casts to float32 in many places (`.float()`, `torch.float32`
softmax/RMSNorm, float32 inv_freq). `f64_transformers()` redirects those casts to float64 for the
duration of a test (module-level `torch` proxy whose float32/float are float64, and
`Tensor.float` -> float64), so the same code runs in float64 and agreement is checked at
~1e-10. One test (`test_attention_layer_float32_unshimmed`) runs transformers unshimmed in
float32 to show the shim changes precision only. Random seeds come from os.urandom and are in
every assertion message.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import pytest
import torch

import transformers.modeling_rope_utils as rope_utils
import transformers.models.deepseek_v4.modeling_deepseek_v4 as mdl
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

try:
    from . import oracle as O
except ImportError:  # tests/e2e collected as a rootdir (no package)
    import oracle as O

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


class _TorchF64:
    """`torch`, except that float32 / float name float64 (installed as transformers' `torch`)."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def f64_transformers():
    """Run transformers' deepseek_v4 code with its float32 casts redirected to float64."""
    proxy = _TorchF64()
    saved_float = torch.Tensor.__dict__.get("float")
    saved_dtype = torch.get_default_dtype()
    mods = (mdl, rope_utils)
    saved_torch = [m.torch for m in mods]
    for m in mods:
        m.torch = proxy
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        for m, t in zip(mods, saved_torch):
            m.torch = t
        if saved_float is None:
            del torch.Tensor.float
        else:
            torch.Tensor.float = saved_float
        torch.set_default_dtype(saved_dtype)


class Rng:
    def __init__(self):
        self.seed = int.from_bytes(os.urandom(6), "little")
        self.g = torch.Generator().manual_seed(self.seed)

    def n(self, *shape, std=1.0, dtype=F64):
        return (torch.randn(*shape, generator=self.g, dtype=F64) * std).to(dtype)

    def ints(self, hi, *shape):
        return torch.randint(0, hi, shape, generator=self.g)

    def fill(self, module, std=None):
        """Every parameter of `module` <- N(0, std or 1/sqrt(fan_in)) (1-D: N(0, 1))."""
        with torch.no_grad():
            for p in module.parameters():
                s = std if std is not None else (1.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 1.0)
                p.copy_(self.n(*p.shape, std=s, dtype=p.dtype))


@pytest.fixture
def rng():
    return Rng()


def close(a, b, rng, what, rtol=RTOL, atol=ATOL):
    a, b = a.to(F64), b.to(F64)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)} (seed {rng.seed})"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max |diff| {err:.3e} (seed {rng.seed})"


def make_config(**over) -> DeepseekV4Config:
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=24,
        num_experts_per_tok=2,
        n_routed_experts=6,
        partial_rotary_factor=0.5,  # rope_dim 8 of head_dim 16
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=3,
        hc_sinkhorn_iters=20,
        sliding_window=6,
        o_groups=2,
        o_lora_rank=12,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    kw.update(over)
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


class _Cache:
    """Minimal past_key_values: `.layers[layer_idx]` is the V4 cache layer."""

    def __init__(self, layer):
        self.layers = [layer]


# ----------------------------------------------------------------------------------------------
# RMSNorm and RoPE
# ----------------------------------------------------------------------------------------------


def test_rms_norm(rng):
    x = rng.n(5, 7, 24, std=3.0)
    w = rng.n(24)
    with f64_transformers():
        m = mdl.DeepseekV4RMSNorm(24, eps=1e-6)
        with torch.no_grad():
            m.weight.copy_(w)
        ref_w = m(x)
        ref_u = mdl.DeepseekV4UnweightedRMSNorm(eps=1e-6)(x)
    assert ref_w.dtype == F64
    close(O.rms_norm(x, w, 1e-6), ref_w, rng, "weighted rms_norm")
    close(O.rms_norm(x, None, 1e-6), ref_u, rng, "unweighted rms_norm")
    # independent: eps=0 gives unit root-mean-square rows
    close(O.rms_norm(x, None, 0.0).square().mean(-1), torch.ones(5, 7, dtype=F64), rng, "unit rms")


@pytest.mark.parametrize("kind", ["main", "compress", "compress_mscale", "compress_default"])
def test_rope_cos_sin(rng, kind):
    over = {}
    if kind == "compress_default":
        over["rope_parameters"] = None  # no YaRN: plain RoPE at compress_rope_theta
    cfg = make_config(**over)
    if kind == "compress_mscale":  # YaRN with its own attention_factor (not V4's forced 1.0)
        del cfg.rope_parameters["compress"]["attention_factor"]
    layer = "main" if kind == "main" else "compress"
    pos = torch.cat((torch.arange(40), rng.ints(200_000, 24)))
    with f64_transformers():
        rot = mdl.DeepseekV4RotaryEmbedding(cfg)
        x = torch.zeros(1, dtype=F64)
        cos_t, sin_t = rot(x, pos[None], layer_type=layer)
    base, scaling = O.rope_args(cfg.rope_parameters, layer)
    assert base == (1e4 if layer == "main" else 1.6e5), f"seed {rng.seed}"
    if kind in ("compress", "compress_mscale"):
        assert scaling is not None and scaling["rope_type"] == "yarn"
    cos, sin = O.rope_cos_sin(pos, cfg.qk_rope_head_dim, base, scaling)
    assert cos.shape == (pos.numel(), cfg.qk_rope_head_dim // 2)
    # angles up to 2e5 rad: f64 rounding of the angle is ~1e-11 absolute
    close(cos, cos_t[0], rng, f"cos {kind}", rtol=0, atol=1e-9)
    close(sin, sin_t[0], rng, f"sin {kind}", rtol=0, atol=1e-9)
    att = 0.1 * math.log(16.0) + 1 if kind == "compress_mscale" else 1.0
    close(cos.square() + sin.square(), torch.full_like(cos, att**2), rng, "cos^2+sin^2 = att^2")
    if kind == "compress":  # YaRN changes the low frequencies and keeps the highest one
        inv_y, _ = O.rope_inv_freq(cfg.qk_rope_head_dim, base, scaling)
        inv_d, _ = O.rope_inv_freq(cfg.qk_rope_head_dim, base, None)
        assert inv_y[0] == inv_d[0] and torch.isclose(inv_y[-1], inv_d[-1] / 16), f"seed {rng.seed}"


def test_rope_interleaved(rng):
    t, h, d, rd = 9, 3, 16, 8
    x = rng.n(t, h, d)
    pos = rng.ints(1000, t)
    cos, sin = O.rope_cos_sin(pos, rd, 1e4, None)
    with f64_transformers():
        ref = mdl.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos[None], sin[None]).squeeze(0).transpose(0, 1)
        ref_inv = mdl.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos[None], -sin[None]).squeeze(0).transpose(0, 1)
    y = O.rope_interleaved(x, cos, sin)
    close(y, ref, rng, "rope vs transformers")
    close(O.rope_interleaved(x, cos, sin, inverse=True), ref_inv, rng, "inverse rope vs transformers")
    close(y[..., : d - rd], x[..., : d - rd], rng, "nope channels untouched")
    close(O.rope_interleaved(y, cos, sin, inverse=True), x, rng, "inverse undoes")
    # independent: pair (2i, 2i+1) is the rotation by pos*inv_freq[i] (complex multiplication)
    z = torch.complex(x[..., d - rd :: 2], x[..., d - rd + 1 :: 2]) * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None]
    close(torch.stack((z.real, z.imag), -1).flatten(-2), y[..., d - rd :], rng, "complex rotation")
    # independent: q.k after RoPE depends only on the position difference
    q, k = rng.n(1, d), rng.n(1, d)
    dots = []
    for p in (3, 50, 700):
        cq, sq = O.rope_cos_sin(torch.tensor([p + 11]), rd, 1e4, None)
        ck, sk = O.rope_cos_sin(torch.tensor([p]), rd, 1e4, None)
        dots.append((O.rope_interleaved(q, cq, sq) * O.rope_interleaved(k, ck, sk)).sum())
    close(torch.stack(dots), dots[0].expand(3), rng, "relative-position invariance")
    # NeoX relation: interleaved == neox on the de-interleaved channels, permuted back
    p = O.neox_permutation(rd)
    perm = torch.cat((torch.arange(d - rd), d - rd + p))
    back = torch.argsort(perm)
    close(O.rope_neox(x[..., perm], cos, sin)[..., back], y, rng, "interleaved == P^-1 neox P")
    assert not torch.allclose(O.rope_neox(x, cos, sin), y), f"layouts must differ (seed {rng.seed})"


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


class _AttnStub(torch.nn.Module):
    def __init__(self, sinks, h):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = h


def test_sparse_attention(rng):
    t, h, d, n = 7, 4, 16, 11
    q = rng.n(t, h, d)
    keys = rng.n(n, d)
    valid = torch.rand(t, n, generator=rng.g) < 0.6
    valid[:, 0] = True
    sink = rng.n(h)
    scale = d**-0.5
    out, lse = O.sparse_attention(q, keys.expand(t, n, d), valid, sink, scale)
    mask = torch.zeros(t, n, dtype=F64).masked_fill(~valid, float("-inf"))[None, None]
    with f64_transformers():
        ref, _ = mdl.eager_attention_forward(_AttnStub(sink, h), q.transpose(0, 1)[None], keys[None, None],
                                             keys[None, None], mask, scale)
    close(out, ref[0], rng, "sparse_attention vs transformers eager")
    # independent: dense softmax with -inf masking and a sink column
    lg = torch.einsum("thd,nd->thn", q, keys) * scale
    lg = torch.where(valid[:, None], lg, torch.tensor(float("-inf"), dtype=F64))
    full = torch.cat((lg, sink[None, :, None].expand(t, h, 1)), -1)
    p = torch.softmax(full, -1)
    close(out, torch.einsum("thn,nd->thd", p[..., :-1], keys), rng, "dense softmax + sink")
    close(lse, torch.logsumexp(full, -1), rng, "lse includes the sink")
    # per-query gathered keys == masked shared keys
    idx = torch.stack([torch.randperm(n, generator=rng.g)[:5] for _ in range(t)])
    o2, l2 = O.sparse_attention(q, keys[idx], torch.ones(t, 5, dtype=torch.bool), sink, scale)
    m2 = torch.zeros(t, n, dtype=torch.bool).scatter_(1, idx, True)
    o3, l3 = O.sparse_attention(q, keys.expand(t, n, d), m2, sink, scale)
    close(o2, o3, rng, "gathered == masked")
    close(l2, l3, rng, "gathered == masked (lse)")
    # no sink: plain softmax; no valid key: out 0, lse = sink or -inf
    o4, l4 = O.sparse_attention(q, keys.expand(t, n, d), valid, None, scale)
    close(o4, torch.einsum("thn,nd->thd", torch.softmax(lg, -1), keys), rng, "no sink")
    close(l4, torch.logsumexp(lg, -1), rng, "no sink (lse)")
    none = torch.zeros(t, n, dtype=torch.bool)
    o5, l5 = O.sparse_attention(q, keys.expand(t, n, d), none, sink, scale)
    assert (o5 == 0).all() and torch.equal(l5, sink.expand(t, h)), f"seed {rng.seed}"
    o6, l6 = O.sparse_attention(q, keys.expand(t, n, d), none, None, scale)
    assert (o6 == 0).all() and torch.isneginf(l6).all(), f"seed {rng.seed}"


def test_o_proj(rng):
    cfg = make_config()
    t = 6
    with f64_transformers():
        attn = mdl.DeepseekV4Attention(cfg, 0)
        rng.fill(attn)
        o = rng.n(1, t, cfg.num_attention_heads, cfg.head_dim)  # attention output [B, S, H, D]
        pos = rng.ints(300, t)
        cos, sin = O.rope_cos_sin(pos, cfg.qk_rope_head_dim, 1e4, None)
        # the tail of DeepseekV4Attention.forward, step by step
        x = mdl.apply_rotary_pos_emb(o.transpose(1, 2), cos[None], -sin[None]).transpose(1, 2)
        ref = attn.o_b_proj(attn.o_a_proj(x.reshape(1, t, cfg.o_groups, -1)).flatten(2))
    out = O.o_proj(o[0], cos, sin, cfg.qk_rope_head_dim, attn.o_a_proj.weight, attn.o_b_proj.weight, cfg.o_groups)
    close(out, ref[0], rng, "o_proj vs transformers")
    # independent: group g = heads [g*H/G, (g+1)*H/G) times wo_a rows [g*R, (g+1)*R)
    hg, r = cfg.num_attention_heads // cfg.o_groups, cfg.o_lora_rank
    od = O.rope_interleaved(o[0], cos, sin, inverse=True)
    y = torch.cat([od[:, g * hg : (g + 1) * hg].reshape(t, -1) @ attn.o_a_proj.weight[g * r : (g + 1) * r].T
                   for g in range(cfg.o_groups)], -1)
    close(out, y @ attn.o_b_proj.weight.T, rng, "explicit group loop")


def _weights(module):
    """Parameters and buffers of a transformers module under their names, in float64."""
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    return {k: (v.detach().to(F64) if v.is_floating_point() else v) for k, v in named.items()}


def _attention_oracle(attn, cfg, x, pos):
    assert torch.equal(pos, torch.arange(x.shape[0]))
    return O.attention_layer(x, _weights(attn), O.spec_from_config(cfg, attn.layer_idx))[0]


def _sliding_mask(cfg, x, pos):
    """transformers' own additive sliding-window causal mask [1, 1, T, T] (what DeepseekV4Model builds)."""
    return mdl.create_sliding_window_causal_mask(config=cfg, inputs_embeds=x[None], attention_mask=None,
                                                 past_key_values=None, position_ids=pos[None])


@pytest.mark.parametrize("window", [1, 5, 128])
def test_sliding_window_valid(rng, window):
    cfg = make_config(sliding_window=window)
    t = 9 + int(rng.ints(140, 1))
    pos = torch.arange(t)
    mask = _sliding_mask(cfg, torch.zeros(t, cfg.hidden_size), pos)[0, 0]
    valid = O.sliding_window_valid(pos, pos, window)
    assert torch.equal(valid, mask == 0), f"window {window}, T {t} (seed {rng.seed})"
    assert (valid.sum(1) == torch.clamp(pos + 1, max=window)).all(), f"seed {rng.seed}"


def _run_attention(attn, cfg, x, pos):
    rot = mdl.DeepseekV4RotaryEmbedding(cfg)
    pe = {k: rot(x, pos[None], layer_type=k) for k in ("main", "compress")}
    mask = _sliding_mask(cfg, x, pos)
    out, _ = attn(x[None], position_embeddings=pe, position_ids=pos[None], attention_mask=mask)
    return out[0]


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_attention_layer(rng, layer):
    """Whole DeepseekV4Attention (q/kv paths, compressor, indexer, sinks, o_proj) vs the oracle."""
    cfg = make_config()
    t = 21
    pos = torch.arange(t)
    with f64_transformers():
        attn = mdl.DeepseekV4Attention(cfg, layer).eval()
        rng.fill(attn)
        with torch.no_grad():
            for name, p in attn.named_parameters():
                if name.endswith("position_bias") or name.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * rng.n(*p.shape)) if "norm" in name else p.copy_(rng.n(*p.shape))
        x = rng.n(t, cfg.hidden_size)
        with torch.no_grad():
            ref = _run_attention(attn, cfg, x, pos)
    close(_attention_oracle(attn, cfg, x, pos), ref, rng, f"attention layer {attn.layer_type}", rtol=1e-9, atol=1e-11)


def test_attention_layer_float32_unshimmed(rng):
    """transformers in its native float32 path agrees with the float64 oracle to float32 accuracy."""
    cfg = make_config()
    t = 21
    pos = torch.arange(t)
    attn = mdl.DeepseekV4Attention(cfg, 2).eval()
    rng.fill(attn)
    with torch.no_grad():
        attn.compressor.position_bias.copy_(rng.n(*attn.compressor.position_bias.shape, dtype=torch.float32))
    x = rng.n(t, cfg.hidden_size, dtype=torch.float32)
    with torch.no_grad():
        ref = _run_attention(attn, cfg, x, pos)
    assert ref.dtype == torch.float32
    close(_attention_oracle(attn, cfg, x, pos), ref, rng, "float32 HCA layer", rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Compressor and indexer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [8, 128])
def test_compress_hca(rng, ratio):
    cfg = make_config(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": ratio})
    t = 3 * ratio + ratio // 2 + 1  # three closed windows and a tail
    with f64_transformers():
        c = mdl.DeepseekV4HCACompressor(cfg)
        rng.fill(c)
        with torch.no_grad():
            c.kv_norm.weight.copy_(1 + 0.3 * rng.n(cfg.head_dim))
        x = rng.n(1, t, cfg.hidden_size)
        pos = torch.arange(t)
        ref, bias = c(x, None, pos[None], None, 0)
    kv, gate = x[0] @ c.kv_proj.weight.T, x[0] @ c.gate_proj.weight.T
    base, sc = O.rope_args(cfg.rope_parameters, "compress")
    ent, epos = O.compress(kv, gate, c.position_bias, ratio, False, c.kv_norm.weight, cfg.rms_norm_eps,
                           cfg.qk_rope_head_dim, base, sc)
    assert epos.tolist() == [0, ratio, 2 * ratio], f"seed {rng.seed}"
    close(ent, ref[0, 0], rng, f"HCA entries ratio {ratio}")
    close(O.compressed_valid(pos, 3, ratio).to(F64), torch.isfinite(bias[0, 0]).to(F64), rng, "HCA causality")
    # independent: window 1 by hand (softmax per channel over its ratio tokens, norm, RoPE at ratio)
    w = torch.softmax(gate[ratio : 2 * ratio] + c.position_bias, 0)
    e1 = O.rms_norm((w * kv[ratio : 2 * ratio]).sum(0, keepdim=True), c.kv_norm.weight, cfg.rms_norm_eps)
    cs = O.rope_cos_sin(torch.tensor([ratio]), cfg.qk_rope_head_dim, base, sc)
    close(ent[1:2], O.rope_interleaved(e1, *cs), rng, "HCA window 1 by hand")


def _csa_weights(rng, cfg, module):
    rng.fill(module)
    with torch.no_grad():
        module.kv_norm.weight.copy_(1 + 0.3 * rng.n(module.kv_norm.weight.shape[0]))
        module.position_bias.copy_(rng.n(*module.position_bias.shape))


@pytest.mark.parametrize("which", ["compressor", "indexer"])
def test_compress_csa(rng, which):
    """CSA overlapping windows (compressor at head_dim, indexer at index_head_dim), one shot and
    chunked through transformers' cache (carry-over of the previous window's Ca half)."""
    cfg = make_config()
    m, t = 4, 23
    with f64_transformers():
        csa = mdl.DeepseekV4CSACompressor(cfg)
        c = csa if which == "compressor" else csa.indexer
        _csa_weights(rng, cfg, c)
        x = rng.n(1, t, cfg.hidden_size)
        qres = rng.n(1, t, cfg.q_lora_rank)
        pos = torch.arange(t)
        if which == "compressor":
            ref = csa(x, qres, pos[None], None, 0)[0][0, 0]
            # chunked: 9 + 14 tokens through a cache layer
            cache = _Cache(mdl.DeepseekV4CSACache(cfg))
            csa(x[:, :9], qres[:, :9], pos[None, :9], cache, 0)
            chunked = csa(x[:, 9:], qres[:, 9:], pos[None, 9:], cache, 0)[0][0, 0]
        else:
            ref = chunked = None
    kv, gate = x[0] @ c.kv_proj.weight.T, x[0] @ c.gate_proj.weight.T
    base, sc = O.rope_args(cfg.rope_parameters, "compress")
    args = (c.position_bias, m, True, c.kv_norm.weight, cfg.rms_norm_eps, cfg.qk_rope_head_dim, base, sc)
    ent, epos = O.compress(kv, gate, *args)
    assert ent.shape == (t // m, c.head_dim) and epos.tolist() == [0, 4, 8, 12, 16], f"seed {rng.seed}"
    if ref is not None:
        close(ent, ref, rng, "CSA entries one-shot")
        close(ent, chunked, rng, "CSA entries chunked through the cache")
    # oracle's own continuation: windows from 8 on, with window 1 as prev_window
    e2, p2 = O.compress(kv[8:], gate[8:], *args, start_pos=8, prev_window=(kv[4:8], gate[4:8]))
    assert p2.tolist() == [8, 12, 16], f"seed {rng.seed}"
    close(e2, ent[2:], rng, "CSA continuation")
    # independent: window 2 by hand = softmax over (Ca of tokens 4..7, Cb of tokens 8..11)
    d, ape = c.head_dim, c.position_bias
    lg = torch.cat((gate[4:8, :d] + ape[:, :d], gate[8:12, d:] + ape[:, d:]), 0)
    v = torch.cat((kv[4:8, :d], kv[8:12, d:]), 0)
    e = O.rms_norm((torch.softmax(lg, 0) * v).sum(0, keepdim=True), c.kv_norm.weight, cfg.rms_norm_eps)
    close(ent[2:3], O.rope_interleaved(e, *O.rope_cos_sin(torch.tensor([8]), cfg.qk_rope_head_dim, base, sc)),
          rng, "CSA window 2 by hand")
    # window 0 has no Ca half: Cb of tokens 0..3 alone
    lg0 = gate[0:4, d:] + ape[:, d:]
    e0 = O.rms_norm((torch.softmax(lg0, 0) * kv[0:4, d:]).sum(0, keepdim=True), c.kv_norm.weight, cfg.rms_norm_eps)
    close(ent[0:1], O.rope_interleaved(e0, *O.rope_cos_sin(torch.tensor([0]), cfg.qk_rope_head_dim, base, sc)),
          rng, "CSA window 0 by hand")


def test_indexer(rng):
    cfg = make_config(index_topk=3)
    m, t = 4, 22
    with f64_transformers():
        ix = mdl.DeepseekV4Indexer(cfg)
        _csa_weights(rng, cfg, ix)
        x = rng.n(1, t, cfg.hidden_size)
        qres = rng.n(1, t, cfg.q_lora_rank)
        pos = torch.arange(t)
        ref_idx = ix(x, qres, pos[None], None, 0)[0]
        # scorer module alone
        q = rng.n(1, t, ix.num_heads, ix.head_dim)
        k = rng.n(1, 5, ix.head_dim)
        ref_sc = ix.scorer(q, k, x)[0]
    w = x[0] @ ix.scorer.weights_proj.weight.T
    close(O.indexer_scores(q[0], w, k[0], ix.head_dim**-0.5, ix.num_heads**-0.5), ref_sc, rng, "indexer scores")
    # independent: loop over heads
    sc = sum(w[:, h, None] * ix.num_heads**-0.5 * torch.relu(q[0, :, h] @ k[0].T) * ix.head_dim**-0.5
             for h in range(ix.num_heads))
    close(O.indexer_scores(q[0], w, k[0], ix.head_dim**-0.5, ix.num_heads**-0.5), sc, rng, "indexer by hand")
    # full indexer: compressed keys + rotated queries + scores + causal top-k
    base, scl = O.rope_args(cfg.rope_parameters, "compress")
    rd = cfg.qk_rope_head_dim
    ik, _ = O.compress(x[0] @ ix.kv_proj.weight.T, x[0] @ ix.gate_proj.weight.T, ix.position_bias, m, True,
                       ix.kv_norm.weight, cfg.rms_norm_eps, rd, base, scl)
    iq = O.rope_interleaved((qres[0] @ ix.q_b_proj.weight.T).reshape(t, ix.num_heads, ix.head_dim),
                            *O.rope_cos_sin(pos, rd, base, scl))
    idx = O.indexer_topk(O.indexer_scores(iq, w, ik, ix.head_dim**-0.5, ix.num_heads**-0.5), pos, m, 3)
    assert idx.shape == ref_idx.shape == (t, 3), f"seed {rng.seed}"
    for r in range(t):
        assert set(idx[r].tolist()) == set(ref_idx[r].tolist()), f"row {r}: {idx[r]} vs {ref_idx[r]} (seed {rng.seed})"
    assert (idx[:3] == -1).all() and (idx[-1] >= 0).all(), f"causal -1 sentinels (seed {rng.seed})"


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------


def _moe_block(rng, cfg, layer, limit_hit=True):
    blk = mdl.DeepseekV4SparseMoeBlock(cfg, layer)
    rng.fill(blk)
    with torch.no_grad():
        blk.experts.gate_up_proj.copy_(rng.n(*blk.experts.gate_up_proj.shape, std=1.0))
        blk.experts.down_proj.copy_(rng.n(*blk.experts.down_proj.shape, std=0.3))
        if not blk.is_hash:
            blk.gate.e_score_correction_bias.copy_(rng.n(cfg.n_routed_experts, std=0.5))
    return blk


def _experts(blk, cfg):
    i = cfg.moe_intermediate_size
    gu = blk.experts.gate_up_proj
    sh = blk.shared_experts
    return (gu[:, :i], gu[:, i:], blk.experts.down_proj), (sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_moe(rng, scoring):
    cfg = make_config(scoring_func=scoring, swiglu_limit=1.5, routed_scaling_factor=1.7)
    t = 13
    with f64_transformers():
        blk = _moe_block(rng, cfg, 1)
        x = rng.n(1, t, cfg.hidden_size, std=2.0)
        ref = blk(x)[0]
        _, ref_w, ref_idx = blk.gate(x)
    experts, shared = _experts(blk, cfg)
    args = (blk.gate.weight, blk.gate.e_score_correction_bias, experts, shared, cfg.num_experts_per_tok,
            cfg.routed_scaling_factor, scoring, True, cfg.swiglu_limit)
    out, chosen, margin = O.moe(x[0], *args)
    close(out, ref, rng, f"moe {scoring}")
    assert torch.equal(chosen.sort(-1).values, ref_idx.sort(-1).values), f"chosen experts (seed {rng.seed})"
    # margin = key gap at the top-k boundary; bias enters the key (choice) only
    s = O.router_scores(x[0] @ blk.gate.weight.T, scoring)
    key = s + blk.gate.e_score_correction_bias
    kth = key.gather(1, chosen).min(-1).values
    rest = key.masked_fill(torch.zeros_like(key, dtype=torch.bool).scatter_(1, chosen, True), float("-inf"))
    close(margin, kth - rest.max(-1).values, rng, "margin")
    assert (margin >= 0).all(), f"seed {rng.seed}"
    w = s.gather(1, chosen)
    close(ref_w.gather(1, ref_idx.argsort(-1).argsort(-1)).sort(-1).values,
          (w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor).sort(-1).values, rng, "weights from unbiased scores")
    # the clamp is live in this configuration (the test could catch a missing clamp)
    out_nc, _, _ = O.moe(x[0], *args[:-1], None)
    assert not torch.allclose(out_nc, out), f"swiglu_limit had no effect (seed {rng.seed})"
    # independent: softmax scoring (transformers' ACT2FN has no 'softmax'; checked by hand)
    o_sm, c_sm, _ = O.moe(x[0], blk.gate.weight, None, experts, None, 2, 1.0, "softmax", True, 1.5)
    p = torch.softmax(x[0] @ blk.gate.weight.T, -1)
    top = p.topk(2, -1)
    wn = top.values / top.values.sum(-1, keepdim=True)
    by_hand = torch.stack([sum(wn[r, k] * O.swiglu(x[0, r : r + 1], experts[0][e], experts[1][e], experts[2][e], 1.5)[0]
                               for k, e in enumerate(top.indices[r].tolist())) for r in range(t)])
    close(o_sm, by_hand, rng, "softmax scoring by hand")


def test_moe_hash(rng):
    cfg = make_config(swiglu_limit=1.5)
    t = 11
    with f64_transformers():
        blk = _moe_block(rng, cfg, 0)
        assert blk.is_hash
        tid2eid = torch.stack([torch.randperm(cfg.n_routed_experts, generator=rng.g)[: cfg.num_experts_per_tok]
                               for _ in range(cfg.vocab_size)])
        blk.gate.tid2eid.copy_(tid2eid)
        ids = rng.ints(cfg.vocab_size, 1, t)
        x = rng.n(1, t, cfg.hidden_size, std=2.0)
        ref = blk(x, input_ids=ids)[0]
    experts, shared = _experts(blk, cfg)
    out, chosen = O.moe_hash(x[0], ids[0], tid2eid, blk.gate.weight, experts, shared, cfg.routed_scaling_factor,
                             cfg.scoring_func, True, cfg.swiglu_limit)
    close(out, ref, rng, "hash moe")
    assert torch.equal(chosen, tid2eid[ids[0]]), f"seed {rng.seed}"


# ----------------------------------------------------------------------------------------------
# mHC
# ----------------------------------------------------------------------------------------------


def _hc(rng, cfg):
    hc = mdl.DeepseekV4HyperConnection(cfg)
    rng.fill(hc)
    with torch.no_grad():
        hc.fn.mul_(3.0)
        hc.base.copy_(rng.n(*hc.base.shape))
        hc.scale.copy_(1 + 0.5 * rng.n(3))
    return hc


def test_mhc_coeffs(rng):
    cfg = make_config()
    n, t = cfg.hc_mult, 9
    with f64_transformers():
        hc = _hc(rng, cfg)
        s = rng.n(1, t, n, cfg.hidden_size, std=2.0)
        post_t, comb_t, coll_t = hc(s)
    pre, post, comb = O.mhc_coeffs(s[0], hc.fn, hc.base, hc.scale, cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters)
    close(post, post_t[0], rng, "post")
    close(comb, comb_t[0], rng, "comb")
    close(O.mhc_collapse(s[0], pre), coll_t[0], rng, "collapse (pre)")
    # independent: pre in (eps, 1+eps), post in (0, 2), comb ~ doubly stochastic after Sinkhorn
    assert (pre > cfg.hc_eps).all() and (pre < 1 + cfg.hc_eps).all() and (post > 0).all() and (post < 2).all()
    close(comb.sum(1), torch.ones(t, n, dtype=F64), rng, "comb column sums", rtol=0, atol=1e-5)
    close(comb.sum(2), torch.ones(t, n, dtype=F64), rng, "comb row sums", rtol=0, atol=5e-2)
    # Sinkhorn converges (linearly, slowly for peaked inputs): many more iterations shrink the
    # row-sum error, and never grow it
    _, _, comb_inf = O.mhc_coeffs(s[0], hc.fn, hc.base, hc.scale, cfg.hc_eps, cfg.rms_norm_eps, 2000)
    err, err_inf = (comb.sum(2) - 1).abs().max(), (comb_inf.sum(2) - 1).abs().max()
    assert err_inf <= err and err_inf < 1e-2, f"Sinkhorn does not converge: {err} -> {err_inf} (seed {rng.seed})"
    assert not torch.allclose(comb, comb.transpose(1, 2), atol=1e-3), f"comb symmetric? (seed {rng.seed})"


class _FixedOut(torch.nn.Module):
    """Stand-in block that records its input and returns a fixed output."""

    def __init__(self, out, attn):
        super().__init__()
        self.out, self.attn, self.seen = out, attn, None

    def forward(self, x, **kw):
        self.seen = x
        return (self.out, None) if self.attn else self.out


def test_mhc_expand_in_decoder_layer(rng):
    """DeepseekV4DecoderLayer with stand-in attention / MoE: collapse -> norm -> block -> expand twice."""
    cfg = make_config()
    n, t, dm = cfg.hc_mult, 7, cfg.hidden_size
    with f64_transformers():
        layer = mdl.DeepseekV4DecoderLayer(cfg, 1)
        layer.attn_hc, layer.ffn_hc = _hc(rng, cfg), _hc(rng, cfg)
        with torch.no_grad():
            layer.input_layernorm.weight.copy_(1 + 0.3 * rng.n(dm))
            layer.post_attention_layernorm.weight.copy_(1 + 0.3 * rng.n(dm))
        a_out, m_out = rng.n(1, t, dm), rng.n(1, t, dm)
        layer.self_attn, layer.mlp = _FixedOut(a_out, True), _FixedOut(m_out, False)
        s = rng.n(1, t, n, dm)
        ref = layer(s)[0]
    eps, it = cfg.rms_norm_eps, cfg.hc_sinkhorn_iters
    hc = layer.attn_hc
    pre, post, comb = O.mhc_coeffs(s[0], hc.fn, hc.base, hc.scale, cfg.hc_eps, eps, it)
    close(O.rms_norm(O.mhc_collapse(s[0], pre), layer.input_layernorm.weight, eps), layer.self_attn.seen[0], rng,
          "attention block input")
    s1 = O.mhc_expand(a_out[0], s[0], post, comb)
    hc = layer.ffn_hc
    pre, post, comb = O.mhc_coeffs(s1, hc.fn, hc.base, hc.scale, cfg.hc_eps, eps, it)
    close(O.rms_norm(O.mhc_collapse(s1, pre), layer.post_attention_layernorm.weight, eps), layer.mlp.seen[0], rng,
          "MoE block input")
    out = O.mhc_expand(m_out[0], s1, post, comb)
    close(out, ref, rng, "decoder layer streams")
    # orientation matters: the transposed comb gives a different answer
    wrong = O.mhc_expand(m_out[0], s1, post, comb.transpose(1, 2))
    assert not torch.allclose(wrong, ref), f"comb orientation not exercised (seed {rng.seed})"
    # independent: stream k by hand
    k = 1
    by_hand = post[:, k, None] * m_out[0] + sum(comb[:, j, k, None] * s1[:, j] for j in range(n))
    close(out[:, k], by_hand, rng, "new_k = post_k*out + sum_j comb[j,k] x_j")


def test_hyper_head(rng):
    cfg = make_config()
    n, t = cfg.hc_mult, 8
    with f64_transformers():
        hh = mdl.DeepseekV4HyperHead(cfg)
        rng.fill(hh)
        with torch.no_grad():
            hh.hc_fn.mul_(3.0)
            hh.hc_base.copy_(rng.n(n))
            hh.hc_scale.copy_(1 + 0.5 * rng.n(1))
        s = rng.n(1, t, n, cfg.hidden_size, std=2.0)
        ref = hh(s)[0]
    out = O.hyper_head(s[0], hh.hc_fn, hh.hc_base, hh.hc_scale, cfg.hc_eps, cfg.rms_norm_eps)
    close(out, ref, rng, "hyper head")
    # independent: weights lie in (eps, 1+eps), so the output is a sub-convex mix of the streams
    y = O.rms_norm(s[0].reshape(t, -1), None, cfg.rms_norm_eps) @ hh.hc_fn.T
    pre = torch.sigmoid(y * hh.hc_scale + hh.hc_base) + cfg.hc_eps
    close(out, torch.einsum("tn,tnd->td", pre, s[0]), rng, "hyper head by hand")


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding+hash", "csa+moe", "hca+moe"])
def test_decoder_layer(rng, layer):
    """Whole DeepseekV4DecoderLayer (mHC, norms, attention, MoE) vs oracle.decoder_layer."""
    cfg = make_config(swiglu_limit=2.0)
    t, n = 18, cfg.hc_mult
    pos = torch.arange(t)
    with f64_transformers():
        dl = mdl.DeepseekV4DecoderLayer(cfg, layer).eval()
        rng.fill(dl)
        dl.attn_hc, dl.ffn_hc = _hc(rng, cfg), _hc(rng, cfg)
        with torch.no_grad():
            for name, p in dl.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * rng.n(*p.shape))
                elif name.endswith("position_bias"):
                    p.copy_(rng.n(*p.shape))
            dl.mlp.experts.gate_up_proj.copy_(rng.n(*dl.mlp.experts.gate_up_proj.shape))
            if dl.mlp.is_hash:
                dl.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=rng.g)[:2]
                                                       for _ in range(cfg.vocab_size)]))
            else:
                dl.mlp.gate.e_score_correction_bias.copy_(rng.n(cfg.n_routed_experts, std=0.3))
        ids = rng.ints(cfg.vocab_size, 1, t)
        s = rng.n(1, t, n, cfg.hidden_size)
        rot = mdl.DeepseekV4RotaryEmbedding(cfg)
        pe = {k: rot(s, pos[None], layer_type=k) for k in ("main", "compress")}
        with torch.no_grad():
            ref = dl(s, input_ids=ids, position_embeddings=pe, position_ids=pos[None],
                     attention_mask=_sliding_mask(cfg, s[0, :, 0], pos))[0]
    out, parts = O.decoder_layer(s[0], _weights(dl), O.spec_from_config(cfg, layer), input_ids=ids[0])
    close(out, ref, rng, f"decoder layer {layer}", rtol=1e-9, atol=1e-11)
    assert parts["chosen"].shape == (t, cfg.num_experts_per_tok), f"seed {rng.seed}"
