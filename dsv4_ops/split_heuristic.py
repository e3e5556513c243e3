"""How many splits of the key axis a sparse-MLA decode uses: static shapes only, no host sync.

    head_blocks = cdiv(H, BLOCK_H)                 (BLOCK_H = 16: heads a program holds)
    splits      = cdiv(TARGET_CTAS, T * head_blocks), clamped to [1, max_splits(K)]
    max_splits  = min(cdiv(K, PARTITION_N), MAX_SPLITS)   (one key block of 16 per split at most)

TARGET_CTAS = 256 is about two waves on an A100 (108 SMs) or an H200 (132 SMs). The (shape,
splits) pairs are pinned in tests/test_split_heuristic.py; benchmarks/bench_attention.py
sweeps every split count on the GPU so a retune is deliberate.
"""

from __future__ import annotations

from .csrc_triton.sparse_mla import MAX_SPLITS, PARTITION_N, SPLIT_CONFIG

TARGET_CTAS = 256
BLOCK_H = SPLIT_CONFIG["portable"]["BLOCK_H"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_splits(K: int) -> int:
    """The largest split count worth launching for K key positions (>= 1)."""
    return max(1, min(_cdiv(int(K), PARTITION_N), MAX_SPLITS))


def num_splits(T: int, H: int, K: int) -> int:
    """Splits for T tokens, H query heads and K key positions a token (static shapes)."""
    ctas = max(1, int(T)) * _cdiv(max(1, int(H)), BLOCK_H)
    return max(1, min(_cdiv(TARGET_CTAS, ctas), max_splits(K)))
