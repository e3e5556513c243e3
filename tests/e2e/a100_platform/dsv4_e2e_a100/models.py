"""vLLM's own model classes, unchanged, plus (after their weights load, in the worker) the model
e2e's tripwire and counters; ``worker_report`` returns them through ``LLM.collective_rpc``."""

from __future__ import annotations

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


def worker_report(*_args, **_kw) -> dict:
    """The worker's view (called through ``LLM.collective_rpc``)."""
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
                max_memory_allocated=torch.cuda.max_memory_allocated(),
                max_memory_reserved=torch.cuda.max_memory_reserved())
