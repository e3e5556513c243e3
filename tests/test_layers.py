"""The import graph points one way: base < kernels < launchers + references < registration <
composites + vLLM integration < tools. Read from the source (AST), so it needs no GPU and
fails on the first upward arrow, naming it."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Installed module name -> repository folder (setup.py's package_dir).
FOLDERS = {"dsv4_ops": ROOT / "dsv4_ops", "dsv4_ops.csrc_triton": ROOT / "csrc_triton",
           "dsv4_ops.registration": ROOT / "registration"}

BASE, KERNELS, LAUNCHERS, REGISTRATION, INTEGRATION, TOOLS = range(6)
LAYER_NAMES = ("base", "kernels", "launchers", "registration", "integration", "tools")
TOOL_MODULES = {"dsv4_ops.tools.cli", "dsv4_ops.__main__", "dsv4_ops.tools.selftest", "dsv4_ops.testing", "dsv4_ops.support",
                "dsv4_ops.__init__", "dsv4_ops.tools.doctor"}  # doctor: a command; it asks the vLLM integration


def layer_of(module: str) -> int:
    if module == "dsv4_ops.layout":
        return BASE
    if module.startswith("dsv4_ops.csrc_triton"):
        return KERNELS
    if module == "dsv4_ops.registration.vllm_plugin":
        return TOOLS  # the vLLM entry point sits on top of the integration it forwards to
    if module.startswith("dsv4_ops.registration"):
        return REGISTRATION
    if module.startswith("dsv4_ops.vllm") or module == "dsv4_ops.dsv4_decode":
        return INTEGRATION
    if module in TOOL_MODULES or module.startswith("dsv4_ops.tools"):
        return TOOLS
    return LAUNCHERS


def modules():
    for pkg, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            if pkg == "dsv4_ops" and path.relative_to(folder).parts[0] in ("csrc_triton", "registration"):
                continue
            rel = path.relative_to(folder).with_suffix("").parts
            name = ".".join((pkg,) + rel)
            yield (name if not name.endswith(".__init__") or name == "dsv4_ops.__init__" else name[:-9]), path


def imports_of(name: str, path: pathlib.Path):
    """Absolute dsv4_ops module names imported by a file (module level and inside functions)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    pkg = name if is_pkg else name.rsplit(".", 1)[0]
    if name == "dsv4_ops.__init__":
        pkg = "dsv4_ops"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv4_ops"):
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            if not base.startswith("dsv4_ops"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                yield (full if any(full == m for m, _ in ALL) else base), node.lineno


ALL = list(modules())
IDS = [m for m, _ in ALL]


def in_layers(*layers):
    rows = [(m, p) for m, p in ALL if layer_of(m) in layers]
    return pytest.mark.parametrize("name,path", rows, ids=[m for m, _ in rows])


@pytest.mark.parametrize("name,path", ALL, ids=IDS)
def test_imports_point_down(name, path):
    mine = layer_of(name)
    for target, line in imports_of(name, path):
        if target == "dsv4_ops":  # the package itself: its __init__ registers the ops
            assert mine >= INTEGRATION, \
                f"{path.name}:{line} imports the dsv4_ops package (side effects) from the {LAYER_NAMES[mine]} layer"
            continue
        theirs = layer_of(target)
        assert theirs <= mine, (f"{path.relative_to(ROOT)}:{line}: {name} ({LAYER_NAMES[mine]}) imports {target} "
                                f"({LAYER_NAMES[theirs]}), an upward arrow")


@in_layers(KERNELS)
def test_kernels_import_only_triton_and_the_base(name, path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        for m in mods:
            top = m.split(".")[0]
            assert (top in sys.stdlib_module_names or top in ("triton", "dsv4_ops")) and \
                (not m.startswith("dsv4_ops") or m == "dsv4_ops.layout" or m == "dsv4_ops"), \
                f"{path.name}:{node.lineno} imports {m}"
        if isinstance(node, ast.ImportFrom) and not node.level and node.module == "dsv4_ops":
            assert [a.name for a in node.names] == ["layout"], f"{path.name}:{node.lineno}"


@in_layers(BASE, KERNELS, LAUNCHERS)
def test_launchers_never_call_torch_ops(name, path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "ops" and getattr(node.value, "id", None) == "torch":
            pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: a {LAYER_NAMES[layer_of(name)]} module calls torch.ops")


def test_every_reference_lives_in_reference_py():
    for name, path in ALL:
        if name == "dsv4_ops.reference":
            continue
        tree = ast.parse(path.read_text())
        refs = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("ref_")]
        assert not refs, f"{path.relative_to(ROOT)} defines references {refs}; they belong in dsv4_ops/reference.py"


def test_ops_are_registered_from_the_package_init_only():
    callers = []
    for name, path in ALL:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "register_all":
                callers.append(name)
    assert callers == ["dsv4_ops.__init__"], callers


def _graph():
    """module -> {imported module: first line}, every import (module level and inside functions);
    an import of a package is an arrow to its __init__ (the package's own name here)."""
    names = {m for m, _ in ALL}
    graph = {}
    for name, path in ALL:
        edges = {}
        for target, line in imports_of(name, path):
            while target not in names and "." in target:
                target = target.rsplit(".", 1)[0]  # from pkg.mod import name -> pkg.mod
            if target in names and target != name and target != "dsv4_ops" and name != "dsv4_ops.__init__":
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    graph = _graph()
    circles = _cycles(graph)
    detail = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in c for b in c if b in graph[a]) for c in circles]
    assert not circles, "import circles (function-local imports included):\n" + "\n".join(detail)


def test_the_cycle_finder_sees_a_planted_circle():
    assert _cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_only_tools_import_the_tools_and_the_audit():
    """dsv4_ops.tools (cli, doctor, selftest) and the audit-vllm tool (dsv4_ops.vllm.audit) stand
    apart from the runtime: no runtime module imports them."""
    for name, edges in _graph().items():
        if name.startswith(("dsv4_ops.tools", "dsv4_ops.vllm.audit")) or name == "dsv4_ops.__main__":
            continue
        bad = [t for t in edges if t.startswith(("dsv4_ops.tools", "dsv4_ops.vllm.audit"))]
        assert not bad, f"{name} (runtime) imports the tool module(s) {bad}"
