"""The e2e's discontinuous-choice rules on fresh random inputs: the top-k validity rule
(checks_v32.valid_top_k) accepts any tie-break at the k-th score and rejects a swapped, short or
repeated choice; the routing rule (v32_checkpoint.force_route / route_margin, checks.route_check)
teacher-forces the oracle on vLLM's experts exactly where the float64 margin is within the cut
and counts every other token whose experts differ."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # checks.py imports its siblings by name

import checks  # noqa: E402
import v32_checkpoint  # noqa: E402
from checks_v32 import valid_top_k  # noqa: E402


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


def _gate(E, k, groups=1, topk_group=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(top_k=k, num_group=groups, topk_group=topk_group, norm_topk_prob=True,
                           routed_scaling_factor=1.5, e_score_correction_bias=0.1 * torch.randn(E, generator=g))


def _logits_with_margin(gate, margin: float, g) -> torch.Tensor:
    """Router logits [E] (f32, as transformers' router) whose bias-corrected key has the k-th minus
    the (k+1)-th gap ``margin``."""
    E, k = gate.e_score_correction_bias.shape[0], gate.top_k
    key = torch.rand(E, generator=g, dtype=torch.float64) * 0.5 + 0.2
    order = key.argsort(descending=True)
    key[order[k]] = key[order[k - 1]] - margin
    key[order[k + 1:]] = key[order[k + 1:]].clamp(max=float(key[order[k]]) - 0.05)
    s = (key - gate.e_score_correction_bias.double()).clamp(1e-3, 1 - 1e-3)
    return torch.logit(s).float()


def test_near_ties_take_vllms_experts_and_clear_flips_are_counted():
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    gate, cut = _gate(8, 2, seed=seed), 0.03
    # rows: clear margin, near-tie, near-tie whose vLLM choice was not recorded, clear and agreeing
    margins_set = (0.2, 0.004, 0.004, 0.2)
    logits = torch.stack([_logits_with_margin(gate, m, g) for m in margins_set])
    margin = v32_checkpoint.route_margin(gate, logits)
    assert torch.allclose(margin, torch.tensor(margins_set, dtype=torch.float64), atol=1e-5), (seed, margin)
    key = logits.double().sigmoid() + gate.e_score_correction_bias.double()
    own = key.topk(2, dim=-1).indices
    runner_up = key.topk(3, dim=-1).indices[:, 2]
    swapped = torch.stack((own[:, 0], runner_up), 1)          # the k-th expert traded for the next one
    forced = torch.stack((swapped[0], swapped[1], torch.tensor([-1, -1]), own[3].flip(0)))
    weights, ids, taken = v32_checkpoint.force_route(gate, logits, own, forced, margin, cut)
    assert taken.tolist() == [False, True, False, False], (seed, taken)
    assert torch.equal(ids[1], swapped[1]) and torch.equal(ids[[0, 2, 3]], own[[0, 2, 3]]), (seed, ids)
    # vLLM's experts weighed as the router weighs: uncorrected sigmoid scores, renormalised, x 1.5
    s = logits.sigmoid().gather(1, ids)
    assert torch.allclose(weights, 1.5 * s / s.sum(-1, keepdim=True), rtol=1e-6), seed
    # the must-match side: row 0 clear and different (counted), row 1 a near-tie (free), row 3 the
    # same experts in another order (not a mismatch)
    mismatch, clear = checks.route_check(forced[[0, 1, 3]], own[[0, 1, 3]], margin[[0, 1, 3]], cut)
    assert mismatch == 1 and clear.tolist() == [True, False, True], (seed, mismatch, clear)


def test_the_margin_is_the_nearest_flip_with_groups():
    """With more groups than topk_group, a choice may also flip when a kept group trades places
    with a dropped one: the margin is the smaller of the two gaps. Brute force: no key moved by
    less than the margin changes the kept groups or the experts, and two keys moved just over half
    of it in opposite directions change one of them."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    gate = _gate(8, 2, groups=4, topk_group=2, seed=seed)
    logits = torch.randn(64, 8, generator=g)
    margin = v32_checkpoint.route_margin(gate, logits)
    key = logits.double().sigmoid() + gate.e_score_correction_bias.double()

    def choose(kk):   # (the kept groups, the experts)
        grp = kk.view(-1, 4, 2).topk(2, dim=-1).values.sum(-1)
        gi = grp.topk(2, dim=-1).indices
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter_(1, gi, True)
        experts = kk.masked_fill(~keep.repeat_interleave(2, 1), float("-inf")).topk(2, dim=-1).indices
        return frozenset(gi[0].tolist()), frozenset(experts[0].tolist())

    for t in range(key.shape[0]):
        base = choose(key[t:t + 1])
        # nudging any one key by less than the margin (either way) never changes the choice
        for e in range(8):
            for d in (-0.999, 0.999):
                kk = key[t:t + 1].clone()
                kk[0, e] += d * float(margin[t])
                assert choose(kk) == base, (seed, t, e, d, float(margin[t]))
        # and the margin is reached: some pair moved a bit over half of it each way changes the groups
        # or the experts
        assert any(choose(_nudged(key[t:t + 1], a, b, 0.51 * float(margin[t]))) != base
                   for a in range(8) for b in range(8) if a != b), (seed, t)


def _nudged(key, up: int, down: int, d: float) -> torch.Tensor:
    kk = key.clone()
    kk[0, up] += d
    kk[0, down] -= d
    return kk
