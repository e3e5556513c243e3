"""The v3 decode form's launch configs by name: what a name launches and whether it fits a device.
Read by dispatch.decode (the plans) and dispatch.tables (checking a decode table's entries), so
neither imports the other for them."""

from __future__ import annotations

from ..csrc_triton.decode import paged_chunk128 as _vk
from ..csrc_triton.decode import paged_f16dot as _v4k


def v3_config(name: str) -> dict:
    """The launch config of a v3-form name: paged_chunk128.V3_CANDIDATES (bf16 decode) or
    paged_f16dot.V4_CANDIDATES (fp16 dots; its configs carry PV_KEY). KeyError if neither."""
    cfg = _vk.V3_CANDIDATES.get(name) or _v4k.V4_CANDIDATES.get(name)
    if cfg is None:
        raise KeyError(f"no v3 / v4 decode config named {name!r}")
    return cfg


def is_f16dot(cfg: dict) -> bool:
    """Whether a v3-form config runs paged_f16dot (its configs carry PV_KEY), else paged_chunk128."""
    return "PV_KEY" in cfg


def config_fits(name: str, smem: int) -> bool:
    """Whether a v3-form config's shared memory fits ``smem`` bytes a block."""
    return _v4k.V4_SMEM_BYTES.get(name, 0) <= smem
