"""The paged decode in 64-dim chunks (decode mode fused): op ``dsv4_decode_fused_out``, csrc_triton.decode.paged_chunk64.

One kernel reads the 584-byte records by slot (no workspace), builds the index semantics of
dsv4_decode_gather on the fly and attends with the sink (+ the merge when it splits).

CPU: the kernel under the Triton interpreter (fp16 q: the interpreter's bf16 tl.dot is
wrong; the decoded keys of these caches are exact in fp16) against the float64 reference,
outputs poisoned first; adversarial slots; the reference against the old composite; bad
arguments; the plan. GPU: both variants at the DSv4 shape, every split count class, CUDA
graph replay on new inputs == eager, torch.compile(fullgraph=True) through the composite.
"""

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import aot, attention, dispatch, dsv4_decode, paged_decode, reference
from dsv4_ops.csrc_triton.decode import paged_chunk64 as _pk
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import assert_attention_close, capture_graph, poison_like, rng, short_id

D = 512
SM_SCALE = D ** -0.5
ops = torch.ops.dsv4_ampere


def make_cache(block_size, nblk, seed, extra=8):
    """A paged cache of valid records (reference insert), pages padded by ``extra`` bytes."""
    cache = torch.zeros(nblk, min_page_bytes(block_size) + extra, dtype=torch.uint8)
    rows = (torch.randn(nblk * block_size, D, generator=rng(seed)) * 2).to(torch.bfloat16)
    reference.ref_kv_cache_insert(rows, cache, torch.arange(nblk * block_size), block_size)
    return cache


def case(T, H, K1, K2, slot_dtype=torch.int32, seed=0, bs_c=4, nb_c=6, bs_w=8, nb_w=2, lens=(True, True),
         q_dtype=torch.float16, device="cpu"):
    """Inputs of one fused decode call: slots in [-3, cap + 3] (negative, valid, past the end)."""
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


def run_and_check(args, num_splits, device):
    T, H = args["q"].shape[:2]
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=device))
    got, lse = paged_decode.dsv4_decode_fused(**args, num_splits=num_splits, out=out)
    assert got is out
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
    assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)


@pytest.mark.parametrize("splits", [1, 3, 0], ids=["direct", "S3", "plan"])
@pytest.mark.parametrize("lens", [(True, True), (False, False), (True, False)], ids=["tl-sl", "nolen", "tl"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
@pytest.mark.parametrize("T,H,K1,K2", [(3, 8, 40, 9), (2, 40, 21, 16), (1, 3, 0, 7)],
                         ids=["T3-H8", "T2-H40-two-groups", "T1-H3-swa-only"])
def test_fused_kernel_matches_float64_reference(interpret, T, H, K1, K2, slot_dtype, lens, splits):
    args = case(T, H, K1, K2, slot_dtype, seed=T * 7 + H + K1, lens=lens, device=interpret)
    run_and_check(args, splits, interpret)


@pytest.fixture
def pipelined(monkeypatch):
    """The PIPELINE form of the 16-head config (not dispatched yet) in place of the default."""
    monkeypatch.setitem(_pk.FUSED_CONFIG, 16, _pk.FUSED_PIPELINE_CONFIG[16])
    dispatch.decode.fused_plan.cache_clear()
    yield
    dispatch.decode.fused_plan.cache_clear()


@pytest.mark.parametrize("splits", [1, 4], ids=["direct", "S4"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_fused_pipe_form_matches_float64_reference(interpret, pipelined, slot_dtype, splits):
    assert dispatch.decode.fused_plan(3, 8, 49, 108).block_n == _pk.FUSED_PIPELINE_CONFIG[16]["BLOCK_N"]
    args = case(3, 8, 40, 9, slot_dtype, seed=31, device=interpret)
    args["topk_slots"][0, :3] = torch.tensor([-1, 10 ** 6, 5]).to(slot_dtype).to(interpret)
    run_and_check(args, splits, interpret)


def test_fused_no_sink_and_no_keys(interpret):
    """No sink; a token whose every entry is invalid: out 0, lse -inf (sink None) / sink, never NaN."""
    args = case(2, 5, 12, 4, seed=3, device=interpret)
    args["topk_slots"][1] = -1
    args["swa_slots"][1] = 10 ** 6
    run_and_check(args, 1, interpret)
    run_and_check(dict(args, sink=None), 1, interpret)
    run_and_check(dict(args, sink=None), 4, interpret)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=short_id)
def test_fused_adversarial_slots(interpret, slot_dtype):
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


def test_fused_strided_slots_q_and_out(interpret):
    """Slot rows and q rows with a stride (column slices), out a slice of a wider buffer."""
    args = case(2, 8, 9, 4, seed=9, device=interpret)
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


def test_fused_reference_equals_old_composite_on_cpu():
    """The new op's reference against the two-op composite (gather + sparse_mla_decode)."""
    args = case(3, 8, 20, 8, seed=5, q_dtype=torch.bfloat16)
    args.pop("swa_length")
    want = dsv4_decode.dsv4_decode_attention(**args)
    got = reference.ref_dsv4_decode_fused(**args, swa_length=None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_composite_fused_mode_on_cpu(monkeypatch):
    """DSV4_AMPERE_DECODE_KERNEL=fused: one op, same outputs as the workspace path."""
    args = case(3, 8, 20, 8, seed=6, q_dtype=torch.bfloat16)
    sl = args.pop("swa_length")
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")
    want = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl)
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fused")
    out = poison_like(torch.empty_like(args["q"]))
    got = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl, out=out)
    assert got[0] is out
    assert torch.equal(out, want[0]) and torch.equal(got[1], want[1])


def test_fused_opcheck_and_fake():
    args = case(2, 4, 6, 4, seed=3, q_dtype=torch.bfloat16)
    out = torch.zeros(2, 4, D, dtype=torch.bfloat16)
    vals = list(args.values())
    torch.library.opcheck(ops.dsv4_decode_fused_out.default, (*vals, 0, out))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        f = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in vals]
        lse = ops.dsv4_decode_fused_out(*f, 0, mode.from_tensor(out))
        assert lse.shape == (2, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("bad,match", [
    ("q_dtype", "q"), ("float_slots", "topk_slots"), ("short_len", "swa_length"), ("rows", "swa_slots"),
    ("cache_dtype", "cache"), ("sink_shape", "sink"), ("out_shape", "out"), ("splits", "num_splits"),
    ("block_size", "pages")])
def test_fused_bad_arguments_raise(bad, match):
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
    with pytest.raises(ValueError, match=match):
        paged_decode.dsv4_decode_fused(**args, num_splits=splits, out=out)
    with pytest.raises(ValueError, match=match):
        ops.dsv4_decode_fused_out(*args.values(), splits, out)


@pytest.mark.parametrize("T,H", [(1, 8), (1, 128), (4, 64), (64, 8), (64, 64), (128, 128), (512, 8)])
@pytest.mark.parametrize("sms", [108, 132])
def test_fused_plan_is_static_and_sane(T, H, sms):
    p = dispatch.decode.fused_plan(T, H, 640, sms)
    nb = -(-640 // p.block_n)
    assert p.kernel == "fused" and 1 <= p.splits <= min(nb, attention.MAX_SPLITS)
    assert p.block_h == _pk.block_h_for(H) and p.groups == -(-H // p.block_h) and p.direct == (p.splits == 1)
    assert p.block_n == _pk.FUSED_CONFIG[p.block_h]["BLOCK_N"]
    assert dispatch.decode.fused_plan(T, H, 640, sms, 5).splits == 5


def test_fused_mode_is_a_known_mode(monkeypatch):
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fused")
    assert dispatch.decode.mode() == "fused"
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fusd")
    with pytest.raises(ValueError, match=dispatch.decode.ENV_VAR):
        dispatch.decode.mode()


def test_aot_fused_kernels_compile_for_sm80_and_sm86(aot_results):
    """Every specialization: compiles, fits shared memory, no spills (triton of this
    environment; triton 3.6 spills 8-48 B in some, see docs/journal/notes.md)."""
    results = [r for r in aot_results if r.label.startswith("fused[") and r.variant == "portable"]
    assert {r.arch for r in results} == set(aot.AMPERE_ARCHS)
    assert len(results) == 2 * len([s for s in paged_decode.aot_specs() if s.label.startswith("fused[portable")])
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r.shared_bytes <= aot.SMEM_LIMIT[r.arch] and r.registers <= 255
        assert r.spill_bytes == 0, f"sm_{r.arch} {r.label} spills {r.spill_bytes} B"


# ---- GPU ---------------------------------------------------------------------------------


def gpu_case(T, H, seed, slot_dtype=torch.int32):
    """The DSv4 decode shape: K1 = 512 top-k + K2 = 128 window, block size 64, bf16 q."""
    args = case(T, H, 512, 128, slot_dtype, seed=seed, bs_c=64, nb_c=16, bs_w=64, nb_w=8,
                q_dtype=torch.bfloat16, device="cuda")
    args["topk_length"] = torch.randint(0, 530, (T,), generator=rng(seed + 1), dtype=torch.int32).cuda()
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 0], ids=["direct", "S2", "S7", "plan"])
@pytest.mark.parametrize("T,H", [(1, 8), (5, 16), (3, 64), (2, 128), (70, 8)])
def test_gpu_fused_matches_reference(variant, T, H, splits):
    args = gpu_case(T, H, seed=T * 11 + H)
    run_and_check(args, splits, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,splits", [(1, 8, 0), (4, 16, 0), (70, 8, 1), (5, 8, 3)])
def test_gpu_fused_pipe_form_matches_reference(variant, pipelined, T, H, splits):
    run_and_check(gpu_case(T, H, seed=T + 3 * H), splits, "cuda")


@pytest.mark.gpu
def test_gpu_fused_int64_adversarial(variant):
    args = gpu_case(3, 64, seed=2, slot_dtype=torch.int64)
    args["topk_slots"][0, :6] = torch.tensor([-(2 ** 63), 2 ** 63 - 1, 2 ** 40, -1, 16 * 64, 16 * 64 - 1]).cuda()
    args["topk_slots"][1] = 77
    run_and_check(args, 0, "cuda")
    run_and_check(args, 1, "cuda")


@pytest.mark.gpu
def test_gpu_fused_equals_old_step(variant, monkeypatch):
    """The fused composite against the workspace composite on the same inputs (bf16 out)."""
    args = gpu_case(64, 64, seed=8)
    common = {k: args[k] for k in ("q", "compressed_cache", "topk_slots", "swa_cache", "swa_slots", "sink",
                                   "sm_scale", "compressed_block_size", "swa_block_size", "topk_length",
                                   "swa_length")}
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "heads")
    o_old, l_old = dsv4_decode.dsv4_decode_attention(**common)
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fused")
    o_new, l_new = dsv4_decode.dsv4_decode_attention(**common)
    want, want_lse = reference.ref_dsv4_decode_fused(**cpu(args), out_dtype=torch.float64)
    assert_attention_close(o_new.cpu(), l_new.cpu(), want, want_lse)
    assert_attention_close(o_old.cpu(), l_old.cpu(), want, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,splits", [(2, 16, 0), (64, 64, 1)])
def test_gpu_fused_graph_replay_equals_eager(variant, monkeypatch, T, H, splits):
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fused")
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
    e_out, e_lse = paged_decode.dsv4_decode_fused(**new, num_splits=splits)
    assert torch.equal(out, e_out) and torch.equal(g_lse, e_lse)


@pytest.mark.gpu
def test_gpu_fused_torch_compile_fullgraph(variant, monkeypatch):
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "fused")
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


@pytest.mark.parametrize("T,H,K,want", [(4, 8, 640, True), (4, 16, 640, True), (4, 64, 640, False),
                                        (1, 8, 640, False), (16, 8, 640, False), (64, 64, 640, False),
                                        (4, 8, 256, False)])
def test_auto_picks_fused_only_where_measured_faster(T, H, K, want):
    """decode_paged_chunk64.md (H200, portable): fused won only at T = 4, H <= 16, K = 640 (1.17-1.18x)."""
    assert dispatch.decode.auto_is_fused(T, H, K) is want


def test_auto_fused_composite_on_cpu_equals_workspace_path(monkeypatch):
    """At a shape where auto takes the fused op, the CPU composite's outputs are unchanged."""
    args = case(4, 8, 512, 128, seed=12, bs_c=64, nb_c=3, bs_w=64, nb_w=2, q_dtype=torch.bfloat16)
    sl = args.pop("swa_length")
    assert dispatch.decode.auto_is_fused(4, 8, 640)
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")
    want = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl)
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "auto")
    got = dsv4_decode.dsv4_decode_attention(**args, swa_length=sl)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
