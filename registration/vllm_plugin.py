"""vLLM plugin: DeepSeek-V4 / V4.1-Flash on NVIDIA sm_8x (A100, A800, A10, A6000) in vLLM 0.33.0.

Entry point (pyproject): ``[project.entry-points."vllm.general_plugins"]
dsv4_ops = "dsv4_ops.registration.vllm_plugin:register"``. vLLM calls ``register()`` in
every process (API server, engine core, each worker) before the model is built.

``register()`` imports vLLM lazily, is idempotent, and logs one line: the GPU capability,
the op-table decision (``dsv4_ops.dispatch.routes_to_dsv4_ops``; ``DSV4_AMPERE_IMPL``
forces it) and what it patched. On sm_90+ it patches nothing: vLLM keeps FlashMLA/DeepGEMM.
On sm_8x it first checks every entry of ``PATCHES`` against the installed vLLM (each
symbol must exist with the parameter names the replacement was written for) and raises
``VllmPatchError`` naming the symbol and the vLLM version on a mismatch: that is how a vLLM
upgrade announces itself. Then it applies them all.

``PATCHES`` is the single table of what the plugin replaces. ``NOT_COVERED`` lists what
still blocks sm_8x and is left to later issues.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

VLLM_VERSION_TESTED = "0.33.0"
_V4 = "vllm.models.deepseek_v4"
_V41 = "vllm.models.deepseek_v41"
_AMPERE = "dsv4_ops.vllm_ampere"


@dataclass(frozen=True)
class Patch:
    """One replaced vLLM symbol.

    module/symbol: where the name is looked up at call time (``symbol`` may be
    ``Class.attr``). params: the parameter names the replacement expects of the original
    (``self``/``cls`` excluded). build: ``module:function`` in dsv4_ops that takes the
    original object and returns the replacement (``replacement_name`` says what runs). kind: ``patch`` (setattr),
    ``override`` (a method the Ampere attention class overrides: only checked) or ``kept``
    (a base method the Ampere class inherits unchanged and relies on: only checked). placeholders: names of
    vLLM stand-ins that are accepted unchecked (FlashMLA's ``_raise_flashmla_unavailable``
    on a machine without CUDA).
    """

    module: str
    symbol: str
    params: Tuple[str, ...]
    build: str
    why: str
    kind: str = "patch"
    placeholders: Tuple[str, ...] = field(default=())


def _p(*names: str) -> Tuple[str, ...]:
    return tuple(names)


_GATHER = _p("out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset", "use_fnuz")
_SPARSE_FWD = _p("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length", "out")
_DECODE = _p("q", "kv_cache", "swa_metadata", "attn_metadata", "swa_only", "output")
_COMPRESSOR = _p("state_cache", "num_actual", "token_to_req_indices", "positions", "slot_mapping", "block_table",
                 "block_size", "state_width", "cos_sin_cache", "kv_cache", "k_cache_metadata", "pdl_kwargs",
                 "head_dim", "rope_head_dim", "compress_ratio", "overlap", "use_fp4_cache", "rms_norm_weight",
                 "rms_norm_eps", "quant_block", "token_stride", "scale_dim", "store_full_kv", "store_full_fp8",
                 "fp8_scale")
_NO_FLASHMLA = ("_raise_flashmla_unavailable",)

# The one table: every vLLM 0.33.0 symbol the plugin replaces on sm_8x, and its replacement.
PATCHES: Tuple[Patch, ...] = (
    Patch(f"{_V4}.nvidia.model", "_select_dsv4_attn_cls", _p("vllm_config"),
          f"{__name__}:_build_select_v4",
          "returns DeepseekV4FlashMLAAttention on sm_80; FlashMLA has only sm_90a/sm_100 cubins"),
    Patch(f"{_V41}.nvidia.model", "_select_dsv4_attn_cls", _p("vllm_config"),
          f"{__name__}:_build_select_v41",
          "same for V4.1 (the FlashMLA class is its default below sm_100)"),
    Patch(f"{_V4}.nvidia.flashmla", "dequantize_and_gather_k_cache", _GATHER,
          f"{__name__}:_build_gather",
          "prefill gather; CUDA path is CuTeDSL (cvt.rn.f16x2.e4m3x2, sm_89+), Triton path uses tl.float8e4nv"),
    Patch(f"{_V41}.nvidia.flashmla", "dequantize_and_gather_k_cache", _GATHER + ("max_gather_len",),
          f"{__name__}:_build_gather", "same, V4.1 copy (imported by name into its flashmla module)"),
    Patch(f"{_V4}.nvidia.flashmla", "flash_mla_sparse_fwd", _SPARSE_FWD,
          f"{__name__}:_build_sparse_fwd", "prefill attention; FlashMLA sparse prefill is sm_90a/sm_100 only",
          placeholders=_NO_FLASHMLA),
    Patch(f"{_V41}.nvidia.flashmla", "flash_mla_sparse_fwd", _SPARSE_FWD,
          f"{__name__}:_build_sparse_fwd", "same, V4.1", placeholders=_NO_FLASHMLA),
    Patch(f"{_V4}.nvidia.ops.sparse_attn_compress_cutedsl", "_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL",
          _COMPRESSOR, f"{__name__}:_build_compressor",
          "compressed 512-d cache writer: CuTeDSL (cvt.rn.satfinite.e4m3x2.f32, sm_89+) on every CUDA GPU"),
    Patch(f"{_V41}.compressor", "rope_quant_insert",
          _p("latent", "positions", "cos_sin_cache", "kv_cache", "slot_mapping", "compress_ratio", "fp8_scale"),
          f"{__name__}:_build_rope_quant_insert", "V4.1 compressed cache writer: Triton tl.float8e4nv (sm_89+)"),
    Patch("vllm.model_executor.warmup.jit_warmup", "JitWarmupRegistry.register", _p("kernel", "args", "kwargs"),
          f"{__name__}:_build_warmup_filter",
          "JIT warmup would compile the replaced CuTeDSL / tl.float8e4nv kernels for sm_80 and fail"),
    # Methods of vLLM's FlashMLA classes that the Ampere subclass overrides (checked, not set).
    Patch(f"{_V4}.nvidia.flashmla", "DeepseekV4FlashMLAAttention._forward_decode", _DECODE,
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "decode: flash_mla_with_kvcache (sm_90a/sm_100) -> "
          "gather both caches + split-KV + merge with sink", kind="override"),
    Patch(f"{_V41}.nvidia.flashmla", "DeepseekV4FlashMLAAttention._forward_decode", _DECODE,
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "same, V4.1", kind="override"),
    Patch(f"{_V4}.nvidia.flashmla", "DeepseekV4FlashMLAAttention._forward_prefill",
          _p("q", "positions", "compressed_k_cache", "swa_k_cache", "output", "attn_metadata", "swa_metadata"),
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "kept: its gather and sparse_fwd are the patched names above",
          kind="kept"),
    Patch(f"{_V41}.nvidia.flashmla", "DeepseekV4FlashMLAAttention._forward_prefill",
          _p("q", "positions", "compressed_k_cache", "swa_k_cache", "output", "attn_metadata", "swa_metadata"),
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "kept, V4.1", kind="kept"),
    Patch(f"{_V4}.nvidia.flashmla", "DeepseekV4FlashMLAAttention._o_proj", _p("o", "positions"),
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "deep_gemm_fp8_o_proj: fused_inv_rope_fp8_quant fails to "
          "compile on sm_80, fp8_einsum is DeepGEMM -> bf16 wo_a (dequantized at load) + torch", kind="override"),
    Patch(f"{_V41}.nvidia.flashmla", "DeepseekV4FlashMLAAttention._o_proj", _p("attn_out", "positions"),
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "dsv41_o_proj -> same bf16 path", kind="override"),
    Patch(f"{_V4}.nvidia.flashmla", "DeepseekV4FlashMLAAttention.get_padded_num_q_heads", _p("num_heads"),
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "no padding to 64: the real per-rank heads (8 at TP=8)",
          kind="override"),
    Patch(f"{_V41}.nvidia.flashmla", "DeepseekV4FlashMLAAttention.get_padded_num_q_heads", _p("num_heads"),
          f"{_AMPERE}.attention:_AmpereAttentionMixin", "same, V4.1", kind="override"),
)

# Kept as they are on sm_8x (vLLM's own code), with their verification status.
KEPT = (
    ("torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "SWA cache insert + q norm/RoPE: "
     "sm_80/sm_86 cubins present (cuobjdump of _C_stable_libtorch.abi3.so), host code allows sm_80+; "
     "q_head_padded in {8,16,32,64,128} covers 64/TP heads; not yet run on an Ampere GPU"),
)

# What still blocks sm_8x and is not covered by this plugin yet.
NOT_COVERED = (
    "C4A indexer: DeepGEMM fp8_fp4_mqa_logits / fp8_fp4_paged_mqa_logits / get_paged_mqa_logits_metadata "
    "(sm_90+) and the tl.float8e4nv indexer-K store and indexer-q quant kernels",
    "V4.1 indexer_k_store.py (tl.float8e4nv) and its compressor for head_dim 128",
    "V4.1 Engram (fp8 embedding gather kernel uses tl.float8e4nv; host-table mmap)",
    "mHC (TileLang fallback expected to work; unverified on sm_80)",
    "prefill context parallel (PCP) for V4.1 (the selector raises NotImplementedError)",
    "MTP / DSpark draft layers: built through the same selector, untested",
)


class VllmPatchError(RuntimeError):
    """A vLLM symbol the plugin patches is missing or has another signature."""


@dataclass
class _State:
    registered: bool = False
    capability: Optional[Tuple[int, int]] = None
    routed: bool = False
    originals: Dict[Tuple[str, str], Any] = field(default_factory=dict)

    @property
    def patched(self) -> List[str]:
        return [f"{m}.{s}" for (m, s) in self.originals]


STATE = _State()


# ------------------------------------------------------------------- builders (original -> new)

def _ampere_cls(flashmla_module: str) -> type:
    from dsv4_ops.vllm_ampere.attention import make_ampere_attention_cls

    base = importlib.import_module(flashmla_module).DeepseekV4FlashMLAAttention
    return make_ampere_attention_cls(base)


def _select(flashmla_module: str) -> Callable:
    def _select_dsv4_attn_cls(vllm_config):
        """dsv4_ops: the sm_8x attention class (replaces vLLM's selection)."""
        pcp = getattr(getattr(vllm_config, "parallel_config", None), "prefill_context_parallel_size", 1)
        if pcp and pcp > 1:
            raise NotImplementedError("dsv4_ops: prefill context parallelism is not supported on sm_8x yet")
        return _ampere_cls(flashmla_module)

    return _select_dsv4_attn_cls


def _build_select_v4(original):
    return _select(f"{_V4}.nvidia.flashmla")


def _build_select_v41(original):
    return _select(f"{_V41}.nvidia.flashmla")


def _build_gather(original):
    from dsv4_ops.vllm_ampere.attention import dequantize_and_gather_k_cache_ampere

    return dequantize_and_gather_k_cache_ampere


def _build_sparse_fwd(original):
    from dsv4_ops.vllm_ampere.attention import flash_mla_sparse_fwd_ampere

    return flash_mla_sparse_fwd_ampere


def _build_compressor(original):
    from dsv4_ops.vllm_ampere.compressed_cache import compress_norm_rope_store_ampere

    return compress_norm_rope_store_ampere


def _build_rope_quant_insert(original):
    from dsv4_ops.vllm_ampere.compressed_cache import rope_quant_insert_ampere

    return rope_quant_insert_ampere


# Kernels whose JIT warmup is dropped on sm_8x: replaced above, or CuTeDSL (sm_89+ PTX).
_WARMUP_SKIP = (
    (f"{_V4}.common.ops.fused_inv_rope_fp8_quant", "_FUSED_INV_ROPE_FP8_QUANT_KERNEL"),
    (f"{_V4}.common.ops.cache_utils", "_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL"),
)


def _skip_warmup(kernel: Any) -> bool:
    mod = type(kernel).__module__
    if "cutedsl" in mod or "cute_dsl" in mod:
        return True
    for module, name in _WARMUP_SKIP:
        m = importlib.import_module(module)
        if getattr(m, name, None) is kernel:
            return True
    return False


def _build_warmup_filter(original):
    func = original.__func__

    def register(cls, kernel, *args, **kwargs):
        """dsv4_ops: vLLM's warmup registration minus kernels that cannot compile on sm_8x."""
        if _skip_warmup(kernel):
            return None
        return func(cls, kernel, *args, **kwargs)

    return classmethod(register)


# ------------------------------------------------------------------------- check and apply

def vllm_version() -> str:
    try:
        import vllm

        return getattr(vllm, "__version__", "unknown")
    except Exception:  # pragma: no cover
        return "not installed"


def _resolve(entry: Patch) -> Tuple[Any, str, Any]:
    """(owner object, attribute name, current value) of an entry."""
    try:
        owner: Any = importlib.import_module(entry.module)
    except Exception as exc:
        raise VllmPatchError(f"dsv4_ops vLLM plugin: module {entry.module} does not import in vLLM "
                             f"{vllm_version()} (written for {VLLM_VERSION_TESTED}): {exc}") from exc
    *path, name = entry.symbol.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    if owner is None or not hasattr(owner, name):
        raise VllmPatchError(f"dsv4_ops vLLM plugin: {entry.module}.{entry.symbol} is missing in vLLM "
                             f"{vllm_version()} (written for {VLLM_VERSION_TESTED})")
    return owner, name, getattr(owner, name)


def _param_names(obj: Any) -> Tuple[str, ...]:
    target = obj
    if not (inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj)) and callable(obj):
        target = type(obj).__call__
        names = tuple(inspect.signature(target).parameters)[1:]
    else:
        names = tuple(inspect.signature(target).parameters)
        if inspect.isfunction(obj) and names and names[0] in ("self", "cls"):
            names = names[1:]
    return names


def check_signatures(entries=PATCHES) -> None:
    """Raise VllmPatchError unless every entry's symbol exists with the expected parameter names."""
    for entry in entries:
        _, _, current = _resolve(entry)
        if getattr(current, "__name__", None) in entry.placeholders:
            continue
        if getattr(current, "_dsv4_ampere_replacement", False):
            continue
        got = _param_names(current)
        if got != entry.params:
            raise VllmPatchError(
                f"dsv4_ops vLLM plugin: {entry.module}.{entry.symbol} has parameters {got} in vLLM "
                f"{vllm_version()}; the sm_8x replacement was written for {entry.params} "
                f"(vLLM {VLLM_VERSION_TESTED}). Update dsv4_ops or pin vllm=={VLLM_VERSION_TESTED}.")


def _builder(entry: Patch) -> Callable:
    module, name = entry.build.split(":")
    return getattr(importlib.import_module(module), name)


def apply_patches(entries=PATCHES) -> List[str]:
    """Set every ``patch`` entry (idempotent); returns the names patched now."""
    done = []
    for entry in entries:
        if entry.kind != "patch":
            continue
        key = (entry.module, entry.symbol)
        if key in STATE.originals:
            continue
        owner, name, current = _resolve(entry)
        raw = owner.__dict__[name] if isinstance(owner, type) else current
        new = _builder(entry)(current)
        try:
            (new.__func__ if isinstance(new, classmethod) else new)._dsv4_ampere_replacement = True
        except AttributeError:
            pass
        setattr(owner, name, new)
        STATE.originals[key] = (owner, name, raw)
        done.append(f"{entry.module}.{entry.symbol}")
    return done


def unpatch() -> None:
    """Restore every original (tests; and a process that wants vLLM's own kernels back)."""
    for owner, name, raw in STATE.originals.values():
        setattr(owner, name, raw)
    STATE.originals.clear()


def reset() -> None:
    """Unpatch and forget that register() ran (tests)."""
    unpatch()
    STATE.registered = False
    STATE.capability = None
    STATE.routed = False


def _capability() -> Optional[Tuple[int, int]]:
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return None if cap is None else (int(cap[0]), int(cap[1]))


def decide(capability: Optional[Tuple[int, int]]) -> Tuple[bool, str]:
    """(route to dsv4_ops?, reason) from the capability and DSV4_AMPERE_IMPL."""
    from dsv4_ops import dispatch

    forced = dispatch.impl_override()
    if capability is None:
        if forced != "auto":
            return True, f"no GPU capability, {dispatch.ENV_VAR}={forced} forces the dsv4_ops path"
        return False, "no GPU capability: nothing to patch"
    variant = dispatch.table_variant(capability) or "unsupported"
    if dispatch.routes_to_dsv4_ops(capability):
        how = f"{dispatch.ENV_VAR}={forced}" if forced != "auto" else f"op table: {variant}"
        return True, f"{how} -> dsv4_ops kernels ({dispatch.kernel_variant(capability)})"
    return False, f"op table: {variant} -> vLLM keeps its own kernels"


def register() -> None:
    """vLLM general-plugin entry point; idempotent, imports vLLM lazily, logs one line."""
    if STATE.registered:
        return
    from vllm.logger import init_logger

    logger = init_logger("vllm.plugins.dsv4_ops")
    cap = _capability()
    routed, reason = decide(cap)
    patched: List[str] = []
    if routed:
        check_signatures()
        patched = apply_patches()
    STATE.registered, STATE.capability, STATE.routed = True, cap, routed
    cap_s = f"sm_{cap[0]}{cap[1]}" if cap else "none"
    what = (f"patched {len(patched)} vLLM symbols: " + ", ".join(p.rsplit(".", 1)[-1] for p in patched)
            if patched else "patched nothing")
    logger.info("dsv4_ops plugin (pid %d): capability %s; %s; %s", os.getpid(), cap_s, reason, what)


_REPLACEMENT_NAMES = {
    "_build_select_v4": "make_ampere_attention_cls(deepseek_v4 FlashMLA class) -> DeepseekAmpereV4Attention",
    "_build_select_v41": "make_ampere_attention_cls(deepseek_v41 FlashMLA class) -> DeepseekAmpereV41Attention",
    "_build_gather": "vllm_ampere.attention.dequantize_and_gather_k_cache_ampere (kv_cache_gather)",
    "_build_sparse_fwd": "vllm_ampere.attention.flash_mla_sparse_fwd_ampere (sparse_mla_decode)",
    "_build_compressor": "vllm_ampere.compressed_cache.compress_norm_rope_store_ampere (torch + kv_cache_insert)",
    "_build_rope_quant_insert": "vllm_ampere.compressed_cache.rope_quant_insert_ampere (torch + kv_cache_insert)",
    "_build_warmup_filter": "the same registration, minus kernels that cannot compile on sm_8x",
}


def replacement_name(entry: Patch) -> str:
    """What runs instead of ``entry``'s symbol, in words."""
    name = entry.build.split(":")[1]
    if entry.kind == "kept":
        return "inherited unchanged"
    if entry.kind == "override":
        return f"DeepseekAmpereV4{'1' if entry.module.startswith(_V41) else ''}Attention.{entry.symbol.split('.')[-1]}"
    return _REPLACEMENT_NAMES.get(name, entry.build)


def patch_table_markdown() -> str:
    """The patch table as Markdown (docs/vllm.md quotes it)."""
    rows = ["| vLLM 0.33.0 symbol | kind | sm_8x replacement | why |", "|---|---|---|---|"]
    for e in PATCHES:
        rows.append(f"| `{e.module.replace('vllm.models.', '')}.{e.symbol}` | {e.kind} | {replacement_name(e)} | {e.why} |")
    return "\n".join(rows)
