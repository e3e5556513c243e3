"""Every cache of a plan, a recorded launch, a table lookup or a device fact, driven one input at
a time: two calls that differ in exactly one input the cached result depends on, each order, and
the cached answer must be the one computed afresh for that input (never the other input's).

Caches covered: the recorded launch plans (``_host_plan.planned``: a synthetic launcher whose
result encodes every fact its key must hold, then the paged decode op's own launcher with a
mocked launch), ``_host_plan.env_memo``, the SM count and shared memory of ``dispatch.device``
(device index 0, 1 and -1, DSV4_AMPERE_SMS), the kernel variant of ``dispatch.variant``, the
decode tables' lookups (``dispatch.tables``), the decode plan memos of ``dispatch.decode`` / ``dispatch.workspace`` and
``dispatch.indexer``, and the warm set's file key (``vllm.warm_common.cache_key``).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace as NS

import pytest
import torch

from dsv4_ops import _host_plan, _launch, envs
from dsv4_ops.dispatch import device as ddev

from test_host_cost import _fused_inputs, mocked_launches  # noqa: F401  (fixture reused)

ORDERS = ("ab", "ba")


# ---- the recorded launch plans: a launcher that decides from every part of the key ------------

class _OnDevice(torch.Tensor):
    """A CPU tensor that reports a CUDA device index (the key's and the launcher's get_device())."""

    index = -1

    def get_device(self):
        return self.index


def _on(t: torch.Tensor, index: int) -> _OnDevice:
    x = torch.Tensor._make_subclass(_OnDevice, t)
    x.index = index
    return x


TEST_ENV = "DSV4_AMPERE_TEST_CACHE_KEYS"
_CODES: dict = {}


def _decision(x, n) -> int:
    """What the synthetic launcher decides from: every fact the plan key claims to hold."""
    fact = (tuple(x.shape), x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, x.storage_offset() & 15,
            type(n).__name__, n, torch._C._cuda_getDevice(), envs.raw(envs.SMS) if envs.is_set(envs.SMS) else None,
            os.environ.get(TEST_ENV), envs.override_key())
    return _CODES.setdefault(fact, len(_CODES) + 1)


def _launcher(x, n):
    return torch.empty((_decision(x, n),))


def _frombuffer_at(align: int, count: int = 16) -> torch.Tensor:
    """float32 [count] at storage offset 0 whose address is ``align`` (mod 16)."""
    buf = bytearray(count * 4 + 64)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr() & 15
    return torch.frombuffer(buf, dtype=torch.float32, offset=(align - base) % 16 + 16, count=count)


def _flip(name, monkeypatch):
    """(input a, input b, setup a, setup b): one fact of the launcher's key differs."""
    base = torch.zeros(64)
    none = lambda: None  # noqa: E731
    if name == "shape":
        return (base[:16], 1), (base[:32], 1), none, none
    if name == "strides":
        t = torch.zeros(16, 4)
        return (t[::2].contiguous(), 1), (t[::2], 1), none, none  # both [8, 4]
    if name == "dtype":
        return (base[:16], 1), (base[:16].view(torch.int32), 1), none, none
    if name == "device index 0 vs 1":
        return (_on(base[:16], 0), 1), (_on(base[:16], 1), 1), none, none
    if name == "device index 0 vs cpu":
        return (_on(base[:16], 0), 1), (_on(base[:16], -1), 1), none, none
    if name == "alignment":
        return (_frombuffer_at(0), 1), (_frombuffer_at(8), 1), none, none  # storage offset 0 both
    if name == "storage offset":
        d = torch.zeros(64, dtype=torch.float64)
        return (d[:16], 1), (d[2:18], 1), none, none  # addresses 16 bytes apart: same alignment
    if name == "scalar value":
        return (base[:16], 1), (base[:16], 2), none, none
    if name == "scalar class":
        return (base[:16], 1), (base[:16], True), none, none
    if name == "current device":
        return ((base[:16], 1), (base[:16], 1),
                lambda: monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False),
                lambda: monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False))
    if name == "override":
        return ((base[:16], 1), (base[:16], 1), lambda: monkeypatch.setattr(envs, "_OVERRIDE_KEY", ()),
                lambda: monkeypatch.setattr(envs, "_OVERRIDE_KEY", (("x", "1"),)))
    if name == "knob":
        return ((base[:16], 1), (base[:16], 1), lambda: monkeypatch.setenv(envs.SMS, "108"),
                lambda: monkeypatch.setenv(envs.SMS, "84"))
    if name == "env var":
        return ((base[:16], 1), (base[:16], 1), lambda: monkeypatch.setenv(TEST_ENV, "a"),
                lambda: monkeypatch.setenv(TEST_ENV, "b"))
    raise KeyError(name)


FLIPS = ["shape", "strides", "dtype", "device index 0 vs 1", "device index 0 vs cpu", "alignment", "storage offset",
         "scalar value", "scalar class", "current device", "override", "knob", "env var"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flip", FLIPS)
def test_recorded_plan_key_holds_each_input(mocked_launches, monkeypatch, flip, order):  # noqa: F811
    """A launcher recorded (run, record, replay) on one input, then called on an input that differs
    in one fact only: its result is the launcher's own for that input, never the replayed plan of
    the other; then back to the first (its plan still serves it)."""
    monkeypatch.setattr(_host_plan, "_ENV_KEYS", list(_host_plan._ENV_KEYS))
    monkeypatch.delenv(TEST_ENV, raising=False)
    monkeypatch.delenv(envs.SMS, raising=False)
    a, b, set_a, set_b = _flip(flip, monkeypatch)
    f = _host_plan.planned(_launcher)
    first, second = ((a, set_a), (b, set_b)) if order == "ab" else ((b, set_b), (a, set_a))
    seen = []
    for args, setup in (first, second, first):
        setup()
        want = _decision(*args)
        r0 = _host_plan.STATS["replay"]
        for _ in range(3):  # run, record (or replay when kept), replay
            assert f(*args).shape == (want,), (flip, order)
        assert _host_plan.STATS["replay"] > r0, "the plan was never replayed: nothing tested"
        seen.append(want)
    assert seen[0] != seen[1], f"{flip}: the two inputs make the same decision (not a flip)"


# ---- the paged decode op's recorded plans: one layout fact at a time ---------------------------

def _spec_log(monkeypatch):
    """Like test_host_cost's mocked_launches, but each compiled stand-in remembers the argument
    specialization it was 'compiled' for (dtypes, 16-byte alignment, ints % 16 and == 1), and every
    launch logs whether the arguments it got have that specialization: a replay of a stale plan
    calls a compiled kernel of another specialization."""
    from dsv4_ops import attention, kv_cache  # noqa: F401  (fill the registry)

    log = []

    def spec(args):
        out = []
        for a in args:
            if isinstance(a, torch.Tensor):
                out.append((a.dtype, a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or a is None or isinstance(a, float):
                out.append(type(a))
            elif isinstance(a, int):
                out.append((a == 1, a % 16 == 0))
            else:
                out.append(a)
        return tuple(out)

    class Compiled:
        function, packed_metadata = "fn", ("meta",)

        def __init__(self, name, sp):
            self.name, self.sp = name, sp

        def run(self, gx, gy, gz, stream, function, packed, lm, enter, exit_, *args):
            log.append((self.name, (gx, gy, gz), args, spec(args) == self.sp))

    class Jit:
        params = None

        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **opts):
                g = tuple(grid) + (1,) * (3 - len(grid))
                log.append((self.name, g, args, True))
                return Compiled(self.name, spec(args))
            return launch

    for fk in list(_launch._REGISTRY.values()):
        monkeypatch.setattr(fk, "fn", Jit(fk.name))
        monkeypatch.setattr(fk, "jit", True)
        monkeypatch.setattr(fk, "cache", {})
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 77, raising=False)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_host_plan, "ENABLED", True)
    return log


def _canon(entry, inputs):
    name, grid, args, matches = entry
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            hit = [i for i, t in enumerate(inputs) if t is x]
            out.append(("in", hit[0], x.dtype) if hit else ("alloc", tuple(x.shape), x.stride(), x.dtype))
        else:
            out.append(x)
    return name, grid, tuple(out), matches


def _all_on(args, index):
    return tuple(_on(x, index) if isinstance(x, torch.Tensor) else x for x in args)


def _paged_flip(name, monkeypatch):
    """(inputs a, inputs b, setup a, setup b) of dsv4_decode_fused_out differing in one fact."""
    none = lambda: None  # noqa: E731
    a = _fused_inputs(1, 8, 512, 128)
    if name == "q strides":  # same shape [1, 8, 512], the heads 1024 apart
        q = torch.randn(1, 8, 1024).to(torch.bfloat16)[:, :, :512]
        return a, (q,) + a[1:], none, none
    if name == "out strides":
        out = torch.empty(1, 8, 1024, dtype=torch.bfloat16)[:, :, :512]
        return a, a[:12] + (out,), none, none
    if name == "page stride":  # the compressed cache's pages 16 bytes further apart, same shape
        cc = a[1]
        wide = torch.zeros(cc.shape[0], cc.shape[1] + 16, dtype=torch.uint8)[:, :cc.shape[1]]
        return a, a[:1] + (wide,) + a[2:], none, none
    if name == "cache alignment":
        return a, _fused_inputs(1, 8, 512, 128, offset=8), none, none
    if name == "slot dtype":
        b = list(a)
        b[2] = a[2].to(torch.int64)
        return a, tuple(b), none, none
    if name == "lengths dtype":
        b = list(a)
        b[3] = a[3].to(torch.int64)
        b[2] = a[2].to(torch.int64)
        b[6] = a[6].to(torch.int64)
        b[7] = a[7].to(torch.int64)
        return a, tuple(b), none, none
    if name == "block size":
        cc = a[1]
        b = list(a)
        b[4] = 32  # the compressed cache's block size: its pages hold 32 tokens (a larger page stride)
        from dsv4_ops.layout import min_page_bytes

        b[1] = torch.zeros(cc.shape[0], min_page_bytes(32), dtype=torch.uint8)
        return a, tuple(b), none, none
    if name == "SM count":  # the knob steers a CUDA tensor's plan (a CPU tensor plans for NO_DEVICE_SMS)
        a = _all_on(a, 0)
        return (a, a, lambda: monkeypatch.setenv(envs.SMS, "132"), lambda: monkeypatch.setenv(envs.SMS, "16"))
    if name == "device SMs, device 0":  # no knob: the device's own count, device 0 vs a CPU tensor
        return _all_on(a, 0), a, none, none
    if name == "decode config knob":  # T = 1, H = 8 plans h16n16w4 (paged_chunk128); forced: paged_f16dot
        return (a, a, lambda: monkeypatch.delenv(envs.DECODE_CONFIG, raising=False),
                lambda: monkeypatch.setenv(envs.DECODE_CONFIG, "kh16n32w4"))
    raise KeyError(name)


PAGED_FLIPS = ["q strides", "out strides", "page stride", "cache alignment", "slot dtype", "lengths dtype",
               "block size", "SM count", "device SMs, device 0", "decode config knob"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flip", PAGED_FLIPS)
def test_paged_op_plan_follows_each_layout_fact(monkeypatch, flip, order):
    """dsv4_decode_fused_out's recorded plans: layout a recorded and replayed, then b (one fact
    changed), then a again; each call launches exactly what the launcher itself launches for its
    inputs, through a compiled kernel of its arguments' specialization, and a and b launch
    differently (the fact decides something)."""
    from dsv4_ops.registration import library

    log = _spec_log(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(8, 163 * 1024))  # few SMs: fewer splits than a CPU plan
    monkeypatch.setattr(ddev, "_SMEM", {})
    ddev._device_sms.cache_clear()
    _host_plan.clear()
    monkeypatch.setattr(_host_plan, "_ENV_KEYS", list(_host_plan._ENV_KEYS))
    monkeypatch.delenv(envs.SMS, raising=False)
    impl = library.cuda_impl("dsv4_decode_fused_out")
    a, b, set_a, set_b = _paged_flip(flip, monkeypatch)
    first, second = ((a, set_a), (b, set_b)) if order == "ab" else ((b, set_b), (a, set_a))
    wants = []
    try:
        for args, setup in (first, second, first):
            setup()
            del log[:]
            impl.__wrapped__(*args)
            want = [_canon(e, args) for e in log]
            wants.append(want)
            r0 = _host_plan.STATS["replay"]
            for call in range(3):
                del log[:]
                impl(*args)
                got = [_canon(e, args) for e in log]
                assert got == want, (flip, order, call)
                assert all(m for *_, m in got), f"{flip}: a launch through another specialization's kernel"
            assert _host_plan.STATS["replay"] > r0
    finally:
        _host_plan.clear()
        ddev._device_sms.cache_clear()
    assert wants[0] != wants[1], f"{flip}: a and b launch the same (not a flip)"


# ---- env_memo: its arguments, the overrides and the variables it read ---------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flip", ["argument", "override", "variable"])
def test_env_memo_follows_each_input(monkeypatch, flip, order):
    calls = []

    def read(x):
        calls.append(x)
        return (x, envs.raw(envs.SMS), envs.override_key())

    f = _host_plan.env_memo(read)
    monkeypatch.delenv(envs.SMS, raising=False)
    states = {
        "argument": ((1, lambda: None), (2, lambda: None)),
        "override": ((1, lambda: monkeypatch.setattr(envs, "_OVERRIDE_KEY", ())),
                     (1, lambda: monkeypatch.setattr(envs, "_OVERRIDE_KEY", (("k", "v"),)))),
        "variable": ((1, lambda: monkeypatch.setenv(envs.SMS, "108")), (1, lambda: monkeypatch.setenv(envs.SMS, "84"))),
    }[flip]
    seq = states if order == "ab" else states[::-1]
    got = []
    for x, setup in seq + seq[:1]:
        setup()
        assert f(x) == read.__call__(x)
        assert f(x) == f(x)
        got.append(f(x))
    assert got[0] != got[1] and got[0] == got[2]


# ---- dispatch.device: the SM count and shared memory of device 0, 1 and no device --------------

class _Props:
    def __init__(self, sms, smem):
        self.multi_processor_count, self.shared_memory_per_block_optin = sms, smem


DEVICES = {0: _Props(84, 99 * 1024), 1: _Props(132, 227 * 1024)}  # an A40 and an H200: neither NO_DEVICE_SMS


@pytest.fixture
def two_devices(monkeypatch):
    asked = []

    def props(i):
        asked.append(i)
        return DEVICES[int(i)]

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ddev, "_SMEM", {})
    monkeypatch.delenv(envs.SMS, raising=False)
    ddev._device_sms.cache_clear()
    yield asked
    ddev._device_sms.cache_clear()


@pytest.mark.parametrize("order", ORDERS)
def test_sm_count_follows_the_device_index_including_0(two_devices, order):
    idx = (0, 1) if order == "ab" else (1, 0)
    for i in idx + idx:
        assert ddev.num_sms(i) == DEVICES[i].multi_processor_count
        assert ddev.num_sms_at(i) == DEVICES[i].multi_processor_count
    assert ddev.num_sms_at(-1) == ddev.NO_DEVICE_SMS
    assert set(two_devices) == {0, 1}


@pytest.mark.parametrize("order", ORDERS)
def test_sm_count_follows_the_knob(two_devices, monkeypatch, order):
    vals = ("64", None) if order == "ab" else (None, "64")
    for v in vals + vals:
        if v is None:
            monkeypatch.delenv(envs.SMS, raising=False)
        else:
            monkeypatch.setenv(envs.SMS, v)
        for i in (0, 1):
            assert ddev.num_sms(i) == (int(v) if v else DEVICES[i].multi_processor_count)
        # a CPU tensor (the interpreter) plans for NO_DEVICE_SMS whatever the knob says
        assert ddev.num_sms_at(-1) == ddev.NO_DEVICE_SMS


@pytest.mark.parametrize("order", ORDERS)
def test_shared_memory_follows_the_device_index(two_devices, monkeypatch, order):
    idx = (0, 1) if order == "ab" else (1, 0)
    for i in idx + idx:
        assert ddev.smem_per_block(i) == DEVICES[i].shared_memory_per_block_optin
        assert ddev.known_smem(i) == DEVICES[i].shared_memory_per_block_optin
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert ddev.smem_per_block(-1) == DEVICES[1].shared_memory_per_block_optin
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert ddev.smem_per_block(-1) == ddev.DEFAULT_SMEM_BYTES


def test_decode_plans_follow_the_devices_shared_memory(two_devices, monkeypatch):
    """The plan with smem -1 (the current device's) follows the current device: its memoised config
    choice keys on the resolved figure, not on -1."""
    from dsv4_ops.dispatch import decode as dd

    T, H, K, sms = 4, 64, 640, 108
    answers = {}
    for cur in (0, 1, 0, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda c=cur: c)
        smem = DEVICES[cur].shared_memory_per_block_optin
        got = dd.plan_step(T, H, K, sms, -1)
        assert got == dd.plan_step(T, H, K, sms, smem)
        assert got.config == dd._sm_config.__wrapped__(T, H, K, sms, smem, dd._window_config(T, H, K, smem)[0])[0]
        assert dd.v3_resident("kh16n32w4", -1) == dd.v3_resident("kh16n32w4", smem)
        answers.setdefault(cur, got)
        assert answers[cur] == got
    assert dd.v3_resident("kh16n32w4", DEVICES[0].shared_memory_per_block_optin) != \
        dd.v3_resident("kh16n32w4", DEVICES[1].shared_memory_per_block_optin)


# ---- dispatch.variant: the kernel variant a device runs ----------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flip", ["device index", "override"])
def test_kernel_variant_follows_device_and_override(monkeypatch, flip, order):
    from dsv4_ops.dispatch import variant as dv

    caps = {0: (8, 0), 1: (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[int(i)])
    monkeypatch.delenv(envs.IMPL, raising=False)
    dv._cuda_variant.cache_clear()
    try:
        if flip == "device index":
            states = [((0, "auto"), "portable"), ((1, "auto"), "native")]
        else:
            states = [((1, "auto"), "native"), ((1, "portable"), "portable")]
        seq = states if order == "ab" else states[::-1]
        for (index, impl), want in seq + seq:
            if impl == "auto":
                monkeypatch.delenv(envs.IMPL, raising=False)
            else:
                monkeypatch.setenv(envs.IMPL, impl)
            assert dv._cuda_variant(index, envs.raw(envs.IMPL)) == want
    finally:
        dv._cuda_variant.cache_clear()


# ---- dispatch.tables: the per-device decode tables ----------------------------------------------

def _table(device, sms, variant, entries):
    from dsv4_ops.dispatch import tables

    return {"format": tables.FORMAT, "device_name": tables.sanitize_device_name(device), "sms": sms,
            "variant": variant, "source": "test", "entries": entries}


def _write(folder, table):
    import json

    from dsv4_ops.dispatch import tables

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / tables.file_name(table["device_name"], table["sms"], table["variant"])
    path.write_text(json.dumps(table))
    return path


A100_SMEM, A10_SMEM = 163 * 1024, 99 * 1024


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("flip", ["device name", "sms", "variant", "shared memory", "user dir", "T", "H", "K",
                                  "tables knob"])
def test_table_lookup_follows_each_input(tmp_path, monkeypatch, flip, order):
    """lookup_for (device name, SMs, variant, shared memory, the user directory, T, H, K, the
    tables knob) with one input changed: each answer is the one the files give for it."""
    from dsv4_ops.dispatch import tables

    monkeypatch.setattr(tables, "SHIPPED_DIR", str(tmp_path / "none"))
    monkeypatch.setenv(envs.DECODE_TABLES, "1")
    one = {"640": {"1,8": {"config": "h16n32w4", "splits": 2}, "2-4,8": {"config": "h16n32w4", "splits": 4},
                   "1,16": {"config": "kh16n32w4", "splits": 3}},
           "1024": {"1,8": {"config": "h16n32w4", "splits": 5}}}
    two = {"640": {"1,8": {"config": "kh32n64w8", "splits": 6}}}  # kh32n64w8: 108544 bytes, not on an A10
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    _write(d1, _table("DevA", 108, "portable", one))
    _write(d1, _table("DevB", 108, "portable", two))
    _write(d1, _table("DevA", 84, "portable", two))
    _write(d1, _table("DevA", 108, "native", two))
    _write(d2, _table("DevA", 108, "portable", two))
    base = dict(device_name="DevA", variant="portable", smem=A100_SMEM, T=1, H=8, K=640, sms=108)
    other = {"device name": dict(device_name="DevB"), "sms": dict(sms=84), "variant": dict(variant="native"),
             "shared memory": None, "user dir": None, "T": dict(T=3), "H": dict(H=16), "K": dict(K=1024),
             "tables knob": None}[flip]

    def state(which):
        kw = dict(base)
        monkeypatch.setenv(envs.DECODE_TABLE_DIR, str(d1))
        monkeypatch.setenv(envs.DECODE_TABLES, "1")
        if which == "b":
            if flip == "user dir":
                monkeypatch.setenv(envs.DECODE_TABLE_DIR, str(d2))
            elif flip == "tables knob":
                monkeypatch.setenv(envs.DECODE_TABLES, "0")
            elif flip == "shared memory":
                kw.update(device_name="DevB", smem=A100_SMEM)
            else:
                kw.update(other)
        elif flip == "shared memory":
            kw.update(device_name="DevB", smem=A10_SMEM)
        return kw

    def fresh(kw):
        if not envs.get(envs.DECODE_TABLES):
            return None
        path = tables.find(kw["device_name"], kw["sms"], kw["variant"])
        if path is None:
            return None
        for lo, hi, e in tables.load(path, kw["smem"]).get(kw["K"], {}).get(kw["H"], ()):
            if lo <= kw["T"] <= hi:
                return e
        return None

    tables.clear()
    seq = ("a", "b", "a", "b") if order == "ab" else ("b", "a", "b", "a")
    answers = {}
    try:
        for which in seq:
            kw = state(which)
            try:
                want = fresh(kw)
            except tables.TableError as exc:
                want = type(exc)
            try:
                got = tables.lookup_for(kw["device_name"], kw["variant"], kw["smem"], kw["T"], kw["H"], kw["K"],
                                        kw["sms"])
            except tables.TableError as exc:
                got = type(exc)
            assert got == want, (flip, which)
            answers[which] = got
    finally:
        tables.clear()
    assert answers["a"] != answers["b"], f"{flip}: not a flip"


# ---- dispatch.decode / dispatch.indexer memos: each argument decides ----------------------------

def _memo_cases():
    from dsv4_ops.dispatch import decode as dd
    from dsv4_ops.dispatch import indexer as di
    from dsv4_ops.dispatch import workspace as ws

    return {
        "_plan": (ws._plan, dict(T=8, H=8, K=8192, sms=108, kernel_mode="heads", splits=0),
                  dict(T=[64], H=[64], K=[32], sms=[4], kernel_mode=["tiles"], splits=[3])),
        "_sm_config": (dd._sm_config, dict(T=64, H=64, K=640, sms=108, smem=A100_SMEM, window="h16n32w4"),
                       dict(T=[1], H=[8], K=[64], sms=[16], smem=[A10_SMEM], window=["h16n16w4"])),
        "tile_splits_cached": (ws.tile_splits_cached, dict(T=1, H=8, K=640), dict(T=[256], H=[128], K=[65536])),
        "wave_plan": (di.wave_plan, dict(rows=64, tiles=512, slots=216), dict(rows=[4], tiles=[64], slots=[132])),
    }


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["_plan", "_sm_config", "tile_splits_cached", "wave_plan"])
def test_dispatch_memos_follow_each_argument(name, order):
    """Each memoised plan with one argument changed gives what its uncached function computes, and
    that argument changes the answer at these values (each is a real input of the plan)."""
    fn, base, alts = _memo_cases()[name]
    fn.cache_clear()
    for arg, values in alts.items():
        for v in values:
            b = dict(base, **{arg: v})
            seq = (base, b) if order == "ab" else (b, base)
            got = [fn(**kw) for kw in seq + seq]
            want = [fn.__wrapped__(**kw) for kw in seq + seq]
            assert got == want, (name, arg)
            assert want[0] != want[1], f"{name}: {arg}={v} decides nothing here (pick another value)"


# ---- the warm set's file key -------------------------------------------------------------------

def test_warm_set_file_key_holds_each_input(monkeypatch):
    """The cached set's file name changes with every field of the model shapes, the batch limit,
    the SM count, the variant, the mode and every DSV4_AMPERE_* setting (but not the cache
    directory itself), and stays when nothing changes."""
    from dsv4_ops.vllm import warm_common as wc
    from dsv4_ops.vllm import warm_set as ws

    for k in list(os.environ):
        if k.startswith(envs.PREFIX):
            monkeypatch.delenv(k)
    shapes = ws.v4_flash(tp=2)
    base = dict(shapes=shapes, max_tokens=8192, sms=108, variant="portable", mode="auto")
    k0 = wc.cache_key(**base)
    assert wc.cache_key(**base) == k0
    seen = {k0}
    for f in dataclasses.fields(shapes):
        v = getattr(shapes, f.name)
        if isinstance(v, bool):
            nv = not v
        elif isinstance(v, int):
            nv = v + 1
        elif isinstance(v, tuple):
            nv = v + (v[-1] if v else 1,)
        elif isinstance(v, str):
            nv = v + "x"
        else:
            nv = None if v is not None else 1
        key = wc.cache_key(**dict(base, shapes=dataclasses.replace(shapes, **{f.name: nv})))
        assert key not in seen, f"shapes.{f.name}"
        seen.add(key)
    for arg, v in (("max_tokens", 4096), ("sms", 132), ("variant", "native"), ("mode", "tiles")):
        key = wc.cache_key(**dict(base, **{arg: v}))
        assert key not in seen, arg
        seen.add(key)
    for name, knob in envs.KNOBS.items():
        if name == envs.WARM_SET_CACHE:
            continue
        value = knob.default or "1"
        for cand in ("0", "1", "2", "64", "portable", "tiles"):
            try:
                knob.parse(cand)
            except Exception:  # noqa: BLE001 - not a legal value of this knob
                continue
            value = cand
            break
        monkeypatch.setenv(name, value)
        key = wc.cache_key(**base)
        assert key not in seen, name
        seen.add(key)
        monkeypatch.delenv(name)
    assert wc.cache_key(**base) == k0
    monkeypatch.setenv(envs.WARM_SET_CACHE, "/tmp/elsewhere")
    assert wc.cache_key(**base) == k0  # where the set is kept is not what it holds
