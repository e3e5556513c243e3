"""The vLLM plugin's logic: decide, check every assumption, then patch (sm_8x only).

``register()`` (called by vLLM in every process through the thin entry point
``dsv4_ops.registration.vllm_plugin``) is idempotent, imports vLLM lazily and logs one line.
On sm_90+ it patches nothing. On sm_8x it first refuses a vLLM release outside
``dsv4_ops.vllm.versions.SUPPORTED`` (``VllmVersionError``, naming the supported releases), then
runs ``check_table()`` over every row of the installed release's table
(``dsv4_ops.vllm.table.patches(version)``) and raises ``VllmPatchError`` naming the symbol and
the vLLM version when vLLM moved under us:
  - the symbol exists and has the parameter names the replacement was written for;
  - every attribute / dataclass field a replacement reads (``Patch.reads``) still exists;
  - call-site binding: every vLLM module that imported a patched function by name at import
    time (``from m import f`` at module level) is itself patched, or listed as a known
    non-caller (register() checks the modules imported so far; the CI test reads all of vLLM's
    source).
Then, on sm_8x only, it makes its startup choices (``startup_choices``): the safe setting where
one exists, said in its log line (vLLM's Triton sampler, ``VLLM_USE_FLASHINFER_SAMPLER=0``, when
FlashInfer's sampler JIT cannot build on this host), and ``UnauditedServePathError`` where none
does (a vLLM setting that moves the serve path off the audited kernels). Only then does it apply
the ``patch`` rows and install its hooks (``quant_guard`` checks the checkpoint's quant layout at
model build).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import pathlib
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from . import serve_host, versions
from .quant_guard import UnauditedServePathError
from .table import Patch, Reads, installed_release, patches


class VllmPatchError(RuntimeError):
    """A vLLM symbol the plugin relies on is missing, or has another signature or attributes."""


class VllmVersionError(VllmPatchError):
    """The installed vLLM is not a release the patch table was checked against."""


@dataclass
class _State:
    registered: bool = False
    capability: Optional[Tuple[int, int]] = None
    routed: bool = False
    originals: Dict[Tuple[str, str], Any] = field(default_factory=dict)
    sampler_set: bool = False            # the startup choice set VLLM_USE_FLASHINFER_SAMPLER ...
    sampler_before: Optional[str] = None  # ... which was this before

    @property
    def patched(self) -> List[str]:
        return [f"{m}.{s}" for (m, s) in self.originals]


STATE = _State()


def vllm_version() -> str:
    try:
        import vllm

        return getattr(vllm, "__version__", "unknown")
    except Exception:  # pragma: no cover
        return "not installed"


def _error(what: str) -> VllmPatchError:
    """VllmPatchError with ``.what``, the bare mismatch (``table_problems`` lists those)."""
    tested = ", ".join(versions.SUPPORTED)
    exc = VllmPatchError(f"dsv4_ops vLLM plugin: {what} in vLLM {vllm_version()} (the table is checked against "
                         f"vLLM {tested}). Update dsv4_ops or install a supported vLLM release.")
    exc.what = what
    return exc


def check_version(version: Optional[str] = None) -> str:
    """The installed vLLM's release ('X.Y.Z'); VllmVersionError unless it is supported."""
    version = vllm_version() if version is None else version
    if not versions.supported(version):
        raise VllmVersionError(f"dsv4_ops vLLM plugin (sm_8x): {versions.refusal(version)}.")
    return versions.release(version)


def _resolve(entry: Patch) -> Tuple[Any, str, Any]:
    """(owner object, attribute name, current value) of a row."""
    try:
        owner: Any = importlib.import_module(entry.module)
    except Exception as exc:
        raise _error(f"module {entry.module} does not import ({exc})") from exc
    *path, name = entry.symbol.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    if owner is None or not hasattr(owner, name):
        raise _error(f"{entry.qualname} is missing")
    return owner, name, getattr(owner, name)


def _param_names(obj: Any) -> Tuple[str, ...]:
    if not (inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj)) and callable(obj):
        return tuple(inspect.signature(type(obj).__call__).parameters)[1:]
    names = tuple(inspect.signature(obj).parameters)
    if inspect.isfunction(obj) and names and names[0] in ("self", "cls"):
        names = names[1:]
    return names


# ------------------------------------------------------------------------------ the guards

class _Mismatch(Exception):
    """One row assumption that does not hold (the text of a VllmPatchError, without the version)."""


def _resolve_or_mismatch(entry: Patch) -> Tuple[Any, str, Any]:
    try:
        return _resolve(entry)
    except VllmPatchError as exc:
        raise _Mismatch(getattr(exc, "what", str(exc))) from exc


def _signature_mismatch(entry: Patch) -> Optional[str]:
    try:
        _, _, current = _resolve_or_mismatch(entry)
    except _Mismatch as exc:
        return str(exc)
    if getattr(current, "__name__", None) in entry.placeholders:
        return None
    if getattr(current, "_dsv4_ampere_replacement", False):
        return None
    got = _param_names(current)
    if got != entry.params:
        return f"{entry.qualname} has parameters {got}; the sm_8x replacement was written for {entry.params}"
    return None


def check_signature(entry: Patch) -> None:
    problem = _signature_mismatch(entry)
    if problem:
        raise _error(problem)


def _assigned_self_attrs(cls: type) -> Set[str]:
    """Names assigned as ``self.<name> = ...`` (or annotated) in the methods of ``cls``."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return set()
    names: Set[str] = set()
    for node in ast.walk(ast.parse(src)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def class_attributes(cls: type) -> Set[str]:
    """Every attribute an instance of ``cls`` can be expected to have: dataclass fields, class
    attributes, and ``self.x =`` assignments in the methods of its vLLM (and torch) bases."""
    names: Set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        if dataclasses.is_dataclass(klass):
            names.update(f.name for f in dataclasses.fields(klass))
        names.update(vars(klass))
        names.update(_assigned_self_attrs(klass))
    return names


def _reads_mismatches(reads: Iterable[Reads]) -> List[str]:
    out = []
    for r in reads:
        try:
            cls = getattr(importlib.import_module(r.module), r.cls)
        except Exception as exc:
            out.append(f"class {r.module}.{r.cls} (whose attributes dsv4_ops reads) is missing ({exc})")
            continue
        have = class_attributes(cls)
        missing = [n for n in r.names if n not in have]
        if missing:
            out.append(f"{r.module}.{r.cls} no longer has {', '.join(missing)}, which the sm_8x replacement reads")
    return out


def check_reads(reads: Iterable[Reads]) -> None:
    problems = _reads_mismatches(reads)
    if problems:
        raise _error(problems[0])


def _vllm_root() -> pathlib.Path:
    import vllm

    return pathlib.Path(vllm.__file__).parent


def _module_level_import_froms(tree: ast.Module):
    """``from x import y`` statements that run at import time (not inside a function body:
    those bind at call time, after the plugin patched, and so do see the replacement)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ImportFrom):
            yield node
            continue
        stack.extend(ast.iter_child_nodes(node))


def _module_name(path: pathlib.Path, root: pathlib.Path) -> Tuple[str, str]:
    """(module name, package name) of a source file under the vllm package root."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    pkg = ".".join(rel.parts[:-1])
    return ".".join(parts), pkg


def _absolute(node: ast.ImportFrom, pkg: str) -> str:
    if not node.level:
        return node.module or ""
    base = pkg.split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def by_name_importers(sources: Set[str], name: str, root: Optional[pathlib.Path] = None) -> Set[str]:
    """vLLM modules with a module-level ``from S import name`` for some S in ``sources``
    (relative imports included), found by reading all of vLLM's source (text filter, then AST)."""
    root = root or _vllm_root()
    found: Set[str] = set()
    for path in root.rglob("*.py"):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if name not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        here, pkg = _module_name(path, root)
        for node in _module_level_import_froms(tree):
            if any(al.name == name and al.asname in (None, name) for al in node.names) and _absolute(node, pkg) in sources:
                found.add(here)
    return found


def _uses_name(module: str, name: str, root: Optional[pathlib.Path] = None) -> bool:
    """True when ``module``'s source reads ``name`` outside import statements (a caller, not
    a re-export). Unknown source counts as a use."""
    root = root or _vllm_root()
    rel = pathlib.Path(*module.split(".")[1:])
    for path in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if path.exists():
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                       for n in ast.walk(tree))
    return True


# vLLM packages of other platforms: never imported on the NVIDIA path the plugin patches.
_OTHER_PLATFORMS = (".amd.", ".rocm", "rocm_", ".xpu", ".tpu", ".cpu.")


def _other_platform(module: str) -> bool:
    return any(tag in module + "." for tag in _OTHER_PLATFORMS)


def _aliases(name: str, original: Any) -> Set[str]:
    """Imported vLLM modules whose global ``name`` is ``original`` (by identity)."""
    import sys

    return {m for m, mod in list(sys.modules.items())
            if m.startswith("vllm") and mod is not None and getattr(mod, "__dict__", {}).get(name) is original}


def call_site_problems(rows: Tuple[Patch, ...], root: Optional[pathlib.Path] = None,
                       scan_source: bool = True) -> List[str]:
    """Every vLLM module that binds the original of a patched module-level function at import
    time, and calls it, is patched too (or listed in the row's ``known_non_callers``).

    The original's bindings are found by identity among the imported modules; with
    scan_source, also every module of vLLM's source that imports it by name from one of
    those (imported or not; ~10 s). The defining module, pure re-exports (packages that
    import the name without reading it) and other platforms' packages (AMD, XPU, ...) are not
    callers on NVIDIA. Returns one line per binding that breaks the rule.
    """
    patched = {(e.module, e.symbol) for e in rows if e.kind == "patch" and "." not in e.symbol}
    problems = []
    for e in rows:
        if e.kind != "patch" or "." in e.symbol:
            continue
        try:
            current = _resolve_or_mismatch(e)[2]
        except _Mismatch:
            continue  # reported by the row's own check
        original = STATE.originals.get((e.module, e.symbol), (None, None, current))[2]
        if getattr(original, "_dsv4_ampere_replacement", False):
            continue
        holders = _aliases(e.symbol, original) | {e.module}
        candidates = set(holders)
        if scan_source:
            candidates |= by_name_importers(holders, e.symbol, root)
        for mod in sorted(candidates):
            if (mod, e.symbol) in patched or mod in e.known_non_callers or _other_platform(mod):
                continue
            if mod == getattr(original, "__module__", None) or not _uses_name(mod, e.symbol, root):
                continue
            problems.append(f"{mod} imports {e.symbol} by name (the same object as {e.qualname})")
    return problems


def check_call_sites(rows: Tuple[Patch, ...], root: Optional[pathlib.Path] = None, scan_source: bool = True) -> None:
    """VllmPatchError when ``call_site_problems`` finds any."""
    problems = call_site_problems(rows, root, scan_source)
    if problems:
        raise _error("; ".join(problems) + ": a patch of the name would not reach those calls (add a row for each, "
                     "or list it in the row's known_non_callers)")


def table_problems(rows: Optional[Tuple[Patch, ...]] = None, root: Optional[pathlib.Path] = None,
                   scan_source: bool = True) -> List[str]:
    """Every row assumption that does not hold in the importable vLLM, one line each (a row's
    signature or a read attribute; a by-name binding no row covers). [] when the table fits."""
    rows = patches() if rows is None else rows
    problems = []
    for entry in rows:
        sig = _signature_mismatch(entry)
        problems += ([sig] if sig else []) + _reads_mismatches(entry.reads)
    return list(dict.fromkeys(problems)) + call_site_problems(rows, root, scan_source)


def check_table(rows: Optional[Tuple[Patch, ...]] = None, root: Optional[pathlib.Path] = None,
                scan_source: bool = True) -> None:
    """Raise VllmPatchError unless every assumption of every row holds in the installed vLLM.

    register() passes scan_source=False (by-name bindings among the imported modules only);
    the CI test scans the whole source tree.
    """
    problems = table_problems(rows, root, scan_source)
    if problems:
        raise _error("; ".join(problems))


# ------------------------------------------------------------------------------- apply

def apply_patches(rows: Optional[Tuple[Patch, ...]] = None) -> List[str]:
    """Set every ``patch`` row (idempotent); returns the names patched now."""
    rows = patches() if rows is None else rows
    done = []
    for entry in rows:
        if entry.kind != "patch":
            continue
        key = (entry.module, entry.symbol)
        if key in STATE.originals:
            continue
        owner, name, current = _resolve(entry)
        raw = owner.__dict__[name] if isinstance(owner, type) else current
        new = entry.replacement(current) if entry.wraps else entry.replacement
        try:
            (new.__func__ if isinstance(new, classmethod) else new)._dsv4_ampere_replacement = True
        except AttributeError:
            pass
        setattr(owner, name, new)
        STATE.originals[key] = (owner, name, raw)
        done.append(entry.qualname)
    return done


def unpatch() -> None:
    """Restore every original (tests; and a process that wants vLLM's own kernels back)."""
    for owner, name, raw in STATE.originals.values():
        setattr(owner, name, raw)
    STATE.originals.clear()
    from . import quant_guard, v32_backend

    v32_backend.uninstall()
    quant_guard.uninstall()


def reset() -> None:
    """Unpatch, restore the environment variables register() set, and forget that it ran (tests)."""
    unpatch()
    if STATE.sampler_set:
        if STATE.sampler_before is None:
            os.environ.pop(serve_host.SAMPLER_ENV, None)
        else:
            os.environ[serve_host.SAMPLER_ENV] = STATE.sampler_before
    STATE.sampler_set, STATE.sampler_before = False, None
    STATE.registered = False
    STATE.capability = None
    STATE.routed = False


def _capability() -> Optional[Tuple[int, int]]:
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    return None if cap is None else (int(cap[0]), int(cap[1]))


def decide(capability: Optional[Tuple[int, int]]) -> Tuple[bool, str]:
    """(route to dsv4_ops?, reason) from the capability and DSV4_AMPERE_IMPL."""
    from dsv4_ops import dispatch

    forced = dispatch.impl_override()
    if capability is None:
        if forced != "auto":
            return True, f"no GPU capability, {dispatch.ENV_VAR}={forced} forces the dsv4_ops path"
        return False, "no GPU capability: nothing to patch"
    variant = dispatch.table_variant(capability) or "unsupported"
    if dispatch.routes_to_dsv4_ops(capability):
        how = f"{dispatch.ENV_VAR}={forced}" if forced != "auto" else f"op table: {variant}"
        return True, f"{how} -> dsv4_ops kernels ({dispatch.kernel_variant(capability)})"
    return False, f"op table: {variant} -> vLLM keeps its own kernels"


def startup_choices(environ=None, toolchain: Optional[serve_host.Toolchain] = None,
                    torch_cuda: Optional[str] = None) -> List[str]:
    """The plugin's own choices on sm_8x, made before vLLM reads the settings (log phrases).

    The sampler: vLLM reads ``VLLM_USE_FLASHINFER_SAMPLER`` when a worker's model runner
    builds its sampler (``flashinfer_sampler_supported``), after every process loaded the
    plugin and before ``enable_envs_cache``; a variable set here is inherited by the workers
    this process starts and set again by each worker's own ``register()``. Raises
    UnauditedServePathError for a setting with no safe choice."""
    env = os.environ if environ is None else environ
    problems = serve_host.kernel_setting_problems(env)
    if problems:
        raise UnauditedServePathError("dsv4_ops (sm_8x): " + "; ".join(problems) + ". Refused at startup.")
    choice = serve_host.sampler_env_choice(env)
    if choice is False:
        return [f"sampler: Triton ({serve_host.SAMPLER_ENV}=0 as set)"]
    if toolchain is None:
        toolchain = serve_host.read_toolchain()
    if torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    jit = serve_host.jit_problems(toolchain, torch_cuda)
    if not jit:
        return [f"sampler: FlashInfer (its JIT can build: nvcc {toolchain.nvcc_release} at {toolchain.nvcc})"]
    if choice is True:
        raise UnauditedServePathError(
            f"dsv4_ops (sm_8x): {serve_host.SAMPLER_ENV}=1 asks for FlashInfer's sampler, but its JIT cannot build "
            f"here ({'; '.join(jit)}): vLLM's profile run would fail on every worker. Install a CUDA "
            f"{(torch_cuda or '13').split('.')[0]} toolkit and set CUDA_HOME, or set {serve_host.SAMPLER_ENV}=0.")
    env[serve_host.SAMPLER_ENV] = "0"
    return [f"sampler: Triton, set {serve_host.SAMPLER_ENV}=0 (FlashInfer's sampler JIT cannot build here: "
            f"{jit[0]}; a CUDA toolkit of torch's major at CUDA_HOME brings it back)"]


def register() -> None:
    """vLLM general-plugin entry point; idempotent, imports vLLM lazily, logs one line."""
    if STATE.registered:
        return
    from vllm.logger import init_logger

    logger = init_logger("vllm.plugins.dsv4_ops")
    cap = _capability()
    routed, reason = decide(cap)
    done: List[str] = []
    choices: List[str] = []
    if routed:
        from . import quant_guard, v32_backend

        rows = patches(check_version())
        check_table(rows, scan_source=False)
        v32_backend.check_registration(_error)  # the sm_8x sparse-MLA backend (V3.2 / GLM-5), checked first
        if cap is not None and cap[0] == 8:
            before = os.environ.get(serve_host.SAMPLER_ENV)
            choices = startup_choices()
            if os.environ.get(serve_host.SAMPLER_ENV) != before:
                STATE.sampler_set, STATE.sampler_before = True, before
        done = apply_patches(rows)
        done += v32_backend.install()
        done += quant_guard.install()
    STATE.registered, STATE.capability, STATE.routed = True, cap, routed
    cap_s = f"sm_{cap[0]}{cap[1]}" if cap else "none"
    what = (f"patched {len(done)} vLLM symbols: " + ", ".join(p.rsplit(".", 1)[-1] for p in done)
            if done else "patched nothing")
    line = (f"dsv4_ops plugin (pid {os.getpid()}): capability {cap_s}; {reason}; {what}"
            + "".join(f"; {c}" for c in choices))
    if logger.hasHandlers():
        logger.info("%s", line)
    else:
        # vLLM loads general plugins in EngineArgs.__post_init__, before LLM() configures its
        # logging: an INFO record would be dropped there, and this line is the user's only word
        # of what was routed, so it goes to stderr itself.
        print(f"INFO {line}", file=sys.stderr, flush=True)
