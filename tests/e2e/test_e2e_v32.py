"""End to end, DeepSeek-V3.2 and GLM-5 (issue 20): vLLM 0.33.0's own ``DeepseekV32ForCausalLM`` (its
CUDA model class, chosen as on an A100; GLM-5's ``GlmMoeDsaForCausalLM`` is the same class) with the
plugin on the CPU: a tiny checkpoint written by
transformers and read by vLLM's loader, vLLM's attention-backend selector answering for sm_80
(it must pick the plugin's sparse-MLA backend), vLLM's planner/binder/metadata builders, and the
prefill / mixed / decode steps of tests/e2e/steps.py. Checked in float64:
- every step's logits against transformers' ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` on the
  same weights (with
  the fp8_ds_mla cache, that oracle's KV latent goes through the 656-byte record's rounding);
- every sparse-MLA call against softmax(scale q.k) v over the keys decoded from the cache bytes.
index_topk (128) exceeds every sequence, so the indexer selects every causal key and the choice
cannot differ from the oracle's on near-ties (the choice itself is not checked here); tokens whose
float64 expert choice is a near-tie are left out of the logits comparison and counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytest.importorskip("vllm")
pytest.importorskip("transformers")

# (cos, max |vLLM - oracle| / max |oracle|) bounds of the logits after two bf16 layers (measured:
# cos >= 0.99989, rel <= 0.017 over seeds); a broken attention gave cos 0.02, a flipped expert 0.93;
# with the fp8 cache, E4M3 codes of the bf16 latent flip against the float64 one near rounding
# boundaries (one code step is up to 6.25% of that element)
LOGITS_BOUNDS = {"auto": (0.9995, 0.03), "fp8_ds_mla": (0.998, 0.08)}
MQA_COS, MQA_REL = 0.99999, 0.01


MODEL_TYPES = {"v32": "deepseek_v32", "glm5": "glm_moe_dsa"}


@pytest.fixture(scope="module", params=[("v32", "auto"), ("v32", "fp8_ds_mla"), ("glm5", "fp8_ds_mla")],
                ids=lambda p: "-".join(p))
def report(request, tmp_path_factory):
    family, cache = request.param
    out = tmp_path_factory.mktemp("e2e_v32") / f"{family}_{cache}.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "driver_v32.py"), "--device", "cpu",
                           "--family", family, "--cache-dtype", cache, "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_vllm_picks_the_plugin_backend_and_cache(report):
    assert report["model_class"] == "vllm.models.deepseek_v32.nvidia.model", report["model_class"]  # the CUDA class
    assert report["impl_classes"] == ["dsv4_ops.vllm.v32_backend.AmpereSparseMLAImpl"], report["impl_classes"]
    assert report["resolved"]["cache_dtype"] == report["cache_dtype"], report["resolved"]
    assert report["model_type"] == MODEL_TYPES[report["model"]], report["model_type"]


def test_logits_match_transformers(report):
    cos_min, rel_max = LOGITS_BOUNDS[report["cache_dtype"]]
    checks = report["checks"]
    assert [c["step"] for c in checks][:1] == ["prefill"] and len(checks) == 7
    # rows whose float64 expert choice is a near-tie (margin <= 0.02) are left out; most must remain
    compared = sum(c["tokens"] - c["near_ties"] for c in checks)
    assert compared >= 0.6 * sum(c["tokens"] for c in checks), checks
    for c in checks:
        if not c.get("skipped"):
            assert c["cos"] >= cos_min and c["rel_max"] <= rel_max, c


def test_every_sparse_mla_call_matches_float64_over_the_cache_bytes(report):
    rows = report["mqa"]
    assert len(rows) == 8, rows            # 2 layers x 4 steps
    for r in rows:
        assert r["out_of_range"] == 0 and r["nonfinite"] == 0 and r["valid"] > 0, r
        assert r["cos"] >= MQA_COS and r["rel_max"] <= MQA_REL, r


def test_the_plugin_ops_ran(report):
    ops = report["ops_called"]
    for op in ("v32_kv_insert", "v32_sparse_mla_decode", "indexer_k_insert", "mqa_logits", "paged_mqa_logits"):
        assert ops.get(op, 0) > 0, ops


def test_no_dead_kernel_ran(report):
    """The tripwire (tests/e2e/tripwire.py) from `dsv4-ops audit-vllm --model v32 / glm5`'s dead
    rows was armed for the whole run and nothing tripped it; the kernels vLLM launched ran."""
    wire = report["tripwire"]
    assert wire["dead_rows"] > 0 and wire["originals"], wire
    assert report["tripped"] == [], report["tripped"]
    assert sum(report["triton_launches"].values()) > 0, report["triton_launches"]
