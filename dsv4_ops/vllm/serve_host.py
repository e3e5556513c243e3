"""What a vLLM 0.33.0 / 0.34.0 serve on sm_8x needs beyond the plugin's kernels, decided once here
for ``dsv4-ops doctor`` (which reports) and the plugin's ``register()`` (which acts):

- FlashInfer's sampler JIT. On sm_80 vLLM's ``flashinfer_sampler_supported()`` is true
  (``v1/sample/ops/topk_topp_sampler.py``; 0.34.0 only adds a ``has_flashinfer()`` test before the
  capability, SM-count and JIT ones, L99-116), and the profile run's top-k/top-p pass makes
  FlashInfer build its ``sampling`` module on every last-stage worker. FlashInfer takes the
  toolkit from ``CUDA_HOME`` / ``CUDA_PATH``, else ``dirname(dirname(which nvcc))``, else
  ``/usr/local/cuda`` (flashinfer ``jit/cpp_ext.py`` ``get_cuda_path``), runs ``ninja``, the host
  compiler ``$CXX`` (default ``c++``) and ``$FLASHINFER_NVCC`` (default ``<cuda>/bin/nvcc``), includes
  ``cuda.h`` / ``curand*.h`` from ``<cuda>/include`` and links ``-L<cuda>/lib64
  -L<cuda>/lib64/stubs -lcudart -lcuda``. ``VLLM_USE_FLASHINFER_SAMPLER=0`` selects vLLM's Triton
  sampler instead (read when the model runner builds its sampler, after the plugin loaded).
- The checkpoint's quantization layout and the methods vLLM's ``DeepseekV4FP8Config`` builds
  for it (``models/deepseek_v4{,1}/quant_config.py``); only the layouts the audit covers are
  accepted.
- vLLM settings that move the serve path off the audited kernels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from .. import envs

SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"

# Headers FlashInfer's sampling sources include from the toolkit (csrc/sampling.cu and
# include/flashinfer/sampling.cuh; cub/cccl come vendored with FlashInfer).
SAMPLER_HEADERS = ("cuda.h", "cuda_runtime.h", "curand.h", "curand_kernel.h", "curand_philox4x32_x.h")
# Where the linker looks for -lcudart / -lcuda besides FlashInfer's -L dirs.
_SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/lib/x86_64-linux-gnu", "/lib64", "/usr/lib",
                    "/usr/local/lib", "/usr/lib/aarch64-linux-gnu", "/usr/lib/wsl/lib")


@dataclass(frozen=True)
class Toolchain:
    """What FlashInfer's JIT would find on this host (paths; None where absent)."""
    cuda_home: Optional[str]
    how: str                       # which of FlashInfer's rules gave cuda_home
    nvcc: Optional[str]            # the nvcc FlashInfer runs, when it exists
    nvcc_release: Optional[str]    # "13.0" from nvcc --version
    missing_headers: Tuple[str, ...]
    ninja: Optional[str]
    cxx: Optional[str]
    cudart: bool                   # libcudart.so where -lcudart looks
    libcuda: bool                  # libcuda.so where -lcuda looks
    jit_cache: bool                # flashinfer-jit-cache (prebuilt modules) installed


def _nvcc_release(nvcc: str) -> Optional[str]:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def read_toolchain(environ: Optional[Mapping[str, str]] = None,
                   which: Callable[[str], Optional[str]] = shutil.which,
                   exists: Callable[[str], bool] = os.path.exists,
                   nvcc_release: Callable[[str], Optional[str]] = _nvcc_release,
                   jit_cache: Optional[bool] = None) -> Toolchain:
    """Apply FlashInfer's own lookup rules to this host (or to the faked ``environ`` / ``which``
    / ``exists`` of a test). Nothing is built."""
    env = os.environ if environ is None else environ
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    how = "CUDA_HOME" if env.get("CUDA_HOME") else "CUDA_PATH" if home else ""
    if not home:
        found = which("nvcc")
        if found:
            home, how = os.path.dirname(os.path.dirname(found)), "nvcc on PATH"  # no realpath, as FlashInfer
        elif exists("/usr/local/cuda"):
            home, how = "/usr/local/cuda", "/usr/local/cuda"
    nvcc = env.get("FLASHINFER_NVCC") or (os.path.join(home, "bin", "nvcc") if home else None)
    if nvcc and not exists(nvcc):
        nvcc = None
    inc = os.path.join(home, "include") if home else None
    missing = tuple(h for h in SAMPLER_HEADERS if not (inc and exists(os.path.join(inc, h))))
    cxx = env.get("CXX", "c++")
    lib_dirs = ([os.path.join(home, "lib64"), os.path.join(home, "lib64", "stubs")] if home else []) \
        + list(_SYSTEM_LIB_DIRS)
    if jit_cache is None:
        import importlib.util

        jit_cache = importlib.util.find_spec("flashinfer_jit_cache") is not None
    return Toolchain(
        cuda_home=home, how=how, nvcc=nvcc, nvcc_release=nvcc_release(nvcc) if nvcc else None,
        missing_headers=missing, ninja=which("ninja"), cxx=which(cxx) if not os.path.isabs(cxx) else
        (cxx if exists(cxx) else None),
        cudart=any(exists(os.path.join(d, n)) for d in lib_dirs for n in ("libcudart.so", "libcudart_static.a")),
        libcuda=any(exists(os.path.join(d, "libcuda.so")) for d in lib_dirs), jit_cache=bool(jit_cache))


def jit_problems(tc: Toolchain, torch_cuda: Optional[str]) -> List[str]:
    """Why FlashInfer's sampling JIT cannot build (and link) here for torch's CUDA; empty: it can.
    An installed flashinfer-jit-cache is not trusted to hold an sm_80 build (not checked)."""
    if tc.cuda_home is None:
        return ["no CUDA toolkit where FlashInfer looks (CUDA_HOME/CUDA_PATH unset, no nvcc on PATH, no "
                "/usr/local/cuda; the pip nvcc in site-packages/nvidia is not found)"]
    out = []
    if tc.nvcc is None:
        out.append(f"no nvcc at {tc.cuda_home}/bin/nvcc (toolkit from {tc.how})")
    elif torch_cuda and tc.nvcc_release and tc.nvcc_release.split(".")[0] != torch_cuda.split(".")[0]:
        out.append(f"nvcc {tc.nvcc_release} at {tc.nvcc} is not torch's CUDA {torch_cuda} major")
    if tc.missing_headers:
        out.append(f"{tc.cuda_home}/include lacks {', '.join(tc.missing_headers)}")
    if not tc.cudart:
        out.append(f"no libcudart.so in {tc.cuda_home}/lib64 or the system lib dirs (-lcudart)")
    if not tc.libcuda:
        out.append(f"no libcuda.so in {tc.cuda_home}/lib64/stubs or the system lib dirs (-lcuda)")
    if tc.ninja is None:
        out.append("no ninja on PATH")
    if tc.cxx is None:
        out.append("no host C++ compiler ($CXX or c++ on PATH)")
    return out


# ------------------------------------------------------------------ quantization layout

# The layouts the audit covers (``dsv4-ops audit-vllm``: vLLM's own selection run as sm_80):
# variant -> (weight block, expert dtype) -> (linear method -> kernel, MoE method -> kernel).
AUDITED_LAYOUTS: Dict[str, Dict[Tuple[Tuple[int, int], str], Tuple[str, str]]] = {
    "v4": {((128, 128), "fp4"): ("Fp8LinearMethod (FP8 block 128x128, e8m0 scales) -> MarlinFP8ScaledMMLinearKernel "
                                 "(W8A16)", "Mxfp4MoEMethod -> MarlinExperts (W4A16)")},
    "v41": {((32, 32), "fp4"): ("ModelOptLinearMethod (MXFP8 block 32x32) -> MarlinMxfp8LinearKernel (W8A16)",
                                "Mxfp4MoEMethod -> MarlinExperts (W4A16)")},
}
_QUANT_METHODS = ("fp8", "deepseek_v4_fp8")  # what DeepseekV4FP8Config claims


@dataclass(frozen=True)
class QuantLayout:
    variant: str
    quant_method: Optional[str]
    weight_block_size: Optional[Tuple[int, int]]
    expert_dtype: str
    moe_quant_algo: str
    linear: str            # the method (and sm_80 kernel) vLLM builds for the linears
    moe: str               # ... for the routed experts
    problem: Optional[str]  # None: a layout the audit covers

    def describe(self) -> str:
        block = "x".join(map(str, self.weight_block_size)) if self.weight_block_size else "none"
        return (f"quant_method {self.quant_method}, weight_block_size {block}, expert_dtype {self.expert_dtype}"
                + (f", moe_quant_algo {self.moe_quant_algo}" if self.moe_quant_algo else ""))


def classify(variant: str, quant_method: Optional[str], weight_block_size, expert_dtype: str,
             moe_quant_algo: str) -> QuantLayout:
    """The methods ``DeepseekV4FP8Config.get_quant_method`` builds for this layout and whether
    the audit covers them (``problem`` None) -- the same rule for a config.json and for
    vLLM's resolved quant config."""
    block = tuple(int(x) for x in weight_block_size) if weight_block_size else None
    algo = (moe_quant_algo or "").upper()
    audited = AUDITED_LAYOUTS.get(variant, {})
    linear = moe = "?"
    problem = None
    if quant_method not in _QUANT_METHODS:
        problem = (f"quant_method {quant_method!r}: vLLM does not build DeepseekV4FP8Config for it, so neither its "
                   "linear nor its MoE methods are audited on sm_80")
    else:
        if variant == "v41" and block == (32, 32) and expert_dtype == "fp4":
            linear = "ModelOptLinearMethod (MXFP8)"
        else:
            linear = f"Fp8LinearMethod (block {'x'.join(map(str, block)) if block else 'none'})"
        if expert_dtype == "fp4":
            moe = "ModelOptNvFp4FusedMoE (NVFP4)" if algo == "NVFP4" else "Mxfp4MoEMethod"
        else:
            moe = "Fp8MoEMethod (FP8 block experts, float32 scales)"
        if algo == "NVFP4":
            problem = ("moe_quant_algo NVFP4: vLLM builds ModelOptNvFp4FusedMoE for the experts, which the audit "
                       "never evaluated on sm_80")
        elif (block, expert_dtype) in audited:
            linear, moe = audited[(block, expert_dtype)]
        else:
            covered = "; ".join(f"block {'x'.join(map(str, b))}, expert_dtype {e}" for b, e in audited) or "none"
            problem = (f"{linear} + {moe}: not a layout the audit covers for {variant} on sm_80 (covered: "
                       f"{covered})")
    return QuantLayout(variant, quant_method, block, expert_dtype, algo, linear, moe, problem)


def layout_of_config(variant: str, text: Mapping) -> QuantLayout:
    """The layout a checkpoint's config.json declares (vLLM's defaults where a field is absent:
    expert_dtype fp4, no moe_quant_algo)."""
    q = text.get("quantization_config") or {}
    return classify(variant, q.get("quant_method"), q.get("weight_block_size"), text.get("expert_dtype", "fp4"),
                    q.get("moe_quant_algo") or "")


# ------------------------------------------------------------------ settings that move kernels

# The kernels on the audited sm_80 path that vLLM's VLLM_DISABLED_KERNELS could switch off.
AUDITED_KERNELS = ("MarlinFP8ScaledMMLinearKernel", "MarlinMxfp8LinearKernel", "EmulationMxfp8LinearKernel",
                   "MarlinExperts")


def kernel_setting_problems(environ: Mapping[str, str], linear_backend: str = "auto", moe_backend: str = "auto",
                            linear_backend_per_quant: Optional[Mapping[str, str]] = None) -> List[str]:
    """vLLM settings that move DeepSeek-V4's linears or experts off the audited sm_80 kernels;
    empty: none set. Each entry says what it does and what to do."""
    out = []
    if environ.get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0"):
        out.append("VLLM_BATCH_INVARIANT=1 makes Marlin FP8 refuse (kernels/linear/scaled_mm/marlin.py), so V4's "
                   "linears fall to Humming (unaudited) or TritonFp8BlockScaledMMKernel (fp8 activations: dead on "
                   f"sm_80); unset it (the plugin's {envs.BATCH_INVARIANT}=1 makes its own kernels "
                   "batch-invariant)")
    if environ.get("VLLM_MARLIN_INPUT_DTYPE"):
        out.append(f"VLLM_MARLIN_INPUT_DTYPE={environ['VLLM_MARLIN_INPUT_DTYPE']} moves Marlin off bf16 activations "
                   "(fp8 raises on sm_80; int8 is unaudited; vLLM 0.34.0 itself rejects the variable at startup, "
                   "'has been removed'); unset it")
    disabled = [k for k in environ.get("VLLM_DISABLED_KERNELS", "").split(",") if k.strip() in AUDITED_KERNELS]
    if disabled:
        out.append(f"VLLM_DISABLED_KERNELS disables {', '.join(disabled)}, on the audited sm_80 path; remove them")
    for flag, value in (("--linear-backend", linear_backend), ("--moe-backend", moe_backend)):
        if value not in ("auto", "marlin", None):
            out.append(f"{flag} {value}: the audit covers only vLLM's automatic choice (Marlin) on sm_80; drop it")
    for quant, value in (linear_backend_per_quant or {}).items():
        if value not in ("auto", "marlin"):
            out.append(f"--linear-backend-per-quant {quant}={value}: not the audited Marlin; drop it")
    return out


def sampler_env_choice(environ: Mapping[str, str]) -> Optional[bool]:
    """VLLM_USE_FLASHINFER_SAMPLER as vLLM reads it (``bool(int(...))``); None: unset."""
    v = environ.get(SAMPLER_ENV)
    if v is None:
        return None
    try:
        return bool(int(v))
    except ValueError:
        return None


__all__ = ["AUDITED_KERNELS", "AUDITED_LAYOUTS", "QuantLayout", "SAMPLER_ENV", "SAMPLER_HEADERS", "Toolchain",
           "classify", "jit_problems", "kernel_setting_problems", "layout_of_config", "read_toolchain",
           "sampler_env_choice"]
