"""torch.library registration of the ``dsv4_ampere`` namespace (torch.library only).

Each ``*_ops`` module holds ``OPS``, one ``OpDef`` row per op (schema, launcher, reference
as the CPU impl, fake). ``register_all()`` defines them; ``import dsv4_ops`` calls it, once.
A new op adds one row to its area's module (or a new module listed in ``AREAS``).
The vLLM entry point ``vllm_plugin`` lives here too; its logic is in ``dsv4_ops.vllm``.
"""

from __future__ import annotations

import importlib
from typing import Tuple

from .library import NAMESPACE, OpDef, define, define_op, op_exists

# Op modules of this folder, in registration order.
AREAS = ("codec_ops", "kv_cache_ops", "attention_ops", "indexer_ops", "engram_ops", "v32_ops", "sparse_prefill_ops")


def all_ops() -> Tuple[OpDef, ...]:
    """Every op row of every area (an area module that does not exist yet is skipped)."""
    rows = []
    for area in AREAS:
        try:
            module = importlib.import_module(f"{__name__}.{area}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{area}":
                raise
            continue
        rows.extend(module.OPS)
    return tuple(rows)


def op_names() -> Tuple[str, ...]:
    """The public op names, in registration order."""
    return tuple(op.name for op in all_ops())


def register_all() -> None:
    """Define every dsv4_ampere op in this process (idempotent)."""
    for op in all_ops():
        define(op)


__all__ = ["NAMESPACE", "OpDef", "all_ops", "define", "define_op", "op_exists", "op_names", "register_all"]
