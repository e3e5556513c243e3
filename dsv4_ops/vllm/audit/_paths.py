"""What is on the default NVIDIA serve path (TP=8, PP=1, no MTP), as data with reasons.

Status is never decided here: these lists only say which code a default ``vllm serve`` of
DeepSeek-V4/V4.1-Flash cannot reach on sm_8x (another platform, an opt-in feature, an sm_100
format). A kernel or module that is not named here is on the path, so a new kernel in a new
vLLM shows up in the audit by itself. The scope these lists prune (roots, followed packages,
registry architectures, modules off the path) is ``dsv4_ops.vllm.serve_graph._scope``, which the
runtime reads too.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ..serve_graph import _scope
from ..serve_graph._scope import V32_FAMILY

# Class-graph roots besides the registry class: the sparse-MLA base classes of the backend the
# selector instantiates by class path on sm_8x (dsv4_ops.vllm.v32_backend subclasses them; the
# selector's string path is not a name the graph can follow).
_SMA = "vllm.model_executor.layers.attention.sparse_mla_attention"
EXTRA_ROOT_NODES = {m: ((_SMA, "SparseMLACommonImpl"), (_SMA, "SparseMLACommonMetadataBuilder"),
                        (_SMA, "SparseMLACommonMetadata")) for m in V32_FAMILY}

# Classes a reached class names but never builds on this path, each with the source that shows
# it: (node, module, regexes that must match its source, why). A cut that no longer matches is
# not applied (the class is followed again).
_V2 = "vllm.model_executor.models.deepseek_v2"
_REACH_CUTS = {m: (
    ((_V2, "DeepseekV2Model"), _V2,
     (r"class DeepseekV2ForCausalLM\b.*?\n    model_cls = DeepseekV2Model\n",
      r"self\.model = self\.model_cls\("),
     "DeepseekV2ForCausalLM builds self.model_cls(...), and DeepseekV32ForCausalLM sets model_cls = "
     "DeepseekV32Model (deepseek_v32/nvidia/model.py)"),
    ((_V2, "DeepseekV2DecoderLayer"), _V2,
     (r"\n            assert isinstance\(layer, DeepseekV2DecoderLayer\)\n",
      r"lambda prefix: DeepseekV2DecoderLayer\("),
     "built by DeepseekV2Model only (cut above); DeepseekV2ForCausalLM.set_moe_parameters names it in an isinstance "
     "assert, and DeepseekV32ForCausalLM overrides set_moe_parameters (keyed on DeepseekV2MoE)"),
) for m in V32_FAMILY}
_V32_MODEL_SRC = ("vllm.models.deepseek_v32.nvidia.model", (r"class DeepseekV32ForCausalLM\(DeepseekV2ForCausalLM\):",
                                                           r"\n    model_cls = DeepseekV32Model\n",
                                                           r"\n    def set_moe_parameters\(self\):\n"))


def reach_cuts(model: str):
    """The class-graph nodes not entered for ``model`` (their source checks must still hold)."""
    out = []
    for node, module, regexes, _why in _REACH_CUTS.get(model, ()):
        if _source_matches(module, regexes) and _source_matches(*_V32_MODEL_SRC):
            out.append(node)
    return out


# Reported, not enforced: speculative-decoding heads (module suffix under <model>.nvidia).
EXTRA_PATHS = {"v4": {"mtp": (".mtp",), "dspark": (".dspark",)}, "v41": {"dspark": (".dspark",), "mtp": (".mtp",)},
               "v32": {"mtp": (".mtp",)}, "glm5": {"mtp": (".mtp",)}}

# Kernel (or function) names that only run for a cache/weight format or feature sm_8x never gets.
_OFF_PATH_NAMES: Tuple[Tuple[str, str], ...] = (
    (r"(?i)mxfp4|fp4x2|nvfp4|_fp4_(?!mqa|paged)", "MXFP4/NVFP4 indexer or KV cache: sm_100 only (dsa_indexer_uses_fp4)"),
    (r"(?i)mxfp8", "MXFP8 activations/KV: needs FlashInfer MXFP8 (sm_100)"),
    (r"(?i)flashinfer", "FlashInfer sparse-MLA metadata: sm_100 backend"),
    (r"(?i)(^|_)dcp_|_cp_|cp_out|ATTN_CP", "context parallelism: not the default serve"),
    (r"(?i)dspark_noncausal", "DSpark drafting only"),
    (r"(?i)sparse_mqa|expand_candidates|sparse_topk_remap", "SparseMQAIndexer: opt-in indexer_sparse_logits, MXFP4 cache (sm_100)"),
    (r"(?i)fused_wo_a", "fused WO-A o_proj: sm_100 only"),
    (r"^forward_(cpu|hip|xpu|tpu)$", "CustomOp platform method: vLLM dispatches forward_cuda on NVIDIA"),
)


# Off the NVIDIA path because of a branch in vLLM's source, each with the source patterns that
# show it: (name pattern, ((module, patterns), ...), why). A pattern is a regex that must match the
# module's source, or (regex, n): it must match exactly n times (every call site is accounted for).
# When vLLM changes the branch, a pattern stops matching and the kernels are audited again.
_SAI = "vllm.model_executor.layers.sparse_attn_indexer"
_OFF_PATH_CHECKED: Tuple[Tuple[str, Tuple[Tuple[str, tuple], ...], str], ...] = (
    (r"^(_compress_gather_split_sparse_attn|_finalize_norm_rope_quant_store_sparse_attn|"
     r"_launch_two_stage_sparse_attn_compressor|compress_norm_rope_store_two_stage_triton)$",
     (("vllm.models.deepseek_v4.compressor",
       (r"if current_platform\.is_cuda\(\) and self\.head_dim == 512:(?:(?!\n        else:).)*?"
        r"\n        elif self\._use_two_stage_fused_compressor:",
        r"self\._use_two_stage_fused_compressor = \(\s*_prefer_two_stage_compressor\(\) and head_dim == 512")),),
     "two-stage Triton compressor: DeepseekCompressor picks it only in the `elif` after "
     "`if current_platform.is_cuda() and self.head_dim == 512` (CuTeDSL), and it requires head_dim == 512: "
     "never on NVIDIA (deepseek_v4/compressor.py)"),
    # vLLM 0.34: the direct (symmetric-memory) DCP top-k merge.
    (r"^(_push_candidates_kernel|DirectDCPTopKWorkspace|get_direct_dcp_topk_workspace)$",
     (("vllm.model_executor.kernels.attention.dsa.dcp_topk_direct",
       ((r"\b_push_candidates_kernel\[", 1), (r"(?<!class )\bDirectDCPTopKWorkspace\(", 1),
        r"\ndef get_direct_dcp_topk_workspace\(")),
      (_SAI,
       ((r"\b_get_direct_dcp_topk_workspace\(", 3),  # its def and the two calls below
        (r"\bget_direct_dcp_topk_workspace\b", 2),    # the import inside it and its call
        r"\ndef _merge_dcp_topk_global\((?:(?!\ndef ).)*?\n    if dcp_world_size <= 1:\n        return\n"
        r"(?:(?!\ndef ).)*?workspace = _get_direct_dcp_topk_workspace\(",
        r"\n        self\.dcp_world_size = parallel_config\.decode_context_parallel_size\n",
        r"\n        if \(\n            self\.dcp_world_size > 1\n(?:            and [^\n]+\n)+        \):\n"
        r"(?:(?!\n        if ).)*?workspace = _get_direct_dcp_topk_workspace\(")),
      ("vllm.config.parallel", (r"\n    decode_context_parallel_size: int = (?:1|Field\(default=1,[^\n]*)\n",))),
     "direct DCP top-k merge (symmetric-memory candidate exchange): DirectDCPTopKWorkspace is built only by "
     "get_direct_dcp_topk_workspace, called only through _get_direct_dcp_topk_workspace, whose two callers "
     "(SparseAttnIndexer.__init__ and _merge_dcp_topk_global) run it only when the decode context parallel "
     "size is > 1 (default 1: vllm/config/parallel.py; model_executor/layers/sparse_attn_indexer.py, "
     "kernels/attention/dsa/dcp_topk_direct.py)"),
)


@dataclass(frozen=True)
class PerRelease:
    """A pattern that differs between vLLM releases: ((Releases, pattern), ...); the audit reads
    the one recorded for the release whose evidence applies (``_scope.evidence_release``)."""

    choices: Tuple[Tuple[_scope.Releases, Any], ...]

    def pick(self):
        return _scope.for_release(dict(self.choices))


def _source_matches(module: str, patterns: tuple) -> bool:
    """Whether every pattern holds in ``module``'s source: a regex matches, or a (regex, n) pair
    matches exactly n times; a ``PerRelease`` pattern is the one of the audited release."""
    return _matches(module, tuple(p.pick() if isinstance(p, PerRelease) else p for p in patterns))


@functools.lru_cache(maxsize=None)
def _matches(module: str, patterns: tuple) -> bool:
    from ..serve_graph import _source

    path = _source.module_path(module)
    if not path:
        return False
    text = open(path).read()
    return all(len(re.findall(p[0], text, re.S)) == p[1] if isinstance(p, tuple) else re.search(p, text, re.S)
               for p in patterns)


# Per model, as _OFF_PATH_CHECKED: (name pattern, ((module, regexes), ...), why).
_IDX = "vllm.v1.attention.backends.mla.indexer"
_OFF_PATH_CHECKED_BY_MODEL = {m: (
    (r"^(_COMPRESSED_SLOT_MAPPING_KERNEL|get_compressed_slot_mapping)$",
     ((_IDX, (r"self\.compress_ratio = 1\n\s*if isinstance\(self\.kv_cache_spec, MLAAttentionSpec\):\n\s*"
              r"assert isinstance\(self\.kv_cache_spec\.tokens_per_state, int\)\n\s*"
              r"self\.compress_ratio = self\.kv_cache_spec\.tokens_per_state",
              r"if self\.compress_ratio > 1:\n {12}padded_num_tokens = num_tokens\n",
              r"\n {12}compressed_slot_mapping = get_compressed_slot_mapping\(",
              r"if self\.compress_ratio > 1:\n\s*get_compressed_slot_mapping\(")),
      (_V2, (r"return MLAAttentionSpec\(\n {12}block_size=self\.cache_config\.block_size,"
             r"\n {12}num_kv_heads=1,\n {12}max_tp_shards=1,\n {12}head_size=self\.head_dim,\n {12}dtype=self\.dtype,"
             r"\n {12}cache_role=SparseCacheRole\.INDEXER,\n {8}\)  # Only has one vector",)),
      ("vllm.v1.kv_cache_interface", (r"\n    tokens_per_state: int \| Fraction = 1\n",))),
     "compressed (V4) indexer slot mapping: DeepseekV32IndexerMetadataBuilder calls it only when "
     "compress_ratio > 1, and compress_ratio = the indexer spec's tokens_per_state, which DeepseekV32IndexerCache "
     "leaves at its default 1 (v1/attention/backends/mla/indexer.py, deepseek_v2.py, v1/kv_cache_interface.py)"),
    (r"^(forward_impl|_v_up_proj|forward_mha|_compute_context_mha|_run_masked_mha|_try_build_global_mask|"
     r"_build_topk_mask|_scatter_topk_kernel|_scatter_topk_single_req_kernel)$",
     (("dsv4_ops.vllm.v32_backend", (r"\n        supports_dense_mha_prefill = False\n",)),
      ("vllm.model_executor.layers.attention.mla_attention",
       (r"if self\.impl\.is_sparse and not \(\n\s*self\.impl\.supports_dense_mha_prefill and "
        r"self\.supports_dense_mha_prefill\n\s*\):\n(?:[^\n]*\n){0,5}?\s*self\.prefill_backend = None\n",
        PerRelease((
            (_scope.until("0.33.0"),
             r"def _use_sparse_mha\(self, attn_metadata: \"MLACommonMetadata\"\) -> bool:\n\s*if self\.hisparse_cache "
             r"is not None:\n\s*return False\n\s*prefill = attn_metadata\.prefill\n\s*if prefill is None:\n"
             r"\s*return False\n"),
            # 0.34: a ShardQ step returns False before the prefill check (SparseMLACommonImpl.supports_shardq is False)
            (_scope.since("0.34.0"),
             r"def _use_sparse_mha\(self, attn_metadata: \"MLACommonMetadata\"\) -> bool:\n\s*if self\.hisparse_cache "
             r"is not None:\n\s*return False\n\s*# ShardQ[^\n]*\n\s*if getattr\(attn_metadata, \"shardq\", None\) "
             r"is not None:\n\s*return False\n\s*prefill = attn_metadata\.prefill\n\s*if prefill is None:\n"
             r"\s*return False\n"),
        )))),
      (_SMA, (r"layer_prefill_backend\.clone\(\) if layer_prefill_backend is not None else None",
              r"if num_prefills > 0 and self\._prefill_backend is not None:")),
      ("vllm.models.deepseek_v32.attention",
       (r"\n        if self\._use_sparse_mha\(attn_metadata\):\n(?:[^\n]*\n){0,9}?\s*self\.forward_impl\(",))),
     "dense/masked-MHA prefill (MLAAttention.forward_impl -> impl.forward_mha): dsv4_ops' sm_8x backend sets "
     "supports_dense_mha_prefill = False, so MLAAttention keeps prefill_backend None, the sparse-MLA builder "
     "builds no prefill metadata, _use_sparse_mha returns False, and DeepseekV32Attention calls forward_impl "
     "only under `if self._use_sparse_mha(...)`: every token takes the top-k MQA path"),
) for m in V32_FAMILY}


# Library calls inside a function that only runs under a guard never taken on sm_8x, with the
# source that shows it: (module, function, ((module, regexes), ...), why). The row stays, as
# "off" with the guard as evidence; a regex that stops matching puts the call back to its own
# evidence.
_V41 = "vllm.models.deepseek_v41.nvidia"
_GUARDED_OFF = (
    (f"{_V41}.ops.mhc", "mhc_pre_delayed_overlap",
     ((f"{_V41}.ops.mhc", (r"def supports_mhc_overlap\(vllm_config: VllmConfig\) -> bool:(?:(?!\ndef ).)*?"
                           r"return \(\n\s*current_platform\.is_device_capability_family\(100\)\n\s*and ",
                           r"\n    if stream is not None:\n(?:(?!\ndef ).)*?pre_outputs = mhc_pre_delayed_overlap\(")),
      (f"{_V41}.model", (r"mhc_stream = torch\.cuda\.Stream\(\) if supports_mhc_overlap\(vllm_config\) else None",
                         r"partial\(mhc_pre_delayed_overlap, stream=mhc_stream\)\n\s*if mhc_stream is not None\n"))),
     "the mHC overlap path: mhc_pre_delayed_overlap is called only with the mHC side stream "
     "(DeepseekV41DecoderLayer: partial(mhc_pre_delayed_overlap, stream=mhc_stream) if mhc_stream is not None; "
     "mhc_shifted_post_pre: under `if stream is not None`), and the model builds that stream only when "
     "supports_mhc_overlap(), which requires is_device_capability_family(100) (deepseek_v41/nvidia/model.py, "
     "ops/mhc.py)"),
)


def guarded_off(module: str, func: str) -> Optional[str]:
    """Why a call inside ``module:func`` is never reached on sm_8x (its checks hold), or None."""
    for mod, fname, checks, why in _GUARDED_OFF:
        if module == mod and func.split(".")[0] == fname and all(_source_matches(m, rx) for m, rx in checks):
            return why
    return None


def off_path(name: str) -> Optional[str]:
    """Why ``name`` is never reached on the default sm_8x serve path, or None."""
    for pattern, why in _OFF_PATH_NAMES:
        if re.search(pattern, name):
            return why
    for pattern, checks, why in _OFF_PATH_CHECKED:
        if re.search(pattern, name) and all(_source_matches(m, rx) for m, rx in checks):
            return why
    for pattern, checks, why in _OFF_PATH_CHECKED_BY_MODEL.get(_scope.CURRENT_MODEL, ()):
        if re.search(pattern, name) and all(_source_matches(m, rx) for m, rx in checks):
            return why
    return None


# Values a layer passes to ``register_warmup`` from its own attributes (``head_dim=self.head_dim``),
# per model: every value the default serve path's layers take (main compressor head 512, V4
# indexer compressor head 128; V4 ratios 4/128, V4.1 ratios 1/2; SWA window 128, block 256 (V4) / 128 (V4.1 on sm_8x)).
# mHC (TileLang) registrations read the decoder layer: hidden size, hc_mult 4, eps values of the
# public configs (rms 1e-6, hc_eps 1e-6, 20 Sinkhorn iterations, hc_post_alpha 2.0 hard-coded in
# vLLM); include_pre_gemm_splits = is_deep_gemm_supported() (False on sm_8x); the broadcast
# splits only on layer 0 of the first pipeline rank (both values occur).
_MHC = {"hc_mult": (4,), "rms_eps": (1e-6,), "hc_eps": (1e-6,), "hc_pre_eps": (1e-6,), "hc_sinkhorn_eps": (1e-6,),
        "hc_post_mult_value": (2.0,), "sinkhorn_repeat": (20,), "norm_eps": ((1e-6, 1e-6),),
        "broadcast_norm_eps": (1e-6,), "include_pre_gemm_splits": (False,), "include_broadcast_splits": (True, False),
        "n_out": (24,)}
LAYER_VALUES = {
    "v4": dict(_MHC, head_dim=(512, 128), compress_ratio=(4, 128), window_size=(128,), block_size=(256,),
               hidden_size=(4096,)),
    # V4.1 from 0.34: _pad_interleaved_q registers only when 32 live heads pad to 64 (its power-of-two
    # chunk widths; deepseek_v41/attention.py `_pads_q_by_copy`), in the model dtype (bf16)
    "v41": dict(_MHC, head_dim=(512,), compress_ratio=(1, 2), window_size=(128,), block_size=(128,),
                hidden_size=(5120,), live_heads=(32,), padded_heads=(64,), dtype=(torch.bfloat16,)),
    # V3.2 / GLM-5: 64-token blocks, rows aligned to the block (customize_spec -> align_blocks_to_rows)
    "v32": dict(block_size=(64,), block_stride_rows=(64,), hidden_size=(7168,)),
    "glm5": dict(block_size=(64,), block_stride_rows=(64,), hidden_size=(6144,)),
}

TILELANG_NOTE = ("TileLang: not compiled for sm_8x here (a CPU-side TileLang build for sm_80 was not "
                 "established within the audit's time budget); treated as unknown until it is run or replaced")

_FP8 = re.compile(r"float8e4nv|fp8e4nv|float8_e4m3fn")


def bare_status(name: str, obj, arch: int) -> Tuple[str, str]:
    """Status of a @triton.jit kernel with no vLLM warmup owner (so no launch arguments to
    compile with): dead when its source (or a jit helper it calls) names the E4M3 type that
    Triton rejects below sm_89, else unknown."""
    from triton.runtime.jit import JITFunction

    fn = obj
    while fn is not None and not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)
    if fn is None:
        return "unknown", "not a JITFunction"
    srcs = [(name, fn.src)]
    for gname, g in fn.fn.__globals__.items():
        if isinstance(g, JITFunction) and re.search(rf"\b{re.escape(gname)}\(", fn.src):
            srcs.append((gname, g.src))
    for where, src in srcs:
        m = _FP8.search(src)
        if m and arch < 89:
            return "dead", (f"source of {where} uses {m.group(0)}; Triton has no fp8e4nv below sm_89 "
                            f"({probe_fp8(arch)})")
    return "unknown", "bare @triton.jit without a vLLM warmup owner: launch dtypes/constexprs not derivable"


_PROBE = {}


def probe_fp8(arch: int) -> str:
    """Compile a one-line kernel storing tl.float8e4nv for sm_<arch>; the compiler's verdict."""
    if arch in _PROBE:
        return _PROBE[arch]
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _probe(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr).to(tl.float8e4nv))

    try:
        triton.compile(ASTSource(_probe, {"x_ptr": "*fp32", "y_ptr": "*fp8e4nv"}, {}),
                       target=GPUTarget("cuda", arch, 32))
        _PROBE[arch] = f"probe: an fp8e4nv store compiles for sm_{arch}"
    except Exception as exc:  # noqa: BLE001
        lines = str(exc.__cause__ or exc).splitlines()
        msg = [ln for ln in lines if "not supported" in ln] or [ln for ln in lines if "fp8" in ln]
        _PROBE[arch] = f"probe for sm_{arch}: {(msg[-1] if msg else type(exc).__name__).strip()[:120]}"
    return _PROBE[arch]
