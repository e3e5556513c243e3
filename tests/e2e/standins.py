"""Torch stand-ins for the vLLM C++/CUDA ops that the sm_80 serve path keeps (they have sm_80
cubins) but that cannot run on a CPU machine. Each is written from the op's documented
semantics (vLLM's torch reference where one exists), registered under vLLM's own namespace
(``_C``, ``_C_cache_ops``, ``_moe_C``) so vLLM's unchanged call sites reach it, and counts its
calls in ``CALLS``.

Why none of them can hide a plugin bug: the plugin replaces none of these ops (they are KEPT
rows of the audit); what they compute is checked by the float64 oracle downstream (the SWA
writer's bytes are decoded by the oracle's own decoder and compared with the oracle's KV; the
top-k choices are checked against the oracle's indexer scores; the MoE output against the
oracle's MoE), so a stand-in that were wrong would fail the test rather than pass it.

| op | stand-in |
|---|---|
| ``_C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` | GPT-J RoPE (fp32) on q and kv, optional per-head q RMSNorm, zero head padding; kv written as a 584-byte ``fp8_ds_mla`` record by a torch writer (``torch.float8_e4m3fn`` encode, UE8M0 scale per 64 dims) |
| ``_C.fused_deepseek_v4_kv_rope_insert`` (V4.1's decoder-replay KV write, DSpark's context insert) | the KV half of the row above (vLLM: "bit for bit, without the unused query") |
| ``_C.top_k_per_row_prefill`` / ``top_k_per_row_decode`` / ``persistent_topk`` / ``cooperative_topk`` | masked ``torch.topk`` over each row's ``[start, end)``, -1 fill (vLLM's ``"torch"`` top-k branch) |
| ``_C_cache_ops.cp_gather_indexer_k_quant_cache`` | byte gather from the indexer page layout (128 E4M3 bytes a row, then the page's fp32 scales) |
| ``_moe_C.topk_softplus_sqrt`` | ``s = sqrt(softplus(logit))``, choice on ``s + bias`` (or the hash table), weights ``s``, renormalise, x scale |
| ``_moe_C.moe_align_block_size`` / ``moe_sum`` | the algorithm of vLLM's docstring / a sum over top-k |
| ``_C.silu_and_mul_with_clamp`` | ``SiluAndMulWithClamp.forward_native``'s formula in fp32 |
| ``_C.rms_norm`` / ``fused_add_rms_norm`` | the native RMSNorm formula (fp32) |
| ``_C.get_cuda_view_from_cpu_tensor`` (GPU only: the V2 runner's UVA buffers) | the pinned tensor's own address aliased on cuda through ``__cuda_array_interface__`` |
| ``_C.weak_ref_tensor`` (GPU only: CUDA-graph outputs) | an owning alias |
| ``_C.cutlass_scaled_mm_supports_*`` | the sm_80 answer (False) |
| ``aten::mm.dtype`` (CPU only) | fp32 upcast + mm |
| mHC TileLang wrappers (``mhc_pre_tilelang``, ``mhc_fused_post_pre_tilelang`` and its ``_reuse_residual`` form, V4.1's delayed ones, ``hc_head``) | vLLM's torch references (``kernels/mhc/torch.py``) + the collapsed input's RMSNorm; the reuse form writes the new residual into its input where vLLM's dispatch does |
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
import torch.nn.functional as F

CALLS: "collections.Counter[str]" = collections.Counter()
LAST_ROUTING: list = []   # the expert ids each router call chose (the oracle is teacher-forced on them)
_LIBS = []

# fp8_ds_mla record (the layout is written down once in dsv4_ops.layout; these are the
# numbers of that record, restated here so the writer stays independent of the code it checks)
NOPE, ROPE, DATA_BYTES, SCALE_BYTES, QUANT_BLOCK = 448, 64, 576, 8, 64


def _lib(ns: str) -> torch.library.Library:
    lib = torch.library.Library(ns, "FRAGMENT")
    _LIBS.append(lib)
    return lib


def _has(ns: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, ns), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _define(lib, ns, schema, fn, key="CompositeExplicitAutograd"):
    name = schema.split("(", 1)[0]
    if _has(ns, name):
        return
    lib.define(schema)

    def counted(*args, **kwargs):
        CALLS[f"{ns}.{name}"] += 1
        return fn(*args, **kwargs)

    lib.impl(name, counted, key)


# ------------------------------------------------------------------ RoPE and the SWA record

def rope_gptj(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved pairs) RoPE of the last 64 dims of ``x [T, ..., D]`` in fp32; the
    cache row is ``[cos(32) | sin(32)]``. Returns fp32."""
    cs = cos_sin_cache[positions.long()].float()
    half = cs.shape[-1] // 2
    cos, sin = cs[:, :half], cs[:, half:]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = x.float().clone()
    r = out[..., -2 * half:]
    even, odd = r[..., 0::2].clone(), r[..., 1::2].clone()
    r[..., 0::2] = even * cos - odd * sin
    r[..., 1::2] = odd * cos + even * sin
    return out


def write_fp8_ds_mla(rows: torch.Tensor, cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
    """Write bf16 ``rows [N, 512]`` as fp8_ds_mla records into ``cache_2d`` (uint8
    ``[num_blocks, page_bytes]``, stride(1) = 1) at ``slots`` (negative: skipped). No host sync
    (it is captured in the decode graph): skipped rows rewrite the null block's own bytes."""
    assert cache_2d.stride(1) == 1 and cache_2d.shape[1] >= block_size * (DATA_BYTES + SCALE_BYTES)
    n = rows.shape[0]
    if n == 0:
        return
    s = slots[:n].long()
    valid = s >= 0
    b = torch.where(valid, torch.div(s, block_size, rounding_mode="floor"), torch.zeros_like(s))
    p = torch.where(valid, torch.remainder(s, block_size), torch.zeros_like(s))
    nope = rows[:, :NOPE].float().view(n, NOPE // QUANT_BLOCK, QUANT_BLOCK)
    amax = nope.abs().amax(dim=2).clamp(min=1e-4)
    e = torch.ceil(torch.log2(amax / 448.0))
    codes = (nope / torch.exp2(e)[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.cat([codes.reshape(n, NOPE), rows[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)], 1)
    scale = torch.cat([(e + 127).to(torch.uint8), torch.zeros(n, 1, dtype=torch.uint8, device=rows.device)], 1)
    dcol = p[:, None] * DATA_BYTES + torch.arange(DATA_BYTES, device=rows.device)[None, :]
    scol = block_size * DATA_BYTES + p[:, None] * SCALE_BYTES + torch.arange(SCALE_BYTES, device=rows.device)[None, :]
    bb = b[:, None]
    old_d, old_s = cache_2d[bb, dcol], cache_2d[bb, scol]
    cache_2d[bb, dcol] = torch.where(valid[:, None], data, old_d)
    cache_2d[bb, scol] = torch.where(valid[:, None], scale, old_s)


def _qnorm_rope_kv_insert(q, kv, cache, slot_mapping, positions, cos_sin_cache, pad_to, eps, block_size,
                          apply_q_norm=True, kv_mxfp8=False, apply_q_rope=True, is_q_interleaved=False):
    assert not kv_mxfp8 and not is_q_interleaved, "only the fp8_ds_mla record is stood in for"
    T = positions.shape[0]
    qf = q[:T].float()
    if apply_q_norm:
        qf = qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + eps)
    if apply_q_rope:
        qf = rope_gptj(qf, positions, cos_sin_cache)
    kvr = rope_gptj(kv[:T], positions, cos_sin_cache).to(torch.bfloat16)
    write_fp8_ds_mla(kvr, cache, slot_mapping[:T], block_size)
    heads = max(pad_to, q.shape[1])
    out = q.new_zeros((q.shape[0], heads, q.shape[2]))
    out[:T, : q.shape[1]] = qf.to(q.dtype)
    return out


def _kv_rope_insert(kv, cache, slot_mapping, positions, cos_sin_cache, block_size, fp8_scale=None, kv_mxfp8=False):
    """The KV half of ``_qnorm_rope_kv_insert`` into the layer's bound cache ``[num_blocks,
    block_size, record bytes]`` (uint8 fp8_ds_mla only; ``fp8_scale`` belongs to the fp8 cache)."""
    assert not kv_mxfp8 and cache.dtype == torch.uint8 and fp8_scale is None, \
        "only the fp8_ds_mla record is stood in for"
    T = positions.shape[0]
    kvr = rope_gptj(kv[:T], positions, cos_sin_cache).to(torch.bfloat16)
    write_fp8_ds_mla(kvr, cache.view(cache.shape[0], -1), slot_mapping[:T], block_size)


# ------------------------------------------------------------------ top-k

def _topk_rows(logits, starts, ends, topk, out):
    cols = torch.arange(logits.shape[1], device=logits.device)
    valid = (cols[None, :] >= starts[:, None].long()) & (cols[None, :] < ends[:, None].long())
    k = min(topk, logits.shape[1])
    # an in-range -inf outranks every out-of-range column
    key = torch.where(valid, logits.float().nan_to_num(neginf=-3e38), torch.full_like(logits, float("-inf"), dtype=torch.float32))
    order = key.topk(k, dim=1).indices
    n_valid = valid.sum(1)
    take = torch.arange(k, device=logits.device)[None, :] < n_valid[:, None]
    res = torch.where(take, order, torch.full_like(order, -1)).to(out.dtype)
    out[:, :k].copy_(res)
    if k < out.shape[1]:
        out[:, k:].fill_(-1)


def _top_k_per_row_prefill(logits, ks, ke, out, num_rows, stride0, stride1, topk):
    _topk_rows(logits[:num_rows], ks[:num_rows], ke[:num_rows], topk, out[:num_rows])


def _decode_row_ends(seq_lens, next_n, num_rows):
    if seq_lens.numel() == num_rows:
        return seq_lens.reshape(-1).long()
    off = torch.arange(next_n, device=seq_lens.device)
    return (seq_lens.reshape(-1, 1).long() - next_n + 1 + off).clamp(min=0).reshape(-1)


def _top_k_per_row_decode(logits, next_n, seq_lens, out, num_rows, stride0, stride1, topk):
    ends = _decode_row_ends(seq_lens, next_n, num_rows)
    _topk_rows(logits[:num_rows], torch.zeros_like(ends), ends, topk, out[:num_rows])


def _persistent_topk(logits, seq_lens, out, workspace, topk, max_seq_len):
    rows = logits.shape[0]
    next_n = max(1, rows // max(1, seq_lens.shape[0]))
    ends = _decode_row_ends(seq_lens, next_n, rows)
    _topk_rows(logits, torch.zeros_like(ends), ends, topk, out)


# ------------------------------------------------------------------ indexer K gather

def _cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    """``kv_cache`` is ``[nb, bs, 132]`` (or a view of it): per page ``bs * 128`` E4M3 bytes,
    then ``bs`` fp32 scales. Rows of request r, token j, land at ``cu_seq_lens[r] + j``."""
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    page = kv_cache.reshape(nb, -1)
    head = dst_k.shape[-1]
    dk = dst_k.view(torch.uint8).view(-1, head)
    ds = dst_scale.view(torch.uint8).view(-1, 4)
    cu = cu_seq_lens.tolist()
    for r in range(len(cu) - 1):
        for j in range(cu[r + 1] - cu[r]):
            b = int(block_table[r, j // bs])
            p = j % bs
            dk[cu[r] + j] = page[b, p * head:(p + 1) * head]
            ds[cu[r] + j] = page[b, bs * head + 4 * p: bs * head + 4 * p + 4]


# ------------------------------------------------------------------ MoE

def _topk_softplus_sqrt(topk_weights, topk_indices, token_expert_indices, gating_output, renormalize,
                        routed_scaling_factor, bias, input_tokens, hash_table, is_padding=None, bias_vl=None,
                        image_sentinel_lo=0):
    s = torch.sqrt(F.softplus(gating_output.float()))
    k = topk_indices.shape[1]
    if hash_table is not None and input_tokens is not None:
        idx = hash_table[input_tokens.long()].long()[:, :k]
    else:
        choice = s + (bias.float() if bias is not None else 0.0)
        idx = choice.topk(k, dim=1).indices
    w = s.gather(1, idx)
    if renormalize:
        w = w / w.sum(1, keepdim=True)
    topk_weights.copy_(w * routed_scaling_factor)
    topk_indices.copy_(idx.to(topk_indices.dtype))
    LAST_ROUTING.append(idx.detach().clone())
    token_expert_indices.copy_(torch.arange(idx.numel(), device=idx.device).view_as(idx).to(token_expert_indices.dtype))


def _moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_post_pad,
                          expert_map=None, scatter_idx=None):
    """Rows grouped by expert (stable), each group padded to a multiple of ``block_size`` with
    the sentinel ``numel``; ``expert_ids[j]`` = the expert of block j. No host sync."""
    flat = topk_ids.reshape(-1).long()
    total = flat.numel()
    dev = flat.device
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat.clamp(0, num_experts - 1), torch.ones_like(flat))     # bincount would sync the host
    padded = torch.div(counts + block_size - 1, block_size, rounding_mode="floor") * block_size
    starts_sorted = torch.cumsum(counts, 0) - counts
    starts_padded = torch.cumsum(padded, 0) - padded
    e_sorted = flat[order]
    rank = torch.arange(total, device=dev) - starts_sorted[e_sorted]
    sorted_ids.fill_(total)
    sorted_ids.scatter_(0, (starts_padded[e_sorted] + rank).to(torch.int64), order.to(sorted_ids.dtype))
    blocks = torch.arange(expert_ids.numel(), device=dev) * block_size
    ends = torch.cumsum(padded, 0)
    e_of_block = torch.searchsorted(ends, blocks, right=True).clamp(max=num_experts - 1)
    if expert_map is not None:
        e_of_block = expert_map.long()[e_of_block]
    in_range = blocks < ends[-1]
    expert_ids.copy_(torch.where(in_range, e_of_block, torch.full_like(e_of_block, -1 if expert_map is not None else 0))
                     .to(expert_ids.dtype))
    num_post_pad.copy_(ends[-1].reshape(num_post_pad.shape).to(num_post_pad.dtype))
    if scatter_idx is not None:
        scatter_idx.copy_(torch.arange(total, device=dev).view_as(scatter_idx).to(scatter_idx.dtype))


def _moe_sum(inp, out, topk_ids=None, expert_map=None):
    out.copy_(inp.float().sum(1).to(out.dtype))


def _silu_and_mul_with_clamp(out, x, limit, alpha=1.0, beta=0.0):
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    out.copy_((F.silu(gate * alpha) * (up + beta)).to(out.dtype))


def _rms_norm(out, x, w, eps):
    xf = x.float()
    out.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(out.dtype))


def _fused_add_rms_norm(x, residual, w, eps):
    residual.add_(x)
    _rms_norm(x, residual, w, eps)


class _CudaArrayInterface:
    """``__cuda_array_interface__`` of raw bytes at a device-accessible address (torch aliases it,
    no copy; the caller keeps the owner alive)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(ptr, False), version=2)


def _cuda_view_from_cpu_tensor(cpu_tensor):
    """The pinned CPU tensor's memory seen from the GPU through unified virtual addressing (the
    same address: cudaHostAlloc memory is mapped under UVA), as the C++ op returns it: an alias
    on cuda, not a copy."""
    CALLS["_C.get_cuda_view_from_cpu_tensor"] += 1
    assert cpu_tensor.is_pinned(), "UVA view of an unpinned CPU tensor"
    st = cpu_tensor.untyped_storage()
    if st.nbytes() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    raw = torch.as_tensor(_CudaArrayInterface(st.data_ptr(), st.nbytes()), device="cuda")
    return raw.view(cpu_tensor.dtype).as_strided(cpu_tensor.shape, cpu_tensor.stride(),
                                                 cpu_tensor.storage_offset())


def _weak_ref_tensor(t):
    """An owning alias instead of the C++ op's non-owning one (only the lifetime of a CUDA
    graph's output memory differs)."""
    CALLS["_C.weak_ref_tensor"] += 1
    return t.as_strided(t.shape, t.stride(), t.storage_offset())


# Kept C++ ops that vLLM's compile-pass modules (vllm/compilation/passes/fusion/*, imported by
# vllm.compilation.backends, which DSpark's and MTP's draft loaders import even with
# enforce_eager) name at import time as pattern-matcher targets. The fusion passes are off in
# every run here, so these are never called: each is defined with a placeholder schema (not
# vLLM's) and raises if anything calls it.
IMPORT_ONLY_OPS = ("rotary_embedding", "static_scaled_fp8_quant", "dynamic_scaled_fp8_quant",
                   "dynamic_per_token_scaled_fp8_quant", "rms_norm_static_fp8_quant",
                   "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_quant",
                   "fused_qk_norm_rope", "silu_and_mul_quant", "silu_and_mul_per_block_quant")


def _import_only(name: str):
    def never(x):
        raise RuntimeError(f"_C.{name}: an import-only stand-in (tests/e2e/standins.IMPORT_ONLY_OPS) was "
                           "called; the harness has no torch version of it")
    return never


def install(cpu: bool = True) -> None:
    """Register every stand-in that is not already defined (idempotent)."""
    c, cc, moe = _lib("_C"), _lib("_C_cache_ops"), _lib("_moe_C")
    for name in IMPORT_ONLY_OPS:
        _define(c, "_C", f"{name}(Tensor x) -> ()", _import_only(name))
    _define(c, "_C", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(Tensor q, Tensor kv, Tensor(a!) cache, "
            "Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache, int pad_to, float eps, int block_size, "
            "bool apply_q_norm=True, bool kv_mxfp8=False, bool apply_q_rope=True, bool is_q_interleaved=False) -> Tensor",
            _qnorm_rope_kv_insert)
    _define(c, "_C", "fused_deepseek_v4_kv_rope_insert(Tensor kv, Tensor(a!) cache, Tensor slot_mapping, "
            "Tensor positions, Tensor cos_sin_cache, int block_size, Tensor? fp8_scale=None, bool kv_mxfp8=False) -> ()",
            _kv_rope_insert)
    _define(c, "_C", "top_k_per_row_prefill(Tensor logits, Tensor ks, Tensor ke, Tensor(a!) out, int num_rows, "
            "int s0, int s1, int topk) -> ()", _top_k_per_row_prefill)
    _define(c, "_C", "top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor(a!) out, "
            "int num_rows, int s0, int s1, int topk) -> ()", _top_k_per_row_decode)
    for name in ("persistent_topk", "cooperative_topk"):
        _define(c, "_C", f"{name}(Tensor logits, Tensor seq_lens, Tensor(a!) out, Tensor(b!) ws, int topk, "
                "int max_seq_len) -> ()", _persistent_topk)
    _define(c, "_C", "silu_and_mul_with_clamp(Tensor(a!) out, Tensor x, float limit, float alpha, float beta) -> ()",
            _silu_and_mul_with_clamp)
    _define(c, "_C", "rms_norm(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()", _rms_norm)
    _define(c, "_C", "fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()",
            _fused_add_rms_norm)
    if not cpu:
        _define(c, "_C", "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor", _cuda_view_from_cpu_tensor)
        _define(c, "_C", "weak_ref_tensor(Tensor(a) tensor) -> Tensor(a)", _weak_ref_tensor)
    for probe in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                  "cutlass_scaled_mm_supports_fp4", "cutlass_group_gemm_supported"):
        _define(c, "_C", f"{probe}(int cap) -> bool", lambda cap: False)
    _define(cc, "_C_cache_ops", "cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, "
            "Tensor(b!) dst_scale, Tensor block_table, Tensor cu_seq_lens) -> ()", _cp_gather_indexer_k_quant_cache)
    _define(moe, "_moe_C", "topk_softplus_sqrt(Tensor(a!) w, Tensor(b!) idx, Tensor(c!) tei, Tensor gating, "
            "bool renormalize, float scale, Tensor? bias, Tensor? input_tokens, Tensor? hash_table, "
            "Tensor? is_padding=None, Tensor? bias_vl=None, int image_sentinel_lo=0) -> ()", _topk_softplus_sqrt)
    _define(moe, "_moe_C", "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
            "Tensor(a!) sorted_ids, Tensor(b!) expert_ids, Tensor(c!) num_post_pad, Tensor? expert_map=None, "
            "Tensor(d!)? scatter_idx=None) -> ()", _moe_align_block_size)
    _define(moe, "_moe_C", "moe_sum(Tensor inp, Tensor(a!) out, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()",
            _moe_sum)
    if cpu:
        aten = _lib("aten")

        def mm_dtype(a, b, out_dtype):
            CALLS["aten.mm.dtype"] += 1
            return torch.mm(a.float(), b.float()).to(out_dtype)

        try:
            aten.impl("mm.dtype", mm_dtype, "CPU")
        except RuntimeError:
            pass


# ------------------------------------------------------------------ mHC (TileLang on sm_80)

def _rms(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(torch.bfloat16) if w is not None else y.to(torch.bfloat16)


def _mhc_pre_delayed(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                     sinkhorn_repeat, pre_mix=None, x=None, norm_weight=None, norm_eps=1e-6):
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_delayed_torch

    CALLS["mhc.pre_delayed"] += 1
    post, comb, layer_input, pre = mhc_pre_delayed_torch(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                                                         hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                                                         pre_mix=pre_mix, x=x)
    if norm_weight is not None:
        layer_input = _rms(layer_input, norm_weight, norm_eps)
    return post, comb, layer_input, pre


def _mhc_post(x, residual, post_layer_mix, comb_res_mix):
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    CALLS["mhc.post"] += 1
    return mhc_post_torch(x, residual, post_layer_mix, comb_res_mix)


def _mhc_fused_post_pre_delayed(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
                                hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, pre_mix=None,
                                norm_weight=None, norm_eps=1e-6, capture_aux=False):
    new_res = _mhc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, layer_input, pre = _mhc_pre_delayed(new_res, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                                                    hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                                                    pre_mix=pre_mix, norm_weight=norm_weight, norm_eps=norm_eps)
    aux = new_res.float().mean(dim=1).to(new_res.dtype) if capture_aux else None
    return new_res, post, comb, layer_input, pre, aux


def _mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
             sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6):
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    CALLS["mhc.pre"] += 1
    post, comb, layer_input = mhc_pre_torch(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                                            hc_post_mult_value, sinkhorn_repeat)
    return post, comb, _rms(layer_input, norm_weight, norm_eps) if norm_weight is not None else layer_input


def _post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
              hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps):
    new_res = _mhc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, layer_input = _mhc_pre(new_res, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                                       hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)
    return new_res, post, comb, layer_input


def _mhc_fused_post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                        hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1,
                        norm_weight=None, norm_eps=1e-6):
    rec = _boundary_inputs(x, residual, post_layer_mix, comb_res_mix, fn)
    out = _post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                    hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps)
    _record_boundary(rec, out, in_place=False)
    return out


def _mhc_fused_post_pre_reuse_residual(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
                                       hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1,
                                       tile_n=1, norm_weight=None, norm_eps=1e-6):
    """``mhc_fused_post_pre_tilelang_reuse_residual``: the values of ``mhc_fused_post_pre_tilelang``;
    where vLLM's dispatch runs the separate post kernel (``mhc_fused_post_pre_split_config`` is
    None: more tokens than the fused kernel takes), the new residual is written into ``residual``'s
    storage and returned as that tensor, as vLLM's kernel does, so a caller that still read the old
    residual reads the new one here too."""
    from vllm.model_executor.kernels.mhc.tilelang_kernels import mhc_fused_post_pre_split_config

    rec = _boundary_inputs(x, residual, post_layer_mix, comb_res_mix, fn)
    new_res, post, comb, layer_input = _post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
                                                 rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                                 sinkhorn_repeat, norm_weight, norm_eps)
    hc, hidden = residual.shape[-2], residual.shape[-1]
    in_place = mhc_fused_post_pre_split_config(residual.numel() // (hc * hidden), hidden, hc) is None
    if in_place:
        residual.copy_(new_res)
        new_res = residual
    CALLS[f"mhc.fused_post_pre_reuse_residual.{'in_place' if in_place else 'fresh'}"] += 1
    out = (new_res, post, comb, layer_input)
    _record_boundary(rec, out, in_place)
    return out


# V4's mHC boundaries (the post of one sublayer fused with the pre of the next), recorded for the
# float64 check (checks.Checker.check_mhc_boundaries) while RECORD_BOUNDARIES is on; the inputs are
# cloned before the call, since the reuse-residual form overwrites its residual
RECORD_BOUNDARIES = False
BOUNDARIES: list = []


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _boundary_inputs(x, residual, post_layer_mix, comb_res_mix, fn):
    if not RECORD_BOUNDARIES or _capturing():
        return None
    return dict(fn=fn, x=x.detach().clone(), residual=residual.detach().clone(),
                post_in=post_layer_mix.detach().clone(), comb_in=comb_res_mix.detach().clone())


def _record_boundary(rec, out, in_place):
    if rec is None:
        return
    new_res, post, comb, layer_input = out
    rec.update(new_res=new_res.detach().clone(), post=post.detach().clone(), comb=comb.detach().clone(),
               layer_input=layer_input.detach().clone(), in_place=in_place)
    BOUNDARIES.append(rec)


def _hc_head(hs_flat, fn, hc_scale, hc_base, rms_eps, hc_eps):
    """Final stream collapse: pre = sigmoid(rmsnorm-scaled (x fn^T) * scale + base) + eps."""
    CALLS["mhc.hc_head"] += 1
    x = hs_flat.flatten(1).float()
    mixes = (x @ fn.float().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mixes * hc_scale.float()[0] + hc_base.float()) + hc_eps
    return (pre.unsqueeze(-1) * hs_flat.float()).sum(1).to(torch.bfloat16)


class _PreBigFuse:
    """Stand-in for the TileLang ``_MHC_PRE_BIG_FUSE_TILELANG_KERNEL`` behind V4's first-layer
    ``mhc_pre_broadcast_tilelang`` (kept: vLLM's wrapper and the plugin's prenorm-GEMM row run
    unchanged before it). From the split-K GEMM partials ``mul [S, T, M]`` / ``sqrsum [S, T]``
    of the broadcast embedding ``residual [T, D]``: mixes = sum_s mul * rsqrt(sum_s sqrsum / D +
    eps); coefficients as ``mhc_pre_torch``; the streams are hc copies of the embedding, so the
    collapsed input is (sum_j pre_j) * x, RMS-normed with ``norm_weight``."""

    def register_warmup(self, *args, **kwargs) -> None:   # nothing to compile (see _NotWarmed)
        CALLS["mhc.warmup_dropped._MHC_PRE_BIG_FUSE_TILELANG_KERNEL"] += 1

    def __call__(self, mul, sqrsum, hc_scale, hc_base, residual, post_mix, comb_mix, layer_input, rms_eps,
                 hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, residual_out=None,
                 norm_weight=None, norm_eps=1e-6):
        CALLS["mhc.pre_big_fuse"] += 1
        hc = post_mix.shape[1]
        D = residual.shape[-1]
        mixes = mul.sum(0) * torch.rsqrt(sqrsum.sum(0) / D + rms_eps)[:, None]
        pre = torch.sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_pre_eps
        post = torch.sigmoid(mixes[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc]) * hc_post_mult_value
        comb = mixes[:, 2 * hc:].view(-1, hc, hc) * hc_scale[2] + hc_base[2 * hc:].view(1, hc, hc)
        comb = torch.softmax(comb, dim=-1) + hc_sinkhorn_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
        for _ in range(sinkhorn_repeat - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_sinkhorn_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
        post_mix.copy_(post)
        comb_mix.copy_(comb.reshape(comb_mix.shape))
        collapsed = (pre.sum(1, keepdim=True) * residual.float()).to(torch.bfloat16)
        layer_input.copy_(_rms(collapsed, norm_weight, norm_eps) if norm_weight is not None else collapsed)
        if residual_out is not None:
            residual_out.copy_(residual.unsqueeze(1).expand_as(residual_out))


class _NotWarmed:
    """A TileLang mHC kernel object where tilelang is absent: vLLM's model code imports it by name
    and registers it for its JIT warmup; the registration is counted and dropped (nothing to
    compile: its wrapper runs as a torch stand-in); a call raises."""

    def __init__(self, name: str):
        self.name = name

    def register_warmup(self, *args, **kwargs) -> None:
        CALLS[f"mhc.warmup_dropped.{self.name}"] += 1

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name}: a TileLang kernel without tilelang and without a torch stand-in")


TILELANG_KERNEL_NAMES = ("_MHC_PRE_BIG_FUSE_TILELANG_KERNEL", "_HC_PRENORM_GEMM_TILELANG_KERNEL",
                         "_MHC_POST_TILELANG_KERNEL", "_MHC_FUSED_TILELANG_KERNEL", "_HC_HEAD_FUSED_TILELANG_KERNEL")
# a TileLang function vLLM's V4.1 mHC warmup module imports from it (never called here: the wrappers
# run as torch)
TILELANG_HELPER_NAMES = ("mhc_pre_big_fuse_with_norm_tilelang",)


def _host_python_of(path: str) -> dict:
    """The plain-Python part of a vLLM module that imports tilelang at the top: its constants and its
    undecorated (or ``functools.cache``) functions that name no TileLang object, run from vLLM's own
    source (e.g. ``mhc_fused_post_pre_splits``, the split-k factors V4.1's model build registers for
    the JIT warmup). The TileLang kernels and their classes are left out."""
    import ast
    import functools
    import math

    import torch
    from vllm.platforms import current_platform
    from vllm.utils.math_utils import cdiv

    tree = ast.parse(open(path).read(), path)
    tl_names = {"T", "tilelang", "tilelang_jit"}
    keep = []
    for node in tree.body:
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if names & tl_names:
            continue
        if isinstance(node, ast.FunctionDef) and all(ast.unparse(d) == "cache" for d in node.decorator_list):
            keep.append(node)
        elif isinstance(node, ast.Assign) and not isinstance(node.value, ast.Call):
            keep.append(node)
    ns = {"cache": functools.cache, "math": math, "torch": torch, "current_platform": current_platform,
          "cdiv": cdiv, "__name__": "vllm.model_executor.kernels.mhc.tilelang_kernels"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), ns)
    return {k: v for k, v in ns.items() if k not in ("__name__", "__builtins__")}


def _install_tilelang_kernels_module() -> None:
    """``vllm.model_executor.kernels.mhc.tilelang_kernels`` where tilelang cannot be imported: the
    kernel objects vLLM's V4 code imports by name (its JIT-warmup registrations at model build,
    the first-layer broadcast wrapper's epilogue, which runs ``_PreBigFuse``) and its plain-Python
    helpers from vLLM's source (``_host_python_of``); any other name is missing, so
    ``from ... import`` of it raises ImportError as before."""
    import os
    import sys
    import types

    import vllm.model_executor.kernels.mhc as pkg

    name = "vllm.model_executor.kernels.mhc.tilelang_kernels"
    mod = types.ModuleType(name, "dsv4 e2e: TileLang mHC kernel objects without tilelang (standins.py)")
    mod.__dict__.update(_host_python_of(os.path.join(os.path.dirname(pkg.__file__), "tilelang_kernels.py")))
    for attr in TILELANG_KERNEL_NAMES + TILELANG_HELPER_NAMES:   # the epilogue's stand-in or a refusal
        setattr(mod, attr, MHC_STANDINS.get(attr) or _NotWarmed(attr))
    sys.modules[name] = mod
    pkg.tilelang_kernels = mod
    # V4.1's mHC warmup kernel (a VllmJitKernel over the TileLang pre-norm fuse, imported from the
    # module above): its registrations are dropped as the V4 kernels' are
    from vllm.model_executor.kernels.mhc import warmup

    warmup.MHC_PRE_NORM_KERNEL.register_warmup = _NotWarmed("MHC_PRE_NORM_KERNEL").register_warmup


MHC_STANDINS = {"mhc_pre_tilelang": _mhc_pre, "mhc_fused_post_pre_tilelang": _mhc_fused_post_pre,
                "hc_head_fused_kernel_tilelang": _hc_head, "_MHC_PRE_BIG_FUSE_TILELANG_KERNEL": _PreBigFuse(),
                "mhc_pre_delayed_tilelang": _mhc_pre_delayed, "mhc_post_tilelang": _mhc_post,
                "mhc_fused_post_pre_delayed_tilelang": _mhc_fused_post_pre_delayed,
                "mhc_fused_post_pre_tilelang_reuse_residual": _mhc_fused_post_pre_reuse_residual}


def install_mhc() -> list:
    """Rebind the TileLang mHC wrappers (kept on sm_80; TileLang needs a GPU) to vLLM's torch
    references in every module that holds them by name; V4's first-layer broadcast wrapper is kept
    (it calls the plugin's prenorm-GEMM row) and only its TileLang epilogue kernel is stood in
    for. Returns the modules rebound."""
    import sys

    try:
        import vllm.model_executor.kernels.mhc.tilelang_kernels  # noqa: F401 (holds the kernel objects)
    except ImportError:   # no tilelang (the H200 image): a module of stand-ins in its place
        _install_tilelang_kernels_module()

    rebound = []
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if not name.startswith("vllm."):
            continue
        for attr, fn in MHC_STANDINS.items():
            if getattr(mod, attr, None) is not None and getattr(mod, attr) is not fn:
                setattr(mod, attr, fn)
                rebound.append(f"{name}.{attr}")
    return rebound


def install_flashmla_metadata() -> None:
    """The SWA builder's ``get_mla_metadata()`` is FlashMLA's pure-Python entry point (an empty
    scheduler struct); without ``_flashmla_C`` vLLM bound a raiser. The Ampere decode never
    reads the struct, so an empty one is what a real A100 install returns."""
    import vllm.v1.attention.backends.mla.sparse_swa as sw

    def get_mla_metadata(*a, **k):
        CALLS["flashmla.get_mla_metadata"] += 1
        return sw.FlashMLASchedMeta(), None

    sw.get_mla_metadata = get_mla_metadata
