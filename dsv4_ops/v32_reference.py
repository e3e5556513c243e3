"""Pure-PyTorch references of the DeepSeek-V3.2 / GLM-5 MLA ops (``v32_*``): the contract the
kernels of ``dsv4_ops.v32`` are tested against, and the CPU implementations of the ops.

Cache layouts: ``dsv4_ops.layout`` (V3.2 section: the 656-byte ``fp8_ds_mla`` record, the bf16
``auto`` rows of 576). Written for clarity, not speed; any device.

- ``ref_v32_kv_insert``: vLLM 0.33.0's ``concat_and_cache_mla`` as its C++ computes it (fp32
  amax / 448, floor 1e-4, ``2 ** ceil(log2(.))``, a division, a saturating RNE cast), with
  torch's float8 cast; independent of the kernel's integer exponent and fp8-free codec.
- ``ref_v32_kv_gather``: e4m3 * fp32 scale rounded to bf16, RoPE raw; invalid slot: zeros.
- ``ref_v32_sparse_mla``: attention over bf16 rows [N, 576] (d_qk 576, d_v 512, no sink),
  in ``compute_dtype`` (float64 for the tests' oracle); FlashMLA ``tests/ref.py`` semantics
  except that a token with no valid key gets lse = -inf (FlashMLA reports +inf).
- ``ref_v32_sparse_mla_decode``: the same over the paged cache by slot (gather, then attend).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import layout as L

E4M3_MAX = L.E4M3_MAX


def _slots_valid(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    return (slots >= 0) & (slots < capacity)


def v32_quantize_rows(kv_c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 kv_c [N, 512] -> (codes uint8 [N, 512], scales fp32 [N, 4]) exactly as vLLM 0.33.0's
    concat_and_cache_ds_mla_kernel: per 128-dim tile s = max(amax / 448, 1e-4) (fp32),
    scale = 2 ** ceil(log2(s)), codes = e4m3(satfinite(x / scale)), round to nearest even."""
    x = kv_c.to(torch.float32).reshape(-1, L.V32_NUM_TILES, L.V32_TILE)
    amax = x.abs().amax(dim=-1)  # [N, 4]
    s = torch.clamp_min(amax / torch.tensor(E4M3_MAX, dtype=torch.float32), L.V32_SCALE_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(s)))  # fp32 power of two
    q = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # satfinite, then the RNE cast
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, L.V32_NOPE_DIM)
    return codes, scale


def ref_v32_kv_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write the records of tokens 0..M-1 (M = slot_mapping.numel()) in place.

    kv_c bf16 [N, 512], k_pe bf16 [N, 64] (or [N, 1, 64]); kv_cache as accepted by
    ``layout.v32_cache_pages``. A slot < 0 or >= num_blocks * block_size is skipped.
    fp8_ds_mla: bytes [0, 512) codes, [512, 528) the 4 fp32 scales, [528, 656) k_pe raw.
    auto: the row cat(kv_c, k_pe).
    """
    c, fmt = L.v32_cache_pages(kv_cache)
    nb, bs, _ = c.shape
    m = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64).reshape(-1)
    ok = _slots_valid(slots, nb * bs)
    tok = torch.nonzero(ok).reshape(-1)
    if tok.numel() == 0:
        return
    s = slots[tok]
    blk, pos = s // bs, s % bs
    x = kv_c[:m][tok]
    pe = k_pe.reshape(k_pe.shape[0], -1)[:m][tok]
    if fmt == "auto":
        c[blk, pos] = torch.cat([x, pe], dim=-1).to(torch.bfloat16)
        return
    codes, scale = v32_quantize_rows(x)
    rec = torch.cat([codes, scale.contiguous().view(torch.uint8).reshape(-1, 16),
                     pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1, 2 * L.V32_ROPE_DIM)], dim=-1)
    c[blk, pos] = rec


def v32_dequantize_records(rec: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] records -> bf16 [..., 576]: e4m3(code) * fp32 scale of its tile
    (rounded once to bf16), then the 64 raw bf16 RoPE dims."""
    lead = rec.shape[:-1]
    r = rec.reshape(-1, L.V32_RECORD_BYTES)
    codes = r[:, :L.V32_NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = r[:, L.V32_SCALE_OFFSET:L.V32_ROPE_OFFSET].contiguous().view(torch.float32)  # [n, 4]
    nope = (codes.reshape(-1, L.V32_NUM_TILES, L.V32_TILE) * scale[..., None]).reshape(-1, L.V32_NOPE_DIM)
    rope = r[:, L.V32_ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=-1).reshape(*lead, L.V32_HEAD_DIM_QK)


def ref_v32_kv_gather(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """bf16 slots.shape + (576,): the dequantized record of each slot (any shape, order,
    repeats); an invalid slot (< 0 or >= num_blocks * block_size) gives a zero row."""
    c, fmt = L.v32_cache_pages(kv_cache)
    nb, bs, _ = c.shape
    flat = slots.to(torch.int64).reshape(-1)
    ok = _slots_valid(flat, nb * bs)
    s = torch.where(ok, flat, torch.zeros_like(flat))
    out = torch.zeros((flat.numel(), L.V32_HEAD_DIM_QK), dtype=torch.bfloat16, device=c.device)
    if nb * bs and flat.numel():
        rec = c[s // bs, s % bs]
        rows = rec if fmt == "auto" else v32_dequantize_records(rec)
        out = torch.where(ok[:, None], rows, out)
    return out.reshape(tuple(slots.shape) + (L.V32_HEAD_DIM_QK,))


def ref_v32_sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                       topk_length: Optional[torch.Tensor], sm_scale: float,
                       compute_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype = torch.bfloat16,
                       chunk: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over rows: q [T, H, 576], kv [N, 576], indices [T, K] rows of kv.

    valid(t, j) = 0 <= indices[t, j] < N and (topk_length is None or j < topk_length[t]);
    s = sm_scale * <q[t, h], kv[row]> over the 576 dims; out = softmax(s) @ kv[row, :512];
    lse = logsumexp(s) (natural log). No valid key: out 0, lse -inf. Repeats count each time.
    Returns out [T, H, 512] in out_dtype, lse float32 (or compute_dtype if float64) [T, H].
    Computed in compute_dtype, ``chunk`` tokens at a time (bounded memory)."""
    T, H = q.shape[0], q.shape[1]
    K = indices.shape[1]
    N = kv.shape[0]
    dv = L.V32_HEAD_DIM_V
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros((T, H, dv), dtype=out_dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=lse_dtype, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    kvc = kv.to(compute_dtype)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        idx = indices[t0:t1].to(torch.int64)
        ok = (idx >= 0) & (idx < N)
        if topk_length is not None:
            ok &= torch.arange(K, device=idx.device)[None, :] < topk_length[t0:t1].to(torch.int64)[:, None]
        if K == 0 or N == 0:
            continue
        rows = kvc[torch.where(ok, idx, torch.zeros_like(idx))]  # [t, K, 576]
        s = torch.einsum("thd,tkd->thk", q[t0:t1].to(compute_dtype), rows) * sm_scale
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [t, H]
        has = l > float("-inf")
        p = torch.exp(s - torch.where(has, l, torch.zeros_like(l))[..., None])
        p = torch.where(has[..., None], p, torch.zeros_like(p))
        o = torch.einsum("thk,tkd->thd", p, rows[..., :dv])
        out[t0:t1] = o.to(out_dtype)
        lse[t0:t1] = l.to(lse_dtype)
    return out, lse


def ref_v32_sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                              topk_length: Optional[torch.Tensor], sm_scale: float,
                              compute_dtype: torch.dtype = torch.float32,
                              out_dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over the paged cache: indices [T, K] are slots (block * block_size + pos);
    a slot outside [0, num_blocks * block_size) is masked. The keys are the records
    dequantized to bf16 (ref_v32_kv_gather), then ref_v32_sparse_mla over them."""
    T, K = indices.shape
    c, _ = L.v32_cache_pages(kv_cache)
    cap = c.shape[0] * c.shape[1]
    rows = ref_v32_kv_gather(kv_cache, indices.reshape(-1))  # [T*K, 576]
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < cap)
    local = torch.arange(T * K, device=indices.device, dtype=torch.int64).reshape(T, K)
    local = torch.where(ok, local, torch.full_like(local, -1))
    return ref_v32_sparse_mla(q, rows, local, topk_length, sm_scale, compute_dtype, out_dtype)
