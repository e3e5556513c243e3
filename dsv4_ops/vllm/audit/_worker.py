"""The audit itself; runs in its own interpreter (``python -m dsv4_ops.vllm.audit._worker``)
because the target-only Triton driver must be installed before vLLM is imported.

Prints one JSON object: {"vllm": version, "arch": N, "rows": [...], "notes": [...]}.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..serve_graph import _CLASS_ENTRY, ServeGraph, _follow, _reach, _source
from . import _paths

# Library -> the vLLM module whose wrappers the audit resolves that library's call sites to.
_LIB_WRAPPERS = {"DeepGEMM": "vllm.utils.deep_gemm"}


def _wrapper_patches() -> Dict[Tuple[str, str], str]:
    """(module, name) -> row name of the patch rows that replace a library wrapper ITSELF (not
    a by-name copy of it elsewhere, which covers only that copy's callers)."""
    from dsv4_ops.vllm.table import patches

    return {(p.module, p.symbol): p.qualname for p in patches()
            if p.kind == "patch" and p.module in _LIB_WRAPPERS.values()}


def _kernel_tech(obj) -> Optional[str]:
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    if isinstance(obj, (JITFunction, Autotuner, Heuristics)):
        return "Triton"
    names = [c.__name__ for c in type(obj).__mro__]
    if "VllmTritonJitKernel" in names:
        return "Triton"
    if "VllmCuTeDSLJitKernel" in names or "cutedsl" in type(obj).__module__.lower():
        return "CuTeDSL" if not isinstance(obj, type) and not inspect.isfunction(obj) else None
    if "VllmTileLangJitKernel" in names:
        return "TileLang"
    if "VllmJitKernel" in names and not isinstance(obj, type):
        # a plain VllmJitKernel owner (MHCPreNormKernel, FA4, ...): the technology of what it wraps
        inner = type(getattr(obj, "kernel", None)).__module__.split(".")[0]
        return {"tilelang": "TileLang", "triton": "Triton"}.get(inner, "JIT")
    return None


def kernel_source_sha(obj) -> str:
    """sha256 (16 hex) of the vLLM source that defines a kernel object: the innermost function
    under its wrappers (a warmup owner's ``kernel``, an Autotuner's / JITFunction's ``fn``) that
    lives in vLLM, else the owner's class; '' when none is found. The kernel inventory compares it
    between releases (a changed kernel may change its verdict)."""
    import hashlib

    import vllm

    root = os.path.dirname(os.path.abspath(vllm.__file__))
    chain, x = [], obj
    for _ in range(6):
        chain.append(x)
        if inspect.isfunction(x):
            break
        own = vars(x) if hasattr(x, "__dict__") and not isinstance(x, type) else {}
        nxt = own.get("kernel") if own.get("kernel") is not None else own.get("fn")
        if nxt is None:
            break
        x = nxt
    for cand in reversed(chain):
        target = cand if inspect.isfunction(cand) or isinstance(cand, type) else type(cand)
        try:
            if not os.path.abspath(inspect.getsourcefile(target) or "").startswith(root + os.sep):
                continue
            return hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            continue
    return ""


def _is_jit_def(func: _source.Func, objs) -> bool:
    return (func.module, func.qualname) in objs


class Audit(ServeGraph):
    """The report over the serve graph: kernels discovered, compiled for the target, and one row
    per use with its status, evidence and patch."""

    def __init__(self, arch: int, jobs: int):
        super().__init__(arch)
        self.jobs = jobs
        self.notes: List[str] = []
        self._roots = ""  # the path's root class names (rows_for sets them)

    # ------------------------------------------------------------------ discovery
    @staticmethod
    def reach(model: str, path: str, mods) -> Tuple[Optional[_reach.Graph], Dict, str]:
        """(graph, reached nodes, root names) of the class-level graph from the path's model
        classes; (None, {}, why) when no root class was found (reachability then not applied)."""
        roots = Audit.root_classes(model, path)
        if not roots:
            return None, {}, f"no registry class found for {model}/{path}"
        graph = _reach.Graph({n: (i.path, os.path.basename(i.path) == "__init__.py") for n, i in mods.items()})
        names = " + ".join(f"{m.rsplit('.', 2)[-2]}.{m.rsplit('.', 1)[-1]}:{c}" for m, c in roots)
        # the classes the attention-backend selector instantiates (by class path, not by name)
        roots = roots + [n for n in _paths.EXTRA_ROOT_NODES.get(model, ()) if n[0] in mods]
        return graph, graph.reached(roots, _paths.reach_cuts(model)), names

    def kernels(self, mods: Dict[str, _source.ModuleIndex]) -> Dict[Tuple[str, str], Any]:
        out = {}
        for name, idx in mods.items():
            try:
                live = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a module that does not import on CPU
                self.notes.append(f"{name} does not import on this machine: {type(exc).__name__}: {exc}"[:200])
                continue
            for sym in idx.toplevel:
                obj = getattr(live, sym, None)
                if obj is not None and _kernel_tech(obj):
                    out[(name, sym)] = obj
        # a JITFunction wrapped by a warmup owner is one kernel: keep the owner
        inner = {id(getattr(o, "kernel", None)) for o in out.values()}
        return {k: o for k, o in out.items() if id(o) not in inner}

    # ------------------------------------------------------------------ coverage
    @staticmethod
    def kept_keys() -> Set[str]:
        """module:qualname of the 'kept' rows (vLLM functions the plugin's replacements call
        themselves): a use through them is not replaced, so it is decided by its own evidence."""
        from dsv4_ops.vllm.table import patches

        out: Set[str] = set()
        for p in patches():
            if p.kind != "kept":
                continue
            out.add(f"{p.module}:{p.symbol}")
            try:
                obj = importlib.import_module(p.module)
                for part in p.symbol.split("."):
                    obj = getattr(obj, part)
                if getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
                    out.add(f"{obj.__module__}:{obj.__qualname__}")
            except Exception:  # noqa: BLE001 - a row register() would reject anyway
                pass
        return out

    # ------------------------------------------------------------------ rows
    @staticmethod
    def gated_refs(mods) -> Dict[str, List[str]]:
        """name -> guard notes of its references that sit under a guard never taken on sm_8x."""
        out: Dict[str, List[str]] = {}
        for idx in mods.values():
            for f in idx.funcs.values():
                for n, note in f.gated.items():
                    out.setdefault(n, []).append(note)
        return out

    @staticmethod
    def unbuilt_classes(mods) -> Dict[str, str]:
        """Classes of the scope that are constructed somewhere (``Cls(...)`` / ``cls(...)``), but
        only under guards never taken on sm_8x: class name -> the guards. Their methods never run."""
        classes = {c for idx in mods.values() for c in idx.classes}
        seen: Dict[str, List[str]] = {}
        for idx in mods.values():
            for cname, _fkey, off in idx.constructions:
                if cname in classes:
                    seen.setdefault(cname, []).append(off)
        return {c: "; ".join(sorted(set(offs))) for c, offs in seen.items() if offs and all(offs)}

    def unreached(self, f: _source.Func, refs, gated, unbuilt, depth: int = 0, seen=None) -> str:
        """Why ``f`` never runs on sm_8x ('' when it may): a method of a class that is never
        constructed there, a module-level function referenced only under guards never taken, or
        a function all of whose users are unreached."""
        seen = set() if seen is None else seen
        if f.key in seen or depth > 6:
            return ""
        seen.add(f.key)
        parts = f.qualname.split(".")
        if len(parts) > 1 and parts[0] in unbuilt:
            return f"{parts[0]} is only constructed {unbuilt[parts[0]]}"
        short = parts[-2] if len(parts) > 1 and parts[-1] in _CLASS_ENTRY else parts[-1]
        users = [u for u in refs.get(short, ()) if u is not f]
        if not users:
            return ""
        # a function registered as a custom op is referenced as torch.ops.vllm.<op name>
        keys = [short] + sorted(op for op, fn in getattr(self, "_ops", {}).items() if fn == short and op != short)

        def gated_in(u):
            return next((f"{k} is referenced only {u.gated[k]}" for k in keys if k in u.gated and k not in u.live), "")

        why = [gated_in(u) or self.unreached(u, refs, gated, unbuilt, depth + 1, seen) for u in users]
        return "; ".join(sorted(set(why))) if all(why) else ""

    def rows_for(self, model: str, path: str, mods, objs, compiled) -> List[dict]:
        self._mods = mods
        self.kept = self.kept_keys()
        if self.entry_modules:
            self._graph, self._reached, self._roots = None, {}, ""
        else:
            self._graph, self._reached, self._roots = self.reach(model, path, mods)
            if self._graph is None:
                self.notes.append(f"{model}/{path}: class-level reachability not applied ({self._roots})")
        self._ops = {op: fn for idx in mods.values() for op, fn in idx.custom_ops.items()}
        refs = self.build_graph(mods)
        gated, unbuilt = self.gated_refs(mods), self.unbuilt_classes(mods)
        bind, funcs = self.patched()
        jit_defs = {k for k, o in objs.items() if _kernel_tech(o) == "Triton"}
        rows = []
        regs: Dict[Tuple[str, str], List[_source.Registration]] = {}
        for idx in mods.values():
            for r in idx.registrations:
                regs.setdefault((r.kernel_module, r.kernel), []).append(r)
        for (mod, name), obj in sorted(objs.items()):
            tech = _kernel_tech(obj)
            every = [f for f in self.resolved_users(name, mod, refs) if (f.module, f.qualname) not in jit_defs]
            every_reg = regs.get((mod, name), [])
            if not every and not every_reg:
                continue  # not used on this path
            users = [f for f in every if self.is_reached(f.module, f.qualname)]
            registered = [r for r in every_reg if self.is_reached(r.module, r.func)]
            if not users and not registered:
                if not _paths.off_path(name):
                    rows.extend(self._unreached_rows(model, path, mod, name, tech, every, every_reg, obj,
                                                     compiled))
                continue
            src = getattr(obj, "src", None)  # bare JITFunctions only: warmup owners are kernels
            if tech == "Triton" and isinstance(src, str) and "program_id" not in src and not registered:
                continue  # a @triton.jit device helper: compiled as part of the kernels that call it
            status, evidence = self.status(mod, name, obj, tech, registered, compiled)
            off = _paths.off_path(name)
            if off:  # a feature or format sm_8x never serves (``_paths``): listed, with the reason
                why = f"off the sm_8x serve path: {off} (if reached, {status}: {evidence[:120]})"[:900]
                for phase, site in ([("forward", f"{users[0].module}:{users[0].qualname}:{users[0].lineno}")]
                                    if users else []) + [("jit-warmup", f"{r.module}:{r.func}:{r.lineno}")
                                                         for r in registered[:1]]:
                    rows.append(dict(model=model, path=path, phase=phase, kernel=f"{mod}.{name}", tech=tech,
                                     location=_short(site), status="off", evidence=why, patch=""))
                continue
            patch = self.coverage(name, mod, refs, bind, funcs, jit_defs) if users else None
            unused = [f for f in users if "." not in f.qualname and f.module not in self.entry_modules
                      and not [u for u in refs.get(f.qualname, ()) if u is not f]
                      and not _source.called_anywhere_in_vllm(f.qualname)]
            fstatus, fevidence = status, evidence
            dead = [(f"{name} is referenced only {f.gated[name]}" if name not in f.live and name in f.gated
                     else self.unreached(f, refs, gated, unbuilt)) for f in users]
            if users and all(dead) and status != "runs" and not patch:
                fstatus, fevidence = "off", ("not reached on sm_8x: " + "; ".join(sorted(set(dead)))[:900]
                                             + f" (if reached, {status}: {evidence[:120]})")
            elif users and len(unused) == len(users) and status != "runs" and not patch:
                fstatus, fevidence = "off", (f"not reached: its only user(s) {', '.join(f.qualname for f in unused)} "
                                             f"are module-level functions nothing on the serve path calls "
                                             f"(if called, {status}: {evidence[:160]})")
            loc = f"{users[0].module}:{users[0].qualname}:{users[0].lineno}" if users else ""
            if users:
                rows.append(dict(model=model, path=path, phase="forward", kernel=f"{mod}.{name}", tech=tech,
                                 location=_short(loc), status=fstatus, evidence=fevidence, patch=patch or ""))
            for r in registered[:1]:
                wpatch = ""
                if status != "runs" and patch:
                    wpatch = "dsv4_ops.vllm.warmup (drops it: fails on this arch and is replaced by " + patch + ")"
                rows.append(dict(model=model, path=path, phase="jit-warmup", kernel=f"{mod}.{name}", tech=tech,
                                 location=_short(f"{r.module}:{r.func}:{r.lineno}"), status=status,
                                 evidence=evidence, patch=wpatch))
        from . import _native

        for idx in mods.values():
            for c, reached in [(c, True) for c in idx.libcalls] + [(c, False) for c in idx.gated_off]:
                if _paths.off_path(c.func.split(".")[-1]) or _paths.off_path(c.name):
                    continue
                key = f"{c.module}:{c.func}"
                if not self.is_reached(c.module, c.func):
                    rows.append(dict(model=model, path=path, phase="forward", kernel=f"{c.library}.{c.name}",
                                     tech=c.library, location=_short(f"{key}:{c.lineno}"), status="off",
                                     evidence=self._not_reached_why([(c.module, c.func)]), patch=""))
                    continue
                guard = _paths.guarded_off(c.module, c.func)
                if guard:  # every caller of the enclosing function is under a guard never taken on sm_8x
                    rows.append(dict(model=model, path=path, phase="forward", kernel=f"{c.library}.{c.name}",
                                     tech=c.library, location=_short(f"{key}:{c.lineno}"), status="off",
                                     evidence="not reached on sm_8x: " + guard, patch=""))
                    continue
                if not reached:  # the call sits under a guard that is never taken on sm_8x
                    rows.append(dict(model=model, path=path, phase="forward", kernel=f"{c.library}.{c.name}",
                                     tech=c.library, location=_short(f"{key}:{c.lineno}"), status="off",
                                     evidence="not reached on sm_8x: " + "; ".join(c.guards), patch=""))
                    continue
                if c.library == _source.CPP:
                    found, ev = _native.find_cpp_kernel(c.name, self.arch)
                    status = {True: "runs", False: "dead", None: "unknown"}[found]
                else:
                    status, ev = "dead", _native.library_evidence(c.library, self.arch)
                if c.guards:
                    ev += "; guard: " + "; ".join(c.guards)
                # A patch of the vLLM wrapper that the call site resolved to (DeepGEMM calls are found
                # as calls of vllm.utils.deep_gemm.<name>) replaces every call of it.
                wrapper = _LIB_WRAPPERS.get(c.library)
                patch = funcs.get(key) or bind.get((c.module, c.name)) or \
                    (_wrapper_patches().get((wrapper, c.name)) if wrapper else None) or \
                    self.coverage(c.func.split(".")[-1], c.module, refs, bind, funcs, jit_defs)
                owner = idx.funcs.get(c.func)
                why = self.unreached(owner, refs, gated, unbuilt) if owner and status != "runs" and not patch else ""
                if why:
                    status, ev = "off", f"not reached on sm_8x: {why[:700]} (if reached, {status}: {ev[:120]})"
                rows.append(dict(model=model, path=path, phase="forward", kernel=f"{c.library}.{c.name}",
                                 tech=c.library, location=_short(f"{key}:{c.lineno}"), status=status,
                                 evidence=ev, patch=patch or ""))
        return rows

    def _not_reached_why(self, owners: List[Tuple[str, str]], also: str = "") -> str:
        names = sorted({f"{m.rsplit('.', 1)[-1]}:{q.split('.')[0]}" for m, q in owners})
        return (f"not reached: nothing that {self._roots} constructs or calls names "
                f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''} (class-level graph from the "
                f"model class, serve_graph/_reach.py)" + (f" (if reached, {also})" if also else ""))[:900]

    def _unreached_rows(self, model, path, mod, name, tech, users, regs, obj, compiled) -> List[dict]:
        """Rows of a kernel whose every user is outside the model's class graph: off, not reached."""
        status, evidence = self.status(mod, name, obj, tech, regs, compiled)
        also = f"{status}: {evidence[:120]}"
        out = []
        if users:
            f = users[0]
            out.append(dict(model=model, path=path, phase="forward", kernel=f"{mod}.{name}", tech=tech,
                            location=_short(f"{f.module}:{f.qualname}:{f.lineno}"), status="off",
                            evidence=self._not_reached_why([(u.module, u.qualname) for u in users], also),
                            patch=""))
        for r in regs[:1]:
            out.append(dict(model=model, path=path, phase="jit-warmup", kernel=f"{mod}.{name}", tech=tech,
                            location=_short(f"{r.module}:{r.func}:{r.lineno}"), status="off",
                            evidence=self._not_reached_why([(x.module, x.func) for x in regs], also), patch=""))
        return out

    def status(self, mod, name, obj, tech, registered, compiled) -> Tuple[str, str]:
        if tech == "Triton":
            return compiled.get((mod, name), ("unknown", "not compiled"))
        if tech == "CuTeDSL":
            from . import _native

            ok, ev = _native.cutedsl_evidence(obj)
            return ("dead" if ok is False else "unknown"), ev
        if tech == "TileLang":
            return compiled.get((mod, name), ("unknown", _paths.TILELANG_NOTE))
        return "unknown", (f"a plain VllmJitKernel ({type(obj).__name__}) wrapping "
                           f"{type(getattr(obj, 'kernel', None)).__module__}: no compile path in the audit")

    # ------------------------------------------------------------------ Triton compile
    def compile_triton(self, objs, regs_by_kernel, model: str) -> Dict[Tuple[str, str], Tuple[str, str]]:
        from . import _config, _recipes, _triton

        cfg = _config.vllm_config(model)

        out: Dict[Tuple[str, str], Tuple[str, str]] = {}
        specs, owners, notes, recipe = [], [], {}, {}
        for key, obj in objs.items():
            if _kernel_tech(obj) == "TileLang" and hasattr(obj, "get_warmup_keys"):
                from . import _tilelang

                builder = _tilelang.KWSETS.get(type(obj).__name__)
                with _config.target_platform(self.arch):
                    if builder is not None:
                        kwsets = builder(cfg) if regs_by_kernel.get(key) else []
                    else:
                        kwsets = [kw for r in regs_by_kernel.get(key, [])
                                  for kw in self._eval_kwargs(r, model)] or [{}]
                        if "vllm_config" in inspect.signature(obj.get_warmup_keys).parameters:
                            kwsets = [dict(kw, vllm_config=cfg) for kw in kwsets]
                    out[key] = (_tilelang.compile_kernel(obj, kwsets, self.arch) if kwsets else
                                ("unknown", "no JIT-warmup registration of this kernel on the path"))
                continue
            if _kernel_tech(obj) != "Triton":
                continue
            if not hasattr(obj, "get_warmup_keys"):
                out[key] = _paths.bare_status(key[1], obj, self.arch)
                if out[key][0] == "unknown":
                    from triton.runtime.jit import JITFunction

                    got, why = (_recipes.specs_for(f"{key[0]}.{key[1]}", obj) if isinstance(obj, JITFunction)
                                else ([], ""))
                    if got:
                        specs.extend(got)
                        owners.extend([key] * len(got))
                        notes[key] = why
                        recipe[key] = True
                    elif why:
                        out[key] = ("unknown", why)
                continue
            kwsets = [kw for r in regs_by_kernel.get(key, []) for kw in self._eval_kwargs(r, model)] or [{}]
            if "vllm_config" in inspect.signature(obj.get_warmup_keys).parameters:
                kwsets = [dict(kw, vllm_config=cfg) for kw in kwsets]
            got = []
            try:
                for kw in kwsets:
                    with _config.target_platform(self.arch):
                        s, note = _triton.capture_specs(obj, kw)
                    got.extend(s)
                    notes[key] = note
            except Exception as exc:  # noqa: BLE001
                out[key] = ("unknown", f"vLLM's warmup key expansion failed: {type(exc).__name__}: {exc}"[:240])
                continue
            if not got:
                out[key] = ("unknown", "vLLM's warmup inputs produced no compile key")
                continue
            specs.extend(got)
            owners.extend([key] * len(got))
        results = _triton.compile_specs(specs, self.arch, self.jobs)
        per: Dict[Tuple[str, str], List[Tuple[bool, str, Any]]] = {}
        for key, spec, res in zip(owners, specs, results):
            per.setdefault(key, []).append((res[0], res[1], spec))
        for key, items in per.items():
            bad = [i for i in items if not i[0]]
            if bad:
                ok, err, spec = bad[0]
                cx = {k: v for k, v in spec.constexprs.items() if v is not None}
                fp8 = [k for k, v in spec.signature.items() if "fp8" in str(v)]
                out[key] = ("dead", f"AOT sm_{self.arch} fails ({len(bad)}/{len(items)} keys): {err}"
                                    + (f"; fp8 pointer args: {', '.join(fp8)}" if fp8 else "")
                                    + f"; key constexprs {_clip(cx)}")
            elif recipe.get(key):
                out[key] = ("runs", f"AOT sm_{self.arch} ok, {notes.get(key, '')}")
            else:
                out[key] = ("runs", f"AOT sm_{self.arch} ok, {notes.get(key, '')} from vLLM's warmup inputs")
        return out

    @staticmethod
    def _eval_kwargs(reg: _source.Registration, model: str) -> List[Dict[str, Any]]:
        """Registration keyword arguments: constant expressions are evaluated; one that reads
        the layer (``self.head_dim``) takes each value the serve path registers it with
        (``_paths.LAYER_VALUES``); returns every combination."""
        import itertools

        import torch

        from vllm.platforms import current_platform

        env = {"torch": torch, "current_platform": _FP8Platform(current_platform)}
        fixed, varying = {}, {}
        for k, src in reg.kwargs.items():
            src = reg.local_defs.get(src, src)  # `dtype=pack_dtype` -> the expression assigned to it
            try:
                fixed[k] = eval(src, env, {})  # noqa: S307 - vLLM's own source text, constants only
                continue
            except Exception:  # noqa: BLE001
                pass
            if " if " in src and " else " in src:  # `torch.uint8 if use_fp4_cache else fp8`: default cache
                try:
                    fixed[k] = eval(src.rsplit(" else ", 1)[1], env, {})  # noqa: S307
                    continue
                except Exception:  # noqa: BLE001
                    pass
            values = _paths.LAYER_VALUES.get(model, {}).get(k)
            if values:
                varying[k] = values
        names = list(varying)
        return [dict(fixed, **dict(zip(names, combo))) for combo in itertools.product(*varying.values())]


class _FP8Platform:
    """``current_platform`` as vLLM sees it on an NVIDIA GPU, for registration arguments."""

    def __init__(self, real):
        self._real = real

    def fp8_dtype(self):
        import torch

        return torch.float8_e4m3fn

    def __getattr__(self, name):
        return getattr(self._real, name)


def _row_sha(kernel: str, known: Dict[str, str]) -> str:
    """The source sha of a row's kernel given as ``module.name`` outside the scopes' objects (the
    runner's speculative-decoding kernels; DeepGEMM calls: vLLM's wrapper of the library function);
    '' for other library calls and for module rows."""
    mod, _, name = kernel.rpartition(".")
    mod = _LIB_WRAPPERS.get(mod, mod)  # a DeepGEMM call: its vLLM wrapper (where a signature moves)
    if not mod.startswith("vllm."):
        return ""
    try:
        obj = getattr(importlib.import_module(mod), name)
    except Exception:  # noqa: BLE001 - not a module attribute: a library call or a module row
        return ""
    known[kernel] = kernel_source_sha(obj)
    return known[kernel]


def _clip(d, n=160) -> str:
    s = ", ".join(f"{k}={v}" for k, v in d.items())
    return s if len(s) <= n else s[: n - 3] + "..."


def _short(loc: str) -> str:
    return loc.replace("vllm.models.", "").replace("vllm.model_executor.", "me.").replace("vllm.v1.", "v1.")


def run(models: List[str], arch: int, jobs: int, modules: Tuple[str, ...] = ()) -> dict:
    """Audit ``models``; with ``modules``, audit those modules instead (as model 'v4': the
    tests' made-up kernels), following their imports into the usual packages."""
    from . import _driver

    os.environ.pop("TRITON_INTERPRET", None)
    _driver.install(arch)
    t0 = time.time()
    import vllm

    try:  # bind tilelang/T in vLLM before its mHC modules are imported (it only does so on CUDA)
        import vllm.tilelang_utils as _tu

        _tu._ensure_tilelang_imported()
    except Exception:  # noqa: BLE001 - no tilelang: the TileLang rows say so
        pass

    audit = Audit(arch, jobs)
    scopes = {}
    if modules:
        _source.FOLLOW = _source.FOLLOW + tuple(modules)
        models = ["v4"]
        audit.entry_modules = set(modules)
        scopes[("v4", "default")] = {k: v for k, v in _source.closure(modules, audit.libs).items()
                                     if k in modules}
    for m in models if not modules else ():
        scopes[(m, "default")] = audit.scope(m)
        for path, parts in _paths.EXTRA_PATHS.get(m, {}).items():
            scopes[(m, path)] = audit.scope(m, parts, path)
    all_mods: Dict[str, _source.ModuleIndex] = {}
    for s in scopes.values():
        all_mods.update(s)
    objs = audit.kernels(all_mods)
    regs: Dict[Tuple[str, str], List[_source.Registration]] = {}
    for idx in all_mods.values():
        for r in idx.registrations:
            regs.setdefault((r.kernel_module, r.kernel), []).append(r)
    t1 = time.time()
    # each model compiles the kernels of its own scopes (the warmup keys depend on its config)
    in_model = {m: {k for (mm, _p), s in scopes.items() if mm == m for k in s} for m in models}
    compiled = {m: audit.compile_triton({k: o for k, o in objs.items() if k[0] in in_model[m]} if not modules
                                        else objs, regs, m) for m in models}
    t2 = time.time()
    rows = []
    for (m, path), mods in scopes.items():
        local = {k: o for k, o in objs.items() if k[0] in mods}
        with _follow(m):
            got = audit.rows_for(m, path, mods, local, compiled[m])
        if path != "default":
            base = {(r["kernel"], r["phase"], r["location"]) for r in rows if r["model"] == m and r["path"] == "default"}
            got = [r for r in got if (r["kernel"], r["phase"], r["location"]) not in base]
        rows.extend(got)
    if not modules:  # linears, MoE, router/gate, norms, embedding/LM head, sampler, all-reduce, ViT, loading
        from . import _modules, _spec

        for m in models:
            rows.extend(_modules.rows(m, arch))
        for m in models:  # the runner's speculative-decoding kernels (reported, not enforced)
            rows.extend(_spec.rows(audit, m, {r["kernel"] for r in rows if r["model"] == m}, _kernel_tech, _short))
    shas = {f"{m}.{n}": kernel_source_sha(o) for (m, n), o in objs.items()}
    for r in rows:
        r["source"] = shas[r["kernel"]] if r["kernel"] in shas else _row_sha(r["kernel"], shas)
    t3 = time.time()
    audit.notes.append(f"timing: serve-path modules {t3 - t2:.0f} s")
    audit.notes.append(f"timing: import+discovery {t1 - t0:.0f} s, Triton AOT {t2 - t1:.0f} s")
    return {"vllm": getattr(vllm, "__version__", "unknown"), "arch": arch, "rows": rows, "notes": audit.notes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="v4,v41")
    p.add_argument("--arch", type=int, default=80)
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    p.add_argument("--out", default="-")
    p.add_argument("--modules", default="", help="audit these modules instead of the models (tests)")
    a = p.parse_args(argv)
    res = run(a.models.split(","), a.arch, a.jobs, tuple(m for m in a.modules.split(",") if m))
    text = json.dumps(res)
    if a.out == "-":
        sys.stdout.write("\n@@AUDIT@@" + text + "\n")
    else:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
