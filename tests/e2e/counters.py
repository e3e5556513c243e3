"""Count every call of the plugin's replacements (one counter per patch-table row) and of every
``torch.ops.dsv4_ampere`` op, so the test can say which rows vLLM's own model code reached."""

from __future__ import annotations

import collections
import functools
import inspect

import torch

import tripwire

ROWS: "collections.Counter[str]" = collections.Counter()
OPS: "collections.Counter[str]" = collections.Counter()
UNCOUNTED: list = []
LAST: dict = {}    # op name -> its latest output (the oracle teacher-forces the indexer's fp8 q on it)


def _counting(fn, key):
    @functools.wraps(fn)
    def counted(*a, **k):
        ROWS[key] += 1
        return fn(*a, **k)

    return counted


def install(model: str, attention_classes=()) -> None:
    """Wrap the replacement of every ``patch``/``hook``/``override`` row of ``model``."""
    from dsv4_ops.vllm import plugin
    from dsv4_ops.vllm.table import patches

    for row in patches():
        if row.model not in (model, None, "") or row.kind not in ("patch", "hook", "override"):
            continue
        key = row.qualname
        if row.kind == "override":
            name = row.symbol.split(".")[-1]
            for cls in attention_classes:
                for klass in cls.__mro__:
                    if klass.__module__.startswith("dsv4_ops") and name in vars(klass):
                        fn = vars(klass)[name]
                        if isinstance(fn, classmethod):
                            setattr(klass, name, classmethod(_counting(fn.__func__, key)))
                        elif inspect.isfunction(fn):
                            setattr(klass, name, _counting(fn, key))
                        break
            continue
        owner, attr, cur = plugin._resolve(row)
        if inspect.isfunction(cur):
            tripwire.rebind_everywhere(cur, _counting(cur, key))
        else:
            UNCOUNTED.append(key)


# ops whose first argument's dim 1 is the tokens a request brings to a decode step (next_n: 1
# without speculative decoding, 1 + k with k drafted tokens): counted per next_n as well
NEXT_N_OPS = ("paged_mqa_logits",)


def _count(name: str, args) -> None:
    OPS[name] += 1
    if name in NEXT_N_OPS and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        OPS[f"{name}[next_n={int(args[0].shape[1])}]"] += 1


def install_ops() -> None:
    """Count ``torch.ops.dsv4_ampere.<op>(...)`` calls at the namespace attribute."""
    from dsv4_ops.registration import op_names

    ns = torch.ops.dsv4_ampere
    for name in op_names():
        packet = getattr(ns, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue

        class Counted:
            def __init__(self, p, n):
                self._p, self._n = p, n

            def __call__(self, *a, **k):
                _count(self._n, a)
                out = self._p(*a, **k)
                LAST[self._n] = out
                return out

            def __getattr__(self, item):
                return getattr(self._p, item)

        setattr(ns, name, Counted(packet, name))
    # the decode composite calls some ops' CUDA kernels without the dispatcher hop on CUDA
    # (dsv4_ops._host_plan.direct_op): count those calls too
    from dsv4_ops import _host_plan

    def observe(name, args, out):
        _count(name, args)
        LAST[name] = out

    _host_plan.DIRECT_OBSERVERS.append(observe)
