"""The vLLM plugin (dsv4_ops.vllm.plugin, entry point registration/vllm_plugin.py) and the sm_8x pieces it installs (dsv4_ops.vllm).

Needs vllm==0.33.0 (the ``test`` extra); skipped without it. Runs on the CPU: the capability
is spoofed on vLLM's platform class, and the dsv4_ampere ops run their CPU references.
"""

from types import SimpleNamespace as NS

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the plugin tests need vllm==0.33.0 (pip install dsv4-ops[test])")

from dsv4_ops import layout, reference  # noqa: E402
from dsv4_ops.vllm import plugin as vp  # noqa: E402
from dsv4_ops.vllm.table import patch_table_markdown, patches  # noqa: E402
from dsv4_ops.vllm import attention as va  # noqa: E402
from dsv4_ops.vllm import compressed_cache as vc  # noqa: E402
from dsv4_ops.vllm import o_proj as vo  # noqa: E402

V4_MODEL = "vllm.models.deepseek_v4.nvidia.model"
V41_MODEL = "vllm.models.deepseek_v41.nvidia.model"
V4_FLASHMLA = "vllm.models.deepseek_v4.nvidia.flashmla"
V41_FLASHMLA = "vllm.models.deepseek_v41.nvidia.flashmla"


@pytest.fixture(autouse=True)
def clean_plugin(monkeypatch):
    """Every test starts and ends with vLLM unpatched and register() not yet run."""
    monkeypatch.delenv("DSV4_AMPERE_IMPL", raising=False)
    vp.reset()
    yield
    vp.reset()


def spoof(monkeypatch, cap):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    value = None if cap is None else DeviceCapability(*cap)
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: value))


def mod(name):
    import importlib

    return importlib.import_module(name)


def vllm_config():
    return NS(attention_config=NS(backend=None), parallel_config=NS(prefill_context_parallel_size=1))


# ---------------------------------------------------------------------------- plugin loading

def test_vllm_loader_discovers_and_runs_the_entry_point(monkeypatch):
    import vllm.plugins as plugins

    assert "dsv4_ops" in plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
    monkeypatch.setenv("VLLM_PLUGINS", "dsv4_ops")
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    plugins.load_general_plugins()
    assert vp.STATE.registered
    assert vp.STATE.capability is None and not vp.STATE.routed  # CPU: nothing to patch
    assert vp.STATE.patched == []


@pytest.mark.parametrize("cap", [(8, 0), (8, 6)])
def test_register_twice_is_harmless(monkeypatch, cap):
    spoof(monkeypatch, cap)
    original = mod(V4_FLASHMLA).dequantize_and_gather_k_cache
    vp.register()
    first = dict(vp.STATE.originals)
    patched = mod(V4_FLASHMLA).dequantize_and_gather_k_cache
    vp.register()
    assert vp.STATE.originals == first
    assert vp.apply_patches() == []  # idempotent even when called directly
    assert mod(V4_FLASHMLA).dequantize_and_gather_k_cache is patched is not original
    vp.unpatch()
    assert mod(V4_FLASHMLA).dequantize_and_gather_k_cache is original


# ------------------------------------------------------------------------ capability decision

@pytest.mark.parametrize("cap", [(8, 0), (8, 6)])
def test_sm8x_selects_the_ampere_class_for_v4_and_v41(monkeypatch, cap):
    spoof(monkeypatch, cap)
    vp.register()
    assert vp.STATE.routed and vp.STATE.capability == cap
    assert len(vp.STATE.patched) == sum(e.kind == "patch" for e in patches())
    for model, flashmla in ((V4_MODEL, V4_FLASHMLA), (V41_MODEL, V41_FLASHMLA)):
        cls = mod(model)._select_dsv4_attn_cls(vllm_config())
        base = mod(flashmla).DeepseekV4FlashMLAAttention
        assert issubclass(cls, base) and cls is not base and cls.dsv4_ampere
        assert cls.get_padded_num_q_heads(8) == 8 and cls.get_padded_num_q_heads(64) == 64
        assert cls._forward_decode is va._AmpereAttentionMixin._forward_decode
        assert cls._forward_prefill is base._forward_prefill  # kept; its callees are patched
    assert mod(V4_FLASHMLA).flash_mla_sparse_fwd is va.flash_mla_sparse_fwd_ampere
    assert mod(V41_FLASHMLA).dequantize_and_gather_k_cache is va.dequantize_and_gather_k_cache_ampere
    cutedsl = mod("vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl")
    assert cutedsl._SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL is vc.compress_norm_rope_store_ampere
    assert mod("vllm.models.deepseek_v41.compressor").rope_quant_insert is vc.rope_quant_insert_ampere


def test_sm90_patches_nothing(monkeypatch):
    spoof(monkeypatch, (9, 0))
    before = {(e.module, e.symbol): vp._resolve(e)[2] for e in patches()}
    vp.register()
    assert vp.STATE.registered and not vp.STATE.routed and vp.STATE.patched == []
    assert {(e.module, e.symbol): vp._resolve(e)[2] for e in patches()} == before
    assert mod(V4_MODEL)._select_dsv4_attn_cls(vllm_config()) is mod(V4_FLASHMLA).DeepseekV4FlashMLAAttention


def test_env_override_routes_without_a_gpu(monkeypatch):
    spoof(monkeypatch, None)
    monkeypatch.setenv("DSV4_AMPERE_IMPL", "portable")
    vp.register()
    assert vp.STATE.routed and vp.STATE.patched


def test_every_assumption_of_the_table_holds_in_the_installed_vllm():
    # Signatures, attributes and dataclass fields read, and by-name imports over all of vLLM's source.
    from dsv4_ops.vllm import versions

    assert versions.supported(vllm.__version__)
    rows = patches(versions.release(vllm.__version__))
    vp.check_table(rows, scan_source=True)
    assert rows == patches()  # the default table is the installed release's


def test_every_release_has_its_own_rows_and_they_are_disjoint_per_symbol():
    """A symbol whose params moved has one row per release span, never two for one release."""
    from dsv4_ops.vllm import table, versions

    every = table.patches(table.ALL)
    for rel in versions.SUPPORTED:
        rows = table.patches(rel)
        keys = [(r.module, r.symbol) for r in rows]
        assert len(keys) == len(set(keys)), f"two rows for one symbol in vLLM {rel}'s table"
        assert set(rows) == {r for r in every if not r.versions or rel in r.versions}
    assert any(r.versions for r in every)  # the table does differ by release


@pytest.mark.parametrize("installed", ["0.32.0", "0.35.0", "0.34.1.dev3+gabc", "0.34.0rc1"])
def test_register_refuses_an_untested_release_before_checking_rows(monkeypatch, installed):
    from dsv4_ops.vllm import versions

    spoof(monkeypatch, (8, 0))
    monkeypatch.setattr(vp, "vllm_version", lambda: installed)
    monkeypatch.setattr(vp, "check_table", lambda *a, **k: pytest.fail("rows checked on an untested release"))
    with pytest.raises(vp.VllmVersionError) as err:
        vp.register()
    msg = str(err.value)
    assert installed in msg and all(v in msg for v in versions.SUPPORTED) and "install_vllm" in msg
    assert vp.STATE.patched == [] and not vp.STATE.registered


@pytest.mark.parametrize("installed", ["0.34.0+cu130", "0.33.0.post1"])
def test_a_release_build_of_a_supported_version_is_accepted(installed):
    assert vp.check_version(installed) == installed.split("+")[0].replace(".post1", "")


def test_renamed_metadata_field_is_caught(monkeypatch):
    import dataclasses

    swa = mod("vllm.v1.attention.backends.mla.sparse_swa")
    original = swa.DeepseekSparseSWAMetadata
    fields = [(("decode_swa_idx" if f.name == "decode_swa_indices" else f.name), f.type, f)
              for f in dataclasses.fields(original)]
    renamed = dataclasses.make_dataclass("DeepseekSparseSWAMetadata", [(n, t, dataclasses.field(default=None))
                                                                        for n, t, _ in fields])
    monkeypatch.setattr(swa, "DeepseekSparseSWAMetadata", renamed)
    with pytest.raises(vp.VllmPatchError, match=r"DeepseekSparseSWAMetadata no longer has decode_swa_indices") as err:
        vp.check_table(scan_source=False)
    assert vllm.__version__ in str(err.value)


def test_missing_layer_attribute_is_caught(monkeypatch):
    cls = mod(V41_FLASHMLA).DeepseekV4FlashMLAAttention
    monkeypatch.setattr(vp, "_assigned_self_attrs", lambda klass: set())  # as if __init__ stopped setting them
    with pytest.raises(vp.VllmPatchError, match=r"DeepseekV4FlashMLAAttention no longer has .*topk_indices_buffer"):
        vp.check_reads([r for e in patches() for r in e.reads if r.cls == cls.__name__])


def test_new_by_name_import_is_caught_at_register(monkeypatch):
    import sys
    import types

    spoof(monkeypatch, (8, 0))
    copy = types.ModuleType("vllm.models.deepseek_v4.nvidia.new_prefill_path")
    copy.dequantize_and_gather_k_cache = mod(V4_FLASHMLA).dequantize_and_gather_k_cache
    monkeypatch.setitem(sys.modules, copy.__name__, copy)
    with pytest.raises(vp.VllmPatchError, match=r"new_prefill_path imports dequantize_and_gather_k_cache by name"):
        vp.register()
    assert vp.STATE.patched == [] and not vp.STATE.registered


def test_new_by_name_import_is_found_in_source(tmp_path):
    root = tmp_path / "vllm"
    (root / "models" / "newmodel").mkdir(parents=True)
    for pkg in (root, root / "models", root / "models" / "newmodel"):
        (pkg / "__init__.py").write_text("")
    (root / "models" / "newmodel" / "prefill.py").write_text(
        "from vllm.models.deepseek_v4.nvidia.flashmla import dequantize_and_gather_k_cache\n"
        "def f(*a):\n    return dequantize_and_gather_k_cache(*a)\n")
    (root / "models" / "newmodel" / "lazy.py").write_text(
        "def f(*a):\n    from vllm.models.deepseek_v4.nvidia.flashmla import dequantize_and_gather_k_cache\n"
        "    return dequantize_and_gather_k_cache(*a)\n")  # binds at call time: sees the patch
    found = vp.by_name_importers({V4_FLASHMLA}, "dequantize_and_gather_k_cache", root)
    assert found == {"vllm.models.newmodel.prefill"}
    rows = tuple(e for e in patches() if e.symbol == "dequantize_and_gather_k_cache" and e.model == "v4")
    with pytest.raises(vp.VllmPatchError, match=r"vllm.models.newmodel.prefill imports"):
        vp.check_call_sites(rows, root=root, scan_source=True)


def test_no_dsv4_caller_reads_the_prefill_return_value():
    """flash_mla_sparse_fwd_ampere's lse includes the sink (FlashMLA's excludes it): prove no
    DSv4 caller reads the return value, so the convention cannot leak."""
    import ast
    import pathlib

    root = pathlib.Path(vllm.__file__).parent / "models"
    calls = 0
    for path in list(root.glob("deepseek_v4/**/*.py")) + list(root.glob("deepseek_v41/**/*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                    "flash_mla_sparse_fwd":
                calls += 1
                assert isinstance(parents[node], ast.Expr), f"{path}:{node.lineno} reads flash_mla_sparse_fwd's result"
    assert calls >= 2  # V4 and V4.1 prefill


def test_docs_patch_table_is_the_generated_one():
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "vllm_plugin.md").read_text()
    begin = text.index("<!-- patch-table:begin")
    begin = text.index("\n", begin) + 1
    end = text.index("<!-- patch-table:end -->")
    assert text[begin:end].strip() == patch_table_markdown().strip(), \
        "docs/vllm_plugin.md's patch table is stale: paste dsv4_ops.vllm.table.patch_table_markdown() between the markers"


def test_signature_mismatch_names_symbol_and_version(monkeypatch):
    def changed(out, k_cache, seq_lens, block_table, block_size, offset):  # gather_lens dropped
        pass

    monkeypatch.setattr(mod(V4_FLASHMLA), "dequantize_and_gather_k_cache", changed)
    with pytest.raises(vp.VllmPatchError) as err:
        vp.check_table(scan_source=False)
    msg = str(err.value)
    assert "vllm.models.deepseek_v4.nvidia.flashmla.dequantize_and_gather_k_cache" in msg
    assert vllm.__version__ in msg and "0.33.0" in msg


def test_missing_symbol_and_register_refuses(monkeypatch):
    spoof(monkeypatch, (8, 0))
    monkeypatch.delattr(mod(V41_MODEL), "_select_dsv4_attn_cls")
    with pytest.raises(vp.VllmPatchError, match=r"deepseek_v41\.nvidia\.model\._select_dsv4_attn_cls is missing"):
        vp.register()
    assert vp.STATE.patched == [] and not vp.STATE.registered


def test_jit_warmup_is_wrapped_on_sm8x_only(monkeypatch):
    """The filter's decisions are tested in tests/test_audit_vllm.py; here: it is installed on
    sm_8x, the warmup is vLLM's own on sm_90, and registration is vLLM's own everywhere."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    original = JitWarmupRegistry.__dict__["warmup"]
    register = JitWarmupRegistry.__dict__["register"]
    spoof(monkeypatch, (9, 0))
    vp.register()
    assert JitWarmupRegistry.__dict__["warmup"] is original
    vp.reset()
    spoof(monkeypatch, (8, 0))
    vp.register()
    assert JitWarmupRegistry.__dict__["warmup"] is not original
    assert JitWarmupRegistry.__dict__["register"] is register
    vp.unpatch()
    assert JitWarmupRegistry.__dict__["warmup"] is original


# ------------------------------------------------------------------ startup choices (sm_8x only)

from dsv4_ops.vllm import quant_guard as qg  # noqa: E402
from dsv4_ops.vllm import serve_host as sh  # noqa: E402

SAMPLER = sh.SAMPLER_ENV


def _toolchain(ok: bool):
    home = "/opt/cuda-13"
    files = {f"{home}/bin/nvcc", f"{home}/lib64/libcudart.so", f"{home}/lib64/stubs/libcuda.so"} | \
        {f"{home}/include/{h}" for h in sh.SAMPLER_HEADERS}
    return sh.read_toolchain({"CUDA_HOME": home} if ok else {}, which=lambda n: f"/usr/bin/{n}" if n != "nvcc" else None,
                             exists=files.__contains__, nvcc_release=lambda _: "13.0", jit_cache=False)


def test_startup_sampler_choice():
    env = {}
    said = vp.startup_choices(env, _toolchain(False), "13.0")
    assert env[SAMPLER] == "0" and "Triton" in said[0] and "no CUDA toolkit" in said[0]
    env = {}
    said = vp.startup_choices(env, _toolchain(True), "13.0")
    assert SAMPLER not in env and "FlashInfer" in said[0]
    env = {SAMPLER: "0"}
    assert "as set" in vp.startup_choices(env, _toolchain(True), "13.0")[0] and env == {SAMPLER: "0"}
    with pytest.raises(vp.UnauditedServePathError, match=f"{SAMPLER}=1 asks for FlashInfer"):
        vp.startup_choices({SAMPLER: "1"}, _toolchain(False), "13.0")
    assert "FlashInfer" in vp.startup_choices({SAMPLER: "1"}, _toolchain(True), "13.0")[0]


def test_triton_sampler_env_is_what_vllm_reads(monkeypatch):
    """The variable the plugin sets turns vLLM's own FlashInfer sampler choice off."""
    from vllm.v1.sample.ops import topk_topp_sampler as ts

    from dsv4_ops.vllm.platform_view import answering

    env = {}
    vp.startup_choices(env, _toolchain(False), "13.0")
    monkeypatch.setenv(SAMPLER, env[SAMPLER])
    # answering() removes the attribute from the platform instance afterwards; a monkeypatch
    # here left the platform changed for later tests (test_wo_a_formats' MXFP8 selection)
    with answering(is_cuda=lambda: True):
        assert ts.flashinfer_sampler_supported() is False


@pytest.mark.parametrize("env", [{"VLLM_BATCH_INVARIANT": "1"}, {"VLLM_MARLIN_INPUT_DTYPE": "fp8"},
                                 {"VLLM_DISABLED_KERNELS": "MarlinFP8ScaledMMLinearKernel"}])
def test_settings_off_the_audited_kernels_are_refused_at_register(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spoof(monkeypatch, (9, 0))
    vp.register()  # sm_90+: vLLM's own kernels, nothing refused
    assert vp.STATE.registered and not vp.STATE.patched
    vp.reset()
    spoof(monkeypatch, (8, 0))
    with pytest.raises(vp.UnauditedServePathError, match=next(iter(env))):
        vp.register()
    assert vp.STATE.patched == [] and not vp.STATE.registered


def test_register_line_reaches_stderr_before_vllm_configures_logging(monkeypatch, capsys):
    """vLLM loads general plugins before LLM() configures its logging: the plugin's line must
    not be dropped there (no handler anywhere -> stderr), and must go through logging after."""
    import logging

    spoof(monkeypatch, (8, 0))
    logger = logging.getLogger("vllm.plugins.dsv4_ops")
    monkeypatch.setattr(logger, "hasHandlers", lambda: False)
    vp.register()
    err = capsys.readouterr().err
    assert "dsv4_ops plugin (pid" in err and "capability sm_80" in err, err
    vp.reset()
    monkeypatch.setattr(logger, "hasHandlers", lambda: True)
    vp.register()
    assert "dsv4_ops plugin" not in capsys.readouterr().err


def test_register_sets_the_triton_sampler_and_says_so(monkeypatch, caplog):
    import logging
    import os

    monkeypatch.delenv(SAMPLER, raising=False)
    broken = _toolchain(False)
    monkeypatch.setattr(sh, "read_toolchain", lambda: broken)
    spoof(monkeypatch, (9, 0))
    vp.register()
    assert SAMPLER not in os.environ  # sm_90+: vLLM decides
    vp.reset()
    spoof(monkeypatch, (8, 0))
    logger = logging.getLogger("vllm.plugins.dsv4_ops")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.dsv4_ops"):
        vp.register()
    assert os.environ[SAMPLER] == "0"
    assert any("sampler: Triton" in r.getMessage() for r in caplog.records), caplog.text
    vp.reset()
    assert SAMPLER not in os.environ  # reset() restores what register() set


def _quant_config(pkg, block, expert_dtype="fp4", moe_algo=""):
    cls = mod(f"vllm.models.{pkg}.quant_config").DeepseekV4FP8Config
    cfg = cls.from_config({"quant_method": "fp8", "weight_block_size": block, "activation_scheme": "dynamic",
                           "fmt": "e4m3", "scale_fmt": "ue8m0"})
    cfg._resolved_expert_dtype, cfg._resolved_moe_quant_algo = expert_dtype, moe_algo  # as vLLM resolves them
    return cfg


def test_quant_guard_accepts_the_audited_layouts_of_vllms_config():
    assert "MarlinFP8" in qg.check_quant_config(_quant_config("deepseek_v4", [128, 128]), "v4").linear
    assert "MarlinMxfp8" in qg.check_quant_config(_quant_config("deepseek_v41", [32, 32]), "v41").linear
    ok = NS(linear_backend="marlin", moe_backend="auto", linear_backend_per_quant=None)
    qg.check_quant_config(_quant_config("deepseek_v4", [128, 128]), "v4", ok)


@pytest.mark.parametrize("pkg,block,expert,algo,kernel,words", [
    ("deepseek_v41", [32, 32], "fp4", "NVFP4", None, "ModelOptNvFp4FusedMoE"),
    ("deepseek_v4", [128, 128], "fp8", "", None, "Fp8MoEMethod"),
    ("deepseek_v41", [128, 128], "fp4", "", None, "not a layout the audit covers"),
    ("deepseek_v4", [128, 128], "fp4", "", NS(linear_backend="triton", moe_backend="auto"), "--linear-backend triton"),
    ("deepseek_v41", [32, 32], "fp4", "", NS(linear_backend="auto", moe_backend="triton"), "--moe-backend triton"),
])
def test_quant_guard_refuses_at_model_build(monkeypatch, pkg, block, expert, algo, kernel, words):
    """Wrapped on sm_8x: get_quant_method (the first call, at model build) raises before vLLM
    builds any method; unwrapped on sm_90."""
    variant = "v41" if pkg.endswith("41") else "v4"
    monkeypatch.setattr(qg, "_current_kernel_config", lambda: kernel)
    monkeypatch.setattr(vp, "startup_choices", lambda: [])
    cls = mod(f"vllm.models.{pkg}.quant_config").DeepseekV4FP8Config
    original = cls.__dict__["get_quant_method"]
    spoof(monkeypatch, (9, 0))
    vp.register()
    assert cls.__dict__["get_quant_method"] is original
    vp.reset()
    spoof(monkeypatch, (8, 0))
    vp.register()
    assert cls.__dict__["get_quant_method"] is not original
    cfg = _quant_config(pkg, block, expert, algo)
    with pytest.raises(qg.UnauditedServePathError, match=words) as err:
        cfg.get_quant_method(NS(), "model.layers.0.ffn.experts")
    assert "Refused at startup" in str(err.value) and ("V4.1" if variant == "v41" else "V4") in str(err.value)
    good = _quant_config(pkg, [128, 128] if variant == "v4" else [32, 32])
    if kernel is None:  # an audited layout passes through to vLLM's own method
        assert good.get_quant_method(object(), "lm_head") is original(good, object(), "lm_head")


class _QuarkLike:
    """A quant config of another family, as vLLM would build for a Quark checkpoint."""

    def get_name(self):
        return "quark"


@pytest.mark.parametrize("pkg", ["deepseek_v4", "deepseek_v41"])
def test_attention_refuses_a_quant_config_no_audit_covers(monkeypatch, pkg):
    """The sm_8x attention layer's constructor (model build, before weights load) accepts bf16
    weights (no quant config) and DeepseekV4FP8Config, and refuses any other family by name."""
    from dsv4_ops.vllm import attention as va

    base = mod(f"vllm.models.{pkg}.nvidia.flashmla").DeepseekV4FlashMLAAttention
    hooked = []
    monkeypatch.setattr(va, "install_wo_a_bf16_hook", lambda *a: hooked.append(a))
    layer = NS(_dsv4_ampere_base=base, wo_a=object(), n_local_groups=1, o_lora_rank=8)
    for accepted in (None, _quant_config(pkg, [128, 128] if pkg == "deepseek_v4" else [32, 32])):
        monkeypatch.setattr(qg, "current_quant_config", lambda c=accepted: c)
        va._AmpereAttentionMixin._dsv4_ampere_post_init(layer)
    assert len(hooked) == 2
    monkeypatch.setattr(qg, "current_quant_config", _QuarkLike)
    with pytest.raises(qg.UnauditedServePathError, match="'quark'.*Refused at startup"):
        va._AmpereAttentionMixin._dsv4_ampere_post_init(layer)
    assert len(hooked) == 2


# ------------------------------------------------------------------------------ tiny caches

def make_cache(num_blocks, block_size, n_rows, seed):
    """uint8 cache [num_blocks, block_size, 584] with vLLM's padded page stride, every slot written."""
    g = torch.Generator().manual_seed(seed)
    page = layout.vllm_page_bytes(block_size)
    storage = torch.zeros(num_blocks, page, dtype=torch.uint8)
    cache3d = storage[:, :block_size * layout.RECORD_BYTES].view(num_blocks, block_size, layout.RECORD_BYTES)
    kv = (torch.randn(n_rows, 512, generator=g) * 2).to(torch.bfloat16)
    torch.ops.dsv4_ampere.kv_cache_insert(kv, vc.as_paged_2d(cache3d), torch.arange(n_rows), block_size)
    return cache3d


def rows_of(cache3d, slots):
    """Independent dequantization of the records at ``slots`` (any shape): bf16 [..., 512]."""
    return reference.ref_kv_cache_gather(vc.as_paged_2d(cache3d), slots, cache3d.shape[1])


def dense_attention(q, keys, valid, sink, scale):
    """float64 softmax with sink over explicit keys [T, K, 512] / mask [T, K]."""
    s = torch.einsum("thd,tkd->thk", q.double(), keys.double()) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    full = torch.cat([s, sink.double()[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", p, keys.double())


# --------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("H", [8, 16])
def test_ampere_decode_matches_reference_attention(H):
    T, W, K, bs_w, bs_c = 3, 6, 5, 4, 2
    swa = make_cache(4, bs_w, 16, seed=1)
    comp = make_cache(5, bs_c, 10, seed=2)
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(T, H, 512, generator=g) * 0.1).to(torch.bfloat16)
    swa_idx = torch.randint(0, 16, (T, 1, W), generator=g, dtype=torch.int32)
    swa_idx[1, 0, 4:] = -1
    swa_lens = torch.tensor([W, 4, 3], dtype=torch.int32)  # token 2: entries 3.. ignored
    topk = torch.randint(0, 10, (T, 1, K), generator=g, dtype=torch.int32)
    topk[0, 0, 2] = -1
    topk_lens = torch.tensor([K, 2, 0], dtype=torch.int32)  # token 2: no compressed keys
    sink = torch.tensor([0.5, float("-inf")] * (H // 2), dtype=torch.float32)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    va.ampere_decode(q, out, swa, swa_idx, swa_lens, bs_w, comp, topk, topk_lens, bs_c, sink, 512 ** -0.5)

    ks, ts = swa_idx[:, 0].long(), topk[:, 0].long()
    keys = torch.cat([rows_of(comp, ts.clamp(min=0)), rows_of(swa, ks.clamp(min=0))], dim=1)
    jk, jw = torch.arange(K), torch.arange(W)
    valid = torch.cat([(ts >= 0) & (jk[None] < topk_lens[:, None]), (ks >= 0) & (jw[None] < swa_lens[:, None])], 1)
    want = dense_attention(q, keys, valid, sink, 512 ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), want.flatten(), dim=0)
    assert cos > 0.9999


def test_ampere_class_forward_decode_c128_path():
    """The class's _forward_decode (V4, C128A: top-k precomputed by the metadata builder)."""
    cls = va.make_ampere_attention_cls(mod(V4_FLASHMLA).DeepseekV4FlashMLAAttention)
    assert va.make_ampere_attention_cls(mod(V4_FLASHMLA).DeepseekV4FlashMLAAttention) is cls
    H, T, W, K = 8, 2, 4, 3
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    swa = make_cache(3, 4, 12, seed=5)
    comp = make_cache(3, 2, 6, seed=6)
    layer.swa_cache_layer = NS(kv_cache=swa)
    layer.attn_sink = torch.full((H,), 0.25)
    layer.scale, layer.compress_ratio = 512 ** -0.5, 128
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(T, H, 512, generator=g) * 0.1).to(torch.bfloat16)
    swa_meta = NS(num_decodes=T, num_decode_tokens=T, block_size=4,
                  decode_swa_indices=torch.randint(0, 12, (T, 1, W), generator=g, dtype=torch.int32),
                  decode_swa_lens=torch.full((T,), W, dtype=torch.int32))
    attn_meta = NS(block_size=256, c128a_global_decode_topk_indices=torch.randint(0, 6, (T, 1, K), generator=g,
                                                                                   dtype=torch.int32),
                   c128a_decode_topk_lens=torch.full((T,), K, dtype=torch.int32))
    out = torch.empty(T, H, 512, dtype=torch.bfloat16)
    layer._forward_decode(q, comp, swa_meta, attn_meta, False, out)
    want = torch.empty_like(out)
    va.ampere_decode(q, want, swa, swa_meta.decode_swa_indices, swa_meta.decode_swa_lens, 4, comp,
                     attn_meta.c128a_global_decode_topk_indices, attn_meta.c128a_decode_topk_lens, 2,
                     layer.attn_sink, layer.scale)
    assert torch.equal(out, want)
    swa_only = torch.empty_like(out)
    layer._forward_decode(q, None, swa_meta, None, True, swa_only)
    keys = rows_of(swa, swa_meta.decode_swa_indices[:, 0].long())
    want = dense_attention(q, keys, torch.ones(T, W, dtype=torch.bool), layer.attn_sink, layer.scale)
    torch.testing.assert_close(swa_only.double(), want, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------- prefill

def test_prefill_gather_matches_vllm_semantics():
    bs = 4
    cache = make_cache(6, bs, 24, seed=8)
    block_table = torch.tensor([[5, 0, 2, 1], [3, 4, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 6], dtype=torch.int32)
    gather_lens = torch.tensor([5, 6], dtype=torch.int32)
    offset, M = 2, 9
    sentinel = torch.full((2, M, 512), 7.0, dtype=torch.bfloat16)
    out = sentinel.clone()
    va.dequantize_and_gather_k_cache_ampere(out, cache, seq_lens, gather_lens, block_table, bs, offset)
    want = sentinel.clone()
    for b in range(2):
        for i in range(int(gather_lens[b])):
            p = int(seq_lens[b] - gather_lens[b]) + i
            slot = int(block_table[b, p // bs]) * bs + p % bs
            want[b, offset + i] = rows_of(cache, torch.tensor([slot]))[0]
    assert torch.equal(out, want)  # rows past gather_len are left as they were
    with pytest.raises(NotImplementedError, match="FNUZ"):
        va.dequantize_and_gather_k_cache_ampere(out, cache, seq_lens, None, block_table, bs, 0, use_fnuz=True)


def test_prefill_sparse_fwd_matches_reference():
    g = torch.Generator().manual_seed(9)
    S, H, N, K = 4, 8, 20, 7
    q = (torch.randn(S, H, 512, generator=g) * 0.1).to(torch.bfloat16)
    kv = torch.randn(N, 1, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, N, (S, 1, K), generator=g, dtype=torch.int32)
    lens = torch.tensor([7, 3, 0, 5], dtype=torch.int32)
    sink = torch.linspace(-1, 1, H)
    out = torch.empty(S, H, 512, dtype=torch.bfloat16)
    res = va.flash_mla_sparse_fwd_ampere(q, kv, idx, 512 ** -0.5, attn_sink=sink, topk_length=lens, out=out)
    assert res[0] is out
    want, _ = reference.ref_sparse_mla_decode(q, kv[:, 0], idx[:, 0], lens, sink, 512 ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------- compressed-cache writers

def _expected_compressed_row(state, block_table, req, p, bs, sw, ratio, overlap, w, eps, cos_sin, head=512):
    """float64, one token, straight from the Triton kernel's definition (head 512 or 128)."""
    Wn = (1 + overlap) * ratio
    kvs, scs = [], []
    for j in range(Wn):
        pos = p - Wn + 1 + j
        if pos < 0:
            continue
        row = state[int(block_table[req, pos // bs]), pos % bs].double()
        off = head if j >= ratio else 0
        kvs.append(row[off:off + head])
        scs.append(row[sw + off:sw + off + head])
    kv, sc = torch.stack(kvs), torch.stack(scs)
    c = (torch.softmax(sc, 0) * kv).sum(0)
    normed = c / torch.sqrt((c * c).mean() + eps) * w.double()
    cs = cos_sin[(p // ratio) * ratio].double()
    r = head - 64
    e, o = normed[r::2].clone(), normed[r + 1::2].clone()
    normed[r::2], normed[r + 1::2] = e * cs[:32] - o * cs[32:], o * cs[:32] + e * cs[32:]
    return normed


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_v4_compressed_writer_matches_triton_kernel_math(ratio, overlap):
    g = torch.Generator().manual_seed(10 + ratio)
    coff = 1 + overlap
    sw = coff * 512
    bs, nblk = 8, 4
    state = torch.randn(nblk, bs, 2 * sw, generator=g)
    block_table = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    positions = torch.tensor([3, 7, 8, 11, 15, 2, 7], dtype=torch.int64)
    req = torch.tensor([0, 0, 0, 0, 0, 1, 1], dtype=torch.int32)
    state_slots = torch.tensor([0, 1, 2, 3, -1, 4, 5])  # token 4: no state slot -> skipped
    kv_slots = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    w = torch.rand(512, generator=g) + 0.5
    cos_sin = torch.cat([torch.cos(torch.rand(32, 32, generator=g)), torch.sin(torch.rand(32, 32, generator=g))], 1)
    kv_cache = torch.zeros(4, 2, layout.RECORD_BYTES, dtype=torch.uint8)
    vc.compress_norm_rope_store_ampere(
        state_cache=state, num_actual=7, token_to_req_indices=req, positions=positions, slot_mapping=state_slots,
        block_table=block_table, block_size=bs, state_width=sw, cos_sin_cache=cos_sin, kv_cache=kv_cache,
        k_cache_metadata=NS(slot_mapping=kv_slots), pdl_kwargs={}, head_dim=512, rope_head_dim=64,
        compress_ratio=ratio, overlap=overlap, use_fp4_cache=False, rms_norm_weight=w, rms_norm_eps=1e-6,
        quant_block=64, token_stride=576, scale_dim=8)
    got = rows_of(kv_cache, kv_slots)
    for t in range(7):
        p = int(positions[t])
        boundary = (p + 1) % ratio == 0 and int(state_slots[t]) >= 0
        if not boundary:
            assert torch.count_nonzero(got[t]) == 0, f"token {t} is not a boundary and must not be written"
            continue
        want = _expected_compressed_row(state, block_table, int(req[t]), p, bs, sw, ratio, int(overlap), w, 1e-6,
                                        cos_sin)
        torch.testing.assert_close(got[t, 448:].double(), want[448:], atol=1e-2, rtol=1e-2)  # bf16 RoPE dims
        err = (got[t, :448].double() - want[:448]).abs().view(7, 64).amax(1)
        assert (err <= want[:448].abs().view(7, 64).amax(1) / 8).all()  # within e4m3 precision per group


@pytest.mark.parametrize("ratio,overlap", [(4, True), (4, False)], ids=["c4-overlap", "c4"])
def test_v4_indexer_compressor_writer_matches_triton_kernel_math(ratio, overlap):
    """The head-128 indexer compressor (vLLM's _fused_kv_compress_norm_rope_insert_indexer_attn):
    bf16 row -> per-row fp32 power-of-two scale + E4M3 codes, checked by decoding the bytes."""
    g = torch.Generator().manual_seed(20 + overlap)
    sw = (1 + overlap) * 128
    bs, nblk = 8, 4
    state = torch.randn(nblk, bs, 2 * sw, generator=g)
    block_table = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    positions = torch.tensor([3, 7, 8, 11, 15, 2, 7], dtype=torch.int64)
    req = torch.tensor([0, 0, 0, 0, 0, 1, 1], dtype=torch.int32)
    state_slots = torch.tensor([0, 1, 2, 3, -1, 4, 5])
    kv_slots = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    w = torch.rand(128, generator=g) + 0.5
    cos_sin = torch.cat([torch.cos(torch.rand(32, 32, generator=g)), torch.sin(torch.rand(32, 32, generator=g))], 1)
    tokens_per_block = 2
    kv_cache = torch.full((4, tokens_per_block, 132), 0xAB, dtype=torch.uint8)
    before = kv_cache.clone()
    vc.compress_norm_rope_store_indexer_ampere(
        state_cache=state, num_actual=7, token_to_req_indices=req, positions=positions, slot_mapping=state_slots,
        block_table=block_table, block_size=bs, state_width=sw, cos_sin_cache=cos_sin, kv_cache=kv_cache,
        k_cache_metadata=NS(slot_mapping=kv_slots), pdl_kwargs={}, head_dim=128, rope_head_dim=64,
        compress_ratio=ratio, overlap=overlap, use_fp4_cache=False, rms_norm_weight=w, rms_norm_eps=1e-6,
        quant_block=128, token_stride=128, scale_dim=4)
    blk, pos = kv_slots // tokens_per_block, kv_slots % tokens_per_block
    codes, scales = reference.ref_indexer_read_rows(kv_cache, tokens_per_block, blk, pos)
    codes_before, _ = reference.ref_indexer_read_rows(before, tokens_per_block, blk, pos)
    for t in range(7):
        p = int(positions[t])
        if not ((p + 1) % ratio == 0 and int(state_slots[t]) >= 0):
            assert torch.equal(codes[t], codes_before[t]), f"token {t} is not a boundary and must not be written"
            continue
        want = _expected_compressed_row(state, block_table, int(req[t]), p, bs, sw, ratio, int(overlap), w, 1e-6,
                                        cos_sin, head=128)
        amax = want.abs().max().clamp(min=1e-4)
        e = torch.ceil(torch.log2(amax / 448))
        assert scales[t].item() == 2.0 ** e.item() or scales[t].item() == 2.0 ** (e.item() + 1)  # bf16 rounding
        got = reference.ref_e4m3_decode(codes[t]).double() * scales[t].double()
        assert ((got - want).abs() <= want.abs() / 8 + scales[t] * 2.0 ** -9).all()  # e4m3 precision


def test_v41_rope_quant_insert_writes_only_boundary_tokens():
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 2, 3, 5])
    slots = torch.tensor([0, 1, 2, -1, 4])
    cos_sin = torch.cat([torch.ones(8, 32), torch.zeros(8, 32)], 1)  # identity rotation
    kv_cache = torch.zeros(3, 2, layout.RECORD_BYTES, dtype=torch.uint8)
    vc.rope_quant_insert_ampere(latent, positions, cos_sin, kv_cache, slots, 2)
    ref = torch.zeros_like(kv_cache)
    keep = torch.tensor([-1, 1, -1, -1, 4])  # positions 1 and 5 close a group of 2; token 3 has no slot
    reference.ref_kv_cache_insert(latent, vc.as_paged_2d(ref), keep, 2)
    assert torch.equal(kv_cache, ref)
    with pytest.raises(NotImplementedError, match="584"):
        vc.rope_quant_insert_ampere(latent, positions, cos_sin, torch.zeros(3, 2, 528, dtype=torch.uint8), slots, 2)


# ---------------------------------------------------------------------------------- o_proj

def _inverse_rope_f64(o, positions, cos_sin):
    """float64 inverse GPT-J rotation of dims 448..511 of o [T, H, 512]."""
    x = o.double().clone()
    c, s = cos_sin[positions].double()[:, None, :32], cos_sin[positions].double()[:, None, 32:]
    e, od = x[..., 448::2].clone(), x[..., 449::2].clone()
    x[..., 448::2], x[..., 449::2] = e * c + od * s, od * c - e * s
    return x


def test_o_proj_matches_grouped_einsum():
    g = torch.Generator().manual_seed(12)
    T, H, G, R, hidden = 3, 4, 2, 16, 24
    o = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 9])
    ang = torch.rand(10, 32, generator=g) * 6
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1)
    wa = (torch.randn(G, R, (H // G) * 512, generator=g) * 0.02).to(torch.bfloat16)
    wb = torch.randn(hidden, G * R, generator=g).to(torch.bfloat16)
    got = vo.ampere_o_proj(o, positions, cos_sin, wa, lambda z: z @ wb.T)
    x = _inverse_rope_f64(o, positions, cos_sin)
    z = torch.einsum("tgk,grk->tgr", x.view(T, G, -1), wa.double()).reshape(T, G * R)
    torch.testing.assert_close(got.double(), z @ wb.double().T, atol=0.1, rtol=2e-2)
    # forward then inverse rotation is the identity
    x32 = torch.randn(T, 512, generator=g)
    cs = cos_sin[positions]
    back = vo.gptj_rotate_tail(vo.gptj_rotate_tail(x32, cs, inverse=False), cs, inverse=True)
    torch.testing.assert_close(back, x32, atol=1e-5, rtol=1e-5)


def test_wo_a_block_fp8_dequantized_once_at_load():
    g = torch.Generator().manual_seed(13)
    G, R, K = 2, 128, 256
    w = (torch.randn(G * R, K, generator=g) * 3).clamp(-440, 440).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 130, (G * R // 128, K // 128), generator=g, dtype=torch.uint8)
    calls = []
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(exps.view(torch.float8_e8m0fnu), requires_grad=False)
    layer.weight_block_size = [128, 128]
    layer.quant_method = NS(process_weights_after_loading=lambda lyr: calls.append(lyr))
    vo.install_wo_a_bf16_hook(layer, G, R)
    vo.install_wo_a_bf16_hook(layer, G, R)  # idempotent: one wrapper
    layer.quant_method.process_weights_after_loading(layer)
    assert calls == [layer]
    scale = torch.exp2(exps.double() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = (w.double() * scale).to(torch.bfloat16).view(G, R, K)
    assert torch.equal(vo.wo_a_weight_bf16(layer, G, R), want)


def _grouped_wo_a_module():
    import importlib.util

    name = "vllm.models.deepseek_v4.common.grouped_wo_a"
    return mod(name) if importlib.util.find_spec("vllm.models.deepseek_v4.common") and \
        importlib.util.find_spec(name) else None


@pytest.mark.skipif(_grouped_wo_a_module() is None, reason="DeepseekV4GroupedWoA is vLLM 0.34+ (wo_a was a plain linear)")
def test_grouped_wo_a_replacements_match_the_float64_inverse_rope_and_grouped_einsum():
    """grouped_input == the float64 inverse rotation rounded once to bf16 (what vLLM's
    fused_inv_rope_fp8_quant(quantize=False) computes: fp32 math, one bf16 rounding), grouped
    [T, G, HPG * 512]; grouped_forward == the float64 grouped einsum of it."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    T, G, HPG, R = 5, 2, 4, 16
    o = torch.randn(T, G * HPG, 512, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 64, (T,), generator=g)
    ang = torch.rand(64, 32, generator=g) * 6
    cos_sin = torch.cat([ang.cos(), ang.sin()], 1)
    dims = dict(n_groups=G, heads_per_group=HPG, nope_dim=448, rope_dim=64)
    exact = _inverse_rope_f64(o, positions, cos_sin).view(T, G, HPG * 512)
    got = vo.grouped_input(None, o, positions, cos_sin, **dims)
    assert got.shape == (T, G, HPG * 512) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(T, G, HPG, 512)[..., :448], o.view(T, G, HPG, 512)[..., :448])  # NoPE untouched
    # one rounding of an fp32 result: within one bf16 ulp of the exact value
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-30).all()
    want = got

    layer = torch.nn.Module()
    wa = (torch.randn(G, R, HPG * 512, generator=g) * 0.02).to(torch.bfloat16)
    setattr(layer, vo.WO_A_BF16_ATTR, wa)
    z = vo.grouped_forward(layer, o, positions, cos_sin, o_lora_rank=R, einsum_recipe=(1, 1, 1),
                           tma_aligned_scales=False, **dims)
    ref = torch.einsum("tgk,grk->tgr", want.double(), wa.double())
    assert z.shape == (T, G, R)
    torch.testing.assert_close(z.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="not DSv4's layout"):
        vo.grouped_input(None, o, positions, cos_sin, n_groups=G, heads_per_group=HPG, nope_dim=384, rope_dim=128)


@pytest.mark.skipif(_grouped_wo_a_module() is None, reason="DeepseekV4GroupedWoA is vLLM 0.34+")
def test_register_on_sm80_routes_grouped_wo_a_to_torch(monkeypatch):
    spoof(monkeypatch, (8, 0))
    vp.register()
    cls = _grouped_wo_a_module().DeepseekV4GroupedWoA
    assert cls.grouped_input is vo.grouped_input and cls.grouped_forward is vo.grouped_forward


@pytest.mark.parametrize("lora, logits, refused", [
    (None, None, ()), (None, "auto", ()), (None, "float32", ()),
    (object(), None, ("LoRA",)), (None, "bfloat16", ("indexer_logits_dtype='bfloat16'",)),
    (object(), "bfloat16", ("LoRA", "bfloat16"))])
def test_model_settings_off_the_audited_path_are_refused_at_build(lora, logits, refused):
    import types

    from dsv4_ops.vllm import quant_guard

    cfg = types.SimpleNamespace(lora_config=lora, attention_config=types.SimpleNamespace(indexer_logits_dtype=logits))
    if not refused:
        quant_guard.check_serve_settings("v41", cfg)
        return
    with pytest.raises(quant_guard.UnauditedServePathError) as err:
        quant_guard.check_serve_settings("v4", cfg)
    assert all(r in str(err.value) for r in refused) and "DeepSeek-V4 " in str(err.value)


def test_bfloat16_indexer_logits_are_refused_by_the_replacements_too():
    from dsv4_ops.vllm import indexer as vi

    with pytest.raises(NotImplementedError, match="float32"):
        vi.fp8_fp4_mqa_logits((None, None), (None, None), None, None, None, 1, logits_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="float32"):
        vi.fp8_fp4_paged_mqa_logits((None, None), None, None, None, None, None, 1, logits_dtype=torch.bfloat16)
