"""Numeric self-test of every op against its reference (used by ``dsv4-ops check``).

On a GPU: the real kernels on fresh random inputs. On a CPU: the references against
independent formulations, plus the kernels the Triton interpreter runs faithfully (the
interpreter is switched on at import, so those run in a subprocess with TRITON_INTERPRET=1).
Each check returns (ok, detail). Op modules add checks to CHECKS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Tuple

import torch

from .. import reference, testing

Check = Callable[[str], Tuple[bool, str]]
# name -> (check(device), where it runs: "gpu", "cpu" (reference level) or "interpret")
CHECKS: Dict[str, Tuple[Check, str]] = {}


def check(name: str, where: str):
    def deco(fn: Check) -> Check:
        CHECKS[name] = (fn, where)
        return fn
    return deco


def _finite_codes(device):
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    return codes, (codes & 0x7F) != 0x7F


@check("e4m3_decode: reference == torch fp8 (254 finite codes)", "cpu")
def _ref_decode(device):
    codes, fin = _finite_codes("cpu")
    ok = torch.equal(reference.ref_e4m3_decode(codes)[fin], codes.view(torch.float8_e4m3fn).float()[fin])
    return ok, "all 254 finite codes"


@check("e4m3_encode: reference == torch saturating cast (all bf16, midpoints, specials)", "cpu")
def _ref_encode(device):
    x = torch.cat([testing.all_bf16().float(), testing.next_up_down(testing.e4m3_midpoints()),
                   testing.e4m3_specials(), testing.random_fp32_bits(1 << 18)])
    nan = torch.isnan(x)
    bad = int((reference.ref_e4m3_encode(x)[~nan] != testing.torch_saturating_e4m3(x)[~nan]).sum())
    return bad == 0, f"{bad} mismatches in {int((~nan).sum())} values"


@check("e4m3_decode kernel == reference (256 codes)", "kernel")
def _kernel_decode(device):
    codes, fin = _finite_codes(device)
    got = torch.ops.dsv4_ampere.e4m3_decode(codes) if device == "cuda" else _codec().e4m3_decode(codes)
    ok = torch.equal(got[fin].cpu(), reference.ref_e4m3_decode(codes.cpu())[fin.cpu()])
    return ok, "bit-exact on the finite codes"


@check("e4m3_encode(exact) kernel == reference (all bf16 + 2**18 random fp32)", "kernel")
def _kernel_encode(device):
    x = torch.cat([testing.all_bf16().float(), testing.random_fp32_bits(1 << 18)]).to(device)
    got = torch.ops.dsv4_ampere.e4m3_encode(x, True) if device == "cuda" else _codec().e4m3_encode(x)
    nan = torch.isnan(x.cpu())
    bad = int((got.cpu()[~nan] != reference.ref_e4m3_encode(x.cpu())[~nan]).sum())
    return bad == 0, f"{bad} mismatches"


def _codec():
    from .. import codec

    return codec


def _kv_inputs(device, n=96, block_size=16, num_blocks=12):
    from .. import layout

    kv = (torch.randn(n, layout.HEAD_DIM, device=device) * torch.rand(n, 1, device=device) * 30).bfloat16()
    cache = torch.zeros((num_blocks, layout.vllm_page_bytes(block_size)), dtype=torch.uint8, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:n]
    return kv, cache, slots, block_size


@check("kv_cache: reference insert + gather == unpack(pack(kv)), error within UE8M0/E4M3 rounding", "cpu")
def _ref_kv_roundtrip(device):
    kv, cache, slots, bs = _kv_inputs("cpu")
    reference.ref_kv_cache_insert(kv, cache, slots, bs)
    got = reference.ref_kv_cache_gather(cache, slots, bs)
    exact = torch.equal(got, reference.ref_unpack_records(reference.ref_pack_records(kv)))
    rel = float((got.float() - kv.float()).norm() / kv.float().norm())
    return exact and rel < 0.05, f"bit-exact to pack/unpack, rel. error {rel:.2e} vs the bf16 input"


@check("kv_cache insert + gather kernels == reference, bit for bit (adversarial slots)", "kernel")
def _kernel_kv(device):
    from .. import kv_cache

    kv, cache, slots, bs = _kv_inputs(device)
    ref_cache = cache.cpu().clone()
    reference.ref_kv_cache_insert(kv.cpu(), ref_cache, slots.cpu(), bs)
    if device == "cuda":
        torch.ops.dsv4_ampere.kv_cache_insert(kv, cache, slots, bs)
    else:
        kv_cache.kv_cache_insert(kv, cache, slots, bs)
    probe = torch.cat([slots, torch.tensor([-5, cache.shape[0] * bs, 2 ** 40], device=device)])
    got = (torch.ops.dsv4_ampere.kv_cache_gather(cache, probe, bs) if device == "cuda"
           else kv_cache.kv_cache_gather(cache, probe, bs))
    ok = torch.equal(cache.cpu(), ref_cache) and torch.equal(got.cpu(), reference.ref_kv_cache_gather(ref_cache, probe.cpu(), bs))
    return ok, "cache bytes and gathered rows identical; invalid slots give zero rows"


def _attn_inputs(device, T=3, H=8, K=100, N=300):
    q = torch.randn(T, H, 512, device=device).bfloat16()
    kv = torch.randn(N, 512, device=device).bfloat16()
    idx = torch.randint(-2, N + 2, (T, K), device=device, dtype=torch.int32)
    topk_length = torch.randint(0, K + 1, (T,), device=device, dtype=torch.int32)
    sink = torch.randn(H, device=device)
    return q, kv, idx, topk_length, sink, 512 ** -0.5


@check("sparse_mla: reference split (S=5) + merge == unsplit reference with sink", "cpu")
def _ref_attention(device):
    q, kv, idx, tl_, sink, scale = _attn_inputs("cpu")
    o_p, l_p = reference.ref_sparse_mla_split(q, kv, idx, tl_, scale, 5)
    out, lse = reference.ref_merge_splits(o_p, l_p, sink, out_dtype=torch.float32)
    want, want_lse = reference.ref_sparse_mla_decode(q, kv, idx, tl_, sink, scale, out_dtype=torch.float32)
    err = float((out - want).norm() / want.norm())
    return err < 1e-5 and torch.allclose(lse, want_lse, atol=1e-5), f"rel. error {err:.1e}"


@check("merge_splits kernel == float64 reference (S=7, sink, an empty row)", "kernel")
def _kernel_merge(device):
    from .. import attention

    o_p = torch.randn(2, 8, 7, 512, device=device)
    l_p = torch.randn(2, 8, 7, device=device) * 3
    l_p[0, 0] = float("-inf")
    sink = torch.randn(8, device=device)
    out, lse = (torch.ops.dsv4_ampere.merge_splits(o_p, l_p, sink) if device == "cuda"
                else attention.merge_splits(o_p, l_p, sink))
    want, want_lse = reference.ref_merge_splits(o_p.cpu(), l_p.cpu(), sink.cpu(), out_dtype=torch.float32)
    err = float((out.cpu().float() - want).norm() / want.norm())
    ok = err < 5e-3 and torch.allclose(lse.cpu(), want_lse, atol=1e-4) and not torch.isnan(out).any()
    return ok, f"rel. error {err:.1e}"


@check("sparse_mla_decode kernels == float64 reference (T=3, H=8, K=100, invalid indices, sink)", "gpu")
def _gpu_attention(device):
    q, kv, idx, tl_, sink, scale = _attn_inputs(device)
    out, lse = torch.ops.dsv4_ampere.sparse_mla_decode(q, kv, idx, tl_, sink, scale, 0)
    want, want_lse = reference.ref_sparse_mla_decode(q.cpu(), kv.cpu(), idx.cpu(), tl_.cpu(), sink.cpu(), scale,
                                                     out_dtype=torch.float32)
    err = float((out.cpu().float() - want).norm() / want.norm())
    lse_err = float((lse.cpu() - want_lse).abs().max())
    return err <= 5e-3 and lse_err <= 1e-3, f"out rel. error {err:.1e}, lse abs. error {lse_err:.1e}"


def run_checks(device: str, kinds) -> List[Dict[str, object]]:
    rows = []
    for name, (fn, where) in CHECKS.items():
        if where not in kinds:
            continue
        try:
            ok, detail = fn(device)
        except Exception as exc:  # noqa: BLE001 - a crash is a failed check, reported
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:300]
        rows.append({"check": name, "device": device, "ok": bool(ok), "detail": detail})
    return rows


def run() -> List[Dict[str, object]]:
    """All checks for this machine: GPU kernels if there is a GPU, else reference + interpreter."""
    if torch.cuda.is_available():
        return run_checks("cpu", ("cpu",)) + run_checks("cuda", ("kernel", "gpu"))
    rows = run_checks("cpu", ("cpu",))
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "dsv4_ops.tools.selftest", "--interpret-json"], env=env,
                         capture_output=True, text=True)
    try:
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        rows.append({"check": "interpreter self-test", "device": "cpu", "ok": False,
                     "detail": (out.stderr or out.stdout)[-300:]})
    return rows


def format_rows(rows) -> str:
    return "\n".join(f"  [{'ok' if r['ok'] else 'FAIL'}] ({r['device']}) {r['check']}: {r['detail']}" for r in rows)


if __name__ == "__main__":
    if "--interpret-json" in sys.argv:
        from triton import knobs

        assert knobs.runtime.interpret, "run with TRITON_INTERPRET=1"
        for row in (rows := run_checks("cpu", ("kernel",))):
            row["device"] = "cpu, Triton interpreter"
        print(json.dumps(rows))
    else:
        print(format_rows(run()))
