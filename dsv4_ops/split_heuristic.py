"""How many splits of the key axis a sparse-MLA decode uses: static shapes only, no host sync.

    programs    W  = T * cdiv(H, BLOCK_H)                (BLOCK_H = 16 heads a program holds)
    key blocks  nb = cdiv(K, PARTITION_N)                (16 keys a block)
    target      C  = 128 if W <= 8, 256 if W <= 32, else 512   (programs in all)
    blocks/split b = ceil(nb * W / C)   -> splits = cdiv(nb, b), at most MAX_SPLITS

Balanced rounding: a split count is only worth what its longest split costs (ceil(nb / S)
key blocks), so the heuristic picks the smallest S with that longest split: at nb = 40,
S = 40, 20, 14, 10, 8, 7, 6, 5, 4, 3, 2, 1 are the only counts it returns.
The target grows with W because at small W the merge and the per-program q load dominate,
and at large W more programs hide the gather latency. Fitted to the H200 sweep of the
portable kernel (benchmarks/results/attention_split_sweep.md): all 14 pinned shapes of
tests/test_split_heuristic.py land within 5% of the best count measured there. Not tuned on
an A100 (108 SMs instead of 132): the pinned table is the thing to re-measure there.
"""

from __future__ import annotations

from .csrc_triton.sparse_mla import MAX_SPLITS, PARTITION_N, SPLIT_CONFIG

BLOCK_H = SPLIT_CONFIG["portable"]["BLOCK_H"]
# (largest W, programs in all) steps of the target.
TARGET_STEPS = ((8, 128), (32, 256))
TARGET_LARGE = 512


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_splits(K: int) -> int:
    """The largest split count worth launching for K key positions (>= 1)."""
    return max(1, min(_cdiv(int(K), PARTITION_N), MAX_SPLITS))


def target_programs(programs: int) -> int:
    """Programs in all the split kernel should launch, for T * cdiv(H, BLOCK_H) = programs."""
    for bound, target in TARGET_STEPS:
        if programs <= bound:
            return target
    return TARGET_LARGE


def num_splits(T: int, H: int, K: int) -> int:
    """Splits for T tokens, H query heads and K key positions a token (static shapes)."""
    w = max(1, int(T)) * _cdiv(max(1, int(H)), BLOCK_H)
    nb = _cdiv(max(1, int(K)), PARTITION_N)
    per_split = max(1, _cdiv(nb * w, target_programs(w)))  # key blocks of the longest split
    return max(1, min(_cdiv(nb, per_split), max_splits(K)))
