"""``dsv4-ops doctor``: will this host serve DeepSeek-V4/V4.1-Flash (or DeepSeek-V3.2 / GLM-5) with
vLLM and the plugin?

``dsv4-ops check`` tests the library; ``doctor`` checks the deployment, on the machine it runs
on (GPU or not), and prints one line per check with what to do:

- the NVIDIA driver against the CUDA runtime the installed torch was built with;
- GPU architecture, count and memory against the model's per-GPU share at the requested TP/PP
  (weights per rank from the checkpoint's safetensors index, the KV cache left);
- V4.1 Engram host memory, by the installed vLLM's own rule (``config/engram.py``,
  ``models/deepseek_v41/common/engram.py``; ``engram_need``): ``EngramConfig.cpu_offload`` is on
  by default; with data parallelism 1 each rank allocates its TP share of every Engram table as
  two ``pin_memory=True`` tensors (fp8 rows, UE8M0 scales), which torch's pinned allocator rounds
  up to a power of two each (0.33.0 and 0.34.0 alike); with DP > 1, ``dp_shared_memory`` defaults
  on and one copy of the tables per node is shared when ``can_share_engram_tables`` says so --
  0.33.0: ``/dev/shm`` has room; 0.34.0: ``/dev/shm`` has room AND the tables fit the available
  host memory (``_shm_shortfall``) -- 0.33.0 puts them in ``/dev/shm``, 0.34.0 in host-NUMA cuMem
  shared by FABRIC handle where the driver allows it, else in ``/dev/shm``; when not shared, vLLM
  falls back to private pinned tables sharded over TP x DP. The need is compared with free memory
  (``MemAvailable``), the cgroup limit and ``ulimit -l``;
- the vLLM version against the releases the plugin supports (``dsv4_ops.vllm.versions.SUPPORTED``,
  with the install that works for each), and whether vLLM will load the plugin's entry point
  (``vllm.general_plugins``, ``VLLM_PLUGINS``);
- ``/dev/shm`` against vLLM's own shared-memory rings at TP x PP > 1 (the scheduler's broadcast
  ring, one response ring per worker, the TP group's broadcaster: ``shm_broadcast.MessageQueue``
  sizes, ``check_shm_free_space`` raises when a ring does not fit) -- any TP > 1, not only DP > 1;
- whether FlashInfer's sampler JIT can build here (``dsv4_ops.vllm.serve_host``), else the
  setting that avoids it (``VLLM_USE_FLASHINFER_SAMPLER=0``, which the plugin sets on sm_8x);
- NVLink full connectivity at TP > 2 (NVML P2P, vLLM's ``is_fully_connected``): without it vLLM's
  custom all-reduce is off and NCCL over PCIe carries every all-reduce;
- vLLM settings that move the serve path off the audited kernels (``VLLM_BATCH_INVARIANT``, ...);
- vLLM's batch defaults for this GPU name (``EngineArgs.get_batch_defaults``) and their scale;
- with ``--model``: the checkpoint's quantization layout and the methods vLLM builds for it on
  sm_80 (a layout no audit covers fails), the pipeline partition (``dsv4_ops.pp_partition``; V3.2 / GLM-5: vLLM's own
  layer split) and the KV-cache block size vLLM resolves for the model's attention backends on
  this GPU's architecture (vLLM's own ``_preferred_block_size_for_backends``; V3.2 / GLM-5: the
  plugin's sparse-MLA backend and vLLM's V3.2 indexer backend); V3.2 / GLM-5 also the heads a
  rank gets at the TP and the ``--kv-cache-dtype`` the plugin's backend reads.

Every host fact is read once into ``HostFacts`` (``read_host``), so tests fake the machine.
Exit status: 1 when a check fails, else 0 (warnings do not fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..vllm import serve_host, versions

GIB = float(1 << 30)

# CUDA major version -> minimum Linux driver (R-major, minor, patch) that runs every minor
# release of it (NVIDIA CUDA Toolkit release notes, "CUDA Toolkit and Minimum Required Driver
# Version for CUDA Minor Version Compatibility"). torch 2.14 (the pin of vLLM 0.33.0 and 0.34.0) is CUDA 13.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


def _driver_str(v: Tuple[int, int, int]) -> str:
    return f"{v[0]}.{v[1]:02d}.{v[2]:02d}"
# vLLM's default --gpu-memory-utilization.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# A KV budget below this share of the GPU's memory is reported as a warning (a rule of thumb:
# short contexts and small batches only), not a failure.
KV_WARN_FRACTION = 0.1
ENGRAM_SCALE_BLOCK = 32  # one UE8M0 byte per 32 fp8 values (ParallelEngramEmbedding block_size)


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: Tuple[int, int]
    total_bytes: int


@dataclass
class HostFacts:
    """What the checks read from the machine (bytes; None where not found / unlimited)."""
    driver: Optional[str] = None             # "580.65.06"
    torch_version: str = ""
    torch_cuda: Optional[str] = None         # torch.version.cuda ("13.0"); None: a CPU build
    gpus: List[Gpu] = field(default_factory=list)
    mem_total: Optional[int] = None
    mem_available: Optional[int] = None      # /proc/meminfo MemAvailable
    memlock_limit: Optional[int] = None      # RLIMIT_MEMLOCK soft limit; None: unlimited
    cgroup_limit: Optional[int] = None       # memory.max (v2) / memory.limit_in_bytes (v1)
    cgroup_usage: Optional[int] = None
    shm_free: Optional[int] = None           # free bytes of /dev/shm; None: not mounted
    vllm_version: Optional[str] = None
    plugin_entry_points: List[str] = field(default_factory=list)  # vllm.general_plugins -> dsv4_ops
    vllm_plugins_env: Optional[str] = None   # VLLM_PLUGINS as set (None: unset)
    toolchain: Optional[Any] = None          # serve_host.Toolchain: what FlashInfer's JIT finds
    nvlink: Optional[List[List[bool]]] = None  # [i][j]: NVML NVLink P2P status OK; None: not readable
    environ: Dict[str, str] = field(default_factory=dict)  # the VLLM_* settings the checks read


@dataclass
class Deployment:
    """The serve command being checked (vLLM's flag names)."""
    model: Optional[str] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_size: Optional[int] = None
    kv_cache_dtype: str = "auto"
    engram_use_thp: bool = False
    engram_cpu_offload: bool = True
    linear_backend: str = "auto"
    moe_backend: str = "auto"
    max_num_batched_tokens: Optional[int] = None  # None: vLLM's default for the GPU
    max_num_seqs: Optional[int] = None


@dataclass
class Check:
    name: str
    status: str      # ok / warn / fail / skip
    message: str

    def line(self) -> str:
        return f"[{self.status.upper():4}] {self.name}: {self.message}"


# ------------------------------------------------------------------ host facts

def _run(cmd: Sequence[str]) -> Optional[str]:
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo(key: str) -> Optional[int]:
    m = re.search(rf"^{key}:\s+(\d+) kB", _read("/proc/meminfo") or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def _cgroup() -> Tuple[Optional[int], Optional[int]]:
    """(limit, usage) of this process's memory cgroup, v2 then v1; limit None when unlimited."""
    for lim_path, use_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                               ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim = (_read(lim_path) or "").strip()
        if not lim:
            continue
        use = (_read(use_path) or "").strip()
        limit = None if lim == "max" or int(lim) >= (1 << 62) else int(lim)
        return limit, (int(use) if use.isdigit() else None)
    return None, None


def _driver() -> Optional[str]:
    m = re.search(r"Kernel Module\s+(\d+\.\d+(?:\.\d+)?)", _read("/proc/driver/nvidia/version") or "")
    if m:
        return m.group(1)
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.strip().splitlines()[0].strip() if out and out.strip() else None


def _gpus() -> List[Gpu]:
    out = _run(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"])
    gpus = []
    for line in (out or "").strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and re.fullmatch(r"\d+\.\d+", parts[1]) and parts[2].isdigit():
            major, minor = parts[1].split(".")
            gpus.append(Gpu(parts[0], (int(major), int(minor)), int(parts[2]) << 20))
    if gpus:
        return gpus
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(Gpu(p.name, (p.major, p.minor), int(p.total_memory)))
    except Exception:  # noqa: BLE001 - no usable CUDA: no GPUs
        pass
    return gpus


def _nvlink() -> Optional[List[List[bool]]]:
    """Pairwise NVLink P2P status by NVML, the query vLLM's ``CudaPlatform.is_fully_connected``
    makes; None when NVML is not readable (no driver)."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML here
        return None
    try:
        n = nvml.nvmlDeviceGetCount()
        hs = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        out = [[True] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i != j:
                    try:
                        out[i][j] = nvml.nvmlDeviceGetP2PStatus(
                            hs[i], hs[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK
                    except nvml.NVMLError:
                        out[i][j] = False
        return out
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


# The environment variables the checks read (vLLM's names).
ENV_READ = ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_BATCH_INVARIANT", "VLLM_MARLIN_INPUT_DTYPE", "VLLM_DISABLED_KERNELS",
            "VLLM_MQ_MAX_CHUNK_BYTES_MB", "VLLM_USE_V2_MODEL_RUNNER", "CUDA_VISIBLE_DEVICES")


def read_host() -> HostFacts:
    """Read every fact the checks need from this machine (nothing is changed)."""
    import resource
    from importlib import metadata

    import torch

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit, usage = _cgroup()
    try:
        vllm_version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        vllm_version = None
    eps = [ep.name for ep in metadata.entry_points(group="vllm.general_plugins")
           if ep.value.startswith("dsv4_ops")]
    return HostFacts(
        driver=_driver(), torch_version=torch.__version__, torch_cuda=torch.version.cuda, gpus=_gpus(),
        mem_total=_meminfo("MemTotal"), mem_available=_meminfo("MemAvailable"),
        memlock_limit=None if soft == resource.RLIM_INFINITY else int(soft),
        cgroup_limit=limit, cgroup_usage=usage,
        shm_free=shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None,
        vllm_version=vllm_version, plugin_entry_points=eps, vllm_plugins_env=os.environ.get("VLLM_PLUGINS"),
        toolchain=serve_host.read_toolchain(), nvlink=_nvlink(),
        environ={k: v for k, v in os.environ.items() if k in ENV_READ})


# ------------------------------------------------------------------ the model

@dataclass
class ModelInfo:
    source: str
    config: Dict[str, Any]
    variant: Optional[str]            # v4 / v41 / v32 / glm5 / None (none of those)
    checkpoint_bytes: Optional[int]   # safetensors index total_size (None: no local weights index)

    @property
    def text(self) -> Dict[str, Any]:
        """The text-model config (a VL config nests it in text_config)."""
        return dict(self.config, **(self.config.get("text_config") or {}))


def variant_of(cfg: Dict[str, Any]) -> Optional[str]:
    names = " ".join(cfg.get("architectures") or []) + " " + str(cfg.get("model_type", ""))
    if "GlmMoeDsa" in names or "glm_moe_dsa" in names:
        return "glm5"
    if "V32" in names or "v32" in names:
        return "v32"
    if "V41" in names or "v41" in names:
        return "v41"
    if "V4" in names or "v4" in names:
        return "v4"
    return None


def load_model(model: str) -> ModelInfo:
    """config.json (and the safetensors index size) of a local model directory, a config.json
    path, or a Hugging Face id already in the local cache; FileNotFoundError otherwise."""
    folder = None
    if os.path.isdir(model):
        folder = model
    elif os.path.isfile(model):
        folder = os.path.dirname(os.path.abspath(model))
    else:
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(model, local_files_only=True,
                                       allow_patterns=["config.json", "*.safetensors.index.json"])
        except Exception as exc:  # noqa: BLE001 - not cached / no hub client
            raise FileNotFoundError(f"{model}: not a local directory and not in the Hugging Face cache "
                                    f"({type(exc).__name__}); download it or give the model directory") from exc
    path = model if os.path.isfile(model) else os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    size = None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            size = (json.load(f).get("metadata") or {}).get("total_size")
    return ModelInfo(model, cfg, variant_of(cfg), int(size) if size else None)


# ------------------------------------------------------------------ checks

def _gib(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def _version_tuple(s: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", s)[:3])


def check_driver(h: HostFacts) -> Check:
    """The NVIDIA driver against the minimum for torch's CUDA runtime major version."""
    if h.torch_cuda is None:
        return Check("driver", "fail", f"torch {h.torch_version} is a CPU build (torch.version.cuda is None): "
                     "vLLM needs the CUDA build it pins (vLLM 0.33.0 and 0.34.0: pip install torch==2.14.0 from "
                     "the PyTorch CUDA 13 index)")
    major = _version_tuple(h.torch_cuda)[0]
    need = MIN_DRIVER.get(major)
    if h.driver is None:
        return Check("driver", "fail", f"no NVIDIA driver found (/proc/driver/nvidia/version, nvidia-smi); torch "
                     f"{h.torch_version} (CUDA {h.torch_cuda}) needs driver "
                     f"{_driver_str(need) if need else 'a recent'} or newer")
    if need is None:
        return Check("driver", "warn", f"driver {h.driver}; no minimum recorded for CUDA {h.torch_cuda}")
    if _version_tuple(h.driver) < need:
        return Check("driver", "fail", f"driver {h.driver} is older than {_driver_str(need)}, the minimum for "
                     f"CUDA {major}.x, which torch {h.torch_version} (CUDA {h.torch_cuda}) uses: upgrade the driver "
                     f"to R{need[0]} or newer (or install a torch/vLLM build for an older CUDA)")
    return Check("driver", "ok", f"driver {h.driver} >= {_driver_str(need)} (CUDA {h.torch_cuda}, "
                 f"torch {h.torch_version})")


# How to install each supported vLLM release where a plain ``pip install vllm==X`` does not work.
# vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not serve (0.7.2.post1, then 0.7.4):
# the module installs the vllm wheel with --no-deps, then vLLM's requirement list with
# flashinfer-python 0.7.4.
def check_vllm(h: HostFacts) -> List[Check]:
    """The installed vLLM against ``versions.SUPPORTED`` (what the plugin's ``register()``
    accepts on sm_8x; it refuses anything else with ``VllmVersionError``; on sm_90+ it patches
    nothing, so there an unsupported release is a warning), then the entry point, then the
    settings a supported release itself refuses at startup."""
    tested = ", ".join(versions.SUPPORTED)
    rel = versions.release(h.vllm_version)
    if h.vllm_version is None:
        out = [Check("vllm", "fail", f"vLLM is not installed; dsv4-ops supports vLLM {tested}: {versions.install_advice()}")]
    elif rel in versions.SUPPORTED:
        out = [Check("vllm", "ok", f"vLLM {h.vllm_version}: a release the plugin supports ({tested})")]
    else:
        if rel is None:
            why = f"vLLM {h.vllm_version} is not a release the plugin knows (a dev or rc build?)"
        elif versions.key(rel) > versions.key(versions.NEWEST_DIFFED):
            why = (f"vLLM {h.vllm_version} is newer than the newest release diffed against the patch table "
                   f"({versions.NEWEST_DIFFED}; `dsv4-ops audit-vllm --against <vllm wheel or source dir>` shows what "
                   "moved)")
        else:
            why = f"vLLM {h.vllm_version} is older than the oldest supported release ({versions.SUPPORTED[0]})"
        if _plugin_acts(h):
            out = [Check("vllm", "fail", f"{why}: on sm_8x the plugin's register() refuses it at startup "
                         f"(VllmVersionError); dsv4-ops supports vLLM {tested}: {versions.install_advice()}")]
        else:
            out = [Check("vllm", "warn", f"{why}; on sm_90+ the plugin patches nothing, so vLLM runs on its own "
                         f"kernels; on sm_8x dsv4-ops supports vLLM {tested}: {versions.install_advice()}")]
    if not h.plugin_entry_points:
        out.append(Check("plugin", "fail", "no vllm.general_plugins entry point points at dsv4_ops: vLLM will not load "
                         "the plugin; reinstall dsv4-ops (pip install -e . / pip install dsv4-ops)"))
    elif h.vllm_plugins_env is not None and not set(h.vllm_plugins_env.split(",")) & set(h.plugin_entry_points):
        out.append(Check("plugin", "fail", f"VLLM_PLUGINS={h.vllm_plugins_env!r} does not name "
                         f"{h.plugin_entry_points[0]!r}: vLLM loads only the plugins it names; unset VLLM_PLUGINS or "
                         f"add {h.plugin_entry_points[0]}"))
    else:
        out.append(Check("plugin", "ok", f"entry point {', '.join(h.plugin_entry_points)} (vllm.general_plugins) is "
                         "visible and VLLM_PLUGINS " + ("is unset" if h.vllm_plugins_env is None else "names it")))
    runner = h.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if runner is not None and runner != "1" and rel is not None and versions.key(rel) >= versions.key("0.34.0"):
        # vLLM 0.34.0 removed the V1 model runner: Platform.validate_environ raises
        # (platforms/interface.py:1481-1486).
        out.append(Check("vllm settings", "fail", f"VLLM_USE_V2_MODEL_RUNNER={runner}: vLLM {rel} removed the V1 model "
                         "runner and refuses this at startup ('no longer supported'); unset it"))
    return out


def weights_per_rank(m: ModelInfo, d: Deployment) -> Optional[float]:
    """GPU weight bytes per rank, an even split of the checkpoint over TP x PP after taking out
    the Engram tables (host memory); replicated small layers make the real share a little
    larger. None without a local safetensors index."""
    if m.checkpoint_bytes is None:
        return None
    engram = engram_table_bytes(m.text) if m.variant == "v41" else 0
    return (m.checkpoint_bytes - engram) / (d.tensor_parallel_size * d.pipeline_parallel_size)


def check_gpus(h: HostFacts, d: Deployment, m: Optional[ModelInfo]) -> List[Check]:
    if not h.gpus:
        return [Check("gpu", "fail", "no NVIDIA GPU visible (nvidia-smi, torch.cuda): run doctor on the serving host")]
    out = []
    caps = sorted({g.capability for g in h.gpus})
    low = [c for c in caps if c < (8, 0)]
    arch = ", ".join(f"sm_{a}{b}" for a, b in caps)
    if low:
        out.append(Check("gpu arch", "fail", f"{arch}: DeepSeek-V4 needs sm_80 or newer (A100/A800/A10/A40/RTX 30xx+)"))
    else:
        who = ("the plugin routes sm_8x to its kernels" if any(c[0] == 8 for c in caps)
               else "vLLM's own kernels (the plugin patches nothing)")
        out.append(Check("gpu arch", "ok", f"{len(h.gpus)} x {h.gpus[0].name} ({arch}): {who}"))
    ranks = d.tensor_parallel_size * d.pipeline_parallel_size
    if len(h.gpus) < ranks:
        out.append(Check("gpu count", "fail", f"TP {d.tensor_parallel_size} x PP {d.pipeline_parallel_size} = {ranks} "
                         f"GPUs needed on this node, {len(h.gpus)} visible (CUDA_VISIBLE_DEVICES?)"))
    per_rank = weights_per_rank(m, d) if m is not None else None
    if per_rank is None:
        out.append(Check("gpu memory", "skip", "weights per rank unknown: give --model with a local checkpoint "
                         "(its model.safetensors.index.json)"))
        return out
    mem = min(g.total_bytes for g in h.gpus)
    kv = mem * d.gpu_memory_utilization - per_rank
    what = (f"{_gib(per_rank)} of weights per rank at TP {d.tensor_parallel_size} x PP {d.pipeline_parallel_size}, "
            f"{_gib(mem)} per GPU x --gpu-memory-utilization {d.gpu_memory_utilization}: {_gib(kv)} left for the KV "
            f"cache, activations and CUDA graphs")
    if kv <= 0:
        out.append(Check("gpu memory", "fail", what + ": raise --tensor-parallel-size / --pipeline-parallel-size"))
    elif kv < KV_WARN_FRACTION * mem:
        out.append(Check("gpu memory", "warn", what + ": little room for context; consider a larger TP/PP"))
    else:
        out.append(Check("gpu memory", "ok", what))
    return out


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 1 else int(n)


def _engram_layout(text: Dict[str, Any]):
    """vLLM's own EngramLayout of the config (prime-sized bucket ranges per (n-gram, head))."""
    from types import SimpleNamespace

    from vllm.models.deepseek_v41.common.engram import EngramLayout

    return EngramLayout(SimpleNamespace(**text))


def engram_table_bytes(text: Dict[str, Any]) -> int:
    """Bytes of all Engram tables as stored (fp8 rows + UE8M0 scales), vLLM's own sum
    (``can_share_engram_tables``): sum(engram_num_embeddings) * (head_dim + head_dim / 32)."""
    if not text.get("engram_layer_ids"):
        return 0
    dim = int(text["engram_head_dim"])
    return sum(int(n) for n in text["engram_num_embeddings"]) * (dim + dim // ENGRAM_SCALE_BLOCK)


def engram_pinned_per_rank(text: Dict[str, Any], shards: int) -> List[int]:
    """Pinned host bytes of each of ``shards`` ranks (TP at DP 1; TP x DP for private tables at
    DP > 1): per Engram layer, a rank's hash heads are ``cdiv(n_hash_cols, shards)`` consecutive
    columns; their rows are pinned as rows x dim fp8 bytes and rows x dim/32 scale bytes, each
    allocation rounded up to a power of two by torch's pinned allocator."""
    layout = _engram_layout(text)
    dim = layout.head_dim
    per = [0] * shards
    for layer in layout.primes:
        sizes = [s for per_ngram in layer for s in per_ngram]
        part = -(-len(sizes) // shards)
        for r in range(shards):
            rows = sum(sizes[r * part:(r + 1) * part])
            if rows:
                per[r] += _pow2(rows * dim) + _pow2(rows * (dim // ENGRAM_SCALE_BLOCK))
    return per


def engram_shared_rule(vllm_version: Optional[str]) -> str:
    """Which release's DP-shared Engram rule applies: '0.33.0' or '0.34.0' (a vLLM that is not a
    supported release, or none: the newest's).

    0.33.0 (``can_share_engram_tables``, engram.py:885-913): shared when ``/dev/shm`` is mounted
    and has the tables' bytes free (``check_shm_free_space``); the tables then live in a
    ``/dev/shm`` file, registered with ``cudaHostRegister``; nothing checks host memory, so
    tmpfs pages beyond it are faulted in under the OOM killer while the weights load.
    0.34.0 (engram.py:667-682 ``_shm_shortfall``, 831-852): the same ``/dev/shm`` test ("/dev/shm
    must fit even where cuMem will, since it is the fallback") AND the tables no larger than the
    available host memory (``get_available_memory``: psutil's available, capped by the cgroup
    headroom, utils/cpu_resource_utils.py:118-125). The tables then live in host-NUMA cuMem
    (``engram_host_table.share_host_table``: pinned, 2 GiB chunks created by the Engram DP leader
    on its GPU's NUMA node, which must keep 5 % free, FABRIC handles imported by the other ranks;
    2 MiB GPU pages) where the driver exports FABRIC handles, else in the ``/dev/shm`` file.
    The private pinned tables (DP 1, or the DP > 1 fallback) are the same on both."""
    rel = versions.release(vllm_version)
    if rel in versions.SUPPORTED and versions.key(rel) < versions.key("0.34.0"):
        return "0.33.0"
    return "0.34.0"


def engram_need(text: Dict[str, Any], d: Deployment, shm_free: Optional[int], vllm_version: Optional[str] = None,
                available: Optional[int] = None) -> Dict[str, Any]:
    """Where the installed vLLM puts the Engram tables for this deployment and how many bytes:
    {'mode': 'pinned' | 'shm' | 'device', 'rule', 'pinned_node', 'pinned_rank', 'shm', 'tables',
    'why'}. 'shm' (mode): one copy per node shared by the DP ranks (0.34.0: in cuMem or
    /dev/shm); the 'shm' value is the /dev/shm free space vLLM's check demands (DP > 1), 0 when
    /dev/shm plays no part. ``available``: host memory free for the tables (MemAvailable capped
    by the cgroup headroom; None: unknown, not checked)."""
    tables = engram_table_bytes(text)
    tp, dp = d.tensor_parallel_size, d.data_parallel_size
    rule = engram_shared_rule(vllm_version)
    if not d.engram_cpu_offload:
        return dict(mode="device", rule=rule, tables=tables, pinned_node=0, pinned_rank=0, shm=0,
                    why="cpu_offload off: the tables are in GPU memory")
    if dp > 1 and not d.engram_use_thp:  # EngramConfig.resolve_dp_shared_memory
        shm_ok = shm_free is not None and shm_free >= tables
        mem_ok = rule == "0.33.0" or available is None or tables <= available
        if shm_ok and mem_ok:  # can_share_engram_tables
            where = ("/dev/shm" if rule == "0.33.0" else
                     "host-NUMA cuMem (FABRIC handles) where the driver allows it, else /dev/shm")
            return dict(mode="shm", rule=rule, tables=tables, pinned_node=0, pinned_rank=0, shm=tables,
                        why=f"DP {dp} > 1: one copy per node in {where} (dp_shared_memory, vLLM {rule} rule)")
        per = engram_pinned_per_rank(text, tp * dp)
        if not shm_ok:
            short = ("/dev/shm " + ("is not mounted" if shm_free is None else f"has {_gib(shm_free)} free")
                     + f" for {_gib(tables)} of tables")
        else:
            short = f"{_gib(tables)} of tables exceed the {_gib(available)} of available host memory"
        return dict(mode="pinned", rule=rule, tables=tables, pinned_node=sum(per), pinned_rank=max(per), shm=tables,
                    why=(f"DP {dp} > 1 but {short}: vLLM {rule} falls back to private pinned tables sharded over "
                         f"TP x DP = {tp * dp}"))
    per = engram_pinned_per_rank(text, tp)
    return dict(mode="pinned", rule=rule, tables=tables, pinned_node=sum(per), pinned_rank=max(per), shm=0,
                why=f"DP {dp}: each of the {tp} TP ranks pins its share (rounded up to powers of two)")


def _available_host(h: HostFacts) -> Optional[int]:
    """Host memory free for new allocations as vLLM 0.34.0 counts it (``get_available_memory``):
    MemAvailable, capped by the memory cgroup's headroom."""
    cg = None if h.cgroup_limit is None else max(0, h.cgroup_limit - (h.cgroup_usage or 0))
    vals = [v for v in (h.mem_available, cg) if v is not None]
    return min(vals) if vals else None


def _rings_bytes(d: Deployment) -> int:
    """vLLM's /dev/shm MessageQueue rings of every co-located DP replica (each engine has its
    own executor and TP group: ``shm_rings`` x DP); 0 where vLLM is not importable."""
    try:
        return d.data_parallel_size * sum(b for _, b in shm_rings(d, mq_sizes()))
    except Exception:  # noqa: BLE001 - vLLM not importable here
        return 0


def engram_shm_size_gib(tables: int, rings: int) -> int:
    """The ``--shm-size`` (GiB) to give a DP > 1 V4.1 container: the Engram tables, which vLLM
    checks against /dev/shm's free space at model load, plus the rings of every DP replica
    (``_rings_bytes``), which fill later, plus 1 GiB for NCCL's shared-memory transport and the
    rest."""
    return int(-(-(tables + rings) // int(GIB))) + 1


def check_engram(h: HostFacts, d: Deployment, m: Optional[ModelInfo]) -> List[Check]:
    if m is None or m.variant != "v41" or not m.text.get("engram_layer_ids"):
        return [Check("engram", "skip", "no Engram layers in the model (V4.1 only; give --model)")]
    available = _available_host(h)
    try:
        need = engram_need(m.text, d, h.shm_free, h.vllm_version, available)
    except Exception as exc:  # noqa: BLE001 - vLLM missing or a config field absent
        return [Check("engram", "warn", f"could not compute the Engram host memory ({type(exc).__name__}: {exc})")]
    out = []
    if need["mode"] == "device":
        return [Check("engram", "ok", need["why"])]
    if need["shm"]:
        ok = h.shm_free is not None and h.shm_free >= need["shm"]
        size = engram_shm_size_gib(need["shm"], _rings_bytes(d))
        fix = (f"start the container with --ipc=host or --shm-size={size}g (the tables, the /dev/shm rings of "
               f"vLLM's {d.data_parallel_size} DP replicas and 1 GiB)")
        if need["mode"] == "shm":
            where = ("in /dev/shm" if need["rule"] == "0.33.0" else
                     "in host-NUMA cuMem where the driver exports FABRIC handles (vLLM logs 'shared across DP "
                     "replicas via cuMem'), else in /dev/shm; /dev/shm must hold them either way (vLLM checks it "
                     "first, as the fallback)")
            out.append(Check("engram /dev/shm", "ok",
                             f"{_gib(need['shm'])} of Engram tables shared by the node's DP ranks, {where} "
                             f"({_gib(h.shm_free)} free)"))
        else:
            out.append(Check("engram /dev/shm", "warn",
                             f"{need['why']} ({_gib(need['pinned_node'])} pinned on this node); "
                             + (fix if not ok else "to share them, free host memory or raise the container's memory "
                                "limit (docker --memory)")))
    if need["mode"] == "shm":
        if available is not None and available < need["tables"]:
            # vLLM 0.33.0 only: 0.34.0 would have fallen back to private tables (engram_need)
            out.append(Check("engram host memory", "warn",
                             f"{_gib(need['tables'])} of shared Engram tables, {_gib(available)} of host memory "
                             f"available (MemAvailable / cgroup): vLLM {need['rule']} does not check it, and the "
                             "/dev/shm pages past it are faulted in under the OOM killer while the weights load; free "
                             "host memory or raise the container's memory limit (docker --memory)"))
        return out
    n = need["pinned_node"]
    msg = f"{_gib(n)} of pinned host memory on this node ({_gib(need['pinned_rank'])} per rank): {need['why']}"
    free = h.mem_available
    cg = None if h.cgroup_limit is None else h.cgroup_limit - (h.cgroup_usage or 0)
    if free is not None and free < n:
        out.append(Check("engram host memory", "fail", f"{msg}; only {_gib(free)} available (MemAvailable): "
                         "free memory, use a host with more RAM, or raise TP (smaller shares)"))
    elif cg is not None and cg < n:
        out.append(Check("engram host memory", "fail", f"{msg}; the memory cgroup allows {_gib(cg)} more: raise "
                         "the container's memory limit (docker --memory)"))
    else:
        out.append(Check("engram host memory", "ok", f"{msg}; {_gib(free)} available"
                         + ("" if cg is None else f", cgroup headroom {_gib(cg)}")))
    if h.memlock_limit is not None and h.memlock_limit < need["pinned_rank"]:
        out.append(Check("engram lockable memory", "warn", f"ulimit -l is {_gib(h.memlock_limit)} per process, "
                         f"below the {_gib(need['pinned_rank'])} each rank pins: where the driver counts pinned "
                         "pages against RLIMIT_MEMLOCK the allocation fails; run `ulimit -l unlimited` "
                         "(docker --ulimit memlock=-1)"))
    return out


def check_pp(d: Deployment, m: Optional[ModelInfo]) -> Check:
    from .. import pp_partition

    if m is None:
        return Check("pp partition", "skip", "give --model to check the pipeline partition")
    if m.variant in V32_VARIANTS:
        return Check("pp partition", "ok", f"PP {d.pipeline_parallel_size}: vLLM's own layer split (the plugin adds "
                     "no stage rule for DeepSeek-V3.2 / GLM-5)")
    if d.pipeline_parallel_size <= 1:
        return Check("pp partition", "ok", "PP 1: no stage boundaries")
    env = os.environ.get(pp_partition.ENV_VAR)
    try:
        counts = pp_partition.check_partition(m.text, env, d.pipeline_parallel_size)
    except pp_partition.PPPartitionError as exc:
        return Check("pp partition", "fail", str(exc))
    return Check("pp partition", "ok", f"{pp_partition.ENV_VAR}={pp_partition.format_partition(counts)} "
                 f"({'set' if env else 'vLLM default'}) is legal")


# The attention backends a DeepSeek-V4 layer set registers KV caches through (read from vLLM
# 0.33.0 and 0.34.0, the same classes: the FlashMLA attention class's backend_cls / swa_backend_cls, the indexer's
# get_attn_backend, the compressor's CompressorBackend).
_BACKENDS = {
    "v4": ("vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention",
           "vllm.v1.attention.backends.mla.indexer:DeepseekV4IndexerBackend",
           "vllm.models.deepseek_v4.compressor:CompressorBackend"),
    "v41": ("vllm.models.deepseek_v41.nvidia.flashmla:DeepseekV4FlashMLAAttention",
            "vllm.v1.attention.backends.mla.indexer:DeepseekV41IndexerBackend",
            "vllm.models.deepseek_v41.compressor:CompressorBackend"),
}


def platform_as(arch: int):
    """vLLM's ``current_platform`` answers capability questions as an sm_<arch> GPU (the
    instance methods the backends call), restored afterwards (a context manager)."""
    from vllm.platforms.interface import DeviceCapability

    from ..vllm.platform_view import answering

    cap = DeviceCapability(major=arch // 10, minor=arch % 10)
    return answering(
        get_device_capability=lambda device_id=0: cap,
        has_device_capability=lambda c, device_id=0: cap >= c if isinstance(c, tuple) else cap.to_int() >= c,
        is_device_capability_family=lambda c, device_id=0: cap.to_int() // 10 == c // 10)


def resolved_block_size(variant: str, arch: int) -> Tuple[int, str]:
    """(block size, backends) vLLM picks without --block-size for the model's backends on
    sm_<arch>: its own Platform._preferred_block_size_for_backends with the platform answering
    as that GPU. Raises ValueError when the backends share no size (vLLM's message)."""
    import importlib
    from types import SimpleNamespace

    from vllm.config.cache import CacheConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

    def get(s):
        mod, name = s.split(":")
        return getattr(importlib.import_module(mod), name)

    if variant in V32_VARIANTS:  # MLAAttention's selected backend (the plugin's, on sm_8x) + the indexer's
        from ..vllm import v32_backend

        classes = [v32_backend.AmpereSparseMLABackend,
                   get("vllm.v1.attention.backends.mla.indexer:DeepseekV32IndexerBackend")]
    else:
        attn, indexer, compressor = (get(s) for s in _BACKENDS[variant])
        classes = [attn.backend_cls, getattr(attn, "swa_backend_cls", None) or DeepseekSparseSWABackend,
                   get(_BACKENDS[variant][1]), compressor]
    with platform_as(arch):  # a stand-in config: these backends read only the platform
        size = type(current_platform)._preferred_block_size_for_backends(
            classes, CacheConfig.DEFAULT_BLOCK_SIZE, SimpleNamespace(compilation_config=None))
        names = "; ".join(f"{b.get_name()} {b.get_supported_kernel_block_sizes()}" for b in classes)
    return size, names


def check_block_size(h: HostFacts, d: Deployment, m: Optional[ModelInfo]) -> Check:
    if m is None or m.variant is None:
        return Check("kv block size", "skip", "give --model (a DeepSeek-V4/V4.1/V3.2 or GLM-5 config) to resolve "
                     "the block size")
    cap = h.gpus[0].capability if h.gpus else (8, 0)
    arch = cap[0] * 10 + cap[1]
    try:
        size, names = resolved_block_size(m.variant, arch)
    except ValueError as exc:
        return Check("kv block size", "fail", f"sm_{arch}: {exc}")
    except Exception as exc:  # noqa: BLE001 - vLLM not importable here
        return Check("kv block size", "skip", f"could not ask vLLM ({type(exc).__name__}: {str(exc)[:120]})")
    where = f"sm_{arch}{'' if h.gpus else ' (no GPU here: A100 assumed)'}"
    if d.block_size is not None and d.block_size != size:
        return Check("kv block size", "fail", f"--block-size {d.block_size}, but on {where} vLLM's backends for this "
                     f"model take {size} ({names}); drop --block-size or pass {size}")
    return Check("kv block size", "ok", f"vLLM resolves {size}-token KV blocks on {where} ({names})")


# ------------------------------------------------------------------ serve host (vLLM's own needs)

MIB = float(1 << 20)


def _ring_bytes(chunk: int, chunks: int, readers: int) -> int:
    """Bytes of one ``ShmRingBuffer``: (chunk + 1 + readers) x chunks (its total_bytes_of_buffer)."""
    return (chunk + 1 + readers) * chunks


def mq_sizes() -> Dict[str, Any]:
    """vLLM's own MessageQueue sizes: the constructor's defaults, VLLM_MQ_MAX_CHUNK_BYTES_MB
    for the executor's ring, and the TP group broadcaster's (chunk, chunks) read from
    ``GroupCoordinator.__init__``'s source. {'default': (chunk, chunks), 'executor_chunk',
    'group': (chunk, chunks), 'source'}."""
    import inspect

    from vllm import envs
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    sig = inspect.signature(MessageQueue.__init__).parameters
    default = (int(sig["max_chunk_bytes"].default), int(sig["max_chunks"].default))
    src = inspect.getsource(parallel_state.GroupCoordinator.__init__)
    m = re.search(r"MessageQueue\.create_from_process_group\(\s*self\.cpu_group,\s*(\d+)\s*<<\s*(\d+),\s*(\d+)", src)
    group, where = ((int(m.group(1)) << int(m.group(2)), int(m.group(3))), "vLLM source") if m else \
        ((1 << 22, 6), "vLLM 0.33.0's values (the source no longer matches)")
    return dict(default=default, executor_chunk=int(envs.VLLM_MQ_MAX_CHUNK_BYTES_MB) << 20, group=group, source=where)


def shm_rings(d: Deployment, sizes: Dict[str, Any]) -> List[Tuple[str, int]]:
    """(name, bytes) of each /dev/shm ring a one-node multiprocessing serve creates
    (``v1/executor/multiproc_executor.py``; ``distributed/parallel_state.py``); none at TP x PP 1
    (the in-process executor)."""
    tp, pp = d.tensor_parallel_size, d.pipeline_parallel_size
    world = tp * pp
    if world <= 1:
        return []
    chunk, chunks = sizes["default"]
    rings = [("scheduler broadcast", _ring_bytes(sizes["executor_chunk"], chunks, world))]
    rings += [(f"worker {r} response", _ring_bytes(chunk, chunks, 1)) for r in range(world)]
    if tp > 1:
        gchunk, gchunks = sizes["group"]
        rings += [(f"TP group {g} broadcaster", _ring_bytes(gchunk, gchunks, tp - 1)) for g in range(pp)]
    return rings


def check_shm(h: HostFacts, d: Deployment) -> Check:
    """/dev/shm against vLLM's MessageQueue rings: vLLM refuses a ring larger than the free
    space (``check_shm_free_space``); the rings fill as they are written (tmpfs pages)."""
    world = d.tensor_parallel_size * d.pipeline_parallel_size
    if world <= 1:
        return Check("/dev/shm", "ok", f"TP x PP = 1: vLLM's in-process executor makes no /dev/shm rings"
                     + (" (DP > 1: see the Engram line)" if d.data_parallel_size > 1 else ""))
    try:
        sizes = mq_sizes()
    except Exception as exc:  # noqa: BLE001 - vLLM not importable here
        return Check("/dev/shm", "skip", f"could not read vLLM's MessageQueue sizes ({type(exc).__name__})")
    rings = shm_rings(d, sizes)
    biggest = max(rings, key=lambda r: r[1])
    total = sum(b for _, b in rings)
    fix = f"start the container with --ipc=host or --shm-size={max(1, int(-(-total // GIB)))}g (Docker's default is 64m)"
    what = (f"TP {d.tensor_parallel_size} x PP {d.pipeline_parallel_size}: vLLM's rings need {biggest[1] / MIB:.0f} MiB "
            f"for the largest ({biggest[0]}), {total / MIB:.0f} MiB for all {len(rings)} ({sizes['source']})")
    if h.shm_free is None:
        return Check("/dev/shm", "fail", f"{what}; /dev/shm is not mounted: {fix}")
    if h.shm_free < biggest[1]:
        return Check("/dev/shm", "fail", f"{what}; {h.shm_free / MIB:.0f} MiB free: vLLM raises 'Insufficient space "
                     f"in /dev/shm' at startup; {fix}")
    if h.shm_free < total:
        return Check("/dev/shm", "warn", f"{what}; {h.shm_free / MIB:.0f} MiB free: the rings can outgrow it as they "
                     f"fill (SIGBUS), and NCCL's shared-memory transport wants more; {fix}")
    return Check("/dev/shm", "ok", f"{what}; {_gib(h.shm_free)} free")


def _plugin_acts(h: HostFacts) -> bool:
    """The plugin's startup choices apply on sm_8x (and a GPU-less doctor host assumes A100)."""
    return not h.gpus or any(g.capability[0] == 8 for g in h.gpus)


def check_sampler(h: HostFacts) -> Check:
    """FlashInfer's sampling JIT (every last-stage worker, in the profile run) or the Triton
    sampler."""
    choice = serve_host.sampler_env_choice(h.environ)
    if choice is False:
        return Check("sampler", "ok", f"{serve_host.SAMPLER_ENV}=0: vLLM's Triton top-k/top-p sampler, no JIT build")
    tc = h.toolchain
    if tc is None:
        return Check("sampler", "skip", "toolchain not read")
    problems = serve_host.jit_problems(tc, h.torch_cuda)
    major = (h.torch_cuda or "13").split(".")[0]
    if not problems:
        return Check("sampler", "ok", f"FlashInfer can build its sampling module: nvcc {tc.nvcc_release} at {tc.nvcc} "
                     f"(from {tc.how}), headers, ninja, {tc.cxx}, libcudart/libcuda")
    why = "; ".join(problems)
    toolkit = (f"install a CUDA {major} toolkit (nvcc, headers incl. curand, lib64 and its stubs) and point CUDA_HOME "
               "at it")
    if choice is True:
        return Check("sampler", "fail", f"{serve_host.SAMPLER_ENV}=1 asks for FlashInfer's sampler, whose JIT cannot "
                     f"build here ({why}): the profile run fails on every worker; {toolkit}, or set "
                     f"{serve_host.SAMPLER_ENV}=0")
    if _plugin_acts(h):
        return Check("sampler", "warn", f"FlashInfer's sampler JIT cannot build here ({why}): the plugin sets "
                     f"{serve_host.SAMPLER_ENV}=0 (vLLM's Triton sampler) and says so in its log line; to keep "
                     f"FlashInfer's, {toolkit}")
    return Check("sampler", "fail", f"FlashInfer's sampler JIT cannot build here ({why}): vLLM's profile run fails on "
                 f"every worker; export {serve_host.SAMPLER_ENV}=0 (Triton sampler), or {toolkit}")


def check_nvlink(h: HostFacts, d: Deployment) -> Check:
    """vLLM's custom all-reduce at world size > 2 needs every pair of the TP GPUs NVLink-
    connected (``custom_all_reduce.py``: ``is_fully_connected``, NVML P2P status)."""
    tp = d.tensor_parallel_size
    if tp <= 2:
        return Check("nvlink", "ok", f"TP {tp}: vLLM's custom all-reduce needs no NVLink at TP <= 2")
    if h.nvlink is None:
        return Check("nvlink", "skip", "NVML not readable here (no driver): run doctor on the serving host")
    n = min(tp, len(h.nvlink))
    missing = [(i, j) for i in range(n) for j in range(i + 1, n) if not (h.nvlink[i][j] and h.nvlink[j][i])]
    if missing:
        pairs = ", ".join(f"{i}-{j}" for i, j in missing[:6]) + (" ..." if len(missing) > 6 else "")
        return Check("nvlink", "warn", f"GPUs 0..{n - 1} are not NVLink-fully-connected (no NVLink P2P: {pairs}; a PCIe "
                     f"box): vLLM turns its custom all-reduce off at TP {tp} and NCCL over PCIe carries every "
                     "all-reduce (tens of us each, two a layer: decode latency); prefer an NVLink/NVSwitch (SXM) host "
                     "or a smaller TP with PP")
    return Check("nvlink", "ok", f"GPUs 0..{n - 1} NVLink-fully-connected: vLLM's custom all-reduce runs at TP {tp}")


def check_kernel_settings(h: HostFacts, d: Deployment) -> Check:
    problems = serve_host.kernel_setting_problems(h.environ, d.linear_backend, d.moe_backend)
    if problems:
        return Check("serve-path settings", "fail", "; ".join(problems) + " (the plugin refuses these at startup on "
                     "sm_8x)")
    return Check("serve-path settings", "ok", "no VLLM_BATCH_INVARIANT, VLLM_MARLIN_INPUT_DTYPE, VLLM_DISABLED_KERNELS "
                 "entry or --linear-backend/--moe-backend that leaves the audited kernels")


def check_quant_layout(m: Optional[ModelInfo]) -> Check:
    if m is None or m.variant not in ("v4", "v41"):
        return Check("quant layout", "skip", "give --model (a DeepSeek-V4/V4.1 config) to read its quantization layout")
    lay = serve_host.layout_of_config(m.variant, m.text)
    if lay.problem:
        return Check("quant layout", "fail", f"{lay.describe()}: {lay.problem}; the plugin refuses it at startup on "
                     "sm_8x")
    return Check("quant layout", "ok", f"{lay.describe()}: linears {lay.linear}; experts {lay.moe} (audited on sm_80)")


def _platform_gpu(gpu: Gpu):
    """vLLM's ``current_platform`` answers the questions ``get_batch_defaults`` asks as ``gpu``
    (a context manager)."""
    from ..vllm.platform_view import answering

    return answering(
        get_device_total_memory=lambda device_id=0: gpu.total_bytes,
        get_device_name=lambda device_id=0: gpu.name,
        is_device_capability=lambda c, device_id=0: (tuple(c) == tuple(gpu.capability) if not isinstance(c, int)
                                                     else c == gpu.capability[0] * 10 + gpu.capability[1]),
        is_tpu=lambda: False,
        is_cpu=lambda: False)


def batch_defaults(gpu: Gpu, world_size: int) -> Tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) ``vllm serve`` defaults to on ``gpu``: vLLM's own
    ``EngineArgs.get_batch_defaults`` (by GPU memory and name: an A800 is not an "a100")."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    with _platform_gpu(gpu):
        tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    return tokens[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER]


def check_batch_defaults(h: HostFacts, d: Deployment, m: Optional[ModelInfo]) -> Check:
    gpu = h.gpus[0] if h.gpus else Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80 * (1 << 30))
    try:
        tokens, seqs = batch_defaults(gpu, d.tensor_parallel_size * d.pipeline_parallel_size)
    except Exception as exc:  # noqa: BLE001 - vLLM not importable here
        return Check("batch defaults", "skip", f"could not ask vLLM ({type(exc).__name__}: {str(exc)[:100]})")
    tokens = d.max_num_batched_tokens or tokens
    seqs = d.max_num_seqs or seqs
    where = f"{gpu.name}{'' if h.gpus else ' (no GPU here: assumed)'}"
    msg = f"{where}: --max-num-batched-tokens {tokens}, --max-num-seqs {seqs}"
    text = m.text if m is not None else {}
    if text.get("hidden_size") and text.get("vocab_size"):
        hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
        hc = int(text.get("hc_mult", 1) or 1)
        per = tokens * hidden * hc * 2  # one bf16 copy of the (mHC-widened) hidden stream
        logits = seqs * vocab * 4       # the sampler's fp32 logits, one row a sequence
        msg += (f"; each bf16 copy of the hidden stream is {_gib(per)} (tokens x {hidden} x hc {hc} x 2 B) and the "
                f"fp32 logits {_gib(logits)} (seqs x {vocab} x 4 B); vLLM's profile run measures the peak and takes it "
                "from the KV cache")
    if tokens > 2048 and gpu.total_bytes < 48 * (1 << 30):
        return Check("batch defaults", "warn", msg + "; on a 40 GB card lower --max-num-batched-tokens")
    return Check("batch defaults", "ok", msg + ("; A800/H800 get vLLM's H100 tier (the name lacks 'a100'), A100 "
                                                "2048 / 256" if tokens >= 8192 else ""))


V32_VARIANTS = ("v32", "glm5")


def check_v32(d: Deployment, m: Optional[ModelInfo]) -> List[Check]:
    """DeepSeek-V3.2 / GLM-5: the query heads a rank gets at this TP (vLLM shards them; the
    indexer's heads run on every rank) and the ``--kv-cache-dtype`` the plugin's sparse-MLA
    backend reads (``v32_backend``: auto / bfloat16 / fp8_ds_mla and the fp8 aliases of it)."""
    if m is None or m.variant not in V32_VARIANTS:
        return []
    from ..vllm import v32_backend

    out = []
    heads = int(m.text.get("num_attention_heads", 0) or 0)
    tp = d.tensor_parallel_size
    if heads and heads % tp:
        out.append(Check("heads per rank", "fail", f"{heads} query heads do not split over TP {tp}"))
    elif heads:
        out.append(Check("heads per rank", "ok", f"{heads // tp} query heads a rank at TP {tp}; the indexer's "
                         f"{m.text.get('index_n_heads', '?')} heads run on every rank"))
    dtype = d.kv_cache_dtype
    known = v32_backend.KV_CACHE_DTYPES + tuple(v32_backend.KV_CACHE_ALIASES)
    if dtype not in known:
        out.append(Check("kv cache dtype", "fail", f"--kv-cache-dtype {dtype}: the sm_8x sparse-MLA backend reads "
                         f"{', '.join(known)}"))
    else:
        what = v32_backend.KV_CACHE_ALIASES.get(dtype, dtype)
        rec = "656-byte fp8_ds_mla records" if what == "fp8_ds_mla" else "bf16 rows of 576"
        out.append(Check("kv cache dtype", "ok", f"--kv-cache-dtype {dtype}: {rec} a token"))
    return out


def run(h: HostFacts, d: Deployment, m: Optional[ModelInfo] = None) -> List[Check]:
    """Every check, in the order a deployment meets them."""
    checks = [check_driver(h)] + check_vllm(h) + check_gpus(h, d, m)
    checks += [check_shm(h, d), check_sampler(h), check_nvlink(h, d), check_kernel_settings(h, d),
               check_batch_defaults(h, d, m)]
    checks += check_engram(h, d, m)
    if m is not None:
        checks.append(check_quant_layout(m))
        checks += check_v32(d, m)
        checks += [check_pp(d, m), check_block_size(h, d, m)]
    return checks


def main(args) -> int:
    """``dsv4-ops doctor``: print one line per check; 1 when any check fails."""
    d = Deployment(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
                   pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size,
                   gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                   kv_cache_dtype=getattr(args, "kv_cache_dtype", None) or "auto",
                   linear_backend=getattr(args, "linear_backend", None) or "auto",
                   moe_backend=getattr(args, "moe_backend", None) or "auto",
                   max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
                   max_num_seqs=getattr(args, "max_num_seqs", None))
    m = None
    if args.model:
        try:
            m = load_model(args.model)
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            print(Check("model", "fail", str(exc)).line())
            return 1
        if m.variant is None:
            print(Check("model", "warn", f"{args.model}: not a DeepSeek-V4/V4.1/V3.2 or GLM-5 config "
                        f"(architectures {m.config.get('architectures')})").line())
    checks = run(read_host(), d, m)
    for c in checks:
        print(c.line())
    failed = [c for c in checks if c.status == "fail"]
    print(f"doctor: {len(failed)} failed, {sum(c.status == 'warn' for c in checks)} warning(s), "
          f"{sum(c.status == 'ok' for c in checks)} ok")
    return 1 if failed else 0


__all__ = ["Check", "Deployment", "Gpu", "HostFacts", "ModelInfo", "batch_defaults", "check_batch_defaults",
           "check_block_size", "check_driver", "check_engram", "check_gpus", "check_kernel_settings", "check_nvlink",
           "check_pp", "check_quant_layout", "check_sampler", "check_shm", "check_v32", "check_vllm", "mq_sizes",
           "shm_rings", "engram_need", "engram_shared_rule", "engram_shm_size_gib",
           "engram_pinned_per_rank", "engram_table_bytes", "load_model", "main", "read_host", "resolved_block_size", "run"]
