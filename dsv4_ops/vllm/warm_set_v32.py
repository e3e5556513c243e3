"""The warm set of DeepSeek-V3.2 / GLM-5 (vLLM 0.33.0's ``deepseek_v32`` serve path on sm_8x):
every Triton launch key this library's kernels get from that path, for one model, TP degree,
cache format and ``max_num_batched_tokens`` (the V4 / V4.1 set is ``warm_set``; this file
reuses its tracing: meta tensors, ``routed_ops``, ``device_of``, ``trace``).

The calls are the plugin's own V3.2 entry points, shaped as vLLM's forward passes them:
- ``v32_backend.forward_mqa_kernel`` (the backend's ``_forward_mqa_kernel``): q as (ql_nope
  [T, H, 512], q_pe [T, H, 64]) bf16, the layer's cache (fp8_ds_mla uint8 [nb, bs, 656] or
  bf16 [nb, bs, 576]), physical top-k rows int32 [T, index_topk], decode and prefill;
- ``v32_model.fused_norm_rope`` (MLA cache insert, int64 slots; indexer K insert on indexer
  layers; none on GLM-5's shared-indexer layers) and ``v32_model.fused_q`` (indexer Q quant);
- the indexer's logits through the ``indexer`` rows (``fp8_fp4_mqa_logits`` for prefill,
  ``fp8_fp4_paged_mqa_logits`` for decode: 1-D context lengths, [B, next_n] on the MTP path),
  ``index_heads`` x 128, one indexer-cache row of 132 bytes a token.

Batch classes: a key depends on T only through the kernels' int classes of T (1, multiple of
16, other), the split count and form of ``dispatch.v32.num_splits_for`` / ``auto_form`` (at every
form the tree has), and the decode indexer's tiles a program; one T per signature
(``batch_classes``), checked against a scan of every T in tests/test_warm_set.py.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable, Dict, List, Optional, Tuple

from . import warm_common as ws

LATENT, ROPE, INDEXER_DIM = 512, 64, 128
CACHE_DTYPES = ("fp8_ds_mla", "auto")


@dataclasses.dataclass(frozen=True)
class V32Shapes:
    """What the V3.2 / GLM-5 dispatch depends on. heads: query heads (per rank: heads // tp);
    index_heads: indexer heads (replicated over TP); cache_dtype: 'fp8_ds_mla' (the 656-byte
    record; ``--kv-cache-dtype fp8`` names it too) or 'auto' (bf16 rows of 576); block_size:
    the MLA and indexer caches' (vLLM: 64); next_n: query rows a request has in a decode step."""

    name: str
    heads: int
    index_heads: int
    index_topk: int = 2048
    tp: int = 1
    max_model_len: int = 163840
    block_size: int = 64
    num_blocks: int = 4096
    cache_dtype: str = "fp8_ds_mla"
    next_n: Tuple[int, ...] = (1,)

    def __post_init__(self):
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"{self.name}: cache_dtype {self.cache_dtype!r} not in {CACHE_DTYPES}")

    @property
    def heads_per_rank(self) -> int:
        if self.heads % self.tp:
            raise ValueError(f"{self.name}: {self.heads} heads do not split over TP = {self.tp}")
        return self.heads // self.tp


def deepseek_v32(tp: int = 1, **kw) -> V32Shapes:
    """DeepSeek-V3.2: 128 query heads, indexer 64 x 128, top-k 2048."""
    return V32Shapes("DeepSeek-V3.2", heads=128, index_heads=64, tp=tp, **kw)


def glm5(tp: int = 1, **kw) -> V32Shapes:
    """GLM-5: 64 query heads, indexer 32 x 128, top-k 2048 (transformers' GlmMoeDsaConfig)."""
    return V32Shapes("GLM-5", heads=64, index_heads=32, tp=tp, **kw)


MODELS: Dict[str, Callable[..., V32Shapes]] = {"v32": deepseek_v32, "glm5": glm5}


# ----------------------------------------------------------------------------- the calls

def _mla_cache(s: V32Shapes):
    import torch

    if s.cache_dtype == "fp8_ds_mla":
        return ws._meta((s.num_blocks, s.block_size, 656), torch.uint8)
    return ws._meta((s.num_blocks, s.block_size, LATENT + ROPE), torch.bfloat16)


def mla_step(s: V32Shapes, T: int, is_decode: bool) -> None:
    """The backend's ``_forward_mqa_kernel`` for T query rows (decode or prefill tokens)."""
    import torch

    from . import v32_backend

    H = s.heads_per_rank
    impl = types.SimpleNamespace(scale=(LATENT + ROPE) ** -0.5, need_to_return_lse_for_decode=False)
    q = (ws._meta((T, H, LATENT), torch.bfloat16), ws._meta((T, H, ROPE), torch.bfloat16))
    v32_backend.forward_mqa_kernel(impl, q, _mla_cache(s), ws._meta((T, s.index_topk), torch.int32), None,
                                   layer=None, block_size=s.block_size, is_decode=is_decode)


def writers(s: V32Shapes, T: int, has_indexer: bool) -> None:
    """``fused_norm_rope`` (caches) and ``fused_q`` (indexer Q) of one layer for T tokens."""
    import torch

    from . import v32_model

    H, Hi, m = s.heads_per_rank, s.index_heads, ws._meta
    f32, bf16 = torch.float32, torch.bfloat16
    pos = m((T,), torch.int64)
    cs = m((s.max_model_len, ROPE), f32)
    v32_model.fused_norm_rope(
        pos, m((T, 1536), bf16), m((1536,), bf16), 1e-6, m((T, LATENT), bf16), m((LATENT,), bf16), 1e-6,
        m((T, 1, ROPE), bf16), cs, m((T, INDEXER_DIM), bf16) if has_indexer else None,
        m((INDEXER_DIM,), bf16), m((INDEXER_DIM,), bf16), 1e-6, cs, m((T, s.index_topk), torch.int32),
        slot_mapping=m((T,), torch.int64),
        indexer_k_cache=m((s.num_blocks, s.block_size, INDEXER_DIM + 4), torch.uint8) if has_indexer else None,
        mla_kv_cache=_mla_cache(s), mla_kv_cache_dtype=s.cache_dtype, has_indexer=has_indexer)
    if has_indexer:
        v32_model.fused_q(pos, m((T, H, ROPE), bf16), cs, m((T, Hi, INDEXER_DIM), bf16), cs,
                          m((T, H, LATENT), bf16), None, m((T, Hi), bf16), 1.0, 1.0, has_indexer=True,
                          quantize_mqa=False)


def indexer_decode(s: V32Shapes, T: int) -> None:
    """The decode logits (``fp8_fp4_paged_mqa_logits``) for T = B * next_n rows: context
    lengths [B] (plain decode, vLLM's flatten path) and [B, next_n] (native MTP)."""
    import torch

    from . import indexer as vidx

    Hi, m = s.index_heads, ws._meta
    icache = m((s.num_blocks, s.block_size, 1, INDEXER_DIM + 4), torch.uint8)
    for next_n in s.next_n:
        if T % next_n:
            continue
        B = T // next_n
        for ctx_shape in {(B,), (B, next_n) if next_n > 1 else (B,)}:
            vidx.fp8_fp4_paged_mqa_logits((m((B, next_n, Hi, INDEXER_DIM), torch.float8_e4m3fn), None), icache,
                                          m((T, Hi), torch.float32), m(ctx_shape, torch.int32),
                                          m((B, ws._cdiv(s.max_model_len, s.block_size)), torch.int32), None,
                                          s.max_model_len)


def serve_calls(s: V32Shapes, token_counts, variant: str, sms: int) -> List[Callable[[], None]]:
    """Every call of the V3.2 serve path at each token count; the prefill indexer's
    data-dependent sizes (keys, logit columns) at every class of ``warm_set.DATA_SIZES``."""
    calls = []
    for T in token_counts:
        for is_decode in (True, False):
            calls.append(functools.partial(mla_step, s, T, is_decode))
        for has_indexer in (True, False):
            calls.append(functools.partial(writers, s, T, has_indexer))
        calls.append(functools.partial(indexer_decode, s, T))
        for n in ws.DATA_SIZES:
            for cols in ws.DATA_SIZES:
                calls.append(functools.partial(ws.prefill_logits, s, T, n, cols, variant))
    return calls


# ----------------------------------------------------------------------------- batch classes

def t_signature(s: V32Shapes, sms: int) -> Callable[[int], tuple]:
    """What the V3.2 launchers choose from T: the int class of T, the attention's split count
    of every form the tree has and the form auto picks, the decode indexer's tiles a program."""
    from .. import v32
    from ..dispatch import indexer
    from ..dispatch import v32 as dispatch_v32

    H, K = s.heads_per_rank, s.index_topk
    forms = tuple(getattr(v32, "FORMS", ("w64", "w128")))
    fp8 = s.cache_dtype == "fp8_ds_mla"

    def sig(T: int) -> tuple:
        out = [ws.int_class(T), T % 16, dispatch_v32.auto_form(fp8, H, T)]
        out.extend(dispatch_v32.num_splits_for(T, H, K, sms, f) for f in forms)
        out.extend(T % n == 0 for n in s.next_n)
        out.append(ws.int_class(indexer.paged_tiles_per_program(T, s.max_model_len)))
        return tuple(out)

    return sig


def batch_classes(s: V32Shapes, max_tokens: int, sms: int) -> List[int]:
    """One token count per signature of [1, max_tokens], ascending."""
    sig = t_signature(s, sms)
    seen: Dict[tuple, int] = {}
    for T in range(1, max_tokens + 1):
        seen.setdefault(sig(T), T)
    return sorted(seen.values())


def build(s: V32Shapes, max_tokens: int, sms: int = 108, variant: str = "portable",
          cache_dir: Optional[str] = None) -> "ws.WarmSet":
    """The warm set of one V3.2 / GLM-5 configuration (``cache_dir``: as ``warm_set.build``)."""
    if cache_dir is not None:
        return ws.cached_build(cache_dir, s, max_tokens, sms, variant, "v32",
                               lambda: build(s, max_tokens, sms, variant))
    classes = batch_classes(s, max_tokens, sms)
    keys = ws.trace(serve_calls(s, classes, variant, sms), sms, variant)
    return ws.WarmSet(s, max_tokens, sms, variant, keys, tuple(classes))


def shapes_from_vllm_config(vllm_config) -> Optional[V32Shapes]:
    """V32Shapes of the model vLLM serves, or None when it is not DeepSeek-V3.2 / GLM-5 (read:
    the HF config's heads, indexer heads and top-k; TP; max_model_len; the cache's dtype, block
    size and blocks; the speculative tokens)."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_config", None)
    archs = " ".join(getattr(hf, "architectures", None) or ())
    if hf is None or not any(a in archs for a in ("DeepseekV32", "GlmMoeDsa")):
        return None
    cache = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cache, "cache_dtype", "auto") or "auto")
    from .v32_backend import KV_CACHE_ALIASES

    dtype = KV_CACHE_ALIASES.get(dtype, dtype)
    kw = dict(name="GLM-5" if "GlmMoeDsa" in archs else "DeepSeek-V3.2",
              heads=int(getattr(hf, "num_attention_heads", 128)), index_heads=int(getattr(hf, "index_n_heads", 64)),
              index_topk=int(getattr(hf, "index_topk", 2048)),
              tp=int(vllm_config.parallel_config.tensor_parallel_size),
              max_model_len=int(model_config.max_model_len),
              cache_dtype="auto" if dtype in ("auto", "bfloat16") else dtype)
    kw.update(ws.serve_limits(vllm_config))
    return V32Shapes(**kw)
