"""The low-overhead launch path (dsv4_ops._launch) and the host-cost shape of a decode step.

CPU: the cache key is at least as fine as Triton's own specialization (checked against
triton's native specialize_impl), and FastKernel's hit / miss / fallback logic with a fake
compiled kernel (no GPU). GPU: a warmed decode step makes exactly 3 launches, all direct.
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
    from dsv4_ops.csrc_triton import codec as ck, kv_cache as kk, merge as mk, sparse_mla as sk

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
def test_gpu_decode_step_is_three_direct_launches(variant, T, H):
    from test_decode_v2 import gpu_composite_args

    from dsv4_ops import dsv4_decode

    args = gpu_composite_args(T, H, seed=T)
    for _ in range(2):
        dsv4_decode.dsv4_decode_attention(**args)
    torch.cuda.synchronize()
    before = {id(k): dict(k.stats) for k in _launch._REGISTRY.values()}
    dsv4_decode.dsv4_decode_attention(**args)
    fast = sum(k.stats["fast"] - before[id(k)]["fast"] for k in _launch._REGISTRY.values())
    slow = sum(k.stats["slow"] - before[id(k)]["slow"] for k in _launch._REGISTRY.values())
    assert (fast, slow) == (3, 0)
