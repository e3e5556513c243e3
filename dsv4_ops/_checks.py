"""Argument checks shared by the launchers: each raises ValueError naming the argument.

A device mismatch names both tensors: ``check_tensor("kv", kv, device=q.device,
device_of="q")`` says "q and kv are on different devices (q: cpu, kv: cuda:0)", and
``check_same_device(q=q, kv=kv, indices=indices)`` checks a whole argument list at once.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def _device_mismatch(name: str, got: torch.device, ref_name: Optional[str], ref: torch.device) -> str:
    if ref_name:
        return (f"{ref_name} and {name} are on different devices ({ref_name}: {ref}, {name}: {got}); "
                f"every tensor argument must be on one device")
    return (f"{name}: on {got}, but the other tensor arguments are on {ref}; every tensor argument "
            f"must be on one device")


def check_tensor(name: str, t, *, dtypes: Optional[Iterable[torch.dtype]] = None,
                 ndim: Optional[int] = None, device: Optional[torch.device] = None,
                 contiguous: bool = False, device_of: Optional[str] = None) -> None:
    """ValueError unless ``t`` is a tensor of one of ``dtypes``, ``ndim`` dims, on ``device``.

    device_of: the name of the argument ``device`` was taken from (e.g. ``"q"`` for
    ``device=q.device``), so a mismatch names both tensors.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(_device_mismatch(name, t.device, device_of, torch.device(device)))
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name}: expected dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """ValueError naming the first two arguments (in keyword order) that sit on different
    devices; None entries (absent optional tensors) and non-tensors are skipped."""
    first_name, first_dev = None, None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        if first_name is None:
            first_name, first_dev = name, t.device
        elif t.device != first_dev:
            raise ValueError(_device_mismatch(name, t.device, first_name, first_dev))


def check_last_dim(name: str, t: torch.Tensor, size: int) -> None:
    if t.dim() == 0 or t.shape[-1] != size:
        raise ValueError(f"{name}: expected last dim {size}, got shape {tuple(t.shape)}")
