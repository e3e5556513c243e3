"""mHC (hyper-connections) on sm_8x: V4's first-layer prenorm GEMM without DeepGEMM.

``mhc_pre_broadcast_tilelang`` (vLLM 0.33.0 ``model_executor/kernels/mhc/tilelang.py``
L685-775, DeepSeek-V4 layer 0, hit in the profile run) calls
``_hc_prenorm_gemm_outputs(..., use_tilelang_fallback=False)`` (L9-58), which forces DeepGEMM's
``tf32_hc_prenorm_gemm``: no sm_80 implementation. Its inputs are the embedding ``x`` bf16
[T, H] (one copy of the residual, broadcast to hc_mult streams) and ``fn_broadcast`` fp32
[hc_mult * (2 + hc_mult), H] (``hc_attn_fn`` summed over the hc copies, made at load by
``finalize_mhc_broadcast_weights``), so the TileLang fallback GEMM (which asserts
``x.shape[1] == hc_mult * hidden_size``) does not take it either.

The replacement computes the same two outputs with torch (cuBLAS, any GPU):
``out[0, t, n] = sum_k x[t, k] * fn[n, k]`` (fp32 [1, T, N]) and ``sqrsum[0, t] = sum_k
x[t, k]**2`` (fp32 [1, T]), one split, which ``_MHC_PRE_BIG_FUSE_TILELANG_KERNEL`` reduces
exactly as it reduces DeepGEMM's split outputs (``rsqrt(sum(sqrsum) / H + eps)``). Calls
with ``use_tilelang_fallback=True`` (every other mHC boundary) go to vLLM's own function,
which on sm_8x runs the TileLang kernel ``_HC_PRENORM_GEMM_TILELANG_KERNEL``.

The other mHC TileLang kernels (prenorm GEMM, pre big-fuse incl. the broadcast variant,
post, fused post+pre, head) compiled to sm_80 cubins on a CPU host with TileLang 0.1.12 and
nvcc 13.0 (hidden 4096 and 5120, vLLM's warmup keys; ``docs/journal/notes.md``). Compiled,
not run: no A100 was available.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from .table import Patch

_MHC = "vllm.model_executor.kernels.mhc.tilelang"


def hc_prenorm_gemm_torch(x: torch.Tensor, fn: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, K], fn fp32 [N, K] -> (out fp32 [1, T, N] = x @ fn.T, sqrsum fp32 [1, T] =
    row sums of x**2), both accumulated in fp32. No host sync (CUDA-graph capturable)."""
    if x.dim() != 2 or fn.dim() != 2 or x.shape[1] != fn.shape[1]:
        raise ValueError(f"x, fn: expected [T, K] and [N, K], got {tuple(x.shape)} and {tuple(fn.shape)}")
    xf = x.float()
    out = torch.mm(xf, fn.float().t()).unsqueeze(0)
    sqrsum = torch.bmm(xf.unsqueeze(1), xf.unsqueeze(2)).view(1, x.shape[0])  # no [T, K] square temp
    return out, sqrsum


def tf32_hc_prenorm_gemm_ampere(x: torch.Tensor, fn: torch.Tensor, out: torch.Tensor, sqrsum: torch.Tensor,
                                num_split: int) -> torch.Tensor:
    """Drop-in for vLLM's ``vllm.utils.deep_gemm.tf32_hc_prenorm_gemm`` (DeepGEMM, sm_90+):
    x bf16 [T, K], fn fp32 [N, K], out fp32 [num_split, T, N], sqrsum fp32 [num_split, T],
    written in place as split-K partials whose sum is ``x @ fn.T`` and the row sums of x**2
    (every consumer sums the splits): the whole result in split 0, zeros in the others.
    fp32 accumulation (DeepGEMM's is tf32). Every vLLM 0.33.0 caller imports it at call time
    (mHC broadcast, delayed and overlap paths), so this one row reaches them all."""
    full, sq = hc_prenorm_gemm_torch(x, fn)
    if out.dim() != 3 or sqrsum.dim() != 2 or out.shape[1:] != full.shape[1:] or sqrsum.shape[1] != sq.shape[1]:
        raise ValueError(f"tf32_hc_prenorm_gemm: out {tuple(out.shape)} / sqrsum {tuple(sqrsum.shape)} do not match "
                         f"x {tuple(x.shape)} and fn {tuple(fn.shape)}")
    out[0].copy_(full[0])
    sqrsum[0].copy_(sq[0])
    if out.shape[0] > 1:
        out[1:].zero_()
        sqrsum[1:].zero_()
    return out


def hc_prenorm_gemm_outputs_ampere(original: Callable) -> Callable:
    """Builder for ``_hc_prenorm_gemm_outputs``: the broadcast call (``use_tilelang_fallback=
    False``, DeepGEMM forced) goes to torch; every other call to vLLM's original."""

    def _hc_prenorm_gemm_outputs(x, fn, *, hidden_size, hc_mult, use_tilelang_fallback=True):
        if use_tilelang_fallback:
            return original(x, fn, hidden_size=hidden_size, hc_mult=hc_mult, use_tilelang_fallback=True)
        return hc_prenorm_gemm_torch(x, fn)

    _hc_prenorm_gemm_outputs.__qualname__ = "hc_prenorm_gemm_outputs_ampere"
    return _hc_prenorm_gemm_outputs


PATCHES = (
    Patch(_MHC, "_hc_prenorm_gemm_outputs", ("x", "fn", "hidden_size", "hc_mult", "use_tilelang_fallback"),
          "V4 first-layer mHC (mhc_pre_broadcast_tilelang) forces DeepGEMM tf32_hc_prenorm_gemm "
          "(no sm_80 implementation) -> torch fp32 GEMM + row sum of squares; other calls keep "
          "vLLM's TileLang fallback (compiles for sm_80)",
          hc_prenorm_gemm_outputs_ampere, wraps=True, model="v4"),
    Patch("vllm.utils.deep_gemm", "tf32_hc_prenorm_gemm", ("x", "fn", "out", "sqrsum", "num_split"),
          "DeepGEMM's mHC prenorm GEMM has no sm_80 implementation; every other path to it (V4.1's "
          "mhc_pre_delayed_overlap, the delayed and broadcast mHC paths when forced) -> torch fp32 GEMM "
          "written as split-K partials", tf32_hc_prenorm_gemm_ampere),
)
