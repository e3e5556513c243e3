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

# Every warmup key is compiled: the keys choose different TileLang programs (broadcast / with
# norm / plain; block-M prenorm GEMMs), and vLLM's JIT warmup compiles each at startup and
# aborts on the first failure. TileLang's own disk cache (TILELANG_CACHE_DIR, default
# ~/.tilelang/cache) makes a repeat run cheap; the audit's result cache (audit.cache_path) skips
# the worker altogether while nothing it depends on changed.


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
    t0 = time.time()
    done = 0
    try:
        _bind_tilelang(kernel)
        with Target({"kind": "cuda", "arch": f"sm_{arch}"}):
            for key in keys:
                kernel.compile(key)
                done += 1
    except Exception as exc:  # noqa: BLE001 - the compiler's verdict is the evidence
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return "dead", (f"TileLang compile for sm_{arch} fails ({type(exc).__name__}: "
                        f"{(lines[-1] if lines else '')[:160]}); key {done + 1} of {len(keys)}: {keys[done]}")[:600]
    return "runs", (f"TileLang compile for sm_{arch} ok (all {len(keys)} warmup keys; "
                    f"{time.time() - t0:.0f} s; target cuda sm_{arch}, {nvcc()})")


def pre_norm_kwsets(cfg) -> List[Dict[str, Any]]:
    """The registrations of V4.1's ``MHC_PRE_NORM_KERNEL`` (an ``MHCPreNormKernel``, TileLang
    under a plain ``VllmJitKernel``) as every V4.1 decoder layer makes them
    (deepseek_v41/nvidia/model.py): the broadcast embedding (rms_numel = hidden) and the hc
    stream (hc_mult * hidden, extra_splits = mhc_fused_post_pre_splits) with and without the
    pre-mix, plus the speculative ``write_aux`` variant; split_mode 'fused' only (the shifted
    'stats' / 'input' modes need the mHC stream, family 100); max_tokens =
    max_num_batched_tokens (no sequence parallelism without expert parallelism)."""
    from vllm.model_executor.kernels.mhc.tilelang_kernels import mhc_fused_post_pre_splits

    from . import _paths

    hf = cfg.model_config.hf_config
    hidden, hc = int(hf.hidden_size), int(hf.hc_mult)
    mhc = _paths.LAYER_VALUES["v41"]
    hc_eps = float(getattr(hf, "hc_eps", mhc["hc_eps"][0]))
    common = dict(split_mode="fused", max_tokens=int(cfg.scheduler_config.max_num_batched_tokens),
                  hidden_size=hidden, rms_eps=float(hf.rms_norm_eps), hc_pre_eps=hc_eps, hc_sinkhorn_eps=hc_eps,
                  hc_post_mult_value=mhc["hc_post_mult_value"][0],
                  sinkhorn_repeat=int(getattr(hf, "hc_sinkhorn_iters", mhc["sinkhorn_repeat"][0])),
                  norm_eps=float(hf.rms_norm_eps), hc_mult=hc)
    stream = dict(rms_numel=hc * hidden, extra_splits=mhc_fused_post_pre_splits(hidden, hc))
    variants = [dict(rms_numel=hidden, use_pre_mix_in=False, extra_splits=()),
                dict(stream, use_pre_mix_in=False), dict(stream, use_pre_mix_in=True),
                dict(stream, use_pre_mix_in=True, write_aux=True)]
    return [dict(common, **v) for v in variants]


# Kernels whose registrations pass their fields through ``**variant`` (not evaluable from the
# source): the class name -> a builder of their kwargs sets from the audit's VllmConfig.
KWSETS = {"MHCPreNormKernel": pre_norm_kwsets}
