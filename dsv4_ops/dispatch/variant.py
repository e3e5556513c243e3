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

import functools
from typing import Optional, Tuple, Union

import torch

from .. import envs

ENV_VAR = envs.IMPL
KERNEL_VARIANTS = ("portable", "native")
_OVERRIDES = ("auto",) + KERNEL_VARIANTS

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
    return envs.get(ENV_VAR)


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


@functools.lru_cache(maxsize=None)
def _cuda_variant(device_index: int, override: str) -> str:
    cap = device_capability(device_index)
    variant = kernel_variant(cap)
    if variant == "native" and not native_fp8_available(cap):
        raise RuntimeError(f"{ENV_VAR}=native on sm_{cap[0]}{cap[1]}: the E4M3 cvt needs sm_89+; use portable")
    return variant


def variant_for(t: torch.Tensor) -> str:
    """'portable' or 'native' for the device of ``t`` (cached per device and override value).

    CUDA: the op table (with the DSV4_AMPERE_IMPL override). CPU tensors only reach a kernel
    under the Triton interpreter: portable unless the override says otherwise.
    """
    override = envs.raw(ENV_VAR)
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _cuda_variant(index, override)
    forced = impl_override()
    return "portable" if forced == "auto" else forced
