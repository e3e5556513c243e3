"""Launch recipes: the inputs (argument types, constexprs, launch options) of bare
``@triton.jit`` kernels that have no vLLM warmup owner, read by hand from their vLLM launch site.

A recipe never decides a status: the audit compiles the kernel with it for the target arch
(``aot.compile_spec``), and the compile is the evidence. Each recipe records the launch site it
was read from and a hash of the kernel's source; when vLLM changes the kernel, the hash no longer
matches and the row goes back to unknown ("stale recipe") instead of trusting old inputs. A recipe
holds for the vLLM releases it was read from (``releases``); the audit uses those of the release
whose evidence applies (``serve_graph._scope.evidence_release``).

``sig``: every non-constexpr parameter -> Triton type ('*fp32', '*i32', 'i32', ...); a pointer
that the launch site may pass as ``None`` has a variant with it as a None constexpr.
``consts``: constexpr parameters -> value. Scalars the launch site passes as Python ints are 'i32'.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..serve_graph._scope import ANY, Releases, evidence_release, since, until


@dataclass(frozen=True)
class Recipe:
    kernel: str                    # module.name of the @triton.jit function
    site: str                      # vllm/<file>:<line> of the launch read
    src_sha: str                   # first 16 hex of sha256 of the kernel's `def ...` source
    variants: Tuple[Tuple[Dict[str, str], Dict[str, object]], ...]
    num_warps: int = 4
    num_stages: int = 3
    note: str = ""
    releases: Releases = ANY       # the vLLM releases it was read from


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
           num_warps=8, releases=until("0.33.0")),
    Recipe("vllm.models.deepseek_v41.attention._fill_short_context_topk_indices",
           "vllm/models/deepseek_v41/attention.py:1574", "93e41bcb2e8e265c",
           (_v({"output": "*i32", "positions": "*i64"}, dict(TOP_K=512, COMPRESS_RATIO=1, PADDED_TOP_K=512)),
            _v({"output": "*i32", "positions": "*i64"}, dict(TOP_K=512, COMPRESS_RATIO=2, PADDED_TOP_K=512))),
           num_warps=8, releases=until("0.33.0")),
    # 0.34 renamed it (no underscore) and V4.1 launches V4's: one kernel, V4's ratio 4 and V4.1's 1 and 2.
    Recipe("vllm.models.deepseek_v4.attention.fill_short_context_topk_indices",
           "vllm/models/deepseek_v4/attention.py:1092 and vllm/models/deepseek_v41/attention.py:1630",
           "851b0d720f15df2a",
           tuple(_v({"output": "*i32", "positions": "*i64"}, dict(TOP_K=512, COMPRESS_RATIO=r, PADDED_TOP_K=512))
                 for r in (4, 1, 2)),
           num_warps=8, releases=since("0.34.0"),
           note="topk_indices_buffer int32, positions int64; compress ratios 4 (V4), 1 and 2 (V4.1)"),
    # V4.1 decode top-k -> global slots (called by vLLM's _forward_decode and by the plugin's Ampere
    # decode, dsv4_ops/vllm/attention.py): topk_indices = topk_indices_buffer[:T] int32 [T, index_topk
    # 512] (stride 512), global indices empty_like it; topk_lens int32; token_to_req_indices int32 and
    # is_valid_token bool (sparse_swa.py:504, 556); block_table int32 [reqs, cdiv(max_model_len, 128)]
    # (65536 / 128 = 512 columns); block_size = attn_metadata.block_size // compress_ratio with the
    # backend's 128-token kernel block off sm_90 (ratios 1 and 2 -> 128, 64).
    Recipe("vllm.models.deepseek_v41.common.ops.cache_utils._compute_global_topk_indices_and_lens_kernel",
           "vllm/models/deepseek_v41/common/ops/cache_utils.py:841", "23e006aa7a9cb64f",
           tuple(_v({"global_topk_indices_ptr": "*i32", "topk_lens_ptr": "*i32", "topk_indices_ptr": "*i32",
                     "token_to_req_indices_ptr": "*i32", "block_table_ptr": "*i32", "is_valid_token_ptr": "*i1"},
                    dict(global_topk_indices_stride=512, topk_indices_stride=512, topk=512, block_table_stride=512,
                         block_size=bs, TRITON_BLOCK_SIZE=1024)) for bs in (128, 64)),
           note="called every decode step by the plugin's Ampere decode (kept row)"),
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
           num_warps=8, note="qo = torch.empty(..., dtype=torch.float8_e4m3fn) (query_quant.py:103)",
           releases=until("0.33.0")),
    Recipe("vllm.models.deepseek_v41.common.ops.query_quant._q_kv_norm_quant_kernel",
           "vllm/models/deepseek_v41/common/ops/query_quant.py:125", "087eaaca445ff2be",
           (_v({"q": "*bf16", "kv": "*bf16", "qw": "*bf16", "kvw": "*bf16", "qo": "*fp8e4nv", "kvo": "*bf16",
                "scales": "*u8", "num_tokens": "i32", "q_stride": "i32", "kv_stride": "i32", "eps": "fp32"},
               dict(Q_SIZE=1280, KV_SIZE=512, BLOCK=2048, LAUNCH_PDL=False, TRIGGER_FIRST=False)),),
           num_warps=8, note="qo = torch.empty(..., dtype=torch.float8_e4m3fn) (query_quant.py:116); PDL is "
                             "sm_90+ (is_arch_support_pdl), so LAUNCH_PDL and TRIGGER_FIRST are False",
           releases=since("0.34.0")),
    # V4.1's first decoder layer broadcasts the embedding output (bf16 [T, hidden]) to hc_mult copies
    # (nvidia/model.py:546): x bf16 with strides (hidden, 1) as constexprs, out = x.new_empty, numel i32.
    Recipe("vllm.models.deepseek_v41.nvidia.ops.mhc._hc_expand_kernel",
           "vllm/models/deepseek_v41/nvidia/ops/mhc.py:352", "c61a87672815ba63",
           (_v({"x": "*bf16", "out": "*bf16", "numel": "i32"},
               dict(H=5120, N=4, STRIDE_M=5120, STRIDE_H=1, BLOCK=1024)),),
           note="hidden 5120, hc_mult 4 (V4.1-Flash config)", releases=since("0.34.0")),
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
    Recipe("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache._fused_save_compress_norm_kernel",
           "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py:108", "da6561225c718c1e",
           (_v({"raw": "*fp32", "positions": "*i64", "state": "*fp32", "state_slots": "*i64",
                "query_start_loc": "*i32", "req_ids": "*i32", "norm_weight": "*bf16", "latent": "*bf16",
                "prev_rows": "*fp32", "prev_row_indices": "*i64", "num_tokens": "i32", "num_reqs": "i32"},
               dict(RAW_STRIDE=1024, PREV_ROW_STRIDE=1, STATE_STRIDE=4096, STATE_ROW_STRIDE=1024, STATE_BLOCK=4,
                    COMPRESS_RATIO=2, EPS=1e-6, JOIN_ROW_PTRS=True, HAS_PREV_ROWS=False)),
            _v({"raw": "*fp32", "positions": "*i64", "state": "constexpr", "state_slots": "*i64",
                "query_start_loc": "constexpr", "req_ids": "constexpr", "norm_weight": "*bf16", "latent": "*bf16",
                "prev_rows": "*fp32", "prev_row_indices": "*i64", "num_tokens": "i32", "num_reqs": "i32"},
               dict(state=None, query_start_loc=None, req_ids=None, RAW_STRIDE=512, PREV_ROW_STRIDE=1,
                    STATE_STRIDE=1, STATE_ROW_STRIDE=1, STATE_BLOCK=1, COMPRESS_RATIO=1, EPS=1e-6,
                    JOIN_ROW_PTRS=True, HAS_PREV_ROWS=False))),
           note="kv_score asserted fp32 [T, 512*ratio], latent bf16 (fused_compress_quant_cache.py:70-74); CR1 "
                "passes None state/query_start_loc/req_ids (:97); slot_mapping int64, token_to_req_indices int32 "
                "(sparse_swa.py:504); without PCP prev_rows=kv_score, prev_row_indices=slot_mapping (:117-118); "
                "ring of 4 rows representative"),
    # Engram n-gram hashing (NgramHashState.forward, engram.py:519-600): input_ids int32 (runner
    # input buffer), token_map int32 (engram.py:465), dead_mask bool (image_sentinel_mask, a ==
    # compare; nvidia/model.py:1016), slot_mapping int64, block_table / query_start_loc int32 (SWA
    # metadata), multipliers / primes / offsets int64 (engram.py:187-206, 246-250), hash cache int32
    # (engram.py:501), lookback_token_ids int32 (model_state.py:209 / input_ids.new_full), output int32.
    Recipe("vllm.models.deepseek_v41.common.engram._write_hash_cache_kernel",
           "vllm/models/deepseek_v41/common/engram.py:550", "947fe3a3ffee331b",
           (_v({"input_ids": "*i32", "token_map": "*i32", "dead_mask": "*i1", "slot_mapping": "*i64",
                "cache": "*i32", "num_tokens": "i32", "input_stride": "i32", "mask_stride": "i32",
                "slot_stride": "i32", "dead_id": "i32"}, dict(BLOCK_SIZE=256)),),
           note="V1 runner only (use_slot_cache)", releases=until("0.33.0")),
    Recipe("vllm.models.deepseek_v41.common.engram._hash_ids_kernel",
           "vllm/models/deepseek_v41/common/engram.py:563", "3e96d2ddd69cf674",
           tuple(_v(dict({"input_ids": "*i32", "token_map": "*i32", "dead_mask": "*i1", "positions": "*i64",
                          "block_table": "*i32", "query_start_loc": "*i32", "multipliers": "*i64",
                          "primes": "*i64", "offsets": "*i64", "lookback_token_ids": "*i32",
                          "lookback_dead_mask": "*i1", "output": "*i32"},
                         **{k: "i32" for k in ("num_tokens", "num_slots", "pad_id", "input_stride", "mask_stride",
                                               "position_stride", "table_stride", "table_col_stride",
                                               "query_stride", "num_query_rows", "num_table_rows", "max_blocks",
                                               "cache_block_size", "num_heads", "dead_id", "lookback_depth",
                                               "lookback_row_stride", "lookback_col_stride",
                                               "lookback_mask_row_stride", "lookback_mask_col_stride")},
                         cache=cache), dict(cx, MAX_NGRAM=3, BLOCK_T=32, BLOCK_H=8))
                 for cache, cx in (("*i32", {}), ("constexpr", {"cache": None}))),
           note="cache None on the V2 runner (engram.py:538); MAX_NGRAM 3 / 8 heads representative",
           releases=until("0.33.0")),
    # 0.34 dropped the V1 runner's slot cache (cache, block_table and their sizes are gone).
    Recipe("vllm.models.deepseek_v41.common.engram._hash_ids_kernel",
           "vllm/models/deepseek_v41/common/engram.py:444", "b3597e50097233b7",
           (_v(dict({"input_ids": "*i32", "token_map": "*i32", "dead_mask": "*i1", "positions": "*i64",
                     "query_start_loc": "*i32", "multipliers": "*i64", "primes": "*i64", "offsets": "*i64",
                     "lookback_token_ids": "*i32", "lookback_dead_mask": "*i1", "output": "*i32"},
                    **{k: "i32" for k in ("num_tokens", "pad_id", "input_stride", "mask_stride", "position_stride",
                                          "query_stride", "num_query_rows", "num_heads", "dead_id", "lookback_depth",
                                          "lookback_row_stride", "lookback_col_stride", "lookback_mask_row_stride",
                                          "lookback_mask_col_stride")}),
                dict(MAX_NGRAM=3, BLOCK_T=32, BLOCK_H=8)),),
           note="MAX_NGRAM 3 / 8 heads representative", releases=since("0.34.0")),
    Recipe("vllm.models.deepseek_v41.common.engram._engram_select_rows_kernel",
           "vllm/models/deepseek_v41/common/engram.py:1384", "414eb1ab8df1d8b5",
           (_v({"gathered": "*bf16", "output": "*bf16", "num_tokens": "i32", "token_start": "i32",
                "num_elements": "i32"}, dict(LOCAL_WIDTH=2 * 512, WIDTH=16 * 512, BLOCK_SIZE=1024)),),
           note="staged_rows bf16 (engram.py:1667-1671), all-gathered, out = rows.new_empty (engram.py:1737); "
                "widths representative"),
    Recipe("vllm.models.deepseek_v41.common.engram._fused_engram_post_wkv_kernel",
           "vllm/models/deepseek_v41/common/engram.py:1785", "8c766469c40e5ae5",
           tuple(_v(dict({"hidden_states": "*bf16", "kv": "*bf16", "q_weight": "*bf16", "k_weight": "*bf16",
                          "token_mask": mask, "output": "*bf16", "eps": "fp32", "clamp_value": "fp32"},
                         **{k: "i32" for k in ("num_kv_tokens", "hidden_stride_t", "hidden_stride_h",
                                               "hidden_stride_d", "kv_stride_t", "kv_stride_d", "q_stride_h",
                                               "q_stride_d", "k_stride_h", "k_stride_d", "mask_stride",
                                               "output_stride_t", "output_stride_h", "output_stride_d")}),
                    dict(DIM=5120, HC_MULT=4, BLOCK_SIZE=8192, HAS_MASK=has))
                 for mask, has in (("*i1", True), ("*bf16", False))),
           num_warps=8, note="q/k_weight bf16 (engram.py:1639-1646), hidden bf16, kv = wkv(bf16 rows); "
                             "mask bool or hidden_states when None (engram.py:1784)"),
    # V2 model-runner state (DeepseekV41ModelState): query_start_loc / seq_lens int32, positions int64
    # (v1/worker/gpu/input_batch.py:30-35), idx_mapping int64 (model_runner.py:1406-1407), all_token_ids
    # int32 (v1/worker/gpu/states.py:37-39), slot mappings int64 (block_table.py:90-93).
    Recipe("vllm.models.deepseek_v41.nvidia.model_state._gather_lookback_kernel",
           "vllm/models/deepseek_v41/nvidia/model_state.py:303", "1d9356fe3c3cf492",
           (_v({"lookback_ptr": "*i32", "idx_mapping_ptr": "*i64", "query_start_loc_ptr": "*i32",
                "positions_ptr": "*i64", "all_token_ids_ptr": "*i32", "all_token_ids_stride": "i32",
                "num_reqs": "i32"}, dict(DEPTH=2, BLOCK_DEPTH=2)),),
           note="lookback_token_ids int32 (model_state.py:209); depth = max_ngram - 1 (2 representative)"),
    Recipe("vllm.models.deepseek_v41.nvidia.model_state._pad_replayed_slots_kernel",
           "vllm/models/deepseek_v41/nvidia/model_state.py:386", "ad96008c88f2a511",
           (_v({"slot_mappings_ptr": "*i64", "group_stride": "i32", "cacheable_groups_ptr": "*i32",
                "query_start_loc_ptr": "*i32", "positions_ptr": "*i64", "replay_start_ptr": "*i32",
                "window": "i32", "pad_slot_id": "i32"}, dict(NUM_GROUPS=4, BLOCK=1024)),),
           note="cacheable_groups int32 (model_state.py:341-345), replay_start int32 (model_state.py:215)"),
    Recipe("vllm.models.deepseek_v41.nvidia.model_state._gather_replay_batch_kernel",
           "vllm/models/deepseek_v41/nvidia/model_state.py:689", "03271f69a7046c07",
           (_v({"query_start_loc_ptr": "*i32", "dropped_before_ptr": "*i32", "seq_lens_ptr": "*i32",
                "replay_start_ptr": "*i32", "positions_ptr": "*i64", "slot_mappings_ptr": "*i64",
                "slot_mappings_stride": "i32", "rows_ptr": "*i64", "kept_query_start_loc_ptr": "*i32",
                "kept_positions_ptr": "*i64", "kept_slot_mappings_ptr": "*i64", "kept_slot_mappings_stride": "i32",
                "kept_kv_start_ptr": "*i32", "window": "i32"}, dict(NUM_GROUPS=4, BLOCK=1024)),),
           note="dropped_before int32 (model_state.py:235), _kept_* buffers (model_state.py:240-252, 348-352)"),
    Recipe("vllm.models.deepseek_v41.common.engram._engram_unpack_fp8_kernel",
           "vllm/models/deepseek_v41/common/engram.py:1559", "e0996d8c43310ba1",
           (_v({"packed": "*u8", "values": "*u8", "scales": "*u8", "num_tokens": "i32", "values_stride": "i32",
                "scales_stride": "i32"}, dict(HEADS=16, LOCAL_HEADS=16, LAYERS=2, RANK=0, DIM=512, BLOCK=16,
                                              PEER=False)),),
           note="packed_rows / fp8_values / fp8_scales are uint8 (engram.py:1476-1495)"),
)

# DeepSeek-V3.2 / GLM-5: the fused embedding gather + first input_layernorm (DeepseekV32Model.forward with
# the full vocab on rank, fused_embed_norm.py:111-147): ids = input_ids (int32 from the V2 runner, int64
# accepted), the bf16 table, out / normed bf16 [T, H], chain_w = the first layer's RMSNorm weight (bf16),
# H = hidden size (7168 V3.2, 6144 GLM-5), BLOCK = next_power_of_2(H) = 8192, HAS_NORM True,
# num_warps = min(32, max(4, BLOCK // 512)) = 16.
RECIPES = RECIPES + (
    Recipe("vllm.model_executor.layers.fused_embed_norm._fused_embed_norm_kernel",
           "vllm/model_executor/layers/fused_embed_norm.py:135", "0bc0d6199336bb40",
           tuple(_v({"ids_ptr": ids, "table_ptr": "*bf16", "table_stride_0": "i32", "out_ptr": "*bf16",
                     "normed_ptr": "*bf16", "chain_w_ptr": "*bf16", "eps": "fp32"},
                    dict(H=h, BLOCK=8192, HAS_NORM=True)) for h in (7168, 6144) for ids in ("*i32", "*i64")),
           num_warps=16, note="V3.2 hidden 7168 and GLM-5 hidden 6144; only with the full vocab on rank"),
)

def by_kernel(release: Optional[str] = None) -> Dict[str, Recipe]:
    """The recipes read from vLLM ``release`` (default: the release whose evidence applies to the
    vLLM being audited), by kernel (module.name)."""
    release = release or evidence_release()
    return {r.kernel: r for r in RECIPES if release in r.releases}


def source_sha(jit) -> Optional[str]:
    """sha256 (16 hex) of the kernel's ``def`` source as it is in its file (decorators excluded)."""
    fn = getattr(jit, "fn", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return _file_sha(code.co_filename, fn.__name__)


def file_sha(kernel: str) -> Optional[str]:
    """``source_sha`` of ``kernel`` (module.name) read from the vLLM source on disk, nothing
    imported (where vLLM's Triton kernels are placeholders: a process without a GPU or the
    audit's target driver)."""
    from ..serve_graph import _source

    mod, name = kernel.rsplit(".", 1)
    path = _source.module_path(mod)
    return _file_sha(path, name) if path else None


def _file_sha(path: str, name: str) -> Optional[str]:
    try:
        text = open(path).read()
    except OSError:
        return None
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            seg = ast.get_source_segment(text, node) or ""
            return hashlib.sha256(seg.encode()).hexdigest()[:16]
    return None


def specs_for(key: str, jit, recipes: Optional[Dict[str, Recipe]] = None) -> Tuple[List, str]:
    """(KernelSpecs, note) for the kernel ``key`` (module.name) from ``recipes`` (default:
    ``by_kernel()``); no specs when there is no recipe or its hash is stale (the note says which)."""
    from ... import aot

    r = (by_kernel() if recipes is None else recipes).get(key)
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
