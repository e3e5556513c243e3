"""The engine run's checkpoints (tests/e2e/engine/checkpoints.py): vLLM's own loader reads each
directory into a fresh model (V4's MTP draft model too; every parameter loaded, none left at its NaN poison, V4.1 / V4
equal to what was written), ``process_weights_after_loading`` runs, the manifest rewrites the
same bytes without vLLM (what the device does), and the local tokenizer round-trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install dsv4-ops[test])")
# the checkpoints are written once a module (``written``); under pytest-xdist --dist loadgroup
# this module's tests stay on one worker, which writes them once
pytestmark = pytest.mark.xdist_group("e2e_engine_checkpoints")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "checkpoints.py")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    p = subprocess.run([sys.executable, SCRIPT, str(d), "v41", "v41x", "v4", "v32", "--verify"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = {os.path.basename(r["dir"]): r for r in
           (json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{"))}
    return d, res


def test_vllm_loader_reads_every_parameter(written):
    _, res = written
    spec = res.pop("v41#spec")["spec"]
    assert set(res) == {"v41", "v41#mtp", "v41x", "v41x#mtp", "v4", "v4#mtp", "v32"}
    for m, r in res.items():
        assert r["params"] > 0 and r["mismatched"] == [], (m, r)
    # the engine's DSpark options resolve, through vLLM's SpeculativeConfig, to this checkpoint's stages
    for k in ("1", "5"):
        s = spec[k]
        assert s["method"] == "dspark" and s["use_dspark"] and s["k"] == int(k) and s["parallel"], s
        assert s["arch"] == "DSparkV41DraftModel" and s["draft_model"] == str(written[0] / "v41"), s
        assert s["target_layer_ids"] == [1, 3], s
    # every parameter compared with the tensor written
    for m in ("v41", "v41#mtp", "v41x", "v41x#mtp", "v4", "v4#mtp"):
        assert res[m]["compared"] == res[m]["params"], res[m]
    assert res["v41"]["arch"] == "DeepseekV41LLMForCausalLM" and res["v4"]["arch"] == "DeepseekV4ForCausalLM"
    assert res["v4#mtp"]["arch"] == "DeepSeekV4MTPModel"   # V4's MTP layer, as the speculative path loads it
    # V4.1's DSpark stages (mtp.0.*, mtp.1.*), as the speculative path (method "dspark") loads them;
    # embed / head are the target's (aliased), not counted
    assert res["v41#mtp"]["arch"] == "DSparkV41DraftModel" and res["v41#mtp"]["params"] > 0


def test_v41x_engram_layer_loaded(written):
    """V4.1 + one Engram layer (v41x): the architecture vLLM resolves an EngramConfig for, the
    Engram parameters among those loaded and compared (the fp8 table and its ue8m0 scale as bytes),
    the table's rows the layout's prime-sized bucket ranges, the compressed vocab vLLM's own."""
    from safetensors import safe_open

    d, res = written
    cfg = json.loads((d / "v41x" / "config.json").read_text())
    assert res["v41x"]["arch"] == "DeepseekV41ForCausalLM"
    assert res["v41x"]["params"] == res["v41"]["params"] + 5   # q_weight, k_weight, wkv, table, scale
    assert res["v41x#mtp"]["params"] == res["v41#mtp"]["params"]
    (layer,) = cfg["engram_layer_ids"]
    assert layer < max(cfg["kv_source_layer_ids"])    # vLLM's decoder replay stays on
    with safe_open(str(d / "v41x" / "model.safetensors"), "pt") as f:
        table = f.get_tensor(f"layers.{layer}.engram.embed.weight")
        scale = f.get_tensor(f"layers.{layer}.engram.embed.scale")
    assert table.shape == (cfg["engram_num_embeddings"][0], cfg["engram_head_dim"])
    assert str(table.dtype) == "torch.float8_e4m3fn"
    assert scale.shape == (table.shape[0], 1) and bool(((scale >= 124) & (scale <= 127)).all())
    assert bool(table.float().abs().sum(1).gt(0).all())    # every bucket row drawn


def test_v41_checkpoint_holds_the_dspark_stages(written):
    from safetensors import safe_open

    d, _ = written
    cfg = json.loads((d / "v41" / "config.json").read_text())
    n = cfg["n_mtp_layers"]
    with safe_open(str(d / "v41" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    stages = {int(k.split(".")[1]) for k in names if k.startswith("mtp.")}
    assert stages == set(range(n))
    last = f"mtp.{n - 1}."
    for k in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", last + "norm.weight",
              last + "markov_head.embed.weight", last + "markov_head.head.weight",
              last + "confidence_head.proj.weight"):
        assert k in names, k
    for i in range(n):   # each stage a decoder layer in the checkpoint's own names
        assert f"mtp.{i}.attn.wq_a.weight" in names and f"mtp.{i}.ffn.experts.0.w1.weight" in names
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + n


def test_manifest_rewrites_the_same_bytes(written, tmp_path):
    d, _ = written
    p = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "v41", "v41x", "v4", "--from-manifest",
                        str(d / "manifest.json")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for m in ("v41", "v41x", "v4"):
        assert (tmp_path / m / "model.safetensors").read_bytes() == (d / m / "model.safetensors").read_bytes(), m


def test_tokenizer_round_trips(written):
    from transformers import AutoTokenizer

    d, _ = written
    tok = AutoTokenizer.from_pretrained(str(d / "v41"))
    ids = tok("w5 w17 w300", add_special_tokens=False)["input_ids"]
    assert ids == [5, 17, 300]
    assert tok.decode(ids) == "w5 w17 w300"
    assert tok.eos_token_id == 1 and tok.bos_token_id == 0


@pytest.mark.parametrize("model", ["v41", "v4"])
def test_score_routed_layers_choose_the_same_experts_for_every_token(written, model):
    """checkpoints._stable_routing: in each score-routed MoE layer (the target's and the draft
    layers') the routing biases alone choose the experts: top-k of sqrtsoftplus(h W^T) + bias is one
    set for thousands of random unit-RMS hidden states, while without the biases the choice varies
    (so the check can fail)."""
    import torch
    from safetensors import safe_open

    d, _ = written
    cfg = json.load(open(os.path.join(d, model, "config.json")))
    k = cfg["num_experts_per_tok"]
    with safe_open(os.path.join(d, model, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        gates = [n[: -len(".bias")] for n in names if n.endswith(".gate.bias")]
        assert len(gates) >= 2 and any(n.startswith("mtp.") for n in gates), gates
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        for n in gates:
            w, b = f.get_tensor(n + ".weight").float(), f.get_tensor(n + ".bias").float()
            h = torch.randn(4096, w.shape[1], generator=g)
            scores = torch.nn.functional.softplus(h @ w.T).sqrt()
            chosen = {tuple(sorted(r)) for r in (scores + b).topk(k, dim=-1).indices.tolist()}
            assert len(chosen) == 1, (n, len(chosen))
            assert len({tuple(sorted(r)) for r in scores.topk(k, dim=-1).indices.tolist()}) > 1, n
