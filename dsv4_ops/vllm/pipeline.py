"""Pipeline-parallel partitions of V4.1 checked at model build (``dsv4_ops.pp_partition``).

vLLM 0.33.0 raises NotImplementedError only when a stage boundary splits a layer from its
KV source; a boundary between a layer and its index or candidate source (stage-local
buffers) builds and then reads unwritten data. The wrapped ``DeepseekV4Model.__init__`` of
the V4.1 package checks the partition vLLM will use (``VLLM_PP_LAYER_PARTITION`` or its
default split) first and raises ``PPPartitionError`` naming a legal alternative.
"""

from __future__ import annotations

import functools

from ..pp_partition import check_vllm_config
from .table import V41, Patch


def check_partition_at_build(original):
    """Builder: the V4.1 model's ``__init__``, checking the PP partition before building."""

    @functools.wraps(original)
    def __init__(self, *args, vllm_config, prefix: str = "", **kwargs):
        check_vllm_config(vllm_config)
        original(self, *args, vllm_config=vllm_config, prefix=prefix, **kwargs)

    return __init__


PATCHES = (
    Patch(f"{V41}.nvidia.model", "DeepseekV4Model.__init__", ("vllm_config", "prefix"),
          "a PP stage boundary between a layer and its index / candidate source builds and reads unwritten "
          "buffers (vLLM raises only for KV sources): check the partition, name a legal one",
          check_partition_at_build, wraps=True, model="v41"),
)
