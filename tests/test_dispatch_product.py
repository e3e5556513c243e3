"""Every dispatch rule over the product of the inputs it reads, on the CPU, through the plan
functions of dsv4_ops/dispatch/ (the resolvers return (choice, reason)); then every config the
DeepSeek-V4 decode can dispatch (the paged op's configs over aligned and unaligned caches, the
workspace gather + tiles / heads) run against the float64 reference under the Triton
interpreter, over both caches' block sizes: powers of two, and mixed pairs where one cache's
block size is not (a rule that reads one block size only picks a shift-based kernel there,
and that kernel reads the wrong pages).

The plan checks assert properties, not picks: the choice is valid (a known config, a split
count in [1, min(key blocks, MAX_SPLITS)], so no split is empty, the groups of its head block,
partials under the cap), fits the device (shared memory), and agrees with the rules of
docs/dispatch.md where the doc states the rule (route, window config, alignment and block-size
fallback, kernel choice, V3.2, prefill, indexer); the measured split counts themselves may move
with the SM count.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4_ops import dsv4_decode, envs, paged_decode, paged_plan, reference
from dsv4_ops.csrc_triton import indexer as _ik
from dsv4_ops.csrc_triton import sparse_prefill as _spk
from dsv4_ops.csrc_triton import v32_attention as _ak
from dsv4_ops.csrc_triton.decode import heads as _hk
from dsv4_ops.csrc_triton.decode import paged_chunk128 as _vk
from dsv4_ops.csrc_triton.decode import paged_f16dot as _v4k
from dsv4_ops.csrc_triton.decode.tiles import MAX_SPLITS, PARTITION_N
from dsv4_ops.dispatch import configs as dc
from dsv4_ops.dispatch import decode as dd
from dsv4_ops.dispatch import device
from dsv4_ops.dispatch import indexer as di
from dsv4_ops.dispatch import prefill as dp
from dsv4_ops.dispatch import v32 as dv
from dsv4_ops.dispatch import windows as dw
from dsv4_ops.dispatch import workspace as dws
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import assert_attention_close, poison_like, rng

TS = (1, 2, 3, 4, 5, 15, 16, 17, 47, 48, 63, 64, 95, 96, 128, 255, 256, 257, 1024)
HS = (1, 3, 8, 16, 17, 32, 40, 64, 128)
KS = (7, 255, 256, 257, 640, 641, 2048)
SMEMS = (99 * 1024, 101 * 1024, 108544, 163 * 1024, 227 * 1024)
SMS = (1, 7, 46, 84, 108, 132)
BLOCK_SIZES = (1, 3, 4, 6, 16, 64, 65)
MIXED = [p for p in itertools.product(BLOCK_SIZES, repeat=2)]


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (envs.DECODE_KERNEL, envs.DECODE_CONFIG, envs.BATCH_INVARIANT, envs.SMS, envs.V32_FORM,
                 envs.DECODE_BALANCE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.DECODE_TABLES, "0")  # the windows and the model, not the current device's table


def assert_splits_valid(S: int, nb: int, where) -> None:
    """1 <= S <= min(nb, MAX_SPLITS): the kernels give split s the key blocks [s * nb // S,
    (s + 1) * nb // S), so S <= nb leaves no split empty, and the merge takes 64 at most."""
    assert isinstance(S, int) and 1 <= S <= max(1, min(nb, MAX_SPLITS)), (S, nb, where)


# ---- the doc's rules, written from docs/dispatch.md (the table is windows.py's data) ----


def doc_window_config(T, H, K, smem):
    """The first CONFIG_WINDOWS row holding (T, H, K) whose config fits ``smem``, or ''."""
    for t_lo, t_hi, h_lo, h_hi, k, name in dw.CONFIG_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k and _v4k.V4_SMEM_BYTES.get(name, 0) <= smem:
            return name
    return ""


def doc_chunk128_config(T, H):
    """paged_chunk128's config for the shape: 16-key blocks for one token at H <= 16, else 32."""
    return "h16n16w4" if T == 1 and H <= 16 else "h16n32w4"


def doc_unaligned_config():
    """The config every plan over caches that are not 16-byte aligned runs (spill-free with ALIGN off)."""
    return "h16n32w8"


def doc_config(T, H, K, smem):
    """The window's config, else paged_chunk128's (the SM model aside: no ``sms``)."""
    return doc_window_config(T, H, K, smem) or doc_chunk128_config(T, H)


def doc_route(mode):
    """The route reads the mode alone: the paged op in auto and v3, the workspace step in tiles / heads."""
    return "workspace" if mode in ("tiles", "heads") else "paged"


def is_f16dot_name(name):
    return "PV_KEY" in (_v4k.V4_CANDIDATES.get(name) or {})


# ---- the composite's route, the caches' alignment ----


@pytest.mark.parametrize("mode", envs.DECODE_MODES)
def test_route_reads_the_mode_alone(monkeypatch, mode):
    """resolve_route takes the mode and nothing else; the composite's memoised route (the mode from
    the environment) agrees, and so does decode_peak_bytes at any shape and cache alignment."""
    got, why = dd.resolve_route(mode)
    assert got == doc_route(mode) == dd.route(mode) and mode in why, (mode, why)
    monkeypatch.setenv(envs.DECODE_KERNEL, mode)
    assert dsv4_decode._route_memo() == got
    for T, H, K1, aligned in itertools.product((1, 4, 64, 300), (8, 64, 128), (0, 512), (True, False)):
        assert dsv4_decode.decode_peak_bytes(T, H, K1, 128, 108, 163 * 1024, aligned)[0] == got, (T, H, K1, aligned)


def page_cache(stride_ok: bool, addr_ok: bool = True, pages: int = 3):
    """A uint8 [pages, page_bytes] cache whose page stride (and address) is or is not a
    multiple of 16 bytes."""
    width = 576 * 4 if stride_ok else 584 * 4 + 8
    base = torch.zeros(pages, width + 16, dtype=torch.uint8)
    cache = base[:, :width] if addr_ok else base[:, 8:8 + width]
    assert (cache.stride(0) % 16 == 0) == stride_ok and (cache.data_ptr() % 16 == 0) == addr_ok
    return cache


CACHE_KINDS = {"aligned": (True, True), "odd-stride": (False, True), "odd-address": (True, False)}


def test_paged_alignment_reads_both_caches_address_and_stride():
    for (c_name, c_kind), (w_name, w_kind) in itertools.product(CACHE_KINDS.items(), repeat=2):
        cc, sw = page_cache(*c_kind), page_cache(*w_kind)
        assert paged_plan.paged_aligned(cc, sw) == (all(c_kind) and all(w_kind)), (c_name, w_name)


# ---- the launch config: windows, shared memory, alignment, both block sizes ----


def test_config_over_T_H_K_smem_block_sizes_and_alignment():
    """Without an SM count: the window's config (its shared memory fitting), else paged_chunk128's;
    over unaligned caches paged_chunk128's unaligned config; a paged_f16dot pick over a non-power-of-two
    block size (either cache's) paged_chunk128's config for the shape; the reason naming why."""
    for T, H, K, smem in itertools.product(TS, HS, KS, SMEMS):
        windows_pick = doc_config(T, H, K, smem)
        for bs, aligned in itertools.product(MIXED, (True, False)):
            name, why = dd.resolve_config(T, H, K, smem, "", bs, aligned=aligned)
            where = (T, H, K, smem, bs, aligned, why)
            cfg = dd.v3_config(name)  # a known config (KeyError otherwise)
            assert dc.config_fits(name, smem), where
            fallback = is_f16dot_name(windows_pick) and not all(pow2(b) for b in bs)
            if not aligned:  # 2-byte reads: the one config spill-free with ALIGN off
                assert name == doc_unaligned_config() and "aligned" in why, where
            elif fallback:  # paged_f16dot: block sizes as shifts
                assert not dd.is_f16dot(cfg) and name == doc_chunk128_config(T, H), where
                assert "power-of-two" in why, where
            else:
                assert name == windows_pick, where
                assert ("CONFIG_WINDOWS row" if doc_window_config(T, H, K, smem) else "no window") in why, where


F16DOT_NAMES = sorted(n for n in _v4k.V4_CANDIDATES if is_f16dot_name(n))


@pytest.mark.parametrize("source", ["caller", "env"])
def test_forced_f16dot_config_falls_back_on_any_odd_block_size_or_unaligned_cache(monkeypatch, source):
    for name in F16DOT_NAMES:
        if source == "env":
            monkeypatch.setenv(envs.DECODE_CONFIG, name)
        for bs, aligned in itertools.product(MIXED, (True, False)):
            for T, H in ((1, 8), (4, 8), (1, 64)):
                got, why = dd.resolve_config(T, H, 640, 163 * 1024, name if source == "caller" else "", bs,
                                             aligned=aligned)
                want = (doc_unaligned_config() if not aligned else
                        name if all(pow2(b) for b in bs) else doc_chunk128_config(T, H))
                assert got == want, (name, bs, aligned, why)
                assert not dd.is_f16dot(dd.v3_config(got)) or (aligned and all(pow2(b) for b in bs))


# ---- split counts: the paged op's plan, workspace (tiles / heads), batch invariance ----


def dispatchable_configs():
    """Every config resolve_config returns over the product (with the alignment and block-size
    fallbacks)."""
    return sorted({dd.resolve_config(T, H, K, smem, "", bs, aligned=aligned)[0]
                   for T, H, K, smem in itertools.product(TS, HS, KS, SMEMS) for bs in ((4, 8), (3, 8))
                   for aligned in (True, False)})


def test_plan_over_T_H_K_sms():
    """plan_step with each dispatchable config forced: the config's blocks and groups, a valid split
    count, the partials under PAGED_PARTIALS_MAX_BYTES, and the caller's splits kept as given."""
    names = dispatchable_configs()
    assert set(names) >= {"h16n16w4", "h16n32w4"}
    for name, T, H, K, sms in itertools.product(names, TS, HS, KS, SMS):
        cfg = dd.v3_config(name)
        p = dd.plan_step(T, H, K, sms, config=name)
        where = (name, T, H, K, sms, p, p.why)
        assert (p.kernel, p.config, p.block_h, p.block_n) == ("v3", name, cfg["BLOCK_H"], cfg["BLOCK_N"]), where
        assert p.groups == cdiv(H, cfg["BLOCK_H"]) and p.direct == (p.splits == 1) and not p.balanced, where
        assert_splits_valid(p.splits, cdiv(K, cfg["BLOCK_N"]), where)
        assert p.splits <= dd.split_cap(T, H), where
        assert p.splits == 1 or T * H * p.splits * 513 * 4 <= dd.PAGED_PARTIALS_MAX_BYTES, where
    assert dd.plan_step(1024, 128, 640, 108, splits=7).splits == 7  # forced: not capped


PLAN_GRID = list(itertools.product((1, 4, 16, 64, 128, 256), (8, 16, 64, 128), (256, 640), (104, 108, 132)))


@pytest.mark.parametrize("smem", [99 * 1024, 163 * 1024])
@pytest.mark.parametrize("bs,aligned", [((64, 64), True), ((64, 64), False), ((64, 48), True)],
                         ids=["aligned", "unaligned", "odd-block"])
def test_plan_step_is_its_rules(smem, bs, aligned):
    """One planner, one definition: plan_step equals resolve_config (with the SM count) + v3_splits
    capped at split_cap, and its reason is resolve_config's followed by the split rule's."""
    for T, H, K, sms in PLAN_GRID:
        name, why = dd.resolve_config(T, H, K, smem, "", bs, sms, aligned)
        cfg = dd.v3_config(name)
        bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
        planned = dd.v3_splits(T, H, K, sms, bh, bn, name, smem)
        S = min(planned, dd.split_cap(T, H))
        want = dws.DecodePlan("v3", S, bh, bn, cdiv(H, bh), S == 1, name, False)
        p = dd.plan_step(T, H, K, sms, smem, bs, aligned=aligned)
        where = (T, H, K, sms, smem, bs, aligned, p.why)
        assert p == want, where
        assert p.why.startswith(f"config {name}: {why}; S = {S}: v3_splits on {sms} SMs"), where
        assert ("capped at" in p.why) == (planned > S), where


def test_the_split_cap_holds_for_a_direct_op_call_too():
    """The paged op's own plan (num_splits 0, no composite in between) caps its partials as the
    composite's does: the launch plan's count is plan_step's, capped below v3_splits' (16 tokens x 128
    heads on 108 SMs: the kh32n64w8 window plans more than 3 splits, the cap is 3); a caller's count
    is kept; the composite's accounting counts the same S."""
    T, H, K1, K2, bs = 16, 128, 512, 128, 64
    sms, smem = 108, -1  # what the launcher reads for CPU tensors (device index -1)
    step = dd.plan_step(T, H, K1 + K2, sms, smem, (bs, bs), lengths=True)
    cfg = dd.v3_config(step.config)
    uncapped = dd.v3_splits(T, H, K1 + K2, sms, cfg["BLOCK_H"], cfg["BLOCK_N"], step.config, smem)
    assert step.splits == dd.split_cap(T, H) == 3 < uncapped and "capped at 3" in step.why, step.why
    cache = torch.zeros(4, (min_page_bytes(bs) + 15) // 16 * 16, dtype=torch.uint8)  # 16-byte aligned pages
    q = torch.zeros(T, H, D, dtype=torch.bfloat16)
    topk, swa = torch.zeros(T, K1, dtype=torch.int32), torch.zeros(T, K2, dtype=torch.int32)
    length = torch.full((T,), K1, dtype=torch.int32)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)

    def launch_plan(num_splits):
        return paged_plan.make_paged_plan(q, cache, topk, length, bs, cache, swa, None, bs, True, num_splits, out,
                                          "portable")

    plan = launch_plan(0)
    assert (plan.config, plan.splits, plan.direct) == (step.config, 3, False)
    assert launch_plan(uncapped).splits == uncapped  # the caller's count, as given
    peak = dsv4_decode.decode_peak_bytes(T, H, K1, K2, sms, device.smem_per_block(-1), True, (bs, bs))[1]
    assert peak == T * H * 4 + T * H * 3 * 513 * 4


@pytest.mark.parametrize("mode", envs.DECODE_MODES)
def test_workspace_plan_over_T_H_K_sms_and_index_dtype(monkeypatch, mode):
    for sms in SMS:
        monkeypatch.setenv(envs.SMS, str(sms))
        for T, H, K, int32 in itertools.product(TS, HS, KS, (True, False)):
            p, why = dws.resolve_workspace(mode, T, H, K, int32, 0)
            where = (mode, sms, T, H, K, int32, p, why)
            heads = int32 and (mode == "heads" or (mode in ("auto", "v3") and T >= dws.AUTO_HEADS_MIN_T))
            assert p.kernel == ("heads" if heads else "tiles"), where
            if heads:
                bh = _hk.block_h_for(H)
                assert (p.block_h, p.block_n) == (bh, _hk.HEADS_CONFIG[bh]["BLOCK_N"]), where
            else:
                assert (p.block_h, p.block_n) == (16, PARTITION_N) and p.splits == dws.tile_splits(T, H, K), where
            assert p.groups == cdiv(H, p.block_h), where
            assert_splits_valid(p.splits, cdiv(K, p.block_n), where)
            assert dws.workspace_plan(mode, T, H, K, int32, 0) == p


def test_batch_invariant_plan_does_not_read_T(monkeypatch):
    monkeypatch.setenv(envs.BATCH_INVARIANT, "1")
    for sms in SMS:
        monkeypatch.setenv(envs.SMS, str(sms))
        for H, K in itertools.product(HS, KS):
            mode = dd.resolve_mode()[0]  # what sparse_mla_decode passes
            plans = {dws.resolve_workspace(mode, T, H, K, True, 0)[0] for T in TS}
            assert len(plans) == 1, (sms, H, K, plans)
            p = plans.pop()
            assert p.kernel == "heads", p
            assert_splits_valid(p.splits, cdiv(K, p.block_n), (H, K, p))


def test_gather_rule_edges():
    m = dws.FUSED_GATHER_MAX_ROWS
    for rows in (0, 1, m - 1, m, m + 1, 4 * m):
        assert dws.resolve_gather(rows)[0] == (rows <= m) == dws.gather_in_one_launch(rows)


# ---- V3.2 / GLM-5, sparse prefill, decode indexer ----


@pytest.mark.parametrize("form", [None, "auto", "w64", "w128", "f16"] + [f"f16:{n}" for n in sorted(_ak.F16_CANDIDATES)])
def test_v32_form_and_splits_over_the_product(form):
    for aligned, fp8, H, T in itertools.product((True, False), (True, False), HS, TS):
        got, why = dv.resolve_form(aligned, form, fp8, H, T)
        base = form or "auto"
        if base == "auto":
            want = ("f16" if H <= 16 and T >= 16 else "w128") if fp8 else ("w128" if H > 16 else "w64")
        elif base.startswith("f16") and not fp8:
            want = "w128" if H > 16 else "w64"
        else:
            want = base
        if not aligned:
            want = "w64"
        assert got == want, (form, aligned, fp8, H, T, why)
        for K, sms in itertools.product((1, 100, 2048), SMS):
            S = dv.num_splits_for(T, H, K, sms, got)
            cfg = dv.config_of(got, _ak.block_h_for(H))
            groups = cdiv(H, cfg.get("BLOCK_H", _ak.block_h_for(H)))
            slots = sms * cfg.get("PER_SM", 1)
            nb = max(1, cdiv(K, cfg["BLOCK_N"]))
            want_s = 1 if T * groups >= slots else max(1, min(_ak.MAX_SPLITS, nb, slots // (T * groups)))
            assert S == want_s, (got, T, H, K, sms, S)


def test_prefill_rule_over_T_H_dtype_sms_and_alignment():
    for T, H, sms, dtype in itertools.product(TS + (4096,), HS, SMS, (torch.int32, torch.int64)):
        groups = cdiv(H, _spk.block_h_for(H))
        want = dtype == torch.int32 and T * groups >= dp.PREFILL_MIN_WAVES * sms
        assert dp.uses_prefill_kernel(T, H, dtype, sms) == want, (T, H, sms, dtype)
    q = torch.zeros(4096 + 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(64, 576, dtype=torch.bfloat16)
    idx = torch.zeros(4096, 8, dtype=torch.int32)
    assert dp.resolve(q[:4096], kv, idx)[0]  # 108 SMs without a device: 4096 >= 4 x 108
    assert not dp.resolve(q[:4096], kv, idx.long())[0]
    assert not dp.resolve(q[1:], kv, idx)[0] or q[1:].data_ptr() % 16 == 0
    assert not dp.resolve(q[:4096], kv[:, 1:], idx)[0]  # misaligned kv
    assert not dp.resolve(q[:64], kv, idx[:64])[0]


def test_indexer_plan_over_rows_context_config_sms():
    for H in HS:
        want = _ik.PAGED_CONFIG_WIDE if max(16, 1 << (H - 1).bit_length()) >= 64 else _ik.PAGED_CONFIG
        assert di.paged_config(H) is want, H
    for cfg, rows, ctx, sms in itertools.product((_ik.PAGED_CONFIG, _ik.PAGED_CONFIG_WIDE), (1, 4, 64, 512, 4096),
                                                (1, 64, 129, 4096, 65536, 1 << 20), (None,) + SMS):
        tiles = cdiv(ctx, cfg["BLOCK_N"])
        tpp = di.paged_tiles_per_program(rows, ctx, cfg, sms)
        where = (cfg["KERNEL"], rows, ctx, sms, tpp)
        assert 1 <= tpp <= tiles, where
        if sms and "PROGRAMS_PER_SM" in cfg:  # the wave model's optimum, uncapped, ties to fewer programs
            slots = sms * cfg["PROGRAMS_PER_SM"]
            every = {cdiv(tiles, c) for c in range(1, tiles + 1)}
            best = min((di.wave_cost(rows, tiles, slots, t), rows * cdiv(tiles, t)) for t in every)
            assert (di.wave_cost(rows, tiles, slots, tpp), rows * cdiv(tiles, tpp)) == best, where
        else:
            assert tpp <= cfg["MAX_TILES_PER_PROGRAM"], where


# ---- every dispatched paged config against the reference, both block sizes (interpreter) ----

PAIRS = {"pow2": (4, 8), "c-odd": (3, 8), "w-odd": (4, 6), "both-odd": (3, 5)}
D = 512


def make_cache(block_size, nblk, seed, device, aligned=True, offset=0):
    """A paged cache of valid records (reference insert) on ``device`` whose page stride is a multiple
    of 16 bytes (``aligned``) or not, its first page ``offset`` bytes into a 16-byte aligned buffer."""
    stride = min_page_bytes(block_size) + 8
    stride = (stride + 15) // 16 * 16 if aligned else stride + (0 if stride % 16 else 2)
    buf = torch.zeros(nblk * stride + 64, dtype=torch.uint8)
    cache = buf[offset:offset + nblk * stride].view(nblk, stride)
    rows = (torch.randn(nblk * block_size, D, generator=rng(seed)) * 2).to(torch.bfloat16)
    reference.ref_kv_cache_insert(rows, cache, torch.arange(nblk * block_size), block_size)
    buf = buf.to(device)  # the whole buffer: the offset stays
    cache = buf[offset:offset + nblk * stride].view(nblk, stride)
    assert (cache.stride(0) % 16 == 0) == aligned and cache.data_ptr() % 16 == offset % 16
    return cache


def small_case(T, H, bs, seed, device, c_kind=(True, 0), w_kind=(True, 0)):
    """Inputs of one paged decode call (fp16 q under the interpreter: its bf16 dot is wrong, the
    decoded keys are exact in fp16), caches of ~24 / ~12 slots; ``c_kind`` / ``w_kind``: each cache's
    (page stride a multiple of 16, byte offset of its first page). Slots in [-3, capacity + 3]
    (negative, valid, past the end), lengths past K too."""
    bs_c, bs_w = bs
    nb_c, nb_w = cdiv(24, bs_c), cdiv(12, bs_w)
    K1, K2 = 20, 6
    g = rng(seed)
    cc = make_cache(bs_c, nb_c, seed, device, *c_kind)
    cw = make_cache(bs_w, nb_w, seed + 1, device, *w_kind)
    topk = torch.randint(-3, bs_c * nb_c + 4, (T, K1), generator=g).to(torch.int32)
    swa = torch.randint(-3, bs_w * nb_w + 4, (T, K2), generator=g).to(torch.int32)
    tl = torch.randint(0, K1 + 3, (T + 2,), generator=g).to(torch.int32)
    sl = torch.randint(0, K2 + 3, (T + 1,), generator=g).to(torch.int32)
    q = torch.randn(T, H, D, generator=g).to(torch.float16)
    sink = torch.randn(H, generator=g)
    return dict(q=q.to(device), compressed_cache=cc, topk_slots=topk.to(device), topk_length=tl.to(device),
                compressed_block_size=bs_c, swa_cache=cw, swa_slots=swa.to(device), swa_length=sl.to(device),
                swa_block_size=bs_w, sink=sink.to(device), sm_scale=D ** -0.5)


def cpu(args):
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def run_dispatched(args, device, monkeypatch):
    """The paged op with every choice left to the plan (config '', splits 0): the PagedPlan it made."""
    made = []
    real = paged_plan.make_paged_plan
    monkeypatch.setattr(paged_plan, "make_paged_plan", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    T, H = args["q"].shape[:2]
    out = poison_like(torch.empty(T, H, 512, dtype=torch.bfloat16, device=device))
    got, lse = paged_decode.dsv4_decode_fused(**args, out=out)
    assert got is out
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
    assert_attention_close(got.cpu(), lse.cpu(), want, want_lse)  # no NaN row, every row within bounds
    (plan,) = made
    return plan


V3_TARGETS = ["h16n16w4", "h16n32w4", "h16n32w8", "kh16n32w4", "kh16n64w8", "kh32n64w8"]


def test_the_targets_are_every_dispatchable_config():
    assert set(dispatchable_configs()) <= set(V3_TARGETS)
    assert set(V3_TARGETS) >= set(_vk.V3_DISPATCHED) | set(_vk.V3_UNALIGNED) | set(_v4k.V4_DISPATCHED)


@pytest.fixture
def windows_decide(monkeypatch):
    """The window's config stands on any SM count (the SM model's margin infinite; its memo cleared
    around the test)."""
    monkeypatch.setattr(dd, "V3_CONFIG_MARGIN", float("inf"))
    dd._sm_config.cache_clear()
    yield
    dd._sm_config.cache_clear()


def _steer(monkeypatch, name):
    """A CONFIG_WINDOWS of one row steering the small shape (T = 2, K = 26; H 20 for a 32-head config,
    else 8) to ``name`` (a swapped table steers every reader)."""
    T, H, K = 2, (20 if dd.v3_config(name)["BLOCK_H"] == 32 else 8), 26
    monkeypatch.setattr(dw, "CONFIG_WINDOWS", ((T, T, H, H, K, name),))
    return T, H, K


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
@pytest.mark.parametrize("name", V3_TARGETS)
def test_dispatched_config_matches_reference(interpret, monkeypatch, windows_decide, name, pair):
    """A window steering the small shape to ``name``, auto mode, aligned caches: the op runs that
    config, or paged_chunk128's config for the shape over an odd block size, with 16-byte reads."""
    bs = PAIRS[pair]
    T, H, K = _steer(monkeypatch, name)
    want = name if all(pow2(b) for b in bs) or not is_f16dot_name(name) else doc_chunk128_config(T, H)
    assert dd.resolve_config(T, H, K, 163 * 1024, "", bs)[0] == want
    args = small_case(T, H, bs, seed=len(name) + sum(bs), device=interpret)
    plan = run_dispatched(args, interpret, monkeypatch)
    assert plan.config == want
    if not is_f16dot_name(want):
        assert plan.consts[-1] is True  # paged_chunk128's ALIGN: 16-byte vector reads


UNALIGNED = {"c-stride": ((False, 0), (True, 0)), "w-stride": ((True, 0), (False, 0)),
             "c-address": ((True, 2), (True, 0)), "w-address": ((True, 0), (True, 8))}


@pytest.mark.parametrize("kind", list(UNALIGNED))
@pytest.mark.parametrize("name", ["h16n16w4", "kh16n32w4", "kh32n64w8"])
def test_unaligned_caches_run_paged_chunk128_without_16_byte_reads(interpret, monkeypatch, windows_decide,
                                                                   name, kind):
    """Caches whose page stride or address is not a multiple of 16 bytes (either cache): the paged op
    still runs (no workspace, no v1 form): paged_chunk128 with its ALIGN constexpr off, in its unaligned
    config (V3_UNALIGNED) whatever the window's."""
    T, H, K = _steer(monkeypatch, name)
    c_kind, w_kind = UNALIGNED[kind]
    args = small_case(T, H, (4, 8), seed=5 + len(kind), device=interpret, c_kind=c_kind, w_kind=w_kind)
    assert not paged_plan.paged_aligned(args["compressed_cache"], args["swa_cache"])
    assert dd.route(dd.mode()) == "paged"
    plan = run_dispatched(args, interpret, monkeypatch)
    assert plan.config == doc_unaligned_config() == _vk.V3_UNALIGNED[0]
    assert plan.consts[-1] is False  # ALIGN off: 2-byte aligned reads


@pytest.mark.parametrize("pair", ["c-odd", "w-odd"])
@pytest.mark.parametrize("mode", ["tiles", "heads"])
def test_dispatched_workspace_step_matches_reference(interpret, mode, pair):
    """The workspace route: the one-launch gather over a mixed block-size pair (bit-exact rows
    and indices), then the attention kernel resolve_workspace gives for the mode."""
    from dsv4_ops import attention

    T, H = 2, 20
    args = small_case(T, H, PAIRS[pair], seed=11, device=interpret)
    K = args["topk_slots"].shape[1] + args["swa_slots"].shape[1]
    assert dws.resolve_gather(T * K)[0]
    plan, why = dws.resolve_workspace(mode, T, H, K, True, -1)
    assert plan.kernel == mode, why
    gather = {k: args[k] for k in ("compressed_cache", "topk_slots", "topk_length", "compressed_block_size",
                                   "swa_cache", "swa_slots", "swa_length", "swa_block_size")}
    ws = poison_like(torch.empty(T * K, 512, dtype=torch.bfloat16, device=interpret))
    idx = attention.dsv4_decode_gather(**gather, workspace=ws)
    want_ws = torch.empty(T * K, 512, dtype=torch.bfloat16)
    want_idx = reference.ref_dsv4_decode_gather(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                   for k, v in gather.items()}, workspace=want_ws)
    assert torch.equal(idx.cpu(), want_idx)
    assert torch.equal(ws.cpu().view(torch.int16), want_ws.view(torch.int16))
    ws16 = ws.to(torch.float16)  # the interpreter's bf16 dot is wrong; these decoded keys are exact in fp16
    assert torch.equal(ws16.float(), ws.float())
    out, lse = attention.sparse_mla_decode(args["q"], ws16, idx, None, args["sink"], args["sm_scale"], kernel=mode)
    want, want_lse = reference.ref_sparse_mla_decode(args["q"].cpu(), want_ws, want_idx, None, args["sink"].cpu(),
                                                     args["sm_scale"], out_dtype=torch.float64)
    assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)
