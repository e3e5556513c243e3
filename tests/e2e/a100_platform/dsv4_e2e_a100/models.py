"""vLLM's own model classes, unchanged, plus (after their weights load, in the worker) the model
e2e's tripwire and counters; ``worker_report`` returns them through ``LLM.collective_rpc``."""

from __future__ import annotations

import functools
import os

from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM as _V4
from vllm.models.deepseek_v41.nvidia.model import DeepseekV41LLMForCausalLM as _V41
from vllm.models.deepseek_v32 import DeepseekV32ForCausalLM as _V32

STATE: dict = {}


def _arm(model_name: str) -> None:
    """Tripwire (audit-dead Triton kernels, fp8 Triton launches, replaced originals, DeepGEMM /
    FlashMLA entries) and counters, once per process, after every model module is imported."""
    if STATE.get("armed"):
        return
    import counters
    import tripwire
    from dsv4_ops.vllm import plugin

    models = ("v32", "glm5") if model_name == "v32" else None
    env = "DSV4_E2E_AUDIT_JSON_V32" if model_name == "v32" else "DSV4_E2E_AUDIT_JSON"
    path = os.environ.get(env, "")
    try:
        if not (path and os.path.isfile(path) and os.path.getsize(path) > 0):
            raise FileNotFoundError(f"{env}={path!r}: no audit JSON (tests/e2e/make_bundle.sh writes it)")
        STATE["tripwire"] = tripwire.install(model_name, plugin.STATE.originals, models=models)
    except Exception as exc:  # noqa: BLE001 (reported: the summary fails a run whose tripwire is not armed)
        STATE["tripwire"] = f"NOT ARMED: {type(exc).__name__}: {exc}"[:500]
    if os.environ.get("DSV4_E2E_COUNT_OPS") == "1":   # Python-level counters (eager runs only)
        counters.install_ops()
    STATE["armed"] = model_name
    STATE["pid"] = os.getpid()
    mut = os.environ.get("DSV4_E2E_MUTATE", "")
    if mut:
        import driver

        STATE["mutation"] = driver.mutate(mut)


class DeepseekV41LLMForCausalLM(_V41):
    def load_weights(self, weights):
        out = super().load_weights(weights)
        _arm("v41")
        return out


class DeepseekV4ForCausalLM(_V4):
    def load_weights(self, weights):
        out = super().load_weights(weights)
        _arm("v4")
        return out


class DeepseekV32ForCausalLM(_V32):
    def load_weights(self, weights):
        out = super().load_weights(weights)
        _arm("v32")
        return out


def worker_report(worker=None, *_args, **_kw) -> dict:
    """The worker's view (called through ``LLM.collective_rpc``; ``worker`` is vLLM's Worker)."""
    import counters
    import standins
    import tripwire
    import torch
    from dsv4_ops.vllm import plugin
    from dsv4_e2e_a100 import plugin as e2e_plugin
    from vllm.platforms import current_platform as cp

    cap = cp.get_device_capability()
    return dict(pid=os.getpid(), platform=type(cp).__name__, capability=f"{cap.major}.{cap.minor}",
                device_name=cp.get_device_name(), sms=cp.num_compute_units(), plugin_registered=plugin.STATE.registered, armed=STATE.get("armed"), tripwire=STATE.get("tripwire"),
                mutation=STATE.get("mutation"), tripped=list(tripwire.TRIPPED),
                triton_launches=dict(tripwire.LAUNCHES), standin_calls=dict(standins.CALLS),
                ops_called=dict(counters.OPS), plugin_routed=plugin.STATE.routed,
                plugin_capability=plugin.STATE.capability,
                triton_compiles=list(e2e_plugin.COMPILES),
                triton_compiles_ours=[c for c in e2e_plugin.COMPILES if c.split("[", 1)[0] in _our_kernel_names()],
                max_memory_allocated=torch.cuda.max_memory_allocated(),
                max_memory_reserved=torch.cuda.max_memory_reserved(),
                memory_profile={k: getattr(worker, k, None) for k in (
                    "requested_memory", "available_kv_cache_memory_bytes", "peak_activation_memory",
                    "cudagraph_memory_estimate", "total_consumed")},
                mem_get_info=list(torch.cuda.mem_get_info()))


def reset_peak(*_args, **_kw) -> int:
    """Peak-memory statistics restart here (so the report's peak is the generation's)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return os.getpid()


_PROF: dict = {}


def profile_start(*_args, **_kw) -> int:
    """A torch.profiler (kineto / CUPTI) trace of the worker's CUDA kernels until profile_stop."""
    import torch

    torch.cuda.synchronize()
    p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                           torch.profiler.ProfilerActivity.CPU])
    p.__enter__()
    _PROF["p"] = p
    return os.getpid()


@functools.lru_cache(maxsize=1)
def _our_kernel_names() -> frozenset:
    """Names of dsv4_ops' Triton kernels (every ``triton.jit`` function under the package and
    csrc_triton), the names CUPTI reports for their launches."""
    import ast
    import pathlib

    import dsv4_ops

    root = pathlib.Path(dsv4_ops.__file__).resolve().parent
    names = set()
    for d in (root, root.parent / "csrc_triton"):
        for f in d.rglob("*.py"):
            try:
                tree = ast.parse(f.read_text())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for n in ast.walk(tree):
                if isinstance(n, ast.FunctionDef) and any("jit" in ast.unparse(x) for x in n.decorator_list):
                    names.add(n.name)
    return frozenset(names)


def profile_stop(*_args, **_kw) -> dict:
    """Kernel counts of the trace since profile_start: every kernel, ours (dsv4_ops' Triton
    kernel names), and those launched from a CUDA graph: CUPTI gives every kernel the
    correlation id of the runtime call that launched it, so a replayed graph's kernels carry the
    id of a ``cudaGraphLaunch``; plus the graph launches themselves."""
    import json
    import tempfile
    from collections import Counter

    import torch

    torch.cuda.synchronize()
    p = _PROF.pop("p")
    p.__exit__(None, None, None)
    path = tempfile.mktemp(suffix=".json")
    p.export_chrome_trace(path)
    ev = json.load(open(path)).get("traceEvents", [])
    ours = _our_kernel_names()
    kern, in_graph, ours_all, ours_graph, rt = Counter(), Counter(), Counter(), Counter(), Counter()
    graph_keys = set()
    graph_launch_ids = {(e.get("args") or {}).get("correlation") for e in ev
                        if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")} - {None}
    for e in ev:
        cat, name, args = e.get("cat", ""), e.get("name", ""), e.get("args") or {}
        if cat == "cuda_runtime" and "Graph" in name:
            rt[name] += 1
        if cat != "kernel":
            continue
        gk = [k for k in args if "graph" in k.lower()]
        graph_keys.update(gk)
        g = args.get("correlation") in graph_launch_ids or any(args.get(k) not in (None, 0, -1, "0") for k in gk)
        kern[name] += 1
        is_ours = name in ours   # Triton names a launched kernel by its function (helpers never launch)
        if g:
            in_graph[name] += 1
        if is_ours:
            ours_all[name] += 1
            if g:
                ours_graph[name] += 1
    return dict(pid=os.getpid(), kernels=sum(kern.values()), kernels_in_graph=sum(in_graph.values()),
                ours=dict(ours_all), ours_in_graph=dict(ours_graph), graph_runtime_calls=dict(rt),
                graph_arg_keys=sorted(graph_keys), top_kernels=kern.most_common(25),
                n_our_names=len(ours))
