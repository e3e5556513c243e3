"""The checkpoint's quantization layout and vLLM's kernel settings, checked at model build.

``DeepseekV4FP8Config.get_quant_method`` (V4 and V4.1 packages) picks the linear and MoE
methods for every layer while the model is built, under the current vLLM config. The wrapped
method first checks, once per config object, that vLLM's resolved layout (weight block size,
``expert_dtype``, ``moe_quant_algo``) is one the audit covers on sm_80 and that
``--linear-backend`` / ``--moe-backend`` keep the audited kernels
(``dsv4_ops.vllm.serve_host``); otherwise it raises ``UnauditedServePathError`` at startup,
before any weight loads, instead of running an unevaluated kernel mid-serving.
"""

from __future__ import annotations

import functools
import importlib
from typing import Dict, List

from . import serve_host
from .table import Patch, Reads, per_model, since


class UnauditedServePathError(RuntimeError):
    """vLLM would serve this model on sm_8x through kernels the audit never evaluated."""


def _refused(variant: str, what: str) -> UnauditedServePathError:
    """The startup refusal of a DeepSeek-V4 / V4.1 checkpoint: ``what`` says why."""
    model = {"v4": "V4", "v41": "V4.1"}.get(variant, variant)
    return UnauditedServePathError(f"dsv4_ops (sm_8x): DeepSeek-{model} checkpoint {what}. Refused at startup; "
                                   "`dsv4-ops doctor --model <dir>` lists what is covered.")


def check_quant_config(config, variant: str, kernel_config=None) -> serve_host.QuantLayout:
    """Raise UnauditedServePathError unless ``config`` (vLLM's DeepseekV4FP8Config, resolved)
    is an audited layout and ``kernel_config`` selects no other backend; the layout otherwise."""
    layout = serve_host.classify(variant, config.get_name(), config.weight_block_size, config.expert_dtype,
                                 config.moe_quant_algo)
    problems = [layout.problem] if layout.problem else []
    if kernel_config is not None:
        problems += serve_host.kernel_setting_problems(
            {}, getattr(kernel_config, "linear_backend", "auto"), getattr(kernel_config, "moe_backend", "auto"),
            getattr(kernel_config, "linear_backend_per_quant", None))
    if problems:
        raise _refused(variant, f"with {layout.describe()}: " + "; ".join(problems))
    return layout


def check_model_quant(quant_config, variant: str) -> None:
    """Raise UnauditedServePathError unless vLLM's quant config for a V4 / V4.1 model is None
    (bf16 weights: vLLM's unquantized linear and MoE methods, the path the end-to-end tests run)
    or a ``DeepseekV4FP8Config`` (its layout is checked by the hook above). Any other config
    (Quark, compressed-tensors, ModelOpt, ...) builds linear and MoE methods no audit evaluated
    on sm_80; called while the model is built (the attention layers' constructor)."""
    if quant_config is None or type(quant_config).__name__ == "DeepseekV4FP8Config":
        return
    name = quant_config.get_name() if hasattr(quant_config, "get_name") else type(quant_config).__name__
    raise _refused(variant, f"quantized as {name!r} ({type(quant_config).__name__}): vLLM builds its linear and MoE "
                            "methods from that config, and the audit covers only the DeepseekV4FP8Config layouts and "
                            "bf16 weights")


def serve_setting_problems(lora_config, indexer_logits_dtype) -> List[str]:
    """What in vLLM's model settings leaves the audited V4 / V4.1 path (empty: nothing).

    lora_config: vLLM's LoRAConfig or None. LoRA wraps wo_a (vLLM 0.34's
    ``DeepseekV4GroupedWoAWithLoRA``) and other linears with punica kernels no audit covered, and
    the Ampere ``_o_proj`` reads the bf16 wo_a directly, so an adapter on wo_a would be dropped
    silently. indexer_logits_dtype: vLLM 0.34's ``attention_config.indexer_logits_dtype`` (None
    on 0.33); bfloat16 logits are DeepGEMM's SM100 form, the sm_8x indexer scores in float32."""
    problems = []
    if lora_config is not None:
        problems.append("LoRA (--enable-lora) is not served on sm_8x: its adapters on wo_a and the other "
                        "linears run through kernels the audit does not cover; serve without --enable-lora")
    if indexer_logits_dtype not in (None, "auto", "float32"):
        problems.append(f"indexer_logits_dtype={indexer_logits_dtype!r}: the sm_8x indexer scores in float32; "
                        "leave --attention-config.indexer_logits_dtype at auto or float32")
    return problems


def check_serve_settings(variant: str, vllm_config=None) -> None:
    """Raise UnauditedServePathError when the model settings of vLLM's current config (or
    ``vllm_config``) leave the audited path (``serve_setting_problems``); at model build."""
    if vllm_config is None:
        lora, attention = _current("lora_config"), _current("attention_config")
    else:
        lora, attention = getattr(vllm_config, "lora_config", None), getattr(vllm_config, "attention_config", None)
    problems = serve_setting_problems(lora, getattr(attention, "indexer_logits_dtype", None))
    if problems:
        raise _refused(variant, "served with " + "; ".join(problems))


def _current(field: str):
    """``field`` of vLLM's current config (the model being built); None without one."""
    try:
        from vllm.config import get_current_vllm_config

        return getattr(get_current_vllm_config(), field, None)
    except Exception:  # noqa: BLE001 - no current config: nothing to check
        return None


def current_quant_config():
    """vLLM's quant config of the model being built (None: bf16 weights, or no current config)."""
    return _current("quant_config")


def _current_kernel_config():
    return _current("kernel_config")


def checked_get_quant_method(original):
    """Builder: ``get_quant_method`` that checks the layout on its first call for a config
    (the model, V4 or V4.1, from the package that defines the original)."""
    variant = "v41" if ".deepseek_v41." in original.__module__ + "." else "v4"

    @functools.wraps(original)
    def get_quant_method(self, layer, prefix):
        if not getattr(self, "_dsv4_ampere_layout_checked", False):
            check_quant_config(self, variant, _current_kernel_config())
            self._dsv4_ampere_layout_checked = True
        return original(self, layer, prefix)

    return get_quant_method


_CLASSES = {"v4": "vllm.models.deepseek_v4.quant_config", "v41": "vllm.models.deepseek_v41.quant_config"}
_ORIGINALS: Dict[str, object] = {}  # module -> vLLM's own get_quant_method (while installed)


def install() -> List[str]:
    """Wrap ``DeepseekV4FP8Config.get_quant_method`` of both packages (idempotent; sm_8x, by
    ``register()``). A hook, not a patch: the wrapper calls vLLM's method unchanged, so the
    audit's evidence for what vLLM builds stays vLLM's own. Returns the names wrapped now."""
    done = []
    for module in _CLASSES.values():
        if module in _ORIGINALS:
            continue
        cls = importlib.import_module(module).DeepseekV4FP8Config
        original = cls.__dict__["get_quant_method"]
        wrapped = checked_get_quant_method(original)
        wrapped._dsv4_ampere_replacement = True
        cls.get_quant_method = wrapped
        _ORIGINALS[module] = original
        done.append(f"{module}.DeepseekV4FP8Config.get_quant_method")
    return done


def uninstall() -> None:
    """Put vLLM's own methods back (tests; the plugin's ``unpatch``)."""
    for module, original in list(_ORIGINALS.items()):
        importlib.import_module(module).DeepseekV4FP8Config.get_quant_method = original
        del _ORIGINALS[module]


PATCHES = (
    # what check_serve_settings reads on vLLM's config (a renamed field would silently read None)
    Patch("vllm.config.attention", "AttentionConfig.resolve_indexer_logits_dtype", ("default",),
          "model settings checked at model build: LoRA and bfloat16 indexer logits leave the audited path",
          check_serve_settings, kind="hook", versions=since("0.34.0"),
          reads=(Reads("vllm.config.attention", "AttentionConfig", ("indexer_logits_dtype",)),
                 Reads("vllm.config", "VllmConfig", ("lora_config", "attention_config")))),
) + per_model(
    "quant_config", "DeepseekV4FP8Config.get_quant_method", ("layer", "prefix"),
    "checkpoint quant layout and --linear/--moe-backend pick the kernels: before vLLM's own method runs, refuse at "
    "model build what the audit does not cover (NVFP4 or FP8 experts, another block size, another backend)",
    install, kind="hook",
    reads={m: (Reads(_CLASSES[m], "DeepseekV4FP8Config", ("weight_block_size", "expert_dtype", "moe_quant_algo",
                                                          "get_name")),) for m in ("v4", "v41")})
