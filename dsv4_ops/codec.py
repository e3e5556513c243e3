"""Launchers of the E4M3 codec kernels (ops ``e4m3_decode`` and ``e4m3_encode``)."""

from __future__ import annotations

from typing import Optional

import torch

from .csrc_triton import codec as _k
from ._checks import check_tensor
from ._launch import fast
from .dispatch import variant_for

_decode_kernel = fast(_k._e4m3_decode_kernel)
_encode_kernel = fast(_k._e4m3_encode_kernel)

ENCODE_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def encode_mode(exact: bool, variant: str) -> int:
    """Kernel MODE for an encode: exact -> integer RNE (portable) or hardware cvt (native)."""
    if not exact:
        return _k.ENCODE_FAST
    return _k.ENCODE_NATIVE if variant == "native" else _k.ENCODE_EXACT


def e4m3_decode(codes: torch.Tensor, variant: Optional[str] = None) -> torch.Tensor:
    """uint8 codes, any shape -> float32 values, same shape (contiguous).

    variant: 'portable' or 'native'; None picks from the op table for codes.device.
    """
    if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8):
        check_tensor("codes", codes, dtypes=(torch.uint8,))
    variant = variant or variant_for(codes)
    src = codes if codes.is_contiguous() else codes.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    n = src.numel()
    if n:
        block = _k.CODEC_CONFIG["BLOCK"]
        _decode_kernel((-(-n // block),), (src, out, n), (block, variant == "native"), _k.CODEC_CONFIG["num_warps"])
    return out


def e4m3_encode(x: torch.Tensor, exact: bool = True, variant: Optional[str] = None,
                mode: Optional[int] = None) -> torch.Tensor:
    """float32/bfloat16/float16, any shape -> uint8 E4M3 codes, same shape (saturating).

    exact=True: bit-identical to torch's cast of x.clamp(-448, 448) (NaN -> 0x7F | sign).
    exact=False: the e4b15 trick (half away from zero at midpoints).
    mode overrides the kernel MODE (csrc_triton.codec.ENCODE_*), for benchmarks and tests.
    """
    check_tensor("x", x, dtypes=ENCODE_INPUT_DTYPES)
    variant = variant or variant_for(x)
    mode = encode_mode(exact, variant) if mode is None else mode
    src = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = src.numel()
    if n:
        block = _k.CODEC_CONFIG["BLOCK"]
        _encode_kernel((-(-n // block),), (src, out, n), (block, mode), _k.CODEC_CONFIG["num_warps"])
    return out


def aot_specs():
    """Every codec kernel specialization a launcher can pick (see dsv4_ops.aot)."""
    from .aot import KernelSpec

    block, warps = _k.CODEC_CONFIG["BLOCK"], _k.CODEC_CONFIG["num_warps"]
    specs = []
    for variant in ("portable", "native"):
        specs.append(KernelSpec(
            "e4m3_decode", f"decode[{variant}]", _k._e4m3_decode_kernel,
            {"codes_ptr": "*u8", "out_ptr": "*fp32", "n": "i64", "BLOCK": "constexpr", "NATIVE": "constexpr"},
            {"BLOCK": block, "NATIVE": variant == "native"}, variant, num_warps=warps))
        modes = [(False, encode_mode(False, variant))] + [(True, encode_mode(True, variant))]
        for exact, mode in modes:
            for in_ty in ("fp32", "bf16", "fp16"):
                specs.append(KernelSpec(
                    "e4m3_encode", f"encode[{variant},{'exact' if exact else 'fast'},{in_ty}]",
                    _k._e4m3_encode_kernel,
                    {"x_ptr": f"*{in_ty}", "out_ptr": "*u8", "n": "i64", "BLOCK": "constexpr", "MODE": "constexpr"},
                    {"BLOCK": block, "MODE": mode}, variant, num_warps=warps))
    return specs
