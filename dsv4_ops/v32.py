"""Launchers of the DeepSeek-V3.2 / GLM-5 MLA ops: the 656-byte ``fp8_ds_mla`` cache (and the
bf16 ``auto`` cache) and sparse MLA with d_qk = 576, d_v = 512, no sink.

Ops (``torch.ops.dsv4_ampere.*``, registered by registration/v32_ops.py):
  v32_kv_insert(kv_c, k_pe, kv_cache, slot_mapping)            in place
  v32_kv_gather(kv_cache, slots) -> bf16 slots.shape + (576,)
  v32_kv_gather_into(kv_cache, slots, out, row_offset)         in place
  v32_sparse_mla_decode(q, kv_cache, indices, topk_length, sm_scale, num_splits) -> (out, lse)
  v32_sparse_mla_decode_out(..., out) -> lse
  v32_sparse_mla_prefill(q, kv, indices, topk_length, sm_scale) -> (out, lse)
  v32_sparse_mla_prefill_out(..., out) -> lse

Layouts: dsv4_ops.layout (V3.2 section). References: dsv4_ops.reference, V3.2 section (the oracle of
every test). Shapes: T tokens, H heads, K key positions a token, N rows.

Agreement with vLLM 0.33.0's writer (``concat_and_cache_mla(..., "fp8_ds_mla", scale)`` ->
``concat_and_cache_ds_mla_kernel``; read from the sm_90 SASS of the shipped
``vllm/_C_stable_libtorch.abi3.so``): tile amax over 128 dims in fp32 (FMNMX |x|), then
``max_abs / 448.f`` (IEEE division: FCHK + refinement), ``fmaxf(., 1e-4f)``, the libdevice
``log2f`` polynomial, ``FRND.CEIL``, ``MUFU.EX2`` (exact for integers), the fp32 scale stored
at 512 + 4 * tile, each value ``x / scale`` (IEEE division; exact, scale a power of two)
through ``F2FP.SATFINITE.E4M3`` (RNE, saturating), stored 8 bytes a thread; RoPE copied as
32-bit words to 528..655; ``slot < 0`` returns early. Here: the same exponent with integer
bit work (exact for every bf16 amax, see dsv4_ops.layout), ``x * 2**-e`` (exact), and
csrc_triton.codec's ENCODE_EXACT (bit-identical to the saturating RNE cvt) on sm_8x. Slots
>= capacity are skipped too (vLLM writes out of bounds there). NaN/inf inputs: unspecified.
On sm_80 vLLM's writer produces no fp8 at all (its ``fp8::scaled_convert`` is compiled to
return 0 below sm_89), which is why this op exists.

Launchers never sync the host and allocate only their outputs (plus the merge partials
when a decode splits), so they capture into CUDA graphs; split counts come from static
shapes.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from . import layout as L
from ._checks import check_last_dim, check_tensor
from ._launch import fast
from .codec import encode_mode
from .csrc_triton import v32_attention as _ak
from .csrc_triton import v32_cache as _ck
from .attention import merge_splits  # the V4 LSE merge (d_v = 512, no sink), its public launcher
from .dispatch import device as _device
from .dispatch import v32 as _dv
from .dispatch import variant_for

QK = L.V32_HEAD_DIM_QK  # 576
DV = L.V32_HEAD_DIM_V  # 512
SLOT_DTYPES = (torch.int64, torch.int32)
# bf16 is the contract; fp16 is accepted so the kernels can run under the Triton interpreter.
Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_SPLITS = _ak.MAX_SPLITS
FORMS = _ak.FORMS  # w64, w128, f16 (the kernel forms dispatch.v32.form_for can pick)

_insert_kernel = fast(_ck._v32_kv_insert_kernel)
_gather_kernel = fast(_ck._v32_kv_gather_kernel)
_attn_kernel = fast(_ak._v32_sparse_mla_kernel)
_w128_kernel = fast(_ak._v32_sparse_mla_w128_kernel)
_f16_kernel = fast(_ak._v32_sparse_mla_f16_kernel)
_f16t_kernel = fast(_ak._v32_sparse_mla_f16t_kernel)

_CACHE_OK = {}


def cache_view(kv_cache: torch.Tensor, name: str = "kv_cache") -> Tuple[torch.Tensor, str]:
    """layout.v32_cache_pages (3-D view, 'fp8_ds_mla' | 'auto'), with the layout check
    memoised on everything it reads (shape, strides, offset mod 4, dtype)."""
    if isinstance(kv_cache, torch.Tensor):
        key = (kv_cache.shape, kv_cache.stride(), kv_cache.storage_offset() & 3, kv_cache.dtype)
        fmt = _CACHE_OK.get(key)
        if fmt is not None:
            c = kv_cache
            if c.dim() == 4:
                c = c.select(2, 0)
            if c.dtype == torch.float8_e4m3fn:
                c = c.view(torch.uint8)
            return c, fmt
        c, fmt = L.v32_cache_pages(kv_cache, name)
        _CACHE_OK[key] = fmt
        return c, fmt
    return L.v32_cache_pages(kv_cache, name)


def _geometry(c: torch.Tensor) -> Tuple[int, int, int, int]:
    """(block_size, stride_blk, stride_rec, capacity) of a 3-D cache view."""
    nb, bs = int(c.shape[0]), int(c.shape[1])
    return bs, int(c.stride(0)) if nb > 1 else bs * int(c.shape[2]), int(c.shape[2]), nb * bs


# ---- insert / gather ----


def check_insert_args(kv_c, k_pe, kv_cache, slot_mapping):
    """ValueError naming the bad argument of v32_kv_insert; returns (cache view, format, k_pe 2-D)."""
    c, fmt = cache_view(kv_cache)
    # fp32 latents for fp8_ds_mla: quantized straight from fp32, as vLLM's fused writer does from
    # its registers (a bf16 step first would round some codes twice)
    kv_dtypes = (torch.bfloat16, torch.float32) if fmt == "fp8_ds_mla" else (torch.bfloat16,)
    check_tensor("kv_c", kv_c, dtypes=kv_dtypes, ndim=2, device=c.device, device_of="kv_cache")
    check_last_dim("kv_c", kv_c, L.V32_NOPE_DIM)
    check_tensor("k_pe", k_pe, dtypes=(torch.bfloat16,), device=c.device, device_of="kv_cache")
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.select(1, 0)
    if k_pe.dim() != 2 or k_pe.shape[-1] != L.V32_ROPE_DIM:
        raise ValueError(f"k_pe: expected [N, 64] or [N, 1, 64], got shape {tuple(k_pe.shape)}")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected contiguous dims (stride(-1) == 1), got strides {t.stride()}")
    check_tensor("slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=c.device, device_of="kv_cache")
    n = slot_mapping.shape[0]
    if n > kv_c.shape[0] or n > k_pe.shape[0]:
        raise ValueError(f"slot_mapping: {n} slots for {kv_c.shape[0]} kv_c rows and {k_pe.shape[0]} k_pe rows")
    return c, fmt, k_pe


def v32_kv_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  variant: Optional[str] = None) -> None:
    """Write tokens 0..M-1 (M = slot_mapping.shape[0]) into their records, in place.

    kv_c bf16 [N, 512] (fp32 too for fp8_ds_mla), k_pe bf16 [N, 64] or [N, 1, 64] (rows may be
    strided, dims contiguous); kv_cache uint8 [num_blocks, block_size, 656] (fp8_ds_mla;
    float8_e4m3fn and [.., 1, 656] views accepted) or bf16 [num_blocks, block_size, 576] (auto);
    slot_mapping int64/int32 [M], M <= N. fp8_ds_mla: byte-identical to vLLM 0.33.0's writers
    (module doc): from bf16 rows as concat_and_cache_ds_mla, from fp32 rows as the fused
    norm + RoPE kernel; auto: the row cat(kv_c, k_pe). A slot < 0 or >= num_blocks * block_size is skipped.
    variant: 'portable' / 'native'; None picks from the op table. Never syncs the host.
    """
    c, fmt, k_pe = check_insert_args(kv_c, k_pe, kv_cache, slot_mapping)
    n = slot_mapping.shape[0]
    if n == 0 or c.shape[0] == 0:
        return
    variant = variant or variant_for(c)
    slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
    bs, s_blk, s_rec, cap = _geometry(c)
    cfg = _ck.V32_INSERT_CONFIG
    _insert_kernel(
        (-(-n // cfg["TOKENS"]),),
        (kv_c, k_pe, c, slots, n, kv_c.stride(0), k_pe.stride(0), bs, s_blk, s_rec, cap),
        (fmt == "fp8_ds_mla", encode_mode(True, variant), cfg["TOKENS"]),
        cfg["num_warps"])


def check_gather_args(kv_cache, slots):
    c, fmt = cache_view(kv_cache)
    check_tensor("slots", slots, dtypes=SLOT_DTYPES, device=c.device, device_of="kv_cache")
    return c, fmt


def check_gather_out(out, like, n: int, row_offset) -> None:
    """ValueError unless out is a contiguous bf16 [R, 576] on like's device holding rows
    row_offset .. row_offset + n - 1."""
    check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=2, device=like.device, device_of="kv_cache",
                 contiguous=True)
    check_last_dim("out", out, QK)
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or row_offset < 0:
        raise ValueError(f"row_offset: expected an int >= 0, got {row_offset!r}")
    if row_offset + n > out.shape[0]:
        raise ValueError(f"out: rows {row_offset}..{row_offset + n - 1} do not fit {out.shape[0]} rows")


def _launch_gather(c, fmt, flat, target, variant) -> None:
    n = flat.numel()
    if n == 0:
        return
    variant = variant or variant_for(c)
    bs, s_blk, s_rec, cap = _geometry(c)
    cfg = _ck.V32_GATHER_CONFIG
    _gather_kernel(
        (-(-n // cfg["ROWS"]),),
        (c, flat, target, n, target.stride(0), bs, s_blk, s_rec, cap),
        (fmt == "fp8_ds_mla", variant == "native", cfg["ROWS"]),
        cfg["num_warps"])


def v32_kv_gather(kv_cache: torch.Tensor, slots: torch.Tensor, out: Optional[torch.Tensor] = None,
                  row_offset: int = 0, variant: Optional[str] = None) -> torch.Tensor:
    """Dequantized rows of arbitrary slots: bf16 slots.shape + (576,).

    kv_cache: as in v32_kv_insert. slots int32/int64, any shape / order / repeats. Row =
    e4m3(code) * fp32 scale of its 128-dim tile (rounded once to bf16) for dims < 512, then
    the raw RoPE dims (auto: the stored row). An invalid slot (< 0 or >= capacity) gives a
    zero row and is never read. out: bf16 [R, 576] contiguous; rows go to out[row_offset :
    row_offset + n] (slots flattened in C order) and that view is returned (a prefill
    workspace without a copy). Never syncs the host.
    """
    c, fmt = check_gather_args(kv_cache, slots)
    flat = slots.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    n = flat.numel()
    if out is None:
        res = torch.empty(tuple(slots.shape) + (QK,), dtype=torch.bfloat16, device=c.device)
        _launch_gather(c, fmt, flat, res.view(n, QK), variant)
        return res
    check_gather_out(out, c, n, row_offset)
    target = out.narrow(0, row_offset, n)
    _launch_gather(c, fmt, flat, target, variant)
    return target.view(tuple(slots.shape) + (QK,))


# ---- sparse attention ----


def _interpreting() -> bool:
    """Under the Triton interpreter the f16 form spells its fp16 decode out as a bit move (BITS)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in [0, {MAX_SPLITS}] (0: heuristic), got {num_splits!r}")
    return num_splits


def _check_q_idx(q, indices, topk_length, device):
    check_tensor("q", q, dtypes=Q_DTYPES, ndim=3, device=device, device_of="kv_cache")
    check_last_dim("q", q, QK)
    if q.stride(2) != 1:
        raise ValueError(f"q: expected unit-stride dims, got strides {q.stride()}")
    check_tensor("indices", indices, dtypes=SLOT_DTYPES, ndim=2, device=device, device_of="kv_cache")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices: expected {q.shape[0]} rows (one per token of q), got shape {tuple(indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtypes=SLOT_DTYPES, ndim=1, device=device, device_of="kv_cache")
        if topk_length.shape[0] < q.shape[0]:
            raise ValueError(f"topk_length: expected at least {q.shape[0]} values (one per token), "
                             f"got {tuple(topk_length.shape)}")


def check_decode_args(q, kv_cache, indices, topk_length):
    """ValueError naming the bad argument of v32_sparse_mla_decode; returns (cache view, format)."""
    c, fmt = cache_view(kv_cache)
    _check_q_idx(q, indices, topk_length, c.device)
    return c, fmt


def check_prefill_args(q, kv, indices, topk_length) -> None:
    """ValueError naming the bad argument of v32_sparse_mla_prefill."""
    check_tensor("kv", kv, dtypes=Q_DTYPES, ndim=2)
    check_last_dim("kv", kv, QK)
    if kv.stride(1) != 1:
        raise ValueError(f"kv: expected unit-stride dims, got strides {kv.stride()}")
    _check_q_idx(q, indices, topk_length, kv.device)
    if q.dtype != kv.dtype:
        raise ValueError(f"kv: expected q's dtype {str(q.dtype).replace('torch.', '')}, got "
                         f"{str(kv.dtype).replace('torch.', '')}")


def check_attn_out(out, T, H, like) -> None:
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.dim() == 3
            and tuple(out.shape) == (T, H, DV) and out.stride(2) == 1 and out.device == like.device):
        check_tensor("out", out, dtypes=(torch.bfloat16,), ndim=3, device=like.device)
        if tuple(out.shape) != (T, H, DV):
            raise ValueError(f"out: expected shape {(T, H, DV)}, got {tuple(out.shape)}")
        raise ValueError(f"out: expected unit-stride last dim, got strides {out.stride()}")


def _norm_idx(indices, topk_length, cap: int, K: int):
    """int32 indices with unit-stride entries (int64: out-of-range values become -1 before the
    narrowing, so no value wraps into range) and int32 topk_length clamped to [0, K]."""
    if indices.dtype != torch.int32:
        ok = (indices >= 0) & (indices < cap)
        indices = torch.where(ok, indices, torch.full_like(indices, -1)).to(torch.int32)
    if indices.shape[1] > 1 and indices.stride(1) != 1:
        indices = indices.contiguous()
    if topk_length is not None and (topk_length.dtype != torch.int32 or topk_length.stride(0) != 1):
        topk_length = topk_length.clamp(min=0, max=K).to(torch.int32).contiguous()
    return indices, topk_length


def _aligned(src: torch.Tensor, fp8: bool, s_blk: int, s_rec: int) -> bool:
    """Records start 16-byte aligned: the base and both strides (bytes for fp8, bf16 elements
    else) are multiples of 16 bytes. vLLM's caches are (656 = 16 * 41, pages of 64 records)."""
    a = 16 if fp8 else 8
    return src.data_ptr() % 16 == 0 and s_blk % a == 0 and s_rec % a == 0


class _MaxnregLaunch:
    """A FastKernel launch with a register cap (maxnreg): for benchmark-only candidates
    (F16_CANDIDATES with MAXNREG; not dispatched, not in the AOT table: they may spill)."""

    def __init__(self, fk, maxnreg: int):
        self.fk, self.maxnreg = fk, maxnreg

    def __call__(self, grid, args, consts, num_warps=4, num_stages=3):
        self.fk(grid, args, consts, num_warps, num_stages, maxnreg=self.maxnreg)


def _attend(q, src, fp8: bool, geom, indices, topk_length, sm_scale, num_splits, out, variant, form=None):
    """Launch the attention kernel over a key source (inputs checked); returns (out, lse)."""
    T, H = q.shape[0], q.shape[1]
    K = indices.shape[1]
    bs, s_blk, s_rec, cap = geom
    indices, topk_length = _norm_idx(indices, topk_length, cap, K)
    variant = variant or variant_for(q)
    form = _dv.form_for(_aligned(src, fp8, s_blk, s_rec), form, fp8, H, T)
    bh = _dv.block_h_of(form, H)
    cfg = _dv.config_of(form, _ak.block_h_for(H))
    G = -(-H // bh)
    S = num_splits or _dv.num_splits_for(T, H, K, _device.num_sms_at(q.get_device()), form)
    if out is None:
        out = torch.empty((T, H, DV), dtype=torch.bfloat16, device=q.device)
    if form.startswith("f16"):  # fp8 records only (dispatch.v32.form_for)
        consts = (bh, cfg["BLOCK_N"], variant == "native", topk_length is not None)
        kernel, extra = (_f16t_kernel if cfg.get("KT") else _f16_kernel), (True, _interpreting(), cfg["PREFETCH"])
        if cfg.get("MAXNREG") and not _interpreting():  # benchmark-only candidates: Triton's own launch
            kernel = _MaxnregLaunch(_f16_kernel, cfg["MAXNREG"])
    else:
        consts = (bh, cfg["BLOCK_N"], fp8, variant == "native", topk_length is not None)
        kernel, extra = (_w128_kernel, (True,)) if form == "w128" else (_attn_kernel, ())
    tail = (bs, s_blk, s_rec, cap)
    if S == 1:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T and H:
            kernel(
                (T * G,),
                (q, src, indices, topk_length, out, lse, H, K, 1, G, float(sm_scale),
                 q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1)) + tail,
                consts + (True,) + extra, cfg["num_warps"], cfg["num_stages"])
        return out, lse
    o_part = torch.empty((T, H, S, DV), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((T, H, S), dtype=torch.float32, device=q.device)
    if T and H:
        kernel(
            (T * S * G,),
            (q, src, indices, topk_length, o_part, lse_part, H, K, S, G, float(sm_scale),
             q.stride(0), q.stride(1), indices.stride(0), 0, 0) + tail,
            consts + (False,) + extra, cfg["num_warps"], cfg["num_stages"])
    return merge_splits(o_part, lse_part, None, variant=variant, out=out)


def v32_sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                          topk_length: Optional[torch.Tensor], sm_scale: float, num_splits: int = 0,
                          out: Optional[torch.Tensor] = None, variant: Optional[str] = None,
                          form: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA read straight from the paged cache by slot (no workspace).

    q bf16 [T, H, 576] (ql_nope | q_pe; dims unit-stride; fp16 accepted for the interpreter);
    kv_cache as in v32_kv_insert (fp8_ds_mla or auto); indices int32/int64 [T, K] slots
    (block * block_size + pos; < 0 or >= capacity masked); topk_length int [>= T] or None
    (entries j >= topk_length[t] ignored); sm_scale: applied to q.k as is; num_splits 0 =
    heuristic, else 1..64; out bf16 [T, H, 512] (dims unit-stride) or None; form: the kernel
    form (dispatch.v32.form_for: w64 | w128 | auto; None = env DSV4_AMPERE_V32_FORM, default auto).
    Returns out bf16 [T, H, 512] (``out`` itself when given) and lse fp32 [T, H] (natural log;
    -inf and out 0 where a token has no valid key). No sink.
    """
    c, fmt = check_decode_args(q, kv_cache, indices, topk_length)
    check_splits(num_splits)
    if out is not None:
        check_attn_out(out, q.shape[0], q.shape[1], q)
    return _attend(q, c, fmt == "fp8_ds_mla", _geometry(c), indices, topk_length, sm_scale, num_splits, out,
                   variant, form)


def v32_sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                           topk_length: Optional[torch.Tensor], sm_scale: float, num_splits: int = 0,
                           out: Optional[torch.Tensor] = None, variant: Optional[str] = None,
                           form: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over bf16 rows (the prefill workspace that v32_kv_gather fills).

    q bf16 [T, H, 576]; kv bf16 [N, 576] (q's dtype; row stride free, dims contiguous);
    indices int32/int64 [T, K] rows of kv (< 0 or >= N masked); other arguments and the
    result as in v32_sparse_mla_decode.
    """
    check_prefill_args(q, kv, indices, topk_length)
    check_splits(num_splits)
    if out is not None:
        check_attn_out(out, q.shape[0], q.shape[1], q)
    N = int(kv.shape[0])
    geom = (max(N, 1), 0, int(kv.stride(0)) if N > 1 else QK, N)
    return _attend(q, kv, False, geom, indices, topk_length, sm_scale, num_splits, out, variant, form)


# ---- AOT ----


def f16_spec(variant: str, cfg: dict, has_len: bool, direct: bool, name: str = ""):
    """The AOT KernelSpec of one f16-form specialization (config cfg; name: a candidate's)."""
    from .aot import KernelSpec, optional_pointer

    sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "len_ptr": None,
           "o_ptr": "*bf16" if direct else "*fp32", "lse_ptr": "*fp32",
           "H": "i32", "K": "i32", "S": "i32", "G": "i32", "sm_scale": "fp32",
           "stride_q_t": "i32", "stride_q_h": "i32", "stride_idx_t": "i32",
           "stride_o_t": "i32", "stride_o_h": "i32", "block_size": "i32",
           "stride_blk": "i32", "stride_rec": "i32", "capacity": "i32",
           "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "NATIVE": "constexpr", "HAS_LEN": "constexpr",
           "DIRECT": "constexpr", "ALIGN": "constexpr", "BITS": "constexpr", "PREFETCH": "constexpr"}
    consts = {"BLOCK_H": cfg["BLOCK_H"], "BLOCK_N": cfg["BLOCK_N"], "NATIVE": variant == "native",
              "HAS_LEN": has_len, "DIRECT": direct, "ALIGN": True, "BITS": False, "PREFETCH": cfg["PREFETCH"]}
    optional_pointer(sig, consts, "len_ptr", "*i32", has_len)
    label = (f"v32_attn_f16[{variant},bh{cfg['BLOCK_H']}{',' + name if name else ''},"
             f"{'len' if has_len else 'nolen'},{'direct' if direct else 'part'}]")
    kern = _ak._v32_sparse_mla_f16t_kernel if cfg.get("KT") else _ak._v32_sparse_mla_f16_kernel
    return KernelSpec("v32_sparse_mla_decode", label, kern, sig, consts, variant,
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def aot_specs():
    """Every V3.2 kernel specialization a launcher can pick (see dsv4_ops.aot)."""
    from .aot import KernelSpec, optional_pointer

    ins, gat = _ck.V32_INSERT_CONFIG, _ck.V32_GATHER_CONFIG
    specs = []
    for variant in ("portable", "native"):
        for fp8 in (True, False):
            fmt = "fp8" if fp8 else "bf16"
            cache_ty = "*u8" if fp8 else "*bf16"
            for slot_ty in ("i64", "i32"):
                for kv_ty in (("bf16", "fp32") if fp8 else ("bf16",)):
                    specs.append(KernelSpec(
                        "v32_kv_insert", f"v32_insert[{variant},{fmt},{slot_ty}" + (",fp32 kv]" if kv_ty == "fp32" else "]"),
                        _ck._v32_kv_insert_kernel,
                        {"kv_c_ptr": f"*{kv_ty}", "k_pe_ptr": "*bf16", "cache_ptr": cache_ty, "slot_ptr": f"*{slot_ty}",
                         "n": "i32", "stride_kvc": "i32", "stride_kpe": "i32", "block_size": "i32",
                         "stride_blk": "i32", "stride_rec": "i32", "capacity": "i32",
                         "FP8": "constexpr", "MODE": "constexpr", "TOKENS": "constexpr"},
                        {"FP8": fp8, "MODE": encode_mode(True, variant), "TOKENS": ins["TOKENS"]}, variant,
                        num_warps=ins["num_warps"]))
                specs.append(KernelSpec(
                    "v32_kv_gather", f"v32_gather[{variant},{fmt},{slot_ty}]", _ck._v32_kv_gather_kernel,
                    {"cache_ptr": cache_ty, "slot_ptr": f"*{slot_ty}", "out_ptr": "*bf16", "n": "i32",
                     "stride_out": "i32", "block_size": "i32", "stride_blk": "i32", "stride_rec": "i32",
                     "capacity": "i32", "FP8": "constexpr", "NATIVE": "constexpr", "ROWS": "constexpr"},
                    {"FP8": fp8, "NATIVE": variant == "native", "ROWS": gat["ROWS"]}, variant,
                    num_warps=gat["num_warps"]))
            for bh, cfg in sorted(_ak.V32_ATTN_CONFIG.items()):
                for has_len in (False, True):
                    for direct in (False, True):
                        sig = {"q_ptr": "*bf16", "kv_ptr": cache_ty, "idx_ptr": "*i32", "len_ptr": None,
                               "o_ptr": "*bf16" if direct else "*fp32", "lse_ptr": "*fp32",
                               "H": "i32", "K": "i32", "S": "i32", "G": "i32", "sm_scale": "fp32",
                               "stride_q_t": "i32", "stride_q_h": "i32", "stride_idx_t": "i32",
                               "stride_o_t": "i32", "stride_o_h": "i32", "block_size": "i32",
                               "stride_blk": "i32", "stride_rec": "i32", "capacity": "i32",
                               "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "FP8": "constexpr",
                               "NATIVE": "constexpr", "HAS_LEN": "constexpr", "DIRECT": "constexpr"}
                        consts = {"BLOCK_H": bh, "BLOCK_N": cfg["BLOCK_N"], "FP8": fp8,
                                  "NATIVE": variant == "native", "HAS_LEN": has_len, "DIRECT": direct}
                        optional_pointer(sig, consts, "len_ptr", "*i32", has_len)
                        op = "v32_sparse_mla_decode" if fp8 else "v32_sparse_mla_prefill"
                        specs.append(KernelSpec(
                            op, f"v32_attn[{variant},{fmt},bh{bh},{'len' if has_len else 'nolen'},"
                                f"{'direct' if direct else 'part'}]",
                            _ak._v32_sparse_mla_kernel, sig, consts, variant,
                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
                        wcfg = _ak.V32_W128_CONFIG[bh]
                        wsig = dict(sig, ALIGN="constexpr")
                        wconsts = dict(consts, BLOCK_N=wcfg["BLOCK_N"], ALIGN=True)
                        specs.append(KernelSpec(
                            op, f"v32_attn_w128[{variant},{fmt},bh{bh},{'len' if has_len else 'nolen'},"
                                f"{'direct' if direct else 'part'}]",
                            _ak._v32_sparse_mla_w128_kernel, wsig, wconsts, variant,
                            num_warps=wcfg["num_warps"], num_stages=wcfg["num_stages"]))
                        if fp8 and bh == min(_ak.F16_CONFIG):  # the f16 form: fp8 records; one config
                            assert all(c is _ak.F16_CONFIG[bh] for c in _ak.F16_CONFIG.values())
                            specs.append(f16_spec(variant, _ak.F16_CONFIG[bh], has_len, direct))
    return specs
