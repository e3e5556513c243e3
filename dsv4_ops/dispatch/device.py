"""Device facts the dispatch plans with: SM counts and the shared memory a block may opt into.

Every SM count a launcher uses comes from ``num_sms`` (directly, or through ``num_sms_at`` for
a ``Tensor.get_device()`` index), so ``DSV4_AMPERE_SMS`` steers all of them: the decode plans,
the V3.2 split counts, the sparse-prefill rule, the decode indexer's tiles a program and the
Engram grid. The warm set patches ``num_sms`` while it traces (vllm/warm_common.SM_SOURCES).
"""

from __future__ import annotations

import functools

from .. import envs

# Plans for this many SMs instead of the device's count: a green context or an MPS share runs
# on fewer SMs than the device properties report (benchmarks: 108, an A100's count, on the H200).
SMS_ENV = envs.SMS

# The SM count of a plan made without a CUDA device (CPU tensors under the interpreter, fake and
# meta tensors): an A100's, the arch the plans are written for.
NO_DEVICE_SMS = 108


def num_sms(device_index: int) -> int:
    """Streaming multiprocessors a plan counts on: DSV4_AMPERE_SMS when set (read at each
    call; the recorded launch plans keep what they were planned with), else the device's
    (cached; 108 on an A100, 132 on an H200)."""
    forced = envs.get(SMS_ENV)
    if forced is not None:
        return forced
    return _device_sms(device_index)


@functools.lru_cache(maxsize=16)
def _device_sms(device_index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_sms_at(device_index: int) -> int:
    """num_sms for a ``Tensor.get_device()`` result: NO_DEVICE_SMS for -1 (a CPU tensor)."""
    return num_sms(device_index) if device_index >= 0 else NO_DEVICE_SMS


# Shared memory a block may opt into where no CUDA device is current (the CPU, the interpreter,
# fake tensors): an A100's, the arch the plan is written for.
DEFAULT_SMEM_BYTES = 163 * 1024
_SMEM: dict = {}  # device index -> bytes (a plain dict: traced code reads it as a constant)


def known_smem(device_index: int) -> int:
    """smem_per_block's cached figure for the device, or DEFAULT_SMEM_BYTES before it was asked:
    no device query (traced code: torch.compile reads it as a constant)."""
    return _SMEM.get(device_index, DEFAULT_SMEM_BYTES)


def smem_per_block(device_index: int = -1) -> int:
    """Bytes of shared memory a block may opt into on CUDA device ``device_index`` (cached; 163
    KiB on an A100, 99 KiB on sm_86, 227 KiB on an H200); -1 (a CPU tensor's index): the
    current CUDA device where CUDA is initialised, else DEFAULT_SMEM_BYTES."""
    got = _SMEM.get(device_index)
    if got is None:
        import torch

        if not torch.cuda.is_available():  # fake CUDA tensors on a CPU machine (the warm-set trace)
            return DEFAULT_SMEM_BYTES
        if device_index < 0:
            if not torch.cuda.is_initialized():
                return DEFAULT_SMEM_BYTES
            return smem_per_block(torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device_index)
        got = _SMEM[device_index] = int(getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SMEM_BYTES)
    return got


def blocks_by_smem(block_bytes: int, smem: int) -> int:
    """Blocks of ``block_bytes`` of shared memory one SM holds on a device whose blocks may opt into
    ``smem`` bytes (smem_per_block): sm_80 / sm_86 / sm_90 have 1 KiB more an SM than a block may
    take, and reserve 1 KiB a block (164 KB an SM on an A100 holds 3 blocks of 54 KB, sm_86's 100
    KB holds 1)."""
    return (smem + 1024) // (block_bytes + 1024)


_CUDA_DRIVER: list = []  # [the libcuda handle or None], loaded once


def resident_programs(function: int, num_warps: int, dyn_smem: int) -> "int | None":
    """Programs of one compiled kernel (a CUfunction handle, e.g. a Triton ``CompiledKernel.function``)
    resident at once on one SM of the current device, from the driver's occupancy calculator
    (``cuOccupancyMaxActiveBlocksPerMultiprocessor``: its registers a thread, shared memory and
    warps against the arch's limits: 5 programs of 185 registers x 2 warps on sm_80, 8 of <= 128
    registers x 2 warps).
    A host query (no sync, legal under capture). None where no CUDA driver answers (ROCm, no
    libcuda): the caller keeps its config's constant."""
    if not _CUDA_DRIVER:
        import ctypes

        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
            fn.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _CUDA_DRIVER.append(fn)
    fn = _CUDA_DRIVER[0]
    if fn is None or not function:
        return None
    import ctypes

    got = ctypes.c_int(0)
    if fn(ctypes.byref(got), ctypes.c_void_p(function), int(num_warps) * 32, int(dyn_smem)) != 0:
        return None
    return got.value if got.value > 0 else None
