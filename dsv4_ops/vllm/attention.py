"""DeepSeek-V4 / V4.1 sparse-MLA attention for vLLM 0.33.0 on sm_8x, through torch.ops.dsv4_ampere.

Three pieces, each testable without vLLM:
- ``ampere_decode``: one decode step. The compressed top-k rows and the sliding-window rows
  are gathered from their two fp8_ds_mla caches into one bf16 workspace, then split-KV
  sparse attention and the LSE merge with the per-head sink
  (``dsv4_ops.dsv4_decode.dsv4_decode_attention``). Replaces FlashMLA's
  ``flash_mla_with_kvcache`` (sm_90a/sm_100 cubins only).
- ``dequantize_and_gather_k_cache_ampere``: the prefill gather, same arguments as vLLM's
  ``dequantize_and_gather_k_cache`` (whose CUDA path is CuTeDSL, sm_89+ PTX).
- ``flash_mla_sparse_fwd_ampere``: prefill attention over the gathered workspace, same
  arguments as FlashMLA's ``flash_mla_sparse_fwd`` (sm_90a/sm_100 only).

``make_ampere_attention_cls(base)`` builds, once per vLLM FlashMLA class (V4, V4.1), a
subclass that keeps the real per-rank head count (no padding to 64), decodes through
``ampere_decode``, and projects through the bf16 o_proj (``o_proj.ampere_o_proj``). Its
prefill is the base class's own ``_forward_prefill`` (chunk plan, index combination), whose
two FlashMLA/CuTeDSL calls the plugin's patch table redirects to the functions above.

Graph safety: everything is static-shape torch and dsv4_ampere ops (no host sync); every
function that vLLM calls inside ``eager_break_during_capture`` writes into the buffers it is
given (``output`` / ``out``).
"""

from __future__ import annotations

import functools
import importlib
import sys
import weakref
from typing import Dict, Optional, Tuple

import torch

from .. import _host_plan, layout
from ..dsv4_decode import dsv4_decode_attention
from . import decode_graph, quant_guard
from .compressed_cache import as_paged_2d
from .o_proj import ampere_o_proj, install_wo_a_bf16_hook, wo_a_weight_bf16
from .table import V4, V41, Reads, Patch, per_model


def _as_2d_slots(idx: torch.Tensor, T: int) -> torch.Tensor:
    """[T, 1, K] or [T, K] int slot tensor -> [T, K] (a view)."""
    return idx.reshape(idx.shape[0], -1)[:T]


# Host cost: vLLM runs the decode eagerly in mixed prefill + decode batches, per layer
# per step, so the views ampere_decode needs are memoised on the identity of what vLLM passes:
# the caches are the same tensor objects every step (one entry per cache, dropped when vLLM drops
# the cache: a weakref callback), the slot tensors the same objects for every layer of a step
# (the last few kept). A hit is checked against the tensor's address (a set_() / new storage
# misses); a view shares the tensor's memory, so values never go stale.
_PAGE_VIEWS: Dict[int, tuple] = {}
_SLOT_VIEWS: list = []
_SLOT_VIEWS_KEPT = 4


def _paged_2d(cache: torch.Tensor, what: str) -> torch.Tensor:
    """as_paged_2d(cache, what), memoised per cache tensor (see above)."""
    e = _PAGE_VIEWS.get(id(cache))
    if e is not None and e[0]() is cache and e[2] == cache.data_ptr():
        return e[1]
    view = as_paged_2d(cache, what)
    if view is not cache:
        # An alias of the same memory without the view's link to its base (a view keeps its base
        # alive, so the entry would keep the cache alive): the entry dies with the cache.
        alias = torch.empty((0,), dtype=view.dtype, device=view.device).set_(
            view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        k = id(cache)
        try:
            ref = weakref.ref(cache, lambda _r, k=k: _PAGE_VIEWS.pop(k, None))
        except TypeError:
            return view
        _PAGE_VIEWS[k] = (ref, alias, cache.data_ptr())
        return alias
    return view


def _slots_2d(idx: torch.Tensor, T: int) -> torch.Tensor:
    """_as_2d_slots(idx, T), memoised for the last few slot tensors (see above)."""
    if idx.dim() == 2 and idx.shape[0] == T:
        return idx
    for e in _SLOT_VIEWS:
        if e[0] is idx and e[1] == T and e[2] == idx.data_ptr():
            return e[3]
    view = _as_2d_slots(idx, T)
    _SLOT_VIEWS.insert(0, (idx, T, idx.data_ptr(), view))
    del _SLOT_VIEWS[_SLOT_VIEWS_KEPT:]
    return view


def _no_topk(swa_slots: torch.Tensor) -> torch.Tensor:
    """swa_slots[:, :0] (an SWA-only layer's empty top-k), memoised like the slot views."""
    for e in _SLOT_VIEWS:
        if e[0] is swa_slots and e[1] == -1:
            return e[3]
    view = swa_slots[:, :0]
    _SLOT_VIEWS.insert(0, (swa_slots, -1, None, view))
    del _SLOT_VIEWS[_SLOT_VIEWS_KEPT:]
    return view


def ampere_decode(q: torch.Tensor, output: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                  swa_lens: Optional[torch.Tensor], swa_block_size: int,
                  compressed_cache: Optional[torch.Tensor], topk_indices: Optional[torch.Tensor],
                  topk_lens: Optional[torch.Tensor], compressed_block_size: int,
                  attn_sink: Optional[torch.Tensor], scale: float, num_splits: int = 0,
                  step_plans: Optional[dict] = None) -> None:
    """One DSv4 decode attention step, written into ``output``.

    q bf16 [T, H, 512] (H = the rank's real heads); output bf16 [T, H, 512], written in place.
    swa_cache uint8 [num_blocks, swa_block_size, 584] (or its 2-D page view); swa_indices int
    [T, 1, W] or [T, W]: global slots of the window (-1: none); swa_lens int [T] or None:
    entries j >= swa_lens[t] are ignored. compressed_cache uint8 [num_blocks,
    compressed_block_size, 584] or None (SWA-only layer); topk_indices int [T, 1, K] / [T, K]
    global compressed slots (-1: none) or None; topk_lens int [T] or None. attn_sink float32
    [H] (a logit in the softmax denominator, no value; -inf: none); scale = 512 ** -0.5.
    Semantics: FlashMLA's ``flash_mla_with_kvcache`` with ``indices`` / ``extra_indices``:
    one softmax over the union of window and compressed keys. step_plans: a dict kept for one step
    and one layer type (``step_plans_of``) or None (dsv4_decode.dsv4_decode_attention).
    """
    T = q.shape[0]
    swa2d = _paged_2d(swa_cache, "swa kv_cache")
    swa_slots = _slots_2d(swa_indices, T)
    if compressed_cache is None or topk_indices is None:
        comp2d, comp_bs = swa2d, swa_block_size  # never read: zero top-k columns
        topk_slots = _no_topk(swa_slots)
        topk_lens = None
    else:
        comp2d, comp_bs = _paged_2d(compressed_cache, "compressed kv_cache"), compressed_block_size
        topk_slots = _slots_2d(topk_indices, T)
    # Lengths: the first T values are read (no slicing needed); written straight into output; the
    # lse is dropped (the eager paged step then writes it to scratch: no allocation).
    dsv4_decode_attention(q, comp2d, topk_slots, swa2d, swa_slots, attn_sink, scale, comp_bs,
                          swa_block_size, topk_length=topk_lens, num_splits=num_splits,
                          swa_length=swa_lens, out=output, return_lse=False, step_plans=step_plans)


def step_plans_of(metadata, layer_type) -> Optional[dict]:
    """The dict of one layer type's step plans (dsv4_decode.dsv4_decode_attention's ``step_plans``)
    kept on this step's metadata object, FlashMLA's per-step tile-scheduler holder: vLLM builds the
    metadata afresh every step and for every CUDA-graph capture, so the DecodeStepPlan made by a step's
    first layer of a type (dsv4_decode.make_decode_plan: the launch config, split count, balance and
    launch) is run by that step's later layers of the type (a FULL graph captures it with the rest of
    the step) and is never carried into another step or graph. None when the object takes no attribute
    (then every call takes the layout's kept plan)."""
    try:
        kept = metadata.__dict__.get("_dsv4_step_plans")
        if kept is None:
            kept = metadata.__dict__["_dsv4_step_plans"] = {}
    except (AttributeError, TypeError):
        return None
    got = kept.get(layer_type)
    if got is None:
        got = kept[layer_type] = {}
    return got


def dequantize_and_gather_k_cache_ampere(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    use_fnuz: bool = False,
    max_gather_len: Optional[int] = None,
) -> None:
    """Drop-in for vLLM's ``dequantize_and_gather_k_cache`` (V4 and V4.1 signatures).

    out bf16 [R, M, 512] (may be strided in dims 0-1); k_cache uint8 [num_blocks,
    block_size, 584]; seq_lens int [R]; gather_lens int [R] or None (= seq_lens);
    block_table int [R, max_blocks]. For request b and i < gather_len[b]:
    ``out[b, offset + i] = record(block_table[b, p // bs] * bs + p % bs)`` with
    ``p = seq_lens[b] - gather_len[b] + i``. Rows past gather_len keep their contents (as in
    vLLM, which does not write them). Static shapes, no host sync.
    """
    if use_fnuz:
        raise NotImplementedError("dsv4_ops: FNUZ fp8 caches are ROCm-only; the sm_8x gather reads OCP E4M3")
    R, M = out.shape[0], out.shape[1]
    L = M - offset if max_gather_len is None else min(M - offset, int(max_gather_len))
    if R == 0 or L <= 0:
        return
    cache2d = as_paged_2d(k_cache, "k_cache")
    dev = out.device
    seq = seq_lens[:R].to(torch.int64)[:, None]
    gl = seq if gather_lens is None else gather_lens[:R].to(torch.int64)[:, None]
    i = torch.arange(L, device=dev, dtype=torch.int64)[None, :]
    pos = seq - gl + i  # [R, L]
    valid = (i < gl) & (pos >= 0)
    pc = pos.clamp(min=0)
    bidx = torch.div(pc, block_size, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
    phys = block_table[:R].to(torch.int64).gather(1, bidx)
    slots = torch.where(valid, phys * block_size + torch.remainder(pc, block_size), torch.full_like(pc, -1))
    rows = torch.ops.dsv4_ampere.kv_cache_gather(cache2d, slots, block_size)  # [R, L, 512]
    dst = out[:, offset:offset + L]
    dst.copy_(torch.where(valid[:, :, None], rows, dst))


def flash_mla_sparse_fwd_ampere(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, None, torch.Tensor]:
    """Drop-in for FlashMLA's ``flash_mla_sparse_fwd`` (sparse prefill), same arguments.

    q bf16 [s_q, h_q, 512]; kv bf16 [s_kv, 1, 512]; indices int32 [s_q, 1, topk] (-1 or
    >= s_kv: invalid); topk_length int32 [s_q] or None; attn_sink float32 [h_q] or None;
    out bf16 [s_q, h_q, 512] or None. Returns (out, None, lse). Differences from FlashMLA,
    both unused by vLLM's DSv4 callers: max_logits is not computed (None), and lse
    includes the sink.
    """
    if d_v != layout.HEAD_DIM:
        raise NotImplementedError(f"dsv4_ops: sparse prefill supports d_v 512, got {d_v}")
    kv2d = kv.reshape(-1, kv.shape[-1])
    idx = indices.reshape(indices.shape[0], -1)
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], layout.HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    # The prefill kernel (dsv4_ops.sparse_prefill: one program per query and head group, no
    # split), or the split-KV decode kernels where the queries do not fill the SMs.
    lse = torch.ops.dsv4_ampere.sparse_mla_prefill(q, kv2d, idx, topk_length, attn_sink, float(sm_scale), out)
    return out, None, lse


# ----------------------------------------------------------------------------------------
# The attention classes
# ----------------------------------------------------------------------------------------

_CLASSES: Dict[type, type] = {}
_graphs_enabled = _host_plan.env_memo(decode_graph.enabled)  # DSV4_AMPERE_DECODE_GRAPHS, read cheaply


# Compress ratio of the C4A layers (indexer top-k); V4's other compressed layers are C128A,
# whose decode top-k the metadata builder precomputes.
C4A_RATIO = 4


@functools.lru_cache(maxsize=None)
def _is_v41(base_cls: type) -> bool:
    return base_cls.__module__.startswith(V41 + ".")


class _AmpereAttentionMixin:
    """Methods the Ampere class adds on top of vLLM's FlashMLA DSv4 attention class."""

    dsv4_ampere = True

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        """The real per-rank head count: the dsv4_ampere kernels take any H (no pad to 64)."""
        return num_heads

    def _dsv4_ampere_post_init(self) -> None:
        variant = "v41" if _is_v41(self._dsv4_ampere_base) else "v4"
        quant_guard.check_model_quant(quant_guard.current_quant_config(), variant)
        quant_guard.check_serve_settings(variant)
        install_wo_a_bf16_hook(self.wo_a, self.n_local_groups, self.o_lora_rank)

    def _decode_topk(self, swa_metadata, attn_metadata, num_decode_tokens: int):
        """(global top-k slots [T, 1, K] int32, lens [T] int32) of the compressed cache."""
        num_decodes = swa_metadata.num_decodes
        block_size = attn_metadata.block_size // self.compress_ratio
        base = self._dsv4_ampere_base
        if not _is_v41(base) and self.compress_ratio != C4A_RATIO:
            # V4 C128A: precomputed by the metadata builder.
            return attn_metadata.c128a_global_decode_topk_indices, attn_metadata.c128a_decode_topk_lens
        base_module = sys.modules[base.__module__]
        global_indices, lens = base_module.compute_global_topk_indices_and_lens(
            self.topk_indices_buffer[:num_decode_tokens],
            swa_metadata.token_to_req_indices,
            attn_metadata.block_table[:num_decodes],
            block_size,
            swa_metadata.is_valid_token[:num_decode_tokens],
        )
        return global_indices.view(num_decode_tokens, 1, -1), lens

    def _forward_decode(self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output) -> None:
        """Replaces the FlashMLA ``flash_mla_with_kvcache`` call; same arguments as the base.
        With ``DSV4_AMPERE_DECODE_GRAPHS=1`` the step replays a private CUDA graph per input
        key (``dsv4_ops.vllm.decode_graph``)."""
        T = swa_metadata.num_decode_tokens
        if _graphs_enabled():
            args = (q, kv_cache, swa_metadata, attn_metadata, swa_only, output, T)
            decode_graph.run_forward_decode(self, lambda: self._dsv4_ampere_decode_step(*args), args)
        else:
            self._dsv4_ampere_decode_step(q, kv_cache, swa_metadata, attn_metadata, swa_only, output, T)

    def _dsv4_ampere_decode_step(self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output, T: int) -> None:
        """One eager decode step of this layer (``ampere_decode`` on vLLM's caches and metadata)."""
        topk_indices = topk_lens = None
        comp_bs = 1
        if not swa_only:
            topk_indices, topk_lens = self._decode_topk(swa_metadata, attn_metadata, T)
            comp_bs = attn_metadata.block_size // self.compress_ratio
        # vLLM passes q[:num_decode_tokens] / output[:num_decode_tokens]: no second slice then
        # one plan a step and layer type (the private per-layer graphs replay alone: they plan)
        plans = None if _graphs_enabled() else step_plans_of(swa_metadata, 0 if swa_only else self.compress_ratio)
        ampere_decode(q if q.shape[0] == T else q[:T], output if output.shape[0] == T else output[:T],
                      self.swa_cache_layer.kv_cache, swa_metadata.decode_swa_indices,
                      swa_metadata.decode_swa_lens, swa_metadata.block_size,
                      None if swa_only else kv_cache, topk_indices, topk_lens, comp_bs,
                      self.attn_sink, self.scale, step_plans=plans)

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """bf16 o_proj: inverse RoPE (torch) + grouped bmm with the load-time bf16 wo_a + wo_b."""
        o = o[:, : self.n_local_heads, :]
        wo_b = getattr(self, "_wo_b_proj", None) or self.wo_b
        w = wo_a_weight_bf16(self.wo_a, self.n_local_groups, self.o_lora_rank)
        return ampere_o_proj(o, positions, self.rotary_emb.cos_sin_cache, w, wo_b)


def make_ampere_attention_cls(base_cls: type) -> type:
    """The Ampere subclass of a vLLM FlashMLA DSv4 attention class (cached per base).

    base_cls: ``vllm.models.deepseek_v4.nvidia.flashmla.DeepseekV4FlashMLAAttention`` or the
    ``deepseek_v41`` one. The result is ``class X(_AmpereAttentionMixin, base_cls)`` with
    ``X._dsv4_ampere_base = base_cls`` (used to reach the base module's helpers).
    """
    cls = _CLASSES.get(base_cls)
    if cls is not None:
        return cls
    model = "V41" if _is_v41(base_cls) else "V4"

    def __init__(self, *args, **kwargs) -> None:
        base_cls.__init__(self, *args, **kwargs)
        self._dsv4_ampere_post_init()

    cls = type(f"DeepseekAmpere{model}Attention", (_AmpereAttentionMixin, base_cls), {
        "__init__": __init__,
        "_dsv4_ampere_base": base_cls,
        "__module__": __name__,
        "__doc__": (f"DeepSeek-{model} attention on sm_8x (dsv4_ops): {base_cls.__qualname__} with decode, "
                    "prefill attention, prefill gather and o_proj through torch.ops.dsv4_ampere / bf16 torch."),
    })
    _CLASSES[base_cls] = cls
    return cls


def _flashmla_module(model: str) -> str:
    return f"{V41 if model == 'v41' else V4}.nvidia.flashmla"


def _make_selector(model: str):
    def _select_dsv4_attn_cls(vllm_config):
        """dsv4_ops: the sm_8x attention class (replaces vLLM's FlashMLA/FlashInfer selection)."""
        pcp = getattr(getattr(vllm_config, "parallel_config", None), "prefill_context_parallel_size", 1)
        if pcp and pcp > 1:
            raise NotImplementedError("dsv4_ops: prefill context parallelism is not supported on sm_8x yet")
        base = importlib.import_module(_flashmla_module(model)).DeepseekV4FlashMLAAttention
        return make_ampere_attention_cls(base)

    _select_dsv4_attn_cls.__qualname__ = f"select_attention_cls_{model}"
    return _select_dsv4_attn_cls


select_attention_cls_v4 = _make_selector("v4")
select_attention_cls_v41 = _make_selector("v41")

# What the Ampere class reads on vLLM objects, checked at register() (dsv4_ops.vllm.plugin).
_LAYER_READS = ("wo_a", "n_local_groups", "o_lora_rank", "compress_ratio", "topk_indices_buffer", "swa_cache_layer",
                "attn_sink", "scale", "n_local_heads", "rotary_emb", "wo_b")
_SWA_META_READS = ("num_decodes", "num_decode_tokens", "decode_swa_indices", "decode_swa_lens", "block_size",
                   "is_valid_token", "token_to_req_indices")
_ATTN_META_READS = {"v4": ("block_size", "block_table", "c128a_global_decode_topk_indices", "c128a_decode_topk_lens"),
                    "v41": ("block_size", "block_table")}
_SWA_META_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
_DECODE_PARAMS = ("q", "kv_cache", "swa_metadata", "attn_metadata", "swa_only", "output")
_PREFILL_PARAMS = ("q", "positions", "compressed_k_cache", "swa_k_cache", "output", "attn_metadata", "swa_metadata")
_GATHER_PARAMS = ("out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset", "use_fnuz")
_SPARSE_FWD_PARAMS = ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length", "out")
_NO_FLASHMLA = ("_raise_flashmla_unavailable",)

PATCHES = (
    *per_model("nvidia.model", "_select_dsv4_attn_cls", ("vllm_config",),
               "returns the FlashMLA class on sm_80, whose kernels have only sm_90a/sm_100 cubins",
               {"v4": select_attention_cls_v4, "v41": select_attention_cls_v41}),
    *per_model("nvidia.flashmla", "dequantize_and_gather_k_cache",
               {"v4": _GATHER_PARAMS, "v41": _GATHER_PARAMS + ("max_gather_len",)},
               "prefill gather: CuTeDSL (cvt.rn.f16x2.e4m3x2, sm_89+); its Triton twin uses tl.float8e4nv",
               dequantize_and_gather_k_cache_ampere,
               # V4.1's mega-attention class is sm_100-only and chosen only by the selector replaced above.
               known_non_callers={"v4": (), "v41": (f"{V41}.nvidia.flash_mla_mega_attn",)}),
    *per_model("nvidia.flashmla", "flash_mla_sparse_fwd", _SPARSE_FWD_PARAMS,
               "prefill attention: FlashMLA sparse prefill is sm_90a/sm_100 only",
               flash_mla_sparse_fwd_ampere, placeholders=_NO_FLASHMLA,
               # Other models' FlashMLA backends (DeepSeek-V3.2's sparse MLA, Hunyuan-V4): not on the DSv4 path.
               known_non_callers=("vllm.v1.attention.backends.mla.flashmla_sparse",
                                  "vllm.models.hy_v4.nvidia.flashmla_sparse")),
    *per_model("nvidia.flashmla", "DeepseekV4FlashMLAAttention._forward_decode", _DECODE_PARAMS,
               "decode: flash_mla_with_kvcache (sm_90a/sm_100) -> both caches gathered, split-KV, merge with sink",
               _AmpereAttentionMixin._forward_decode, kind="override",
               reads={m: (Reads(f"{pkg}.nvidia.flashmla", "DeepseekV4FlashMLAAttention", _LAYER_READS),
                          Reads(_SWA_META_MODULE, "DeepseekSparseSWAMetadata", _SWA_META_READS),
                          Reads(f"{pkg}.sparse_mla", "DeepseekV4FlashMLAMetadata", _ATTN_META_READS[m]))
                      for m, pkg in (("v4", V4), ("v41", V41))}),
    *per_model("nvidia.flashmla", "compute_global_topk_indices_and_lens",
               ("topk_indices", "token_to_req_indices", "block_table", "block_size", "is_valid_token"),
               "kept: the Ampere decode calls vLLM's own Triton top-k -> global slot mapping (int only)",
               kind="kept"),
    *per_model("nvidia.flashmla", "DeepseekV4FlashMLAAttention._forward_prefill", _PREFILL_PARAMS,
               "kept: its gather and sparse_fwd are the patched names above",
               kind="kept"),
    *per_model("nvidia.flashmla", "DeepseekV4FlashMLAAttention._o_proj",
               {"v4": ("o", "positions"), "v41": ("attn_out", "positions")},
               "DeepGEMM fp8_einsum + fused_inv_rope_fp8_quant (tl.float8e4nv) -> bf16 wo_a (dequantized at load) "
               "+ torch", _AmpereAttentionMixin._o_proj, kind="override"),
    *per_model("nvidia.flashmla", "DeepseekV4FlashMLAAttention.get_padded_num_q_heads", ("num_heads",),
               "no padding to 64: the real per-rank heads (8 at TP=8)",
               _AmpereAttentionMixin.get_padded_num_q_heads, kind="override"),
)
