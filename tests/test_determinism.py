"""Same inputs, same bits: every op and the whole decode step, run to run and process to
process (GPU: this file run as a script in two fresh processes, digests compared); batch
invariance under DSV4_AMPERE_BATCH_INVARIANT=1 (a token's output does not depend on the
rest of its batch); non-finite sink semantics (the reference, and the GPU kernels against it).

    python tests/test_determinism.py --digests [--device cpu]   # one process's digests, JSON
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4_ops import dispatch, reference
from dsv4_ops.testing import HAS_GPU, rng

SCALE = 512 ** -0.5


# ------------------------------------------------------------------------- the digests

def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.detach().contiguous().cpu()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(t).encode())
    return h.hexdigest()[:16]


def _paged_cache(num_blocks, block_size, n_rows, g, device):
    """A uint8 [num_blocks, page] fp8_ds_mla cache with rows 0..n_rows-1 written by the op."""
    from dsv4_ops import layout

    cache = torch.zeros(num_blocks, layout.vllm_page_bytes(block_size), dtype=torch.uint8, device=device)
    kv = (torch.randn(n_rows, 512, generator=g) * 3).to(torch.bfloat16).to(device)
    torch.ops.dsv4_ampere.kv_cache_insert(kv, cache, torch.arange(n_rows, device=device), block_size)
    return cache


def _with_env(name, value, fn, *args, **kwargs):
    """fn(*args, **kwargs) with os.environ[name] = value for the call."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args, **kwargs)
    finally:
        if saved is None:
            os.environ.pop(name)
        else:
            os.environ[name] = saved


def op_cases(device: str):
    """(name, thunk) for every op and the decode step; each thunk returns its outputs."""
    from dsv4_ops.dsv4_decode import dsv4_decode_attention

    ops = torch.ops.dsv4_ampere
    g = rng(19)
    dev = device
    codes = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g).to(dev)
    x = (torch.randn(8192, generator=g) * 100).to(dev)
    bs, nb = 64, 32
    cache = _paged_cache(nb, bs, 1500, g, dev)
    slots = torch.randint(-4, nb * bs + 4, (257,), generator=g).to(dev)
    H, N, K = 16, 2000, 640
    kv = (torch.randn(N, 512, generator=g)).to(torch.bfloat16).to(dev)
    sink = torch.randn(H, generator=g).to(dev)

    def attn_inputs(T):
        q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev)
        idx = torch.randint(-8, N, (T, K), generator=g).to(torch.int32).to(dev)
        lens = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32).to(dev)
        return q, idx, lens

    cases = [
        ("e4m3_decode", lambda: ops.e4m3_decode(codes)),
        ("e4m3_encode_exact", lambda: ops.e4m3_encode(x, True)),
        ("e4m3_encode_fast", lambda: ops.e4m3_encode(x.to(torch.bfloat16), False)),
        ("kv_cache_insert", lambda: _paged_cache(nb, bs, 1500, rng(7), dev)),
        ("kv_cache_gather", lambda: ops.kv_cache_gather(cache, slots, bs)),
    ]
    for T in (1, 8, 64, 300):  # tiles, tiles, heads + merge, heads direct (T >= 2 * SMs)
        q, idx, lens = attn_inputs(T)
        cases.append((f"sparse_mla_decode_T{T}", lambda q=q, idx=idx, lens=lens:
                      ops.sparse_mla_decode(q, kv, idx, lens, sink, SCALE, 0)))
    q5, idx5, lens5 = attn_inputs(5)
    cases.append(("sparse_mla_split", lambda: ops.sparse_mla_split(q5, kv, idx5, lens5, SCALE, 7)))
    cases.append(("merge_splits", lambda: ops.merge_splits(*ops.sparse_mla_split(q5, kv, idx5, lens5, SCALE, 7),
                                                            sink)))
    swa = _paged_cache(nb, bs, 2000, g, dev)
    for T in (1, 64):
        q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev)
        topk = torch.randint(-2, nb * bs, (T, 512), generator=g).to(torch.int32).to(dev)
        win = torch.randint(-2, nb * bs, (T, 128), generator=g).to(torch.int32).to(dev)
        tl_ = torch.randint(0, 513, (T,), generator=g).to(torch.int32).to(dev)
        cases.append((f"dsv4_decode_indices_T{T}", lambda topk=topk, tl_=tl_, win=win:
                      ops.dsv4_decode_indices(topk, tl_, win, nb * bs, nb * bs)))
        cases.append((f"dsv4_decode_step_T{T}", lambda q=q, topk=topk, tl_=tl_, win=win:
                      dsv4_decode_attention(q, cache, topk, swa, win, sink, SCALE, bs, bs, topk_length=tl_)))
        # the workspace step (gather + the tiles kernel at T = 1, the heads kernel at T = 64); auto: the paged op
        cases.append((f"dsv4_decode_step_workspace_T{T}", lambda q=q, topk=topk, tl_=tl_, win=win, T=T:
                      _with_env(dispatch.decode.ENV_VAR, "tiles" if T == 1 else "heads", dsv4_decode_attention, q,
                                cache, topk, swa, win, sink, SCALE, bs, bs, topk_length=tl_)))
    # indexer
    Hi, D = 32, 128
    k = torch.randn(300, D, generator=g).to(torch.bfloat16).to(dev)
    icache = torch.zeros(16, 64, D + 4, dtype=torch.uint8, device=dev)
    islots = torch.randperm(16 * 64, generator=g)[:300].to(dev)

    def k_insert():
        c = icache.clone()
        ops.indexer_k_insert(k, c, islots, 64)
        return c

    T = 40
    pos = torch.randint(0, 4096, (T,), generator=g).to(dev)
    iq = torch.randn(T, Hi, D, generator=g).to(torch.bfloat16).to(dev)
    cs = torch.randn(4096, 64, generator=g).to(dev)
    iw = torch.randn(T, Hi, generator=g).to(torch.bfloat16).to(dev)
    qc = torch.randint(0, 256, (T, Hi, D), dtype=torch.uint8, generator=g).to(dev)
    wq = torch.randn(T, Hi, generator=g).to(dev)
    kc = torch.randint(0, 256, (500, D), dtype=torch.uint8, generator=g).to(dev)
    ksc = torch.rand(500, generator=g).to(dev)
    ks_cpu = torch.randint(0, 100, (T,), generator=g).to(torch.int32)
    ke = (ks_cpu + torch.randint(0, 400, (T,), generator=g).to(torch.int32)).to(dev)
    ks = ks_cpu.to(dev)
    pcache = k_insert()
    bt = torch.randint(0, 16, (4, 16), generator=g).to(torch.int32).to(dev)
    ctx = torch.tensor([1, 200, 700, 1024], dtype=torch.int32, device=dev)
    qp = torch.randint(0, 256, (4, 1, Hi, D), dtype=torch.uint8, generator=g).to(dev)
    wp = torch.randn(4, Hi, generator=g).to(dev)
    cases += [
        ("indexer_k_insert", k_insert),
        ("indexer_q_quant", lambda: ops.indexer_q_quant(pos, iq, cs, iw, 0.125, 32 ** -0.5)),
        ("mqa_logits", lambda: ops.mqa_logits(qc, wq, kc, ksc, ks, ke, -1)),
        ("mqa_logits_compressed", lambda: ops.mqa_logits(qc, wq, kc, ksc, ks, ke, 512)),
        ("paged_mqa_logits", lambda: ops.paged_mqa_logits(qp, pcache, wp, ctx, bt, 1024)),
    ]
    # Engram
    weight = torch.randint(0, 256, (4096, 256), dtype=torch.uint8, generator=g).to(dev)
    escales = torch.randint(100, 140, (4096, 8), dtype=torch.uint8, generator=g).to(dev)
    ids = torch.randint(0, 8192, (33, 16), generator=g).to(torch.int32).to(dev)

    def engram():
        out = torch.empty(33, 8, 256, dtype=torch.bfloat16, device=dev)
        ops.engram_lookup(weight, escales, ids, out, 0, 4096, 8, 16)
        return out

    cases.append(("engram_lookup", engram))
    return cases


def digests(device: str) -> dict:
    """{op: digest} of one process; each op also runs twice here and must match itself."""
    out = {}
    for name, thunk in op_cases(device):
        first = _digest(*_flat(thunk()))
        second = _digest(*_flat(thunk()))
        if first != second:
            raise AssertionError(f"{name}: two runs in one process differ ({first} vs {second})")
        out[name] = first
    return out


def _flat(res):
    return res if isinstance(res, (tuple, list)) else (res,)


@pytest.mark.gpu
def test_every_op_gives_the_same_bits_in_fresh_processes(monkeypatch):
    """Digests of this process (each op twice) against a fresh process's (portable)."""
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    runs = [digests("cuda")]
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--digests"], capture_output=True,
                         text=True, timeout=240, env=dict(os.environ, DSV4_AMPERE_IMPL="portable"))
    assert res.returncode == 0, res.stderr[-3000:]
    runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert len(runs[0]) >= 20
    diff = {k: (runs[0][k], runs[1].get(k)) for k in runs[0] if runs[0][k] != runs[1].get(k)}
    assert not diff, f"ops whose bits differ between processes: {diff}"


def test_digest_script_runs_on_the_cpu_references():
    """The same script on CPU tensors (the ops' CPU implementations): every case runs and
    repeats itself bit for bit (a guard on the script; the GPU test is the claim)."""
    d = digests("cpu")
    plain = {k: v for k, v in d.items() if "_workspace_" not in k}
    assert len(plain) >= 20 and len(set(plain.values())) == len(plain), "every case must have its own output"
    for T in (1, 64):  # the paged op's CPU implementation is the same reference as the workspace step's
        assert d[f"dsv4_decode_step_workspace_T{T}"] == d[f"dsv4_decode_step_T{T}"]


# ------------------------------------------------------------------------ batch invariance

def test_batch_invariant_plan_ignores_t(monkeypatch):
    ws = dispatch.workspace
    monkeypatch.delenv(dispatch.decode.ENV_VAR, raising=False)
    monkeypatch.setenv(ws.BATCH_INVARIANT_ENV, "1")
    assert dispatch.decode.mode() == "heads" and dispatch.decode.route(dispatch.decode.mode()) == "workspace"
    for H, K in ((8, 640), (16, 640), (64, 640), (128, 1152), (8, 16)):
        plans = {ws.plan(T, H, K, sms, dispatch.decode.mode()) for T in (1, 2, 17, 63, 64, 95, 264, 8192)
                 for sms in (108, 132)}
        assert len(plans) == 1, (H, K, plans)
        (p,) = plans
        assert p.kernel == "heads" and p.splits == min(4 if H <= 16 else 2, -(-K // 32))
    for mode in ("tiles", "v3"):  # both plan from T
        monkeypatch.setenv(dispatch.decode.ENV_VAR, mode)
        with pytest.raises(ValueError, match="cannot be batch-invariant"):
            dispatch.decode.mode()
    monkeypatch.delenv(ws.BATCH_INVARIANT_ENV)
    assert dispatch.decode.mode() == "v3"
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "tiles")
    assert dispatch.decode.mode() == "tiles"
    monkeypatch.delenv(dispatch.decode.ENV_VAR)
    assert {ws.plan(T, 8, 640, 108, "auto").kernel for T in (1, 64)} == {"tiles", "heads"}
    assert dispatch.decode.route(dispatch.decode.mode()) == "paged"  # auto: the paged op, whose plan reads T


@pytest.mark.gpu
def test_batch_invariant_decode_step(monkeypatch):
    """With the switch, the decode step of the first tokens is bit-identical whether the
    batch holds 1, 7, 64 or 300 tokens (plans that differ by T without it)."""
    from dsv4_ops.dsv4_decode import dsv4_decode_attention

    monkeypatch.setenv(dispatch.workspace.BATCH_INVARIANT_ENV, "1")
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    g, dev, bs, nb, H = rng(5), "cuda", 64, 64, 8
    cache = _paged_cache(nb, bs, nb * bs, g, dev)
    swa = _paged_cache(nb, bs, nb * bs, g, dev)
    T = 300
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev)
    topk = torch.randint(-2, nb * bs, (T, 512), generator=g).to(torch.int32).to(dev)
    win = torch.randint(0, nb * bs, (T, 128), generator=g).to(torch.int32).to(dev)
    lens = torch.randint(1, 513, (T,), generator=g).to(torch.int32).to(dev)
    sink = torch.randn(H, generator=g).to(dev)
    full, full_lse = dsv4_decode_attention(q, cache, topk, swa, win, sink, SCALE, bs, bs, topk_length=lens)
    for n in (1, 7, 64):
        out, lse = dsv4_decode_attention(q[:n], cache, topk[:n], swa, win[:n], sink, SCALE, bs, bs,
                                         topk_length=lens[:n])
        assert torch.equal(out.view(torch.int16), full[:n].view(torch.int16)), f"batch of {n} vs {T}: out bits differ"
        assert torch.equal(lse.view(torch.int32), full_lse[:n].view(torch.int32)), f"batch of {n} vs {T}: lse differs"


# ------------------------------------------------------------------------ non-finite sinks

def _attn_case(seed=3, T=6, H=4, N=40, K=48):
    g = rng(seed)
    q = torch.randn(T, H, 512, generator=g)
    kv = torch.randn(N, 512, generator=g)
    idx = torch.randint(-2, N, (T, K), generator=g)
    idx[0] = -1  # a token without keys
    return q, kv, idx


def test_reference_nan_sink_is_no_sink():
    q, kv, idx = _attn_case()
    base = torch.tensor([0.5, -1.0, 2.0, 0.0])
    nan, none = base.clone(), base.clone()
    nan[1], none[1] = float("nan"), float("-inf")
    o_nan, l_nan = reference.ref_sparse_mla_decode(q, kv, idx, None, nan, SCALE)
    o_ref, l_ref = reference.ref_sparse_mla_decode(q, kv, idx, None, none, SCALE)
    assert not torch.isnan(o_nan).any() and not torch.isnan(l_nan).any()
    assert torch.equal(o_nan, o_ref) and torch.equal(l_nan, l_ref)
    assert torch.equal(o_nan[:, 0], reference.ref_sparse_mla_decode(q, kv, idx, None, base, SCALE)[0][:, 0])
    # the merge of split partials agrees with the one-pass reference
    o_part, lse_part = reference.ref_sparse_mla_split(q, kv, idx, None, SCALE, 3)
    o_m, l_m = reference.ref_merge_splits(o_part, lse_part, nan)
    assert (o_m.float() - o_ref.float()).abs().max() < 2e-2 and torch.allclose(l_m, l_ref, atol=1e-5)
    # +inf: the sink takes all the mass (out 0), lse -inf like an empty row; no NaN
    inf = base.clone()
    inf[2] = float("inf")
    o_inf, l_inf = reference.ref_sparse_mla_decode(q, kv, idx, None, inf, SCALE)
    assert torch.all(o_inf[:, 2] == 0) and torch.all(torch.isneginf(l_inf[:, 2])) and not torch.isnan(o_inf).any()


@pytest.mark.gpu
def test_gpu_nan_sink_matches_the_reference(monkeypatch):
    """Every attention path (tiles + merge, heads + merge, heads direct) with a NaN sink
    logit equals the reference's no-sink result for that head."""
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    q, kv, idx = _attn_case(T=300, H=16, N=700, K=640)
    sink = torch.randn(16, generator=rng(4))
    sink[3] = float("nan")
    q, kv = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    ref_o, ref_l = reference.ref_sparse_mla_decode(q, kv, idx, None, sink, SCALE)
    dq, dkv, didx = q.to(torch.bfloat16).cuda(), kv.to(torch.bfloat16).cuda(), idx.to(torch.int32).cuda()
    for T in (1, 64, 300):
        o, lse = torch.ops.dsv4_ampere.sparse_mla_decode(dq[:T], dkv, didx[:T], None, sink.cuda(), SCALE, 0)
        o, lse = o.float().cpu(), lse.cpu()
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"T={T}: NaN"
        assert (o - ref_o[:T].float()).abs().max() < 3e-2, f"T={T}: out differs from the reference"
        assert torch.allclose(lse, ref_l[:T], atol=1e-2, equal_nan=False), f"T={T}: lse differs"


if __name__ == "__main__":
    if "--digests" in sys.argv:
        import dsv4_ops  # noqa: F401  (registers the ops)

        device = "cpu" if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu" else "cuda"
        print(json.dumps(digests(device)))
