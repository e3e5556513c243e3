"""Which kernel variant a launcher runs for a given tensor's device."""

from __future__ import annotations

import torch

from . import dispatch


def variant_for(t: torch.Tensor) -> str:
    """'portable' or 'native' for the device of ``t``.

    CUDA: the op table (with the DSV4_AMPERE_IMPL override). CPU tensors only reach a kernel
    under the Triton interpreter: portable unless the override says otherwise.
    """
    if t.device.type == "cuda":
        cap = dispatch.device_capability(t.device)
        variant = dispatch.kernel_variant(cap)
        if variant == "native" and not dispatch.native_fp8_available(cap):
            raise RuntimeError(f"{dispatch.ENV_VAR}=native on sm_{cap[0]}{cap[1]}: the E4M3 cvt "
                               "needs sm_89+; use portable")
        return variant
    forced = dispatch.impl_override()
    return "portable" if forced == "auto" else forced
