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

from . import reference, testing

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
    from . import codec

    return codec


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
    out = subprocess.run([sys.executable, "-m", "dsv4_ops.selftest", "--interpret-json"], env=env,
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
