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
    composite: paged op or workspace step     decode.resolve_route                  -
    paged op: the step's plan (one planner)   decode.plan_step                      (the rows below)
      launch config (DSV4_AMPERE_DECODE_CONFIG, decode.resolve_config             decode_paged_f16dot.md, decode_paged_chunk128.md,
      windows, the SMs, alignment)            (V3_COST on the plan's SMs)           decode_sms_call1.md
      measured windows (data)                 windows.CONFIG_WINDOWS                the same + decode_paged_f16dot_splits.md
      config + splits measured on the device  tables.lookup (dsv4-ops tune;         dsv4_ops/tables/*.json (from decode_sms_call1.json,
      at its SM count (first, where set)      DSV4_AMPERE_DECODE_TABLE(S/_DIR))     decode_sms_heads.json)
      split count, partials cap               decode.v3_splits, split_cap           decode_paged_f16dot_splits.md, decode_sms.md
      balanced splits                         decode.balanced                       decode_balance.md
    v3-form kernel                            configs.is_f16dot (PV_KEY)            -
    workspace gather: one launch or three     workspace.resolve_gather              host_cost.md
    workspace kernel: tiles or heads          workspace.resolve_workspace           decode_kernels.md
    tiles split count                         workspace.tile_splits                 attention_split_sweep.md
    heads split count                         workspace.auto_heads_splits           decode_kernels.md, sparse_prefill.md
                                              (heads_splits: cost model, forced heads only)
    batch invariance                          workspace.batch_invariant_plan        decode_kernels.md
    V3.2 form (DSV4_AMPERE_V32_FORM)          v32.resolve_form, auto_form           v32_decode.md, v32_prefill.md
    V3.2 split count                          v32.num_splits_for                    v32_decode.md
    sparse prefill: own kernel or split-KV    prefill.resolve, uses_prefill_kernel  sparse_prefill.md (PREFILL_MIN_WAVES: a guess)
    decode indexer config, tiles a program    indexer.paged_config,                 indexer.md
                                              paged_tiles_per_program
"""

from __future__ import annotations

from . import decode, device, indexer, prefill, tables, v32, variant, windows, workspace
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

__all__ = ["decode", "device", "indexer", "prefill", "tables", "v32", "variant", "windows", "workspace",
           "CAPABILITY_TABLE", "ENV_VAR", "KERNEL_VARIANTS", "SHOWCASE_CAPABILITIES", "device_capability",
           "impl_override", "kernel_variant", "native_fp8_available", "routes_to_dsv4_ops", "table_variant",
           "variant_for"]
