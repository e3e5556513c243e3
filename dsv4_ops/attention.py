"""Launchers of split-KV sparse MLA decode (ops ``sparse_mla_split``, ``merge_splits``,
``sparse_mla_decode``).

Shapes: T tokens, H query heads, K key positions a token, N rows of kv, D = 512 (the latent
row is both key and value), S splits.

Partial layout (between the two kernels)
  o_part   float32 [T, H, S, D] contiguous: the split's normalised output sum_j p_j v_j / l_s
  lse_part float32 [T, H, S]    contiguous: the split's natural-log LSE of its scaled scores
  An empty split (no valid key in its share) has o = 0 and lse = -inf. Split s of token t
  covers key blocks [floor(s*nb/S), floor((s+1)*nb/S)) of PARTITION_N = 16 positions, with
  nb = cdiv(min(topk_length[t], K), 16) (see csrc_triton.sparse_mla).

Launchers never sync the host and allocate only their outputs, so they capture into CUDA
graphs; the split count comes from static shapes (dsv4_ops.split_heuristic).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import check_last_dim, check_tensor
from .csrc_triton import merge as _mk
from .csrc_triton import sparse_mla as _sk
from .split_heuristic import max_splits, num_splits as heuristic_splits  # noqa: F401
from .variant import variant_for

HEAD_DIM = _sk.HEAD_DIM
MAX_SPLITS = _sk.MAX_SPLITS
PARTITION_N = _sk.PARTITION_N
# bf16 is the contract; fp16 is accepted so the split kernel can run under the Triton
# interpreter, whose bf16 tl.dot is wrong.
QKV_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """A view whose last dim is unit-stride (copies otherwise)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    return num_splits


def _check_inputs(q, kv, indices, topk_length):
    check_tensor("q", q, dtypes=QKV_DTYPES, ndim=3)
    check_last_dim("q", q, HEAD_DIM)
    check_tensor("kv", kv, dtypes=(q.dtype,), ndim=2, device=q.device)
    check_last_dim("kv", kv, HEAD_DIM)
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, ndim=2, device=q.device)
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices: expected {q.shape[0]} rows (one per token of q), got shape {tuple(indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, ndim=1, device=q.device)
        if topk_length.shape[0] != q.shape[0]:
            raise ValueError(f"topk_length: expected shape ({q.shape[0]},), got {tuple(topk_length.shape)}")
        if topk_length.dtype != torch.int32:
            # Values above K act as K, so clamping first keeps the int32 cast exact.
            topk_length = topk_length.clamp(max=indices.shape[1]).to(torch.int32)
        topk_length = topk_length.contiguous()
    return _check_rows("q", q), _check_rows("kv", kv), _check_rows("indices", indices), topk_length


def split_outputs_like(q: torch.Tensor, num_splits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty (o_part fp32 [T, H, S, D], lse_part fp32 [T, H, S]), as the launcher allocates them."""
    T, H = q.shape[0], q.shape[1]
    o_part = torch.empty((T, H, num_splits, HEAD_DIM), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
    return o_part, lse_part


def sparse_mla_split(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                     topk_length: Optional[torch.Tensor], sm_scale: float, num_splits: int,
                     variant: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial attention.

    q bf16 [T, H, 512] (last dim unit-stride); kv bf16 [N, 512]; indices int32/int64 [T, K]
    (rows of kv; < 0 or >= N is masked); topk_length int32/int64 [T] or None (positions
    j >= topk_length[t] are masked); sm_scale float; num_splits int in [1, 64].
    Returns o_part fp32 [T, H, S, 512], lse_part fp32 [T, H, S] (layout in the module doc).
    """
    q, kv, indices, topk_length = _check_inputs(q, kv, indices, topk_length)
    num_splits = _check_splits(num_splits)
    variant = variant or variant_for(q)
    cfg = _sk.SPLIT_CONFIG[variant]
    T, H = q.shape[0], q.shape[1]
    K, N = indices.shape[1], kv.shape[0]
    o_part, lse_part = split_outputs_like(q, num_splits)
    if T and H:
        grid = (T, -(-H // cfg["BLOCK_H"]), num_splits)
        _sk._sparse_mla_split_kernel[grid](
            q, kv, indices, topk_length, o_part, lse_part,
            H, K, N, num_splits, float(sm_scale),
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
            D=HEAD_DIM, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
            HAS_TOPK_LENGTH=topk_length is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o_part, lse_part


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, sink: Optional[torch.Tensor],
                 variant: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of the partials, folding the per-head sink logit into the denominator.

    o_part fp32 [T, H, S, 512] contiguous; lse_part fp32 [T, H, S] contiguous; sink float
    [H] or None. Returns out bf16 [T, H, 512] and lse fp32 [T, H] (natural log). A row with no
    valid key gives out 0 and lse = sink (-inf without a sink), never NaN.
    """
    check_tensor("o_part", o_part, dtypes=(torch.float32,), ndim=4, contiguous=True)
    check_last_dim("o_part", o_part, HEAD_DIM)
    T, H, S = o_part.shape[0], o_part.shape[1], o_part.shape[2]
    check_tensor("lse_part", lse_part, dtypes=(torch.float32,), ndim=3, device=o_part.device, contiguous=True)
    if tuple(lse_part.shape) != (T, H, S):
        raise ValueError(f"lse_part: expected shape {(T, H, S)} to match o_part, got {tuple(lse_part.shape)}")
    _check_splits(S)
    if sink is not None:
        check_tensor("sink", sink, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=1,
                     device=o_part.device)
        if sink.shape[0] != H:
            raise ValueError(f"sink: expected shape ({H},) (one logit per head), got {tuple(sink.shape)}")
        sink = sink.to(torch.float32).contiguous()
    variant = variant or variant_for(o_part)  # validates the override; both variants share the kernel
    out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=o_part.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=o_part.device)
    if T and H:
        cfg = _mk.merge_config(S, HEAD_DIM)
        grid = (T * H, HEAD_DIM // cfg["BLOCK_D"])
        _mk._merge_splits_kernel[grid](
            o_part, lse_part, sink, out, lse, H, S,
            D=HEAD_DIM, BLOCK_S=cfg["BLOCK_S"], BLOCK_D=cfg["BLOCK_D"], HAS_SINK=sink is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                      topk_length: Optional[torch.Tensor], sink: Optional[torch.Tensor],
                      sm_scale: float, num_splits: int = 0,
                      variant: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode with sink: split + merge. num_splits=0 picks the heuristic from the
    static shapes (T, H, K). Returns out bf16 [T, H, 512], lse fp32 [T, H]."""
    check_tensor("q", q, dtypes=QKV_DTYPES, ndim=3)
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, ndim=2)
    if num_splits == 0:
        num_splits = heuristic_splits(q.shape[0], q.shape[1], indices.shape[1])
    o_part, lse_part = sparse_mla_split(q, kv, indices, topk_length, sm_scale, num_splits, variant)
    return merge_splits(o_part, lse_part, sink, variant)


def aot_specs():
    """Every split/merge kernel specialization a launcher can pick (see dsv4_ops.aot)."""
    from .aot import KernelSpec, optional_pointer

    specs = []
    for variant in ("portable", "native"):
        cfg = _sk.SPLIT_CONFIG[variant]
        for idx_ty in ("i32", "i64"):
            for has_len in (False, True):
                sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "indices_ptr": f"*{idx_ty}",
                       "topk_length_ptr": None,
                       "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                       "H": "i32", "K": "i32", "N": "i32", "S": "i32", "sm_scale": "fp32",
                       "stride_q_t": "i32", "stride_q_h": "i32", "stride_kv_n": "i32",
                       "stride_indices_t": "i32",
                       "D": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr",
                       "HAS_TOPK_LENGTH": "constexpr"}
                consts = {"D": HEAD_DIM, "BLOCK_H": cfg["BLOCK_H"], "BLOCK_N": cfg["BLOCK_N"],
                          "HAS_TOPK_LENGTH": has_len}
                optional_pointer(sig, consts, "topk_length_ptr", "*i32", has_len)
                specs.append(KernelSpec(
                    "sparse_mla_split", f"split[{variant},{idx_ty},{'len' if has_len else 'nolen'}]",
                    _sk._sparse_mla_split_kernel, sig, consts, variant,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        s = 1
        while s <= MAX_SPLITS:
            mcfg = _mk.merge_config(s, HEAD_DIM)
            for has_sink in (False, True):
                sig = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                       "sink_ptr": None,
                       "out_ptr": "*bf16", "lse_ptr": "*fp32", "H": "i32", "S": "i32",
                       "D": "constexpr", "BLOCK_S": "constexpr", "BLOCK_D": "constexpr",
                       "HAS_SINK": "constexpr"}
                consts = {"D": HEAD_DIM, "BLOCK_S": mcfg["BLOCK_S"], "BLOCK_D": mcfg["BLOCK_D"],
                          "HAS_SINK": has_sink}
                optional_pointer(sig, consts, "sink_ptr", "*fp32", has_sink)
                specs.append(KernelSpec(
                    "merge_splits", f"merge[{variant},S<={s},{'sink' if has_sink else 'nosink'}]",
                    _mk._merge_splits_kernel, sig, consts, variant,
                    num_warps=mcfg["num_warps"], num_stages=mcfg["num_stages"]))
            s *= 2
        icfg = _sk.INDICES_CONFIG
        for slot_ty in ("i32", "i64"):
            for has_len in (False, True):
                sig = {"topk_slots_ptr": f"*{slot_ty}", "topk_length_ptr": None,
                       "swa_slots_ptr": f"*{slot_ty}", "indices_ptr": "*i32", "T": "i32", "K1": "i32",
                       "K2": "i32", "cap_c": "i64", "cap_w": "i64", "stride_topk_t": "i32",
                       "stride_swa_t": "i32", "BLOCK": "constexpr", "HAS_TOPK_LENGTH": "constexpr"}
                consts = {"BLOCK": icfg["BLOCK"], "HAS_TOPK_LENGTH": has_len}
                optional_pointer(sig, consts, "topk_length_ptr", "*i32", has_len)
                specs.append(KernelSpec(
                    "dsv4_decode_indices", f"indices[{variant},{slot_ty},{'len' if has_len else 'nolen'}]",
                    _sk._dsv4_decode_indices_kernel, sig, consts, variant, num_warps=icfg["num_warps"]))
    return specs
