"""Startup cost of the warm set (issue 19) and the cost of batch invariance.

    python benchmarks/bench_startup.py --out DIR [--quick]

1. Compile seconds of the warm set (``dsv4_ops.vllm.warm_set.build``: every Triton
   specialization the dispatch can pick) per worker, for V4-Flash and V4.1-Flash at TP = 8
   and max_num_batched_tokens = 8192, on this GPU's SM count, with DSV4_AMPERE_IMPL=portable.
   Each measurement is a fresh process (an empty in-memory JIT cache) compiling through
   ``warm_keys.compile_many_jit`` with vLLM's default pool of 4 threads (and 1 thread, cold):
   ``cold`` with an empty TRITON_CACHE_DIR, ``warm`` again on the cache the cold run filled
   (a restart). ``build_s`` is the Python enumeration of the set.
2. In-graph microseconds of the decode step (``dsv4_decode_attention``, K = 512 + 128) with
   and without DSV4_AMPERE_BATCH_INVARIANT=1 (the fixed heads plan), and their ratio.

Writes startup.{json,md} and batch_invariant.{json,md} under DIR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(model: str, tp: int, max_tokens: int, threads: int) -> dict:
    """Build and compile one warm set in this (fresh) process; returns the timings."""
    import torch

    import dsv4_ops  # noqa: F401
    from dsv4_ops import decode_plan, warm_keys
    from dsv4_ops.vllm import warm_set as ws

    shapes = (ws.v41_flash if model == "v41" else ws.v4_flash)(tp=tp)
    sms = decode_plan.num_sms(torch.cuda.current_device())
    t0 = time.perf_counter()
    warm = ws.build(shapes, max_tokens, sms=sms, variant="portable")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm_keys.compile_many_jit(warm.keys, threads=threads)
    torch.cuda.synchronize()
    return {"keys": len(warm), "classes": len(warm.classes), "build_s": round(build_s, 2),
            "compile_s": round(time.perf_counter() - t0, 2)}


def run_child(model, tp, max_tokens, threads, cache_dir, timeout):
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, DSV4_AMPERE_IMPL="portable")
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, str(tp), str(max_tokens),
                          str(threads)], env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def startup_rows(quick: bool):
    cases = [("v41", 8, 512)] if quick else [("v4", 8, 8192), ("v41", 8, 8192)]
    rows = []
    for model, tp, max_tokens in cases:
        with tempfile.TemporaryDirectory() as cache:
            row = {"model": model, "tp": tp, "max_tokens": max_tokens}
            try:
                cold = run_child(model, tp, max_tokens, 4, cache, 120)
                warm = run_child(model, tp, max_tokens, 4, cache, 60)
                row.update(keys=cold["keys"], classes=cold["classes"], build_s=cold["build_s"],
                           cold_4_threads_s=cold["compile_s"], warm_cache_s=warm["compile_s"])
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                row["error"] = str(exc)[-300:]
        rows.append(row)
        print(row, flush=True)
    if not quick:
        with tempfile.TemporaryDirectory() as cache:
            try:
                serial = run_child("v41", 8, 8192, 1, cache, 150)
                rows.append({"model": "v41", "tp": 8, "max_tokens": 8192, "keys": serial["keys"],
                             "cold_1_thread_s": serial["compile_s"]})
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append({"model": "v41", "tp": 8, "error": "1 thread: " + str(exc)[-200:]})
    return rows


def invariant_rows(quick: bool):
    import torch

    import dsv4_ops  # noqa: F401
    from common import time_graph_us
    from dsv4_ops import decode_plan, layout
    from dsv4_ops.dsv4_decode import dsv4_decode_attention

    os.environ["DSV4_AMPERE_IMPL"] = "portable"
    g = torch.Generator().manual_seed(0)
    dev, bs, nb = "cuda", 64, 1024
    cache = torch.zeros(nb, layout.vllm_page_bytes(bs), dtype=torch.uint8, device=dev)
    kv = torch.randn(nb * bs, 512, generator=g).to(torch.bfloat16).to(dev)
    torch.ops.dsv4_ampere.kv_cache_insert(kv, cache, torch.arange(nb * bs, device=dev), bs)
    rows = []
    for H in (8, 64):
        for T in ((1, 64) if quick else (1, 8, 64, 256, 1024)):
            q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev)
            topk = torch.randint(0, nb * bs, (T, 512), generator=g).to(torch.int32).to(dev)
            win = torch.randint(0, nb * bs, (T, 128), generator=g).to(torch.int32).to(dev)
            sink = torch.randn(H, generator=g).to(dev)
            out = torch.empty_like(q)
            ws = torch.empty(T * 640, 512, dtype=torch.bfloat16, device=dev)

            def step():
                dsv4_decode_attention(q, cache, topk, cache, win, sink, 512 ** -0.5, bs, bs, workspace=ws, out=out)

            row = {"T": T, "H": H}
            for label, flag in (("default_us", "0"), ("invariant_us", "1")):
                os.environ[decode_plan.BATCH_INVARIANT_ENV] = flag
                row[label] = time_graph_us(step)
                mode = decode_plan.mode()
                fused = mode == "auto" and decode_plan.auto_is_fused(T, H, 640)
                p = decode_plan.plan(T, H, 640, decode_plan.num_sms(0), mode)
                row[label.replace("_us", "_plan")] = "fused" if fused else f"{p.kernel} S={p.splits}"
            os.environ.pop(decode_plan.BATCH_INVARIANT_ENV, None)
            row["ratio"] = row["invariant_us"] / row["default_us"]
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    from common import parse_args, write_results

    args = parse_args("warm-set compile cost at startup; batch-invariance cost")
    write_results("startup", args.out, startup_rows(args.quick),
                  ["model", "tp", "max_tokens", "keys", "classes", "build_s", "cold_4_threads_s", "warm_cache_s",
                   "cold_1_thread_s", "error"],
                  notes="Seconds per worker (fresh process, portable). cold: empty TRITON_CACHE_DIR; warm_cache: "
                        "the cache the cold run filled (a restart). 4 threads = vLLM's default "
                        "VLLM_TRITON_JIT_WARMUP_NUM_THREADS.")
    write_results("batch_invariant", args.out, invariant_rows(args.quick),
                  ["T", "H", "default_plan", "default_us", "invariant_plan", "invariant_us", "ratio"],
                  notes="dsv4_decode_attention in a CUDA graph, K = 512 top-k + 128 window, portable; "
                        "invariant: DSV4_AMPERE_BATCH_INVARIANT=1 (heads kernel, splits fixed by H and K).")


if __name__ == "__main__":
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        m, tp, mt, th = sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3]), int(sys.argv[i + 4])
        print(json.dumps(child(m, tp, mt, th)))
    else:
        main()
