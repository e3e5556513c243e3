"""Pipeline-parallel partitions (``dsv4_ops.pp_partition``, ``dsv4-ops pp-partition``).

V4.1 layouts (KV sources [2, 8, 14, 20], index sources up to 36, candidate source 20, 40
layers) against a brute-force enumeration of every split with the sharing rules written out
independently; vLLM's own partition parsing (``get_pp_indices``) where vLLM is importable;
V4 (no sharing): any split is legal.
"""

import itertools
import json

import pytest

from dsv4_ops import pp_partition as ppp
from dsv4_ops.tools import cli

KV = [2, 8, 14, 20]
IDX = [2, 8, 14, 20, 24, 28, 32, 36]


def v41_config(n=40, kv=KV, idx=IDX, cand=20, ratios=None):
    ratios = ratios if ratios is not None else [0, 0] + [1 if i % 2 else 2 for i in range(2, n)] + [0]  # + MTP
    return dict(num_hidden_layers=n, compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=idx,
                candidate_source_layer_id=cand, candidate_topk_blocks=64 if cand >= 0 else 0,
                architectures=["DeepseekV41ForCausalLM"])


def v4_config(n=43):
    return dict(num_hidden_layers=n, compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, n)] + [0],
                architectures=["DeepseekV4ForCausalLM"])


def brute_legal(cfg, counts):
    """Independent statement of the rules: every compressed layer's nearest KV source and
    index source at or below it, and (index sources after it) the candidate source, share
    its stage."""
    stage_of, start = {}, 0
    for i, c in enumerate(counts):
        for layer in range(start, start + c):
            stage_of[layer] = i
        start += c
    for layer in range(cfg["num_hidden_layers"]):
        if cfg["compress_ratios"][layer] <= 0 or not cfg.get("kv_source_layer_ids"):
            continue
        need = [max(s for s in cfg["kv_source_layer_ids"] if s <= layer),
                max(s for s in cfg["index_source_layer_ids"] if s <= layer)]
        c = cfg.get("candidate_source_layer_id", -1)
        if layer in cfg["index_source_layer_ids"] and 0 <= c < layer:
            need.append(c)
        if any(stage_of[s] != stage_of[layer] for s in need):
            return False
    return True


def compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def test_v41_pp2_is_20_20():
    best = ppp.best_partitions(ppp.layout_from_config(v41_config()), 2)
    assert best[0] == [20, 20]
    assert ppp.check_partition(v41_config(), "20,20") == [20, 20]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v41_best_matches_brute_force(pp):
    cfg = v41_config()
    layout = ppp.layout_from_config(cfg)
    legal = [c for c in compositions(40, pp) if brute_legal(cfg, c)]
    for c in compositions(40, pp):
        assert (not ppp.violations(layout, c)) == brute_legal(cfg, c), c
    best = ppp.best_partitions(layout, pp, limit=1000)
    m = min(max(c) for c in legal)
    assert max(best[0]) == m
    assert sorted(map(tuple, best)) == sorted(tuple(c) for c in legal if max(c) == m)


@pytest.mark.parametrize("kv,idx,cand", [([3, 9, 21], [3, 9, 21, 27, 33], 21), ([2, 8, 14, 20], [2, 8, 14, 20], -1)],
                         ids=["other-sources", "no-candidates"])
def test_other_layouts_match_brute_force(kv, idx, cand):
    ratios = [0] * kv[0] + [1 if i % 2 else 2 for i in range(kv[0], 36)]  # nothing compressed below the first source
    cfg = v41_config(n=36, kv=kv, idx=idx, cand=cand, ratios=ratios)
    layout = ppp.layout_from_config(cfg)
    for pp in (2, 3):
        for c in compositions(36, pp):
            assert (not ppp.violations(layout, c)) == brute_legal(cfg, c), c


def test_v4_every_split_is_legal():
    layout = ppp.layout_from_config(v4_config())
    assert not layout.shares
    assert all(not ppp.violations(layout, c) for c in compositions(43, 3))
    assert ppp.best_partitions(layout, 2)[0] == [22, 21]  # vLLM's default for 43 / 2
    assert ppp.check_partition(v4_config(), "1,42") == [1, 42]


def test_illegal_partition_names_a_legal_alternative():
    with pytest.raises(ppp.PPPartitionError, match=r"layer 10 reads the compressed KV cache of layer 8.*"
                                                  r"VLLM_PP_LAYER_PARTITION=8,6,6,20"):
        ppp.check_partition(v41_config(), "10,10,10,10")
    # vLLM's default split (no env variable) is checked too
    with pytest.raises(ppp.PPPartitionError, match="default split"):
        ppp.check_partition(v41_config(), None, pp=4)
    # a split that only breaks a stage-local buffer (candidate blocks): no vLLM error, still illegal
    cfg = v41_config(kv=KV + [22], idx=sorted(IDX + [22]))  # layer 22 owns KV and index, not candidates
    assert brute_legal(cfg, [22, 18]) is False
    with pytest.raises(ppp.PPPartitionError, match="layer 22 reads the candidate blocks of layer 20"):
        ppp.check_partition(cfg, "22,18")


@pytest.mark.parametrize("bad,needle", [("20;20", "integers"), ("20", "1 stages"), ("20,21", "41 layers"),
                                        ("40,0", "at least one")])
def test_partition_string_errors(bad, needle):
    with pytest.raises(ppp.PPPartitionError, match=needle):
        ppp.check_partition(v41_config(), bad, 2)


def test_parse_agrees_with_vllm(monkeypatch):
    """Our parse and default split give the stage bounds vLLM's get_pp_indices gives."""
    utils = pytest.importorskip("vllm.distributed.utils")
    for part in ("20,20", " 8, 6,6 ,20", None):
        pp = 2 if part == "20,20" else 4
        if part is None:
            monkeypatch.delenv(ppp.ENV_VAR, raising=False)
            counts = ppp.vllm_default_partition(40, pp)
        else:
            monkeypatch.setenv(ppp.ENV_VAR, part)
            counts = ppp.parse_partition(part, 40, pp)
        assert [utils.get_pp_indices(40, r, pp) for r in range(pp)] == [tuple(b) for b in ppp.stage_bounds(counts)]


def test_cli_reads_a_model_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(v41_config()))
    assert cli.main(["pp-partition", str(tmp_path), "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "VLLM_PP_LAYER_PARTITION=20,20" in out and "not at layers 21-39" in out
    assert cli.main(["pp-partition", str(tmp_path / "config.json"), "--pp", "4", "--check", "10,10,10,10"]) == 1
    assert "8,6,6,20" in capsys.readouterr().err


def test_v41_model_build_checks_the_partition(monkeypatch):
    """The plugin's row wraps the real V4.1 DeepseekV4Model.__init__: an illegal PP split
    raises before vLLM builds anything, a legal one reaches vLLM's own __init__."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from dsv4_ops.vllm import pipeline
    from dsv4_ops.vllm import plugin as vp
    import importlib

    model_cls = importlib.import_module("vllm.models.deepseek_v41.nvidia.model").DeepseekV4Model
    (row,) = pipeline.PATCHES
    vp.check_signature(row)
    reached = []
    wrapped = pipeline.check_partition_at_build(lambda self, **kw: reached.append(kw))
    cfg = NS(parallel_config=NS(pipeline_parallel_size=4), model_config=NS(hf_config=v41_config()))
    monkeypatch.delenv(ppp.ENV_VAR, raising=False)  # vLLM's default 10,10,10,10 is illegal here
    with pytest.raises(ppp.PPPartitionError, match="8,6,6,20"):
        wrapped(object(), vllm_config=cfg, prefix="model")
    assert reached == []
    monkeypatch.setenv(ppp.ENV_VAR, "8,6,6,20")
    wrapped(object(), vllm_config=cfg, prefix="model")
    assert reached == [{"vllm_config": cfg, "prefix": "model"}]
    assert row.module == model_cls.__module__ and row.symbol == "DeepseekV4Model.__init__"
