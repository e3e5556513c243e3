"""Split-KV sparse MLA decode and the LSE merge with sink (ops sparse_mla_split, merge_splits,
sparse_mla_decode): references vs independent float64 formulations, the kernels under the
interpreter where it is faithful (merge: fp32 only; split: fp16 operands), argument errors,
the AOT specializations, and on the GPU both variants against the float64 reference (whole-
tensor, per-row and LSE checks, ``dsv4_ops.testing.assert_attention_close``), CUDA graphs and
torch.compile. opcheck for every op is in test_opcheck.py."""

import pytest
import torch

from dsv4_ops import aot, attention, dispatch, reference
from dsv4_ops.testing import (ATTN_LSE_ATOL as LSE_ATOL, ATTN_OUT_RTOL as OUT_RTOL, assert_attention_close,
                              capture_graph, rng, short_id)

D = 512
SM_SCALE = D ** -0.5


def make_case(T, H, K, N=None, *, device="cpu", dtype=torch.bfloat16, seed=0, invalid=True,
              topk=True, empty_row=True, idx_dtype=torch.int32):
    """Random q, kv, indices (with -1 and >= N entries), topk_length shorter than K, and one
    token with no valid key."""
    g = rng(seed)
    N = N or max(2 * K, 64)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g).to(dtype)
    idx = torch.randint(0, N, (T, K), generator=g)
    if invalid:
        bad = torch.rand(T, K, generator=g)
        idx = torch.where(bad < 0.1, torch.full_like(idx, -1), idx)
        idx = torch.where((bad >= 0.1) & (bad < 0.15), idx + N, idx)  # >= N
    topk_length = None
    if topk:
        topk_length = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
        topk_length[0] = K
    if empty_row and T > 1:
        idx[T - 1] = -1
    return (q.to(device), kv.to(device), idx.to(idx_dtype).to(device),
            None if topk_length is None else topk_length.to(device))


def make_sink(kind, H, device="cpu", seed=1):
    g = rng(seed)
    if kind is None:
        return None
    if kind == "finite":
        return torch.randn(H, generator=g).to(device)
    if kind == "-inf":
        return torch.full((H,), float("-inf"), device=device)
    if kind == "large":
        return (30.0 + torch.randn(H, generator=g)).to(device)
    if kind == "mixed":  # padded heads carry -inf
        s = torch.randn(H, generator=g)
        s[::2] = float("-inf")
        return s.to(device)
    raise ValueError(kind)


def sink_as_logit(q, kv, indices, topk_length, sink, sm_scale):
    """Independent float64 formulation: the sink is one more logit, with a zero value row."""
    T, H, _ = q.shape
    N = kv.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        keys = [int(i) for j, i in enumerate(indices[t].tolist())
                if 0 <= i < N and (topk_length is None or j < int(topk_length[t]))]
        k = kv[keys].double() if keys else torch.zeros(0, D, dtype=torch.float64)
        s = sm_scale * (q[t].double() @ k.T)  # [H, n]
        sk = (torch.full((H, 1), float("-inf"), dtype=torch.float64) if sink is None
              else sink.double()[:, None])
        logits = torch.cat([s, sk], dim=1)  # [H, n + 1]
        if logits.shape[1] == 0:
            continue
        lse_t = torch.logsumexp(logits, dim=1)  # -inf when every logit is -inf
        ok = torch.isfinite(lse_t)
        p = torch.where(ok[:, None], torch.exp(logits - torch.where(ok, lse_t, 0.0)[:, None]), 0.0)
        out[t] = p[:, :-1] @ k
        lse[t] = lse_t
    return out, lse


def check_close(out, lse, ref_out, ref_lse):
    """out [T, H, D] vs float64: whole-tensor relative Frobenius <= OUT_RTOL, every (token,
    head) row's max abs error within ATTN_ROW_RTOL of the row's max, and the LSE separately."""
    assert_attention_close(out, lse, ref_out, ref_lse)


SINKS = [None, "finite", "-inf", "large", "mixed"]


def thk_ids(cases):
    return [f"T{T}-H{H}-K{K}" for T, H, K in cases]


# ------------------------------------------------------------------------------------------
# CPU: references against independent formulations
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sink_kind", SINKS, ids=short_id)
@pytest.mark.parametrize("T,H,K", [(1, 1, 16), (3, 8, 100), (4, 16, 37)], ids=thk_ids([(1, 1, 16), (3, 8, 100), (4, 16, 37)]))
def test_reference_matches_sink_as_extra_logit(T, H, K, sink_kind):
    q, kv, idx, tl = make_case(T, H, K, seed=T * 100 + K)
    sink = make_sink(sink_kind, H)
    out, lse = reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, out_dtype=torch.float64)
    want_out, want_lse = sink_as_logit(q, kv, idx, tl, sink, SM_SCALE)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-9)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-5, rtol=1e-6)
    if T > 1:  # the token with no valid key: out 0, lse = sink
        assert torch.all(out[T - 1] == 0)
        want = torch.full((H,), float("-inf")) if sink is None else sink
        assert torch.equal(lse[T - 1], want.float())


@pytest.mark.parametrize("sink_kind", ["finite", "large", "mixed"])
def test_sink_is_the_factor_one_over_one_plus_exp(sink_kind):
    """out_sink = out_plain / (1 + exp(sink - lse_plain)), lse_sink = logaddexp(lse_plain, sink)."""
    T, H, K = 4, 8, 64
    q, kv, idx, tl = make_case(T, H, K, seed=7)
    sink = make_sink(sink_kind, H)
    out0, lse0 = reference.ref_sparse_mla_decode(q, kv, idx, tl, None, SM_SCALE, out_dtype=torch.float64)
    out1, lse1 = reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, out_dtype=torch.float64)
    l0 = lse0.double()
    factor = torch.where(torch.isfinite(l0), 1.0 / (1.0 + torch.exp(sink.double()[None, :] - l0)), 0.0)
    # lse comes back in float32: its rounding bounds the agreement
    torch.testing.assert_close(out1, out0 * factor[..., None], atol=1e-7, rtol=1e-5)
    want_lse = torch.logaddexp(l0, sink.double()[None, :])
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse1.double()[fin], want_lse[fin], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("sink_kind", [None, "finite", "-inf"], ids=short_id)
@pytest.mark.parametrize("S", [1, 2, 3, 7, 16], ids=lambda s: f"S{s}")
def test_reference_split_then_merge_equals_unsplit(S, sink_kind):
    T, H, K = 3, 4, 100  # 7 key blocks: S = 16 leaves empty splits
    q, kv, idx, tl = make_case(T, H, K, seed=S)
    sink = make_sink(sink_kind, H)
    o_part, lse_part = reference.ref_sparse_mla_split(q, kv, idx, tl, SM_SCALE, S)
    assert o_part.shape == (T, H, S, D) and lse_part.shape == (T, H, S)
    assert o_part.dtype == lse_part.dtype == torch.float32
    empty = torch.isinf(lse_part)
    assert torch.all(o_part[empty] == 0)
    out, lse = reference.ref_merge_splits(o_part, lse_part, sink, out_dtype=torch.float64)
    want_out, want_lse = reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, out_dtype=torch.float64)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin], want_lse[fin], atol=1e-5, rtol=1e-6)


def test_split_bounds_partition_every_block_once():
    idx = torch.zeros(4, 200, dtype=torch.int32)
    tl = torch.tensor([200, 17, 0, 5000], dtype=torch.int32)
    for S in (1, 3, 13, 64):
        lo, hi = reference.ref_split_bounds(idx, tl, S)
        assert torch.all(lo[:, 0] == 0) and torch.all(hi[:, :-1] == lo[:, 1:])
        k_len = tl.clamp(max=200).to(torch.int64)
        assert torch.all(hi[:, -1] == (k_len + 15) // 16 * 16)
        sizes = hi - lo
        nb = (k_len + 15) // 16
        assert torch.all((sizes.max(1).values - sizes.min(1).values <= 16) | (nb == 0))


# ------------------------------------------------------------------------------------------
# CPU: kernels under the Triton interpreter (faithful for fp32 and fp16 tl.dot)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sink_kind", [None, "finite", "-inf", "large"], ids=short_id)
@pytest.mark.parametrize("S", [1, 5, 40, 64], ids=lambda s: f"S{s}")
def test_merge_kernel_matches_reference(interpret, S, sink_kind):
    T, H = 3, 5
    g = rng(S)
    o_part = torch.randn(T, H, S, D, generator=g)
    lse_part = 3 * torch.randn(T, H, S, generator=g)
    lse_part[0, 0, : S // 2 + 1] = float("-inf")  # empty splits
    o_part[0, 0, : S // 2 + 1] = 0.0
    lse_part[1, 2] = float("-inf")  # a (token, head) with no valid key at all
    o_part[1, 2] = 0.0
    sink = make_sink(sink_kind, H)
    dev = interpret
    out, lse = attention.merge_splits(o_part.to(dev), lse_part.to(dev), None if sink is None else sink.to(dev))
    want_out, want_lse = reference.ref_merge_splits(o_part, lse_part, sink, out_dtype=torch.float64)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == (T, H, D) and lse.shape == (T, H)
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # the interpreter truncates fp32 -> bf16: allow one bf16 ulp
    torch.testing.assert_close(out.double(), want_out, atol=1e-6, rtol=2 ** -7)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin], want_lse[fin], atol=1e-5, rtol=1e-6)
    assert torch.all(out[1, 2] == 0)
    want_empty = float("-inf") if sink is None else sink[2].item()
    assert lse[1, 2].item() == want_empty


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=short_id)
@pytest.mark.parametrize("T,H,K,S", [(2, 8, 100, 3), (3, 1, 16, 1), (2, 20, 40, 5)],
                         ids=["T2-H8-K100-S3", "T3-H1-K16-S1", "T2-H20-K40-S5"])
def test_split_kernel_fp16_matches_reference(interpret, T, H, K, S, idx_dtype):
    """The split kernel's masks, partition and online softmax, with fp16 operands (the
    interpreter's bf16 tl.dot is wrong); S = 5 over 3 key blocks leaves empty splits."""
    q, kv, idx, tl = make_case(T, H, K, dtype=torch.float16, seed=K + S, idx_dtype=idx_dtype)
    dev = interpret
    o_part, lse_part = attention.sparse_mla_split(q.to(dev), kv.to(dev), idx.to(dev), tl.to(dev), SM_SCALE, S)
    want_o, want_lse = reference.ref_sparse_mla_split(q, kv, idx, tl, SM_SCALE, S)
    o_part, lse_part = o_part.cpu(), lse_part.cpu()
    # rows (token, head, split): whole-tensor 2e-3, every row within ATTN_ROW_RTOL, lse 1e-3
    assert_attention_close(o_part, lse_part, want_o, want_lse, rtol=2e-3, what="o_part")
    assert torch.all(o_part[~torch.isfinite(want_lse)] == 0)


# ------------------------------------------------------------------------------------------
# CPU: ops (references on CPU tensors, fakes on meta), argument checks, AOT
# (opcheck of every op: test_opcheck.py)
# ------------------------------------------------------------------------------------------

def test_ops_on_cpu_run_the_references():
    q, kv, idx, tl = make_case(3, 8, 100, seed=3)
    sink = make_sink("finite", 8)
    out, lse = torch.ops.dsv4_ampere.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, 0)
    want_out, want_lse = reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    o_part, lse_part = torch.ops.dsv4_ampere.sparse_mla_split(q, kv, idx, tl, SM_SCALE, 4)
    out2, lse2 = torch.ops.dsv4_ampere.merge_splits(o_part, lse_part, sink)
    check_close(out2, lse2, want_out, want_lse)


def test_fakes_match_shapes_on_meta():
    q = torch.empty(3, 8, D, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(50, D, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(3, 640, dtype=torch.int32, device="meta")
    o_part, lse_part = torch.ops.dsv4_ampere.sparse_mla_split(q, kv, idx, None, SM_SCALE, 7)
    assert o_part.shape == (3, 8, 7, D) and lse_part.shape == (3, 8, 7)
    assert o_part.dtype == lse_part.dtype == torch.float32 and o_part.is_contiguous()
    out, lse = torch.ops.dsv4_ampere.merge_splits(o_part, lse_part, None)
    assert out.shape == (3, 8, D) and out.dtype == torch.bfloat16 and lse.shape == (3, 8)
    out, lse = torch.ops.dsv4_ampere.sparse_mla_decode(q, kv, idx, None, None, SM_SCALE, 0)
    assert out.shape == (3, 8, D) and lse.dtype == torch.float32


def test_compile_fullgraph_traces_the_ops_on_cpu():
    q, kv, idx, tl = make_case(2, 8, 40, seed=9)
    sink = make_sink("finite", 8)

    def f(q, kv, idx, tl, sink):
        o_part, lse_part = torch.ops.dsv4_ampere.sparse_mla_split(q, kv, idx, tl, SM_SCALE, 2)
        out, lse = torch.ops.dsv4_ampere.merge_splits(o_part, lse_part, sink)
        out2, lse2 = torch.ops.dsv4_ampere.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, 0)
        return out, lse, out2, lse2

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kv, idx, tl, sink)
    want = f(q, kv, idx, tl, sink)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_bad_arguments_raise_value_error():
    q, kv, idx, tl = make_case(2, 8, 40, seed=1)
    with pytest.raises(ValueError, match="q"):
        attention.sparse_mla_split(q.float(), kv, idx, tl, SM_SCALE, 1)
    with pytest.raises(ValueError, match="kv"):
        attention.sparse_mla_split(q, kv[:, :256], idx, tl, SM_SCALE, 1)
    with pytest.raises(ValueError, match="indices"):
        attention.sparse_mla_split(q, kv, idx.float(), tl, SM_SCALE, 1)
    with pytest.raises(ValueError, match="indices"):
        attention.sparse_mla_split(q, kv, idx[:1], tl, SM_SCALE, 1)
    with pytest.raises(ValueError, match="topk_length"):
        attention.sparse_mla_split(q, kv, idx, tl[:1], SM_SCALE, 1)
    for bad in (0, attention.MAX_SPLITS + 1, 2.0):
        with pytest.raises(ValueError, match="num_splits"):
            attention.sparse_mla_split(q, kv, idx, tl, SM_SCALE, bad)
    o_part = torch.zeros(2, 8, 3, D)
    with pytest.raises(ValueError, match="lse_part"):
        attention.merge_splits(o_part, torch.zeros(2, 8, 4), None)
    with pytest.raises(ValueError, match="sink"):
        attention.merge_splits(o_part, torch.zeros(2, 8, 3), torch.zeros(7))
    with pytest.raises(ValueError, match="o_part"):
        attention.merge_splits(o_part.half(), torch.zeros(2, 8, 3), None)


def test_device_mismatch_names_both_tensors():
    """The _checks helpers the launchers call: a tensor on the wrong device names the tensor
    the device came from as well (meta vs cpu stands in for cuda vs cpu on a CPU machine)."""
    from dsv4_ops._checks import check_same_device, check_tensor

    q, kv, idx, _ = make_case(2, 8, 40, seed=1)
    kv_meta = kv.to("meta")
    with pytest.raises(ValueError, match=r"q and kv are on different devices \(q: cpu, kv: meta\)"):
        check_tensor("kv", kv_meta, dtypes=(q.dtype,), ndim=2, device=q.device, device_of="q")
    with pytest.raises(ValueError, match=r"kv: on meta, but the other tensor arguments are on cpu"):
        check_tensor("kv", kv_meta, device=q.device)  # without device_of: still names kv and both devices
    with pytest.raises(ValueError, match=r"q and kv are on different devices"):
        check_same_device(q=q, topk_length=None, kv=kv_meta, indices=idx)
    with pytest.raises(ValueError, match=r"q and indices are on different devices"):
        check_same_device(q=q, kv=kv, indices=idx.to("meta"))
    check_same_device(q=q, kv=kv, indices=idx, sink=None)  # one device: no error


def test_sparse_mla_decode_with_q_and_kv_on_different_devices_says_so():
    """The issue's case (q on the CPU, kv on the GPU), with meta standing in for the GPU."""
    q, kv, idx, tl = make_case(2, 8, 40, seed=1)
    with pytest.raises(ValueError, match=r"q and kv are on different devices"):
        attention.sparse_mla_decode(q, kv.to("meta"), idx, tl, None, SM_SCALE)
    with pytest.raises(ValueError, match=r"q and indices are on different devices"):
        attention.sparse_mla_decode(q, kv, idx.to("meta"), tl, None, SM_SCALE)


def test_aot_covers_every_specialization_the_launchers_pick():
    specs = [s for s in aot.all_specs() if s.op in ("sparse_mla_split", "merge_splits", "dsv4_decode_indices")]
    labels = {s.label for s in specs}
    for variant in ("portable", "native"):
        for idx_ty in ("i32", "i64"):
            for has_len in ("len", "nolen"):
                assert f"split[{variant},{idx_ty},{has_len}]" in labels
        # every split count 1..MAX_SPLITS maps to a merge BLOCK_S that has a spec
        merge_blocks = {s.constexprs["BLOCK_S"] for s in specs if s.op == "merge_splits" and s.variant == variant}
        from dsv4_ops.csrc_triton.decode import merge as mk
        assert {mk.merge_config(n)["BLOCK_S"] for n in range(1, attention.MAX_SPLITS + 1)} <= merge_blocks


def test_aot_attention_kernels_compile_for_sm80_and_sm86(aot_results):
    ours = ("sparse_mla_split", "merge_splits", "dsv4_decode_indices")
    results = [r for r in aot_results if r.op in ours and r.variant == "portable"]
    assert {r.op for r in results} == set(ours)
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.shared_bytes <= aot.SMEM_LIMIT[r.arch]
        assert r.registers <= 255
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"


# ------------------------------------------------------------------------------------------
# GPU: both variants against the float64 reference
# ------------------------------------------------------------------------------------------

def _ref(q, kv, idx, tl, sink):
    return reference.ref_sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, out_dtype=torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [16, 100, 640, 2048], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("H", [1, 8, 16, 64, 128], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("T", [1, 3, 8, 64], ids=lambda t: f"T{t}")
def test_gpu_decode_matches_reference(variant, T, H, K):
    q, kv, idx, tl = make_case(T, H, K, device="cuda", seed=T * 7 + H * 3 + K)
    sink = make_sink("finite", H, "cuda")
    out, lse = attention.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    check_close(out, lse, *_ref(q, kv, idx, tl, sink))
    # no topk_length, no sink, num_splits = 1 (the unsplit kernel)
    out, lse = attention.sparse_mla_decode(q, kv, idx, None, None, SM_SCALE, num_splits=1)
    check_close(out, lse, *_ref(q, kv, idx, None, None))


@pytest.mark.gpu
@pytest.mark.parametrize("sink_kind", SINKS, ids=short_id)
@pytest.mark.parametrize("T,H,K", [(3, 8, 100), (8, 64, 640), (1, 128, 2048)],
                         ids=thk_ids([(3, 8, 100), (8, 64, 640), (1, 128, 2048)]))
def test_gpu_decode_sink_kinds(variant, T, H, K, sink_kind):
    q, kv, idx, tl = make_case(T, H, K, device="cuda", seed=K)
    sink = make_sink(sink_kind, H, "cuda")
    out, lse = attention.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE)
    check_close(out, lse, *_ref(q, kv, idx, tl, sink))
    if T > 1:  # the token with no valid key
        assert torch.all(out[T - 1] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K", [(1, 8, 640), (3, 16, 100), (2, 64, 2048), (1, 1, 16)],
                         ids=thk_ids([(1, 8, 640), (3, 16, 100), (2, 64, 2048), (1, 1, 16)]))
def test_gpu_every_num_splits(variant, T, H, K):
    q, kv, idx, tl = make_case(T, H, K, device="cuda", seed=11)
    sink = make_sink("finite", H, "cuda")
    want = _ref(q, kv, idx, tl, sink)
    for S in range(1, dispatch.workspace.tile_max_splits(K) + 1):
        out, lse = attention.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, num_splits=S)
        check_close(out, lse, *want)
    # the partials themselves, against the reference's partition
    for S in (1, 2, dispatch.workspace.tile_max_splits(K)):
        o_part, lse_part = attention.sparse_mla_split(q, kv, idx, tl, SM_SCALE, S)
        want_o, want_lse = reference.ref_sparse_mla_split(q, kv, idx, tl, SM_SCALE, S)
        assert_attention_close(o_part, lse_part, want_o, want_lse, what=f"o_part S={S}")
        assert torch.all(o_part[~torch.isfinite(want_lse)] == 0)


@pytest.mark.gpu
def test_gpu_int64_indices_and_strided_q(variant):
    T, H, K = 4, 16, 200
    q, kv, idx, tl = make_case(T, H, K, device="cuda", seed=2, idx_dtype=torch.int64)
    idx[0, :5] = 2 ** 33  # far out of range: masked, no wrap to a valid row
    q_big = torch.randn(T, 2 * H, D, generator=rng(3)).to(torch.bfloat16).cuda()
    q_big[:, ::2] = q
    sink = make_sink("finite", H, "cuda")
    out, lse = attention.sparse_mla_decode(q_big[:, ::2], kv, idx, tl.long(), sink, SM_SCALE)
    check_close(out, lse, *_ref(q, kv, idx, tl, sink))


@pytest.mark.gpu
def test_gpu_merge_of_all_empty_splits_gives_zero_and_the_sink(variant):
    T, H, S = 2, 8, 7
    o_part = torch.zeros(T, H, S, D, device="cuda")
    lse_part = torch.full((T, H, S), float("-inf"), device="cuda")
    for sink in (None, make_sink("finite", H, "cuda"), make_sink("-inf", H, "cuda")):
        out, lse = attention.merge_splits(o_part, lse_part, sink)
        assert torch.all(out == 0) and not torch.isnan(lse).any()
        want = torch.full((T, H), float("-inf"), device="cuda") if sink is None else sink[None].expand(T, H)
        assert torch.equal(lse, want)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_on_new_inputs(variant):
    T, H, K = 4, 64, 640
    q, kv, idx, tl = make_case(T, H, K, device="cuda", seed=21)
    sink = make_sink("finite", H, "cuda")
    static = [q.clone(), kv.clone(), idx.clone(), tl.clone(), sink.clone()]

    def step():
        return attention.sparse_mla_decode(*static[:4], static[4], SM_SCALE)

    g, (g_out, g_lse) = capture_graph(step)
    q2, kv2, idx2, tl2 = make_case(T, H, K, device="cuda", seed=22)
    sink2 = make_sink("large", H, "cuda")
    for dst, src in zip(static, (q2, kv2, idx2, tl2, sink2)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    e_out, e_lse = attention.sparse_mla_decode(q2, kv2, idx2, tl2, sink2, SM_SCALE)
    assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_equals_eager(variant):
    T, H, K = 3, 16, 640
    q, kv, idx, tl = make_case(T, H, K, device="cuda", seed=31)
    sink = make_sink("finite", H, "cuda")

    def f(q, kv, idx, tl, sink):
        o_part, lse_part = torch.ops.dsv4_ampere.sparse_mla_split(q, kv, idx, tl, SM_SCALE, 4)
        out, lse = torch.ops.dsv4_ampere.merge_splits(o_part, lse_part, sink)
        out2, lse2 = torch.ops.dsv4_ampere.sparse_mla_decode(q, kv, idx, tl, sink, SM_SCALE, 0)
        return out, lse, out2 * 2, lse2 + 1

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(q, kv, idx, tl, sink)
    want = f(q, kv, idx, tl, sink)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reference_partition_matches_the_kernels():
    """The reference's split partition uses the kernels' key-block size (defined twice today:
    csrc_triton.decode.tiles.PARTITION_N and reference.ATTN_PARTITION_N), and every split config
    iterates keys in blocks of that size."""
    from dsv4_ops.csrc_triton.decode import tiles

    assert tiles.PARTITION_N == reference.ATTN_PARTITION_N
    assert all(cfg["BLOCK_N"] == tiles.PARTITION_N for cfg in tiles.SPLIT_CONFIG.values())


def test_the_comparison_catches_one_bad_row_that_the_whole_tensor_norm_hides():
    """One (token, head) row 5% off in a [64, 16, 512] output passes the Frobenius check
    (5% / sqrt(1024 rows) ~ 0.16%) but fails the per-row one; a 2e-3 LSE shift fails the LSE."""
    g = rng(41)
    ref = torch.randn(64, 16, D, generator=g, dtype=torch.float64)
    ref_lse = torch.randn(64, 16, generator=g, dtype=torch.float64)
    bad = ref.clone()
    bad[37, 5] *= 1.05
    assert ((bad - ref).norm() / ref.norm()).item() <= OUT_RTOL
    with pytest.raises(AssertionError, match=r"row \[37, 5\]"):
        assert_attention_close(bad, ref_lse, ref, ref_lse)
    lse = ref_lse.clone()
    lse[2, 3] += 2 * LSE_ATOL
    with pytest.raises(AssertionError, match="lse"):
        assert_attention_close(ref, lse, ref, ref_lse)
    assert_attention_close(ref.bfloat16(), ref_lse.float(), ref, ref_lse)  # bf16 rounding passes
