"""vLLM's JIT warmup on sm_8x, filtered by evidence instead of a hand list.

vLLM aborts startup when a kernel registered with ``JitWarmupRegistry`` fails to compile.
``warmup_filtered`` wraps ``JitWarmupRegistry.warmup``. Before vLLM expands its registrations,
``filter_registrations`` decides each one:

1. it compiles the registration's warmup keys for this GPU (vLLM's own ``get_warmup_keys`` +
   ``compile``, the same compile the warmup would run; a kernel that compiles is cached by
   Triton or by the kernel's own compile cache, so vLLM's warmup of it costs nothing more), and
2. if that fails, it asks the serve-path call graph (``dsv4_ops.vllm.serve_graph``) whether every
   use of the kernel on the serve path goes through a row of the patch table.

Failed and replaced: removed from the warmup (logged at info). Failed and NOT replaced: kept and
logged as an error naming the kernel, so vLLM's warmup fails loudly instead of a later request.
Compiles: kept. The decision is made at warmup time, not at registration: a registration's keys
may depend on state that exists only after the model is built (V4's C128 compressor store takes
its keys from the allocated KV cache and the final block size), so at registration they can be
empty and prove nothing.

Then it adds this library's own kernels, one ``VllmJitKernel`` whose compile keys are the warm
set (``dsv4_ops.vllm.warm_set.build``: every Triton specialization the dispatch can pick for the
served model, its per-rank heads, the KV-cache block sizes and every batch class up to
``max_num_batched_tokens``). So they compile during vLLM's "JIT kernel warmup" (its log line
reports the seconds), in parallel (``VLLM_TRITON_JIT_WARMUP_NUM_THREADS``), and a compile failure
aborts startup. Each key is compiled by replaying its launch through Triton's own
``JITFunction.warmup`` (``dsv4_ops.warm_keys.compile_jit``), so it lands under the key the real
launch looks up. The enumerated set itself is kept on disk per sources and arguments
(``warm_set.cached_build``, ``DSV4_AMPERE_WARM_SET_CACHE``; 0 = off), so a restart skips the
enumeration as Triton's cache skips the compiles. ``DSV4_AMPERE_WARMUP=0`` skips the warm set
(our kernels then compile at their first launch); vLLM's ``enable_jit_warmup=False`` skips every
JIT warmup, ours too.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .. import envs
from .table import Patch

logger = logging.getLogger("vllm.plugins.dsv4_ops.warmup")


@dataclass(frozen=True)
class Verdict:
    kernel: str
    fails: bool
    error: str
    replaced_by: Optional[str]

    @property
    def drop(self) -> bool:
        return self.fails and self.replaced_by is not None


def kernel_name(kernel: Any) -> Tuple[str, str]:
    """(defining module, module-level name) of a warmup kernel object."""
    import sys

    for mod_name in (getattr(kernel, "__module__", None), type(kernel).__module__):
        mod = sys.modules.get(mod_name or "")
        if mod is None:
            continue
        for name, obj in vars(mod).items():
            if obj is kernel:
                return mod_name, name
    return type(kernel).__module__, type(kernel).__name__


_COMPILED: Dict[Tuple, Tuple[bool, str]] = {}


def compile_fails(kernel: Any, args: tuple, kwargs: dict) -> Tuple[bool, str]:
    """(fails, error) of compiling every warmup key of this registration for the current GPU
    (``args`` / ``kwargs`` as ``get_warmup_keys`` takes them; see ``warmup_call_kwargs``)."""
    try:
        cache_key = (id(kernel), repr(args), repr(sorted(kwargs.items())))
    except Exception:  # noqa: BLE001 - an unrepresentable argument: do not cache
        cache_key = None
    if cache_key in _COMPILED:
        return _COMPILED[cache_key]
    try:
        for key in kernel.get_warmup_keys(*args, **kwargs):
            kernel.compile(key)
        result = (False, "")
    except Exception as exc:  # noqa: BLE001 - any compile error is the evidence
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        result = (True, f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300])
    if cache_key is not None:
        _COMPILED[cache_key] = result
    return result


def warmup_call_kwargs(kernel: Any, args: tuple, kwargs: dict, vllm_config: Any) -> dict:
    """The kwargs vLLM's warmup passes to ``get_warmup_keys`` for this registration: a bare
    registration of a kernel whose ``get_warmup_keys`` takes ``vllm_config`` gets the registry's."""
    if not args and not kwargs and vllm_config is not None:
        import inspect

        if "vllm_config" in inspect.signature(kernel.get_warmup_keys).parameters:
            return {"vllm_config": vllm_config}
    return dict(kwargs)


@functools.lru_cache(maxsize=1)
def _call_graph():
    """(graph, refs, bindings, replaced functions) over every model's serve-path source (AST only)."""
    from .serve_graph import MODELS, ServeGraph

    graph = ServeGraph(arch=0)
    mods: Dict[str, Any] = {}
    for model in MODELS:
        mods.update(graph.scope(model))
    refs = graph.build_graph(mods)
    bind, funcs = graph.patched()
    return graph, refs, bind, funcs


def replaced_by(module: str, name: str) -> Optional[str]:
    """The patch-table row(s) that every serve-path use of ``module.name`` goes through, or None."""
    graph, refs, bind, funcs = _call_graph()
    return graph.coverage(name, module, refs, bind, funcs, jit_defs=set())


def decide(kernel: Any, args: tuple, kwargs: dict) -> Verdict:
    module, name = kernel_name(kernel)
    fails, error = compile_fails(kernel, args, kwargs)
    replaced = replaced_by(module, name) if fails else None
    return Verdict(f"{module}.{name}", fails, error, replaced)


def filter_registrations(registry: Any) -> None:
    """Remove from ``registry`` (a ``JitWarmupRegistry`` about to warm up) every registration that
    fails to compile on this GPU and is replaced; log an error for one that fails and is not."""
    regs = getattr(registry, "_registrations", None)
    if not isinstance(regs, dict):
        raise RuntimeError("dsv4_ops: vLLM's JitWarmupRegistry has no `_registrations` dict (a vLLM release "
                           "this plugin was not checked against?); the sm_8x JIT-warmup filter cannot run")
    config = getattr(registry, "vllm_config", None)
    for kernel in list(regs):
        kept = []
        for args, kwargs in regs[kernel]:
            verdict = decide(kernel, args, warmup_call_kwargs(kernel, args, kwargs, config))
            if verdict.drop:
                logger.info("dsv4_ops: JIT warmup of %s dropped: it fails to compile on this GPU (%s) and is "
                            "replaced by %s", verdict.kernel, verdict.error, verdict.replaced_by)
                continue
            if verdict.fails:
                logger.error("dsv4_ops: %s fails to compile on this GPU (%s) and is NOT replaced by dsv4_ops; "
                             "vLLM's JIT warmup will abort startup on it (run `dsv4-ops audit-vllm`)",
                             verdict.kernel, verdict.error)
            kept.append((args, kwargs))
        if kept:
            regs[kernel] = kept
        else:
            del regs[kernel]


WARMUP_ENV = envs.WARMUP


def warmup_enabled() -> bool:
    """False when DSV4_AMPERE_WARMUP is 0 / false / off (default on)."""
    return envs.get(WARMUP_ENV)


@functools.lru_cache(maxsize=1)
def warm_set_kernel_cls():
    """The VllmJitKernel class of the warm set (built once; vLLM is imported here, lazily)."""
    from vllm.model_executor.warmup.jit_warmup import VllmJitKernel

    class Dsv4AmpereWarmSet(VllmJitKernel):
        """dsv4_ops' Triton kernels for the served DeepSeek-V4/V4.1 model: compile keys are
        dsv4_ops.warm_keys.LaunchKey (the warm set), compiled into Triton's JIT cache."""

        CompileKey = tuple

        def get_warmup_keys(self, vllm_config=None):
            ws = build_warm_set(vllm_config)
            return [] if ws is None else sorted(ws.keys, key=lambda k: k.label())

        def compile(self, compile_key):
            from .. import warm_keys

            warm_keys.compile_jit(compile_key)

        def compile_many(self, compile_keys):
            from .. import warm_keys

            from vllm import envs

            threads = max(1, int(envs.VLLM_TRITON_JIT_WARMUP_NUM_THREADS))  # vLLM's own pool size (4)
            keys = list(compile_keys)
            start = time.perf_counter()
            warm_keys.compile_many_jit(keys, threads=threads)
            logger.info("dsv4_ops: warmed %d Triton specializations in %.1f s (%d threads)", len(keys),
                        time.perf_counter() - start, threads)

    return Dsv4AmpereWarmSet


def build_warm_set(vllm_config):
    """The warm set of the model vLLM serves on this worker's GPU, or None (not DSv4/V4.1)."""
    import torch

    from .. import dispatch
    from .warm_set import build, default_cache_dir, shapes_from_vllm_config

    shapes = shapes_from_vllm_config(vllm_config)
    if shapes is None:
        return None
    device = torch.cuda.current_device()
    variant = dispatch.kernel_variant(dispatch.device_capability(device))
    max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    start = time.perf_counter()
    ws = build(shapes, max_tokens, sms=dispatch.device.num_sms(device), variant=variant, cache_dir=default_cache_dir())
    logger.info("dsv4_ops: warm set of %s at TP=%d, <= %d tokens a batch: %d Triton specializations "
                "(%d batch classes, %s), enumerated in %.1f s", shapes.name, shapes.tp, max_tokens, len(ws),
                len(ws.classes), variant, time.perf_counter() - start)
    return ws


def warmup_filtered(original):
    """Builder: ``JitWarmupRegistry.warmup`` minus the failing, replaced registrations, plus the
    warm set of dsv4_ops' own kernels."""

    def warmup(self):
        """dsv4_ops: vLLM's JIT warmup, filtered for this GPU, plus every dsv4_ops Triton
        specialization of this model."""
        filter_registrations(self)
        if warmup_enabled() and _served_model_is_dsv4(getattr(self, "vllm_config", None)):
            self._add(_warm_set_kernel(), (), {})
        return original(self)

    return warmup


def _served_model_is_dsv4(vllm_config) -> bool:
    from .warm_set import shapes_from_vllm_config

    return vllm_config is not None and shapes_from_vllm_config(vllm_config) is not None


@functools.lru_cache(maxsize=1)
def _warm_set_kernel():
    return warm_set_kernel_cls()()


PATCHES = (
    Patch("vllm.model_executor.warmup.jit_warmup", "JitWarmupRegistry.warmup", (),
          "JIT warmup compiles every registered kernel for this GPU and aborts startup on the first failure "
          "-> replaced kernels that fail on sm_8x are dropped (decided by compiling them when the warmup "
          "runs), others fail loudly; and dsv4_ops' own Triton kernels, unknown to vLLM's warmup (each "
          "specialization would compile at its first batch class, mid-serving), are added as the warm set "
          "(every specialization the dispatch can pick for this model, TP and max_num_batched_tokens)",
          warmup_filtered, wraps=True),
)
