"""The tiles kernel's split count: moved into dsv4_ops.decode_plan (one home for the decode
plan: kernel choice and split counts of every decode kernel); this module re-exports it under
its old names (num_splits, max_splits, target_programs, BLOCK_H, TARGET_STEPS, TARGET_LARGE)."""

from __future__ import annotations

from .decode_plan import TARGET_LARGE, TARGET_STEPS, target_programs  # noqa: F401
from .decode_plan import TILE_BLOCK_H as BLOCK_H  # noqa: F401
from .decode_plan import tile_max_splits as max_splits  # noqa: F401
from .decode_plan import tile_splits as num_splits  # noqa: F401
