"""Launcher of the paged DeepSeek-V4 decode (op ``dsv4_decode_fused_out``): one decode step read
straight from the two paged fp8_ds_mla caches, no workspace and no gather launch (+ the merge
when it splits).

A launch config (dispatch.decode.resolve_config) runs csrc_triton.decode.paged_chunk128 (configs h...,
4 x 128-dim chunks, any 2-byte aligned records) or csrc_triton.decode.paged_f16dot (configs kh / gh...,
the E4M3 codes as fp16 dot operands; 16-byte aligned caches). Every decision of a call is
dispatch.decode.plan_step's, turned into a launch by dsv4_ops.paged_plan.make_paged_plan (one home,
shared with the composite's kept plans). Semantics: the workspace
step's (dsv4_ops.dsv4_decode), reference ``reference.ref_dsv4_decode_fused``.

Launchers never sync the host and allocate only their outputs (plus the partials when they
split), so they capture into CUDA graphs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import kv_cache as _kv
from ._checks import check_last_dim, check_tensor
from . import paged_plan as _pp
from .attention import HEAD_DIM, QKV_DTYPES, _check_out, _sink, check_splits
from .csrc_triton.decode import balance as _bk
from .csrc_triton.decode import merge as _mk
from .csrc_triton.decode import paged_chunk128 as _vk
from .csrc_triton.decode import paged_f16dot as _v4k
from .dispatch import variant_for

_v3_kernel, _v4_kernel = _pp._v3_kernel, _pp._v4_kernel


def check_fused_args(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots,
                     swa_length, swa_block_size, sink, out) -> None:
    """The detailed checks of dsv4_decode_fused (and of the op's CPU reference); each raises
    ValueError naming the argument."""
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


def dsv4_decode_fused(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                      topk_length: Optional[torch.Tensor], compressed_block_size: int, swa_cache: torch.Tensor,
                      swa_slots: torch.Tensor, swa_length: Optional[torch.Tensor], swa_block_size: int,
                      sink: Optional[torch.Tensor], sm_scale: float, num_splits: int = 0,
                      out: Optional[torch.Tensor] = None, variant: Optional[str] = None,
                      config: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """One DSv4 decode attention step read straight from the paged caches (op
    ``dsv4_decode_fused_out``): no workspace, one kernel (+ the merge when it splits).

    q bf16 [T, H, 512] (fp16 accepted for the interpreter; dims unit-stride);
    compressed_cache, swa_cache uint8 [num_blocks, page_bytes] (fp8_ds_mla records);
    topk_slots int32/int64 [T, K1], swa_slots int32/int64 [T, K2] (entries contiguous);
    topk_length / swa_length int32/int64 [>= T] or None (entries j >= length[t] ignored);
    sink float [H] or None; num_splits 0 = the plan's count (dispatch.decode), else 1..64;
    out bf16 [T, H, 512] (dims unit-stride) or None (allocated).
    Semantics: dsv4_decode_gather's valid entries (slot in [0, capacity) of its cache and
    within the token's length), attended as sparse_mla_decode does with the sink.
    config: a paged_chunk128.V3_CANDIDATES or paged_f16dot.V4_CANDIDATES name to force (benchmarks;
    a paged_f16dot config over caches that are not 16-byte aligned runs paged_chunk128's), '' =
    dispatch.decode.plan_step's.
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
        check_fused_args(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
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
    plan = _pp.make_paged_plan(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                               swa_slots, swa_length, swa_block_size, sink is not None, num_splits, out, variant,
                               config)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if plan.direct:
        _pp.launch_paged(plan, q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, sink,
                         sm_scale, out, lse)
        return out, lse
    o_part, lse_part = (torch.empty(s, dtype=torch.float32, device=q.device) for s in plan.partials_shape())
    _pp.launch_paged(plan, q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, sink,
                     sm_scale, out, lse, o_part, lse_part)
    return out, lse


def _fused_specs(variant, KernelSpec, optional_pointer):
    """Specializations of the paged kernels dsv4_decode_fused can pick: every dispatched config of
    paged_chunk128 (``v3-...``, 16-byte aligned reads; ``v3u-...``, its unaligned config) and paged_f16dot
    (``v4-...``) x slot dtype (both caches alike) x lengths (none | top-k | both) x (partials | direct
    with sink | direct | balanced partials)."""
    specs = []
    configs = [(f"v3-{n}", _vk.V3_CANDIDATES[n]["BLOCK_H"], _vk.V3_CANDIDATES[n]) for n in _vk.V3_DISPATCHED]
    configs += [(f"v3u-{n}", _vk.V3_CANDIDATES[n]["BLOCK_H"], _vk.V3_CANDIDATES[n]) for n in _vk.V3_UNALIGNED]
    configs += [(f"v4-{n}", _v4k.V4_CANDIDATES[n]["BLOCK_H"], _v4k.V4_CANDIDATES[n]) for n in _v4k.V4_DISPATCHED]
    from .aot import archs_holding

    for name, bh, cfg in configs:
        v4 = name.startswith("v4-")
        need = _v4k.V4_SMEM_BYTES.get(name[3:], 0) if v4 else 0
        archs = archs_holding(need) if need else ()
        for slot_ty in ("i32", "i64"):
            for has_tl, has_sl in ((False, False), (True, False), (True, True)):
                for direct, has_sink, bal in ((False, False, False), (True, True, False), (True, False, False),
                                              (False, False, True)):
                    if bal and not (v4 and has_tl and slot_ty == "i32"):  # dispatch.decode.balanced's cases
                        continue
                    sig = {"q_ptr": "*bf16", "cc_ptr": "*u8", "topk_ptr": f"*{slot_ty}", "topk_len_ptr": None,
                           "cw_ptr": "*u8", "swa_ptr": f"*{slot_ty}", "swa_len_ptr": None, "sink_ptr": None,
                           "o_ptr": "*bf16" if direct else "*fp32", "lse_ptr": "*fp32"}
                    if v4:
                        sig["plan_ptr"] = None
                    sig.update({"H": "i32", "K1": "i32", "K2": "i32", "S": "i32", "G": "i32", "sm_scale": "fp32",
                           "stride_q_t": "i32", "stride_q_h": "i32", "stride_topk_t": "i32", "stride_swa_t": "i32",
                           "stride_o_t": "i32", "stride_o_h": "i32",
                           "page_c": "i32", "bs_c": "i32", "cap_c": "i64", "page_w": "i32", "bs_w": "i32",
                           "cap_w": "i64",
                           "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "NATIVE": "constexpr",
                           "HAS_TOPK_LEN": "constexpr", "HAS_SWA_LEN": "constexpr", "HAS_SINK": "constexpr",
                           "DIRECT": "constexpr"})
                    if not v4:
                        sig["PIPE"] = "constexpr"
                    sig["ALIGN"] = "constexpr"
                    if v4:
                        sig["PV_KEY"] = "constexpr"
                        sig["STREAM"] = "constexpr"
                        sig["WIDE_PV"] = "constexpr"
                        sig["BALANCED"] = "constexpr"
                    consts = {"BLOCK_H": bh, "BLOCK_N": cfg["BLOCK_N"], "NATIVE": variant == "native",
                              "HAS_TOPK_LEN": has_tl, "HAS_SWA_LEN": has_sl, "HAS_SINK": has_sink, "DIRECT": direct}
                    if v4:
                        consts["ALIGN"] = True
                        consts["PV_KEY"] = cfg["PV_KEY"]
                        consts["STREAM"] = cfg.get("STREAM", False)
                        consts["WIDE_PV"] = cfg.get("WIDE_PV", False)
                        consts["BALANCED"] = bal
                        optional_pointer(sig, consts, "plan_ptr", "*i32", bal)
                    else:
                        consts["PIPE"] = cfg["PIPE"]
                        consts["ALIGN"] = not name.startswith("v3u-")
                    optional_pointer(sig, consts, "topk_len_ptr", f"*{slot_ty}", has_tl)
                    optional_pointer(sig, consts, "swa_len_ptr", f"*{slot_ty}", has_sl)
                    optional_pointer(sig, consts, "sink_ptr", "*fp32", has_sink)
                    epi = "direct,sink" if has_sink else ("direct" if direct else ("part,balanced" if bal else "part"))
                    lens = ("tl" if has_tl else "-") + (",sl" if has_sl else "")
                    specs.append(KernelSpec(
                        "dsv4_decode_fused_out", f"{name}[{variant},bh{bh},{slot_ty},{lens},{epi}]",
                        _v4k._dsv4_decode_v4_kernel if v4 else _vk._dsv4_decode_v3_kernel, sig, consts, variant,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], archs=archs))
    for bn in sorted({c["BLOCK_N"] for _, _, c in configs if c is not None and "PV_KEY" in c}):
        for has_sl in (False, True):  # the planning kernel: top-k lengths always (dispatch.decode.balanced)
            sig = {"topk_len_ptr": "*i32", "swa_len_ptr": None, "plan_ptr": "*i32", "T": "i32", "S": "i32",
                   "K1": "i32", "K2": "i32", "BLOCK_N": "constexpr", "HAS_TOPK_LEN": "constexpr",
                   "HAS_SWA_LEN": "constexpr", "CHUNK": "constexpr"}
            consts = {"BLOCK_N": bn, "HAS_TOPK_LEN": True, "HAS_SWA_LEN": has_sl, "CHUNK": _pp.BALANCE_CHUNK}
            optional_pointer(sig, consts, "swa_len_ptr", "*i32", has_sl)
            specs.append(KernelSpec("dsv4_decode_fused_out", f"balance-plan[{variant},bn{bn},{'sl' if has_sl else '-'}]",
                                    _bk._balance_plan_kernel, sig, consts, variant, num_warps=4, num_stages=1))
    s = 2  # the balanced merge, BLOCK_S = the plan's S rounded up (a split launch: S >= 2), capped
    while s <= _pp.BALANCED_MERGE_ROWS:
        mcfg = _mk.merge_config(s, 512)
        for has_sink in (False, True):
            sig = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "plan_ptr": "*i32", "sink_ptr": None,
                   "out_ptr": "*bf16", "lse_ptr": "*fp32", "H": "i32", "P": "i32", "stride_out_t": "i32",
                   "stride_out_h": "i32", "D": "constexpr", "BLOCK_S": "constexpr", "BLOCK_D": "constexpr",
                   "HAS_SINK": "constexpr"}
            consts = {"D": 512, "BLOCK_S": mcfg["BLOCK_S"], "BLOCK_D": mcfg["BLOCK_D"], "HAS_SINK": has_sink}
            optional_pointer(sig, consts, "sink_ptr", "*fp32", has_sink)
            specs.append(KernelSpec(
                "dsv4_decode_fused_out", f"merge-balanced[{variant},S<={s},{'sink' if has_sink else 'nosink'}]",
                _mk._merge_balanced_kernel, sig, consts, variant,
                num_warps=mcfg["num_warps"], num_stages=mcfg["num_stages"]))
        s *= 2
    return specs


def aot_specs():
    """Every paged-decode kernel specialization dsv4_decode_fused can pick (see dsv4_ops.aot)."""
    from .aot import KernelSpec, optional_pointer

    specs = []
    for variant in ("portable", "native"):
        specs.extend(_fused_specs(variant, KernelSpec, optional_pointer))
    return specs
