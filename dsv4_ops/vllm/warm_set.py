"""The warm set: every Triton launch key (``dsv4_ops.warm_keys``) that vLLM's DeepSeek-V4 /
V4.1 serve path can reach through this library on sm_8x, for one model, TP degree and
``max_num_batched_tokens``.

Built by calling the plugin's own entry points (``dsv4_ops.vllm.attention.ampere_decode`` /
``flash_mla_sparse_fwd_ampere`` / ``dequantize_and_gather_k_cache_ampere``, the
``dsv4_ops.vllm.indexer`` functions) and the ops the other writers call, with ``meta``
tensors shaped as vLLM 0.33.0's DSv4 forward passes them, under ``warm_keys.recording()``,
with ``torch.ops.dsv4_ampere`` routed to each op's registered CUDA implementation (its
launcher: on meta tensors the real op would run its fake) and the launchers answering for the
target device (``device_of``: its SM count, the kernel variant). Nothing is allocated on a
GPU and nothing runs; every dispatch decision below an entry point (the composite's paged /
workspace / gather branches, split plans, sparse prefill's kernel-or-split rule, ...) is the code's
own, so a new branch or kernel shows up here without a hand list, and a kernel of the AOT
table that none reaches fails ``tests/test_warm_set.py`` unless ``NOT_SERVED`` names it.

Batch classes. A launch key depends on the token count T only through the dispatch's choices
from T (``t_choices``: the paged op's plan, the workspace plan of the mode, sparse prefill's
rule), the one-launch gather branch (T * K <= FUSED_GATHER_MAX_ROWS),
Triton's specialization of ints derived from T (== 1, multiple of 16; the kernels mark pure
counts ``do_not_specialize``) and a few T-derived launch ints (``_other_t_ints``), so the keys
of all T in [1, max_tokens] are those of one representative per class (``batch_classes``).
Sizes that depend on request contents, not on T (a prefill workspace's rows, the tokens a
compressor writes, indexer key counts), take each specialization class: ``DATA_SIZES`` (1, a
multiple of 16, neither). The plans also depend on the SM count (108 on an A100): ``sms``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import envs, warm_keys
from . import warm_set_v32
from .warm_common import (  # noqa: F401 - shared with warm_set_v32; tests and warmup read them here
    DATA_SIZES, INDEXER_DIM, _cdiv, int_class, _meta, on_device, prefill_logits, WarmSet, SM_SOURCES,
    trace, CACHE_ENV, default_cache_dir, cache_key, cached_build, serve_limits)

HEAD_DIM = 512
RECORD_BYTES = 584
C128A_TOPK_ALIGNMENT = 128  # vLLM deepseek_v4/sparse_mla.py _C128A_TOPK_ALIGNMENT
# Kernels of the sm_8x AOT table (``dsv4_ops.aot.all_specs``) that vLLM's DeepSeek-V4 / V4.1 and
# V3.2 / GLM-5 (``warm_set_v32``) serve paths never launch, with the reason; every other AOT
# kernel must be in a warm set (tests/test_warm_set.py), so a new kernel is warmed or named here.
NOT_SERVED = {
    "_e4m3_decode_kernel": "the E4M3 decode op (dsv4_ampere.e4m3_decode) serves tools and tests; the cache "
                           "readers inline their own codec (e4m3_encode is served: V3.2's indexer Q quant)",
    "_v32_kv_gather_kernel": "DeepSeek-V3.2's cache gather (dsv4_ampere.v32_kv_gather) serves tests and tools; "
                             "the backend's attention reads the cache rows by index",
}
# AOT kernels a launcher keeps selectable by an explicit config (benchmarks, overrides) while
# its shipped config may run another kernel: warm or not, both are fine.
SELECTABLE = {
    "_mqa_logits_v2_kernel": "the prefill indexer's v2 kernel: a MQA_CANDIDATES row once MQA_COMPRESSED_CONFIG "
                             "runs v3",
    "_sparse_mla_prefill_splitd_kernel": "sparse prefill's split-d kernel: CANDIDATES rows with SPLIT (measured "
                                         "slower, 3.6 vs 1.96 ms at H = 64; benchmarks/results/sparse_prefill.md)",
    "_v32_sparse_mla_f16t_kernel": "V3.2's transposed f16 decode: F16_CANDIDATES rows (benchmark candidates, not "
                                   "auto's)",
    "_balance_plan_kernel": f"the balanced decode split's planning kernel: opt-in ({envs.DECODE_BALANCE}=1, read at "
                            "each call and in the set's cache key), warm when the knob is on at startup",
    "_merge_balanced_kernel": "the balanced decode split's merge: as _balance_plan_kernel",
}
# Engram table rows of a shard and hash columns: stand-ins (they only reach kernel ints, whose
# classes the real values may differ in: unverified against a V4.1 checkpoint).
ENGRAM_ROWS, ENGRAM_COLS = 1 << 20, 16


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the dispatch of one served model depends on.

    heads: query heads of the model (heads per rank = heads // tp); index_heads: indexer
    heads (replicated over TP in vLLM 0.33.0: ``self.n_head = config.index_n_heads``);
    index_topk: top-k of the indexed layers; window: sliding-window keys; ratios: compress
    ratios of the compressed layers (V4: 4 = C4A, indexed, and 128 = C128A; V4.1: 1 and 2,
    both indexed); index_ratios: those whose indexer writes an indexer cache; c128a: V4's C128A
    layers exist (their top-k width is a power of two >= 128 up to max_model_len / 128,
    vLLM sparse_mla.py); engram: (DIM, QUANT_BLOCK) of V4.1's Engram rows or None;
    block_size: KV-cache block size (tokens; compressed caches hold block_size // ratio);
    swa_block_size: the window cache's; num_blocks: blocks of each cache (capacities are
    kernel ints); max_image_tokens: V4.1's image tokens in the prefill index width;
    next_n: query rows a request has in a decode step (1, and 1 + speculative tokens with MTP).
    draft_windows: window index widths of the draft's decode besides ``window`` (DSpark's
    non-causal draft block: window + speculative tokens rounded up to 64, vLLM
    ``get_dspark_swa_index_width``; 192 for window 128); its layers take every layer kind.
    """

    name: str
    heads: int
    index_heads: int
    index_topk: int = 512
    window: int = 128
    c128a: bool = False
    ratios: Tuple[int, ...] = (4,)
    index_ratios: Tuple[int, ...] = (4,)
    engram: Optional[Tuple[int, int]] = None
    tp: int = 1
    max_model_len: int = 65536
    block_size: int = 256
    swa_block_size: int = 64
    num_blocks: int = 4096
    max_image_tokens: int = 0
    next_n: Tuple[int, ...] = (1,)
    draft_windows: Tuple[int, ...] = ()

    def swa_widths(self) -> Tuple[int, ...]:
        """Every window index width a decode step passes (K2): the window, and the draft's."""
        return tuple(sorted({self.window} | set(self.draft_windows)))

    @property
    def heads_per_rank(self) -> int:
        if self.heads % self.tp:
            raise ValueError(f"{self.name}: {self.heads} heads do not split over TP = {self.tp}")
        return self.heads // self.tp

    def decode_layer_kinds(self) -> Tuple[Tuple[int, int], ...]:
        """(K1, compress ratio) of every decode layer kind: (0, 1) SWA-only, (top-k, 4) C4A,
        and V4's C128A widths (powers of two from 128, up to the aligned max_model_len / 128)."""
        kinds = {(0, 1)} | {(self.index_topk, r) for r in self.ratios if r != 128}
        if self.c128a:
            top = _cdiv(_cdiv(self.max_model_len, 128), C128A_TOPK_ALIGNMENT) * C128A_TOPK_ALIGNMENT
            w = C128A_TOPK_ALIGNMENT
            while w < top:
                kinds.add((w, 128))
                w *= 2
            kinds.add((top, 128))
        return tuple(sorted(kinds))

    def decode_topk_widths(self) -> Tuple[int, ...]:
        """K1 of every decode layer kind."""
        return tuple(sorted({k1 for k1, _ in self.decode_layer_kinds()}))

    def prefill_index_widths(self) -> Tuple[int, ...]:
        """Width of vLLM's combined prefill indices: round_up(top_k + window + image tokens, 128)."""
        return tuple(sorted({_cdiv(k1 + self.window + self.max_image_tokens, 128) * 128
                             for k1 in self.decode_topk_widths()}))


def v4_flash(tp: int = 1, **kw) -> ModelShapes:
    """DeepSeek-V4-Flash: 64 query heads, indexer 64 x 128, C4A and C128A layers, no Engram."""
    return ModelShapes("DeepSeek-V4-Flash", heads=64, index_heads=64, c128a=True, ratios=(4, 128), tp=tp, **kw)


def v41_flash(tp: int = 1, **kw) -> ModelShapes:
    """DeepSeek-V4.1-Flash: 64 query heads, indexer 32 x 128, Engram rows of 256 E4M3 bytes
    with one UE8M0 byte per 32."""
    kw.setdefault("block_size", 128)
    return ModelShapes("DeepSeek-V4.1-Flash", heads=64, index_heads=32, engram=(256, 32), ratios=(1, 2),
                       index_ratios=(1, 2), tp=tp, **kw)


# ----------------------------------------------------------------------------- batch classes

def t_choices(T: int, H: int, K: int, sms: int, mode: str) -> tuple:
    """Every choice the dispatch makes from (T, H, K, SMs) for one key width: the paged op's plan
    (dispatch.decode.plan_step, aligned and not, with and without lengths), the workspace plan of the
    mode (dispatch.workspace), and whether sparse prefill takes its own kernel (dispatch.prefill).
    Token counts with equal choices at every width launch the same kernels."""
    import torch

    from ..dispatch import decode as dp
    from ..dispatch import prefill
    from ..dispatch import workspace as ws

    out = [ws.plan(T, H, K, sms, mode if mode in ws.MODES else "auto")]
    out.extend(dp.plan_step(T, H, K, sms, -1, lengths=lengths, aligned=aligned)
               for aligned in (True, False) for lengths in (False, True))
    out.append(prefill.uses_prefill_kernel(T, H, torch.int32, sms))
    return tuple(out)


def batch_classes(max_tokens: int, H: int, widths: Sequence[int], sms: int, mode: str = "auto",
                  fused_max_rows: Optional[int] = None,
                  extra: Optional[Callable[[int], tuple]] = None) -> List[int]:
    """One token count per class of [1, max_tokens] (module doc): T == 1, T mod 16, every
    dispatch choice at every key width in ``widths`` (``t_choices``), the one-launch gather
    branch (T * width <= fused_max_rows) for each, and ``extra(T)`` (other launch ints
    computed from T, as their int_class). Ascending."""
    seen: Dict[tuple, int] = {}
    for T in range(1, max_tokens + 1):
        sig = (T == 1, T % 16, tuple(t_choices(T, H, K, sms, mode) for K in widths),
               () if fused_max_rows is None else tuple(T * K <= fused_max_rows for K in widths),
               () if extra is None else extra(T))
        seen.setdefault(sig, T)
    return sorted(seen.values())


def _other_t_ints(shapes: ModelShapes, sms: int) -> Callable[[int], tuple]:
    """Launch ints that launchers compute from T besides the plan: the decode indexer's key
    tiles a program (``dispatch.indexer.paged_tiles_per_program``) and the Engram grid size (both of
    engram_calls' grids), as int classes."""
    from ..csrc_triton import engram as engram_kernels
    from ..dispatch import indexer

    ctx_cols = [_cdiv(shapes.max_model_len, r) for r in shapes.index_ratios]
    cfg = engram_kernels.LOOKUP_CONFIG
    local = _cdiv(ENGRAM_COLS, shapes.tp)

    def ints(T: int) -> tuple:
        out = [T % n == 0 for n in shapes.next_n]
        out.extend(int_class(indexer.paged_tiles_per_program(T, c)) for c in ctx_cols)
        if shapes.engram is not None:
            for programs in (sms * cfg["PROGRAMS_PER_SM"], max(1, sms // 2)):
                out.append(int_class(min(_cdiv(T * local, cfg["BLOCK_R"]), programs)))
        return tuple(out)

    return ints


# ----------------------------------------------------------------------------- the calls


def _cache(shapes: ModelShapes, block_size: int, record_bytes: int = RECORD_BYTES):
    """A paged cache uint8 [num_blocks, page_bytes] as vLLM sizes it (page rounded up to 576)."""
    import torch

    page = _cdiv(block_size * record_bytes, 576) * 576 if record_bytes == RECORD_BYTES else block_size * record_bytes
    return _meta((shapes.num_blocks, page), torch.uint8)


def decode_step(shapes: ModelShapes, T: int, K1: int, variant: str, with_swa_len: bool, mode: str,
                ratio: int = 4, K2: Optional[int] = None) -> None:
    """One decode layer as vLLM's ``_forward_decode`` calls the plugin's
    ``vllm.attention.ampere_decode``: q / output bf16 [T, H, 512], window slots int32
    [T, 1, window] with or without int32 lengths, the compressed cache (block_size // ratio
    tokens a block) with int32 top-k slots [T, 1, K1] and lengths, or none (SWA-only, K1 = 0),
    the sink; K2: the window index width (None: ``shapes.window``; a draft's, draft_windows).
    Everything below is the composite's own dispatch (``dsv4_decode``: the paged op or the
    workspace step's one-launch gather or two gathers; plan and splits from T) and the ops'
    launchers (``routed_ops``)."""
    import torch

    from . import attention as vattn

    H, K2 = shapes.heads_per_rank, shapes.window if K2 is None else K2
    comp_bs = max(1, shapes.block_size // ratio)
    swa = _cache(shapes, shapes.swa_block_size)
    comp = _cache(shapes, comp_bs) if K1 else None
    topk = _meta((T, 1, K1), torch.int32) if K1 else None
    topk_len = _meta((T,), torch.int32) if K1 else None
    swa_slots = _meta((T, 1, K2), torch.int32)
    swa_len = _meta((T,), torch.int32) if with_swa_len else None
    q = _meta((T, H, HEAD_DIM), torch.bfloat16)
    out = _meta((T, H, HEAD_DIM), torch.bfloat16)
    sink = _meta((H,), torch.float32)
    with decode_mode(mode):
        vattn.ampere_decode(q, out, swa, swa_slots, swa_len, shapes.swa_block_size, comp, topk, topk_len,
                            comp_bs if K1 else shapes.swa_block_size, sink, HEAD_DIM ** -0.5)


@contextlib.contextmanager
def decode_mode(mode: Optional[str]):
    """The decode mode (envs.DECODE_KERNEL) overridden for the block (None or 'invariant': unchanged; the
    composite reads it at each call)."""
    if mode is None or mode == "invariant":
        yield
        return
    with envs.override(**{envs.DECODE_KERNEL: mode}):
        yield


def prefill_attention(shapes: ModelShapes, T: int, width: int, n_kv: int, variant: str, mode: str) -> None:
    """vLLM's ``_forward_prefill`` through the plugin's ``flash_mla_sparse_fwd_ampere``: q
    [T, H, 512], the chunk's gathered workspace [n_kv, 1, 512], combined int32 indices
    [T, 1, width] with int32 lengths, the sink, ``out`` given."""
    import torch

    from . import attention as vattn

    H = shapes.heads_per_rank
    q = _meta((T, H, HEAD_DIM), torch.bfloat16)
    kv = _meta((n_kv, 1, HEAD_DIM), torch.bfloat16)
    idx = _meta((T, 1, width), torch.int32)
    lens = _meta((T,), torch.int32)
    out = _meta((T, H, HEAD_DIM), torch.bfloat16)
    with decode_mode(mode):
        vattn.flash_mla_sparse_fwd_ampere(q, kv, idx, HEAD_DIM ** -0.5, HEAD_DIM, _meta((H,), torch.float32), lens,
                                          out)


def prefill_gather(shapes: ModelShapes, n_slots: int, block_size: int, variant: str) -> None:
    """The plugin's ``dequantize_and_gather_k_cache_ampere`` for one request of n_slots rows
    into a bf16 [1, n_slots, 512] workspace (int64 slots [R, L] built by torch)."""
    import torch

    from . import attention as vattn

    vattn.dequantize_and_gather_k_cache_ampere(
        _meta((1, n_slots, HEAD_DIM), torch.bfloat16), _cache(shapes, block_size), _meta((1,), torch.int32), None,
        _meta((1, _cdiv(n_slots, block_size) + 1), torch.int32), block_size, 0)


def cache_inserts(shapes: ModelShapes, n: int, variant: str) -> None:
    """The compressed-cache writers: 512-d records (``kv_cache_insert``, int64 slots, at every
    compressed block size) and indexer keys (``indexer_k_insert`` into [nb, bs, 132])."""
    import torch

    ops = torch.ops.dsv4_ampere
    rows = _meta((n, HEAD_DIM), torch.bfloat16)
    for ratio in shapes.ratios:  # compressed_cache.*_ampere: rows, the 2-D page view, int64 slots
        bs = max(1, shapes.block_size // ratio)
        ops.kv_cache_insert(rows, _cache(shapes, bs), _meta((n,), torch.int64), bs)
    for ratio in shapes.index_ratios:
        bs = max(1, shapes.block_size // ratio)
        icache = _meta((shapes.num_blocks, bs, INDEXER_DIM + 4), torch.uint8)
        ops.indexer_k_insert(_meta((n, INDEXER_DIM), torch.bfloat16), icache, _meta((n,), torch.int64), bs)


def indexer_calls(shapes: ModelShapes, T: int, variant: str) -> None:
    """Indexer Q quant for T tokens (bf16 or fp32 weights, fp32 cos/sin cache) and the decode
    logits per indexed ratio (T = B * next_n rows for every next_n, 1-D and, with next_n > 1, [B, next_n] context lengths,
    max_model_len / ratio columns, the indexer cache of block_size // ratio tokens a block)."""
    import torch

    from . import indexer as vidx

    Hi = shapes.index_heads
    for w_dtype in (torch.bfloat16, torch.float32):
        vidx.fused_indexer_q_rope_quant(_meta((T,), torch.int64), _meta((T, Hi, INDEXER_DIM), torch.bfloat16),
                                        _meta((shapes.max_model_len, 64), torch.float32), _meta((T, Hi), w_dtype),
                                        1.0, 1.0)
    for ratio in shapes.index_ratios:
        bs = max(1, shapes.block_size // ratio)
        icache = _meta((shapes.num_blocks, bs, 1, INDEXER_DIM + 4), torch.uint8)
        ctx_cols = _cdiv(shapes.max_model_len, ratio)
        for next_n in shapes.next_n:
            if T % next_n:
                continue
            B = T // next_n
            # context lengths [B] (plain decode, vLLM's flatten path) and [B, next_n] (native MTP)
            for ctx_shape in {(B,), (B, next_n) if next_n > 1 else (B,)}:
                vidx.fp8_fp4_paged_mqa_logits((_meta((B, next_n, Hi, INDEXER_DIM), torch.float8_e4m3fn), None),
                                              icache, _meta((T, Hi), torch.float32), _meta(ctx_shape, torch.int32),
                                              _meta((B, _cdiv(ctx_cols, bs)), torch.int32), None, ctx_cols)


def engram_calls(shapes: ModelShapes, T: int, sms: int, variant: str) -> None:
    """``engram_lookup_ampere``: int32 ids [T, cols], bf16 and packed outputs, the default
    grid and the background one (sms // 2 programs)."""
    import torch

    dim, qb = shapes.engram
    rows, cols = ENGRAM_ROWS, ENGRAM_COLS
    local = _cdiv(cols, shapes.tp)
    weight, scales = _meta((rows, dim), torch.uint8), _meta((rows, dim // qb), torch.uint8)
    for out in (_meta((T, local, dim), torch.bfloat16), _meta((T, local, dim + dim // qb), torch.uint8)):
        for programs in (0, max(1, sms // 2)):
            torch.ops.dsv4_ampere.engram_lookup(weight, scales, _meta((T, cols), torch.int32), out, 0, rows, 0,
                                                cols, None, programs)


# ----------------------------------------------------------------------------- the set


def serve_calls(shapes: ModelShapes, token_counts: Iterable[int], variant: str, sms: int,
                mode: Optional[str] = None):
    """Every call the serve path makes, at each token count (decode, prefill, writers,
    indexer, Engram); data-dependent sizes at every class of DATA_SIZES. mode: the decode
    kernel mode (None: DSV4_AMPERE_DECODE_KERNEL)."""
    from ..dispatch import decode as dispatch_decode

    mode = dispatch_decode.mode() if mode is None else mode
    calls = []
    for T in token_counts:
        for K1, ratio in shapes.decode_layer_kinds():
            for K2 in shapes.swa_widths():
                for with_swa_len in (False, True):
                    calls.append(functools.partial(decode_step, shapes, T, K1, variant, with_swa_len, mode, ratio,
                                                   K2))
        for width in shapes.prefill_index_widths():
            for n_kv in DATA_SIZES[1:]:  # a chunk's workspace holds >= window rows
                calls.append(functools.partial(prefill_attention, shapes, T, width, n_kv, variant, mode))
        calls.append(functools.partial(indexer_calls, shapes, T, variant))
        if shapes.engram is not None:
            calls.append(functools.partial(engram_calls, shapes, T, sms, variant))
    for n in DATA_SIZES:
        for bs in {shapes.swa_block_size} | {max(1, shapes.block_size // r) for r in shapes.ratios}:
            calls.append(functools.partial(prefill_gather, shapes, n, bs, variant))
        calls.append(functools.partial(cache_inserts, shapes, n, variant))
        for N in DATA_SIZES:
            for cols in DATA_SIZES:
                calls.append(functools.partial(prefill_logits, shapes, n, N, cols, variant))
    return calls


def build(shapes: ModelShapes, max_tokens: int, sms: int = 108, variant: str = "portable",
          mode: Optional[str] = None, cache_dir: Optional[str] = None) -> WarmSet:
    """The warm set of one model / TP for batches up to ``max_tokens`` tokens on a device of
    ``sms`` SMs. mode: the decode kernel mode (None: DSV4_AMPERE_DECODE_KERNEL). cache_dir:
    reuse a set built before from the same sources and arguments (``cached_build``)."""
    from ..dispatch import decode as dispatch_decode
    from ..dispatch import workspace as dispatch_workspace

    if isinstance(shapes, warm_set_v32.V32Shapes):  # DeepSeek-V3.2 / GLM-5: that file's calls
        return warm_set_v32.build(shapes, max_tokens, sms, variant, cache_dir)
    mode = dispatch_decode.mode() if mode is None else mode
    if cache_dir is not None:
        return cached_build(cache_dir, shapes, max_tokens, sms, variant, mode,
                            lambda: build(shapes, max_tokens, sms, variant, mode))
    H = shapes.heads_per_rank
    widths = tuple(sorted({k1 + k2 for k1 in shapes.decode_topk_widths() for k2 in shapes.swa_widths()}
                          | set(shapes.prefill_index_widths())))
    classes = batch_classes(max_tokens, H, widths, sms, mode, dispatch_workspace.FUSED_GATHER_MAX_ROWS,
                            _other_t_ints(shapes, sms))
    keys = trace(serve_calls(shapes, classes, variant, sms, mode), sms, variant)
    return WarmSet(shapes, max_tokens, sms, variant, keys, tuple(classes))


# ----------------------------------------------------------------------------- the set on disk


def shapes_from_vllm_config(vllm_config):
    """ModelShapes of the model vLLM serves (DeepSeek-V3.2 / GLM-5: ``warm_set_v32.V32Shapes``),
    or None when it is none of those. Reads the HF config (heads, indexer heads and top-k,
    window, compress rates, image tokens), TP, max_model_len, the cache config (block size,
    blocks) and the speculative config (query rows a request)."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_config", None)
    archs = " ".join(getattr(hf, "architectures", None) or ())
    if hf is None or "DeepseekV4" not in archs and "DeepseekV41" not in archs:
        return warm_set_v32.shapes_from_vllm_config(vllm_config)
    v41 = "V41" in archs or getattr(hf, "engram_layer_ids", None) is not None
    rates = getattr(hf, "compress_rates", None) or {}
    kw = dict(name="DeepSeek-V4.1-Flash" if v41 else "DeepSeek-V4-Flash", engram=(256, 32) if v41 else None,
              tp=int(vllm_config.parallel_config.tensor_parallel_size),
              max_model_len=int(model_config.max_model_len),
              heads=int(getattr(hf, "num_attention_heads", 64)),
              index_heads=int(getattr(hf, "index_n_heads", 64 if not v41 else 32)),
              index_topk=int(getattr(hf, "index_topk", 512)),
              window=int(getattr(hf, "sliding_window", None) or getattr(hf, "window_size", None) or 128))
    if getattr(hf, "vision_n_layers", 0):  # vLLM: image spans widen the prefill window rows
        kw["max_image_tokens"] = int(getattr(hf, "vision_max_n_token", 0) or 0)
    if v41:  # per-layer list: 0 sliding window, 1 full-length compressed, 2 ratio-2
        found = tuple(sorted({int(r) for r in (getattr(hf, "compress_ratios", None) or (1, 2)) if int(r) > 0}))
        kw.update(ratios=found, index_ratios=found, block_size=128)
    else:
        found = tuple(sorted({int(r) for r in (rates.values() if isinstance(rates, dict) else rates) if int(r) > 0}))
        kw.update(ratios=found or (4,), index_ratios=(4,), c128a=128 in found)
    kw.update(serve_limits(vllm_config))
    draft = draft_window(getattr(vllm_config, "speculative_config", None), kw["window"])
    if draft and draft != kw["window"]:
        kw["draft_windows"] = (draft,)
    return ModelShapes(**kw)


DSPARK_SWA_INDEX_ALIGNMENT = 64  # vLLM v1/attention/backends/mla/compressor_utils.py


def draft_window(spec, window: int) -> int:
    """The window index width of the draft's decode under ``spec`` (vLLM's speculative config),
    or 0 when its draft is causal (MTP: the plain window) or there is none. DSpark's draft
    block is non-causal: window + num_speculative_tokens, rounded up to 64 (vLLM
    ``get_dspark_swa_index_width``; sparse_swa.py builds its decode index list that wide)."""
    n = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    use = getattr(spec, "use_dspark", None)
    dspark = use() if callable(use) else getattr(spec, "method", None) == "dspark"
    if not n or not dspark:
        return 0
    return _cdiv(max(window, 0) + n, DSPARK_SWA_INDEX_ALIGNMENT) * DSPARK_SWA_INDEX_ALIGNMENT


def main(argv=None) -> int:
    """``python -m dsv4_ops.vllm.warm_set --model v4|v41 --tp N --max-tokens M [--sms S]``:
    the warm set's keys per kernel (and with --list, every key)."""
    import argparse

    p = argparse.ArgumentParser(description="the dsv4_ops warm set of one model / TP (no GPU needed)")
    p.add_argument("--model", choices=("v4", "v41"), default="v41")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--sms", type=int, default=108)
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    shapes = (v41_flash if args.model == "v41" else v4_flash)(tp=args.tp)
    warm = build(shapes, args.max_tokens, sms=args.sms)
    print(f"{shapes.name} TP={args.tp}, <= {args.max_tokens} tokens, {args.sms} SMs: {len(warm)} keys, "
          f"{len(warm.classes)} batch classes")
    for name, keys in warm_keys.by_kernel(warm.keys).items():
        print(f"  {name}: {len(keys)}")
        if args.list:
            for k in keys:
                print(f"    {k.label()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
