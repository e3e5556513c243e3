"""Launcher of the Engram row lookup (op ``engram_lookup``, DeepSeek-V4.1).

Same inputs and output as vLLM 0.33.0's ``_engram_lookup_kernel``
(``vllm/models/deepseek_v41/common/engram.py``, kernel at L640, launched by
``ParallelEngramEmbedding.lookup`` at L1180-1235), with the table read as uint8:

- rows: ``num_rows = T * local_heads``; output row r is token ``r // local_heads``, local
  head ``r % local_heads``, global hash column ``head = head_start + r % local_heads``.
- id: ``ids[token, head]`` (any strides; int32 in vLLM); a column ``head >= total_heads``
  (padding of the last shard) reads nothing. Owned when ``vocab_start <= id < vocab_end``;
  the table row is ``id - vocab_start``.
- bf16 output (``out`` bf16 [T, local_heads, DIM]): ``e4m3(weight[row, c]) *
  2**(scales[row, c // QUANT_BLOCK] - 127)`` rounded to bf16; the scale is built from the
  byte as the fp32 exponent field, so byte 0 gives 0.0 (vLLM does the same). A row that is
  not owned is written as zeros.
- packed output (``out`` uint8 [T, local_heads, DIM + DIM // QUANT_BLOCK], vLLM's
  ``PACKED=True`` for its MXFP8 batch path): the DIM code bytes, then the scale bytes;
  zeros for a row that is not owned.
- sorted mode (``sorted_dst`` given; vLLM's ``SORTED``, which it uses only on sm_100 for
  big host lookups): ``ids`` is 1-D [num_rows] of rows relative to ``vocab_start`` in
  table order and ``sorted_dst[i]`` the output row of entry i.
- Differences, on inputs vLLM never passes: a table row at or past ``weight.shape[0]`` is
  never read (zeros); the NaN codes 0x7F/0xFF decode to +-480 on the portable path (vLLM:
  NaN). vLLM's peer-read mode (``PEER_ROWS``, GPU tables split over a DP group) is not an
  input of this op.

UVA: ``weight`` / ``scales`` may be CUDA views of pinned host memory (vLLM's default:
``EngramConfig.cpu_offload``); each row is read once, 16 bytes a load.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ._checks import check_same_device, check_tensor
from .csrc_triton import engram as _k
from .dispatch import device as _device
from .dispatch import variant_for

ID_DTYPES = (torch.int32, torch.int64)
TABLE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# Programs a launch uses at most when max_programs == 0 and the device is not a GPU.
_CPU_PROGRAMS = 4


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def as_uint8_table(weight: torch.Tensor) -> torch.Tensor:
    """The E4M3 table as uint8 (a view; float8_e4m3fn and uint8 share the bytes)."""
    return weight.view(torch.uint8) if weight.dtype == torch.float8_e4m3fn else weight


def check_lookup_args(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                      sorted_dst=None, max_programs=0) -> None:
    """ValueError naming the bad argument of engram_lookup."""
    check_tensor("weight", weight, dtypes=TABLE_DTYPES, ndim=2)
    check_tensor("scales", scales, dtypes=(torch.uint8,), ndim=2)
    check_tensor("out", out, dtypes=(torch.bfloat16, torch.uint8), ndim=3)
    check_same_device(out=out, weight=weight, scales=scales, ids=ids, sorted_dst=sorted_dst)
    dim = weight.shape[1]
    if weight.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"weight, scales: expected contiguous rows, got strides {weight.stride()} and "
                         f"{scales.stride()}")
    if scales.shape[0] != weight.shape[0]:
        raise ValueError(f"scales: expected {weight.shape[0]} rows (one per weight row), got {scales.shape[0]}")
    n_scales = scales.shape[1]
    if n_scales == 0 or dim % n_scales or not _pow2(dim) or not _pow2(n_scales):
        raise ValueError(f"weight/scales: expected power-of-two DIM with DIM % n_scales == 0, got DIM {dim} "
                         f"and {n_scales} scales a row")
    width = dim + n_scales if out.dtype == torch.uint8 else dim
    if out.shape[2] != width or out.stride(2) != 1:
        raise ValueError(f"out: expected last dim {width} (contiguous) for dtype "
                         f"{str(out.dtype).replace('torch.', '')}, got shape {tuple(out.shape)} strides {out.stride()}")
    for name, v in (("vocab_start", vocab_start), ("vocab_end", vocab_end), ("head_start", head_start),
                    ("total_heads", total_heads), ("max_programs", max_programs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    if vocab_end < vocab_start:
        raise ValueError(f"vocab_end: expected >= vocab_start ({vocab_start}), got {vocab_end}")
    if sorted_dst is None:
        check_tensor("ids", ids, dtypes=ID_DTYPES, ndim=2)
        if out.shape[0] < ids.shape[0]:
            raise ValueError(f"out: {out.shape[0]} token rows for {ids.shape[0]} tokens of ids")
        if ids.shape[1] < min(total_heads, head_start + out.shape[1]):
            raise ValueError(f"ids: {ids.shape[1]} hash columns, but this shard reads columns "
                             f"{head_start}..{min(total_heads, head_start + out.shape[1]) - 1}")
    else:
        check_tensor("ids", ids, dtypes=ID_DTYPES, ndim=1, contiguous=True)
        check_tensor("sorted_dst", sorted_dst, dtypes=ID_DTYPES, ndim=1, contiguous=True)
        if sorted_dst.shape[0] != ids.shape[0]:
            raise ValueError(f"sorted_dst: expected {ids.shape[0]} entries (one per id), got {sorted_dst.shape[0]}")
        if ids.shape[0] > out.shape[0] * out.shape[1]:
            raise ValueError(f"ids: {ids.shape[0]} sorted rows do not fit out ({out.shape[0]} x {out.shape[1]} rows)")


def num_rows(ids: torch.Tensor, out: torch.Tensor, sorted_dst: Optional[torch.Tensor]) -> int:
    """Output rows a lookup writes: T * local_heads (sorted: ids.numel())."""
    return ids.shape[0] if sorted_dst is not None else ids.shape[0] * out.shape[1]


def default_programs(device: torch.device) -> int:
    """Persistent-grid size when max_programs == 0: LOOKUP_CONFIG['PROGRAMS_PER_SM'] per SM
    (dispatch.device.num_sms: DSV4_AMPERE_SMS overrides the device's count)."""
    if device.type != "cuda":
        return _CPU_PROGRAMS
    sms = _device.num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return sms * _k.LOOKUP_CONFIG["PROGRAMS_PER_SM"]


def engram_lookup(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                  vocab_start: int, vocab_end: int, head_start: int, total_heads: int,
                  sorted_dst: Optional[torch.Tensor] = None, max_programs: int = 0,
                  variant: Optional[str] = None) -> None:
    """Gather this shard's Engram rows into ``out``, in place (see the module docstring).

    weight: E4M3 table, uint8 or float8_e4m3fn [R, DIM] (read as uint8); scales: uint8
    [R, DIM // QUANT_BLOCK] UE8M0 bytes; both may be CUDA views of pinned host memory.
    ids: int32/int64 [T, >= total_heads] hash ids (sorted mode: [num_rows] local rows, with
    sorted_dst [num_rows] output rows). out: bf16 [T', local_heads, DIM] (T' >= T) or uint8
    [T', local_heads, DIM + DIM // QUANT_BLOCK] (packed bytes). max_programs: persistent
    grid size (0: LOOKUP_CONFIG['PROGRAMS_PER_SM'] per SM). Never syncs the host.
    """
    check_lookup_args(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                      sorted_dst, max_programs)
    rows = num_rows(ids, out, sorted_dst)
    if rows == 0:
        return
    variant = variant or variant_for(out)
    cfg = _k.LOOKUP_CONFIG
    table = as_uint8_table(weight)
    programs = min(triton.cdiv(rows, cfg["BLOCK_R"]), max_programs or default_programs(out.device))
    sorted_mode = sorted_dst is not None
    _k._engram_lookup_kernel[(programs,)](
        table, scales, ids, sorted_dst if sorted_mode else ids, out,
        vocab_start, vocab_end, table.shape[0], rows,
        ids.stride(0), ids.stride(1) if ids.dim() == 2 else 0,
        table.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        head_start, out.shape[1], total_heads, programs,
        DIM=table.shape[1], QUANT_BLOCK=table.shape[1] // scales.shape[1], BLOCK_R=cfg["BLOCK_R"],
        SORTED=sorted_mode, PACKED=out.dtype == torch.uint8, NATIVE=variant == "native",
        num_warps=cfg["num_warps"])


# Table geometries the AOT check compiles: (DIM, QUANT_BLOCK). V4.1-Flash: 256-byte rows.
AOT_GEOMETRIES = ((256, 32),)


def aot_specs():
    """Every Engram lookup specialization a launcher can pick, for the known geometries."""
    from .aot import KernelSpec

    cfg = _k.LOOKUP_CONFIG
    specs = []
    for variant in ("portable", "native"):
        for dim, qb in AOT_GEOMETRIES:
            for packed in (False, True):
                for sorted_mode, id_ty in ((False, "i32"), (False, "i64"), (True, "i64")):
                    sig = {"weight_ptr": "*u8", "scales_ptr": "*u8", "ids_ptr": f"*{id_ty}",
                           "dst_ptr": "*i32" if sorted_mode else f"*{id_ty}",
                           "out_ptr": "*u8" if packed else "*bf16"}
                    sig.update({n: "i32" for n in (
                        "vocab_start", "vocab_end", "n_table_rows", "num_rows", "ids_stride_t", "ids_stride_h",
                        "stride_w_0", "stride_s_0", "stride_out_t", "stride_out_h", "head_start",
                        "local_heads", "total_heads", "grid_size")})
                    sig.update({n: "constexpr" for n in ("DIM", "QUANT_BLOCK", "BLOCK_R", "SORTED", "PACKED",
                                                         "NATIVE")})
                    label = (f"lookup[{variant},{'packed' if packed else 'bf16'},"
                             f"{'sorted' if sorted_mode else 'ids:' + id_ty},D{dim}]")
                    specs.append(KernelSpec(
                        "engram_lookup", label, _k._engram_lookup_kernel, sig,
                        {"DIM": dim, "QUANT_BLOCK": qb, "BLOCK_R": cfg["BLOCK_R"], "SORTED": sorted_mode,
                         "PACKED": packed, "NATIVE": variant == "native"}, variant, num_warps=cfg["num_warps"]))
    return specs


def pinned_cuda_view(cpu_tensor: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """A CUDA tensor that aliases a pinned host tensor through UVA (no copy), as vLLM's
    ``get_accelerator_view_from_cpu_tensor`` makes for Engram tables; torch only, so tests
    and benchmarks run without vLLM. The caller keeps ``cpu_tensor`` alive as long as the view.
    ValueError if the tensor is not pinned or contiguous."""
    check_tensor("cpu_tensor", cpu_tensor, device=torch.device("cpu"), contiguous=True)
    if cpu_tensor.dim() == 0 or not cpu_tensor.is_pinned():
        raise ValueError("cpu_tensor: expected pinned host memory with >= 1 dim (torch.empty(..., pin_memory=True))")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    raw = cpu_tensor.view(torch.uint8)  # bytes; the last dim grows by the element size

    class _Iface:  # the pinned pointer is a device pointer under UVA (64-bit Linux CUDA)
        __cuda_array_interface__ = {"shape": tuple(raw.shape), "typestr": "|u1", "data": (raw.data_ptr(), False),
                                    "version": 3, "strides": None}

    with torch.cuda.device(device):
        view = torch.as_tensor(_Iface(), device=device)
    return view.view(cpu_tensor.dtype)
