"""The DeepSeek-V4 decode the plugin calls, at an A100's SM counts: ours (and P2 when a local copy is
present) on 132, 112 and 104 SMs of the H200 through driver green contexts (benchmarks/green_ctx.py).

    python benchmarks/bench_decode_sms.py --out DIR [--sms 132,112,104] [--shapes T:H:K1,...] [--name decode_sms]
                                          [--sweep] [--configs a,b] [--max-splits N] [--p2 DIR] [--budget S]

For T in {1, 4, 16, 64, 128, 256} x H in {8, 16, 64, 128} at K = 512 top-k + 128 window, and V4.1's
draft K = 128 + 128 at T in {1, 16, 64, 128} x H in {8, 64, 128}, block 64, int32 random valid slots,
sink, no lengths, on each SM count (DSV4_AMPERE_SMS = the granted count):
  ours_us      dsv4_decode.dsv4_decode_attention under DSV4_AMPERE_DECODE_KERNEL=auto (the plugin's
               call), plan in ``plan`` (route / config / splits); err: out vs float64
               (testing.assert_attention_close; 'FAIL' when it rejects)
  p2_us        P2's direct_dual_sparse_attention (Qeeweew/deepseek-v4-a100-sglang, Apache-2.0, read
               from --p2 DIR/attention.py, never committed) over bf16 buffers of the same shape
               (its own inputs: it decodes nothing), autotuned before capture; p2_err vs float64
  floor_us     max(bytes_us, mma_us, launch_us): bytes = T*K*584 record bytes + q + out at this
               SM count's copy rate (measured in the same green context); mma = 4*T*H16*K*512
               flops at MMA_TFLOPS_132 * SMs / 132 (mma.sync, H16 = H padded to 16); launch =
               the plan's launches * LAUNCH_US
  mma_a100_us  the same flops at an A100's mma.sync rate, A100_TFLOPS (bf16 dense, 108 SMs) * SMs / 108
  --sweep      also every dispatched v3-form config (or --configs) x balanced split count <= --max-splits
               (20) through the paged op (best_us / best: config and S; every time in sweep_us), for
               re-planning; each output checked as well
Every time: 20 calls captured in one CUDA graph on the green stream, median of the replays.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402
from green_ctx import GreenStream  # noqa: E402

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import _host_plan, dispatch, dsv4_decode, paged_decode, reference  # noqa: E402
from dsv4_ops.csrc_triton.decode import paged_chunk128 as _vk  # noqa: E402
from dsv4_ops.csrc_triton.decode import paged_f16dot as _v4k  # noqa: E402
from dsv4_ops.layout import RECORD_BYTES, vllm_page_bytes  # noqa: E402
from dsv4_ops.testing import assert_attention_close  # noqa: E402
from dsv4_ops.tools.timing import graph_us  # noqa: E402

D = 512
SM_SCALE = D ** -0.5
BS = 64
NBLK = 16384  # 1M slots a cache (612 MB of records, beyond the L2)
TS = (1, 4, 16, 64, 128, 256)
HS = (8, 16, 64, 128)
DRAFT = [(T, H) for T in (1, 16, 64, 128) for H in (8, 64, 128)]  # K1 = 128: V4.1's draft K = 256
LAUNCH_US = 0.9  # one in-graph launch (benchmarks/results/decode_graph.md)
MMA_TFLOPS_132 = 600.0  # mma.sync bf16 on the H200's 132 SMs (no wgmma under DISABLE_MMA_V3), a guide
A100_TFLOPS = 312.0  # an A100's bf16 dense tensor rate (mma.sync), 108 SMs
SWEEP_CONFIGS = tuple(_vk.V3_DISPATCHED) + tuple(_v4k.V4_DISPATCHED)


def copy_gbs(nbytes=256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), replays=10, inner=5)
    return 2 * nbytes / us / 1e3


def make_caches(with_bf16: bool):
    """Two fp8_ds_mla paged caches of NBLK pages of BS slots (random rows), and, for P2, two bf16
    [slots, 512] buffers of the rows before quantisation."""
    ops = torch.ops.dsv4_ampere
    out = []
    for seed in (1, 2):
        cache = torch.zeros(NBLK, vllm_page_bytes(BS), dtype=torch.uint8, device="cuda")
        buf = torch.empty(NBLK * BS, D, dtype=torch.bfloat16, device="cuda") if with_bf16 else None
        g = torch.Generator(device="cuda").manual_seed(seed)
        n = NBLK * BS
        for lo in range(0, n, 1 << 18):
            rows = torch.randn(min(1 << 18, n - lo), D, device="cuda", generator=g).to(torch.bfloat16)
            ops.kv_cache_insert(rows, cache, torch.arange(lo, lo + rows.shape[0], device="cuda"), BS)
            if buf is not None:
                buf[lo:lo + rows.shape[0]] = rows
        out.append((cache, buf))
    return out


def load_p2(path: str, name: str = "direct_dual_sparse_attention"):
    """P2's ``name`` (direct_dual_sparse_attention, direct_sparse_attention) from a local copy, or None
    (absent: skipped)."""
    f = os.path.join(path, "attention.py") if path else ""
    if not f or not os.path.exists(f):
        return None
    spec = importlib.util.spec_from_file_location("p2_attention", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def ref_bf16(q, buf0, idx0, buf1, idx1, sink, len0=None):
    """float64 attention with sink over bf16 buffers (P2's inputs): out [T, H, 512]; len0 int [T] or
    None: top-k entries j >= len0[t] left out."""
    kv = torch.cat([buf0[idx0.long()], buf1[idx1.long()]], dim=1).double()  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.double(), kv) * SM_SCALE
    if len0 is not None:
        keep = torch.cat([torch.arange(idx0.shape[1], device=q.device)[None, :] < len0[:, None].long(),
                          torch.ones_like(idx1, dtype=torch.bool)], dim=1)
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.double()[None, :])
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink.double()[None, :] - m)
    return torch.einsum("thk,tkd->thd", p, kv) / den[..., None]


def plan_of(T, H, K, sms) -> tuple:
    """(plan text, launches) of the composite under auto for this shape and SM count."""
    p = dispatch.decode.plan_step(T, H, K, sms, dispatch.device.smem_per_block(torch.cuda.current_device()), (BS, BS))
    return f"paged {p.config} S{p.splits}", 1 + (not p.direct)


def sweep_candidates(T, H, K, sms, configs=SWEEP_CONFIGS, max_splits=20):
    out = []
    for name in configs:
        cfg = dispatch.decode.v3_config(name)
        if cfg["BLOCK_H"] > 16 and H <= 16:
            continue
        if not dispatch.decode.config_fits(name, dispatch.device.smem_per_block(torch.cuda.current_device())):
            continue
        nb = -(-K // cfg["BLOCK_N"])
        for s in dispatch.decode.balanced_splits(nb):
            if s <= max_splits:
                out.append((name, s))
    return out


def measure(shape, caches, ctxs, gbs, p2, sweep, replays, configs=SWEEP_CONFIGS, max_splits=20):
    T, H, K1 = shape
    K = K1 + 128
    (cc, bc), (cw, bw) = caches
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H + K1)
    cap = NBLK * BS
    topk = torch.randint(0, cap, (T, K1), device="cuda", generator=g, dtype=torch.int32)
    swa = torch.randint(0, cap, (T, 128), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device="cuda", generator=g)
    want, want_lse = reference.ref_dsv4_decode_fused(q, cc, topk, None, BS, cw, swa, None, BS, sink, SM_SCALE,
                                                     out_dtype=torch.float64)

    def check(out, lse):
        diff = (out.double() - want).norm().item() / max(want.norm().item(), 1e-30)
        try:
            assert_attention_close(out, lse, want, want_lse)
        except AssertionError:
            return "FAIL %.2g" % diff
        return "%.2g" % diff

    p2_want = None
    if p2 is not None:
        lens0 = torch.full((T,), K1, dtype=torch.int32, device="cuda")
        lens1 = torch.full((T,), 128, dtype=torch.int32, device="cuda")
        p2_want = ref_bf16(q, bc, topk, bw, swa, sink)
    rows = []
    for gs in ctxs:
        sms = gs.sms
        row = {"T": T, "H": H, "K": K, "SMs": sms}
        try:
            with gs.reentered():
                _host_plan.clear()
                os.environ[dispatch.decode.ENV_VAR] = "auto"
                row["plan"], launches = plan_of(T, H, K, sms)

                def ours():
                    return dsv4_decode.dsv4_decode_attention(q, cc, topk, cw, swa, sink, SM_SCALE, BS, BS)

                row["err"] = check(*ours())
                row["ours_us"] = graph_us(ours, replays)
                nbytes = T * K * RECORD_BYTES + 2 * T * H * D * 2
                h16 = max(16, -(-H // 16) * 16)
                row["bytes_us"] = nbytes / (gbs[sms] * 1e3)
                row["mma_us"] = 4.0 * T * h16 * K * D / (MMA_TFLOPS_132 * sms / 132 * 1e6)
                row["mma_a100_us"] = 4.0 * T * h16 * K * D / (A100_TFLOPS * sms / 108 * 1e6)
                row["launch_us"] = launches * LAUNCH_US
                row["floor_us"] = max(row["bytes_us"], row["mma_us"], row["launch_us"])
                row["ours/floor"] = row["ours_us"] / row["floor_us"]
                if p2 is not None:
                    def p2_call():
                        return p2(q, bc, topk, lens0, bw, swa, lens1, SM_SCALE, sink)

                    out = p2_call()[0]
                    d = (out.double() - p2_want).norm().item() / p2_want.norm().item()
                    row["p2_err"] = ("FAIL %.2g" if d > 1e-2 else "%.2g") % d
                    row["p2_us"] = graph_us(p2_call, replays)
                    row["ours/p2"] = row["ours_us"] / row["p2_us"]
                if sweep:
                    best = None
                    for name, s in sweep_candidates(T, H, K, sms, configs, max_splits):
                        fn = (lambda name=name, s=s: paged_decode.dsv4_decode_fused(
                            q, cc, topk, None, BS, cw, swa, None, BS, sink, SM_SCALE, s, config=name))
                        e = check(*fn())
                        if e.startswith("FAIL"):
                            row.setdefault("sweep_fail", []).append(f"{name}S{s}:{e}")
                            continue
                        us = graph_us(fn, max(5, replays // 2))
                        row.setdefault("sweep", {})[f"{name}S{s}"] = round(us, 2)
                        if best is None or us < best[0]:
                            best = (us, f"{name} S{s}")
                    if best:
                        row["best_us"], row["best"] = round(best[0], 2), best[1]
                        row["ours/best"] = row["ours_us"] / best[0]
        except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
            row["error"] = repr(exc)[:200]
            traceback.print_exc()
        finally:
            os.environ.pop(dispatch.decode.ENV_VAR, None)
        print({k: v for k, v in row.items() if k != "sweep"}, flush=True)
        if row.get("sweep"):
            print("sweep", T, H, K, sms, row["sweep"], flush=True)
        rows.append(row)
    return rows


class _Ctx:
    """A GreenStream entered once (context and stream kept) and re-entered per shape."""

    def __init__(self, n):
        self.gs = GreenStream(n)
        self.gs.__enter__()
        self.sms = self.gs.sms
        self.gs.__exit__(None, None, None)

    def reentered(self):
        gs = self.gs
        outer = self

        class _Re:
            def __enter__(self):
                self._saved = os.environ.get(dsv4_ops.envs.SMS)
                os.environ[dsv4_ops.envs.SMS] = str(outer.sms)
                # inputs made on the caller's stream (outside the context) are complete before the green
                # stream reads them: without this wait the first count's check could read a cache whose
                # scales were not yet written
                gs.stream.wait_stream(torch.cuda.current_stream())
                self._s = torch.cuda.stream(gs.stream)
                self._s.__enter__()

            def __exit__(self, *exc):
                gs.stream.synchronize()
                self._s.__exit__(*exc)
                if self._saved is None:
                    os.environ.pop(dsv4_ops.envs.SMS, None)
                else:
                    os.environ[dsv4_ops.envs.SMS] = self._saved
        return _Re()


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="decode_sms")
    ap.add_argument("--sms", default="", help="SM counts, e.g. 132,112,104 (default: the device's, and 112 and "
                                                  "104 where the device has more)")
    ap.add_argument("--shapes", default="", help="T:H:K1,... instead of the grid")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", default="", help="sweep configs, comma-separated (default: the dispatched ones)")
    ap.add_argument("--max-splits", type=int, default=20)
    ap.add_argument("--p2", default=os.environ.get("DSV4_P2_DIR", ""))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", "1e9")))
    ap.add_argument("--replays", type=int, default=20)
    ns = ap.parse_args()
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    t0 = time.time()
    p2 = load_p2(ns.p2)
    print(f"P2: {'from ' + ns.p2 if p2 else 'absent, skipped'}", flush=True)
    from green_ctx import device_sms

    full = device_sms(torch.cuda.current_device())
    counts = [int(n) for n in ns.sms.split(",")] if ns.sms else [full] + [n for n in (112, 104) if n < full]
    ctxs = [_Ctx(n) for n in counts]
    gbs = {}
    for c in ctxs:
        with c.reentered():
            gbs[c.sms] = copy_gbs()
    print("copy GB/s by SMs:", {k: round(v) for k, v in gbs.items()}, flush=True)
    caches = make_caches(p2 is not None)
    shapes = [(T, H, 512) for T in TS for H in HS] + [(T, H, 128) for T, H in DRAFT]
    if ns.shapes:
        shapes = [tuple(int(x) for x in sh.split(":")) for sh in ns.shapes.split(",")]
    rows = []
    cols = ["T", "H", "K", "SMs", "plan", "ours_us", "p2_us", "ours/p2", "floor_us", "ours/floor", "bytes_us",
            "mma_us", "mma_a100_us", "launch_us", "best_us", "best", "ours/best", "err", "p2_err", "error"]
    for shape in shapes:
        configs = tuple(ns.configs.split(",")) if ns.configs else SWEEP_CONFIGS
        rows += measure(shape, caches, ctxs, gbs, p2, ns.sweep, ns.replays, configs, ns.max_splits)
        write_results(ns.name, ns.out, rows, cols,
                      notes=(f"{os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3')}, "
                             f"SMs by driver green contexts (benchmarks/green_ctx.py), DSV4_AMPERE_SMS = SMs; copy "
                             f"GB/s by SMs {({k: round(v) for k, v in gbs.items()})}; P2 "
                             f"{'timed' if p2 else 'absent'}; 20 calls a graph, median; floors: module doc."))
        if time.time() - t0 > ns.budget:
            print("bench_decode_sms: time budget reached, stopping", flush=True)
            break
    print(f"bench_decode_sms: {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
