"""torch.library plumbing for the ``dsv4_ampere`` namespace: one declarative row per op.

An op module of this folder lists its ops as ``OPS = (OpDef(...), ...)``; ``register_all()``
(in ``__init__``) defines every row once. Idempotent: a row whose op already exists in this
process is skipped, so importing ``dsv4_ops`` twice is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

NAMESPACE = "dsv4_ampere"

# One Library for the whole namespace; it must stay alive (registrations die with it).
_LIBRARY: Optional[torch.library.Library] = None
_DEFINED: Dict[str, "OpDef"] = {}


@dataclass(frozen=True)
class OpDef:
    """One op: ``dsv4_ampere::<name><schema>``.

    cuda: the Triton launcher; cpu: the pure-PyTorch reference (``dsv4_ops.reference``),
    None when the op has no CPU implementation; fake: allocates exactly what the launcher
    returns (shapes, dtypes, strides) for meta tensors and ``torch.compile``.
    """

    name: str
    schema: str
    cuda: Callable
    fake: Callable
    cpu: Optional[Callable] = None

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


def op_exists(name: str) -> bool:
    """True when dsv4_ampere::<name> is defined in this process."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def define(op: OpDef) -> bool:
    """Define one row (schema, CUDA impl, CPU impl, fake). True when defined now, False if present."""
    global _LIBRARY
    if op_exists(op.name):
        return False
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    _LIBRARY.define(op.name + op.schema)
    _LIBRARY.impl(op.name, op.cuda, "CUDA")
    if op.cpu is not None:
        _LIBRARY.impl(op.name, op.cpu, "CPU")
    torch.library.register_fake(op.qualname, op.fake, lib=_LIBRARY)
    _DEFINED[op.name] = op
    return True


def cuda_impl(name: str) -> Optional[Callable]:
    """The CUDA implementation (the launcher) of a defined ``dsv4_ampere::<name>``, or None when
    this process has not defined it: what the dispatcher calls for CUDA tensors."""
    row = _DEFINED.get(name)
    return row.cuda if row is not None else None


def define_op(name: str, schema: str, *, cuda: Callable, fake: Callable,
              cpu: Optional[Callable] = None) -> bool:
    """``define(OpDef(...))`` with keyword arguments."""
    return define(OpDef(name, schema, cuda=cuda, fake=fake, cpu=cpu))
