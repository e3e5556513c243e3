"""``dsv4-ops audit-vllm``: vLLM's DeepSeek-V4/V4.1 serve path on sm_80, from evidence, on every
supported vLLM release (``dsv4_ops.vllm.versions.SUPPORTED``; the installed one is audited).

CI gate: no row of the default serve path (TP=8, PP=1, no MTP) is dead/unknown on sm_80 and
unreplaced, except KNOWN_OPEN, which may only shrink. The audit of a model runs once per vLLM
release and source: its result is cached on disk per model by content (the vLLM source read +
dsv4_ops.vllm sources), and a process that needs a model another one is auditing waits for that
result (pytest-xdist workers, `dsv4-ops check` in the same CI run). It compiles every TileLang
warmup key: with TileLang's disk cache warm (~/.tilelang/cache) it takes minutes (importing vLLM,
Triton AOT); cold, nvcc adds tens of minutes on 2 shared cores (docs/vllm_plugin.md).
"""

import logging
import os
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="the audit needs vLLM (pip install dsv4-ops[test])")

from dsv4_ops.vllm import audit  # noqa: E402
from dsv4_ops.vllm import warmup  # noqa: E402

# Rows open now (model:phase:kernel). Empty since the audit decides reachability from the
# classes each model constructs (serve_graph/_reach.py): the V4-only kernels that V4.1's import of
# deepseek_v4.nvidia.model pulled in are "not reached". It may only shrink: a new open row fails.
KNOWN_OPEN_TEXT = """
"""
KNOWN_OPEN = frozenset(line.strip() for line in KNOWN_OPEN_TEXT.splitlines() if line.strip())
KNOWN_OPEN_START = 0  # the length this list has now (102, 23, 4, then 0); it may only shrink


@pytest.fixture(scope="session")
def result():
    return audit.run(audit.MODELS, arch=80)


def test_known_open_list_only_shrinks():
    assert len(KNOWN_OPEN) <= KNOWN_OPEN_START


@pytest.mark.parametrize("model", audit.MODELS)
def test_default_serve_path_has_no_new_open_row(result, model):
    rows = [r for r in result.rows if r.model == model]
    assert any(r.path == "default" for r in rows), f"the audit found no {model} rows at all"
    open_now = {r.ident for r in result.open_rows(model)}
    mine = {k for k in KNOWN_OPEN if k.startswith(model + ":")}
    closed = sorted(mine - open_now)
    if closed:
        print(f"\n{model}: known-open rows now covered (trim KNOWN_OPEN):\n  " + "\n  ".join(closed))
    for ident in closed:  # a row that leaves the list must be covered by a patch row, run, or be
        same = [r for r in rows if r.ident == ident and r.path == "default"]  # off by a guard read
        assert all(r.patch or r.status == "runs" or (r.status == "off" and "not reached" in r.evidence)
                   for r in same), ident
    new = sorted(open_now - KNOWN_OPEN)
    detail = {r.ident: f"{r.location}: {r.status}: {r.evidence[:160]}" for r in result.open_rows(model)}
    assert not new, "dead or unknown on sm_80 and not replaced:\n" + "\n".join(f"{i}  ({detail[i]})" for i in new)


def test_map_facts_are_found(result):
    """Spot checks against VLLM_SM80_MAP.md, each decided by the audit's own evidence."""
    by = {(r.model, r.phase, r.kernel.rsplit(".", 1)[-1]): r for r in result.rows if r.path == "default"}
    pack = by.get(("v4", "jit-warmup", "_PACK_SEQ_TRITON_KERNEL"))
    assert pack is not None and pack.status == "dead" and "fp8e4nv" in pack.evidence
    unpack = by.get(("v4", "forward", "_UNPACK_SEQ_TRITON_KERNEL"))
    assert unpack is not None and unpack.status == "runs"
    meta = [r for r in result.rows if r.kernel == "DeepGEMM.get_paged_mqa_logits_metadata" and r.model == "v41"]
    assert meta and all(r.status == "dead" for r in meta) and any("has_deep_gemm" in r.evidence for r in meta)
    decode = [r for r in result.rows if r.kernel == "FlashMLA.flash_mla_with_kvcache" and r.model == "v4"]
    assert decode and all(r.patch for r in decode), "the plugin's decode override must cover FlashMLA decode"


def _rows(result, model, kernel_tail, phase="forward"):
    return [r for r in result.rows if r.model == model and r.path == "default" and r.phase == phase
            and r.kernel.endswith(kernel_tail)]


def test_v4_kernels_in_v41_import_scope_are_not_reached(result):
    """V4.1 imports deepseek_v4.nvidia.model for its MoE class only: V4's compressor and sparse-MLA
    kernels are in its import scope but not in its class graph; in V4 itself they are reached."""
    for tail in ("save_partial_states._SAVE_PARTIAL_STATES_KERNEL", "sparse_mla._BUILD_C128A_TOPK_METADATA_KERNEL"):
        for phase in ("forward", "jit-warmup"):
            v41 = _rows(result, "v41", tail, phase)
            assert v41 and all(r.status == "off" and r.evidence.startswith("not reached") for r in v41), v41
            assert all("DeepseekV41ForCausalLM" in r.evidence for r in v41)
            v4 = _rows(result, "v4", tail, phase)
            assert v4 and all(r.status == "runs" for r in v4), v4


def test_v41_global_topk_kernel_runs_and_is_not_credited_to_a_patch(result):
    """The plugin's decode calls vLLM's compute_global_topk_indices_and_lens itself (a kept row), so
    no override covers its kernel: it must run on sm_80, by an AOT compile."""
    rows = _rows(result, "v41", "deepseek_v41.common.ops.cache_utils._compute_global_topk_indices_and_lens_kernel")
    assert rows and all(r.status == "runs" and not r.patch and "AOT sm_80 ok" in r.evidence for r in rows), rows


def test_v32_indexer_q_kernel_is_not_attributed_to_a_dsv4_patch(result):
    """sparse_attn_indexer.fused_indexer_q_rope_quant is DeepSeek-V3.2's (deepseek_v2.py); V4/V4.1
    call their own function of the same name, which the plugin patches."""
    for model in audit.MODELS:
        rows = _rows(result, model, "sparse_attn_indexer._fused_indexer_q_rope_quant_kernel")
        assert rows and all(r.status == "off" and not r.patch and "not reached" in r.evidence for r in rows), rows


# Every module of the serve path outside the model packages has rows, each decided by one of the
# evidence kinds of audit/_modules.py (selection code run as sm_80, cubins, traced launch + AOT).
SERVE_PATH_MODULES = ("linear:", "moe experts:", "router:", "gate:", "norm:", "activation:", "embedding:",
                      "lm head:", "sampler:", "all-reduce", "repack:")
EVIDENCE_KINDS = ("selection", "cubin", "traced launch, AOT sm_80", "source guards", "torch 2.")


@pytest.mark.parametrize("model", audit.MODELS)
def test_every_serve_path_module_has_rows_from_evidence(result, model):
    rows = [r for r in result.rows if r.model == model and r.path == "default"]
    wanted = SERVE_PATH_MODULES + (("vit attention:", "vit:") if model == "v41" else ())
    for prefix in wanted:
        got = [r for r in rows if r.kernel.startswith(prefix)]
        assert got, f"{model}: no audit row for {prefix!r}"
        for r in got:
            assert any(k in r.evidence for k in EVIDENCE_KINDS), r
            assert r.status in ("runs", "dead", "unknown", "off"), r
    assert [r for r in rows if r.phase == "weight-load"], "no weight-loading rows"


def test_serve_path_selections_resolve_to_sm80_kernels(result):
    """What vLLM's own selection code picks with the platform answering as sm_80."""
    by = {(r.model, r.kernel.split(" -> ")[0]): r for r in result.rows if r.path == "default"}
    v4 = [r for (m, k), r in by.items() if m == "v4" and k.startswith("linear:fp8 block")]
    assert v4 and "MarlinFP8ScaledMMLinearKernel" in v4[0].kernel and v4[0].status == "runs", v4
    assert "CutlassFp8BlockScaledMMKernel" in v4[0].evidence  # rejected, with its reason
    v41 = [r for (m, k), r in by.items() if m == "v41" and k.startswith("linear:MXFP8 [32,32]")]
    assert v41 and "MarlinMxfp8LinearKernel" in v41[0].kernel and "float8_e8m0fnu" in v41[0].evidence
    for model in audit.MODELS:
        moe = [r for (m, k), r in by.items() if m == model and k.startswith("moe experts:")]
        assert moe and "MarlinExperts" in moe[0].kernel and "float4_e2m1f" in moe[0].evidence, moe


def test_a_selection_without_an_sm80_candidate_is_dead():
    from dsv4_ops.vllm.audit import _modules

    class A:
        pass

    class B:
        pass

    name, notes = _modules.first_supported([A, B], lambda k: (False, f"{k.__name__} needs sm_90"), 80)
    assert name == "" and notes == ["A: A needs sm_90", "B: B needs sm_90"]
    row = _modules._row("v4", "forward", "linear:x", "selection", "here", (False, "; ".join(notes)))
    assert row["status"] == "dead" and not row["patch"]
    row = audit.Row(**row)
    assert row.open  # a dead, unreplaced default-path row fails the gate


def test_every_tilelang_warmup_key_is_compiled(result):
    """Every TileLang row of the default path compiled all of its warmup keys for sm_80 (vLLM's JIT
    warmup compiles each key at startup and aborts on the first failure); V4.1's
    MHC_PRE_NORM_KERNEL (TileLang under a plain VllmJitKernel) has rows, with its four
    registration variants' keys."""
    tl = [r for r in result.rows if r.path == "default" and r.tech == "TileLang"]
    assert {r.model for r in tl} == set(audit.MODELS)
    for r in tl:
        if r.status == "off":
            continue
        assert r.status == "runs" and "TileLang compile for sm_80 ok (all " in r.evidence, r
    pre = [r for r in tl if r.model == "v41" and r.kernel.endswith(".MHC_PRE_NORM_KERNEL")]
    assert {r.phase for r in pre} == {"forward", "jit-warmup"}, pre
    keys = int(pre[0].evidence.split("(all ", 1)[1].split()[0])
    assert keys >= 7, pre[0].evidence  # 1 broadcast + 3 hc-stream variants x (1 + the fused GEMM's splits)


def test_no_plain_jit_kernel_is_left_unclassified(result):
    """A kernel owner the classifier does not know (tech 'JIT') would be unknown: none is on a
    default path."""
    assert not [r for r in result.rows if r.path == "default" and r.tech == "JIT" and r.status != "off"]


def test_v41_overlap_prenorm_gemm_is_off_by_its_guard(result):
    rows = [r for r in result.rows if r.model == "v41" and r.kernel == "DeepGEMM.tf32_hc_prenorm_gemm"
            and "mhc_pre_delayed_overlap" in r.location]
    assert rows and all(r.status == "off" and "is_device_capability_family(100)" in r.evidence
                        and not r.patch for r in rows), rows


def test_a_guard_that_no_longer_matches_is_not_applied(monkeypatch):
    from dsv4_ops.vllm.audit import _paths

    mod, fn, checks, why = _paths._GUARDED_OFF[0]
    assert _paths.guarded_off(mod, fn) == why
    monkeypatch.setattr(_paths, "_GUARDED_OFF", ((mod, fn, ((mod, (r"no such source text",)),), why),))
    assert _paths.guarded_off(mod, fn) is None


def test_decoder_replay_is_on_the_default_path():
    """V4.1's YOCO decoder replay (cudagraph_decoder_replay, default True) runs on sm_80: its
    module is not pruned from the scope."""
    from dsv4_ops.vllm.serve_graph import _scope

    assert not [k for k in _scope.OFF_PATH_MODULES if "decoder_replay" in k]
    from vllm.config.compilation import CompilationConfig

    assert CompilationConfig().cudagraph_decoder_replay is True


def test_speculative_decoding_runner_kernels_have_rows(result):
    """V4 MTP and V4.1 DSpark: the runner's rejection sampler, the top-k / top-p split warmups and
    DSpark's DFlash input preparation are listed (reported under their path), each decided."""
    for model, path in (("v4", "mtp"), ("v41", "dspark")):
        rows = [r for r in result.rows if r.model == model and r.path == path
                and r.kernel.startswith(("vllm.v1.worker.gpu.spec_decode", "vllm.v1.sample.ops.topk_topp_sampler"))]
        names = {r.kernel for r in rows}
        assert any(".rejection_sampler." in k for k in names), (model, path)
        assert any("_topp_split_" in k for k in names), (model, path)
        assert all(r.status in ("runs", "dead", "unknown", "off") and r.evidence for r in rows)
        if path == "dspark":
            assert any(".dflash." in k for k in names), names
    assert not [r for r in result.rows if r.path != "default" and r.open]


def test_nvfp4_experts_layout_is_reported_not_audited(result):
    from dsv4_ops.vllm.audit import _modules

    for model in audit.MODELS:
        rows = [r for r in result.rows if r.model == model and r.path == _modules.NVFP4_PATH]
        assert len(rows) == 1 and "ModelOptNvFp4FusedMoE" in rows[0].kernel, rows
        assert rows[0].status == "unknown" and "unsupported by dsv4-ops" in rows[0].evidence
        assert "select_nvfp4_moe_backend on sm_80" in rows[0].evidence


def test_summary_and_table_render(result):
    line = audit.summary_line(result)
    assert line.startswith("audit-vllm sm_80") and "v4:" in line and "v41:" in line
    table = audit.format_table(result)
    assert "DeepSeek-V4-Flash" in table and "DeepSeek-V4.1-Flash" in table


# ------------------------------------------------------------------ made-up kernels are caught

FAKE_MODULE = '''
import torch
import triton
import triton.language as tl

from vllm.model_executor.warmup.jit_warmup_triton_helper import (
    TritonWarmupTensor, triton_kernel_dispatcher_with_warmup)
from vllm.utils.deep_gemm import fp8_fp4_mqa_logits
from vllm.utils.deep_gemm import is_deep_gemm_supported
from vllm.utils.import_utils import has_deep_gemm


@triton.jit
def _copy_fp8_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def _copy_inputs():
    fp8 = torch.float8_e4m3fn
    return {"grid": (1,), "src_ptr": TritonWarmupTensor(fp8), "dst_ptr": TritonWarmupTensor(fp8),
            "n": 16, "BLOCK": 128}


_COPY_FP8_KERNEL = triton_kernel_dispatcher_with_warmup(warmup_inputs=_copy_inputs)(_copy_fp8_kernel)


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def _add_inputs():
    return {"grid": (1,), "x_ptr": TritonWarmupTensor(torch.int32), "n": 16, "BLOCK": 128}


_ADD_ONE_KERNEL = triton_kernel_dispatcher_with_warmup(warmup_inputs=_add_inputs)(_add_one_kernel)


def copy_fp8(src, dst):
    _COPY_FP8_KERNEL[(1,)](src, dst, src.numel(), BLOCK=128)
    _ADD_ONE_KERNEL[(1,)](dst, dst.numel(), BLOCK=128)


def logits(q, k, w, ks, ke):
    if has_deep_gemm():
        return fp8_fp4_mqa_logits(q, k, w, ks, ke)
    return None


def gated_logits(q, k, w, ks, ke, use_fallback=True):
    use_deep_gemm = is_deep_gemm_supported()
    if use_deep_gemm:
        return fp8_fp4_mqa_logits(q, k, w, ks, ke)
    either = is_deep_gemm_supported() or not use_fallback
    if either:
        return fp8_fp4_mqa_logits(q, k, w, ks, ke)
    return None
'''


@pytest.fixture(scope="module")
def fake_result(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_vllm_code")
    (root / "dsv4_audit_fake_case.py").write_text(textwrap.dedent(FAKE_MODULE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + sys.path))
    return audit.run(modules=("dsv4_audit_fake_case",), arch=80, jobs=1, cache=None, env=env)


def test_made_up_fp8_triton_kernel_is_dead_and_open(fake_result):
    rows = {r.kernel.rsplit(".", 1)[-1]: r for r in fake_result.rows}
    fp8 = rows["_COPY_FP8_KERNEL"]
    assert fp8.status == "dead" and fp8.open, fp8
    assert "fp8e4nv" in fp8.evidence and "src_ptr" in fp8.evidence
    ok = rows["_ADD_ONE_KERNEL"]  # the control: same harness, no fp8 -> runs
    assert ok.status == "runs" and not ok.open, ok


def test_made_up_deep_gemm_call_site_is_dead_and_open(fake_result):
    dg = [r for r in fake_result.rows if r.kernel == "DeepGEMM.fp8_fp4_mqa_logits" and ":logits:" in r.location]
    assert len(dg) == 1 and dg[0].status == "dead" and dg[0].open
    assert "dsv4_audit_fake_case:logits" in dg[0].location
    assert "has_deep_gemm() only checks" in dg[0].evidence


def test_guard_through_a_local_name_is_evaluated(fake_result):
    """`use_deep_gemm = is_deep_gemm_supported(); if use_deep_gemm:` is never taken on sm_8x (off,
    with the assignment as evidence); `... or not use_fallback` depends on the caller (reached)."""
    rows = sorted((r for r in fake_result.rows if ":gated_logits:" in r.location), key=lambda r: r.location)
    assert [r.status for r in rows] == ["off", "dead"], rows
    assert not rows[0].open and "use_deep_gemm = is_deep_gemm_supported()" in rows[0].evidence
    assert rows[1].open and "depends on the caller" in rows[1].evidence


# ------------------------------------------------------------------ the JIT-warmup filter

class _Kernel:
    """A warmup owner: ``compile`` raises ``error`` (or not), and records its keys. Its keys exist
    only once ``ready`` (as a kernel whose keys need the allocated KV cache)."""

    def __init__(self, error=None, ready=True):
        self.error, self.compiled, self.ready = error, [], ready

    def get_warmup_keys(self, **kwargs):
        return [("key", tuple(sorted(kwargs.items())))] if self.ready else []

    def compile(self, key):
        self.compiled.append(key)
        if self.error:
            raise self.error


_FP8_ERROR = "type fp8e4nv not supported in this architecture"


@pytest.fixture
def filtered(monkeypatch):
    """(registry, run): kernels registered through vLLM's own register; run() is vLLM's warmup
    wrapped by the plugin, with vLLM's compile loop recording what it would compile."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    reg = JitWarmupRegistry(vllm_config=None)
    warmed = []
    monkeypatch.setattr(warmup, "_COMPILED", {})
    monkeypatch.setattr(warmup, "kernel_name", lambda k: ("fake", str(id(k))))
    monkeypatch.setattr(warmup, "warmup_enabled", lambda: False)

    def original(self):
        warmed.extend(k for k, regs in self._registrations.items() for _ in regs)

    return reg, (lambda: warmup.warmup_filtered(original)(reg)), warmed


def test_warmup_drops_only_failing_and_replaced_kernels(filtered, monkeypatch, caplog):
    reg, run, warmed = filtered
    good = _Kernel()
    bad_replaced = _Kernel(RuntimeError(_FP8_ERROR))
    bad_open = _Kernel(RuntimeError(_FP8_ERROR))
    covered = {id(bad_replaced): "vllm.models.deepseek_v4.nvidia.flashmla.dequantize_and_gather_k_cache"}
    monkeypatch.setattr(warmup, "replaced_by", lambda module, name: covered.get(int(name)))
    with reg.activate():
        for k in (good, bad_replaced, bad_open):
            type(reg).register(k, dtype="fp8")   # as a kernel's register_warmup does
    with caplog.at_level(logging.INFO, logger=warmup.logger.name):
        run()
    assert warmed == [good, bad_open]
    assert good.compiled and bad_replaced.compiled and bad_open.compiled  # decided by compiling
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(id(bad_open)) in errors[0].getMessage()
    assert "NOT replaced" in errors[0].getMessage()


def test_warmup_decides_on_the_keys_that_exist_when_the_warmup_runs(filtered, monkeypatch):
    """V4's C128 compressor store registers before the KV cache exists, when its keys are empty;
    decided then, it would pass, stay registered, and abort vLLM's warmup on sm_80."""
    reg, run, warmed = filtered
    late = _Kernel(RuntimeError(_FP8_ERROR), ready=False)
    monkeypatch.setattr(warmup, "replaced_by", lambda module, name: "some.patch.row")
    with reg.activate():
        type(reg).register(late, compress_ratio=128)
    late.ready = True          # the KV cache is allocated, the block size set: the keys exist now
    run()
    assert late.compiled and warmed == []


def test_warmup_passes_the_registry_config_to_a_bare_registration(filtered, monkeypatch):
    reg, run, warmed = filtered
    reg.vllm_config = object()

    class Bare(_Kernel):
        def get_warmup_keys(self, vllm_config):
            return [("cfg", id(vllm_config))]

    bare = Bare(RuntimeError(_FP8_ERROR))
    monkeypatch.setattr(warmup, "replaced_by", lambda module, name: "some.patch.row")
    with reg.activate():
        type(reg).register(bare)
    run()
    assert bare.compiled == [("cfg", id(reg.vllm_config))] and warmed == []


def test_warmup_coverage_comes_from_the_patch_table():
    # the plugin's prefill-gather patch covers vLLM's Triton gather kernel; a made-up name is not covered
    row = warmup.replaced_by("vllm.models.deepseek_v4.common.ops.cache_utils", "_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL")
    assert row and "dequantize_and_gather_k_cache" in row
    assert warmup.replaced_by("vllm.models.deepseek_v4.common.ops.cache_utils", "_NO_SUCH_KERNEL_X") is None


def test_a_kernel_registered_through_a_local_is_registered_not_used():
    """`k = A if c else B; k.register_warmup()` registers A and B without using them (V4's
    indexer registers its CuTeDSL q-quant kernels so); any other use of k uses both."""
    import ast

    from dsv4_ops.vllm.serve_graph import _source

    src = """
from m import A, B
class C:
    def __init__(self, c):
        k = A if c else B
        k.register_warmup(n=1)
    def run(self, c, x):
        k = A if c else B
        return k(x)
"""
    idx = _source.ModuleIndex("t", "t.py")
    _source._Visitor(idx, False, {}).visit(ast.parse(src))
    assert sorted((r.func, r.kernel, r.kernel_module) for r in idx.registrations) == [
        ("C.__init__", "A", "m"), ("C.__init__", "B", "m")]
    assert not {"A", "B"} & idx.funcs["C.__init__"].idents
    assert {"A", "B"} <= idx.funcs["C.run"].idents


def test_v4_indexer_cutedsl_q_quant_warmup_is_covered_by_the_q_quant_patch():
    # registered in DeepseekV4Indexer.__init__ (jit warmup on, CuTeDSL present, as a CUDA install of
    # vLLM has it); launched only from fused_indexer_q_rope_quant, which the plugin replaces. Were it
    # not covered, its e4m3 cvt would fail the sm_80 compile and vLLM's JIT warmup would abort startup.
    mod = "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl"
    for name in ("_INDEXER_Q_FP8_KERNEL", "_INDEXER_Q_MXFP4_KERNEL"):
        row = warmup.replaced_by(mod, name)
        assert row and row.endswith("fused_indexer_q_rope_quant"), (name, row)


_INV_ROPE = "vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant"


def test_inverse_rope_fp8_quant_is_replaced_for_the_warmup_and_the_audit(result):
    """fused_inv_rope_fp8_quant (tl.float8e4nv) fails to compile for sm_80; vLLM registers it for
    its JIT warmup, so every serve-path use must go through a patch row or startup aborts. From vLLM
    0.34 it is reached through DeepseekV4GroupedWoA's two methods: those rows, and only those."""
    from dsv4_ops.vllm import table

    warmup._call_graph.cache_clear()
    row = warmup.replaced_by(_INV_ROPE, "_FUSED_INV_ROPE_FP8_QUANT_KERNEL")
    assert row, "the warm-up filter would keep a kernel that fails on sm_80"
    grouped = {p.qualname for p in table.patches() if p.symbol.startswith("DeepseekV4GroupedWoA.")}
    if grouped:
        assert set(row.split(" + ")) == grouped, row
    rows = [r for r in result.rows if r.kernel.endswith("._FUSED_INV_ROPE_FP8_QUANT_KERNEL") and r.path == "default"
            and r.status != "off"]
    assert rows and all(r.status == "dead" and "fp8e4nv" in r.evidence and r.patch for r in rows), rows
    for r in rows:  # the audit names the rows of the model's own path; the filter, those of every model
        if r.phase == "forward":
            assert set(r.patch.split(" + ")) <= set(row.split(" + ")), (r.patch, row)
            assert not grouped or set(r.patch.split(" + ")) == grouped, r.patch


def test_warmup_coverage_is_the_same_once_the_patches_are_applied():
    """In a served process the rows are applied (module attributes are the replacements); the
    filter must still find vLLM's originals, or a kernel used only inside a replaced function of
    another module (V4's q-quant kernels, in fused_indexer_q) is not dropped and aborts startup."""
    from dsv4_ops.vllm import plugin

    cases = [("vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl", "_INDEXER_Q_FP8_KERNEL"),
             ("vllm.models.deepseek_v4.common.ops.fused_indexer_q", "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL"),
             ("vllm.models.deepseek_v4.common.ops.cache_utils", "_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL"),
             (_INV_ROPE, "_FUSED_INV_ROPE_FP8_QUANT_KERNEL")]
    warmup._call_graph.cache_clear()
    before = [warmup.replaced_by(m, n) for m, n in cases]
    assert all(before), before
    plugin.apply_patches()
    try:
        warmup._call_graph.cache_clear()
        assert [warmup.replaced_by(m, n) for m, n in cases] == before
    finally:
        plugin.unpatch()
        warmup._call_graph.cache_clear()


# ------------------------------------------------------------------ evidence helpers (no vLLM run)

def test_class_graph_resolves_names_per_module(tmp_path):
    """Reachability follows what the root class names, with imports and re-exports resolved: a
    same-named function of another module, a class nobody builds and its kernels are not reached."""
    from dsv4_ops.vllm.serve_graph import _reach

    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    files = {
        "__init__.py": "from .model import Root\nfrom .other import helper as exported\n",
        "model.py": textwrap.dedent('''
            from pkgx.other import UsedCls, helper as h
            from pkgx import other
            from pkgx import exported
            from pkgx.third import fused

            class Root:
                def __init__(self):
                    self.x = UsedCls()
                    h()

                def forward(self):
                    exported()
                    fused()
                    return other.called_via_module()
        '''),
        "other.py": textwrap.dedent('''
            def kernel_a(): pass
            def kernel_b(): pass
            class UsedCls:
                def run(self): kernel_b()
            class UnusedCls:
                def m(self): kernel_a()
            def helper(): pass
            def called_via_module(): pass
            def fused(): kernel_a()
        '''),
        "third.py": "def fused(): pass\n",
    }
    mods = {}
    for fn, text in files.items():
        (pkg / fn).write_text(text)
        name = "pkgx" if fn == "__init__.py" else f"pkgx.{fn[:-3]}"
        mods[name] = (str(pkg / fn), fn == "__init__.py")
    g = _reach.Graph(mods)
    reached = g.reached([("pkgx.model", "Root")])
    for node in [("pkgx.other", n) for n in ("UsedCls", "helper", "called_via_module", "kernel_b")] + \
            [("pkgx.third", "fused")]:
        assert node in reached, node
    for node in [("pkgx.other", n) for n in ("UnusedCls", "kernel_a", "fused")]:
        assert node not in reached, node
    assert g.users(("pkgx.third", "fused")) == {("pkgx.model", "Root.forward")}
    assert g.users(("pkgx.other", "fused")) == set()
    assert _reach.path_to(reached, ("pkgx.other", "kernel_b")) == "Root -> UsedCls -> kernel_b"


def test_cpp_kernel_names_match_exactly():
    from dsv4_ops.vllm.audit import _native

    sym = "_ZN4vllm21deepseek_v4_fused_ops47fusedDeepseekV4QNormRopeKVRopeQuantInsertKernelIN3c108BFloat16ELi128ELb0ELb0EEEvv"
    assert _native.kernel_base_name(sym) == "fusedDeepseekV4QNormRopeKVRopeQuantInsertKernel"
    assert _native.kernel_base_name("_Z16topKPerRowDecodev") == "topKPerRowDecode"
    norm = _native._norm
    assert norm("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert") == norm(_native.kernel_base_name(sym))
    assert norm("fused_deepseek_v4_kv_rope_insert") != norm(_native.kernel_base_name(sym))  # no loose match


def test_launch_recipe_is_refused_when_the_kernel_source_changed(monkeypatch, tmp_path):
    import importlib

    from dsv4_ops.vllm.audit import _recipes

    (tmp_path / "dsv4_recipe_case.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def _k(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, 1, mask=offs < n)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    jit = importlib.import_module("dsv4_recipe_case")._k
    sha = _recipes.source_sha(jit)
    variants = (({"x_ptr": "*i32", "n": "i32"}, {"BLOCK": 128}),)
    good = _recipes.Recipe("dsv4_recipe_case._k", "test:1", sha, variants)
    stale = _recipes.Recipe("dsv4_recipe_case._k", "test:1", "0" * 16, variants)
    specs, note = _recipes.specs_for("dsv4_recipe_case._k", jit, {"dsv4_recipe_case._k": good})
    assert len(specs) == 1 and list(specs[0].signature) == ["x_ptr", "n", "BLOCK"] and "test:1" in note
    specs, note = _recipes.specs_for("dsv4_recipe_case._k", jit, {"dsv4_recipe_case._k": stale})
    assert specs == [] and "stale" in note


# ------------------------------------------------------------------ evidence per vLLM release

def test_recipes_of_the_audited_release_match_its_kernels():
    """Every launch recipe recorded for the installed release names a kernel of it whose source
    is the one the recipe was read from (a stale recipe would leave its row unknown)."""
    from dsv4_ops.vllm.audit import _recipes

    recipes = _recipes.by_kernel()
    assert recipes
    for kernel, r in sorted(recipes.items()):
        sha = _recipes.file_sha(kernel)
        assert sha is not None, f"{kernel}: not in vLLM {_installed()} ({r.site})"
        assert sha == r.src_sha, f"{kernel}: source changed since the recipe ({r.site})"


def _installed():
    from dsv4_ops.vllm.serve_graph import _scope

    return _scope.evidence_release()


def _per_release_patterns():
    """(where, PerRelease) of every source pattern recorded per release, with the module it reads."""
    from dsv4_ops.vllm.audit import _modules, _paths

    out = [("vllm.model_executor.layers.fused_moe.router.gate_linear", p) for p in _modules._GATE_GUARDS
           if isinstance(p, _paths.PerRelease)]
    for checks in [c for _pat, c, _why in _paths._OFF_PATH_CHECKED] + \
            [c for rules in _paths._OFF_PATH_CHECKED_BY_MODEL.values() for _pat, c, _why in rules]:
        out += [(m, p) for m, rx in checks for p in rx if isinstance(p, _paths.PerRelease)]
    return out


def test_per_release_patterns_match_only_their_own_release():
    """A pattern recorded per release matches the installed vLLM's source with the choice of its
    release, and with no other release's choice (why it is recorded per release)."""
    import re

    from dsv4_ops.vllm.serve_graph import _scope, _source

    pats = _per_release_patterns()
    assert pats
    rel = _installed()
    for module, p in pats:
        text = open(_source.module_path(module)).read()
        hits = {str(releases): bool(re.search(rx, text, re.S)) for releases, rx in p.choices}
        mine = [str(releases) for releases, _rx in p.choices if rel in releases]
        assert [k for k, hit in hits.items() if hit] == mine, (module, hits)


def test_evidence_of_a_release_applies_to_that_release_only():
    from dsv4_ops.vllm import versions
    from dsv4_ops.vllm.serve_graph import _scope

    newer = ".".join(str(p + (i == 1)) for i, p in enumerate(versions.key(versions.NEWEST_DIFFED)))
    assert _scope.evidence_release(newer) == versions.NEWEST_DIFFED  # a later release reads the newest evidence
    for rel in versions.SUPPORTED:
        assert _scope.evidence_release(rel) == rel and _scope.evidence_release(rel + ".post1") == rel
        choices = {_scope.until(rel): "old", _scope.since(newer): "unreleased"}
        assert _scope.for_release(choices, rel) == "old"
        assert newer not in _scope.until(rel) and rel not in _scope.since(newer)
    with pytest.raises(KeyError):  # evidence read from an unsupported release never applies to a supported one
        _scope.for_release({_scope.since(newer): "unreleased"}, versions.SUPPORTED[0])


def _defined(module: str, name: str) -> bool:
    """Whether ``module`` of the installed vLLM defines ``name`` (read from source, not imported)."""
    import re

    from dsv4_ops.vllm.serve_graph import _source

    path = _source.module_path(module)
    return bool(path) and bool(re.search(rf"^(?:def |class )?{re.escape(name)}\b", open(path).read(), re.M))


_DSA = "vllm.model_executor.kernels.attention.dsa"
# Kernels that vLLM 0.34 added to the serve paths, each decided by its own evidence wherever the
# installed vLLM has it: (model, phase, kernel, defining module, status, words of the evidence).
NEW_KERNELS = (
    ("v4", "forward", f"{_DSA}.dcp_topk_direct._push_candidates_kernel", f"{_DSA}.dcp_topk_direct", "off",
     "decode context parallel size is > 1"),
    ("v41", "forward", f"{_DSA}.dcp_topk_direct._push_candidates_kernel", f"{_DSA}.dcp_topk_direct", "off",
     "decode context parallel size is > 1"),
    ("v4", "forward", "C++ _C.fused_mqa_topk_prefill", f"{_DSA}.fused_mqa_topk", "off",
     "is_device_capability_family(100)"),
    ("v41", "jit-warmup", "vllm.models.deepseek_v41.attention._pad_interleaved_q", "vllm.models.deepseek_v41.attention",
     "runs", "AOT sm_80 ok"),
    ("v41", "forward", "vllm.models.deepseek_v41.nvidia.ops.mhc._hc_expand_kernel",
     "vllm.models.deepseek_v41.nvidia.ops.mhc", "runs", "from the recipe read at"),
    ("v41", "forward", "vllm.models.deepseek_v4.attention.fill_short_context_topk_indices",
     "vllm.models.deepseek_v4.attention", "runs", "from the recipe read at"),
)


@pytest.mark.parametrize("model,phase,kernel,module,status,words", NEW_KERNELS,
                         ids=[f"{k[0]}-{k[2].rsplit('.', 1)[-1]}" for k in NEW_KERNELS])
def test_new_kernels_are_decided_by_their_evidence(result, model, phase, kernel, module, status, words):
    rows = [r for r in result.rows if r.model == model and r.path == "default" and r.phase == phase
            and r.kernel == kernel]
    name = kernel.rsplit(".", 1)[-1]
    assert bool(rows) == _defined(module, name), (kernel, rows)  # rows exactly where vLLM has it
    for r in rows:
        assert r.status == status and words in r.evidence and not r.open, r


# ------------------------------------------------------------------ the kernel inventory and --against

def test_recorded_kernel_inventory_is_what_the_audit_finds(result):
    """``audit-vllm --against`` diffs a new vLLM's kernels with the inventory recorded for the
    newest supported release; the recorded one must be what the audit finds on its release."""
    from dsv4_ops.vllm.audit import _against

    recorded = _against.load_inventory(_installed())
    assert recorded, f"no kernel inventory recorded for vLLM {_installed()}"
    want = {k: v for k, v in recorded["kernels"].items() if k.split("|", 1)[0] in audit.MODELS}
    got = _against.inventory(result)
    stale = sorted(set(want.items()) ^ set(got.items()))
    assert not stale, ("the recorded inventory differs (re-record it: python -m dsv4_ops.vllm.audit._against "
                       "--record):\n" + "\n".join(f"{k}: {v}" for k, v in stale[:20]))
    assert any(got.values()), "no kernel of the inventory has a source hash"


def test_kernel_diff_names_new_changed_and_gone_kernels(result):
    from dsv4_ops.vllm.audit import _against

    inv = _against.inventory(result)
    keyed = [k for k, v in inv.items() if v]
    added, edited = keyed[0], keyed[1]
    recorded = {k: v for k, v in inv.items() if k != added}
    recorded[edited] = "0" * 16
    gone = "v4|default|forward|vllm.fake._GONE_KERNEL|vllm.fake:f"
    recorded[gone] = "1" * 16
    diff = _against.diff_inventory(result, recorded, audit.MODELS)
    assert [_against.inventory_key(r) for r in diff.new] == [added]
    assert [_against.inventory_key(r) for r in diff.changed] == [edited]
    assert diff.removed == [gone] and diff
    assert not _against.diff_inventory(result, inv, audit.MODELS)
    rep = _against.Report("x.whl", result.vllm, _installed(), 0, [], result, audit.MODELS, diff, True)
    text = _against.format_report(rep)
    assert rep.found and "1 new, 1 changed source, 1 gone" in text and added.split("|")[3] in text


def _mirror(src: str, dst: str, real: tuple) -> None:
    """``src`` seen through links, with the directories ``real`` (relative, '.' the top) made real
    so that files in them can be replaced without touching the installed vLLM; every other entry
    links to the installed one (its compiled bytecode is reused, never rewritten)."""
    for rel in real:
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for entry in os.listdir(os.path.join(src, rel)):
            if entry == "__pycache__" or os.path.normpath(os.path.join(rel, entry)) in map(os.path.normpath, real):
                continue
            os.symlink(os.path.join(src, rel, entry), os.path.join(dst, rel, entry))


def _replace(tree: str, rel: str, text: str) -> None:
    path = os.path.join(tree, rel)
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, "w") as f:
        f.write(text)


def test_against_a_source_tree_finds_the_rows_it_breaks(tmp_path):
    """``audit-vllm --against <tree>`` on a copy of the installed vLLM in which DeepGEMM's MQA
    logits gained a parameter and a new module imports them by name: the table check names exactly
    those two mismatches (the copy is otherwise the installed release, whose table fits)."""
    import vllm

    from dsv4_ops.vllm.audit import _against

    src = os.path.dirname(os.path.abspath(vllm.__file__))
    tree = tmp_path / "tree" / "vllm"
    _mirror(src, str(tree), (".", "utils"))
    dg = open(os.path.join(src, "utils", "deep_gemm.py")).read()
    head = "def fp8_fp4_mqa_logits("
    assert dg.count(head) == 1
    _replace(str(tree), "utils/deep_gemm.py", dg.replace(head, head + "dsv4_test_new_arg, ", 1))
    _replace(str(tree), "dsv4_test_caller.py", "from vllm.utils.deep_gemm import fp8_fp4_mqa_logits\n\n\n"
                                               "def logits(*args):\n    return fp8_fp4_mqa_logits(*args)\n")
    rep = _against.against(str(tree.parent), models=())
    assert rep.release == _installed() and rep.table_rows > 0
    sig = [p for p in rep.table if "fp8_fp4_mqa_logits has parameters" in p and "dsv4_test_new_arg" in p]
    byname = [p for p in rep.table if p.startswith("vllm.dsv4_test_caller imports fp8_fp4_mqa_logits by name")]
    assert sig and byname and len(rep.table) == len(sig) + len(byname), rep.table
    assert rep.found and "FOUND: " in _against.format_report(rep)


def test_against_refuses_what_is_not_a_vllm_tree(tmp_path):
    from dsv4_ops.vllm.audit import _against

    with pytest.raises(audit.AuditError, match="neither a vLLM wheel"):
        _against.unpack(str(tmp_path))


# ------------------------------------------------------------------ one audit run per model

def test_each_model_is_audited_once_across_sets_and_processes(tmp_path, monkeypatch):
    """Concurrent runs (pytest-xdist workers, `dsv4-ops check`) and any set of models reuse each
    model's result: the worker runs once per model, whoever asks first."""
    import threading
    import time
    from collections import Counter

    calls = []

    def worker(models, arch, jobs, timeout, modules, env):
        calls.append(tuple(models))
        time.sleep(0.3)  # the second run arrives while the first is still working
        return {"vllm": "x", "arch": arch, "notes": [f"ran {','.join(models)}"],
                "rows": [dict(model=m, path="default", phase="forward", kernel=f"k_{m}", tech="Triton", location="l",
                              status="runs", evidence="e", patch="") for m in models]}

    monkeypatch.setenv("DSV4_OPS_CACHE", str(tmp_path))
    monkeypatch.setattr(audit, "_worker", worker)
    got = {}
    threads = [threading.Thread(target=lambda ms=ms: got.__setitem__(ms, audit.run(ms)))
               for ms in (("v4", "v41"), ("v4",), ("v41", "v4"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(m for c in calls for m in c) == Counter({"v4": 1, "v41": 1}), calls
    for ms, res in got.items():
        assert [r.model for r in res.rows] == list(ms)
    assert [r.model for r in audit.run(("v41",)).rows] == ["v41"] and len(calls) <= 2
