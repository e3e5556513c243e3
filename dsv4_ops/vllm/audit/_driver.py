"""A Triton driver that reports a CUDA target without a GPU, so vLLM's Triton kernels compile on a CPU.

Install it before vLLM is imported: vLLM disables Triton (``HAS_TRITON = False``, placeholder
kernels) when no Triton GPU driver is active, and the audit needs the real ``JITFunction``s.
"""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class TargetOnlyDriver(DriverBase):
    """Answers what Triton's binder and ``triton.compile`` ask (target, device 0, stream 0);
    anything that would launch or benchmark raises."""

    def __init__(self, arch: int = 80):
        self.target = GPUTarget("cuda", int(arch), 32)

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("dsv4_ops audit driver: no GPU to benchmark on")

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        return None

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        import torch

        return torch.cuda


def install(arch: int = 80) -> TargetOnlyDriver:
    """Make Triton (and vLLM's driver probe) see a CUDA sm_<arch> target; returns the driver."""
    import triton
    from triton.backends import backends

    drv = TargetOnlyDriver(arch)
    triton.runtime.driver.set_active(drv)
    backends["nvidia"].driver.is_active = classmethod(lambda cls: True)
    return drv
