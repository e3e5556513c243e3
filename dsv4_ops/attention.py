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
graphs; the split count comes from static shapes (dsv4_ops.decode_plan).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from ._checks import check_last_dim, check_tensor
from ._launch import fast
from . import kv_cache as _kv
from .csrc_triton import kv_cache as _kk
from .csrc_triton.decode import merge as _mk
from .csrc_triton.decode import tiles as _sk
from .csrc_triton.decode import heads as _hk
from .csrc_triton.decode import paged_chunk64 as _pk
from .csrc_triton.decode import paged_chunk128 as _vk
from .csrc_triton.decode import paged_f16dot as _v4k
from . import decode_plan as _dp
from .decode_plan import tile_splits as _heuristic_splits
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
_fused_kernel = fast(_pk._dsv4_decode_fused_kernel)
_v3_kernel = fast(_vk._dsv4_decode_v3_kernel)
_v4_kernel = fast(_v4k._dsv4_decode_v4_kernel)


@functools.lru_cache(maxsize=4096)
def heuristic_splits(T: int, H: int, K: int) -> int:
    """dsv4_ops.decode_plan.tile_splits, memoised (static shapes repeat every step)."""
    return _heuristic_splits(T, H, K)


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
    'tiles' | 'heads' or None (= env DSV4_AMPERE_DECODE_KERNEL, default auto); see
    dsv4_ops.decode_plan. tiles: split kernel + merge; heads (int32 indices only, else tiles):
    the all-heads kernel, + merge when it splits. Returns out bf16 [T, H, 512], lse fp32 [T, H]."""
    q, kv, indices, topk_length = _inputs(q, kv, indices, topk_length)
    T, H = q.shape[0], q.shape[1]
    if kernel is None:
        kernel_mode = _dp.mode()
    elif kernel in _dp.MODES:
        kernel_mode = kernel
    else:
        raise ValueError(f"kernel: expected one of {', '.join(_dp.MODES)} or None, got {kernel!r}")
    if kernel_mode in ("fused", "v3"):  # the paged kernels need the caches: over a workspace, auto's choice
        kernel_mode = "auto"
    if num_splits:
        check_splits(num_splits)
    sink = _sink(sink, H, q)
    if out is not None:
        _check_out(out, T, H, q)
    variant = variant or variant_for(q)
    if (kernel_mode == "heads" or (kernel_mode == "auto" and T >= _dp.AUTO_HEADS_MIN_T)) \
            and indices.dtype == torch.int32:
        # the heads kernel takes int32 indices only (int64 runs the tiles)
        plan = _decode_plan(T, H, indices.shape[1], q, kernel_mode, num_splits)
        if plan.kernel == "heads":
            return _launch_heads(q, kv, indices, topk_length, sink, sm_scale, plan, out, variant)
    if num_splits == 0:
        num_splits = heuristic_splits(T, H, indices.shape[1])
    o_part, lse_part = _launch_split(q, kv, indices, topk_length, sm_scale, num_splits, variant)
    return _launch_merge(o_part, lse_part, sink, out, variant)


def _decode_plan(T: int, H: int, K: int, q: torch.Tensor, kernel_mode: str, num_splits: int):
    """dsv4_ops.decode_plan.plan on q's device (CPU / interpreter: an A100's 108 SMs)."""
    dev = q.get_device()
    return _dp.plan(T, H, K, _dp.num_sms(dev) if dev >= 0 else 108, kernel_mode, num_splits)


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
    T, K1 = topk_slots.shape
    check_slots("swa_slots", swa_slots, T)
    K2 = swa_slots.shape[1]
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
        specs.extend(_fused_specs(variant, KernelSpec, optional_pointer))
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


# ---- the fused paged decode (op dsv4_decode_fused_out): gather + indices + attention ----


def _fused_slow_checks(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots,
                       swa_length, swa_block_size, sink, out) -> None:
    """The detailed checks of dsv4_decode_fused; each raises ValueError naming the argument."""
    check_tensor("q", q, dtypes=QKV_DTYPES, ndim=3)
    check_last_dim("q", q, HEAD_DIM)
    if q.stride(2) != 1:
        raise ValueError(f"q: expected unit-stride dims, got strides {q.stride()}")
    dev = q.device
    _kv.check_cache(compressed_cache, compressed_block_size)
    _kv.check_cache(swa_cache, swa_block_size)
    for name, c in (("compressed_cache", compressed_cache), ("swa_cache", swa_cache)):
        if c.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (q's device), got {c.device}")
    T = q.shape[0]
    for name, slots in (("topk_slots", topk_slots), ("swa_slots", swa_slots)):
        check_tensor(name, slots, dtypes=_kv.SLOT_DTYPES, ndim=2, device=dev, device_of="q")
        if slots.shape[0] != T:
            raise ValueError(f"{name}: expected {T} rows (one per token of q), got shape {tuple(slots.shape)}")
    for name, length in (("topk_length", topk_length), ("swa_length", swa_length)):
        if length is not None:
            check_tensor(name, length, dtypes=_kv.SLOT_DTYPES, ndim=1, device=dev, device_of="q")
            if length.shape[0] < T:
                raise ValueError(f"{name}: expected at least {T} values (one per token), got {tuple(length.shape)}")
    _sink(sink, q.shape[1], q)
    if out is not None:
        _check_out(out, T, q.shape[1], q)


def _fused_plan(T: int, H: int, K: int, q: torch.Tensor, num_splits: int):
    dev = q.get_device()
    return _dp.fused_plan(T, H, K, _dp.num_sms(dev) if dev >= 0 else 108, num_splits)


def dsv4_decode_fused(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                      topk_length: Optional[torch.Tensor], compressed_block_size: int, swa_cache: torch.Tensor,
                      swa_slots: torch.Tensor, swa_length: Optional[torch.Tensor], swa_block_size: int,
                      sink: Optional[torch.Tensor], sm_scale: float, num_splits: int = 0,
                      out: Optional[torch.Tensor] = None, variant: Optional[str] = None,
                      form: Optional[str] = None, config: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """One DSv4 decode attention step read straight from the paged caches (op
    ``dsv4_decode_fused_out``): no workspace, one kernel (+ the merge when it splits).

    q bf16 [T, H, 512] (fp16 accepted for the interpreter; dims unit-stride);
    compressed_cache, swa_cache uint8 [num_blocks, page_bytes] (fp8_ds_mla records);
    topk_slots int32/int64 [T, K1], swa_slots int32/int64 [T, K2] (entries contiguous);
    topk_length / swa_length int32/int64 [>= T] or None (entries j >= length[t] ignored);
    sink float [H] or None; num_splits 0 = decode_plan.fused_plan's count, else 1..64;
    out bf16 [T, H, 512] (dims unit-stride) or None (allocated).
    Semantics: dsv4_decode_gather's valid entries (slot in [0, capacity) of its cache and
    within the token's length), attended as sparse_mla_decode does with the sink.
    form: 'v1' (csrc_triton.decode.paged_chunk64) | 'v3' (csrc_triton.decode.paged_chunk128, 16-byte
    aligned caches only; else v1) | None (decode_plan.fused_form); config: a
    paged_chunk128.V3_CANDIDATES or paged_f16dot.V4_CANDIDATES name to force (benchmarks),
    '' = decode_plan.v3_config_name.
    Returns out bf16 [T, H, 512] (``out`` itself when given), lse fp32 [T, H].
    """
    ok = (isinstance(q, torch.Tensor) and isinstance(topk_slots, torch.Tensor) and isinstance(swa_slots, torch.Tensor)
          and isinstance(compressed_cache, torch.Tensor) and isinstance(swa_cache, torch.Tensor)
          and q.dtype in QKV_DTYPES and q.dim() == 3 and q.shape[2] == HEAD_DIM and q.stride(2) == 1
          and topk_slots.dtype in _kv.SLOT_DTYPES and swa_slots.dtype in _kv.SLOT_DTYPES
          and topk_slots.dim() == 2 and swa_slots.dim() == 2
          and topk_slots.shape[0] == q.shape[0] and swa_slots.shape[0] == q.shape[0])
    if ok:
        dev = q.get_device()
        ok = (compressed_cache.get_device() == dev and swa_cache.get_device() == dev
              and topk_slots.get_device() == dev and swa_slots.get_device() == dev)
        for length in (topk_length, swa_length):
            ok = ok and (length is None or (isinstance(length, torch.Tensor) and length.dtype in _kv.SLOT_DTYPES
                                            and length.dim() == 1 and length.shape[0] >= q.shape[0]
                                            and length.get_device() == dev))
    if not ok:
        _fused_slow_checks(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                           swa_slots, swa_length, swa_block_size, sink, out)
    _kv.check_cache(compressed_cache, compressed_block_size)
    _kv.check_cache(swa_cache, swa_block_size)
    T, H = q.shape[0], q.shape[1]
    K1, K2 = topk_slots.shape[1], swa_slots.shape[1]
    if num_splits:
        check_splits(num_splits)
    sink = _sink(sink, H, q)
    if out is not None:
        _check_out(out, T, H, q)
    if K1 and topk_slots.stride(1) != 1:
        topk_slots = topk_slots.contiguous()
    if K2 and swa_slots.stride(1) != 1:
        swa_slots = swa_slots.contiguous()
    if topk_length is not None and topk_length.stride(0) != 1:
        topk_length = topk_length.contiguous()
    if swa_length is not None and swa_length.stride(0) != 1:
        swa_length = swa_length.contiguous()
    variant = variant or variant_for(q)
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    if form is None:
        form = _dp.fused_form(T, H, K1 + K2, _dp.smem_per_block(q.get_device()))
    if form == "v3" and not (compressed_cache.data_ptr() % 16 or swa_cache.data_ptr() % 16
                             or compressed_cache.stride(0) % 16 or swa_cache.stride(0) % 16):
        return _launch_v3(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots,
                          swa_length, swa_block_size, sink, sm_scale, num_splits, out, variant, config)
    plan = _fused_plan(T, H, K1 + K2, q, num_splits)
    cfg = _pk.FUSED_CONFIG[plan.block_h]
    consts_head = (plan.block_h, plan.block_n, variant == "native", topk_length is not None, swa_length is not None)
    scalars = (compressed_cache.stride(0), compressed_block_size, compressed_cache.shape[0] * compressed_block_size,
               swa_cache.stride(0), swa_block_size, swa_cache.shape[0] * swa_block_size)
    if plan.direct:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T and H:
            _fused_kernel(
                (T * plan.groups,),
                (q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, sink, out, lse,
                 H, K1, K2, 1, plan.groups, float(sm_scale),
                 q.stride(0), q.stride(1), topk_slots.stride(0), swa_slots.stride(0), out.stride(0), out.stride(1),
                 *scalars),
                consts_head + (sink is not None, True, cfg["PIPELINE"]), cfg["num_warps"],
                cfg["num_stages"])
        return out, lse
    S = plan.splits
    o_part, lse_part = split_outputs_like(q, S)
    if T and H:
        _fused_kernel(
            (T * S * plan.groups,),
            (q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, None, o_part, lse_part,
             H, K1, K2, S, plan.groups, float(sm_scale),
             q.stride(0), q.stride(1), topk_slots.stride(0), swa_slots.stride(0), 0, 0, *scalars),
            consts_head + (False, False, cfg["PIPELINE"]), cfg["num_warps"], cfg["num_stages"])
    return _launch_merge(o_part, lse_part, sink, out, variant)


def _launch_v3(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots, swa_length,
               swa_block_size, sink, sm_scale, num_splits, out, variant, config):
    """The v3 form over 16-byte aligned caches, inputs checked: csrc_triton.decode.paged_chunk128 or, for a
    paged_f16dot config (decode_plan.v3_config), the fp16-dot kernel of the same contract."""
    T, H = q.shape[0], q.shape[1]
    K1, K2 = topk_slots.shape[1], swa_slots.shape[1]
    dev = q.get_device()
    name = config or _dp.v3_config_name(T, H, K1 + K2, _dp.smem_per_block(dev))
    cfg = _dp.v3_config(name)
    pow2 = not (compressed_block_size & (compressed_block_size - 1) or swa_block_size & (swa_block_size - 1))
    if "PV_KEY" in cfg and not pow2:  # the v4 kernel takes power-of-two block sizes (as shifts)
        name = "h16n32w4"
        cfg = _dp.v3_config(name)
    plan = _dp.v3_plan(T, H, K1 + K2, _dp.num_sms(dev) if dev >= 0 else 108, num_splits, name)
    consts_head = (plan.block_h, plan.block_n, variant == "native", topk_length is not None, swa_length is not None)
    scalars = (compressed_cache.stride(0), compressed_block_size, compressed_cache.shape[0] * compressed_block_size,
               swa_cache.stride(0), swa_block_size, swa_cache.shape[0] * swa_block_size)
    if "PV_KEY" in cfg:  # csrc_triton.decode.paged_f16dot (the fp16-dot decode): block sizes as shifts
        scalars = (scalars[0], compressed_block_size.bit_length() - 1, scalars[2],
                   scalars[3], swa_block_size.bit_length() - 1, scalars[5])
        kernel, consts_tail = _v4_kernel, (True, cfg["PV_KEY"])
        if cfg.get("maxnreg") and _v4_kernel.jit:  # register-capped: the plain launch (no fast path for it)
            def kernel(grid, args, consts, num_warps, num_stages, _n=cfg["maxnreg"]):
                _v4k._dsv4_decode_v4_kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages,
                                                  maxnreg=_n)
    else:
        kernel, consts_tail = _v3_kernel, (cfg["PIPE"], True)
    if plan.direct:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T and H:
            kernel(
                (T * plan.groups,),
                (q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, sink, out, lse,
                 H, K1, K2, 1, plan.groups, float(sm_scale),
                 q.stride(0), q.stride(1), topk_slots.stride(0), swa_slots.stride(0), out.stride(0), out.stride(1),
                 *scalars),
                consts_head + (sink is not None, True) + consts_tail, cfg["num_warps"], cfg["num_stages"])
        return out, lse
    S = plan.splits
    o_part, lse_part = split_outputs_like(q, S)
    if T and H:
        kernel(
            (T * S * plan.groups,),
            (q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, None, o_part, lse_part,
             H, K1, K2, S, plan.groups, float(sm_scale),
             q.stride(0), q.stride(1), topk_slots.stride(0), swa_slots.stride(0), 0, 0, *scalars),
            consts_head + (False, False) + consts_tail, cfg["num_warps"], cfg["num_stages"])
    return _launch_merge(o_part, lse_part, sink, out, variant)


def _fused_specs(variant, KernelSpec, optional_pointer):
    """Specializations of the fused paged kernel dsv4_decode_fused can pick: every head-group
    config x slot dtype (both caches alike) x lengths (none | top-k | both) x (partials |
    direct with sink | direct); plus the PIPELINE configs (``fused-pipe[...]``, not dispatched
    yet: benchmarked beside the default, kept compiling and spill-free), and the dispatched v3
    (``v3-...``) and v4 (``v4-...``: csrc_triton.decode.paged_f16dot) configs of the v3 form."""
    specs = []
    configs = [("fused", bh, cfg) for bh, cfg in sorted(_pk.FUSED_CONFIG.items())]
    configs += [("fused-pipe", bh, cfg) for bh, cfg in sorted(_pk.FUSED_PIPELINE_CONFIG.items())]
    configs += [(f"v3-{n}", _vk.V3_CANDIDATES[n]["BLOCK_H"], _vk.V3_CANDIDATES[n]) for n in _vk.V3_DISPATCHED]
    configs += [(f"v4-{n}", _v4k.V4_CANDIDATES[n]["BLOCK_H"], _v4k.V4_CANDIDATES[n]) for n in _v4k.V4_DISPATCHED]
    from .aot import archs_holding

    for name, bh, cfg in configs:
        v3 = name.startswith(("v3-", "v4-"))
        v4 = name.startswith("v4-")
        need = _v4k.V4_SMEM_BYTES.get(name[3:], 0) if v4 else 0
        archs = archs_holding(need) if need else ()
        for slot_ty in ("i32", "i64"):
            for has_tl, has_sl in ((False, False), (True, False), (True, True)):
                for direct, has_sink in ((False, False), (True, True), (True, False)):
                    sig = {"q_ptr": "*bf16", "cc_ptr": "*u8", "topk_ptr": f"*{slot_ty}", "topk_len_ptr": None,
                           "cw_ptr": "*u8", "swa_ptr": f"*{slot_ty}", "swa_len_ptr": None, "sink_ptr": None,
                           "o_ptr": "*bf16" if direct else "*fp32", "lse_ptr": "*fp32",
                           "H": "i32", "K1": "i32", "K2": "i32", "S": "i32", "G": "i32", "sm_scale": "fp32",
                           "stride_q_t": "i32", "stride_q_h": "i32", "stride_topk_t": "i32", "stride_swa_t": "i32",
                           "stride_o_t": "i32", "stride_o_h": "i32",
                           "page_c": "i32", "bs_c": "i32", "cap_c": "i64", "page_w": "i32", "bs_w": "i32",
                           "cap_w": "i64",
                           "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "NATIVE": "constexpr",
                           "HAS_TOPK_LEN": "constexpr", "HAS_SWA_LEN": "constexpr", "HAS_SINK": "constexpr",
                           "DIRECT": "constexpr"}
                    if not v4:
                        sig["PIPE" if v3 else "PIPELINE"] = "constexpr"
                    if v3:
                        sig["ALIGN"] = "constexpr"
                    if v4:
                        sig["PV_KEY"] = "constexpr"
                    consts = {"BLOCK_H": bh, "BLOCK_N": cfg["BLOCK_N"], "NATIVE": variant == "native",
                              "HAS_TOPK_LEN": has_tl, "HAS_SWA_LEN": has_sl, "HAS_SINK": has_sink, "DIRECT": direct}
                    if v4:
                        consts["ALIGN"] = True
                        consts["PV_KEY"] = cfg["PV_KEY"]
                    elif v3:
                        consts["PIPE"] = cfg["PIPE"]
                        consts["ALIGN"] = True
                    else:
                        consts["PIPELINE"] = cfg["PIPELINE"]
                    optional_pointer(sig, consts, "topk_len_ptr", f"*{slot_ty}", has_tl)
                    optional_pointer(sig, consts, "swa_len_ptr", f"*{slot_ty}", has_sl)
                    optional_pointer(sig, consts, "sink_ptr", "*fp32", has_sink)
                    epi = "direct,sink" if has_sink else ("direct" if direct else "part")
                    lens = ("tl" if has_tl else "-") + (",sl" if has_sl else "")
                    specs.append(KernelSpec(
                        "dsv4_decode_fused_out", f"{name}[{variant},bh{bh},{slot_ty},{lens},{epi}]",
                        _v4k._dsv4_decode_v4_kernel if v4 else (_vk._dsv4_decode_v3_kernel if v3 else
                                                                _pk._dsv4_decode_fused_kernel), sig, consts, variant,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], archs=archs))
    return specs
