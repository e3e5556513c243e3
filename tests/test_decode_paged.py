"""The paged decode in 128-dim chunks: csrc_triton.decode.paged_chunk128 behind op ``dsv4_decode_fused_out`` (form 'v3').

The same contract as the v1 fused kernel (tests/test_decode_paged_chunk64.py), checked the same way:
CPU through the Triton interpreter (fp16 q) against the float64 reference with outputs
poisoned first, adversarial slots, every launch config a benchmark can pick; the plan; the
AOT table (no spills on sm_80/86). GPU: both variants at the DSv4 shape, every split class,
CUDA-graph replay on new inputs == eager, torch.compile(fullgraph=True) through the composite.
v3 needs 16-byte aligned caches (vLLM's pages are multiples of 576 B): the caches here have
16-byte aligned pages, and one test checks that an unaligned cache falls back to v1.
"""

import os

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import dispatch, dsv4_decode, paged_decode, paged_plan, reference
from dsv4_ops.csrc_triton.decode import paged_chunk128 as _vk
from dsv4_ops.csrc_triton.decode import paged_f16dot as _v4k
from dsv4_ops.testing import arch_programs_an_sm, assert_attention_close, capture_graph, poison_like, rng, short_id

from test_decode_paged_chunk64 import case as _case
from test_decode_paged_chunk64 import cpu

D = 512
SM_SCALE = D ** -0.5


def case(*a, **k):
    """test_decode_paged_chunk64.case with 16-byte aligned pages (584 * block_size + 16 bytes for the
    block sizes used here: 4 -> 2352, 8 -> 4688, 64 -> 37392)."""
    k.setdefault("bs_c", 4)
    k.setdefault("bs_w", 8)
    args = _case(*a, **k)
    for name in ("compressed_cache", "swa_cache"):
        c = args[name]
        pad = (-c.shape[1]) % 16
        if pad:
            wide = torch.zeros(c.shape[0], c.shape[1] + pad, dtype=c.dtype, device=c.device)
            wide[:, :c.shape[1]] = c
            args[name] = wide
    return args


def run_and_check(args, num_splits, device, config=""):
    T, H = args["q"].shape[:2]
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=device))
    got, lse = paged_decode.dsv4_decode_fused(**args, num_splits=num_splits, out=out, form="v3", config=config)
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
    """Every config bench_decode_paged.py may time (and so may be dispatched) is correct."""
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


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_v3_adversarial_slots(interpret, slot_dtype):
    """Out-of-range, negative, dtype extremes and repeated slots: masked or counted each time."""
    args = case(2, 8, 24, 8, slot_dtype, seed=21, lens=(False, False), device=interpret)
    info = torch.iinfo(slot_dtype)
    ext = torch.tensor([info.min, info.max, -1, 2 ** 31 - 1, -(2 ** 31), 24, 23, 0], dtype=torch.int64)
    if slot_dtype == torch.int64:
        ext[3] = 2 ** 40
    args["topk_slots"][0, :8] = ext.to(slot_dtype).to(interpret)
    args["topk_slots"][1] = 5  # one slot repeated 24 times
    args["swa_slots"][0, :4] = torch.tensor([info.max, info.min, 16, 15], dtype=torch.int64).to(slot_dtype).to(interpret)
    run_and_check(args, 1, interpret)
    run_and_check(args, 5, interpret)


def test_v3_unaligned_cache_falls_back_to_v1(interpret, monkeypatch):
    """A cache whose page stride is not a multiple of 16 runs the v1 kernel (same results)."""
    args = _case(2, 8, 9, 4, seed=9, device=interpret)  # pages of 584 * 4 + 8 bytes
    assert args["compressed_cache"].stride(0) % 16
    made = []
    real = paged_plan.make_paged_plan
    monkeypatch.setattr(paged_plan, "make_paged_plan", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    out, lse = paged_decode.dsv4_decode_fused(**args, num_splits=1, form="v3")
    assert [p.form for p in made] == ["v1"]
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
    assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)


@pytest.mark.parametrize("T,H,sms", [(1, 8, 132), (4, 64, 132), (64, 64, 132), (128, 8, 108), (256, 128, 132),
                                     (64, 8, 132), (64, 16, 108), (1, 128, 132), (16, 8, 132)])
def test_v3_plan_is_static_and_sane(T, H, sms):
    p = dispatch.decode.v3_plan(T, H, 640, sms)
    nb = -(-640 // p.block_n)
    assert p.kernel == "v3" and 1 <= p.splits <= min(nb, 64) and p.direct == (p.splits == 1)
    assert p.groups * p.block_h >= H
    assert dispatch.decode.v3_config_name(T, H) in _vk.V3_DISPATCHED + _v4k.V4_DISPATCHED
    assert p.config in _vk.V3_DISPATCHED + _v4k.V4_DISPATCHED
    # no balanced count has a shorter modelled time on these SMs (dispatch.decode.V3_COST)
    def cost(s):
        return dispatch.decode.v3_cost_us(T, H, 640, sms, p.config, s)
    assert p.splits in dispatch.decode.balanced_splits(nb)
    assert all(cost(p.splits) <= cost(s) for s in dispatch.decode.balanced_splits(nb))
    assert dispatch.decode.v3_plan(T, H, 640, sms) == p


def test_v3_mode_routes_the_composite(monkeypatch):
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "v3")
    assert dispatch.decode.mode() == "v3" and dispatch.decode.fused_form(64, 64, 640) == "v3"
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fused")
    assert dispatch.decode.fused_form(64, 64, 640) == "v1"


def test_aot_v3_kernels_compile_for_sm80_and_sm86(aot_results):
    """Every dispatched v3 specialization compiles for sm_80 and sm_86, fits shared memory,
    holds no e4m3 cvt, and spills nothing."""
    from dsv4_ops import aot

    results = [r for r in aot_results if r.label.startswith("v3-") and r.variant == "portable"]
    assert {r.arch for r in results} == set(aot.AMPERE_ARCHS)
    specs = [s for s in paged_decode.aot_specs() if s.label.startswith("v3-") and s.variant == "portable"]
    assert len(specs) == 18 * len(_vk.V3_DISPATCHED) and len(results) == 2 * len(specs)
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.shared_bytes <= aot.SMEM_LIMIT[r.arch] and r.registers <= 255
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"


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
    """AUTO_V3_SMEM_WINDOWS: kh32n64w8 (108 KB) runs where the device's blocks hold it (an A100,
    an H200), never on sm_86 (99 KB), where the shape keeps its other choice; the composite
    routes by the same rule."""
    monkeypatch.delenv(dispatch.decode.ENV_VAR, raising=False)
    a100, sm86, h200 = 163 * 1024, 99 * 1024, 227 * 1024
    for T, _, H, _, K, _ in dispatch.windows.AUTO_V3_SMEM_WINDOWS:  # each window's lowest T and H
        for smem in (a100, h200):
            assert dispatch.decode.v3_config_name(T, H, K, smem) == "kh32n64w8"
            assert dispatch.decode.auto_is_v3(T, H, K, smem) and dispatch.decode.fused_form(T, H, K, smem) == "v3"
            assert dispatch.decode.route("auto", T, H, K, smem) == "v3"
        assert dispatch.decode.v3_config_name(T, H, K, sm86) != "kh32n64w8"
        base = any(t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k
                   for t_lo, t_hi, h_lo, h_hi, k in dispatch.windows.AUTO_V3_WINDOWS)
        assert dispatch.decode.auto_is_v3(T, H, K, sm86) == base
        assert dispatch.decode.route("auto", T, H, K, sm86) == ("v3" if base else "paged")
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
    """decode_paged_f16dot.md (H200 call 2): the config v3_config_name picks at every measured dispatched shape;
    T = 16, H = 64: decode_sms_call1.md (kh32n64w8 27.5 us against kh16n32w4's 30.7 at 132 SMs)."""
    assert dispatch.decode.v3_config_name(T, H, K) == want


@pytest.mark.parametrize("T,H,K,config,want", [(1, 8, 640, "h16n16w4", 40), (4, 8, 640, "h16n32w4", 20),
                                               (1, 64, 640, "h16n32w4", 20), (16, 8, 640, "kh16n32w4", 10),
                                               (16, 16, 640, "kh16n32w4", 10), (128, 8, 640, "kh16n32w4", 2),
                                               (128, 16, 640, "kh16n32w4", 2), (256, 8, 640, "kh16n32w4", 1),
                                               (16, 128, 640, "kh16n32w4", 2), (16, 64, 640, "kh16n32w4", 4),
                                               (64, 64, 256, "kh16n32w4", 1), (16, 16, 256, "h16n32w4", 8)])
def test_v3_splits_of_the_32_key_configs_are_the_measured_ones(T, H, K, config, want):
    """decode_paged_chunk128.md / decode_paged_f16dot.md / decode_paged_f16dot_splits.md (H200, 132 SMs): the best split count
    measured at each shape (T = 16, H = 64: S = 4 30.6 us against S = 3 39.1)."""
    assert dispatch.decode.v3_plan(T, H, K, 132, 0, config).splits == want


def test_v3_splits_of_the_64_key_configs_are_the_measured_ones():
    """decode_paged_f16dot.md: kh16n64w8 at T = 64, H <= 16: S = 2 (of 1, 2, 3); T = 1, H = 128: S = 10."""
    assert dispatch.decode.v3_plan(64, 8, 640, 132, 0, "kh16n64w8").splits == 2
    assert dispatch.decode.v3_plan(64, 16, 640, 132, 0, "kh16n64w8").splits == 2
    assert dispatch.decode.v3_plan(1, 128, 640, 132).splits == 10


def test_v4_config_with_odd_block_sizes_runs_v3(interpret, monkeypatch):
    """The v4 kernel takes power-of-two block sizes as shifts; with others the v3 kernel runs
    (same results)."""
    args = case(3, 8, 40, 9, seed=43, bs_c=3, nb_c=7, bs_w=5, nb_w=3, device=interpret)
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
    """(bench_decode_paged.py checks every config it times against the float64 reference too.)"""
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
def test_gpu_v3_int64_adversarial(variant):
    args = gpu_case(3, 64, seed=2, slot_dtype=torch.int64)
    args["topk_slots"][0, :6] = torch.tensor([-(2 ** 63), 2 ** 63 - 1, 2 ** 40, -1, 16 * 64, 16 * 64 - 1]).cuda()
    args["topk_slots"][1] = 77
    run_and_check(args, 0, "cuda")
    run_and_check(args, 1, "cuda")


GRAPH_REPLAY_CONFIGS = ["", "kh16n32w4", "kh32n64w8"]
GRAPH_REPLAY_SHAPES = [(2, 16, 0), (64, 64, 1), (128, 8, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GRAPH_REPLAY_CONFIGS, ids=["dispatched", "kh16n32w4", "kh32n64w8"])
@pytest.mark.parametrize("T,H,splits", GRAPH_REPLAY_SHAPES)
def test_gpu_v3_graph_replay_equals_eager(variant, monkeypatch, T, H, splits, config):
    graph_replay_equals_eager(monkeypatch, T, H, splits, config)


def graph_replay_equals_eager(monkeypatch, T, H, splits, config):
    """The composite's v3 form (with ``config`` forced through DSV4_AMPERE_DECODE_CONFIG, '' for
    the dispatched one; a k... config runs csrc_triton.decode.paged_f16dot) captured in a CUDA
    graph and replayed on new inputs: bit-identical to the eager paged op with that config."""
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "v3")
    if config:
        monkeypatch.setenv(dispatch.decode.CONFIG_ENV, config)
    else:
        monkeypatch.delenv(dispatch.decode.CONFIG_ENV, raising=False)
    args = gpu_case(T, H, seed=4)
    new = gpu_case(T, H, seed=5)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
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
    e_out, e_lse = paged_decode.dsv4_decode_fused(**new, num_splits=splits, form="v3", config=config)
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


def test_auto_v3_composite_traces_fullgraph_on_cpu():
    """The composite's v3 routing (auto_is_v3 + the cache stride check) traces under
    torch.compile(fullgraph=True): a data_ptr() check there broke it on the H200."""
    args = case(3, 16, 512, 128, seed=6, bs_c=64, nb_c=3, bs_w=64, nb_w=2, q_dtype=torch.bfloat16)
    assert dispatch.decode.auto_is_v3(3, 16, 640) and dispatch.decode.cache_aligned(args["compressed_cache"])

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


@pytest.mark.parametrize("T,H,K,want", [(1, 8, 640, True), (256, 16, 640, True), (1, 64, 640, True),
                                        (4, 64, 640, False), (1, 128, 640, True), (64, 64, 640, False),
                                        (16, 64, 640, True), (8, 64, 640, False), (32, 64, 640, False),
                                        (2, 128, 640, False), (1, 96, 640, False),
                                        (300, 8, 640, False), (16, 16, 256, True), (64, 8, 256, False),
                                        (64, 64, 256, True), (128, 128, 256, False)])
def test_auto_picks_v3_only_where_measured_faster(T, H, K, want):
    """decode_paged_chunk128.md / decode_paged_f16dot.md (H200, portable): the v3 form won at H <= 16 (every T, K 640;
    T <= 16 at K 256), T = 1 with H = 64 or 128 (v4 kh16n64w8 at 128), T = 64, H = 64, K = 256,
    T = 16, H = 64 (decode_paged_f16dot_splits.md: kh16n32w4 at S = 4);
    the step stays at H >= 64 from T = 4 (K 640), unmeasured H (96) and T > 256: on a device
    whose blocks cannot hold kh32n64w8 (sm_86's 99 KiB; the gated windows: the test above)."""
    assert dispatch.decode.auto_is_v3(T, H, K, 99 * 1024) is want


@pytest.mark.parametrize("config", ["sh32n32w4", "sh64n16w8", "wh64n16w8"])
def test_v4_stream_head_groups_and_long_loop(interpret, config):
    """STREAM configs (each key tile shared by 32 / 64 heads, key groups read twice): several head
    groups with a partial last one (H = 72), lengths, adversarial slots, 20+ key blocks in one split."""
    args = case(2, 72, 300, 24, seed=43, device=interpret)
    args["topk_slots"][0, :3] = torch.tensor([-1, 10 ** 6, 5]).to(torch.int32).to(interpret)
    run_and_check(args, 1, interpret, config)
    run_and_check(dict(args, sink=None), 3, interpret, config)
