"""``dsv4-ops audit-vllm --against <vLLM wheel or source tree>``: what a vLLM that is not installed
breaks, before anyone installs it.

A wheel is unpacked to a temporary directory (a source tree is read where it is); a subprocess
with that directory first on ``PYTHONPATH`` (same torch, Triton and the rest of this
environment) then

1. checks the patch table of the release whose evidence applies (``_scope.evidence_release``:
   the tree's own release when it is supported, else ``versions.NEWEST_DIFFED``) against the
   tree: every signature, attribute read and by-name import that no longer matches
   (``plugin.table_problems`` over all of the tree's source);
2. runs the audit on it (same worker, same evidence rules; the tree's own kernels compiled for
   sm_<arch>) for its open rows;

and the kernels of every row are compared with the inventory recorded for that release
(``inventory/<release>.json``: model, path, phase, kernel and call site -> the kernel's source
sha): a kernel the release did not have is *new*, one whose source differs is *changed*. Those
are what a reader has to look at even where the audit already decided them (a new kernel that an
existing name rule puts off the path, a changed kernel that still compiles).

The inventory of a supported release is written by ``python -m dsv4_ops.vllm.audit._against
--record`` with that release installed; a test keeps it equal to what the audit finds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import ALL_MODELS, AuditError, AuditResult, Row, _result, format_table, run, summary_line

INVENTORY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inventory")
_MARKER = "\n@@AGAINST@@"


# ------------------------------------------------------------------ the kernel inventory

def inventory_key(r: Row) -> str:
    return f"{r.model}|{r.path}|{r.phase}|{r.kernel}|{r.site}"


def inventory(res: AuditResult) -> Dict[str, str]:
    """Every row's kernel and call site (no line numbers) -> its source sha."""
    return {inventory_key(r): r.source for r in sorted(res.rows, key=inventory_key)}


def inventory_path(release: str) -> str:
    return os.path.join(INVENTORY_DIR, f"{release}.json")


def load_inventory(release: str) -> Optional[dict]:
    try:
        with open(inventory_path(release)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def record_inventory(res: AuditResult, release: str) -> str:
    """Write the inventory of ``res`` (an audit of every model on vLLM ``release``)."""
    os.makedirs(INVENTORY_DIR, exist_ok=True)
    path = inventory_path(release)
    with open(path, "w") as f:
        json.dump({"vllm": release, "arch": res.arch, "models": sorted({r.model for r in res.rows}),
                   "kernels": inventory(res)}, f, indent=0, sort_keys=True)
        f.write("\n")
    return path


@dataclass
class KernelDiff:
    new: List[Row] = field(default_factory=list)
    changed: List[Row] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.new or self.changed)


def diff_inventory(res: AuditResult, recorded: Dict[str, str], models: Sequence[str]) -> KernelDiff:
    """Rows of ``res`` whose kernel (at that call site) ``recorded`` does not have, or has with
    other source; and the recorded keys of ``models`` that ``res`` no longer has."""
    out = KernelDiff()
    seen = set()
    for r in sorted(res.rows, key=inventory_key):
        key = inventory_key(r)
        if key in seen:
            continue
        seen.add(key)
        if key not in recorded:
            out.new.append(r)
        elif recorded[key] != r.source:
            out.changed.append(r)
    out.removed = sorted(k for k in recorded if k.split("|", 1)[0] in models and k not in seen)
    return out


# ------------------------------------------------------------------ the tree

def unpack(path: str) -> Tuple[str, Optional[str]]:
    """(directory holding the ``vllm`` package, temporary directory to remove or None)."""
    path = os.path.abspath(path)
    if os.path.isfile(path) and path.endswith(".whl"):
        tmp = tempfile.mkdtemp(prefix="dsv4-against-")
        with zipfile.ZipFile(path) as z:
            z.extractall(tmp)
        return tmp, tmp
    if os.path.isfile(os.path.join(path, "vllm", "__init__.py")):
        return path, None
    if os.path.basename(path) == "vllm" and os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.dirname(path), None
    raise AuditError(f"{path} is neither a vLLM wheel (.whl) nor a directory holding the vllm package "
                     f"(vllm/__init__.py)")


@dataclass
class Report:
    target: str
    vllm: str
    release: str                 # whose table, evidence and inventory it was read with
    table_rows: int
    table: List[str]
    result: AuditResult
    models: Tuple[str, ...]
    kernels: KernelDiff
    recorded: bool               # an inventory was recorded for ``release``

    @property
    def found(self) -> bool:
        return bool(self.table or self.result.open_rows() or self.kernels)


def against(path: str, models: Sequence[str] = ALL_MODELS, arch: int = 80, timeout: float = 7200,
            env: Optional[dict] = None) -> Report:
    """Check the patch table, audit and diff the kernels of the vLLM at ``path`` (a wheel or a
    source tree), in a subprocess that imports it instead of the installed vLLM."""
    root, tmp = unpack(path)
    try:
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "dsv4_ops.vllm.audit._against", "--root", root, "--models", ",".join(models),
               "--arch", str(arch)] + (["--no-cache"] if tmp else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or _MARKER not in proc.stdout:
            raise AuditError(f"audit-vllm --against {path} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        data = json.loads(proc.stdout.rsplit(_MARKER, 1)[1])
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    res = _result(data["audit"])
    recorded = load_inventory(data["release"])
    kernels = diff_inventory(res, (recorded or {}).get("kernels", {}), models)
    return Report(path, data["vllm"], data["release"], data["table_rows"], data["table"], res, tuple(models),
                  kernels, recorded is not None)


def _probe(root: str, models: Sequence[str], arch: int, cache: bool) -> dict:
    """In the subprocess: the table check and the audit of the tree at ``root``."""
    import pathlib

    import vllm

    from .. import plugin, table
    from ..serve_graph import _scope

    here = os.path.dirname(os.path.abspath(vllm.__file__))
    if os.path.realpath(os.path.dirname(here)) != os.path.realpath(root):
        raise AuditError(f"`import vllm` found {here}, not the tree under {root}")
    version = _scope.source_version() or "unknown"
    release = _scope.evidence_release(version)
    rows = table.patches(release)
    problems = plugin.table_problems(rows, root=pathlib.Path(here), scan_source=True)
    res = (run(tuple(models), arch=arch, cache="auto" if cache else None) if models
           else AuditResult(version, arch, [], []))
    return {"vllm": version, "release": release, "table_rows": len(rows), "table": problems,
            "audit": {"vllm": res.vllm, "arch": res.arch, "rows": [r.__dict__ for r in res.rows], "notes": res.notes}}


# ------------------------------------------------------------------ the report

def format_report(rep: Report, details: bool = False) -> str:
    res, kd = rep.result, rep.kernels
    out = [f"vLLM {rep.vllm} from {rep.target} (not installed), read with the patch table, evidence and kernel "
           f"inventory of vLLM {rep.release}"]
    out.append(f"\n== patch table ({rep.table_rows} rows of vLLM {rep.release}): "
               f"{len(rep.table)} no longer match" + ("" if rep.table else " (none)"))
    out += [f"- {p}" for p in rep.table]
    if rep.models:
        opened = res.open_rows()
        out.append(f"\n== audit, sm_{res.arch}: {summary_line(res)}")
        out.append(f"open rows: {len(opened)}" + ("" if opened else " (none)"))
        out += [f"- {r.ident} ({r.location}): {r.status}: {r.evidence[:220]}" for r in opened]
        if not rep.recorded:
            out.append(f"\n== kernels: no inventory recorded for vLLM {rep.release} ({inventory_path(rep.release)}); "
                       "every kernel counts as new")
        out.append(f"\n== kernels versus vLLM {rep.release}: {len(kd.new)} new, {len(kd.changed)} changed source, "
                   f"{len(kd.removed)} gone (call sites of {', '.join(rep.models)})")
        for title, rows in (("new", kd.new), ("changed source", kd.changed)):
            if rows:
                out.append(f"{title}:")
                out += [f"- {r.model} {r.path} {r.phase} {r.kernel} @ {r.site}: "
                        f"{'OPEN ' if r.open else ''}{r.status}"
                        + (f" via {r.patch}" if r.patch else "") + f": {r.evidence[:160]}" for r in rows]
        if kd.removed:
            out.append("gone:")
            out += [f"- {k.replace('|', ' ', 3).replace('|', ' @ ')}" for k in kd.removed]
        if details:
            out.append(format_table(res, rep.models))
        out += [f"note: {n}" for n in res.notes]
    found = [f"{len(rep.table)} table mismatch(es)", f"{len(res.open_rows())} open row(s)",
             f"{len(kd.new)} new and {len(kd.changed)} changed kernel(s)"]
    out.append(f"\n{'FOUND' if rep.found else 'nothing found'}: " + ", ".join(found))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_ops.vllm.audit._against")
    p.add_argument("--root", help="(subprocess) the directory holding the vllm package to read")
    p.add_argument("--models", default=",".join(ALL_MODELS))
    p.add_argument("--arch", type=int, default=80)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--record", action="store_true",
                   help="write the inventory of the installed vLLM (a supported release), every model")
    a = p.parse_args(argv)
    models = tuple(m for m in a.models.split(",") if m)
    if a.record:
        from .. import versions
        from ..serve_graph import _scope

        version = _scope.source_version()
        if not versions.supported(version):
            print(f"vLLM {version} is not a supported release ({', '.join(versions.SUPPORTED)})", file=sys.stderr)
            return 2
        res = run(ALL_MODELS, arch=a.arch)
        print(record_inventory(res, versions.release(version)))
        return 0
    data = _probe(a.root, models, a.arch, cache=not a.no_cache)
    sys.stdout.write(_MARKER + json.dumps(data) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
