"""Pure-PyTorch references: the contract every kernel is tested against.

Written for clarity, not speed; they run on any device and are the CPU implementations of
the ``dsv4_ampere`` ops.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F
E4M3_MAX_CODE = 0x7E

# ---------------------------------------------------------------------------------------
# E4M3 codec (ops e4m3_decode, e4m3_encode)
# ---------------------------------------------------------------------------------------


def ref_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32: sign, 4-bit exponent (bias 7), 3-bit mantissa; 0x7F/0xFF NaN."""
    c = codes.to(torch.int64)
    exp = (c >> 3) & 0xF
    mant = (c & 0x7).to(torch.float64)
    subnormal = mant * 2.0 ** -9
    normal = (8.0 + mant) * torch.pow(2.0, (exp - 10).to(torch.float64))
    mag = torch.where(exp == 0, subnormal, normal)
    mag = torch.where((c & 0x7F) == E4M3_NAN_CODE, torch.full_like(mag, float("nan")), mag)
    return torch.where((c & 0x80) != 0, -mag, mag).to(torch.float32)


def _e4m3_magnitudes(device) -> torch.Tensor:
    """float64 [127]: the value of codes 0x00..0x7E, ascending."""
    return ref_e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8, device=device)).to(torch.float64)


def ref_e4m3_encode(x: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """float32/bfloat16/float16 -> uint8 E4M3 codes, saturating at +-448.

    Nearest of the 127 magnitudes; ties go to the even code (exact=True, torch's rounding)
    or away from zero (exact=False, the e4b15 trick). NaN: 0x7F | sign (exact) or 0x7E |
    sign (fast: the e4b15 path saturates NaN).
    """
    xd = x.to(torch.float64)
    neg = torch.signbit(xd)
    nan = torch.isnan(xd)
    a = xd.abs().nan_to_num(0.0).clamp(max=E4M3_MAX)
    table = _e4m3_magnitudes(x.device)
    hi = torch.searchsorted(table, a.contiguous()).clamp(max=E4M3_MAX_CODE)
    lo = (hi - 1).clamp(min=0)
    d_lo = a - table[lo]
    d_hi = table[hi] - a
    tie_to_hi = (hi % 2 == 0) if exact else torch.ones_like(hi, dtype=torch.bool)
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & tie_to_hi), hi, lo)
    code = torch.where(nan, torch.full_like(code, E4M3_NAN_CODE if exact else E4M3_MAX_CODE), code)
    code = torch.where(neg, code | 0x80, code)
    return code.to(torch.uint8)
