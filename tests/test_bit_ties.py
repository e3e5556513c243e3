"""Exact rounding ties for the ops the README calls bit- or byte-identical to vLLM: the KV insert
(584-byte fp8_ds_mla records), the indexer K store, the indexer Q quant and the V3.2 insert. The
inputs are built to land on every tie: each E4M3 midpoint (normal and subnormal, both parities),
group maxima exactly at 448 * 2**k (the UE8M0 / power-of-two scale boundary) and one bf16 ulp
either side, the scale floor, and bf16 midpoints in the Q quant's rotation. The kernels run under
the Triton interpreter (CPU) or on the GPU; the expected bytes come from vLLM's own rules written
out here in torch (its writers' ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``, RNE, after a
division by a power of two; the exponent ceil(log2(max(amax, 1e-4) / 448)) computed exactly with
Python integers; fp32 -> bf16 RNE), not from the package's references.

(Engram's lookup multiplies an E4M3 code by a UE8M0 scale, an exact product: it has no rounding
tie to build; tests/test_engram.py compares it with vLLM's kernel.)
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

E4M3 = torch.float8_e4m3fn
# every finite positive E4M3 value, and the midpoint of each adjacent pair (exact in bf16)
MAGS = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).double()
MIDS = (MAGS[:-1] + MAGS[1:]) / 2


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """vLLM's cast: satfinite, then round to nearest even (uint8 codes)."""
    return x.double().clamp(-448.0, 448.0).to(E4M3).view(torch.uint8)


def exponent(amax: float) -> int:
    """ceil(log2(max(amax, 1e-4) / 448)) by exact rational arithmetic."""
    a = Fraction(max(float(amax), 1e-4)) / 448
    e = math.frexp(float(a))[1]  # a < 2**e (float(a) may round: checked both ways below)
    while Fraction(2) ** (e - 1) >= a:
        e -= 1
    while Fraction(2) ** e < a:
        e += 1
    return e


def bf16_neighbours(v: float):
    """(v one bf16 ulp down, v, one ulp up) as floats (v exact in bf16)."""
    t = torch.tensor([v], dtype=torch.bfloat16).view(torch.int16)
    return [float(torch.tensor([int(t) + d], dtype=torch.int16).view(torch.bfloat16)) for d in (-1, 0, 1)]


def tie_groups(width: int, ks=(-14, -6, -1, 0, 3, 9)):
    """Groups of ``width`` values whose maximum sits at / beside 448 * 2**k and whose other
    values are E4M3 midpoints (ties) at that group's own scale, alternating signs; plus an
    all-zero group and a group under the 1e-4 floor. float64 [G, width], exact in bf16."""
    groups = []
    for k in ks:
        for amax in bf16_neighbours(448.0 * 2.0 ** k):
            scale = 2.0 ** exponent(amax)
            mids = MIDS[MIDS * scale <= amax]
            fill = (width - 1)
            for start in range(0, len(mids), fill):
                vals = mids[start:start + fill]
                vals = torch.cat([vals, mids[:fill - len(vals)]]) if len(vals) < fill else vals
                signs = torch.tensor([1.0, -1.0]).repeat(fill // 2 + 1)[:fill]
                g = torch.cat([torch.tensor([amax if k % 2 else -amax]), vals * scale * signs])
                groups.append(g)
    groups.append(torch.zeros(width))
    tiny = torch.zeros(width)
    tiny[:3] = torch.tensor([2.0 ** -20, -(2.0 ** -21) * 3, 2.0 ** -24])
    groups.append(tiny)
    out = torch.stack(groups)
    assert torch.equal(out.to(torch.bfloat16).double(), out), "tie inputs must be exact in bf16"
    return out


def quantize_groups(g: torch.Tensor):
    """(codes uint8 [G, W], exponents [G]) of groups by vLLM's rule."""
    es = [exponent(float(x.abs().max())) for x in g]
    scale = torch.tensor([2.0 ** e for e in es], dtype=torch.float64)
    return e4m3(g / scale[:, None]), es


def test_inputs_are_ties():
    """The controls: the built values really are ties (halfway between two codes) and the maxima
    really sit on the scale boundary."""
    g = tie_groups(64)
    codes, es = quantize_groups(g)
    scaled = g / torch.tensor([2.0 ** e for e in es])[:, None]
    lo, hi = e4m3(scaled * (1 - 2 ** -20)), e4m3(scaled * (1 + 2 ** -20))
    ties = (lo != hi) & (scaled != 0)
    assert int(ties.sum()) >= 600, int(ties.sum())
    for parity in (0, 1):  # ties to an even code from both sides
        assert bool(((codes & 1) == 0)[ties & ((lo & 1) == parity)].all())
    boundary = [exponent(448.0 * 2.0 ** k) for k in (-6, 0, 3)]
    assert boundary == [-6, 0, 3] and exponent(bf16_neighbours(448.0)[2]) == 1 and exponent(bf16_neighbours(448.0)[0]) == 0


# ---- KV insert: 584-byte records --------------------------------------------------------------

def test_kv_insert_ties(interpret):
    from dsv4_ops import kv_cache, layout

    g = tie_groups(layout.QUANT_GROUP)
    n_groups = layout.NUM_SCALES
    rows = -(-g.shape[0] // n_groups)
    pad = rows * n_groups - g.shape[0]
    g = torch.cat([g, g[:pad]])
    codes, es = quantize_groups(g)
    rope = (torch.arange(rows * 64, dtype=torch.float64).reshape(rows, 64) * 0.37 - 11).to(torch.bfloat16)
    kv = torch.cat([g.reshape(rows, layout.NOPE_DIM).to(torch.bfloat16), rope], 1)
    bs = 1
    cache = torch.full((rows, layout.min_page_bytes(bs)), 0xEE, dtype=torch.uint8)
    dev_cache = cache.to(interpret)
    kv_cache.kv_cache_insert(kv.to(interpret), dev_cache, torch.arange(rows, device=interpret), bs, variant="portable")
    got = dev_cache.cpu()
    want = torch.cat([codes.reshape(rows, layout.NOPE_DIM), rope.view(torch.uint8).reshape(rows, 128),
                      (torch.tensor(es).reshape(rows, n_groups) + 127).to(torch.uint8),
                      torch.zeros(rows, 1, dtype=torch.uint8)], 1)
    assert got.shape[1] == want.shape[1]
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at (row, byte) {diff[:5].tolist()}"


# ---- indexer K store ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_k_store_ties(interpret, dtype):
    from dsv4_ops import indexer

    g = tie_groups(128)
    codes, es = quantize_groups(g)
    n = g.shape[0]
    bs = 4
    nb = -(-n // bs)
    cache = torch.full((nb, bs * 132), 0xEE, dtype=torch.uint8, device=interpret)
    indexer.indexer_k_insert(g.to(dtype).to(interpret), cache, torch.arange(n, device=interpret), bs)
    got = cache.cpu()
    blk, pos = torch.arange(n) // bs, torch.arange(n) % bs
    got_codes = torch.stack([got[b, p * 128:(p + 1) * 128] for b, p in zip(blk.tolist(), pos.tolist())])
    got_scales = torch.stack([got[b, bs * 128 + p * 4:bs * 128 + p * 4 + 4] for b, p in zip(blk.tolist(), pos.tolist())])
    assert torch.equal(got_codes, codes)
    want_scales = torch.tensor([2.0 ** e for e in es], dtype=torch.float32).view(torch.uint8).reshape(n, 4)
    assert torch.equal(got_scales, want_scales)


# ---- V3.2 insert: 656-byte records ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v32_insert_ties(interpret, dtype):
    """vLLM's V3.2 writer takes s = max(amax / 448, 1e-4) in fp32, scale 2**ceil(log2 s): for these
    maxima (exact multiples of 448 or one bf16 ulp off) the same exponent as the exact rule."""
    from dsv4_ops import v32

    g = tie_groups(128, ks=(-6, -1, 0, 3, 9))  # the V3.2 floor is 1e-4 on amax / 448: no smaller k
    rows = -(-g.shape[0] // 4)
    g = torch.cat([g, g[:rows * 4 - g.shape[0]]])
    amax32 = g.abs().amax(1).float()
    s = torch.clamp_min(amax32 / torch.tensor(448.0), 1e-4)
    es = [exponent(float(v) * 448.0) for v in s.double()]  # ceil(log2 s), exact
    scale = torch.tensor([2.0 ** e for e in es], dtype=torch.float64)
    codes = e4m3(g / scale[:, None]).reshape(rows, 512)
    pe = (torch.arange(rows * 64, dtype=torch.float64).reshape(rows, 64) * -0.21 + 3).to(torch.bfloat16)
    cache = torch.full((rows, 1, 656), 0xEE, dtype=torch.uint8, device=interpret)
    v32.v32_kv_insert(g.reshape(rows, 512).to(dtype).to(interpret), pe.to(interpret), cache,
                      torch.arange(rows, device=interpret))
    want = torch.cat([codes, scale.float().view(torch.uint8).reshape(rows, 16), pe.view(torch.uint8).reshape(rows, 128)],
                     1)
    got = cache.cpu().reshape(rows, 656)
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at (row, byte) {diff[:5].tolist()}"


# ---- indexer Q quant: bf16 ties in the rotation, then E4M3 and UE8M0 ties ------------------------

def _bf16_rne(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def test_indexer_q_quant_ties(interpret):
    """cos = 1, sin = 1 at position 1 (the identity at 0): x0 - x1 and x0 + x1 with x1 half a bf16
    ulp of x0 land on bf16 midpoints of both parities; the no-RoPE dims are E4M3 midpoints at the
    head's scale with the maximum on the 448 * 2**k boundary."""
    from dsv4_ops import indexer

    g = tie_groups(64, ks=(-6, 0, 3))  # the first 64 dims (no RoPE) of each head
    H = 4
    T = -(-g.shape[0] // H)
    g = torch.cat([g, g[:T * H - g.shape[0]]]).reshape(T, H, 64)
    # RoPE dims: pairs (x0, x1) with x0 an E4M3 midpoint at the head's scale that rounds down to its
    # even code, and x1 half a bf16 ulp of x0: x0 + x1 (the odd dim, cos = sin = 1) is a bf16 tie whose
    # even neighbour is x0 (then the E4M3 tie, down) and whose odd one lies above the E4M3 midpoint
    # (a code up): the bf16 rounding shows in the stored code.
    down = MIDS[(e4m3(MIDS) == e4m3(MIDS * (1 - 2 ** -20))) & (MIDS > 2.0 ** -6)]
    rope = torch.zeros(T, H, 64, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            amax = float(g[t, h].abs().max())
            scale = 2.0 ** exponent(amax)
            cand = down[down * scale * (1 + 2 ** -7) <= amax]
            if not len(cand):  # the all-zero head
                continue
            x0 = cand[torch.arange(32) % len(cand)] * scale
            ulp = torch.tensor([2.0 ** (math.frexp(float(v))[1] - 8) for v in x0])
            rope[t, h, 0::2], rope[t, h, 1::2] = x0, ulp / 2
    assert torch.equal(rope.to(torch.bfloat16).double(), rope)
    q = torch.cat([g, rope], -1)
    q = q.to(torch.bfloat16)
    cs = torch.zeros(2, 64)
    cs[0, :32] = 1.0  # position 0: cos 1, sin 0
    cs[1, :32] = 1.0
    cs[1, 32:] = 1.0  # position 1: cos 1, sin 1
    positions = torch.arange(T) % 2
    w = torch.linspace(-2.0, 3.0, T * H).reshape(T, H).to(torch.bfloat16)
    ss, hs = 128 ** -0.5, 32 ** -0.5
    # the oracle: fp32 products, rounded sum, bf16 RNE; then the head's exponent and E4M3 codes
    x = q.double()
    c = cs[positions].double()
    cos, sin = c[:, None, :32], c[:, None, 32:]
    a0, a1 = x[..., 64::2].float(), x[..., 65::2].float()
    r0 = _bf16_rne(a0 * cos.float() - a1 * sin.float())
    r1 = _bf16_rne(a0 * sin.float() + a1 * cos.float())
    v = x.clone()
    v[..., 64::2], v[..., 65::2] = r0, r1
    moved = (r0 != (a0 * cos.float() - a1 * sin.float()).double()).sum() + \
        (r1 != (a0 * sin.float() + a1 * cos.float()).double()).sum()
    assert int(moved) >= T * 8  # the rotation's bf16 rounding is exercised, at ties
    es = torch.tensor([[exponent(float(v[t, h].abs().max())) for h in range(H)] for t in range(T)])
    scale = torch.exp2(es.double())
    codes = e4m3(v / scale[..., None])
    w_want = (w.float() * torch.tensor(ss * hs, dtype=torch.float32)) * torch.exp2(es.double()).float()
    got_q, got_w = indexer.indexer_q_quant(positions.to(interpret), q.to(interpret), cs.to(interpret),
                                           w.to(interpret), ss, hs)
    got_q = got_q.cpu().view(torch.uint8) if got_q.dtype != torch.uint8 else got_q.cpu()
    diff = (got_q != codes).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} codes differ, first at {diff[:5].tolist()}"
    assert torch.equal(got_w.cpu().view(torch.int32), w_want.view(torch.int32))
