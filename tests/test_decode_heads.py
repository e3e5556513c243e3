"""The "heads" decode kernel (csrc_triton.decode.heads: all heads of a token in one
program) and its dispatch (dsv4_ops.dispatch.decode, DSV4_AMPERE_DECODE_KERNEL): the kernel
against the float64 reference under the interpreter (fp16 operands: the interpreter's bf16
tl.dot is wrong), both epilogues (one split writes out + lse directly; more splits go
through the merge), the plan, the AOT specializations, and on the GPU both kernels against
the reference with the tolerances of tests/test_attention.py, CUDA-graph replay and the
whole decode step under each DSV4_AMPERE_DECODE_KERNEL value."""

import pytest
import torch

from dsv4_ops import aot, attention, dispatch, reference
from dsv4_ops.csrc_triton.decode import heads as hk
from dsv4_ops.testing import assert_attention_close, capture_graph, poison_like, rng

D = 512
SM_SCALE = D ** -0.5


def make_case(T, H, K, *, N=None, dtype=torch.float16, seed=0, device="cpu"):
    """q, kv, int32 indices with -1 and >= N entries, topk_length < K on some tokens (the
    first is K), and the last token (T > 1) with no valid key at all."""
    g = rng(seed)
    N = N or 2 * K + 8
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g).to(dtype)
    idx = torch.randint(0, N, (T, K), generator=g)
    bad = torch.rand(T, K, generator=g)
    idx = torch.where(bad < 0.1, torch.full_like(idx, -1), idx)
    idx = torch.where((bad >= 0.1) & (bad < 0.15), idx + N, idx)
    tl = torch.randint(1, K + 1, (T,), generator=g, dtype=torch.int32)
    tl[0] = K
    if T > 1:
        idx[T - 1] = -1
    idx = idx.to(torch.int32)
    return q.to(device), kv.to(device), idx.to(device), tl.to(device)


def make_sink(kind, H, device="cpu"):
    if kind is None:
        return None
    s = torch.randn(H, generator=rng(H + 1))
    if kind == "mixed":
        s[::2] = float("-inf")
    return s.to(device)


def _ref(q, kv, idx, tl, sink):
    """The float64 reference, on the inputs' device (a GPU runs it in well under a second)."""
    return reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, out_dtype=torch.float64)


def _check_empty_row(out, lse, sink, T, H):
    """The token with no valid key: out 0 and lse = sink (-inf without one)."""
    if T > 1:
        assert torch.all(out[T - 1].float().cpu() == 0)
        want = torch.full((H,), float("-inf")) if sink is None else sink.float().cpu()
        assert torch.equal(lse[T - 1].cpu(), want)


# ------------------------------------------------------------------------------------------
# CPU: the kernel under the interpreter, fp16 operands
# ------------------------------------------------------------------------------------------

HS = [1, 8, 16, 24, 64]


@pytest.mark.parametrize("splits", ["1", "2", "max"])
@pytest.mark.parametrize("H", HS, ids=lambda h: f"H{h}")
def test_heads_kernel_fp16_matches_reference(interpret, H, splits):
    T, K = 3, 70  # 3 key blocks of 32; the last token has no valid key
    q, kv, idx, tl = make_case(T, H, K, seed=H * 10 + len(splits))
    sink = make_sink("finite" if H % 2 else "mixed", H)
    S = {"1": 1, "2": 2, "max": -(-K // hk.HEADS_CONFIG[hk.block_h_for(H)]["BLOCK_N"])}[splits]
    dev = interpret
    out, lse = attention.sparse_mla_decode(q.to(dev), kv.to(dev), idx.to(dev), tl.to(dev), sink.to(dev),
                                           SM_SCALE, S, kernel="heads")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (T, H, D)
    want_out, want_lse = _ref(q, kv, idx, tl, sink)
    assert_attention_close(out.cpu(), lse.cpu(), want_out, want_lse)
    _check_empty_row(out, lse, sink, T, H)


@pytest.mark.parametrize("S", [1, 8], ids=lambda s: f"S{s}")
def test_heads_kernel_without_sink_or_topk_length(interpret, S):
    """No sink (empty row: lse -inf), no topk_length; S = 8 > 2 key blocks leaves empty splits."""
    T, H, K = 2, 8, 40
    q, kv, idx, _ = make_case(T, H, K, seed=5)
    dev = interpret
    out, lse = attention.sparse_mla_decode(q.to(dev), kv.to(dev), idx.to(dev), None, None, SM_SCALE, S,
                                           kernel="heads")
    want_out, want_lse = _ref(q, kv, idx, None, None)
    assert_attention_close(out.cpu(), lse.cpu(), want_out, want_lse)
    _check_empty_row(out, lse, None, T, H)


def test_heads_direct_writes_a_strided_out_in_place(interpret):
    T, H, K = 2, 24, 50
    q, kv, idx, tl = make_case(T, H, K, seed=9)
    sink = make_sink("finite", H)
    dev = interpret
    buf = poison_like(torch.empty(T, H + 2, D, dtype=torch.bfloat16, device=dev))
    out = buf[:, 1:H + 1]
    o2, lse = attention.sparse_mla_decode(q.to(dev), kv.to(dev), idx.to(dev), tl.to(dev), sink.to(dev),
                                          SM_SCALE, 1, out=out, kernel="heads")
    assert o2 is out
    assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl, sink))
    buf = buf.cpu()
    assert torch.isnan(buf[:, 0].float()).all() and torch.isnan(buf[:, H + 1].float()).all()


def test_heads_mode_launches_the_heads_kernel_and_tiles_does_not(interpret, monkeypatch):
    T, H, K = 2, 8, 40
    q, kv, idx, tl = [t.to(interpret) for t in make_case(T, H, K, seed=4)]
    stats = attention._heads_kernel.stats
    for env, want in (("heads", 1), ("tiles", 0), ("auto", 0 if T < dispatch.workspace.AUTO_HEADS_MIN_T else 1)):
        monkeypatch.setenv(dispatch.decode.ENV_VAR, env)
        before = dict(stats)
        out, lse = attention.sparse_mla_decode(q, kv, idx, tl, None, SM_SCALE)
        launched = stats["fast"] + stats["slow"] - before["fast"] - before["slow"]
        if want is not None:
            assert launched == want, env
        assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl, None))
    # int64 indices: the heads kernel takes int32 only, so heads mode runs the tiles
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "heads")
    before = dict(stats)
    out, lse = attention.sparse_mla_decode(q, kv, idx.long(), tl, None, SM_SCALE)
    assert stats["fast"] + stats["slow"] == before["fast"] + before["slow"]
    assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl, None))


# ------------------------------------------------------------------------------------------
# CPU: the plan
# ------------------------------------------------------------------------------------------

def test_mode_reads_the_env_and_rejects_unknown_values(monkeypatch):
    monkeypatch.delenv(dispatch.decode.ENV_VAR, raising=False)
    assert dispatch.decode.mode() == "auto"
    for m in dispatch.decode.MODES:
        monkeypatch.setenv(dispatch.decode.ENV_VAR, m.upper())
        assert dispatch.decode.mode() == m
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=dispatch.decode.ENV_VAR):
        dispatch.decode.mode()
    with pytest.raises(ValueError, match="kernel"):
        attention.sparse_mla_decode(*make_case(1, 8, 16)[:3], None, None, SM_SCALE, kernel="fast")


@pytest.mark.parametrize("sms", [108, 132])
@pytest.mark.parametrize("T", [1, 8, 64, 128, 512])
@pytest.mark.parametrize("H", [1, 8, 16, 24, 64, 128])
def test_plan_is_consistent(T, H, sms):
    K = 640
    p = dispatch.workspace.plan(T, H, K, sms, "heads")
    assert p.kernel == "heads" and p.block_h == hk.block_h_for(H) and p.groups * p.block_h >= H
    assert p.block_h <= hk.MAX_BLOCK_H and p.block_h in hk.HEADS_CONFIG and p.block_h >= min(16, p.block_h)
    assert 1 <= p.splits <= attention.MAX_SPLITS and p.direct == (p.splits == 1)
    assert p.splits in dispatch.decode.balanced_splits(-(-K // p.block_n))
    # the chosen count is the model's minimum
    best = min(dispatch.workspace.heads_time_us(T, H, K, sms, s) for s in dispatch.decode.balanced_splits(-(-K // p.block_n)))
    assert dispatch.workspace.heads_time_us(T, H, K, sms, p.splits) == best
    assert dispatch.workspace.plan(T, H, K, sms, "tiles").kernel == "tiles"
    auto = dispatch.workspace.plan(T, H, K, sms, "auto")
    if T < dispatch.workspace.AUTO_HEADS_MIN_T:
        assert auto == dispatch.workspace.plan(T, H, K, sms, "tiles")
    else:
        assert auto.kernel == "heads" and auto.splits == min(dispatch.workspace.auto_heads_splits(T, H, sms), -(-K // auto.block_n))
    assert dispatch.workspace.plan(T, H, K, sms, "heads", 5).splits == 5


def test_plan_skips_the_merge_once_the_programs_fill_the_gpu():
    """Many tokens: more splits only add partial bytes and a merge; few tokens: split."""
    for sms in (108, 132):
        assert dispatch.workspace.plan(4 * sms, 8, 640, sms, "heads").splits == 1
        assert dispatch.workspace.plan(1, 8, 640, sms, "heads").splits > 1


@pytest.mark.parametrize("T,H,want", [(64, 8, 4), (64, 16, 4), (128, 8, 3), (64, 64, 2), (128, 128, 2),
                                      (4096, 8, 1), (4096, 64, 2)],
                         ids=["T64-H8", "T64-H16", "T128-H8", "T64-H64", "T128-H128", "T4096-H8", "T4096-H64"])
def test_auto_uses_the_measured_heads_plan_from_t64(T, H, want):
    """Pinned to benchmarks/results/decode_kernels.md and sparse_prefill.md (H200, portable):
    from T = 64 the heads kernel with these split counts beat the tiles; below T = 64 auto
    keeps the tiles."""
    for sms in (108, 132):
        p = dispatch.workspace.plan(T, H, 640, sms, "auto")
        assert (p.kernel, p.splits) == ("heads", want)
        assert dispatch.workspace.plan(8, H, 640, sms, "auto").kernel == "tiles"


def test_balanced_splits():
    for nb in (1, 2, 7, 20, 40, 200):
        got = dispatch.decode.balanced_splits(nb)
        longest = [-(-nb // s) for s in got]
        assert got[0] == 1 and all(a > b for a, b in zip(longest, longest[1:]))  # each shortens
        assert all(s <= attention.MAX_SPLITS for s in got)


def test_block_h():
    assert [hk.block_h_for(h) for h in (1, 8, 16, 17, 24, 32, 64, 128)] == [16, 16, 16, 32, 32, 32, 32, 32]


# ------------------------------------------------------------------------------------------
# AOT: every specialization the launcher can pick, sm_80 and sm_86, no spills
# ------------------------------------------------------------------------------------------

def test_aot_covers_every_heads_specialization():
    labels = {s.label for s in aot.all_specs() if s.label.startswith("heads[")}
    for variant in ("portable", "native"):
        for bh in hk.HEADS_CONFIG:
            for ln in ("len", "nolen"):
                for epi in ("part", "direct", "direct,sink"):
                    assert f"heads[{variant},bh{bh},{ln},{epi}]" in labels
    # every H maps to a configured head group
    assert {hk.block_h_for(h) for h in range(1, 257)} <= set(hk.HEADS_CONFIG)


def test_aot_heads_kernels_compile_for_sm80_and_sm86(aot_results):
    results = [r for r in aot_results if r.label.startswith("heads[") and r.variant == "portable"]
    assert {r.arch for r in results} == set(aot.AMPERE_ARCHS)
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.shared_bytes <= aot.SMEM_LIMIT[r.arch] and r.registers <= 255
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"


# ------------------------------------------------------------------------------------------
# GPU: both kernels, both variants, against the float64 reference
# ------------------------------------------------------------------------------------------

KERNELS = ("tiles", "heads")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("K", [100, 640], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("H", [1, 8, 24, 64, 128], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("T", [1, 130], ids=lambda t: f"T{t}")
def test_gpu_decode_matches_reference(variant, kernel, T, H, K):
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=T * 7 + H * 3 + K)
    sink = make_sink("finite", H, "cuda")
    out, lse = attention.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, kernel=kernel)
    assert_attention_close(out, lse, *_ref(q, kv, idx, tl, sink))
    _check_empty_row(out, lse, sink, T, H)
    out, lse = attention.sparse_mla_decode(q, kv, idx, None, None, SM_SCALE, kernel=kernel)
    assert_attention_close(out, lse, *_ref(q, kv, idx, None, None))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K", [(1, 8, 640), (3, 24, 100), (2, 128, 640)], ids=["T1-H8", "T3-H24", "T2-H128"])
def test_gpu_heads_every_num_splits(variant, T, H, K):
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=11)
    for sink_kind in (None, "mixed"):
        sink = make_sink(sink_kind, H, "cuda")
        want = _ref(q, kv, idx, tl, sink)
        nb = -(-K // hk.HEADS_CONFIG[hk.block_h_for(H)]["BLOCK_N"])
        for S in sorted(set(dispatch.decode.balanced_splits(nb)) | {2, attention.MAX_SPLITS}):
            out, lse = attention.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, S, kernel="heads")
            assert_attention_close(out, lse, *want, what=f"out S={S}")
            _check_empty_row(out, lse, sink, T, H)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [0, 1, 4], ids=lambda s: f"S{s}")
def test_gpu_heads_cuda_graph_replay_on_new_inputs(variant, S):
    T, H, K = 4, 64, 640
    static = list(make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=21))
    static.append(make_sink("finite", H, "cuda"))

    def step():
        return attention.sparse_mla_decode(*static[:4], static[4], SM_SCALE, S, kernel="heads")

    g, (g_out, g_lse) = capture_graph(step)
    new = list(make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=22)) + [make_sink("mixed", H, "cuda")]
    for dst, src in zip(static, new):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    e_out, e_lse = attention.sparse_mla_decode(*new[:4], new[4], SM_SCALE, S, kernel="heads")
    assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", dispatch.decode.MODES)
def test_gpu_whole_step_under_each_env_value(variant, mode, monkeypatch):
    """dsv4_decode_attention (gather + decode) with DSV4_AMPERE_DECODE_KERNEL=mode against
    the float64 reference on the gathered workspace."""
    from dsv4_ops import dsv4_decode
    from dsv4_ops.layout import min_page_bytes

    monkeypatch.setenv(dispatch.decode.ENV_VAR, mode)
    g = rng(5)
    T, H, K1, K2, bs = 3, 64, 96, 32, 64
    nblk = 4
    caches = []
    for seed in (6, 7):  # caches written by the reference insert
        cache = torch.zeros(nblk, min_page_bytes(bs), dtype=torch.uint8)
        rows = torch.randn(nblk * bs, D, generator=rng(seed)).to(torch.bfloat16)
        reference.ref_kv_cache_insert(rows, cache, torch.arange(nblk * bs), bs)
        caches.append(cache)
    cache_c, cache_w = caches
    cap = nblk * bs
    topk = torch.randint(-2, cap + 2, (T, K1), generator=g, dtype=torch.int32)
    swa = torch.randint(-2, cap + 2, (T, K2), generator=g, dtype=torch.int32)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    cuda = [t.cuda() for t in (q, cache_c, topk, cache_w, swa, sink)]
    ws = torch.empty(T * (K1 + K2), D, dtype=torch.bfloat16, device="cuda")
    out, lse = dsv4_decode.dsv4_decode_attention(cuda[0], cuda[1], cuda[2], cuda[3], cuda[4], cuda[5], SM_SCALE,
                                                 bs, bs, workspace=ws)
    idx = torch.ops.dsv4_ampere.dsv4_decode_gather(cuda[1], cuda[2], None, bs, cuda[3], cuda[4], None, bs, ws)
    assert_attention_close(out, lse, *_ref(cuda[0], ws, idx, None, cuda[5]))
