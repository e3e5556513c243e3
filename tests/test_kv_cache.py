"""Paged 584-byte fp8 KV cache: layout, reference packer, kernels (insert, gather), ops.

CPU: the reference against an independent byte-by-byte packer, exact round trip, the
kernels through the Triton interpreter (portable: integer encode, fp8e4b15 decode), the
ops' CPU implementations, AOT sm_80/86 (the session's compile), argument errors. GPU (both
variants): kernels == reference bit for bit, portable == native, adversarial slots, a cache
larger than 2**31 bytes, vLLM's fp32 scale formula replayed on the device. opcheck of every
op: test_opcheck.py. Every random input comes from a seeded generator (``rng``).
"""

import math

import pytest
import torch

from dsv4_ops import aot, kv_cache, layout
from dsv4_ops.reference import (ref_kv_cache_gather, ref_kv_cache_insert, ref_pack_records,
                                ref_ue8m0_exponent, ref_unpack_records)
from dsv4_ops.testing import HAS_GPU, poison_like, rng, short_id

L = layout
DEV = "cuda" if HAS_GPU else "cpu"


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------


def make_kv(n: int, device=DEV, seed: int = 0) -> torch.Tensor:
    """bf16 [n, 512] spanning magnitudes 1e-6..1e4, with edge groups: all zero, amax exactly
    448 * 2**k (a power-of-two ratio), amax just above it, -0.0 entries, tiny values."""
    g = rng(seed)
    x = torch.randn(n, L.HEAD_DIM, dtype=torch.float32, generator=g)
    x *= torch.exp(torch.empty(n, 8, 1).uniform_(-14, 9, generator=g)).repeat_interleave(64, 1).view(n, 8, 64).reshape(n, 512)
    kv = x.to(torch.bfloat16)
    if n >= 6:
        kv[0, 0:64] = 0
        kv[1, 64:128].clamp_(-1, 1)
        kv[1, 64 + 5] = 448 * 2.0 ** -3
        kv[2, 128:192].clamp_(-100, 100)
        kv[2, 130] = -448 * 2.0 ** 4  # negative amax at a power-of-two ratio
        kv[3, 192:256] = 1e-7  # below the 1e-4 floor
        kv[4, 256:320] = -0.0
        kv[5, 320:384].clamp_(-1, 1)
        kv[5, 330] = torch.tensor(448 * 1.0078125, dtype=torch.bfloat16)  # just above 448 * 2**0
    return kv.to(device)


def make_cache(num_blocks: int, block_size: int, extra: int = 0, device=DEV, seed: int = 1) -> torch.Tensor:
    """Poisoned (random-byte) uint8 cache with vLLM-sized pages; extra > 0 gives stride(0) > shape[1]."""
    page = L.vllm_page_bytes(block_size)
    base = torch.empty(num_blocks, page + extra, dtype=torch.uint8).random_(0, 256, generator=rng(seed))
    return base.to(device)[:, :page]


def randperm(n: int, seed: int, device=DEV) -> torch.Tensor:
    return torch.randperm(n, generator=rng(seed)).to(device)


def adversarial_slots(cap: int, n: int, dtype=torch.int64, device=DEV, written=None, seed: int = 2) -> torch.Tensor:
    """Random valid slots (from ``written`` when given: slots whose records were written),
    repeated and unsorted, plus invalid ones (-1, -5, cap, 2**31 - 1, +-2**40)."""
    g = rng(seed)
    if written is None:
        s = torch.randint(0, cap, (n,), dtype=torch.int64, generator=g)
    else:
        w = written.cpu().to(torch.int64)
        w = w[(w >= 0) & (w < cap)]
        s = w[torch.randint(0, w.numel(), (n,), generator=g)]
    bad = [-1, -5, cap, 2**31 - 1] + ([2**40, -(2**40)] if dtype == torch.int64 else [])
    s[torch.randperm(n, generator=g)[:len(bad)]] = torch.tensor(bad, dtype=torch.int64)
    s[-1] = s[0]  # a repeat
    return s.to(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# ---------------------------------------------------------------------------------------
# An independent formulation of the writer: python scalars, explicit byte offsets.
# ---------------------------------------------------------------------------------------


def indep_exponent(amax: float) -> int:
    """Smallest e >= -22 with amax <= 448 * 2**e (python floats: exact)."""
    e = -22
    while amax > 448.0 * 2.0 ** e:
        e += 1
    return e


def indep_insert(kv: torch.Tensor, cache: torch.Tensor, slots, block_size: int) -> None:
    page = cache.stride(0)
    flat = torch.as_strided(cache, (cache.shape[0] * page - (page - cache.shape[1]),), (1,))
    kvf = kv.float().cpu()
    cap = cache.shape[0] * block_size
    for i, s in enumerate(slots):
        if s < 0 or s >= cap:
            continue
        blk, pos = s // block_size, s % block_size
        data = blk * page + pos * 576
        scale = blk * page + block_size * 576 + pos * 8
        for g in range(7):
            grp = kvf[i, 64 * g:64 * g + 64]
            e = indep_exponent(float(grp.abs().max()))
            codes = (grp / 2.0 ** e).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            flat[data + 64 * g:data + 64 * g + 64] = codes.to(cache.device)
            flat[scale + g] = e + 127
        flat[scale + 7] = 0
        rope = kv[i, 448:].cpu().contiguous().view(torch.uint8)  # little-endian bf16
        flat[data + 448:data + 576] = rope.to(cache.device)


# ---------------------------------------------------------------------------------------
# CPU: layout and reference
# ---------------------------------------------------------------------------------------


def test_layout_constants():
    assert (L.RECORD_BYTES, L.DATA_BYTES, L.SCALE_BYTES, L.NOPE_DIM, L.ROPE_DIM) == (584, 576, 8, 448, 64)
    assert (L.HEAD_DIM, L.QUANT_GROUP, L.NUM_SCALES) == (512, 64, 7)
    assert L.min_page_bytes(64) == 64 * 584 and L.vllm_page_bytes(64) == 37440  # 65 * 576
    assert L.UE8M0_MIN_EXP == math.ceil(math.log2(1e-4 / 448))
    assert L.data_offset(130, 64, 37440) == 2 * 37440 + 2 * 576
    assert L.scale_offset(130, 64, 37440) == 2 * 37440 + 64 * 576 + 2 * 8


def test_exponent_all_bf16():
    """ref_ue8m0_exponent (exact frexp of amax / 448) == the independent search, for every
    positive finite bf16."""
    codes = torch.arange(1, 0x7F80, dtype=torch.int16)  # all positive finite bf16
    vals = codes.view(torch.bfloat16)
    ref = ref_ue8m0_exponent(vals)
    ind = torch.tensor([indep_exponent(v) for v in vals.double().tolist()])
    assert torch.equal(ref, ind)
    assert int(ref.min()) == -22 and int(ref.max()) == 120


@pytest.mark.parametrize("block_size,extra", [(1, 0), (16, 0), (64, 24)], ids=["bs1", "bs16", "bs64-gap24"])
def test_ref_insert_matches_independent(block_size, extra):
    num_blocks = 3
    cap = num_blocks * block_size
    kv = make_kv(12, "cpu")
    # A block boundary (last slot of block 0, first of block 1), the last slot, skips.
    slots = [block_size - 1, block_size, cap - 1, -1, -5, cap] + list(range(2, 2 + 6))
    slots = [s if s < cap else cap for s in slots]
    slots = list(dict.fromkeys(slots))  # unique valid slots
    kv = kv[:len(slots)]
    cache = make_cache(num_blocks, block_size, extra, "cpu")
    c_ref, c_ind = cache.clone(), cache.clone()
    if extra:  # keep the strided views on storage that also has the gap bytes
        base_ref = torch.empty(num_blocks, cache.shape[1] + extra, dtype=torch.uint8)
        base_ref.copy_(torch.as_strided(cache, base_ref.shape, (cache.stride(0), 1)))
        base_ind = base_ref.clone()
        c_ref, c_ind = base_ref[:, :cache.shape[1]], base_ind[:, :cache.shape[1]]
    ref_kv_cache_insert(kv, c_ref, torch.tensor(slots), block_size)
    indep_insert(kv, c_ind, slots, block_size)
    assert torch.equal(c_ref, c_ind)
    if extra:
        assert torch.equal(base_ref, base_ind)  # the gap bytes between pages are untouched
    # Offsets directly: the pad byte is 0, the scale row follows all data rows of its block.
    for s in (block_size - 1, block_size):
        blk, pos = divmod(s, block_size)
        assert int(c_ref[blk, block_size * 576 + pos * 8 + 7]) == 0
        i = slots.index(s)
        assert torch.equal(c_ref[blk, pos * 576 + 448:pos * 576 + 576], kv[i, 448:].contiguous().view(torch.uint8))


def test_ref_round_trip_exact():
    """Values that the record represents exactly come back bit for bit."""
    n = 16
    g = rng(3)
    codes = torch.randint(0, 256, (n, 7, 64), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    top = torch.randint(0x77, 0x7F, (n, 7), dtype=torch.uint8, generator=g)  # |code| in (224, 448]: fixes e
    sign = (torch.randint(0, 2, (n, 7), generator=g) << 7).to(torch.uint8)
    codes[:, :, 0] = top | sign
    e = torch.randint(-20, 100, (n, 7, 1), generator=g)
    vals = codes.view(torch.float8_e4m3fn).to(torch.float64) * torch.exp2(e.double())
    kv = torch.cat([vals.reshape(n, 448).to(torch.bfloat16), torch.randn(n, 64, generator=g).to(torch.bfloat16)], dim=1)
    kv[3, :64] = 0  # an all-zero group
    cache = make_cache(2, 8, device="cpu")
    slots = torch.randperm(16, generator=g)
    ref_kv_cache_insert(kv, cache, slots, 8)
    back = ref_kv_cache_gather(cache, slots, 8)
    assert torch.equal(bits(back), bits(kv))
    assert torch.equal(bits(ref_unpack_records(ref_pack_records(kv))), bits(kv))


def test_ref_gather_invalid_and_shapes():
    cache = make_cache(2, 4, device="cpu")
    kv = make_kv(8, "cpu")
    ref_kv_cache_insert(kv, cache, torch.arange(8), 4)
    slots = torch.tensor([[7, -5, 8], [2**40, 0, 7]])
    out = ref_kv_cache_gather(cache, slots, 4)
    assert out.shape == (2, 3, 512) and out.dtype == torch.bfloat16
    assert (bits(out[0, 1]) == 0).all() and (bits(out[0, 2]) == 0).all() and (bits(out[1, 0]) == 0).all()
    assert torch.equal(bits(out[0, 0]), bits(out[1, 2]))
    assert ref_kv_cache_gather(cache[:0], slots, 4).abs().sum() == 0  # empty cache: all zero rows


# ---------------------------------------------------------------------------------------
# CPU: the kernels through the Triton interpreter (portable), against the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=short_id)
def test_kernels_interpreter(interpret, slot_dtype):
    if interpret != "cpu":
        pytest.skip("GPU runs the kernel tests below")
    bs, nb = 16, 4
    cap = bs * nb
    kv = make_kv(24, "cpu")
    slots = randperm(cap, seed=4, device="cpu")[:24]
    slots[[2, 9, 15]] = torch.tensor([-1, -5, cap])
    cache = make_cache(nb, bs, extra=32, device="cpu")
    c_k, c_r = cache.clone(), cache.clone()
    kv_cache.kv_cache_insert(kv, c_k, slots.to(slot_dtype), bs, variant="portable")
    ref_kv_cache_insert(kv, c_r, slots, bs)
    assert torch.equal(c_k, c_r)
    g = adversarial_slots(cap, 30, slot_dtype, "cpu", written=slots).view(5, 6)
    out = kv_cache.kv_cache_gather(c_r, g, bs, variant="portable")
    assert out.shape == (5, 6, 512)
    assert torch.equal(bits(out), bits(ref_kv_cache_gather(c_r, g, bs)))
    ws = poison_like(torch.empty(40, 512, dtype=torch.bfloat16))
    view = kv_cache.kv_cache_gather(c_r, g, bs, out=ws, row_offset=7, variant="portable")
    assert view.shape == (5, 6, 512) and view.data_ptr() == ws[7].data_ptr()
    assert torch.equal(bits(view), bits(out))
    assert ws[:7].isnan().all() and ws[37:].isnan().all()


# ---------------------------------------------------------------------------------------
# CPU: ops, errors, AOT (opcheck of every op: test_opcheck.py)
# ---------------------------------------------------------------------------------------


def test_errors():
    bs = 4
    cache = make_cache(2, bs, device="cpu")
    kv = make_kv(4, "cpu")
    slots = torch.arange(4)
    ins = kv_cache.kv_cache_insert
    with pytest.raises(ValueError, match="kv"):
        ins(kv.float(), cache, slots, bs)
    with pytest.raises(ValueError, match="kv"):
        ins(kv[:, :256], cache, slots, bs)
    with pytest.raises(ValueError, match="kv"):
        ins(kv.to("meta"), cache, slots, bs)
    with pytest.raises(ValueError, match="slot_mapping"):
        ins(kv, cache, slots.float(), bs)
    with pytest.raises(ValueError, match="slot_mapping"):
        ins(kv, cache, torch.arange(5), bs)
    with pytest.raises(ValueError, match="cache"):
        ins(kv, cache.view(torch.int8), slots, bs)
    with pytest.raises(ValueError, match="cache"):
        ins(kv, cache[:, :bs * 584 - 1], slots, bs)  # pages too small
    with pytest.raises(ValueError, match="cache"):
        ins(kv, cache, slots, bs + 1)  # pages too small for block_size
    with pytest.raises(ValueError, match="block_size"):
        ins(kv, cache, slots, 0)
    with pytest.raises(ValueError, match="cache"):
        ins(kv, cache.reshape(-1), slots, bs)
    with pytest.raises(ValueError, match="slots"):
        kv_cache.kv_cache_gather(cache, slots.to(torch.int16), bs)
    with pytest.raises(ValueError, match="slots"):
        kv_cache.kv_cache_gather(cache, slots.to("meta"), bs)
    with pytest.raises(ValueError, match="out"):
        kv_cache.kv_cache_gather(cache, slots, bs, out=torch.empty(5, 512, dtype=torch.bfloat16), row_offset=2)
    with pytest.raises(ValueError, match="out"):
        kv_cache.kv_cache_gather(cache, slots, bs, out=torch.empty(8, 512))
    with pytest.raises(ValueError):  # the op (CPU impl) checks too
        torch.ops.dsv4_ampere.kv_cache_gather(cache, slots, bs + 1)


def test_aot_sm80_sm86(aot_results):
    """The insert and gather kernels, every portable specialization this module lists,
    compile for sm_80/86: no spills, no e4m3 cvt."""
    specs = [s for s in kv_cache.aot_specs() if s.variant == "portable"]
    assert {"kv_cache_insert", "kv_cache_gather"} <= {s.op for s in specs}
    want = {(s.label, a) for s in specs for a in aot.AMPERE_ARCHS}
    rows = [r for r in aot_results if (r.label, r.arch) in want]
    assert {(r.label, r.arch) for r in rows} == want
    for r in rows:
        assert r.ok, r
        assert r.spill_bytes == 0, r


# ---------------------------------------------------------------------------------------
# GPU: both variants
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 64, 256], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=short_id)
def test_gpu_insert_gather_match_reference(variant, block_size, slot_dtype):
    nb = max(4, 4096 // block_size)
    cap = nb * block_size
    n = min(cap, 3000)
    kv = make_kv(n)
    slots = randperm(cap, seed=block_size)[:n]
    slots[randperm(n, seed=block_size + 1)[:4]] = torch.tensor([-1, -5, cap, 2**31 - 1], device="cuda")
    cache = make_cache(nb, block_size, extra=64)
    c_k, c_r = cache.clone(), cache.clone()
    kv_cache.kv_cache_insert(kv, c_k, slots.to(slot_dtype), block_size)
    ref_kv_cache_insert(kv, c_r, slots, block_size)
    torch.cuda.synchronize()
    assert torch.equal(c_k, c_r)
    g = adversarial_slots(cap, 5000, slot_dtype, written=slots).view(50, 100)
    out = kv_cache.kv_cache_gather(c_r, g, block_size)
    assert torch.equal(bits(out), bits(ref_kv_cache_gather(c_r, g, block_size)))
    # the torch ops route to the same kernels
    c_op = cache.clone()
    torch.ops.dsv4_ampere.kv_cache_insert(kv, c_op, slots.to(slot_dtype), block_size)
    assert torch.equal(c_op, c_r)
    assert torch.equal(bits(torch.ops.dsv4_ampere.kv_cache_gather(c_r, g, block_size)), bits(out))


@pytest.mark.gpu
def test_gpu_gather_into_workspace(variant):
    bs, nb = 64, 32
    cap = bs * nb
    cache = make_cache(nb, bs)
    ref_kv_cache_insert(make_kv(cap), cache, torch.arange(cap, device="cuda"), bs)
    topk = adversarial_slots(cap, 512)
    window = torch.arange(cap - 128, cap, device="cuda", dtype=torch.int32)
    ws = poison_like(torch.empty(700, 512, dtype=torch.bfloat16, device="cuda"))
    a = kv_cache.kv_cache_gather(cache, topk, bs, out=ws, row_offset=0)
    b = kv_cache.kv_cache_gather(cache, window, bs, out=ws, row_offset=512)
    torch.ops.dsv4_ampere.kv_cache_gather_into(cache, window[:10], bs, ws, 650)
    assert a.data_ptr() == ws.data_ptr() and b.data_ptr() == ws[512].data_ptr()
    assert torch.equal(bits(ws[:512]), bits(ref_kv_cache_gather(cache, topk, bs)))
    assert torch.equal(bits(ws[512:640]), bits(ref_kv_cache_gather(cache, window, bs)))
    assert torch.equal(bits(ws[650:660]), bits(ws[512:522]))
    assert ws[640:650].isnan().all() and ws[660:].isnan().all()


@pytest.mark.gpu
def test_gpu_portable_equals_native():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native fp8 needs sm_89+")
    bs, nb = 64, 64
    cap = bs * nb
    kv = make_kv(cap)
    slots = randperm(cap, seed=5)
    cache = make_cache(nb, bs)
    c_p, c_n = cache.clone(), cache.clone()
    kv_cache.kv_cache_insert(kv, c_p, slots, bs, variant="portable")
    kv_cache.kv_cache_insert(kv, c_n, slots, bs, variant="native")
    assert torch.equal(c_p, c_n)
    g = adversarial_slots(cap, 10000)
    o_p = kv_cache.kv_cache_gather(c_p, g, bs, variant="portable")
    o_n = kv_cache.kv_cache_gather(c_p, g, bs, variant="native")
    assert torch.equal(bits(o_p), bits(o_n))


@pytest.mark.gpu
def test_gpu_gather_random_bytes(variant):
    """Gather of arbitrary record bytes (no NaN codes, scale bytes 90..160) == the reference."""
    bs, nb = 32, 16
    cache = make_cache(nb, bs, extra=16)
    cache[(cache & 0x7F) == 0x7F] = 0x11
    g = rng(8)
    for p in range(bs):
        cache[:, bs * 576 + p * 8:bs * 576 + p * 8 + 8] = torch.randint(90, 161, (nb, 8), dtype=torch.uint8,
                                                                        generator=g).cuda()
    slots = adversarial_slots(bs * nb, 3000)
    assert torch.equal(bits(kv_cache.kv_cache_gather(cache, slots, bs)), bits(ref_kv_cache_gather(cache, slots, bs)))


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_cache_over_2gib(variant):
    """4096 blocks x 1 MiB (4 GiB): slots in the last blocks, byte offsets past 2**31 (int32 wraps)."""
    page = 1 << 20
    nb = 4096
    bs = page // L.RECORD_BYTES  # 1795
    cache = torch.zeros(nb, page, dtype=torch.uint8, device="cuda")
    cap = nb * bs
    n = 2048
    slots = cap - 1 - randperm(8 * bs, seed=6)[:n]  # the last 8 blocks
    slots[:4] = torch.tensor([2100 * bs + 5, 2048 * bs, 2047 * bs + bs - 1, 0], device="cuda")
    assert L.data_offset(int(slots.max()), bs, page) > 2**31 + 2**30  # past int32 by a wide margin
    kv = make_kv(n)
    kv_cache.kv_cache_insert(kv, cache, slots, bs)
    recs = ref_pack_records(kv)
    for i in (0, 1, 2, 3, 100, n - 1):  # bytes where the layout says, with int64 python offsets
        s = int(slots[i])
        blk, pos = divmod(s, bs)
        assert torch.equal(cache[blk, pos * 576:pos * 576 + 576], recs[i, :576])
        assert torch.equal(cache[blk, bs * 576 + pos * 8:bs * 576 + pos * 8 + 8], recs[i, 576:])
    g = torch.cat([slots, torch.tensor([-5, cap, 2**40], device="cuda")])
    out = kv_cache.kv_cache_gather(cache, g, bs)
    assert torch.equal(bits(out[:n]), bits(ref_unpack_records(recs)))
    assert (bits(out[n:]) == 0).all()
    # nothing written outside the inserted records
    touched = torch.zeros(nb, dtype=torch.bool, device="cuda")
    touched[torch.div(slots, bs, rounding_mode="floor")] = True
    assert int(cache[~touched].count_nonzero()) == 0
    del cache


if HAS_GPU:
    import triton
    import triton.language as tl

    @triton.jit
    def _vllm_formula_kernel(x_ptr, codes_ptr, scale_ptr):
        """Grid (groups,): vLLM 0.33.0's fp32 UE8M0 formula (cache_utils.py L120-152), for
        one 64-dim group: max(|x|) floored at 1e-4, / 448, log2, ceil; x / 2**e; e4nv cvt."""
        g = tl.program_id(0).to(tl.int64)
        o = tl.arange(0, 64)
        x = tl.load(x_ptr + g * 64 + o)  # bf16
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
        e = tl.ceil(tl.log2(amax / 448.0))
        q = tl.clamp(x / tl.exp2(e), -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(codes_ptr + g * 64 + o, q)
        tl.store(scale_ptr + g, tl.maximum(tl.minimum(e + 127.0, 255.0), 0.0).to(tl.uint8))


@pytest.mark.gpu
def test_gpu_exponent_matches_vllm_formula(variant):
    """Every positive finite bf16 as a group amax (and random groups): the record's codes and
    scale bytes equal vLLM's fp32 formula run on this GPU."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the vLLM formula uses the e4nv cvt (sm_89+)")
    amax = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16)  # 32639 values
    ngroups = 7 * ((amax.numel() + 6) // 7)
    g = rng(7)
    grp = (torch.rand(ngroups, 64, generator=g) * 2 - 1)
    a = torch.cat([amax.float(), amax.float()[: ngroups - amax.numel()]])
    grp = (grp * a[:, None]).to(torch.bfloat16)
    grp[torch.arange(ngroups), torch.randint(0, 64, (ngroups,), generator=g)] = a.to(torch.bfloat16) * torch.where(
        torch.rand(ngroups, generator=g) < 0.5, -1.0, 1.0).to(torch.bfloat16)
    grp = grp.cuda()
    n = ngroups // 7
    kv = torch.cat([grp.view(n, 448), torch.randn(n, 64, generator=g).to(torch.bfloat16).cuda()], dim=1)
    codes = torch.empty(ngroups, 64, dtype=torch.uint8, device="cuda")
    scales = torch.empty(ngroups, dtype=torch.uint8, device="cuda")
    _vllm_formula_kernel[(ngroups,)](grp, codes, scales)
    bs = 64
    nb = (n + bs - 1) // bs
    cache = make_cache(nb, bs)
    kv_cache.kv_cache_insert(kv, cache, torch.arange(n, device="cuda"), bs)
    blk = torch.arange(n, device="cuda") // bs
    pos = torch.arange(n, device="cuda") % bs
    data = cache[blk[:, None], (pos * 576)[:, None] + torch.arange(448, device="cuda")]
    sc = cache[blk[:, None], (bs * 576 + pos * 8)[:, None] + torch.arange(7, device="cuda")]
    assert torch.equal(sc.reshape(-1), scales), "UE8M0 scale bytes differ from vLLM's formula"
    assert torch.equal(data.reshape(ngroups, 64), codes), "E4M3 codes differ from vLLM's formula"
