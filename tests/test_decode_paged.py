"""The paged decode op ``dsv4_decode_fused_out`` (paged_decode.dsv4_decode_fused): its two kernels,
csrc_triton.decode.paged_chunk128 (configs h..., 4 x 128-dim chunks of each 584-byte record, any 2-byte
aligned caches) and csrc_triton.decode.paged_f16dot (configs kh / gh / sh / wh..., 16-byte aligned caches,
power-of-two block sizes), and the plan dispatch.decode.plan_step makes for them.

CPU through the Triton interpreter (fp16 q: the interpreter's bf16 tl.dot is wrong; the decoded keys of
these caches are exact in fp16) against the float64 reference with outputs poisoned first: adversarial
slots, no sink, no keys, strided arguments, every launch config a benchmark can pick, caches that are not
16-byte aligned (paged_chunk128 with its 16-byte reads off, ALIGN False); the plan; bad arguments; the AOT
table (no spills on sm_80/86). GPU: both variants at the DSv4 shape, every split class, unaligned caches,
CUDA-graph replay on new inputs == eager, torch.compile(fullgraph=True) through the composite.
"""

import os

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import dispatch, dsv4_decode, envs, paged_decode, paged_plan, reference
from dsv4_ops.csrc_triton.decode import paged_chunk128 as _vk
from dsv4_ops.csrc_triton.decode import paged_f16dot as _v4k
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import arch_programs_an_sm, assert_attention_close, capture_graph, poison_like, rng, short_id

D = 512
SM_SCALE = D ** -0.5
ops = torch.ops.dsv4_ampere


def make_cache(block_size, nblk, seed, extra=8):
    """A paged cache of valid records (reference insert), pages padded by ``extra`` bytes."""
    cache = torch.zeros(nblk, min_page_bytes(block_size) + extra, dtype=torch.uint8)
    rows = (torch.randn(nblk * block_size, D, generator=rng(seed)) * 2).to(torch.bfloat16)
    reference.ref_kv_cache_insert(rows, cache, torch.arange(nblk * block_size), block_size)
    return cache


def base_case(T, H, K1, K2, slot_dtype=torch.int32, seed=0, bs_c=4, nb_c=6, bs_w=8, nb_w=2, lens=(True, True),
              q_dtype=torch.float16, device="cpu"):
    """Inputs of one paged decode call: slots in [-3, cap + 3] (negative, valid, past the end); pages of
    584 * block_size + 8 bytes (not a multiple of 16); lengths of T + 2 / T + 1 entries (past T unread)."""
    g = rng(seed)
    cc, cw = make_cache(bs_c, nb_c, seed), make_cache(bs_w, nb_w, seed + 1)
    cap_c, cap_w = bs_c * nb_c, bs_w * nb_w
    topk = torch.randint(-3, cap_c + 4, (T, K1), generator=g)
    swa = torch.randint(-3, cap_w + 4, (T, K2), generator=g)
    tl = torch.randint(0, K1 + 3, (T + 2,), generator=g).to(torch.int32) if lens[0] else None
    sl = torch.randint(0, K2 + 3, (T + 1,), generator=g).to(slot_dtype) if lens[1] else None
    q = torch.randn(T, H, D, generator=g).to(q_dtype)
    sink = torch.randn(H, generator=g)
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    return dict(q=dev(q), compressed_cache=dev(cc), topk_slots=dev(topk.to(slot_dtype)), topk_length=dev(tl),
                compressed_block_size=bs_c, swa_cache=dev(cw), swa_slots=dev(swa.to(slot_dtype)),
                swa_length=dev(sl), swa_block_size=bs_w, sink=dev(sink), sm_scale=SM_SCALE)


def cpu(args):
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def case(*a, **k):
    """base_case with 16-byte aligned pages (584 * block_size + 16 bytes for the block sizes used
    here: 4 -> 2352, 8 -> 4688, 64 -> 37392)."""
    k.setdefault("bs_c", 4)
    k.setdefault("bs_w", 8)
    args = base_case(*a, **k)
    for name in ("compressed_cache", "swa_cache"):
        c = args[name]
        pad = (-c.shape[1]) % 16
        if pad:
            wide = torch.zeros(c.shape[0], c.shape[1] + pad, dtype=c.dtype, device=c.device)
            wide[:, :c.shape[1]] = c
            args[name] = wide
    return args


# How a cache is made not 16-byte aligned: its first byte 2 bytes into a 16-byte aligned buffer
# ("address"), its page stride 6 bytes past a multiple of 16 ("stride"), or both. check_cache takes
# any even address and stride (the RoPE dims are 2-byte words).
MISALIGNMENTS = {"address": (2, 0), "stride": (0, 6), "both": (2, 6)}


def misaligned(cache, how, junk=0xFF):
    """The pages of ``cache`` (uint8 [nblk, page_bytes]) in a view that is not 16-byte aligned
    (MISALIGNMENTS[how]): its page stride page_bytes rounded up to 16, plus the stride pad; the view
    ``offset`` bytes into a larger buffer. Every byte of the buffer outside the pages (before, between,
    after) is ``junk`` (0xFF: an E4M3 NaN code, a 2**128 scale), so a read outside a page shows."""
    offset, pad = MISALIGNMENTS[how]
    nblk, width = cache.shape
    stride = -(-width // 16) * 16 + pad
    buf = torch.full((offset + nblk * stride + 64,), junk, dtype=torch.uint8, device=cache.device)
    view = buf.as_strided((nblk, width), (stride, 1), offset)
    view.copy_(cache[:, :width])
    assert view.storage_offset() == offset and view.stride(0) == stride
    assert (view.data_ptr() % 16 != 0) == bool(offset) and (stride % 16 != 0) == bool(pad)
    return view


def unaligned_case(*a, how="both", which=("compressed_cache", "swa_cache"), **k):
    """base_case with ``which`` caches not 16-byte aligned (``misaligned``)."""
    args = base_case(*a, **k)
    for name in which:
        args[name] = misaligned(args[name], how)
    assert not paged_plan.paged_aligned(args["compressed_cache"], args["swa_cache"])
    return args


def run_and_check(args, num_splits, device, config=""):
    T, H = args["q"].shape[:2]
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=device))
    got, lse = paged_decode.dsv4_decode_fused(**args, num_splits=num_splits, out=out, config=config)
    assert got is out
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
    assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)


@pytest.mark.parametrize("splits", [1, 3, 0], ids=["direct", "S3", "plan"])
@pytest.mark.parametrize("lens", [(True, True), (False, False)], ids=["tl-sl", "nolen"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
@pytest.mark.parametrize("T,H,K1,K2", [(3, 8, 40, 9), (2, 40, 21, 16), (1, 3, 0, 7)],
                         ids=["T3-H8", "T2-H40-two-groups", "T1-H3-swa-only"])
def test_v3_matches_float64_reference(interpret, T, H, K1, K2, slot_dtype, lens, splits):
    args = case(T, H, K1, K2, slot_dtype, seed=T * 5 + H + K1, lens=lens, device=interpret)
    run_and_check(args, splits, interpret)


@pytest.mark.parametrize("config", sorted(_vk.V3_CANDIDATES))
def test_v3_every_candidate_config_matches_reference(interpret, config):
    """Every paged_chunk128 config a caller or DSV4_AMPERE_DECODE_CONFIG may force is correct."""
    args = case(3, 20, 40, 9, seed=17, device=interpret)
    args["topk_slots"][0, :3] = torch.tensor([-1, 10 ** 6, 5]).to(torch.int32).to(interpret)
    run_and_check(args, 1, interpret, config)
    run_and_check(args, 2, interpret, config)


# One v4 config per (block shape, PV mode): warps / stages do not change the interpreter's result.
V4_SHAPES = sorted({(c["BLOCK_H"], c["BLOCK_N"], c["PV_KEY"], c.get("STREAM", False), c.get("WIDE_PV", False)): n
                    for n, c in _v4k.V4_CANDIDATES.items()}.values())


@pytest.mark.parametrize("config", V4_SHAPES)
def test_v4_every_block_shape_matches_reference(interpret, config):
    """The fp16-dot kernel (paged_f16dot) at every block shape and PV mode a config can pick."""
    args = case(3, 20, 40, 9, seed=19, device=interpret)
    args["topk_slots"][0, :3] = torch.tensor([-1, 10 ** 6, 5]).to(torch.int32).to(interpret)
    run_and_check(args, 1, interpret, config)
    run_and_check(args, 3, interpret, config)


@pytest.mark.parametrize("config", ["kh16n32w4", "gh16n32w4"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_v4_lengths_no_sink_and_adversarial_slots(interpret, config, slot_dtype):
    args = case(2, 8, 24, 8, slot_dtype, seed=23, device=interpret)
    info = torch.iinfo(slot_dtype)
    ext = torch.tensor([info.min, info.max, -1, 2 ** 31 - 1, -(2 ** 31), 24, 23, 0], dtype=torch.int64)
    args["topk_slots"][0, :8] = ext.to(slot_dtype).to(interpret)
    args["swa_slots"][1] = -1
    run_and_check(args, 1, interpret, config)
    run_and_check(dict(args, sink=None), 2, interpret, config)
    args["topk_slots"][1] = -1  # token 1: no valid key at all
    run_and_check(dict(args, sink=None), 1, interpret, config)
    run_and_check(args, 4, interpret, config)


@pytest.mark.parametrize("bs", [(2, 16), (16, 8), (1, 4)], ids=["2-16", "16-8", "1-4"])
def test_v4_block_sizes_as_shifts(interpret, bs):
    """Power-of-two block sizes reach the kernel as shifts (page = slot >> s, position = slot & mask)."""
    args = case(3, 8, 40, 9, seed=41, bs_c=bs[0], nb_c=7, bs_w=bs[1], nb_w=3, device=interpret)
    run_and_check(args, 1, interpret, "kh16n32w4")
    run_and_check(args, 2, interpret, "kh16n32w4")


@pytest.mark.parametrize("config", ["kh16n16w4", "gh16n16w4"])
def test_v4_long_key_loop_one_split(interpret, config):
    """32 key blocks in one program (S = 1): the P unit must not drift from block to block (a
    unit rounded strictly up doubled each block and underflowed p' after ~20: H200 call 1)."""
    args = case(2, 8, 480, 32, seed=37, lens=(False, False), device=interpret)
    run_and_check(args, 1, interpret, config)


def wide_scale_cache(block_size, nblk, seed, key_exp=12, group_exp=6):
    """Records whose NoPE groups span 2**+-group_exp within a key and keys 2**+-key_exp (UE8M0
    bytes far apart inside one key block; the RoPE dims unscaled, so they stay in fp16 range
    under the interpreter): the per-key scales and P units of v4 must hold."""
    from dsv4_ops.layout import min_page_bytes

    g = rng(seed)
    n = nblk * block_size
    rows = torch.randn(n, D, generator=g, dtype=torch.float64)
    k_exp = torch.randint(-key_exp, key_exp + 1, (n, 1), generator=g)
    g_exp = torch.randint(-group_exp, group_exp + 1, (n, 7), generator=g).repeat_interleave(64, 1)
    rows[:, :448] *= torch.pow(2.0, (k_exp + g_exp).double())
    cache = torch.zeros(nblk, min_page_bytes(block_size) + 16, dtype=torch.uint8)
    reference.ref_kv_cache_insert(rows.to(torch.bfloat16), cache, torch.arange(n), block_size)
    return cache


def wide_case(device, q_dtype=torch.float16, key_exp=12, group_exp=6):
    args = case(2, 16, 40, 8, seed=29, lens=(False, False), q_dtype=q_dtype, device=device)
    args["compressed_cache"] = wide_scale_cache(4, 6, 31, key_exp, group_exp).to(device)
    args["swa_cache"] = wide_scale_cache(8, 2, 32, key_exp, group_exp).to(device)
    q = args["q"].float()
    q[..., :448] *= 2.0 ** -key_exp
    args["q"] = q.to(q_dtype)
    return args


@pytest.mark.parametrize("config", ["kh16n32w4", "gh16n32w4"])
def test_v4_wide_scale_spread_matches_reference(interpret, config):
    """Keys 2**+-12 apart and groups 2**+-6 apart inside a key, q's NoPE dims 2**-12 (scores of
    both signs and sizes): every per-key scale, q prescale and P unit path runs, vs float64.
    (The v3 kernel decodes to q's dtype, fp16 here, which such values overflow: GPU only.)"""
    args = wide_case(interpret)
    run_and_check(args, 1, interpret, config)
    run_and_check(args, 2, interpret, config)


def test_v4_code_to_f16_is_exact_for_every_code(interpret):
    """paged_f16dot.code_to_f16: every E4M3 byte but the two NaNs -> its value * 2**-8, bit-exact."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, y_ptr):
        o = tl.arange(0, 256)
        tl.store(y_ptr + o, _v4k.code_to_f16(tl.load(x_ptr + o)))

    codes = torch.arange(256, dtype=torch.uint8, device=interpret)
    got = torch.empty(256, dtype=torch.float16, device=interpret)
    k[(1,)](codes, got)
    want = codes.cpu().view(torch.float8_e4m3fn).double() * 2.0 ** -8
    ok = ~torch.isnan(want)
    assert int(ok.sum()) == 254
    assert torch.equal(got.cpu().double()[ok], want[ok])
    assert torch.equal(got.cpu().view(torch.int16)[ok] < 0, codes.cpu()[ok] >= 128)  # the sign of +-0 too


def test_v3_no_sink_and_no_keys(interpret):
    args = case(2, 5, 12, 4, seed=3, device=interpret)
    args["topk_slots"][1] = -1
    args["swa_slots"][1] = 10 ** 6
    run_and_check(args, 1, interpret)
    run_and_check(dict(args, sink=None), 1, interpret)
    run_and_check(dict(args, sink=None), 4, interpret)


def plant_adversarial_slots(args, slot_dtype, device):
    """Out-of-range, negative, dtype-extreme and repeated slots into a case of T = 2, K1 = 24, K2 = 8."""
    info = torch.iinfo(slot_dtype)
    ext = torch.tensor([info.min, info.max, -1, 2 ** 31 - 1, -(2 ** 31), 24, 23, 0], dtype=torch.int64)
    if slot_dtype == torch.int64:
        ext[3] = 2 ** 40
    args["topk_slots"][0, :8] = ext.to(slot_dtype).to(device)
    args["topk_slots"][1] = 5  # one slot repeated 24 times
    args["swa_slots"][0, :4] = torch.tensor([info.max, info.min, 16, 15], dtype=torch.int64).to(slot_dtype).to(device)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_v3_adversarial_slots(interpret, slot_dtype):
    """Out-of-range, negative, dtype extremes and repeated slots: masked or counted each time."""
    args = case(2, 8, 24, 8, slot_dtype, seed=21, lens=(False, False), device=interpret)
    plant_adversarial_slots(args, slot_dtype, interpret)
    run_and_check(args, 1, interpret)
    run_and_check(args, 5, interpret)


# ---- caches that are not 16-byte aligned: paged_chunk128 with its 16-byte reads off (ALIGN False) ----


def unaligned_config():
    """The paged_chunk128 config every plan over unaligned caches runs (spill-free with ALIGN off)."""
    return _vk.V3_UNALIGNED[0]


def spy_plans(monkeypatch):
    """The PagedPlans the op's calls make, in order."""
    made = []
    real = paged_plan.make_paged_plan
    monkeypatch.setattr(paged_plan, "make_paged_plan", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    return made


def plan_of(args, num_splits=0, config=""):
    """make_paged_plan of the op's call on ``args`` (metadata only: nothing runs)."""
    T, H = args["q"].shape[:2]
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=args["q"].device)
    return paged_plan.make_paged_plan(args["q"], args["compressed_cache"], args["topk_slots"], args["topk_length"],
                                      args["compressed_block_size"], args["swa_cache"], args["swa_slots"],
                                      args["swa_length"], args["swa_block_size"], args["sink"] is not None,
                                      num_splits, out, "portable", config)


def assert_unaligned_plan(p, T, H):
    """The paged_chunk128 kernel in its unaligned config (V3_UNALIGNED) with ALIGN, its last constexpr,
    off; never the balanced split (a paged_f16dot form)."""
    assert p.kernel is paged_plan._v3_kernel and p.config == unaligned_config(), p.config
    assert p.consts[-1] is False and not p.balanced
    assert p.plan_arg is False


def test_misaligned_views_are_what_the_op_accepts_and_hold_the_records():
    """The views of MISALIGNMENTS: the address 2 bytes past 16-byte alignment and / or the page stride
    6 bytes past a multiple of 16; the op's cache check takes them (an even address and stride), the
    records are the aligned cache's byte for byte, and an odd offset or stride is refused."""
    from dsv4_ops import kv_cache

    cache = make_cache(4, 3, seed=1)
    for how, (offset, pad) in MISALIGNMENTS.items():
        v = misaligned(cache, how)
        kv_cache.check_cache(v, 4)
        assert (v.data_ptr() % 16, v.stride(0) % 16) == (offset, pad)
        assert torch.equal(v, cache[:, :v.shape[1]]) and v.shape[1] == cache.shape[1]
        assert not paged_plan.paged_aligned(v, cache) and not paged_plan.paged_aligned(cache, v)
    assert paged_plan.paged_aligned(case(1, 1, 1, 1)["compressed_cache"], case(1, 1, 1, 1)["swa_cache"])
    buf = torch.zeros(cache.numel() + 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="cache"):  # an odd address: the RoPE dims are 2-byte words
        kv_cache.check_cache(buf.as_strided(cache.shape, (cache.shape[1] + 16, 1), 1), 4)
    with pytest.raises(ValueError, match="cache"):  # an odd page stride
        kv_cache.check_cache(buf.as_strided((2, cache.shape[1]), (cache.shape[1] + 1, 1), 0), 4)


@pytest.mark.parametrize("which", [("compressed_cache",), ("swa_cache",), ("compressed_cache", "swa_cache")],
                         ids=["compressed", "window", "both"])
@pytest.mark.parametrize("how", sorted(MISALIGNMENTS))
@pytest.mark.parametrize("T,H", [(1, 8), (4, 8), (16, 8), (64, 8), (16, 64), (64, 64), (1, 128), (256, 8)])
def test_unaligned_caches_plan_paged_chunk128_with_align_off(T, H, how, which):
    """Either cache not 16-byte aligned (address, page stride or both): the op's plan is paged_chunk128's
    unaligned config with ALIGN off, also where the aligned plan is a paged_f16dot config (T = 16,
    64, 256 at H = 8; the H = 64 windows; T = 1, H = 128), at the planner's split count for unaligned
    caches; the same shape over aligned caches plans the planner's config (ALIGN on for paged_chunk128)."""
    dd = dispatch.decode
    kw = dict(bs_c=64, nb_c=2, bs_w=64, nb_w=2, lens=(True, False))
    aligned = case(T, H, 512, 128, seed=T + H, **kw)
    sms, smem = dispatch.device.num_sms_at(-1), dispatch.device.smem_per_block(-1)
    want = dd.plan_step(T, H, 640, sms, smem, (64, 64), lengths=True)
    p = plan_of(aligned)
    assert (p.config, p.splits) == (want.config, want.splits)
    if dd.is_f16dot(dd.v3_config(want.config)):
        assert p.kernel is not paged_plan._v3_kernel and p.plan_arg
    else:
        assert p.kernel is paged_plan._v3_kernel and p.consts[-1] is True
    un = unaligned_case(T, H, 512, 128, seed=T + H, how=how, which=which, **kw)
    p = plan_of(un)
    assert_unaligned_plan(p, T, H)
    assert p.splits == dd.plan_step(T, H, 640, sms, smem, (64, 64), lengths=True, aligned=False).splits
    assert p.splits <= dd.split_cap(T, H)
    # a forced config (the caller's, or DSV4_AMPERE_DECODE_CONFIG), paged_f16dot's or paged_chunk128's
    # aligned one, runs the unaligned config too (the one the AOT table compiles with ALIGN off)
    assert_unaligned_plan(plan_of(un, 2, "kh16n32w4"), T, H)
    assert_unaligned_plan(plan_of(un, 2, "h16n16w4"), T, H)
    with envs.override(**{envs.DECODE_CONFIG: "kh32n64w8"}):
        assert_unaligned_plan(plan_of(un), T, H)
        assert plan_of(aligned).config == "kh32n64w8"


def test_the_paged_f16dot_shapes_are_in_the_unaligned_plan_test():
    """The shapes above include plans the aligned caches run on paged_f16dot (else the fallback is untested):
    on this machine's plan (no CUDA device: 108 SMs, an A100's shared memory), where V3_COST moves T = 64,
    H = 8 from the window's kh16n64w8 to kh16n32w4."""
    dd = dispatch.decode
    sms, smem = dispatch.device.num_sms_at(-1), dispatch.device.smem_per_block(-1)
    assert (sms, smem) == (108, 163 * 1024)
    got = {(T, H): dd.plan_step(T, H, 640, sms, smem, (64, 64)).config
           for T, H in [(16, 8), (64, 8), (16, 64), (64, 64), (1, 128), (256, 8)]}
    assert got == {(16, 8): "kh16n32w4", (64, 8): "kh16n32w4", (16, 64): "kh32n64w8", (64, 64): "kh32n64w8",
                   (1, 128): "kh16n64w8", (256, 8): "kh16n32w4"}
    assert dd.resolve_config(64, 8, 640, smem)[0] == "kh16n64w8"


@pytest.mark.parametrize("splits", [1, 3, 0], ids=["direct", "S3", "plan"])
@pytest.mark.parametrize("lens", [(True, True), (False, False)], ids=["tl-sl", "nolen"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_unaligned_caches_match_float64_reference(interpret, monkeypatch, slot_dtype, lens, splits):
    """Both caches at an address 2 bytes past 16-byte alignment with page strides 6 bytes past a multiple
    of 16 (junk bytes around every page): the op runs paged_chunk128 with ALIGN off and gives the float64
    reference's output, with and without lengths, int32 and int64 slots, direct and split."""
    T, H = 3, 20  # two head groups, the last partial
    args = unaligned_case(T, H, 40, 9, slot_dtype, seed=51 + splits, lens=lens, device=interpret)
    made = spy_plans(monkeypatch)
    run_and_check(args, splits, interpret)
    (p,) = made
    assert_unaligned_plan(p, T, H)
    planned = dispatch.decode.plan_step(T, H, 49, dispatch.device.num_sms_at(-1), -1, (4, 8), lengths=lens[0],
                                        int32_slots=slot_dtype == torch.int32, aligned=False).splits
    assert p.splits == (splits or planned) and p.direct == (p.splits == 1)


@pytest.mark.parametrize("how", ["address", "stride"])
def test_unaligned_one_cache_and_forced_configs_match_float64_reference(interpret, monkeypatch, how):
    """One cache misaligned (the address alone, or the page stride alone), the other aligned; a forced
    config (paged_f16dot's or paged_chunk128's) runs paged_chunk128's unaligned config."""
    T, H = 2, 8
    args = unaligned_case(T, H, 24, 16, seed=57, how=how, which=("swa_cache" if how == "address" else
                                                                  "compressed_cache",), device=interpret)
    made = spy_plans(monkeypatch)
    run_and_check(args, 2, interpret, "kh16n32w4")
    run_and_check(args, 1, interpret, "h16n16w4")
    assert_unaligned_plan(made[0], T, H)
    assert_unaligned_plan(made[1], T, H)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_unaligned_adversarial_slots(interpret, monkeypatch, slot_dtype):
    """Out-of-range, negative, dtype extremes and repeated slots over unaligned caches: masked or counted
    each time (a slot one past the capacity would read the junk between pages)."""
    args = unaligned_case(2, 8, 24, 8, slot_dtype, seed=21, lens=(False, False), device=interpret)
    plant_adversarial_slots(args, slot_dtype, interpret)
    made = spy_plans(monkeypatch)
    run_and_check(args, 1, interpret)
    run_and_check(args, 5, interpret)
    assert [p.splits for p in made] == [1, 5]
    for p in made:
        assert_unaligned_plan(p, 2, 8)


def test_unaligned_no_sink_and_no_keys(interpret):
    """No sink; a token whose every entry is invalid: out 0, lse -inf (sink None) / the sink, never NaN."""
    args = unaligned_case(2, 5, 12, 4, seed=3, device=interpret)
    args["topk_slots"][1] = -1
    args["swa_slots"][1] = 10 ** 6
    run_and_check(args, 1, interpret)
    run_and_check(dict(args, sink=None), 1, interpret)
    run_and_check(dict(args, sink=None), 4, interpret)


def test_strided_slots_q_and_out(interpret):
    """Slot rows and q rows with a stride (column slices), out a slice of a wider buffer (the rest of it
    untouched), over unaligned caches and aligned ones."""
    for make in (unaligned_case, case):
        args = make(2, 8, 9, 4, seed=9, device=interpret)
        wide = torch.full((2, 15), -1, dtype=torch.int32, device=interpret)
        wide[:, 3:12] = args["topk_slots"]
        qw = torch.zeros(2, 10, D, dtype=args["q"].dtype, device=interpret)
        qw[:, 1:9] = args["q"]
        buf = poison_like(torch.empty(2, 10, D, dtype=torch.bfloat16, device=interpret))
        sliced = dict(args, topk_slots=wide[:, 3:12], q=qw[:, 1:9])
        out, lse = paged_decode.dsv4_decode_fused(**sliced, num_splits=2, out=buf[:, 2:10])
        want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
        assert_attention_close(buf[:, 2:10].cpu(), lse.cpu(), want, want_lse)
        assert torch.isnan(buf[:, :2].float()).all()


def test_the_split_cap_applies_to_direct_op_calls():
    """num_splits 0 on a direct op call: the plan's split count, capped so that the partials stay under
    PAGED_PARTIALS_MAX_BYTES (dispatch.decode.split_cap), as the composite's (T = 256, H = 8, K = 640:
    kh16n32w4, 4 splits modelled, 3 run); a caller's count is the caller's."""
    dd = dispatch.decode
    T, H = 256, 8
    args = case(T, H, 512, 128, seed=5, bs_c=64, nb_c=2, bs_w=64, nb_w=2)
    sms, smem = dispatch.device.num_sms_at(-1), dispatch.device.smem_per_block(-1)
    cfg = dd.v3_config("kh16n32w4")
    assert dd.v3_splits(T, H, 640, sms, cfg["BLOCK_H"], cfg["BLOCK_N"], "kh16n32w4", smem) == 4
    assert dd.split_cap(T, H) == 3
    p = plan_of(args)
    assert (p.config, p.splits) == ("kh16n32w4", 3)
    assert "capped at 3" in dd.plan_step(T, H, 640, sms, smem, (64, 64), lengths=True).why
    assert plan_of(args, 4).splits == 4
    assert T * H * p.splits * (D + 1) * 4 <= dd.PAGED_PARTIALS_MAX_BYTES < T * H * 4 * (D + 1) * 4


def test_reference_equals_the_workspace_composite_on_cpu(monkeypatch):
    """The op's reference against the two-op composite (gather + sparse_mla_decode: mode tiles) on the
    CPU, over aligned and unaligned caches."""
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")
    for make in (case, unaligned_case):
        args = make(3, 8, 20, 8, seed=5, q_dtype=torch.bfloat16)
        args.pop("swa_length")
        want = dsv4_decode.dsv4_decode_attention(**args)
        got = reference.ref_dsv4_decode_fused(**args, swa_length=None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("mode", ["auto", "v3"])
def test_composite_paged_route_on_cpu_equals_the_workspace_step(monkeypatch, mode):
    """Modes auto and v3: the composite's one op call gives the workspace step's outputs (mode tiles),
    into the caller's out, over aligned and unaligned caches."""
    for make in (case, unaligned_case):
        args = make(4, 8, 512, 128, seed=12, bs_c=64, nb_c=3, bs_w=64, nb_w=2, q_dtype=torch.bfloat16)
        sl = args.pop("swa_length")
        monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")
        want = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl)
        monkeypatch.setenv(dispatch.decode.ENV_VAR, mode)
        assert dispatch.decode.route(dispatch.decode.mode()) == "paged"
        out = poison_like(torch.empty_like(args["q"]))
        got = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl, out=out)
        assert got[0] is out
        assert torch.equal(out, want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bad,match", [
    ("q_dtype", "q"), ("float_slots", "topk_slots"), ("short_len", "swa_length"), ("rows", "swa_slots"),
    ("cache_dtype", "cache"), ("sink_shape", "sink"), ("out_shape", "out"), ("splits", "num_splits"),
    ("block_size", "pages"), ("odd_stride", "cache"), ("odd_address", "cache")])
def test_bad_arguments_raise(bad, match):
    """The op launcher and the op itself refuse each bad argument by name (an odd page stride or an odd
    cache address among them: the paged kernels read 2-byte words at least)."""
    args = case(2, 4, 6, 4, seed=4, q_dtype=torch.bfloat16)
    out = torch.zeros(2, 4, D, dtype=torch.bfloat16)
    splits = 0
    if bad == "q_dtype":
        args["q"] = args["q"].float()
    elif bad == "float_slots":
        args["topk_slots"] = args["topk_slots"].float()
    elif bad == "short_len":
        args["swa_length"] = args["swa_length"][:1]
    elif bad == "rows":
        args["swa_slots"] = args["swa_slots"][:1]
    elif bad == "cache_dtype":
        args["swa_cache"] = args["swa_cache"].to(torch.int8)
    elif bad == "sink_shape":
        args["sink"] = args["sink"][:3]
    elif bad == "out_shape":
        out = out[:, :3]
    elif bad == "splits":
        splits = 65
    elif bad == "block_size":
        args["compressed_block_size"] = 64
    elif bad in ("odd_stride", "odd_address"):
        c = args["compressed_cache"]
        buf = torch.zeros(c.numel() + c.shape[0] + 64, dtype=torch.uint8)
        stride, offset = (c.shape[1] + 1, 0) if bad == "odd_stride" else (c.shape[1], 1)
        args["compressed_cache"] = buf.as_strided(c.shape, (stride, 1), offset)
        args["compressed_cache"].copy_(c)
    with pytest.raises(ValueError, match=match):
        paged_decode.dsv4_decode_fused(**args, num_splits=splits, out=out)
    with pytest.raises(ValueError, match=match):
        ops.dsv4_decode_fused_out(*args.values(), splits, out)


@pytest.mark.parametrize("T,H,sms", [(1, 8, 132), (4, 64, 132), (64, 64, 132), (128, 8, 108), (256, 128, 132),
                                     (64, 8, 132), (64, 16, 108), (1, 128, 132), (16, 8, 132), (256, 8, 108)])
def test_v3_plan_is_static_and_sane(T, H, sms):
    """plan_step's plan: a dispatched config, a balanced split count of least modelled time on these SMs
    (dispatch.decode.V3_COST) unless that many splits' partials pass PAGED_PARTIALS_MAX_BYTES (then the
    cap, split_cap), the same every call."""
    dd = dispatch.decode
    p = dd.plan_step(T, H, 640, sms)
    nb = -(-640 // p.block_n)
    assert p.kernel == "v3" and 1 <= p.splits <= min(nb, 64) and p.direct == (p.splits == 1)
    assert p.groups * p.block_h >= H and p.groups == -(-H // p.block_h)
    assert dd.resolve_config(T, H, 640)[0] in _vk.V3_DISPATCHED + _v4k.V4_DISPATCHED
    assert p.config in _vk.V3_DISPATCHED + _v4k.V4_DISPATCHED
    assert (p.block_h, p.block_n) == (dd.v3_config(p.config)["BLOCK_H"], dd.v3_config(p.config)["BLOCK_N"])

    def cost(s):
        return dd.v3_cost_us(T, H, 640, sms, p.config, s)

    counts = dd.balanced_splits(nb)
    best = min(counts, key=lambda s: (cost(s), s))
    assert p.splits == min(best, dd.split_cap(T, H))
    assert ("capped at" in p.why) == (best > dd.split_cap(T, H))
    assert dd.plan_step(T, H, 640, sms) == p


def test_the_plan_is_data_and_why_is_not_part_of_it():
    """DecodePlan equality is the launch's facts: two plans alike but for their reasons are equal."""
    import dataclasses

    p = dispatch.decode.plan_step(4, 8, 640, 108)
    assert dataclasses.replace(p, why="another reason") == p
    assert dataclasses.replace(p, splits=p.splits + 1) != p


def test_modes_route_the_composite(monkeypatch):
    """v3 and auto take the paged op whatever the shape; the removed 'fused' mode is refused by name."""
    dd = dispatch.decode
    for m in ("v3", "auto"):
        monkeypatch.setenv(dd.ENV_VAR, m)
        assert dd.mode() == m and dd.route(dd.mode()) == "paged" and "paged op" in dd.resolve_route(m)[1]
    monkeypatch.setenv(dd.ENV_VAR, "fused")
    with pytest.raises(ValueError, match=dd.ENV_VAR):
        dd.mode()


@pytest.mark.parametrize("prefix", ["v3-", "v3u-"], ids=["aligned", "unaligned"])
def test_aot_v3_kernels_compile_for_sm80_and_sm86(aot_results, prefix):
    """Every dispatched paged_chunk128 specialization, with its 16-byte reads (v3-, ALIGN on: the
    V3_DISPATCHED configs) and without (v3u-, ALIGN off: V3_UNALIGNED, for caches that are not 16-byte
    aligned), compiles for sm_80 and sm_86, fits shared memory, holds no e4m3 cvt, and spills nothing
    (with ALIGN off h16n32w4 spilled 1.8-2.2 KB a thread and h16n16w4 up to 72 B: hence h16n32w8)."""
    from dsv4_ops import aot

    results = [r for r in aot_results if r.label.startswith(prefix) and r.variant == "portable"]
    assert {r.arch for r in results} == set(aot.AMPERE_ARCHS)
    specs = [s for s in paged_decode.aot_specs() if s.label.startswith(prefix) and s.variant == "portable"]
    configs = _vk.V3_DISPATCHED if prefix == "v3-" else _vk.V3_UNALIGNED
    assert {s.label.split("[")[0][len(prefix):] for s in specs} == set(configs)
    assert all(s.constexprs["ALIGN"] is (prefix == "v3-") for s in specs)
    assert len(specs) == 18 * len(configs) and len(results) == 2 * len(specs)
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.shared_bytes <= aot.SMEM_LIMIT[r.arch] and r.registers <= 255
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"


def test_aot_specs_are_the_two_paged_kernels_only():
    """The paged op's AOT table holds paged_chunk128 (aligned and unaligned reads) and paged_f16dot (and
    the balanced split's planning kernel and its merge): the v1 kernel (paged_chunk64) is gone."""
    labels = {s.label.split("[")[0] for s in paged_decode.aot_specs() if s.op == "dsv4_decode_fused_out"}
    prefixes = {lab.split("-")[0] for lab in labels}
    assert prefixes <= {"v3", "v3u", "v4", "balance", "merge"}, prefixes
    assert {"v3", "v3u", "v4"} <= prefixes
    assert not any(lab.startswith("fused") for lab in labels)


def test_aot_v4_kernels_compile_for_sm80_and_sm86(aot_results):
    """Every dispatched v4 specialization (csrc_triton.decode.paged_f16dot) compiles for sm_80 and
    sm_86, fits sm_86's 99 KB, holds no e4m3 cvt, and spills nothing; a config of
    V4_SMEM_BYTES compiles for the archs that hold it only (sm_80), within its declared bytes
    and over sm_86's limit (else it would not need the gate)."""
    from dsv4_ops import aot

    results = [r for r in aot_results if r.label.startswith("v4-") and r.variant == "portable"]
    specs = [s for s in paged_decode.aot_specs() if s.label.startswith("v4-") and s.variant == "portable"]
    assert {s.label.split("[")[0][3:] for s in specs} == set(_v4k.V4_DISPATCHED)
    # 2 slot dtypes x 3 length cases x 3 epilogues, + the balanced split (int32 slots, top-k lengths: 2 cases)
    assert len(specs) == 20 * len(_v4k.V4_DISPATCHED)
    assert sum("balanced" in s.label for s in specs) == 2 * len(_v4k.V4_DISPATCHED)
    assert len(results) == sum(len(s.archs or aot.AMPERE_ARCHS) for s in specs)
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        name = r.label.split("[")[0][3:]
        need = _v4k.V4_SMEM_BYTES.get(name)
        assert r.shared_bytes <= (need or aot.SMEM_LIMIT[86]) and r.registers <= 255, r
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"
        if need:
            assert r.arch == 80 and r.shared_bytes > aot.SMEM_LIMIT[86], r
    for name in _v4k.V4_SMEM_BYTES:
        assert name in _v4k.V4_DISPATCHED
        assert {r.arch for r in results if r.label.startswith(f"v4-{name}[")} == {80}


def test_the_cost_models_shared_bytes_are_the_compiles(aot_results):
    """dispatch.decode.V3_SHARED_BYTES (what v3_resident counts blocks an SM with) is the largest
    shared memory of each dispatched v3-form config's specializations on sm_80 / sm_86."""
    got = {}
    for r in aot_results:
        if r.variant == "portable" and r.label.startswith(("v3-", "v4-")):
            name = r.label.split("[")[0][3:]
            got[name] = max(got.get(name, 0), r.shared_bytes)
    assert got == dispatch.decode.V3_SHARED_BYTES


# An SM of each target as CUDA's occupancy table gives it: (registers, threads, shared memory an SM, a block's
# opt-in shared memory): an A100 (sm_80) and an A10 / A40 / A6000 (sm_86).
_TARGET_SMS = {80: (65536, 2048, 167936, 166912), 86: (65536, 1536, 102400, 101376)}


def test_the_cost_models_programs_an_sm_are_the_compiles_on_sm80_and_sm86(aot_results, monkeypatch):
    """v3_resident (V3_COST's count by registers, fewer where shared memory binds) equals the arch's limits
    (testing.arch_programs_an_sm) of every sm_80 / sm_86 AOT specialization of each dispatched config (its
    registers and shared bytes): the model's waves are the compiled kernels' on the targets no GPU here is
    (the GPU test checks the same against the driver on the device it has)."""
    import types

    from dsv4_ops.testing import arch_programs_an_sm

    checked = set()
    for r in aot_results:
        name = r.label.split("[")[0][3:]
        if r.variant != "portable" or not r.label.startswith(("v3-", "v4-")) or name not in dispatch.decode.V3_COST:
            continue
        regs, threads, per_sm, per_block = _TARGET_SMS[r.arch]
        props = types.SimpleNamespace(major=r.arch // 10, minor=r.arch % 10, regs_per_multiprocessor=regs,
                                      max_threads_per_multi_processor=threads,
                                      shared_memory_per_multiprocessor=per_sm)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        warps = dispatch.decode.v3_config(name)["num_warps"]
        compiled = types.SimpleNamespace(n_regs=r.registers,
                                         metadata=types.SimpleNamespace(num_warps=warps, shared=r.shared_bytes))
        assert arch_programs_an_sm(compiled, 0) == dispatch.decode.v3_resident(name, per_block), (r.label, r.arch)
        checked.add((name, r.arch))
    assert {n for n, _ in checked} == set(dispatch.decode.V3_COST)
    assert {a for _, a in checked} == {80, 86}


def test_the_shared_memory_gate_picks_kh32_only_where_it_fits(monkeypatch):
    """CONFIG_WINDOWS' shared-memory rows: kh32n64w8 (108 KB) runs where the device's blocks hold it (an
    A100, an H200), never on sm_86 (99 KB), where the shape keeps its other choice (the next row that
    holds it, else paged_chunk128's); the composite takes the paged op either way."""
    dd = dispatch.decode
    monkeypatch.delenv(dd.ENV_VAR, raising=False)
    a100, sm86, h200 = 163 * 1024, 99 * 1024, 227 * 1024
    rows = [r for r in dispatch.windows.CONFIG_WINDOWS if r[-1] == "kh32n64w8"]
    assert rows and not dd.config_fits("kh32n64w8", sm86)
    assert dispatch.windows.CONFIG_WINDOWS[:len(rows)] == tuple(rows)  # the shared-memory rows first
    for T, _, H, _, K, _ in rows:  # each row's lowest T and H
        for smem in (a100, h200):
            assert dd.resolve_config(T, H, K, smem)[0] == "kh32n64w8"
            assert "CONFIG_WINDOWS row" in dd.resolve_config(T, H, K, smem)[1]
        got = dd.resolve_config(T, H, K, sm86)[0]
        others = [r[-1] for r in dispatch.windows.CONFIG_WINDOWS
                  if r[-1] != "kh32n64w8" and r[0] <= T <= r[1] and r[2] <= H <= r[3] and K == r[4]]
        assert got == (others[0] if others else ("h16n16w4" if T <= 1 and H <= 16 else "h16n32w4")), (T, H, K)
        assert dd.config_fits(got, sm86)
        assert dd.route(dd.mode()) == "paged"
    # no CUDA device here: the plan is made for an A100's 163 KiB
    assert dispatch.device.smem_per_block(-1) == dispatch.device.DEFAULT_SMEM_BYTES == a100


def test_sms_env_overrides_the_device_count(monkeypatch):
    """DSV4_AMPERE_SMS plans for a green context / MPS share; a bad value is an error."""
    monkeypatch.setenv(dispatch.device.SMS_ENV, "108")
    assert dispatch.device.num_sms(0) == 108
    for bad in ("0", "-3", "a100"):
        monkeypatch.setenv(dispatch.device.SMS_ENV, bad)
        with pytest.raises(ValueError, match=dispatch.device.SMS_ENV):
            dispatch.device.num_sms(0)


@pytest.mark.parametrize("T,H,K,want", [(1, 8, 640, "h16n16w4"), (4, 8, 640, "h16n32w4"), (16, 8, 640, "kh16n32w4"),
                                        (64, 8, 640, "kh16n64w8"), (64, 16, 640, "kh16n64w8"),
                                        (128, 16, 640, "kh16n32w4"), (256, 8, 640, "kh16n32w4"),
                                        (1, 64, 640, "h16n32w4"), (1, 128, 640, "kh16n64w8"), (16, 64, 640, "kh32n64w8"),
                                        (64, 64, 256, "kh32n64w8"), (64, 64, 640, "kh32n64w8"), (1, 8, 256, "h16n16w4"),
                                        (16, 16, 256, "h16n32w4")])
def test_v3_config_is_the_measured_winner(T, H, K, want):
    """decode_paged_f16dot.md (H200 call 2): the config the windows give (resolve_config without an SM
    count, on an A100's shared memory) at every measured dispatched shape; T = 16, H = 64:
    decode_sms_call1.md (kh32n64w8 27.5 us against kh16n32w4's 30.7 at 132 SMs)."""
    name, why = dispatch.decode.resolve_config(T, H, K)
    assert name == want and ("CONFIG_WINDOWS row" in why) == want.startswith("k")


@pytest.mark.parametrize("T,H,K,config,want", [(1, 8, 640, "h16n16w4", 40), (4, 8, 640, "h16n32w4", 20),
                                               (1, 64, 640, "h16n32w4", 20), (16, 8, 640, "kh16n32w4", 10),
                                               (16, 16, 640, "kh16n32w4", 10), (128, 8, 640, "kh16n32w4", 2),
                                               (128, 16, 640, "kh16n32w4", 2), (256, 8, 640, "kh16n32w4", 1),
                                               (16, 128, 640, "kh16n32w4", 2), (16, 64, 640, "kh16n32w4", 4),
                                               (64, 64, 256, "kh16n32w4", 1), (16, 16, 256, "h16n32w4", 8)])
def test_v3_splits_of_the_32_key_configs_are_the_measured_ones(T, H, K, config, want):
    """decode_paged_chunk128.md / decode_paged_f16dot.md / decode_paged_f16dot_splits.md (H200, 132 SMs): the best split count
    measured at each shape (T = 16, H = 64: S = 4 30.6 us against S = 3 39.1), within the partials cap."""
    p = dispatch.decode.plan_step(T, H, K, 132, config=config)
    assert (p.config, p.splits) == (config, want) and want <= dispatch.decode.split_cap(T, H)


def test_v3_splits_of_the_64_key_configs_are_the_measured_ones():
    """decode_paged_f16dot.md: kh16n64w8 at T = 64, H <= 16: S = 2 (of 1, 2, 3); T = 1, H = 128: S = 10."""
    dd = dispatch.decode
    assert dd.plan_step(64, 8, 640, 132, config="kh16n64w8").splits == 2
    assert dd.plan_step(64, 16, 640, 132, config="kh16n64w8").splits == 2
    assert (dd.plan_step(1, 128, 640, 132).config, dd.plan_step(1, 128, 640, 132).splits) == ("kh16n64w8", 10)


def test_v4_config_with_odd_block_sizes_runs_v3(interpret, monkeypatch):
    """The v4 kernel takes power-of-two block sizes as shifts; with others the v3 kernel runs
    paged_chunk128's config for the shape (same results), its reads aligned where the caches are."""
    args = case(3, 8, 40, 9, seed=43, bs_c=3, nb_c=7, bs_w=5, nb_w=3, device=interpret)
    p = plan_of(args, 1, "kh16n32w4")
    assert p.config == "h16n32w4" and p.kernel is paged_plan._v3_kernel and p.consts[-1] is True
    assert plan_of(dict(args, q=args["q"][:1]), 1, "kh16n32w4").config == "h16n16w4"  # T = 1, H <= 16
    why = dispatch.decode.plan_step(3, 8, 49, 108, block_sizes=(3, 5), config="kh16n32w4").why
    assert "power-of-two" in why and "paged_chunk128" in why
    launched = []
    orig = type(paged_decode._v4_kernel).__call__
    monkeypatch.setattr(type(paged_decode._v4_kernel), "__call__",
                        lambda self, *a, **k: launched.append(self.name) or orig(self, *a, **k))
    run_and_check(args, 1, interpret, "kh16n32w4")
    run_and_check(args, 2, interpret, "kh16n32w4")
    assert "_dsv4_decode_v3_kernel" in launched and "_dsv4_decode_v4_kernel" not in launched
    launched.clear()
    run_and_check(case(3, 8, 40, 9, seed=43, bs_c=4, nb_c=7, bs_w=8, nb_w=3, device=interpret), 1, interpret,
                  "kh16n32w4")
    assert launched == ["_dsv4_decode_v4_kernel"]


# ---- GPU ---------------------------------------------------------------------------------


def gpu_case(T, H, seed, slot_dtype=torch.int32):
    """The DSv4 decode shape: K1 = 512 top-k + K2 = 128 window, block size 64, bf16 q."""
    args = case(T, H, 512, 128, slot_dtype, seed=seed, bs_c=64, nb_c=16, bs_w=64, nb_w=8,
                q_dtype=torch.bfloat16, device="cuda")
    args["topk_length"] = torch.randint(0, 530, (T,), generator=rng(seed + 1), dtype=torch.int32).cuda()
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 0], ids=["direct", "S2", "S7", "plan"])
@pytest.mark.parametrize("T,H", [(1, 8), (5, 16), (3, 64), (2, 128), (70, 8), (130, 64)])
def test_gpu_v3_matches_reference(variant, T, H, splits):
    run_and_check(gpu_case(T, H, seed=T * 13 + H), splits, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config", _vk.V3_DISPATCHED)
def test_gpu_v3_every_dispatched_config(variant, config):
    """(dsv4-ops tune checks every config it times against the float64 reference too.)"""
    run_and_check(gpu_case(6, 40, seed=3), 1, "cuda", config)
    run_and_check(gpu_case(6, 40, seed=4), 3, "cuda", config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(dispatch.decode.V3_COST))
def test_gpu_the_cost_models_programs_an_sm_are_the_drivers(variant, config, monkeypatch):
    """The driver's occupancy of the kernel the launch compiled (dispatch.device.resident_programs)
    is the arch's limits worked out from its registers, warps and shared memory (device.blocks_by_smem's
    rule), and, where the dots are mma.sync (sm_8x, or DISABLE_MMA_V3=1 on a newer GPU: sm_80's code
    shape), dispatch.decode.v3_resident (V3_COST's count by registers, fewer where the device's shared
    memory holds fewer blocks)."""
    from dsv4_ops import _launch

    smem = dispatch.device.smem_per_block(torch.cuda.current_device())
    if not dispatch.decode.config_fits(config, smem):
        pytest.skip(f"{config} needs more shared memory a block than this device's {smem} B")
    kern = _v4k._dsv4_decode_v4_kernel if config in _v4k.V4_CANDIDATES else _vk._dsv4_decode_v3_kernel
    monkeypatch.setattr(_launch.fast(kern), "cache", {})  # the launch goes through Triton's run
    compiled = []
    real_run = type(kern).run

    def spy(self, *args, grid, warmup, **kwargs):
        ck = real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        if self is kern and not warmup:
            compiled.append(ck)
        return ck

    monkeypatch.setattr(type(kern), "run", spy)
    run_and_check(gpu_case(6, 40, seed=5), 1, "cuda", config)
    ck = compiled[-1]
    warps, shared = ck.metadata.num_warps, ck.metadata.shared
    got = dispatch.device.resident_programs(ck.function, warps, shared)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert props.shared_memory_per_multiprocessor == smem + 1024  # what blocks_by_smem assumes
    assert got == arch_programs_an_sm(ck), (got, ck.n_regs, shared, warps)
    if props.major == 8 or os.environ.get("DISABLE_MMA_V3") == "1":
        assert got == dispatch.decode.v3_resident(config, smem), (got, ck.n_regs, shared)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["kh16n32w4", "gh16n32w4", "h16n32w4"])
def test_gpu_v4_wide_scale_spread(variant, config):
    """bf16 q: keys 2**+-24 and groups 2**+-10 apart, v3 and both v4 PV modes vs float64."""
    args = wide_case("cuda", torch.bfloat16, key_exp=24, group_exp=10)
    run_and_check(args, 1, "cuda", config)
    run_and_check(args, 3, "cuda", config)


@pytest.mark.gpu
def test_gpu_v4_code_to_f16_compiled(variant):
    """The compiled e4b15 -> fp16 conversion (not the interpreter's): every code bit-exact."""
    test_v4_code_to_f16_is_exact_for_every_code("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["direct", "S3", "plan"])
@pytest.mark.parametrize("T,H", [(1, 8), (5, 16), (3, 64), (70, 8), (33, 128)])
@pytest.mark.parametrize("config", ["kh16n32w4", "kh32n32w8", "kh16n64w8", "kh32n64w8", "gh16n32w4"])
def test_gpu_v4_matches_reference(variant, config, T, H, splits):
    run_and_check(gpu_case(T, H, seed=T * 11 + H), splits, "cuda", config)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3], ids=["direct", "S3"])
@pytest.mark.parametrize("T,H", [(3, 64), (33, 128), (2, 72)])
@pytest.mark.parametrize("config", ["sh32n32w4", "sh32n32w8", "sh64n16w8", "wh64n16w8"])
def test_gpu_v4_stream_matches_reference(variant, config, T, H, splits):
    """STREAM configs (32 / 64 heads a program) at the DSv4 shape, compiled, against float64."""
    run_and_check(gpu_case(T, H, seed=T * 13 + H), splits, "cuda", config)


@pytest.mark.gpu
@pytest.mark.parametrize("make", ["aligned", "unaligned"])
def test_gpu_v3_int64_adversarial(variant, make):
    args = (gpu_case if make == "aligned" else gpu_unaligned_case)(3, 64, seed=2, slot_dtype=torch.int64)
    args["topk_slots"][0, :6] = torch.tensor([-(2 ** 63), 2 ** 63 - 1, 2 ** 40, -1, 16 * 64, 16 * 64 - 1]).cuda()
    args["topk_slots"][1] = 77
    run_and_check(args, 0, "cuda")
    run_and_check(args, 1, "cuda")


def gpu_unaligned_case(T, H, seed, slot_dtype=torch.int32, how="both"):
    """gpu_case with both caches not 16-byte aligned (``misaligned``: junk bytes around every page)."""
    args = gpu_case(T, H, seed, slot_dtype)
    for name in ("compressed_cache", "swa_cache"):
        args[name] = misaligned(args[name], how)
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 0], ids=["direct", "S2", "S7", "plan"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
@pytest.mark.parametrize("T,H", [(1, 8), (5, 16), (3, 64), (2, 128), (16, 8), (70, 8)])
def test_gpu_unaligned_caches_match_reference(variant, monkeypatch, T, H, slot_dtype, splits):
    """Compiled paged_chunk128 with ALIGN off (2-byte reads) over caches 2 bytes past 16-byte alignment
    with page strides 6 past a multiple of 16, at the DSv4 shape (T = 16, 70, H = 8: shapes whose aligned
    plan is paged_f16dot): the float64 reference's output, with and without lengths."""
    args = gpu_unaligned_case(T, H, seed=T * 7 + H, slot_dtype=slot_dtype)
    made = spy_plans(monkeypatch)
    run_and_check(args, splits, "cuda")
    run_and_check(dict(args, topk_length=None, swa_length=None), splits, "cuda")
    assert len(made) == 2
    for p in made:
        assert_unaligned_plan(p, T, H)


@pytest.mark.gpu
@pytest.mark.parametrize("how", sorted(MISALIGNMENTS))
@pytest.mark.parametrize("config", _vk.V3_DISPATCHED)
def test_gpu_unaligned_every_dispatched_config(variant, monkeypatch, how, config):
    args = gpu_unaligned_case(6, 40, seed=3, how=how)
    made = spy_plans(monkeypatch)
    run_and_check(args, 1, "cuda", config)
    run_and_check(args, 3, "cuda", config)
    for p in made:
        assert_unaligned_plan(p, 6, 40, config)


@pytest.mark.gpu
@pytest.mark.parametrize("make", ["aligned", "unaligned"])
def test_gpu_paged_composite_equals_the_workspace_step(variant, monkeypatch, make):
    """The composite's paged op (mode v3) and its workspace step (mode heads) on the same inputs, over
    aligned and unaligned caches: both the float64 reference's output."""
    args = (gpu_case if make == "aligned" else gpu_unaligned_case)(64, 64, seed=8)
    common = {k: args[k] for k in ("q", "compressed_cache", "topk_slots", "swa_cache", "swa_slots", "sink",
                                   "sm_scale", "compressed_block_size", "swa_block_size", "topk_length",
                                   "swa_length")}
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "heads")
    o_old, l_old = dsv4_decode.dsv4_decode_attention(**common)
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "v3")
    o_new, l_new = dsv4_decode.dsv4_decode_attention(**common)
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
    assert_attention_close(o_new.cpu(), l_new.cpu(), want, want_lse)
    assert_attention_close(o_old.cpu(), l_old.cpu(), want, want_lse)


GRAPH_REPLAY_CONFIGS = ["", "kh16n32w4", "kh32n64w8"]
GRAPH_REPLAY_SHAPES = [(2, 16, 0), (64, 64, 1), (128, 8, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GRAPH_REPLAY_CONFIGS, ids=["dispatched", "kh16n32w4", "kh32n64w8"])
@pytest.mark.parametrize("T,H,splits", GRAPH_REPLAY_SHAPES)
def test_gpu_v3_graph_replay_equals_eager(variant, monkeypatch, T, H, splits, config):
    graph_replay_equals_eager(monkeypatch, T, H, splits, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["", "kh16n32w4"], ids=["dispatched", "kh16n32w4"])
@pytest.mark.parametrize("T,H,splits", GRAPH_REPLAY_SHAPES)
def test_gpu_unaligned_graph_replay_equals_eager(variant, monkeypatch, T, H, splits, config):
    """The same over unaligned caches: paged_chunk128 with ALIGN off in the graph and in the eager op."""
    graph_replay_equals_eager(monkeypatch, T, H, splits, config, unaligned=True)


def graph_replay_equals_eager(monkeypatch, T, H, splits, config, unaligned=False):
    """The composite's paged op (with ``config`` forced through DSV4_AMPERE_DECODE_CONFIG, '' for
    the dispatched one; a k... config runs csrc_triton.decode.paged_f16dot over aligned caches)
    captured in a CUDA graph and replayed on new inputs: bit-identical to the eager paged op with
    that config. ``unaligned``: both caches not 16-byte aligned (gpu_unaligned_case), their views kept."""
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "v3")
    if config:
        monkeypatch.setenv(dispatch.decode.CONFIG_ENV, config)
    else:
        monkeypatch.delenv(dispatch.decode.CONFIG_ENV, raising=False)
    make = gpu_unaligned_case if unaligned else gpu_case
    args = make(T, H, seed=4)
    new = make(T, H, seed=5)
    static = {k: (v if "cache" in k else v.clone()) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    assert paged_plan.paged_aligned(static["compressed_cache"], static["swa_cache"]) is not unaligned
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")

    def step():
        return dsv4_decode.dsv4_decode_attention(
            static["q"], static["compressed_cache"], static["topk_slots"], static["swa_cache"], static["swa_slots"],
            static["sink"], SM_SCALE, 64, 64, topk_length=static["topk_length"], swa_length=static["swa_length"],
            num_splits=splits, out=out)[1]

    g, g_lse = capture_graph(step)
    for k, v in new.items():
        if isinstance(v, torch.Tensor):
            static[k].copy_(v)
    g.replay()
    torch.cuda.synchronize()
    e_out, e_lse = paged_decode.dsv4_decode_fused(**new, num_splits=splits, config=config)
    assert torch.equal(out, e_out) and torch.equal(g_lse, e_lse)
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(new), out_dtype=torch.float64)
    assert_attention_close(out.cpu(), g_lse.cpu(), want, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["", "kh16n32w4"], ids=["dispatched", "kh16n32w4"])
def test_gpu_v3_torch_compile_fullgraph(variant, monkeypatch, config):
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "v3")
    if config:
        monkeypatch.setenv(dispatch.decode.CONFIG_ENV, config)
    args = gpu_case(3, 16, seed=6)

    def f(q, cc, topk, cw, swa, sink, tl, sl):
        out = torch.empty_like(q)
        _, lse = dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, 64, 64, topk_length=tl,
                                                   swa_length=sl, out=out)
        return out.float() * 2, lse

    inputs = [args[k] for k in ("q", "compressed_cache", "topk_slots", "swa_cache", "swa_slots", "sink",
                                "topk_length", "swa_length")]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(*inputs)
    want = f(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("make", [case, unaligned_case], ids=["aligned", "unaligned"])
def test_auto_composite_traces_fullgraph_on_cpu(make):
    """The composite's paged route (the mode alone decides it; the caches' alignment is the op's plan's
    business) traces under torch.compile(fullgraph=True) over aligned and unaligned caches: a data_ptr()
    check in the composite broke it on the H200."""
    args = make(3, 16, 512, 128, seed=6, bs_c=64, nb_c=3, bs_w=64, nb_w=2, q_dtype=torch.bfloat16)
    assert dispatch.decode.route(dispatch.decode.mode()) == "paged"

    def f(q, cc, topk, cw, swa, sink, tl, sl):
        out = torch.empty_like(q)
        _, lse = dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, 64, 64, topk_length=tl,
                                                   swa_length=sl, out=out)
        return out.float() * 2, lse

    inputs = [args[k] for k in ("q", "compressed_cache", "topk_slots", "swa_cache", "swa_slots", "sink",
                                "topk_length", "swa_length")]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(*inputs)
    want = f(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("config", ["sh32n32w4", "sh64n16w8", "wh64n16w8"])
def test_v4_stream_head_groups_and_long_loop(interpret, config):
    """STREAM configs (each key tile shared by 32 / 64 heads, key groups read twice): several head
    groups with a partial last one (H = 72), lengths, adversarial slots, 20+ key blocks in one split."""
    args = case(2, 72, 300, 24, seed=43, device=interpret)
    args["topk_slots"][0, :3] = torch.tensor([-1, 10 ** 6, 5]).to(torch.int32).to(interpret)
    run_and_check(args, 1, interpret, config)
    run_and_check(dict(args, sink=None), 3, interpret, config)
