"""End to end: vLLM's own DeepSeek-V4.1 and DeepSeek-V4 model code runs forward with the
plugin on the Ampere path (the platform answers as an A100: capability 8.0, 108 SMs, its name),
every layer checked against a float64 oracle teacher-forced from its captured input.

What runs (``driver.py``, in a subprocess: the setup changes process-wide state): tiny random
models (``build.py``) built by vLLM's classes. V4.1: SWA-only layers 0 and 4, a ratio-2 kv +
index source (1), a ratio-2 consumer that is an index source on the source's K cache (2), a
ratio-1 kv + index source (3). V4: an SWA layer with hash MoE routing and the first-layer mHC
(the broadcast path whose prenorm GEMM the plugin replaces), C4A (ratio 4: indexer + its
compressor), C128A, C4A. Then vLLM's KV-cache spec, planner (``get_kv_cache_configs``) and
binder (``init_kv_cache``) at the block size and cache dtype vLLM itself resolves (the
executor's ``update_block_size_for_backend`` rule); ``process_weights_after_loading`` (the wo_a
hook); per step only the block tables and slot mappings are hand-made (one block pool for all
groups), then vLLM's ``build_attn_metadata``, ``set_forward_context`` and the model's forward.
Steps: a prefill longer than top-k x ratio (40 tokens for V4.1, 136 for V4 so C128A has an
entry), a mixed step (one request decodes while a second prefills 24 tokens), two decode steps
with both requests.

The oracle (``oracle.py``, float64, written from DeepSeek's published math and checked against
transformers' ``deepseek_v4`` in ``test_oracle.py``; ``checks.py`` applies it): q and the KV row
from the layer's input (projections, RMSNorms, GPT-J RoPE); the SWA writer checked by decoding
the bytes vLLM's run wrote with an independent decoder; the indexer's choice (its top-k over the
visible compressed entries) against the oracle's scores from the K bytes in the indexer cache and
vLLM's E4M3 q (itself checked against the float64 q); sparse attention with the sink over the
request's window and the compressed entries the indexer chose (read from the bytes in the
caches); inverse RoPE + grouped wo_a + wo_b; MoE teacher-forced on vLLM's experts, whose choice
must equal the oracle's wherever the router margin is clear (hash layers: the tid2eid table);
layer 0's input from the embedding through the first-layer mHC and attn_norm; V4's every later
mHC boundary (new streams, mixes, the next sublayer's normed input) from its own inputs; the LM
head.
Writer and reader are pinned separately: ``writer_checks.py`` recomputes, from the layers' inputs
of every step, what the compressed-KV and indexer-K caches must hold (pooling, RMSNorm, RoPE at
the window's first token) and checks the decoded bytes entry by entry (E4M3 + bf16 bound), while
the attention and indexer checks read the same bytes as vLLM does. Each attention row is held to a
bound from the rounding model of the served path (``bounds.py``: bf16 storage, fp32 arithmetic,
Z = 6 standard deviations per element) rather than a cosine per layer; the planted bugs of
``plants.py`` fail it >= 5x (``test_planted_bugs.py``, opt-in: DSV4_E2E_PLANTS=1).

Stand-ins (``standins.py``; all KEPT rows of the audit: the plugin replaces none of them, and
each output is checked downstream by the oracle, so a wrong stand-in fails rather than hides):
the fused SWA insert + q RoPE (torch, an fp8_ds_mla writer on ``torch.float8_e4m3fn``), the
C++ top-k ops (masked torch top-k, vLLM's "torch" branch semantics), the indexer K gather, the
sqrtsoftplus router, ``moe_align_block_size`` / ``moe_sum``, ``silu_and_mul_with_clamp``,
RMSNorm, the cutlass capability probes (sm_80 answers), ``aten::mm.dtype`` on the CPU, the TileLang
mHC wrappers (vLLM's torch references ``mhc_pre_delayed_torch`` / ``mhc_pre_torch`` /
``mhc_post_torch`` + the collapsed input's RMSNorm; the reuse-residual form writes its new streams
into the old ones' storage where vLLM's dispatch does; V4's first-layer broadcast wrapper is kept and
only its TileLang epilogue kernel is stood in for, so the plugin's prenorm-GEMM row runs), FlashMLA's pure-Python ``get_mla_metadata`` (an empty struct), and
no-op CUDA streams on the CPU. The Triton interpreter is patched for bf16 ``tl.dot`` and
fp32->bf16 rounding (``interpreter_patch.py``). No vLLM fp8 Triton kernel is used as a stand-in.

The tripwire (``tripwire.py``) raises on any kernel the audit lists dead, any Triton launch with
an fp8 tensor or an fp8 type in its source, any DeepGEMM / FlashMLA entry point, and any original
the plugin replaced wherever it is still bound; its positive controls must fire.

What this cannot prove: kernel numerics on sm_80 (on the CPU every dsv4_ampere op runs its
reference; the kernels are proven by the AOT, H200 and reference legs), CUDA-graph capture (the
H200 test below does it for V4.1), Marlin / MXFP4 weights (the model is bf16), Engram (no Engram
layer yet) and its UVA tables, MTP / next_n > 1 and the DSpark draft, the TileLang mHC kernels
(and V4.1's mHC prenorm-GEMM row behind them), stream-ordering races, V4.1's delayed mHC mixes
past layer 0 (V4's are checked against the oracle).

One driver process a model: V4.1's also runs, on the same built model and on requests of their own,
the two forced decode routes and the two deliberately broken replacements (``driver.Run``), so
vLLM's import and the build (about half of a run on 2 cores) are paid once.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the end-to-end test needs vLLM (pip install dsv4-ops[test])")

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from .shared_report import session_report
except ImportError:  # tests/e2e collected as a rootdir (no package), or imported by path
    sys.path.insert(0, HERE)
    from shared_report import session_report

# Patch-table rows a model's run does not reach, and why (every other row of the model must run).
_COMMON_OFF = {
    "vllm.model_executor.layers.quantization.fp8.Fp8LinearMethod.process_weights_after_loading": "bf16 weights",
    "vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod.process_weights_after_loading":
        "bf16 weights",
    "vllm.model_executor.warmup.jit_warmup.JitWarmupRegistry.warmup": "enforce_eager turns JIT warmup off",
    "vllm.model_executor.layers.sparse_attn_indexer.pack_seq_triton": "ragged spec-decode path (no MTP)",
    # the quant-layout guard runs at model build of an FP8 checkpoint (tests/test_vllm_plugin.py
    # runs it on vLLM's own quant config)
    "vllm.models.deepseek_v4.quant_config.DeepseekV4FP8Config.get_quant_method": "bf16 weights (no quant config)",
    "vllm.models.deepseek_v41.quant_config.DeepseekV4FP8Config.get_quant_method": "bf16 weights (no quant config)",
}
# vLLM 0.34's grouped wo_a entry points: their callers on CUDA are the attention classes' own
# ``_o_proj`` (V4: nvidia/flashmla.py; V4.1: nvidia/ops/o_proj.py dsv41_o_proj from
# nvidia/flashmla.py, and the SM100 specialized decode), which the Ampere attention overrides
# (its ``_o_proj`` row), the FlashInfer backends (not chosen on sm_80) and LoRA's wrapper of the
# layer (no LoRA here)
_GROUPED_WO_A = {f"vllm.models.deepseek_v4.common.grouped_wo_a.DeepseekV4GroupedWoA.{m}":
                 "its callers are the _o_proj the Ampere attention overrides" for m in ("grouped_input", "grouped_forward")}
NOT_ON_PATH = {
    "v41": dict(_COMMON_OFF, **_GROUPED_WO_A, **{
        "vllm.models.deepseek_v41.common.engram.ParallelEngramEmbedding.lookup": "no Engram layer in the tiny config",
        "vllm.utils.deep_gemm.tf32_hc_prenorm_gemm": "behind V4.1's TileLang mHC wrappers, which are stood in for",
        "vllm.model_executor.kernels.mhc.tilelang._hc_prenorm_gemm_outputs":
            "behind V4.1's TileLang mHC wrappers, which are stood in for",
    }),
    "v4": dict(_COMMON_OFF, **_GROUPED_WO_A, **{
        "vllm.utils.deep_gemm.tf32_hc_prenorm_gemm": "V4's first layer reaches the wrapper row "
                                                     "(_hc_prenorm_gemm_outputs) instead",
    }),
}
# The decode under auto is the paged op (no workspace: dispatch.decode.resolve_route); the
# workspace step (dsv4_decode_gather + sparse_mla_decode_out) runs only when forced.
OPS_ON_PATH = ("kv_cache_gather", "kv_cache_insert", "dsv4_decode_fused_out",
               "indexer_k_insert", "indexer_q_quant", "mqa_logits", "paged_mqa_logits")
LAYERS = {"v41": dict(n=5, attn={"attn(ratio=0)", "attn(ratio=1)", "attn(ratio=2)"}, indexer=(1, 2, 3)),
          "v4": dict(n=4, attn={"attn(ratio=0)", "attn(ratio=4)", "attn(ratio=128)"}, indexer=(1, 3))}
STEPS = ("prefill", "mixed", "decode1", "decode2")
# the layers that write compressed KV entries / indexer K entries. V4.1: kv sources 1 (ratio 2)
# and 3 (ratio 1) write both, layer 2 reads layer 1's; V4: C4A 1 and 3 both, C128A 2 its KV only
WRITERS = {"v41": ({1, 3}, {1, 3}), "v4": ({1, 2, 3}, {1, 3})}
ATTN_COS, MOE_COS, LOGITS_COS = 0.9999, 0.9999, 0.9999
REL_MAX = 0.02          # max |vLLM - oracle| over max |oracle|: bf16 activations and weights
MHC_COEFF_REL = 1e-5    # the mHC mixes: fp32 from the same bf16 streams as the oracle's (measured <= 3e-7)


def run_driver(tmp_path, model="v41", device="cpu", timeout=1800, **env):
    tag = "_private_graphs" if env.get("DSV4_AMPERE_DECODE_GRAPHS") == "1" else ""
    tag += f"_{env['DSV4_AMPERE_DECODE_KERNEL']}" if env.get("DSV4_AMPERE_DECODE_KERNEL") else ""
    out = tmp_path / f"e2e_{model}_{device}{tag}.json"
    if os.environ.get("DSV4_E2E_REPORT_DIR"):   # the device script brings the report back
        import pathlib

        out = pathlib.Path(os.environ["DSV4_E2E_REPORT_DIR"]) / out.name
    full_env = dict(os.environ, **env)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "driver.py"), "--model", model, "--device", device,
                           "--out", str(out)], env=full_env, capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def _model_report(tmp_path_factory, model, **env):
    def make():
        proc, rep = run_driver(tmp_path_factory.mktemp("e2e"), model=model, **env)
        assert proc.returncode == 0 and rep is not None, proc.stderr[-6000:]
        return rep

    return session_report(tmp_path_factory, f"model_{model}", make)


# One driver process a model: its import and build (half of a run on 2 cores) are paid once. Under
# pytest-xdist ``--dist loadgroup`` every test of one report runs on one worker (the module fixture
# is not computed twice); the reports are independent, so the groups run in parallel.
V41_GROUP, V4_GROUP = pytest.mark.xdist_group("e2e_model_v41"), pytest.mark.xdist_group("e2e_model_v4")


@pytest.fixture(scope="module")
def report_v41(tmp_path_factory):
    """V4.1's run, then on the same built model (fresh requests and blocks each) the forced decode
    routes and the deliberately broken replacements (driver.Run)."""
    return _model_report(tmp_path_factory, "v41", DSV4_E2E_EXTRAS="routes,mutations")


@pytest.fixture(scope="module")
def report_v4(tmp_path_factory):
    return _model_report(tmp_path_factory, "v4")


@pytest.fixture(params=[pytest.param("v41", marks=V41_GROUP), pytest.param("v4", marks=V4_GROUP)])
def report(request):
    return request.getfixturevalue(f"report_{request.param}")


def test_default_serve_configuration(report):
    res = report["resolved"]
    # what vLLM resolves with no flags, bound by vLLM's own binder: V4.1's packed blocks must split
    # into its backend's 128-token kernel blocks off sm_90 (a 256 default that could not would
    # fail at binding); V4's indexer backend takes 256; both in the fp8_ds_mla record
    assert res["block_size"] == {"v41": 128, "v4": 256}[report["model"]], res
    assert res["cache_dtype"] == "fp8_ds_mla", res


def test_every_attention_layer_matches_the_oracle(report):
    rows, seed = [c for c in report["checks"] if c["kind"].startswith("attn")], report.get("seed")
    assert {c["step"] for c in rows} == set(STEPS)
    assert {c["kind"] for c in rows} == LAYERS[report["model"]]["attn"]
    for c in rows:
        assert c["topk_out_of_range"] == 0, (seed, c)
        assert c["writer_err"] <= 1.0, (seed, c)
        assert c["cos"] >= ATTN_COS and c["max_abs"] <= REL_MAX * c["ref_max"], (seed, c)
        # every row within its rounding-model bound (tests/e2e/bounds.py; the planted bugs of
        # test_planted_bugs.py exceed it >= 5x)
        assert c["bound_ratio"] <= 1.0, c


def test_every_cache_entry_is_the_float64_one(report):
    """The compressed KV entries (pooling, RMSNorm, RoPE at the window's first token) and the
    indexer K entries each step closes, recomputed in float64 from the layers' inputs of every
    step (writer_checks.py), are what the decoded cache bytes hold, element by element within the
    E4M3 + bf16 bound; every compressor layer writes entries and every window's inputs were seen."""
    rows, seed = [c for c in report["checks"] if c["kind"].startswith("attn")], report.get("seed")
    for c in rows:
        assert c["comp_writer_err"] <= 1.0 and c["index_writer_err"] <= 1.0, (seed, c)
        assert c["writer_unseen"] == 0, (seed, c)
    comp, index = WRITERS[report["model"]]
    assert {c["layer"] for c in rows if c["comp_written"]} == comp, rows
    assert {c["layer"] for c in rows if c["index_written"]} == index, rows


def test_indexer_choice_is_the_oracles(report):
    """Every row's chosen compressed entries are the oracle's top-k (teacher-forced on vLLM's E4M3
    q, whose codes are checked against the float64 q), on the long path of every step."""
    rows = [c for c in report["checks"] if c["kind"] == "indexer"]
    assert {(c["step"], c["layer"]) for c in rows} == {(s, l) for s in STEPS for l in LAYERS[report["model"]]["indexer"]}
    for c in rows:
        assert c["mismatched"] == 0, c
        assert c["q_err"] <= 1.0 and c["q_scale_pow2"], c
    # every long-path row is checked (entries tied with the k-th score may go either way:
    # checks_v32.valid_top_k), and every step has some
    assert all(c["checked"] == c["tokens"] for c in rows), rows
    for step in STEPS:
        assert sum(c["long_rows"] for c in rows if c["step"] == step) > 0, (step, rows)


def test_every_moe_matches_the_oracle(report):
    rows = [c for c in report["checks"] if c["kind"] == "moe"]
    assert len(rows) == len(STEPS) * LAYERS[report["model"]]["n"]
    for c in rows:
        assert c["choice_mismatch"] == 0, c
        assert c["cos"] >= MOE_COS and c["max_abs"] <= REL_MAX * c["ref_max"], c
    # a near-tie router row is not decided; every step still decides some
    for step in STEPS:
        assert sum(c["clear_rows"] for c in rows if c["step"] == step) > 0, (step, rows)


def test_first_layer_mhc_matches_the_oracle(report):
    rows = [c for c in report["checks"] if c["kind"] == "mhc_first"]
    assert len(rows) == len(STEPS)
    for c in rows:
        assert c["cos"] >= ATTN_COS and c["max_abs"] <= REL_MAX * c["ref_max"], c


def test_every_v4_mhc_boundary_matches_the_oracle(report):
    """V4's mHC boundaries past the first (the post of every sublayer fused with the pre of the
    next: 2 a layer, less layer 0's attention side, which is the first-layer broadcast) against
    the float64 mhc_expand / mhc_coeffs / collapse + RMSNorm, from each call's own inputs. Where
    vLLM writes the new streams into the old ones' storage (the reuse-residual form, over the fused
    kernel's token limit) that path ran too. V4.1's boundaries are the delayed form, not this math:
    its rows must be absent."""
    rows = [c for c in report["checks"] if c["kind"] == "mhc"]
    if report["model"] != "v4":
        assert rows == [] and report["standin_calls"].get("mhc.pre_delayed", 0) > 0, rows
        return
    n = LAYERS["v4"]["n"]
    assert sorted((c["step"], c["layer"], c["side"]) for c in rows) == sorted(
        (s, i, side) for s in STEPS for i in range(n) for side in ("attn", "ffn") if (i, side) != (0, "attn"))
    for c in rows:
        assert c["streams_cos"] >= ATTN_COS and c["streams_rel"] <= REL_MAX, c
        assert c["input_cos"] >= ATTN_COS and c["input_rel"] <= REL_MAX, c
        # fp32 coefficients from the same bf16 streams
        assert c["post_rel"] <= MHC_COEFF_REL and c["comb_rel"] <= MHC_COEFF_REL, c
    if "vllm.models.deepseek_v4.nvidia.model.mhc_fused_post_pre_tilelang_reuse_residual" in report["mhc_standins"]:
        # the model calls the reuse-residual form: the 136-token prefill over the fused kernel's
        # limit writes in place, the smaller steps do not
        assert any(c["in_place"] for c in rows) and not all(c["in_place"] for c in rows), rows


def test_logits_match_the_oracle(report):
    for c in [c for c in report["checks"] if c["kind"] == "logits"]:
        assert c["cos"] >= LOGITS_COS and c["max_abs"] <= REL_MAX * c["ref_max"], c


def test_every_plugin_row_on_the_path_ran(report):
    from dsv4_ops.vllm.table import patches

    called = report["rows_called"]
    model = report["model"]
    expected = [p.qualname for p in patches() if p.model in (model, None, "")
                and p.kind in ("patch", "hook", "override") and p.qualname not in NOT_ON_PATH[model]]
    missing = [q for q in expected if called.get(q, 0) == 0 and q not in report["rows_uncounted"]]
    assert not missing, f"plugin rows on the {model} path that never ran: {missing}"
    for op in OPS_ON_PATH:
        assert report["ops_called"].get(op, 0) > 0, (op, report["ops_called"])


def test_no_dead_kernel_ran_and_the_tripwire_fires(report):
    assert report["tripped"] == []
    assert report["tripwire"]["dead_rows"] > 0
    assert all(not f.startswith("NOT FIRED") for f in report["positive_control"]), report["positive_control"]
    assert len(report["positive_control"]) == 4


def _failures(report):
    bad = [c for c in report["checks"] if c["kind"].startswith("attn")
           and (c["cos"] < ATTN_COS or c["max_abs"] > REL_MAX * c["ref_max"] or c["bound_ratio"] > 1.0)]
    return bad


@V41_GROUP
def test_a_broken_replacement_fails(report_v41):
    """An off-by-one in the sparse-prefill index mapping must show in the attention checks."""
    m = report_v41["mutations"]["topk_off_by_one"]
    assert m["error"] == "", m.get("traceback")
    assert m["mutation"].startswith("topk_off_by_one") and not m["mutation"].endswith("(0 bindings)"), m["mutation"]
    assert {c["step"] for c in m["checks"] if c["kind"].startswith("attn")} == {"prefill"}, m["checks"]
    assert _failures(m), "the off-by-one went unnoticed"


@V41_GROUP
def test_an_unpatched_by_name_import_fails(report_v41):
    """An original the plugin replaced, bound again by name in a vLLM module, stops the forward at
    its first call with the tripwire's error."""
    m = report_v41["mutations"]["unpatched_import"]
    assert m["error"].startswith("DeadOnSm80"), m
    assert "indexer_k_norm_rope_store" in m["traceback"] and m["tripped"], m


REPORT_CHECKS = (test_default_serve_configuration, test_every_attention_layer_matches_the_oracle,
                 test_every_cache_entry_is_the_float64_one,
                 test_indexer_choice_is_the_oracles, test_every_moe_matches_the_oracle,
                 test_first_layer_mhc_matches_the_oracle, test_every_v4_mhc_boundary_matches_the_oracle,
                 test_logits_match_the_oracle,
                 test_every_plugin_row_on_the_path_ran, test_no_dead_kernel_ran_and_the_tripwire_fires)


@V41_GROUP
@pytest.mark.parametrize("kernel", ["v3", "tiles"])
def test_forced_decode_routes_inside_vllms_forward(report_v41, kernel):
    """The default run takes auto's route for the tiny model (the paged op, one launch, no
    workspace); these runs force the other two through vLLM's own V4.1 forward
    (DSV4_AMPERE_DECODE_KERNEL), on requests of their own on the same built model: v3, the paged
    op's 16-byte-vector form, and tiles, the workspace step (gather both caches, then attention
    over the workspace). Every attention row must still match the oracle, and the ops called
    must be the forced route's."""
    rep = report_v41["routes"][kernel]
    assert rep["tripped"] == [], rep["tripped"]
    ops = rep["ops_called"]
    if kernel == "v3":
        assert ops.get("dsv4_decode_fused_out", 0) > 0 and "dsv4_decode_gather" not in ops, ops
    else:
        assert ops.get("dsv4_decode_gather", 0) > 0 and ops.get("sparse_mla_decode_out", 0) > 0, ops
        assert "dsv4_decode_fused_out" not in ops, ops
    test_every_attention_layer_matches_the_oracle(rep)
    test_logits_match_the_oracle(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("model,private_graphs", [("v41", "0"), ("v41", "1"), ("v4", "0")])
def test_h200_real_kernels_and_decode_graph(tmp_path, model, private_graphs):
    """The same model, steps, oracle, counters and tripwire with every tensor on CUDA and the
    plugin's portable Triton kernels (DSV4_AMPERE_IMPL=portable); then the uniform decode step
    captured as one FULL CUDA graph and replayed on new inputs: bit-identical to eager.
    private_graphs=1 turns on DSV4_AMPERE_DECODE_GRAPHS: each eager decode step then captures the
    private per-layer graph of its key inside vLLM's forward, and must pass the same oracle checks
    and FULL-graph comparison. Needs vLLM's sources on PYTHONPATH (tests/e2e/gpu_run.sh)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if model == "v4":
        # vLLM runs V4's mHC boundaries as TileLang kernels on every CUDA GPU (the plugin
        # replaces only the first layer's DeepGEMM prenorm GEMM); a serving host has tilelang
        # (vLLM's CUDA requirement), the H200 image here does not: V4 on a GPU needs it
        pytest.importorskip("tilelang", reason="vLLM's V4 mHC kernels are TileLang's (not in this image)")
    proc, report = run_driver(tmp_path, model=model, device="cuda", DSV4_AMPERE_DECODE_GRAPHS=private_graphs)
    assert proc.returncode == 0 and report is not None, proc.stderr[-6000:]
    for check in REPORT_CHECKS:
        check(report)
    assert len(report["graph"]) == 4 and report["graph"][0].get("captured"), report["graph"]
    for g in report["graph"]:
        assert g["bit_identical"], g
    pg = report["private_graphs"]
    if private_graphs == "1":
        # captured at first sight of each layer's key (inside vLLM's own forward, the checks above
        # passed on those steps); the driver's eager q / out addresses change step to step, so no
        # key repeats and nothing is replayed here (H200: 35 captures, 0 hits): replay on new values
        # is tests/test_decode_graph.py's GPU test
        assert pg.get("captures", 0) > 0 and not pg.get("failures"), pg
    else:
        assert not pg.get("captures") and not pg.get("hits"), pg
