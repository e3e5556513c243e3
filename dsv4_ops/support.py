"""What this build supports where: ``is_supported(op) -> (ok, reason)`` and the printable table.

Sits above registration (it asks torch.ops which ops exist) and below the CLI.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import dispatch
from .registration import op_exists, op_names


def is_supported(op: str, device: Union[torch.device, str, int, None] = None,
                 capability: Optional[Tuple[int, int]] = None) -> Tuple[bool, str]:
    """Whether ``op`` can run its kernel on ``device`` (or a given capability), and why.

    Returns (ok, reason); reason names the variant that would run, or what is missing.
    """
    ops = op_names()
    if op not in ops:
        return False, f"unknown op {op!r}; ops are {', '.join(ops)}"
    if not op_exists(op):
        return False, f"{op} is not registered in this process (import dsv4_ops registers every op)"
    if capability is None:
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            return False, f"{op} has kernels for CUDA devices only (got {dev}); the CPU runs the reference"
        if not torch.cuda.is_available():
            return False, "no CUDA device; the CPU runs the PyTorch reference"
        capability = dispatch.device_capability(dev)
    cap = tuple(capability)
    entry = dispatch.table_variant(cap)
    if entry is None:
        return False, f"sm_{cap[0]}{cap[1]} is below sm_80: bf16 tl.dot and the kernels' layouts need Ampere"
    try:
        variant = dispatch.kernel_variant(cap)
    except ValueError as exc:
        return False, str(exc)
    if variant == "native" and not dispatch.native_fp8_available(cap):
        return False, (f"{dispatch.ENV_VAR}=native needs the E4M3 cvt of sm_89+; sm_{cap[0]}{cap[1]} "
                       "has only fp8e4b15/fp8e5 in Triton: use portable")
    where = "vLLM keeps upstream kernels; direct calls run " if entry == "upstream" else ""
    return True, f"{where}{variant} variant on sm_{cap[0]}{cap[1]}"


def format_table(capabilities=dispatch.SHOWCASE_CAPABILITIES) -> str:
    """A printable op table: one row per capability, one column per op."""
    ops = op_names()
    rows = [("capability", "table", "runs") + ops]
    for cap in capabilities:
        entry = dispatch.table_variant(cap) or "-"
        try:
            runs = dispatch.kernel_variant(cap)
        except (RuntimeError, ValueError) as exc:
            runs = f"error: {exc}"
        cells = tuple("yes" if is_supported(op, capability=cap)[0] else "no" for op in ops)
        rows.append((f"sm_{cap[0]}{cap[1]}", entry, runs) + cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
