"""Launchers of the sparse-attention indexer kernels (ops ``indexer_k_insert``,
``indexer_q_quant``, ``mqa_logits``, ``paged_mqa_logits``).

Cache layout: ``dsv4_ops.layout`` ("indexer cache"). References (the oracles of every test):
``reference.ref_indexer_k_insert``, ``ref_indexer_q_quant``, ``ref_mqa_logits``,
``ref_paged_mqa_logits``. E4M3 arguments may be uint8 or float8_e4m3fn tensors of the same
bytes; they are viewed as uint8 (no kernel takes an fp8 pointer).

Agreement with vLLM 0.33.0:

- ``indexer_k_insert`` writes what vLLM's non-SM100 FP8 indexer stores write
  (``deepseek_v4/common/ops/fused_compress_quant_cache.py``
  ``_fused_kv_compress_norm_rope_insert_indexer_attn`` and
  ``deepseek_v41/common/ops/indexer_k_store.py`` ``_indexer_k_norm_rope_quant_store_kernel``,
  from their bf16-rounded key): amax of the row, ``max(amax, 1e-4)``, ``exponent =
  ceil(log2(amax * (1/448)))``, codes ``e4m3(clamp(x * 2**-exponent))`` (RNE cvt), the fp32
  ``exp2(exponent)`` at ``block * stride(0) + block_size * 128 + pos * 4``. The exponent is the
  integer ``ue8m0_exponent`` (csrc_triton.kv_cache): for a bf16 amax, amax/448 is a power of
  two only at amax = 1.75 * 2**m, where ``amax * fl(1/448)`` rounds to exactly that power of
  two, and is >= 0.4% away from one elsewhere, so vLLM's fp32 log2/ceil gives the same e.
  Slots outside ``[0, capacity)`` are skipped (vLLM skips only < 0).
- ``indexer_q_quant`` follows the CuTeDSL kernel that vLLM runs on CUDA
  (``deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl.py``, ``IndexerQFp8Kernel``):
  ``rot0 = q0*cos - q1*sin``, ``rot1 = q0*sin + q1*cos`` in fp32 on pairs (64 + 2i, 65 + 2i),
  rounded to bf16 (``cvt.rn.bf16x2``); amax over the head's 128 values; the power-of-two
  scale from ``max(amax, 1e-4) * fl32(1/448)`` rounded up through the exponent bits;
  codes ``cvt.rn.satfinite.e4m3(value * 2**-e)``; ``weights_out = (w * fl32(softmax_scale *
  head_scale)) * 2**e``. Its Triton fallback (``FusedIndexerQRopeQuantTritonKernel``)
  multiplies the weight by the three factors one at a time, which differs in the last bit
  when head_scale is not a power of two (V4.1: 32**-0.5); the CuTeDSL order is the one
  followed here. Unverified without an sm_90 GPU: whether the CuTeDSL compiler contracts
  the RoPE products into FMAs (it would change the bf16 rounding of a rope value in rare
  ties); this kernel launches with ``enable_fp_fusion=False``, so it never does.
- ``mqa_logits`` / ``paged_mqa_logits``: ``fp8_mqa_logits_torch`` /
  ``fp8_paged_mqa_logits_torch`` (``v1/attention/ops/rocm_aiter_mla_sparse.py``), computed
  with exact E4M3 products and fp32 sums (the non-paged torch reference rounds to bf16).
  ``mqa_logits(..., max_seqlen_k=C)`` returns DeepGEMM's compressed form
  ``[M, C]``: column j is key ``ks[m] + j`` (``vllm.utils.deep_gemm.fp8_fp4_mqa_logits``);
  unlike DeepGEMM, the tail ``[ke - ks, C)`` is -inf, not left unwritten.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton

from . import layout
from ._checks import check_last_dim, check_tensor
from .codec import encode_mode
from .csrc_triton import indexer as _k
from .dispatch import device as _device
from .dispatch import indexer as _di
from .dispatch import variant_for

E4M3_DTYPES = (torch.uint8, torch.float8_e4m3fn)
SLOT_DTYPES = (torch.int64, torch.int32)
D = layout.INDEXER_HEAD_DIM


def as_codes(name: str, t, ndim: int, device=None) -> torch.Tensor:
    """uint8 view of an E4M3 tensor (uint8 or float8_e4m3fn) of ``ndim`` dims, last dim 128."""
    check_tensor(name, t, dtypes=E4M3_DTYPES, ndim=ndim, device=device)
    check_last_dim(name, t, D)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _interpreting() -> bool:
    """True under the Triton interpreter: the v2 kernels then spell out their fp16 decode
    as a bit move (BITS=True; the interpreter's fp8e4b15 -> fp16 cast flushes subnormals)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_int(name: str, v, lo: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")


# ---------------------------------------------------------------------------------------
# indexer_k_insert
# ---------------------------------------------------------------------------------------


def check_k_insert_args(k, cache, slot_mapping, block_size) -> Tuple[torch.Tensor, int]:
    """ValueError naming the bad argument; returns (2-D uint8 page view, block_size)."""
    flat, block_size = layout.indexer_cache_pages(cache, block_size)
    check_tensor("k", k, dtypes=(torch.bfloat16, torch.float32), ndim=2, device=flat.device)
    check_last_dim("k", k, D)
    if k.stride(1) != 1:
        raise ValueError(f"k: expected contiguous dims (stride(1) == 1), got strides {k.stride()}")
    check_tensor("slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=flat.device)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for only {k.shape[0]} k rows")
    return flat, block_size


def indexer_k_insert(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                     variant: Optional[str] = None, config: Optional[dict] = None) -> None:
    """Quantize indexer keys into the paged indexer cache, in place.

    k: bf16 [N, 128] (normed and roped; rows may be strided), or fp32 (quantized as it is, as
    vLLM's V3.2 fused norm + RoPE writer does from its registers). cache: uint8 (or float8) [num_blocks,
    page_bytes] or vLLM's [num_blocks, block_size, 132] / [num_blocks, block_size, 1, 132];
    page_bytes = stride(0) >= block_size * 132. slot_mapping int64/int32 [M], M <= N: row i
    goes to slot slot_mapping[i]; slots outside [0, num_blocks * block_size) are skipped.
    Row: 128 bytes e4m3(k / 2**e) (RNE), fp32 scale 2**e, e = ceil(log2(max(amax, 1e-4) / 448)).
    Never syncs the host. config: a row of K_INSERT_CANDIDATES (default K_INSERT_CONFIG).
    """
    flat, block_size = check_k_insert_args(k, cache, slot_mapping, block_size)
    n = slot_mapping.shape[0]
    if n == 0 or flat.shape[0] == 0:
        return
    variant = variant or variant_for(flat)
    cfg = config or _k.K_INSERT_CONFIG
    _k._indexer_k_insert_kernel[(triton.cdiv(n, cfg["TOKENS"]),)](
        k, flat, slot_mapping.contiguous(), n, k.stride(0), flat.stride(0), block_size,
        flat.shape[0] * block_size,
        MODE=encode_mode(True, variant), TOKENS=cfg["TOKENS"], num_warps=cfg["num_warps"])


# ---------------------------------------------------------------------------------------
# indexer_q_quant
# ---------------------------------------------------------------------------------------


def check_q_quant_args(positions, index_q, cos_sin_cache, index_weights) -> None:
    check_tensor("index_q", index_q, dtypes=(torch.bfloat16,), ndim=3)
    dev = index_q.device
    check_last_dim("index_q", index_q, D)
    if index_q.stride(2) != 1:
        raise ValueError(f"index_q: expected contiguous head dims (stride(2) == 1), got strides {index_q.stride()}")
    check_tensor("positions", positions, dtypes=SLOT_DTYPES, ndim=1, device=dev)
    if positions.shape[0] != index_q.shape[0]:
        raise ValueError(f"positions: expected {index_q.shape[0]} positions (index_q.shape[0]), got {positions.shape[0]}")
    check_tensor("index_q_cos_sin_cache", cos_sin_cache, dtypes=(torch.float32, torch.bfloat16), ndim=2, device=dev)
    check_last_dim("index_q_cos_sin_cache", cos_sin_cache, layout.INDEXER_ROPE_DIM)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError(f"index_q_cos_sin_cache: expected contiguous rows, got strides {cos_sin_cache.stride()}")
    check_tensor("index_weights", index_weights, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                 device=dev)
    if tuple(index_weights.shape) != tuple(index_q.shape[:2]):
        raise ValueError(f"index_weights: expected shape {tuple(index_q.shape[:2])} (index_q.shape[:2]), "
                         f"got {tuple(index_weights.shape)}")


def indexer_q_quant(positions: torch.Tensor, index_q: torch.Tensor, index_q_cos_sin_cache: torch.Tensor,
                    index_weights: torch.Tensor, index_weights_softmax_scale: float,
                    index_weights_head_scale: float, use_fp4: bool = False,
                    variant: Optional[str] = None, config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FP8 path of vLLM 0.33.0's ``fused_indexer_q_rope_quant`` (same arguments, same order).

    positions int64/int32 [T] (each < index_q_cos_sin_cache.shape[0]; not checked: no host
    sync); index_q bf16 [T, H, 128] (head dims contiguous); index_q_cos_sin_cache fp32/bf16
    [max_pos, 64] (32 cos, then 32 sin); index_weights bf16/fp16/fp32 [T, H].
    Returns (q uint8 [T, H, 128] E4M3 codes, weights_out fp32 [T, H]): GPT-J RoPE on dims
    64..127 rounded to bf16, one power-of-two scale 2**e per (token, head) with
    e = ceil(log2(max(amax, 1e-4) / 448)), codes e4m3(value / 2**e),
    weights_out = (w * fl32(softmax_scale * head_scale)) * 2**e. use_fp4=True raises.
    config: a row of Q_QUANT_CANDIDATES (default Q_QUANT_CONFIG).
    """
    if use_fp4:
        raise NotImplementedError("indexer_q_quant: the MXFP4 indexer path (use_fp4=True) needs sm_100")
    check_q_quant_args(positions, index_q, index_q_cos_sin_cache, index_weights)
    T, H, _ = index_q.shape
    q_out = torch.empty((T, H, D), dtype=torch.uint8, device=index_q.device)
    w_out = torch.empty((T, H), dtype=torch.float32, device=index_q.device)
    if T == 0 or H == 0:
        return q_out, w_out
    variant = variant or variant_for(index_q)
    cfg = config or _k.Q_QUANT_CONFIG
    heads = min(cfg["HEADS"], triton.next_power_of_2(H))
    kern = _k._indexer_q_quant_pairs_kernel if cfg.get("KERNEL", 1) == 2 else _k._indexer_q_quant_kernel
    kern[(T, triton.cdiv(H, heads))](
        positions, index_q, index_q_cos_sin_cache, index_weights, q_out, w_out, H,
        index_q.stride(0), index_q.stride(1), index_q_cos_sin_cache.stride(0),
        index_weights.stride(0), index_weights.stride(1), w_out.stride(0),
        float(index_weights_softmax_scale * index_weights_head_scale),
        MODE=encode_mode(True, variant), HEADS=heads, num_warps=cfg["num_warps"], enable_fp_fusion=False)
    return q_out, w_out


# ---------------------------------------------------------------------------------------
# mqa_logits (prefill)
# ---------------------------------------------------------------------------------------


def check_mqa_args(q, weights, k, k_scale, ks, ke, max_seqlen_k):
    """ValueError naming the bad argument; returns (q, k, k_scale) as uint8/uint8/fp32 [N]."""
    qc = as_codes("q", q, 3)
    dev = qc.device
    M, H, _ = qc.shape
    if qc.stride(2) != 1:
        raise ValueError(f"q: expected contiguous head dims, got strides {q.stride()}")
    kc = as_codes("k", k, 2, dev)
    if kc.stride(1) != 1:
        raise ValueError(f"k: expected contiguous dims, got strides {k.stride()}")
    N = kc.shape[0]
    check_tensor("weights", weights, dtypes=(torch.float32,), ndim=2, device=dev)
    if tuple(weights.shape) != (M, H):
        raise ValueError(f"weights: expected shape {(M, H)}, got {tuple(weights.shape)}")
    check_tensor("k_scale", k_scale, dtypes=(torch.float32,), device=dev)
    if k_scale.numel() != N or (k_scale.dim() == 2 and k_scale.shape[1] != 1) or k_scale.dim() > 2:
        raise ValueError(f"k_scale: expected [N] or [N, 1] with N = {N}, got shape {tuple(k_scale.shape)}")
    for name, t in (("ks", ks), ("ke", ke)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=1, device=dev)
        if t.shape[0] != M:
            raise ValueError(f"{name}: expected [{M}] (one per query row), got shape {tuple(t.shape)}")
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < -1:
        raise ValueError(f"max_seqlen_k: expected -1 (full [M, N] output) or an int >= 0, got {max_seqlen_k!r}")
    return qc, kc, k_scale.reshape(-1).contiguous()


def mqa_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int = -1,
               variant: Optional[str] = None, config: Optional[dict] = None) -> torch.Tensor:
    """Prefill indexer logits (vLLM's ``fp8_mqa_logits_torch`` semantics).

    q: E4M3 [M, H, 128]; weights fp32 [M, H] (q scales folded in); k: E4M3 [N, 128];
    k_scale fp32 [N] (or [N, 1]); ks, ke int32 [M]. Returns fp32
    ``out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(<q[m, h], k[n]>)`` for
    ``ks[m] <= n < ke[m]`` and -inf elsewhere: [M, N] when max_seqlen_k == -1, else the
    compressed [M, max_seqlen_k] (column j = key ks[m] + j; -inf past ke[m] - ks[m]).
    config: a row of MQA_CANDIDATES (default MQA_COMPRESSED_CONFIG / MQA_CONFIG).
    """
    qc, kc, scale = check_mqa_args(q, weights, k, k_scale, ks, ke, max_seqlen_k)
    M, H, _ = qc.shape
    N = kc.shape[0]
    cols = N if max_seqlen_k < 0 else max_seqlen_k
    out = torch.empty((M, cols), dtype=torch.float32, device=qc.device)
    if M == 0 or cols == 0:
        return out
    variant = variant or variant_for(qc)
    cfg = config or (_k.MQA_COMPRESSED_CONFIG if max_seqlen_k >= 0 else _k.MQA_CONFIG)
    kernel = cfg.get("KERNEL", 1)
    if kernel in (2, 3):
        grid = (triton.cdiv(max(N, cols), cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
        h_block = max(16, triton.next_power_of_2(H))
        extra = {"ROWS": _di.mqa_rows_per_dot(H, cfg)} if kernel == 3 else {}
        kern = _k._mqa_logits_v3_kernel if kernel == 3 else _k._mqa_logits_v2_kernel
        kern[grid](
            qc, weights, kc, scale, ks, ke, out, M, N, H, cols,
            qc.stride(0), qc.stride(1), weights.stride(0), weights.stride(1), kc.stride(0), out.stride(0),
            COMPRESSED=max_seqlen_k >= 0, NATIVE=variant == "native", BITS=_interpreting(),
            H_BLOCK=h_block, **extra, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(max(N, cols), cfg["BLOCK_N"]))
    _k._mqa_logits_kernel[grid](
        qc, weights, kc, scale, ks, ke, out, M, N, H, cols,
        qc.stride(0), qc.stride(1), weights.stride(0), weights.stride(1), kc.stride(0), out.stride(0),
        COMPRESSED=max_seqlen_k >= 0, NATIVE=variant == "native", BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ---------------------------------------------------------------------------------------
# paged_mqa_logits (decode)
# ---------------------------------------------------------------------------------------


def check_paged_args(q, kv_cache, weights, context_lens, block_table, max_context_len, block_size):
    """ValueError naming the bad argument; returns (q uint8 [R, H, 128], 2-D pages, block_size)."""
    qc = as_codes("q", q, 4)
    dev = qc.device
    B, next_n, H, _ = qc.shape
    flat, block_size = layout.indexer_cache_pages(kv_cache, block_size or None, "kv_cache")
    if flat.device != dev:
        raise ValueError(f"kv_cache: expected a tensor on {dev}, got {flat.device}")
    check_tensor("weights", weights, dtypes=(torch.float32,), ndim=2, device=dev)
    if tuple(weights.shape) != (B * next_n, H):
        raise ValueError(f"weights: expected shape {(B * next_n, H)} ([B * next_n, H]), got {tuple(weights.shape)}")
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), device=dev)
    if not (tuple(context_lens.shape) == (B,) or tuple(context_lens.shape) == (B, next_n)):
        raise ValueError(f"context_lens: expected [{B}] or [{B}, {next_n}], got shape {tuple(context_lens.shape)}")
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows, got shape {tuple(block_table.shape)}")
    _check_int("max_context_len", max_context_len)
    return qc, flat, block_size



def logits_sms(device: torch.device, cfg: dict) -> Optional[int]:
    """The SM count the paged logits plan its tiles a program for: dispatch.device.num_sms (so
    DSV4_AMPERE_SMS, read at each call, steers it: a green context, an MPS share) for a CUDA
    device and a config with PROGRAMS_PER_SM, else None (TARGET_PROGRAMS: the interpreter)."""
    if device.type != "cuda" or "PROGRAMS_PER_SM" not in cfg:
        return None
    return _device.num_sms(device.index if device.index is not None else torch.cuda.current_device())

def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                     block_table: torch.Tensor, max_context_len: int, block_size: int = 0,
                     variant: Optional[str] = None, config: Optional[dict] = None) -> torch.Tensor:
    """Decode indexer logits over the paged indexer cache (``fp8_paged_mqa_logits_torch``).

    q: E4M3 [B, next_n, H, 128]; kv_cache: the indexer cache ([num_blocks, block_size, 132],
    [num_blocks, block_size, 1, 132], or [num_blocks, page_bytes] with block_size given, or
    inferred when page_bytes is a multiple of 132); weights fp32 [B * next_n, H];
    context_lens int32 [B] (row j of request b sees keys < context_lens[b] - next_n + j + 1)
    or [B, next_n] (row (b, j) sees keys < context_lens[b, j]); block_table int32
    [B, max_blocks]. Returns fp32 [B * next_n, max_context_len]; -inf past each row's
    context and where the page id is outside [0, num_blocks) or past the block table.
    config: a row of PAGED_CANDIDATES (default ``dispatch.indexer.paged_config(H)``).
    """
    qc, flat, block_size = check_paged_args(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                            block_size)
    B, next_n, H, _ = qc.shape
    rows = B * next_n
    out = torch.empty((rows, max_context_len), dtype=torch.float32, device=qc.device)
    if rows == 0 or max_context_len == 0:
        return out
    variant = variant or variant_for(qc)
    cfg = config or _di.paged_config(H)
    q3 = qc.reshape(rows, H, D)
    kernel = cfg.get("KERNEL", 1)
    kern = {1: _k._paged_mqa_logits_kernel, 2: _k._paged_mqa_logits_v2_kernel,
            3: _k._paged_mqa_logits_v3_kernel}[kernel]
    extra = {"BITS": _interpreting()} if kernel > 1 else {}
    if kernel == 3:
        extra["CODES_AHEAD"] = bool(cfg.get("CODES_AHEAD", False))
        extra["PAIRS"] = bool(cfg.get("PAIRS", False))
    args = (q3, weights, flat, context_lens.contiguous(), block_table, out,
            next_n, H, max_context_len, flat.shape[0], block_table.shape[1], block_size, flat.stride(0),
            q3.stride(0), q3.stride(1), weights.stride(0), weights.stride(1), block_table.stride(0), out.stride(0))
    consts = dict(CTX_PER_ROW=context_lens.dim() == 2, NATIVE=variant == "native", **extra,
                  H_BLOCK=max(16, triton.next_power_of_2(H)), BLOCK_N=cfg["BLOCK_N"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sms = logits_sms(qc.device, cfg)
    per_sm = _resident(kern, args, consts) if sms else None
    tpp = _di.paged_tiles_per_program(rows, max_context_len, cfg, sms, per_sm)
    grid = (rows, triton.cdiv(triton.cdiv(max_context_len, cfg["BLOCK_N"]), tpp))
    kern[grid](*args, tpp, **consts)
    return out


_RESIDENT: dict = {}  # (kernel, device, constexprs and options) -> programs an SM or None


def _resident(kern, args: tuple, consts: dict) -> Optional[int]:
    """Programs of the compiled paged kernel resident an SM (``dispatch.device.resident_programs``),
    cached per kernel, device and constexprs (``tiles_per_prog`` is not specialised, so the plan's
    compile is this one); None under the interpreter or where the driver cannot be asked."""
    key = (kern, torch.cuda.current_device(), tuple(sorted(consts.items())))
    got = _RESIDENT.get(key, False)
    if got is False:
        if not hasattr(kern, "warmup") or _interpreting():
            got = None
        else:
            ck = kern.warmup(*args, 2, grid=(1,), **consts)  # compiles (or finds) it, launches nothing
            if ck is None:  # warm_keys.recording(): nothing compiled, ask again at the next call
                return None
            ck.run  # loads the module: its registers and CUfunction handle
            got = _device.resident_programs(ck.function, ck.metadata.num_warps, ck.metadata.shared)
        _RESIDENT[key] = got
    return got


# ---------------------------------------------------------------------------------------
# AOT
# ---------------------------------------------------------------------------------------


def _k_insert_spec(variant, slot_ty, cfg, tag="", k_ty="bf16"):
    from .aot import KernelSpec

    return KernelSpec(
        "indexer_k_insert", f"k_insert[{variant},{slot_ty}{',fp32 k' if k_ty == 'fp32' else ''}{tag}]",
        _k._indexer_k_insert_kernel,
        {"k_ptr": f"*{k_ty}", "cache_ptr": "*u8", "slot_ptr": f"*{slot_ty}", "n_tokens": "i32",
         "stride_k_0": "i32", "page_bytes": "i32", "block_size": "i32", "capacity": "i64",
         "MODE": "constexpr", "TOKENS": "constexpr"},
        {"MODE": encode_mode(True, variant), "TOKENS": cfg["TOKENS"]}, variant, num_warps=cfg["num_warps"])


def _q_quant_spec(variant, w_ty, cfg, tag=""):
    from .aot import KernelSpec

    v2 = cfg.get("KERNEL", 1) == 2
    return KernelSpec(
        "indexer_q_quant", f"q_quant[{variant},w={w_ty},heads={cfg['HEADS']}{',pairs' if v2 else ''}{tag}]",
        _k._indexer_q_quant_pairs_kernel if v2 else _k._indexer_q_quant_kernel,
        {"pos_ptr": "*i64", "q_ptr": "*bf16", "cs_ptr": "*fp32", "w_ptr": f"*{w_ty}", "q_out_ptr": "*u8",
         "w_out_ptr": "*fp32", "n_heads": "i32", "stride_q_t": "i32", "stride_q_h": "i32",
         "stride_cs": "i32", "stride_w_t": "i32", "stride_w_h": "i32", "stride_wo_t": "i32",
         "w_scale": "fp32", "MODE": "constexpr", "HEADS": "constexpr"},
        {"MODE": encode_mode(True, variant), "HEADS": cfg["HEADS"]}, variant, num_warps=cfg["num_warps"])


def _mqa_spec(variant, compressed, cfg, h_block=64, tag=""):
    from .aot import KernelSpec

    kernel = cfg.get("KERNEL", 1)
    v2 = kernel in (2, 3)
    sig = {"q_ptr": "*u8", "w_ptr": "*fp32", "k_ptr": "*u8", "k_scale_ptr": "*fp32", "ks_ptr": "*i32",
           "ke_ptr": "*i32", "out_ptr": "*fp32", "M": "i32", "N": "i32", "n_heads": "i32", "out_cols": "i32",
           "stride_q_m": "i32", "stride_q_h": "i32", "stride_w_m": "i32", "stride_w_h": "i32",
           "stride_k_n": "i32", "stride_out_m": "i32", "COMPRESSED": "constexpr", "NATIVE": "constexpr",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    const = {"COMPRESSED": compressed, "NATIVE": variant == "native", "BLOCK_M": cfg["BLOCK_M"],
             "BLOCK_N": cfg["BLOCK_N"]}
    label = f"mqa[{variant},compressed={compressed}"
    if v2:
        sig.update({"BITS": "constexpr", "H_BLOCK": "constexpr"})
        const.update({"BITS": False, "H_BLOCK": h_block})
        label += f",v{kernel},H={h_block},M={cfg['BLOCK_M']},N={cfg['BLOCK_N']},w={cfg['num_warps']},s={cfg['num_stages']}"
    if kernel == 3:
        sig["ROWS"] = "constexpr"
        const["ROWS"] = _di.mqa_rows_per_dot(h_block, cfg)
        label += f",rows={const['ROWS']}"
    kern = {1: _k._mqa_logits_kernel, 2: _k._mqa_logits_v2_kernel, 3: _k._mqa_logits_v3_kernel}[kernel]
    return KernelSpec("mqa_logits", label + tag + "]", kern,
                      sig, const, variant, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _paged_spec(variant, h_block, per_row, cfg, tag=""):
    from .aot import KernelSpec

    kernel = cfg.get("KERNEL", 1)
    v2 = kernel > 1
    sig = {"q_ptr": "*u8", "w_ptr": "*fp32", "cache_ptr": "*u8", "ctx_ptr": "*i32", "bt_ptr": "*i32",
           "out_ptr": "*fp32", "next_n": "i32", "n_heads": "i32", "max_ctx": "i32", "num_blocks": "i32",
           "bt_cols": "i32", "block_size": "i32", "page_bytes": "i32", "stride_q_r": "i32",
           "stride_q_h": "i32", "stride_w_r": "i32", "stride_w_h": "i32", "stride_bt_b": "i32",
           "stride_out_r": "i32", "tiles_per_prog": "i32", "CTX_PER_ROW": "constexpr",
           "NATIVE": "constexpr", "H_BLOCK": "constexpr", "BLOCK_N": "constexpr"}
    const = {"CTX_PER_ROW": per_row, "NATIVE": variant == "native", "H_BLOCK": h_block, "BLOCK_N": cfg["BLOCK_N"]}
    label = f"paged[{variant},H={h_block},ctx_per_row={per_row}"
    if v2:
        sig["BITS"] = "constexpr"
        const["BITS"] = False
        label += f",v{kernel},N={cfg['BLOCK_N']},w={cfg['num_warps']},s={cfg['num_stages']}"
    if kernel == 3:
        sig["CODES_AHEAD"] = "constexpr"
        const["CODES_AHEAD"] = bool(cfg.get("CODES_AHEAD", False))
        sig["PAIRS"] = "constexpr"
        const["PAIRS"] = bool(cfg.get("PAIRS", False))
        label += f",ahead={int(const['CODES_AHEAD'])},pairs={int(const['PAIRS'])}"
    kern = {1: _k._paged_mqa_logits_kernel, 2: _k._paged_mqa_logits_v2_kernel, 3: _k._paged_mqa_logits_v3_kernel}
    return KernelSpec("paged_mqa_logits", label + tag + "]", kern[kernel], sig, const, variant,
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def aot_specs():
    """Every indexer kernel specialization a launcher can pick with the shipped configs
    (see dsv4_ops.aot); candidate_specs() adds the sweep's candidates."""
    specs = []
    for variant in ("portable", "native"):
        for slot_ty in ("i64", "i32"):
            specs.append(_k_insert_spec(variant, slot_ty, _k.K_INSERT_CONFIG))
            specs.append(_k_insert_spec(variant, slot_ty, _k.K_INSERT_CONFIG, k_ty="fp32"))
        for w_ty in ("bf16", "fp32"):
            specs.append(_q_quant_spec(variant, w_ty, _k.Q_QUANT_CONFIG))
        for compressed in (False, True):
            cfg = _k.MQA_COMPRESSED_CONFIG if compressed else _k.MQA_CONFIG
            for h_block in ((32, 64) if cfg.get("KERNEL", 1) > 1 else (64,)):
                specs.append(_mqa_spec(variant, compressed, cfg, h_block))
        for h_block in (32, 64):
            for per_row in (False, True):
                specs.append(_paged_spec(variant, h_block, per_row, _di.paged_config(h_block)))
    return specs


def candidate_specs(variant: str = "portable"):
    """One specialization per row of the *_CANDIDATES lists (V4 shapes: H = 64, 1-D
    context_lens, compressed prefill output), labelled 'cand'; benchmarks/sweep_indexer.py
    --aot compiles them for sm_80/86 on the CPU."""
    specs = [_k_insert_spec(variant, "i64", c, ",cand") for c in _k.K_INSERT_CANDIDATES]
    specs += [_q_quant_spec(variant, "bf16", c, ",cand") for c in _k.Q_QUANT_CANDIDATES]
    specs += [_mqa_spec(variant, True, c, 64, ",cand") for c in _k.MQA_CANDIDATES]
    specs += [_paged_spec(variant, 64, False, c, ",cand") for c in _k.PAGED_CANDIDATES]
    return specs
