"""The eager paged decode step's kept plans (dsv4_ops.dsv4_decode._kept_step, dsv4_ops.paged_plan):
one plan per layout, made once and reused by every layer of a step; re-made when T or the SM count
changes; no allocation per call (the partials and a dropped lse in per-stream scratch); the same
launches as the op; correct against the float64 reference, also for a direct op caller.

CPU: launches mocked (logged) or run by the Triton interpreter (fp16 q: the interpreter's bf16 dot
is wrong); GPU (marked): the composite on CUDA, eager and inside a captured graph."""

import os

import pytest
import torch

from dsv4_ops import _host_plan, dsv4_decode, paged_decode, paged_plan, reference
from dsv4_ops.dispatch import decode as _dd
from dsv4_ops.dispatch import device as _device
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import assert_attention_close, poison_like, rng
from test_decode_paged import case as paged_case  # 16-byte aligned pages of real records, fp16 q
from test_host_cost import mocked_launches  # noqa: F401 (a fixture: FastKernels log instead of launching)

D = 512
SM_SCALE = D ** -0.5


@pytest.fixture
def mocked(mocked_launches, monkeypatch):
    """test_host_cost's mocked launches (every FastKernel logs (name, grid, args); device / stream
    queries stubbed), plus CPU tensors on the eager CUDA path (DIRECT_CPU) and no scratch from
    another test."""
    monkeypatch.setattr(_host_plan, "DIRECT_CPU", True)
    paged_plan.clear_scratch()
    yield mocked_launches
    paged_plan.clear_scratch()


def inputs(T, H, K1, K2, *, slot_dtype=torch.int32, lens=True, sink=True, offset=0, same_cache=False, seed=0,
           q_dtype=torch.bfloat16):
    """One layer's decode inputs (keyword names of dsv4_decode_attention; bs 16, caches 8 / 4 pages)."""
    g = rng(seed)
    bs = 16
    base = torch.randint(0, 120, (8 * min_page_bytes(bs) + 16,), generator=g, dtype=torch.uint8)
    cc = base[offset:offset + 8 * min_page_bytes(bs)].view(8, min_page_bytes(bs))
    cw = cc if same_cache else torch.randint(0, 120, (4, min_page_bytes(bs)), generator=g, dtype=torch.uint8)
    return dict(
        q=torch.randn(T, H, D, generator=g).to(q_dtype), compressed_cache=cc,
        topk_slots=torch.randint(-1, 8 * bs, (T, K1), generator=g).to(slot_dtype),
        swa_cache=cw, swa_slots=torch.randint(-1, cw.shape[0] * bs, (T, K2), generator=g).to(slot_dtype),
        sink=torch.randn(H, generator=g) if sink else None, sm_scale=SM_SCALE, compressed_block_size=bs,
        swa_block_size=bs, topk_length=torch.full((T,), K1, dtype=slot_dtype) if lens else None,
        swa_length=torch.full((T,), K2, dtype=slot_dtype) if lens else None,
        out=torch.empty(T, H, D, dtype=torch.bfloat16))


def _canon(entry, inputs_):
    """A launch with tensors named: ('in', name) for an input, else (shape, stride, dtype)."""
    name, grid, args = entry
    named = {id(v): k for k, v in inputs_.items() if isinstance(v, torch.Tensor)}
    return name, grid, tuple((("in", named[id(a)]) if id(a) in named else ("buf", tuple(a.shape), a.stride(), a.dtype))
                             if isinstance(a, torch.Tensor) else a for a in args)


def _kept_plans():
    return [v[0] for v in dsv4_decode._KEPT.values() if v is not dsv4_decode._SLOW]


LAYOUTS = [
    dict(T=1, H=8, K1=512, K2=128),  # auto: v3 + merge (the default decode step at TP 8)
    dict(T=4, H=64, K1=512, K2=128),
    dict(T=3, H=8, K1=40, K2=9, slot_dtype=torch.int64, lens=False, sink=False),
    dict(T=1, H=8, K1=512, K2=128, offset=8),  # caches not 16-byte aligned: paged_chunk128, ALIGN off
    dict(T=256, H=8, K1=512, K2=128),  # kh16n32w4 at the partials cap (S = 3 of the model's 4)
    dict(T=2, H=16, K1=0, K2=128, same_cache=True),  # the plugin's SWA-only call: one cache twice
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_kept_step_launches_what_the_op_launches(mocked, layout):
    """Every call of the kept path (first: planned + FastKernel; later: the compiled launchers)
    launches the kernels, grids, scalars and constexprs that the op launcher launches for the same
    inputs (its own plan: num_splits 0, capped as the composite's), with the inputs in the same places
    and buffers of the same shapes."""
    log = mocked
    layout = dict(layout)
    T, H, K1, K2 = (layout.pop(k) for k in ("T", "H", "K1", "K2"))
    a = inputs(T, H, K1, K2, **layout)
    del log[:]
    paged_decode.dsv4_decode_fused(**a)
    want = [_canon(e, a) for e in log]
    assert want
    aligned = paged_plan.paged_aligned(a["compressed_cache"], a["swa_cache"])
    p = paged_plan.make_paged_plan(a["q"], a["compressed_cache"], a["topk_slots"], a["topk_length"], 16,
                                   a["swa_cache"], a["swa_slots"], a["swa_length"], 16, a["sink"] is not None, 0,
                                   a["out"], "portable")
    want_plan = _dd.plan_step(T, H, K1 + K2, _device.num_sms_at(-1), -1, (16, 16), lengths=a["topk_length"] is not None,
                              int32_slots=a["topk_slots"].dtype == torch.int32, aligned=aligned)
    assert (p.config, p.splits) == (want_plan.config, want_plan.splits) and p.splits <= _dd.split_cap(T, H)
    assert aligned == (layout.get("offset", 0) == 0)
    assert ("capped at" in want_plan.why) == (T == 256), want_plan.why
    if not aligned:
        assert p.kernel is paged_plan._v3_kernel and p.consts[-1] is False
    for _ in range(4):
        del log[:]
        out, lse = dsv4_decode.dsv4_decode_attention(**a)
        assert out is a["out"] and lse.shape == (T, H)
        assert [_canon(e, a) for e in log] == want
    assert len(_kept_plans()) == 1


def test_one_plan_serves_every_layer_of_a_step(mocked, monkeypatch):
    """Forty layers of one step (their own caches, q, out, sink; the step's slots and lengths): one
    plan made, reused by every layer (the plugin's entry drops the lse)."""
    made = []
    real = paged_plan.make_paged_plan
    monkeypatch.setattr(paged_plan, "make_paged_plan", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    step = inputs(1, 8, 512, 128, seed=1)
    k0 = _host_plan.STATS["kept"]
    for layer in range(40):
        a = inputs(1, 8, 512, 128, seed=100 + layer)
        a.update(topk_slots=step["topk_slots"], swa_slots=step["swa_slots"], topk_length=step["topk_length"],
                 swa_length=step["swa_length"])
        out, lse = dsv4_decode.dsv4_decode_attention(**a, return_lse=False)
        assert out is a["out"] and lse is None
    assert len(made) == 1 and _kept_plans() == made and _host_plan.STATS["kept"] - k0 == 40


def test_plan_is_remade_when_T_or_the_sm_count_changes(mocked, monkeypatch):
    """A new T is a new plan; so is a new SM count (DSV4_AMPERE_SMS, read on a device tensor's
    plan: here q's device index is stubbed to 0), and each plan's split count is what the dispatch
    gives for its SM count."""
    monkeypatch.delenv("DSV4_AMPERE_SMS", raising=False)
    monkeypatch.setattr(_device, "num_sms_at", lambda dev: _device.num_sms(0))
    monkeypatch.setattr(_device, "_device_sms", lambda index: 132)
    # a shape whose v3 split count differs between 104 and 132 SMs
    T = next(t for t in (16, 32, 64, 128) if _dd.plan_step(t, 8, 640, 104).splits != _dd.plan_step(t, 8, 640, 132).splits)
    a1, aT = inputs(1, 8, 512, 128), inputs(T, 8, 512, 128)
    dsv4_decode.dsv4_decode_attention(**a1)
    dsv4_decode.dsv4_decode_attention(**a1)
    assert len(_kept_plans()) == 1
    dsv4_decode.dsv4_decode_attention(**aT)
    assert sorted(p.T for p in _kept_plans()) == [1, T]
    p132 = next(p for p in _kept_plans() if p.T == T)
    monkeypatch.setenv("DSV4_AMPERE_SMS", "104")
    dsv4_decode.dsv4_decode_attention(**aT)
    p104 = [p for p in _kept_plans() if p.T == T and p is not p132]  # both kept: each keyed on its SMS value
    assert len(p104) == 1
    want = {sms: _dd.plan_step(T, 8, 640, sms, -1, (16, 16), lengths=True) for sms in (132, 104)}
    assert (p132.config, p132.splits) == (want[132].config, want[132].splits)
    assert (p104[0].config, p104[0].splits) == (want[104].config, want[104].splits)
    assert p104[0].splits != p132.splits


def test_plan_is_remade_when_the_forced_config_changes(mocked, monkeypatch):
    """DSV4_AMPERE_DECODE_CONFIG read inside the planning's own memos (route, split cap) still keys
    the kept plan: at one layout, the dispatched config, then two forced ones in turn (each call
    followed by the op with that config, as the GPU test of graph replay does), and each call's
    kept plan is its config's, at its own split count. The H200 caught a graph replay of kh32n64w8
    that ran another config's plan."""
    monkeypatch.setenv(_dd.ENV_VAR, "v3")
    monkeypatch.setattr(_device, "num_sms_at", lambda dev: 132)
    a = inputs(128, 8, 512, 128)
    op_args = {k: v for k, v in a.items() if k != "out"}
    for config in ("", "kh16n32w4", "kh32n64w8"):
        if config:
            monkeypatch.setenv(_dd.CONFIG_ENV, config)
        else:
            monkeypatch.delenv(_dd.CONFIG_ENV, raising=False)
        before = set(map(id, _kept_plans()))
        dsv4_decode.dsv4_decode_attention(**a)
        paged_decode.dsv4_decode_fused(**op_args, config=config)
        made = [p for p in _kept_plans() if id(p) not in before]  # a new value of the variable: a new plan
        want = _dd.plan_step(128, 8, 640, 132, -1, (16, 16), lengths=True)  # reads DSV4_AMPERE_DECODE_CONFIG
        assert want.config == (config or _dd.resolve_config(128, 8, 640, -1, "", (16, 16), 132)[0])
        assert want.splits <= _dd.split_cap(128, 8)
        assert [(p.config, p.splits) for p in made] == [(want.config, want.splits)], (config, want)


def test_nested_env_memos_tell_the_outer_recording_what_they_read(monkeypatch):
    """An env_memo hit (or miss) inside another recording adds the variables its answer depends on
    to that recording, so the outer memo is keyed on them too."""
    name = "DSV4_TEST_NESTED_ENV_MEMO"
    monkeypatch.delenv(name, raising=False)
    inner = _host_plan.env_memo(lambda x: os.environ.get(name, "a") + str(x))
    outer = _host_plan.env_memo(lambda x: "outer:" + inner(x))
    assert inner(1) == "a1"          # filled first: the outer's first run hits it, reading nothing itself
    assert outer(1) == "outer:a1"
    monkeypatch.setenv(name, "b")
    assert inner(1) == "b1" and outer(1) == "outer:b1"
    monkeypatch.delenv(name)
    assert outer(2) == "outer:a2"     # a miss nested in a miss
    monkeypatch.setenv(name, "c")
    assert outer(2) == "outer:c2"


def test_kept_step_allocates_nothing(mocked, monkeypatch):
    """Warm: a plugin-style call (out given, lse dropped) calls no torch allocator, and its split
    partials and lse sit at the same addresses every call (the stream's scratch)."""
    log = mocked
    a = inputs(1, 8, 512, 128)
    for _ in range(3):
        dsv4_decode.dsv4_decode_attention(**a, return_lse=False)
    assert _kept_plans()[0].splits > 1  # the merge runs: partials are in play
    calls = []
    for name in ("empty", "empty_strided", "zeros"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *x, _r=real, **k: calls.append(x) or _r(*x, **k))
    ptrs = set()
    for _ in range(5):
        del log[:]
        dsv4_decode.dsv4_decode_attention(**a, return_lse=False)
        assert len(log) == 2
        ptrs.add(tuple(t.data_ptr() for _, _, args in log for t in args
                       if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t is not a["sink"]))
    assert not calls and len(ptrs) == 1
    assert paged_plan.scratch_bytes() >= 8 * _kept_plans()[0].splits * (D + 1) * 4


def test_general_path_when_the_kept_path_does_not_apply(mocked, monkeypatch):
    """A workspace-mode call, a bad argument and a layout that needs a copy never take a kept plan:
    the general path runs (and raises its own errors)."""
    log = mocked
    a = inputs(1, 8, 512, 128)
    bad = dict(a, sink=torch.randn(9))
    with pytest.raises(ValueError, match="sink"):
        dsv4_decode.dsv4_decode_attention(**bad)
    with pytest.raises(ValueError, match="q"):  # the composite takes bf16 q only (the op fp16 too)
        dsv4_decode.dsv4_decode_attention(**dict(a, q=a["q"].half()))
    strided = dict(a, topk_slots=torch.randint(0, 8, (1, 1024), dtype=torch.int32)[:, ::2])
    dsv4_decode.dsv4_decode_attention(**strided)
    assert not _kept_plans()
    monkeypatch.setenv(_dd.ENV_VAR, "heads")
    del log[:]
    dsv4_decode.dsv4_decode_attention(**a)  # the workspace step: gather, then attention
    assert "_dsv4_decode_gather_kernel" in {e[0] for e in log}
    assert not _kept_plans()


@pytest.mark.parametrize("T,H,K1,K2", [(3, 8, 40, 9), (1, 3, 0, 7)])
def test_kept_step_and_a_direct_caller_match_float64(interpret, monkeypatch, T, H, K1, K2):
    """The kept path (interpreter, fp16 q) on two inputs of one layout in turn, the scratch partials
    reused, and then a direct op-launcher call of a third: each against the float64 reference."""
    if interpret != "cpu":
        pytest.skip("CPU interpreter leg (the GPU leg is test_gpu_kept_step_eager_and_graph)")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    _host_plan.clear()
    paged_plan.clear_scratch()
    for seed in (1, 2, 1):
        a = paged_case(T, H, K1, K2, seed=seed)
        a["out"] = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16))
        got = dsv4_decode._kept_step(a["q"], a["compressed_cache"], a["topk_slots"], a["swa_cache"], a["swa_slots"],
                                     a["sink"], SM_SCALE, a["compressed_block_size"], a["swa_block_size"],
                                     a["topk_length"], 3, a["swa_length"], a["out"], True)
        assert got is not None and got[0] is a["out"]
        want, want_lse = reference.ref_dsv4_decode_fused(**{k: v for k, v in a.items() if k != "out"},
                                                         out_dtype=torch.float64)
        assert_attention_close(got[0], got[1], want, want_lse)
    assert paged_plan.scratch_bytes() > 0
    args = paged_case(T, H, K1, K2, seed=3)
    out, lse = paged_decode.dsv4_decode_fused(**args, num_splits=3)
    want, want_lse = reference.ref_dsv4_decode_fused(**args, out_dtype=torch.float64)
    assert_attention_close(out, lse, want, want_lse)
    _host_plan.clear()
    paged_plan.clear_scratch()


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 8), (4, 64), (64, 8)])
def test_gpu_kept_step_eager_and_graph(T, H):
    """CUDA: the composite's kept path, eager (scratch partials) and captured in a graph (allocated
    partials), interleaved on one stream, each output against the float64 reference."""
    from dsv4_ops.testing import capture_graph

    def case(seed):
        a = paged_case(T, H, 512, 128, seed=seed, q_dtype=torch.bfloat16, device="cuda")
        a["out"] = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")
        return a

    def check(a):
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items() if k != "out"}
        want, _ = reference.ref_dsv4_decode_fused(**cpu, out_dtype=torch.float64)
        assert_attention_close(a["out"].cpu(), None, want, None)

    g_in, e1, e2 = case(1), case(2), case(3)
    dsv4_decode.dsv4_decode_attention(**g_in, return_lse=False)
    graph, _ = capture_graph(lambda: dsv4_decode.dsv4_decode_attention(**g_in, return_lse=False))
    for e in (e1, e2):
        e["out"].fill_(float("nan"))
        g_in["out"].fill_(float("nan"))
        dsv4_decode.dsv4_decode_attention(**e, return_lse=False)
        graph.replay()
        dsv4_decode.dsv4_decode_attention(**e, return_lse=False)
        torch.cuda.synchronize()
        check(e)
        check(g_in)
    assert any(p.T == T and p.H == H for p in _kept_plans())
