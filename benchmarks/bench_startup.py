"""Startup cost of the warm set and the cost of batch invariance.

    python benchmarks/bench_startup.py --out DIR [--quick] [--part startup|invariant|both] [--budget S]

1. Seconds per worker of the warm set (``dsv4_ops.vllm.warm_set.build``: every Triton
   specialization the plugin's entry points can launch) for V4.1-Flash and V4-Flash at TP = 8
   and TP = 1, max_num_batched_tokens = 8192, on this GPU's SM count, DSV4_AMPERE_IMPL=portable.
   Each measurement is a fresh process (an empty in-memory JIT cache) compiling through
   ``warm_keys.compile_many_jit`` (what vLLM's JIT warmup calls) with vLLM's default pool of
   4 threads: ``cold`` with an empty TRITON_CACHE_DIR, ``warm_cache`` again on the cache the
   cold run filled (a restart). ``build_s`` is the Python enumeration of the set (part of the
   startup too); ``compiles`` counts Triton's post-compile hook during the warmup.
2. In-graph microseconds of the decode step (``dsv4_decode_attention``, K = 512 + 128) with
   and without DSV4_AMPERE_BATCH_INVARIANT=1 (the fixed heads plan), same process, and their
   ratio; the plan each ran.

Writes startup.{json,md} (both tables) under DIR. --budget: skip the cases that would start
after that many seconds (each written as it finishes, so a timeout keeps the finished ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "test_warm_set.py")


def run_child(model: str, tp: int, cache_dir: str, timeout: float) -> dict:
    """One worker's startup in a fresh process: ``tests/test_warm_set.py --sweep`` (build the
    set, compile it as vLLM's warmup does, then the mixed sweep with Triton's compiles
    counted) on TRITON_CACHE_DIR = cache_dir."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, DSV4_AMPERE_IMPL="portable")
    res = subprocess.run([sys.executable, TESTS, "--sweep", model, str(tp)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def startup_rows(cases, cache_root: str, deadline: float, emit):
    """Per case (model, tp): cold (an empty cache dir under cache_root) then warm (the same)."""
    rows = []
    for model, tp in cases:
        row = {"model": model, "tp": tp}
        if time.perf_counter() > deadline:
            row["error"] = "skipped: over the time budget"
            rows.append(row)
            emit(rows)
            continue
        cache = os.path.join(cache_root, f"c_{model}_{tp}")
        os.makedirs(cache, exist_ok=True)
        try:
            cold = run_child(model, tp, cache, 150)
            row.update(max_tokens=cold["max_tokens"], keys=cold["warm_keys"], classes=cold["classes"],
                       build_s=cold["build_s"], cold_4_threads_s=cold["warm_s"], cold_compiles=cold["warmup_compiles"],
                       sweep_compiles=cold["compiles_after_warmup"])
            warm = run_child(model, tp, cache, 60)
            row.update(warm_cache_s=warm["warm_s"], warm_compiles=warm["warmup_compiles"],
                       sweep_compiles=row["sweep_compiles"] + warm["compiles_after_warmup"])
            if cold["new"] or warm["new"]:
                row["error"] = f"compiled after warmup: {(cold['new'] + warm['new'])[:3]}"
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as exc:
            row["error"] = str(exc)[-300:]
        rows.append(row)
        print(row, flush=True)
        emit(rows)
    return rows


def invariant_rows(quick: bool, emit=lambda rows: None):
    import torch

    import dsv4_ops  # noqa: F401
    from common import time_graph_us
    from dsv4_ops import dispatch, layout
    from dsv4_ops.dsv4_decode import dsv4_decode_attention

    os.environ["DSV4_AMPERE_IMPL"] = "portable"
    g = torch.Generator().manual_seed(0)
    dev, bs, nb = "cuda", 64, 1024
    cache = torch.zeros(nb, layout.vllm_page_bytes(bs), dtype=torch.uint8, device=dev)
    kv = torch.randn(nb * bs, 512, generator=g).to(torch.bfloat16).to(dev)
    torch.ops.dsv4_ampere.kv_cache_insert(kv, cache, torch.arange(nb * bs, device=dev), bs)
    rows = []
    for H in (8, 64):
        for T in ((1, 64) if quick else (1, 8, 64, 256)):
            q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev)
            topk = torch.randint(0, nb * bs, (T, 512), generator=g).to(torch.int32).to(dev)
            win = torch.randint(0, nb * bs, (T, 128), generator=g).to(torch.int32).to(dev)
            sink = torch.randn(H, generator=g).to(dev)
            out = torch.empty_like(q)
            ws = torch.empty(T * 640, 512, dtype=torch.bfloat16, device=dev)

            def step():
                dsv4_decode_attention(q, cache, topk, cache, win, sink, 512 ** -0.5, bs, bs, workspace=ws, out=out)

            row = {"T": T, "H": H}
            # Written before measuring. Floor of the invariant (workspace) step: the gather reads
            # each of the T * 640 records (584 B) and writes its bf16 row (1024 B), the heads kernel
            # reads the row once per head group, at 4 TB/s, plus three in-graph launches (gather,
            # heads, merge) of ~0.9 us. Prediction: dispatch.decode's own heads + merge cost model
            # (heads_time_us) for the invariant split count, plus the gather at the floor's bytes.
            from dsv4_ops.csrc_triton.decode import heads as hk

            groups = -(-H // hk.block_h_for(H))
            gather_us = T * 640 * (584 + 1024) / dispatch.workspace.BANDWIDTH_BPS * 1e6
            row["floor_us"] = round(gather_us + T * 640 * 1024 * groups / dispatch.workspace.BANDWIDTH_BPS * 1e6 + 3 * 0.9, 2)
            os.environ[dispatch.workspace.BATCH_INVARIANT_ENV] = "1"
            inv = dispatch.workspace.plan(T, H, 640, dispatch.device.num_sms(0), dispatch.decode.mode())
            os.environ.pop(dispatch.workspace.BATCH_INVARIANT_ENV, None)
            row["predicted_invariant_us"] = round(gather_us + 0.9 + dispatch.workspace.heads_time_us(
                T, H, 640, dispatch.device.num_sms(0), inv.splits), 2)
            for label, flag in (("default_us", "0"), ("invariant_us", "1")):
                os.environ[dispatch.workspace.BATCH_INVARIANT_ENV] = flag
                row[label] = time_graph_us(step)
                mode = dispatch.decode.mode()
                sms = dispatch.device.num_sms(0)
                if dispatch.decode.route(mode) == "paged":
                    p = dispatch.decode.plan_step(T, H, 640, sms)
                    row[label.replace("_us", "_plan")] = f"paged {p.config} S={p.splits}"
                else:
                    p = dispatch.workspace.plan(T, H, 640, sms, mode)
                    row[label.replace("_us", "_plan")] = f"{p.kernel} S={p.splits}"
            os.environ.pop(dispatch.workspace.BATCH_INVARIANT_ENV, None)
            row["ratio"] = row["invariant_us"] / row["default_us"]
            rows.append(row)
            print(row, flush=True)
            emit(rows)
    return rows


def assemble(path: str):
    """Startup rows from sweep JSON lines: per (model, tp), the cold line and the warm one."""
    rows = {}
    with open(path) as f:
        for line in f:
            if not line.strip().startswith("{"):
                continue
            d = json.loads(line)
            row = rows.setdefault((d["model"], d["tp"]), {"model": d["model"], "tp": d["tp"], "sweep_compiles": 0})
            row.update(max_tokens=d["max_tokens"], keys=d["warm_keys"], classes=d["classes"], build_s=d["build_s"])
            row["sweep_compiles"] += d["compiles_after_warmup"]
            if d.get("cache") == "cold":
                row.update(cold_4_threads_s=d["warm_s"], cold_compiles=d["warmup_compiles"])
            elif d.get("cache") == "warm":
                row.update(warm_cache_s=d["warm_s"], warm_compiles=d["warmup_compiles"])
            if d["new"]:
                row["error"] = f"compiled after warmup: {d['new'][:3]}"
    return [rows[k] for k in sorted(rows, key=lambda k: (-k[1], k[0] != "v41"))]


STARTUP_COLUMNS = ["model", "tp", "max_tokens", "keys", "classes", "build_s", "cold_4_threads_s", "cold_compiles",
                   "warm_cache_s", "warm_compiles", "sweep_compiles", "error"]
STARTUP_NOTES = ("Seconds per worker (fresh process each, portable, the served shapes: 4096 blocks, 64K context). "
                 "build: enumerating the warm set (Python, meta tensors); cold: compiling it as vLLM's JIT warmup does "
                 "(warm_keys.compile_many_jit, 4 threads = VLLM_TRITON_JIT_WARMUP_NUM_THREADS' default) with an empty "
                 "TRITON_CACHE_DIR; warm_cache: again on the cache the cold run filled (a restart); *_compiles: "
                 "Triton's post-compile hook during the warmup; sweep_compiles: during the mixed-batch sweep after "
                 "it, both runs (tests/test_warm_set.py; must be 0).")
INVARIANT_COLUMNS = ["T", "H", "floor_us", "predicted_invariant_us", "default_plan", "default_us", "invariant_plan",
                     "invariant_us", "ratio"]
INVARIANT_NOTES = ("dsv4_decode_attention in a CUDA graph (20 calls, median), K = 512 top-k + 128 window, portable, "
                   "same process; invariant: DSV4_AMPERE_BATCH_INVARIANT=1 (heads kernel, splits fixed by H and K). "
                   "floor_us: the invariant step's bytes at 4 TB/s + 3 launches; predicted_invariant_us: written "
                   "before the run, dispatch.workspace.heads_time_us + the gather at the floor (bench_startup.py).")


def write_all(out_dir, startup, invariant):
    """startup.{json,md}: both tables (the JSON's rows are the startup rows, 'invariant' the others)."""
    from common import markdown_table, write_results

    md = write_results("startup", out_dir, startup, STARTUP_COLUMNS, notes=STARTUP_NOTES)
    path = os.path.join(out_dir, "startup.json")
    with open(path) as f:
        data = json.load(f)
    data["invariant"] = invariant
    data["invariant_notes"] = INVARIANT_NOTES
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out_dir, "startup.md"), "w") as f:
        f.write(md + f"\n### batch invariance: decode step\n\n{markdown_table(invariant, INVARIANT_COLUMNS)}\n\n"
                f"{INVARIANT_NOTES}\n")


def main():
    import argparse

    p = argparse.ArgumentParser(description="warm-set compile cost at startup; batch-invariance cost")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--part", choices=("startup", "invariant", "both"), default="both")
    p.add_argument("--cases", default="v41:8,v4:8,v41:1,v4:1", help="model:tp,... of the startup rows")
    p.add_argument("--cache-root", default="", help="folder for the per-case Triton caches (default: a temp dir)")
    p.add_argument("--budget", type=float, default=1e9, help="seconds after which no new startup case starts")
    p.add_argument("--assemble", default="", help="a file of sweep JSON lines (tests/test_warm_set.py --sweep, "
                   "tagged cache=cold/warm): the startup rows from it instead of running the cases")
    args = p.parse_args()
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",") if c]
    deadline = time.perf_counter() + args.budget
    state = {"startup": [], "invariant": []}
    previous = os.path.join(args.out, "startup.json")
    if os.path.exists(previous):  # the other part of an earlier run into the same folder is kept
        with open(previous) as f:
            data = json.load(f)
        state = {"startup": data.get("rows", []), "invariant": data.get("invariant", [])}

    def emit(key):
        def f(rows):
            state[key] = list(rows)
            write_all(args.out, state["startup"], state["invariant"])
        return f

    if args.assemble:
        emit("startup")(assemble(args.assemble))
        return
    if args.part in ("invariant", "both"):
        invariant_rows(args.quick, emit("invariant"))
    if args.part in ("startup", "both"):
        root = args.cache_root or tempfile.mkdtemp(prefix="dsv4_triton_")
        startup_rows(cases[:1] if args.quick else cases, root, deadline, emit("startup"))
    write_all(args.out, state["startup"], state["invariant"])


if __name__ == "__main__":
    main()
