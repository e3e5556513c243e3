"""Float64 oracle for DeepSeek-V4 / V4.1 layer math (pure torch, explicit tensor arguments).

Written from the published model math (paper + the transformers `deepseek_v4` reference in
transformers 5.20.2); independent of vLLM and of dsv4_ops. Every function up-casts its tensor
inputs to float64 and returns float64 (index outputs: int64). `tests/e2e/test_oracle.py`
checks each function against the transformers modules at float64.

Conventions (all checked against transformers by test_oracle.py):
- Head layout `[nope | rope]`: RoPE rotates the LAST `rope_dim` channels.
- RoPE is GPT-J interleaved: pairs (2i, 2i+1) rotate by angle pos * inv_freq[i]. transformers'
  `rotate_half` in deepseek_v4 is already the interleaved form (x[0::2], x[1::2]), so checkpoint
  weights need no permutation; a NeoX (half-split) kernel would need the de-interleave
  permutation `neox_permutation` on the rope channels of q and k.
- Two RoPE flavours: "main" (sliding-only layers: default RoPE, theta=rope_theta=1e4) and
  "compress" (CSA/HCA layers: attention q/k, compressor entries and indexer q/k:
  theta=compress_rope_theta=1.6e5, with the config's YaRN scaling, attention_factor forced to 1).
- Attention scale = head_dim**-0.5; per-head sink logit enlarges the softmax denominator only.
- The attention output's rope slice is de-rotated at the QUERY position (inverse RoPE) before
  the grouped output projection; group g = heads [g*H/G, (g+1)*H/G), head-major flattening.
- Compressed entry w covers source tokens [w*m, (w+1)*m) (plus the previous window for CSA)
  and is RoPE'd at position start_pos + w*m (its window's FIRST token). Query at position t may
  use entry w iff w < (t+1) // m (the window is closed at or before t).
- mHC comb[j, k]: j = input (residual) stream, k = output stream: new_k = post_k*out + sum_j comb[j,k] x_j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(F64)


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x [..., D]; weight [D] or None (unweighted) -> [..., D] f64.

    y = x / sqrt(mean(x^2) + eps) * weight
    """
    x = _f64(x)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * _f64(weight)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def rope_inv_freq(rope_dim: int, base: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] f64 and the cos/sin multiplier (YaRN attention_factor).

    default: inv_freq[i] = base^(-2i/rope_dim).
    yarn (scaling["rope_type" or "type"] == "yarn"; keys factor, original_max_position_embeddings,
    beta_fast=32, beta_slow=1, truncate=True, attention_factor, mscale, mscale_all_dim):
      low/high = correction dims for beta_fast/beta_slow rotations (floor/ceil if truncate),
      ramp[i] = clamp((i - low)/(high - low), 0, 1),
      inv_freq = (inv/factor)*ramp + inv*(1 - ramp)   (high-frequency dims kept, low ones scaled),
      attention_factor defaults to 0.1*ln(factor)+1 (or the mscale ratio); V4's config sets 1.0.
    Keys rope_theta / partial_rotary_factor in `scaling` are ignored (pass base/rope_dim).
    """
    idx = torch.arange(0, rope_dim, 2, dtype=F64)
    inv = 1.0 / (float(base) ** (idx / rope_dim))
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind != "yarn":
        raise NotImplementedError(f"rope type {kind!r}")
    factor = float(scaling["factor"])
    orig = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    att = scaling.get("attention_factor")
    if att is None:
        ms, msa = scaling.get("mscale"), scaling.get("mscale_all_dim")
        att = mscale(factor, ms) / mscale(factor, msa) if (ms and msa) else mscale(factor)

    def corr_dim(n_rot):  # dim index whose wavelength makes n_rot turns over `orig` positions
        return rope_dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
    return (inv / factor) * ramp + inv * (1 - ramp), float(att)


def rope_cos_sin(
    positions: torch.Tensor, rope_dim: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rope_dim/2] f64 for integer positions [n] (one angle per interleaved pair).

    angle[p, i] = positions[p] * inv_freq[i];  cos = cos(angle) * att, sin = sin(angle) * att
    (att = YaRN attention_factor, 1 for default RoPE and for V4's compress rope).
    For a V4 config use `rope_args(config.rope_parameters, "main"|"compress")` for base/scaling.
    """
    inv, att = rope_inv_freq(rope_dim, base, scaling)
    ang = _f64(positions).reshape(-1, 1) * inv
    return ang.cos() * att, ang.sin() * att


def rope_args(rope_parameters: dict, kind: str) -> tuple[float, dict | None]:
    """(base, scaling) for rope_cos_sin from a DeepseekV4Config.rope_parameters[kind] dict
    (kind 'main' = sliding-only layers, 'compress' = CSA/HCA layers and their compressor/indexer)."""
    p = rope_parameters[kind]
    return float(p["rope_theta"]), (None if p.get("rope_type", "default") == "default" else dict(p))


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope_dim = 2*cos.shape[-1] channels of x in GPT-J pairs (2i, 2i+1).

    x [T, ..., D] (e.g. [T, H, D] or [T, D]); cos/sin [T, rope_dim/2] broadcast over the middle dims.
      y[2i]   = x[2i] cos_i - x[2i+1] sin_i
      y[2i+1] = x[2i] sin_i + x[2i+1] cos_i
    inverse=True rotates by -angle (sin -> -sin). Leading D - rope_dim channels pass through.
    """
    x, cos, sin = _f64(x), _f64(cos), _f64(sin)
    half = cos.shape[-1]
    rd = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    r = x[..., -rd:]
    even, odd = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rot), dim=-1)


def neox_permutation(rope_dim: int) -> torch.Tensor:
    """Channel permutation p [rope_dim] with x_neox = x_interleaved[..., p]: evens first, then odds.
    rope_interleaved(x) == rope_neox(x[..., p])[..., argsort(p)] (test_oracle checks it)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """NeoX (half-split) RoPE on the last 2*cos.shape[-1] channels: pairs (i, i + rope_dim/2).
    Only for documenting the layout relation (see neox_permutation); V4 uses rope_interleaved."""
    x, cos, sin = _f64(x), _f64(cos), _f64(sin)
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    r = x[..., -2 * half :]
    a, b = r[..., :half], r[..., half:]
    return torch.cat((x[..., : -2 * half], a * c - b * s, a * s + b * c), dim=-1)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query sparse MQA with K = V (MLA latent) and an optional per-head sink logit.

    q [T, H, D]; keys [T, K, D] (query t's candidate entries, also the values); valid [T, K] bool;
    sink [H] or None; scale (V4: head_dim**-0.5).
      l[t,h,k] = scale * q[t,h] . keys[t,k]         (only valid k)
      lse[t,h] = log(sum_k exp(l) + exp(sink[h]))   (sink term absent if sink is None)
      out[t,h] = sum_k exp(l[t,h,k] - lse[t,h]) * keys[t,k]   (sink has no value)
    Returns out [T, H, D] f64, lse [T, H] f64. No valid key: out = 0, lse = sink[h] (or -inf).
    """
    q, keys = _f64(q), _f64(keys)
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid.bool()[:, None, :], float("-inf"))
    if sink is not None:
        col = _f64(sink).reshape(1, -1, 1).expand(q.shape[0], -1, 1)
        full = torch.cat((logits, col), dim=-1)
    else:
        full = logits
    lse = torch.logsumexp(full, dim=-1)  # -inf on rows with nothing
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(logits - safe[..., None])  # exp(-inf) = 0 on masked keys
    out = torch.einsum("thk,tkd->thd", p, keys)
    return out, lse


def sliding_window_valid(positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """valid [T, K] bool for the sliding-window branch: key position j visible to query t iff
    t - window < j <= t (window keys including t itself; transformers' sliding causal mask)."""
    t = positions.reshape(-1, 1)
    j = key_positions.reshape(1, -1)
    return (j <= t) & (j > t - window)


def compressed_valid(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """valid [T, n_entries] bool: compressed entry w visible to query position t iff
    w < (t + 1) // ratio, i.e. its window [w*ratio, (w+1)*ratio) ends at or before t."""
    w = torch.arange(n_entries).reshape(1, -1)
    return w < (positions.reshape(-1, 1) + 1) // ratio


def o_proj(
    o: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    wo_a: torch.Tensor,
    wo_b: torch.Tensor,
    n_groups: int,
) -> torch.Tensor:
    """Grouped output projection. o [T, H, D]; cos/sin [T, rope_dim/2] at the QUERY positions;
    wo_a [G*R, (H/G)*D]; wo_b [hidden, G*R] -> [T, hidden] f64.

      o'   = inverse RoPE on the last rope_dim channels of every head (angle -pos*inv_freq)
      x_g  = concat(o'[:, g*H/G], ..., o'[:, (g+1)*H/G - 1])      [T, (H/G)*D], head-major
      y_g  = x_g @ wo_a[g*R:(g+1)*R].T                             [T, R]
      out  = concat_g(y_g) @ wo_b.T
    """
    assert cos.shape[-1] * 2 == rope_dim
    t, h, d = o.shape
    g = n_groups
    o = rope_interleaved(o, cos, sin, inverse=True)
    x = o.reshape(t, g, (h // g) * d)
    wa = _f64(wo_a).reshape(g, -1, (h // g) * d)  # [G, R, in]
    y = torch.einsum("tgi,gri->tgr", x, wa).reshape(t, -1)
    return y @ _f64(wo_b).T


# ----------------------------------------------------------------------------------------------
# Compressor and indexer
# ----------------------------------------------------------------------------------------------


def compress_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor | None,
    ratio: int,
    overlap: bool,
    prev_window: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The gated pooling step of `compress` (before its RMSNorm and RoPE): [n // m, D] f64.
    kv, gate [n, D'] as in `compress`; ape [ratio, D'] or None (no position bias: V4.1)."""
    kv, gate = _f64(kv), _f64(gate)
    ape = 0.0 if ape is None else _f64(ape)
    m = ratio
    nw = kv.shape[0] // m
    dp = kv.shape[-1]
    d = dp // 2 if overlap else dp
    kvw = kv[: nw * m].reshape(nw, m, dp)
    lgw = gate[: nw * m].reshape(nw, m, dp) + ape
    if overlap:
        if prev_window is not None:
            pkv = _f64(prev_window[0]).reshape(1, m, dp)
            plg = _f64(prev_window[1]).reshape(1, m, dp) + ape
        else:
            pkv = torch.zeros(1, m, dp, dtype=F64)
            plg = torch.full((1, m, dp), float("-inf"), dtype=F64)
        prev_kv = torch.cat((pkv, kvw[:-1]), 0)[..., :d]  # Ca of window w-1
        prev_lg = torch.cat((plg, lgw[:-1]), 0)[..., :d]
        kvw = torch.cat((prev_kv, kvw[..., d:]), dim=1)  # [nw, 2m, D]
        lgw = torch.cat((prev_lg, lgw[..., d:]), dim=1)
    c = (torch.softmax(lgw, dim=1) * kvw).sum(dim=1)
    return c


def compress(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    norm_weight: torch.Tensor,
    eps: float,
    rope_dim: int,
    rope_base: float,
    rope_scaling: dict | None,
    start_pos: int = 0,
    prev_window: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed entries for every CLOSED window of the source tokens.

    kv, gate [n, D'] (the compressor's kv_proj / gate_proj outputs for tokens start_pos ..
    start_pos+n-1, start_pos a multiple of ratio); ape [ratio, D'] (position_bias);
    norm_weight [D] (kv_norm); D' = D (HCA, overlap=False) or 2D (CSA/indexer, overlap=True).
    Window w = tokens [w*m, (w+1)*m) (m = ratio), only the n // m complete ones; the tail is dropped.
      HCA:  c_w = sum_{j<m} softmax_j(gate[w,j] + ape[j]) * kv[w,j]          (softmax per channel)
      CSA:  Ca = [..., :D], Cb = [..., D:] of every token; over 2m slots
            slots = (Ca of window w-1, Cb of window w), logits = gate + ape of the same slice,
            c_w = sum_slots softmax(logits) * kv. For w = 0 the Ca half comes from prev_window
            (raw (kv, gate) [m, D'] of the window before start_pos), else it has weight 0.
      entry_w = RoPE_interleaved(rms_norm(c_w, norm_weight, eps)) at position start_pos + w*m
            (compress rope: rope_cos_sin(pos, rope_dim, rope_base, rope_scaling)).
    Returns entries [n // m, D] f64 and their positions [n // m] int64 (= window first tokens).
    """
    c = compress_pool(kv, gate, ape, ratio, overlap, prev_window)
    c = rms_norm(c, norm_weight, eps)
    pos = start_pos + torch.arange(c.shape[0], dtype=torch.long) * ratio
    cos, sin = rope_cos_sin(pos, rope_dim, rope_base, rope_scaling)
    return rope_interleaved(c, cos, sin), pos


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, softmax_scale: float, weights_scale: float
) -> torch.Tensor:
    """Lightning-indexer scores. q [T, Hi, d] (RoPE'd at query positions, compress rope, no norm);
    weights [T, Hi] (weights_proj(hidden)); k [N, d] (indexer compressed entries) -> [T, N] f64.

      score[t, s] = sum_h (weights[t,h] * weights_scale) * (relu(q[t,h] . k[s]) * softmax_scale)
    transformers: softmax_scale = index_head_dim**-0.5 multiplies relu(q.k), weights_scale =
    index_n_heads**-0.5 multiplies the head weights (both positive, so placement is immaterial).
    """
    s = torch.relu(torch.einsum("thd,nd->thn", _f64(q), _f64(k))) * softmax_scale
    w = _f64(weights) * weights_scale
    return (s * w[..., None]).sum(dim=1)


def indexer_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """Top-k compressed entries per query. scores [T, N]; positions [T] -> idx [T, min(topk, N)] int64,
    by descending score, entries not yet closed (w >= (t+1)//ratio) replaced by -1
    (transformers' DeepseekV4Indexer selection). Ties make the order/set ambiguous: compare sets."""
    n = scores.shape[-1]
    ok = compressed_valid(positions, n, ratio)
    s = _f64(scores).masked_fill(~ok, float("-inf"))
    idx = s.topk(min(topk, n), dim=-1).indices
    bad = ~torch.gather(ok, 1, idx)
    return torch.where(bad, torch.full_like(idx, -1), idx)


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Expert affinities from router logits [T, E]: sqrtsoftplus = sqrt(log(1+e^x)),
    sigmoid, or softmax over experts."""
    logits = _f64(logits)
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(scoring)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU FFN. x [T, Dm]; w1, w3 [I, Dm] (gate, up); w2 [Dm, I] -> [T, Dm] f64.
    g = x w1^T clamped to (-inf, limit]; u = x w3^T clamped to [-limit, limit]; y = (silu(g) * u) w2^T.
    limit None or <= 0: no clamp. (transformers' gate_up_proj[e] = cat(w1, w3) along rows.)"""
    x = _f64(x)
    g = x @ _f64(w1).T
    u = x @ _f64(w3).T
    if limit is not None and limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return (torch.nn.functional.silu(g) * u) @ _f64(w2).T


def _moe_combine(x, scores, chosen, experts, shared, routed_scaling_factor, norm_topk_prob, swiglu_limit,
                 shared_swiglu_limit):
    w = torch.gather(scores, 1, chosen)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * routed_scaling_factor
    w1, w3, w2 = experts
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        rows, slot = torch.where(chosen == e)
        y = swiglu(x[rows], w1[e], w3[e], w2[e], swiglu_limit)
        out.index_add_(0, rows, y * w[rows, slot, None])
    if shared is not None:
        out = out + swiglu(x, *shared, shared_swiglu_limit)
    return out, w


def moe(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    gate_bias: torch.Tensor | None,
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    topk: int,
    routed_scaling_factor: float,
    scoring: str = "sqrtsoftplus",
    norm_topk_prob: bool = True,
    swiglu_limit: float | None = 10.0,
    shared_swiglu_limit: float | None | str = "same",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routed MoE + shared expert. x [T, Dm]; gate_w [E, Dm]; gate_bias [E] or None
    (e_score_correction_bias); experts = (w1 [E, I, Dm], w3 [E, I, Dm], w2 [E, Dm, I]);
    shared = (w1 [Is, Dm], w3 [Is, Dm], w2 [Dm, Is]) or None.

      s      = score_fn(x gate_w^T)                       [T, E]
      chosen = topk_e(s + bias)                           (bias used ONLY for the choice)
      w      = s[chosen] / (sum s[chosen] + 1e-20) if norm_topk_prob else s[chosen];  w *= rsf
      out    = sum_k w_k * swiglu_{chosen_k}(x) + swiglu_shared(x)
    shared_swiglu_limit "same" (default) = swiglu_limit, as transformers' DeepseekV4MLP clamps.
    Returns out [T, Dm] f64, chosen [T, topk] int64 (descending key), margin [T] f64 =
    key[topk-th] - key[(topk+1)-th] (inf if topk == E): a small margin means a near-tie choice.
    """
    x = _f64(x)
    scores = router_scores(x @ _f64(gate_w).T, scoring)
    key = scores if gate_bias is None else scores + _f64(gate_bias)
    srt = key.sort(dim=-1, descending=True)
    chosen = srt.indices[:, :topk]
    if topk < key.shape[-1]:
        margin = srt.values[:, topk - 1] - srt.values[:, topk]
    else:
        margin = torch.full((x.shape[0],), float("inf"), dtype=F64)
    ssl = swiglu_limit if shared_swiglu_limit == "same" else shared_swiglu_limit
    out, _ = _moe_combine(x, scores, chosen, experts, shared, routed_scaling_factor, norm_topk_prob,
                          swiglu_limit, ssl)
    return out, chosen, margin


def moe_hash(
    x: torch.Tensor,
    input_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    gate_w: torch.Tensor,
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    routed_scaling_factor: float,
    scoring: str = "sqrtsoftplus",
    norm_topk_prob: bool = True,
    swiglu_limit: float | None = 10.0,
    shared_swiglu_limit: float | None | str = "same",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash-routed MoE (first `hash_moe` layers). x [T, Dm]; input_ids [T] int; tid2eid [V, topk]:
    chosen = tid2eid[input_ids] (fixed table, no bias, no learned choice); the weights still come
    from the learned gate: w = s[chosen] normalised (+1e-20) * rsf, s = score_fn(x gate_w^T).
    Returns out [T, Dm] f64 and chosen [T, topk] int64."""
    x = _f64(x)
    scores = router_scores(x @ _f64(gate_w).T, scoring)
    chosen = tid2eid[input_ids.reshape(-1)].long()
    ssl = swiglu_limit if shared_swiglu_limit == "same" else shared_swiglu_limit
    out, _ = _moe_combine(x, scores, chosen, experts, shared, routed_scaling_factor, norm_topk_prob,
                          swiglu_limit, ssl)
    return out, chosen


# ----------------------------------------------------------------------------------------------
# Manifold-constrained hyper-connections (mHC)
# ----------------------------------------------------------------------------------------------


def mhc_coeffs(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC mixing weights. streams [T, N, D]; fn [(2+N)*N, N*D]; base [(2+N)*N]; scale [3]
    -> pre [T, N], post [T, N], comb [T, N, N] (f64).

      y    = rms_norm(flatten(streams), None, norm_eps) @ fn^T     split as [N | N | N*N]
      pre  = sigmoid(scale0 * y_pre + base_pre) + hc_eps
      post = 2 * sigmoid(scale1 * y_post + base_post)
      comb = softmax_k(scale2 * y_comb[j,k] + base_comb[j,k]) + hc_eps   (row j, softmax over k)
      Sinkhorn: comb /= (col sums + hc_eps); then (iters-1) x [comb /= (row sums + hc_eps);
                comb /= (col sums + hc_eps)]   (col sum = sum over j, row sum = sum over k)
    comb[t, j, k]: j = input stream, k = output stream (see mhc_expand).
    """
    t, n, d = streams.shape
    y = rms_norm(_f64(streams).reshape(t, n * d), None, norm_eps) @ _f64(fn).T
    base, scale = _f64(base), _f64(scale)
    pre = torch.sigmoid(y[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(y[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logit = y[:, 2 * n :].reshape(t, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = torch.softmax(logit, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=1, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=2, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=1, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Block input from the streams. streams [T, N, D]; pre [T, N] -> [T, D]: x = sum_n pre_n * s_n."""
    return (_f64(pre)[..., None] * _f64(streams)).sum(dim=1)


def mhc_expand(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams after a block. block_out [T, D]; streams [T, N, D]; post [T, N]; comb [T, N, N]
    -> [T, N, D]:  new[t, k] = post[t, k] * block_out[t] + sum_j comb[t, j, k] * streams[t, j]."""
    return _f64(post)[..., None] * _f64(block_out)[:, None, :] + torch.einsum(
        "tjk,tjd->tkd", _f64(comb), _f64(streams)
    )


def hyper_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float
) -> torch.Tensor:
    """Final stream collapse before the model norm. streams [T, N, D]; fn [N, N*D]; base [N];
    scale [1] -> [T, D]:  pre = sigmoid(scale * (rms_norm(flatten(streams)) @ fn^T) + base) + eps;
    out = sum_n pre_n * streams_n."""
    t, n, d = streams.shape
    y = rms_norm(_f64(streams).reshape(t, n * d), None, norm_eps) @ _f64(fn).T
    pre = torch.sigmoid(y * _f64(scale).reshape(-1)[0] + _f64(base)) + eps
    return mhc_collapse(streams, pre)


# ----------------------------------------------------------------------------------------------
# Whole layers (compositions of the functions above, checked against transformers' modules)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """Scalars of one V4 decoder layer. attention: 'sliding_attention' | 'compressed_sparse_attention'
    | 'heavily_compressed_attention'; rope_main / rope_compress: (base, scaling) as from rope_args."""

    attention: str
    n_heads: int
    head_dim: int
    rope_dim: int
    eps: float
    sliding_window: int
    o_groups: int
    rope_main: tuple
    rope_compress: tuple
    compress_ratio: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    hc_eps: float = 1e-6
    sinkhorn_iters: int = 20
    topk: int = 0
    routed_scaling_factor: float = 1.0
    scoring: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    swiglu_limit: float | None = None
    hash_moe: bool = False


def spec_from_config(config, layer_idx: int) -> LayerSpec:
    """LayerSpec from a transformers DeepseekV4Config (its attribute names) for layer `layer_idx`."""
    lt = config.layer_types[layer_idx]
    return LayerSpec(
        attention=lt,
        n_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        rope_dim=config.qk_rope_head_dim,
        eps=config.rms_norm_eps,
        sliding_window=config.sliding_window,
        o_groups=config.o_groups,
        rope_main=rope_args(config.rope_parameters, "main"),
        rope_compress=rope_args(config.rope_parameters, "compress"),
        compress_ratio=0 if lt == "sliding_attention" else config.compress_rates[lt],
        index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim,
        index_topk=config.index_topk,
        hc_eps=config.hc_eps,
        sinkhorn_iters=config.hc_sinkhorn_iters,
        topk=config.num_experts_per_tok,
        routed_scaling_factor=config.routed_scaling_factor,
        scoring=config.scoring_func,
        norm_topk_prob=config.norm_topk_prob,
        swiglu_limit=config.swiglu_limit,
        hash_moe=config.mlp_layer_types[layer_idx] == "hash_moe",
    )


def attention_layer(x: torch.Tensor, w: dict, spec: LayerSpec) -> tuple[torch.Tensor, dict]:
    """One V4 attention block over a whole sequence from position 0 (prefill semantics).

    x [T, hidden] (the block input, i.e. after input_layernorm), token t at position t.
    w: tensors under transformers' names relative to `self_attn.`: q_a_proj.weight, q_a_norm.weight,
    q_b_proj.weight, kv_proj.weight, kv_norm.weight, o_a_proj.weight, o_b_proj.weight, sinks;
    CSA/HCA: compressor.{kv_proj.weight, gate_proj.weight, position_bias, kv_norm.weight};
    CSA: compressor.indexer.{kv_proj.weight, gate_proj.weight, position_bias, kv_norm.weight,
    q_b_proj.weight, scorer.weights_proj.weight}.
      qr = rms_norm(x Wqa^T, q_a_norm);  q = rope(rms_norm_per_head(qr Wqb^T))   (no weight)
      kv = rope(rms_norm(x Wkv^T, kv_norm));  keys = sliding window of kv (+ compressed entries:
      HCA all closed windows, CSA the indexer's top-k of the closed windows)
      out = o_proj(sparse_attention(q, keys, valid, sinks, head_dim^-0.5))
    RoPE: rope_main on sliding layers, rope_compress on CSA/HCA layers (q, kv, o de-rotation).
    Returns out [T, hidden] f64 and parts: q, kv, qr, entries, index_entries, index_q,
    index_scores [T, N], topk [T, k] (-1 = none), valid [T, T+N], attn [T, H, D], lse [T, H].
    """
    x = _f64(x)
    t = x.shape[0]
    h, d, rd, eps = spec.n_heads, spec.head_dim, spec.rope_dim, spec.eps
    pos = torch.arange(t)
    base, scaling = spec.rope_main if spec.attention == "sliding_attention" else spec.rope_compress
    cos, sin = rope_cos_sin(pos, rd, base, scaling)
    parts: dict = {}
    qr = rms_norm(x @ _f64(w["q_a_proj.weight"]).T, w["q_a_norm.weight"], eps)
    q = rms_norm((qr @ _f64(w["q_b_proj.weight"]).T).reshape(t, h, d), None, eps)
    q = rope_interleaved(q, cos, sin)
    kv = rope_interleaved(rms_norm(x @ _f64(w["kv_proj.weight"]).T, w["kv_norm.weight"], eps), cos, sin)
    parts.update(qr=qr, q=q, kv=kv)
    keys = kv.expand(t, t, d)
    valid = sliding_window_valid(pos, pos, spec.sliding_window)
    if spec.attention != "sliding_attention":
        m = spec.compress_ratio
        csa = spec.attention == "compressed_sparse_attention"
        cb, cs = spec.rope_compress

        def comp(pfx, overlap):
            return compress(x @ _f64(w[pfx + "kv_proj.weight"]).T, x @ _f64(w[pfx + "gate_proj.weight"]).T,
                            w[pfx + "position_bias"], m, overlap, w[pfx + "kv_norm.weight"], eps, rd, cb, cs)[0]

        ent = comp("compressor.", csa)
        n = ent.shape[0]
        parts["entries"] = ent
        if csa:
            p = "compressor.indexer."
            ik = comp(p, True)
            hi, di = spec.index_n_heads, spec.index_head_dim
            iq = rope_interleaved((qr @ _f64(w[p + "q_b_proj.weight"]).T).reshape(t, hi, di),
                                  *rope_cos_sin(pos, rd, cb, cs))
            sc = indexer_scores(iq, x @ _f64(w[p + "scorer.weights_proj.weight"]).T, ik, di**-0.5, hi**-0.5)
            idx = indexer_topk(sc, pos, m, spec.index_topk)
            cvalid = torch.zeros(t, n + 1, dtype=torch.bool).scatter_(1, torch.where(idx < 0, n, idx), True)[:, :n]
            parts.update(index_entries=ik, index_q=iq, index_scores=sc, topk=idx)
        else:
            cvalid = compressed_valid(pos, n, m)
        keys = torch.cat((keys, ent.expand(t, n, d)), 1)
        valid = torch.cat((valid, cvalid), 1)
    o, lse = sparse_attention(q, keys, valid, w["sinks"], d**-0.5)
    parts.update(valid=valid, attn=o, lse=lse)
    return o_proj(o, cos, sin, rd, w["o_a_proj.weight"], w["o_b_proj.weight"], spec.o_groups), parts


def decoder_layer(
    streams: torch.Tensor, w: dict, spec: LayerSpec, input_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """One V4 decoder layer over a whole sequence from position 0. streams [T, N, hidden] -> [T, N, hidden].

    w: tensors under transformers' names relative to the layer: attn_hc.{fn, base, scale},
    ffn_hc.{fn, base, scale}, input_layernorm.weight, post_attention_layernorm.weight,
    self_attn.* (see attention_layer), mlp.gate.weight, mlp.gate.e_score_correction_bias (top-k) or
    mlp.gate.tid2eid (hash; needs input_ids [T]), mlp.experts.gate_up_proj [E, 2I, hidden]
    (rows: w1 then w3), mlp.experts.down_proj, mlp.shared_experts.{gate,up,down}_proj.weight.
      pre, post, comb = mhc_coeffs(streams, attn_hc);  a = attention(rms_norm(collapse(streams, pre)))
      s1 = mhc_expand(a, streams, post, comb);  same with ffn_hc and the MoE on s1.
    Returns the new streams and parts: attn_in, attn_out, mid (s1), moe_in, moe_out, chosen,
    margin (top-k only), attn_parts, and the mHC coefficients (attn_pre/post/comb, ffn_*).
    """
    eps = spec.eps
    parts: dict = {}

    def coeffs(pfx, s):
        return mhc_coeffs(s, w[pfx + "fn"], w[pfx + "base"], w[pfx + "scale"], spec.hc_eps, eps, spec.sinkhorn_iters)

    pre, post, comb = coeffs("attn_hc.", _f64(streams))
    a_in = rms_norm(mhc_collapse(streams, pre), w["input_layernorm.weight"], eps)
    a_out, ap = attention_layer(a_in, {k[len("self_attn."):]: v for k, v in w.items() if k.startswith("self_attn.")},
                                spec)
    s1 = mhc_expand(a_out, streams, post, comb)
    parts.update(attn_pre=pre, attn_post=post, attn_comb=comb, attn_in=a_in, attn_out=a_out, attn_parts=ap, mid=s1)
    pre, post, comb = coeffs("ffn_hc.", s1)
    m_in = rms_norm(mhc_collapse(s1, pre), w["post_attention_layernorm.weight"], eps)
    gu = _f64(w["mlp.experts.gate_up_proj"])
    i = gu.shape[1] // 2
    experts = (gu[:, :i], gu[:, i:], w["mlp.experts.down_proj"])
    shared = tuple(w[f"mlp.shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    common = dict(scoring=spec.scoring, norm_topk_prob=spec.norm_topk_prob, swiglu_limit=spec.swiglu_limit)
    if spec.hash_moe:
        m_out, chosen = moe_hash(m_in, input_ids, w["mlp.gate.tid2eid"], w["mlp.gate.weight"], experts, shared,
                                 spec.routed_scaling_factor, **common)
    else:
        m_out, chosen, margin = moe(m_in, w["mlp.gate.weight"], w.get("mlp.gate.e_score_correction_bias"), experts,
                                    shared, spec.topk, spec.routed_scaling_factor, **common)
        parts["margin"] = margin
    parts.update(ffn_pre=pre, ffn_post=post, ffn_comb=comb, moe_in=m_in, moe_out=m_out, chosen=chosen)
    return mhc_expand(m_out, s1, post, comb), parts
