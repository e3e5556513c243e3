"""Eager host cost of the DSv4 decode step as vLLM calls it, and of every op on its path (issues 12, 17).

    python benchmarks/bench_host_cost.py --out DIR [--quick] [--variants portable,native]
    python benchmarks/bench_host_cost.py --mock [--out DIR]   # CPU: Python cost only (launches mocked)

vLLM 0.33.0 replays uniform decode batches as one FULL CUDA graph (no host cost) and runs the
attention region eagerly for mixed prefill + decode batches, so there every layer pays the
host cost of our calls every step. Rows, at T in {1, 4} x H in {8, 64}:

- ``step: plugin entry [kind]``: ``_AmpereAttentionMixin._forward_decode`` (the function vLLM's
  DeepseekV4 attention calls per layer per step) on a stand-in layer (an ``nn.Module`` with the
  sink as a Parameter, vLLM's 3-D page views, [T, 1, K] slots): kind ``c128a`` (top-k
  precomputed by vLLM's metadata builder) and ``swa_only``;
- ``step: composite``: ``dsv4_decode_attention(..., out=)`` as ``ampere_decode`` calls it;
- every op of the default path through ``torch.ops`` (``dsv4_decode_fused_out``: what auto runs at
  T = 1 and H <= 16; ``dsv4_decode_gather`` + ``sparse_mla_decode_out``: the workspace step);
- floors: a tiny torch add (one op hop + one allocation + one launch), ``torch.empty``, an
  empty Triton kernel launched through ``dsv4_ops._launch`` (one direct launch).

Columns: ``launches`` (Triton launches a call makes), ``kernels`` (which), ``fast`` / ``slow``
(FastKernel direct / normal launches during the timed loop: slow should be 0), ``replay``
(calls served by ``dsv4_ops._host_plan``'s recorded plans or the composite's kept plans during
the timed loop),
``eager_us`` (N eager calls back to back, one synchronize at the end, per call, best of 3),
``eager_slow_launch_us`` (steps only: the same with the direct launch and the plan replay off,
every launch through ``kernel[grid](...)``), ``graph_us`` (in a CUDA graph, 20 calls a replay),
``eager/graph``. The step rows of the paged op run the composite's kept plans
(``dsv4_decode._kept_step``: one plan per layout, partials in per-stream scratch, the plugin's lse
dropped), counted in ``replay`` with the ops' recorded-plan replays. Goals (H200 host): whole step
at T = 1, H = 8 <= 40 us eager; no op above 25 us.

``--mock`` (no GPU needed): CPU tensors, every Triton launch replaced by a no-op compiled
kernel (the direct path is exercised: key, cache hit, ``run``), and every dsv4_ampere op's CPU
kernel replaced by its CUDA kernel for the run, so the op hop, the composite and the plugin entry
are timed as they run on a GPU, minus the C launcher and the CUDA allocator.

Writes host_cost.{json,md} under DIR (--mock: host_cost_mock.{json,md}).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, time_graph_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import _launch, dsv4_decode  # noqa: E402
from dsv4_ops.layout import RECORD_BYTES, min_page_bytes  # noqa: E402

try:  # the replayed launch plans; absent in older trees
    from dsv4_ops import _host_plan  # noqa: E402
except ImportError:  # pragma: no cover
    _host_plan = None

D = 512
SM_SCALE = D ** -0.5
K1, K2, BS = 512, 128, 64
SHAPES = ((1, 8), (1, 64), (4, 8), (4, 64))
GOALS = "Goals (H200 host): whole step at T = 1, H = 8 <= 40 us eager; no op above 25 us."


def eager_us(fn, n: int, sync, clock=time.perf_counter, reps: int = 3) -> float:
    """us per call of n back-to-back eager calls, synchronised once at the end (best of reps)."""
    for _ in range(10):
        fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (clock() - t0) / n * 1e6)
    return best


def _stats():
    return {id(k): (k, k.stats["fast"], k.stats["slow"]) for k in _launch._REGISTRY.values()}


def _replays() -> int:
    """Calls served by a plan: the ops' recorded replays and the composite's kept plans."""
    return _host_plan.STATS["replay"] + _host_plan.STATS.get("kept", 0) if _host_plan is not None else 0


def launch_info(fn):
    """(launches per call, the launched kernels' names) of one warmed call."""
    fn()
    before = _stats()
    fn()
    names, n = [], 0
    for key, (k, f, s) in _stats().items():
        d = f + s - (before[key][1] + before[key][2] if key in before else 0)
        if d:
            n += d
            name = getattr(k, "name", None) or getattr(getattr(k.fn, "fn", k.fn), "__name__", "?")
            names.append(name.lstrip("_").replace("_kernel", "") + (f" x{d}" if d > 1 else ""))
    return n, ", ".join(sorted(names))


def timed(fn, n: int, sync, **kw) -> dict:
    """eager_us with the FastKernel fast / slow launches and plan replays counted over the loop."""
    before, r0 = _stats(), _replays()
    us = eager_us(fn, n, sync, **kw)
    after = _stats()
    fast = sum(f - before.get(k, (None, 0, 0))[1] for k, (_, f, _s) in after.items())
    slow = sum(s - before.get(k, (None, 0, 0))[2] for k, (_, _f, s) in after.items())
    return {"eager_us": us, "fast": fast, "slow": slow, "replay": _replays() - r0}


def make_case(T, H, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk_c, nblk_w = 256, 64
    caches = [torch.zeros(nb, min_page_bytes(BS), dtype=torch.uint8, device=device) for nb in (nblk_c, nblk_w)]
    for c in caches:  # random bytes; scale rows in a sane range (values only matter for speed)
        c.copy_(torch.randint(0, 120, c.shape, generator=g, dtype=torch.uint8).to(device))
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device)
    sink = torch.randn(H, generator=g).to(device)
    topk = torch.randint(0, nblk_c * BS, (T, K1), generator=g, dtype=torch.int32).to(device)
    swa = torch.randint(0, nblk_w * BS, (T, K2), generator=g, dtype=torch.int32).to(device)
    lens = torch.full((T,), K1, dtype=torch.int32, device=device)
    swa_lens = torch.full((T,), K2, dtype=torch.int32, device=device)
    ws = torch.empty(T * (K1 + K2), D, dtype=torch.bfloat16, device=device)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    return dict(q=q, cc=caches[0], cw=caches[1], sink=sink, topk=topk, swa=swa, lens=lens, swa_lens=swa_lens,
                ws=ws, out=out)


# ---- the plugin entry on a stand-in vLLM layer -------------------------------------------------

_FAKE_V4 = "dsv4_bench_v4.nvidia.flashmla"  # a V4 module name (not deepseek_v41): C128A reads the metadata


def plugin_call(c, kind: str):
    """A zero-argument call of the Ampere ``_forward_decode`` on a stand-in vLLM layer.

    The layer is an nn.Module (the sink an nn.Parameter, the window cache on a sub-module), the
    caches vLLM's 3-D page views, the slots [T, 1, K] int32 with lengths, the metadata plain
    objects (vLLM's are dataclasses): attribute reads cost what they cost in vLLM."""
    from dsv4_ops.vllm import attention as vattn

    T = c["q"].shape[0]
    base = types.new_class("FakeFlashMLA")
    base.__module__ = _FAKE_V4

    class _SWACache(torch.nn.Module):
        def __init__(self, kv):
            super().__init__()
            self.kv_cache = kv

    class _Layer(vattn._AmpereAttentionMixin, torch.nn.Module):
        _dsv4_ampere_base = base

        def __init__(self):
            torch.nn.Module.__init__(self)
            self.attn_sink = torch.nn.Parameter(c["sink"].float(), requires_grad=False)
            self.swa_cache_layer = _SWACache(c["cw"].view(c["cw"].shape[0], BS, RECORD_BYTES))
            self.scale = SM_SCALE
            self.compress_ratio = 1 if kind == "swa_only" else 128
            self.topk_indices_buffer = None

    layer = _Layer()
    swa_meta = types.SimpleNamespace(num_decodes=T, num_decode_tokens=T, block_size=BS,
                                     decode_swa_indices=c["swa"].view(T, 1, K2), decode_swa_lens=c["swa_lens"],
                                     is_valid_token=None, token_to_req_indices=None)
    attn_meta = types.SimpleNamespace(block_size=BS * 128, block_table=None,
                                      c128a_global_decode_topk_indices=c["topk"].view(T, 1, K1),
                                      c128a_decode_topk_lens=c["lens"])
    kv = c["cc"].view(c["cc"].shape[0], BS, RECORD_BYTES)
    q, out = c["q"], c["out"]
    fwd = vattn._AmpereAttentionMixin._forward_decode
    if kind == "swa_only":
        return lambda: fwd(layer, q, None, swa_meta, None, True, out)
    return lambda: fwd(layer, q, kv, swa_meta, attn_meta, False, out)


def step_calls(c):
    """The whole decode step: through the plugin's entry and through the composite."""
    q, cc, cw, sink, topk, swa, lens, swa_lens, out = (c[k] for k in ("q", "cc", "cw", "sink", "topk", "swa", "lens",
                                                                       "swa_lens", "out"))
    return {
        "step: plugin entry [c128a]": plugin_call(c, "c128a"),
        "step: plugin entry [swa_only]": plugin_call(c, "swa_only"),
        "step: composite (out=)": lambda: dsv4_decode.dsv4_decode_attention(
            q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS, topk_length=lens, swa_length=swa_lens, out=out),
        "step: composite (allocates out)": lambda: dsv4_decode.dsv4_decode_attention(
            q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS, topk_length=lens, swa_length=swa_lens),
    }


def op_calls(c):
    """name -> zero-argument callable: the ops of the default decode paths, through torch.ops."""
    ops = torch.ops.dsv4_ampere
    q, cc, cw, sink, topk, swa, lens, swa_lens, ws, out = (c[k] for k in ("q", "cc", "cw", "sink", "topk", "swa",
                                                                           "lens", "swa_lens", "ws", "out"))
    idx = ops.dsv4_decode_gather(cc, topk, lens, BS, cw, swa, swa_lens, BS, ws)
    return {
        "op dsv4_decode_fused_out": lambda: ops.dsv4_decode_fused_out(q, cc, topk, lens, BS, cw, swa, swa_lens, BS,
                                                                      sink, SM_SCALE, 0, out),
        "op dsv4_decode_gather": lambda: ops.dsv4_decode_gather(cc, topk, lens, BS, cw, swa, swa_lens, BS, ws),
        "op sparse_mla_decode_out": lambda: ops.sparse_mla_decode_out(q, ws, idx, None, sink, SM_SCALE, 0, out),
        "op e4m3_decode[16 B]": lambda: ops.e4m3_decode(cc[0, :16]),
    }


def floor_calls(c, device):
    q = c["q"]
    tiny = q[0, 0, :16]
    calls = {"floor: torch add (16 elements)": lambda: tiny.add(tiny),
             "floor: torch.empty [T,H]": lambda: torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32,
                                                             device=q.device)}
    k = _empty_kernel()
    if k is not None:
        calls["floor: one direct launch (empty kernel, 4 args)"] = lambda: k((1,), (q, 1.0, 16, 640), (), 1, 1)
    return calls


_EMPTY = []


def _empty_kernel():
    """A FastKernel of a kernel that does nothing (the launch floor), or None without triton."""
    if not _EMPTY:
        try:
            import triton

            @triton.jit
            def _host_cost_empty_kernel(x_ptr, scale, n, m):
                pass

            _EMPTY.append(_launch.fast(_host_cost_empty_kernel))
        except Exception:  # noqa: BLE001
            _EMPTY.append(None)
    return _EMPTY[0]


@contextlib.contextmanager
def direct_launch_off():
    saved = _launch.ENABLED
    _launch.ENABLED = False
    hp = _host_plan.ENABLED if _host_plan is not None else None
    if _host_plan is not None:
        _host_plan.ENABLED = False
    try:
        yield
    finally:
        _launch.ENABLED = saved
        if _host_plan is not None:
            _host_plan.ENABLED = hp


def bench_gpu(args, variants):
    rows = []
    n = 200 if args.quick else 500
    sync = torch.cuda.synchronize
    for v in variants:
        os.environ["DSV4_AMPERE_IMPL"] = v
        for T, H in SHAPES:
            case = make_case(T, H, "cuda", seed=T + H)
            groups = [("floor", floor_calls(case, "cuda")), ("step", step_calls(case)), ("op", op_calls(case))]
            for group, calls in groups:
                for name, fn in calls.items():
                    row = {"variant": v, "T": T, "H": H, "what": name}
                    try:
                        row["launches"], row["kernels"] = launch_info(fn)
                        row.update(timed(fn, n, sync))
                        if group == "step":
                            with direct_launch_off():
                                row["eager_slow_launch_us"] = eager_us(fn, n // 2, sync)
                        if group != "floor" or name.startswith("floor: torch add"):
                            row["graph_us"] = time_graph_us(fn, 10 if args.quick else 20)
                            row["eager/graph"] = row["eager_us"] / row["graph_us"]
                    except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
                        row["error"] = repr(exc)[:160]
                        traceback.print_exc()
                    rows.append(row)
    os.environ.pop("DSV4_AMPERE_IMPL", None)
    write_results("host_cost", args.out, rows,
                  ["variant", "T", "H", "what", "launches", "kernels", "fast", "slow", "replay", "eager_us",
                   "eager_slow_launch_us", "graph_us", "eager/graph", "error"],
                  notes="eager_us: N eager calls back to back, one synchronize at the end, per call (best of 3). "
                        "fast / slow / replay: FastKernel direct / normal launches and replayed launch plans "
                        "(dsv4_ops._host_plan) during the timed loops (slow should be 0). eager_slow_launch_us: "
                        "the same with the direct launch and the replay off (kernel[grid](...) each launch). "
                        "graph_us: in a CUDA graph, 20 calls a replay. K1 = 512, K2 = 128, 64-slot pages of "
                        "584-byte records. " + GOALS)
    return rows


# ---- --mock: the Python cost on a CPU ----------------------------------------------------------

class _Compiled:
    function, packed_metadata = 0, ()

    @staticmethod
    def run(*a):
        return None


class _MockFn:
    """Stands in for a JITFunction: kernel[grid](...) 'launches' and returns a no-op compiled kernel."""

    params = None

    def __getitem__(self, grid):
        return lambda *a, **k: _Compiled()


@contextlib.contextmanager
def mocked_gpu():
    """CPU tensors through the CUDA code path: no-op Triton launches (the direct path taken), the
    CUDA device / stream queries stubbed, and every dsv4_ampere op's CPU kernel replaced by its
    CUDA kernel (restored on exit)."""
    from dsv4_ops.registration import library

    _empty_kernel()
    saved = {}
    for fk in list(_launch._REGISTRY.values()):
        saved[fk] = (fk.fn, fk.jit, dict(fk.cache))
        fk.fn, fk.jit = _MockFn(), True
        fk.cache.clear()
    get_dev, get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream = (lambda: 0), (lambda d: 0)
    lib = torch.library.Library(library.NAMESPACE, "IMPL")
    for name, op in library._DEFINED.items():
        lib.impl(name, op.cuda, "CPU")
    if _host_plan is not None:
        _host_plan.clear()
        direct_cpu = getattr(_host_plan, "DIRECT_CPU", None)
        _host_plan.DIRECT_CPU = True  # CPU tensors take the ops' CUDA kernels without the hop, as CUDA ones do
    try:
        yield
    finally:
        if _host_plan is not None:
            _host_plan.DIRECT_CPU = direct_cpu
        lib._destroy()
        torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream = get_dev, get_stream
        for fk, (fn, jit, cache) in saved.items():
            fk.fn, fk.jit = fn, jit
            fk.cache.clear()
            fk.cache.update(cache)
        if _host_plan is not None:
            _host_plan.clear()


def bench_mock(args):
    """CPU only: Python cost of the decode path with the Triton launch replaced by a no-op."""
    rows = []
    n = 500 if args.quick else 2000
    with mocked_gpu():
        for T, H in SHAPES:
            case = make_case(T, H, "cpu", seed=T + H)
            for group in (floor_calls(case, "cpu"), step_calls(case), op_calls(case)):
                for name, fn in group.items():
                    row = {"T": T, "H": H, "what": name}
                    try:
                        row["launches"], row["kernels"] = launch_info(fn)
                        # the thread's CPU time: a shared CPU box's other load does not count
                        t = timed(fn, n, lambda: None, clock=time.thread_time, reps=5)
                        row.update({"python_us": t["eager_us"], "fast": t["fast"], "slow": t["slow"],
                                    "replay": t["replay"]})
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = repr(exc)[:160]
                        traceback.print_exc()
                    rows.append(row)
    write_results("host_cost_mock", args.out, rows,
                  ["T", "H", "what", "launches", "kernels", "fast", "slow", "replay", "python_us", "error"],
                  notes="CPU tensors, launches mocked (the direct-launch hit path with a no-op run), each "
                        "dsv4_ampere op's CPU kernel replaced by its CUDA kernel: the Python cost of the plugin "
                        "entry, the composite, the op hop, validation, plan, allocation (CPU allocator) and "
                        "launch preparation; no C launcher, no CUDA allocator. CPU time of the calling thread, "
                        "best of 5 loops of N calls.")
    return rows


def main():
    mock = "--mock" in sys.argv
    if mock:
        sys.argv.remove("--mock")
    variants = ("portable",)
    if "--variants" in sys.argv:
        i = sys.argv.index("--variants")
        variants = tuple(sys.argv[i + 1].split(","))
        del sys.argv[i:i + 2]
    args = parse_args(__doc__.splitlines()[0])
    if mock or not torch.cuda.is_available():
        bench_mock(args)
        return 0
    try:
        bench_gpu(args, variants)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
