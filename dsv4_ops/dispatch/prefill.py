"""Whether DeepSeek-V4 sparse prefill runs its own kernel (csrc_triton.sparse_prefill) or the
split-KV decode kernels: static shapes and alignment only, no host sync.

The prefill kernel when T x G >= PREFILL_MIN_WAVES x the device's SM count (G = cdiv(H, BLOCK_H)
head groups), the indices are int32 and q / kv / out are 16-byte aligned with row strides a
multiple of 8 elements (the kernel's vector-load hints assume it; vLLM's buffers always are);
otherwise dsv4_ops.attention.sparse_mla_decode (split-KV decode kernels + merge).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..csrc_triton import sparse_prefill as _pk
from . import device as _device

# Programs (T x G) per SM at which the prefill kernel takes over: 4 waves; below that the
# split-KV path balances better. A guess, NOT measured between T = 4 and T = 4096, where the
# prefill kernel won 1.0-1.9x (benchmarks/results/sparse_prefill.md).
PREFILL_MIN_WAVES = 4


def num_sms_of(t) -> int:
    """SMs of t's CUDA device (device.num_sms: DSV4_AMPERE_SMS overrides it); without a CUDA
    device (the interpreter, meta tensors) device.NO_DEVICE_SMS."""
    if t.device.type != "cuda":
        return _device.NO_DEVICE_SMS
    return _device.num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())


def uses_prefill_kernel(T: int, H: int, index_dtype, sms: int) -> bool:
    """The rule of the module doc without the alignment: the prefill kernel when its T x G
    programs are at least PREFILL_MIN_WAVES per SM and the indices are int32."""
    groups = -(-int(H) // _pk.block_h_for(H))
    return index_dtype == torch.int32 and int(T) * groups >= PREFILL_MIN_WAVES * sms


def aligned(q, kv, out) -> bool:
    """16-byte aligned bases and row strides a multiple of 8 elements (what the kernel's
    tl.multiple_of hints promise)."""
    for t in (q, kv) if out is None else (q, kv, out):
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return False
    return True


def resolve(q, kv, indices, out: Optional[object] = None) -> Tuple[bool, str]:
    """(whether the prefill kernel runs, why) for the inputs (module doc)."""
    T, H = q.shape[0], q.shape[1]
    if indices.dtype != torch.int32:
        return False, "int64 indices: the split-KV decode kernels"
    sms = num_sms_of(q)
    if not uses_prefill_kernel(T, H, indices.dtype, sms):
        return False, f"T x G below PREFILL_MIN_WAVES x {sms} SMs: the split-KV decode kernels"
    if not aligned(q, kv, out):
        return False, "q / kv / out not 16-byte aligned: the split-KV decode kernels"
    return True, f"T x G >= PREFILL_MIN_WAVES x {sms} SMs, int32 indices, aligned"


def uses_kernel(q, kv, indices, out: Optional[object] = None) -> bool:
    """resolve's answer (num_sms_of read through this module at each call)."""
    return uses_prefill_kernel(q.shape[0], q.shape[1], indices.dtype, num_sms_of(q)) and aligned(q, kv, out)
