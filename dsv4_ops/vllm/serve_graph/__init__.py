"""The serve-path call graph of vLLM's model code, read from source (AST only): which vLLM
modules a model's default NVIDIA serve path loads, who references which name, and whether every
serve-path use of a vLLM function goes through a row of the patch table (``dsv4_ops.vllm.table``).

The plugin asks it at startup (``dsv4_ops.vllm.warmup``: is a JIT kernel that fails to compile
here replaced?); ``dsv4-ops audit-vllm`` (``dsv4_ops.vllm.audit``) builds its report on it.
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Set, Tuple

from . import _reach, _scope, _source

MODELS = {"v4": "vllm.models.deepseek_v4", "v41": "vllm.models.deepseek_v41",
          # DeepSeek-V3.2 and GLM-5: one package, one model class on CUDA (different configs)
          "v32": "vllm.models.deepseek_v32", "glm5": "vllm.models.deepseek_v32"}


class _follow:
    """``_source.FOLLOW`` extended with the model's extra packages (``_scope.FOLLOW_BY_MODEL``)
    while its scope is read and its rows are decided; the V4/V4.1 scopes are unchanged."""

    def __init__(self, model: str):
        self.model = model
        self.extra = tuple(_scope.FOLLOW_BY_MODEL.get(model, ()))

    def __enter__(self):
        self.saved, self.saved_model = _source.FOLLOW, _scope.CURRENT_MODEL
        _source.FOLLOW = self.saved + tuple(x for x in self.extra if x not in self.saved)
        _scope.CURRENT_MODEL = self.model

    def __exit__(self, *exc):
        _source.FOLLOW, _scope.CURRENT_MODEL = self.saved, self.saved_model


# Methods reached by calling the class or an instance, not by name.
_CLASS_ENTRY = ("__call__", "__init__")


class ServeGraph:
    """A model's serve-path scope and the name-reference graph over it, with the patch table's
    coverage of each use. ``arch``: the capability the source's guards are evaluated for."""

    def __init__(self, arch: int):
        self.arch = arch
        self.libs = _source.deep_gemm_kernel_names()
        _source.init_guards(arch)
        self.entry_modules: Set[str] = set()  # --modules (tests): their functions are entry points
        # the class-level graph of the path being read (the audit's rows_for sets them; None: not
        # applied, every symbol counts as reached)
        self._graph: Optional[_reach.Graph] = None
        self._reached: Dict = {}
        self._mods: Dict[str, _source.ModuleIndex] = {}
        self._ops: Dict[str, str] = {}
        # module:qualname of the patch table's 'kept' rows, whose uses count as not replaced (the
        # audit's kept_keys fills it)
        self.kept: Set[str] = set()

    def is_reached(self, module: str, qualname: str) -> bool:
        """Whether the top-level symbol owning ``module:qualname`` is reached from the path's
        model classes (always True when the graph is not applied)."""
        if self._graph is None or module not in self._graph.mods:
            return True
        return (module, qualname.split(".")[0]) in self._reached

    def resolved_users(self, name: str, module: str, refs) -> List[_source.Func]:
        """Functions that reference ``module.name``: through the resolved graph for a top-level
        symbol of an audited module (a same-named function elsewhere does not count), by name for
        a method (``self.x`` is not resolved)."""
        g = self._graph
        if g is not None and module in g.mods and name in g.mods[module].defs:
            out = []
            for m, q in sorted(g.users((module, name))):
                f = self._mods[m].funcs.get(q) if m in self._mods else None
                # a use as _source reads it (a name or torch.ops.vllm.<op>; not a warmup registration)
                if f is not None and (name in f.idents or any(self._ops.get(i) == name for i in f.idents)):
                    out.append(f)
            return out
        return list(refs.get(name, ()))

    # ------------------------------------------------------------------ discovery
    @staticmethod
    def root_classes(model: str, path: str) -> List[_reach.Node]:
        """The classes vLLM's registry loads on NVIDIA for the path's architectures (the default
        path's too, for a draft path)."""
        pkg = MODELS[model]
        by_arch = _reach.registry_classes(pkg)
        archs = list(_scope.ARCHITECTURES[model]["default"])
        if path != "default":
            archs += list(_scope.ARCHITECTURES[model].get(path, ()))
        names = [by_arch[a] for a in archs if a in by_arch]
        return _reach.registry_roots(pkg, names)

    def scope(self, model: str, extra: Tuple[str, ...] = (), path: str = "default") -> Dict[str, _source.ModuleIndex]:
        pkg = MODELS[model]
        saved = _source.EXCLUDE_PARTS
        _source.EXCLUDE_PARTS = saved + tuple(x for x in _scope.EXTRA_PATH_PARTS if x not in extra) + \
            tuple(_scope.OFF_PATH_MODULES)
        try:
            with _follow(model):
                roots = [f"{pkg}.nvidia.model"] + [f"{pkg}.nvidia{p}" for p in extra] + \
                    list(_scope.shared_roots(model)) + [m for m, _ in self.root_classes(model, path)]
                return _source.closure(roots, self.libs)
        finally:
            _source.EXCLUDE_PARTS = saved

    # ------------------------------------------------------------------ coverage
    def patched(self):
        """(bindings, replaced function keys, patch-row name for each)."""
        from dsv4_ops.vllm.plugin import STATE   # late: the plugin imports the warmup filter
        from dsv4_ops.vllm.table import patches

        bind: Dict[Tuple[str, str], str] = {}
        funcs: Dict[str, str] = {}
        for p in patches():
            if p.kind not in ("patch", "override"):
                continue
            owner_mod, *path = p.symbol.split(".")
            name = p.qualname
            if p.kind == "patch" and not path:
                bind[(p.module, p.symbol)] = name
                try:
                    # vLLM's function, also in a served process where the row is applied (there
                    # the module attribute is the replacement, the original is in STATE.originals)
                    applied = STATE.originals.get((p.module, p.symbol))
                    obj = applied[2] if applied else getattr(importlib.import_module(p.module), p.symbol)
                    mod = getattr(obj, "__module__", None) or type(obj).__module__
                    qual = getattr(obj, "__qualname__", None)
                    if mod and qual and not isinstance(obj, type):
                        funcs[f"{mod}:{qual}"] = name
                        bind.setdefault((mod, qual), name)
                except Exception:  # noqa: BLE001
                    pass
            funcs[f"{p.module}:{p.symbol}"] = name
        return bind, funcs

    def build_graph(self, mods):
        """name -> functions that reference it; ``torch.ops.vllm.<op>`` counts as a reference to
        the Python function registered as that custom op."""
        ops: Dict[str, str] = {}
        for idx in mods.values():
            ops.update(idx.custom_ops)
        refs: Dict[str, List[_source.Func]] = {}
        for idx in mods.values():
            for f in idx.funcs.values():
                for n in f.idents | {ops[i] for i in f.idents if i in ops and ops[i] != f.qualname}:
                    refs.setdefault(n, []).append(f)
        return refs

    def coverage(self, name: str, module: str, refs, bind, funcs, jit_defs, depth=0, seen=None) -> Optional[str]:
        """The patch row that every on-path use of ``module.name`` goes through, or None."""
        seen = set() if seen is None else seen
        if (module, name) in bind:
            return bind[(module, name)]
        if f"{module}:{name}" in self.kept:
            return None  # the replacement calls it itself: its status is its own evidence
        users = [f for f in self.resolved_users(name, module, refs) if (f.module, f.qualname) not in jit_defs
                 and self.is_reached(f.module, f.qualname)]
        if not users or depth > 6:
            return None
        rows = set()
        for f in users:
            if (f.module, name) in bind:
                rows.add(bind[(f.module, name)])
                continue
            if f.key in funcs and f.key not in self.kept:
                rows.add(funcs[f.key])
                continue
            if ("." not in f.qualname and f.module not in self.entry_modules
                    and not [u for u in refs.get(f.qualname, ()) if u is not f]
                    and not _source.called_anywhere_in_vllm(f.qualname)):
                continue  # a module-level function nothing in vLLM calls: never called
            if f.key in seen:
                return None
            seen.add(f.key)
            parts = f.qualname.split(".")
            short = parts[-1]
            if len(parts) > 1 and short in _CLASS_ENTRY:
                short = parts[-2]  # `obj(...)` / `Cls(...)`: the users of the class (or its instances)
            row = self.coverage(short, f.module, refs, bind, funcs, jit_defs, depth + 1, seen)
            if row is None:
                return None
            rows.add(row)
        return " + ".join(sorted(rows)) or None
