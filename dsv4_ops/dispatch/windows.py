"""The measured windows of the DeepSeek-V4 decode dispatch, as data (dispatch.decode reads them
at each call, through this module: a test or benchmark that swaps one swaps it everywhere).

Every row is a shape range where a paged kernel was measured faster than the workspace step
(H200, portable, in-graph, same-run ratios); docs/dispatch.md shows the same tables
(tests/test_dispatch_doc.py holds the two equal). T: tokens, H: query heads a rank, K: key
positions a token (K1 top-k + K2 window).
"""

from __future__ import annotations

# Where auto runs the 64-dim-chunk paged kernel (mode "fused", csrc_triton.decode.paged_chunk64)
# in the composite. Rows (T_lo, T_hi, H_max, K). benchmarks/results/decode_paged_chunk64.md:
# T = 4, H = 8 / 16, K = 640: 10.2 / 10.6 us against the step's 12.1 / 12.5 (1.18x / 1.17x).
# Elsewhere it measured even (T = 1, H <= 16: 1.00-1.02x) or slower (0.26-0.99x from T = 16 or
# H = 64; K = 256: 0.96x at T = 1); unmeasured T (2, 3, 5..15) keep the step.
AUTO_FUSED_WINDOWS = ((4, 4, 16, 640),)

# Where auto runs the v3 form (paged_chunk128 / paged_f16dot) in the composite. Rows
# (T_lo, T_hi, H_lo, H_hi, K). benchmarks/results/decode_paged_chunk128.md: H <= 16, K = 640 at
# every T measured (1, 4, 16, 64, 128, 256): 1.11-1.36x (T = 128, H = 8: 62.2 vs 81.4 us);
# K = 256 at T = 1 and 16: 1.27 / 1.45x; T = 1, H = 64: 1.15x; K = 256, T = 64, H = 64: 44.6-45.0
# vs 48.8-49.0 us (1.09x). From H = 64 at T >= 4 the step stays (0.66-0.98x). Between the
# measured T the ratio held at every point, so a row spans them; T > 256 keeps the step.
# benchmarks/results/decode_paged_f16dot.md: T = 1, H = 128 (kh16n64w8 11.8 vs the step's 13.1
# us); decode_paged_f16dot_splits.md: T = 16, H = 64 (kh16n32w4 at S = 4: 30.6 vs 37.9 us).
AUTO_V3_WINDOWS = ((1, 256, 1, 16, 640), (1, 16, 1, 16, 256), (1, 1, 1, 64, 640), (64, 64, 64, 64, 256),
                   (1, 1, 128, 128, 640), (16, 16, 64, 64, 640))

# Where auto runs the v3 form with a config whose shared memory (paged_f16dot.V4_SMEM_BYTES)
# only some Ampere parts hold: taken where the device's blocks may opt into it (an A100: 163
# KiB), else the shape keeps its other choice. Rows (T_lo, T_hi, H_lo, H_hi, K, config).
# benchmarks/results/decode_paged_f16dot.md (132 SMs, kh32n64w8 against the workspace step):
# H = 64, K 640: T = 4 14.5 vs 16.5 us, T = 64 74.2 vs 93.2, T = 128 150 vs 172, T = 256 295 vs
# 324 (T = 16 even, T = 1 slower); K 256: T = 64, H = 64 32.5 vs 40.7 (kh16n32w4), T = 128,
# H = 128 132 vs 149.
# benchmarks/results/decode_sms_call1.md (132 / 112 / 104 SMs, same run): T = 16, H = 64: kh32n64w8
# 27.5 / 33.4 / 34.0 us against kh16n32w4's 30.7 / 39.4 / 39.6; T = 4..16, H = 128 against the
# step: T = 4 20.6 / 20.4 / 20.5 vs 20.5 / 23.5 / 24.0, T = 16 41.1 / 59.8 / 64.0 vs 51.5 / 70.1 / 71.1.
AUTO_V3_SMEM_WINDOWS = ((4, 4, 64, 64, 640, "kh32n64w8"), (16, 16, 64, 64, 640, "kh32n64w8"),
                        (48, 256, 64, 64, 640, "kh32n64w8"), (64, 64, 64, 64, 256, "kh32n64w8"),
                        (128, 128, 128, 128, 256, "kh32n64w8"), (4, 16, 128, 128, 640, "kh32n64w8"))

# Which v3-form config auto runs outside AUTO_V3_SMEM_WINDOWS, first match wins (measured at 132
# SMs; on the plan's SM count dispatch.decode.v3_sm_config may take another where its cost model,
# V3_COST, says the window's config is more than V3_CONFIG_MARGIN slower there). Rows
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
# Elsewhere paged_chunk128 (dispatch.decode.v3_config_name): 16-key blocks for one token at
# H <= 16 (T = 1: 8.0 vs 9.2-9.3 us at 32 keys), 32-key blocks elsewhere (T = 4, H = 8: 9.6 vs
# paged_f16dot's 9.7).
V3_CONFIG_WINDOWS = (
    (48, 96, 1, 16, 640, "kh16n64w8"),
    (16, 256, 1, 16, 640, "kh16n32w4"),
    (16, 16, 64, 64, 640, "kh16n32w4"),
    (1, 1, 128, 128, 640, "kh16n64w8"),
    (64, 64, 64, 64, 256, "kh16n32w4"),
)

TABLES = ("AUTO_FUSED_WINDOWS", "AUTO_V3_WINDOWS", "AUTO_V3_SMEM_WINDOWS", "V3_CONFIG_WINDOWS")

