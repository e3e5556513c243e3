"""Capability-keyed op table: which kernel variant runs on which GPU.

Variants:
  portable  no fp8 dtype in any kernel (E4M3 through fp8e4b15 or integer bit operations);
            what sm_80/sm_86/sm_87 (A100, A800, A10, A6000, RTX 30xx) run.
  native    the hardware E4M3 type (``tl.float8e4nv``, sm_89+).
  upstream  sm_90 and newer inside vLLM: vLLM keeps its own kernels (FlashMLA, DeepGEMM).
            Called directly, this library's ops still run there with the native variant.

``DSV4_AMPERE_IMPL=portable|native|auto`` (default ``auto``) overrides the kernel variant:
forcing ``portable`` on an H200 runs exactly the kernels an A100 would run.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch

ENV_VAR = "DSV4_AMPERE_IMPL"
KERNEL_VARIANTS = ("portable", "native")
_OVERRIDES = ("auto",) + KERNEL_VARIANTS

# Public ops of the dsv4_ampere namespace; an op module adds its names here when it lands.
OPS = (
    "e4m3_decode",
    "e4m3_encode",
    "kv_cache_insert",
    "kv_cache_gather",
    "kv_cache_gather_into",
    "sparse_mla_split",
    "merge_splits",
    "sparse_mla_decode",
    "dsv4_decode_indices",
)

# (major, minor) -> variant. Looked up exactly first, then by the rules in table_variant().
CAPABILITY_TABLE = {
    (8, 0): "portable",  # A100, A800
    (8, 6): "portable",  # A10, A40, A6000, RTX 30xx
    (8, 7): "portable",  # Jetson Orin
    (8, 9): "native",  # Ada: fp8 cvt exists, no FlashMLA / DeepGEMM
    (9, 0): "upstream",  # Hopper
    (10, 0): "upstream",  # Blackwell
}

# Capabilities the CLI prints the table for.
SHOWCASE_CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0))


def table_variant(capability: Tuple[int, int]) -> Optional[str]:
    """The op-table entry for a (major, minor) capability, ignoring the override; None below sm_80."""
    capability = tuple(capability)
    if capability in CAPABILITY_TABLE:
        return CAPABILITY_TABLE[capability]
    major, minor = capability
    if major < 8:
        return None
    if major == 8:
        return "native" if minor >= 9 else "portable"
    return "upstream"


def native_fp8_available(capability: Tuple[int, int]) -> bool:
    """True where the hardware has the E4M3 cvt (sm_89+)."""
    return tuple(capability) >= (8, 9)


def impl_override() -> str:
    """The value of DSV4_AMPERE_IMPL (auto when unset); ValueError on anything else."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _OVERRIDES:
        raise ValueError(f"{ENV_VAR} must be one of {_OVERRIDES}, got {value!r}")
    return value


def kernel_variant(capability: Tuple[int, int]) -> str:
    """The kernel variant a direct call of an op runs on this capability: portable or native.

    The override wins; 'upstream' runs the native kernels when the ops are called directly.
    """
    forced = impl_override()
    if forced != "auto":
        return forced
    entry = table_variant(capability)
    if entry is None:
        raise RuntimeError(f"dsv4_ops needs compute capability >= 8.0, got sm_{capability[0]}{capability[1]}")
    return "portable" if entry == "portable" else "native"


def routes_to_dsv4_ops(capability: Tuple[int, int]) -> bool:
    """True where vLLM should use this library's ops (sm_8x, or whenever the override is set)."""
    if impl_override() != "auto":
        return True
    return table_variant(capability) in ("portable", "native")


def device_capability(device: Union[torch.device, str, int, None] = None) -> Tuple[int, int]:
    """(major, minor) of a CUDA device; raises if there is none."""
    return tuple(torch.cuda.get_device_capability(device))


def _op_defined(op: str) -> bool:
    try:
        getattr(torch.ops.dsv4_ampere, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def is_supported(op: str, device: Union[torch.device, str, int, None] = None,
                 capability: Optional[Tuple[int, int]] = None) -> Tuple[bool, str]:
    """Whether ``op`` can run its kernel on ``device`` (or a given capability), and why.

    Returns (ok, reason); reason names the variant that would run, or what is missing.
    """
    if op not in OPS:
        return False, f"unknown op {op!r}; ops are {', '.join(OPS)}"
    if not _op_defined(op):
        return False, f"{op} is part of the contract but not built in this version of dsv4_ops"
    if capability is None:
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            return False, f"{op} has kernels for CUDA devices only (got {dev}); the CPU runs the reference"
        if not torch.cuda.is_available():
            return False, "no CUDA device; the CPU runs the PyTorch reference"
        capability = device_capability(dev)
    cap = tuple(capability)
    entry = table_variant(cap)
    if entry is None:
        return False, f"sm_{cap[0]}{cap[1]} is below sm_80: bf16 tl.dot and the kernels' layouts need Ampere"
    try:
        variant = kernel_variant(cap)
    except ValueError as exc:
        return False, str(exc)
    if variant == "native" and not native_fp8_available(cap):
        return False, (f"{ENV_VAR}=native needs the E4M3 cvt of sm_89+; sm_{cap[0]}{cap[1]} "
                       "has only fp8e4b15/fp8e5 in Triton: use portable")
    where = "vLLM keeps upstream kernels; direct calls run " if entry == "upstream" else ""
    return True, f"{where}{variant} variant on sm_{cap[0]}{cap[1]}"


def format_table(capabilities=SHOWCASE_CAPABILITIES) -> str:
    """A printable op table: one row per capability, one column per op."""
    rows = [("capability", "table", "runs") + tuple(OPS)]
    for cap in capabilities:
        entry = table_variant(cap) or "-"
        try:
            runs = kernel_variant(cap)
        except (RuntimeError, ValueError) as exc:
            runs = f"error: {exc}"
        cells = []
        for op in OPS:
            ok, _ = is_supported(op, capability=cap)
            cells.append("yes" if ok else "no")
        rows.append((f"sm_{cap[0]}{cap[1]}", entry, runs) + tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
