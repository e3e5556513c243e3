"""Capture, per step and layer, what the float64 oracle needs: each attention module's input and
output, the indexer's top-k choice as the attention saw it, the metadata's block tables, each
MoE's input and output, and the final hidden state. Hooks only read; they change nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch


@dataclass
class LayerRecord:
    layer: int
    x: torch.Tensor = None            # attention input [T, hidden] bf16
    positions: torch.Tensor = None    # [T] int64
    out: torch.Tensor = None          # attention output [T, hidden]
    topk: torch.Tensor = None         # [T, K] local compressed entry ids the attention read (or None)
    swa_block_table: torch.Tensor = None
    swa_block_size: int = 0
    swa_slot_mapping: torch.Tensor = None
    comp_block_table: torch.Tensor = None
    comp_block_size: int = 0
    index_block_table: torch.Tensor = None
    index_q: torch.Tensor = None      # [T, Hi, 128] uint8 E4M3, the indexer's quantized q
    index_w: torch.Tensor = None      # [T, Hi] fp32 weights with the q scale folded in
    ffn_x: torch.Tensor = None
    ffn_out: torch.Tensor = None
    experts: torch.Tensor = None      # [T, topk] the experts vLLM's router chose
    ffn_ids: torch.Tensor = None      # token ids the MoE saw (hash routing)
    window_lo: torch.Tensor = None    # [T] lowest position whose window KV the row may read (SWA
    #                                   bounded replay: vLLM's kernels clip the window there), or None


@dataclass
class StepRecord:
    name: str
    batch: Dict[str, Any]
    layers: Dict[int, LayerRecord] = field(default_factory=dict)
    final_hidden: torch.Tensor = None
    logits: torch.Tensor = None


class Recorder:
    def __init__(self, model):
        self.model = model
        self.steps: List[StepRecord] = []
        self.current: StepRecord = None
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            self._hook_layer(i, layer)

    def begin(self, name, batch):
        self.current = StepRecord(name, batch)
        self.steps.append(self.current)

    @staticmethod
    def capturing() -> bool:
        """No recording inside a CUDA-graph capture (the hooks copy to the host)."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def _rec(self, i) -> LayerRecord:
        return self.current.layers.setdefault(i, LayerRecord(i))

    def _hook_layer(self, i, layer):
        attn = layer.attn

        def attn_pre(mod, args, kwargs):
            if self.capturing():
                return
            import counters

            counters.LAST.pop("indexer_q_quant", None)
            positions, x = args[0], args[1]
            r = self._rec(i)
            r.positions, r.x = positions.detach().clone(), x.detach().clone()

        def attn_post(mod, args, kwargs, out):
            if self.capturing():
                return
            self._rec(i).out = out.detach().clone()

        self._handles.append(attn.register_forward_pre_hook(attn_pre, with_kwargs=True))
        self._handles.append(attn.register_forward_hook(attn_post, with_kwargs=True))

        orig_mqa = attn.forward_mqa

        def forward_mqa(q, kv, positions, out, *a, **k):
            from vllm.forward_context import get_forward_context

            if self.capturing():
                return orig_mqa(q, kv, positions, out, *a, **k)
            md = get_forward_context().attn_metadata
            r = self._rec(i)
            T = positions.shape[0]
            swa = md[attn.swa_cache_layer.prefix]
            r.swa_block_table = swa.block_table.detach().clone()
            r.swa_block_size = int(swa.block_size)
            r.swa_slot_mapping = swa.slot_mapping[:T].detach().clone()
            if attn.compress_ratio > 1 or (attn.compress_ratio > 0 and hasattr(attn, "compressed_cache_prefix")):
                cm = md[getattr(attn, "compressed_cache_prefix", attn.prefix)]
                r.comp_block_table = cm.block_table.detach().clone()
                r.comp_block_size = int(cm.block_size) // attn.compress_ratio
                if attn.indexer is not None or hasattr(attn, "compressed_cache_prefix"):
                    r.topk = attn.topk_indices_buffer[:T].detach().clone()
            import counters

            if "indexer_q_quant" in counters.LAST:
                r.index_q, r.index_w = (t.detach().clone() for t in counters.LAST["indexer_q_quant"])
            if attn.indexer is not None:
                r.index_block_table = md[attn.indexer.k_cache.prefix].block_table.detach().clone()
            return orig_mqa(q, kv, positions, out, *a, **k)

        attn.forward_mqa = forward_mqa

        def ffn_pre(mod, args, kwargs):
            if self.capturing():
                return
            import standins

            standins.LAST_ROUTING.clear()
            self._rec(i).ffn_x = args[0].detach().clone()
            ids = args[1] if len(args) > 1 else kwargs.get("input_ids")
            self._rec(i).ffn_ids = None if ids is None else ids.detach().clone()

        def ffn_post(mod, args, kwargs, out):
            if self.capturing():
                return
            o = out[0] if isinstance(out, tuple) else out
            self._rec(i).ffn_out = o.detach().clone() if isinstance(o, torch.Tensor) else None
            import standins

            assert len(standins.LAST_ROUTING) == 1, "one router call per MoE forward"
            self._rec(i).experts = standins.LAST_ROUTING[0].cpu()

        self._handles.append(layer.ffn.register_forward_pre_hook(ffn_pre, with_kwargs=True))
        self._handles.append(layer.ffn.register_forward_hook(ffn_post, with_kwargs=True))
