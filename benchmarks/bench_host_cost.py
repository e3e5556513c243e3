"""Eager host cost of every attention-path op and of the whole DSv4 decode step (issue 12).

    python benchmarks/bench_host_cost.py --out DIR [--quick]
    python benchmarks/bench_host_cost.py --mock        # CPU: Python cost only (launch mocked)

vLLM 0.33.0 runs DeepSeek-V4's attention region eagerly between CUDA-graph segments, so a
layer pays the host cost of our calls every step. ``eager_us``: a tight loop of N eager calls
synchronised once at the end, divided by N (what that eager segment pays when the host is the
bottleneck); ``eager_slow_launch_us``: the same with the direct Triton launch disabled
(``kernel[grid](...)`` every time; the pre-v2 launch path); ``graph_us``: the in-graph time
(benchmarks.common.time_graph_us); ``launches``: Triton launches a call makes. Baseline in the
same run: a tiny torch add. Goals (H200 host): whole step at T = 1, H = 8 <= 40 us, no op
above 25 us.

Writes host_cost.{json,md} under DIR (--mock: host_cost_mock.{json,md}).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, time_graph_us, write_results  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import _launch, attention, codec, dsv4_decode, kv_cache  # noqa: E402
from dsv4_ops.layout import min_page_bytes  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
K1, K2, BS = 512, 128, 64
VARIANTS = ("portable", "native")


def eager_us(fn, n: int, sync) -> float:
    """us per call of n back-to-back eager calls, synchronised once at the end (best of 3)."""
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def launches_per_call(fn) -> int:
    before = sum(k.stats["fast"] + k.stats["slow"] for k in _launch._REGISTRY.values())
    fn()
    return sum(k.stats["fast"] + k.stats["slow"] for k in _launch._REGISTRY.values()) - before


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
    ws = torch.empty(T * (K1 + K2), D, dtype=torch.bfloat16, device=device)
    return dict(q=q, cc=caches[0], cw=caches[1], sink=sink, topk=topk, swa=swa, lens=lens, ws=ws)


def op_calls(c, mock=False):
    """name -> zero-argument callable, for one case. Through torch.ops (what callers use)."""
    ops = torch.ops.dsv4_ampere
    q, cc, cw, sink, topk, swa, lens, ws = (c[k] for k in ("q", "cc", "cw", "sink", "topk", "swa", "lens", "ws"))
    T, H = q.shape[0], q.shape[1]
    idx = ops.dsv4_decode_indices(topk, lens, swa, cc.shape[0] * BS, cw.shape[0] * BS) if not mock else \
        torch.zeros(T, K1 + K2, dtype=torch.int32)
    s = attention.heuristic_splits(T, H, K1 + K2)
    o_part = torch.zeros(T, H, s, D, device=q.device)
    lse_part = torch.zeros(T, H, s, device=q.device)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=q.device)
    codes = cc[0, :16]
    if mock:  # call the launchers (the CPU op impls are references, not what CUDA runs)
        return {
            "e4m3_decode[16 B]": lambda: codec.e4m3_decode(codes),
            "kv_cache_gather_into[K1]": lambda: kv_cache.kv_cache_gather(cc, topk, BS, out=ws, row_offset=0),
            "dsv4_decode_indices": lambda: attention.dsv4_decode_indices(topk, lens, swa, 1 << 14, 1 << 12),
            "dsv4_decode_gather": lambda: attention.dsv4_decode_gather(cc, topk, lens, BS, cw, swa, None, BS, ws),
            "sparse_mla_split": lambda: attention.sparse_mla_split(q, ws, idx, None, SM_SCALE, s),
            "merge_splits": lambda: attention.merge_splits(o_part, lse_part, sink),
            "sparse_mla_decode": lambda: attention.sparse_mla_decode(q, ws, idx, None, sink, SM_SCALE, 0),
            "sparse_mla_decode(out=)": lambda: attention.sparse_mla_decode(q, ws, idx, None, sink, SM_SCALE, 0,
                                                                           out=out),
            "whole step (launchers)": lambda: (
                attention.sparse_mla_decode(q, ws, attention.dsv4_decode_gather(cc, topk, lens, BS, cw, swa, None,
                                                                               BS, ws), None, sink, SM_SCALE, 0)),
        }
    return {
        "torch add (baseline)": lambda: q.add(q),
        "e4m3_decode[16 B]": lambda: ops.e4m3_decode(codes),
        "kv_cache_gather_into[K1]": lambda: ops.kv_cache_gather_into(cc, topk, BS, ws, 0),
        "dsv4_decode_indices": lambda: ops.dsv4_decode_indices(topk, lens, swa, cc.shape[0] * BS, cw.shape[0] * BS),
        "dsv4_decode_gather": lambda: ops.dsv4_decode_gather(cc, topk, lens, BS, cw, swa, None, BS, ws),
        "sparse_mla_split": lambda: ops.sparse_mla_split(q, ws, idx, None, SM_SCALE, s),
        "merge_splits": lambda: ops.merge_splits(o_part, lse_part, sink),
        "merge_splits_out": lambda: ops.merge_splits_out(o_part, lse_part, sink, out),
        "sparse_mla_decode": lambda: ops.sparse_mla_decode(q, ws, idx, None, sink, SM_SCALE, 0),
        "sparse_mla_decode_out": lambda: ops.sparse_mla_decode_out(q, ws, idx, None, sink, SM_SCALE, 0, out),
        "whole step": lambda: dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS,
                                                                topk_length=lens),
        "whole step (out=, workspace)": lambda: dsv4_decode.dsv4_decode_attention(
            q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS, topk_length=lens, workspace=ws, out=out),
    }


def bench_gpu(args):
    rows = []
    shapes = ((1, 8), (1, 64), (4, 8)) if args.quick else ((1, 8), (1, 64), (4, 8), (64, 64), (128, 8))
    n = 200 if args.quick else 1000
    sync = torch.cuda.synchronize
    for v in VARIANTS:
        os.environ["DSV4_AMPERE_IMPL"] = v
        for T, H in shapes:
            case = make_case(T, H, "cuda", seed=T + H)
            for name, fn in op_calls(case).items():
                row = {"variant": v, "T": T, "H": H, "op": name}
                try:
                    row["launches"] = launches_per_call(fn)
                    row["eager_us"] = eager_us(fn, n, sync)
                    _launch.ENABLED = False
                    try:
                        row["eager_slow_launch_us"] = eager_us(fn, n // 2, sync)
                    finally:
                        _launch.ENABLED = True
                    row["graph_us"] = time_graph_us(fn, 10 if args.quick else 30)
                    row["eager/graph"] = row["eager_us"] / row["graph_us"]
                except Exception as exc:  # noqa: BLE001 - one failing op must not hide the others
                    row["error"] = repr(exc)[:120]
                    traceback.print_exc()
                rows.append(row)
    os.environ.pop("DSV4_AMPERE_IMPL", None)
    write_results("host_cost", args.out, rows,
                  ["variant", "T", "H", "op", "launches", "eager_us", "eager_slow_launch_us", "graph_us",
                   "eager/graph", "error"],
                  notes="eager_us: N eager calls back to back, one synchronize at the end, per call (best of 3). "
                        "eager_slow_launch_us: the same with dsv4_ops._launch disabled (kernel[grid](...) each "
                        "launch). graph_us: in a CUDA graph, 20 calls a replay. K1 = 512, K2 = 128. Goals: whole "
                        "step at T = 1, H = 8 <= 40 us eager; no op above 25 us.")
    return rows


def bench_mock(args):
    """CPU only: Python cost of the launchers with the Triton launch replaced by a no-op."""

    class _Compiled:
        function, packed_metadata = 0, ()

        @staticmethod
        def run(*a):
            return None

    class _Fn:
        def __getitem__(self, grid):
            return lambda *a, **k: _Compiled()

    saved = {}
    for fk in list(_launch._REGISTRY.values()):
        saved[fk] = (fk.fn, fk.jit)
        fk.fn, fk.jit = _Fn(), True
        fk.cache.clear()
    get_dev, get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream = (lambda: 0), (lambda d: 0)
    rows = []
    try:
        for T, H in ((1, 8), (1, 64)):
            case = make_case(T, H, "cpu")
            base = {"torch add (baseline)": lambda: case["q"].add(case["q"]),
                    "torch.empty [T,H,512]": lambda: torch.empty(T, H, D, dtype=torch.bfloat16)}
            for name, fn in list(base.items()) + list(op_calls(case, mock=True).items()):
                rows.append({"T": T, "H": H, "op": name, "python_us": eager_us(fn, 2000, lambda: None),
                             "launches": launches_per_call(fn) if name not in base else 0})
    finally:
        torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream = get_dev, get_stream
        for fk, (fn, jit) in saved.items():
            fk.fn, fk.jit = fn, jit
            fk.cache.clear()
    write_results("host_cost_mock", args.out, rows, ["T", "H", "op", "launches", "python_us"],
                  notes="CPU tensors, launch mocked (the cached-launcher hit path with a no-op run): the "
                        "Python cost of validation, variant lookup, allocation and launch preparation only.")
    return rows


def main():
    mock = "--mock" in sys.argv
    if mock:
        sys.argv.remove("--mock")
    args = parse_args(__doc__.splitlines()[0])
    if mock or not torch.cuda.is_available():
        bench_mock(args)
        return 0
    try:
        bench_gpu(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
