"""Launchers of split-KV sparse MLA decode (ops ``sparse_mla_split``, ``merge_splits``,
``sparse_mla_decode`` and their out= forms ``merge_splits_out``, ``sparse_mla_decode_out``),
of the DSv4 decode index build (op ``dsv4_decode_indices``) and of the one-launch decode
gather (op ``dsv4_decode_gather``: both caches into the workspace plus the indices).

Host cost: launches go through dsv4_ops._launch (cached compiled launchers); the common
case of every check is one boolean expression, the detailed checks run only on failure.

Shapes: T tokens, H query heads, K key positions a token, N rows of kv, D = 512 (the latent
row is both key and value), S splits.

Partial layout (between the two kernels)
  o_part   float32 [T, H, S, D] contiguous: the split's normalised output sum_j p_j v_j / l_s
  lse_part float32 [T, H, S]    contiguous: the split's natural-log LSE of its scaled scores
  An empty split (no valid key in its share) has o = 0 and lse = -inf. Split s of token t
  covers key blocks [floor(s*nb/S), floor((s+1)*nb/S)) of PARTITION_N = 16 positions, with
  nb = cdiv(min(topk_length[t], K), 16) (see csrc_triton.decode.tiles).

Launchers never sync the host and allocate only their outputs, so they capture into CUDA
graphs; the kernel and split count come from static shapes (dsv4_ops.dispatch.workspace). The
paged decode (op ``dsv4_decode_fused_out``) is dsv4_ops.paged_decode.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import check_last_dim, check_tensor
from ._launch import fast
from . import kv_cache as _kv
from .csrc_triton import kv_cache as _kk
from .csrc_triton.decode import merge as _mk
from .csrc_triton.decode import tiles as _sk
from .csrc_triton.decode import heads as _hk
from .dispatch import decode as _dd
from .dispatch import workspace as _ws
from .dispatch import variant_for

HEAD_DIM = _sk.HEAD_DIM
MAX_SPLITS = _sk.MAX_SPLITS
PARTITION_N = _sk.PARTITION_N
# bf16 is the contract; fp16 is accepted so the split kernel can run under the Triton
# interpreter, whose bf16 tl.dot is wrong.
QKV_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
_SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_split_kernel = fast(_sk._sparse_mla_split_kernel)
_heads_kernel = fast(_hk._sparse_mla_heads_kernel)
_merge_kernel = fast(_mk._merge_splits_kernel)
_indices_kernel = fast(_sk._dsv4_decode_indices_kernel)
_decode_gather_kernel = fast(_kk._dsv4_decode_gather_kernel)


def _unit_stride_last_dim(t: torch.Tensor) -> torch.Tensor:
    """A view whose last dim is unit-stride (copies otherwise)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    return num_splits


def _check_inputs(q, kv, indices, topk_length):
    """Detailed checks (ValueError naming the argument) and normalisation of the split inputs."""
    check_tensor("q", q, dtypes=QKV_DTYPES, ndim=3)
    check_last_dim("q", q, HEAD_DIM)
    check_tensor("kv", kv, dtypes=(q.dtype,), ndim=2, device=q.device, device_of="q")
    check_last_dim("kv", kv, HEAD_DIM)
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, ndim=2, device=q.device, device_of="q")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices: expected {q.shape[0]} rows (one per token of q), got shape {tuple(indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, ndim=1, device=q.device, device_of="q")
        if topk_length.shape[0] != q.shape[0]:
            raise ValueError(f"topk_length: expected shape ({q.shape[0]},), got {tuple(topk_length.shape)}")
        if topk_length.dtype != torch.int32:
            # Values above K act as K, so clamping first keeps the int32 cast exact.
            topk_length = topk_length.clamp(max=indices.shape[1]).to(torch.int32)
        topk_length = topk_length.contiguous()
    return _unit_stride_last_dim(q), _unit_stride_last_dim(kv), _unit_stride_last_dim(indices), topk_length


def _inputs(q, kv, indices, topk_length):
    """_check_inputs with a cheap common case: dtype/ndim/size/device tests only, no copies
    when the inputs are already right; anything unusual takes the detailed path."""
    if (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor) and isinstance(indices, torch.Tensor)
            and q.dtype in QKV_DTYPES and q.dim() == 3 and q.shape[2] == HEAD_DIM and q.stride(2) == 1
            and kv.dtype == q.dtype and kv.dim() == 2 and kv.shape[1] == HEAD_DIM and kv.stride(1) == 1
            and indices.dtype in INDEX_DTYPES and indices.dim() == 2 and indices.shape[0] == q.shape[0]
            and (indices.stride(1) == 1 or indices.shape[1] <= 1)
            and (topk_length is None
                 or (isinstance(topk_length, torch.Tensor) and topk_length.dtype == torch.int32
                     and topk_length.dim() == 1 and topk_length.shape[0] == q.shape[0]
                     and (topk_length.stride(0) == 1 or q.shape[0] <= 1)
                     and topk_length.device == q.device))):
        dev = q.device
        if kv.device == dev and indices.device == dev:
            return q, kv, indices, topk_length
    return _check_inputs(q, kv, indices, topk_length)


def split_outputs_like(q: torch.Tensor, num_splits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty (o_part fp32 [T, H, S, D], lse_part fp32 [T, H, S]), as the launcher allocates them."""
    T, H = q.shape[0], q.shape[1]
    o_part = torch.empty((T, H, num_splits, HEAD_DIM), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
    return o_part, lse_part


def _launch_split(q, kv, indices, topk_length, sm_scale, num_splits, variant):
    """Allocate the partials and launch the split kernel (inputs already checked)."""
    cfg = _sk.SPLIT_CONFIG[variant]
    T, H = q.shape[0], q.shape[1]
    o_part, lse_part = split_outputs_like(q, num_splits)
    if T and H:
        bh = cfg["BLOCK_H"]
        _split_kernel(
            (T, -(-H // bh), num_splits),
            (q, kv, indices, topk_length, o_part, lse_part,
             H, indices.shape[1], kv.shape[0], num_splits, float(sm_scale),
             q.stride(0), q.stride(1), kv.stride(0), indices.stride(0)),
            (HEAD_DIM, bh, cfg["BLOCK_N"], topk_length is not None),
            cfg["num_warps"], cfg["num_stages"])
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
    q, kv, indices, topk_length = _inputs(q, kv, indices, topk_length)
    num_splits = check_splits(num_splits)
    return _launch_split(q, kv, indices, topk_length, sm_scale, num_splits, variant or variant_for(q))


def _check_out(out, T, H, like) -> None:
    """ValueError unless out is bf16 [T, H, 512] with unit-stride dims on like's device."""
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.dim() == 3
            and tuple(out.shape) == (T, H, HEAD_DIM) and out.stride(2) == 1
            and out.get_device() == like.get_device()):
        check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=3, device=like.device)
        if tuple(out.shape) != (T, H, HEAD_DIM):
            raise ValueError(f"out: expected shape {(T, H, HEAD_DIM)}, got {tuple(out.shape)}")
        raise ValueError(f"out: expected unit-stride last dim, got strides {out.stride()}")


def _sink(sink, H, like):
    """sink as fp32 [H] unit-stride (no copy when it already is), ValueError otherwise."""
    if sink is None:
        return None
    if not (isinstance(sink, torch.Tensor) and sink.dtype in _SINK_DTYPES and sink.dim() == 1
            and sink.shape[0] == H and sink.get_device() == like.get_device()):
        check_tensor("sink", sink, dtypes=_SINK_DTYPES, ndim=1, device=like.device)
        raise ValueError(f"sink: expected shape ({H},) (one logit per head), got {tuple(sink.shape)}")
    if sink.dtype != torch.float32 or (sink.stride(0) != 1 and H > 1):
        sink = sink.to(torch.float32).contiguous()
    return sink


def _launch_merge(o_part, lse_part, sink, out, variant):
    """Merge into out (allocated when None); returns (out, lse). Inputs already checked."""
    T, H, S = o_part.shape[0], o_part.shape[1], o_part.shape[2]
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=o_part.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=o_part.device)
    if T and H:
        cfg = _mk.merge_config(S, HEAD_DIM)
        _merge_kernel(
            (T * H, HEAD_DIM // cfg["BLOCK_D"]),
            (o_part, lse_part, sink, out, lse, H, S, out.stride(0), out.stride(1)),
            (HEAD_DIM, cfg["BLOCK_S"], cfg["BLOCK_D"], sink is not None),
            cfg["num_warps"], cfg["num_stages"])
    return out, lse


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, sink: Optional[torch.Tensor],
                 variant: Optional[str] = None, out: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of the partials, folding the per-head sink logit into the denominator.

    o_part fp32 [T, H, S, 512] contiguous; lse_part fp32 [T, H, S] contiguous; sink float
    [H] or None; out bf16 [T, H, 512] (dims unit-stride, rows may be strided) or None
    (allocated). Returns out bf16 [T, H, 512] and lse fp32 [T, H] (natural log). A row with
    no valid key gives out 0 and lse = sink (-inf without a sink), never NaN.
    """
    check_tensor("o_part", o_part, dtypes=(torch.float32,), ndim=4, contiguous=True)
    check_last_dim("o_part", o_part, HEAD_DIM)
    T, H, S = o_part.shape[0], o_part.shape[1], o_part.shape[2]
    check_tensor("lse_part", lse_part, dtypes=(torch.float32,), ndim=3, device=o_part.device, contiguous=True)
    if tuple(lse_part.shape) != (T, H, S):
        raise ValueError(f"lse_part: expected shape {(T, H, S)} to match o_part, got {tuple(lse_part.shape)}")
    check_splits(S)
    sink = _sink(sink, H, o_part)
    if out is not None:
        _check_out(out, T, H, o_part)
    variant = variant or variant_for(o_part)  # validates the override; both variants share the kernel
    return _launch_merge(o_part, lse_part, sink, out, variant)


def sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                      topk_length: Optional[torch.Tensor], sink: Optional[torch.Tensor],
                      sm_scale: float, num_splits: int = 0,
                      variant: Optional[str] = None, out: Optional[torch.Tensor] = None,
                      kernel: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode with sink. num_splits=0 picks the split count from the static shapes
    (T, H, K). out: bf16 [T, H, 512] to write (dims unit-stride) or None. kernel: 'auto' |
    'tiles' | 'heads' or None (= env DSV4_AMPERE_DECODE_KERNEL, default auto); the plan is
    dispatch.workspace.resolve_workspace's. tiles: split kernel + merge; heads (int32 indices only,
    else tiles): the all-heads kernel, + merge when it splits. Returns out bf16 [T, H, 512], lse
    fp32 [T, H]."""
    q, kv, indices, topk_length = _inputs(q, kv, indices, topk_length)
    T, H = q.shape[0], q.shape[1]
    if kernel is None:
        kernel_mode = _dd.mode()
    elif kernel in _dd.MODES:
        kernel_mode = kernel
    else:
        raise ValueError(f"kernel: expected one of {', '.join(_dd.MODES)} or None, got {kernel!r}")
    if num_splits:
        check_splits(num_splits)
    sink = _sink(sink, H, q)
    if out is not None:
        _check_out(out, T, H, q)
    variant = variant or variant_for(q)
    plan = _ws.workspace_plan(kernel_mode, T, H, indices.shape[1], indices.dtype == torch.int32, q.get_device(),
                              num_splits)
    if plan.kernel == "heads":
        return _launch_heads(q, kv, indices, topk_length, sink, sm_scale, plan, out, variant)
    o_part, lse_part = _launch_split(q, kv, indices, topk_length, sm_scale, plan.splits, variant)
    return _launch_merge(o_part, lse_part, sink, out, variant)


def _launch_heads(q, kv, indices, topk_length, sink, sm_scale, plan, out, variant):
    """The heads kernel (csrc_triton.decode.heads); one split writes out/lse directly,
    more write the partials and merge. Inputs already checked; indices int32."""
    T, H = q.shape[0], q.shape[1]
    K = indices.shape[1]
    cfg = _hk.HEADS_CONFIG[plan.block_h]
    consts_tail = (HEAD_DIM, plan.block_h, cfg["BLOCK_N"], topk_length is not None)
    if plan.direct:
        if out is None:
            out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T and H:
            _heads_kernel(
                (T * plan.groups,),
                (q, kv, indices, topk_length, sink, out, lse,
                 H, K, kv.shape[0], 1, plan.groups, float(sm_scale),
                 q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1)),
                consts_tail + (sink is not None, True), cfg["num_warps"], cfg["num_stages"])
        return out, lse
    S = plan.splits
    o_part, lse_part = split_outputs_like(q, S)
    if T and H:
        _heads_kernel(
            (T * S * plan.groups,),
            (q, kv, indices, topk_length, None, o_part, lse_part,
             H, K, kv.shape[0], S, plan.groups, float(sm_scale),
             q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), 0, 0),
            consts_tail + (False, False), cfg["num_warps"], cfg["num_stages"])
    return _launch_merge(o_part, lse_part, sink, out, variant)


SLOT_DTYPES = INDEX_DTYPES


def check_slots(name: str, slots: torch.Tensor, T: Optional[int] = None) -> None:
    check_tensor(name, slots, dtypes=SLOT_DTYPES, ndim=2)
    if T is not None and slots.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows (one per token), got shape {tuple(slots.shape)}")


def check_decode_indices_args(topk_slots: torch.Tensor, topk_length: Optional[torch.Tensor],
                              swa_slots: torch.Tensor) -> None:
    """ValueError naming the argument unless the index-build inputs are consistent."""
    check_slots("topk_slots", topk_slots)
    T = topk_slots.shape[0]
    check_slots("swa_slots", swa_slots, T)
    if swa_slots.device != topk_slots.device:
        raise ValueError(f"swa_slots: expected a tensor on {topk_slots.device}, got {swa_slots.device}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=SLOT_DTYPES, ndim=1, device=topk_slots.device)
        if topk_length.shape[0] != T:
            raise ValueError(f"topk_length: expected shape ({T},), got {tuple(topk_length.shape)}")


def dsv4_decode_indices(topk_slots: torch.Tensor, topk_length: Optional[torch.Tensor], swa_slots: torch.Tensor,
                   compressed_capacity: int, swa_capacity: int) -> torch.Tensor:
    """Workspace indices int32 [T, K1 + K2] (layout in the module doc); one kernel on CUDA.

    topk_slots int32/int64 [T, K1]; swa_slots int32/int64 [T, K2]; topk_length int [T] or None;
    capacities = num_blocks * block_size of each cache. On CPU tensors the kernel needs the
    Triton interpreter.
    """
    check_decode_indices_args(topk_slots, topk_length, swa_slots)
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]
    if topk_length is not None:
        topk_length = topk_length.clamp(max=K1).to(torch.int32).contiguous()
    topk_slots = topk_slots if topk_slots.stride(-1) == 1 else topk_slots.contiguous()
    swa_slots = swa_slots if swa_slots.stride(-1) == 1 else swa_slots.contiguous()
    indices = torch.empty((T, K1 + K2), dtype=torch.int32, device=topk_slots.device)
    cfg = _sk.INDICES_CONFIG
    if T and K1 + K2:
        grid = (T, -(-(K1 + K2) // cfg["BLOCK"]))
        _indices_kernel(
            grid,
            (topk_slots, topk_length, swa_slots, indices, T, K1, K2,
             int(compressed_capacity), int(swa_capacity), topk_slots.stride(0), swa_slots.stride(0)),
            (cfg["BLOCK"], topk_length is not None),
            cfg["num_warps"])
    return indices


def _decode_gather_slow_checks(compressed_cache, topk_slots, topk_length, compressed_block_size,
                               swa_cache, swa_slots, swa_length, swa_block_size, workspace) -> None:
    """The detailed checks of dsv4_decode_gather; each raises ValueError naming the argument."""
    _kv.check_cache(compressed_cache, compressed_block_size)
    _kv.check_cache(swa_cache, swa_block_size)
    dev = compressed_cache.device
    if swa_cache.device != dev:
        raise ValueError(f"swa_cache: expected a tensor on {dev}, got {swa_cache.device}")
    check_tensor("topk_slots", topk_slots, dtypes=_kv.SLOT_DTYPES, ndim=2, device=dev)
    T, K1 = topk_slots.shape
    check_tensor("swa_slots", swa_slots, dtypes=_kv.SLOT_DTYPES, ndim=2, device=dev)
    if swa_slots.shape[0] != T:
        raise ValueError(f"swa_slots: expected {T} rows (one per token), got shape {tuple(swa_slots.shape)}")
    for name, length in (("topk_length", topk_length), ("swa_length", swa_length)):
        if length is not None:
            check_tensor(name, length, dtypes=_kv.SLOT_DTYPES, ndim=1, device=dev)
            if length.shape[0] < T:
                raise ValueError(f"{name}: expected at least {T} values (one per token), got {tuple(length.shape)}")
    rows = T * (K1 + swa_slots.shape[1])
    check_tensor("workspace", workspace, dtypes=(torch.bfloat16,), ndim=2, device=dev, contiguous=True)
    if workspace.shape[0] < rows or workspace.shape[1] != HEAD_DIM:
        raise ValueError(f"workspace: expected at least ({rows}, {HEAD_DIM}), got {tuple(workspace.shape)}")


def dsv4_decode_gather(compressed_cache: torch.Tensor, topk_slots: torch.Tensor, topk_length: Optional[torch.Tensor],
                       compressed_block_size: int, swa_cache: torch.Tensor, swa_slots: torch.Tensor,
                       swa_length: Optional[torch.Tensor], swa_block_size: int, workspace: torch.Tensor,
                       variant: Optional[str] = None) -> torch.Tensor:
    """Both gathers of a DSv4 decode step and its index build, in one launch (op
    ``dsv4_decode_gather``).

    compressed_cache, swa_cache: uint8 [num_blocks, page_bytes] paged caches; topk_slots
    int32/int64 [T, K1], swa_slots int32/int64 [T, K2] (rows may be strided, entries
    contiguous); topk_length, swa_length: int32/int64 [>= T] or None (entries j >= length[t]
    are ignored); workspace bf16 [>= T*(K1+K2), 512] contiguous, rows [0, T*(K1+K2))
    written (layout: dsv4_ops.dsv4_decode; zero rows where unused).
    Returns indices int32 [T, K1 + K2]: the workspace row of each entry, -1 where the slot is
    outside [0, capacity) of its cache or the entry is past the token's length.
    """
    ok = (isinstance(topk_slots, torch.Tensor) and isinstance(swa_slots, torch.Tensor)
          and isinstance(workspace, torch.Tensor) and isinstance(compressed_cache, torch.Tensor)
          and isinstance(swa_cache, torch.Tensor)
          and topk_slots.dtype in _kv.SLOT_DTYPES and swa_slots.dtype in _kv.SLOT_DTYPES
          and topk_slots.dim() == 2 and swa_slots.dim() == 2 and topk_slots.shape[0] == swa_slots.shape[0]
          and workspace.dtype == torch.bfloat16 and workspace.dim() == 2 and workspace.shape[1] == HEAD_DIM
          and workspace.is_contiguous()
          and workspace.shape[0] >= topk_slots.shape[0] * (topk_slots.shape[1] + swa_slots.shape[1]))
    if ok:
        dev = compressed_cache.get_device()
        ok = (swa_cache.get_device() == dev and topk_slots.get_device() == dev
              and swa_slots.get_device() == dev and workspace.get_device() == dev)
        for length in (topk_length, swa_length):
            ok = ok and (length is None or (isinstance(length, torch.Tensor) and length.dtype in _kv.SLOT_DTYPES
                                            and length.dim() == 1 and length.shape[0] >= topk_slots.shape[0]
                                            and length.get_device() == dev))
    if not ok:
        _decode_gather_slow_checks(compressed_cache, topk_slots, topk_length, compressed_block_size,
                                   swa_cache, swa_slots, swa_length, swa_block_size, workspace)
    _kv.check_cache(compressed_cache, compressed_block_size)
    _kv.check_cache(swa_cache, swa_block_size)
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]
    if K1 and topk_slots.stride(1) != 1:
        topk_slots = topk_slots.contiguous()
    if K2 and swa_slots.stride(1) != 1:
        swa_slots = swa_slots.contiguous()
    indices = torch.empty((T, K1 + K2), dtype=torch.int32, device=workspace.device)
    if T == 0 or K1 + K2 == 0:
        return indices
    cfg = _kk.DECODE_GATHER_CONFIG
    rows = cfg["ROWS"]
    variant = variant or variant_for(workspace)
    _decode_gather_kernel(
        (-(-(T * K1) // rows) + -(-(T * K2) // rows),),
        (compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, workspace, indices,
         T, K1, K2, topk_slots.stride(0), swa_slots.stride(0),
         compressed_cache.stride(0), compressed_block_size, compressed_cache.shape[0] * compressed_block_size,
         swa_cache.stride(0), swa_block_size, swa_cache.shape[0] * swa_block_size),
        (variant == "native", rows, topk_length is not None, swa_length is not None),
        cfg["num_warps"])
    return indices


def _heads_specs(variant, KernelSpec, optional_pointer):
    """Specializations of the heads kernel _launch_heads can pick: every head-group config x
    topk_length or not x (partials | direct | direct with sink); int32 indices only."""
    specs = []
    for bh, cfg in sorted(_hk.HEADS_CONFIG.items()):
        for has_len in (False, True):
            for direct, has_sink in ((False, False), (True, False), (True, True)):
                sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "indices_ptr": "*i32", "topk_length_ptr": None,
                       "sink_ptr": None, "o_ptr": "*bf16" if direct else "*fp32", "lse_ptr": "*fp32",
                       "H": "i32", "K": "i32", "N": "i32", "S": "i32", "G": "i32", "sm_scale": "fp32",
                       "stride_q_t": "i32", "stride_q_h": "i32", "stride_kv_n": "i32",
                       "stride_indices_t": "i32", "stride_o_t": "i32", "stride_o_h": "i32",
                       "D": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr",
                       "HAS_TOPK_LENGTH": "constexpr", "HAS_SINK": "constexpr", "DIRECT": "constexpr"}
                consts = {"D": HEAD_DIM, "BLOCK_H": bh, "BLOCK_N": cfg["BLOCK_N"], "HAS_TOPK_LENGTH": has_len,
                          "HAS_SINK": has_sink, "DIRECT": direct}
                optional_pointer(sig, consts, "topk_length_ptr", "*i32", has_len)
                optional_pointer(sig, consts, "sink_ptr", "*fp32", has_sink)
                epi = "direct,sink" if has_sink else ("direct" if direct else "part")
                specs.append(KernelSpec(
                    "sparse_mla_decode", f"heads[{variant},bh{bh},{'len' if has_len else 'nolen'},{epi}]",
                    _hk._sparse_mla_heads_kernel, sig, consts, variant,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return specs


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
        specs.extend(_heads_specs(variant, KernelSpec, optional_pointer))
        s = 1
        while s <= MAX_SPLITS:
            mcfg = _mk.merge_config(s, HEAD_DIM)
            for has_sink in (False, True):
                sig = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                       "sink_ptr": None,
                       "out_ptr": "*bf16", "lse_ptr": "*fp32", "H": "i32", "S": "i32",
                       "stride_out_t": "i32", "stride_out_h": "i32",
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
        dg = _kk.DECODE_GATHER_CONFIG
        for slot_ty in ("i32", "i64"):
            for has_tl, has_sl in ((False, False), (True, False), (True, True)):
                sig = {"cc_ptr": "*u8", "topk_ptr": f"*{slot_ty}", "topk_len_ptr": None, "cw_ptr": "*u8",
                       "swa_ptr": f"*{slot_ty}", "swa_len_ptr": None, "ws_ptr": "*bf16", "idx_ptr": "*i32",
                       "T": "i32", "K1": "i32", "K2": "i32", "stride_topk_t": "i32", "stride_swa_t": "i32",
                       "page_c": "i32", "bs_c": "i32", "cap_c": "i64", "page_w": "i32", "bs_w": "i32",
                       "cap_w": "i64", "NATIVE": "constexpr", "ROWS": "constexpr", "HAS_TOPK_LEN": "constexpr",
                       "HAS_SWA_LEN": "constexpr"}
                consts = {"NATIVE": variant == "native", "ROWS": dg["ROWS"], "HAS_TOPK_LEN": has_tl,
                          "HAS_SWA_LEN": has_sl}
                optional_pointer(sig, consts, "topk_len_ptr", "*i32", has_tl)
                optional_pointer(sig, consts, "swa_len_ptr", "*i32", has_sl)
                specs.append(KernelSpec(
                    "dsv4_decode_gather",
                    f"decode_gather[{variant},{slot_ty},{'tl' if has_tl else '-'}{',sl' if has_sl else ''}]",
                    _kk._dsv4_decode_gather_kernel, sig, consts, variant, num_warps=dg["num_warps"]))
    return specs
