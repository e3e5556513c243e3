"""Engram (DeepSeek-V4.1) on sm_8x: the row lookup through ``dsv4_ampere.engram_lookup``.

vLLM's ``ParallelEngramEmbedding.lookup`` (``models/deepseek_v41/common/engram.py``: 0.33.0
L1180-1235, 0.34.0 L1129-1183) launches ``_engram_lookup_kernel``, which takes the table as a
``float8_e4m3fn`` pointer and does not compile for sm_80. Its replacement below keeps everything
else of vLLM: the table storage, ``_storage()`` for the CUDA views, the staging buffers, prefetch
stream and gathers. Only the launch changes: same inputs, same output rows.

Storages ``_storage()`` hands over (``_allocate_weights``), all as a float8_e4m3fn [rows, dim]
view and a uint8 [rows, dim / 32] view of memory the GPU reads: private pinned host tables read
over UVA (DP 1, the default ``cpu_offload=True``), device memory (``cpu_offload`` off), or at
DP > 1 ``DPSharedEngramStorage`` -- one allocation, fp8 rows then scales -- which 0.33.0 maps
from ``/dev/shm`` and 0.34.0 from host-NUMA cuMem shared by FABRIC handle where the driver
allows it (``models/deepseek_v41/nvidia/ops/engram_host_table.py``; ``get_views`` returns the
mapping's GPU view made at construction), else from ``/dev/shm`` (engram.py:710-828).
The reads below (and the views' dtypes and shapes) are the same on both releases
(tests/test_engram_plugin.py runs vLLM's own ``_storage``/``get_views``/``lookup`` for each).

Not covered: vLLM's peer-read mode (``peer_rows > 0``: GPU tables split over a
fully connected DP group with TP = 1 and ``cpu_offload`` off) raises NotImplementedError
naming the setting; the default ``cpu_offload=True`` never takes it. vLLM sorts big host
lookups only on sm_100 (``_engram_lookup_thresholds``; 0.34.0 also not for a cuMem table,
``_uses_small_host_pages``), so this never sorts: the rows written are the same either way.
"""

from __future__ import annotations

import torch

from .table import V41, Patch, Reads

_READS = ("peer_rows", "part_n_hash_cols", "head_start", "n_hash_cols", "vocab_start_idx", "vocab_end_idx",
          "_num_sms", "_storage")


def engram_lookup_ampere(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
    """``ParallelEngramEmbedding.lookup`` on sm_8x: this rank's hash heads of ``indices``
    (int32 [T, n_hash_cols]) into ``out`` (bf16 [T, part_n_hash_cols, dim], or uint8 packed
    [T, part_n_hash_cols, dim + dim // 32])."""
    if indices.shape[0] * self.part_n_hash_cols == 0:
        return
    if self.peer_rows:
        raise NotImplementedError(
            "dsv4_ops (sm_8x): Engram peer-read tables (GPU tables split over a DP group, "
            "engram cpu_offload=False with DP > 1 and TP = 1) are not supported; keep the default "
            "cpu_offload=True (pinned host tables read over UVA)")
    weight, scales = self._storage()
    # vLLM: a persistent grid of one program per SM, halved for a background lookup.
    programs = max(1, self._num_sms // 2) if background else 0
    torch.ops.dsv4_ampere.engram_lookup(weight, scales, indices, out, self.vocab_start_idx, self.vocab_end_idx,
                                        self.head_start, self.n_hash_cols, None, programs)


PATCHES = (
    Patch(f"{V41}.common.engram", "ParallelEngramEmbedding.lookup", ("indices", "out", "background"),
          "Engram row lookup: _engram_lookup_kernel takes the table as a float8_e4m3fn pointer "
          "(tl.float8e4nv), which Triton rejects on sm_80 -> dsv4_ampere.engram_lookup (uint8 table, "
          "portable decode; pinned host tables read over UVA)",
          engram_lookup_ampere, model="v41",
          reads=(Reads(f"{V41}.common.engram", "ParallelEngramEmbedding", _READS),)),
)
