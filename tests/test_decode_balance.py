"""The balanced split of a decode step's key blocks (csrc_triton.decode.balance): the plan words the
planning kernel writes, read as the attention programs and the merge read them, against the module doc's
formula, on the interpreter (CPU) and on a GPU; the paged decode with it against float64 on ragged
batches; the rule that turns it on."""

import pytest
import torch
import dsv4_ops  # noqa: F401
from dsv4_ops import dispatch, envs, paged_decode, paged_plan, reference
from dsv4_ops.csrc_triton.decode import balance
from dsv4_ops.testing import assert_attention_close, poison_like, rng

from test_decode_paged import D, case, gpu_case


def probe(topk_len, swa_len, T, S, K1, K2, block_n, chunk, device):
    """Run the planning kernel over poisoned words and read them back as the kernels do: slots [T * S, 4]
    (t, s, n_t, first_t) of each slot (t = -1, n = 0 for a slot no token uses), tokens [T, 4]
    (t, 0, n_t, first_t) of each token's merge word."""
    P = T * S
    words = torch.full((balance.plan_words(T, S),), -7 << 12, dtype=torch.int32, device=device)
    balance._balance_plan_kernel[(1,)](topk_len, swa_len, words, T, S, K1, K2, block_n, topk_len is not None,
                                       swa_len is not None, chunk)
    w = words.cpu().tolist()
    tokens = torch.tensor([[t, 0, (x & 63) + 1, x >> 6] for t, x in enumerate(w[P:])], dtype=torch.int32)
    tokens = tokens.reshape(T, 4)
    slots = []
    for x in w[:P]:
        if x < 0:
            slots.append([-1, 0, 0, x])
        else:
            t, n = x >> 12, (x & 63) + 1
            slots.append([t, (x >> 6) & 63, n, int(tokens[t, 3])])
    return torch.tensor(slots, dtype=torch.int32).reshape(P, 4), tokens


def expected_splits(k1, k2, S, K1, K2, block_n):
    """The module doc's n_t from the tokens' lengths (python ints, clamped as the kernel clamps)."""
    nb = [-(-min(max(a, 0), K1) // block_n) + -(-min(max(b, 0), K2) // block_n) for a, b in zip(k1, k2)]
    T, W = len(nb), max(sum(nb), 1)
    return nb, [min(1 + n * (T * S - T) // W, max(n, 1), balance._MAX_SPLITS) for n in nb]


def check_map(slots, tokens, n_want, S):
    """Slot p runs split s of token t's n_t consecutive slots from first_t; the merge sees the same."""
    T = len(n_want)
    first = 0
    for t, n in enumerate(n_want):
        assert tokens[t].tolist() == [t, 0, n, first], (t, tokens[t].tolist(), n, first)
        for s in range(n):
            assert slots[first + s].tolist() == [t, s, n, first], (first + s, slots[first + s].tolist())
        first += n
    assert first <= T * S
    for p in range(first, T * S):  # slots no token uses: the word -1 exactly (never the poison)
        assert slots[p].tolist() == [-1, 0, 0, -1], (p, slots[p].tolist())


@pytest.mark.parametrize("chunk", [4, 256], ids=["chunks-of-4", "one-chunk"])
@pytest.mark.parametrize("T,S", [(1, 1), (1, 7), (6, 3), (13, 4), (9, 1)])
def test_the_slot_map_is_the_formulas(interpret, T, S, chunk):
    """Random lengths (some past K, negative, zero), the map of every slot and token as the doc says;
    several chunks carry the prefix over."""
    K1, K2, bn = 40, 9, 8
    g = rng(T * 10 + S)
    k1 = torch.randint(-3, K1 + 5, (T,), generator=g, dtype=torch.int32)
    k2 = torch.randint(-2, K2 + 3, (T,), generator=g, dtype=torch.int32)
    slots, tokens = probe(k1.to(interpret), k2.to(interpret), T, S, K1, K2, bn, chunk, interpret)
    _, n_want = expected_splits(k1.tolist(), k2.tolist(), S, K1, K2, bn)
    check_map(slots, tokens, n_want, S)


def test_equal_tokens_keep_the_plans_splits_and_ragged_ones_move_slots_to_the_long(interpret):
    """Every token full: n_t = S exactly (the unbalanced plan). One long token in 8 with the rest short:
    the long ones take more than S slots, the short fewer, and the longest split holds fewer blocks
    than S splits a token give it."""
    T, S, K1, K2, bn = 16, 3, 512, 128, 32
    full = torch.full((T,), K1, dtype=torch.int32)
    slots, tokens = probe(full.to(interpret), None, T, S, K1, K2, bn, 256, interpret)
    assert tokens[:, 2].tolist() == [S] * T
    check_map(slots, tokens, [S] * T, S)
    ragged = torch.full((T,), 32, dtype=torch.int32)
    ragged[::8] = K1
    slots, tokens = probe(ragged.to(interpret), None, T, S, K1, K2, bn, 256, interpret)
    nb, n_want = expected_splits(ragged.tolist(), [K2] * T, S, K1, K2, bn)
    check_map(slots, tokens, n_want, S)
    n = tokens[:, 2]
    assert (n[::8] > S).all() and (n[1:8] < S).all()
    longest = max(-(-b // m) for b, m in zip(nb, n.tolist()))
    assert longest < -(-nb[0] // S)


def test_no_keys_anywhere_gives_each_token_one_empty_split(interpret):
    T, S = 5, 4
    zero = torch.zeros(T, dtype=torch.int32)
    slots, tokens = probe(zero.to(interpret), zero.to(interpret), T, S, 16, 8, 8, 256, interpret)
    check_map(slots, tokens, [1] * T, S)


@pytest.mark.parametrize("config,splits", [("kh16n32w4", 3), ("kh32n64w8", 3), ("kh16n16w4", 2)])
def test_ragged_batch_matches_float64_balanced_and_not(interpret, config, splits, monkeypatch):
    """A ragged batch (one long token, short ones, one with no key, one past the top-k width) through
    the paged op with the balance on and off: both equal the float64 reference, and the
    plan says which ran. kh16n16w4 at S = 2: the long tokens take 3 partials, more than the merge's
    BLOCK_S = 2 a step."""
    T, H = 7, 8
    args = case(T, H, 40, 9, seed=61, device=interpret)
    args["topk_length"] = torch.tensor([40, 2, 0, 45, 1, 3, 0, 9], dtype=torch.int32).to(interpret)
    args["swa_length"] = torch.tensor([9, 1, 0, 9, 0, 2, 1], dtype=torch.int32).to(interpret)
    want, want_lse = reference.ref_dsv4_decode_fused(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                        for k, v in args.items()}, out_dtype=torch.float64)
    seen = []
    make = paged_plan.make_paged_plan

    def spy(*a, **k):
        p = make(*a, **k)
        seen.append(p.balanced)
        return p

    monkeypatch.setattr(paged_plan, "make_paged_plan", spy)
    for flag in ("1", "0"):
        with envs.override(**{envs.DECODE_BALANCE: flag}):
            out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=interpret))
            _, lse = paged_decode.dsv4_decode_fused(**args, num_splits=splits, out=out, config=config)
            assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)
    assert seen == [True, False]
    if splits == 2:
        bn = dispatch.decode.v3_config(config)["BLOCK_N"]
        _, n = expected_splits(args["topk_length"][:T].tolist(), args["swa_length"].tolist(), splits, 40, 9, bn)
        assert max(n) == 3, n


def test_the_rule_balances_split_launches_with_lengths_and_int32_slots_only_when_asked():
    dd = dispatch.decode
    assert not dd.balanced(False, True, True)  # off by default
    with envs.override(**{envs.DECODE_BALANCE: "1"}):
        assert dd.balanced(False, True, True)
        assert not dd.balanced(True, True, True)  # direct: no partials to balance
        assert not dd.balanced(False, False, True)  # no lengths: every token full
        assert not dd.balanced(False, True, False)  # int64 slots: not the AOT-checked forms
        # T must fit the plan words' token field
        assert dd.balanced(False, True, True, balance.MAX_TOKENS - 1)
        assert not dd.balanced(False, True, True, balance.MAX_TOKENS)
        with envs.override(**{envs.BATCH_INVARIANT: "1"}):  # a token's splits would follow the others'
            assert not dd.balanced(False, True, True)


def test_the_plan_balances_only_paged_f16dot_splits_over_aligned_caches():
    """plan_step applies the rule to paged_f16dot plans only: a paged_chunk128 plan (its config, or
    the one a paged_f16dot config falls back to over unaligned caches or odd block sizes) never
    balances; a balanced plan says so in its reasons."""
    dd = dispatch.decode
    with envs.override(**{envs.DECODE_BALANCE: "1"}):
        p = dd.plan_step(16, 8, 640, 108, 163 * 1024, (64, 64), splits=3, config="kh16n32w4", lengths=True)
        assert p.balanced and p.why.endswith("; balanced")
        for kw in (dict(config="h16n32w4"), dict(config="kh16n32w4", aligned=False),
                   dict(config="kh16n32w4", block_sizes=(48, 64)), dict(config="kh16n32w4", int32_slots=False),
                   dict(config="kh16n32w4", lengths=False), dict(config="kh16n32w4", splits=1)):
            kw = dict(dict(block_sizes=(64, 64), splits=3, lengths=True), **kw)
            p = dd.plan_step(16, 8, 640, 108, 163 * 1024, **kw)
            assert not p.balanced and "balanced" not in p.why, kw
        T = balance.MAX_TOKENS
        assert not dd.plan_step(T, 8, 640, 108, 163 * 1024, (64, 64), splits=3, config="kh16n32w4",
                                lengths=True).balanced


# ---- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T,S", [(300, 3), (64, 5), (2, 40)])
def test_gpu_the_slot_map_is_the_formulas(variant, T, S):
    """Compiled: the map of every slot and token (T = 300: three chunks of 128)."""
    g = rng(T + S)
    k1 = torch.randint(0, 530, (T,), generator=g, dtype=torch.int32)
    k2 = torch.randint(0, 130, (T,), generator=g, dtype=torch.int32)
    slots, tokens = probe(k1.cuda(), k2.cuda(), T, S, 512, 128, 32, paged_plan.BALANCE_CHUNK, "cuda")
    _, n_want = expected_splits(k1.tolist(), k2.tolist(), S, 512, 128, 32)
    check_map(slots, tokens, n_want, S)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["kh16n32w4", "kh16n64w8", "kh32n64w8"])
@pytest.mark.parametrize("T,H,splits", [(64, 8, 3), (300, 8, 2), (33, 64, 4), (7, 5, 3)])
def test_gpu_ragged_batches_match_float64(variant, config, T, H, splits):
    """The DSv4 shape, one token in 8 long and the rest short (some with no key), balanced (T = 64, S = 3:
    the long tokens take 6 partials, two merge steps of 4; T * S * H = 105: the plan words start past a
    rounded-up offset)."""
    args = gpu_case(T, H, seed=T + H)
    tl_ = torch.randint(0, 40, (T,), generator=rng(T), dtype=torch.int32)
    tl_[::8] = 512
    tl_[5::11] = 0
    args["topk_length"] = tl_.cuda()
    args["swa_length"] = torch.where(tl_ == 0, 0, 128).to(torch.int32).cuda()
    out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda"))
    planned = sum(paged_plan._balance_plan.stats.values())
    with envs.override(**{envs.DECODE_BALANCE: "1"}):
        _, lse = paged_decode.dsv4_decode_fused(**args, num_splits=splits, out=out, config=config)
    assert sum(paged_plan._balance_plan.stats.values()) == planned + 1  # the balanced form ran
    want, want_lse = reference.ref_dsv4_decode_fused(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                        for k, v in args.items()}, out_dtype=torch.float64)
    assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)


def _launch(p, args, out, step_plans):
    """launch_paged of plan p on the case's tensors, partials allocated as the op allocates them."""
    o_part, lse_part = (torch.empty(s, dtype=torch.float32, device=out.device) for s in p.partials_shape())
    lse = torch.empty(p.T, p.H, dtype=torch.float32, device=out.device)
    sink = args["sink"].float() if args["sink"] is not None else None
    paged_plan.launch_paged(p, args["q"], args["compressed_cache"], args["topk_slots"], args["topk_length"],
                            args["swa_cache"], args["swa_slots"], args["swa_length"], sink, args["sm_scale"], out,
                            lse, o_part, lse_part, step_plans=step_plans)
    return lse


def test_step_plans_plan_once_a_step_and_a_stale_plan_keeps_the_result(interpret, monkeypatch):
    """With a step's dict the first call plans and the next reuses its words (no planning launch); the
    reused words came from other lengths, and the output is still the float64 reference of the second
    call's lengths (the plan sets only the balance)."""
    T, H = 7, 8
    args = case(T, H, 40, 9, seed=62, device=interpret)
    first_len = torch.tensor([40, 2, 0, 45, 1, 3, 0], dtype=torch.int32)
    second_len = torch.tensor([1, 40, 38, 0, 40, 2, 7], dtype=torch.int32)
    args["swa_length"] = torch.tensor([9, 1, 0, 9, 0, 2, 1], dtype=torch.int32).to(interpret)
    plans = {}
    launches = []
    real = paged_plan._balance_plan.__class__.__call__
    monkeypatch.setattr(paged_plan._balance_plan.__class__, "__call__",
                        lambda self, *a, **k: (launches.append(self.fn.__name__), real(self, *a, **k))[1])
    with envs.override(**{envs.DECODE_BALANCE: "1"}):
        for lens in (first_len, second_len):
            args["topk_length"] = lens.to(interpret)
            out = poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device=interpret))
            p = paged_plan.make_paged_plan(args["q"], args["compressed_cache"], args["topk_slots"],
                                           args["topk_length"], args["compressed_block_size"], args["swa_cache"],
                                           args["swa_slots"], args["swa_length"], args["swa_block_size"],
                                           args["sink"] is not None, 2, out, "portable", "kh16n16w4")
            assert p.balanced
            lse = _launch(p, args, out, plans)
            want, want_lse = reference.ref_dsv4_decode_fused(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                                for k, v in args.items()}, out_dtype=torch.float64)
            assert_attention_close(out.cpu(), lse.cpu(), want, want_lse)
    assert launches.count("_balance_plan_kernel") == 1 and len(plans) == 1
    n_first = expected_splits(first_len.tolist(), args["swa_length"].tolist(), 2, 40, 9, 16)[1]
    n_second = expected_splits(second_len.tolist(), args["swa_length"].tolist(), 2, 40, 9, 16)[1]
    assert n_first != n_second  # the second call really ran on the first call's plan


@pytest.mark.gpu
def test_gpu_step_plans_in_a_cuda_graph_plan_once_and_follow_new_lengths(variant):
    """The composite (the plugin's call) with one step dict, three layers captured in one CUDA graph: one
    planning launch in the graph; replayed after the lengths change in place, every layer equals the
    float64 reference of the new lengths."""
    from dsv4_ops import dsv4_decode

    T, H = 64, 8
    args = gpu_case(T, H, seed=9)
    lens = torch.randint(0, 40, (T,), generator=rng(3), dtype=torch.int32)
    lens[::8] = 512
    args["topk_length"] = lens.cuda()
    args["swa_length"] = torch.full((T,), 128, dtype=torch.int32, device="cuda")
    outs = [poison_like(torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")) for _ in range(3)]

    def layers(plans):
        for out in outs:
            dsv4_decode.dsv4_decode_attention(
                args["q"], args["compressed_cache"], args["topk_slots"], args["swa_cache"], args["swa_slots"],
                args["sink"], args["sm_scale"], args["compressed_block_size"], args["swa_block_size"],
                topk_length=args["topk_length"], num_splits=3, swa_length=args["swa_length"], out=out,
                return_lse=False, step_plans=plans)

    with envs.override(**{envs.DECODE_BALANCE: "1", dispatch.decode.ENV_VAR: "v3"}):
        layers({})  # compiles, outside the graph
        torch.cuda.synchronize()
        planned = sum(paged_plan._balance_plan.stats.values())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layers({})
        assert sum(paged_plan._balance_plan.stats.values()) == planned + 1
        new = torch.randint(0, 512, (T,), generator=rng(4), dtype=torch.int32)
        new[1::5] = 0
        args["topk_length"].copy_(new.cuda())
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    want, _ = reference.ref_dsv4_decode_fused(
        **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}, out_dtype=torch.float64)
    for out in outs:
        assert_attention_close(out, None, want, None)
