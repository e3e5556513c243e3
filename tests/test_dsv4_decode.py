"""The DSv4 decode composite: the gathers into one workspace, the index build, split + merge.

CPU: the index build (reference and the kernel under the interpreter) against a Python loop,
and the composite through the ops' CPU implementations against an independent oracle: each
token's valid rows read with ``reference.ref_kv_cache_gather`` (never the op under test),
then float64 attention with the sink. GPU: both variants against that oracle, CUDA-graph
replay on new inputs, and torch.compile(fullgraph=True). opcheck: test_opcheck.py.
"""

import pytest
import torch

from dsv4_ops import attention, dispatch, dsv4_decode, reference
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import assert_attention_close, capture_graph, rng, short_id

D = 512
SM_SCALE = D ** -0.5


def loop_indices(topk_slots, topk_length, swa_slots, cap_c, cap_w):
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]
    out = torch.full((T, K1 + K2), -1, dtype=torch.int32)
    for t in range(T):
        for j in range(K1):
            s = int(topk_slots[t, j])
            if 0 <= s < cap_c and (topk_length is None or j < int(topk_length[t])):
                out[t, j] = t * K1 + j
        for j in range(K2):
            s = int(swa_slots[t, j])
            if 0 <= s < cap_w:
                out[t, K1 + j] = T * K1 + t * K2 + j
    return out


def make_slots(T, K1, K2, cap_c, cap_w, seed=0, dtype=torch.int32):
    g = rng(seed)
    topk = torch.randint(-3, cap_c + 3, (T, K1), generator=g).to(dtype)
    swa = torch.randint(-3, cap_w + 3, (T, K2), generator=g).to(dtype)
    topk_length = torch.randint(0, K1 + 1, (T,), generator=g, dtype=torch.int32)
    return topk, topk_length, swa


@pytest.mark.parametrize("with_len", [False, True], ids=["nolen", "len"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=short_id)
def test_index_build_reference_and_kernel(interpret, dtype, with_len):
    T, K1, K2, cap_c, cap_w = 3, 37, 11, 50, 20
    topk, tl, swa = make_slots(T, K1, K2, cap_c, cap_w, dtype=dtype)
    tl = tl if with_len else None
    want = loop_indices(topk, tl, swa, cap_c, cap_w)
    got = reference.ref_decode_indices(topk, tl, swa, cap_c, cap_w)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    dev = interpret
    got = attention.dsv4_decode_indices(topk.to(dev), None if tl is None else tl.to(dev), swa.to(dev), cap_c,
                                        cap_w)
    assert torch.equal(got.cpu(), want)


def build_caches(block_c, block_w, nblk_c, nblk_w, device="cpu", seed=0):
    """Two caches with a record at every slot, written by the reference packer."""
    g = rng(seed)
    caches = []
    for bs, nb in ((block_c, nblk_c), (block_w, nblk_w)):
        cache = torch.zeros(nb, min_page_bytes(bs), dtype=torch.uint8, device=device)
        rows = torch.randn(nb * bs, D, generator=g).to(torch.bfloat16).to(device)
        reference.ref_kv_cache_insert(rows, cache, torch.arange(nb * bs, device=device), bs)
        caches.append(cache)
    return caches


def composite_inputs(T=3, H=8, K1=40, K2=16, block_c=16, block_w=8, nblk_c=4, nblk_w=3, device="cpu", seed=0,
                     swa_length=False):
    cc, cw = build_caches(block_c, block_w, nblk_c, nblk_w, device, seed)
    topk, tl, swa = make_slots(T, K1, K2, nblk_c * block_c, nblk_w * block_w, seed=seed)
    g = rng(seed + 1)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    if T > 1:  # keep at least one token with keys
        topk[T - 1] = -1  # a token with no compressed key ...
        swa[T - 1] = -1  # ... and no window key
    args = dict(q=q.to(device), compressed_cache=cc, topk_slots=topk.to(device), swa_cache=cw,
                swa_slots=swa.to(device), sink=sink.to(device), sm_scale=SM_SCALE,
                compressed_block_size=block_c, swa_block_size=block_w, topk_length=tl.to(device))
    if swa_length:
        args["swa_length"] = torch.randint(0, K2 + 1, (T,), generator=g, dtype=torch.int32).to(device)
    return args


def independent(args):
    """Each token's valid rows, read with reference.ref_kv_cache_gather and packed densely
    (a layout unlike the composite's workspace), then float64 attention with the sink."""
    q, T = args["q"], args["q"].shape[0]
    cap_c = args["compressed_cache"].shape[0] * args["compressed_block_size"]
    cap_w = args["swa_cache"].shape[0] * args["swa_block_size"]
    topk, swa = args["topk_slots"].cpu().long(), args["swa_slots"].cpu().long()
    j1, j2 = torch.arange(topk.shape[1]), torch.arange(swa.shape[1])
    valid_c = (topk >= 0) & (topk < cap_c)
    if args.get("topk_length") is not None:
        valid_c &= j1[None, :] < args["topk_length"].cpu()[:T, None]
    valid_w = (swa >= 0) & (swa < cap_w)
    if args.get("swa_length") is not None:
        valid_w &= j2[None, :] < args["swa_length"].cpu()[:T, None]
    keys, idx = [], []
    for t in range(T):
        slots_c = topk[t][valid_c[t]].to(q.device)
        slots_w = swa[t][valid_w[t]].to(q.device)
        rows = torch.cat([reference.ref_kv_cache_gather(args["compressed_cache"], slots_c, args["compressed_block_size"]),
                          reference.ref_kv_cache_gather(args["swa_cache"], slots_w, args["swa_block_size"])])
        base = sum(k.shape[0] for k in keys)
        keys.append(rows)
        idx.append(list(range(base, base + rows.shape[0])))
    kv = torch.cat(keys)
    if kv.shape[0] == 0:
        kv = torch.zeros(1, D, dtype=torch.bfloat16, device=q.device)
    width = max(1, max(len(i) for i in idx))
    indices = torch.tensor([i + [-1] * (width - len(i)) for i in idx], device=q.device)
    return reference.ref_sparse_mla_decode(q, kv, indices, None, args["sink"], SM_SCALE, out_dtype=torch.float64)


def check(out, lse, want_out, want_lse):
    """Whole-tensor 5e-3 relative Frobenius, per-(token, head) row max error, LSE 1e-3."""
    assert_attention_close(out, lse, want_out, want_lse)


@pytest.fixture(params=["fused_gather", "two_gathers"])
def gather_path(request, monkeypatch):
    """Both gather paths of the composite's workspace step (mode tiles: auto runs the paged op):
    one launch (small T) and two gathers + indices."""
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")
    monkeypatch.setattr(dispatch.workspace, "FUSED_GATHER_MAX_ROWS", 1 << 30 if request.param == "fused_gather" else 0)
    return request.param


@pytest.mark.parametrize("swa_length", [False, True], ids=["no_swa_length", "swa_length"])
def test_composite_on_cpu_matches_independent_gather(swa_length, gather_path):
    args = composite_inputs(swa_length=swa_length)
    out, lse = dsv4_decode.dsv4_decode_attention(**args)
    assert out.shape == args["q"].shape and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    check(out, lse, *independent(args))
    T = args["q"].shape[0]
    assert torch.all(out[T - 1] == 0) and torch.equal(lse[T - 1], args["sink"])
    # a preallocated, larger workspace gives the same result
    ws = torch.full((T * 56 + 10, D), float("nan"), dtype=torch.bfloat16)
    out2, lse2 = dsv4_decode.dsv4_decode_attention(**args, workspace=ws)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_composite_bad_workspace_raises(monkeypatch):
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")  # the workspace step (auto runs the paged op)
    args = composite_inputs()
    with pytest.raises(ValueError, match="workspace"):
        dsv4_decode.dsv4_decode_attention(**args, workspace=torch.zeros(4, D, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 64), (3, 8), (8, 16)], ids=["T1-H64", "T3-H8", "T8-H16"])
def test_gpu_composite_matches_reference(variant, T, H, gather_path):
    args = composite_inputs(T=T, H=H, K1=512, K2=128, block_c=64, block_w=64, nblk_c=16, nblk_w=8,
                            device="cuda", seed=T, swa_length=True)
    out, lse = dsv4_decode.dsv4_decode_attention(**args)
    check(out, lse, *independent(args))


@pytest.mark.gpu
def test_gpu_composite_cuda_graph_replay_on_new_inputs(variant):
    T, H = 2, 64
    args = composite_inputs(T=T, H=H, K1=512, K2=128, block_c=64, block_w=64, nblk_c=16, nblk_w=8,
                            device="cuda", seed=1)
    new = composite_inputs(T=T, H=H, K1=512, K2=128, block_c=64, block_w=64, nblk_c=16, nblk_w=8,
                           device="cuda", seed=2)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    ws = torch.empty(T * 640, D, dtype=torch.bfloat16, device="cuda")

    def step():
        return dsv4_decode.dsv4_decode_attention(**static, workspace=ws)

    g, (g_out, g_lse) = capture_graph(step)
    for k, v in new.items():
        if isinstance(v, torch.Tensor):
            static[k].copy_(v)
    g.replay()
    torch.cuda.synchronize()
    e_out, e_lse = dsv4_decode.dsv4_decode_attention(**new)
    assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)


@pytest.mark.gpu
def test_gpu_composite_torch_compile_fullgraph(variant):
    args = composite_inputs(T=3, H=16, K1=512, K2=128, block_c=64, block_w=64, nblk_c=16, nblk_w=8,
                            device="cuda", seed=3)

    def f(q, compressed_cache, topk_slots, swa_cache, swa_slots, sink, topk_length):
        out, lse = dsv4_decode.dsv4_decode_attention(q, compressed_cache, topk_slots, swa_cache, swa_slots, sink,
                                                     SM_SCALE, 64, 64, topk_length=topk_length)
        return out.float() * 2, lse

    keys = ("q", "compressed_cache", "topk_slots", "swa_cache", "swa_slots", "sink", "topk_length")
    inputs = [args[k] for k in keys]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(*inputs)
    want = f(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
