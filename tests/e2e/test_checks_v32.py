"""The e2e's top-k validity rule (checks_v32.valid_top_k) on fresh random scores: it accepts any
tie-break at the k-th score and rejects a swapped, short or repeated choice."""

from __future__ import annotations

import os

import torch

try:
    from .checks_v32 import valid_top_k
except ImportError:  # tests/e2e collected as a rootdir (no package)
    from checks_v32 import valid_top_k


def _scores(seed, n=300, levels=40):
    g = torch.Generator().manual_seed(seed)
    # few distinct values, as E4M3 products give: ties at the k-th score are common
    return torch.randint(0, levels, (n,), generator=g).double() / levels


def test_every_tie_break_is_valid_and_a_wrong_choice_is_not():
    seed = int.from_bytes(os.urandom(4), "little")
    score, k = _scores(seed), 128
    order = score.sort(descending=True, stable=True).indices.tolist()
    kth = float(score[order[k - 1]])
    above = [i for i in range(len(score)) if score[i] > kth]
    tied = [i for i in range(len(score)) if score[i] == kth]
    other = above + tied[::-1][: k - len(above)]        # ties broken the other way
    for chosen in (order[:k], other):
        assert valid_top_k(score, chosen, k) == (True, len(tied) > 1), seed
    below = [i for i in range(len(score)) if score[i] < kth]
    swapped = order[1:k] + [below[0]]                        # best key out, a clearly lower one in
    assert not valid_top_k(score, swapped, k)[0], seed
    assert not valid_top_k(score, order[: k - 1], k)[0], seed
    assert not valid_top_k(score, order[: k - 1] + [order[0]], k)[0], seed


def test_a_rounding_difference_is_not_a_mismatch():
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    score, k = torch.rand(300, generator=g, dtype=torch.float64), 128
    order = score.sort(descending=True).indices.tolist()
    # the k-th and (k+1)-th within fp32 order of each other: either may be chosen
    score[order[k]] = score[order[k - 1]] - 1e-7
    assert valid_top_k(score, order[: k - 1] + [order[k]], k)[0], seed
