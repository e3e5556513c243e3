"""The split-count heuristic: pinned (shape -> splits) pairs, so that a retune is deliberate.

benchmarks/bench_attention.py sweeps every split count on the GPU (portable variant) and
reports, per shape, the best count and the heuristic's time ratio to it (goal: within 5%).
Change a pinned value only with a sweep.
"""

import pytest

from dsv4_ops import dispatch
from dsv4_ops.csrc_triton.decode.tiles import MAX_SPLITS

# (T, H, K) -> splits; K = 640 = 512 top-k + 128 window. Each value is within 5% of the best
# count of the H200 sweep (portable), benchmarks/results/attention_split_sweep.md.
PINNED = {
    (1, 64, 640): 20, (2, 64, 640): 14, (4, 64, 640): 14, (8, 64, 640): 8,
    (16, 64, 640): 8, (32, 64, 640): 4, (64, 64, 640): 2,
    (1, 8, 640): 40, (2, 8, 640): 40, (4, 8, 640): 20, (8, 8, 640): 14,
    (16, 8, 640): 14, (32, 8, 640): 8, (64, 8, 640): 8,
}


@pytest.mark.parametrize("shape,splits", sorted(PINNED.items()))
def test_pinned_split_counts(shape, splits):
    assert dispatch.workspace.tile_splits(*shape) == splits


def test_max_splits_is_the_number_of_key_blocks_capped():
    assert dispatch.workspace.tile_max_splits(640) == 40
    assert dispatch.workspace.tile_max_splits(16) == 1
    assert dispatch.workspace.tile_max_splits(17) == 2
    assert dispatch.workspace.tile_max_splits(100) == 7
    assert dispatch.workspace.tile_max_splits(2048) == MAX_SPLITS
    assert dispatch.workspace.tile_max_splits(0) == 1


@pytest.mark.parametrize("T", [1, 2, 3, 8, 64, 1000])
@pytest.mark.parametrize("H", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("K", [0, 16, 100, 640, 2048])
def test_heuristic_bounds_and_balance(T, H, K):
    s = dispatch.workspace.tile_splits(T, H, K)
    assert 1 <= s <= dispatch.workspace.tile_max_splits(K)
    nb = max(1, -(-K // 16))
    longest = -(-nb // s)
    # balanced: one split fewer would make the longest split longer (or s is at the cap)
    assert s == 1 or -(-nb // (s - 1)) > longest or s == dispatch.workspace.tile_max_splits(K)
    # the programs launched stay near the target: not more than one longest-split's worth over it
    w = T * -(-H // dispatch.workspace.TILE_BLOCK_H)
    assert w * s <= dispatch.workspace.target_programs(w) + w * longest or s == 1


def test_target_grows_with_programs():
    targets = [dispatch.workspace.target_programs(w) for w in (1, 8, 9, 32, 33, 4096)]
    assert targets == sorted(targets) and targets[0] == 128 and targets[-1] == 512


def test_heads_below_a_tile_are_not_padded_to_64():
    # H = 8 (TP = 8) is one head tile, like H = 16; H = 64 is four
    assert dispatch.workspace.tile_splits(8, 8, 640) == dispatch.workspace.tile_splits(8, 16, 640)
    assert dispatch.workspace.tile_splits(2, 64, 640) == dispatch.workspace.tile_splits(8, 16, 640)
