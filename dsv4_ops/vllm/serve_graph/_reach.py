"""Which top-level symbols of the audited modules a model actually constructs or calls: a
class-level reference graph from the model class vLLM's registry resolves for the
architecture, down (AST only, nothing imported).

A *node* is a top-level symbol ``(module, name)``: a class (its bases, decorators, class body
and every method, taken together), a module-level function, or a module-level assignment
(``_K = dispatcher(...)(_k)``). A node refers to another when its source names it, with
``import ... as`` undone, re-exports followed (``from .ops import f`` in a package
``__init__``) and dotted module chains resolved (``cache_utils.f``, ``torch.ops.vllm.<op>``
through vLLM's ``direct_register_custom_op`` table). Attribute access on objects
(``self.x``) adds nothing: every method of a reached class counts as reached, which
over-approximates (a method that is never called is still "reached"), so "not reached" is only
said of symbols that no reached code names at all.

This replaces module-import scope: V4.1 imports ``deepseek_v4.nvidia.model`` for its MoE
class, and the module import alone pulled V4's attention, compressor and sparse-MLA kernels
into V4.1's rows although V4.1 never builds those classes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ._source import _resolve_relative as _relative

Node = Tuple[str, str]  # (module, top-level name)


@dataclass
class _Mod:
    name: str
    is_pkg: bool
    defs: Set[str] = field(default_factory=set)
    aliases: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # local -> (module, name or '')
    refs: Dict[str, List[List[str]]] = field(default_factory=dict)     # top-level name -> dotted chains
    fn_refs: Dict[str, List[List[str]]] = field(default_factory=dict)  # function / Cls.method -> chains
    custom_ops: Dict[str, str] = field(default_factory=dict)           # torch.ops.vllm.<op> -> function


def _chain(node: ast.AST) -> Optional[List[str]]:
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _chains(node: ast.AST) -> List[List[str]]:
    """Every maximal dotted name (``a``, ``a.b.c``) read inside ``node``."""
    out, inner = [], set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and id(n) not in inner:
            c = _chain(n)
            if c:
                out.append(c)
                sub = n.value
                while isinstance(sub, ast.Attribute):
                    inner.add(id(sub))
                    sub = sub.value
                inner.add(id(sub))
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and id(n) not in inner:
            out.append([n.id])
    return out


def index(name: str, path: str, is_pkg: bool) -> _Mod:
    tree = ast.parse(open(path).read(), filename=path)
    mod = _Mod(name, is_pkg)
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.asname:
                    mod.aliases[a.asname] = (a.name, "")
                else:
                    top = a.name.split(".")[0]
                    mod.aliases.setdefault(top, (top, ""))
        elif isinstance(n, ast.ImportFrom):
            src = _relative(name, is_pkg, n.level, n.module) if n.level else n.module
            for a in n.names if src else ():
                mod.aliases[a.asname or a.name] = (src, a.name)
        elif isinstance(n, ast.Call):
            f = _chain(n.func)
            if f and f[-1].endswith("register_custom_op"):
                kw = {k.arg: k.value for k in n.keywords}
                if isinstance(kw.get("op_name"), ast.Constant) and isinstance(kw.get("op_func"), ast.Name):
                    mod.custom_ops[kw["op_name"].value] = kw["op_func"].id
    for st in tree.body:
        names: List[str] = []
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [st.name]
        elif isinstance(st, (ast.Assign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if st.value is None:
                continue
        for nm in names:
            mod.defs.add(nm)
            mod.aliases.pop(nm, None)  # a local definition shadows an import of the same name
            body = st if not isinstance(st, (ast.Assign, ast.AnnAssign)) else st.value
            mod.refs.setdefault(nm, []).extend(_chains(body))
            if isinstance(st, ast.ClassDef):
                for m in st.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        mod.fn_refs[f"{nm}.{m.name}"] = _chains(m)
            else:
                mod.fn_refs[nm] = mod.refs[nm]
    return mod


class Graph:
    """The class-level reference graph over ``modules`` ({module: (path, is_pkg)})."""

    def __init__(self, modules: Dict[str, Tuple[str, bool]]):
        self.mods: Dict[str, _Mod] = {m: index(m, p, k) for m, (p, k) in modules.items()}
        self.ops: Dict[str, Node] = {op: (m.name, fn) for m in self.mods.values() for op, fn in m.custom_ops.items()}

    def resolve(self, module: str, name: str, depth: int = 0) -> Optional[Node]:
        """The defining node of ``name`` as seen from ``module`` (re-exports followed), or None
        when it is defined outside the audited modules."""
        m = self.mods.get(module)
        if m is None or depth > 8:
            return None
        if name in m.defs:
            return (module, name)
        if name in m.aliases:
            src, sym = m.aliases[name]
            if not sym or f"{src}.{sym}" in self.mods:
                return None  # a module, not a symbol
            return self.resolve(src, sym, depth + 1)
        return None

    def _module_of(self, module: str, local: str) -> Optional[str]:
        m = self.mods.get(module)
        if m is None or local not in m.aliases:
            return None
        src, sym = m.aliases[local]
        return src if not sym else f"{src}.{sym}"

    def targets(self, module: str, chain: List[str]) -> Iterable[Node]:
        head = self.resolve(module, chain[0])
        if head is not None:
            yield head
            return
        if len(chain) >= 4 and chain[:3] == ["torch", "ops", "vllm"] and chain[3] in self.ops:
            yield self.ops[chain[3]]
            return
        cur = self._module_of(module, chain[0])
        for part in chain[1:]:
            if cur is None:
                return
            if f"{cur}.{part}" in self.mods or (cur not in self.mods and f"{cur}.{part}".count(".") < 8):
                cur = f"{cur}.{part}"
                continue
            got = self.resolve(cur, part)
            if got is not None:
                yield got
            return

    def edges(self, node: Node) -> Set[Node]:
        m = self.mods.get(node[0])
        out: Set[Node] = set()
        for chain in (m.refs.get(node[1], ()) if m else ()):
            out.update(t for t in self.targets(node[0], chain) if t != node)
        return out

    def users(self, node: Node) -> Set[Tuple[str, str]]:
        """(module, qualname) of every function, method or module-level object whose source
        names ``node`` (resolved, so a same-named symbol of another module does not count)."""
        if not hasattr(self, "_users"):
            inv: Dict[Node, Set[Tuple[str, str]]] = {}
            for m in self.mods.values():
                for qual, chains in m.fn_refs.items():
                    for chain in chains:
                        for t in self.targets(m.name, chain):
                            inv.setdefault(t, set()).add((m.name, qual))
            self._users = inv
        return self._users.get(node, set())

    def reached(self, roots: Iterable[Node], stop: Iterable[Node] = ()) -> Dict[Node, Optional[Node]]:
        """Every node reachable from ``roots``, each with the node it was first reached from;
        ``stop``: nodes a reached class names but never constructs (the audit's
        ``_paths.reach_cuts``, each read from source), not entered."""
        seen: Dict[Node, Optional[Node]] = {}
        cut = set(stop)
        todo: List[Tuple[Node, Optional[Node]]] = [(r, None) for r in roots]
        while todo:
            node, parent = todo.pop()
            if node in seen or node in cut:
                continue
            seen[node] = parent
            todo.extend((e, node) for e in self.edges(node) if e not in seen)
        return seen


def path_to(reached: Dict[Node, Optional[Node]], node: Node, limit: int = 6) -> str:
    """``Root -> ... -> node`` (short names), for evidence."""
    hops, cur = [], node
    while cur is not None and len(hops) < 40:
        hops.append(cur[1])
        cur = reached.get(cur)
    hops = hops[::-1]
    if len(hops) > limit:
        hops = hops[:2] + ["..."] + hops[-(limit - 3):]
    return " -> ".join(hops)


def registry_roots(package: str, architectures: Iterable[str]) -> List[Node]:
    """The classes vLLM's model registry loads for ``architectures`` of ``package`` on NVIDIA:
    the registry names (package, class); the package ``__init__`` imports the class from a
    per-platform module, and the NVIDIA one is the import outside the ROCm/XPU/CPU branches."""
    from . import _source

    path = _source.module_path(package)
    tree = ast.parse(open(path).read())
    out: List[Node] = []
    platform_only = ("is_rocm", "is_xpu", "is_cpu", "is_tpu")

    def walk(stmts, off: bool):
        for st in stmts:
            if isinstance(st, ast.If):
                test = ast.unparse(st.test)
                walk(st.body, off or any(p in test for p in platform_only))
                # `if current_platform.is_cuda(): ... else: ...` (deepseek_v32): the else is another platform
                walk(st.orelse, off or test.endswith("is_cuda()"))
            elif isinstance(st, ast.ImportFrom) and not off:
                src = _relative(package, True, st.level, st.module) if st.level else st.module
                for a in st.names:
                    if (a.asname or a.name) in architectures and _source.followed(src):
                        out.append((src, a.name))

    walk(tree.body, False)
    return out


def registry_classes(package: str) -> Dict[str, str]:
    """architecture -> class name for every registry row of ``package`` (vLLM's
    ``model_executor/models/registry.py``, read as source)."""
    from . import _source

    path = _source.module_path("vllm.model_executor.models.registry")
    out: Dict[str, str] = {}
    for n in ast.walk(ast.parse(open(path).read())):
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2
                        and all(isinstance(e, ast.Constant) for e in v.elts) and v.elts[0].value == package):
                    out[k.value] = v.elts[1].value
    return out
