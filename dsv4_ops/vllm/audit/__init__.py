"""``dsv4-ops audit-vllm``: which kernels of vLLM's DeepSeek-V4/V4.1, V3.2 and GLM-5 serve paths
run on sm_8x, which are replaced by this plugin, and which are open, decided from evidence.

The vLLM releases it is written for are ``dsv4_ops.vllm.versions.SUPPORTED``; evidence that
differs between them (launch recipes, guard regexes, the kernel inventory) is recorded per
release and read for the release being audited (``serve_graph._scope.evidence_release``).

One row per kernel use on the path (``phase`` forward: prefill/decode/profile/metadata calls;
``jit-warmup``: a registration with vLLM's JIT-warmup registry, compiled at startup):

- Triton: discovered by importing the path's modules (the import closure of
  ``<model>.nvidia.model`` plus the indexer op and metadata builders), compiled ahead of time
  for ``GPUTarget('cuda', arch, 32)`` with vLLM's own warmup compile keys (``_triton``).
- DeepGEMM / FlashMLA / deep_select: call sites found in the source (``serve_graph._source``)
  with their guards evaluated for sm_8x (``has_deep_gemm()`` is True on every install); dead
  with the library's cubin/implementation list as evidence (``_native``).
- CuTeDSL: dead when its PTX holds an E4M3 cvt (sm_89+). TileLang: unknown (see ``_paths``).
- patch: the ``dsv4_ops.vllm.table`` row through which every use of the kernel passes.

``status`` is runs / dead / unknown / off (a library call under a guard that is never taken on
sm_8x, with the guard as evidence); a row is *open* when it is on the default path, neither
``runs`` nor ``off``, and has no patch. The audit runs in a subprocess (a Triton driver that reports the
target has to be installed before vLLM is imported); its result is cached on disk per model,
keyed by the vLLM source read and this package's source, and concurrent runs (pytest-xdist
workers, ``dsv4-ops check``) wait for the one that computes a model instead of repeating it.
``--against`` (``_against``) runs it, and the patch-table check, on a vLLM that is not installed.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from .. import versions

MODELS = ("v4", "v41")  # "both": what CI audits
# Every model the audit knows: DeepSeek-V3.2 and GLM-5 audit separately (--model v32 / glm5).
ALL_MODELS = MODELS + ("v32", "glm5")
MODEL_TITLES = {"v4": "DeepSeek-V4-Flash", "v41": "DeepSeek-V4.1-Flash", "v32": "DeepSeek-V3.2",
                "glm5": "GLM-5 (GlmMoeDsaForCausalLM)"}


@dataclass(frozen=True)
class Row:
    model: str
    path: str       # default / mtp / dspark
    phase: str      # forward / jit-warmup
    kernel: str
    tech: str
    location: str
    status: str     # runs / dead / unknown / off (a call under a guard never taken on sm_8x)
    evidence: str
    patch: str      # the patch-table row that replaces it, or ''
    source: str = ""  # sha256 (16 hex) of the kernel's Python source ('' for library calls, module rows)

    @property
    def open(self) -> bool:
        return self.path == "default" and self.status not in ("runs", "off") and not self.patch

    @property
    def ident(self) -> str:
        """Stable name of a row: model, phase, kernel (what the known-open list holds)."""
        return f"{self.model}:{self.phase}:{self.kernel}"

    @property
    def site(self) -> str:
        """Where the kernel is used, without the line number (which moves every release): the
        kernel inventory's key with model, path, phase and kernel."""
        head, _, tail = self.location.rpartition(":")
        return head if tail.isdigit() else self.location


@dataclass
class AuditResult:
    vllm: str
    arch: int
    rows: List[Row]
    notes: List[str]

    def open_rows(self, model: Optional[str] = None) -> List[Row]:
        return [r for r in self.rows if r.open and (model is None or r.model == model)]


class AuditError(RuntimeError):
    """The audit could not run (no vLLM, or the worker failed)."""


def vllm_installed() -> Optional[str]:
    """vLLM's version without importing it (None when it is not installed)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("vllm")
    except PackageNotFoundError:
        return None


def cache_dir() -> str:
    return os.environ.get("DSV4_OPS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv4_ops"))


def cache_key(arch: int) -> str:
    """Everything a model's audit result depends on: the vLLM source read (its version and where
    it is, so an overlay or an ``--against`` tree is not mistaken for the installed release), the
    arch, and the source of dsv4_ops.vllm (patch table, serve graph, audit code) and of the AOT
    checker it compiles with."""
    import importlib.util

    from ..serve_graph import _scope

    spec = importlib.util.find_spec("vllm")
    h = hashlib.sha256(f"{_scope.source_version()}|{spec.origin if spec else None}|{arch}".encode())
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(pkg, "**", "*.py"), recursive=True))
    files.append(os.path.join(os.path.dirname(pkg), "aot.py"))
    for path in files:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, pkg).encode() + f.read())
    return h.hexdigest()[:16]


def cache_path(model: str, arch: int) -> str:
    """The cache file of one model's rows (``cache_key``): any set of models reuses it."""
    return os.path.join(cache_dir(), f"audit-vllm-{model}-sm{arch}-{cache_key(arch)}.json")


@contextlib.contextmanager
def _locked(paths: Sequence[str]):
    """Exclusive locks on ``paths`` (taken in sorted order, so two runs never deadlock): a second
    process that needs a model being audited waits for that result instead of repeating it."""
    import fcntl

    files = []
    try:
        for p in sorted(set(paths)):
            os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
            f = open(p, "a")
            fcntl.flock(f, fcntl.LOCK_EX)
            files.append(f)
        yield
    finally:
        for f in reversed(files):
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()


def _load(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # readers never see half a file


def run(models: Sequence[str] = MODELS, arch: int = 80, jobs: Optional[int] = None,
        cache: Optional[str] = "auto", timeout: float = 3600, modules: Sequence[str] = (),
        env: Optional[dict] = None) -> AuditResult:
    """Run the audit (in a subprocess). ``cache``: 'auto' (default) reuses and writes one file a
    model (``cache_path``), so every set of models, in any process, audits a model once per vLLM
    and source; a path: one JSON file for this set of models; None: afresh. ``timeout`` (s)
    covers a cold TileLang cache: every mHC warmup key goes through nvcc (1-2 min a key on 2
    shared cores)."""
    models = tuple(models)
    if modules or cache != "auto":
        path = None if modules else cache
        data = _load(path) if path else None
        if data is None:
            data = _worker(models, arch, jobs, timeout, modules, env)
            if path:
                _write(path, data)
        return _result(data)
    paths = {m: cache_path(m, arch) for m in models}
    got = {m: _load(p) for m, p in paths.items()}
    missing = [m for m in models if got[m] is None]
    if missing:
        with _locked([paths[m] + ".lock" for m in missing]):
            got.update({m: _load(paths[m]) for m in missing})  # another process may have written it
            missing = [m for m in models if got[m] is None]
            if missing:
                data = _worker(tuple(missing), arch, jobs, timeout, (), env)
                for m in missing:
                    got[m] = dict(data, rows=[r for r in data["rows"] if r["model"] == m])
                    _write(paths[m], got[m])
    first = got[models[0]]
    return _result(dict(first, rows=[r for m in models for r in got[m]["rows"]],
                        notes=list(dict.fromkeys(n for m in models for n in got[m].get("notes", [])))))


def _worker(models: Sequence[str], arch: int, jobs: Optional[int], timeout: float, modules: Sequence[str],
            env: Optional[dict]) -> dict:
    import importlib.util

    if env is None and importlib.util.find_spec("vllm") is None:
        raise AuditError("dsv4-ops audit-vllm needs vLLM (pip install 'dsv4-ops[vllm]'); it is not installed")
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "dsv4_ops.vllm.audit._worker", "--models", ",".join(models), "--arch", str(arch)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    if modules:
        cmd += ["--modules", ",".join(modules)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    marker = "\n@@AUDIT@@"
    if proc.returncode != 0 or marker not in proc.stdout:
        raise AuditError(f"audit worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.rsplit(marker, 1)[1])


def _result(data: dict) -> AuditResult:
    return AuditResult(data["vllm"], data["arch"], [Row(**r) for r in data["rows"]], data.get("notes", []))


def version_line(res: AuditResult) -> str:
    if not versions.supported(res.vllm):
        return (f"WARNING: vLLM {res.vllm} is not a supported release ({', '.join(versions.SUPPORTED)}); rows are "
                f"decided from its code with the evidence recorded for vLLM "
                f"{_evidence_release(res.vllm)}. Running anyway.")
    return f"vLLM {res.vllm}, target sm_{res.arch}"


def _evidence_release(version: str) -> str:
    from ..serve_graph import _scope

    return _scope.evidence_release(version)


def summary_line(res: AuditResult) -> str:
    parts = []
    for m in sorted({r.model for r in res.rows}):
        rows = [r for r in res.rows if r.model == m and r.path == "default"]
        runs = sum(r.status == "runs" for r in rows)
        off = sum(r.status == "off" for r in rows)
        patched = sum(r.status not in ("runs", "off") and bool(r.patch) for r in rows)
        opened = sum(r.open for r in rows)
        parts.append(f"{m}: {len(rows)} rows, {runs} run, {off} guarded off, {patched} replaced, {opened} open")
    return f"audit-vllm sm_{res.arch} (vLLM {res.vllm}): " + "; ".join(parts)


def format_table(res: AuditResult, models: Iterable[str] = MODELS, markdown: bool = False) -> str:
    out = []
    for m in models:
        rows = sorted((r for r in res.rows if r.model == m),
                      key=lambda r: (r.path != "default", not r.open, r.status == "runs", r.kernel, r.phase))
        if not rows:
            continue
        out.append(f"\n== {MODEL_TITLES.get(m, m)}, sm_{res.arch}")
        head = ("path", "phase", "kernel", "tech", "vLLM location", "status", "plugin", "evidence")
        table = [head] + [(r.path, r.phase, _k(r.kernel), r.tech, r.location,
                           ("OPEN " if r.open else "") + r.status, r.patch.replace("vllm.models.", "") or "-",
                           r.evidence) for r in rows]
        if markdown:
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table[1:]]
        else:
            w = [min(60, max(len(row[i]) for row in table)) for i in range(len(head) - 1)]
            for row in table:
                out.append("  ".join(c[:60].ljust(x) for c, x in zip(row, w)) + "  " + row[-1][:200])
    return "\n".join(out)


def _k(kernel: str) -> str:
    return kernel.replace("vllm.models.", "").replace("vllm.model_executor.", "me.").replace("vllm.v1.", "v1.")


__all__ = ["ALL_MODELS", "AuditError", "AuditResult", "MODELS", "Row", "cache_path", "format_table", "run",
           "summary_line", "version_line", "vllm_installed"]
