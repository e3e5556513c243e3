"""sm_8x (Ampere) implementations that the vLLM plugin puts in place of vLLM 0.33.0 symbols.

Nothing here imports vLLM at module level: vLLM is an optional dependency, and the
attention classes are built lazily from vLLM's own classes
(``attention.make_ampere_attention_cls``). The patch table that says which vLLM symbol
each function replaces lives in ``dsv4_ops.registration.vllm_plugin``.

Modules:
  attention         decode (both caches gathered into one workspace, split-KV, merge with
                    the sink), the prefill gather and prefill attention, the class factory
  compressed_cache  the compressed 512-d cache writers (V4 compressor, V4.1 rope_quant_insert)
  o_proj            bf16 wo_a (dequantized once at load), inverse RoPE, grouped bmm, wo_b
"""
