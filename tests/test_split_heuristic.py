"""The split-count heuristic: pinned (shape -> splits) pairs, so that a retune is deliberate.

The pinned values are the heuristic's output; benchmarks/bench_attention.py sweeps every
split count on the GPU (portable variant) and reports, per shape, the best count and the
heuristic's time ratio to it (goal: within 5%). Change a pinned value only with a sweep.
"""

import pytest

from dsv4_ops import split_heuristic
from dsv4_ops.csrc_triton.sparse_mla import MAX_SPLITS

# (T, H, K) -> splits; K = 640 = 512 top-k + 128 window.
PINNED = {
    (1, 64, 640): 40, (2, 64, 640): 32, (4, 64, 640): 16, (8, 64, 640): 8,
    (16, 64, 640): 4, (32, 64, 640): 2, (64, 64, 640): 1,
    (1, 8, 640): 40, (2, 8, 640): 40, (4, 8, 640): 40, (8, 8, 640): 32,
    (16, 8, 640): 16, (32, 8, 640): 8, (64, 8, 640): 4,
}


@pytest.mark.parametrize("shape,splits", sorted(PINNED.items()))
def test_pinned_split_counts(shape, splits):
    assert split_heuristic.num_splits(*shape) == splits


def test_max_splits_is_the_number_of_key_blocks_capped():
    assert split_heuristic.max_splits(640) == 40
    assert split_heuristic.max_splits(16) == 1
    assert split_heuristic.max_splits(17) == 2
    assert split_heuristic.max_splits(100) == 7
    assert split_heuristic.max_splits(2048) == MAX_SPLITS
    assert split_heuristic.max_splits(0) == 1


@pytest.mark.parametrize("T", [1, 2, 3, 8, 64, 1000])
@pytest.mark.parametrize("H", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("K", [0, 16, 100, 640, 2048])
def test_heuristic_bounds(T, H, K):
    s = split_heuristic.num_splits(T, H, K)
    assert 1 <= s <= split_heuristic.max_splits(K)
    # about TARGET_CTAS programs in all, unless the key blocks bound it
    ctas = T * -(-H // split_heuristic.BLOCK_H) * s
    assert ctas >= split_heuristic.TARGET_CTAS or s == split_heuristic.max_splits(K)
    if s > 1:
        assert ctas - T * -(-H // split_heuristic.BLOCK_H) < split_heuristic.TARGET_CTAS


def test_heads_below_a_tile_are_not_padded_to_64():
    # H = 8 (TP = 8) is one head tile, like H = 16; H = 64 is four
    assert split_heuristic.num_splits(8, 8, 640) == split_heuristic.num_splits(8, 16, 640)
    assert split_heuristic.num_splits(8, 8, 640) == 4 * split_heuristic.num_splits(8, 64, 640)
