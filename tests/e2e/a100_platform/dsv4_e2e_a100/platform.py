"""vLLM's own CUDA platform (NVML) with an A100's identity: capability 8.0, 108 SMs, its name.
Everything else (memory, streams, graphs, the backend selector rules) is vLLM's CudaPlatform."""

from __future__ import annotations

from vllm.platforms.cuda import NvmlCudaPlatform
from vllm.platforms.interface import DeviceCapability

A100_NAME = "NVIDIA A100-SXM4-80GB"
A100_SMS = 108


class A100OnH200Platform(NvmlCudaPlatform):
    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(major=8, minor=0)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return A100_NAME

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return A100_SMS
