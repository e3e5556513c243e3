"""Compile vLLM's Triton kernels for a target arch with the arguments vLLM itself warms them up with.

For a kernel with a vLLM JIT-warmup owner (``VllmTritonJitKernel``), its own
``get_warmup_keys(**registration)`` gives the compile keys, and ``compile(key)`` runs Triton's
binder on vLLM's warmup inputs (dtypes, constexprs, launch options). A ``jit_cache_hook``
captures the resulting (signature, constexprs, num_warps, num_stages) instead of compiling;
``dsv4_ops.aot.compile_spec`` then builds the cubin for ``GPUTarget('cuda', arch, 32)`` (the
same check as this project's own kernels: compiles, fits shared memory, no e4m3 cvt in PTX).
Needs ``_driver.install(arch)`` before vLLM is imported.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from ... import aot

MAX_KEYS = 24  # compile keys per kernel; more are reported as not all checked


def capture_specs(kernel: Any, kwargs: Dict[str, Any]) -> Tuple[List[aot.KernelSpec], str]:
    """KernelSpecs for every warmup compile key of ``kernel`` registered with ``kwargs``;
    returns (specs, note). Raises when vLLM's own key expansion fails."""
    from triton import knobs

    keys = list(kernel.get_warmup_keys(**kwargs))
    note = f"{len(keys)} compile key(s)"
    if len(keys) > MAX_KEYS:
        note += f", first {MAX_KEYS} compiled"
        keys = keys[:MAX_KEYS]
    specs: List[aot.KernelSpec] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        sig = {k: v for k, v in compile["signature"].items()}
        consts = {}
        for path, value in compile["constants"].items():
            name = list(sig)[path[0]] if isinstance(path, tuple) else path
            consts[name] = value
        specs.append(aot.KernelSpec(fn.name, fn.name, fn.jit_function, sig, consts, "vllm",
                                    compile["num_warps"], compile["num_stages"]))
        return True  # skip Triton's own compile: aot.compile_spec does it

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for key in keys:
            kernel.compile(key)
    finally:
        knobs.runtime.jit_cache_hook = old
    return specs, note


_ORDER: List[aot.KernelSpec] = []


def _compile_index(i_arch):
    i, arch = i_arch
    res = aot.compile_spec(_ORDER[i], arch)
    return res.ok, res.error or f"ok ({res.registers} regs, {res.shared_bytes} B smem)"


def _spec_key(s: aot.KernelSpec) -> Tuple:
    return (s.kernel.fn.__module__, s.kernel.fn.__name__, tuple(sorted(s.signature.items())),
            tuple(sorted((k, repr(v)) for k, v in s.constexprs.items())), s.num_warps, s.num_stages)


def compile_specs(specs: List[aot.KernelSpec], arch: int, jobs: int) -> List[Tuple[bool, str]]:
    """Compile specs (deduplicated by signature+constexprs+options) for sm_<arch>."""
    keyed: Dict[Tuple, int] = {}
    _ORDER.clear()
    for s in specs:
        keyed.setdefault(_spec_key(s), len(_ORDER))
        if len(_ORDER) < len(keyed):
            _ORDER.append(s)
    work = [(i, arch) for i in range(len(_ORDER))]
    if jobs > 1 and len(work) > 1:
        import multiprocessing as mp

        # fork: the children inherit the imported vLLM modules and the kernels in _ORDER
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            results = list(pool.map(_compile_index, work, chunksize=1))
    else:
        results = [_compile_index(w) for w in work]
    return [results[keyed[_spec_key(s)]] for s in specs]
