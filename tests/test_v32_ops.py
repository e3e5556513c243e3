"""DeepSeek-V3.2 / GLM-5 MLA ops (dsv4_ops.v32): the 656-byte fp8_ds_mla cache (+ bf16 auto)
and sparse MLA with d_qk 576, d_v 512, no sink.

- The references (dsv4_ops.reference, V3.2 section) against independent formulations (a per-row
  float64 loop; the exponent rule over every bf16 amax).
- Insert / gather kernels bit for bit against the vLLM-semantics torch writer (CPU through
  the Triton interpreter, which is faithful for integer bit work and fp8 decode; GPU).
- Attention kernels against the float64 reference: small cases on the CPU interpreter
  (fp16 q: the interpreter's bf16 tl.dot is wrong), FlashMLA's d_qk = 576 sparse-decode cases
  (tests/test_flash_mla_sparse_decoding.py: (s_k, topk, block_size) in (512, 64, 69),
  (1024, 576, 61), (2046, 2048, 64) ..., corner cases all-invalid / zero seqlen) on the GPU,
  heads 16 (TP8) and 128 (TP1).
- Fakes + torch.library.opcheck (V32_OPCHECK_SAMPLES, also meant for tests/test_opcheck.py),
  CUDA-graph replay == eager, torch.compile(fullgraph=True).
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from dsv4_ops import layout as L
from dsv4_ops.csrc_triton import v32_attention as _ak
from dsv4_ops import dispatch, v32
from dsv4_ops import reference as R
from dsv4_ops.testing import HAS_GPU, assert_attention_close, poison_like, rng

QK, DV = L.V32_HEAD_DIM_QK, L.V32_HEAD_DIM_V
V32_SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2  # V3.2: qk_head_dim 192, yarn mscale (factor 40)


# ---- helpers ----


def make_kv(n, seed, device="cpu", spread=True):
    """bf16 kv_c [n, 512], k_pe [n, 64]; spread: tile magnitudes from 1e-6 to 1e3, one all-zero
    row (every tile at the 1e-4 floor), one with a tile at the 1.75 * 2**k boundary."""
    g = rng(seed)
    kv_c = torch.randn(n, L.V32_NOPE_DIM, generator=g)
    if spread and n >= 4:
        mag = torch.logspace(-6, 3, n * L.V32_NUM_TILES).reshape(n, L.V32_NUM_TILES, 1)
        mag = mag[torch.randperm(n, generator=g)]
        kv_c = (kv_c.reshape(n, L.V32_NUM_TILES, L.V32_TILE) * mag).reshape(n, -1)
        kv_c[1] = 0.0
        kv_c[2, :128] = kv_c[2, :128].clamp(-1, 1)
        kv_c[2, 5] = 1.75 * 2.0 ** -3  # amax / 448 exactly a power of two
    k_pe = torch.randn(n, L.V32_ROPE_DIM, generator=g) * 4
    return kv_c.to(torch.bfloat16).to(device), k_pe.to(torch.bfloat16).to(device)


def make_cache(fmt, nb, bs, seed, device="cpu", pad=0):
    """A poisoned cache (random bytes / values) [nb, bs, D]; pad: extra bytes (fp8, a multiple
    of 4) or elements (auto) after each block, so stride(0) > bs * D as vLLM may allocate."""
    g = rng(seed)
    d = L.V32_RECORD_BYTES if fmt == "fp8_ds_mla" else QK
    if fmt == "fp8_ds_mla":
        full = torch.randint(0, 256, (nb, bs * d + pad), generator=g, dtype=torch.uint8).to(device)
    else:
        full = torch.randn(nb, bs * d + pad, generator=g).to(torch.bfloat16).to(device)
    return torch.as_strided(full, (nb, bs, d), (full.stride(0), d, 1))


def cache_bits(c):
    return c.view(torch.uint8) if c.dtype != torch.bfloat16 else c.view(torch.int16)


def fill_cache(fmt, nb, bs, seed, device):
    """A cache with every slot written by the reference writer, and its bf16 rows."""
    cap = nb * bs
    c = make_cache(fmt, nb, bs, seed, device)
    kv_c, k_pe = make_kv(cap, seed + 1, device, spread=False)
    R.ref_v32_kv_insert(kv_c, k_pe, c, torch.arange(cap, device=device))
    return c


def flashmla_case(b, s_q, h, s_k, topk, bs, has_len, seed, device, all_invalid=False, zero_seqlen=False,
                  fmt="fp8_ds_mla"):
    """FlashMLA-style sparse decode inputs: b requests of random length <= s_k, paged through a
    shuffled block table; s_q query tokens each with topk positions of its request (about 1 in
    8 invalid: -1 or past the request), as slots; q bf16 [b * s_q, h, 576]."""
    g = rng(seed)
    seqlens = torch.randint(1, s_k + 1, (b,), generator=g)
    if zero_seqlen:
        seqlens[::2] = 0
    pages = [-(-int(s) // bs) for s in seqlens]
    nb = sum(pages) + 3
    perm = torch.randperm(nb, generator=g)
    cache = fill_cache(fmt, nb, bs, seed + 7, device)
    idx = []
    off = 0
    for r in range(b):
        table = perm[off:off + pages[r]]
        off += pages[r]
        n = int(seqlens[r])
        pos = torch.randint(0, max(n, 1), (s_q, topk), generator=g)
        slot = table[(pos // bs).clamp(max=max(pages[r] - 1, 0))] * bs + pos % bs if pages[r] else pos * 0 - 1
        bad = (torch.rand(s_q, topk, generator=g) < 0.125) | (n == 0)
        if all_invalid:
            bad[:] = True
        idx.append(torch.where(bad, torch.full_like(slot, -1), slot))
    indices = torch.cat(idx).to(torch.int32).to(device)
    T = b * s_q
    q = torch.randn(T, h, QK, generator=g).to(torch.bfloat16).to(device)
    tlen = torch.randint(0, topk + 1, (T,), generator=g).to(torch.int32).to(device) if has_len else None
    return q, cache, indices, tlen


def check_attention(out, lse, q, cache, indices, tlen, sm_scale, ref=None):
    ref_o, ref_l = ref or R.ref_v32_sparse_mla_decode(q, cache, indices, tlen, sm_scale, torch.float64, torch.float64)
    assert_attention_close(out, lse, ref_o, ref_l)


_CASES = {}


def gpu_case(*args):
    """flashmla_case(*args) on CUDA and its float64 reference, memoised for the last two
    argument lists (the two kernel forms of a case share inputs and reference)."""
    if args not in _CASES:
        while len(_CASES) >= 2:
            _CASES.pop(next(iter(_CASES)))
        q, cache, idx, tlen = flashmla_case(*args)
        ref = R.ref_v32_sparse_mla_decode(q, cache, idx, tlen, V32_SCALE, torch.float64, torch.float64)
        _CASES[args] = (q, cache, idx, tlen, ref)
    return _CASES[args]


# ---- layout ----


def test_split_count_fits_one_wave():
    for T, H, want in ((1, 16, 64), (1, 128, 33), (16, 16, 8), (16, 128, 2), (64, 16, 2), (64, 128, 1), (128, 16, 1)):
        s = dispatch.v32.num_splits_for(T, H, 2048, 132)
        assert s == want, (T, H, s)
        assert T * -(-H // (16 if H <= 16 else 32)) * s <= 132 or s == 1
    for T, H in ((1, 16), (1, 128), (16, 16), (64, 16), (128, 128)):  # f16: PER_SM programs an SM
        cfg = dispatch.v32.config_of("f16", 16 if H <= 16 else 32)
        s = dispatch.v32.num_splits_for(T, H, 2048, 132, "f16")
        slots = 132 * cfg.get("PER_SM", 1)
        base = T * -(-H // cfg["BLOCK_H"])
        assert (base * s <= slots and (s == 64 or base * (s + 1) > slots)) or (s == 1 and base >= slots), (T, H, s)


def test_layout_constants():
    assert L.V32_RECORD_BYTES == 512 + 4 * 4 + 2 * 64 == 656
    assert (L.V32_SCALE_OFFSET, L.V32_ROPE_OFFSET) == (512, 528)
    assert L.V32_MIN_EXP == math.ceil(math.log2(L.V32_SCALE_FLOOR))


def test_cache_pages_accepts_vllm_views_and_rejects_the_rest():
    u8 = torch.zeros(3, 64, 656, dtype=torch.uint8)
    for view in (u8, u8.view(torch.float8_e4m3fn), u8.unsqueeze(2)):
        c, fmt = L.v32_cache_pages(view)
        assert fmt == "fp8_ds_mla" and c.dtype == torch.uint8 and c.shape == (3, 64, 656)
    c, fmt = L.v32_cache_pages(torch.zeros(3, 64, 576, dtype=torch.bfloat16))
    assert fmt == "auto"
    bad = [torch.zeros(3, 64, 584, dtype=torch.uint8),  # V4's record
           torch.zeros(3, 64, 656, dtype=torch.bfloat16),
           torch.zeros(3, 64, 576, dtype=torch.float16),
           torch.zeros(3, 64 * 656, dtype=torch.uint8),  # 2-D: a V4-style page
           torch.zeros(3, 64, 2, 656, dtype=torch.uint8),
           torch.zeros(3, 64, 1312, dtype=torch.uint8)[:, :, :656],  # records not contiguous
           torch.zeros(3 * 64 * 656 + 2, dtype=torch.uint8)[2:].view(3, 64, 656)]  # scales misaligned
    for b in bad:
        with pytest.raises(ValueError, match="kv_cache"):
            L.v32_cache_pages(b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_exponent_rule_matches_vllm_float_formula_for_every_bf16_amax(device):
    """ceil(log2(max(amax / 448, 1e-4))) in fp32 (vLLM's formula, via torch; on CUDA torch's
    log2 is libdevice log2f, the function vLLM's writer calls) == the exact integer rule of
    the insert kernel, max(E - 8 + (mant > 1.75), -13), for all bf16 amax."""
    bits = torch.arange(0, 0x7F80, dtype=torch.int32, device=device)  # +0 .. largest finite bf16
    amax = bits.to(torch.int16).view(torch.bfloat16).float()
    s = torch.clamp_min(amax / torch.tensor(448.0, device=device), 1e-4)
    e_float = torch.ceil(torch.log2(s)).to(torch.int32)
    fb = amax.view(torch.int32)
    e_int = ((fb >> 23) & 0xFF) - 127 - 8 + ((fb & 0x7FFFFF) > 0x600000).to(torch.int32)
    e_int = torch.clamp_min(e_int, L.V32_MIN_EXP)
    assert torch.equal(e_float, e_int)
    # and vLLM stores exactly 2**e as the fp32 scale
    assert torch.equal(torch.exp2(e_float.float()), torch.exp2(torch.ceil(torch.log2(s))))


# ---- references against independent formulations ----


def test_reference_attention_matches_a_per_row_float64_loop():
    g = rng(3)
    T, H, K, N = 3, 5, 9, 12
    q = torch.randn(T, H, QK, generator=g, dtype=torch.float64)
    kv = torch.randn(N, QK, generator=g, dtype=torch.float64)
    idx = torch.randint(-2, N + 2, (T, K), generator=g)
    idx[1, 3] = idx[1, 4] = 5  # a repeat counts twice
    idx[2] = -1  # no valid key
    tlen = torch.tensor([9, 6, 9])
    out, lse = R.ref_v32_sparse_mla(q, kv, idx, tlen, 0.3, torch.float64, torch.float64)
    for t in range(T):
        keys = [int(i) for j, i in enumerate(idx[t]) if 0 <= i < N and j < tlen[t]]
        for h in range(H):
            if not keys:
                assert lse[t, h] == float("-inf") and torch.all(out[t, h] == 0)
                continue
            s = torch.stack([0.3 * torch.dot(q[t, h], kv[k]) for k in keys])
            m = s.max()
            w = torch.exp(s - m)
            want = sum(w[i] * kv[k, :DV] for i, k in enumerate(keys)) / w.sum()
            assert torch.allclose(out[t, h], want, atol=1e-12, rtol=1e-12)
            assert abs(float(lse[t, h]) - float(m + torch.log(w.sum()))) < 1e-12


def test_reference_dequant_round_trips_within_e4m3_precision():
    kv_c, k_pe = make_kv(16, 4)
    c = make_cache("fp8_ds_mla", 2, 8, 5)
    R.ref_v32_kv_insert(kv_c, k_pe, c, torch.arange(16))
    rows = R.ref_v32_kv_gather(c, torch.arange(16))
    x = kv_c.float().reshape(16, 4, 128)
    err = (rows[:, :512].float().reshape(16, 4, 128) - x).abs().amax(-1)
    amax = x.abs().amax(-1)
    assert torch.all(err <= amax * 2.0 ** -3 + 2.0 ** -22)  # half an e4m3 ulp of the scaled tile, at most
    assert torch.equal(rows[:, 512:].view(torch.int16), k_pe.view(torch.int16))
    sc = c.reshape(16, 656)[:, 512:528].contiguous().view(torch.float32)
    assert torch.all(sc == torch.exp2(torch.log2(sc).round()))  # powers of two
    assert torch.all(sc[1] == 2.0 ** -13)  # the all-zero row: the 1e-4 floor


# ---- insert / gather kernels (interpreter on CPU, or the GPU) ----


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_insert_is_bit_identical_to_the_vllm_writer(interpret, fmt, slot_dtype):
    dev = interpret
    nb, bs = 4, 8
    cap = nb * bs
    n = 20
    kv_c, k_pe = make_kv(n + 3, 11, dev)
    kv_c = kv_c[:n + 2]  # row stride 512 but fewer rows than k_pe; and a strided view below
    wide = torch.zeros(n + 2, 700, dtype=torch.bfloat16, device=dev)
    wide[:, :512] = kv_c
    slots = torch.randperm(cap, generator=rng(12))[:n].to(dev)
    slots[3] = -1
    slots[7] = cap  # out of range: skipped
    slots[9] = -7
    for pad in (0, 4):
        for kvc in (kv_c, wide[:, :512]):
            c1 = make_cache(fmt, nb, bs, 13, dev, pad=pad)
            c2 = c1.clone()
            before = cache_bits(c1).clone()
            v32.v32_kv_insert(kvc, k_pe.unsqueeze(1), c1, slots.to(slot_dtype))
            R.ref_v32_kv_insert(kv_c, k_pe, c2, slots)
            assert torch.equal(cache_bits(c1), cache_bits(c2)), f"pad={pad}"
            written = torch.zeros(cap, dtype=torch.bool)
            ok = slots.cpu()[(slots.cpu() >= 0) & (slots.cpu() < cap)]
            written[ok] = True
            untouched = cache_bits(c1).reshape(cap, -1)[~written.to(dev)]
            assert torch.equal(untouched, before.reshape(cap, -1)[~written.to(dev)])


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_insert_of_fp32_rows_quantizes_them_as_they_are(interpret, slot_dtype):
    """fp8_ds_mla from fp32 latents (what vLLM's fused norm + RoPE writer quantizes): bit-equal to
    the reference on the same fp32 rows, and not a bf16 rounding first (some codes differ from
    the bf16 rows' record); an fp32 row into a bf16 cache is refused."""
    dev = interpret
    nb, bs, n = 4, 8, 24
    g = rng(31)
    x = (torch.randn(n, 512, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g))).to(dev)
    _, k_pe = make_kv(n, 32, dev)
    slots = torch.randperm(nb * bs, generator=rng(33))[:n].to(dev)
    slots[2] = -1
    got, want, via_bf16 = (make_cache("fp8_ds_mla", nb, bs, 34, dev) for _ in range(3))
    v32.v32_kv_insert(x, k_pe, got, slots.to(slot_dtype))
    R.ref_v32_kv_insert(x.cpu(), k_pe.cpu(), want, slots.cpu())
    assert torch.equal(cache_bits(got).cpu(), cache_bits(want).cpu())
    R.ref_v32_kv_insert(x.cpu().bfloat16(), k_pe.cpu(), via_bf16, slots.cpu())
    assert not torch.equal(cache_bits(got).cpu(), cache_bits(via_bf16).cpu())
    with pytest.raises(ValueError, match="kv_c"):
        v32.v32_kv_insert(x, k_pe, make_cache("auto", nb, bs, 35, dev), slots)


def test_insert_exponent_for_every_bf16_amax(interpret):
    """One 128-dim tile per positive finite bf16 value as its amax (the rest of the tile
    smaller): the kernel's scales and codes equal the vLLM-semantics writer's."""
    dev = interpret
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    n_tok = -(-amax.numel() // 4)
    a = torch.cat([amax, torch.ones(n_tok * 4 - amax.numel())]).reshape(n_tok, 4, 1)
    frac = torch.rand(n_tok, 4, 128, generator=rng(21)) * 2 - 1
    x = (frac * a).to(torch.bfloat16)
    x[:, :, 0] = a[:, :, 0].to(torch.bfloat16)
    x = x.reshape(n_tok, 512).to(dev)
    pe = torch.zeros(n_tok, 64, dtype=torch.bfloat16, device=dev)
    c1 = torch.zeros(n_tok, 1, 656, dtype=torch.uint8, device=dev)
    c2 = c1.clone()
    slots = torch.arange(n_tok, device=dev)
    v32.v32_kv_insert(x, pe, c1, slots)
    R.ref_v32_kv_insert(x, pe, c2, slots)
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "auto"])
def test_gather_matches_reference_and_zeroes_invalid_slots(interpret, fmt):
    dev = interpret
    nb, bs = 3, 16
    c = fill_cache(fmt, nb, bs, 31, dev)
    cap = nb * bs
    s = torch.tensor([[0, 5, cap - 1, -1], [cap, 17, 17, 2**31 - 1]], device=dev)
    for dt in (torch.int64, torch.int32):
        out = v32.v32_kv_gather(c, s.to(dt))
        ref = R.ref_v32_kv_gather(c, s)
        assert out.shape == (2, 4, QK) and torch.equal(out.view(torch.int16), ref.view(torch.int16))
        assert int(out[0, 3].view(torch.int16).count_nonzero()) == 0
    ws = poison_like(torch.empty(20, QK, dtype=torch.bfloat16, device=dev))
    keep = ws.clone()
    view = v32.v32_kv_gather(c, s, out=ws, row_offset=5)
    assert torch.equal(view.reshape(-1, QK).view(torch.int16), R.ref_v32_kv_gather(c, s).reshape(-1, QK).view(torch.int16))
    assert torch.equal(ws[:5].view(torch.int16), keep[:5].view(torch.int16))
    assert torch.equal(ws[13:].view(torch.int16), keep[13:].view(torch.int16))


def test_bad_arguments_raise_value_error_naming_them():
    c = torch.zeros(2, 4, 656, dtype=torch.uint8)
    kv_c, k_pe = make_kv(3, 1)
    with pytest.raises(ValueError, match="kv_c"):
        v32.v32_kv_insert(kv_c.half(), k_pe, c, torch.arange(3))
    with pytest.raises(ValueError, match="kv_c"):  # fp32 latents: fp8_ds_mla only
        v32.v32_kv_insert(kv_c.float(), k_pe, torch.zeros(2, 4, 576, dtype=torch.bfloat16), torch.arange(3))
    with pytest.raises(ValueError, match="k_pe"):
        v32.v32_kv_insert(kv_c, k_pe[:, :32], c, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        v32.v32_kv_insert(kv_c, k_pe, c, torch.arange(4))
    with pytest.raises(ValueError, match="kv_cache"):
        v32.v32_kv_insert(kv_c, k_pe, torch.zeros(2, 4, 584, dtype=torch.uint8), torch.arange(3))
    q = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q"):
        v32.v32_sparse_mla_decode(q, c, torch.zeros(2, 8, dtype=torch.int32), None, 0.1)
    q = torch.zeros(2, 16, QK, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="indices"):
        v32.v32_sparse_mla_decode(q, c, torch.zeros(3, 8, dtype=torch.int32), None, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        v32.v32_sparse_mla_decode(q, c, torch.zeros(2, 8, dtype=torch.int32), None, 0.1, num_splits=65)
    with pytest.raises(ValueError, match="kv"):
        v32.v32_sparse_mla_prefill(q, torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.int32),
                                   None, 0.1)


# ---- attention kernels on the interpreter (small) ----


@pytest.mark.parametrize("form", ["w64", "w128", "f16"])
@pytest.mark.parametrize("H", [16, 20])
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_decode_kernel_small_against_float64_reference(interpret, form, H, splits):
    dev = interpret
    q, cache, idx, tlen = flashmla_case(2, 2, H, 90, 40, 7, True, 41 + H + splits, dev)
    if dev == "cpu":
        q = q.to(torch.float16)  # the interpreter's bf16 tl.dot is wrong
    idx[1, 3] = idx[1, 4]  # a repeat
    idx[3] = -1  # a token with no valid key
    out, lse = v32.v32_sparse_mla_decode(q, cache, idx, tlen, V32_SCALE, num_splits=splits, form=form)
    check_attention(out, lse, q, cache, idx, tlen, V32_SCALE)
    assert torch.all(lse[3] == float("-inf")) and int(out[3].view(torch.int16).count_nonzero()) == 0


@triton.jit
def _codes_f16_probe(c_ptr, o_ptr, BITS: tl.constexpr):
    o = tl.arange(0, 256)
    b = _ak._codes_f16(tl.load(c_ptr + o), False, BITS)
    tl.store(o_ptr + o, b.to(tl.uint16, bitcast=True))


def _e4m3_values():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.float64)
    nan = torch.isnan(want)
    return codes, torch.where(nan, torch.where(codes >= 128, -480.0, 480.0).double(), want), nan


@pytest.mark.parametrize("bits", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_f16_code_move_is_value_times_2_to_the_minus_8_for_all_256_codes(interpret, bits):
    """The f16 form's decode: every E4M3 code (normals, subnormals, +-0) moved into fp16 bits is
    exactly its value * 2**-8; the NaN codes 0x7F / 0xFF give +-480 * 2**-8 (what the fp32
    portable decode gives, e4b15 has no NaN). BITS (the interpreter's spelling) everywhere; the
    fp8e4b15 -> fp16 cast on the GPU."""
    codes, want, nan = _e4m3_values()
    # the bit formula itself, in torch
    c16 = codes.to(torch.int32)
    moved = (((c16 & 0x7F) << 7) | ((c16 & 0x80) << 8)).to(torch.int16).view(torch.float16).double()
    assert torch.equal(moved * 256.0, want)
    assert int((~nan & (want != 0) & (want.abs() < 2.0 ** -6)).sum()) == 14  # the subnormals are covered
    out = torch.full((256,), 0x7E00, dtype=torch.int16, device=interpret)  # poison: fp16 NaN
    _codes_f16_probe[(1,)](codes.to(interpret), out, BITS=bits)
    got = out.cpu().view(torch.float16).double()
    assert torch.equal(got * 256.0, want), torch.nonzero(got * 256.0 != want)[:5].tolist()


def test_f16_form_accuracy_with_tile_scales_spanning_2_to_the_30(interpret):
    """The f16 form scales P by a per-row power of two before fp16: keys whose tile scales differ
    by 2**30 inside one block (make_kv spread) and q rows from 1e-2 to 1 (scores up to ~1e3: fp32 score rounding stays under the LSE tolerance) stay within the
    attention tolerance of the float64 reference, at BLOCK_N 16 and 32 and with splits."""
    dev = interpret
    nb, bs = 4, 16
    cap = nb * bs
    c = make_cache("fp8_ds_mla", nb, bs, 5, dev)
    kv_c, k_pe = make_kv(cap, 6, dev, spread=True)
    R.ref_v32_kv_insert(kv_c, k_pe, c, torch.arange(cap, device=dev))
    g = rng(7)
    q = torch.randn(3, 16, QK, generator=g) * torch.logspace(-2, 0, 16)[None, :, None]
    q = q.to(torch.float16 if dev == "cpu" else torch.bfloat16).to(dev)
    idx = torch.randint(-1, cap, (3, 40), generator=g).to(torch.int32).to(dev)
    ref = R.ref_v32_sparse_mla_decode(q, c, idx, None, V32_SCALE, torch.float64, torch.float64)
    # keys of two kinds in every block: A (values ~1e-5: tile scales at the writer's 1e-4 floor,
    # 2**-13) and B (the same, but tile 3 ~1e7: scale 2**15; weights ~e**-50 from the RoPE dims;
    # q's tile 3 is 0, so B's scores stay small): tile 3's scales differ by 2**28, so a P scaled
    # by the block's largest tile scale (not the row's largest weight) flushes A to fp16 zero
    kv2, pe2 = (torch.randn(cap, 512, generator=g) * 1e-5, torch.zeros(cap, 64))
    kv2[1::2, 384:] *= 1e12
    pe2[1::2] = -8.0
    c2 = make_cache("fp8_ds_mla", nb, bs, 8, dev)
    R.ref_v32_kv_insert(kv2.to(torch.bfloat16).to(dev), pe2.to(torch.bfloat16).to(dev), c2,
                        torch.arange(cap, device=dev))
    q2 = torch.cat([torch.randn(2, 16, 384, generator=g) * 1e-3, torch.zeros(2, 16, 128), torch.ones(2, 16, 64)],
                   -1).to(q.dtype).to(dev)
    idx2 = torch.stack([torch.randperm(cap, generator=g)[:48] for _ in range(2)]).to(torch.int32).to(dev)
    ref2 = R.ref_v32_sparse_mla_decode(q2, c2, idx2, None, V32_SCALE, torch.float64, torch.float64)
    assert float(ref2[0].abs().max()) < 1e-3 and float(ref2[0][..., 384:].abs().max()) > 1e-6  # A's
    for form in ("f16", "f16:h16n16w4", "f16:h32n32w8", "f16:h16n32w8r128", "f16:t16n32w4", "f16:t16n32w8"):
        for splits in (1, 2):
            out, lse = v32.v32_sparse_mla_decode(q, c, idx, None, V32_SCALE, num_splits=splits, form=form)
            check_attention(out, lse, q, c, idx, None, V32_SCALE, ref)
            out, lse = v32.v32_sparse_mla_decode(q2, c2, idx2, None, V32_SCALE, num_splits=splits, form=form)
            check_attention(out, lse, q2, c2, idx2, None, V32_SCALE, ref2)


def test_decode_int64_indices_out_of_range_never_wrap(interpret):
    dev = interpret
    q, cache, idx, _ = flashmla_case(1, 2, 16, 60, 32, 8, False, 51, dev)
    if dev == "cpu":
        q = q.to(torch.float16)
    i64 = idx.to(torch.int64)
    i64[0, :4] = torch.tensor([2**32, 2**32 + 3, -(2**32), 2**40])  # would wrap to 0, 3 in int32
    out, lse = v32.v32_sparse_mla_decode(q, cache, i64, None, V32_SCALE, num_splits=2)
    check_attention(out, lse, q, cache, i64, None, V32_SCALE)


def test_form_choice_and_unaligned_records_fall_back_to_w64(interpret, monkeypatch):
    assert dispatch.v32.form_for(True, "w128") == "w128" and dispatch.v32.form_for(False, "w128") == "w64"
    assert dispatch.v32.form_for(True, "w64") == "w64"
    assert dispatch.v32.form_for(True, "auto", True, 16) == "w128" and dispatch.v32.form_for(True, "auto", False, 16) == "w64"
    # auto over fp8 records: f16 at H <= 16 from T = 16, w128 at T = 1 and at H > 16 (measured)
    assert dispatch.v32.form_for(True, "auto", True, 16, 16) == "f16" and dispatch.v32.form_for(True, "auto", True, 8, 128) == "f16"
    assert dispatch.v32.form_for(True, "auto", True, 128, 128) == "w128" and dispatch.v32.form_for(False, "auto", True, 16, 64) == "w64"
    assert dispatch.v32.form_for(True, "auto", False, 16, 64) == "w64"
    assert dispatch.v32.form_for(True, "auto", False, 128) == "w128" and dispatch.v32.form_for(False, "auto", True, 128) == "w64"
    assert dispatch.v32.form_for(True, "f16") == "f16" and dispatch.v32.form_for(True, "f16:h16n16w4") == "f16:h16n16w4"
    assert dispatch.v32.form_for(True, "f16", False, 16) == "w64" and dispatch.v32.form_for(True, "f16", False, 128) == "w128"
    assert dispatch.v32.form_for(False, "f16") == "w64"
    with pytest.raises(ValueError, match="DSV4_AMPERE_V32_FORM"):
        dispatch.v32.form_for(True, "f16:h99")
    with pytest.raises(ValueError, match="DSV4_AMPERE_V32_FORM"):
        dispatch.v32.form_for(True, "w128:h16n16w4")
    monkeypatch.setenv(dispatch.v32.FORM_ENV, "w128")
    assert dispatch.v32.form_for(True) == "w128"
    monkeypatch.setenv(dispatch.v32.FORM_ENV, "w256")
    with pytest.raises(ValueError, match="DSV4_AMPERE_V32_FORM"):
        dispatch.v32.form_for(True)
    monkeypatch.delenv(dispatch.v32.FORM_ENV)
    dev = interpret
    # a block stride padded by 4 bytes: records not 16-byte aligned, so w128 must not run
    nb, bs = 3, 8
    c = make_cache("fp8_ds_mla", nb, bs, 62, dev, pad=4)
    kv_c, k_pe = make_kv(nb * bs, 63, dev, spread=False)
    R.ref_v32_kv_insert(kv_c, k_pe, c, torch.arange(nb * bs, device=dev))
    assert not v32._aligned(c, True, c.stride(0), c.stride(1))
    g = rng(64)
    q = torch.randn(2, 16, QK, generator=g).to(torch.float16 if dev == "cpu" else torch.bfloat16).to(dev)
    idx = torch.randint(-1, nb * bs, (2, 20), generator=g).to(torch.int32).to(dev)
    out, lse = v32.v32_sparse_mla_decode(q, c, idx, None, V32_SCALE, form="w128")
    check_attention(out, lse, q, c, idx, None, V32_SCALE)


@pytest.mark.parametrize("form", ["w64", "w128"])
def test_prefill_kernel_small_and_auto_cache(interpret, form):
    dev = interpret
    q, cache, idx, tlen = flashmla_case(2, 2, 16, 70, 24, 5, True, 61, dev)
    ws = v32.v32_kv_gather(cache, torch.arange(cache.shape[0] * cache.shape[1], device=dev))
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    q = q.to(dt)
    out, lse = v32.v32_sparse_mla_prefill(q, ws.to(dt), idx, tlen, V32_SCALE, form=form)
    ref_o, ref_l = R.ref_v32_sparse_mla(q, ws.to(dt), idx, tlen, V32_SCALE, torch.float64, torch.float64)
    assert_attention_close(out, lse, ref_o, ref_l)
    # the bf16 auto cache, read by slot, gives the same attention as its rows
    auto = ws.view(cache.shape[0], cache.shape[1], QK)
    out2, lse2 = v32.v32_sparse_mla_decode(q, auto, idx, tlen, V32_SCALE, num_splits=1, form=form)
    if dev == "cpu":
        assert_attention_close(out2, lse2, ref_o, ref_l)
    else:
        assert torch.equal(out2.view(torch.int16), out.view(torch.int16))


# ---- AOT sm_80 / sm_86 (the session's one compile, conftest fixture aot_results) ----


def test_aot_every_v32_specialization_compiles_spill_free(aot_results):
    from dsv4_ops import aot

    want = sorted(s.label for s in v32.aot_specs() if s.variant == "portable")
    # (insert, gather) x fmt x slots, + the fp8 insert of fp32 rows x slots; attn (w64, w128) x fmt x bh x len x epi;
    # f16 (fp8, one config) x len x epi
    assert len(want) == 2 * 2 * 2 + 2 + 2 * 2 * 2 * 2 * 2 + 2 * 2
    rows = [r for r in aot_results if r.label.startswith("v32_")]
    for arch in aot.AMPERE_ARCHS:
        assert sorted(r.label for r in rows if r.arch == arch) == want, f"sm_{arch}"
    bad = [f"sm_{r.arch} {r.label}: ok={r.ok} spills={r.spill_bytes} smem={r.shared_bytes} {r.error}"
           for r in rows if not r.ok or r.spill_bytes != 0]
    assert not bad, "\n".join(bad)


# ---- opcheck (the same samples are meant for tests/test_opcheck.py's SAMPLES) ----


def _samples_cache(device):
    c = fill_cache("fp8_ds_mla", 3, 8, 71, "cpu").to(device)
    a = R.ref_v32_kv_gather(c.cpu(), torch.arange(24)).view(3, 8, QK).to(device)
    return c, a


def _s_insert(device):
    kv_c, k_pe = make_kv(6, 72)
    slots = torch.tensor([3, -1, 0, 23, 7, 12])
    out = []
    for name, c in zip(("fp8", "auto"), _samples_cache("cpu")):
        out.append((name, tuple(t.to(device) for t in (kv_c, k_pe, c.clone(), slots))))
    return out


def _s_gather(device):
    c, a = _samples_cache(device)
    s = torch.tensor([[0, 5, -1], [23, 24, 7]], device=device)
    return [("fp8", (c, s)), ("auto", (a, s.to(torch.int32)))]


def _s_gather_into(device):
    c, a = _samples_cache(device)
    s = torch.tensor([0, 5, -1, 23], device=device)
    return [("fp8", (c, s, torch.zeros(9, QK, dtype=torch.bfloat16, device=device), 2)),
            ("auto", (a, s, torch.zeros(4, QK, dtype=torch.bfloat16, device=device), 0))]


def _q_idx(device, T=2, H=16, K=12):
    g = rng(73)
    q = torch.randn(T, H, QK, generator=g).to(torch.bfloat16).to(device)
    idx = torch.randint(-2, 26, (T, K), generator=g).to(torch.int32).to(device)
    tlen = torch.tensor([12, 5], dtype=torch.int32, device=device)
    return q, idx, tlen


def _s_decode(device):
    c, a = _samples_cache(device)
    q, idx, tlen = _q_idx(device)
    return [("fp8", (q, c, idx, tlen, 0.1, 0)), ("fp8-split2", (q, c, idx, None, 0.1, 2)),
            ("auto", (q, a, idx, tlen, 0.1, 1))]


def _s_decode_out(device):
    c, _ = _samples_cache(device)
    q, idx, tlen = _q_idx(device)
    return [("fp8", (q, c, idx, tlen, 0.1, 2, torch.zeros(2, 16, DV, dtype=torch.bfloat16, device=device)))]


def _s_prefill(device):
    _, a = _samples_cache(device)
    q, idx, tlen = _q_idx(device)
    return [("rows", (q, a.reshape(-1, QK), idx, tlen, 0.1)), ("nolen", (q, a.reshape(-1, QK), idx, None, 0.1))]


def _s_prefill_out(device):
    _, a = _samples_cache(device)
    q, idx, tlen = _q_idx(device)
    return [("rows", (q, a.reshape(-1, QK), idx, tlen, 0.1, torch.zeros(2, 16, DV, dtype=torch.bfloat16, device=device)))]


V32_OPCHECK_SAMPLES = {
    "v32_kv_insert": _s_insert,
    "v32_kv_gather": _s_gather,
    "v32_kv_gather_into": _s_gather_into,
    "v32_sparse_mla_decode": _s_decode,
    "v32_sparse_mla_decode_out": _s_decode_out,
    "v32_sparse_mla_prefill": _s_prefill,
    "v32_sparse_mla_prefill_out": _s_prefill_out,
}


def _opcheck(name, device):
    op = getattr(torch.ops.dsv4_ampere, name).default
    for case, args in V32_OPCHECK_SAMPLES[name](device):
        try:
            torch.library.opcheck(op, args)
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"{name}[{case}] on {device}: {exc}") from exc


def test_every_v32_op_is_registered_and_sampled():
    from dsv4_ops.registration import op_names

    v32_ops = {n for n in op_names() if n.startswith("v32_")}
    assert v32_ops == set(V32_OPCHECK_SAMPLES)


@pytest.mark.parametrize("name", sorted(V32_OPCHECK_SAMPLES))
def test_opcheck_cpu(name):
    _opcheck(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(V32_OPCHECK_SAMPLES))
def test_opcheck_cuda(monkeypatch, name):
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    _opcheck(name, "cuda")


def test_cpu_ops_run_the_references():
    c, a = _samples_cache("cpu")
    q, idx, tlen = _q_idx("cpu")
    out, lse = torch.ops.dsv4_ampere.v32_sparse_mla_decode(q, c, idx, tlen, 0.1)
    ref_o, ref_l = R.ref_v32_sparse_mla_decode(q, c, idx, tlen, 0.1)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_l)


# ---- GPU: FlashMLA's d_qk = 576 cases, graphs, compile ----

# (s_k, topk, block_size) of FlashMLA's sparse-decode correctness cases with d_qk = 576.
FLASHMLA_CASES = [(512, 64, 69), (1024, 576, 61), (2046, 2048, 64), (2046, 2048, 2)]


# Every (s_k, topk, block_size) x heads {16, 128} x (b, s_q) in {(4, 1), (74, 3)}, except the
# largest shape twice (74 x 3 tokens x 128 heads x 2048 keys runs once, at block size 64).
GPU_CASES = [(c, h, bq) for c in FLASHMLA_CASES for h in (16, 128) for bq in ((4, 1), (74, 3))
             if not (bq == (74, 3) and h == 128 and c == (2046, 2048, 2))]


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["w64", "w128", "f16"])
@pytest.mark.parametrize("case,h,bq", GPU_CASES)
def test_gpu_flashmla_cases(variant, form, case, h, bq):
    (s_k, topk, bs), (b, s_q) = case, bq
    has_len = not (s_k == 512 and b == 4)  # topk_length as vLLM passes it, but one case without
    q, cache, idx, tlen, ref = gpu_case(b, s_q, h, s_k, topk, bs, has_len, s_k + topk + bs + h + b, "cuda")
    out, lse = v32.v32_sparse_mla_decode(q, cache, idx, tlen, V32_SCALE, form=form)
    check_attention(out, lse, q, cache, idx, tlen, V32_SCALE, ref)
    ws = v32.v32_kv_gather(cache, idx.reshape(-1))
    local = torch.arange(idx.numel(), device="cuda", dtype=torch.int32).view_as(idx)
    local = torch.where(idx >= 0, local, -1)
    o2, l2 = v32.v32_sparse_mla_prefill(q, ws, local, tlen, V32_SCALE, form=form)
    assert_attention_close(o2, l2, out.double(), lse.double(), what="prefill vs decode")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["w64", "w128", "f16"])
@pytest.mark.parametrize("all_invalid,zero_seqlen", [(True, False), (False, True)])
@pytest.mark.parametrize("h", [16, 128])
def test_gpu_flashmla_corner_cases(variant, form, all_invalid, zero_seqlen, h):
    q, cache, idx, tlen, ref = gpu_case(74, 3, h, 650, 576, 53, True, 81 + h, "cuda", all_invalid, zero_seqlen)
    out, lse = v32.v32_sparse_mla_decode(q, cache, idx, tlen, V32_SCALE, form=form)
    check_attention(out, lse, q, cache, idx, tlen, V32_SCALE, ref)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.gpu
def test_gpu_insert_bit_identical_large(variant):
    nb, bs = 300, 64
    cap = nb * bs
    kv_c, k_pe = make_kv(cap, 91, "cuda")
    slots = torch.randperm(cap, device="cuda")
    slots[::97] = -1
    for fmt in ("fp8_ds_mla", "auto"):
        c1 = make_cache(fmt, nb, bs, 92, "cuda")
        c2 = c1.clone()
        v32.v32_kv_insert(kv_c, k_pe, c1, slots)
        R.ref_v32_kv_insert(kv_c, k_pe, c2, slots)
        assert torch.equal(cache_bits(c1), cache_bits(c2)), fmt
    # fp32 latents (the fused norm + RoPE writer's rows), spread over many binades
    x = torch.randn(cap, 512, device="cuda") * torch.exp2(torch.randint(-12, 12, (cap, 1), device="cuda"))
    c1 = make_cache("fp8_ds_mla", nb, bs, 93, "cuda")
    c2 = c1.clone()
    v32.v32_kv_insert(x, k_pe, c1, slots)
    R.ref_v32_kv_insert(x, k_pe, c2, slots)
    assert torch.equal(cache_bits(c1), cache_bits(c2)), "fp32 rows"


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["w128", "f16"])
def test_gpu_cuda_graph_replay_equals_eager(monkeypatch, form):
    from dsv4_ops.testing import capture_graph

    monkeypatch.setenv(dispatch.v32.FORM_ENV, form)

    q, cache, idx, tlen = flashmla_case(8, 2, 128, 1024, 2048, 64, True, 101, "cuda")
    kv_c, k_pe = make_kv(16, 102, "cuda")
    slots = torch.arange(16, device="cuda") * 3
    ops = torch.ops.dsv4_ampere
    out = torch.empty(q.shape[0], q.shape[1], DV, dtype=torch.bfloat16, device="cuda")

    def step():
        ops.v32_kv_insert(kv_c, k_pe, cache, slots)
        lse = ops.v32_sparse_mla_decode_out(q, cache, idx, tlen, V32_SCALE, 0, out)
        o2, l2 = ops.v32_sparse_mla_decode(q[:1], cache, idx[:1], None, V32_SCALE, 1)
        return lse, o2, l2

    eager = [t.clone() for t in step()]
    eager_out = out.clone()
    g, res = capture_graph(step)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager_out.view(torch.int16))
    for a, b in zip(res, eager):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["w128", "f16"])
def test_gpu_torch_compile_fullgraph(monkeypatch, form):
    monkeypatch.setenv(dispatch.v32.FORM_ENV, form)
    q, cache, idx, tlen = flashmla_case(4, 1, 16, 512, 64, 69, True, 111, "cuda")
    kv_c, k_pe = make_kv(8, 112, "cuda")
    slots = torch.arange(8, device="cuda")
    ops = torch.ops.dsv4_ampere

    def f(q, cache, idx, tlen, kv_c, k_pe, slots):
        ops.v32_kv_insert(kv_c, k_pe, cache, slots)
        ws = ops.v32_kv_gather(cache, idx.reshape(-1))
        local = torch.arange(idx.numel(), device=idx.device, dtype=torch.int32).view_as(idx)
        o1, l1 = ops.v32_sparse_mla_decode(q, cache, idx, tlen, V32_SCALE, 0)
        o2, l2 = ops.v32_sparse_mla_prefill(q, ws, torch.where(idx >= 0, local, -1), tlen, V32_SCALE)
        return o1 * 2, l1, o2, l2

    c2 = cache.clone()
    eager = f(q, cache, idx, tlen, kv_c, k_pe, slots)
    compiled = torch.compile(f, fullgraph=True)(q, c2, idx, tlen, kv_c, k_pe, slots)
    assert torch.equal(cache, c2)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
