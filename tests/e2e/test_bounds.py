"""The per-row rounding-model bound of the e2e attention check (bounds.py) on fresh random inputs
of the tiny V4 / V4.1 geometry, without vLLM: the layer run as the served path rounds it (bf16
GEMM outputs, norms and RoPE in fp32 rounded to bf16, fp32 softmax over bf16 keys, bf16 output,
bf16 output projection) stays within the bound against float64; the same path with each planted
bug of plants.py (a dropped sink, the scale of head dim 576, a window one key short, top-k
entries read from the wrong blocks) exceeds it >= 5x. The e2e margins themselves are
test_planted_bugs.py's (slow, opt-in)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # as the driver runs them
import bounds as B  # noqa: E402
import oracle as O  # noqa: E402

F64, BF = torch.float64, torch.bfloat16
HID, QL, H, D, RD, G, R, W, NC = 256, 128, 8, 512, 64, 2, 64, 16, 6


def _layer(g):
    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(BF)

    attn = SimpleNamespace(
        fused_wqa_wkv=SimpleNamespace(weight=w(QL + D, HID)), q_lora_rank=QL,
        q_norm=SimpleNamespace(weight=(1 + 0.1 * torch.randn(QL, generator=g)).to(BF)), eps=1e-6,
        wq_b=SimpleNamespace(weight=w(H * D, QL)), n_local_heads=H, head_dim=D)
    wo_a, wo_b = w(G * R, H // G * D), w(HID, G * R)
    sink = torch.randn(H, generator=g, dtype=F64)
    return attn, wo_a, wo_b, sink


def _keys(g, T):
    """Each query t: its window (W positions up to t) of a kv sequence, then NC compressed entries
    (none for the first rows). Returns keys [T, W + NC, D] bf16 values, valid [T, W + NC], and
    the index of each row's oldest window key and first compressed key."""
    kv = torch.randn(T, D, generator=g).to(BF)
    comp = torch.randn(2 * NC, D, generator=g).to(BF)
    keys = torch.zeros(T, W + NC, D, dtype=BF)
    valid = torch.zeros(T, W + NC, dtype=torch.bool)
    for t in range(T):
        lo = max(0, t - W + 1)
        keys[t, : t + 1 - lo] = kv[lo: t + 1]
        valid[t, : t + 1 - lo] = True
        if t >= 8:
            keys[t, W:] = comp[:NC]
            valid[t, W:] = True
    return keys, valid, comp


def _served(attn, wo_a, wo_b, sink, x, keys, valid, cos, sin, v4, scale):
    """The layer as the served path rounds it (bf16 storage, fp32 arithmetic)."""
    f = torch.float32

    def bf(t):
        return t.to(BF)

    def mm(a, b):
        return bf(a.to(f) @ b.to(f).T)

    def rms(t, wt):
        t = t.to(f)
        y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + attn.eps)
        return bf(y if wt is None else y * wt.to(f))

    def rope(t, inverse=False):
        return bf(O.rope_interleaved(t.to(f), cos, sin, inverse).to(f))

    qr = rms(mm(x, attn.fused_wqa_wkv.weight[:QL]), attn.q_norm.weight)
    q = mm(qr, attn.wq_b.weight).view(-1, H, D)
    if v4:
        q = rms(q, None)
    q = rope(q)
    kf = keys.to(f)
    logits = torch.einsum("thd,tkd->thk", q.to(f), kf) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    if sink is not None:
        logits = torch.cat((logits, sink.to(f).view(1, H, 1).expand(logits.shape[0], H, 1)), -1)
    p = torch.softmax(logits, -1)[..., : kf.shape[1]]
    o = rope(bf(torch.einsum("thk,tkd->thd", p, kf)), inverse=True)
    y = bf(torch.einsum("tgi,gri->tgr", o.to(f).reshape(-1, G, H // G * D), wo_a.to(f).reshape(G, R, -1)))
    return mm(y.reshape(-1, G * R), wo_b)


def _ratio(v4, plant=None, seed=None):
    with B.one_thread():
        return _ratio_1(v4, plant, seed)


def _ratio_1(v4, plant, seed):
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    T = 24
    attn, wo_a, wo_b, sink = _layer(g)
    x = torch.randn(T, HID, generator=g).to(BF)
    keys, valid, comp = _keys(g, T)
    pos = torch.arange(T)
    inv = 1.0 / 1e4 ** (torch.arange(0, RD, 2, dtype=F64) / RD)
    cos, sin = (pos[:, None] * inv).cos(), (pos[:, None] * inv).sin()
    # the oracle and its bound (float64 from the same inputs, as checks.py runs them)
    q, vq = B.q_variance(attn, x.to(F64), cos, sin, v4, lambda t: t.to(F64))
    o, vo = B.attention_variance(q, vq, keys.to(F64), valid, sink, D ** -0.5)
    ref, var = B.o_proj_variance(o, vo, cos, sin, wo_a.to(F64), wo_b.to(F64), G)
    # the served path, with the plant
    skeys, svalid, ssink, scale = keys.clone(), valid.clone(), sink, D ** -0.5
    if plant == "drop_sink":
        ssink = None
    elif plant == "scale_576":
        scale = 576 ** -0.5
    elif plant == "window_short":
        svalid[W - 1:, 0] = False           # full windows lose their oldest key
    elif plant == "topk_no_ratio":
        skeys[:, W:] = comp[NC:]            # the entries of another block
    got = _served(attn, wo_a, wo_b, ssink, x, skeys, svalid, cos, sin, v4, scale)
    return float(B.row_ratios(got.to(F64), ref, var).max()), seed


@pytest.mark.parametrize("v4", [False, True], ids=["v41", "v4"])
def test_the_served_rounding_stays_within_the_bound(v4):
    for _ in range(2):
        ratio, seed = _ratio(v4)
        # within the bound, and not vacuous: the rounding uses a visible part of it
        assert 0.02 < ratio <= 1.0, (ratio, seed)


# The scale plant's margin depends on the spread of the logits: 5-7.4 over seeds with these random
# weights (measured), >= 5 in the e2e (test_planted_bugs.py); the others are 20-150.
MIN_MARGIN = {"drop_sink": 5.0, "scale_576": 4.0, "window_short": 5.0, "topk_no_ratio": 5.0}


@pytest.mark.parametrize("plant", sorted(MIN_MARGIN))
def test_a_planted_bug_exceeds_the_bound(plant):
    ratio, seed = _ratio(v4=False, plant=plant)
    assert ratio >= MIN_MARGIN[plant], (plant, ratio, seed)


def _fp8_ds_mla_roundtrip(ref):
    """ref [N, 512] f64 -> what an fp8_ds_mla writer stores, decoded: 448 NoPE dims as E4M3 with
    one UE8M0 scale per 64 (torch's own E4M3 cast), 64 RoPE dims as bf16."""
    nope = ref[:, :448].reshape(-1, 7, 64)
    scale = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448)))
    codes = (nope / scale).to(torch.float32).to(torch.float8_e4m3fn).to(F64)
    return torch.cat(((codes * scale).reshape(-1, 448), ref[:, 448:].to(BF).to(F64)), dim=-1)


def test_the_writer_bound_holds_and_a_rope_position_off_by_one_breaks_it():
    """writer_checks.quant_ratio on fresh rows: a correct fp8_ds_mla write of the served pipeline
    (the entry rounded to bf16, RoPE'd in fp32, rounded to bf16 again) is within the bound; the
    same entry RoPE'd one position late is far outside it."""
    import writer_checks as WC

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    N = 32
    entry = torch.randn(N, D, generator=g, dtype=F64) * (1 + 3 * torch.rand(N, 1, generator=g, dtype=F64))
    inv = 1.0 / 4e4 ** (torch.arange(0, RD, 2, dtype=F64) / RD)
    pos = torch.randint(0, 4000, (N,), generator=g)

    def rope(x, p):
        return O.rope_interleaved(x, (p[:, None] * inv).cos(), (p[:, None] * inv).sin())

    ref = rope(entry, pos)
    served = rope(entry.to(BF).to(F64), pos).to(BF).to(F64)
    good = _fp8_ds_mla_roundtrip(served)
    bad = _fp8_ds_mla_roundtrip(rope(entry, pos + 1))
    ok = max(WC.quant_ratio(good[i], ref[i], 448, 64, True, WC.Rope(RD)) for i in range(N))
    off = max(WC.quant_ratio(bad[i], ref[i], 448, 64, True, WC.Rope(RD)) for i in range(N))
    assert ok <= 1.0 and off >= 5.0, (ok, off, seed)


@pytest.mark.parametrize("first,interleaved", [(False, True), (True, True), (True, False)])
def test_a_rope_channel_rotated_near_zero_is_bounded_by_its_pairs_norm(first, interleaved):
    """One RoPE pair per row far above the row's rms (its norm ~ sqrt(D) x rms), rotated so one
    channel lands near zero: the bf16 rounding of the pair before the rotation leaves an error of
    order ulp(pair norm) on that channel, which the element-wise bound (|x| + rms) does not cover
    and the pair bound does; a sign flipped in the rotation still fails the pair bound. Rows of
    512 bf16 channels, 64 RoPE'd (the writers' layouts: last or first, GPT-J or NeoX pairs)."""
    import writer_checks as WC

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    N, Dk, half = 64, 512, RD // 2
    rope = WC.Rope(RD, first=first, interleaved=interleaved)
    off = 0 if first else Dk - RD
    pa = off + (torch.arange(0, RD, 2) if interleaved else torch.arange(half))   # pairs (pa, pb)
    pb = pa + (1 if interleaved else half)
    j = torch.randint(0, half, (N,), generator=g)                     # the big pair of each row
    rows = torch.arange(N)
    theta = torch.rand(N, half, generator=g, dtype=F64) * 6.28
    norm = 64 * (1 + torch.rand(N, generator=g, dtype=F64))
    phi = torch.pi / 2 - theta[rows, j] + 1e-3 * torch.randn(N, generator=g, dtype=F64)  # a cos - b sin ~ 0
    pre = torch.randn(N, Dk, generator=g, dtype=F64)
    pre[rows, pa[j]], pre[rows, pb[j]] = norm * phi.cos(), norm * phi.sin()

    def rotate(v, sign=1.0):
        c, s = theta.cos(), sign * theta.sin()
        if first:
            return WC.rope_first(v, c, s, interleaved)
        return (O.rope_interleaved if interleaved else O.rope_neox)(v, c, s)

    ref = rotate(pre)
    served = rotate(pre.to(BF).to(F64)).to(BF).to(F64)
    flipped = rotate(pre, -1.0).to(BF).to(F64)
    elementwise = max(WC.quant_ratio(served[i], ref[i], 0, 64, False) for i in range(N))
    paired = max(WC.quant_ratio(served[i], ref[i], 0, 64, False, rope) for i in range(N))
    wrong = max(WC.quant_ratio(flipped[i], ref[i], 0, 64, False, rope) for i in range(N))
    assert elementwise > 1.0 and paired <= 1.0 and wrong >= 5.0, (elementwise, paired, wrong, seed)
