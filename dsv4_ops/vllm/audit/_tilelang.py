"""Compile vLLM's TileLang kernels (mHC) for sm_<arch> on the CPU, the way vLLM's own JIT warmup does.

vLLM's ``VllmTileLangJitKernel.compile(key)`` builds a kernel from storage-less warmup tensors
without launching it; TileLang lowers it and runs nvcc (CUDA toolkit of this machine / the pip
``nvidia-cuda-nvcc`` wheel) into a cubin. On a machine without a GPU two things differ from a
GPU host, and both are set here: vLLM binds ``tilelang``/``T`` only when the platform is CUDA
(``vllm.tilelang_utils``), and TileLang's target "auto" needs a GPU, so the target is given
explicitly as ``{"kind": "cuda", "arch": "sm_<arch>"}`` (TVM's current-target context).
A successful compile is the evidence (nvcc produced an sm_<arch> cubin); a failure is reported
with TileLang's error.
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
from typing import Any, Dict, List, Tuple

MAX_KEYS = 1  # per kernel and model: the last warmup key (the largest specialization); nvcc is slow


def _bind_tilelang(kernel: Any) -> None:
    import vllm.tilelang_utils as tu

    tu._ensure_tilelang_imported()
    mod = inspect.getmodule(type(kernel))
    for name in ("T", "tilelang"):
        if mod is not None and getattr(mod, name, "x") is None:
            setattr(mod, name, getattr(tu, name))


def nvcc() -> str:
    try:
        from tilelang import env

        home = getattr(env, "CUDA_HOME", None)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    except Exception:  # noqa: BLE001
        pass
    return shutil.which("nvcc") or "nvcc (not found)"


def compile_kernel(kernel: Any, kwsets: List[Dict[str, Any]], arch: int) -> Tuple[str, str]:
    """(status, evidence) of compiling ``kernel``'s warmup keys for sm_<arch>."""
    from tvm.target import Target

    keys: List[Any] = []
    try:
        for kw in kwsets:
            keys.extend(k for k in kernel.get_warmup_keys(**kw) if k not in keys)
    except Exception as exc:  # noqa: BLE001
        return "unknown", f"vLLM's TileLang warmup key expansion failed: {type(exc).__name__}: {exc}"[:240]
    if not keys:
        return "unknown", "vLLM's TileLang warmup inputs produced no compile key"
    chosen = keys if len(keys) <= MAX_KEYS else keys[-MAX_KEYS:]
    t0 = time.time()
    try:
        _bind_tilelang(kernel)
        with Target({"kind": "cuda", "arch": f"sm_{arch}"}):
            for key in chosen:
                kernel.compile(key)
    except Exception as exc:  # noqa: BLE001 - the compiler's verdict is the evidence
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return "dead", (f"TileLang compile for sm_{arch} fails ({type(exc).__name__}: "
                        f"{(lines[-1] if lines else '')[:160]}); key {chosen[0]}")
    which = "all" if len(chosen) == len(keys) else "the last"
    return "runs", (f"TileLang compile for sm_{arch} ok ({len(chosen)} of {len(keys)} warmup keys, {which}; "
                    f"{time.time() - t0:.0f} s; target cuda sm_{arch}, {nvcc()})")
