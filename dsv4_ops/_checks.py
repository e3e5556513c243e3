"""Argument checks shared by the launchers: each raises ValueError naming the argument."""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def check_tensor(name: str, t, *, dtypes: Optional[Iterable[torch.dtype]] = None,
                 ndim: Optional[int] = None, device: Optional[torch.device] = None,
                 contiguous: bool = False) -> None:
    """ValueError unless ``t`` is a tensor of one of ``dtypes``, ``ndim`` dims, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name}: expected dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_last_dim(name: str, t: torch.Tensor, size: int) -> None:
    if t.dim() == 0 or t.shape[-1] != size:
        raise ValueError(f"{name}: expected last dim {size}, got shape {tuple(t.shape)}")
