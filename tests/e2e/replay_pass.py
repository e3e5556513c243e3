"""V4.1's decoder-side SWA bounded replay sub-batch for the scheduler-driven e2e, prepared as
vLLM's ``DeepseekV41ModelState._prepare_replay_batch`` does in an eager step (no PCP, no
DP, no replay CUDA graph):

- per request ``kept = min(query_len, window)`` rows (no prompt logprobs: nothing keeps all rows);
  a replay batch only when a prefilling request is trimmed (``kept < query_len``);
- vLLM's own ``_gather_replay_batch_kernel`` (the Triton interpreter on the CPU) gathers the kept
  rows, their positions and slot mappings and each request's ``kv_start`` (a trimmed request's
  replay layers hold no window KV below ``seq_len - window``);
- the replay layers' metadata from builders of their own (vLLM's ``_copy_attn_groups``) over the
  kept batch with ``ReplayAttnMetadata(kv_start)``, the first replay layer's SWA metadata with the
  batch's own ``replay_start`` (it wrote every row's window KV in ``write_batch_kv``);
- a forward context of its own (``create_forward_context``) and ``ReplayBatch`` on the model's
  ``DecoderReplayLayers``, which the forward then runs: the cut layer's ``write_kv`` on every row
  (``forward_kv`` -> ``_C.fused_deepseek_v4_kv_rope_insert``), the replay layers on the kept rows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch


class ReplayPass:
    def __init__(self, built):
        from vllm.models.deepseek_v41.nvidia.model_state import DeepseekV41ModelState

        self.b = built
        self.layers = built.model.model.decoder_replay_layers
        assert self.layers is not None, "the model has no decoder replay layers"
        self.cut = built.model.model.decoder_replay_start
        self.window = self.layers.window
        # vLLM's method, on the two attributes it reads (builders of their own, like a microbatch's)
        owner = SimpleNamespace(vllm_config=built.vllm_config, device=built.device)
        self.replay_groups = DeepseekV41ModelState._copy_attn_groups(owner, built.attn_groups,
                                                                    self.layers.metadata_prefixes)
        self.first_swa_groups = DeepseekV41ModelState._copy_attn_groups(owner, built.attn_groups,
                                                                       {self.layers.first_swa_prefix})

    def prepare(self, bt: dict) -> Optional[dict]:
        """Set ``ReplayBatch`` for this step's forward, or None (nothing trimmed: the layers run on
        the whole batch). Returns the kept batch's description for the checks."""
        from vllm.forward_context import BatchDescriptor, create_forward_context
        from vllm.models.deepseek_v41.decoder_replay_layers import ReplayBatch
        from vllm.models.deepseek_v41.nvidia.model_state import (ReplayAttnMetadata,
                                                                 _gather_replay_batch_kernel)
        from vllm.v1.attention.backends.utils import PAD_SLOT_ID
        from vllm.v1.worker.gpu import attn_utils

        self.layers.replay_batch = None
        dev = self.b.device
        num_reqs = bt["num_reqs"]
        qsl_np = bt["query_start_loc_cpu"].numpy().astype(np.int32)
        query_lens = np.diff(qsl_np)
        prefilling = bt["is_prefilling"].numpy()
        kept_lens = np.minimum(query_lens, self.window)
        if not bool((kept_lens < query_lens)[prefilling].any()):
            return None
        num_tokens = int(kept_lens.sum())
        kept_qsl_np = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(kept_lens, out=kept_qsl_np[1:])
        slot_mappings = bt["slot_mappings"]
        G = slot_mappings.shape[0]
        replay_start = bt["model_specific_attn_metadata"].replay_start
        rows = torch.zeros(bt["num_tokens"], dtype=torch.int64, device=dev)
        kept_qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
        kept_pos = torch.zeros(bt["num_tokens"], dtype=torch.int64, device=dev)
        kept_slots = torch.full((G, num_tokens), PAD_SLOT_ID, dtype=torch.int64, device=dev)
        kv_start = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
        dropped = torch.from_numpy(qsl_np - kept_qsl_np).to(dev)
        _gather_replay_batch_kernel[(num_reqs,)](
            bt["query_start_loc_gpu"], dropped, bt["seq_lens"], replay_start, bt["positions"],
            slot_mappings, slot_mappings.stride(0), rows, kept_qsl, kept_pos, kept_slots,
            kept_slots.stride(0), kv_start, self.window, NUM_GROUPS=G, BLOCK=1024)
        kept_pos = kept_pos[:num_tokens]
        seq_cpu = bt["seq_lens"].cpu()

        def build(groups, start):
            return attn_utils.build_attn_metadata(
                attn_groups=groups, num_reqs=num_reqs, num_tokens=num_tokens,
                query_start_loc_gpu=kept_qsl, query_start_loc_cpu=torch.from_numpy(kept_qsl_np),
                # the runner keeps the whole batch's bound (adaptive verification)
                max_query_len=max(int(kept_lens.max()), bt["max_query_len"]),
                seq_lens=bt["seq_lens"], max_seq_len=bt["max_seq_len"], block_tables=bt["block_tables"],
                slot_mappings=kept_slots, kv_cache_config=self.b.kv_cache_config,
                seq_lens_cpu_upper_bound=seq_cpu, positions=kept_pos, is_prefilling=bt["is_prefilling"],
                req_idx=bt["req_idx"], model_specific_attn_metadata=ReplayAttnMetadata(start))

        md = build(self.replay_groups, kv_start)
        first = self.layers.first_swa_prefix
        md[first] = build(self.first_swa_groups, replay_start)[first]
        fc = create_forward_context(
            md, self.b.vllm_config, batch_descriptor=BatchDescriptor(num_tokens=num_tokens),
            slot_mapping=attn_utils.build_slot_mappings_by_layer(kept_slots, self.b.kv_cache_config))
        self.layers.replay_batch = ReplayBatch(rows[:num_tokens], fc)
        return dict(rows=rows[:num_tokens].cpu(), query_start_loc_cpu=torch.from_numpy(kept_qsl_np.copy()),
                    kept_qsl=kept_qsl.cpu(), positions=kept_pos.cpu(), kv_start=kv_start.cpu(),
                    replay_start=replay_start.cpu(), kept_lens=kept_lens.tolist(), num_tokens=num_tokens,
                    metadata_keys=sorted(md))

    def clear(self) -> None:
        self.layers.replay_batch = None
