"""Tripwire: raise ``DeadOnSm80`` the moment the run reaches something that cannot run on sm_80.

The list comes from the audit's evidence (``dsv4_ops.vllm.audit``: its ``dead`` rows), so the
test and the audit cannot drift apart, plus two rules the audit's rows rest on:
- a Triton launch with an fp8 tensor argument, or of a kernel whose (comment-free) source names
  an fp8 type (Triton 3.8 refuses fp8e4nv on sm_80; under the interpreter such kernels run
  fine on a CPU, so without this a missed replacement would pass silently);
- a call of any original that the plugin replaced, wherever it is still bound (a by-name import
  the plugin missed), of a DeepGEMM wrapper, or of a FlashMLA entry point the audit lists dead.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Dict, List, Set

import torch

FP8_TYPES = re.compile(r"float8e4nv|fp8e4nv|float8_e4m3fn|float8e5|fp8e5")
FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}
TRIPPED: List[str] = []
LAUNCHES: Dict[str, int] = {}


class DeadOnSm80(RuntimeError):
    pass


def _trip(what: str):
    TRIPPED.append(what)
    raise DeadOnSm80(f"dead on sm_80 and reached: {what}")


def _src_has_fp8(fn) -> bool:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    src = "\n".join(line.split("#", 1)[0] for line in src.splitlines())
    return bool(FP8_TYPES.search(src))


def install_triton(dead_triton: Set[str]) -> None:
    """Wrap the launcher of every Triton kernel (the interpreter's on a CPU, the JIT's on a GPU)."""
    from triton.runtime import jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    fp8_src: Dict[int, bool] = {}
    for cls in classes:
        orig = cls.run
        if getattr(orig, "_dsv4_tripwire", False):
            continue

        def run(self, *args, _orig=orig, **kwargs):
            fn = getattr(self, "fn", None)
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"
            LAUNCHES[name] = LAUNCHES.get(name, 0) + 1
            if name in dead_triton:
                _trip(f"Triton kernel {name} (audit: dead)")
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES:
                    _trip(f"Triton kernel {name} launched with an {a.dtype} tensor")
            key = id(fn)
            if key not in fp8_src:
                fp8_src[key] = _src_has_fp8(fn)
            if fp8_src[key]:
                _trip(f"Triton kernel {name} names an fp8 type")
            return _orig(self, *args, **kwargs)

        run._dsv4_tripwire = True
        cls.run = run


def _raiser(what: str):
    def dead(*a, **k):
        _trip(what)

    dead._dsv4_tripwire = True
    return dead


def rebind_everywhere(obj, replacement) -> List[str]:
    """Replace every module-level and class-level binding of ``obj`` in vLLM with ``replacement``."""
    hits = []
    for mod in list(sys.modules.values()):
        mname = getattr(mod, "__name__", "")
        if not mname.startswith("vllm"):
            continue
        for k, v in list(vars(mod).items()):
            if v is obj:
                setattr(mod, k, replacement)
                hits.append(f"{mname}.{k}")
            elif inspect.isclass(v) and v.__module__ == mname:
                for ck, cv in list(vars(v).items()):
                    if cv is obj:
                        setattr(v, ck, replacement)
                        hits.append(f"{mname}.{k}.{ck}")
    return hits


def install_originals(originals: Dict) -> List[str]:
    """Every original the plugin replaced raises where it is still bound."""
    hits = []
    for (module, symbol), (_owner, _name, orig) in originals.items():
        orig = getattr(orig, "__func__", orig)
        if callable(orig) and not inspect.isclass(orig):
            hits += rebind_everywhere(orig, _raiser(f"original {module}.{symbol} (replaced by the plugin)"))
    return hits


def install_libraries(dead_rows) -> List[str]:
    """DeepGEMM wrappers and FlashMLA entry points of the audit's dead rows raise."""
    import vllm.utils.deep_gemm as dg

    hits = []
    for row in dead_rows:
        lib, _, name = row.kernel.partition(".")
        if lib == "DeepGEMM" and hasattr(dg, name):
            hits += rebind_everywhere(getattr(dg, name), _raiser(f"DeepGEMM.{name}"))
        if lib == "FlashMLA":
            for mod in list(sys.modules.values()):
                fn = getattr(mod, name, None) if getattr(mod, "__name__", "").startswith("vllm") else None
                if callable(fn) and not getattr(fn, "_dsv4_ampere_replacement", False) and "flash_mla" in getattr(fn, "__module__", ""):
                    hits += rebind_everywhere(fn, _raiser(f"FlashMLA.{name}"))
    return hits


def install(model: str, originals: Dict, models=None) -> dict:
    """Install every wire; returns what was wired (for the report). models: the audit run whose
    rows are read (default audit.MODELS, i.e. V4 + V4.1; V3.2 / GLM-5: ("v32", "glm5"))."""
    import os

    from dsv4_ops.vllm import audit

    models = tuple(models or audit.MODELS)
    # the H200 has no vLLM install for the audit's own subprocess: it reads the CPU machine's
    # audit JSON
    # (`dsv4-ops audit-vllm --model both --json`; V3.2 / GLM-5: DSV4_E2E_AUDIT_JSON_V32, the same
    # run for those models), the same evidence
    env = {tuple(audit.MODELS): "DSV4_E2E_AUDIT_JSON", ("v32", "glm5"): "DSV4_E2E_AUDIT_JSON_V32"}.get(models)
    path = os.environ.get(env) if env else None
    # the same cache entry as `dsv4-ops audit-vllm` for those models and its CI test
    res = audit.run(models=models, cache=path) if path else audit.run(models=models)
    dead = [r for r in res.rows if r.status == "dead" and r.model == model]
    dead_triton = {r.kernel for r in dead if r.tech == "Triton"}
    install_triton(dead_triton)
    return dict(dead_rows=len(dead), dead_triton=sorted(dead_triton), originals=install_originals(originals),
                libraries=install_libraries(dead))
