"""E4M3 (OCP float8_e4m3fn) codec: device helpers every kernel uses, and the two codec kernels.

Decode
  portable  bitcast to fp8e4b15 (bias 15, the only 4-bit-exponent fp8 Triton accepts on
            sm_80), to fp32, times 2**8: e4b15 and e4m3 differ only in exponent bias.
            The NaN codes 0x7F/0xFF come out as +-480 (e4b15 has no NaN).
  native    bitcast to fp8e4nv (sm_89+).
Encode (input fp32; callers upcast bf16/fp16, which is exact)
  ENCODE_EXACT   round half to even by one IEEE fp32 add: |x| + 2**(E+20) (E the exponent of
                 |x|, at least -6) leaves exactly the E4M3 ulp 2**(E-3) as the sum's ulp, so
                 the adder's own RNE rounds; the rest is integer bit work. No fp8 dtype.
                 |x| >= 448 and +-inf give +-448 (0x7E), NaN gives 0x7F | sign.
  ENCODE_EXACT_INT  the same result with integer operations only (variable-shift RNE);
                 kept for comparison: about 3x the instructions (benchmarks/results/codec.md).
  ENCODE_FAST    the seed's trick: clamp to +-448, times 2**-8, cvt to fp8e4b15. Rounds
                 half away from zero at exact midpoints; NaN saturates.
  ENCODE_NATIVE  clamp to +-448 (NaN kept), cvt to fp8e4nv (sm_89+).
"""

import triton
import triton.language as tl

from dsv4_ops import layout as _L

ENCODE_EXACT = 0
ENCODE_FAST = 1
ENCODE_NATIVE = 2
ENCODE_EXACT_INT = 3

E4M3_MAX = tl.constexpr(_L.E4M3_MAX)  # the one definition is dsv4_ops.layout


@triton.jit
def e4m3_to_f32(b_codes, NATIVE: tl.constexpr):
    """uint8 block -> float32 block of the same shape."""
    if NATIVE:
        b_val = b_codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b_val = b_codes.to(tl.float8e4b15, bitcast=True).to(tl.float32) * 256.0
    return b_val


@triton.jit
def _f32_to_e4m3_rne_bits(b_x):
    """float32 block -> uint8 E4M3 codes, round half to even, integer operations only."""
    b_bits = b_x.to(tl.uint32, bitcast=True)
    b_sign = (b_bits >> 24) & 0x80
    b_abs = b_bits & 0x7FFFFFFF
    # Normal E4M3 (|x| >= 2**-6): keep 3 of 23 mantissa bits with RNE on the 20 dropped
    # ones; a carry rolls into the exponent, which is what RNE wants.
    b_round = b_abs + 0x7FFFF + ((b_abs >> 20) & 1)
    b_normal = (b_round >> 20) - ((127 - 7) << 3)
    # Subnormal E4M3 (|x| < 2**-6): q = RNE(|x| * 2**9) = RNE(mant24 >> (14 - E)).
    b_exp = (b_abs >> 23).to(tl.int32) - 127
    b_shift = tl.minimum(tl.maximum(14 - b_exp, 1), 31).to(tl.uint32)  # in [1, 31]: no UB shifts
    b_mant = (b_abs & 0x7FFFFF) | 0x800000
    b_q = b_mant >> b_shift
    b_rem = b_mant & ((1 << b_shift) - 1)
    b_half = 1 << (b_shift - 1)
    b_q = b_q + ((b_rem > b_half) | ((b_rem == b_half) & ((b_q & 1) == 1))).to(tl.uint32)
    b_sub = tl.where(b_exp < -126, 0, b_q)  # fp32 zeros and subnormals round to 0
    b_code = tl.where(b_exp >= -6, b_normal, b_sub)
    b_code = tl.where(b_abs >= 0x43E00000, 0x7E, b_code)  # |x| >= 448, inf: saturate
    b_code = tl.where(b_abs > 0x7F800000, 0x7F, b_code)  # NaN
    return (b_code | b_sign).to(tl.uint8)


@triton.jit
def _f32_to_e4m3_rne_add(b_x):
    """float32 block -> uint8 E4M3 codes, round half to even through one fp32 add."""
    b_bits = b_x.to(tl.uint32, bitcast=True)
    b_abs = b_bits & 0x7FFFFFFF
    b_sat = tl.minimum(b_abs, 0x43E00000)  # |x| >= 448 and inf saturate to 448 (NaN: below)
    # Biased exponent, clamped at 2**-6: E4M3 subnormals share the ulp 2**-9 of that binade.
    b_eb = tl.maximum(b_sat >> 23, 121)
    b_cbits = (b_eb + 20) << 23  # C = 2**(E + 20): the ulp of |x| + C is 2**(E - 3)
    b_sum = b_sat.to(tl.float32, bitcast=True) + b_cbits.to(tl.float32, bitcast=True)
    # |x| + C = C + k * ulp with k in [0, 16] after rounding; code = (E + 6) * 8 + k.
    b_code = ((b_eb - 121) << 3) + (b_sum.to(tl.uint32, bitcast=True) - b_cbits)
    b_code = tl.where(b_abs > 0x7F800000, 0x7F, b_code)  # NaN
    return (b_code | ((b_bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def f32_to_e4m3(b_x, MODE: tl.constexpr):
    """float32 block -> uint8 E4M3 codes; MODE is one of the ENCODE_* constants."""
    if MODE == 3:
        b_out = _f32_to_e4m3_rne_bits(b_x)
    elif MODE == 2:
        b_c = tl.clamp(b_x, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        b_out = b_c.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif MODE == 1:
        b_c = tl.minimum(tl.maximum(b_x, -E4M3_MAX), E4M3_MAX)
        b_out = (b_c * 0.00390625).to(tl.float8e4b15).to(tl.uint8, bitcast=True)
    else:
        b_out = _f32_to_e4m3_rne_add(b_x)
    return b_out


@triton.jit
def _e4m3_decode_kernel(codes_ptr, out_ptr, n, BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    """Grid (cdiv(n, BLOCK),): each program decodes BLOCK contiguous bytes to float32."""
    o_x = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    b_codes = tl.load(codes_ptr + o_x, mask=m_x, other=0)  # [BLOCK] uint8
    tl.store(out_ptr + o_x, e4m3_to_f32(b_codes, NATIVE), mask=m_x)


@triton.jit
def _e4m3_encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Grid (cdiv(n, BLOCK),): each program encodes BLOCK contiguous values to E4M3 bytes."""
    o_x = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)  # [BLOCK]
    tl.store(out_ptr + o_x, f32_to_e4m3(b_x, MODE), mask=m_x)


# Launch configs as plain data, per kernel variant: (BLOCK, num_warps).
CODEC_CONFIG = {"BLOCK": 8192, "num_warps": 4}
