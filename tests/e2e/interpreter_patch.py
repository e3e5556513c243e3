"""Test-side fixes to the Triton interpreter (triton 3.6-3.8) so vLLM's bf16 Triton kernels give
the answers a GPU gives when the end-to-end test runs them on the CPU.

Two defects, both measured (`tests/e2e/test_interpreter_patch.py`):
- ``create_dot`` hands bf16 operands to numpy as their raw uint16 bit patterns, so every bf16
  ``tl.dot`` multiplies integers (vLLM's ``fused_moe_kernel`` would return garbage);
- ``cast_impl`` truncates fp32 -> bf16 instead of rounding to nearest even.
Only these two paths change; every other cast (fp8 encode included) stays as the interpreter has
it, which is why no fp8 Triton kernel may be used as a stand-in.
"""

from __future__ import annotations

import numpy as np


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    rounded = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, (u >> np.uint32(16)).astype(np.uint16) | np.uint16(0x40), rounded)
    return rounded


def apply() -> None:
    """Patch ``triton.runtime.interpreter.InterpreterBuilder`` in place (idempotent)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder, "_dsv4_e2e_patched", False):
        return
    TensorHandle = interp.TensorHandle
    orig_dot = builder.create_dot
    orig_cast = builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = _bf16_bits_to_f32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
            b_data = _bf16_bits_to_f32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
            return TensorHandle(np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data,
                                d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(_f32_to_bf16_bits_rne(src.data), dst_type.scalar)
        return orig_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder._dsv4_e2e_patched = True
