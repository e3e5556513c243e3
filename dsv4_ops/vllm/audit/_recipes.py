"""Launch recipes: the inputs (argument types, constexprs, launch options) of bare
``@triton.jit`` kernels that have no vLLM warmup owner, read by hand from their vLLM launch site.

A recipe never decides a status: the audit compiles the kernel with it for the target arch
(``aot.compile_spec``), and the compile is the evidence. Each recipe records the launch site it
was read from and a hash of the kernel's source; when vLLM changes the kernel, the hash no longer
matches and the row goes back to unknown ("stale recipe") instead of trusting old inputs.

``sig``: every non-constexpr parameter -> Triton type ('*fp32', '*i32', 'i32', ...); a pointer
that the launch site may pass as ``None`` has a variant with it as a None constexpr.
``consts``: constexpr parameters -> value. Scalars the launch site passes as Python ints are 'i32'.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Recipe:
    kernel: str                    # module.name of the @triton.jit function
    site: str                      # vllm/<file>:<line> of the launch read
    src_sha: str                   # first 16 hex of sha256 of the kernel's `def ...` source
    variants: Tuple[Tuple[Dict[str, str], Dict[str, object]], ...]
    num_warps: int = 4
    num_stages: int = 3
    note: str = ""


def _v(sig: Dict[str, str], consts: Dict[str, object]):
    return (sig, consts)


_CB = "vllm.model_executor.kernels.attention.dsa.candidate_blocks"
# V4.1 candidate selection: block_size = candidate_block_size (64), topk_blocks = candidate_topk_blocks
# (64), row_repeat 1; FULL_WIDTH = not use_deep_select, and DeepSelect is unsupported on sm_8x.
_SCORES = {"logits": "*fp32", "ends": "*i32", "scores": "*fp32", "valid_blocks": "*i32", "stride_row": "i32",
           "stride_col": "i32", "stride_start": "i32", "stride_end": "i32", "stride_scores": "i32",
           "width": "i32", "nblocks": "i32"}
_MASK = {"logits": "*fp32", "ends": "*i32", "flags": "*u8", "stride_row": "i32", "stride_col": "i32",
         "stride_start": "i32", "stride_end": "i32", "width": "i32", "nblocks": "i32"}
_FLAGS = {"candidates": "*i32", "flags": "*u8", "stride_row": "i32", "stride_col": "i32", "stride_start": "i32",
          "width": "i32", "nblocks": "i32"}

RECIPES: Tuple[Recipe, ...] = (
    Recipe(f"{_CB}._block_scores_kernel", "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py:194",
           "3da93b17b7383613",
           (_v(dict(_SCORES, starts="*i32"), dict(BLOCK_SIZE=64, HAS_STARTS=True, ROW_REPEAT=1, TILE=128,
                                                    FULL_WIDTH=True)),
            _v(dict(_SCORES, starts="constexpr"), dict(starts=None, BLOCK_SIZE=64, HAS_STARTS=False, ROW_REPEAT=1,
                                                         TILE=128, FULL_WIDTH=True)))),
    Recipe(f"{_CB}._store_candidates_kernel", "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py:217",
           "adddd6e63d4c5cfe",
           (_v({"values": "*fp32", "indices": "*i64", "output": "*i32", "out_stride_row": "i32",
                "out_stride_col": "i32", "k": "i32"}, dict(OUT_K=64, TILE=256)),)),
    Recipe(f"{_CB}._candidate_flags_kernel", "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py:244",
           "9660e12640bb4ed6",
           (_v(dict(_FLAGS, starts="*i32"), dict(BLOCK_SIZE=64, K=64, HAS_STARTS=True, ROW_REPEAT=1)),
            _v(dict(_FLAGS, starts="constexpr"), dict(starts=None, BLOCK_SIZE=64, K=64, HAS_STARTS=False,
                                                        ROW_REPEAT=1)))),
    Recipe(f"{_CB}._mask_candidates_kernel", "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py:257",
           "464db2ee78eb5b74",
           (_v(dict(_MASK, starts="*i32"), dict(BLOCK_SIZE=64, HAS_STARTS=True, ROW_REPEAT=1, TILE=1024)),
            _v(dict(_MASK, starts="constexpr"), dict(starts=None, BLOCK_SIZE=64, HAS_STARTS=False, ROW_REPEAT=1,
                                                       TILE=1024)))),
    Recipe("vllm.model_executor.layers.sparse_attn_indexer._upcast_logits_kernel",
           "vllm/model_executor/layers/sparse_attn_indexer.py:320", "849e523d0a7526fe",
           (_v({"src_ptr": "*bf16", "dst_ptr": "*fp32", "row_ends_ptr": "*i32", "stride": "i32"},
               dict(BLOCK=1024)),),
           note="bf16 logits only (fp32 logits return before the launch)"),
    Recipe("vllm.models.deepseek_v4.attention._fill_short_context_topk_indices",
           "vllm/models/deepseek_v4/attention.py:1135", "93e41bcb2e8e265c",
           (_v({"output": "*i32", "positions": "*i64"}, dict(TOP_K=512, COMPRESS_RATIO=4, PADDED_TOP_K=512)),),
           num_warps=8),
    Recipe("vllm.models.deepseek_v41.attention._fill_short_context_topk_indices",
           "vllm/models/deepseek_v41/attention.py:1574", "93e41bcb2e8e265c",
           (_v({"output": "*i32", "positions": "*i64"}, dict(TOP_K=512, COMPRESS_RATIO=1, PADDED_TOP_K=512)),
            _v({"output": "*i32", "positions": "*i64"}, dict(TOP_K=512, COMPRESS_RATIO=2, PADDED_TOP_K=512))),
           num_warps=8),
    Recipe("vllm.v1.attention.backends.mla.indexer._kpool_tail_slot_mapping_kernel",
           "vllm/v1/attention/backends/mla/indexer.py:812", "29f1ae21c754db8d",
           (_v({"slot_mapping_ptr": "*i64", "block_table_ptr": "*i32", "block_table_stride": "i32",
                "query_start_loc_ptr": "*i32", "positions_ptr": "*i64", "out_ptr": "*i64", "num_reqs": "i32",
                "num_actual_tokens": "i32", "num_tokens": "i32", "kpool": "i32"}, dict(BLOCK=256)),)),
    Recipe("vllm.v1.attention.backends.mla.sparse_swa._compute_image_visibility_kernel",
           "vllm/v1/attention/backends/mla/sparse_swa.py:824", "ee1773833e2a28ec",
           (_v({"left_visible_ptr": "*i32", "right_visible_ptr": "*i32", "span_indptr_ptr": "*i32",
                "span_starts_ptr": "*i32", "span_ends_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "seq_lens_ptr": "*i32", "token_to_req_indices_ptr": "*i32", "max_image_tokens": "i32",
                "token_offset": "i32"}, {}),),
           note="int32 buffers allocated in DeepseekSparseSWAMetadataBuilder.__init__ (sparse_swa.py:504-556)"),
    # mHC Triton helpers: x bf16 [T, hc_mult=4, H], FP32 pre-mix (hc_collapse_triton asserts both).
    Recipe("vllm.model_executor.kernels.mhc.triton._hc_head_reduce_store_kernel",
           "vllm/model_executor/kernels/mhc/triton.py:119", "6ad87372b54a1ea6",
           tuple(_v({"pre_ptr": "*fp32", "x_ptr": "*bf16", "out_ptr": "*bf16"},
                    dict(hidden_size=h, hc_mult=4, pre_stride_t=4, pre_stride_m=1, x_stride_t=4 * h, x_stride_m=h,
                         x_stride_h=1, out_stride_t=h, out_stride_h=1, BLOCK_H=1024)) for h in (4096, 5120))),
    Recipe("vllm.model_executor.kernels.mhc.triton._mhc_pre_mix_kernel",
           "vllm/model_executor/kernels/mhc/triton.py:225", "99c18afd0c82d30f",
           (_v({"gemm_ptr": "*fp32", "sqrsum_ptr": "*fp32", "hc_scale_ptr": "*fp32", "hc_base_ptr": "*fp32",
                "out_ptr": "*fp32", "splitk": "i32", "gemm_stride_k": "i32", "gemm_stride_t": "i32",
                "gemm_stride_j": "i32", "sqrsum_stride_k": "i32", "sqrsum_stride_t": "i32", "out_stride_t": "i32",
                "out_stride_j": "i32", "inv_hc_hidden": "fp32", "rms_eps": "fp32", "hc_pre_eps": "fp32"},
               dict(hc_mult=4, SPLITK_BLOCK=16, HC_BLOCK=4)),),
           num_warps=1, note="gemm_out/sqrsum asserted float32 (triton.py:214-215)"),
    Recipe("vllm.model_executor.kernels.mhc.triton._rmsnorm_nw_kernel",
           "vllm/model_executor/kernels/mhc/triton.py:53", "508c0e8ce6bb979a",
           (_v({"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_row": "i32", "D": "i32", "eps": "fp32"},
               dict(RBLOCK=8192)),),
           num_warps=8, note="RBLOCK = next_power_of_2(hidden 5120) -> 8 warps"),
    Recipe("vllm.models.deepseek_v41.common.ops.query_quant._q_kv_norm_quant_kernel",
           "vllm/models/deepseek_v41/common/ops/query_quant.py:113", "7a822f770affd614",
           (_v({"q": "*bf16", "kv": "*bf16", "qw": "*bf16", "kvw": "*bf16", "qo": "*fp8e4nv", "kvo": "*bf16",
                "scales": "*u8", "num_tokens": "i32", "q_stride": "i32", "kv_stride": "i32", "eps": "fp32"},
               dict(Q_SIZE=1280, KV_SIZE=512, BLOCK=2048, LAUNCH_PDL=False)),),
           num_warps=8, note="qo = torch.empty(..., dtype=torch.float8_e4m3fn) (query_quant.py:103)"),
    Recipe("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache._save_ring_rows_kernel",
           "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py:251", "225b1ad86cec3ae6",
           (_v({"rows": "*fp32", "slot_mapping": "*i64", "state": "*fp32"},
               dict(ROW_STRIDE=1024, STATE_STRIDE=4096, STATE_ROW_STRIDE=1024, STATE_BLOCK=4)),),
           note="rows asserted float32 [N, 1024]; ring of 4 rows is a representative STATE_BLOCK"),
    Recipe("vllm.models.deepseek_v41.compressor._ring_slot_mapping_kernel",
           "vllm/models/deepseek_v41/compressor.py:133", "65421354e7131c75",
           (_v({"slot_mapping_ptr": "*i64", "block_table_ptr": "*i32", "block_table_stride": "i32",
                "token_to_req_ptr": "*i32", "positions_ptr": "*i64", "num_actual_tokens": "i32", "num_tokens": "i32"},
               dict(CAPACITY=4, BLOCK=256)),),
           note="CAPACITY = the ring spec's block_size (representative 4)"),
)

BY_KERNEL = {r.kernel: r for r in RECIPES}


def source_sha(jit) -> Optional[str]:
    """sha256 (16 hex) of the kernel's ``def`` source as it is in its file (decorators excluded)."""
    fn = getattr(jit, "fn", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    try:
        text = open(code.co_filename).read()
    except OSError:
        return None
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == fn.__name__:
            seg = ast.get_source_segment(text, node) or ""
            return hashlib.sha256(seg.encode()).hexdigest()[:16]
    return None


def specs_for(key: str, jit) -> Tuple[List, str]:
    """(KernelSpecs, note) for the kernel ``key`` (module.name); no specs when there is no recipe
    or its hash is stale (the note says which)."""
    from ... import aot

    r = BY_KERNEL.get(key)
    if r is None:
        return [], ""
    sha = source_sha(jit)
    if sha != r.src_sha:
        return [], (f"launch recipe ({r.site}) is stale: kernel source hash {sha} != recorded {r.src_sha}; "
                    "re-read the launch site and update dsv4_ops/vllm/audit/_recipes.py")
    name = key.rsplit(".", 1)[-1]
    specs = []
    for sig, consts in r.variants:
        given = dict(sig, **{k: "constexpr" for k in consts})
        missing = [a for a in jit.arg_names if a not in given]
        if missing:
            return [], f"launch recipe ({r.site}) does not type {', '.join(missing)}"
        full = {a: given[a] for a in jit.arg_names}  # parameter order
        specs.append(aot.KernelSpec(name, name, jit, full, dict(consts), "vllm", r.num_warps, r.num_stages))
    return specs, f"{len(specs)} launch variant(s) from the recipe read at {r.site}" + (f" ({r.note})" if r.note else "")
