"""Read vLLM's source (AST only, nothing imported): the modules of a model's serve path, who
references which name, JIT-warmup registrations, and calls into sm_90+-only libraries with
their capability guards.

A *function* is a module-level function or a class method (nested functions belong to their
enclosing one); it is keyed ``module:qualname``. Names are matched after undoing ``import ... as``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

# Packages whose modules can be on a DeepSeek-V4/V4.1 serve path; imports elsewhere are not followed.
FOLLOW = (
    "vllm.models.deepseek_v4", "vllm.models.deepseek_v41", "vllm.models.common",
    "vllm.model_executor.kernels.mhc", "vllm.model_executor.kernels.attention.dsa",
    "vllm.model_executor.layers.sparse_attn_indexer", "vllm.model_executor.layers.indexer_topk",
    "vllm.v1.attention.backends.mla.indexer", "vllm.v1.attention.backends.mla.sparse_swa",
    "vllm.v1.attention.backends.mla.compressor_utils", "vllm.v1.attention.ops.common",
)
# Other platforms, the XPU/CPU vision stub, and the multimodal processor (CPU-side, API server):
# never on the NVIDIA GPU serve path. The vision tower itself (common/vision.py, nvidia/vl_model.py)
# is followed: V4.1-Flash's registered class builds it.
EXCLUDE_PARTS = (".amd", ".xpu", ".cpu", ".vl_stub", ".mm_preprocess", "rocm")

# Capability helpers with a known value on sm_8x with a vLLM wheel installed, for guard evaluation.
# has_*: module-existence checks (the wheel vendors DeepGEMM and depends on nvidia-cutlass-dsl).
GUARD_VALUES = {
    "has_deep_gemm": True, "has_cutedsl": True, "is_cuda": True,
    "is_deep_gemm_supported": False, "is_device_capability_family": False,
    "has_deep_gemm_sparse_mqa": False, "supports_mhc_overlap": False, "is_rocm": False, "is_xpu": False,
    "is_cpu": False,
}
# Layer attributes that select an opt-in backend: (value on a default serve, why). Read from
# vLLM's own config source when possible (``_mega_moe_default``).
GUARD_ATTRS: Dict[str, Tuple[bool, str]] = {}
GUARD_WHY = {
    "has_deep_gemm": "has_deep_gemm() only checks that the module imports; vLLM vendors DeepGEMM, so it is True on sm_80",
    "has_cutedsl": "has_cutedsl() only checks that nvidia-cutlass-dsl imports (a vLLM dependency): True on sm_80",
    "is_deep_gemm_supported": "is_deep_gemm_supported() is False below sm_90 (platforms/cuda.py)",
}


@dataclass
class Func:
    module: str
    qualname: str
    lineno: int
    idents: Set[str] = field(default_factory=set)
    # idents holds every reference (the patch coverage follows all of them); live the ones not
    # under a guard never taken on sm_8x; gated: name -> such a guard (reachability, not coverage)
    live: Set[str] = field(default_factory=set)
    gated: Dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass
class Registration:
    module: str
    func: str
    lineno: int
    kernel: str       # name as defined in its own module
    kernel_module: str
    kwargs: Dict[str, str]   # source text of each keyword argument
    local_defs: Dict[str, str] = field(default_factory=dict)  # name = <source> in the same function


@dataclass
class LibCall:
    module: str
    func: str
    lineno: int
    library: str      # DeepGEMM / FlashMLA / deep_select
    name: str
    guards: List[str]  # guard notes (taken branches)


@dataclass
class ModuleIndex:
    name: str
    path: str
    aliases: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # local -> (module, name or '')
    imports: Set[str] = field(default_factory=set)
    funcs: Dict[str, Func] = field(default_factory=dict)
    toplevel: Set[str] = field(default_factory=set)
    registrations: List[Registration] = field(default_factory=list)
    libcalls: List[LibCall] = field(default_factory=list)
    gated_off: List[LibCall] = field(default_factory=list)
    custom_ops: Dict[str, str] = field(default_factory=dict)  # torch.ops op name -> python function
    classes: Set[str] = field(default_factory=set)
    # calls that construct a class: (class name, function key, guard note or '' when reached)
    constructions: List[Tuple[str, str, str]] = field(default_factory=list)


def module_path(name: str) -> Optional[str]:
    """The .py file of module ``name`` under an installed top-level package, found on disk
    (nothing is imported, so a ``from pkg.mod import function`` never imports anything)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec and not rest and spec.origin and spec.origin.endswith(".py"):
        return spec.origin
    if not spec or not spec.submodule_search_locations:
        return None
    base = os.path.join(list(spec.submodule_search_locations)[0], *rest)
    for cand in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(cand):
            return cand
    return None


def followed(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FOLLOW) and not any(x in name for x in EXCLUDE_PARTS)


def _resolve_relative(module: str, is_pkg: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


class _Visitor(ast.NodeVisitor):
    def __init__(self, idx: ModuleIndex, is_pkg: bool, lib_names: Dict[str, Tuple[str, str]]):
        self.idx, self.is_pkg, self.lib_names = idx, is_pkg, lib_names
        self.stack: List[str] = []
        self.func: Optional[Func] = None
        self.guards: List[Tuple[ast.expr, bool]] = []
        self.local_defs: Dict[str, str] = {}
        # `k = A if c else B` (or `k = A`) in a function whose only use of k is
        # `k.register_warmup(...)`: a warmup registration of A / B, not a use of them
        self.kernel_locals: Dict[str, ast.expr] = {}
        self.register_only: Set[str] = set()
        self.early: Set[int] = set()  # tests of `if <test>: return` guards (the rest of the block)

    # imports (anywhere: vLLM imports many kernels inside functions)
    def visit_Import(self, node):
        for a in node.names:
            self.idx.imports.add(a.name)
            self.idx.aliases[a.asname or a.name.split(".")[0]] = (a.name, "")

    def visit_ImportFrom(self, node):
        mod = _resolve_relative(self.idx.name, self.is_pkg, node.level, node.module) if node.level else node.module
        if not mod:
            return
        for a in node.names:
            self.idx.imports.add(mod)
            self.idx.imports.add(f"{mod}.{a.name}")  # a submodule, if it is one
            self.idx.aliases[a.asname or a.name] = (mod, a.name)

    def _name(self, local: str) -> str:
        return self.idx.aliases.get(local, ("", local))[1] or local

    def visit_ClassDef(self, node):
        if not self.stack:
            self.idx.toplevel.add(node.name)
            self.idx.classes.add(node.name)
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        if not self.stack:
            self.idx.toplevel.add(node.name)
        own = self.func is None
        if own:
            self.local_defs = {}
            self.kernel_locals = {}
            self.register_only = _register_only_locals(node)
            qual = ".".join(self.stack + [node.name])
            self.func = self.idx.funcs.setdefault(qual, Func(self.idx.name, qual, node.lineno))
        self.stack.append(node.name)
        for d in node.decorator_list:
            self.visit(d)
        self._block(node.body)
        self.stack.pop()
        if own:
            self.func = None

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        if self.func is not None and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self.local_defs[node.targets[0].id] = ast.unparse(node.value)
            v = node.value
            if node.targets[0].id in self.register_only and (
                    isinstance(v, ast.Name) or (isinstance(v, ast.IfExp) and isinstance(v.body, ast.Name)
                                                and isinstance(v.orelse, ast.Name))):
                if isinstance(v, ast.IfExp):
                    self.visit(v.test)
                self.kernel_locals[node.targets[0].id] = v   # registered below, never used
                return
        if not self.stack:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self.idx.toplevel.add(t.id)
        if (not self.stack and self.func is None and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call)):
            # `_K = SomeKernelClass(part=_OTHER_KERNEL, ...)`: a module-level object built from
            # other names is a user of them (and of its class), keyed module:_K like a function,
            # so a patch row that replaces the object covers what it calls.
            name = node.targets[0].id
            self.func = self.idx.funcs.setdefault(name, Func(self.idx.name, name, node.lineno))
            self.local_defs = {}
            self.visit(node.value)  # not the target: the object is not a user of itself
            self.func = None
            return
        self.generic_visit(node)

    def _block(self, stmts):
        """Visit a statement list; after `if <test>: ... return/raise` (no else), the rest of
        the block runs only when <test> is false, so it is guarded by `not <test>`."""
        pushed = 0
        for stmt in stmts:
            self.visit(stmt)
            if (isinstance(stmt, ast.If) and not stmt.orelse and stmt.body
                    and isinstance(stmt.body[-1], (ast.Return, ast.Raise))):
                self.guards.append((stmt.test, False))
                self.early.add(id(stmt.test))
                pushed += 1
        for _ in range(pushed):
            self.guards.pop()

    def visit_If(self, node):
        self.visit(node.test)
        self.guards.append((node.test, True))
        self._block(node.body)
        self.guards[-1] = (node.test, False)
        self._block(node.orelse)
        self.guards.pop()

    def visit_IfExp(self, node):
        self.visit(node.test)
        self.guards.append((node.test, True))
        self.visit(node.body)
        self.guards[-1] = (node.test, False)
        self.visit(node.orelse)
        self.guards.pop()

    def off_guard(self) -> str:
        """The first enclosing guard that is never taken on sm_8x (as a note), or ''."""
        for test, branch in self.guards:
            value = _eval_guard(test, self)
            if value is not None and value != branch:
                head = (f"after `if {ast.unparse(test)[:100]}: return`" if id(test) in self.early
                        else f"inside `{'if' if branch else 'else of'} {ast.unparse(test)[:100]}`")
                why = "; ".join(GUARD_WHY[n] for n in sorted(set(_guard_names(test, self)) & set(GUARD_WHY)))
                return f"{self.idx.name}:{self.func.qualname if self.func else ''}:{test.lineno} {head}" + (
                    f" ({why})" if why else "")
        return ""

    def _ref(self, name: str):
        self.func.idents.add(name)
        off = self.off_guard() if self.guards else ""
        if off:
            self.func.gated.setdefault(name, off)
        else:
            self.func.live.add(name)

    def visit_Name(self, node):
        if self.func is not None:
            self._ref(self._name(node.id))

    def visit_Attribute(self, node):
        if self.func is not None:
            self._ref(node.attr)
        self.visit(node.value)

    def visit_Call(self, node):
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else "")
        if self.func is not None and isinstance(f, ast.Name):
            # `Cls(...)`, or `cls(...)` in a method of class Cls: a construction of Cls
            cname = self.stack[0] if f.id == "cls" and len(self.stack) > 1 else self._name(f.id)
            self.idx.constructions.append((cname, self.func.key, self.off_guard() if self.guards else ""))
        if fname.endswith("register_custom_op"):
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(kw.get("op_name"), ast.Constant) and isinstance(kw.get("op_func"), ast.Name):
                self.idx.custom_ops[kw["op_name"].value] = kw["op_func"].id
        if isinstance(f, ast.Attribute) and f.attr == "register_warmup" and self.func is not None:
            v = f.value
            if isinstance(v, ast.Name) and v.id in self.kernel_locals:
                v = self.kernel_locals[v.id]
            targets = [v.body, v.orelse] if isinstance(v, ast.IfExp) else [v]
            for t in targets:
                if isinstance(t, ast.Name):
                    mod, name = self.idx.aliases.get(t.id, (self.idx.name, t.id))
                    self.idx.registrations.append(Registration(
                        self.idx.name, self.func.qualname, node.lineno, name or t.id, mod,
                        {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}, dict(self.local_defs)))
            for a in list(node.args) + [k.value for k in node.keywords]:
                self.visit(a)
            return
        self._libcall(node)
        self.generic_visit(node)

    def _libcall(self, node):
        if self.func is None:
            return
        f = node.func
        local = f.id if isinstance(f, ast.Name) else None
        hit = None
        if local is not None:
            mod, name = self.idx.aliases.get(local, ("", ""))
            hit = self.lib_names.get(f"{mod}.{name}")
            if hit is None and name and any(mod.startswith(p) for p in _LIB_MODULE_PREFIXES):
                hit = _lib_for_module(mod, name)
            if hit is None and mod == "vllm._custom_ops" and name:
                hit = (CPP, name)
        elif isinstance(f, ast.Attribute):
            chain = ast.unparse(f)
            if "_deepselect_C" in chain:
                hit = ("deep_select", chain)
            elif chain.startswith("torch.ops._C.") and chain.count(".") == 3:
                hit = (CPP, f.attr)
            elif isinstance(f.value, ast.Name) and self.idx.aliases.get(f.value.id, ("", ""))[0] == "vllm._custom_ops":
                hit = (CPP, f.attr)
            elif (isinstance(f.value, ast.Name) and self.idx.aliases.get(f.value.id) == ("vllm", "_custom_ops")):
                hit = (CPP, f.attr)
            elif isinstance(f.value, ast.Name):
                mod = self.idx.aliases.get(f.value.id, ("", ""))
                full = f"{mod[0]}.{mod[1]}".strip(".") if mod[1] else mod[0]
                hit = self.lib_names.get(f"{full}.{f.attr}") or (
                    _lib_for_module(full, f.attr) if any(full.startswith(p) for p in _LIB_MODULE_PREFIXES) else None)
        if hit is None:
            return
        library, name = hit
        taken, notes = True, []
        for test, branch in self.guards:
            value = _eval_guard(test, self)
            names = {n for n in _guard_names(test, self)}
            defs = [f"{n} = {self.local_defs[n]}" for n in _local_names(test) if n in self.local_defs]
            head = (f"after `if {ast.unparse(test)[:80]}: return`" if id(test) in self.early
                    else f"`{'if' if branch else 'else of'} {ast.unparse(test)[:80]}`")
            where = head + (
                f" ({'; '.join(defs)[:120]})" if defs else "")
            if value is not None and value != branch:
                taken = False
                notes.append(f"{'' if id(test) in self.early else 'inside '}{where}: never reached on sm_8x")
            elif value is None and (names & set(GUARD_VALUES)):
                notes.append(f"inside {where}: not decided for sm_8x (depends on the caller), so counted as reached")
            for n in names & set(GUARD_WHY):
                notes.append(GUARD_WHY[n])
        call = LibCall(self.idx.name, self.func.qualname, node.lineno, library, name, sorted(set(notes)))
        (self.idx.libcalls if taken else self.idx.gated_off).append(call)


CPP = "C++ _C"  # torch.ops._C.<op> / vllm._custom_ops.<op>: a kernel in vLLM's own extension
_LIB_MODULE_PREFIXES = ("vllm.third_party.deep_gemm", "deep_gemm", "vllm.third_party.flashmla", "flash_mla",
                        "vllm.v1.attention.ops.flashmla")


def _register_only_locals(func: ast.AST) -> Set[str]:
    """Names in ``func`` whose every load is the receiver of a ``.register_warmup(...)`` call."""
    loads: Dict[str, int] = {}
    receivers: Dict[str, int] = {}
    for n in ast.walk(func):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            loads[n.id] = loads.get(n.id, 0) + 1
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "register_warmup"
                and isinstance(n.func.value, ast.Name)):
            receivers[n.func.value.id] = receivers.get(n.func.value.id, 0) + 1
    return {k for k, c in receivers.items() if loads.get(k) == c}


def _lib_for_module(mod: str, name: str):
    if "deep_gemm" in mod:
        return ("DeepGEMM", name)
    if "flashmla" in mod or "flash_mla" in mod:
        return ("FlashMLA", name) if name.startswith("flash_mla") else None
    return None


def _local_names(test: ast.expr) -> List[str]:
    return [n.id for n in ast.walk(test) if isinstance(n, ast.Name)]


def _guard_names(test: ast.expr, vis: _Visitor, depth: int = 0) -> Iterable[str]:
    for n in ast.walk(test):
        if isinstance(n, ast.Name):
            yield vis._name(n.id)
            if n.id in vis.local_defs and depth < 3:  # `use_deep_gemm = is_deep_gemm_supported()`
                try:
                    yield from _guard_names(ast.parse(vis.local_defs[n.id], mode="eval").body, vis, depth + 1)
                except SyntaxError:
                    pass
        elif isinstance(n, ast.Attribute):
            yield n.attr


def _eval_guard(test: ast.expr, vis: _Visitor, depth: int = 0) -> Optional[bool]:
    """True/False when the test is decided by GUARD_VALUES alone (a local name is read through
    its assignment in the same function, e.g. ``use_deep_gemm = is_deep_gemm_supported() or not
    use_tilelang_fallback``; a parameter is undecided), else None."""
    if depth > 4:
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = _eval_guard(test.operand, vis, depth + 1)
        return None if v is None else not v
    if isinstance(test, ast.BoolOp):
        vals = [_eval_guard(v, vis, depth + 1) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in vals else (True if all(v is True for v in vals) else None)
        return True if True in vals else (False if all(v is False for v in vals) else None)
    if isinstance(test, ast.Call):
        f = test.func
        name = vis._name(f.id) if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else None)
        return GUARD_VALUES.get(name)
    if isinstance(test, ast.Name) and test.id in vis.local_defs:
        try:
            return _eval_guard(ast.parse(vis.local_defs[test.id], mode="eval").body, vis, depth + 1)
        except SyntaxError:
            return None
    if isinstance(test, ast.Attribute) and test.attr in GUARD_ATTRS:
        return GUARD_ATTRS[test.attr][0]
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and isinstance(test.left, ast.Name) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        # `table = _low_latency_table(); if table is None: return`: a selector that returns None on
        # sm_8x (GUARD_NONE, read from its source)
        src = vis.local_defs.get(test.left.id, "")
        fn = src.split("(", 1)[0].rsplit(".", 1)[-1] if src.endswith(")") else ""
        if fn in GUARD_NONE:
            return isinstance(test.ops[0], ast.Is)
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))
            and isinstance(test.left, ast.Name) and isinstance(test.comparators[0], ast.Constant)):
        # `backend == "cooperative"` with `backend = self.resolve_backend(...)`: a selector whose
        # possible results on sm_8x were read from its source (GUARD_RESULTS)
        src = vis.local_defs.get(test.left.id, "")
        m = src.split("(", 1)[0].rsplit(".", 1)[-1] if src.endswith(")") else ""
        never = GUARD_RESULTS.get(m, (frozenset(), ""))[0]
        if test.comparators[0].value in never:
            return isinstance(test.ops[0], ast.NotEq)
    return None


# selector function -> (results it never returns on sm_8x, why), read from source (init_guards)
GUARD_RESULTS: Dict[str, Tuple[frozenset, str]] = {}
# functions that return None on sm_8x -> why, read from source (init_guards)
GUARD_NONE: Dict[str, str] = {}


def _v32_capability_guards(arch: int) -> None:
    """DeepSeek-V3.2 / GLM-5 sm_90+ fast paths, each read from vLLM's source:
    ``DeepSeekV2FusedQkvAProjLinear._use_min_latency_gemm`` needs capability 9.0 or the 10.x family
    (deepseek_v2.py; dsv3_fused_a_gemm), and GLM-5.2's ``_low_latency_table()`` returns None off
    the sm_100-family capabilities it lists (deepseek_v32/nvidia/glm52_low_latency_gemm.py)."""
    if arch >= 90:
        return
    path = module_path("vllm.model_executor.models.deepseek_v2")
    text = open(path).read() if path else ""
    m = re.search(r"self\._use_min_latency_gemm = \(\n(?:[^\n]*\n){0,5}?\s*and current_platform\.is_cuda\(\)\n"
                  r"\s*and \(\n\s*current_platform\.is_device_capability\(90\)\n"
                  r"\s*or current_platform\.is_device_capability_family\(100\)\n\s*\)\n\s*\)", text)
    if m:
        line = text[: m.start()].count("\n") + 1
        why = (f"self._use_min_latency_gemm needs current_platform.is_device_capability(90) or "
               f"is_device_capability_family(100) (vllm/model_executor/models/deepseek_v2.py:{line}): False on sm_8x")
        GUARD_ATTRS["_use_min_latency_gemm"] = (False, why)
        GUARD_WHY["_use_min_latency_gemm"] = why
    table = _none_below(arch, "vllm.models.deepseek_v32.nvidia.glm52_low_latency_gemm", "_low_latency_table")
    if table:
        GUARD_NONE["_low_latency_table"] = table
        GUARD_WHY["_low_latency_table"] = table


def _none_below(arch: int, module: str, name: str) -> Optional[str]:
    """Why ``module.name()`` returns None on sm_<arch>, or None when its source does not show it: its
    body (docstring aside) is only ``if current_platform.is_device_capability((M, m)): return X``
    statements and a final ``return None``, and no listed capability is sm_<arch>'s."""
    path = module_path(module)
    fn = next((n for n in ast.parse(open(path).read()).body if isinstance(n, ast.FunctionDef) and n.name == name),
              None) if path else None
    if fn is None:
        return None
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
        else fn.body
    if not body or ast.unparse(body[-1]) != "return None":
        return None
    caps = []
    for st in body[:-1]:
        test = ast.unparse(st.test) if isinstance(st, ast.If) else ""
        m = re.fullmatch(r"current_platform\.is_device_capability\(\((\d+), (\d+)\)\)", test)
        if not (m and not st.orelse and len(st.body) == 1 and isinstance(st.body[0], ast.Return)):
            return None
        caps.append((int(m.group(1)), int(m.group(2))))
    if (arch // 10, arch % 10) in caps:
        return None
    rel = "vllm/" + path.split("/vllm/", 1)[-1]
    return (f"{name}() returns None unless the capability is "
            f"{' or '.join(f'{a}.{b}' for a, b in caps)} ({rel}:{fn.lineno})")


def _derived_false(module: str) -> Dict[str, str]:
    """Functions of ``module`` that return False on sm_8x, read from source: a body (docstring
    aside) that is one ``return a and b and ...`` with a term known False there (GUARD_VALUES, or
    another function of the module found so, to a fixpoint). name -> why."""
    path = module_path(module)
    if not path:
        return {}
    funcs = {n.name: n for n in ast.parse(open(path).read()).body if isinstance(n, ast.FunctionDef)}
    rel = "vllm/" + path.split("/vllm/", 1)[-1]
    out: Dict[str, str] = {}
    chain: Dict[str, List[str]] = {}
    changed = True
    while changed:
        changed = False
        for name, fn in funcs.items():
            body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
            if name in out or len(body) != 1 or not isinstance(body[0], ast.Return):
                continue
            ret = body[0].value
            if not (isinstance(ret, ast.BoolOp) and isinstance(ret.op, ast.And)):
                continue
            for term in ret.values:
                f = term.func if isinstance(term, ast.Call) else None
                called = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else None)
                if called in out or (called in GUARD_VALUES and GUARD_VALUES[called] is False):
                    chain[name] = [f"{name}() ({rel}:{fn.lineno})"] + chain.get(called, [ast.unparse(term)[:80]])
                    out[name] = " needs ".join(chain[name]) + ": False on sm_8x"
                    changed = True
                    break
    return out


# Modules whose sm_100-only predicates gate serve-path calls (``_derived_false``): vLLM 0.34's fused
# MQA + top-k prefill kernel (use_fused_mqa_topk -> fused_mqa_topk_available -> capability family 100).
_DERIVED_FALSE_MODULES = ("vllm.model_executor.kernels.attention.dsa.fused_mqa_topk",)


def _cooperative_topk_gate() -> Optional[str]:
    """Why ``SparseIndexerTopk.resolve_backend`` never returns "cooperative" below sm_90, read from
    vLLM's layers/indexer_topk.py, or None when its source no longer says so: ``_cooperative_capable``
    needs ``has_device_capability(90)``; ``_cooperative_constraints`` fails when not capable; auto
    picks "cooperative" only when there are no failures, an explicit "cooperative" raises on them."""
    path = module_path("vllm.model_executor.layers.indexer_topk")
    if not path:
        return None
    tree = ast.parse(open(path).read())
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SparseIndexerTopk"), None)
    if cls is None:
        return None
    meth = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    need = ("__init__", "resolve_backend", "_resolve_auto", "_cooperative_constraints")
    if any(k not in meth for k in need):
        return None
    cap = [a for a in ast.walk(meth["__init__"]) if isinstance(a, ast.Assign)
           and ast.unparse(a.targets[0]) == "self._cooperative_capable" and "has_device_capability(90)" in ast.unparse(a.value)]
    fails = [i for i in ast.walk(meth["_cooperative_constraints"]) if isinstance(i, ast.If)
             and "not self._cooperative_capable" in ast.unparse(i.test) and "failures.append" in ast.unparse(i.body[0])]
    auto = [i for i in ast.walk(meth["_resolve_auto"]) if isinstance(i, ast.If)
            and ast.unparse(i.test).startswith("not self._cooperative_constraints(")
            and ast.unparse(i.body[0]) == "return 'cooperative'"]
    rets_coop = [r for r in ast.walk(meth["_resolve_auto"]) if isinstance(r, ast.Return)
                 and isinstance(r.value, ast.Constant) and r.value.value == "cooperative"]
    rb = ast.unparse(meth["resolve_backend"])
    explicit = ("failures = self._cooperative_constraints(" in rb and "if failures:\n    raise" in rb.replace("        ", "    ")
                or ("if failures:" in rb and "raise RuntimeError" in rb and "self._cooperative_constraints(" in rb))
    if not (cap and fails and len(auto) == 1 and len(rets_coop) == 1 and explicit):
        return None
    return (f"SparseIndexerTopk.resolve_backend never returns 'cooperative' below sm_90 "
            f"(vllm/model_executor/layers/indexer_topk.py: _cooperative_capable needs has_device_capability(90) "
            f":{cap[0].lineno}; _cooperative_constraints fails without it :{fails[0].lineno}; auto picks it only "
            f"with no failures :{auto[0].lineno}; an explicit 'cooperative' raises on failures "
            f":{meth['resolve_backend'].lineno})")


def deep_gemm_kernel_names() -> Dict[str, Tuple[str, str]]:
    """``vllm.utils.deep_gemm.<name>`` -> ('DeepGEMM', name) for every wrapper that launches a
    DeepGEMM device kernel: it calls ``_lazy_init()`` and then a vendored ``_*_impl`` function."""
    path = module_path("vllm.utils.deep_gemm")
    out: Dict[str, Tuple[str, str]] = {}
    if not path:
        return out
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if "_lazy_init" in names and any(n.startswith("_") and n.endswith("_impl") for n in names):
            out[f"vllm.utils.deep_gemm.{node.name}"] = ("DeepGEMM", node.name)
    return out


def index_module(name: str, lib_names: Dict[str, Tuple[str, str]]) -> Optional[ModuleIndex]:
    path = module_path(name)
    if not path:
        return None
    idx = ModuleIndex(name, path)
    tree = ast.parse(open(path).read(), filename=path)
    _Visitor(idx, os.path.basename(path) == "__init__.py", lib_names).visit(tree)
    return idx


def closure(roots: Iterable[str], lib_names: Dict[str, Tuple[str, str]]) -> Dict[str, ModuleIndex]:
    """Every followed module reachable from ``roots`` through imports (module level or not)."""
    out: Dict[str, ModuleIndex] = {}
    todo = [r for r in roots]
    while todo:
        name = todo.pop()
        if name in out or not followed(name):
            continue
        idx = index_module(name, lib_names)
        if idx is None:
            continue
        out[name] = idx
        todo.extend(m for m in idx.imports if m not in out and followed(m))
    return out


def _mega_moe_default() -> Optional[Tuple[bool, str]]:
    """``self.use_native_mega_moe = moe_backend in NATIVE_MEGA_MOE_BACKENDS`` (DeepseekV4MoE):
    its value on a default serve, read from vLLM's ``config/kernel.py`` (the set and the
    ``KernelConfig.moe_backend`` default), or None when that source no longer says it."""
    path = module_path("vllm.config.kernel")
    if not path:
        return None
    tree = ast.parse(open(path).read())
    backends, default = None, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "NATIVE_MEGA_MOE_BACKENDS"
                                                for t in node.targets):
            backends = {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        if isinstance(node, ast.ClassDef) and node.name == "KernelConfig":
            for st in node.body:
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                        and st.target.id == "moe_backend" and isinstance(st.value, ast.Constant)):
                    default = st.value.value
    if backends is None or default is None:
        return None
    value = default in backends
    return value, (f"use_native_mega_moe = moe_backend in NATIVE_MEGA_MOE_BACKENDS {sorted(backends)}; "
                   f"KernelConfig.moe_backend defaults to {default!r} (vllm/config/kernel.py), so it is "
                   f"{value} unless --kernel-config moe_backend=... opts in")


def _capability_gates(path: str, classes: Set[str]) -> Dict[str, Tuple[int, int]]:
    """class -> (minimum major*10+minor its ``is_supported`` checks, line) for the classes of
    ``path`` whose ``is_supported`` requires ``has_device_capability(N)`` /
    ``is_device_capability_family(N)`` (the source text, read with ast)."""
    import re

    out: Dict[str, Tuple[int, int]] = {}
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for st in node.body:
                if isinstance(st, ast.FunctionDef) and st.name == "is_supported":
                    caps = [(int(m.group(2)), c.lineno) for c in ast.walk(st) if isinstance(c, ast.Call)
                            for m in [re.fullmatch(r".*\.(has_device_capability|is_device_capability_family)"
                                                   r"\((\d+)\)", ast.unparse(c))] if m]
                    if caps:
                        out[node.name] = min(caps)
    return out


def _mxfp8_fuse_default(arch: int = 80) -> Optional[Tuple[bool, str]]:
    """V4.1 ``can_fuse_query_quant(linears)`` (common/ops/query_quant.py) is True only when every
    linear runs one of the MXFP8 kernel classes it names (imported inside it: FlashInfer's, and from
    vLLM 0.34 the torch ``_scaled_mm`` one); when each named class's ``is_supported`` requires a
    capability above ``arch``, the predicate is False on sm_<arch>. Read from source; None when the
    source no longer says so."""
    qpath = module_path("vllm.models.deepseek_v41.common.ops.query_quant")
    if not qpath:
        return None
    fn = next((n for n in ast.parse(open(qpath).read()).body
               if isinstance(n, ast.FunctionDef) and n.name == "can_fuse_query_quant"), None)
    if fn is None or not isinstance(fn.body[-1], ast.Return) or not isinstance(fn.body[-1].value, ast.Call) \
            or ast.unparse(fn.body[-1].value.func) != "all":
        return None
    named = {n.id for n in ast.walk(fn.body[-1]) if isinstance(n, ast.Name) and n.id.endswith("LinearKernel")}
    where = {a.asname or a.name: imp.module for imp in ast.walk(fn) if isinstance(imp, ast.ImportFrom)
             for a in imp.names if imp.module}
    if not named or not named <= set(where):
        return None
    gates: Dict[str, Tuple[int, int, str]] = {}
    for module in sorted({where[c] for c in named}):
        kpath = module_path(module)
        if not kpath:
            return None
        for cls, (cap, line) in _capability_gates(kpath, {c for c in named if where[c] == module}).items():
            gates[cls] = (cap, line, kpath)
    if set(gates) != named or any(cap <= arch for cap, _, _ in gates.values()):
        return None
    rel = lambda p: "vllm/" + p.split("/vllm/", 1)[-1]  # noqa: E731
    return False, (f"can_fuse_query_quant() ({rel(qpath)}:{fn.lineno}) requires every linear to run "
                   + " or ".join(f"{c} (is_supported needs capability >= {cap // 10}.{cap % 10} on CUDA, "
                                 f"{rel(path)}:{line})" for c, (cap, line, path) in sorted(gates.items()))
                   + ": False on sm_8x")


def init_guards(arch: int = 80) -> None:
    _v32_capability_guards(arch)
    if arch < 90:
        for module in _DERIVED_FALSE_MODULES:
            for name, why in _derived_false(module).items():
                GUARD_VALUES[name] = False
                GUARD_WHY[name] = why
    got = _mega_moe_default()
    if got is not None:
        GUARD_ATTRS["use_native_mega_moe"] = got
        GUARD_WHY["use_native_mega_moe"] = got[1]
    coop = _cooperative_topk_gate() if arch < 90 else None
    if coop:
        GUARD_RESULTS["resolve_backend"] = (frozenset({"cooperative"}), coop)
        GUARD_WHY["resolve_backend"] = coop
    fuse = _mxfp8_fuse_default(arch)
    if fuse is not None:
        GUARD_VALUES["can_fuse_query_quant"] = fuse[0]
        GUARD_WHY["can_fuse_query_quant"] = fuse[1]
        # DeepseekV4Attention._can_fuse_query_quant (deepseek_v41/attention.py) returns exactly
        # can_fuse_query_quant(linears): the same value, when its source still says so.
        apath = module_path("vllm.models.deepseek_v41.attention")
        for n in ast.walk(ast.parse(open(apath).read())) if apath else ():
            if (isinstance(n, ast.FunctionDef) and n.name == "_can_fuse_query_quant"
                    and isinstance(n.body[-1], ast.Return) and isinstance(n.body[-1].value, ast.Call)
                    and ast.unparse(n.body[-1].value.func) == "can_fuse_query_quant"):
                GUARD_ATTRS["_can_fuse_query_quant"] = (fuse[0], fuse[1])
                GUARD_WHY["_can_fuse_query_quant"] = (
                    f"self._can_fuse_query_quant returns can_fuse_query_quant(...) "
                    f"(vllm/models/deepseek_v41/attention.py:{n.lineno}); " + fuse[1])


_VLLM_TEXT: List[str] = []


def called_anywhere_in_vllm(name: str) -> bool:
    """Whether any vLLM source file outside other platforms' modules (EXCLUDE_PARTS) calls
    ``name(`` (its ``def`` aside): a function that nothing there calls is not on the NVIDIA serve
    path, whatever scope the audit follows."""
    import re

    if not _VLLM_TEXT:
        root = os.path.dirname(module_path("vllm") or "")
        for dirpath, _dirs, files in os.walk(root):
            for fn in files:
                dotted = os.path.relpath(os.path.join(dirpath, fn), os.path.dirname(root)).replace(os.sep, ".")
                if fn.endswith(".py") and not any(x in dotted for x in EXCLUDE_PARTS):  # other platforms
                    try:
                        with open(os.path.join(dirpath, fn), encoding="utf-8", errors="replace") as f:
                            _VLLM_TEXT.append(f.read())
                    except OSError:
                        pass
    call = re.compile(rf"(?<![\w]){re.escape(name)}\s*\(")
    define = re.compile(rf"def\s+{re.escape(name)}\s*\(")
    return any(len(call.findall(t)) > len(define.findall(t)) for t in _VLLM_TEXT if name in t)
