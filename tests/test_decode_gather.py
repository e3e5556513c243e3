"""The workspace decode step: the one-launch decode gather (both caches + the index build),
the out= ops (merge_splits_out, sparse_mla_decode_out), the composite's out= / swa_length.

CPU: the new kernel and the merge/split with out= under the Triton interpreter at small
shapes (fp16 for tl.dot), references, opcheck, fakes. GPU: both variants, CUDA graphs,
torch.compile(fullgraph=True), the fast launch path against the normal one.
"""

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import _launch, attention, dsv4_decode, envs, reference
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import assert_attention_close, capture_graph, poison_like, rng, short_id

D = 512
SM_SCALE = D ** -0.5
ops = torch.ops.dsv4_ampere


def make_cache(block_size, nblk, seed, device="cpu", extra=8):
    cache = torch.zeros(nblk, min_page_bytes(block_size) + extra, dtype=torch.uint8)
    rows = torch.randn(nblk * block_size, D, generator=rng(seed)).to(torch.bfloat16)
    reference.ref_kv_cache_insert(rows, cache, torch.arange(nblk * block_size), block_size)
    return cache.to(device)


def gather_case(T, K1, K2, slot_dtype, seed=0, bs_c=4, nb_c=5, bs_w=8, nb_w=2, device="cpu"):
    g = rng(seed)
    cc, cw = make_cache(bs_c, nb_c, seed, device), make_cache(bs_w, nb_w, seed + 1, device)
    cap_c, cap_w = bs_c * nb_c, bs_w * nb_w
    # slots in [-3, cap + 3]: negative, valid, past the end; 2**31 - 1 as well when there is room
    topk = torch.randint(-3, cap_c + 4, (T, K1), generator=g)
    swa = torch.randint(-3, cap_w + 4, (T, K2), generator=g)
    if K1:
        topk[0, 0] = 2 ** 31 - 1
    tl = torch.randint(0, K1 + 2, (T,), generator=g)
    sl = torch.randint(0, K2 + 2, (T,), generator=g).to(torch.int32)
    return (cc, topk.to(slot_dtype).to(device), tl.to(device), bs_c, cw, swa.to(slot_dtype).to(device),
            sl.to(device), bs_w)


LENS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("lens", LENS, ids=lambda x: f"tl{int(x[0])}-sl{int(x[1])}")
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
@pytest.mark.parametrize("T,K1,K2", [(3, 20, 8), (2, 0, 9), (2, 7, 0), (1, 17, 5)],
                         ids=["T3-K20-W8", "swa-only", "no-window", "T1-K17-W5"])
def test_decode_gather_kernel_matches_reference(interpret, T, K1, K2, slot_dtype, lens):
    cc, topk, tl, bs_c, cw, swa, sl, bs_w = gather_case(T, K1, K2, slot_dtype, seed=T + K1 + K2, device=interpret)
    tl, sl = (tl if lens[0] else None), (sl if lens[1] else None)
    n = T * (K1 + K2)
    ws = poison_like(torch.empty(n + 3, D, dtype=torch.bfloat16, device=interpret))
    want_ws = poison_like(torch.empty(n + 3, D, dtype=torch.bfloat16))
    idx = attention.dsv4_decode_gather(cc, topk, tl, bs_c, cw, swa, sl, bs_w, ws)
    want_idx = reference.ref_dsv4_decode_gather(cc.cpu(), topk.cpu(), None if tl is None else tl.cpu(), bs_c,
                                                cw.cpu(), swa.cpu(), None if sl is None else sl.cpu(), bs_w,
                                                want_ws)
    assert idx.dtype == torch.int32 and idx.shape == (T, K1 + K2)
    assert torch.equal(idx.cpu(), want_idx)
    ws = ws.cpu()
    assert torch.equal(ws[:n].view(torch.int16), want_ws[:n].view(torch.int16))  # bit-exact rows
    assert torch.isnan(ws[n:].float()).all(), "rows past T*(K1+K2) must not be written"


def test_decode_gather_reference_agrees_with_two_gathers_and_index_build():
    """The new op's reference against the old composite's pieces (independent formulation)."""
    cc, topk, tl, bs_c, cw, swa, sl, bs_w = gather_case(3, 12, 6, torch.int64, seed=5)
    T, K1, K2 = 3, 12, 6
    ws = torch.empty(T * (K1 + K2), D, dtype=torch.bfloat16)
    idx = reference.ref_dsv4_decode_gather(cc, topk, tl, bs_c, cw, swa, None, bs_w, ws)
    old = reference.ref_decode_indices(topk, tl, swa, cc.shape[0] * bs_c, cw.shape[0] * bs_w)
    assert torch.equal(idx, old)
    rows_c = reference.ref_kv_cache_gather(cc, topk, bs_c).reshape(-1, D)
    rows_w = reference.ref_kv_cache_gather(cw, swa, bs_w).reshape(-1, D)
    used = idx.reshape(-1) >= 0
    both = torch.cat([rows_c, rows_w])
    picked = idx.reshape(-1)[used].long()
    assert torch.equal(ws[picked], both[picked])


def test_decode_gather_strided_slots(interpret):
    """Slot rows with a stride (a column slice of a wider buffer), as vLLM's [:T] views."""
    cc, topk, tl, bs_c, cw, swa, sl, bs_w = gather_case(2, 9, 4, torch.int32, seed=9)
    wide_t = torch.full((2, 15), -1, dtype=torch.int32)
    wide_t[:, 3:12] = topk
    wide_s = torch.full((2, 7), -1, dtype=torch.int32)
    wide_s[:, 1:5] = swa
    dev = interpret
    ws = poison_like(torch.empty(26, D, dtype=torch.bfloat16, device=dev))
    idx = attention.dsv4_decode_gather(cc.to(dev), wide_t.to(dev)[:, 3:12], tl.to(dev), bs_c, cw.to(dev),
                                       wide_s.to(dev)[:, 1:5], sl.to(dev), bs_w, ws)
    want_ws = torch.empty(26, D, dtype=torch.bfloat16)
    want = reference.ref_dsv4_decode_gather(cc, topk, tl, bs_c, cw, swa, sl, bs_w, want_ws)
    assert torch.equal(idx.cpu(), want)
    assert torch.equal(ws.cpu().view(torch.int16), want_ws.view(torch.int16))


def test_decode_gather_opcheck_and_fake():
    args = list(gather_case(2, 6, 4, torch.int32, seed=3))
    ws = torch.zeros(20, D, dtype=torch.bfloat16)
    torch.library.opcheck(ops.dsv4_decode_gather.default, (*args, ws))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        idx = ops.dsv4_decode_gather(*fargs, mode.from_tensor(ws))
        assert idx.shape == (2, 10) and idx.dtype == torch.int32


@pytest.mark.parametrize("bad,match", [
    ("small_ws", "workspace"), ("float_slots", "topk_slots"), ("short_len", "swa_length"),
    ("rows", "swa_slots"), ("cache_dtype", "cache")])
def test_decode_gather_bad_arguments_raise(bad, match):
    cc, topk, tl, bs_c, cw, swa, sl, bs_w = gather_case(2, 6, 4, torch.int32, seed=4)
    ws = torch.zeros(20, D, dtype=torch.bfloat16)
    if bad == "small_ws":
        ws = ws[:19]
    elif bad == "float_slots":
        topk = topk.float()
    elif bad == "short_len":
        sl = sl[:1]
    elif bad == "rows":
        swa = swa[:1]
    elif bad == "cache_dtype":
        cw = cw.to(torch.int8)
    with pytest.raises(ValueError, match=match):
        attention.dsv4_decode_gather(cc, topk, tl, bs_c, cw, swa, sl, bs_w, ws)
    with pytest.raises(ValueError, match=match):
        ops.dsv4_decode_gather(cc, topk, tl, bs_c, cw, swa, sl, bs_w, ws)


# ---- out= forms ----------------------------------------------------------------------------


def test_merge_splits_out_writes_a_strided_slice(interpret):
    T, H, S = 3, 5, 4
    g = rng(11)
    o_part = torch.randn(T, H, S, D, generator=g)
    lse_part = 2 * torch.randn(T, H, S, generator=g)
    lse_part[1, 2] = float("-inf")
    o_part[1, 2] = 0
    sink = torch.randn(H, generator=g)
    dev = interpret
    buf = poison_like(torch.empty(T, H + 2, D, dtype=torch.bfloat16, device=dev))
    out, lse = attention.merge_splits(o_part.to(dev), lse_part.to(dev), sink.to(dev), out=buf[:, 1:H + 1])
    want_out, want_lse = reference.ref_merge_splits(o_part, lse_part, sink, out_dtype=torch.float64)
    assert out.data_ptr() == buf[:, 1:].data_ptr()
    buf = buf.cpu()
    torch.testing.assert_close(buf[:, 1:H + 1].double(), want_out, atol=1e-6, rtol=2 ** -7)
    assert torch.isnan(buf[:, 0].float()).all() and torch.isnan(buf[:, H + 1].float()).all()
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.cpu()[fin], want_lse[fin], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("T,H,K", [(2, 8, 40), (1, 3, 16)], ids=["T2-H8-K40", "T1-H3-K16"])
def test_sparse_mla_decode_out_fp16(interpret, T, H, K):
    g = rng(T * 100 + K)
    N = 50
    q = torch.randn(T, H, D, generator=g).half()
    kv = torch.randn(N, D, generator=g).half()
    idx = torch.randint(-2, N + 3, (T, K), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    dev = interpret
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=dev))
    o2, lse = attention.sparse_mla_decode(q.to(dev), kv.to(dev), idx.to(dev), None, sink.to(dev), SM_SCALE, 0,
                                          out=out)
    assert o2 is out
    want_out, want_lse = reference.ref_sparse_mla_decode(q, kv, idx, None, sink, SM_SCALE, out_dtype=torch.float64)
    assert_attention_close(out.cpu(), lse.cpu(), want_out, want_lse)


def test_out_ops_opcheck_and_bad_out():
    g = rng(2)
    T, H, S = 2, 4, 3
    o_part, lse_part, sink = torch.randn(T, H, S, D, generator=g), torch.randn(T, H, S, generator=g), \
        torch.randn(H, generator=g)
    out = torch.zeros(T, H, D, dtype=torch.bfloat16)
    torch.library.opcheck(ops.merge_splits_out.default, (o_part, lse_part, sink, out))
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(30, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, 30, (T, 20), generator=g, dtype=torch.int32)
    torch.library.opcheck(ops.sparse_mla_decode_out.default, (q, kv, idx, None, sink, SM_SCALE, 0, out))
    lse = ops.sparse_mla_decode_out(q, kv, idx, None, sink, SM_SCALE, 0, out)
    want_out, want_lse = ops.sparse_mla_decode(q, kv, idx, None, sink, SM_SCALE, 0)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="out"):
        ops.sparse_mla_decode_out(q, kv, idx, None, sink, SM_SCALE, 0, out[:, :3])
    with pytest.raises(ValueError, match="out"):
        ops.merge_splits_out(o_part, lse_part, sink, out.float())


def composite_args(T=3, H=4, K1=10, K2=6, seed=0, device="cpu"):
    cc, topk, tl, bs_c, cw, swa, sl, bs_w = gather_case(T, K1, K2, torch.int32, seed=seed, device=device)
    g = rng(seed + 7)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device)
    sink = torch.randn(H, generator=g).to(device)
    return dict(q=q, compressed_cache=cc, topk_slots=topk, swa_cache=cw, swa_slots=swa, sink=sink,
                sm_scale=SM_SCALE, compressed_block_size=bs_c, swa_block_size=bs_w, topk_length=tl), sl


def test_composite_out_and_swa_length_on_cpu():
    args, sl = composite_args()
    masked = dict(args)
    j = torch.arange(args["swa_slots"].shape[1])
    masked["swa_slots"] = torch.where(j[None, :] < sl[:, None], args["swa_slots"], -1)
    want_out, want_lse = dsv4_decode.dsv4_decode_attention(**masked)
    out = poison_like(torch.empty_like(args["q"]))
    got_out, got_lse = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl, out=out)
    assert got_out is out
    assert torch.equal(out, want_out) and torch.equal(got_lse, want_lse)
    # lengths longer than T (a vLLM buffer): only the first T values are read
    long_sl = torch.cat([sl, torch.zeros(5, dtype=sl.dtype)])
    o3, l3 = dsv4_decode.dsv4_decode_attention(**args, swa_length=long_sl)
    assert torch.equal(o3, want_out) and torch.equal(l3, want_lse)


# ---- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_gpu_decode_gather_matches_reference(variant, slot_dtype):
    T, K1, K2 = 5, 512, 128
    cc, topk, tl, bs_c, cw, swa, sl, bs_w = gather_case(T, K1, K2, slot_dtype, seed=1, bs_c=64, nb_c=16, bs_w=64,
                                                        nb_w=8, device="cuda")
    ws = poison_like(torch.empty(T * (K1 + K2) + 5, D, dtype=torch.bfloat16, device="cuda"))
    idx = ops.dsv4_decode_gather(cc, topk, tl, bs_c, cw, swa, sl, bs_w, ws)
    want_ws = torch.empty(T * (K1 + K2), D, dtype=torch.bfloat16)
    want = reference.ref_dsv4_decode_gather(cc.cpu(), topk.cpu(), tl.cpu(), bs_c, cw.cpu(), swa.cpu(), sl.cpu(), bs_w,
                                            want_ws)
    assert torch.equal(idx.cpu(), want)
    assert torch.equal(ws[:T * (K1 + K2)].cpu().view(torch.int16), want_ws.view(torch.int16))
    assert torch.isnan(ws[T * (K1 + K2):].float()).all()


def gpu_composite_args(T, H, seed):
    """The composite's inputs at the DSv4 decode shape (K1 = 512, K2 = 128, block size 64)."""
    args, _ = composite_args(T=T, H=H, K1=512, K2=128, seed=seed)
    cc = make_cache(64, 16, seed)
    cw = make_cache(64, 8, seed + 1)
    g = rng(seed + 3)
    args.update(compressed_cache=cc.cuda(), swa_cache=cw.cuda(), compressed_block_size=64, swa_block_size=64,
                topk_slots=torch.randint(-1, 16 * 64 + 2, (T, 512), generator=g, dtype=torch.int32).cuda(),
                swa_slots=torch.randint(-1, 8 * 64 + 2, (T, 128), generator=g, dtype=torch.int32).cuda(),
                topk_length=torch.randint(0, 520, (T,), generator=g, dtype=torch.int32).cuda())
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "tiles"])  # auto: one paged op at (3, 64); tiles: gather + tiles + merge
@pytest.mark.parametrize("T,H", [(1, 8), (3, 64)])
def test_gpu_fast_launch_equals_normal_launch(variant, T, H, mode, monkeypatch):
    args = gpu_composite_args(T, H, seed=T + H)
    with envs.override(**{envs.DECODE_KERNEL: mode}):
        dsv4_decode.dsv4_decode_attention(**args)  # compiles / fills the launcher cache
        before = {id(k): dict(k.stats) for k in _launch._REGISTRY.values()}
        fast_out, fast_lse = dsv4_decode.dsv4_decode_attention(**args)
        fast = sum(k.stats["fast"] - before.get(id(k), {}).get("fast", 0) for k in _launch._REGISTRY.values())
        slow = sum(k.stats["slow"] - before.get(id(k), {}).get("slow", 0) for k in _launch._REGISTRY.values())
        assert fast >= 1 and slow == 0, f"the second step should launch every kernel through the cached launchers ({fast} fast, {slow} slow)"
        if mode == "tiles":
            assert fast >= 3, "the workspace step launches gather, tiles and merge"
        monkeypatch.setattr(_launch, "ENABLED", False)
        slow_out, slow_lse = dsv4_decode.dsv4_decode_attention(**args)
    assert torch.equal(fast_out, slow_out) and torch.equal(fast_lse, slow_lse)


@pytest.mark.gpu
def test_gpu_composite_out_swa_length_graph_replay(variant):
    T, H = 2, 16
    args = gpu_composite_args(T, H, seed=4)
    new = gpu_composite_args(T, H, seed=5)
    sl = torch.tensor([100, 7], dtype=torch.int32, device="cuda")
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(T * 640, D, dtype=torch.bfloat16, device="cuda")

    def step():
        return dsv4_decode.dsv4_decode_attention(**static, workspace=ws, swa_length=sl, out=out)[1]

    g, g_lse = capture_graph(step)
    for k, v in new.items():
        if isinstance(v, torch.Tensor):
            static[k].copy_(v)
    g.replay()
    torch.cuda.synchronize()
    e_out, e_lse = dsv4_decode.dsv4_decode_attention(**new, swa_length=sl)
    assert torch.equal(out, e_out) and torch.equal(g_lse, e_lse)


@pytest.mark.gpu
def test_gpu_out_ops_torch_compile_fullgraph(variant):
    args = gpu_composite_args(3, 16, seed=6)
    keys = ("q", "compressed_cache", "topk_slots", "swa_cache", "swa_slots", "sink", "topk_length")

    def f(q, compressed_cache, topk_slots, swa_cache, swa_slots, sink, topk_length):
        out = torch.empty_like(q)
        _, lse = dsv4_decode.dsv4_decode_attention(q, compressed_cache, topk_slots, swa_cache, swa_slots, sink,
                                                   SM_SCALE, 64, 64, topk_length=topk_length, out=out)
        return out.float() * 2, lse

    inputs = [args[k] for k in keys]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(*inputs)
    want = f(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
