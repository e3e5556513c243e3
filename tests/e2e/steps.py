"""What the scheduler would hand the runner, made by hand: block tables and slot mappings (block
ids from ONE pool shared by all KV-cache groups, as vLLM's manager hands them out: under the HMA
the groups share KV tensors, so a block id used by two groups would alias memory). Everything
after that is vLLM's own: ``build_attn_metadata`` runs every metadata builder, then
``set_forward_context`` and the model's ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
import torch


@dataclass
class Request:
    rid: int
    tokens: List[int]                      # every token id of the request so far
    computed: int = 0                      # tokens whose KV is already in the cache
    blocks: Dict[int, List[int]] = field(default_factory=dict)   # group -> block ids


class Scheduler:
    """Block pool + per-request block tables; ``step()`` runs one forward on a batch."""

    def __init__(self, built, max_blocks_per_req: int = 64):
        self.b = built
        groups = built.kv_cache_config.kv_cache_groups
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self.num_blocks = built.kv_cache_config.num_blocks
        self.next_block = 1                # block 0 is vLLM's null block
        self.max_blocks = max_blocks_per_req
        self.requests: Dict[int, Request] = {}

    def _alloc(self) -> int:
        if self.next_block >= self.num_blocks:
            raise RuntimeError(f"block pool exhausted ({self.num_blocks} blocks)")
        self.next_block += 1
        return self.next_block - 1

    def _ensure_blocks(self, req: Request, upto: int) -> None:
        for g, bs in enumerate(self.block_sizes):
            have = req.blocks.setdefault(g, [])
            while len(have) * bs < upto:
                have.append(self._alloc())

    def add(self, rid: int, tokens: List[int]) -> Request:
        self.requests[rid] = Request(rid, list(tokens))
        return self.requests[rid]

    def batch(self, schedule: List[tuple]):
        """``schedule``: [(rid, num_new_tokens)], decodes first (vLLM's reorder puts query
        length <= the decode threshold first). Returns the step's tensors."""
        dev = self.b.device
        ids, pos, qsl, seq_lens, rows = [], [], [0], [], []
        for rid, n in schedule:
            req = self.requests[rid]
            start = req.computed
            assert start + n <= len(req.tokens), "schedule beyond the request's tokens"
            self._ensure_blocks(req, start + n)
            ids += req.tokens[start:start + n]
            pos += list(range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            rows.append(req)
        T = len(ids)
        block_tables, slot_mappings = [], []
        for g, bs in enumerate(self.block_sizes):
            bt = torch.zeros(len(rows), self.max_blocks, dtype=torch.int32)
            for i, req in enumerate(rows):
                blk = req.blocks[g]
                bt[i, : len(blk)] = torch.tensor(blk, dtype=torch.int32)
            sm = torch.empty(T, dtype=torch.int64)
            t = 0
            for i, (rid, n) in enumerate(schedule):
                for p in range(rows[i].computed, rows[i].computed + n):
                    sm[t] = int(bt[i, p // bs]) * bs + p % bs
                    t += 1
            block_tables.append(bt.to(dev))
            slot_mappings.append(sm.to(dev))
        query_lens = np.diff(qsl)
        prefilling = np.array([r.computed + n < len(r.tokens) or n > 1 for r, (_, n) in zip(rows, schedule)])
        out = dict(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables, slot_mappings=torch.stack(slot_mappings),
            max_query_len=int(query_lens.max()), max_seq_len=max(seq_lens), num_reqs=len(rows),
            num_tokens=T, is_prefilling=torch.from_numpy(prefilling), schedule=list(schedule),
            req_idx=np.arange(len(rows), dtype=np.int32),
        )
        out["query_start_loc_gpu"] = out["query_start_loc_cpu"].to(dev)
        return out

    def step(self, schedule: List[tuple], hook=None):
        """Build vLLM's metadata for ``schedule`` and run the model's forward; returns
        (hidden_states [T, hidden], logits [T, vocab], batch)."""
        bt = self.batch(schedule)
        hidden, logits = self.forward(bt, hook)
        for rid, n in schedule:
            self.requests[rid].computed += n
        return hidden, logits, bt

    def forward(self, bt: dict, hook=None):
        """Run vLLM's metadata builders and the model's forward on a prepared batch (``batch()``'s
        dict, or one made from a vLLM SchedulerOutput: tests/e2e/sched_driver.py); returns
        (hidden_states [T, hidden], logits [T, vocab])."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.gpu import attn_utils

        md = attn_utils.build_attn_metadata(
            attn_groups=self.b.attn_groups, num_reqs=bt["num_reqs"], num_tokens=bt["num_tokens"],
            query_start_loc_gpu=bt["query_start_loc_gpu"], query_start_loc_cpu=bt["query_start_loc_cpu"],
            max_query_len=bt["max_query_len"], seq_lens=bt["seq_lens"], max_seq_len=bt["max_seq_len"],
            block_tables=bt["block_tables"], slot_mappings=bt["slot_mappings"],
            kv_cache_config=self.b.kv_cache_config,
            seq_lens_cpu_upper_bound=bt["seq_lens"].cpu(), positions=bt["positions"],
            is_prefilling=bt["is_prefilling"], req_idx=bt["req_idx"],
            model_specific_attn_metadata=bt.get("model_specific_attn_metadata"),
        )
        # the per-layer slot mappings, as the V2 runner passes them (model_runner.py: V3.2's MLA
        # layers read their cache slots from here, not from the metadata)
        by_layer = attn_utils.build_slot_mappings_by_layer(bt["slot_mappings"], self.b.kv_cache_config)
        with torch.no_grad(), set_forward_context(md, self.b.vllm_config, num_tokens=bt["num_tokens"],
                                                  slot_mapping=by_layer):
            if hook is not None:
                hook(bt)
            hidden = self.b.model(input_ids=bt["input_ids"], positions=bt["positions"],
                                  intermediate_tensors=None)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            logits = self.b.model.compute_logits(hidden)
        return hidden, logits
