"""``dsv4-ops audit-vllm --model v32`` / ``--model glm5``: vLLM's DeepSeek-V3.2 and GLM-5 serve
paths on sm_80 (every supported release; the installed one is audited), every kernel decided
from evidence, 0 open.

The audit of each model runs once per vLLM release and source (~1 min on 2 cores; cached on disk
per model, like the V4/V4.1 audit, which "both" keeps meaning, so the CLI test below reuses it).
The rows checked here come from the audit's own evidence (AOT compiles, cubins, vLLM's selection
code run as sm_80, guards read from source).
"""

import sys
import types

import pytest

pytest.importorskip("vllm", reason="the audit needs vLLM (pip install dsv4-ops[test])")

from dsv4_ops.vllm import audit  # noqa: E402

NEW = ("v32", "glm5")


@pytest.fixture(scope="session")
def result():
    return audit.run(NEW, arch=80)


def _rows(result, model, tail, phase="forward"):
    return [r for r in result.rows if r.model == model and r.path == "default" and r.phase == phase
            and r.kernel.endswith(tail)]


@pytest.mark.parametrize("model", NEW)
def test_no_open_row_on_the_default_serve_path(result, model):
    rows = [r for r in result.rows if r.model == model and r.path == "default"]
    assert len(rows) > 40, f"{model}: the audit found only {len(rows)} rows"
    opened = result.open_rows(model)
    assert not opened, "dead or unknown on sm_80 and not replaced:\n" + "\n".join(
        f"{r.ident} ({r.location}: {r.status}: {r.evidence[:160]})" for r in opened)
    assert all(r.status in ("runs", "dead", "unknown", "off") for r in rows)


@pytest.mark.parametrize("model", NEW)
def test_the_fp8_model_kernels_are_dead_and_replaced_by_the_v32_rows(result, model):
    for tail, row in (("_fused_norm_rope_kernel", "deepseek_v32.attention.fused_norm_rope"),
                      ("_fused_q_kernel", "deepseek_v32.attention.fused_q")):
        got = _rows(result, model, "deepseek_v32.common.kernels." + tail)
        assert got and all(r.status == "dead" and "fp8e4nv" in r.evidence and row in r.patch for r in got), got


@pytest.mark.parametrize("model", NEW)
def test_the_indexer_reuses_the_v4_indexer_rows(result, model):
    """V3.2's indexer op is vLLM's sparse_attn_indexer, the one V4 runs: its DeepGEMM calls are
    dead on sm_80 and covered by the same patch rows."""
    from dsv4_ops.vllm import table

    for name in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata"):
        rows = {p.qualname for p in table.patches() if p.kind == "patch" and p.symbol == name}
        got = [r for r in result.rows if r.model == model and r.path == "default" and r.kernel == f"DeepGEMM.{name}"]
        assert rows and got and all(r.status == "dead" and r.patch in rows for r in got), (name, rows, got)
    pack = _rows(result, model, "_PACK_SEQ_TRITON_KERNEL", "jit-warmup")
    assert pack and all(r.status == "dead" and "dsv4_ops.vllm.warmup" in r.patch for r in pack)


@pytest.mark.parametrize("model", NEW)
def test_the_backend_path_runs_on_sm80(result, model):
    """The sparse-MLA base the sm_8x backend inherits: its top-k remap (int Triton) compiles for
    sm_80 with vLLM's warmup keys; the dense/masked-MHA prefill path is off (backend has none)."""
    conv = _rows(result, model, "sparse_utils._CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL")
    assert conv and all(r.status == "runs" and "AOT sm_80 ok" in r.evidence for r in conv), conv
    masked = [r for r in result.rows if r.model == model and r.path == "default"
              and r.kernel.rsplit(".", 1)[-1] in ("_scatter_topk_kernel", "_scatter_topk_single_req_kernel")]
    assert masked and all(r.status == "off" and "dense/masked-MHA prefill" in r.evidence for r in masked), masked
    fa = [r for r in result.rows if r.model == model and r.kernel == "C++ _C.dsv3_fused_a_gemm"]
    assert fa and all(r.status == "off" and ("is_device_capability(90)" in r.evidence or "10.3" in r.evidence)
                      for r in fa), fa


@pytest.mark.parametrize("model", NEW)
def test_selections_resolve_to_sm80_kernels(result, model):
    by = {r.kernel.split(" -> ")[0]: r for r in result.rows if r.model == model and r.path == "default"}
    lin = [r for k, r in by.items() if k.startswith("linear:fp8 block")]
    assert lin and "MarlinFP8ScaledMMLinearKernel" in lin[0].kernel and lin[0].status == "runs", lin
    moe = [r for k, r in by.items() if k.startswith("moe experts: block FP8")]
    assert moe and "MarlinExperts" in moe[0].kernel and moe[0].status == "runs", moe
    assert "float8_e4m3fn" in moe[0].evidence
    router = [r for k, r in by.items() if k.startswith("router: grouped_topk")]
    assert router and router[0].status == "runs" and "grouped_topk_fused_kernel" in router[0].evidence
    fused_ar = [r for k, r in by.items() if k.startswith("all-reduce + RMSNorm")]
    assert fused_ar and fused_ar[0].status == "off"


def test_v4_kernels_are_not_on_the_v32_path(result):
    assert not [r for r in result.rows if r.model in NEW and ".deepseek_v4" in r.kernel]


def test_summary_and_table_name_the_new_models(result):
    line = audit.summary_line(result)
    assert "v32:" in line and "glm5:" in line and ", 0 open" in line
    table = audit.format_table(result, NEW)
    assert "DeepSeek-V3.2" in table and "GLM-5" in table


def test_cli_accepts_the_new_models(result, capsys):
    from dsv4_ops.tools import cli

    assert cli.main(["audit-vllm", "--model", "v32"]) == 0  # exit 0: no open row
    out = capsys.readouterr().out
    assert "v32:" in out and "0 open" in out


def test_the_backend_registration_is_checked_at_register(monkeypatch):
    """register() runs v32_backend.check_registration, which fails when vLLM's sm_80 sparse-MLA
    priority list no longer starts with the member the plugin overrides."""
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms.cuda as cuda
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from dsv4_ops.vllm import plugin, v32_backend

    v32_backend.check_registration(plugin._error, cuda=True)
    monkeypatch.setattr(cuda, "_get_backend_priorities", lambda *a, **k: [AttentionBackendEnum.FLASHMLA_SPARSE])
    with pytest.raises(plugin.VllmPatchError, match="priority list"):
        v32_backend.check_registration(plugin._error, cuda=True)
    plugin.reset()
    monkeypatch.setattr(plugin, "_capability", lambda: (8, 0))
    monkeypatch.setattr(v32_backend, "_on_cuda", lambda: True)
    monkeypatch.setattr(plugin, "check_table", lambda rows, scan_source=True: None)
    with pytest.raises(plugin.VllmPatchError, match="priority list"):
        plugin.register()
    assert not plugin.STATE.originals and not plugin.STATE.registered
    plugin.reset()


def test_recorded_kernel_inventory_is_what_the_audit_finds(result):
    """The V3.2 / GLM-5 part of the inventory that ``audit-vllm --against`` diffs a new vLLM with."""
    from dsv4_ops.vllm.audit import _against
    from dsv4_ops.vllm.serve_graph import _scope

    recorded = _against.load_inventory(_scope.evidence_release())
    assert recorded, f"no kernel inventory recorded for vLLM {_scope.evidence_release()}"
    want = {k: v for k, v in recorded["kernels"].items() if k.split("|", 1)[0] in NEW}
    stale = sorted(set(want.items()) ^ set(_against.inventory(result).items()))
    assert not stale, ("the recorded inventory differs (re-record it: python -m dsv4_ops.vllm.audit._against "
                       "--record):\n" + "\n".join(f"{k}: {v}" for k, v in stale[:20]))


def test_the_default_audit_still_means_v4_and_v41():
    assert audit.MODELS == ("v4", "v41") and set(NEW) <= set(audit.ALL_MODELS)
