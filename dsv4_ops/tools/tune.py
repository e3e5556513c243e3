"""``dsv4-ops tune``: measure the paged decode's v3-form plans on this GPU and write its decode table.

For every shape of the grid (T tokens x H heads x K keys a token: T in {1, 4, 16, 64, 128, 256},
H in {8, 16, 64, 128}, K = 640 (512 top-k + 128 window) and V4.1's draft K = 256 (128 + 128);
``--quick``: T in {1, 16, 64, 128}, H in {8, 64}, K = 640), every candidate (config, splits) runs the
paged op (paged_decode.dsv4_decode_fused) once and its output is checked against the float64
reference (testing.assert_attention_close); a candidate that raises or fails the check is dropped and
reported. The rest are timed with graph_us (20 calls a CUDA graph, median of the replays) and the fastest
becomes the shape's entry of the table dispatch.tables reads (its file named by device, SM count and
variant). ``--sms N`` runs everything on N SMs of the device through a driver green context
(tools.green_ctx) and writes the table for N.

Candidates (``candidates``): the dispatched configs (paged_chunk128.V3_DISPATCHED, paged_f16dot
.V4_DISPATCHED: the ones compiled and checked for sm_80/86 ahead of time) that fit the device's shared
memory, BLOCK_H 32 only for H > 16, x every balanced split count the composite may run (at most
dispatch.decode.split_cap(T, H): the paged op's partials cap), plus the table-less plan (the
cost model's pick), so that every shape also reports how far that pick is from the best.

Besides the table, ``--out`` gets ``tune_<table name>.json`` with every time (rows in
benchmarks/bench_decode_sms.py's form: ``sweep`` maps '<config>S<splits>' to us, so
benchmarks/fit_v3_cost.py refits the cost model from it) and a Markdown summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

GRID_T = (1, 4, 16, 64, 128, 256)
GRID_H = (8, 16, 64, 128)
GRID_K = (640, 256)  # 512 top-k + 128 window; V4.1's draft 128 + 128
QUICK_T = (1, 16, 64, 128)
QUICK_H = (8, 64)
QUICK_K = (640,)
K2 = 128  # the window's keys of every shape (K1 = K - K2 top-k keys)
BLOCK_SIZE = 64  # cache block size of the measured caches
NBLK = 8192  # pages a cache (524288 slots, 306 MB of records: beyond the L2)
QUICK_BUDGET_S = 75.0  # --quick: no shape starts after this many seconds (the device run stays < 2 min)
DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "dsv4_ops", "decode_tables")


@dataclasses.dataclass
class ShapeResult:
    """One shape's measurement: us by '<config>S<splits>', dropped candidates with why, and the
    table-less plan's key (the cost model's pick)."""

    T: int
    H: int
    K: int
    times: Dict[str, float] = dataclasses.field(default_factory=dict)
    dropped: Dict[str, str] = dataclasses.field(default_factory=dict)
    model_pick: str = ""

    def best(self) -> Optional[Tuple[str, float]]:
        """(key, us) of the fastest candidate, or None when every one was dropped."""
        if not self.times:
            return None
        key = min(self.times, key=lambda k: (self.times[k], k))
        return key, self.times[key]


def key_of(config: str, splits: int) -> str:
    return f"{config}S{splits}"


def split_key(key: str) -> Tuple[str, int]:
    """('<config>', splits) of '<config>S<splits>'."""
    name, _, s = key.rpartition("S")
    return name, int(s)


def tune_configs() -> Tuple[str, ...]:
    """The configs tuned by default: the dispatched ones (compiled and checked for sm_80/86 ahead of time)."""
    from ..csrc_triton.decode import paged_chunk128 as _vk
    from ..csrc_triton.decode import paged_f16dot as _v4k

    return tuple(_vk.V3_DISPATCHED) + tuple(_v4k.V4_DISPATCHED)


def model_pick(T: int, H: int, K: int, sms: int, smem: int) -> Tuple[str, int]:
    """(config, splits) the composite runs for (T, H, K) on ``sms`` SMs without a decode table: the
    windows and the cost model (dispatch.decode.plan_step, splits capped). Call it with the tables off
    (envs.override)."""
    from ..dispatch import decode as dd

    p = dd.plan_step(T, H, K, sms, smem, (BLOCK_SIZE, BLOCK_SIZE))
    return p.config, p.splits


def candidates(T: int, H: int, K: int, smem: int, configs: Sequence[str], max_splits: int = 0) -> List[Tuple[str, int]]:
    """(config, splits) to measure at (T, H, K) on a device of ``smem`` bytes of shared memory a block:
    each config that fits (BLOCK_H > 16 only for H > 16) x its balanced split counts up to the composite's
    cap (split_cap) and ``max_splits`` (0: no further limit)."""
    from ..dispatch import decode as dd

    cap = dd.split_cap(T, H)
    out = []
    for name in configs:
        cfg = dd.v3_config(name)
        if (cfg["BLOCK_H"] > 16 and H <= 16) or not dd.config_fits(name, smem):
            continue
        nb = -(-K // cfg["BLOCK_N"])
        for s in dd.balanced_splits(nb):
            if s <= min(cap, nb) and (not max_splits or s <= max_splits):
                out.append((name, s))
    return out


def measure_shape(T: int, H: int, K: int, cands: Iterable[Tuple[str, int]],
                  run: Callable[[str, int], object], check: Callable[[object], Optional[str]],
                  timer: Callable[[Callable[[], object]], float], pick: Tuple[str, int] = ("", 0)) -> ShapeResult:
    """Measure every candidate at one shape: ``run(config, splits)`` makes one call and returns its
    output, ``check(output)`` is None when it matches the reference (else why not), ``timer(fn)`` the
    us of fn(). A candidate that raises or fails the check is dropped (ShapeResult.dropped), never
    timed. ``pick``: the table-less plan, measured too (added when it is not a candidate)."""
    res = ShapeResult(T, H, K, model_pick=key_of(*pick) if pick[0] else "")
    todo = list(dict.fromkeys(list(cands) + ([pick] if pick[0] else [])))
    for name, s in todo:
        key = key_of(name, s)
        try:
            why = check(run(name, s))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is dropped and reported
            why = f"raised {type(exc).__name__}: {exc}"[:200]
        if why:
            res.dropped[key] = why
            continue
        res.times[key] = float(timer(lambda name=name, s=s: run(name, s)))
    return res


def build_table(results: Iterable[ShapeResult], device_name: str, sms: int, variant: str, source: str,
                smem: int, sweeps: Sequence[str] = ()) -> dict:
    """The decode table (dispatch.tables' format) of the fastest candidate of every measured shape
    (a shape whose candidates were all dropped gets no entry: the cost model plans it). ``smem``: the
    measuring device's shared memory a block; ``sweeps``: repository paths of the measurements (the
    tests check the table-less plan against them)."""
    from ..dispatch import tables

    entries: Dict[str, Dict[str, dict]] = {}
    for r in results:
        best = r.best()
        if best is None:
            continue
        name, s = split_key(best[0])
        entries.setdefault(str(r.K), {})[f"{r.T},{r.H}"] = {"config": name, "splits": s, "us": round(best[1], 2)}
    return {"format": tables.FORMAT, "device_name": tables.sanitize_device_name(device_name), "sms": int(sms),
            "variant": variant, "source": source, "smem": int(smem), "sweeps": list(sweeps), "entries": entries}


def write_table(table: dict, out_dir: str) -> str:
    """Write ``table`` under ``out_dir`` by its file name (dispatch.tables.file_name); returns the path."""
    from ..dispatch import tables

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, tables.file_name(table["device_name"], table["sms"], table["variant"]))
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def sweep_rows(results: Iterable[ShapeResult], sms: int) -> List[dict]:
    """The results as benchmarks/bench_decode_sms.py rows (fit_v3_cost.py reads them)."""
    rows = []
    for r in results:
        best = r.best()
        row = {"T": r.T, "H": r.H, "K": r.K, "SMs": sms, "sweep": {k: round(v, 2) for k, v in r.times.items()}}
        if best:
            row["best"], row["best_us"] = best[0], round(best[1], 2)
        if r.model_pick in r.times and best:
            row["model_pick"], row["model_us"] = r.model_pick, round(r.times[r.model_pick], 2)
            row["model/best"] = round(r.times[r.model_pick] / best[1], 3)
        if r.dropped:
            row["sweep_fail"] = [f"{k}: {v}" for k, v in r.dropped.items()]
        rows.append(row)
    return rows


def from_sweep_rows(rows: Iterable[dict], sms: int, smem: int, configs: Sequence[str] = ()) -> List[ShapeResult]:
    """ShapeResults of the rows of a bench_decode_sms.py / tune sweep measured at ``sms`` SMs, as the tune
    would have measured them: only ``candidates`` (default configs: tune_configs) count, plus the row's
    own plan ('v3 <config> S<n>', timed as ``ours_us``) when it is one of them but missing from the sweep.
    Rows of one shape in several files merge (a later row's time of the same candidate wins); dropped:
    the row's ``sweep_fail`` entries. model_pick: the table-less plan now (tables must be off)."""
    import re

    configs = tuple(configs) or tune_configs()
    out: Dict[Tuple[int, int, int], ShapeResult] = {}
    for row in rows:
        if row.get("SMs") != sms or not row.get("sweep"):
            continue
        T, H, K = row["T"], row["H"], row["K"]
        allowed = {key_of(n, s) for n, s in candidates(T, H, K, smem, configs)}
        res = out.setdefault((T, H, K), ShapeResult(T, H, K, model_pick=key_of(*model_pick(T, H, K, sms, smem))))
        m = re.fullmatch(r"\S+ (\S+) S(\d+)", str(row.get("plan", "")))
        own = key_of(m.group(1), int(m.group(2))) if m else ""
        if own and own not in row["sweep"] and "ours_us" in row and not str(row.get("err", "")).startswith("FAIL"):
            if own in allowed or own == res.model_pick:
                res.times[own] = float(row["ours_us"])
        for key, us in row["sweep"].items():
            if key in allowed:
                res.times[key] = float(us)
        for fail in row.get("sweep_fail") or ():
            key, _, why = str(fail).partition(":")
            res.dropped[key] = why.strip()
    return list(out.values())


def summary(results: Sequence[ShapeResult], sms: int) -> str:
    """Markdown: per shape the best candidate, the table-less pick and their ratio, dropped candidates."""
    lines = ["| T | H | K | SMs | best | best us | model's pick | pick us | pick/best | timed | dropped |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        best = r.best() or ("-", float("nan"))
        pick_us = r.times.get(r.model_pick, float("nan"))
        dropped = "; ".join(f"{k}: {v}" for k, v in r.dropped.items()) or "-"
        lines.append(f"| {r.T} | {r.H} | {r.K} | {sms} | {best[0]} | {best[1]:.2f} | {r.model_pick or '-'} | "
                     f"{pick_us:.2f} | {pick_us / best[1]:.3f} | {len(r.times)} | {dropped} |")
    return "\n".join(lines)


def grid(quick: bool, shapes: str = "") -> List[Tuple[int, int, int]]:
    """(T, H, K) to tune: ``shapes`` 'T:H:K,...' when given, else the quick or the full grid."""
    if shapes:
        return [tuple(int(x) for x in sh.split(":")) for sh in shapes.split(",")]
    ts, hs, ks = (QUICK_T, QUICK_H, QUICK_K) if quick else (GRID_T, GRID_H, GRID_K)
    return [(T, H, K) for K in ks for T in ts for H in hs]


class _GpuShape:
    """Inputs of one shape on the GPU (random q, sink, valid slots into the two caches) and the float64
    reference: ``run(config, splits)`` calls the paged op with that config, ``check`` compares."""

    def __init__(self, caches, T: int, H: int, K: int):
        import torch

        from .. import reference

        (self.cc, self.cw) = caches
        self.T, self.H, self.K1 = T, H, K - K2
        g = torch.Generator(device="cuda").manual_seed(T * 1000 + H + K)
        cap = NBLK * BLOCK_SIZE
        self.topk = torch.randint(0, cap, (T, self.K1), device="cuda", generator=g, dtype=torch.int32)
        self.swa = torch.randint(0, cap, (T, K2), device="cuda", generator=g, dtype=torch.int32)
        self.q = torch.randn(T, H, 512, device="cuda", generator=g).to(torch.bfloat16)
        self.sink = torch.randn(H, device="cuda", generator=g)
        self.scale = 512 ** -0.5
        self.want, self.want_lse = reference.ref_dsv4_decode_fused(
            self.q, self.cc, self.topk, None, BLOCK_SIZE, self.cw, self.swa, None, BLOCK_SIZE, self.sink, self.scale,
            out_dtype=torch.float64)

    def run(self, config: str, splits: int):
        from .. import paged_decode

        return paged_decode.dsv4_decode_fused(self.q, self.cc, self.topk, None, BLOCK_SIZE, self.cw, self.swa, None,
                                              BLOCK_SIZE, self.sink, self.scale, splits, config=config)

    def check(self, got) -> Optional[str]:
        from ..testing import assert_attention_close

        try:
            assert_attention_close(got[0], got[1], self.want, self.want_lse)
        except AssertionError as exc:
            return f"wrong output: {str(exc).splitlines()[0][:160]}"
        return None


def _make_caches():
    """Two fp8_ds_mla paged caches of NBLK pages of BLOCK_SIZE slots holding random rows."""
    import torch

    from ..layout import vllm_page_bytes

    ops = torch.ops.dsv4_ampere
    out = []
    for seed in (1, 2):
        cache = torch.zeros(NBLK, vllm_page_bytes(BLOCK_SIZE), dtype=torch.uint8, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        n = NBLK * BLOCK_SIZE
        for lo in range(0, n, 1 << 18):
            rows = torch.randn(min(1 << 18, n - lo), 512, device="cuda", generator=g).to(torch.bfloat16)
            ops.kv_cache_insert(rows, cache, torch.arange(lo, lo + rows.shape[0], device="cuda"), BLOCK_SIZE)
        out.append(cache)
    return tuple(out)


def run_tune(args) -> int:
    """The GPU run (module doc); 0 when a table was written."""
    import contextlib

    import torch

    from .. import envs
    from ..dispatch import device as _dev
    from ..dispatch import tables
    from ..dispatch.variant import variant_for
    from .green_ctx import GreenStream, device_sms
    from .timing import graph_us

    t0 = time.time()
    dev = torch.cuda.current_device()
    total = device_sms(dev)
    asked = args.sms or total
    configs = tuple(args.configs.split(",")) if args.configs else tune_configs()
    smem = _dev.smem_per_block(dev)
    variant = variant_for(torch.empty(0, device="cuda"))
    name = torch.cuda.get_device_name(dev)
    caches = _make_caches()
    budget = args.budget if args.budget > 0 else (QUICK_BUDGET_S if args.quick else 0.0)
    results: List[ShapeResult] = []
    with GreenStream(asked, dev) as gs, envs.override(**{envs.DECODE_TABLES: "0"}):
        sms = gs.sms
        print(f"dsv4-ops tune: {name}, {sms} of {total} SMs, variant {variant}, {smem} B shared memory a block, "
              f"configs {','.join(configs)}", flush=True)
        for T, H, K in grid(args.quick, args.shapes):
            if budget and time.time() - t0 > budget:
                print(f"time budget of {budget:.0f} s reached: the shapes left keep the cost model", flush=True)
                break
            shape = _GpuShape(caches, T, H, K)
            cands = candidates(T, H, K, smem, configs, args.max_splits)
            res = measure_shape(T, H, K, cands, shape.run, shape.check,
                                lambda fn: graph_us(fn, replays=args.replays), model_pick(T, H, K, sms, smem))
            best = res.best()
            print(f"T={T} H={H} K={K}: {len(res.times)} timed, best {best[0] if best else '-'} "
                  f"{f'{best[1]:.2f} us' if best else ''}; model's pick {res.model_pick} "
                  f"{res.times.get(res.model_pick, float('nan')):.2f} us"
                  + (f"; DROPPED {res.dropped}" if res.dropped else ""), flush=True)
            results.append(res)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
    if not any(r.best() for r in results):
        print("dsv4-ops tune: no candidate passed its check: no table written", file=sys.stderr)
        return 1
    from .. import __version__

    source = (f"dsv4-ops tune {__version__} on {name} ({sms} SMs{' of ' + str(total) if sms != total else ''}), "
              f"{variant}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{'quick' if args.quick else 'full'} grid, graph_us median (20 calls a graph)")
    stem = os.path.splitext(tables.file_name(name, sms, variant))[0]
    # where the measurement is committed beside a shipped table (the tests read it from there)
    table = build_table(results, name, sms, variant, source, smem, [f"benchmarks/results/tune_{stem}.json"])
    path = write_table(table, args.out)
    with open(os.path.join(args.out, f"tune_{stem}.json"), "w") as f:
        json.dump({"meta": {"gpu": name, "impl": variant, "sms": sms, "smem": smem}, "source": source,
                   "rows": sweep_rows(results, sms)}, f, indent=1)
    md = summary(results, sms)
    with open(os.path.join(args.out, f"tune_{stem}.md"), "w") as f:
        f.write(f"# {stem}\n\n{source}\n\n{md}\n")
    print(md)
    tables.clear()
    dropped = sum(len(r.dropped) for r in results)
    print(f"wrote {path} ({sum(len(v) for v in table['entries'].values())} shapes; {dropped} candidates dropped) "
          f"in {time.time() - t0:.0f} s. Use it: {envs.DECODE_TABLE_DIR}={os.path.abspath(args.out)}", flush=True)
    return 0


def main(args) -> int:
    """``dsv4-ops tune``: 2 without a CUDA GPU (said so), else run_tune's status."""
    import torch

    if not torch.cuda.is_available():
        print("dsv4-ops tune measures the decode kernels on a CUDA GPU (sm_80+); this machine has none. "
              "Run it on the GPU that will serve; without a table the cost model plans.", file=sys.stderr)
        return 2
    return run_tune(args)
