"""Per-element error bounds of a V4 / V4.1 attention layer's output, from the rounding model of
the path vLLM + the plugin run (float64, next to the oracle in checks.py).

Model: every bf16 value x the path stores carries a rounding error uniform on [-ulp(x)/2,
ulp(x)/2] (ulp(x) = 2**(floor(log2|x|) - 7), variance ulp^2 / 12), independent across values;
fp32 accumulation adds n * 2**-24 relative per dot product (far below the bf16 terms); the cache
keys are the decoded cache bytes, exact in the oracle, and are read as bf16 by the kernels. The
variances are propagated to first order through the layer:

  x (bf16, exact) -> qr = rms_norm(x Wqa^T) -> q = qr Wqb^T (V4: per-head rms_norm) -> RoPE
  -> o = softmax_with_sink(scale q.K) V -> inverse RoPE -> grouped wo_a -> wo_b.

Through the softmax: delta o[d] = scale * sum_k p_k (v_k[d] - o[d]) (K_k . delta q) (K = V), so
Var(o[d]) = scale^2 a_d^T P G P a_d with a_kd = v_k[d] - o[d], P = diag(p), G_kj = sum_e
Var(q_e) K_ke K_je; the keys' own bf16 rounding adds sum_k p_k^2 (a_kd^2 scale^2 q^2.u^2 K_k^2 / 3
+ u^2 K_kd^2 / 3). The bound of an output element is Z standard deviations; a row's ratio is
max |vLLM - oracle| / bound over its elements (<= 1 passes).
"""

from __future__ import annotations

import contextlib

import torch

import oracle as O

F64 = torch.float64
V_ACC = (2.0 ** -24) ** 2 / 3
Z = 6.0                  # standard deviations: the largest of ~10^6 checked elements stays below


def rv(x: torch.Tensor) -> torch.Tensor:
    """Variance of rounding x to bf16: ulp(x)^2 / 12 (8 significant bits); 0 at x = 0."""
    a = x.abs()
    ulp = torch.exp2(torch.floor(torch.log2(a.clamp(min=1e-300))) - 7)
    return torch.where(a > 0, ulp * ulp / 12, torch.zeros_like(a))


@contextlib.contextmanager
def one_thread():
    """Small float64 ops on a loaded machine: one intra-op thread is ~10-40x faster than two
    spinning against other processes. Restores the process's setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _lin(w: torch.Tensor, x: torch.Tensor, vx: torch.Tensor) -> tuple:
    """y = x @ w.T and Var(y) (bf16 output). x, vx [..., n]; w [m, n]."""
    y = x @ w.T
    n = w.shape[1]
    vy = vx @ (w * w).T + n * V_ACC * ((x * x) @ (w * w).T) + rv(y)
    return y, vy


def _rms(x: torch.Tensor, vx: torch.Tensor, weight, eps: float) -> tuple:
    """y = rms_norm(x) * weight and Var(y) (bf16 output); normalised over the last dim."""
    r2 = x.pow(2).mean(-1, keepdim=True) + eps
    n = x.shape[-1]
    w2 = 1.0 if weight is None else weight * weight
    proj = (x * x * vx).sum(-1, keepdim=True) / (n * n * r2)      # Var of mean(x dx) / r^2 term
    y = O.rms_norm(x, weight, eps)
    vy = w2 / r2 * (vx + x * x / r2 * proj) + rv(y)
    return y, vy


def _rope_var(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Var after GPT-J RoPE on the last 2*cos.shape[-1] channels (bf16 output)."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (v.dim() - 2) + (half,)
    c2, s2 = cos.reshape(shape) ** 2, sin.reshape(shape) ** 2
    r = v[..., -2 * half:]
    ve, vo = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((c2 * ve + s2 * vo, s2 * ve + c2 * vo), dim=-1).flatten(-2)
    return torch.cat((v[..., : -2 * half], rot), dim=-1) + rv(y)


def q_variance(attn, x: torch.Tensor, cos, sin, v4: bool, w) -> tuple:
    """(q [T, H, D], Var(q)) for the layer's query path from its bf16 input x [T, hidden] f64.
    ``w(t)``: a parameter as float64."""
    W = w(attn.fused_wqa_wkv.weight)[: attn.q_lora_rank]
    qr_lin, v = _lin(W, x, torch.zeros_like(x))
    qr, v = _rms(qr_lin, v, w(attn.q_norm.weight), attn.eps)
    q, v = _lin(w(attn.wq_b.weight), qr, v)
    q, v = q.view(-1, attn.n_local_heads, attn.head_dim), v.view(-1, attn.n_local_heads, attn.head_dim)
    if v4:
        q, v = _rms(q, v, None, attn.eps)
    qr_ = O.rope_interleaved(q, cos, sin)
    return qr_, _rope_var(v, cos, sin, qr_)


def attention_variance(q, vq, keys, valid, sink, scale, dv: int | None = None) -> tuple:
    """(o [T, H, dv], Var(o)) of the sink softmax attention (values = keys[..., :dv], K = V when
    dv is None; keys exact, read as bf16). q, vq [T, H, D] (vq None: q exact); keys [T, K, D];
    valid [T, K]; sink [H] or None. A query with no valid key: o = 0, Var = 0."""
    T, H, D = q.shape
    dv = D if dv is None else dv
    o_all = torch.zeros(T, H, dv, dtype=F64)
    v_all = torch.zeros(T, H, dv, dtype=F64)
    for t in range(T):
        k = keys[t][valid[t]]                                          # [K, D]
        if k.shape[0] == 0:
            continue
        v = k[:, :dv]
        l = scale * torch.einsum("hd,kd->hk", q[t], k)
        full = l if sink is None else torch.cat((l, sink.reshape(-1, 1)), dim=1)
        p = torch.softmax(full, dim=1)[:, : k.shape[0]]               # [H, K]
        o = p @ v                                                      # [H, dv]
        a = v[None, :, :] - o[:, None, :]                              # [H, K, dv]
        var = torch.zeros(H, dv, dtype=F64)
        if vq is not None:
            G = (vq[t][:, None, :] * k[None]) @ k.T                    # [H, K, K]
            PGP = p[:, :, None] * G * p[:, None, :]
            var = scale * scale * (a * (PGP @ a)).sum(1)
        # the keys' bf16 rounding (in the logits and as values) and the fp32 logits' accumulation
        lk = scale * scale * ((q[t] * q[t]) @ (rv(k) + D * V_ACC * k * k).T)     # Var(dl_k) [H, K]
        var = var + ((p * p * lk)[:, :, None] * a * a).sum(1) + (p * p) @ rv(v)
        o_all[t] = o
        v_all[t] = var + rv(o)
    return o_all, v_all


def o_proj_variance(o, vo, cos, sin, wo_a, wo_b, n_groups) -> tuple:
    """(out [T, hidden], Var(out)) of inverse RoPE + grouped wo_a + wo_b (bf16 at each step)."""
    t, h, d = o.shape
    oi = O.rope_interleaved(o, cos, sin, inverse=True)
    vi = _rope_var(vo, cos, sin, oi)
    g = n_groups
    x, vx = oi.reshape(t, g, (h // g) * d), vi.reshape(t, g, (h // g) * d)
    wa = wo_a.reshape(g, -1, (h // g) * d)
    y = torch.einsum("tgi,gri->tgr", x, wa)
    vy = torch.einsum("tgi,gri->tgr", vx, wa * wa) + rv(y)
    out, vout = _lin(wo_b, y.reshape(t, -1), vy.reshape(t, -1))
    return out, vout


def row_ratios(got: torch.Tensor, ref: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Per row: max |got - ref| / (Z * std) over the row's elements. [T] f64."""
    bound = Z * var.clamp(min=1e-300).sqrt()
    return ((got - ref).abs() / bound).amax(-1)
