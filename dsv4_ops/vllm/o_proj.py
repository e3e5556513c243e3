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

WO_A_BF16_ATTR = "dsv4_ampere_weight_bf16"  # bf16 [G, R, heads_per_group * 512] on wo_a
_HOOK_MARK = "_dsv4_ampere_wo_a_hooked"


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


def _e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (float8_e8m0fnu) -> float32 2**(byte - 127), by placing the byte in the exponent."""
    return (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def dequantize_linear_weight(layer: torch.nn.Module, block_size=None) -> torch.Tensor:
    """float32 [out, in] value of a vLLM linear's weight, applying its FP8 scales.

    Handles block scales (``weight_scale_inv`` / ``weight_scale`` of shape
    [cdiv(out, bm), cdiv(in, bk)], float32 or float8_e8m0fnu), per-channel and per-tensor
    scales, and unquantized weights. ``block_size``: (bm, bk); default from the layer or its
    quant_method's config.
    """
    weight = layer.weight
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(layer, "weight_scale", None)
    if scale is None or weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return weight.to(torch.float32)
    scale = _e8m0_to_fp32(scale) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.float32)
    w = weight.to(torch.float32)
    if scale.numel() == 1:
        return w * scale.reshape(())
    if block_size is None:
        block_size = getattr(layer, "weight_block_size", None)
    if block_size is None:
        cfg = getattr(getattr(layer, "quant_method", None), "quant_config", None)
        block_size = getattr(cfg, "weight_block_size", None)
    if block_size is None:
        return w * scale.reshape(-1, 1)
    bm, bk = block_size
    m, k = w.shape
    full = scale.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)
    return w * full[:m, :k]


def install_wo_a_bf16_hook(wo_a: torch.nn.Module, n_groups: int, o_lora_rank: int) -> None:
    """Dequantize ``wo_a`` to bf16 [G, R, K] once, right before vLLM's own
    ``process_weights_after_loading`` (which, on sm_80, repacks it for Marlin).

    The bf16 copy is stored as ``wo_a.dsv4_ampere_weight_bf16``; the quantized weight that
    the repack leaves behind is never read by the Ampere o_proj. Idempotent per layer.
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
            setattr(layer, WO_A_BF16_ATTR, w.view(groups, rank, -1).contiguous())
        original(layer)

    method.process_weights_after_loading = process_weights_after_loading
    setattr(method, _HOOK_MARK, True)


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
    T, H, D = o.shape
    G, R, K = wo_a_bf16.shape
    if D != layout.HEAD_DIM or H % G or (H // G) * D != K:
        raise ValueError(f"o_proj: o {tuple(o.shape)} does not match wo_a {tuple(wo_a_bf16.shape)}")
    x = inverse_rope_o(o, positions, cos_sin_cache).view(T, G, K)
    z = torch.bmm(x.transpose(0, 1), wo_a_bf16.transpose(1, 2))  # [G, T, R]
    return wo_b(z.transpose(0, 1).reshape(T, G * R))
