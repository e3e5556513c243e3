"""Entry points (pyproject.toml), both inert unless ``DSV4_E2E_A100=1``.

``platform`` (group ``vllm.platform_plugins``): vLLM calls it in every process that resolves
``current_platform`` (API server, engine core, worker, the registry's inspection subprocess),
before vLLM's CUDA platform module imports its C++ extension. It installs what the H200 image
lacks (tests/e2e on PYTHONPATH: ``standins.install`` = the torch.library stand-ins of the kept
``_C`` / ``_C_cache_ops`` / ``_moe_C`` ops, ``platform_spoof.gpu_import_standins`` = the empty
``_C_stable_libtorch``, the FA package without its ``__init__``, CuTeDSL import stand-ins) and
names ``A100OnH200Platform``.

``general`` (group ``vllm.general_plugins``, loaded in every process beside dsv4_ops' own
plugin): DeepGEMM "present" (as on an A100 install; every wrapper still raises through the
tripwire), the TileLang mHC wrappers as vLLM's torch references, FlashMLA's empty scheduler
metadata, and the model classes of tests/e2e/engine (vLLM's classes + the tripwire and
counters installed after weight loading) registered under the checkpoints' architectures.
"""

from __future__ import annotations

import os
import sys

ENABLED = "DSV4_E2E_A100"
QUALNAME = "dsv4_e2e_a100.platform.A100OnH200Platform"
COMPILES: list = []   # every Triton JIT compile in this process (kernel name), in order


def _enabled() -> bool:
    return os.environ.get(ENABLED) == "1"


def _log(msg: str) -> None:
    print(f"dsv4_e2e_a100 (pid {os.getpid()}): {msg}", file=sys.stderr, flush=True)


def platform():
    if not _enabled():
        return None
    import torch  # noqa: F401

    import platform_spoof
    import standins
    import standins_v32

    standins.install(cpu=False)
    standins_v32.install()   # silu_and_mul, grouped_topk (V3.2's dense layers and router)
    platform_spoof.gpu_import_standins()
    _log(f"platform {QUALNAME}")
    return QUALNAME


def general() -> None:
    if not _enabled():
        return
    import importlib

    import standins
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils import import_utils

    # DeepGEMM: the vendored .so cannot travel; an A100 install has the package (has_deep_gemm()
    # True; the sm_80 path never calls a wrapper, and each one raises: `import deep_gemm` fails)
    orig = import_utils.has_deep_gemm
    present = lambda: True  # noqa: E731
    import_utils.has_deep_gemm = present
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm") and getattr(mod, "has_deep_gemm", None) is orig:
            mod.has_deep_gemm = present
    # TileLang mHC wrappers (tilelang is not on the image): vLLM's torch references, bound at
    # their defining module before the model modules import them by name
    tl = importlib.import_module("vllm.model_executor.kernels.mhc.tilelang")
    pkg = importlib.import_module("vllm.model_executor.kernels.mhc")
    for attr, fn in standins.MHC_STANDINS.items():
        for mod in (tl, pkg):
            if hasattr(mod, attr):
                setattr(mod, attr, fn)
    standins.install_mhc()
    standins.install_flashmla_metadata()
    for arch in ("DeepseekV41LLMForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV32ForCausalLM"):
        ModelRegistry.register_model(arch, f"dsv4_e2e_a100.models:{arch}")
    # the V4.1 + Engram checkpoint (v41x) names vLLM's VL architecture, the only one vLLM resolves an
    # EngramConfig for; the text model runs it (no vision tower in the tiny checkpoint)
    ModelRegistry.register_model("DeepseekV41ForCausalLM", "dsv4_e2e_a100.models:DeepseekV41LLMForCausalLM")
    from triton import knobs

    def on_compile(*_a, **kw):
        fn = kw.get("fn")
        COMPILES.append(getattr(getattr(fn, "fn", fn), "__name__", str(kw.get("repr", "?"))[:80]))
        return None

    knobs.runtime.jit_post_compile_hook = on_compile
    _warmup_evidence_as_sm80()
    _log("general: stand-ins installed, e2e model classes registered")


def _fp8_triton_fn(kernel):
    """The Python function of a vLLM Triton warmup owner's kernel (``kernel.kernel``, through
    autotune / heuristics / JIT wrappers, each holding the next as ``fn``) when its source names
    an fp8 type, else None."""
    import types

    import tripwire

    fn, hops = getattr(kernel, "kernel", None), 0
    while fn is not None and not isinstance(fn, types.FunctionType) and hops < 5:
        fn, hops = getattr(fn, "fn", None), hops + 1
    return fn if isinstance(fn, types.FunctionType) and tripwire._src_has_fp8(fn) else None


def _warmup_evidence_as_sm80() -> None:
    """dsv4_ops' JIT-warmup filter decides by compiling each registration for this GPU. The H200
    compiles fp8 Triton kernels that Triton refuses on sm_80 ("type fp8e4nv not supported in this
    architecture", the audit's evidence), so here such a kernel fails without being compiled, as
    on an A100: replaced ones are then dropped, others reach vLLM's warmup and the tripwire. Not
    compiling it matters: the filter runs when vLLM's warmup runs, after the worker armed the
    tripwire, and a probe compile would count as a launch there."""
    from dsv4_ops.vllm import warmup

    orig = warmup.compile_fails
    if getattr(orig, "_dsv4_e2e_sm80", False):
        return

    def compile_fails(kernel, args, kwargs):
        fn = _fp8_triton_fn(kernel)
        if fn is not None:
            return True, f"Triton kernel {fn.__module__}.{fn.__name__} names an fp8 type (refused on sm_80)"
        return orig(kernel, args, kwargs)

    compile_fails._dsv4_e2e_sm80 = True
    warmup.compile_fails = compile_fails
