"""The DSv4 output projection on sm_8x: inverse RoPE, grouped bf16 bmm with wo_a, then wo_b.

Replaces ``deep_gemm_fp8_o_proj`` (V4) / ``dsv41_o_proj`` (V4.1) of vLLM 0.33.0, whose two
sm_80 blockers are:
- ``fused_inv_rope_fp8_quant`` fails to compile on sm_80 even with ``quantize=False``
  (the ``tl.float8e4nv`` cast after a constexpr early return is still code-generated);
- ``fp8_einsum`` is DeepGEMM (sm_90+), and on sm_80 the block-FP8 ``wo_a`` is repacked
  for Marlin at load, so the bf16 ``torch.bmm`` fallback would read packed int32 words.

So ``wo_a`` is dequantized to bf16 once, at load, before vLLM's own
``process_weights_after_loading`` repacks it (``install_wo_a_bf16_hook``), and the
inverse RoPE is plain torch (fp32 math, bf16 result). Everything here is static-shape
torch: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import layout
from .table import Patch, since
from .weights import dequantize_linear_weight

WO_A_BF16_ATTR = "dsv4_ampere_weight_bf16"  # bf16 [G, R, heads_per_group * 512] on wo_a
_HOOK_MARK = "_dsv4_ampere_wo_a_hooked"

# The vLLM 0.33.0 quant-method classes whose ``process_weights_after_loading``
# ``install_wo_a_bf16_hook`` wraps on wo_a (a ColumnParallelLinear, is_bmm) for V4 and V4.1 on
# sm_80. On CUDA the "deepseek_v4_fp8" name maps to ``models/deepseek_v41/quant_config.py``'s
# DeepseekV4FP8Config for both models (``quantization/__init__.py``).
WO_A_QUANT_METHODS = (
    # V4 (every checkpoint: [128,128] blocks, e8m0 or float32 weight_scale_inv) and V4.1 unless
    # [32,32]+e8m0: Fp8Config.get_quant_method -> Fp8LinearMethod. On sm_80 its post-load hands
    # the weight to MarlinFP8ScaledMMLinearKernel, which repacks it: dequantize before that.
    ("vllm.model_executor.layers.quantization.fp8", "Fp8LinearMethod"),
    # V4.1 with weight_block_size [32,32] and e8m0 scales: ModelOptLinearMethod(kMxfp8Static),
    # uint8 weight_scale [N, K/32], layer.weight_block_size [1,32]. Its post-load re-selects
    # a bmm kernel for is_bmm layers (DeepGemm, sm100 only, else Emulation: bf16 at load).
    ("vllm.model_executor.layers.quantization.modelopt", "ModelOptLinearMethod"),
    # wo_a in the checkpoint's ignored layers (is_layer_skipped) or an unquantized checkpoint:
    # bf16 weight, nothing to dequantize; the wrapper only makes the [G, R, K] view.
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
)


def gptj_rotate_tail(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """GPT-J (interleaved-pair) RoPE on the last ``rope_dim`` dims of ``x``, in fp32.

    x: float32 [..., D]; cos_sin: float32 [..., rope_dim] (cos in the first half, sin in the
    second, one per pair), broadcastable against x's leading dims. Forward:
    ``(e, o) -> (e*c - o*s, o*c + e*s)``; inverse: ``(e*c + o*s, o*c - e*s)``.
    Returns a new float32 tensor shaped like x.
    """
    rope_dim = cos_sin.shape[-1]
    half = rope_dim // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    tail = x[..., -rope_dim:].unflatten(-1, (half, 2))
    even, odd = tail[..., 0], tail[..., 1]
    if inverse:
        sin = -sin
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rot), dim=-1)


def inverse_rope_o(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Undo the query RoPE on the attention output: bf16 [T, H, 512] -> bf16 [T, H, 512].

    positions int64 [T]; cos_sin_cache float32 [max_pos, 64]. Matches the QUANTIZE=False
    output of vLLM's ``fused_inv_rope_fp8_quant`` (fp32 math, one bf16 rounding).
    """
    cs = cos_sin_cache[positions[: o.shape[0]]].to(torch.float32)[:, None, :]  # [T, 1, 64]
    return gptj_rotate_tail(o.to(torch.float32), cs, inverse=True).to(torch.bfloat16)


def install_wo_a_bf16_hook(wo_a: torch.nn.Module, n_groups: int, o_lora_rank: int) -> None:
    """Dequantize ``wo_a`` to bf16 [G, R, K] once, right before vLLM's own
    ``process_weights_after_loading`` (which, on sm_80, repacks it for Marlin).

    The weight is decoded by ``weights.dequantize_linear_weight`` (every wo_a format vLLM
    0.33.0 registers; ValueError at load for anything else), and the bf16 [G, R, K] result is
    stored as ``wo_a.dsv4_ampere_weight_bf16``; the repacked weight that vLLM leaves behind is
    never read by the Ampere o_proj. Where vLLM's own post-load leaves a bf16 weight (MXFP8
    Emulation, unquantized), that tensor is checked against ours and kept instead of a second
    copy. Idempotent per layer.
    """
    method = getattr(wo_a, "quant_method", None)
    if method is None:
        return
    wo_a._dsv4_ampere_groups = (int(n_groups), int(o_lora_rank))
    setattr(wo_a, _HOOK_MARK, True)
    if getattr(method, _HOOK_MARK, False):  # a quant_method shared by several layers: wrap once
        return
    original = method.process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        if getattr(layer, _HOOK_MARK, False):
            groups, rank = layer._dsv4_ampere_groups
            w = dequantize_linear_weight(layer).to(torch.bfloat16)
            if w.shape[0] != groups * rank:
                raise ValueError(f"wo_a {getattr(layer, 'prefix', '')!r}: {w.shape[0]} output rows, "
                                 f"expected n_groups * o_lora_rank = {groups} * {rank}")
            original(layer)
            setattr(layer, WO_A_BF16_ATTR, _check_against_vllm(layer, w).view(groups, rank, -1))
            return
        original(layer)

    method.process_weights_after_loading = process_weights_after_loading
    setattr(method, _HOOK_MARK, True)


def _check_against_vllm(layer: torch.nn.Module, ours: torch.Tensor) -> torch.Tensor:
    """The bf16 [N, K] wo_a to keep after vLLM's own post-load ran.

    If vLLM left a bf16 weight of the same shape (MXFP8 Emulation dequantizes at load, or an
    unquantized layer), it must agree with ours to bf16 rounding (a scale read wrongly is off
    by a power of two or more): then keep vLLM's tensor and drop our copy. Otherwise keep ours.
    """
    theirs = getattr(layer, "weight", None)
    if (not isinstance(theirs, torch.Tensor) or theirs.dtype != torch.bfloat16
            or theirs.shape != ours.shape):
        return ours.contiguous()
    theirs = theirs.data
    if not torch.allclose(theirs.float(), ours.float(), rtol=2.0 ** -6, atol=1e-30):
        raise ValueError(
            f"wo_a {getattr(layer, 'prefix', '')!r}: the bf16 weight vLLM built at load differs from "
            "dsv4_ops.vllm.weights.dequantize_linear_weight; the scale format is not the one expected")
    return theirs.contiguous()


def wo_a_weight_bf16(wo_a: torch.nn.Module, n_groups: int, o_lora_rank: int) -> torch.Tensor:
    """bf16 [G, R, K] wo_a weight: the copy made at load, or the weight itself if unquantized."""
    w = getattr(wo_a, WO_A_BF16_ATTR, None)
    if w is not None:
        return w
    if wo_a.weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = wo_a.weight.to(torch.bfloat16).view(n_groups, o_lora_rank, -1)
        setattr(wo_a, WO_A_BF16_ATTR, w)
        return w
    raise RuntimeError(
        f"dsv4_ops: wo_a weight is {wo_a.weight.dtype} and was not dequantized at load; the Ampere "
        "attention's process_weights_after_loading hook did not run (was the layer built by "
        "the dsv4_ops plugin's attention class?)")


def ampere_o_proj(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  wo_a_bf16: torch.Tensor, wo_b: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Output projection: ``wo_b(bmm(inverse_rope(o) grouped, wo_a^T))``.

    o bf16 [T, H, 512] (live heads only); positions int64 [T]; cos_sin_cache float32
    [max_pos, 64]; wo_a_bf16 bf16 [G, R, (H / G) * 512], group g = rows [g*R, (g+1)*R) of
    wo_a; wo_b maps bf16 [T, G*R] to [T, hidden]. Same math as vLLM's bf16 ``torch.bmm``
    fallback in ``deep_gemm_fp8_o_proj``.
    """
    z = grouped_wo_a(o, positions, cos_sin_cache, wo_a_bf16)
    return wo_b(z.reshape(z.shape[0], -1))


def grouped_wo_a(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 wo_a_bf16: torch.Tensor) -> torch.Tensor:
    """``bmm(inverse_rope(o) grouped, wo_a^T)``: bf16 [T, G, R] (arguments as ``ampere_o_proj``)."""
    T, H, D = o.shape
    G, R, K = wo_a_bf16.shape
    if D != layout.HEAD_DIM or H % G or (H // G) * D != K:
        raise ValueError(f"o_proj: o {tuple(o.shape)} does not match wo_a {tuple(wo_a_bf16.shape)}")
    x = inverse_rope_o(o, positions, cos_sin_cache).view(T, G, K)
    return torch.bmm(x.transpose(0, 1), wo_a_bf16.transpose(1, 2)).transpose(0, 1)  # [T, G, R]


def _grouped_dims(o, n_groups: int, heads_per_group: int, nope_dim: int, rope_dim: int) -> None:
    if not isinstance(o, torch.Tensor):
        raise NotImplementedError(f"dsv4_ops (sm_8x): wo_a input {type(o).__name__} (a quantized activation is an "
                                  "sm_90+ FlashMLA path; the Ampere attention hands wo_a bf16)")
    if (nope_dim + rope_dim != layout.HEAD_DIM or rope_dim != layout.ROPE_DIM
            or o.shape[1:] != (n_groups * heads_per_group, layout.HEAD_DIM)):
        raise ValueError(f"dsv4_ops (sm_8x): grouped wo_a input {tuple(o.shape)} with {n_groups} groups of "
                         f"{heads_per_group} heads, nope {nope_dim} + rope {rope_dim}, is not DSv4's layout")


def grouped_input(self, o, positions, cos_sin_cache, *, n_groups, heads_per_group, nope_dim, rope_dim):
    """``DeepseekV4GroupedWoA.grouped_input`` (vLLM 0.34+) on sm_8x: the bf16 inverse-rotated
    groups [T, n_groups, heads_per_group * 512], as vLLM's ``fused_inv_rope_fp8_quant`` with
    quantize=False (whose fp8 cast does not compile for sm_80), in torch."""
    _grouped_dims(o, n_groups, heads_per_group, nope_dim, rope_dim)
    return inverse_rope_o(o, positions, cos_sin_cache).view(o.shape[0], n_groups, -1)


def grouped_forward(self, o, positions, cos_sin_cache, *, n_groups, heads_per_group, nope_dim, rope_dim,
                    o_lora_rank, einsum_recipe, tma_aligned_scales):
    """``DeepseekV4GroupedWoA.grouped_forward`` (vLLM 0.34+) on sm_8x: inverse RoPE and the
    grouped bmm with the load-time bf16 wo_a (``grouped_wo_a``), bf16 [T, n_groups, o_lora_rank].
    ``einsum_recipe`` / ``tma_aligned_scales`` are DeepGEMM's (sm_90+) and unused."""
    _grouped_dims(o, n_groups, heads_per_group, nope_dim, rope_dim)
    return grouped_wo_a(o, positions, cos_sin_cache, wo_a_weight_bf16(self, n_groups, o_lora_rank))


_GROUPED = "vllm.models.deepseek_v4.common.grouped_wo_a"
_GROUPED_PARAMS = ("o", "positions", "cos_sin_cache", "n_groups", "heads_per_group", "nope_dim", "rope_dim")

# The load hook wraps process_weights_after_loading of whichever of these methods owns wo_a
# (installed on live objects by the Ampere attention class): checked rows of the patch table.
# From vLLM 0.34 wo_a is a DeepseekV4GroupedWoA (V4 and V4.1) whose two methods reach
# fused_inv_rope_fp8_quant (tl.float8e4nv): the Ampere _o_proj does not call them, and LoRA's
# wrapper (which would) is refused at startup (quant_guard.check_serve_settings); patched so
# that no path to the kernel is left on sm_8x and the warm-up filter drops it.
PATCHES = (
    Patch(_GROUPED, "DeepseekV4GroupedWoA.grouped_input", _GROUPED_PARAMS,
          "inverse RoPE of the attention output: fused_inv_rope_fp8_quant (tl.float8e4nv, sm_89+ even with "
          "quantize=False)", grouped_input, versions=since("0.34.0")),
    Patch(_GROUPED, "DeepseekV4GroupedWoA.grouped_forward",
          _GROUPED_PARAMS + ("o_lora_rank", "einsum_recipe", "tma_aligned_scales"),
          "grouped wo_a: fused_inv_rope_fp8_quant + DeepGEMM fp8_einsum (sm_90+)", grouped_forward,
          versions=since("0.34.0")),
) + tuple(
    Patch(module, f"{cls}.process_weights_after_loading", ("layer",),
          "wo_a hook: dequantize wo_a to bf16 [G, R, K] before this post-load step (which repacks it for Marlin "
          "on sm_80, or keeps an MXFP8 copy); unrecognised scale formats raise at load",
          install_wo_a_bf16_hook, kind="hook")
    for module, cls in WO_A_QUANT_METHODS
)
