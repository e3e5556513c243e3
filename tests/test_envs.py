"""dsv4_ops.envs is the one home of the DSV4_AMPERE_* knobs: no other module of the package spells
a knob's name or reads / writes os.environ for one (checked on the source, AST), each knob is
read somewhere, and the declarations behave (defaults parse, bad values raise naming the knob,
overrides leave os.environ alone and are undone)."""

import ast
import os
import pathlib

import pytest

from dsv4_ops import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = [p for folder in ("dsv4_ops", "csrc_triton", "registration") for p in sorted((ROOT / folder).rglob("*.py"))]
ENVS = ROOT / "dsv4_ops" / "envs.py"
# The recorded-launch-plan cache keys on the values of whatever variables a recording read (it
# learns their names at run time and reads them from the raw environ dict): a key, not a knob.
RAW_ENV_READERS = {"dsv4_ops/_host_plan.py"}
# Constants of other modules that name a variable that is not ours (vLLM's VLLM_PP_LAYER_PARTITION).
FOREIGN_ENV_CONSTANTS = {"pp_partition.ENV_VAR", "serve_host.SAMPLER_ENV"}


def _docstrings(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _rel(path):
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", [p for p in PACKAGE if p != ENVS], ids=_rel)
def test_no_module_but_envs_spells_a_knob(path):
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            assert envs.PREFIX not in node.value, (
                f"{_rel(path)}:{node.lineno}: the string {node.value!r} names a DSV4_AMPERE_* variable; "
                "use the constant of dsv4_ops.envs")


def _is_environ(node):
    return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", None) == "os"


def _computed_env_reads(tree):
    """Lines that read or write an environment variable whose name is neither a string literal nor a
    module constant bound to one (e.g. vLLM's VLLM_PP_LAYER_PARTITION): os.environ.get / pop /
    setdefault (name), os.environ[name], os.getenv / putenv / unsetenv (name)."""
    literal = {t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
               and isinstance(node.value.value, str) for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) or \
                    (f.attr in ("getenv", "putenv", "unsetenv") and getattr(f.value, "id", None) == "os"):
                arg = node.args[0] if node.args else ast.Name("?")
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            arg = node.slice
        if arg is not None and not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)) \
                and not (isinstance(arg, ast.Name) and arg.id in literal) \
                and not (isinstance(arg, ast.Attribute) and ast.unparse(arg) in FOREIGN_ENV_CONSTANTS):
            yield node.lineno


@pytest.mark.parametrize("path", [p for p in PACKAGE if p != ENVS], ids=_rel)
def test_env_reads_name_their_variable(path):
    """Outside envs.py, an environment access names a literal variable (never a knob: the test
    above), so no knob is read or written around envs; the plan cache's raw reads are the exception."""
    if _rel(path) in RAW_ENV_READERS:
        return
    lines = list(_computed_env_reads(ast.parse(path.read_text())))
    assert not lines, f"{_rel(path)}: lines {lines} access an environment variable by a computed name"


def test_the_checks_see_planted_reads():
    tree = ast.parse("import os\nX = os.environ.get(NAME)\nos.environ[NAME] = '1'\nY = os.getenv(N)\n"
                     "Z = os.environ.get('TRITON_INTERPRET')\nV = 'VLLM_X'\nW = os.environ.get(V)\n")
    assert list(_computed_env_reads(tree)) == [2, 3, 4]
    planted = ast.parse('"""Mentions DSV4_AMPERE_IMPL in a docstring."""\nV = "DSV4_AMPERE_IMPL"\n')
    docs = _docstrings(planted)
    found = [n.value for n in ast.walk(planted) if isinstance(n, ast.Constant) and id(n) not in docs]
    assert found == ["DSV4_AMPERE_IMPL"]


def test_every_knob_is_read_somewhere():
    text = "\n".join(p.read_text() for p in PACKAGE if p != ENVS)
    constants = {name: const for const, name in vars(envs).items() if isinstance(name, str) and name in envs.KNOBS}
    assert set(constants) == set(envs.KNOBS), "every knob has a module constant"
    for name, const in constants.items():
        assert f"envs.{const}" in text, f"{name} is declared but no module reads it"


def test_defaults_parse_and_bad_values_name_the_knob(monkeypatch):
    for name, knob in envs.KNOBS.items():
        monkeypatch.delenv(name, raising=False)
        knob.parse(knob.default)
        assert envs.raw(name) == knob.default and not envs.is_set(name)
    for name, bad in ((envs.IMPL, "fast"), (envs.DECODE_KERNEL, "v9"), (envs.SMS, "0"), (envs.SMS, "x")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            envs.get(name)
    with pytest.raises(KeyError):
        envs.get("DSV4_AMPERE_NOT_A_KNOB")


def test_override_leaves_os_environ_alone_and_is_undone(monkeypatch):
    monkeypatch.setenv(envs.IMPL, "native")
    before = dict(os.environ)
    assert envs.override_key() == ()
    with envs.override(**{envs.IMPL: "portable", envs.DECODE_KERNEL: "heads"}):
        assert envs.get(envs.IMPL) == "portable" and envs.get(envs.DECODE_KERNEL) == "heads"
        assert dict(os.environ) == before
        key = envs.override_key()
        with envs.override(**{envs.IMPL: "native"}):
            assert envs.override_key() != key  # a different override is a different plan-cache key
        assert envs.override_key() == key
    assert envs.get(envs.IMPL) == "native" and envs.override_key() == ()
    with pytest.raises(ValueError, match=envs.DECODE_KERNEL):
        with envs.override(**{envs.DECODE_KERNEL: "v9"}):
            pass
    assert envs.override_key() == ()


def test_markdown_table_lists_every_knob_once():
    table = envs.markdown_table()
    for name in envs.KNOBS:
        assert table.count(f"`{name}`") == 1
    assert len(table.splitlines()) == len(envs.KNOBS) + 2
