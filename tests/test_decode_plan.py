"""The decode step's one planner (dispatch.decode.plan_step) and its route: what decides, and what
no longer does (issue 44: one plan a step, the fewest kernels). CPU only: plans are pure functions
of shapes, device facts and knobs."""

import pytest
import torch

from dsv4_ops import dsv4_decode, envs, paged_plan
from dsv4_ops.dispatch import configs, decode as dd, windows
from dsv4_ops.layout import min_page_bytes
from test_host_cost import mocked_launches  # noqa: F401 (a fixture: FastKernels log instead of launching)

A100_SMS, A100_SMEM, A10_SMEM = 108, 163 * 1024, 99 * 1024


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (envs.DECODE_KERNEL, envs.DECODE_CONFIG, envs.BATCH_INVARIANT, envs.DECODE_BALANCE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.DECODE_TABLES, "0")  # the windows and the model, not a device's table


@pytest.mark.parametrize("mode", envs.DECODE_MODES)
def test_the_route_is_the_mode_alone(monkeypatch, mode):
    """auto and v3 take the paged op whatever the shapes or caches; tiles and heads the workspace
    step; batch invariance the workspace step's heads kernel; an unknown mode (the removed 'fused'
    among them) is refused by name."""
    monkeypatch.setenv(envs.DECODE_KERNEL, mode)
    want = "workspace" if mode in ("tiles", "heads") else "paged"
    assert dd.route(dd.mode()) == want and dd.resolve_route(dd.mode())[1]
    assert dsv4_decode._route() == want
    monkeypatch.setenv(envs.BATCH_INVARIANT, "1")
    if mode in ("auto", "heads"):
        assert dd.mode() == "heads" and dd.route(dd.mode()) == "workspace"
    else:
        with pytest.raises(ValueError, match=envs.BATCH_INVARIANT):
            dd.mode()
    monkeypatch.delenv(envs.BATCH_INVARIANT)
    monkeypatch.setenv(envs.DECODE_KERNEL, "fused")
    with pytest.raises(ValueError, match=envs.DECODE_KERNEL):
        dd.mode()


def _cache(pages: int, stride: int, offset: int = 0) -> torch.Tensor:
    """A uint8 page view of ``pages`` pages of ``stride`` bytes starting ``offset`` bytes into its buffer."""
    buf = torch.zeros(pages * stride + 64, dtype=torch.uint8)
    return buf[offset:offset + pages * stride].view(pages, stride)


@pytest.mark.parametrize("which", ["compressed", "window", "both", "neither"])
@pytest.mark.parametrize("how", ["address", "stride"])
def test_paged_alignment_reads_both_caches(which, how):
    """paged_aligned: both caches' addresses and page strides are multiples of 16 bytes; either one off
    makes the plan run paged_chunk128 with its 16-byte reads off, whatever config the shape plans."""
    good = min_page_bytes(64)
    assert good % 16 == 0
    bad = dict(address=(good, 2), stride=(good + 2, 0))[how]
    cc = _cache(4, *bad) if which in ("compressed", "both") else _cache(4, good)
    cw = _cache(4, *bad) if which in ("window", "both") else _cache(4, good)
    assert paged_plan.paged_aligned(cc, cw) == (which == "neither")


@pytest.mark.parametrize("T,H,K", [(1, 8, 640), (64, 8, 640), (16, 64, 640), (128, 128, 256)])
def test_unaligned_caches_and_odd_block_sizes_run_paged_chunk128(T, H, K):
    """Caches that are not 16-byte aligned run paged_chunk128's unaligned config (V3_UNALIGNED, whatever
    was planned or forced); where the plan would run a paged_f16dot config, block sizes that are not
    powers of two (either cache's) run paged_chunk128's config for the shape; the reason says so; a
    paged_chunk128 plan is unchanged by the block sizes."""
    from dsv4_ops.csrc_triton.decode import paged_chunk128 as _vk

    base = dd.plan_step(T, H, K, A100_SMS, A100_SMEM, (64, 64))
    f16 = configs.is_f16dot(configs.v3_config(base.config))
    for bs in ((64, 48), (48, 64)):
        p = dd.plan_step(T, H, K, A100_SMS, A100_SMEM, bs)
        assert not configs.is_f16dot(configs.v3_config(p.config)), (bs, p)
        if f16:
            assert p.config == ("h16n16w4" if T <= 1 and H <= 16 else "h16n32w4") and "power-of-two" in p.why
        else:
            assert p.config == base.config
    for forced in ("", "kh16n32w4", "h16n16w4"):
        p = dd.plan_step(T, H, K, A100_SMS, A100_SMEM, (64, 64), config=forced, aligned=False)
        assert p.config == _vk.V3_UNALIGNED[0] and "aligned" in p.why


def test_the_windows_take_the_plans_shared_memory_not_the_current_devices(monkeypatch):
    """A shared-memory row (kh32n64w8, 108.5 KB) is taken on an A100's 163 KB and skipped on an A10's
    99 KB, as the plan's ``smem`` says, whatever device is current."""
    from dsv4_ops.dispatch import device

    monkeypatch.setattr(device, "smem_per_block", lambda index=-1: A10_SMEM)
    row = next(r for r in windows.CONFIG_WINDOWS if r[-1] == "kh32n64w8")
    T, H, K = row[0], row[2], row[4]
    assert dd.resolve_config(T, H, K, A100_SMEM)[0] == "kh32n64w8"
    assert dd.resolve_config(T, H, K, A10_SMEM)[0] != "kh32n64w8"
    need = configs._v4k.V4_SMEM_BYTES["kh32n64w8"]
    assert dd.resolve_config(T, H, K, need)[0] == "kh32n64w8"  # exactly enough is enough
    assert dd.resolve_config(T, H, K, need - 1)[0] != "kh32n64w8"
    monkeypatch.setattr(device, "smem_per_block", lambda index=-1: A100_SMEM)
    assert dd.resolve_config(T, H, K, A10_SMEM)[0] != "kh32n64w8"


def test_the_plan_says_why(monkeypatch):
    """Every rule that decided is named: the window row or the default, the SM model, the split rule
    and the cap, a forced config, the caller's splits."""
    p = dd.plan_step(1, 8, 640, A100_SMS, A100_SMEM)
    assert p.config == "h16n16w4" and "no window" in p.why and "v3_splits" in p.why
    p = dd.plan_step(16, 8, 640, A100_SMS, A100_SMEM)
    assert "CONFIG_WINDOWS row" in p.why
    p = dd.plan_step(512, 16, 640, A100_SMS, A100_SMEM)
    assert p.splits == 1 and ("capped" in p.why or "v3_splits" in p.why)
    p = dd.plan_step(4, 8, 640, A100_SMS, A100_SMEM, splits=3)
    assert p.splits == 3 and "caller's splits" in p.why
    monkeypatch.setenv(envs.DECODE_CONFIG, "kh16n32w4")
    p = dd.plan_step(4, 8, 640, A100_SMS, A100_SMEM)
    assert p.config == "kh16n32w4" and envs.DECODE_CONFIG in p.why
    monkeypatch.setenv(envs.DECODE_CONFIG, "no-such-config")
    with pytest.raises(ValueError, match="no-such-config"):
        dd.plan_step(4, 8, 640, A100_SMS, A100_SMEM)


def test_balanced_plans_need_lengths_int32_slots_a_split_and_the_knob(monkeypatch):
    """The balanced split runs only under DSV4_AMPERE_DECODE_BALANCE=1, for a paged_f16dot plan that
    splits, with lengths and int32 slots, and never under batch invariance."""
    T, H, K = 16, 8, 640  # kh16n32w4, several splits
    assert not dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=True).balanced
    monkeypatch.setenv(envs.DECODE_BALANCE, "1")
    p = dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=True)
    assert configs.is_f16dot(configs.v3_config(p.config)) and p.splits > 1 and p.balanced and "balanced" in p.why
    assert not dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=False).balanced
    assert not dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=True, int32_slots=False).balanced
    assert not dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=True, splits=1).balanced
    assert not dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=True, aligned=False).balanced
    monkeypatch.setenv(envs.BATCH_INVARIANT, "1")
    assert not dd.plan_step(T, H, K, A100_SMS, A100_SMEM, lengths=True).balanced


def test_the_composite_takes_the_paged_op_over_any_caches_in_auto(monkeypatch):
    """Auto never allocates a workspace: its accounting is the paged op's over aligned and unaligned
    caches alike (the unaligned plan is paged_chunk128's, its partials capped the same way)."""
    for aligned in (True, False):
        route, peak = dsv4_decode.decode_peak_bytes(64, 64, 512, 128, A100_SMS, A100_SMEM, aligned)
        p = dd.plan_step(64, 64, 640, A100_SMS, A100_SMEM, (64, 64), aligned=aligned)
        assert route == "paged"
        assert peak == 64 * 64 * 4 + (64 * 64 * p.splits * 513 * 4 if p.splits > 1 else 0)
    monkeypatch.setenv(envs.DECODE_KERNEL, "tiles")
    route, peak = dsv4_decode.decode_peak_bytes(64, 64, 512, 128, A100_SMS, A100_SMEM)
    assert route == "workspace" and peak >= 64 * 640 * 1024


# ---- the step's plan object (dsv4_decode.DecodeStepPlan): made once, run by every layer ----------

@pytest.fixture
def mocked(mocked_launches, monkeypatch):
    """Launches logged, not run (test_host_cost's mock), CPU tensors on the eager CUDA path."""
    from dsv4_ops import _host_plan

    monkeypatch.setattr(_host_plan, "DIRECT_CPU", True)
    paged_plan.clear_scratch()
    yield mocked_launches
    paged_plan.clear_scratch()


def _layer(step, seed):
    """One layer's arguments of a step: its own q, caches, sink and out; the step's slots and lengths."""
    from test_decode_step_plan import inputs

    a = inputs(1, 8, 512, 128, seed=seed)
    a.update({k: step[k] for k in ("topk_slots", "swa_slots", "topk_length", "swa_length")})
    return a


def test_the_step_plan_is_made_once_and_run_by_every_layer(mocked, monkeypatch):
    """Forty layers of a step with one step_plans dict: the first makes the DecodeStepPlan, every layer
    runs it, each launching what the paged op launches for its own arguments; a new step's dict makes
    a new plan."""
    from dsv4_ops import _host_plan
    from test_decode_step_plan import _canon, inputs

    made = []
    real = dsv4_decode.make_decode_plan
    monkeypatch.setattr(dsv4_decode, "make_decode_plan", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    for step_seed in (1, 2):
        step, plans = inputs(1, 8, 512, 128, seed=step_seed), {}
        s0 = _host_plan.STATS["step_plan"]
        for layer in range(40):
            a = _layer(step, 100 * step_seed + layer)
            del mocked[:]
            from dsv4_ops import paged_decode

            paged_decode.dsv4_decode_fused(**{k: v for k, v in a.items()})
            want = [_canon(e, a) for e in mocked]
            del mocked[:]
            out, lse = dsv4_decode.dsv4_decode_attention(**a, return_lse=False, step_plans=plans)
            assert out is a["out"] and lse is None
            assert [_canon(e, a) for e in mocked] == want
        assert _host_plan.STATS["step_plan"] - s0 == 40
        assert len(plans[dsv4_decode._STEP_PLAN]) == 1 and made[-1] is plans[dsv4_decode._STEP_PLAN][0]
    assert len(made) == 2
    p = made[-1]
    assert p.config == p.paged.config and p.splits == p.paged.splits and p.config in p.why


def test_a_plan_runs_only_a_call_of_its_layout(mocked):
    """A plan passed to a call of another layout (another T, an unaligned cache, another block size)
    is not run: the call plans for itself and launches what the op launches for it."""
    from dsv4_ops import _host_plan, paged_decode
    from test_decode_step_plan import _canon, inputs

    a = inputs(1, 8, 512, 128, seed=3)
    plan = dsv4_decode.make_decode_plan(**{k: v for k, v in a.items() if k != "sm_scale"})
    assert plan is not None
    for other in (inputs(2, 8, 512, 128, seed=4), inputs(1, 8, 512, 128, seed=5, offset=8)):
        del mocked[:]
        paged_decode.dsv4_decode_fused(**other)
        want = [_canon(e, other) for e in mocked]
        s0 = _host_plan.STATS["step_plan"]
        del mocked[:]
        dsv4_decode.dsv4_decode_attention(**other, plan=plan)
        assert [_canon(e, other) for e in mocked] == want and _host_plan.STATS["step_plan"] == s0
    s0 = _host_plan.STATS["step_plan"]
    dsv4_decode.dsv4_decode_attention(**a, plan=plan)
    assert _host_plan.STATS["step_plan"] == s0 + 1


def test_no_plan_off_the_paged_route(mocked, monkeypatch):
    """The workspace route has no step plan: make_decode_plan is None and the call runs the workspace
    step."""
    from test_decode_step_plan import inputs

    monkeypatch.setenv(envs.DECODE_KERNEL, "tiles")
    a = inputs(1, 8, 512, 128, seed=6)
    assert dsv4_decode.make_decode_plan(**{k: v for k, v in a.items() if k != "sm_scale"}) is None
