"""Everything vLLM: the sm_8x replacements, the patch table and the plugin's logic.

Nothing here imports vLLM at module level (vLLM is an optional dependency); the attention
classes are built lazily from vLLM's own classes. ``registration/vllm_plugin.py`` is the thin
entry point vLLM calls.

Modules:
  table             the ``Patch`` row type and the table assembled from every area's ``PATCHES``
  plugin            decide / check (signatures, attributes read, by-name imports) / apply / register
  attention         decode (both caches into one workspace, split-KV, merge with the sink), the
                    prefill gather and prefill attention, the class factory and selectors
  compressed_cache  the compressed 512-d cache writers (V4 compressor, V4.1 rope_quant_insert)
  o_proj            bf16 wo_a (dequantized once at load), inverse RoPE, grouped bmm, wo_b; the
                    load hook's rows
  weights           dequantize_linear_weight: every wo_a scale format vLLM 0.33.0 loads, or raise
  warmup            vLLM's JIT warmup minus the kernels sm_8x cannot compile (from the audit's evidence)
  indexer           the sparse-attention indexer (Q quant, K stores, logits, metadata, fp8 pack_seq)
  engram, mhc       V4.1's Engram lookup; V4's first-layer mHC prenorm GEMM
  pipeline          the V4.1 pipeline-parallel partition check at model build
  quant_guard       the checkpoint's quant layout and kernel backends checked at model build
  serve_host        host / layout / settings facts shared by the plugin's startup choices and doctor
  decode_graph      an opt-in private CUDA graph of the decode step per input-address key
  audit             dsv4-ops audit-vllm: every kernel on the serve path, by evidence
"""
