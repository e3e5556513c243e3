"""The sparse MLA prefill kernel (csrc_triton.sparse_prefill, launcher
dsv4_ops.sparse_prefill, op dsv4_ampere::sparse_mla_prefill) and the route of
flash_mla_sparse_fwd_ampere through it: every benchmark candidate config against the float64
reference under the interpreter (fp16 operands: the interpreter's bf16 tl.dot is wrong), the
empty-row / sink / masking semantics, the dispatch rule, the op's fake and opcheck, the AOT
specializations (sm_80 and sm_86, no spills); on the GPU every config at real shapes against
the reference with the tolerances of tests/test_attention.py, vLLM's real prefill index layout,
CUDA-graph replay on new inputs == eager, and torch.compile(fullgraph=True)."""

import pytest
import torch

from dsv4_ops import aot, dispatch, reference, sparse_prefill as sp
from dsv4_ops.csrc_triton import sparse_prefill as pk
from dsv4_ops.testing import assert_attention_close, capture_graph, poison_like, rng

D = 512
SM_SCALE = D ** -0.5
ALL_CONFIGS = [(bh, i) for bh, cands in sorted(pk.CANDIDATES.items()) for i in range(len(cands))]


def cfg_id(c):
    bh, i = c
    cfg = pk.CANDIDATES[bh][i]
    return (f"bh{bh}-{i}-bn{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}{'ia' if cfg.get('IDX_AHEAD') else ''}"
            f"{'sp' + str(cfg['SPLIT']) if cfg.get('SPLIT') else ''}")


def make_case(T, H, K, *, N=None, dtype=torch.float16, seed=0, device="cpu"):
    """q, kv, int32 indices with -1 and >= N entries, topk_length < K on some queries (the
    first is K, one is 0), and the last query (T > 1) with no valid index at all."""
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
    if T > 2:
        tl[1] = 0
    if T > 1:
        idx[T - 1] = -1
    return q.to(device), kv.to(device), idx.to(torch.int32).to(device), tl.to(device)


def make_sink(kind, H, device="cpu"):
    if kind is None:
        return None
    s = torch.randn(H, generator=rng(H + 1))
    if kind == "mixed":  # -inf (no sink) and NaN (no sink) heads beside finite ones
        s[::3] = float("-inf")
        s[1::5] = float("nan")
    return s.to(device)


def _ref(q, kv, idx, tl, sink):
    return reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, out_dtype=torch.float64)


def _check_empty_rows(out, lse, sink, idx, tl, N):
    """Queries with no valid key: out 0 and lse = sink (-inf without one or for a NaN sink);
    returns their indices."""
    valid = reference._ref_attn_valid(idx, tl, N)
    H = out.shape[1]
    want = reference.ref_sink_logits(sink, H, "cpu" if sink is None else sink.device).float().cpu()
    empty = [t for t in range(idx.shape[0]) if not valid[t].any()]
    for t in empty:
        assert torch.all(out[t].float().cpu() == 0)
        assert torch.equal(lse[t].cpu(), want)
    return empty


# ------------------------------------------------------------------------------------------
# CPU: the kernel under the interpreter, fp16 operands
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ALL_CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("H", [1, 8, 24, 64], ids=lambda h: f"H{h}")
def test_kernel_fp16_matches_reference(interpret, H, config):
    T, K = 4, 70  # several key blocks; query 1 has topk_length 0, the last no valid index
    q, kv, idx, tl = make_case(T, H, K, seed=H * 10 + config[0] + config[1])
    sink = make_sink("finite" if H % 2 else "mixed", H)
    dev = interpret
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=dev))
    o, lse = sp.sparse_mla_prefill(q.to(dev), kv.to(dev), idx.to(dev), tl.to(dev), sink.to(dev), SM_SCALE,
                                   out=out, config=config)
    assert o is out and lse.dtype == torch.float32 and lse.shape == (T, H)
    assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl, sink))
    assert len(_check_empty_rows(out, lse, sink, idx, tl, kv.shape[0])) == 2


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=cfg_id)
def test_kernel_without_sink_or_topk_length_allocates_out(interpret, config):
    T, H, K = 3, 8, 40
    q, kv, idx, _ = make_case(T, H, K, seed=5)
    dev = interpret
    out, lse = sp.sparse_mla_prefill(q.to(dev), kv.to(dev), idx.to(dev), None, None, SM_SCALE, config=config)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H, D)
    assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, None, None))
    assert _check_empty_rows(out, lse, None, idx, None, kv.shape[0]) == [T - 1]


def test_kernel_never_reads_masked_rows(interpret):
    """Rows of kv that no valid entry names hold NaN / inf (vLLM's workspace is not zeroed):
    the masked loads keep them out of the result."""
    T, H, K = 3, 16, 50
    q, kv, idx, tl = make_case(T, H, K, seed=12)
    N = kv.shape[0]
    valid = (idx >= 0) & (idx < N) & (torch.arange(K)[None, :] < tl[:, None].long())
    used = torch.zeros(N, dtype=torch.bool)
    used[idx[valid].long()] = True
    kv_bad = kv.clone()
    kv_bad[~used] = float("nan")
    kv_bad[torch.nonzero(~used)[:3, 0]] = float("inf")
    assert (~used).sum() > 3
    dev = interpret
    sink = make_sink("finite", H)
    out, lse = sp.sparse_mla_prefill(q.to(dev), kv_bad.to(dev), idx.to(dev), tl.to(dev), sink.to(dev), SM_SCALE,
                                     config=(16, 0))
    assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl, sink))


def test_strided_q_and_out_int64_topk_length(interpret):
    """q a head slice (strided rows), out a slice of a larger buffer written in place (the
    neighbours stay poisoned), topk_length int64 with values above K."""
    T, H, K = 3, 24, 50
    q_full, kv, idx, tl = make_case(T, H + 4, K, seed=9)
    q = q_full[:, 2:H + 2]
    tl64 = tl.to(torch.int64)
    tl64[0] = K + 100
    sink = make_sink("mixed", H)
    dev = interpret
    buf = poison_like(torch.empty(T, H + 2, D, dtype=torch.bfloat16, device=dev))
    out = buf[:, 1:H + 1]
    o2, lse = sp.sparse_mla_prefill(q.to(dev), kv.to(dev), idx.to(dev), tl64.to(dev), sink.to(dev), SM_SCALE,
                                    out=out, config=(32, 0))
    assert o2 is out
    assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl64.clamp(max=K), sink))
    buf = buf.cpu()
    assert torch.isnan(buf[:, 0].float()).all() and torch.isnan(buf[:, H + 1].float()).all()


def test_bad_arguments_name_the_argument(interpret):
    q, kv, idx, tl = make_case(2, 8, 20, seed=3)
    dev = interpret
    q, kv, idx, tl = q.to(dev), kv.to(dev), idx.to(dev), tl.to(dev)
    with pytest.raises(ValueError, match="indices"):
        sp.sparse_mla_prefill(q, kv, idx[:1], tl, None, SM_SCALE)
    with pytest.raises(ValueError, match="sink"):
        sp.sparse_mla_prefill(q, kv, idx, tl, torch.zeros(3, device=dev), SM_SCALE)
    with pytest.raises(ValueError, match="out"):
        sp.sparse_mla_prefill(q, kv, idx, tl, None, SM_SCALE, out=torch.empty(2, 8, D, device=dev))
    with pytest.raises(ValueError, match="config"):
        sp.sparse_mla_prefill(q, kv, idx, tl, None, SM_SCALE, config=(128, 0))
    with pytest.raises(ValueError, match="config"):
        sp.sparse_mla_prefill(q, kv, idx.long(), tl, None, SM_SCALE, config=(16, 0))
    with pytest.raises(ValueError, match="kv"):
        sp.sparse_mla_prefill(q, kv.float(), idx, tl, None, SM_SCALE)


# ------------------------------------------------------------------------------------------
# Dispatch
# ------------------------------------------------------------------------------------------

def test_block_h_and_configs():
    assert [pk.block_h_for(h) for h in (1, 8, 16, 17, 32, 33, 64, 128)] == [16, 16, 16, 32, 32, 32, 32, 32]
    assert {pk.block_h_for(h) for h in range(1, 257)} <= set(pk.PREFILL_CONFIG) <= set(pk.CANDIDATES)
    for bh, cfg in pk.PREFILL_CONFIG.items():
        assert any(cfg is c for c in pk.CANDIDATES[bh])


def test_split_configs_launch_the_split_kernel_with_one_chunk_a_warp():
    """A config with SPLIT runs the split-d kernel with num_warps == SPLIT (its layout gives
    each warp one chunk of 512 // SPLIT dims); the others the 2-D kernel."""
    n_split = 0
    for bh, cands in pk.CANDIDATES.items():
        for cfg in cands:
            if cfg.get("SPLIT"):
                n_split += 1
                assert pk.kernel_for(cfg) is pk._sparse_mla_prefill_splitd_kernel
                assert cfg["num_warps"] == cfg["SPLIT"] and 512 % cfg["SPLIT"] == 0
                assert "split" in pk.config_label(bh, cfg)
            else:
                assert pk.kernel_for(cfg) is pk._sparse_mla_prefill_kernel
    assert n_split > 0


@pytest.mark.parametrize("T,H,sms,want", [(4096, 8, 132, True), (4096, 128, 108, True), (527, 8, 132, False),
                                          (528, 8, 132, True), (132, 128, 132, True), (131, 128, 132, False),
                                          (1, 128, 108, False)])
def test_dispatch_rule(T, H, sms, want):
    assert dispatch.prefill.PREFILL_MIN_WAVES == 4  # the cases below are written for 4 waves
    assert dispatch.prefill.uses_prefill_kernel(T, H, torch.int32, sms) is want
    assert dispatch.prefill.uses_prefill_kernel(T, H, torch.int64, sms) is False  # int64: the decode kernels


def test_dispatch_launches_the_prefill_kernel_only_when_the_programs_fill_the_sms(interpret, monkeypatch):
    """With 4 SMs (16 programs for 4 waves): T x G = 16 runs the prefill kernel, 12 the decode
    path, and so does a q view whose rows are not 16-byte aligned; all match the reference."""
    monkeypatch.setattr(dispatch.prefill, "num_sms_of", lambda t: 4)
    dev = interpret
    for T, want, shift in ((4, True, 0), (3, False, 0), (4, False, 4)):  # H = 128: four groups of 32
        q, kv, idx, tl = make_case(T, 128, 20, seed=T, device=dev)
        if shift:  # the same values at a storage offset of 4 elements (8 bytes)
            q = torch.empty(q.numel() + shift, dtype=q.dtype, device=dev)[shift:].view(q.shape).copy_(q)
            assert not dispatch.prefill.aligned(q, kv, None)
        sink = make_sink("finite", 128, dev)
        before = dict(sp._kernel.stats)
        out, lse = sp.sparse_mla_prefill(q, kv, idx, tl, sink, SM_SCALE)
        ran = sum(sp._kernel.stats.values()) > sum(before.values())
        assert ran is want, (T, shift, before, sp._kernel.stats)
        assert_attention_close(out.cpu(), lse.cpu(), *_ref(q, kv, idx, tl, sink))


# ------------------------------------------------------------------------------------------
# The op: fake, opcheck, the vLLM entry point
# ------------------------------------------------------------------------------------------

def opcheck_samples(device):
    """(case id, args) of dsv4_ampere::sparse_mla_prefill (also the SAMPLES entry the lead
    adds to tests/test_opcheck.py)."""
    cases = []
    for T, H, with_len, with_sink in ((3, 8, True, True), (2, 24, False, False), (0, 8, True, True)):
        q, kv, idx, tl = make_case(max(T, 1), H, 30, dtype=torch.bfloat16, seed=T + H)
        q, idx, tl = q[:T], idx[:T], tl[:T]
        args = (q, kv, idx, tl if with_len else None, make_sink("mixed", H) if with_sink else None, SM_SCALE,
                torch.zeros(T, H, D, dtype=torch.bfloat16))
        cases.append((f"T{T}-H{H}", tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)))
    return cases


def test_opcheck_cpu():
    op = torch.ops.dsv4_ampere.sparse_mla_prefill.default
    for case_id, args in opcheck_samples("cpu"):
        torch.library.opcheck(op, args)


def test_fake_allocates_what_the_op_returns():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, kv, idx, tl = make_case(5, 8, 30, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (q, kv, idx, tl)]
        out = mode.from_tensor(torch.empty(5, 8, D, dtype=torch.bfloat16))
        lse = torch.ops.dsv4_ampere.sparse_mla_prefill(*args, None, SM_SCALE, out)
    assert lse.shape == (5, 8) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_vllm_entry_point_calls_the_op(monkeypatch):
    """flash_mla_sparse_fwd_ampere routes through dsv4_ampere::sparse_mla_prefill, with and
    without out, and its results match the reference."""
    from dsv4_ops.vllm import attention as va

    calls = []
    real = torch.ops.dsv4_ampere.sparse_mla_prefill

    class Spy:
        def __call__(self, *a):
            calls.append(a)
            return real(*a)

    ns = type("NS", (), {"sparse_mla_prefill": Spy()})()
    monkeypatch.setattr(va.torch.ops, "dsv4_ampere", ns, raising=False)
    T, H, K = 4, 8, 33
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.bfloat16, seed=31)
    sink = make_sink("finite", H)
    want = _ref(q, kv, idx, tl, sink)
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16))
    res = va.flash_mla_sparse_fwd_ampere(q, kv[:, None], idx[:, None], SM_SCALE, attn_sink=sink, topk_length=tl,
                                         out=out)
    assert res[0] is out and res[1] is None
    assert_attention_close(out, res[2], *want)
    res = va.flash_mla_sparse_fwd_ampere(q, kv[:, None], idx[:, None], SM_SCALE, attn_sink=sink, topk_length=tl)
    assert_attention_close(res[0], res[2], *want)
    assert len(calls) == 2


# ------------------------------------------------------------------------------------------
# AOT
# ------------------------------------------------------------------------------------------

def test_aot_lists_every_dispatched_specialization_and_every_candidate():
    assert "dsv4_ops.sparse_prefill" in aot.SPEC_MODULES
    labels = {s.label for s in aot.all_specs() if s.op == "sparse_mla_prefill"}
    for bh, cands in pk.CANDIDATES.items():
        for i, cfg in enumerate(cands):
            combos = [("len", "sink")]
            if cfg is pk.PREFILL_CONFIG.get(bh):
                combos = [(a, b) for a in ("len", "nolen") for b in ("sink", "nosink")]
            for ln, sk in combos:
                want = (f"prefill[bh{bh},#{i},bn{cfg['BLOCK_N']},w{cfg['num_warps']},s{cfg['num_stages']}"
                        f"{',ia' if cfg.get('IDX_AHEAD') else ''}{',split' + str(cfg['SPLIT']) if cfg.get('SPLIT') else ''}"
                        f",{ln},{sk}]")
                assert want in labels, want


def test_aot_prefill_kernels_compile_for_sm80_and_sm86_without_spills(aot_results):
    results = [r for r in aot_results if r.op == "sparse_mla_prefill"]
    assert {r.arch for r in results} == set(aot.AMPERE_ARCHS)
    assert len(results) == 2 * len([s for s in aot.all_specs() if s.op == "sparse_mla_prefill"])
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.shared_bytes <= aot.SMEM_LIMIT[r.arch] and r.registers <= 255
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"


# ------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes against the float64 reference
# ------------------------------------------------------------------------------------------

def vllm_prefill_case(T, H, *, topk=512, window=128, ratio=4, seed=0, device="cuda"):
    """One request's prefill as vLLM 0.33.0 builds it: a workspace of N = T // ratio
    compressed rows then the T window rows (gathered once per request, not per query),
    indices [T, 640]: the query's top-k compressed rows (causal: those with position <=
    the query's, all of them while fewer than topk), then its window rows, -1 padding;
    topk_length = the valid count."""
    g = rng(seed)
    N = T // ratio
    kv = torch.randn(N + T, D, generator=g).to(torch.bfloat16)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    width = -(-(topk + window) // 128) * 128
    idx = torch.full((T, width), -1, dtype=torch.int32)
    lens = torch.empty(T, dtype=torch.int32)
    for t in range(T):
        visible = (t + 1) // ratio
        n_top = min(topk, visible)
        top = torch.randperm(visible, generator=g)[:n_top] if visible else torch.empty(0, dtype=torch.int64)
        w_lo = max(0, t - window + 1)
        win = torch.arange(w_lo, t + 1) + N
        row = torch.cat([top, win]).to(torch.int32)
        idx[t, :row.numel()] = row
        lens[t] = row.numel()
    return q.to(device), kv.to(device), idx.to(device), lens.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("H", [8, 64, 128], ids=lambda h: f"H{h}")
def test_gpu_every_config_matches_reference(monkeypatch, config, H):
    """Portable only: the kernel holds no fp8, both variants launch the same code."""
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    T, K = 192, 640
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=H + config[1], N=4096)
    cases = [("mixed", tl)]
    if pk.CANDIDATES[config[0]][config[1]] is pk.PREFILL_CONFIG.get(config[0]):
        cases.append((None, None))  # the other specialization the launcher picks (one compile each)
    for sink_kind, lens in cases:
        sink = make_sink(sink_kind, H, "cuda")
        out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda"))
        o, lse = sp.sparse_mla_prefill(q, kv, idx, lens, sink, SM_SCALE, out=out, config=config)
        assert_attention_close(out, lse, *_ref(q, kv, idx, lens, sink))
        _check_empty_rows(out, lse, sink, idx, lens, kv.shape[0])


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 64, 128], ids=lambda h: f"H{h}")
def test_gpu_vllm_prefill_layout_through_the_entry_point(variant, H):
    """flash_mla_sparse_fwd_ampere on vLLM's real index layout launches the prefill kernel
    (T x G fills the SMs) and matches the reference."""
    from dsv4_ops.vllm import attention as va

    T = 640  # >= 4 waves of programs at H = 8 on 132 SMs
    q, kv, idx, tl = vllm_prefill_case(T, H, seed=H)
    sink = make_sink("finite", H, "cuda")
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda"))
    before = sum(sp._kernel.stats.values())
    res = va.flash_mla_sparse_fwd_ampere(q, kv[:, None], idx[:, None], SM_SCALE, attn_sink=sink, topk_length=tl,
                                         out=out)
    assert sum(sp._kernel.stats.values()) == before + 1
    assert_attention_close(out, res[2], *_ref(q, kv, idx, tl, sink))


@pytest.mark.gpu
def test_gpu_small_t_takes_the_decode_path_and_matches(variant):
    T, H, K = 4, 64, 640
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=41)
    sink = make_sink("finite", H, "cuda")
    before = sum(sp._kernel.stats.values())
    out, lse = sp.sparse_mla_prefill(q, kv, idx, tl, sink, SM_SCALE)
    assert sum(sp._kernel.stats.values()) == before
    assert_attention_close(out, lse, *_ref(q, kv, idx, tl, sink))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 64], ids=lambda h: f"H{h}")
def test_gpu_cuda_graph_replay_on_new_inputs(variant, H):
    T, K = 640, 640  # the prefill kernel at both H (>= 4 waves on 132 SMs)
    static = list(make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=51, N=2048))
    static.append(make_sink("finite", H, "cuda"))
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")

    def step():
        return sp.sparse_mla_prefill(*static[:4], static[4], SM_SCALE, out=out)[1]

    g, g_lse = capture_graph(step)
    new = list(make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=52, N=2048))
    new.append(make_sink("mixed", H, "cuda"))
    for dst, src in zip(static, new):
        dst.copy_(src)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    e_out, e_lse = sp.sparse_mla_prefill(*new[:4], new[4], SM_SCALE)
    assert torch.equal(out, e_out) and torch.equal(g_lse, e_lse)
    assert_attention_close(out, g_lse, *_ref(*new[:4], new[4]))


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph(variant):
    T, H, K = 320, 64, 640  # 640 programs: the prefill kernel
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.bfloat16, device="cuda", seed=61, N=2048)
    sink = make_sink("finite", H, "cuda")

    def f(q, kv, idx, tl, sink):
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        lse = torch.ops.dsv4_ampere.sparse_mla_prefill(q * 1.0, kv, idx, tl, sink, SM_SCALE, out)
        return out, lse

    c_out, c_lse = torch.compile(f, fullgraph=True)(q, kv, idx, tl, sink)
    e_out, e_lse = f(q, kv, idx, tl, sink)
    assert torch.equal(c_out, e_out) and torch.equal(c_lse, e_lse)
    assert_attention_close(c_out, c_lse, *_ref(q, kv, idx, tl, sink))


@pytest.mark.gpu
def test_gpu_opcheck():
    op = torch.ops.dsv4_ampere.sparse_mla_prefill.default
    for case_id, args in opcheck_samples("cuda"):
        torch.library.opcheck(op, args)
