"""Dequantize a vLLM linear layer's weight to float32, as loaded and before any repack.

``dequantize_linear_weight(layer)`` reads ``layer.weight`` and its scale as vLLM 0.33.0's
``create_weights`` registered them and the weight loaders filled them, i.e. BEFORE the
quant method's ``process_weights_after_loading`` (which, on sm_80, repacks FP8 for Marlin).
Formats accepted (N = out, K = in; the block (bm, bk) is always ``layer.weight_block_size``,
never the quant config's, which for MXFP8 is the checkpoint's [32, 32], not the loaded [1, 32]):

- ``Fp8LinearMethod`` block (V4; V4.1 unless [32,32]+e8m0): ``weight_scale_inv`` float32 or
  float8_e8m0fnu [cdiv(N, bm), cdiv(K, bk)], block [128,128] or the checkpoint's.
- ``ModelOptLinearMethod`` MXFP8 (V4.1 [32,32]+e8m0): ``weight_scale`` uint8 UE8M0 [N, K/32]
  (the loader already repeated the checkpoint's rows 32 times), block [1, 32].
- ``ModelOptLinearMethod`` FP8_PB_WO: ``weight_scale`` float32 [cdiv(N,128), 1, K/128, 1], block [128,128].
- per-tensor (``Fp8LinearMethod`` without blocks, ModelOpt FP8): ``weight_scale`` float32 [1], or
  one per logical partition [len(layer.logical_widths)].
- per-channel (ModelOpt FP8_PER_CHANNEL_PER_TOKEN): ``weight_scale`` float32 [N] or [N, 1], no block.
- a bf16/fp16/fp32 weight (``UnquantizedLinearMethod``, or one vLLM already dequantized, e.g. the
  MXFP8 Emulation kernel, which keeps its now unused uint8 scale): returned as is.

UE8M0 (``float8_e8m0fnu`` or ``uint8``): byte e means 2**(e - 127); 255 is NaN and rejected.
Every other combination (unknown weight or scale dtype, a scale whose shape does not match
the weight and block size, a multi-element scale with no block size, both scale names
present, a packed/repacked weight) raises ``ValueError`` naming the layer and tensor: never
guess. Runs once per layer at load time, so the validity scans may sync the host.
"""

from __future__ import annotations

import torch

_FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)
_UE8M0_SCALES = (torch.float8_e8m0fnu, torch.uint8)
_UE8M0_NAN = 255


def _layer_name(layer: torch.nn.Module) -> str:
    prefix = getattr(layer, "prefix", None)
    return repr(prefix) if prefix else type(layer).__name__


def ue8m0_to_fp32(scale: torch.Tensor, what: str = "scale") -> torch.Tensor:
    """UE8M0 bytes (float8_e8m0fnu or uint8, any shape) -> float32 2**(byte - 127), exactly.

    Bytes 1..254 are built in the float32 exponent field; byte 0 (2**-127, a float32
    subnormal) is written as a constant. Byte 255 (NaN in UE8M0) raises ValueError.
    """
    if scale.dtype not in _UE8M0_SCALES:
        raise ValueError(f"{what}: expected float8_e8m0fnu or uint8 UE8M0 bytes, got {scale.dtype}")
    e = scale.view(torch.uint8)
    if bool((e == _UE8M0_NAN).any()):
        raise ValueError(f"{what}: UE8M0 byte 255 (NaN) in the scale; the checkpoint is corrupt")
    normal = (e.to(torch.int32) << 23).view(torch.float32)
    return torch.where(e == 0, torch.full_like(normal, 2.0 ** -127), normal)


def _decode_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    if scale.dtype in _UE8M0_SCALES:
        return ue8m0_to_fp32(scale, what)
    if scale.dtype in _FLOAT_SCALES:
        return scale.to(torch.float32)
    raise ValueError(f"{what}: unrecognised scale dtype {scale.dtype} (expected float32/bfloat16/"
                     "float16 multipliers or float8_e8m0fnu/uint8 UE8M0 exponents)")


def _find_scale(layer: torch.nn.Module, name: str) -> tuple[str, torch.Tensor]:
    found = [(n, getattr(layer, n)) for n in ("weight_scale_inv", "weight_scale")
             if getattr(layer, n, None) is not None]
    if not found:
        raise ValueError(f"{name}: float8 weight has neither weight_scale_inv nor weight_scale")
    if len(found) > 1:
        raise ValueError(f"{name}: both weight_scale_inv and weight_scale are set; which one "
                         "applies is ambiguous")
    return found[0][0], found[0][1].data


def _per_partition(layer: torch.nn.Module, scale: torch.Tensor, n: int) -> torch.Tensor | None:
    """[N, 1] float32 from one scale per logical partition, or None if that is not the layout."""
    widths = getattr(layer, "logical_widths", None)
    if not widths or len(widths) < 2 or scale.numel() != len(widths) or sum(widths) != n:
        return None
    return torch.cat([s.expand(int(width)) for s, width in zip(scale.reshape(-1), widths)])[:, None]


def dequantize_linear_weight(layer: torch.nn.Module) -> torch.Tensor:
    """float32 [N, K] value of a vLLM linear's ``weight`` with its scales applied.

    ``layer.weight``: float8_e4m3fn [N, K] with a scale (see the module docstring for the
    accepted layouts), or bf16/fp16/fp32 [N, K] (returned as is: unquantized, or already
    dequantized by vLLM, e.g. the MXFP8 Emulation kernel, whose leftover scale is unused).
    Raises ValueError, naming the layer and tensor, for anything else.
    """
    name = _layer_name(layer)
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name}: has no weight tensor")
    if weight.ndim != 2:
        raise ValueError(f"{name}.weight: expected a 2-D [out, in] weight, got shape "
                         f"{tuple(weight.shape)} (already processed by vLLM?)")
    if weight.dtype in _FLOAT_WEIGHTS:
        return weight.data.to(torch.float32)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.weight: unrecognised weight dtype {weight.dtype} with shape "
                         f"{tuple(weight.shape)} (expected float8_e4m3fn, or a float dtype; a packed "
                         "or repacked weight, e.g. NVFP4 or Marlin, is not supported)")
    n, k = weight.shape
    scale_name, raw = _find_scale(layer, name)
    what = f"{name}.{scale_name}"
    scale = _decode_scale(raw, what)
    w = weight.data.to(torch.float32)
    block = getattr(layer, "weight_block_size", None)

    if scale.numel() == 1:
        return w * scale.reshape(())
    if block is None:
        per_part = _per_partition(layer, scale, n)
        if per_part is not None:
            return w * per_part
        if tuple(scale.shape) in ((n,), (n, 1)):
            return w * scale.reshape(n, 1)
        raise ValueError(f"{what}: {raw.dtype} scale of shape {tuple(raw.shape)} for weight "
                         f"[{n}, {k}] but the layer has no weight_block_size; refusing to guess "
                         "the block size")

    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"{name}.weight_block_size: expected two positive ints, got {block!r}")
    bm, bk = block
    if scale.ndim == 4 and scale.shape[1] == 1 and scale.shape[3] == 1:  # ModelOpt [ob,1,ib,1]
        scale = scale[:, 0, :, 0]
    want = (-(-n // bm), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: {raw.dtype} scale of shape {tuple(raw.shape)} does not match "
                         f"weight [{n}, {k}] with weight_block_size {list(block)} (expected {list(want)})")
    full = scale.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)
    return w * full[:n, :k]
