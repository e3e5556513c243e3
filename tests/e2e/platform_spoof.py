"""Make vLLM's platform answer as an A100 (sm_80, 108 SMs) would, on a CPU machine or the H200.

Order matters (E2E_CPU_NOTES.md 2.1): environment before any import, ``register()`` of the
plugin after the capability spoof, and ``is_cuda()`` switched on only after vLLM's import-time
capability probes have run (``enable_cuda_answers``).
"""

from __future__ import annotations

import os

A100_NAME = "NVIDIA A100-SXM4-80GB"
A100_SMS = 108


def set_environment(cpu: bool) -> None:
    """Process environment for the run; call before torch / vLLM are imported."""
    os.environ["VLLM_PLUGINS"] = ""            # the plugin is registered by hand, after the spoof
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["DSV4_AMPERE_IMPL"] = "portable"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        # vLLM installs a TritonPlaceholder when it counts no active driver; an empty
        # CUDA_VISIBLE_DEVICES takes its distributed-env branch and keeps the real Triton.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD"] = "0"


def spoof_platform(cpu: bool) -> None:
    """Capability 8.0, the A100's name and SM count on vLLM's current platform class."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    cls = type(current_platform)
    cls.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(8, 0))
    cls.get_device_name = classmethod(lambda c, device_id=0: A100_NAME)
    cls.num_compute_units = classmethod(lambda c, device_id=0: A100_SMS)
    if cpu:
        cls.support_hybrid_kv_cache = classmethod(lambda c: True)
        cls.device_type = "cpu"


def enable_cuda_answers() -> None:
    """``is_cuda()`` / ``is_cuda_alike()`` True from now on, so the CPU run takes the branches an
    A100 takes (DeepGEMM-schedule metadata, the MoE backend list, the top-k backend choice)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    cls.is_cuda = lambda self: True
    cls.is_cuda_alike = lambda self: True


def inspect_models_in_process() -> None:
    """vLLM inspects a lazily registered model class (its interfaces) in a fresh subprocess that
    imports vLLM again (15-40 s on 2 cores) unless its model-info cache holds the class at this
    source's hash; that cache keeps one file a class whatever the vLLM release, so two releases
    used in turn on one machine miss it at each switch. Here the model modules are imported and no
    CUDA runtime is touched, so the inspection runs in this process: the same code on the class an
    A100 resolves (a subprocess would not have the platform's answers)."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


def cpu_cuda_attention_selector() -> None:
    """On the CPU run, vLLM's attention-backend selector asks the CUDA platform's rules (the
    priority lists of ``CudaPlatformBase.get_attn_backend_cls``, which read the spoofed
    capability): models that pick their backend through the selector (DeepSeek-V3.2's MLA)
    then get what an A100 gets."""
    import sys
    import types

    from vllm.platforms import current_platform
    # platforms/cuda.py imports the C++ extension at module level (it needs libcuda); only its
    # pure-Python selection rules are used here
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.platforms.cuda import CudaPlatformBase

    cls = type(current_platform)
    if not hasattr(cls, "device_name"):
        cls.device_name = "cuda"
    for name in ("get_attn_backend_cls", "get_valid_backends"):
        if name in CudaPlatformBase.__dict__:   # the classmethod itself, so cls is the spoofed class
            setattr(cls, name, CudaPlatformBase.__dict__[name])


def cpu_no_pinned_memory() -> None:
    """vLLM computes ``PIN_MEMORY`` once at import (True under the spoof); pinning needs a CUDA
    driver, so every module that imported the flag gets False on the CPU run."""
    import sys

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm") and getattr(mod, "PIN_MEMORY", None) is True:
            mod.PIN_MEMORY = False


class _NoStream:
    """CPU stand-in for ``torch.cuda.Stream`` / ``Event``: one stream, so every wait is a no-op
    (the math is unchanged; stream-ordering races cannot be shown on a CPU)."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NoStream()

    def synchronize(self):
        pass


def cpu_streams() -> None:
    """Streams and events are no-ops on the CPU run; stream capture is never on."""
    import torch

    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.Event = _NoStream      # device-generic event and stream (V3.2's index group uses them)
    torch.Stream = _NoStream
    torch.cuda.stream = lambda s=None: _NoStream()
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.is_current_stream_capturing = lambda: False


def cpu_vllm_streams() -> None:
    """vLLM's own ``current_stream()`` helper (and every by-name import of it) gives the no-op
    stream on the CPU run; call after vLLM's model modules are imported."""
    import sys

    import torch
    from vllm.utils import torch_utils

    orig = torch_utils.current_stream
    torch.cuda.set_stream = lambda s=None: None
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm.") and getattr(mod, "current_stream", None) is orig:
            mod.current_stream = lambda: _NoStream()


# ------------------------------------------------------------------ the H200 run (no vLLM wheel)

class _StubMeta(type):
    """Import stand-in for CuTeDSL's ``cutlass`` / ``quack``, which the V4 CuTeDSL compressor
    module (dead on sm_80, replaced by the plugin) imports at module level: attributes are more
    stubs, a stub applied to one function or class returns it (decorators pass through), any
    other call returns a stub (module-level constants). Nothing on the sm_80 path calls them:
    the tripwire raises on every replaced original."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (), {})

    def __call__(cls, *a, **k):
        if len(a) == 1 and not k and (callable(a[0]) or isinstance(a[0], type)):
            return a[0]
        return _StubMeta("stub", (), {})

    def __getitem__(cls, item):
        return _StubMeta("stub", (), {})

    def __iter__(cls):   # a stub list is empty (e.g. CuTeDSL's runtime libraries to preload)
        return iter(())


def _stub_attr(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _StubMeta(attr, (), {})


def _no_cutedsl_compile(*args, **kwargs):
    """``cute.compile`` of the stand-in: a CuTeDSL kernel compiles for nothing here, as one
    with e4m3 cvt does not for sm_80, so vLLM's JIT warmup of it fails unless the plugin drops it."""
    raise RuntimeError("CuTeDSL is not installed on this image (import stand-in): no kernel compiles")


def gpu_import_standins() -> None:
    """What the H200 image lacks, before vLLM is imported (E2E_GPU_NOTES.md 3.3)."""
    import importlib.util
    import sys
    import types

    import importlib.abc
    import importlib.machinery

    roots = tuple(n for n in ("cutlass", "quack") if importlib.util.find_spec(n) is None)

    class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in roots:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            mod = types.ModuleType(spec.name)
            mod.__path__ = []
            mod.__getattr__ = _stub_attr
            if spec.name == "cutlass.cute":
                mod.compile = _no_cutedsl_compile
            return mod

        def exec_module(self, module):
            pass

    if roots:
        sys.meta_path.insert(0, StubFinder())
    # platforms/cuda.py imports the 92 MB C++ extension unconditionally; the torch.library
    # stand-ins provide the ops the path calls, any other _C op raises AttributeError
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    spec = importlib.util.find_spec("vllm")
    fa_dir = os.path.join(os.path.dirname(spec.origin), "vllm_flash_attn")
    fa = types.ModuleType("vllm.vllm_flash_attn")
    fa.__path__ = [fa_dir]   # the package without its __init__ (which needs the FA .so files)

    def fa_attr(attr):       # its names come from the real flash_attn_interface (FA2/FA3 absent)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface"), attr)

    fa.__getattr__ = fa_attr
    sys.modules["vllm.vllm_flash_attn"] = fa


def gpu_after_import() -> None:
    """After vLLM is imported: DeepGEMM 'present' as on an A100 install (every wrapper still
    raises: the tripwire), the architecture inspection in-process (a fresh subprocess would lack
    the stand-ins)."""
    import sys

    from vllm.utils import import_utils

    inspect_models_in_process()
    orig = import_utils.has_deep_gemm
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm") and getattr(mod, "has_deep_gemm", None) is orig:
            mod.has_deep_gemm = lambda: True
