"""``dsv4-ops doctor`` asserted by value: each check's figures (sizes with their units) and its advice
(the flag or variable, with the value to give it) equal what this file computes on its own from
vLLM's sizes and the host's facts, over faked hosts that pass, warn and fail.

The expected figures are written from the sources of the facts, not from doctor's code: vLLM's
MessageQueue defaults and ``VLLM_MQ_MAX_CHUNK_BYTES_MB``, the TP broadcaster's (4 MiB, 6) chunks
as vLLM 0.33 / 0.34 write them in ``GroupCoordinator.__init__``, ShmRingBuffer's (chunk + 1 +
readers) x chunks, NVIDIA's minimum drivers per CUDA major, vLLM's EngramLayout for the tables.
"""

from __future__ import annotations

import inspect
import re

import pytest

from dsv4_ops.tools import doctor
from dsv4_ops.tools.doctor import Deployment, Gpu, HostFacts, ModelInfo

vllm = pytest.importorskip("vllm", reason="doctor's figures come from vLLM's sizes")

GIB, MIB = 1 << 30, 1 << 20
A100_80 = Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB)
A100_40 = Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GIB)
A10 = Gpu("NVIDIA A10", (8, 6), 24 * GIB)


def host(**kw):
    base = dict(driver="580.95.05", torch_version="2.14.0+cu130", torch_cuda="13.0", gpus=[A100_80] * 8,
                mem_total=2048 * GIB, mem_available=1900 * GIB, memlock_limit=None, cgroup_limit=None,
                cgroup_usage=None, shm_free=1024 * GIB, vllm_version="0.34.0", plugin_entry_points=["dsv4_ops"],
                vllm_plugins_env=None)
    base.update(kw)
    return HostFacts(**base)


def gib(n):
    return f"{n / GIB:.1f} GiB"


def one(checks, name):
    got = [c for c in checks if c.name == name]
    assert len(got) == 1, [c.line() for c in checks]
    return got[0]


# ---- /dev/shm against vLLM's rings ------------------------------------------------------------

def rings_bytes(tp, pp, chunk_mb=None):
    """vLLM's /dev/shm rings of a one-node TP x PP serve, from vLLM's own constants."""
    from vllm import envs as venvs
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    sig = inspect.signature(MessageQueue.__init__).parameters
    chunk, chunks = sig["max_chunk_bytes"].default, sig["max_chunks"].default
    src = inspect.getsource(parallel_state.GroupCoordinator.__init__)
    assert re.search(r"create_from_process_group\(\s*self\.cpu_group,\s*1 << 22,\s*6\s*\)", src), \
        "vLLM's TP broadcaster is no longer (4 MiB, 6): update this test's figure"
    world = tp * pp
    exec_chunk = (chunk_mb if chunk_mb is not None else venvs.VLLM_MQ_MAX_CHUNK_BYTES_MB) * MIB
    sizes = [(exec_chunk + 1 + world) * chunks] + [(chunk + 1 + 1) * chunks] * world
    if tp > 1:
        sizes += [((1 << 22) + 1 + (tp - 1)) * 6] * pp
    return sizes


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (8, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("state", ["ok", "warn", "fail", "unmounted"])
def test_dev_shm_figures_and_size(tp, pp, state):
    sizes = rings_bytes(tp, pp)
    biggest, total = max(sizes), sum(sizes)
    free = {"ok": total, "warn": (biggest + total) // 2, "fail": biggest - 1, "unmounted": None}[state]
    c = doctor.check_shm(host(shm_free=free), Deployment(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    assert c.status == {"unmounted": "fail"}.get(state, state), c.line()
    assert f"{biggest / MIB:.0f} MiB for the largest" in c.message, c.message
    assert f"{total / MIB:.0f} MiB for all {len(sizes)}" in c.message, c.message
    want_g = max(1, -(-total // GIB))
    if state == "ok":
        assert gib(free) + " free" in c.message and "--shm-size" not in c.message
    else:
        assert f"--shm-size={want_g}g" in c.message and "--ipc=host" in c.message, c.message
        if free is not None:
            assert f"{free / MIB:.0f} MiB free" in c.message
    assert want_g * GIB >= total  # the advice holds every ring


def test_dev_shm_size_follows_vllms_chunk_variable(monkeypatch):
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "2048")  # a 20 GiB scheduler ring
    sizes = rings_bytes(8, 1, chunk_mb=2048)
    total = sum(sizes)
    c = doctor.check_shm(host(shm_free=GIB), Deployment(tensor_parallel_size=8))
    assert c.status == "fail" and f"--shm-size={-(-total // GIB)}g" in c.message, c.message
    assert -(-total // GIB) > 20


# ---- GPU memory ---------------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["ok", "warn", "fail"])
@pytest.mark.parametrize("tp,pp,util,gpu", [(8, 1, 0.9, A100_80), (4, 2, 0.85, A100_40), (2, 1, 0.95, A10)])
def test_gpu_memory_figures(state, tp, pp, util, gpu):
    mem = gpu.total_bytes
    budget = mem * util
    kv = {"ok": 0.5 * mem, "warn": 0.05 * mem, "fail": -GIB}[state]
    per_rank = budget - kv
    m = ModelInfo("fake", {"architectures": ["DeepseekV4ForCausalLM"]}, "v4", int(per_rank * tp * pp))
    c = one(doctor.check_gpus(host(gpus=[gpu] * 8), Deployment(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                                 gpu_memory_utilization=util), m), "gpu memory")
    assert c.status == state, c.line()
    per = int(per_rank * tp * pp) / (tp * pp)
    assert f"{gib(per)} of weights per rank at TP {tp} x PP {pp}" in c.message, c.message
    assert f"{gib(mem)} per GPU x --gpu-memory-utilization {util}" in c.message
    assert f"{gib(budget - per)} left for the KV cache" in c.message
    assert ("--tensor-parallel-size" in c.message) == (state == "fail")


def test_gpu_memory_leaves_the_engram_tables_on_the_host():
    cfg, _ = engram_cfg()
    tables = sum(cfg["engram_num_embeddings"]) * (256 + 256 // 32)
    size = 300 * GIB
    m = ModelInfo("fake", dict(cfg, architectures=["DeepseekV41ForCausalLM"]), "v41", size)
    c = one(doctor.check_gpus(host(), Deployment(tensor_parallel_size=8), m), "gpu memory")
    assert f"{gib((size - tables) / 8)} of weights per rank" in c.message, c.message


# ---- the driver ----------------------------------------------------------------------------------

# NVIDIA's minimum Linux drivers for CUDA minor version compatibility, per CUDA major
NVIDIA_MIN = {"11.8": "450.80.02", "12.4": "525.60.13", "13.0": "580.65.06"}


@pytest.mark.parametrize("cuda", sorted(NVIDIA_MIN))
def test_driver_minimum_by_value(cuda):
    need = NVIDIA_MIN[cuda]
    a, b, c = (int(x) for x in need.split("."))
    below = f"{a}.{b:02d}.{c - 1:02d}"
    bad = doctor.check_driver(host(torch_cuda=cuda, driver=below))
    assert bad.status == "fail" and f"older than {need}" in bad.message and f"R{a} or newer" in bad.message
    assert f"CUDA {cuda.split('.')[0]}.x" in bad.message and f"(CUDA {cuda})" in bad.message
    good = doctor.check_driver(host(torch_cuda=cuda, driver=need))
    assert good.status == "ok" and f"driver {need} >= {need}" in good.message
    none = doctor.check_driver(host(torch_cuda=cuda, driver=None))
    assert none.status == "fail" and f"needs driver {need} or newer" in none.message


# ---- the Engram tables' host memory ----------------------------------------------------------------

def engram_cfg(vocab=1000, heads=4, max_ngram=3, dim=256, layers=(1, 14)):
    from types import SimpleNamespace

    from vllm.models.deepseek_v41.common.engram import EngramLayout

    cfg = dict(engram_layer_ids=list(layers), engram_num_embeddings=[0] * len(layers), engram_max_ngram_size=max_ngram,
               engram_n_heads=heads, engram_head_dim=dim, engram_compressed_vocab_size=vocab,
               engram_pad_token_id=0, engram_vocab_size=vocab)
    layout = EngramLayout(SimpleNamespace(**cfg))
    cfg["engram_num_embeddings"] = [sum(s for g in layer for s in g) for layer in layout.primes]
    return cfg, layout


def pinned(layout, shards, dim=256):
    """Each shard's pinned bytes: its hash columns' rows as fp8 rows and UE8M0 scales, each
    allocation rounded up to a power of two (torch's pinned allocator)."""
    def pow2(n):
        return 1 << (n - 1).bit_length() if n > 1 else n

    per = [0] * shards
    for layer in layout.primes:
        cols = [s for g in layer for s in g]
        c = -(-len(cols) // shards)
        for r in range(shards):
            rows = sum(cols[r * c:(r + 1) * c])
            if rows:
                per[r] += pow2(rows * dim) + pow2(rows * (dim // 32))
    return per


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("state", ["ok", "no ram", "cgroup", "memlock"])
def test_engram_pinned_figures(tp, state):
    cfg, layout = engram_cfg()
    m = ModelInfo("fake", dict(cfg, architectures=["DeepseekV41ForCausalLM"]), "v41", None)
    per = pinned(layout, tp)
    node, rank = sum(per), max(per)
    kw = {"ok": dict(mem_available=node + GIB), "no ram": dict(mem_available=node - 1),
          "cgroup": dict(mem_available=node + GIB, cgroup_limit=4 * GIB, cgroup_usage=4 * GIB - node + 1),
          "memlock": dict(mem_available=node + GIB, memlock_limit=rank - 1)}[state]
    checks = doctor.check_engram(host(**kw), Deployment(tensor_parallel_size=tp), m)
    c = one(checks, "engram host memory")
    assert f"{gib(node)} of pinned host memory on this node ({gib(rank)} per rank)" in c.message, c.message
    assert f"each of the {tp} TP ranks" in c.message
    if state == "no ram":
        assert c.status == "fail" and f"only {gib(node - 1)} available (MemAvailable)" in c.message
    elif state == "cgroup":
        assert c.status == "fail" and f"allows {gib(node - 1)} more" in c.message and "docker --memory" in c.message
    else:
        assert c.status == "ok" and f"{gib(node + GIB)} available" in c.message
    locks = [x for x in checks if x.name == "engram lockable memory"]
    if state == "memlock":
        assert len(locks) == 1 and locks[0].status == "warn"
        assert f"ulimit -l is {gib(rank - 1)} per process, below the {gib(rank)}" in locks[0].message
        assert "ulimit -l unlimited" in locks[0].message and "memlock=-1" in locks[0].message
    else:
        assert not locks


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("shared", [True, False])
def test_engram_shared_figures_and_shm_size(dp, shared):
    cfg, layout = engram_cfg()
    tables = sum(cfg["engram_num_embeddings"]) * (256 + 8)
    m = ModelInfo("fake", dict(cfg, architectures=["DeepseekV41ForCausalLM"]), "v41", None)
    d = Deployment(tensor_parallel_size=2, data_parallel_size=dp)
    free = tables if shared else tables - 1
    c = one(doctor.check_engram(host(shm_free=free), d, m), "engram /dev/shm")
    if shared:
        assert c.status == "ok" and f"{gib(tables)} of Engram tables shared" in c.message
        assert f"({gib(free)} free)" in c.message and "--shm-size" not in c.message
        return
    want = -(-(tables + dp * sum(rings_bytes(2, 1))) // GIB) + 1
    assert c.status == "warn" and f"--shm-size={want}g" in c.message, c.message
    assert f"vLLM's {dp} DP replicas" in c.message
    assert f"has {gib(free)} free for {gib(tables)} of tables" in c.message
    assert f"({gib(sum(pinned(layout, 2 * dp)))} pinned on this node)" in c.message


# ---- vLLM's batch defaults and the activation figures ----------------------------------------------

@pytest.mark.parametrize("gpu,tokens,seqs,state", [(A100_80, 4096, 128, "ok"), (A100_40, 4096, 64, "warn"),
                                                   (A100_40, 2048, 32, "ok"), (A10, 8192, 256, "warn")])
def test_batch_figures(gpu, tokens, seqs, state):
    hidden, vocab, hc = 4096, 129280, 4
    m = ModelInfo("fake", {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": hidden, "vocab_size": vocab,
                           "hc_mult": hc}, "v4", None)
    c = doctor.check_batch_defaults(host(gpus=[gpu]), Deployment(max_num_batched_tokens=tokens, max_num_seqs=seqs), m)
    assert c.status == state, c.line()
    assert f"--max-num-batched-tokens {tokens}, --max-num-seqs {seqs}" in c.message
    assert f"hidden stream is {gib(tokens * hidden * hc * 2)}" in c.message, c.message
    assert f"fp32 logits {gib(seqs * vocab * 4)}" in c.message
    assert ("lower --max-num-batched-tokens" in c.message) == (state == "warn")
