"""``dsv4-ops doctor`` on faked hosts: each problem gives its own clear message, and a host
without it passes the same check (the control). Engram figures are checked against vLLM's own
layout (``EngramLayout``) and the rule written out independently here."""

import json

import pytest

from dsv4_ops.tools import cli, doctor
from dsv4_ops.tools.doctor import Deployment, Gpu, HostFacts, ModelInfo

GIB = 1 << 30
A100 = Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB)


def host(**kw):
    base = dict(driver="580.95.05", torch_version="2.14.0+cu130", torch_cuda="13.0", gpus=[A100] * 8,
                mem_total=2048 * GIB, mem_available=1900 * GIB, memlock_limit=None, cgroup_limit=None,
                cgroup_usage=None, shm_free=1024 * GIB, vllm_version="0.33.0", plugin_entry_points=["dsv4_ops"],
                vllm_plugins_env=None)
    base.update(kw)
    return HostFacts(**base)


def by_name(checks, name):
    got = [c for c in checks if c.name == name]
    assert len(got) == 1, (name, [c.line() for c in checks])
    return got[0]


# ------------------------------------------------------------------ driver

def test_driver_too_old_for_torch_cuda13():
    c = doctor.check_driver(host(driver="535.104.05"))
    assert c.status == "fail"
    assert "535.104.05" in c.message and "580.65.06" in c.message and "CUDA 13" in c.message
    assert "upgrade the driver" in c.message
    assert doctor.check_driver(host(driver="580.65.06")).status == "ok"
    assert doctor.check_driver(host(driver="580.65.05")).status == "fail"  # patch level counts


def test_cuda12_torch_accepts_an_r535_driver():
    assert doctor.check_driver(host(driver="535.104.05", torch_cuda="12.8")).status == "ok"


def test_cpu_torch_and_missing_driver_are_named():
    c = doctor.check_driver(host(torch_cuda=None, torch_version="2.14.0+cpu"))
    assert c.status == "fail" and "CPU build" in c.message
    c = doctor.check_driver(host(driver=None))
    assert c.status == "fail" and "no NVIDIA driver" in c.message


# ------------------------------------------------------------------ vLLM and the plugin

def test_plugin_entry_point_and_vllm_plugins_filter():
    ok = doctor.check_vllm(host())
    assert [c.status for c in ok] == ["ok", "ok"]
    filtered = by_name(doctor.check_vllm(host(vllm_plugins_env="other_plugin")), "plugin")
    assert filtered.status == "fail" and "VLLM_PLUGINS" in filtered.message and "dsv4_ops" in filtered.message
    assert by_name(doctor.check_vllm(host(vllm_plugins_env="other,dsv4_ops")), "plugin").status == "ok"
    missing = by_name(doctor.check_vllm(host(plugin_entry_points=[])), "plugin")
    assert missing.status == "fail" and "reinstall" in missing.message
    old = by_name(doctor.check_vllm(host(vllm_version="0.32.1")), "vllm")
    assert old.status == "warn" and "0.32.1" in old.message and "0.33.0" in old.message


# ------------------------------------------------------------------ GPUs

def _model(variant="v4", size=None, **cfg):
    arch = {"v4": "DeepseekV4ForCausalLM", "v41": "DeepseekV41ForCausalLM", "v32": "DeepseekV32ForCausalLM",
            "glm5": "GlmMoeDsaForCausalLM"}[variant]
    return ModelInfo("fake", dict(cfg, architectures=[arch]), variant, size)


def test_weights_that_do_not_fit_ask_for_more_parallelism():
    m = _model(size=600 * GIB)
    bad = by_name(doctor.check_gpus(host(), Deployment(tensor_parallel_size=4), m), "gpu memory")
    assert bad.status == "fail" and "150.0 GiB of weights per rank" in bad.message
    assert "--tensor-parallel-size" in bad.message
    good = by_name(doctor.check_gpus(host(), Deployment(tensor_parallel_size=8, pipeline_parallel_size=2), m),
                   "gpu memory")
    assert good.status == "ok" and "37.5 GiB of weights per rank" in good.message


def test_gpu_arch_and_count():
    old = by_name(doctor.check_gpus(host(gpus=[Gpu("Tesla V100", (7, 0), 32 * GIB)]), Deployment(), None), "gpu arch")
    assert old.status == "fail" and "sm_70" in old.message and "sm_80" in old.message
    few = by_name(doctor.check_gpus(host(gpus=[A100] * 4), Deployment(tensor_parallel_size=8), None), "gpu count")
    assert few.status == "fail" and "8" in few.message and "4 visible" in few.message
    assert by_name(doctor.check_gpus(host(gpus=[]), Deployment(), None), "gpu").status == "fail"


# ------------------------------------------------------------------ Engram

def engram_cfg(vocab=1000, heads=4, max_ngram=3, dim=256, layers=(1, 14)):
    pytest.importorskip("vllm", reason="the Engram layout is vLLM's own EngramLayout")
    from types import SimpleNamespace

    from vllm.models.deepseek_v41.common.engram import EngramLayout

    cfg = dict(engram_layer_ids=list(layers), engram_num_embeddings=[0] * len(layers), engram_max_ngram_size=max_ngram,
               engram_n_heads=heads, engram_head_dim=dim, engram_compressed_vocab_size=vocab,
               engram_pad_token_id=0, engram_vocab_size=vocab)
    layout = EngramLayout(SimpleNamespace(**cfg))
    cfg["engram_num_embeddings"] = [sum(s for g in layer for s in g) for layer in layout.primes]
    return cfg, layout


def _pow2(n):
    p = 1
    while p < n:
        p *= 2
    return p


def test_engram_pinned_share_is_rounded_to_powers_of_two():
    """DP 1: rank r of TP pins the rows of hash columns [r*c, (r+1)*c), c = ceil(cols / TP), as two
    allocations rounded up to powers of two; the node total is the sum over ranks."""
    cfg, layout = engram_cfg()
    tp = 3  # 8 columns over 3 ranks: 3 + 3 + 2, uneven on purpose
    per = doctor.engram_pinned_per_rank(cfg, tp)
    want = [0] * tp
    for layer in layout.primes:
        cols = [s for g in layer for s in g]
        c = -(-len(cols) // tp)
        for r in range(tp):
            rows = sum(cols[r * c:(r + 1) * c])
            want[r] += _pow2(rows * 256) + _pow2(rows * 8)
    assert per == want
    exact = doctor.engram_table_bytes(cfg)
    assert exact == sum(cfg["engram_num_embeddings"]) * (256 + 8)
    assert exact < sum(per) < 2 * exact  # rounding costs, never more than doubles


def test_too_little_lockable_and_free_memory():
    cfg, _ = engram_cfg()
    m = _model("v41", **cfg)
    d = Deployment(tensor_parallel_size=2)
    need = doctor.engram_need(cfg, d, None)
    assert need["mode"] == "pinned" and need["shm"] == 0
    ok = doctor.check_engram(host(), d, m)
    assert [c.status for c in ok] == ["ok"], [c.line() for c in ok]
    low_lock = by_name(doctor.check_engram(host(memlock_limit=need["pinned_rank"] // 2), d, m),
                       "engram lockable memory")
    assert low_lock.status == "warn" and "ulimit -l" in low_lock.message and "memlock=-1" in low_lock.message
    no_ram = by_name(doctor.check_engram(host(mem_available=need["pinned_node"] - 1), d, m), "engram host memory")
    assert no_ram.status == "fail" and "MemAvailable" in no_ram.message
    cgroup = by_name(doctor.check_engram(host(cgroup_limit=need["pinned_node"], cgroup_usage=GIB), d, m),
                     "engram host memory")
    assert cgroup.status == "fail" and "cgroup" in cgroup.message and "--memory" in cgroup.message


def test_dp_above_one_without_enough_dev_shm():
    cfg, _ = engram_cfg()
    m = _model("v41", **cfg)
    d = Deployment(tensor_parallel_size=2, data_parallel_size=2)
    tables = doctor.engram_table_bytes(cfg)
    shared = doctor.check_engram(host(shm_free=tables), d, m)
    assert by_name(shared, "engram /dev/shm").status == "ok"
    assert not [c for c in shared if c.name == "engram host memory"]  # nothing pinned privately
    small = doctor.check_engram(host(shm_free=tables // 2), d, m)  # /dev/shm smaller than the tables
    shm = by_name(small, "engram /dev/shm")
    assert shm.status == "warn" and "/dev/shm" in shm.message
    assert "--ipc=host" in shm.message and "--shm-size=" in shm.message
    assert "falls back to private pinned tables" in shm.message
    # the fallback pins over TP x DP = 4 ranks, checked against host memory
    assert by_name(small, "engram host memory").status == "ok"
    assert doctor.engram_need(cfg, d, tables // 2)["pinned_node"] == sum(doctor.engram_pinned_per_rank(cfg, 4))
    # DP 1 never needs /dev/shm: --ipc=host is for DP > 1 only
    assert doctor.engram_need(cfg, Deployment(tensor_parallel_size=2), None)["shm"] == 0


# ------------------------------------------------------------------ PP and block size

def _v41_pp_config():
    return dict(num_hidden_layers=40, compress_ratios=[0, 0] + [1 if i % 2 else 2 for i in range(2, 40)] + [0],
                kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                candidate_source_layer_id=20, candidate_topk_blocks=64)


def test_pp_partition_default_split_is_caught(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    m = _model("v41", **_v41_pp_config())
    bad = doctor.check_pp(Deployment(pipeline_parallel_size=4), m)
    assert bad.status == "fail" and "VLLM_PP_LAYER_PARTITION=" in bad.message
    assert doctor.check_pp(Deployment(pipeline_parallel_size=2), m).status == "ok"


def test_kv_block_size_is_the_one_vllm_resolves_on_sm80():
    pytest.importorskip("vllm")
    size41, names = doctor.resolved_block_size("v41", 80)
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend

    from dsv4_ops.vllm.audit import _config

    with _config.target_platform(80):
        mla = DeepseekV4FlashMLABackend.get_supported_kernel_block_sizes()
    assert size41 in mla and "DEEPSEEK_V41_INDEXER" in names
    m = _model("v41")
    assert doctor.check_block_size(host(), Deployment(), m).status == "ok"
    wrong = doctor.check_block_size(host(), Deployment(block_size=size41 * 2), m)
    assert wrong.status == "fail" and f"pass {size41}" in wrong.message


def test_v32_and_glm5_configs_are_recognised_and_checked():
    """DeepSeek-V3.2 / GLM-5: the variant from the config, the heads a rank gets, the kv-cache
    dtypes the plugin's backend reads (fp8 names fp8_ds_mla), vLLM's own PP split."""
    assert doctor.variant_of({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}) == "v32"
    assert doctor.variant_of({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}) == "glm5"
    assert doctor.variant_of({"architectures": ["DeepseekV41ForCausalLM"]}) == "v41"
    m = _model("v32", num_attention_heads=128, index_n_heads=64)
    ok = doctor.check_v32(Deployment(tensor_parallel_size=8, kv_cache_dtype="fp8"), m)
    assert by_name(ok, "heads per rank").status == "ok" and "16 query heads" in by_name(ok, "heads per rank").message
    assert by_name(ok, "kv cache dtype").status == "ok" and "656-byte" in by_name(ok, "kv cache dtype").message
    bad = doctor.check_v32(Deployment(tensor_parallel_size=3, kv_cache_dtype="fp8_e5m2"), m)
    assert by_name(bad, "heads per rank").status == "fail" and by_name(bad, "kv cache dtype").status == "fail"
    assert doctor.check_v32(Deployment(), _model("v41")) == []
    assert doctor.check_pp(Deployment(pipeline_parallel_size=4), _model("glm5", num_attention_heads=64)).status == "ok"


def test_v32_kv_block_size_is_the_one_vllm_resolves_on_sm80():
    """With the plugin's backend (MultipleOf 64) and vLLM's V3.2 indexer backend, vLLM resolves 64."""
    pytest.importorskip("vllm")
    size, names = doctor.resolved_block_size("v32", 80)
    assert size % 64 == 0 and "DSV4_AMPERE_MLA_SPARSE" in names, (size, names)
    m = _model("v32", num_attention_heads=128)
    assert doctor.check_block_size(host(), Deployment(), m).status == "ok"
    assert doctor.check_block_size(host(), Deployment(block_size=size + 32), m).status == "fail"


# ------------------------------------------------------------------ the command

def test_doctor_command_runs_here_with_a_model_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(_v41_pp_config(), architectures=["DeepseekV41ForCausalLM"])))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 300 * GIB}}))
    rc = cli.main(["doctor", "--model", str(tmp_path), "-tp", "4", "-pp", "2"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    names = {ln.split("]", 1)[1].split(":", 1)[0].strip() for ln in lines}
    assert {"driver", "vllm", "plugin", "pp partition", "kv block size"} <= names, out
    assert rc == (1 if "[FAIL]" in out else 0)
    assert out.strip().splitlines()[-1].startswith("doctor: ")


def test_audit_stand_in_config_uses_the_block_size_vllm_resolves():
    """The audit's warmup keys are expanded with the KV block size vLLM picks on sm_80."""
    pytest.importorskip("vllm")
    from dsv4_ops.vllm.audit import _config, _paths

    for variant in ("v4", "v41"):
        size, _ = doctor.resolved_block_size(variant, 80)
        assert _config.BLOCK_SIZE[variant] == size
        assert _paths.LAYER_VALUES[variant]["block_size"] == (size,)
