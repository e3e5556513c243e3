"""Audit rows for the serve path outside the DeepSeek model packages: linears, MoE experts,
router and gate, norms and activations, embedding and LM head, sampler, all-reduce, the ViT
tower, and the kernels that run at weight loading.

Each row is decided from one of three kinds of evidence, named in its ``evidence``:

- *selection*: vLLM's own selection code (``choose_scaled_mm_linear_kernel``,
  ``init_mxfp8_linear_kernel``, ``select_deepseek_v4_mxfp4_moe_backend``,
  ``CudaPlatform.get_vit_attn_backend``, the all-reduce capability tables) run with the
  platform answering as an sm_<arch> CUDA GPU; a selection that raises (no kernel for this
  arch) makes the row dead;
- *cubin*: the kernel the selected path launches is present in the sm_<arch> cubins of the
  library that ships it (vLLM's ``_C`` / ``_moe_C`` extensions, cuBLASLt, NCCL, FlashAttention-2;
  ``cuobjdump``), with as many instantiations as any other arch of the same file has; torch's
  own kernels by torch's compiled arch list;
- *traced AOT*: vLLM's Python launcher run on CPU tensors of the serve path's dtypes with
  Triton's compile hook capturing the specialization instead of launching (nothing runs), then
  ``aot.compile_spec`` for ``GPUTarget('cuda', arch, 32)``.

What the selected path is (which op a layer's ``forward_cuda`` calls) was read from vLLM
0.33.0's and 0.34.0's source and is written next to each probe with its file; the status is never written
down, it comes from the evidence.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

from ..serve_graph._scope import since, until
from . import _config, _native
from ._paths import PerRelease

RUNS, DEAD, UNKNOWN = "runs", "dead", "unknown"
_SITE = "site-packages"


# ------------------------------------------------------------------ platform and evidence helpers

@contextlib.contextmanager
def cuda_platform(arch: int):
    """``current_platform`` answers as a CUDA sm_<arch> GPU (capability, platform enum,
    is_cuda, SM count) while vLLM's selection code runs."""
    from vllm.platforms import PlatformEnum

    from ..platform_view import answering

    with _config.target_platform(arch), answering(
            _enum=PlatformEnum.CUDA, is_cuda=lambda: True, is_cuda_alike=lambda: True,
            num_compute_units=lambda device_id=0: _config.SM_COUNT.get(arch, 108),
            device_name=f"sm_{arch}") as cp:
        yield cp


def cubin(lib: str, kernel: str, arch: int) -> Tuple[Optional[bool], str]:
    """Kernel ``kernel`` (unmangled base name, exact) in the sm_<arch> cubins of vLLM's extension
    whose file name starts with ``lib``: True when sm_<arch> has at least as many
    instantiations as any other arch of that file, False when it has none, None in between."""
    sos = [s for s in _native.vllm_sos() if os.path.basename(s).startswith(lib)]
    if not sos:
        return None, f"no vLLM extension named {lib}*"
    so = sos[0]
    count = {a: sum(_native.kernel_base_name(x) == kernel for x in _native.entry_symbols(so, a))
             for a in [int(re.match(r"sm_(\d+)", s).group(1)) for s in _native.elf_archs(so)]}
    here, most = count.get(arch, 0), max(count.values() or [0])
    where = f"{os.path.basename(so)}: {kernel}, {here} sm_{arch} instantiation(s) (most of any arch: {most})"
    if here and here >= most:
        return True, "cubin " + where
    return (False if not here else None), "cubin " + where


def marlin_cubin(lib: str, act: str, weight: str, scale: str, arch: int) -> Tuple[Optional[bool], str]:
    """sm_<arch> instantiations of ``marlin::Marlin`` / ``marlin_moe_wna16::Marlin`` whose first
    four template arguments (vLLM ScalarType ids: activation, weight, output, scale types;
    csrc/quantization/marlin) are (act, weight, act, scale): the exact kernel the layer's types
    launch, not just the template name."""
    from vllm.scalar_type import scalar_types

    want = tuple(getattr(scalar_types, t).id for t in (act, weight, act, scale))
    sos = [x for x in _native.vllm_sos() if os.path.basename(x).startswith(lib)]
    if not sos:
        return None, f"no vLLM extension named {lib}*"
    n = sum(1 for x in _native.entry_symbols(sos[0], arch) if _native.kernel_base_name(x) == "Marlin"
            and tuple(int(v) for v in re.findall(r"Ll(\d+)E", x)[:4]) == want)
    return n > 0, (f"cubin {os.path.basename(sos[0])}: Marlin<{act}, {weight}, {act}, {scale}> "
                   f"{n} sm_{arch} instantiation(s)")


def library_cubins(path: str, arch: int) -> Tuple[Optional[bool], str]:
    """Whether the shared library ``path`` (a CUDA library of the wheel set) holds sm_<arch> cubins."""
    if not os.path.exists(path):
        return None, f"{path} not found"
    archs = _native.elf_archs(path)
    ok = any(a.startswith(f"sm_{arch}") for a in archs)
    return ok, f"cubin {os.path.basename(path)} arches {' '.join(archs)}"


def torch_cuda_arch(arch: int) -> Tuple[Optional[bool], str]:
    """torch's own CUDA kernels (F.embedding, torch.mm/F.linear dispatch): torch's compiled arch list."""
    import torch

    flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
    if not flags:
        return None, f"torch {torch.__version__} has no CUDA arch list (a CPU build)"
    return f"sm_{arch}" in flags.split(), f"torch {torch.__version__} compiled for {flags}"


def nvidia_lib(sub: str, name: str) -> str:
    import site

    for base in site.getsitepackages():
        for cand in (os.path.join(base, "nvidia", "cu13", "lib", name), os.path.join(base, "nvidia", sub, "lib", name)):
            if os.path.exists(cand):
                return cand
    return name


def trace_specs(call: Callable[[], object]):
    """KernelSpecs of every Triton launch ``call`` makes (captured by Triton's jit_cache_hook,
    which skips compile and launch): vLLM's own launcher decides dtypes and constexprs."""
    from triton import knobs

    from ... import aot

    specs = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        sig = dict(compile["signature"])
        consts = {(list(sig)[p[0]] if isinstance(p, tuple) else p): v for p, v in compile["constants"].items()}
        specs.append(aot.KernelSpec(fn.name, fn.name, fn.jit_function, sig, consts, "vllm",
                                    compile["num_warps"], compile["num_stages"]))
        return True

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        call()
    finally:
        knobs.runtime.jit_cache_hook = old
    return specs


def traced_aot(call: Callable[[], object], arch: int) -> Tuple[Optional[bool], str]:
    from ... import aot

    try:
        specs = trace_specs(call)
    except Exception as exc:  # noqa: BLE001 - the launcher did not get to a launch
        return None, f"traced launch failed: {type(exc).__name__}: {str(exc)[:160]}"
    if not specs:
        return None, "traced launch made no Triton launch"
    names, bad = [], []
    for s in specs:
        r = aot.compile_spec(s, arch)
        names.append(s.kernel.fn.__name__)
        if not r.ok:
            bad.append(f"{s.kernel.fn.__name__}: {(r.error or '')[:160]}")
    if bad:
        return False, f"traced launch, AOT sm_{arch} fails: " + "; ".join(bad)
    return True, f"traced launch, AOT sm_{arch} ok: {', '.join(sorted(set(names)))} ({len(specs)} specialization(s))"


def _row(model, phase, kernel, tech, location, got, evidence_prefix="", patch=""):
    ok, ev = got
    status = {True: RUNS, False: DEAD, None: UNKNOWN}[ok]
    return dict(model=model, path="default", phase=phase, kernel=kernel, tech=tech, location=location,
                status=status, evidence=(evidence_prefix + ev)[:900], patch=patch)


def _both(*parts: Tuple[Optional[bool], str]) -> Tuple[Optional[bool], str]:
    """All parts must hold: False if any is False, None if any is None, else True."""
    oks = [p[0] for p in parts]
    ok = False if False in oks else (None if None in oks else True)
    return ok, "; ".join(p[1] for p in parts)


# ------------------------------------------------------------------ linears

# The kernel each selectable linear class launches on CUDA (read from vLLM 0.33.0 and 0.34.0):
# scaled_mm/marlin.py and mxfp8/marlin.py -> ops.marlin_gemm (torch.ops._C.marlin_gemm, C++ template
# marlin::Marlin); mxfp8/emulation.py -> dequantize to bf16 at load, torch matmul (cuBLAS).
_LINEAR_KERNELS = {
    # FP8 weight-only Marlin: bf16 activations, e4m3 weights, bf16 (channel/group) scales
    "MarlinFP8ScaledMMLinearKernel": ("Marlin C++ _C", lambda a: marlin_cubin(
        "_C_stable", "bfloat16", "float8_e4m3fn", "bfloat16", a)),
    # MXFP8 weight-only Marlin: UE8M0 (e8m0) block-32 scales
    "MarlinMxfp8LinearKernel": ("Marlin C++ _C", lambda a: marlin_cubin(
        "_C_stable", "bfloat16", "float8_e4m3fn", "float8_e8m0fnu", a)),
    "EmulationMxfp8LinearKernel": ("torch/cuBLAS", lambda a: _both(torch_cuda_arch(a), library_cubins(
        nvidia_lib("cublas", "libcublasLt.so.13"), a))),
}


# A candidate whose own check calls a C++ op of vLLM's extension (not loadable without a CUDA
# driver) is decided by whether that extension holds the kernel family for the arch: the first
# template name its launches instantiate (cuobjdump, any instantiation).
_CPP_GATED = {"CutlassFp8BlockScaledMMKernel": ("_C_stable", "cutlass_3x_gemm_fp8_blockwise")}


def family_cubin(lib: str, needle: str, arch: int) -> Tuple[Optional[bool], str]:
    """Whether any sm_<arch> kernel symbol of vLLM's ``lib`` extension contains ``needle``."""
    sos = [x for x in _native.vllm_sos() if os.path.basename(x).startswith(lib)]
    if not sos:
        return None, f"no vLLM extension named {lib}*"
    per = {a: sum(needle in x for x in _native.entry_symbols(sos[0], int(a[3:5])))
           for a in _native.elf_archs(sos[0]) if re.fullmatch(r"sm_\d+", a)}
    here = per.get(f"sm_{arch}", 0)
    return (here > 0 if here or any(per.values()) else None), (
        f"cubin {os.path.basename(sos[0])}: {needle} instantiations per arch {per}")


def first_supported(candidates, check, arch: int):
    """vLLM's order: the first candidate whose own check passes. A check that raises for want
    of the CUDA driver falls back to _CPP_GATED's cubin reading; otherwise selection stops
    undecided (None). Returns (chosen class name or None, notes)."""
    notes = []
    for k in candidates:
        try:
            ok, why = check(k)
        except Exception as exc:  # noqa: BLE001
            gate = _CPP_GATED.get(k.__name__)
            if gate is None:
                notes.append(f"{k.__name__}: check not evaluable here ({type(exc).__name__}: {str(exc)[:100]})")
                return None, notes
            ok, why = family_cubin(gate[0], gate[1], arch)
            why = f"its check calls a C++ op (no CUDA driver here); {why}"
            if ok is None:
                notes.append(f"{k.__name__}: {why}")
                return None, notes
        if ok:
            return k.__name__, notes
        notes.append(f"{k.__name__}: {str(why).strip()[:90]}")
    return "", notes


def _select_fp8_block(arch: int):
    import torch
    from vllm.model_executor.kernels import linear as L
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, create_fp8_quant_key
    from vllm.platforms import PlatformEnum

    # Fp8LinearMethod.__init__ (quantization/fp8.py) with weight_block_size [128, 128], dynamic activations
    cfg = L.FP8ScaledMMLinearLayerConfig(
        weight_quant_key=create_fp8_quant_key(static=True, group_shape=GroupShape(128, 128)),
        activation_quant_key=create_fp8_quant_key(static=False, group_shape=GroupShape(1, 128)),
        input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(4096, 1024))
    return first_supported(L._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA],
                           lambda k: L.is_supported_and_can_implement_kernel(k, cfg, None), arch)


def _select_mxfp8(arch: int, bmm: Optional[int] = None):
    from vllm.model_executor.kernels import linear as L

    kernel = L.init_mxfp8_linear_kernel(weight_shape=(5120, 4096), bmm_batch_size=bmm)
    return type(kernel).__name__, []


def linear_rows(model: str, arch: int) -> List[dict]:
    out = []
    fp8 = {"v4": "DeepseekV4FP8Config -> Fp8LinearMethod", "v32": "Fp8Config, the checkpoint's block FP8",
           "glm5": "Fp8Config, GLM-5-FP8's block FP8"}
    probes = ([(f"fp8 block [128,128] ({fp8[model]})", lambda: _select_fp8_block(arch),
                "me.kernels.linear:choose_scaled_mm_linear_kernel (_POSSIBLE_FP8_BLOCK_KERNELS)", "")]
              if model in fp8 else
              [("MXFP8 [32,32] UE8M0 (ModelOptLinearMethod)", lambda: _select_mxfp8(arch),
                "me.kernels.linear:init_mxfp8_linear_kernel (_POSSIBLE_MXFP8_KERNELS)", ""),
               ("MXFP8 wo_a (is_bmm, re-selected in process_weights_after_loading)", lambda: _select_mxfp8(arch, 8),
                "me.layers.quantization.modelopt:ModelOptLinearMethod.process_weights_after_loading",
                "dsv4_ops.vllm.o_proj.install_wo_a_bf16_hook (the Ampere _o_proj reads the bf16 copy)")])
    for what, select, loc, patch in probes:
        try:
            with cuda_platform(arch):
                name, rejected = select()
        except Exception as exc:  # noqa: BLE001 - no kernel for this arch: the selection raises
            out.append(_row(model, "forward", f"linear:{what}", "selection", loc,
                            (False, f"selection for sm_{arch} raises {type(exc).__name__}: {str(exc)[:300]}")))
            continue
        if not name:
            out.append(_row(model, "forward", f"linear:{what}", "selection", loc,
                            (False if name == "" else None, f"no candidate for sm_{arch}: {'; '.join(rejected)[:600]}")))
            continue
        tech, evidence = _LINEAR_KERNELS.get(name, ("?", lambda a: (None, f"{name}: no evidence rule")))
        got = evidence(arch)
        pre = f"selection (vLLM's own code, sm_{arch}): {name}" + (
            f" (rejected: {'; '.join(rejected)[:640]})" if rejected else "") + "; "
        out.append(_row(model, "forward", f"linear:{what} -> {name}", tech, loc, got, pre, patch))
    return out


# ------------------------------------------------------------------ MoE: experts, router, gate

def _v4_moe_config(model: str):
    """A FusedMoEConfig as DeepseekV4MoE builds it (256 experts, top-6, DeepseekV4 routing, fp32
    router logits, the parallel config without EP; hash routing on V4)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)

    return FusedMoEConfig(num_experts=256, experts_per_token=6, hidden_dim=4096 if model == "v4" else 5120,
                          intermediate_size=2048, num_local_experts=256, num_logical_experts=256,
                          activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.DeepseekV4,
                          moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
                          router_logits_dtype=torch.float32, swiglu_limit=10.0, has_hash_routing=model == "v4")


def _select_moe(model: str, arch: int):
    """select_deepseek_v4_mxfp4_moe_backend's auto path (oracle/mxfp4.py): the priority backends in
    order, each backend's expert classes' own is_supported_config(..., kMxfp4Static, the backend's
    activation key, Standard format); a FusedMoEConfig as DeepseekV4MoE builds it (256 experts,
    top-6, DeepseekV4 routing, fp32 router logits; the parallel config without EP)."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as O
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static

    cfg = _v4_moe_config(model)
    pairs = [(b, k) for b in O._get_priority_backends() for k in O.backend_to_kernel_cls(b)]
    by_cls = {}

    def check(k):
        b = by_cls[k]
        return k.is_supported_config(k, cfg, kMxfp4Static, O._backend_activation_key(b),
                                     mk.FusedMoEActivationFormat.Standard)

    classes = []
    for b, k in pairs:
        by_cls.setdefault(k, b)
        classes.append(k)
    name, notes = first_supported(classes, check, arch)
    if name:
        k = next(c for c in classes if c.__name__ == name)
        name = f"{by_cls[k].name} ({name})"
    return name, notes


V32_FAMILY = ("v32", "glm5")
# DeepseekV2MoE (deepseek_v2.py) as V3.2 / GLM-5 build it: experts, top-k, hidden, n_group/topk_group
_V32_MOE = {"v32": (256, 8, 7168, 8, 4), "glm5": (256, 8, 6144, 1, 1)}


def _select_fp8_moe(model: str, arch: int):
    """select_fp8_moe_backend's auto path (oracle/fp8.py) for block-FP8 experts
    (kFp8Static128BlockSym weights, kFp8Dynamic128Sym activations, what Fp8MoEMethod passes for
    weight_block_size [128, 128]), run by vLLM's own function with the platform answering as
    sm_<arch>; a FusedMoEConfig as DeepseekV2MoE builds it (DeepSeekV3 grouped routing)."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as O
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym

    e, k, hidden, _g, _tg = _V32_MOE[model]
    cfg = FusedMoEConfig(num_experts=e, experts_per_token=k, hidden_dim=hidden, intermediate_size=2048,
                         num_local_experts=e, num_logical_experts=e, activation=MoEActivation.SILU,
                         device="cpu", routing_method=RoutingMethodType.DeepSeekV3,
                         moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        backend, cls = O.select_fp8_moe_backend(cfg, kFp8Static128BlockSym, kFp8Dynamic128Sym)
    return f"{backend.name} ({cls.__name__ if cls else None})", []


def _v32_moe_rows(model: str, arch: int) -> List[dict]:
    out = []
    loc = "me.layers.fused_moe.oracle.fp8:select_fp8_moe_backend"
    try:
        with cuda_platform(arch):
            name, notes = _select_fp8_moe(model, arch)
        # MarlinExperts with FP8 weights (experts/marlin_moe.py, W8A16) -> marlin_moe_wna16::Marlin<bf16, e4m3, ...>
        got = (marlin_cubin("_moe_C", "bfloat16", "float8_e4m3fn", "bfloat16", arch) if "MARLIN" in name
               else (None, f"{name}: no evidence rule"))
        out.append(_row(model, "forward", f"moe experts: block FP8 -> {name}", "Marlin C++ _moe_C", loc, got,
                        f"selection (vLLM's select_fp8_moe_backend, sm_{arch}): {name}; "))
    except Exception as exc:  # noqa: BLE001 - no backend for this arch: the selection raises
        out.append(_row(model, "forward", "moe experts: block FP8", "selection", loc,
                        (False, f"selection for sm_{arch} raises {type(exc).__name__}: {str(exc)[:300]}")))
    # Router (router/grouped_topk_router.py): use_grouped_topk with e_score_correction_bias, n_group <= 32,
    # top-k <= 32 and VLLM_USE_FUSED_MOE_GROUPED_TOPK (default 1) -> fused_grouped_topk -> ops.grouped_topk
    # (_moe_C); its grouped and single-group kernels must all be there.
    _e, _k, _h, g, tg = _V32_MOE[model]
    out.append(_row(model, "forward", f"router: grouped_topk (sigmoid + bias, n_group {g}, topk_group {tg})",
                    "C++ _moe_C", "me.layers.fused_moe.router.grouped_topk_router:fused_grouped_topk",
                    _both(*(cubin("_moe_C", n, arch) for n in (
                        "grouped_topk_fused_kernel", "grouped_topk_fused_small_expert_count_kernel",
                        "single_group_topk_warp_kernel", "single_group_topk_block_kernel")))))
    gate = _gate_tier(arch)
    out.append(_row(model, "forward", f"gate: GateLinear -> {gate[0]}", "torch/cuBLAS",
                    "me.layers.fused_moe.router.gate_linear:GateLinear.forward",
                    _both((gate[1], gate[2]), torch_cuda_arch(arch),
                          library_cubins(nvidia_lib("cublas", "libcublasLt.so.13"), arch))))
    return out


def moe_rows(model: str, arch: int) -> List[dict]:
    import torch

    if model in V32_FAMILY:
        return _v32_moe_rows(model, arch)
    out = []
    loc = "me.layers.fused_moe.oracle.mxfp4:select_deepseek_v4_mxfp4_moe_backend"
    try:
        with cuda_platform(arch):
            name, notes = _select_moe(model, arch)
        # MarlinExperts (experts/marlin_moe.py) -> ops.moe_wna16_marlin_gemm (marlin_moe_wna16::Marlin)
        if not name:
            got = (False if name == "" else None, "no backend: " + "; ".join(notes)[:600])
        else:
            got = (marlin_cubin("_moe_C", "bfloat16", "float4_e2m1f", "float8_e8m0fnu", arch) if "MARLIN" in name
                   else (None, f"{name}: no evidence rule"))
        out.append(_row(model, "forward", f"moe experts: MXFP4 -> {name or 'none'}", "Marlin C++ _moe_C", loc, got,
                        f"selection (vLLM's own candidate checks in order, sm_{arch}): {name}"
                        f"{' (rejected: ' + '; '.join(notes)[:400] + ')' if name else ''}; "))
    except Exception as exc:  # noqa: BLE001
        out.append(_row(model, "forward", "moe experts: MXFP4", "selection", loc,
                        (False, f"selection for sm_{arch} raises {type(exc).__name__}: {str(exc)[:300]}")))

    # Router: dsv4_topk (fused_moe/router/dsv4_topk.py, chosen by can_use_dsv4_topk for fp32 logits
    # [T, 256] with a correction bias); V4.1's VL routing passes input_ids + bias_vl.
    import importlib

    def route():
        mod = importlib.import_module("vllm.model_executor.layers.fused_moe.router.dsv4_topk")
        if not hasattr(mod, "_dsv4_topk_kernel"):  # defined under `if current_platform.is_cuda()`
            mod = importlib.reload(mod)
        dsv4_topk = mod.dsv4_topk
        t, e = 4, 256
        dsv4_topk(torch.zeros(t, e), torch.zeros(e), torch.int32, 1.5)
        dsv4_topk(torch.zeros(t, e), torch.zeros(e), torch.int32, 1.5, is_padding=torch.zeros(t, dtype=torch.bool))
        if model == "v41":
            dsv4_topk(torch.zeros(t, e), torch.zeros(e), torch.int32, 1.5, input_ids=torch.zeros(t, dtype=torch.int64),
                      bias_vl=torch.zeros(e), image_sentinel_lo=1000)

    with cuda_platform(arch):
        out.append(_row(model, "forward", "router: dsv4_topk (sqrtsoftplus top-6)", "Triton",
                        "me.layers.fused_moe.router.dsv4_topk:dsv4_topk", traced_aot(route, arch)))
    if model == "v4":  # hash layers (mlp_layer_types 'hash_moe'): ops.topk_hash_softplus_sqrt
        out.append(_row(model, "forward", "router: hash layers (topk_hash_softplus_sqrt)", "C++ _moe_C",
                        "me.layers.fused_moe.router.fused_topk_bias_router", cubin("_moe_C", "dsv4HashTopkSoftplusSqrt", arch)))
    # Gate: GateLinear (fused_moe/router/gate_linear.py): the cuteDSL / fp32 specialized tiers need
    # sm_90/sm_100 (is_hopper / is_blackwell); tier 6 is torch.mm(bf16, out_dtype=fp32) on cuBLAS.
    gate = _gate_tier(arch)
    out.append(_row(model, "forward", f"gate: GateLinear -> {gate[0]}", "torch/cuBLAS",
                    "me.layers.fused_moe.router.gate_linear:GateLinear.forward",
                    _both((gate[1], gate[2]), torch_cuda_arch(arch),
                          library_cubins(nvidia_lib("cublas", "libcublasLt.so.13"), arch))))
    return out


# fused_moe/router/gate_linear.py: every tier before cuBLAS needs sm_90/sm_100 (is_hopper / is_blackwell)
_GATE_GUARDS = (
    r"can_use_specialized_kernels = \(\s*current_platform\.is_cuda\(\)\s*and \(is_hopper or is_blackwell\)",
    r"is_hopper = current_platform\.is_device_capability\(\(9, 0\)\)",
    r"is_blackwell = current_platform\.is_device_capability_family\(100\)",
    r"current_platform\.is_cuda\(\)\s*and \(is_hopper or is_blackwell\)\s*and \(input_size, output_size\) in",
    r"self\.allow_ll_bf16_gemm = False\s*self\.allow_ll_fp32w_gemm = False\s*if can_use_specialized_kernels:",
    r"self\.allow_rocm_bf16x3_router_gemm = \(\s*self\._rocm_bf16x3_weight_eligible",
    # the bf16x3 tier: SM100 only in 0.33, SM90 or SM100 from 0.34
    PerRelease(((until("0.33.0"), r"and current_platform\.is_cuda\(\)\s*and is_blackwell\s*and input_size % 8 == 0"),
                (since("0.34.0"), r"and current_platform\.is_cuda\(\)\s*and \(is_hopper or is_blackwell\)\s*"
                                  r"and input_size % 8 == 0"))),
    r"self\.allow_cublas_router_gemm = \(\s*self\._router_gemm_cublas_capable\s*and self\.weight\.dtype == torch\.bfloat16",
    r"output = torch\.mm\(x, self\.weight\.T, out_dtype=torch\.float32\)",
)


def _gate_tier(arch: int) -> Tuple[str, Optional[bool], str]:
    """GateLinear's tier on sm_<arch>: its specialized tiers (cuteDSL, fp32 router GEMM, bf16x3) are
    guarded by is_hopper / is_blackwell, so below sm_90 the bf16 gate takes tier 6, torch.mm with
    out_dtype fp32 (cuBLAS). Read from the source (the guards must still be there)."""
    from ..serve_graph import _source

    path = _source.module_path("vllm.model_executor.layers.fused_moe.router.gate_linear")
    text = open(path).read() if path else ""
    missing = [g for g in (p.pick() if isinstance(p, PerRelease) else p for p in _GATE_GUARDS)
               if not re.search(g, text)]
    if missing or arch >= 90:
        return "?", None, f"GateLinear guards not as recorded (re-read gate_linear.py): {missing[:1]}"
    return ("torch.mm bf16 -> fp32 (cuBLAS)", True,
            "source guards (gate_linear.py): specialized tiers need is_hopper/is_blackwell; tier 6 torch.mm")


# ------------------------------------------------------------------ norms, activations, embedding, LM head

def layer_op_rows(model: str, arch: int) -> List[dict]:
    cublas = nvidia_lib("cublas", "libcublasLt.so.13")
    rows = [
        # RMSNorm.forward_cuda (layers/layernorm.py) -> ops.rms_norm / ops.fused_add_rms_norm
        ("norm: RMSNorm (rms_norm)", "C++ _C", "me.layers.layernorm:RMSNorm.forward_cuda",
         cubin("_C_stable", "rms_norm_kernel", arch)),
        ("norm: RMSNorm residual (fused_add_rms_norm)", "C++ _C", "me.layers.layernorm:RMSNorm.forward_cuda",
         cubin("_C_stable", "fused_add_rms_norm_kernel", arch)),
        # SiluAndMulWithClamp (shared experts, activation.py:207) -> torch.ops._C.silu_and_mul_with_clamp,
        # the act_and_mul_kernel_with_param template (csrc/activation_kernels.cu)
        (("activation: SiluAndMul (dense MLP, shared experts)", "C++ _C", "me.layers.activation:SiluAndMul",
          cubin("_C_stable", "act_and_mul_kernel", arch)) if model in V32_FAMILY else
         ("activation: SiluAndMulWithClamp (shared experts)", "C++ _C", "me.layers.activation:SiluAndMulWithClamp",
          cubin("_C_stable", "act_and_mul_kernel_with_param", arch))),
        # VocabParallelEmbedding (vocab_parallel_embedding.py:86): F.embedding on the shard (+ mask ops)
        ("embedding: VocabParallelEmbedding (F.embedding)", "torch", "me.layers.vocab_parallel_embedding",
         torch_cuda_arch(arch)),
        # ParallelLMHead: UnquantizedEmbeddingMethod.apply -> F.linear (cuBLASLt bf16)
        ("lm head: ParallelLMHead (F.linear bf16)", "torch/cuBLAS", "me.layers.vocab_parallel_embedding",
         _both(torch_cuda_arch(arch), library_cubins(cublas, arch))),
        # attention/indexer projections kept bf16 (weights_proj, compressor kv/score torch.mm fp32 out)
        ("linear: unquantized bf16 (ReplicatedLinear, torch.mm out_dtype fp32)", "torch/cuBLAS",
         "me.layers.linear:UnquantizedLinearMethod.apply", _both(torch_cuda_arch(arch), library_cubins(cublas, arch))),
    ]
    return [_row(model, "forward", k, t, loc, got) for k, t, loc, got in rows]


# ------------------------------------------------------------------ sampler

def sampler_rows(model: str, arch: int) -> List[dict]:
    """V2 model runner sampler (v1/worker/gpu/sample/sampler.py): top-k/top-p masking
    (apply_top_k_top_p -> Triton) then Gumbel sampling (Triton); FlashInfer's fused sampler when
    flashinfer_sampler_supported() (capability gate of FlashInferBackend, FlashInfer JIT)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    b, v = 4, 129280

    def gumbel():
        for temp in (True, False):
            gumbel_sample(torch.zeros(b, v), torch.zeros(b, dtype=torch.int32), torch.ones(8),
                          torch.zeros(8, dtype=torch.int64), torch.zeros(b, dtype=torch.int64),
                          apply_temperature=temp, is_drafting=False)

    def topk():
        apply_top_k_top_p(torch.zeros(b, v), torch.full((b,), 50, dtype=torch.int32), torch.full((b,), 0.9),
                          has_topp_only_rows=False)

    out = []
    with cuda_platform(arch):
        out.append(_row(model, "forward", "sampler: gumbel_sample", "Triton",
                        "v1.worker.gpu.sample.gumbel:gumbel_sample", traced_aot(gumbel, arch)))
        out.append(_row(model, "forward", "sampler: apply_top_k_top_p", "Triton",
                        "v1.sample.ops.topk_topp_sampler:apply_top_k_top_p", traced_aot(topk, arch)))
        try:
            from vllm.v1.attention.backends.flashinfer import FlashInferBackend
            from vllm.platforms.interface import DeviceCapability

            fi = FlashInferBackend.supports_compute_capability(DeviceCapability(arch // 10, arch % 10))
            fi_ev = (f"selection: FlashInferBackend.supports_compute_capability(sm_{arch}) = {fi} "
                     "(flashinfer_sampler_supported's gate); ")
        except Exception as exc:  # noqa: BLE001
            fi, fi_ev = None, f"FlashInfer gate not evaluated: {type(exc).__name__}: {exc}; "
    out.append(_row(model, "forward", "sampler: FlashInfer top-k/top-p (fused, when eligible)", "FlashInfer JIT",
                    "v1.sample.ops.topk_topp_sampler:flashinfer_sampler_supported", flashinfer_sampling(arch, fi),
                    fi_ev))
    return out


def flashinfer_sampling(arch: int, gate: Optional[bool]) -> Tuple[Optional[bool], str]:
    """FlashInfer's sampling module built for sm_<arch> by FlashInfer's own JIT (nvcc), when the
    result of a build is cached under DSV4_OPS_CACHE (``_flashinfer.py`` builds it)."""
    from . import _flashinfer

    if gate is False:
        return True, "not selected on this arch (vLLM falls back to the Triton top-k/top-p + Gumbel rows)"
    return _flashinfer.sampling_module(arch)


# ------------------------------------------------------------------ all-reduce

def _fi_allreduce_budget(arch: int) -> Dict[int, float]:
    """PassConfig.default_fi_allreduce_fusion_max_size_mb() for sm_<arch>, from source (its module
    imports vLLM's CUDA extension): FI_ALLREDUCE_FUSION_MAX_SIZE_MB (a literal in
    compilation/passes/fusion/allreduce_rms_fusion.py) looked up by capability.to_int(), as
    config/compilation.py does; raises when either source no longer says so."""
    import ast

    from ..serve_graph import _source

    cfg = open(_source.module_path("vllm.config.compilation")).read()
    if "return FI_ALLREDUCE_FUSION_MAX_SIZE_MB.get(capability.to_int(), {})" not in cfg:
        raise RuntimeError("default_fi_allreduce_fusion_max_size_mb no longer looks the table up by capability")
    tree = ast.parse(open(_source.module_path("vllm.compilation.passes.fusion.allreduce_rms_fusion")).read())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "FI_ALLREDUCE_FUSION_MAX_SIZE_MB":
            return ast.literal_eval(node.value).get(arch, {})
    raise RuntimeError("FI_ALLREDUCE_FUSION_MAX_SIZE_MB not found")


def allreduce_rows(model: str, arch: int) -> List[dict]:
    """CudaCommunicator.all_reduce (distributed/device_communicators/cuda_communicator.py): torch
    symm-mem / FlashInfer when their capability tables name this arch, then vLLM's custom
    all-reduce (cross_device_reduce_{1,2}stage), then NCCL."""
    out = []
    try:
        from vllm.distributed.device_communicators.all_reduce_utils import SYMM_MEM_ALL_REDUCE_MAX_SIZES

        cap = f"{arch // 10}.{arch % 10}"
        sym = cap in SYMM_MEM_ALL_REDUCE_MAX_SIZES
        row = _row(model, "forward", "all-reduce: torch symm-mem", "torch symm-mem",
                   "distributed.device_communicators.symm_mem:SymmMemCommunicator",
                   (True, f"selection: SYMM_MEM_ALL_REDUCE_MAX_SIZES has {sorted(SYMM_MEM_ALL_REDUCE_MAX_SIZES)}; "
                          f"sm_{arch} {'listed' if sym else 'not listed: the communicator disables itself, '}"
                          f"{'' if sym else 'custom all-reduce / NCCL carry the reduction'}"))
        if not sym:  # not selected on this arch: a capability table read from vLLM, like a guard
            row["status"] = "off"
            row["evidence"] = "not reached on sm_8x: " + row["evidence"]
        out.append(row)
    except Exception as exc:  # noqa: BLE001
        out.append(_row(model, "forward", "all-reduce: torch symm-mem", "torch symm-mem",
                        "distributed.device_communicators.symm_mem", (None, f"table not read: {exc}")))
    out.append(_row(model, "forward", "all-reduce: custom all-reduce (1-stage / 2-stage)", "C++ _C",
                    "distributed.device_communicators.custom_all_reduce:CustomAllreduce",
                    _both(cubin("_C_stable", "cross_device_reduce_1stage", arch),
                          cubin("_C_stable", "cross_device_reduce_2stage", arch))))
    if model in V32_FAMILY:
        # DeepseekV32DecoderLayer fuses the MLP's un-reduced output into the next norm:
        # models/common/ops/fused_allreduce_rms_norm.py takes FlashInfer's TRT-LLM all-reduce + RMSNorm only
        # when _max_token_num finds a budget in PassConfig.default_fi_allreduce_fusion_max_size_mb() (keyed by
        # capability), else tensor_model_parallel_all_reduce + RMSNorm (the rows above / below)
        loc = "models.common.ops.fused_allreduce_rms_norm:fused_allreduce_rms_norm"
        try:
            table = _fi_allreduce_budget(arch)
            row = _row(model, "forward", "all-reduce + RMSNorm: FlashInfer TRT-LLM fusion", "FlashInfer", loc,
                       (None, f"selection: default_fi_allreduce_fusion_max_size_mb() at sm_{arch} = {table}"))
            if not table.get(8):
                row["status"] = "off"
                row["evidence"] = (f"not reached on sm_8x: selection: default_fi_allreduce_fusion_max_size_mb() at "
                                   f"sm_{arch} = {table} (no TP-8 budget): the unfused all-reduce + RMSNorm runs")
            out.append(row)
        except Exception as exc:  # noqa: BLE001
            out.append(_row(model, "forward", "all-reduce + RMSNorm: FlashInfer TRT-LLM fusion", "FlashInfer", loc,
                            (None, f"selection not evaluated: {type(exc).__name__}: {str(exc)[:200]}")))
    out.append(_row(model, "forward", "all-reduce / all-gather: NCCL (pynccl)", "NCCL",
                    "distributed.device_communicators.pynccl:PyNcclCommunicator",
                    library_cubins(nvidia_lib("nccl", "libnccl.so.2"), arch)))
    return out


# ------------------------------------------------------------------ ViT tower (V4.1's registered class)

def vit_rows(model: str, arch: int) -> List[dict]:
    """DeepseekV41ForCausalLM builds DeepseekV4ViT (models/deepseek_v4/common/vision.py):
    MMEncoderAttention picks its backend through CudaPlatform.get_vit_attn_backend; MLP
    SiluAndMul; linears unquantized bf16 (cuBLAS); its RMSNorm is torch."""
    if model != "v41":
        return []
    import sys
    import types

    import torch
    from vllm.platforms.interface import DeviceCapability

    stub = ""
    try:
        from vllm.platforms.cuda import CudaPlatform
    except ImportError as exc:  # it imports vllm._C_stable_libtorch (op registration), which needs libcuda
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        from vllm.platforms.cuda import CudaPlatform

        stub = f" (vllm.platforms.cuda imported with its extension stubbed here: {str(exc)[:80]})"

    cap = DeviceCapability(arch // 10, arch % 10)

    class _Target(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return cap

    out = []
    picked = {}
    for head in (64, 128):  # the checkpoint's vision head size is not read here; both usual sizes
        try:  # the platform class answers the capability; backend modules import as on any host
            picked[head] = _Target.get_vit_attn_backend(head, torch.bfloat16)
        except Exception as exc:  # noqa: BLE001
            picked[head] = exc
    names = {h: getattr(b, "name", repr(b)) for h, b in picked.items()}
    if all(n == "FLASH_ATTN" for n in names.values()):
        got = _fa2(arch)
    elif all(n == "TORCH_SDPA" for n in names.values()):
        got = torch_cuda_arch(arch)
    else:
        got = (None, "no evidence rule for this backend")
    out.append(_row(model, "forward", f"vit attention: MMEncoderAttention -> {'/'.join(sorted(set(names.values())))}",
                    "FlashAttention-2", "me.layers.attention.mm_encoder_attention", got,
                    f"selection: CudaPlatform.get_vit_attn_backend at sm_{arch}, bf16, head {names}{stub}; "))
    cublas = nvidia_lib("cublas", "libcublasLt.so.13")
    out.append(_row(model, "forward", "vit: linears (unquantized bf16) + aligner", "torch/cuBLAS",
                    "models.deepseek_v4.common.vision:DeepseekV4ViT",
                    _both(torch_cuda_arch(arch), library_cubins(cublas, arch))))
    out.append(_row(model, "forward", "vit: MLP SiluAndMul (act_and_mul_kernel)", "C++ _C",
                    "models.deepseek_v4.common.vision:DeepseekV4VisionMLP", cubin("_C_stable", "act_and_mul_kernel", arch)))
    return out


def _fa2(arch: int) -> Tuple[Optional[bool], str]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    so = os.path.join(os.path.dirname(spec.origin), "vllm_flash_attn", "_vllm_fa2_C.abi3.so")
    return library_cubins(so, arch)


# ------------------------------------------------------------------ weight loading

def weight_load_rows(model: str, arch: int) -> List[dict]:
    """process_weights_after_loading: Marlin repacks the FP8 / MXFP8 linear weights
    (marlin_utils_fp8.prepare_fp8_layer_for_marlin / mxfp8 prepare -> ops.gptq_marlin_repack) and
    the MXFP4 experts (prepare_moe_mxfp4_layer_for_marlin -> ops.gptq_marlin_repack); scale
    permutes are torch. The plugin's wo_a hook dequantizes in torch before the repack."""
    out = [_row(model, "weight-load", "repack: gptq_marlin_repack (Marlin linears and MXFP4 experts)", "C++ _C",
                "me.layers.quantization.utils.marlin_utils_fp8:prepare_fp8_layer_for_marlin",
                cubin("_C_stable", "gptq_marlin_repack_kernel", arch)),
           _row(model, "weight-load", "repack: marlin_permute_scales / UE8M0 scale conversion (torch)", "torch",
                "me.layers.quantization.utils.marlin_utils", torch_cuda_arch(arch)),
           _row(model, "weight-load", "wo_a: dequantize to bf16 [G, R, K] before the repack", "torch",
                "dsv4_ops.vllm.o_proj:install_wo_a_bf16_hook", torch_cuda_arch(arch),
                patch="dsv4_ops.vllm.o_proj.install_wo_a_bf16_hook")]
    if model in V32_FAMILY:  # MLA (deepseek_v2-style): no wo_a; W_UK_T / W_UV come from kv_b_proj in torch
        # get_and_maybe_dequant_weights (quant_utils.py): Fp8LinearMethod with use_marlin (sm_8x) takes the
        # generic path, the layer's own GEMM (Marlin FP8) applied to an identity matrix, then torch splits
        out = out[:2] + [_row(model, "weight-load",
                              "MLA: kv_b_proj -> W_UK_T / W_UV (Marlin FP8 GEMM on an identity, then torch)",
                              "Marlin C++ _C", "me.layers.attention.mla_attention:MLAAttention.process_weights_after_loading",
                              _both(marlin_cubin("_C_stable", "bfloat16", "float8_e4m3fn", "bfloat16", arch),
                                    torch_cuda_arch(arch)))]
    return out


NVFP4_PATH = "nvfp4-experts"


def nvfp4_rows(model: str, arch: int) -> List[dict]:
    """A checkpoint whose routed experts are NVFP4 (``moe_quant_algo: NVFP4``): the model's quant
    config then builds ``ModelOptNvFp4FusedMoE`` (deepseek_v4{,1}/quant_config.py), not the MXFP4
    method the default rows audit. One row under path ``nvfp4-experts`` (reported, not enforced)
    with the backend vLLM's own ``select_nvfp4_moe_backend`` picks for sm_<arch> (DeepseekV4MoE's
    FusedMoEConfig, NVFP4 weights, NVFP4 / no activation quant); status unknown: nothing of this
    layout is evaluated further (the plugin's o_proj / weight hooks assume the MXFP4 layout)."""
    if model not in ("v4", "v41"):
        return []
    from ..serve_graph import _source

    qc = f"vllm.models.{'deepseek_v4' if model == 'v4' else 'deepseek_v41'}.quant_config"
    path = _source.module_path(qc)
    text = open(path).read() if path else ""
    if "ModelOptNvFp4FusedMoE(" not in text or '"NVFP4"' not in text:
        return []
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as O
    from vllm.model_executor.layers.quantization.utils import quant_utils as Q

    cfg = _v4_moe_config(model)
    picks = []
    for act in (getattr(Q, "kNvfp4Dynamic", None), None):
        try:
            with cuda_platform(arch):
                backend, experts = O.select_nvfp4_moe_backend(cfg, Q.kNvfp4Static, act)
            picks.append(f"activation {getattr(act, 'name', act) if act is not None else 'none (W4A16)'}: "
                         f"{backend.name} ({experts.__name__})")
        except Exception as exc:  # noqa: BLE001 - the selection's own verdict
            picks.append(f"activation {act if act is not None else 'none'}: selection raises "
                         f"{type(exc).__name__}: {str(exc)[:160]}")
    ev = (f"moe_quant_algo NVFP4 selects ModelOptNvFp4FusedMoE ({qc.replace('vllm.models.', '')}); vLLM's "
          f"select_nvfp4_moe_backend on sm_{arch}: " + "; ".join(picks) + ". Not audited further (kernels, weight "
          "loading, the plugin's hooks assume MXFP4 experts): this layout is unsupported by dsv4-ops on sm_8x")
    return [dict(model=model, path=NVFP4_PATH, phase="forward", kernel="ModelOptNvFp4FusedMoE (routed experts)",
                 tech="MoE", location=f"{qc.replace('vllm.models.', '')}:get_quant_method", status=UNKNOWN,
                 evidence=ev[:900], patch="")]


PROBES = (linear_rows, moe_rows, layer_op_rows, sampler_rows, allreduce_rows, vit_rows, weight_load_rows, nvfp4_rows)


# Imported with the machine's own platform before any probe answers as CUDA: some run C++ ops of
# vLLM's extension at import (w8a8_utils: CUTLASS_BLOCK_FP8_SUPPORTED), which need a CUDA driver.
_PREIMPORT = ("vllm.model_executor.layers.quantization.utils.w8a8_utils", "vllm.model_executor.kernels.linear",
              "vllm.model_executor.layers.fused_moe.oracle.mxfp4", "vllm.model_executor.layers.fused_moe.router.gate_linear",
              "vllm.v1.worker.gpu.sample.gumbel", "vllm.v1.sample.ops.topk_topp_sampler")


def rows(model: str, arch: int) -> List[dict]:
    """Every row of this module for ``model`` on sm_<arch>; a probe that raises gives one unknown
    row naming the error (so it shows as open instead of disappearing)."""
    import importlib

    for name in _PREIMPORT:
        importlib.import_module(name)
    out: List[dict] = []
    for probe in PROBES:
        try:
            out.extend(probe(model, arch))
        except Exception as exc:  # noqa: BLE001
            out.append(_row(model, "forward", f"module probe {probe.__name__}", "?", "dsv4_ops.vllm.audit._modules",
                            (None, f"probe failed: {type(exc).__name__}: {str(exc)[:300]}")))
    return out


__all__ = ["PROBES", "cubin", "cuda_platform", "library_cubins", "rows", "trace_specs", "traced_aot"]
