"""Rows of the speculative-decoding runner's own kernels: what vLLM's V2 GPU runner (0.33.0, 0.34.0) adds
when ``--speculative-config`` is given (V4 MTP; V4.1 / V4 DSpark), outside the model's modules.

The model-side draft heads (``<model>.nvidia.mtp`` / ``.dspark``) are the class-graph paths of
``_paths.EXTRA_PATHS``; these are the runner's: the rejection sampler and its utilities, the
speculator of the method (``v1/worker/gpu/spec_decode/__init__.py`` ``init_speculator``:
``dspark`` -> DSparkSpeculator, a DFlashSpeculator subclass, so DFlash's input preparation;
``mtp`` -> MTPSpeculator or the multi-module one), and the top-k / top-p split warmups the
runner registers on CUDA whenever a speculative config is set
(``model_runner.py``: ``register_top_k_top_p_warmups``). Every kernel is discovered by
importing those modules (a @triton.jit function or a JIT-warmup owner at module level) and
decided as the model's kernels are (``Audit.compile_triton``: AOT for sm_<arch> with vLLM's
own warmup keys, a recipe, or an fp8 source scan). Rows are reported under the path, not
enforced (``Row.open`` counts the default path only).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from typing import Any, Dict, List, Tuple

_SD = "vllm.v1.worker.gpu.spec_decode"
# Modules every speculative method runs (rejection sampling, the speculator base, the runner's
# verification helpers), and the sampler module whose split warmups the runner registers.
COMMON = (f"{_SD}.rejection_sampler", f"{_SD}.rejection_sampler_utils", f"{_SD}.utils", f"{_SD}.speculator",
          f"{_SD}.adaptive_verification", f"{_SD}.acceptance_estimator")
TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
# The speculator packages of each path (init_speculator's branch for the method).
PACKAGES = {"mtp": (f"{_SD}.mtp", f"{_SD}.multi_module_mtp"), "dspark": (f"{_SD}.dspark", f"{_SD}.dflash")}
# The paths each model serves with a speculative config (its registry's draft classes).
PATHS = {"v4": ("mtp", "dspark"), "v41": ("dspark",)}


def modules(path: str) -> List[str]:
    """The runner modules of ``path``: COMMON, the speculator packages' modules, TOPK_TOPP."""
    out = list(COMMON)
    for pkg in PACKAGES[path]:
        try:
            mod = importlib.import_module(pkg)
        except Exception:  # noqa: BLE001 - reported by the import in kernels()
            out.append(pkg)
            continue
        out.append(pkg)
        out.extend(m.name for m in pkgutil.iter_modules(getattr(mod, "__path__", []), pkg + "."))
    return out + [TOPK_TOPP]


def _topk_topp_split_names() -> Tuple[str, ...]:
    """Names of the kernels ``register_top_k_top_p_warmups`` registers (its source)."""
    mod = importlib.import_module(TOPK_TOPP)
    fn = getattr(mod, "register_top_k_top_p_warmups", None)
    if fn is None:
        return ()
    src = inspect.getsource(fn)
    return tuple(n for n in dir(mod) if not n.startswith("__") and re.search(rf"\b{re.escape(n)}\b", src))


def _defined_in(obj, name: str) -> bool:
    """Whether a kernel object is defined in module ``name`` (not imported into it)."""
    fn = obj
    while getattr(fn, "fn", None) is not None and not isinstance(fn, type):
        fn = fn.fn
    where = getattr(fn, "__module__", None) if not hasattr(obj, "get_warmup_keys") else type(obj).__module__
    return where == name


def rows(audit, model: str, default_kernels: set, kernel_tech, short) -> List[dict]:
    """Rows of the runner's speculative-decoding kernels for ``model`` (each of its PATHS).
    ``kernel_tech(obj)`` / ``short(location)``: the worker's classifier and location format."""
    from ..serve_graph import _source

    out: List[dict] = []
    for path in PATHS.get(model, ()):
        objs: Dict[Tuple[str, str], Any] = {}
        regs: Dict[Tuple[str, str], List[Any]] = {}
        split = set()
        for name in modules(path):
            try:
                live = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001
                audit.notes.append(f"{model}/{path}: {name} does not import here: {type(exc).__name__}: {exc}"[:200])
                continue
            idx = _source.index_module(name, audit.libs)
            for r in (idx.registrations if idx else ()):
                regs.setdefault((r.kernel_module, r.kernel), []).append(r)
            names = _topk_topp_split_names() if name == TOPK_TOPP else tuple(vars(live))
            if name == TOPK_TOPP:
                split = set(names)
            for sym in names:
                obj = getattr(live, sym, None)
                if obj is None or kernel_tech(obj) != "Triton":
                    continue
                if name == TOPK_TOPP or _defined_in(obj, name):
                    objs[(name, sym)] = obj
        inner = {id(getattr(o, "kernel", None)) for o in objs.values()}
        objs = {k: o for k, o in objs.items() if id(o) not in inner}
        compiled = audit.compile_triton(objs, regs, model)
        for (mod, sym), obj in sorted(objs.items()):
            kernel = f"{mod}.{sym}"
            if kernel in default_kernels:
                continue
            src = getattr(obj, "src", None)
            if isinstance(src, str) and "program_id" not in src and (mod, sym) not in regs:
                continue  # a @triton.jit device helper: compiled inside the kernels that call it
            status, evidence = compiled.get((mod, sym), ("unknown", "not compiled"))
            registered = regs.get((mod, sym)) or (sym in split and hasattr(obj, "get_warmup_keys"))
            try:
                fn = getattr(obj, "fn", None) or getattr(obj, "kernel", None) or obj
                fn = getattr(fn, "fn", fn)
                loc = f"{mod}:{sym}:{inspect.getsourcelines(fn)[1]}"
            except Exception:  # noqa: BLE001
                loc = f"{mod}:{sym}"
            why = ("runner, speculative decoding: "
                   + ("the top-k / top-p split warmups registered when a speculative config is set; "
                      if sym in split else f"{path} speculator / rejection sampling; "))
            out.append(dict(model=model, path=path, phase="jit-warmup" if registered else "forward", kernel=kernel,
                            tech="Triton", location=short(loc), status=status, evidence=(why + evidence)[:900],
                            patch=""))
    return out
