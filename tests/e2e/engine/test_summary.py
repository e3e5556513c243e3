"""The engine run's cross-run rules (CPU, no vLLM engine): where two greedy runs part and on
what gap, and which first tokens the float64 oracle checks."""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import first_token  # noqa: E402
import summary  # noqa: E402


def _runs(seed):
    rng = random.Random(seed)
    ref = [[rng.randrange(500) for _ in range(8)] for _ in range(4)]
    gaps = [[round(rng.uniform(0.001, 1.0), 4) for _ in range(8)] for _ in range(4)]
    return rng, ref, gaps


def test_parting_names_the_first_differing_position_and_its_gap():
    rng, ref, gaps = _runs(1)
    other = [list(t) for t in ref]
    assert summary.parting(ref, gaps, other) == []
    i, j = rng.randrange(4), rng.randrange(8)
    other[i][j] = (other[i][j] + 1) % 500
    other[i][-1] = (other[i][-1] + 7) % 500          # later differences follow from the first
    assert summary.parting(ref, gaps, other) == [(i, j, gaps[i][j], summary.TIE)]


def test_only_near_ties_are_excused():
    _, ref, gaps = _runs(2)
    gaps[0][3], gaps[1][5] = summary.TIE / 2, summary.TIE * 4
    tie, wide = [list(t) for t in ref], [list(t) for t in ref]
    tie[0][3] += 1
    wide[1][5] += 1
    assert summary.near_ties_only(summary.parting(ref, gaps, tie))
    assert not summary.near_ties_only(summary.parting(ref, gaps, wide))
    assert not summary.near_ties_only(summary.parting(ref, None, tie))   # no gap recorded: not excused
    assert not summary.near_ties_only([])


def test_with_raw_logits_a_near_tie_is_a_few_bf16_spacings_of_the_top_logit():
    rng, ref, gaps = _runs(7)
    top = rng.choice([-1, 1]) * rng.uniform(4.0, 7.99)            # bf16 spacing there: 1/32
    logits = [[[(t, top), (t + 1, top - g)] for t, g in zip(p, gp)] for p, gp in zip(ref, gaps)]
    assert summary.bf16_ulp(top) == 2.0 ** -5 and summary.bf16_ulp(-0.75) == 2.0 ** -8
    gaps[0][3], gaps[1][5] = summary.TIE_ULPS / 32, (summary.TIE_ULPS + 1) / 32
    tie, wide = [list(t) for t in ref], [list(t) for t in ref]
    tie[0][3] += 1
    wide[1][5] += 1
    pt = summary.parting(ref, gaps, tie, logits)
    assert pt == [(0, 3, gaps[0][3], summary.TIE_ULPS / 32)] and summary.near_ties_only(pt)
    assert not summary.near_ties_only(summary.parting(ref, gaps, wide, logits))
    assert summary.logits_of(dict(top2=logits)) is None                  # logprobs, not logits
    assert summary.logits_of(dict(top2=logits, engine_kwargs=dict(logprobs_mode="raw_logits"))) is logits


def test_first_token_check_counts_clear_selection_free_prompts_only():
    m = first_token.CLEAR_MARGIN
    oracle = [dict(top=[5, 6], margin=2 * m, selection_free=True),
              dict(top=[7, 8], margin=2 * m, selection_free=True),
              dict(top=[9, 1], margin=m / 2, selection_free=True),     # unclear
              dict(top=[3, 4], margin=2 * m, selection_free=False)]    # the indexer selects
    ag = first_token.agreement(oracle, [[5], [8], [2], [0]])
    assert (ag["clear"], ag["agree"], ag["wrong"], ag["runner_up_where_wrong"]) == (2, 1, [1], [True])
    assert ag["unclear"] == [2]
    assert (ag["selected"], ag["selected_agree"], ag["selected_wrong"]) == (1, 0, [3])


def test_dense_len_follows_the_indexer():
    assert first_token.dense_len(dict(index_topk=128)) == 128
    assert first_token.dense_len(dict(index_topk=8, compress_rates={"compressed_sparse_attention": 4})) == 32


def _write(d, name, **r):
    import json

    r.setdefault("mode", "eager")
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(r, f)


def test_serve_only_run_is_compared_with_the_eager_runs_second_prompt(tmp_path, capsys):
    rng, ref, gaps = _runs(3)
    _write(tmp_path, "v41e", model="v41", tokens=ref, margins=gaps)
    _write(tmp_path, "v41s", model="v41", serve=dict(token_ids=list(ref[1]), ready_s=9.0, exit_rc=0))
    with open(os.path.join(tmp_path, "v41s.json.serve.log"), "w") as f:
        f.write("INFO dsv4_ops plugin (pid 4242): capability sm_80\n")
    assert summary.main(str(tmp_path)) == 0
    shown = capsys.readouterr().out
    assert "tokens == LLM.generate (the 13-prompt batch): True" in shown and "4242" in shown   # the server's pid is read
    wrong = list(ref[1])
    wrong[rng.randrange(len(wrong))] += 1
    _write(tmp_path, "v41s", model="v41", serve=dict(token_ids=wrong, ready_s=9.0, exit_rc=0))
    assert summary.main(str(tmp_path)) == 1
    _write(tmp_path, "v41s", model="v41", serve=dict(error="server exited rc=1 before ready"))
    assert summary.main(str(tmp_path)) == 1


def test_serve_is_compared_exactly_with_the_solo_pass_where_the_eager_run_has_one(tmp_path, capsys):
    """The server runs the prompt alone: its tokens must equal the eager run's solo pass of that
    prompt, not the 13-prompt batch's tokens (which may part on a near-tie)."""
    rng, ref, gaps = _runs(5)
    solo = list(ref[summary.SERVED])
    solo[rng.randrange(1, len(solo))] += 1             # the batch of 13 parted from the solo run
    _write(tmp_path, "v41e", model="v41", tokens=ref, margins=gaps, solo_tokens=solo)
    _write(tmp_path, "v41s", model="v41", serve=dict(token_ids=solo, ready_s=9.0, exit_rc=0))
    assert summary.main(str(tmp_path)) == 0
    assert "LLM.generate (its solo pass): True" in capsys.readouterr().out
    _write(tmp_path, "v41s", model="v41", serve=dict(token_ids=list(ref[summary.SERVED]), ready_s=9.0, exit_rc=0))
    assert summary.main(str(tmp_path)) == 1


def test_drift_is_the_largest_shared_token_logprob_move_before_the_parting():
    rng, ref, gaps = _runs(4)
    a = [[[(t, -rng.uniform(0.1, 2.0)), (t + 1, -3.0)] for t in p] for p in ref]
    b = [[[(t, lp + rng.uniform(-0.01, 0.01)), alt] for (t, lp), alt in p] for p in a]
    b[2][1] = [(b[2][1][0][0], a[2][1][0][1] - 0.2), b[2][1][1]]    # the largest move, before the parting
    b[2][4] = [(b[2][4][0][0] + 1, -0.5), b[2][4][1]]               # the parting
    other = [[x[0][0] for x in p] for p in b]
    pt = summary.parting(ref, gaps, other)
    assert pt == [(2, 4, gaps[2][4], summary.TIE)]
    assert summary.drift(a, b, pt) == [0.2]
    assert summary.drift(None, b, pt) == [None]


def test_a_mutated_run_is_told_by_its_report_not_its_name(tmp_path):
    _, ref, gaps = _runs(5)
    _write(tmp_path, "v41e", model="v41", tokens=ref, margins=gaps)
    _write(tmp_path, "v41m", model="v41", tokens=ref, mutation="topk_off_by_one")   # unchanged: must fail
    assert summary.main(str(tmp_path)) == 1
    changed = [[(t + 1) % 500 for t in p] for p in ref]
    _write(tmp_path, "v41m", model="v41", tokens=changed, mutation="topk_off_by_one")
    assert summary.main(str(tmp_path)) == 0


def test_serve_flags_take_scalar_engine_kwargs_only():
    import pytest

    import run_engine

    assert run_engine.serve_flags("") == []
    assert run_engine.serve_flags('{"kv_cache_memory_bytes": 4294967296, "max_num_seqs": 8}') == [
        "--kv-cache-memory-bytes", "4294967296", "--max-num-seqs", "8"]
    for bad in ('{"kernel_config": {"enable_jit_warmup": false}}', '{"enforce_eager": true}'):
        with pytest.raises(ValueError, match="scalar"):
            run_engine.serve_flags(bad)


def test_a_speculative_run_must_reach_the_indexer_decode_with_next_n_k_plus_1(tmp_path, capsys):
    """A spec:K run passes only if its worker counted paged_mqa_logits calls with next_n = K + 1
    (the verify steps), as counters.install_ops records them."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/e2e
    import counters
    import torch

    rng, ref, gaps = _runs(6)
    k = rng.randrange(1, 6)
    counters.OPS.clear()
    q = torch.zeros(3, k + 1, 2, 4)
    counters._count("paged_mqa_logits", (q,))
    assert counters.OPS == {"paged_mqa_logits": 1, f"paged_mqa_logits[next_n={k + 1}]": 1}
    wa = dict(pid=1, ops_called=dict(counters.OPS))
    counters.OPS.clear()
    _write(tmp_path, "v4e", model="v4", tokens=ref, margins=gaps)
    spec = dict(model="v4", spec=f"mtp:{k}", tokens=ref, margins=gaps, indexer_flattened=False)
    _write(tmp_path, "v4m", worker_after=[wa], **spec)
    assert summary.main(str(tmp_path)) == 0
    flat = {"paged_mqa_logits": 1, "paged_mqa_logits[next_n=1]": 1}   # one row a token
    _write(tmp_path, "v4m", worker_after=[dict(wa, ops_called=flat)], **spec)
    assert summary.main(str(tmp_path)) == 1
    assert f"next_n = {k + 1}" in capsys.readouterr().out
    # where vLLM flattens the verify rows (sm_8x: next_n > 2), one row a token is what must arrive
    _write(tmp_path, "v4m", worker_after=[dict(wa, ops_called=flat)], **dict(spec, indexer_flattened=True))
    assert summary.main(str(tmp_path)) == 0
    _write(tmp_path, "v4m", worker_after=[wa], **dict(spec, indexer_flattened=True))
    assert summary.main(str(tmp_path)) == 1
    _write(tmp_path, "v4m", worker_after=[wa], **dict(spec, indexer_flattened=None))   # not recorded: fails
    assert summary.main(str(tmp_path)) == 1


def _logit_runs(seed, top=3.0):
    """A plain eager run with raw logits near ``top`` (bf16 spacing 1/64 in [2, 4))."""
    rng, ref, gaps = _runs(seed)
    gaps = [[round(rng.uniform(0.3, 1.0), 4) for _ in p] for p in ref]          # no near-ties
    top2 = [[[(t, top), (t + 1, top - g)] for t, g in zip(p, gp)] for p, gp in zip(ref, gaps)]
    return rng, ref, gaps, top2


def test_the_near_tie_bound_is_the_plain_runs_own_control_noise(tmp_path, capsys):
    """A spec run parting at a gap of 6 bf16 spacings passes only where the plain run's own reruns
    (prefix-cache pass, solo pass) moved a shared logit by at least that much."""
    rng, ref, gaps, top2 = _logit_runs(8)
    ulp = summary.bf16_ulp(3.0)
    gaps[2][5] = round(6 * ulp, 6)
    top2[2][5] = [(ref[2][5], 3.0), (ref[2][5] + 1, 3.0 - gaps[2][5])]
    base = dict(model="v41", tokens=ref, margins=gaps, top2=top2, engine_kwargs=dict(logprobs_mode="raw_logits"),
                solo_tokens=list(ref[summary.SERVED]), solo_top2=top2[summary.SERVED],
                prefix_pass_tokens=ref[-3:], prefix_pass_top2=[list(p) for p in top2[-3:]])
    other = [list(p) for p in ref]
    other[2][5] += 7
    _write(tmp_path, "v41e", **base)
    _write(tmp_path, "v41g", model="v41", mode="graphs", tokens=other)
    assert summary.main(str(tmp_path)) == 1                        # noise 0: the bound is TIE_ULPS = 4
    moved = [list(p) for p in top2[-3:]]
    moved[0][1] = [(moved[0][1][0][0], 3.0 + 7 * ulp), moved[0][1][1]]   # a rerun moved a logit 7 spacings
    _write(tmp_path, "v41e", **dict(base, prefix_pass_top2=moved))
    assert summary.main(str(tmp_path)) == 0
    assert "control noise" in capsys.readouterr().out and summary.noise_ulps(top2[-3:], moved) == 7.0
    moved[0][1] = [(moved[0][1][0][0], 3.0 + (summary.NOISE_CAP_ULPS + 1) * ulp), moved[0][1][1]]
    _write(tmp_path, "v41e", **dict(base, prefix_pass_top2=moved))
    assert summary.main(str(tmp_path)) == 1                        # reruns of one configuration too far apart


def test_late_compiles_fail_for_ours_with_the_warmup_on_only(tmp_path):
    _, ref, gaps = _runs(9)
    _write(tmp_path, "v41e", model="v41", tokens=ref, margins=gaps)
    wb = dict(pid=1, triton_compiles=["a[x]"], triton_compiles_ours=[])
    for warm, ours, rc in ((True, [], 0), (True, ["_dsv4_decode_v3_kernel[w]"], 1), (False, ["_dsv4_decode_v3_kernel[w]"], 0)):
        wa = dict(pid=1, triton_compiles=["a[x]", "fused_moe_kernel[y]"] + ours, triton_compiles_ours=ours)
        kw = {} if warm else dict(kernel_config=dict(enable_jit_warmup=False))
        _write(tmp_path, "v41g", model="v41", mode="graphs", tokens=ref, engine_kwargs=kw,
               worker_before=[wb], worker_after=[wa])
        assert summary.main(str(tmp_path)) == rc, (warm, ours)
