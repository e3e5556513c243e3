"""The low-overhead launch path (dsv4_ops._launch), the recorded launch plans and direct op
calls (dsv4_ops._host_plan), the plugin's memoised views, and the host-cost shape of a decode step.

CPU: the cache key is at least as fine as Triton's own specialization (checked against
triton's native specialize_impl), and FastKernel's hit / miss / fallback logic with a fake
compiled kernel (no GPU); a replayed plan launches exactly what the launcher launches (mocked
launches, fresh inputs, several layouts, env changes, aliasing); recordings refuse launchers that
copy; the dispatcher bypass only in plain eager calls. GPU: a warmed decode step's launches are
all direct, replayed, and bit-identical to the step without replays.
"""

import pytest
import torch

from dsv4_ops import _launch


def test_launch_key_refines_tritons_integer_specialization():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 15, 16, 17, 32, 48, 640, 4096, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16,
              2 ** 40, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 16, -1, -16, -17, -(2 ** 31), -(2 ** 31) - 16]
    seen = {}
    for v in values:
        spec = native_specialize_impl(BaseBackend, v, False, True, True)
        key = _launch.launch_key((v,))
        assert seen.setdefault(key, spec) == spec, f"{v}: key {key} shared by specializations {seen[key]} / {spec}"


def test_launch_key_tensors_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.float32)
    k0, k1, k4 = (_launch.launch_key((base[i:],)) for i in (0, 1, 2))  # +0, +4, +8 bytes
    assert k0 != k1 and k1 != k4 and k0 != k4  # address % 16 differs
    assert _launch.launch_key((base[4:],)) == k0  # +16 bytes: aligned again
    assert _launch.launch_key((base,)) != _launch.launch_key((base.view(torch.int32),))  # dtype
    assert _launch.launch_key((None,)) != _launch.launch_key((base,))
    assert _launch.launch_key((0.5,)) == _launch.launch_key((0.25,))  # floats are not specialized


class _Param:
    def __init__(self, is_constexpr):
        self.is_constexpr = is_constexpr


class _Compiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn", ("meta",), log

    def run(self, *a):
        self.log.append(("direct", a))


class _FakeJit:
    """Stands in for a JITFunction: kernel[grid](*args, **opts) launches and returns the compiled kernel."""

    def __init__(self, n_args, n_consts):
        self.params = [_Param(False)] * n_args + [_Param(True)] * n_consts
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **opts):
            self.log.append(("normal", grid, args, opts))
            return _Compiled(self.log)

        return launch


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)
    monkeypatch.setattr(_launch, "ENABLED", True)


def make_fast(n_args=3, n_consts=2):
    fn = _FakeJit(n_args, n_consts)
    fk = _launch.FastKernel(fn)
    fk.jit = True
    return fn, fk


def test_fast_kernel_miss_then_direct_hits(fake_cuda):
    fn, fk = make_fast()
    x = torch.zeros(8)
    fk((4,), (x, 16, 0.5), (64, True), 4, 2)
    assert fn.log[-1][0] == "normal" and fn.log[-1][2] == (x, 16, 0.5, 64, True)
    assert fn.log[-1][3] == {"num_warps": 4, "num_stages": 2}
    fk((5, 2), (x, 32, 0.25), (64, True), 4, 2)  # same specialization: direct
    kind, a = fn.log[-1]
    assert kind == "direct"
    assert a == (5, 2, 1, 1234, "fn", ("meta",), None, None, None, x, 32, 0.25, 64, True)
    assert fk.stats == {"fast": 1, "slow": 1}


@pytest.mark.parametrize("change", ["const", "int_align", "int_one", "ptr_align", "warps", "dtype"])
def test_fast_kernel_new_specialization_takes_the_normal_path(fake_cuda, change):
    fn, fk = make_fast()
    x = torch.zeros(8)
    args, consts, warps = (x, 16, 0.5), (64, True), 4
    fk((1,), args, consts, warps)
    if change == "const":
        consts = (128, True)
    elif change == "int_align":
        args = (x, 17, 0.5)
    elif change == "int_one":
        args = (x, 1, 0.5)
    elif change == "ptr_align":
        args = (x[1:], 16, 0.5)
    elif change == "warps":
        warps = 8
    elif change == "dtype":
        args = (x.view(torch.int32), 16, 0.5)
    fk((1,), args, consts, warps)
    assert fn.log[-1][0] == "normal", change


def test_fast_kernel_falls_back_when_the_launcher_api_moved(fake_cuda, monkeypatch):
    fn, fk = make_fast()

    def bad_run(*a):
        raise TypeError("launcher takes a different argument list")

    x = torch.zeros(8)
    fk((1,), (x, 16, 0.5), (64, True))
    key = next(iter(fk.cache))
    fk.cache[key][0] = bad_run
    with pytest.warns(UserWarning, match="fast Triton launch disabled"):
        fk((1,), (x, 16, 0.5), (64, True))
    assert fn.log[-1][0] == "normal" and _launch.ENABLED is False


def test_fast_kernel_takes_the_normal_path_while_a_launch_hook_is_set(fake_cuda, monkeypatch):
    from triton import knobs

    fn, fk = make_fast()
    x = torch.zeros(8)
    fk((1,), (x, 16, 0.5), (64, True))
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda meta: None)
    fk((1,), (x, 16, 0.5), (64, True))
    assert fn.log[-1][0] == "normal"


def test_fast_kernel_rejects_constexprs_that_are_not_trailing(fake_cuda):
    fn, fk = make_fast(n_args=3, n_consts=2)
    with pytest.raises(TypeError, match="constexprs"):
        fk((1,), (torch.zeros(1), 1), (2, 3, 4))


def test_every_launcher_kernel_has_trailing_constexprs():
    """The launchers pass constexprs apart (keyed by value): each kernel must end with them."""
    from dsv4_ops import attention, codec, kv_cache  # noqa: F401  (fills the registry)
    from dsv4_ops.csrc_triton import codec as ck, kv_cache as kk
    from dsv4_ops.csrc_triton.decode import merge as mk, tiles as sk

    kernels = [sk._sparse_mla_split_kernel, sk._dsv4_decode_indices_kernel, mk._merge_splits_kernel,
               kk._kv_cache_insert_kernel, kk._kv_cache_gather_kernel, kk._dsv4_decode_gather_kernel,
               ck._e4m3_decode_kernel, ck._e4m3_encode_kernel]
    for k in kernels:
        fn = getattr(k, "fn", k)
        import inspect

        params = list(inspect.signature(fn).parameters.values())
        flags = ["constexpr" in str(p.annotation) for p in params]
        first = flags.index(True)
        assert all(flags[first:]), f"{fn.__name__}: constexpr parameters must come last"


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 8), (4, 64)])
def test_gpu_decode_step_is_direct_and_replayed(variant, T, H, monkeypatch):
    """A warmed decode step: every launch direct (2 for the v3 form at T = 1, 3 for the workspace
    step), served by a replayed plan or the composite's kept plan, and bit-identical to the step with replays and the
    dispatcher bypass off."""
    from test_decode_gather import gpu_composite_args

    from dsv4_ops import _host_plan, dsv4_decode
    from dsv4_ops.testing import poison_like

    args = gpu_composite_args(T, H, seed=T)
    args["out"] = poison_like(torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda"))
    for _ in range(3):  # run, record, replay
        dsv4_decode.dsv4_decode_attention(**args)
    torch.cuda.synchronize()
    poison_like(args["out"])
    before = {id(k): dict(k.stats) for k in _launch._REGISTRY.values()}
    r0 = _host_plan.STATS["replay"] + _host_plan.STATS["kept"]
    out, lse = dsv4_decode.dsv4_decode_attention(**args)
    fast = sum(k.stats["fast"] - before[id(k)]["fast"] for k in _launch._REGISTRY.values())
    slow = sum(k.stats["slow"] - before[id(k)]["slow"] for k in _launch._REGISTRY.values())
    assert slow == 0 and fast in (2, 3) and _host_plan.STATS["replay"] + _host_plan.STATS["kept"] - r0 >= 1
    got = (out.clone(), lse.clone())
    monkeypatch.setattr(_host_plan, "ENABLED", False)
    monkeypatch.setattr(_host_plan, "DIRECT", False)
    poison_like(args["out"])
    want = dsv4_decode.dsv4_decode_attention(**args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.isnan(got[0].float()).any()


# ---- recorded launch plans (dsv4_ops._host_plan), CPU with a mocked launch ----------------------

class _LogCompiled:
    function, packed_metadata = "fn", ("meta",)

    def __init__(self, log, name):
        self.log, self.name = log, name

    def run(self, gx, gy, gz, stream, function, packed, lm, enter, exit_, *args):
        self.log.append((self.name, (gx, gy, gz), args))


class _LogJit:
    """kernel[grid](*args, **opts) 'launches' (logs) and returns a compiled kernel that logs."""

    params = None

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        def launch(*args, **opts):
            g = tuple(grid) + (1,) * (3 - len(grid))
            self.log.append((self.name, g, args))
            return _LogCompiled(self.log, self.name)

        return launch


@pytest.fixture
def mocked_launches(monkeypatch):
    """Every FastKernel of the registry logs (name, grid, runtime args + constexprs) instead of
    launching; CPU tensors take the CUDA code path (device / stream queries stubbed)."""
    from dsv4_ops import _host_plan, attention, kv_cache  # noqa: F401  (fill the registry)

    log = []
    for fk in list(_launch._REGISTRY.values()):
        monkeypatch.setattr(fk, "fn", _LogJit(log, fk.name))
        monkeypatch.setattr(fk, "jit", True)
        monkeypatch.setattr(fk, "cache", {})
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 77, raising=False)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_host_plan, "ENABLED", True)
    _host_plan.clear()
    yield log
    _host_plan.clear()


def _canon(entry, inputs):
    """A launch log entry with tensors named: ('in', i) for the i-th input, else (shape, stride,
    dtype) of a tensor the launcher allocated (its address is new every call)."""
    name, grid, args = entry
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            hit = [i for i, t in enumerate(inputs) if t is a]
            out.append(("in", hit[0]) if hit else ("alloc", tuple(a.shape), a.stride(), a.dtype))
        else:
            out.append(a)
    return name, grid, tuple(out)


def _fused_inputs(T, H, K1, K2, *, slot_dtype=torch.int32, lens=True, sink=True, offset=0, same_cache=False, seed=0):
    from dsv4_ops.layout import min_page_bytes

    g = torch.Generator().manual_seed(seed)
    bs = 16
    base = torch.zeros(8 * min_page_bytes(bs) + 16, dtype=torch.uint8)
    cc = base[offset:offset + 8 * min_page_bytes(bs)].view(8, min_page_bytes(bs))
    cw = cc if same_cache else torch.zeros(4, min_page_bytes(bs), dtype=torch.uint8)
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    topk = torch.randint(-1, 8 * bs, (T, K1), generator=g).to(slot_dtype)
    swa = torch.randint(-1, cw.shape[0] * bs, (T, K2), generator=g).to(slot_dtype)
    tl = torch.full((T,), K1, dtype=slot_dtype) if lens else None
    sl = torch.full((T,), K2, dtype=slot_dtype) if lens else None
    s = torch.randn(H, generator=g) if sink else None
    out = torch.empty(T, H, 512, dtype=torch.bfloat16)
    return (q, cc, topk, tl, bs, cw, swa, sl, bs, s, 512 ** -0.5, 0, out)


FUSED_LAYOUTS = [
    dict(T=1, H=8, K1=512, K2=128),  # auto: v3 (the default decode step)
    dict(T=1, H=64, K1=512, K2=128),
    dict(T=4, H=64, K1=512, K2=128),  # v1 form
    dict(T=3, H=8, K1=40, K2=9, slot_dtype=torch.int64, lens=False, sink=False),
    dict(T=1, H=8, K1=512, K2=128, offset=8),  # caches not 16-byte aligned: v1 form
    dict(T=2, H=16, K1=0, K2=128, same_cache=True),  # the plugin's SWA-only call: one cache twice
]


@pytest.mark.parametrize("generated", [True, False], ids=["generated", "generic"])
@pytest.mark.parametrize("layout", FUSED_LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_replayed_plan_launches_what_the_launcher_launches(mocked_launches, layout, generated, monkeypatch):
    """dsv4_decode_fused_out's CUDA kernel with recorded plans: from the third call of a layout
    it replays; every call, on fresh tensors, must launch exactly what the launcher itself
    launches for the same inputs (kernels, grids, scalars, constexprs, which input tensor where,
    allocations of the same shape / strides / dtype) and return the same kind of result."""
    from dsv4_ops import _host_plan, paged_decode
    from dsv4_ops.registration import library

    monkeypatch.setattr(_host_plan, "FAST_REPLAY", generated)
    impl = library._DEFINED["dsv4_decode_fused_out"].cuda
    log = mocked_launches
    for call in range(5):
        args = _fused_inputs(**layout, seed=call)
        del log[:]
        r0 = _host_plan.STATS["replay"]
        got = impl(*args)
        replayed = _host_plan.STATS["replay"] - r0
        got_launches = [_canon(e, args) for e in log]
        del log[:]
        want = paged_decode.dsv4_decode_fused(*args[:12], out=args[12])[1]
        want_launches = [_canon(e, args) for e in log]
        assert got_launches == want_launches, f"call {call}"
        assert len(got_launches) >= 1
        assert (type(got), got.shape, got.stride(), got.dtype) == (type(want), want.shape, want.stride(), want.dtype)
        assert got is not want and all(got is not a for a in args)
        assert replayed == (call >= 2), f"call {call}: replayed {replayed}"
    plans = [p for p in impl.plans.values() if isinstance(p, _host_plan._Plan)]
    assert len(plans) == 1 and (plans[0].fast is not None) == generated


def test_replay_keys_on_layout_env_and_aliasing(mocked_launches, monkeypatch):
    """A new shape, a new env value the launcher reads, or a different aliasing of the tensor
    arguments is a new key: recorded anew, never replayed from another key's plan."""
    from dsv4_ops import dispatch
    from dsv4_ops.registration import library

    impl = library._DEFINED["dsv4_decode_fused_out"].cuda
    log = mocked_launches

    def launches(args):
        del log[:]
        impl(*args)
        return [_canon(e, args) for e in log]

    a = _fused_inputs(1, 8, 512, 128)
    base = [launches(_fused_inputs(1, 8, 512, 128, seed=i)) for i in range(3)][-1]
    assert launches(a) == base
    monkeypatch.setenv(dispatch.decode.ENV_VAR, "v3")  # the op's plan does not read the mode: same launches
    assert launches(a) == base
    monkeypatch.delenv(dispatch.decode.ENV_VAR)
    monkeypatch.setenv(dispatch.decode.CONFIG_ENV, "kh16n32w4")  # paged_f16dot where the plan runs paged_chunk128
    forced = [launches(_fused_inputs(1, 8, 512, 128, seed=i)) for i in range(3)]
    assert forced[0] == forced[1] == forced[2] != base and {n for n, _, _ in forced[0]} != {n for n, _, _ in base}
    monkeypatch.delenv(dispatch.decode.CONFIG_ENV)
    # aliasing: the same cache object twice vs two caches of one layout
    one = _fused_inputs(2, 16, 0, 128, same_cache=True)
    two = _fused_inputs(2, 16, 0, 128)
    two = two[:5] + (torch.zeros_like(two[1]),) + two[6:]
    for _ in range(3):
        l_one, l_two = launches(one), launches(two)
    assert [x for _, _, x in l_one] != [x for _, _, x in l_two]  # 'in 1' vs 'in 5' for the window cache
    assert any(("in", 5) in x for _, _, x in l_two)


V3_KERNEL = {"h16n32w4": "_dsv4_decode_v3_kernel", "kh16n32w4": "_dsv4_decode_v4_kernel"}


@pytest.mark.parametrize("order", [("h16n32w4", "kh16n32w4"), ("kh16n32w4", "h16n32w4")], ids="then".join)
def test_replay_keys_on_the_forced_decode_config(mocked_launches, monkeypatch, order):
    """The same layout under two DSV4_AMPERE_DECODE_CONFIG values, each run, recorded and
    replayed, then back to the first: two plans, and every call launches its own config's kernel
    (paged_chunk128 for h..., paged_f16dot for k...), never the plan recorded under the other."""
    from dsv4_ops import _host_plan, envs
    from dsv4_ops.registration import library

    impl = library.cuda_impl("dsv4_decode_fused_out")
    log = mocked_launches

    def kernels(config):
        monkeypatch.setenv(envs.DECODE_CONFIG, config)
        seen = []
        for i in range(4):  # run, record, replay, replay
            del log[:]
            r0 = _host_plan.STATS["replay"]
            impl(*_fused_inputs(1, 8, 512, 128, seed=i))
            seen.append(({n for n, _, _ in log}, _host_plan.STATS["replay"] - r0))
        return seen

    for config in order + order[:1]:
        seen = kernels(config)
        other = V3_KERNEL[order[1] if config == order[0] else order[0]]
        assert all(V3_KERNEL[config] in names and other not in names for names, _ in seen), (config, seen)
        assert [replayed for _, replayed in seen][2:] == [1, 1]
    plans = [p for p in impl.plans.values() if isinstance(p, _host_plan._Plan)]
    assert len(plans) == 2


def test_a_variable_learnt_later_keeps_the_recorded_plans(mocked_launches, monkeypatch):
    """A recording that reads a variable no earlier recording read adds it to every key: the plans
    recorded before stay reachable (replayed, not recorded again), under the variable's value."""
    from dsv4_ops import _host_plan
    from dsv4_ops.registration import library

    impl = library.cuda_impl("dsv4_decode_fused_out")
    monkeypatch.setattr(_host_plan, "_ENV_KEYS", list(_host_plan._ENV_KEYS))
    for i in range(2):  # run, record
        impl(*_fused_inputs(1, 8, 512, 128, seed=i))
    plans = [p for p in impl.plans.values() if isinstance(p, _host_plan._Plan)]
    assert len(plans) == 1
    name = "DSV4_AMPERE_TEST_LEARNT"
    monkeypatch.setenv(name, "x")
    _host_plan._learn([os.environ.encodekey(name)])
    r0, n0 = _host_plan.STATS["replay"], _host_plan.STATS["record"]
    impl(*_fused_inputs(1, 8, 512, 128, seed=2))
    assert (_host_plan.STATS["replay"] - r0, _host_plan.STATS["record"] - n0) == (1, 0)
    assert [p for p in impl.plans.values() if isinstance(p, _host_plan._Plan)] == plans
    monkeypatch.setenv(name, "y")  # another value: a new key (first sight, then recorded)
    for i in range(2):
        impl(*_fused_inputs(1, 8, 512, 128, seed=i))
    assert _host_plan.STATS["record"] - n0 == 1
    assert len([p for p in impl.plans.values() if isinstance(p, _host_plan._Plan)]) == 2


def test_recording_refuses_copies_views_and_torch_kernels(mocked_launches):
    """A launcher that makes a tensor other than torch.empty / new_empty (a copy, a view, an
    in-place op) is never replayed: it runs every call."""
    from dsv4_ops import _host_plan

    calls = []

    def launcher(x, scale):
        calls.append(1)
        y = x.contiguous()  # a copy when x is strided
        return y * scale

    f = _host_plan.planned(launcher)
    x = torch.arange(12.0).view(3, 4).t()
    for _ in range(4):
        assert torch.equal(f(x, 2.0), x.contiguous() * 2.0)
    assert len(calls) == 4 and all(v is _host_plan._REFUSED for v in f.plans.values())


def test_env_memo_follows_the_environment(monkeypatch):
    from dsv4_ops import _host_plan

    calls = []

    def read(x):
        calls.append(x)
        v = os.environ.get("DSV4_AMPERE_TEST_MEMO", "a")
        if v == "bad":
            raise ValueError(v)
        return v + str(x)

    f = _host_plan.env_memo(read)
    monkeypatch.delenv("DSV4_AMPERE_TEST_MEMO", raising=False)
    assert f(1) == "a1" and f(1) == "a1" and len(calls) == 1
    monkeypatch.setenv("DSV4_AMPERE_TEST_MEMO", "b")
    assert f(1) == "b1" and f(2) == "b2" and len(calls) == 3
    monkeypatch.setenv("DSV4_AMPERE_TEST_MEMO", "bad")
    for _ in range(2):
        with pytest.raises(ValueError):
            f(1)
    monkeypatch.delenv("DSV4_AMPERE_TEST_MEMO")
    assert f(1) == "a1" and len(calls) == 5


import os  # noqa: E402


def test_direct_ok_only_for_plain_eager_cuda_calls(monkeypatch):
    """The dispatcher hop is skipped only where torch.ops would call the CUDA kernel itself."""
    from torch.overrides import TorchFunctionMode
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsv4_ops import _host_plan

    x = torch.zeros(2)
    assert not _host_plan.direct_ok(x)  # a CPU tensor: the CPU kernel (the reference) runs
    monkeypatch.setattr(_host_plan, "DIRECT_CPU", True)
    assert _host_plan.direct_ok(x)
    assert not _host_plan.direct_ok(torch.nn.Parameter(x))  # a subclass
    class Through(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Through():
        assert not _host_plan.direct_ok(x)
    with FakeTensorMode():
        assert not _host_plan.direct_ok(x)
    assert not torch.vmap(lambda t: torch.tensor(float(_host_plan.direct_ok(t))))(torch.zeros(3)).any()
    with torch.profiler.profile():
        assert not _host_plan.direct_ok(x)
    monkeypatch.setattr(_host_plan, "DIRECT", False)
    assert not _host_plan.direct_ok(x)


def test_composite_direct_call_equals_the_op(mocked_launches, monkeypatch):
    """The composite's direct path (no dispatcher hop) makes the same launches as the op path."""
    from dsv4_ops import _host_plan, dsv4_decode

    log = mocked_launches
    args = _fused_inputs(1, 8, 512, 128)
    q, cc, topk, tl, bs, cw, swa, sl, _, s, scale, _, out = args

    def run():
        del log[:]
        dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, s, scale, bs, bs, topk_length=tl, swa_length=sl,
                                          out=out)
        return [_canon(e, args) for e in log]

    from dsv4_ops.registration import library

    lib = torch.library.Library(library.NAMESPACE, "IMPL")  # the op path on CPU tensors: the CUDA kernel
    lib.impl("dsv4_decode_fused_out", library._DEFINED["dsv4_decode_fused_out"].cuda, "CPU")
    try:
        via_op = run()
        monkeypatch.setattr(_host_plan, "DIRECT_CPU", True)
        direct = [run() for _ in range(3)]
    finally:
        lib._destroy()
    assert via_op and all(d == via_op for d in direct)


def test_plugin_page_views_are_memoised_and_released():
    import gc

    from dsv4_ops.vllm import attention as vattn

    cache = torch.zeros(4, 16, 584, dtype=torch.uint8)
    v = vattn._paged_2d(cache, "x")
    assert v.shape == (4, 16 * 584) and v.stride() == (16 * 584, 1) and v.data_ptr() == cache.data_ptr()
    cache[1, 2, 3] = 7
    assert v[1, 2 * 584 + 3] == 7  # the same memory
    assert vattn._paged_2d(cache, "x") is v
    k = id(cache)
    del cache, v
    gc.collect()
    assert k not in vattn._PAGE_VIEWS
    idx = torch.arange(12, dtype=torch.int32).view(3, 1, 4)
    s = vattn._slots_2d(idx, 3)
    assert s.shape == (3, 4) and vattn._slots_2d(idx, 3) is s and vattn._slots_2d(idx, 2).shape == (2, 4)


def test_generated_replay_falls_back_on_a_misaligned_allocation(mocked_launches):
    """The compiled kernels of a plan assumed 16-byte aligned allocations: a misaligned one (a
    custom allocator) launches nothing from the plan; the launcher runs instead."""
    from dsv4_ops import _host_plan
    from dsv4_ops.registration import library

    impl = library._DEFINED["dsv4_decode_fused_out"].cuda
    for i in range(3):
        impl(*_fused_inputs(1, 8, 512, 128, seed=i))
    plan = next(p for p in impl.plans.values() if isinstance(p, _host_plan._Plan))

    def misaligned(shape, dtype, device):
        n = 1
        for d in shape:
            n *= d
        return torch.empty(n + 1, dtype=dtype, device=device)[1:].view(shape)

    plan.fast.__globals__["_empty"] = misaligned
    args = _fused_inputs(1, 8, 512, 128, seed=9)
    assert plan.fast(args) is _host_plan._MISALIGNED
    log = mocked_launches
    del log[:]
    r0 = _host_plan.STATS["replay"]
    impl(*args)
    assert _host_plan.STATS["replay"] == r0 and len(log) == 2  # the launcher's own two launches


def test_replay_keys_scalars_by_class(mocked_launches):
    """True == 1 as a dict key: a launcher that rejects a bool must still see it after 1 was replayed."""
    from dsv4_ops import _host_plan

    def launcher(x, n):
        if isinstance(n, bool):
            raise ValueError("num_splits: a bool")
        return torch.empty((n, 2))

    f = _host_plan.planned(launcher)
    x = torch.zeros(2)
    for _ in range(3):
        assert f(x, 1).shape == (1, 2)
    assert any(isinstance(p, _host_plan._Plan) for p in f.plans.values())
    with pytest.raises(ValueError, match="bool"):
        f(x, True)


def test_replay_with_an_unhashable_argument_runs_the_launcher(mocked_launches):
    from dsv4_ops import _host_plan

    f = _host_plan.planned(lambda x, dims: x.new_empty(dims))
    x = torch.zeros(2)
    for _ in range(3):
        assert f(x, [2, 3]).shape == (2, 3)
    assert not f.plans


def test_recording_refuses_a_launcher_that_passes_an_address(mocked_launches):
    """The key holds address % 16 only: a launch taking data_ptr() as an integer is never replayed."""
    from dsv4_ops import _host_plan, attention  # noqa: F401

    fk = next(iter(_launch._REGISTRY.values()))

    def launcher(x):
        out = torch.empty(x.shape, dtype=x.dtype)
        fk((1,), (x.data_ptr(), out), ())
        return out

    f = _host_plan.planned(launcher)
    base = torch.zeros(128)
    for i in range(4):  # one key (offsets 16 elements apart), a new address each call
        f(base[16 * i:16 * i + 8])
    assert list(f.plans.values()) == [_host_plan._REFUSED]


def test_recording_refuses_a_plain_triton_launch(mocked_launches):
    """A launcher that launches a kernel through kernel[grid](...) (not a FastKernel: e.g. a
    register-capped config) is never replayed: the replay would drop that launch."""
    import triton
    import triton.language as tl

    from dsv4_ops import _host_plan

    @triton.jit
    def _write_seven(x_ptr):
        tl.store(x_ptr, 7)

    fk = next(iter(_launch._REGISTRY.values()))

    def launcher(x):
        out = torch.empty((2,), dtype=x.dtype)
        fk((1,), (x, out), ())
        _write_seven[(1,)](x)
        return out

    f = _host_plan.planned(launcher)
    for _ in range(4):
        x = torch.zeros(4, dtype=torch.int32)
        f(x)
        assert x[0] == 7  # the plain launch ran in every call
    assert list(f.plans.values()) == [_host_plan._REFUSED]


def test_recording_counts_jit_launch_entry_points(mocked_launches):
    """What a compiled kernel[grid](...) launch reaches on a GPU: JITFunction.run (it reads only
    metadata, so the torch-function recorder alone would not see it); counted, so never replayed."""
    from triton.runtime.jit import JITFunction

    from dsv4_ops import _host_plan

    class _Stub(JITFunction):
        def __init__(self):  # no kernel: run() is reached and fails after the counter
            pass

    stub = _Stub()
    fk = next(iter(_launch._REGISTRY.values()))
    reached = []

    def launcher(x):
        out = torch.empty((2,), dtype=x.dtype)
        fk((1,), (x, out), ())
        reached.append(1)
        try:
            stub.run(x, grid=(1,), warmup=False)
        except Exception:  # noqa: BLE001 - the stub has no kernel
            pass
        return out

    f = _host_plan.planned(launcher)
    for _ in range(4):
        f(torch.zeros(4))
    assert len(reached) == 4 and list(f.plans.values()) == [_host_plan._REFUSED]


def test_fast_kernel_register_capped_launches(fake_cuda):
    """maxnreg (ptxas register cap) is a launch option: its own cache entry, passed on a miss,
    direct launches on hits."""
    fn, fk = make_fast()
    x = torch.zeros(8)
    fk((1,), (x, 16, 0.5), (64, True), 4, 2)
    fk((1,), (x, 16, 0.5), (64, True), 4, 2, maxnreg=128)  # not the uncapped entry
    assert fn.log[-1][0] == "normal" and fn.log[-1][3] == {"num_warps": 4, "num_stages": 2, "maxnreg": 128}
    fk((2,), (x, 32, 0.5), (64, True), 4, 2, maxnreg=128)
    assert fn.log[-1][0] == "direct" and fn.log[-1][1][:3] == (2, 1, 1)
    fk((1,), (x, 16, 0.5), (64, True), 4, 2, maxnreg=168)
    assert fn.log[-1][0] == "normal"
    assert fk.stats == {"fast": 1, "slow": 3}


def test_replay_of_a_register_capped_launch(mocked_launches):
    from dsv4_ops import _host_plan

    fk = next(iter(_launch._REGISTRY.values()))
    log = mocked_launches

    def launcher(x):
        out = torch.empty((2,), dtype=x.dtype)
        fk((3,), (x, out, 5), (True,), 4, 2, maxnreg=128)
        return out

    f = _host_plan.planned(launcher)
    for i in range(4):
        x = torch.zeros(4)
        del log[:]
        f(x)
        assert [_canon(e, (x,)) for e in log] == [(fk.name, (3, 1, 1), (("in", 0), ("alloc", (2,), (1,),
                                                                                   torch.float32), 5, True))]
    plan = next(p for p in f.plans.values() if isinstance(p, _host_plan._Plan))
    assert plan.fast is not None and _host_plan.STATS["replay"] >= 2


def _op_inputs(name, T, H, seed):
    g = torch.Generator().manual_seed(seed)
    q, cc, topk, tl, bs, cw, swa, sl, _, sink, scale, _, out = _fused_inputs(T, H, 40, 9, seed=seed)
    ws = torch.empty(T * 49, 512, dtype=torch.bfloat16)
    idx = torch.randint(-1, T * 49, (T, 49), generator=g, dtype=torch.int32)
    s = 3
    o_part = torch.randn(T, H, s, 512, generator=g)
    lse_part = torch.randn(T, H, s, generator=g)
    return {
        "sparse_mla_split": (q, ws, idx, None, scale, s),
        "merge_splits": (o_part, lse_part, sink),
        "merge_splits_out": (o_part, lse_part, sink, out),
        "sparse_mla_decode": (q, ws, idx, None, sink, scale, 0),
        "sparse_mla_decode_out": (q, ws, idx, None, sink, scale, 0, out),
        "dsv4_decode_indices": (topk, tl, swa, cc.shape[0] * bs, cw.shape[0] * bs),
        "dsv4_decode_gather": (cc, topk, tl, bs, cw, swa, sl, bs, ws),
    }[name]


@pytest.mark.parametrize("name", ["sparse_mla_split", "merge_splits", "merge_splits_out", "sparse_mla_decode",
                                  "sparse_mla_decode_out", "dsv4_decode_indices", "dsv4_decode_gather"])
@pytest.mark.parametrize("T,H", [(1, 8), (3, 64)])
def test_every_planned_decode_op_replays_its_launchers_launches(mocked_launches, name, T, H):
    """The other decode ops with recorded plans: on fresh inputs, from the third call a replay, and
    every call launches what the op's own launcher (``__wrapped__``) launches; tuple results too.
    dsv4_decode_indices clamps the lengths with a torch kernel every call: its recording is
    refused and the launcher keeps running (same launches)."""
    replays = name != "dsv4_decode_indices"
    from dsv4_ops import _host_plan
    from dsv4_ops.registration import library

    impl = library._DEFINED[name].cuda
    log = mocked_launches
    for call in range(4):
        args = _op_inputs(name, T, H, seed=call)
        del log[:]
        r0 = _host_plan.STATS["replay"]
        got = impl(*args)
        replayed = _host_plan.STATS["replay"] - r0
        got_launches = [_canon(e, args) for e in log]
        del log[:]
        want = impl.__wrapped__(*args)
        assert got_launches == [_canon(e, args) for e in log] and got_launches, f"call {call}"
        got_t = got if isinstance(got, tuple) else (got,)
        want_t = want if isinstance(want, tuple) else (want,)
        assert [(type(x), tuple(x.shape), x.stride(), x.dtype) for x in got_t] == \
            [(type(x), tuple(x.shape), x.stride(), x.dtype) for x in want_t]
        assert [any(x is a for a in args) for x in got_t] == [any(x is a for a in args) for x in want_t]
        assert replayed == (replays and call >= 2), f"call {call}"
    if not replays:
        assert _host_plan._REFUSED in impl.plans.values()
