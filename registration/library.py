"""One helper that defines a ``dsv4_ampere`` op: schema, CUDA kernel, CPU reference, fake.

Idempotent: defining an op that already exists in this process is a no-op, so importing
``dsv4_ops`` twice, or calling ``register_all()`` again, is harmless.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

NAMESPACE = "dsv4_ampere"

# Library objects must stay alive: their registrations are dropped when they are collected.
_LIBRARIES: Dict[str, torch.library.Library] = {}


def op_exists(name: str) -> bool:
    """True when dsv4_ampere::<name> is defined in this process."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def define_op(name: str, schema: str, *, cuda: Callable, fake: Callable,
              cpu: Optional[Callable] = None) -> bool:
    """Define dsv4_ampere::<name><schema> with a CUDA impl, an optional CPU impl and a fake.

    Returns True when it defined the op now, False when it was already there.
    """
    if op_exists(name):
        return False
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(name + schema)
    lib.impl(name, cuda, "CUDA")
    if cpu is not None:
        lib.impl(name, cpu, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    _LIBRARIES[name] = lib
    return True
