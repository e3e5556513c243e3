"""Launcher of the sparse MLA prefill kernel (op ``sparse_mla_prefill``, which writes a
caller's out and returns lse): FlashMLA ``flash_mla_sparse_fwd``'s job on sm_8x.

One program per (query, head group), no split, out and lse written in the epilogue
(csrc_triton.sparse_prefill). Same semantics and arguments as
``dsv4_ops.attention.sparse_mla_decode`` (reference: ``dsv4_ops.reference.ref_sparse_mla_decode``).

Dispatch (dsv4_ops.dispatch.prefill: static shapes and alignment only, no host sync): the
prefill kernel, config ``PREFILL_CONFIG[block_h_for(H)]``, when its programs fill the SMs
PREFILL_MIN_WAVES times over, the indices are int32 and q / kv / out are 16-byte aligned;
otherwise (a few queries do not fill the SMs: split-KV wins; int64 indices; odd views)
``dsv4_ops.attention.sparse_mla_decode`` (split-KV decode kernels + merge).
``config=`` (benchmarks, tests) forces one entry of ``CANDIDATES`` and always runs the kernel
(a config with "SPLIT" runs the split-d kernel, ``_sparse_mla_prefill_splitd_kernel``).

Launchers never sync the host and allocate only their outputs (out when not given, lse), so
they capture into CUDA graphs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import check_last_dim, check_tensor
from ._launch import fast
from .csrc_triton import sparse_prefill as _pk
from .dispatch import prefill as _prefill

HEAD_DIM = _pk.HEAD_DIM
# bf16 is the contract; fp16 is accepted so the kernel runs under the Triton interpreter,
# whose bf16 tl.dot is wrong.
QKV_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
_SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_kernel = fast(_pk._sparse_mla_prefill_kernel)
_splitd_kernel = fast(_pk._sparse_mla_prefill_splitd_kernel)


def _checked(q, kv, indices, topk_length, sink, out):
    """Detailed checks (ValueError naming the argument); returns the normalised inputs."""
    check_tensor("q", q, dtypes=QKV_DTYPES, ndim=3)
    check_last_dim("q", q, HEAD_DIM)
    dev = q.device
    T, H = q.shape[0], q.shape[1]
    check_tensor("kv", kv, dtypes=(q.dtype,), ndim=2, device=dev, device_of="q")
    check_last_dim("kv", kv, HEAD_DIM)
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, ndim=2, device=dev, device_of="q")
    if indices.shape[0] != T:
        raise ValueError(f"indices: expected {T} rows (one per query of q), got shape {tuple(indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=INDEX_DTYPES, ndim=1, device=dev, device_of="q")
        if topk_length.shape[0] != T:
            raise ValueError(f"topk_length: expected shape ({T},), got {tuple(topk_length.shape)}")
        if topk_length.dtype != torch.int32 or topk_length.stride(0) != 1:
            # Values above K act as K, so clamping first keeps the int32 cast exact.
            topk_length = topk_length.clamp(max=indices.shape[1]).to(torch.int32).contiguous()
    if sink is not None:
        check_tensor("sink", sink, dtypes=_SINK_DTYPES, ndim=1, device=dev, device_of="q")
        if sink.shape[0] != H:
            raise ValueError(f"sink: expected shape ({H},) (one logit per head), got {tuple(sink.shape)}")
        if sink.dtype != torch.float32 or sink.stride(0) != 1:
            sink = sink.to(torch.float32).contiguous()
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=3, device=dev, device_of="q")
        if tuple(out.shape) != (T, H, HEAD_DIM) or out.stride(2) != 1:
            raise ValueError(f"out: expected shape {(T, H, HEAD_DIM)} with a unit-stride last dim, got shape "
                             f"{tuple(out.shape)} strides {out.stride()}")
    q = q if q.stride(2) == 1 else q.contiguous()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    indices = indices if indices.stride(1) == 1 or indices.shape[1] <= 1 else indices.contiguous()
    return q, kv, indices, topk_length, sink


def _fast_ok(q, kv, indices, topk_length, sink, out) -> bool:
    """The common case (everything already right): dtype/shape/stride/device tests only."""
    if not (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor) and isinstance(indices, torch.Tensor)
            and q.dtype in QKV_DTYPES and q.dim() == 3 and q.shape[2] == HEAD_DIM and q.stride(2) == 1
            and kv.dtype == q.dtype and kv.dim() == 2 and kv.shape[1] == HEAD_DIM and kv.stride(1) == 1
            and indices.dtype in INDEX_DTYPES and indices.dim() == 2 and indices.shape[0] == q.shape[0]
            and (indices.stride(1) == 1 or indices.shape[1] <= 1)):
        return False
    dev = q.device
    if kv.device != dev or indices.device != dev:
        return False
    if topk_length is not None and not (
            isinstance(topk_length, torch.Tensor) and topk_length.dtype == torch.int32 and topk_length.dim() == 1
            and topk_length.shape[0] == q.shape[0] and (topk_length.stride(0) == 1 or q.shape[0] <= 1)
            and topk_length.device == dev):
        return False
    if sink is not None and not (
            isinstance(sink, torch.Tensor) and sink.dtype == torch.float32 and sink.dim() == 1
            and sink.shape[0] == q.shape[1] and (sink.stride(0) == 1 or q.shape[1] <= 1) and sink.device == dev):
        return False
    if out is not None and not (
            isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.dim() == 3
            and tuple(out.shape) == tuple(q.shape) and out.stride(2) == 1 and out.device == dev):
        return False
    return True


def _launch(q, kv, indices, topk_length, sink, sm_scale, out, block_h, cfg) -> torch.Tensor:
    """Launch the prefill kernel into out (inputs checked); returns lse fp32 [T, H]."""
    T, H = q.shape[0], q.shape[1]
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T and H:
        groups = -(-H // block_h)
        consts = (block_h, cfg["BLOCK_N"], cfg["num_stages"], cfg.get("IDX_AHEAD", False), topk_length is not None,
                  sink is not None)
        kernel = _kernel
        if cfg.get("SPLIT"):
            kernel, consts = _splitd_kernel, consts + (cfg["SPLIT"],)
        kernel(
            (T * groups,),
            (q, kv, indices, topk_length, sink, out, lse,
             H, indices.shape[1], kv.shape[0], groups, float(sm_scale),
             q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1)),
            consts, cfg["num_warps"], cfg["num_stages"])
    return lse


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                       topk_length: Optional[torch.Tensor], sink: Optional[torch.Tensor], sm_scale: float,
                       out: Optional[torch.Tensor] = None, config: Optional[Tuple[int, int]] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill attention with sink.

    q bf16 [T, H, 512] (fp16 accepted for the interpreter; last dim unit-stride); kv [N, 512]
    (q's dtype; the gathered workspace); indices int32/int64 [T, K] (rows of kv; < 0 or >= N
    is masked); topk_length int32/int64 [T] or None (positions j >= topk_length[t] masked);
    sink float [H] or None (a logit per head in the denominator; NaN or -inf: none); out bf16
    [T, H, 512] (last dim unit-stride, rows may be strided) or None (allocated).
    config: None (the dispatch of the module doc) or (block_h, i) = CANDIDATES[block_h][i]
    forced (int32 indices only). Returns out bf16 [T, H, 512] (``out`` itself when given) and
    lse fp32 [T, H] (natural log, sink included).
    """
    if not _fast_ok(q, kv, indices, topk_length, sink, out):
        q, kv, indices, topk_length, sink = _checked(q, kv, indices, topk_length, sink, out)
    T, H = q.shape[0], q.shape[1]
    if config is None:
        if not _prefill.uses_kernel(q, kv, indices, out):
            from .attention import sparse_mla_decode

            return sparse_mla_decode(q, kv, indices, topk_length, sink, sm_scale, 0, out=out)
        block_h = _pk.block_h_for(H)
        cfg = _pk.PREFILL_CONFIG[block_h]
    else:
        block_h, i = config
        if block_h not in _pk.CANDIDATES or not 0 <= i < len(_pk.CANDIDATES[block_h]):
            raise ValueError(f"config: expected (block_h, i) with block_h in {sorted(_pk.CANDIDATES)} and i an "
                             f"index of CANDIDATES[block_h], got {config!r}")
        if indices.dtype != torch.int32 or not _prefill.aligned(q, kv, out):
            raise ValueError("config: a forced prefill config takes int32 indices and 16-byte aligned q / kv / out "
                             "with row strides a multiple of 8")
        cfg = _pk.CANDIDATES[block_h][i]
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    return out, _launch(q, kv, indices, topk_length, sink, sm_scale, out, block_h, cfg)


def aot_specs():
    """Every prefill-kernel specialization: the dispatched configs (PREFILL_CONFIG) x
    topk_length or not x sink or not, and every other benchmark candidate in the
    specialization vLLM calls (topk_length and sink given). int32 indices. The kernel holds
    no fp8, so both variants run these same specs (listed once, as portable)."""
    from .aot import KernelSpec, optional_pointer

    specs = []
    for bh, cands in sorted(_pk.CANDIDATES.items()):
        for i, cfg in enumerate(cands):
            dispatched = cfg is _pk.PREFILL_CONFIG.get(bh)
            for has_len in ((False, True) if dispatched else (True,)):
                for has_sink in ((False, True) if dispatched else (True,)):
                    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "indices_ptr": "*i32", "topk_length_ptr": None,
                           "sink_ptr": None, "o_ptr": "*bf16", "lse_ptr": "*fp32",
                           "H": "i32", "K": "i32", "N": "i32", "G": "i32", "sm_scale": "fp32",
                           "stride_q_t": "i32", "stride_q_h": "i32", "stride_kv_n": "i32",
                           "stride_indices_t": "i32", "stride_o_t": "i32", "stride_o_h": "i32",
                           "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr",
                           "IDX_AHEAD": "constexpr", "HAS_TOPK_LENGTH": "constexpr", "HAS_SINK": "constexpr"}
                    consts = {"BLOCK_H": bh, "BLOCK_N": cfg["BLOCK_N"], "NUM_STAGES": cfg["num_stages"],
                              "IDX_AHEAD": cfg.get("IDX_AHEAD", False), "HAS_TOPK_LENGTH": has_len,
                              "HAS_SINK": has_sink}
                    if cfg.get("SPLIT"):
                        sig["SPLIT"] = "constexpr"
                        consts["SPLIT"] = cfg["SPLIT"]
                    optional_pointer(sig, consts, "topk_length_ptr", "*i32", has_len)
                    optional_pointer(sig, consts, "sink_ptr", "*fp32", has_sink)
                    label = (f"prefill[bh{bh},#{i},bn{cfg['BLOCK_N']},w{cfg['num_warps']},s{cfg['num_stages']}"
                             f"{',ia' if cfg.get('IDX_AHEAD') else ''}"
                             f"{',split' + str(cfg['SPLIT']) if cfg.get('SPLIT') else ''},{'len' if has_len else 'nolen'},"
                             f"{'sink' if has_sink else 'nosink'}]")
                    specs.append(KernelSpec("sparse_mla_prefill", label, _pk.kernel_for(cfg), sig, consts,
                                            "portable", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return specs
