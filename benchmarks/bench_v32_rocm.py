"""DeepSeek-V3.2 sparse MLA decode: vLLM 0.33.0's ROCm Triton bf16 kernels vs ours, same run.

    python3 benchmarks/bench_v32_rocm.py --out DIR [--quick] [--shapes TxH,...] [--budget-s S]

Requirements (the script checks them and says which one is missing):
  - CUDA GPU + triton (3.6 on the H200 image; 3.8 CPU here) and this repo (dsv4_ops importable;
    the script puts the repo root on sys.path);
  - vLLM 0.33.0's Python sources importable: a full install, or the e2e bundle's uncompiled
    sources (PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm after the installs of tests/e2e/gpu_run.sh).
    Without vLLM's compiled extensions the stand-ins of tests/e2e/platform_spoof.py
    (gpu_import_standins: a stub ``vllm._C_stable_libtorch``, FA package without its .so) are
    installed before vLLM is imported; nothing of vLLM's C++ is called;
  - env: DSV4_AMPERE_IMPL=portable (forced by platform_spoof.set_environment, which also sets
    VLLM_PLUGINS=""), DISABLE_MMA_V3=1 (set here unless given);
  - ~3 GB of GPU memory (bf16 cache 1.2 GB, fp8 cache 0.7 GB, float64 references).
  Lead's command (H200, inside the bundle environment):
    DISABLE_MMA_V3=1 DSV4_AMPERE_IMPL=portable PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm \
      python3 benchmarks/bench_v32_rocm.py --out $OUT/v32rocm
  Without a GPU (or with --cpu) it runs one tiny shape under the Triton interpreter on CPU
  tensors (TRITON_INTERPRET=1, tests/e2e/interpreter_patch.py for bf16 tl.dot), checks every
  kernel against float64 and times nothing.

What is compared (d_qk 576 = 512 latent + 64 RoPE, d_v 512, no sink, K = 2048 random slots of a
1,048,576-slot cache, T in {1, 16, 64, 128} tokens x H in {16 (TP8), 128 (TP1)} heads):
  vllm_1pass   vLLM's ``rocm_sparse_attn_prefill`` with ragged indices (its
               ``_sparse_attn_prefill_ragged_kernel``, one pass, grid (T, H/16)): what
               ``ROCMAiterMLASparseImpl._forward_mla`` runs on its Triton path when
               ``rocm_sparse_decode_bf16_num_splits`` says 1; the only vLLM Triton entry that
               accepts d_qk = 576. Over the bf16 rows viewed [rows, 1, 576] as the backend does.
  vllm_splitk  ``rocm_sparse_attn_decode_bf16`` (split-K, what the backend runs when the split
               count is > 1): tried once; at 576 its reduce kernel's ``tl.arange(0, COMB_DIM)``
               with COMB_DIM = 512 + 64 is not a power of two and does not compile (recorded).
  vllm_splitk_pad  NOT a vLLM code path: vLLM's two split-K kernels
               (``_sparse_attn_decode_ragged_bf16_partial_kernel`` + ``_sparse_attn_decode_reduce_kernel``)
               launched by this bench with the reduce's COMB_DIM padded to 1024 (partials and the
               reduce output 1024 wide; the partial kernel reads/writes the 576 real dims only,
               the padding lanes are never read back), then the [..., :512] copy that
               ``rocm_sparse_attn_decode_bf16`` does for a 512-wide output. The split count is
               vLLM's own ``rocm_sparse_decode_bf16_num_splits(T, H, K)``: on CUDA
               ``_ON_GFX950`` is False (the module defines it so off ROCm), so it picks
               ``_decode_num_splits`` (tuned on gfx950) with ``_decode_cu_count()`` = this GPU's
               SM count. Timed only where that count is > 1 (else the backend runs vllm_1pass).
  ours_bf16    ``torch.ops.dsv4_ampere.v32_sparse_mla_decode_out`` over the SAME bf16 rows (our
               ``auto`` cache [16384, 64, 576]; form and split count as dispatched).
  ours_fp8     the same op over the 656-byte ``fp8_ds_mla`` records of the same values (written
               by v32_kv_insert; reads 656 instead of 1152 bytes a key; its own float64
               reference over the dequantized records).
  On the CPU the op's CPU kernel is the reference, so the Triton launcher
  ``dsv4_ops.v32.v32_sparse_mla_decode`` is called instead (what the op's CUDA kernel calls).
Inputs per shape: fresh random q bf16 [T, H, 576] and top-k indices int32 [T, K] (all valid),
given to vLLM as its ragged form (indices [T*K], indptr [T+1] = 0, K, 2K, ...). Every output is
poisoned (NaN) and then checked against a float64 reference of the same inputs
(dsv4_ops.reference.ref_v32_sparse_mla_decode; dsv4_ops.testing.assert_attention_close, the
bounds of tests/test_v32_ops.py). Times: benchmarks.common.time_graph_us (20 calls in one CUDA
graph, median of replays; the 20 calls reuse the same slots, so L2 is warm where the touched
rows fit: T <= 16).
Floors: bytes / copy rate, useful FLOPs / cuBLAS bf16 matmul rate, 0.9 us a launch (max of the
three, one launch); bytes = T*K*1152 (bf16 rows) or T*K*656 (fp8 records) + q T*H*576*2 + out
T*H*512*2; useful FLOPs = 2*T*H*K*(576 + 512). vLLM's kernels pad both dots to BLOCK_D = 1024
(executed 2*T*H*K*2048, the column exec_flop_x). Rates measured in this run.
Writes DIR/v32_rocm_compare.{json,md} (rewritten after every shape; a timeout keeps what ran)
and a line per compiled kernel (registers, spills) in the notes.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
E2E = os.path.join(ROOT, "tests", "e2e")

QK, NOPE, ROPE, DV, REC = 576, 512, 64, 512, 656
SM_SCALE = 0.1352
BS = 64
NBLK = 16384  # 1M slots, as benchmarks/bench_v32.py
K = 2048
TS = (1, 16, 64, 128)
HS = (16, 128)
LAUNCH_US = 0.9
NAME = "v32_rocm_compare"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--quick", action="store_true", help="fewer replays; shapes 1x16,16x16,128x128")
    p.add_argument("--shapes", default="", help="TxH,TxH,... (default: all 8)")
    p.add_argument("--budget-s", type=float, default=45.0, help="no new shape starts after this many seconds")
    p.add_argument("--cpu", action="store_true", help="the interpreter run (default when no GPU)")
    return p.parse_args()


def _vllm_has_extensions() -> bool:
    spec = importlib.util.find_spec("vllm")  # top level: does not import vllm
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench_v32_rocm: vLLM 0.33.0's Python sources are not importable "
                         "(install vllm, or PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm as tests/e2e/gpu_run.sh)")
    loc = list(spec.submodule_search_locations)[0]
    return bool(glob.glob(os.path.join(loc, "_C_stable_libtorch*.so")))


def setup(cpu: bool):
    """Environment, then vLLM's module; returns it. The e2e helpers, not copies of them."""
    sys.path.insert(0, E2E)
    sys.path.insert(0, ROOT)
    import platform_spoof

    platform_spoof.set_environment(cpu)
    os.environ.setdefault("DISABLE_MMA_V3", "1")
    if cpu:
        import interpreter_patch

        interpreter_patch.apply()  # vLLM's bf16 tl.dot under the interpreter
    if not _vllm_has_extensions():
        platform_spoof.gpu_import_standins()
    import vllm.v1.attention.ops.rocm_aiter_mla_sparse as vr

    if type(vr.triton).__name__ == "TritonPlaceholder":
        raise SystemExit(f"bench_v32_rocm: vLLM gave a Triton placeholder ({vr.triton!r}): no active driver")
    return vr


# ---------------------------------------------------------------------------------------------


def _not_cpu_cls():
    """CPU run: vLLM's wrappers assert ``not t.is_cpu``; the interpreter reads any tensor, so the
    CPU run hands them views (same storage) whose is_cpu answers False."""
    import torch

    class NotCpu(torch.Tensor):
        @property
        def is_cpu(self):  # noqa: D401
            return False

    return NotCpu


def make_caches(dev, nblk, seed):
    """The same values twice: bf16 ``auto`` rows [nblk, 64, 576] and fp8_ds_mla records."""
    import torch
    from dsv4_ops import v32

    g = torch.Generator(device=dev).manual_seed(seed)
    rows = torch.empty(nblk, BS, QK, dtype=torch.bfloat16, device=dev)
    recs = torch.empty(nblk, BS, REC, dtype=torch.uint8, device=dev)
    flat = rows.view(-1, QK)
    n = nblk * BS
    for lo in range(0, n, 1 << 18):
        m = min(1 << 18, n - lo)
        flat[lo:lo + m, :NOPE] = torch.randn(m, NOPE, device=dev, generator=g).to(torch.bfloat16)
        flat[lo:lo + m, NOPE:] = torch.randn(m, ROPE, device=dev, generator=g).to(torch.bfloat16)
        slots = torch.arange(lo, lo + m, device=dev)
        v32.v32_kv_insert(flat[lo:lo + m, :NOPE], flat[lo:lo + m, NOPE:], recs, slots)
    return rows, recs


class Runners:
    """fn() for each kernel, all writing out bf16 [T, H, 512]."""

    def __init__(self, vr, cpu):
        self.vr, self.cpu = vr, cpu
        self.wrap = (lambda t: t.as_subclass(_not_cpu_cls())) if cpu else (lambda t: t)
        self.pad_opts = {}  # vllm_splitk_pad: num_stages=1 once the default ran out of shared memory

    def vllm_1pass(self, q, rows, ragged, indptr, out):
        w, vr = self.wrap, self.vr
        kv = w(rows.view(-1, 1, QK))  # the backend's kv_c_and_k_pe_cache.view(-1, 1, q.shape[-1])
        qq, oo, ri, rp = w(q), w(out), w(ragged), w(indptr)
        return lambda: vr.rocm_sparse_attn_prefill(
            q=qq, kv=kv, indices=None, topk_length=None, scale=SM_SCALE, head_dim=QK, nope_head_dim=NOPE,
            rope_head_dim=ROPE, attn_sink=None, output=oo, ragged_indices=ri, ragged_indptr=rp)

    def vllm_splitk(self, q, rows, ragged, indptr, out, splits):
        w, vr = self.wrap, self.vr
        kv = w(rows.view(-1, 1, QK))
        qq, oo, ri, rp = w(q), w(out), w(ragged), w(indptr)
        return lambda: vr.rocm_sparse_attn_decode_bf16(
            q=qq, kv=kv, scale=SM_SCALE, head_dim=QK, nope_head_dim=NOPE, rope_head_dim=ROPE, attn_sink=None,
            output=oo, ragged_indices=ri, ragged_indptr=rp, num_splits=splits)

    def vllm_splitk_pad(self, q, rows, ragged, indptr, out, splits):
        """vLLM's two split-K kernels, launched here by keyword with the reduce's COMB_DIM = 1024."""
        import torch

        vr = self.vr
        T, H, _ = q.shape
        kv = rows.view(-1, QK)
        bh, bk = vr._SPARSE_DECODE_BF16_BLOCK_H, vr._SPARSE_DECODE_BF16_BLOCK_K
        bd = vr.triton.next_power_of_2(QK)
        comb = bd  # 1024: the power of two the reduce's tl.arange needs
        pm = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        # zeros: the partial kernel writes dims < 576 only, so the padding lanes stay 0 (never NaN)
        pa = torch.zeros(T, splits, H, comb, dtype=torch.float32, device=q.device)
        wide = torch.empty(T, H, comb, dtype=out.dtype, device=q.device)
        sink = torch.empty(1, dtype=torch.float32, device=q.device)

        opts = self.pad_opts

        def partial(**stages):
            vr._sparse_attn_decode_ragged_bf16_partial_kernel[(T, splits, vr.triton.cdiv(H, bh))](
                q_ptr=q, kv_ptr=kv, kv_indices_ptr=ragged, kv_indptr_ptr=indptr, part_m_ptr=pm, part_l_ptr=pl,
                part_acc_ptr=pa, q_stride_t=q.stride(0), q_stride_h=q.stride(1), q_stride_d=q.stride(2),
                kv_stride_n=kv.stride(0), kv_stride_d=kv.stride(1), pm_stride0=pm.stride(0), pm_stride_s=pm.stride(1),
                pa_stride0=pa.stride(0), pa_stride_s=pa.stride(1), pa_stride_h=pa.stride(2), num_heads=H,
                head_dim=QK, num_kv=kv.shape[0], scale=float(SM_SCALE), BLOCK_H=bh, BLOCK_D=bd, BLOCK_K=bk,
                NUM_SPLITS=splits, num_warps=4, **stages)

        def run():
            if "num_stages" in opts:
                partial(num_stages=opts["num_stages"])
            else:
                try:  # vLLM's launch: num_warps=4, the backend's default num_stages
                    partial()
                except Exception as exc:  # noqa: BLE001 - only an out-of-shared-memory compile is retried
                    if type(exc).__name__ != "OutOfResources":
                        raise
                    opts["num_stages"] = 1
                    opts["why"] = f"default num_stages: {exc}"[:160]
                    print(f"vllm_splitk_pad: {opts['why']}; num_stages=1 from now on", flush=True)
                    partial(num_stages=1)
            vr._sparse_attn_decode_reduce_kernel[(T, H)](
                part_m_ptr=pm, part_l_ptr=pl, part_acc_ptr=pa, attn_sink_ptr=sink, out_ptr=wide, pos_ptr=None,
                cos_sin_ptr=None, out_scale_ptr=None, out_stride0=wide.stride(0), out_stride1=wide.stride(1),
                os_stride0=0, os_stride1=comb // 32, pm_stride0=pm.stride(0), pm_stride_s=pm.stride(1),
                pa_stride0=pa.stride(0), pa_stride_s=pa.stride(1), pa_stride_h=pa.stride(2), cs_stride=0,
                num_heads=H, HAS_ATTN_SINK=False, ADAPTIVE_SPLITS=False, COMB_DIM=comb, BLOCK_H=1,
                NUM_SPLITS=splits, SPLITS_PAD=vr.triton.next_power_of_2(splits), FUSE_INV_ROPE=False,
                NOPE=NOPE, HALF=ROPE // 2, QUANT_OUT=False, num_warps=4)
            out.copy_(wide[..., :DV])

        return run

    def ours(self, q, cache, idx, out):
        import torch

        if self.cpu:  # the op's CPU kernel is the reference: call the Triton launcher itself
            from dsv4_ops import v32

            return lambda: v32.v32_sparse_mla_decode(q, cache, idx, None, SM_SCALE, 0, out=out)
        op = torch.ops.dsv4_ampere.v32_sparse_mla_decode_out
        return lambda: op(q, cache, idx, None, SM_SCALE, 0, out)


def check(fn, out, ref):
    """Poison, run once, compare with the float64 reference: (status, rel Frobenius error)."""
    import torch
    from dsv4_ops.testing import assert_attention_close

    out.fill_(float("nan"))
    fn()
    if out.is_cuda:
        torch.cuda.synchronize()
    o = out.double().cpu()
    err = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
    try:
        assert_attention_close(out, None, ref, None)
        return "ok", err
    except AssertionError as exc:
        return f"FAIL: {str(exc)[:160]}", err


def compiled_lines(vr):
    """One line per kernel Triton compiled in this run (registers, spills, shared memory)."""
    from dsv4_ops.csrc_triton import v32_attention as ak

    fns = [vr._sparse_attn_prefill_ragged_kernel, vr._sparse_attn_decode_ragged_bf16_partial_kernel,
           vr._sparse_attn_decode_reduce_kernel]
    fns += [getattr(ak, n) for n in dir(ak) if n.startswith("_v32_sparse_mla") and n.endswith("_kernel")]
    lines = []
    for fn in fns:
        for _, caches in getattr(fn, "device_caches", {}).items():
            for ck in list(caches[0].values()):
                try:
                    md = ck.metadata
                    lines.append(f"{fn.__name__}: warps {md.num_warps} stages {md.num_stages} regs "
                                 f"{getattr(ck, 'n_regs', '?')} spills {getattr(ck, 'n_spills', '?')} smem {md.shared}")
                except Exception as exc:  # noqa: BLE001 - a record, never a failure
                    lines.append(f"{fn.__name__}: {type(exc).__name__}: {exc}"[:200])
    return lines


COLUMNS = ["T", "H", "K", "vllm_splits", "vllm_1pass_us", "vllm_splitk_pad_us", "ours_bf16_us", "ours_bf16_form",
           "ours_bf16_splits", "ours_fp8_us", "ours_fp8_splits", "floor_bf16_us", "floor_fp8_us", "x_vllm1",
           "x_vllm_best", "fp8_gain", "floor/vllm_best", "floor/ours_bf16", "floor/ours_fp8", "err_vllm_1pass",
           "err_vllm_splitk_pad", "err_ours_bf16", "err_ours_fp8", "checks"]


def shape_row(vr, run, rows, recs, T, H, K_, rates, timer, sms, state, dev):
    """One table row at (T, H): every kernel checked, then timed by timer(fn) (None: not timed)."""
    import torch
    from dsv4_ops import dispatch
    from dsv4_ops import reference as R

    cpu = dev == "cpu"
    g = torch.Generator(device=dev).manual_seed(1000 * T + H)
    cap = rows.shape[0] * rows.shape[1]
    idx = torch.randint(0, cap, (T, K_), device=dev, generator=g, dtype=torch.int32)
    q = torch.randn(T, H, QK, device=dev, generator=g).to(torch.bfloat16)
    ragged = idx.reshape(-1).contiguous()
    indptr = torch.arange(0, T * K_ + 1, K_, device=dev, dtype=torch.int32)
    out = torch.empty(T, H, DV, dtype=torch.bfloat16, device=dev)
    ref_bf16 = R.ref_v32_sparse_mla_decode(q, rows, idx, None, SM_SCALE, torch.float64, torch.float64)[0].cpu()
    ref_fp8 = R.ref_v32_sparse_mla_decode(q, recs, idx, None, SM_SCALE, torch.float64, torch.float64)[0].cpu()
    S = vr.rocm_sparse_decode_bf16_num_splits(T, H, K_)
    if cpu and S == 1:
        S = 2  # the CPU run exercises the split-K kernels too (vLLM's rule gives 1 for K < 512)
    row = {"T": T, "H": H, "K": K_, "vllm_splits": S}
    checks = []
    cases = [("vllm_1pass", run.vllm_1pass(q, rows, ragged, indptr, out), ref_bf16)]
    if S > 1:
        if not state.get("splitk_tried"):
            state["splitk_tried"] = True
            try:
                st, e = check(run.vllm_splitk(q, rows, ragged, indptr, out, S), out, ref_bf16)
                state["splitk"] = f"rocm_sparse_attn_decode_bf16 at T={T} H={H} S={S}: ran, {st}, err {e:.3g}"
            except Exception as exc:  # noqa: BLE001 - expected at 576 (the reduce's tl.arange)
                msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
                i = msg.find("arange")
                state["splitk"] = (f"rocm_sparse_attn_decode_bf16 at T={T} H={H} S={S}: does not compile: "
                                   + (msg[max(0, i - 60):i + 60] if i >= 0 else msg[:200]))
            print(state["splitk"], flush=True)
        cases.append(("vllm_splitk_pad", run.vllm_splitk_pad(q, rows, ragged, indptr, out, S), ref_bf16))
    cases.append(("ours_bf16", run.ours(q, rows, idx, out), ref_bf16))
    cases.append(("ours_fp8", run.ours(q, recs, idx, out), ref_fp8))
    for fp8, key in ((False, "ours_bf16"), (True, "ours_fp8")):
        form = dispatch.v32.form_for(True, None, fp8, H, T)
        row[f"{key}_form"] = form
        row[f"{key}_splits"] = dispatch.v32.num_splits_for(T, H, K_, sms, form)
    for name, fn, ref in cases:
        try:
            st, e = check(fn, out, ref)
            row[f"err_{name}"] = e
            if st != "ok":
                checks.append(f"{name} {st}")
            if timer is not None:
                row[f"{name}_us"] = timer(fn)
        except Exception as exc:  # noqa: BLE001 - one failing case must not stop the rest
            checks.append(f"{name} error {type(exc).__name__}: {str(exc)[:160]}")
            traceback.print_exc()
    row["checks"] = "; ".join(checks) or "all ok"
    qo = T * H * (QK + DV) * 2
    flops = 2 * T * H * K_ * (QK + DV)
    row["exec_flop_x"] = (2 * 1024) / (QK + DV)
    if rates:
        gbs, tfl = rates
        for key, per in (("bf16", QK * 2), ("fp8", REC)):
            row[f"floor_{key}_us"] = max((T * K_ * per + qo) / (gbs * 1e3), flops / (tfl * 1e6), LAUNCH_US)
        nan = float("nan")
        vb = min(row.get("vllm_1pass_us", nan), row.get("vllm_splitk_pad_us", math.inf))
        ob, of = row.get("ours_bf16_us", nan), row.get("ours_fp8_us", nan)
        row["x_vllm1"] = row.get("vllm_1pass_us", nan) / ob
        row["x_vllm_best"] = vb / ob
        row["fp8_gain"] = ob / of
        row["floor/vllm_best"] = row["floor_bf16_us"] / vb
        row["floor/ours_bf16"] = row["floor_bf16_us"] / ob
        row["floor/ours_fp8"] = row["floor_fp8_us"] / of
        row["TFLOP/s_ours_bf16"] = flops / ob / 1e6
        row["GB/s_ours_bf16"] = (T * K_ * QK * 2 + qo) / ob / 1e3
    print(row, flush=True)
    return row


def main():
    args = parse_args()
    t0 = time.time()
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    vr = setup(cpu)
    sys.path.insert(0, HERE)
    from common import copy_bandwidth_gbs, time_graph_us, write_results

    import dsv4_ops  # noqa: F401  (registers torch.ops.dsv4_ampere)
    from dsv4_ops.dispatch.device import num_sms

    print(f"vLLM module {vr.__file__}; _ON_GFX950={vr._ON_GFX950}; cpu={cpu}; import {time.time() - t0:.1f} s",
          flush=True)
    run = Runners(vr, cpu)
    state = {}
    if cpu:
        dev, rates, sms = "cpu", None, 108
        rows, recs = make_caches(dev, 4, 1)
        shapes, k_, replays = [(2, 16)], 512, 0
        print(f"CPU interpreter run: T=2 H=16 K={k_}, 256-slot cache, vLLM _decode_cu_count()="
              f"{vr._decode_cu_count()}", flush=True)
    else:
        dev = "cuda"
        sms = num_sms(torch.cuda.current_device())
        from bench_v32 import mm_tflops

        rates = (copy_bandwidth_gbs(256 << 20), mm_tflops())
        print(f"copy {rates[0]:.0f} GB/s, bf16 mm {rates[1]:.0f} TFLOP/s, {sms} SMs, vLLM cu {vr._decode_cu_count()}",
              flush=True)
        rows, recs = make_caches(dev, NBLK, 1)
        k_ = K
        replays = 5 if args.quick else 10
        if args.shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        elif args.quick:
            shapes = [(1, 16), (16, 16), (128, 128)]
        else:
            shapes = [(T, H) for T in TS for H in HS]
    out_rows, skipped = [], []

    def notes():
        lines = [f"vLLM module: {vr.__name__} ({vr.__file__}); "
                 f"_ON_GFX950={vr._ON_GFX950} (split rule: _decode_num_splits, cu={vr._decode_cu_count()}).",
                 f"Split-K as vLLM calls it: {state.get('splitk', 'not tried (no shape with splits > 1)')}",
                 "x_vllm1 = vllm_1pass_us / ours_bf16_us; x_vllm_best = min(vllm_1pass, vllm_splitk_pad) / "
                 "ours_bf16_us (> 1: ours faster); fp8_gain = ours_bf16_us / ours_fp8_us; floor/X = floor_bf16_us "
                 "(floor_fp8_us for ours_fp8) / X_us; err_* = relative Frobenius error vs float64.",
                 "vllm_splitk_pad is not a vLLM code path (see the script's docstring); vllm_1pass is. "
                 f"Its partial kernel's launch: {run.pad_opts or 'as vLLM (num_warps=4, default num_stages)'}.",
                 f"DSV4_AMPERE_IMPL={os.environ.get('DSV4_AMPERE_IMPL')}, DISABLE_MMA_V3="
                 f"{os.environ.get('DISABLE_MMA_V3', '-')}, wall {time.time() - t0:.0f} s."]
        if rates:
            lines.insert(0, f"Same run: copy {rates[0]:.0f} GB/s, bf16 matmul {rates[1]:.0f} TFLOP/s (8192^3, cuBLAS), "
                            f"{sms} SMs.")
        if skipped:
            lines.append(f"Not run (budget {args.budget_s:.0f} s): {skipped}")
        comp = compiled_lines(vr) if not cpu else []
        if comp:
            lines.append("Compiled kernels:\n" + "\n".join(f"- {c}" for c in comp))
        return "\n".join(lines)

    for T, H in shapes:
        if time.time() - t0 > args.budget_s and not cpu:
            skipped.append(f"{T}x{H}")
            continue
        timer = None if cpu else (lambda fn: time_graph_us(fn, replays))
        out_rows.append(shape_row(vr, run, rows, recs, T, H, k_, rates, timer, sms, state, dev))
        write_results(NAME, args.out, out_rows, COLUMNS, notes())
    bad = [r for r in out_rows if r["checks"] != "all ok"]
    print(f"done {time.time() - t0:.0f} s; {len(out_rows)} shapes, {len(bad)} with a failed check", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
