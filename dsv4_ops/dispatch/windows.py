"""The measured windows of the DeepSeek-V4 decode plan, as data (dispatch.decode reads them at
each call, through this module: a test or benchmark that swaps one swaps it everywhere).

Every row is a shape range where a paged launch config was measured faster than the default one
(H200, portable, in-graph, same-run ratios); docs/dispatch.md shows the same table
(tests/test_dispatch_doc.py holds the two equal). T: tokens, H: query heads a rank, K: key
positions a token (K1 top-k + K2 window).
"""

from __future__ import annotations

# Configs whose shared memory (paged_f16dot.V4_SMEM_BYTES) only some Ampere parts hold: taken where
# the device's blocks may opt into it (an A100: 163 KiB), else the shape keeps its other choice.
# Rows (T_lo, T_hi, H_lo, H_hi, K, config).
# benchmarks/results/decode_paged_f16dot.md (132 SMs, kh32n64w8 against the workspace step):
# H = 64, K 640: T = 4 14.5 vs 16.5 us, T = 64 74.2 vs 93.2, T = 128 150 vs 172, T = 256 295 vs
# 324 (T = 16 even, T = 1 slower); K 256: T = 64, H = 64 32.5 vs 40.7 (kh16n32w4), T = 128,
# H = 128 132 vs 149.
# benchmarks/results/decode_sms_call1.md (132 / 112 / 104 SMs, same run): T = 16, H = 64: kh32n64w8
# 27.5 / 33.4 / 34.0 us against kh16n32w4's 30.7 / 39.4 / 39.6; T = 4..16, H = 128 against the
# step: T = 4 20.6 / 20.4 / 20.5 vs 20.5 / 23.5 / 24.0, T = 16 41.1 / 59.8 / 64.0 vs 51.5 / 70.1 / 71.1.
_SMEM_ROWS = ((4, 4, 64, 64, 640, "kh32n64w8"), (16, 16, 64, 64, 640, "kh32n64w8"),
              (48, 256, 64, 64, 640, "kh32n64w8"), (64, 64, 64, 64, 256, "kh32n64w8"),
              (128, 128, 128, 128, 256, "kh32n64w8"), (4, 16, 128, 128, 640, "kh32n64w8"))

# Which config the plan runs outside the rows above, first match wins (measured at 132 SMs; on the
# plan's SM count dispatch.decode.resolve_config may take another where its cost model, V3_COST, says
# the window's config is more than V3_CONFIG_MARGIN slower there). Rows
# (T_lo, T_hi, H_lo, H_hi, K, config); the k/g configs are paged_f16dot's. From
# benchmarks/results/decode_paged_f16dot.md (call 2, same-run medians) and decode_paged_chunk128.md:
#   T 48..96, H <= 16, K 640: kh16n64w8 (T = 64: 32.9 / 34.6 us vs paged_chunk128's 42.2 / 44.1 at
#       H = 8 / 16; at T = 16 and 128 it lost to kh16n32w4, so the row stays around T = 64)
#   T 16..256, H <= 16, K 640: kh16n32w4 (T = 16: 15.6 / 16.5 vs 16.0 / 17.1; T = 128: 58.7 /
#       61.2 vs 61.7 / 64.3; T = 256: 102 / 104 vs 111 / 112)
#   T = 16, H = 64, K 640: kh16n32w4 at S = 4 (30.6 vs the step's 37.9, kh16n64w8 33.4, kh32n64w8
#       33.5; decode_paged_f16dot_splits.md)
#   T = 1, H = 128, K 640: kh16n64w8 (11.8 vs the step's 13.1 and paged_chunk128's 12.7)
#   T = 64, H = 64, K 256: kh16n32w4 (40.7 vs paged_chunk128's 44.5)
# Elsewhere paged_chunk128 (dispatch.decode.resolve_config): 16-key blocks for one token at
# H <= 16 (T = 1: 8.0 vs 9.2-9.3 us at 32 keys), 32-key blocks elsewhere (T = 4, H = 8: 9.6 vs
# paged_f16dot's 9.7).
_CONFIG_ROWS = (
    (48, 96, 1, 16, 640, "kh16n64w8"),
    (16, 256, 1, 16, 640, "kh16n32w4"),
    (16, 16, 64, 64, 640, "kh16n32w4"),
    (1, 1, 128, 128, 640, "kh16n64w8"),
    (64, 64, 64, 64, 256, "kh16n32w4"),
)

# The one table the plan reads: the shared-memory rows first, each row taken only where its config
# fits the device's shared memory a block (dispatch.configs.config_fits).
CONFIG_WINDOWS = _SMEM_ROWS + _CONFIG_ROWS

TABLES = ("CONFIG_WINDOWS",)



def identity() -> tuple:
    """The tables' identities (a memo of a plan that reads them keys on this, so that it follows a
    test or benchmark that swaps one)."""
    return tuple(id(globals()[name]) for name in TABLES)
