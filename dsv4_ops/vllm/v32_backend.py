"""The sparse-MLA attention backend vLLM 0.33.0 selects for DeepSeek-V3.2 / GLM-5 on sm_8x.

DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``, the same class on
CUDA) build ``MLAAttention(use_sparse=True)``, whose backend comes from vLLM's selector
(``platforms/cuda.py: get_attn_backend_cls``): it walks ``_get_backend_priorities(...)`` and keeps
the first class whose ``validate_configuration`` passes. Below sm_90 the list holds the dense
MLA backends (they reject ``use_sparse``) and ``FLASH_ATTN_MLA_SPARSE``, ``FLASHMLA_SPARSE``,
``FLASHINFER_MLA_SPARSE_SM90``, each gated to 9.x/10.x: "No valid attention backend found".

How this backend enters, without touching the selector's gates: vLLM's registry
(``v1/attention/backends/registry.py``) lets a plugin override the class behind an enum member
(``register_backend(AttentionBackendEnum.X, "pkg.Class")``; ``get_class()`` honours it). The
plugin, on sm_8x only, overrides ``OVERRIDDEN_MEMBER`` (the first sparse entry of the sm_8x list,
whose own class cannot run there) with ``AmpereSparseMLABackend``. The selector then validates
our class like any other: it accepts compute capabilities the op table routes to dsv4_ops,
MLA + sparse, head 576, bf16, kv-cache ``auto``/``bfloat16``/``fp8_ds_mla`` (``fp8`` / ``fp8_e4m3``
name fp8_ds_mla, as for vLLM's FLASHMLA_SPARSE: ``canonical_kv_cache_dtype``), block sizes that are
multiples of 64 (the V3.2 indexer cache takes 64), and only the model types audited here
(``deepseek_v32``, ``glm_moe_dsa``); any other model keeps vLLM's answer. ``check_registration``
(run by ``register()`` before anything is patched) raises ``VllmPatchError`` when vLLM's
registry, priority list or sparse-MLA base classes are not what this was written for.

The classes reuse vLLM's sparse-MLA machinery: ``SparseMLACommonMetadataBuilder`` (metadata),
``SparseMLACommonImpl.forward_mqa`` (logical -> physical top-k through the index group,
vLLM's int Triton remap kernel), and implement only ``_forward_mqa_kernel``
(``forward_mqa_kernel`` below) with ``torch.ops.dsv4_ampere.v32_sparse_mla_decode`` /
``v32_sparse_mla_prefill`` (d_qk 576, d_v 512, no sink). The impl has no dense-MHA prefill
(``supports_dense_mha_prefill = False``): every token takes the top-k MQA path, which for a
prompt of <= index_topk tokens attends to every causal key, as the dense path would.

vLLM is imported only when the classes are first used (module ``__getattr__``), so this module
imports on a machine without vLLM.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import envs

BACKEND_NAME = envs.BACKEND_NAME
# The enum member whose class path the plugin overrides on sm_8x (see the module docstring).
OVERRIDDEN_MEMBER = "FLASH_ATTN_MLA_SPARSE"
CLASS_PATH = f"{__name__}.AmpereSparseMLABackend"
MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
# ``--kv-cache-dtype`` names that mean the 656-byte fp8_ds_mla record here, as vLLM's
# ``_canonicalize_sparse_mla_kv_cache_dtype`` maps them for FLASHMLA_SPARSE on sm_90.
KV_CACHE_ALIASES = {"fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla"}
HEAD_SIZE = 576          # kv_lora_rank 512 + qk_rope_head_dim 64 (the absorbed MLA query/key)
KV_LORA_RANK = 512
ROPE_DIM = 64
BLOCK_MULTIPLE = 64
_CLASS_NAMES = ("AmpereSparseMLABackend", "AmpereSparseMLAMetadata", "AmpereSparseMLAMetadataBuilder",
                "AmpereSparseMLAImpl")


# ------------------------------------------------------------------ the kernel step (vLLM-free)

def kv_rows(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache as vLLM's flat rows [num_rows, 1, D] (``sparse_utils.flat_kv_row_view``; row r of
    a block b is ``b * block_stride_rows + offset``), so the physical top-k indices vLLM's remap
    produces are this view's slots with block size 1. D: 656 (fp8_ds_mla, uint8) or 576 (bf16)."""
    if kv_cache.dim() == 4:  # [num_blocks, block_size, 1, D]
        kv_cache = kv_cache.squeeze(2)
    num_blocks, _, d = kv_cache.shape
    if kv_cache.stride(0) % d or kv_cache.stride(2) != 1 or kv_cache.stride(1) != d:
        raise ValueError(f"kv_cache: expected rows of {d} contiguous elements and a block stride that is a whole "
                         f"number of rows, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    stride_rows = kv_cache.stride(0) // d
    num_rows = (num_blocks - 1) * stride_rows + block_size if num_blocks else 0
    return kv_cache.as_strided((num_rows, 1, d), (d, d, 1))


def forward_mqa_kernel(self, q, kv_cache, topk_indices, valid_counts, *, layer, block_size, is_decode):
    """``SparseMLACommonImpl._forward_mqa_kernel`` on sm_8x (same arguments).

    q: (ql_nope bf16 [T, H, 512], q_pe bf16 [T, H, 64]) or bf16 [T, H, 576]; kv_cache: the layer's
    cache (fp8_ds_mla uint8 [num_blocks, block_size, 656] or bf16 [num_blocks, block_size, 576]);
    topk_indices int32 [>= T, K]: physical rows of ``kv_rows`` (-1: none); valid_counts: the
    number of valid entries per row, NOT a prefix length (vLLM's remap leaves -1 gaps in place),
    so it is not passed on: the kernels mask invalid entries themselves. Returns (out bf16
    [T, H, 512], lse fp32 [T, H] natural log when the layer needs it (DCP), else None).
    Scores use ``self.scale`` as the layer passes it (qk_head_dim**-0.5, times mscale**2 with YaRN).
    """
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    if q.shape[-1] != HEAD_SIZE:
        raise ValueError(f"q: expected {HEAD_SIZE} dims (512 latent + 64 RoPE), got {tuple(q.shape)}")
    T = q.shape[0]
    rows = kv_rows(kv_cache, block_size)
    idx = topk_indices[:T]
    scale = float(self.scale)
    if rows.dtype == torch.bfloat16 and not is_decode:
        out, lse = torch.ops.dsv4_ampere.v32_sparse_mla_prefill(q, rows.squeeze(1), idx, None, scale)
    else:
        out, lse = torch.ops.dsv4_ampere.v32_sparse_mla_decode(q, rows, idx, None, scale, 0)
    return out, (lse if getattr(self, "need_to_return_lse_for_decode", False) else None)


def canonical_kv_cache_dtype(original):
    """Builder of the ``mla_attention._canonicalize_sparse_mla_kv_cache_dtype`` patch (wraps=True):
    vLLM maps a quantized ``--kv-cache-dtype`` to ``fp8_ds_mla`` only for FLASHMLA_SPARSE (by
    name); for this backend ``fp8`` / ``fp8_e4m3`` become ``fp8_ds_mla`` too, so
    ``--kv-cache-dtype fp8`` serves V3.2 on sm_8x with the cache it gets on sm_90. Other names
    pass through unchanged (the impl refuses the ones it cannot read, e.g. ``fp8_e5m2``)."""

    def canonicalize(attn_backend, kv_cache_dtype):
        if attn_backend.get_name() == BACKEND_NAME:
            return KV_CACHE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        return original(attn_backend, kv_cache_dtype)

    canonicalize.__wrapped__ = original
    return canonicalize


def supports_capability(major: int, minor: int) -> bool:
    """The capabilities this backend serves: those the op table routes to dsv4_ops (sm_8x, or any
    GPU with DSV4_AMPERE_IMPL forcing the portable/native kernels)."""
    from .. import dispatch

    return bool(dispatch.routes_to_dsv4_ops((int(major), int(minor))))


def combination_reason(head_size: int, kv_cache_dtype: Optional[str]) -> Optional[str]:
    """Why this backend declines the current model (None: accepted). Reads vLLM's current config."""
    if head_size != HEAD_SIZE:
        return f"{BACKEND_NAME} serves head_size {HEAD_SIZE} (DeepSeek-V3.2 MLA), got {head_size}"
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None or cfg.model_config is None:
        return None
    hf = cfg.model_config.hf_text_config
    mt = getattr(hf, "model_type", None)
    if mt not in MODEL_TYPES:
        return f"{BACKEND_NAME} (dsv4_ops) serves model types {MODEL_TYPES}, got {mt!r}"
    dims = (getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None))
    if dims != (KV_LORA_RANK, ROPE_DIM):
        return f"{BACKEND_NAME} needs (kv_lora_rank, qk_rope_head_dim) == ({KV_LORA_RANK}, {ROPE_DIM}), got {dims}"
    if not hasattr(hf, "index_topk"):
        return f"{BACKEND_NAME} needs a DSA model (index_topk)"
    return None


# ------------------------------------------------------------------ the vLLM classes (built lazily)

_BUILT: Dict[str, Any] = {}


def _build() -> Dict[str, Any]:
    if _BUILT:
        return _BUILT
    from dataclasses import dataclass
    from typing import ClassVar

    from vllm.config.cache import CacheDType
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonImpl,
        SparseMLACommonMetadata,
        SparseMLACommonMetadataBuilder,
    )
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, MultipleOf
    from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows

    class AmpereSparseMLABackend(AttentionBackend):
        """Sparse MLA (DeepSeek-V3.2 / GLM-5) on sm_8x through torch.ops.dsv4_ampere (dsv4_ops)."""

        supported_dtypes: ClassVar[List[torch.dtype]] = [torch.bfloat16]
        supported_kv_cache_dtypes: ClassVar[List[CacheDType]] = list(KV_CACHE_DTYPES) + list(KV_CACHE_ALIASES)

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(BLOCK_MULTIPLE)]

        @classmethod
        def customize_spec(cls, spec):
            return align_blocks_to_rows(spec)  # the kernels read the cache as flat rows

        @staticmethod
        def get_name() -> str:
            return BACKEND_NAME

        @staticmethod
        def get_builder_cls():
            return AmpereSparseMLAMetadataBuilder

        @staticmethod
        def get_impl_cls():
            return AmpereSparseMLAImpl

        @classmethod
        def get_supported_head_sizes(cls) -> List[int]:
            return [HEAD_SIZE]

        @classmethod
        def is_mla(cls) -> bool:
            return True

        @classmethod
        def is_sparse(cls) -> bool:
            return True

        @classmethod
        def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
            return supports_capability(capability.major, capability.minor)

        @classmethod
        def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                                 use_mm_prefix, device_capability):
            return combination_reason(head_size, kv_cache_dtype)

    @dataclass
    class AmpereSparseMLAMetadata(SparseMLACommonMetadata):
        pass

    class AmpereSparseMLAMetadataBuilder(SparseMLACommonMetadataBuilder[AmpereSparseMLAMetadata]):
        metadata_cls = AmpereSparseMLAMetadata
        _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            heads = self.model_config.get_num_attention_heads(vllm_config.parallel_config)
            # short extends count as decodes (the top-k kernels take any query length per request)
            self._init_reorder_batch_threshold({16: 128, 32: 128, 64: 256, 128: 256}.get(heads, 256),
                                               supports_spec_as_decode=True)

    class AmpereSparseMLAImpl(SparseMLACommonImpl[AmpereSparseMLAMetadata]):
        supports_dense_mha_prefill = False
        supports_pcp = False
        supports_dcp = False
        can_return_lse_for_decode = False

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                     logits_soft_cap, attn_type, kv_sharing_target_layer_name, topk_indices_buffer=None,
                     indexer=None, **mla_args) -> None:
            if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
                raise NotImplementedError(f"{BACKEND_NAME}: alibi, sliding window and logits soft cap are not "
                                          "part of DeepSeek-V3.2 sparse MLA")
            if kv_cache_dtype not in KV_CACHE_DTYPES:
                raise NotImplementedError(f"{BACKEND_NAME}: kv-cache dtype {kv_cache_dtype!r} not supported; "
                                          f"use one of {KV_CACHE_DTYPES} (or an alias of fp8_ds_mla: "
                                          f"{sorted(KV_CACHE_ALIASES)})")
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                             kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                             indexer=indexer, topk_indices_buffer=topk_indices_buffer, **mla_args)
            if (self.kv_lora_rank, self.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
                raise NotImplementedError(f"{BACKEND_NAME}: needs kv_lora_rank {KV_LORA_RANK} and qk_rope_head_dim "
                                          f"{ROPE_DIM}, got {self.kv_lora_rank}, {self.qk_rope_head_dim}")
            if self.topk_indices_buffer is None:
                raise ValueError(f"{BACKEND_NAME}: sparse MLA needs the indexer's top-k buffer")
            self.supports_quant_query_input = False

        _forward_mqa_kernel = forward_mqa_kernel

    for cls in (AmpereSparseMLABackend, AmpereSparseMLAMetadata, AmpereSparseMLAMetadataBuilder, AmpereSparseMLAImpl):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        _BUILT[cls.__name__] = cls
    return _BUILT


def __getattr__(name: str):
    if name in _CLASS_NAMES:
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ registration (the plugin calls these)

_REQUIRED_OPS = ("v32_sparse_mla_decode", "v32_sparse_mla_prefill", "v32_kv_insert", "indexer_k_insert", "e4m3_encode")
_PROBE_CAPABILITIES = ((8, 0), (8, 6))
_INSTALLED: List[str] = []


def _member(name: str = OVERRIDDEN_MEMBER):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _on_cuda() -> bool:
    """Whether this process's vLLM platform is CUDA (the only selector the override is for)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def check_registration(error, cuda: Optional[bool] = None) -> None:
    """Raise ``error(what)`` (the plugin's VllmPatchError factory) unless vLLM's selector would
    consult the override on sm_8x: the member exists, it is the first sparse entry of the
    MLA priority list for head 576 at sm_80 and sm_86, no one else overrode it, vLLM's
    sparse-MLA base classes have what the classes above use. A process whose platform is not
    CUDA (``cuda`` False; default: asked from vLLM) has no CUDA selector: nothing to check."""
    if not (_on_cuda() if cuda is None else cuda):
        return
    try:
        from vllm.platforms.cuda import _get_backend_priorities
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, _ATTN_OVERRIDES  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise error(f"the attention-backend registry / selector is not importable ({exc})") from exc
    if OVERRIDDEN_MEMBER not in AttentionBackendEnum.__members__:
        raise error(f"AttentionBackendEnum.{OVERRIDDEN_MEMBER} is missing")
    member = _member()
    for cap in _PROBE_CAPABILITIES:
        order = _get_backend_priorities(True, DeviceCapability(*cap), head_size=HEAD_SIZE)
        sparse = [m for m in order if "SPARSE" in m.name]
        if not sparse or sparse[0] is not member:
            raise error(f"the sm_{cap[0]}{cap[1]} sparse-MLA priority list is {[m.name for m in sparse]}; the "
                        f"backend override was written for {OVERRIDDEN_MEMBER} first")
    if member.is_overridden() and member.get_path() != CLASS_PATH:
        raise error(f"AttentionBackendEnum.{OVERRIDDEN_MEMBER} is already overridden by {member.get_path()}")
    try:
        classes = _build()
    except Exception as exc:  # noqa: BLE001
        raise error(f"the sparse-MLA base classes do not import or subclass as expected ({exc})") from exc
    impl = classes["AmpereSparseMLAImpl"]
    import inspect

    got = tuple(inspect.signature(impl.__mro__[1]._forward_mqa_kernel).parameters)
    want = ("self", "q", "kv_cache", "topk_indices", "valid_counts", "layer", "block_size", "is_decode")
    if got != want:
        raise error(f"SparseMLACommonImpl._forward_mqa_kernel has parameters {got}; {BACKEND_NAME} implements {want}")
    unbound = impl_call_mismatch(impl)
    if unbound:
        raise error(f"MLAAttention builds its impl with {unbound}, which {BACKEND_NAME}'s impl (and vLLM's "
                    "SparseMLACommonImpl under it) does not accept")


def impl_call_mismatch(impl) -> str:
    """'' when the keywords MLAAttention.__init__ passes to ``impl_cls(...)`` (read from its source)
    bind to ``impl.__init__`` and, minus the ones it consumes, to SparseMLACommonImpl.__init__;
    else what does not bind."""
    import ast
    import inspect
    import textwrap

    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    tree = ast.parse(textwrap.dedent(inspect.getsource(MLAAttention.__init__)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "impl_cls"]
    if len(calls) != 1 or calls[0].args:
        return f"{len(calls)} impl_cls(...) calls (expected one, keywords only)"
    names = [k.arg for k in calls[0].keywords if k.arg]
    extra = [k for k in calls[0].keywords if k.arg is None]  # **extra_impl_args
    # what **extra_impl_args carries for a sparse layer (mla_attention.py: topk_indices_buffer, index_group_builder)
    kwargs = dict.fromkeys(names + (["topk_indices_buffer", "index_group_builder"] if extra else []))
    try:
        inspect.signature(impl.__init__).bind(None, **kwargs)
        base = {k: v for k, v in kwargs.items() if k not in ("topk_indices_buffer", "indexer")}
        inspect.signature(impl.__mro__[1].__init__).bind(None, **base, indexer=None, topk_indices_buffer=None)
    except TypeError as exc:
        return f"keywords {sorted(kwargs)} ({exc})"
    return ""


def missing_ops() -> List[str]:
    """The dsv4_ampere ops this backend and ``v32_model`` call that this install lacks."""
    from dsv4_ops.registration import op_exists

    return [op for op in _REQUIRED_OPS if not op_exists(op)]


def install() -> List[str]:
    """Override ``AttentionBackendEnum.<OVERRIDDEN_MEMBER>`` with this backend (idempotent).
    Returns the names registered now (for the plugin's log line). Without the V3.2 ops
    (``missing_ops()``) nothing is registered and vLLM keeps its own answer for V3.2 ("No valid
    attention backend"), which is a refusal, not a wrong result. Off CUDA (the CPU platform, the
    end-to-end CPU tests) there is no CUDA selector to offer it to: nothing is registered."""
    if _INSTALLED or missing_ops() or not _on_cuda():
        return []
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(_member(), CLASS_PATH)
    _INSTALLED.append(OVERRIDDEN_MEMBER)
    return [f"AttentionBackendEnum.{OVERRIDDEN_MEMBER}->{BACKEND_NAME}"]


def uninstall() -> None:
    """Drop the override (tests; the plugin's ``unpatch``)."""
    if not _INSTALLED:
        return
    member = _member()
    if member.is_overridden() and member.get_path() == CLASS_PATH:
        member.clear_override()
    _INSTALLED.clear()


def installed() -> Tuple[str, ...]:
    return tuple(_INSTALLED)
