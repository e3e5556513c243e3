"""The planted bugs of tests/mutants/run.py: one plausible mistake each, as an exact text edit.

Each row: name; file (repo-relative); old, new (``old`` must occur exactly once in the file,
else the row is reported stale); tests: the pytest selection that must fail (node ids, files,
``-k`` expressions: passed to pytest as they are); why: the mistake, in words; later (optional):
the check expected to catch it, printed beside a survivor.

Classes (issue 29): cache writers (a writer consistent with itself: RoPE position, pooling
window, K-store detail), plugin glue (dropped sink, wrong softmax scale, window one key short,
top-k slots without the compression ratio, Engram shard edge), dispatch (a rule reading one
block size or one cache only, shared memory, splits), references, kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

E2E = "tests/e2e/test_e2e.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: Tuple[str, ...]
    why: str
    later: str = ""  # the check expected to catch it, printed when it survives


MUTANTS = (
    # ---- cache writers ----
    Mutant("v4-writer-rope-at-token", "dsv4_ops/vllm/compressed_cache.py",
           'cpos = torch.div(positions, compress_ratio, rounding_mode="floor") * compress_ratio',
           "cpos = positions",
           ("tests/test_vllm_plugin.py::test_v4_compressed_writer_matches_triton_kernel_math",),
           "compressed-cache RoPE at the boundary token's position instead of its group's first"),
    Mutant("v41-writer-rope-at-token", "dsv4_ops/vllm/compressed_cache.py",
           "rows = _rope_rows(latent[:n].to(torch.float32), pos, cos_sin_cache, compress_ratio)",
           "rows = _rope_rows(latent[:n].to(torch.float32), pos, cos_sin_cache, 1)",
           ("tests/test_vllm_plugin.py::test_v41_rope_quant_insert_writes_only_boundary_tokens",
            E2E + "::test_every_cache_entry_is_the_float64_one", "-k", "v41"),
           "V4.1's rope_quant_insert rotates at the token's own position (its unit test uses the identity "
           "rotation; only the e2e writer check, from the layer inputs, sees it)"),
    Mutant("v4-writer-pool-window-shifted", "dsv4_ops/vllm/compressed_cache.py",
           "p = pos[:, None] - W + 1 + tok[None, :]  # [n, W]",
           "p = pos[:, None] - W + tok[None, :]  # [n, W]",
           ("tests/test_vllm_plugin.py::test_v4_compressed_writer_matches_triton_kernel_math",),
           "the pooling window one position early (p - W .. p - 1)"),
    Mutant("v4-writer-overlap-half", "dsv4_ops/vllm/compressed_cache.py",
           "cols = ((tok >= compress_ratio).to(torch.int64) * head_dim)",
           "cols = ((tok > compress_ratio).to(torch.int64) * head_dim)",
           ("tests/test_vllm_plugin.py::test_v4_compressed_writer_matches_triton_kernel_math",),
           "K-store detail: the overlap window's first own entry reads the previous group's half of the state"),
    Mutant("v41-indexer-k-rope-at-token", "dsv4_ops/vllm/indexer.py",
           'cs = cos_sin_cache[torch.div(pos, compress_ratio, rounding_mode="floor") * compress_ratio]',
           "cs = cos_sin_cache[pos]",
           ("tests/test_vllm_indexer.py::test_v41_k_store_replacement",),
           "V4.1's indexer K store rotates at the token's position, not its group's"),
    Mutant("kv-insert-ue8m0-boundary", "csrc_triton/kv_cache.py",
           "b_e = b_exp - 8 + ((b_bits & 0x7FFFFF) > 0x600000).to(tl.int32)",
           "b_e = b_exp - 8 + ((b_bits & 0x7FFFFF) >= 0x600000).to(tl.int32)",
           ("tests/test_kv_cache.py::test_kernels_interpreter", "tests/test_v32_ops.py::test_insert_exponent_for_every_bf16_amax"),
           "cache writer kernels (shared exponent rule): UE8M0 exponent one too large when a group's amax is "
           "exactly 448 * 2**e"),
    # ---- plugin glue ----
    Mutant("glue-sink-dropped", "dsv4_ops/vllm/attention.py",
           "                      self.attn_sink, self.scale, step_plans=plans)",
           "                      None, self.scale, step_plans=plans)",
           ("tests/test_vllm_plugin.py::test_ampere_class_forward_decode_c128_path",),
           "the decode forward drops the attention sink"),
    Mutant("glue-scale-nope-dim", "dsv4_ops/vllm/attention.py",
           "                      self.attn_sink, self.scale, step_plans=plans)",
           "                      self.attn_sink, 448 ** -0.5, step_plans=plans)",
           ("tests/test_vllm_plugin.py::test_ampere_class_forward_decode_c128_path",),
           "softmax scale from the NoPE head dim (448) instead of the layer's"),
    Mutant("glue-window-one-short", "dsv4_ops/vllm/attention.py",
           "swa_length=swa_lens, out=output, return_lse=False, step_plans=step_plans)",
           "swa_length=None if swa_lens is None else swa_lens - 1, out=output, return_lse=False, "
           "step_plans=step_plans)",
           ("tests/test_vllm_plugin.py::test_ampere_decode_matches_reference_attention",),
           "the sliding window one key short"),
    Mutant("glue-topk-without-ratio", "dsv4_ops/vllm/attention.py",
           "block_size = attn_metadata.block_size // self.compress_ratio",
           "block_size = attn_metadata.block_size",
           (E2E + "::test_every_attention_layer_matches_the_oracle",),
           "top-k positions mapped to compressed-cache slots with the SWA block size (no compression ratio)"),
    Mutant("engram-glue-vocab-end", "dsv4_ops/vllm/engram.py",
           "self.vocab_start_idx, self.vocab_end_idx,",
           "self.vocab_start_idx, self.vocab_end_idx - 1,",
           ("tests/test_engram_plugin.py",),
           "Engram shard edge: the rank's last table row is never looked up"),
    Mutant("engram-kernel-shard-edge", "csrc_triton/engram.py",
           "m_own = m_dst & (b_local >= 0) & (b_local < n_owned)",
           "m_own = m_dst & (b_local >= 0) & (b_local <= n_owned)",
           ("tests/test_engram_plugin.py",),
           "Engram kernel: the id one past the shard's range is owned (reads the next shard's row)"),
    # ---- dispatch ----
    Mutant("dispatch-v3-one-block-size", "dsv4_ops/dispatch/decode.py",
           "if block_sizes and not all(_pow2(b) for b in block_sizes) and is_f16dot(v3_config(name)):",
           "if block_sizes and not _pow2(block_sizes[-1]) and is_f16dot(v3_config(name)):",
           ("tests/test_dispatch_product.py", "-k", "v3_config or forced_f16dot or dispatched_v3"),
           "the shift-kernel fallback reads the window cache's block size only"),
    Mutant("dispatch-composite-one-cache", "dsv4_ops/dispatch/decode.py",
           'return choice in ("fused", "paged") or (choice == "v3" and cache_aligned(compressed_cache)\n'
           '                                            and cache_aligned(swa_cache))',
           'return choice in ("fused", "paged") or (choice == "v3" and cache_aligned(compressed_cache))',
           ("tests/test_dispatch_product.py::test_composite_reads_both_caches",),
           "the composite runs the 16-byte-vector paged op when only the compressed cache is aligned"),
    Mutant("dispatch-smem-strict", "dsv4_ops/dispatch/configs.py",
           'return _v4k.V4_SMEM_BYTES.get(name, 0) <= smem',
           'return _v4k.V4_SMEM_BYTES.get(name, 0) < smem',
           ("tests/test_dispatch_product.py", "-k", "route or v3_config"),
           "a config that needs exactly the device's shared memory is refused"),
    Mutant("dispatch-route-ignores-smem", "dsv4_ops/dispatch/decode.py",
           "if config_fits(name, smem if smem >= 0 else _device.smem_per_block(-1)):",
           "if config_fits(name, _device.smem_per_block(-1)):",
           ("tests/test_dispatch_product.py", "-k", "route or v3_config"),
           "the shared-memory window reads the current device, not the tensors' device"),
    Mutant("dispatch-indexer-first-wave-only", "dsv4_ops/dispatch/indexer.py",
           "if best is None or key < best[0]:",
           "if best is None:",
           ("tests/test_indexer.py", "-k", "wave_models_optimum or measured_shapes"),
           "the indexer's wave plan keeps its first candidate (the fewest waves), never the cheaper plan of more"),
    Mutant("dispatch-decode-residency-ignores-smem", "dsv4_ops/dispatch/decode.py",
           "return max(1, min(V3_COST[config][0], _device.blocks_by_smem(V3_SHARED_BYTES[config], smem)))",
           "return V3_COST[config][0]",
           ("tests/test_decode_sm_plan.py::test_programs_an_sm_follow_the_devices_shared_memory",),
           "the decode model counts 2 programs of 54 KB an SM on sm_86's 100 KB (its waves off 2x there)"),
    Mutant("dispatch-smem-blocks-no-reserve", "dsv4_ops/dispatch/device.py",
           "return (smem + 1024) // (block_bytes + 1024)",
           "return smem // block_bytes",
           ("tests/test_decode_sm_plan.py::test_programs_an_sm_follow_the_devices_shared_memory",),
           "blocks an SM counted without the SM's extra KiB and a block's reserved KiB"),
    Mutant("dispatch-v32-two-waves", "dsv4_ops/dispatch/v32.py",
           "return max(1, min(MAX_SPLITS, nb, slots // base))",
           "return max(1, min(MAX_SPLITS, nb, -(-slots // base)))",
           ("tests/test_dispatch_product.py::test_v32_form_and_splits_over_the_product",),
           "V3.2 split count rounded up: a second wave of programs"),
    # ---- references ----
    Mutant("ref-sink-dropped", "dsv4_ops/reference.py",
           "den = p.sum(-1) + torch.exp(sk[None, :] - m_safe)",
           "den = p.sum(-1)",
           ("tests/test_decode_paged_chunk64.py::test_fused_no_sink_and_no_keys",),
           "the float64 attention reference forgets the sink in the denominator"),
    Mutant("ref-length-inclusive", "dsv4_ops/reference.py",
           "valid = valid & (j[None, :] < topk_length.to(torch.int64)[:, None])",
           "valid = valid & (j[None, :] <= topk_length.to(torch.int64)[:, None])",
           ("tests/test_decode_heads.py::test_heads_kernel_fp16_matches_reference[H8-1]",),
           "the reference attends one entry past each token's top-k length (one key too many)"),
    Mutant("ref-engram-table-not-range", "dsv4_ops/reference.py",
           "owned = (local >= 0) & (local < min(vocab_end - vocab_start, n_tab))",
           "owned = (local >= 0) & (local < n_tab)",
           ("tests/test_engram_plugin.py",),
           "Engram reference owns every table row, not the vocab range (hidden when the table is the range)"),
    # ---- kernels ----
    Mutant("paged128-split-start-rounded-up", "csrc_triton/decode/paged_chunk128.py",
           "blk_lo = (pid_s * nb) // S",
           "blk_lo = (pid_s * nb + S - 1) // S",
           ("tests/test_decode_paged.py::test_v3_matches_float64_reference[T3-H8-i32-tl-sl-S3]",),
           "paged v3 kernel: a split starts one block late when S does not divide the blocks"),
    Mutant("merge-sink-dropped", "csrc_triton/decode/merge.py",
           "        b_den += tl.exp(b_sink - b_max_safe)",
           "        b_den += 0.0",
           ("tests/test_decode_paged_chunk64.py::test_fused_kernel_matches_float64_reference[T3-H8-i32-tl-sl-S3]",),
           "the split merge keeps the sink in the max but not in the denominator"),
)
