"""Every dispatch decision of dsv4_ops: which kernel variant, kernel, config and split count runs,
decided from static shapes, device facts and the knobs (dsv4_ops.envs), never from tensor values.
The launchers ask; nothing here imports a launcher (only envs and the kernels' config data).
docs/dispatch.md is the decision table in prose (tests/test_dispatch_doc.py holds its window
tables equal to windows.py).

    rule                                      function                              results file (benchmarks/results/)
    kernel variant (portable / native)        variant.kernel_variant, variant_for   (capability table: sm_80/86/87 portable)
    SM count (DSV4_AMPERE_SMS), smem a block  device.num_sms, num_sms_at,           -
                                              smem_per_block, known_smem
    decode mode                               decode.resolve_mode                   -
    composite: paged op or workspace step     decode.resolve_route,                 decode_paged_chunk64.md,
                                              resolve_composite                     decode_paged_chunk128.md, decode_paged_f16dot.md
    measured windows (data)                   windows.AUTO_FUSED_WINDOWS, ...       the same three + decode_paged_f16dot_splits.md
    workspace gather: one launch or three     decode.resolve_gather                 host_cost.md
    workspace kernel: tiles or heads          decode.resolve_workspace              decode_kernels.md
    tiles split count                         decode.tile_splits                    attention_split_sweep.md
    heads split count                         decode.auto_heads_splits              decode_kernels.md, sparse_prefill.md
                                              (heads_splits: cost model, forced heads only)
    paged op form (v1 / v3)                   decode.resolve_paged_form             decode_paged_chunk128.md
    v3-form config (DSV4_AMPERE_DECODE_CONFIG) decode.resolve_v3_config             decode_paged_f16dot.md, decode_paged_chunk128.md
                                              (v3_sm_config: the SMs, V3_COST)      decode_sms_call1.md
    v3-form config + splits measured on the   tables.lookup (dsv4-ops tune;         dsv4_ops/tables/*.json (from decode_sms_call1.json,
    device at its SM count (first, where set) DSV4_AMPERE_DECODE_TABLE(S/_DIR))     decode_sms_heads.json)
    v3-form kernel                            configs.is_f16dot (PV_KEY)            -
    v1 / v3 split counts                      decode.fused_splits, v3_splits        decode_paged_chunk64.md, decode_paged_f16dot_splits.md,
                                              (v3: V3_COST on the plan's SMs)       decode_sms_call1.md, decode_sms.md
    batch invariance                          decode.batch_invariant_plan           decode_kernels.md
    V3.2 form (DSV4_AMPERE_V32_FORM)          v32.resolve_form, auto_form           v32_decode.md, v32_prefill.md
    V3.2 split count                          v32.num_splits_for                    v32_decode.md
    sparse prefill: own kernel or split-KV    prefill.resolve, uses_prefill_kernel  sparse_prefill.md (PREFILL_MIN_WAVES: a guess)
    decode indexer config, tiles a program    indexer.paged_config,                 indexer.md
                                              paged_tiles_per_program
"""

from __future__ import annotations

from . import decode, device, indexer, prefill, tables, v32, variant, windows
from .variant import (
    CAPABILITY_TABLE,
    ENV_VAR,
    KERNEL_VARIANTS,
    SHOWCASE_CAPABILITIES,
    device_capability,
    impl_override,
    kernel_variant,
    native_fp8_available,
    routes_to_dsv4_ops,
    table_variant,
    variant_for,
)

__all__ = ["decode", "device", "indexer", "prefill", "tables", "v32", "variant", "windows",
           "CAPABILITY_TABLE", "ENV_VAR", "KERNEL_VARIANTS", "SHOWCASE_CAPABILITIES", "device_capability",
           "impl_override", "kernel_variant", "native_fp8_available", "routes_to_dsv4_ops", "table_variant",
           "variant_for"]
