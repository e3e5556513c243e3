"""``dsv4-ops doctor`` on faked hosts: each problem gives its own clear message, and a host
without it passes the same check (the control). Engram figures are checked against vLLM's own
layout (``EngramLayout``) and the rule written out independently here."""

import json

import pytest

from dsv4_ops.tools import cli, doctor
from dsv4_ops.tools.doctor import Deployment, Gpu, HostFacts, ModelInfo
from dsv4_ops.vllm.versions import SUPPORTED

GIB = 1 << 30
A100 = Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB)
H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB)


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


def _install_ok(message):
    """Every supported release is named with the install that works for it; 0.34.0's is the
    install module (its flashinfer-python==0.7.3 pin is not on PyPI), the others pip."""
    for v in SUPPORTED:
        want = ("python -m dsv4_ops.tools.install_vllm 0.34.0" if v == "0.34.0" else f"pip install 'vllm=={v}'")
        assert f"vLLM {v}: {want}" in message, (v, message)
    if "0.34.0" in SUPPORTED:
        assert "flashinfer-python==0.7.3" in message and "flashinfer-python 0.7.4" in message
        assert "--no-deps" in message
    return True


def test_vllm_version_against_the_supported_releases():
    """ok for every release of versions.SUPPORTED (and its local / post builds); anything else
    fails on sm_8x (the plugin refuses it) with the supported list and the working installs; on
    sm_90+ (the plugin patches nothing) it is a warning."""
    assert SUPPORTED == ("0.33.0", "0.34.0")  # the releases this test was written against
    for v in SUPPORTED + ("0.34.0+cu130", "0.33.0.post1"):
        c = by_name(doctor.check_vllm(host(vllm_version=v)), "vllm")
        assert c.status == "ok" and v in c.message and ", ".join(SUPPORTED) in c.message, c.line()
    cases = {"0.32.1": "older than the oldest supported release (0.33.0)",
             "0.35.0": "newer than the newest release diffed against the patch table (0.34.0",
             "0.34.1.dev12+g1234abc": "not a release the plugin knows",
             "0.34.0rc1": "not a release the plugin knows"}
    for v, why in cases.items():
        c = by_name(doctor.check_vllm(host(vllm_version=v)), "vllm")
        assert c.status == "fail" and v in c.message and why in c.message, c.line()
        assert "refuses it at startup" in c.message and "supports vLLM 0.33.0, 0.34.0" in c.message
        assert _install_ok(c.message)
        h100 = by_name(doctor.check_vllm(host(vllm_version=v, gpus=[H100] * 8)), "vllm")
        assert h100.status == "warn" and "patches nothing" in h100.message and _install_ok(h100.message)
    none = by_name(doctor.check_vllm(host(vllm_version=None)), "vllm")
    assert none.status == "fail" and "not installed" in none.message and _install_ok(none.message)
    # the old single-pin comparison is gone: no dsv4-ops metadata is read
    assert not hasattr(doctor, "plugin_vllm_pin")


def test_v1_model_runner_setting_fails_on_0_34_only():
    """vLLM 0.34.0 removed the V1 model runner and raises on VLLM_USE_V2_MODEL_RUNNER != 1
    (platforms/interface.py:1481-1486); 0.33.0 still takes it."""
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    c = by_name(doctor.check_vllm(host(vllm_version="0.34.0", environ=env)), "vllm settings")
    assert c.status == "fail" and "VLLM_USE_V2_MODEL_RUNNER=0" in c.message and "unset it" in c.message
    assert not [c for c in doctor.check_vllm(host(vllm_version="0.33.0", environ=env)) if c.name == "vllm settings"]
    assert not [c for c in doctor.check_vllm(host(vllm_version="0.34.0", environ={"VLLM_USE_V2_MODEL_RUNNER": "1"}))
                if c.name == "vllm settings"]


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


@pytest.mark.parametrize("vllm_version", SUPPORTED)
def test_dp_above_one_without_enough_dev_shm(vllm_version):
    """Both releases share the tables only when /dev/shm holds them (0.34.0 checks it even when
    the tables go to cuMem: /dev/shm is the fallback); the --shm-size doctor recommends is the
    tables plus vLLM's rings plus 1 GiB, rounded up to whole GiB."""
    cfg, _ = engram_cfg()
    m = _model("v41", **cfg)
    d = Deployment(tensor_parallel_size=2, data_parallel_size=2)
    tables = sum(cfg["engram_num_embeddings"]) * (256 + 256 // 32)  # vLLM's can_share_engram_tables sum
    assert doctor.engram_table_bytes(cfg) == tables
    shared = doctor.check_engram(host(shm_free=tables, vllm_version=vllm_version), d, m)
    assert by_name(shared, "engram /dev/shm").status == "ok"
    assert ("cuMem" in by_name(shared, "engram /dev/shm").message) == (vllm_version == "0.34.0")
    assert not [c for c in shared if c.name == "engram host memory"]  # nothing pinned privately
    small = doctor.check_engram(host(shm_free=tables - 1, vllm_version=vllm_version), d, m)  # one byte short
    shm = by_name(small, "engram /dev/shm")
    assert shm.status == "warn" and "/dev/shm" in shm.message and "--ipc=host" in shm.message
    assert "falls back to private pinned tables" in shm.message and f"vLLM {vllm_version}" in shm.message
    pytest.importorskip("vllm")
    # each of the DP 2 replicas has vLLM's own rings (their sizes are tested against vLLM below)
    rings = 2 * sum(b for _, b in doctor.shm_rings(d, doctor.mq_sizes()))
    assert rings > 0
    want = -(-(tables + rings) // GIB) + 1
    assert f"--shm-size={want}g" in shm.message, shm.message
    assert doctor.engram_shm_size_gib(189 * GIB, 2 * GIB - 1) == 192  # V4.1-Flash's ~189 GiB at TP 8
    small = doctor.check_engram(host(shm_free=tables // 2), d, m)
    # the fallback pins over TP x DP = 4 ranks, checked against host memory
    assert by_name(small, "engram host memory").status == "ok"
    assert doctor.engram_need(cfg, d, tables // 2)["pinned_node"] == sum(doctor.engram_pinned_per_rank(cfg, 4))
    # DP 1 never shares the Engram tables through /dev/shm (vLLM's rings need it at TP > 1: check_shm)
    assert doctor.engram_need(cfg, Deployment(tensor_parallel_size=2), None)["shm"] == 0


def test_dp_sharing_needs_host_memory_on_0_34_only():
    """vLLM 0.34.0's _shm_shortfall also refuses to share tables larger than the available host
    memory (MemAvailable capped by the cgroup headroom) and falls back to private pinned tables
    over TP x DP; 0.33.0 shares them anyway (a warning: tmpfs pages past it meet the OOM killer)."""
    cfg, layout = engram_cfg()
    m = _model("v41", **cfg)
    d = Deployment(tensor_parallel_size=2, data_parallel_size=2)
    tables = sum(cfg["engram_num_embeddings"]) * (256 + 8)
    # the private fallback, independently: TP x DP = 4 shards of the hash columns, two pow2 allocations each
    want = [0] * 4
    for layer in layout.primes:
        cols = [s for g in layer for s in g]
        c = -(-len(cols) // 4)
        for r in range(4):
            rows = sum(cols[r * c:(r + 1) * c])
            want[r] += _pow2(rows * 256) + _pow2(rows * 8)
    for low in (dict(mem_available=tables - 1), dict(cgroup_limit=10 * GIB, cgroup_usage=10 * GIB - tables + 1)):
        h34 = host(shm_free=1024 * GIB, vllm_version="0.34.0", **low)
        need = doctor.engram_need(cfg, d, h34.shm_free, "0.34.0", tables - 1)
        assert need["mode"] == "pinned" and need["pinned_node"] == sum(want) and need["pinned_rank"] == max(want)
        checks = doctor.check_engram(h34, d, m)
        c = by_name(checks, "engram /dev/shm")
        assert c.status == "warn" and "exceed the" in c.message and "available host memory" in c.message
        assert "falls back to private pinned tables sharded over TP x DP = 4" in c.message
        assert by_name(checks, "engram host memory").status == "fail"  # the fallback needs even more
        h33 = host(shm_free=1024 * GIB, vllm_version="0.33.0", **low)
        assert doctor.engram_need(cfg, d, h33.shm_free, "0.33.0", tables - 1)["mode"] == "shm"
        c33 = by_name(doctor.check_engram(h33, d, m), "engram host memory")
        assert c33.status == "warn" and "OOM killer" in c33.message
    # enough memory: both share, nothing pinned
    for v in SUPPORTED:
        need = doctor.engram_need(cfg, d, 1024 * GIB, v, tables)
        assert need["mode"] == "shm" and need["pinned_node"] == 0 and need["shm"] == tables


@pytest.mark.parametrize("vllm_version", SUPPORTED)
def test_dp1_pinned_advice_is_the_same_on_every_release(vllm_version):
    """DP 1: private pin_memory tables on 0.33.0 and 0.34.0 alike; the per-rank figure and the
    memlock threshold doctor gives are the pow2-rounded shares computed here."""
    cfg, layout = engram_cfg()
    m = _model("v41", **cfg)
    d = Deployment(tensor_parallel_size=2)
    want = [0, 0]
    for layer in layout.primes:
        cols = [s for g in layer for s in g]
        c = -(-len(cols) // 2)
        for r in range(2):
            rows = sum(cols[r * c:(r + 1) * c])
            want[r] += _pow2(rows * 256) + _pow2(rows * 8)
    need = doctor.engram_need(cfg, d, None, vllm_version)
    assert (need["mode"], need["pinned_node"], need["pinned_rank"], need["shm"]) == ("pinned", sum(want), max(want), 0)
    lock = by_name(doctor.check_engram(host(memlock_limit=max(want) - 1, vllm_version=vllm_version), d, m),
                   "engram lockable memory")
    assert lock.status == "warn" and "ulimit -l unlimited" in lock.message
    assert not [c for c in doctor.check_engram(host(memlock_limit=max(want), vllm_version=vllm_version), d, m)
                if c.name == "engram lockable memory"]


def test_engram_rule_is_the_installed_vllms_source():
    """The rule doctor applies for the installed release is the one its source holds:
    0.34.0's can_share_engram_tables goes through _shm_shortfall, which checks /dev/shm and the
    available host memory, and DPSharedEngramStorage tries cuMem first; 0.33.0 checks /dev/shm
    only; both pin private tables with pin_memory=True."""
    pytest.importorskip("vllm")
    import inspect
    from importlib.metadata import version

    from vllm.models.deepseek_v41.common import engram as ve

    rule = doctor.engram_shared_rule(version("vllm"))
    share = inspect.getsource(ve.can_share_engram_tables)
    assert "pin_memory=True" in inspect.getsource(ve.ParallelEngramEmbedding._allocate_weights)
    if rule == "0.34.0":
        assert "_shm_shortfall(" in share
        short = inspect.getsource(ve._shm_shortfall)
        assert "check_shm_free_space" in short and "get_available_memory()" in short
        assert "share_host_table" in inspect.getsource(ve.DPSharedEngramStorage.__init__)
    else:
        assert "check_shm_free_space" in share and not hasattr(ve, "_shm_shortfall")


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
    assert {"driver", "vllm", "plugin", "pp partition", "kv block size", "/dev/shm", "sampler", "nvlink",
            "serve-path settings", "batch defaults", "quant layout"} <= names, out
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


# ------------------------------------------------------------------ /dev/shm: vLLM's MessageQueue rings

MIB = 1 << 20


def test_ring_size_is_vllms_own_ring_buffer():
    """The byte count doctor uses for a ring is the size vLLM's ShmRingBuffer allocates."""
    pytest.importorskip("vllm")
    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    for readers, chunk, chunks in ((1, 4096, 3), (7, 8192, 2)):
        ring = ShmRingBuffer(readers, chunk, chunks)
        try:
            assert ring.total_bytes_of_buffer == doctor._ring_bytes(chunk, chunks, readers)
        finally:
            del ring


def test_shm_rings_follow_vllms_sizes_and_env(monkeypatch):
    pytest.importorskip("vllm")
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    sizes = doctor.mq_sizes()
    assert sizes["source"] == "vLLM source"
    sig = inspect.signature(MessageQueue.__init__).parameters
    assert sizes["default"] == (sig["max_chunk_bytes"].default, sig["max_chunks"].default)
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "3")
    assert doctor.mq_sizes()["executor_chunk"] == 3 * MIB
    rings = doctor.shm_rings(Deployment(tensor_parallel_size=8), sizes)
    # one scheduler ring, one response ring a worker, one TP-group broadcaster
    assert len(rings) == 1 + 8 + 1
    assert doctor.shm_rings(Deployment(tensor_parallel_size=2, pipeline_parallel_size=2), sizes)[-2][0].startswith("TP")
    assert doctor.shm_rings(Deployment(data_parallel_size=4), sizes) == []


def test_dev_shm_at_tp8_without_dp_is_checked():
    """Docker's 64 MB /dev/shm fails at TP 8 even at DP 1 (the README used to say DP > 1 only)."""
    pytest.importorskip("vllm")
    d = Deployment(tensor_parallel_size=8)
    rings = doctor.shm_rings(d, doctor.mq_sizes())
    biggest, total = max(b for _, b in rings), sum(b for _, b in rings)
    small = doctor.check_shm(host(shm_free=64 * 1000 * 1000), d)
    assert small.status == "fail" and "Insufficient space in /dev/shm" in small.message
    assert "--ipc=host" in small.message and "--shm-size=" in small.message
    between = doctor.check_shm(host(shm_free=(biggest + total) // 2), d)
    assert between.status == "warn" and "--ipc=host" in between.message
    assert doctor.check_shm(host(shm_free=total), d).status == "ok"
    assert doctor.check_shm(host(shm_free=None), d).status == "fail"
    one = doctor.check_shm(host(shm_free=0), Deployment(data_parallel_size=2))
    assert one.status == "ok" and "in-process" in one.message


# ------------------------------------------------------------------ FlashInfer's sampler JIT

def _fake_fs(files, path_bins=()):
    files = set(files)
    return dict(exists=lambda p: p in files, which=lambda n: next((b for b in path_bins if b.endswith("/" + n)), None))


def _full_toolkit(home="/opt/cuda-13"):
    return [f"{home}/bin/nvcc", f"{home}/lib64/libcudart.so", f"{home}/lib64/stubs/libcuda.so"] + \
        [f"{home}/include/{h}" for h in serve_host.SAMPLER_HEADERS]


def _toolchain(env, files, path_bins=("/usr/bin/ninja", "/usr/bin/c++"), release="13.0"):
    return serve_host.read_toolchain(env, nvcc_release=lambda _: release, jit_cache=False,
                                     **_fake_fs(files, path_bins))


from dsv4_ops.vllm import serve_host  # noqa: E402


def test_toolchain_lookup_follows_flashinfers_order():
    files = _full_toolkit() + _full_toolkit("/usr/local/cuda") + ["/usr/local/cuda"]
    assert _toolchain({"CUDA_HOME": "/opt/cuda-13"}, files).cuda_home == "/opt/cuda-13"
    assert _toolchain({"CUDA_PATH": "/opt/cuda-13"}, files).how == "CUDA_PATH"
    # nvcc on PATH: its grandparent, without resolving links (a /usr/local/bin/nvcc wrapper gives /usr/local)
    on_path = _toolchain({}, files, ("/usr/local/bin/nvcc", "/usr/bin/ninja", "/usr/bin/c++"))
    assert on_path.cuda_home == "/usr/local" and serve_host.jit_problems(on_path, "13.0")
    assert _toolchain({}, files).cuda_home == "/usr/local/cuda"
    assert _toolchain({}, []).cuda_home is None


def test_toolchain_lookup_matches_flashinfer(monkeypatch):
    cpp_ext = pytest.importorskip("flashinfer.jit.cpp_ext")
    monkeypatch.setenv("CUDA_HOME", "/opt/somewhere")
    assert cpp_ext.get_cuda_path.__wrapped__() == serve_host.read_toolchain(jit_cache=False).cuda_home


def test_each_missing_toolchain_piece_is_named():
    full = _full_toolkit()
    env = {"CUDA_HOME": "/opt/cuda-13"}
    assert serve_host.jit_problems(_toolchain(env, full), "13.0") == []
    cases = {
        "no CUDA toolkit": _toolchain({}, []),
        "no nvcc": _toolchain(env, [f for f in full if not f.endswith("nvcc")]),
        "not torch's CUDA 13.0 major": _toolchain(env, full, release="12.4"),
        "lacks curand.h": _toolchain(env, [f for f in full if not f.endswith("/curand.h")]),
        "-lcudart": _toolchain(env, [f for f in full if "cudart" not in f]),
        "-lcuda)": _toolchain(env, [f for f in full if "stubs" not in f]),
        "no ninja": _toolchain(env, full, ("/usr/bin/c++",)),
        "C++ compiler": _toolchain(env, full, ("/usr/bin/ninja",)),
    }
    for words, tc in cases.items():
        problems = serve_host.jit_problems(tc, "13.0")
        assert len(problems) == 1 and words in problems[0], (words, problems)


def test_sampler_check_names_the_setting_or_the_toolkit():
    broken = _toolchain({}, [])
    good = _toolchain({"CUDA_HOME": "/opt/cuda-13"}, _full_toolkit())
    H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB)
    c = doctor.check_sampler(host(toolchain=broken))
    assert c.status == "warn" and "plugin sets VLLM_USE_FLASHINFER_SAMPLER=0" in c.message
    assert "CUDA 13 toolkit" in c.message
    c = doctor.check_sampler(host(toolchain=broken, gpus=[H100] * 8))  # no plugin choice off sm_8x
    assert c.status == "fail" and "export VLLM_USE_FLASHINFER_SAMPLER=0" in c.message
    c = doctor.check_sampler(host(toolchain=broken, environ={"VLLM_USE_FLASHINFER_SAMPLER": "1"}))
    assert c.status == "fail" and "VLLM_USE_FLASHINFER_SAMPLER=1" in c.message
    assert doctor.check_sampler(host(toolchain=broken, environ={"VLLM_USE_FLASHINFER_SAMPLER": "0"})).status == "ok"
    assert doctor.check_sampler(host(toolchain=good)).status == "ok"


# ------------------------------------------------------------------ NVLink

def test_pcie_box_loses_custom_allreduce_at_tp_above_2():
    nvswitch = [[True] * 8 for _ in range(8)]
    pcie = [[i == j for j in range(8)] for i in range(8)]
    pairs = [[(i // 2 == j // 2) for j in range(8)] for i in range(8)]  # NVLink bridges between pairs
    assert doctor.check_nvlink(host(nvlink=nvswitch), Deployment(tensor_parallel_size=8)).status == "ok"
    for topo in (pcie, pairs):
        c = doctor.check_nvlink(host(nvlink=topo), Deployment(tensor_parallel_size=8))
        assert c.status == "warn" and "custom all-reduce off" in c.message and "NCCL over PCIe" in c.message
    assert doctor.check_nvlink(host(nvlink=pcie), Deployment(tensor_parallel_size=2)).status == "ok"
    assert doctor.check_nvlink(host(nvlink=pairs), Deployment(tensor_parallel_size=2)).status == "ok"
    assert doctor.check_nvlink(host(nvlink=None), Deployment(tensor_parallel_size=8)).status == "skip"


# ------------------------------------------------------------------ quant layout and kernel settings

def _quant_model(variant, block, **extra):
    q = {"quant_method": "fp8", "weight_block_size": block, "activation_scheme": "dynamic"}
    q.update(extra.pop("quant", {}))
    return _model(variant, quantization_config=q, **extra)


def test_quant_layout_accepts_the_audited_checkpoints():
    v4 = doctor.check_quant_layout(_quant_model("v4", [128, 128]))
    assert v4.status == "ok" and "MarlinFP8ScaledMMLinearKernel" in v4.message and "MarlinExperts" in v4.message
    v41 = doctor.check_quant_layout(_quant_model("v41", [32, 32]))
    assert v41.status == "ok" and "MarlinMxfp8LinearKernel" in v41.message
    assert doctor.check_quant_layout(None).status == "skip"


def test_quant_layout_refuses_what_no_audit_covers():
    cases = {
        "ModelOptNvFp4FusedMoE": _quant_model("v41", [32, 32], quant={"moe_quant_algo": "nvfp4"}),
        "Fp8MoEMethod": _quant_model("v4", [128, 128], expert_dtype="fp8"),
        "Fp8LinearMethod (block 128x128)": _quant_model("v41", [128, 128]),
        "quant_method 'quark'": _quant_model("v4", [128, 128], quant={"quant_method": "quark"}),
        "quant_method None": _model("v4"),
    }
    for words, m in cases.items():
        c = doctor.check_quant_layout(m)
        assert c.status == "fail" and words in c.message and "refuses it at startup" in c.message, (words, c.line())


def test_settings_that_leave_the_audited_kernels_fail():
    d = Deployment()
    assert doctor.check_kernel_settings(host(), d).status == "ok"
    bad = {
        "Marlin FP8 refuse": (dict(environ={"VLLM_BATCH_INVARIANT": "1"}), d),
        "VLLM_MARLIN_INPUT_DTYPE=int8": (dict(environ={"VLLM_MARLIN_INPUT_DTYPE": "int8"}), d),
        "disables MarlinMxfp8LinearKernel": (dict(environ={"VLLM_DISABLED_KERNELS": "Foo,MarlinMxfp8LinearKernel"}), d),
        "--linear-backend triton": ({}, Deployment(linear_backend="triton")),
        "--moe-backend humming": ({}, Deployment(moe_backend="humming")),
    }
    for words, (kw, dep) in bad.items():
        c = doctor.check_kernel_settings(host(**kw), dep)
        assert c.status == "fail" and words in c.message, (words, c.line())
    assert doctor.check_kernel_settings(host(environ={"VLLM_DISABLED_KERNELS": "CutlassFP8ScaledMMLinearKernel"}),
                                        Deployment(linear_backend="marlin")).status == "ok"


# ------------------------------------------------------------------ batch defaults

def test_batch_defaults_are_vllms_by_gpu_name():
    """vLLM gives an 80 GB A800 the H100 tier (its name lacks 'a100'); an A100 gets the small one."""
    pytest.importorskip("vllm")
    a800 = Gpu("NVIDIA A800-SXM4-80GB", (8, 0), 80 * GIB)
    h100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB)
    a100_40 = Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GIB)
    assert doctor.batch_defaults(a800, 8) == doctor.batch_defaults(h100, 8)
    small = doctor.batch_defaults(A100, 8)
    assert small == doctor.batch_defaults(a100_40, 8) and small[0] < doctor.batch_defaults(a800, 8)[0]
    m = _model("v4", hidden_size=4096, vocab_size=129280, hc_mult=4)
    c = doctor.check_batch_defaults(host(gpus=[a800] * 8), Deployment(tensor_parallel_size=8), m)
    tokens, seqs = doctor.batch_defaults(a800, 8)
    assert c.status == "ok" and f"--max-num-batched-tokens {tokens}" in c.message
    assert f"--max-num-seqs {seqs}" in c.message and f"{tokens * 4096 * 4 * 2 / GIB:.1f} GiB" in c.message
    c = doctor.check_batch_defaults(host(gpus=[a100_40] * 8), Deployment(max_num_batched_tokens=8192), m)
    assert c.status == "warn" and "40 GB" in c.message
