"""Every dispatch rule over the product of the inputs it reads, on the CPU, through the plan
functions of dsv4_ops/dispatch/ (the resolvers return (choice, reason)); then every config the
DeepSeek-V4 decode can dispatch (paged op forms and configs, the workspace gather + tiles /
heads) run against the float64 reference under the Triton
interpreter, over both caches' block sizes: powers of two, and mixed pairs where one cache's
block size is not (a rule that reads one block size only picks a shift-based kernel there,
and that kernel reads the wrong pages).

The plan checks assert properties, not picks: the choice is valid (a known config, a split
count in [1, min(key blocks, MAX_SPLITS)], so no split is empty, the groups of its head block),
fits the device (shared memory), and agrees with the rules of docs/dispatch.md where the doc
states the rule (route, composite, form, block-size fallback, kernel choice, V3.2, prefill,
indexer); the measured split counts themselves may move with the SM count.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4_ops import envs, paged_decode, reference
from dsv4_ops.csrc_triton import indexer as _ik
from dsv4_ops.csrc_triton import sparse_prefill as _spk
from dsv4_ops.csrc_triton import v32_attention as _ak
from dsv4_ops.csrc_triton.decode import heads as _hk
from dsv4_ops.csrc_triton.decode import paged_chunk64 as _pk
from dsv4_ops.csrc_triton.decode import paged_chunk128 as _vk
from dsv4_ops.csrc_triton.decode import paged_f16dot as _v4k
from dsv4_ops.csrc_triton.decode.tiles import MAX_SPLITS, PARTITION_N
from dsv4_ops.dispatch import decode as dd
from dsv4_ops.dispatch import indexer as di
from dsv4_ops.dispatch import prefill as dp
from dsv4_ops.dispatch import v32 as dv
from dsv4_ops.dispatch import windows as dw
from dsv4_ops.testing import assert_attention_close, poison_like

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
    for name in (envs.DECODE_KERNEL, envs.DECODE_CONFIG, envs.BATCH_INVARIANT, envs.SMS, envs.V32_FORM):
        monkeypatch.delenv(name, raising=False)


def assert_splits_valid(S: int, nb: int, where) -> None:
    """1 <= S <= min(nb, MAX_SPLITS): the kernels give split s the key blocks [s * nb // S,
    (s + 1) * nb // S), so S <= nb leaves no split empty, and the merge takes 64 at most."""
    assert isinstance(S, int) and 1 <= S <= max(1, min(nb, MAX_SPLITS)), (S, nb, where)


# ---- the doc's rules, written from docs/dispatch.md (the tables are windows.py's data) ----


def doc_smem_config(T, H, K, smem):
    for t_lo, t_hi, h_lo, h_hi, k, name in dw.AUTO_V3_SMEM_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k and _v4k.V4_SMEM_BYTES.get(name, 0) <= smem:
            return name
    return ""


def doc_auto_v3(T, H, K, smem):
    return (any(t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k for t_lo, t_hi, h_lo, h_hi, k in dw.AUTO_V3_WINDOWS)
            or bool(doc_smem_config(T, H, K, smem)))


def doc_fused_window(T, H, K):
    return any(t_lo <= T <= t_hi and H <= h_max and K == k for t_lo, t_hi, h_max, k in dw.AUTO_FUSED_WINDOWS)


def doc_route(mode, T, H, K, smem):
    if mode in ("fused", "v3"):
        return "fused"
    if mode != "auto":
        return "workspace"
    if doc_fused_window(T, H, K):
        return "fused"
    return "v3" if doc_auto_v3(T, H, K, smem) else "paged"  # auto never takes the workspace step


def doc_v3_config(T, H, K, smem):
    name = doc_smem_config(T, H, K, smem)
    if name:
        return name
    for t_lo, t_hi, h_lo, h_hi, k, name in dw.V3_CONFIG_WINDOWS:
        if t_lo <= T <= t_hi and h_lo <= H <= h_hi and K == k:
            return name
    return "h16n16w4" if T == 1 and H <= 16 else "h16n32w4"


def is_f16dot_name(name):
    return "PV_KEY" in (_v4k.V4_CANDIDATES.get(name) or {})


# ---- the composite's route, the composite, the paged op's form ----


@pytest.mark.parametrize("mode", envs.DECODE_MODES)
def test_route_over_T_H_K_smem(mode):
    for T, H, K, smem in itertools.product(TS, HS, KS, SMEMS):
        got, why = dd.resolve_route(mode, T, H, K, smem)
        assert got == doc_route(mode, T, H, K, smem), (mode, T, H, K, smem, why)
        assert why and dd.route(mode, T, H, K, smem) == got


def page_cache(stride_ok: bool, addr_ok: bool = True, pages: int = 3):
    """A uint8 [pages, page_bytes] cache whose page stride (and address) is or is not a
    multiple of 16 bytes."""
    width = 576 * 4 if stride_ok else 584 * 4 + 8
    base = torch.zeros(pages, width + 16, dtype=torch.uint8)
    cache = base[:, :width] if addr_ok else base[:, 8:8 + width]
    assert (cache.stride(0) % 16 == 0) == stride_ok and (cache.data_ptr() % 16 == 0) == addr_ok
    return cache


CACHE_KINDS = {"aligned": (True, True), "odd-stride": (False, True), "odd-address": (True, False)}


@pytest.mark.parametrize("choice", ["fused", "paged", "v3", "workspace"])
def test_composite_reads_both_caches(choice):
    for (c_name, c_kind), (w_name, w_kind) in itertools.product(CACHE_KINDS.items(), repeat=2):
        cc, sw = page_cache(*c_kind), page_cache(*w_kind)
        got, why = dd.resolve_composite(choice, cc, sw)
        # the composite checks page strides only (traced code cannot read addresses); the
        # paged op checks the address itself (test below)
        want = choice in ("fused", "paged") or (choice == "v3" and c_kind[0] and w_kind[0])
        assert got == want == dd.uses_fused_op(choice, cc, sw), (choice, c_name, w_name, why)


@pytest.mark.parametrize("mode", ["auto", "v3", "fused", "tiles"])
@pytest.mark.parametrize("form", [None, "v1", "v3"])
def test_paged_form_reads_both_caches_and_the_windows(monkeypatch, mode, form):
    monkeypatch.setenv(envs.DECODE_KERNEL, mode)
    kinds = list(itertools.product(CACHE_KINDS.items(), repeat=2))
    for T, H, K, smem in itertools.product((1, 4, 16, 64, 300), (8, 64, 128), (256, 640), SMEMS):
        # auto: v1 only where its window holds the shape and no v3 window does; elsewhere v3
        auto_v3 = doc_auto_v3(T, H, K, smem) or not doc_fused_window(T, H, K)
        wants_v3 = form == "v3" or (form is None and (mode == "v3" or (mode == "auto" and auto_v3)))
        for (c_name, c_kind), (w_name, w_kind) in kinds:
            cc, sw = page_cache(*c_kind), page_cache(*w_kind)
            got, why = dd.resolve_paged_form(form, T, H, K, smem, cc, sw)
            want = "v3" if wants_v3 and all(c_kind) and all(w_kind) else "v1"
            assert got == want == dd.paged_form(form, T, H, K, smem, cc, sw), (T, H, K, smem, c_name, w_name, why)


# ---- the v3 form's config: windows, shared memory, both block sizes ----


def test_v3_config_over_T_H_K_smem_and_block_sizes():
    for T, H, K, smem in itertools.product(TS, HS, KS, SMEMS):
        windows_pick = doc_v3_config(T, H, K, smem)
        for bs in MIXED:
            name, why = dd.resolve_v3_config(T, H, K, smem, "", bs)
            where = (T, H, K, smem, bs, why)
            cfg = dd.v3_config(name)  # a known config (KeyError otherwise)
            assert dd.config_fits(name, smem), where
            if all(pow2(b) for b in bs):
                assert name == windows_pick, where
            else:  # paged_f16dot takes block sizes as shifts: never over a non-power-of-two size
                assert not dd.is_f16dot(cfg), where
                assert name == (dd.V3_ANY_BLOCK_SIZE_CONFIG if is_f16dot_name(windows_pick) else windows_pick), where
            assert dd.v3_launch_config(T, H, K, smem, "", bs) == name


F16DOT_NAMES = sorted(n for n in _v4k.V4_CANDIDATES if is_f16dot_name(n))


@pytest.mark.parametrize("source", ["caller", "env"])
def test_forced_f16dot_config_falls_back_on_any_odd_block_size(monkeypatch, source):
    for name in F16DOT_NAMES:
        if source == "env":
            monkeypatch.setenv(envs.DECODE_CONFIG, name)
        for bs in MIXED:
            got, why = dd.resolve_v3_config(4, 8, 640, 163 * 1024, name if source == "caller" else "", bs)
            want = name if all(pow2(b) for b in bs) else dd.V3_ANY_BLOCK_SIZE_CONFIG
            assert got == want, (name, bs, why)
            assert not dd.is_f16dot(dd.v3_config(got)) or all(pow2(b) for b in bs)


# ---- split counts: v3, v1, workspace (tiles / heads), batch invariance ----


def dispatchable_v3_configs():
    """Every config resolve_v3_config returns over the product (with the fallback)."""
    return sorted({dd.resolve_v3_config(T, H, K, smem, "", bs)[0]
                   for T, H, K, smem in itertools.product(TS, HS, KS, SMEMS) for bs in ((4, 8), (3, 8))})


def test_v3_plan_over_T_H_K_sms():
    names = dispatchable_v3_configs()
    assert set(names) >= {"h16n32w4", dd.V3_ANY_BLOCK_SIZE_CONFIG}
    for name, T, H, K, sms in itertools.product(names, TS, HS, KS, SMS):
        cfg = dd.v3_config(name)
        p = dd.v3_plan(T, H, K, sms, 0, name)
        where = (name, T, H, K, sms, p)
        assert (p.kernel, p.config, p.block_h, p.block_n) == ("v3", name, cfg["BLOCK_H"], cfg["BLOCK_N"]), where
        assert p.groups == cdiv(H, cfg["BLOCK_H"]) and p.direct == (p.splits == 1), where
        assert_splits_valid(p.splits, cdiv(K, cfg["BLOCK_N"]), where)


def test_fused_plan_over_T_H_K_sms():
    for T, H, K, sms in itertools.product(TS, HS, KS, SMS):
        p = dd.fused_plan(T, H, K, sms)
        bh = _pk.block_h_for(H)
        where = (T, H, K, sms, p)
        assert (p.kernel, p.block_h, p.block_n) == ("fused", bh, _pk.FUSED_CONFIG[bh]["BLOCK_N"]), where
        assert p.groups == cdiv(H, bh) and p.direct == (p.splits == 1), where
        assert_splits_valid(p.splits, cdiv(K, p.block_n), where)


@pytest.mark.parametrize("mode", envs.DECODE_MODES)
def test_workspace_plan_over_T_H_K_sms_and_index_dtype(monkeypatch, mode):
    for sms in SMS:
        monkeypatch.setenv(envs.SMS, str(sms))
        for T, H, K, int32 in itertools.product(TS, HS, KS, (True, False)):
            p, why = dd.resolve_workspace(mode, T, H, K, int32, 0)
            where = (mode, sms, T, H, K, int32, p, why)
            heads = int32 and (mode == "heads" or (mode in ("auto", "fused", "v3") and T >= dd.AUTO_HEADS_MIN_T))
            assert p.kernel == ("heads" if heads else "tiles"), where
            if heads:
                bh = _hk.block_h_for(H)
                assert (p.block_h, p.block_n) == (bh, _hk.HEADS_CONFIG[bh]["BLOCK_N"]), where
            else:
                assert (p.block_h, p.block_n) == (16, PARTITION_N) and p.splits == dd.tile_splits(T, H, K), where
            assert p.groups == cdiv(H, p.block_h), where
            assert_splits_valid(p.splits, cdiv(K, p.block_n), where)
            assert dd.workspace_plan(mode, T, H, K, int32, 0) == p


def test_batch_invariant_plan_does_not_read_T(monkeypatch):
    monkeypatch.setenv(envs.BATCH_INVARIANT, "1")
    for sms in SMS:
        monkeypatch.setenv(envs.SMS, str(sms))
        for H, K in itertools.product(HS, KS):
            mode = dd.resolve_mode()[0]  # what sparse_mla_decode passes
            plans = {dd.resolve_workspace(mode, T, H, K, True, 0)[0] for T in TS}
            assert len(plans) == 1, (sms, H, K, plans)
            p = plans.pop()
            assert p.kernel == "heads", p
            assert_splits_valid(p.splits, cdiv(K, p.block_n), (H, K, p))


def test_gather_rule_edges():
    m = dd.FUSED_GATHER_MAX_ROWS
    for rows in (0, 1, m - 1, m, m + 1, 4 * m):
        assert dd.resolve_gather(rows)[0] == (rows <= m) == dd.gather_in_one_launch(rows)


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


def small_case(T, H, bs, seed, device, aligned=True):
    """Inputs of one paged decode call (fp16 q under the interpreter), caches of ~24 / ~12 slots."""
    from test_decode_paged import case as aligned_case
    from test_decode_paged_chunk64 import case as plain_case

    bs_c, bs_w = bs
    make = aligned_case if aligned else plain_case
    args = make(T, H, 20, 6, seed=seed, bs_c=bs_c, nb_c=cdiv(24, bs_c), bs_w=bs_w, nb_w=cdiv(12, bs_w),
                device=device)
    if not aligned:
        assert args["compressed_cache"].stride(0) % 16 or args["swa_cache"].stride(0) % 16
    return args


def run_dispatched(args, device):
    """The paged op with every choice left to the dispatch (form None, config '', splits 0)."""
    T, H = args["q"].shape[:2]
    out = poison_like(torch.empty(T, H, 512, dtype=torch.bfloat16, device=device))
    got, lse = paged_decode.dsv4_decode_fused(**args, out=out)
    want, want_lse = reference.ref_dsv4_decode_fused(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                         for k, v in args.items()}, out_dtype=torch.float64)
    assert_attention_close(got.cpu(), lse.cpu(), want, want_lse)  # no NaN row, every row within bounds


V3_TARGETS = ["h16n16w4", "h16n32w4", "kh16n32w4", "kh16n64w8", "kh32n64w8"]


def test_the_targets_are_every_dispatchable_config():
    assert set(dispatchable_v3_configs()) <= set(V3_TARGETS)
    assert set(V3_TARGETS) >= set(_vk.V3_DISPATCHED)


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
@pytest.mark.parametrize("name", V3_TARGETS)
def test_dispatched_v3_config_matches_reference(interpret, monkeypatch, name, pair):
    """A window steering the small shape to ``name`` (a swapped table steers every reader), auto
    mode: the dispatch picks the config, or its fallback over an odd block size."""
    bs = PAIRS[pair]
    T, H, K = 2, (20 if _v4k.V4_CANDIDATES.get(name, _vk.V3_CANDIDATES.get(name))["BLOCK_H"] == 32 else 8), 26
    monkeypatch.setattr(dw, "AUTO_FUSED_WINDOWS", ())
    monkeypatch.setattr(dw, "AUTO_V3_WINDOWS", ((T, T, H, H, K),))
    big = name in _v4k.V4_SMEM_BYTES
    monkeypatch.setattr(dw, "AUTO_V3_SMEM_WINDOWS", ((T, T, H, H, K, name),) if big else ())
    monkeypatch.setattr(dw, "V3_CONFIG_WINDOWS", () if big else ((T, T, H, H, K, name),))
    smem = 163 * 1024
    picked = dd.resolve_v3_config(T, H, K, smem, "", bs)[0]
    assert picked == (name if all(pow2(b) for b in bs) or not is_f16dot_name(name) else dd.V3_ANY_BLOCK_SIZE_CONFIG)
    args = small_case(T, H, bs, seed=len(name) + sum(bs), device=interpret)
    assert dd.resolve_paged_form(None, T, H, K, smem, args["compressed_cache"], args["swa_cache"])[0] == "v3"
    run_dispatched(args, interpret)


@pytest.mark.parametrize("pair", ["c-odd", "w-odd"])
@pytest.mark.parametrize("aligned", [True, False], ids=["v1-window", "v3-window-unaligned"])
def test_dispatched_v1_form_matches_reference(interpret, monkeypatch, pair, aligned):
    """Form v1 (paged_chunk64): by its window, or a v3 window over caches whose pages are not
    16-byte multiples."""
    T, H, K = 2, 20, 26
    monkeypatch.setattr(dw, "AUTO_FUSED_WINDOWS", ((T, T, 32, K),) if aligned else ())
    monkeypatch.setattr(dw, "AUTO_V3_WINDOWS", () if aligned else ((T, T, H, H, K),))
    args = small_case(T, H, PAIRS[pair], seed=5, device=interpret, aligned=aligned)
    assert dd.resolve_paged_form(None, T, H, K, 163 * 1024, args["compressed_cache"], args["swa_cache"])[0] == "v1"
    run_dispatched(args, interpret)


@pytest.mark.parametrize("pair", ["c-odd", "w-odd"])
@pytest.mark.parametrize("mode", ["tiles", "heads"])
def test_dispatched_workspace_step_matches_reference(interpret, mode, pair):
    """The workspace route: the one-launch gather over a mixed block-size pair (bit-exact rows
    and indices), then the attention kernel resolve_workspace gives for the mode."""
    from dsv4_ops import attention

    T, H = 2, 20
    args = small_case(T, H, PAIRS[pair], seed=11, device=interpret)
    K = args["topk_slots"].shape[1] + args["swa_slots"].shape[1]
    assert dd.resolve_gather(T * K)[0]
    plan, why = dd.resolve_workspace(mode, T, H, K, True, -1)
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
