"""``dsv4-ops audit-vllm``: which kernels of vLLM 0.33.0's DeepSeek-V4/V4.1 serve path run on
sm_8x, which are replaced by this plugin, and which are open, decided from evidence.

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
target has to be installed before vLLM is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

VLLM_VERSION_TESTED = "0.33.0"
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

    @property
    def open(self) -> bool:
        return self.path == "default" and self.status not in ("runs", "off") and not self.patch

    @property
    def ident(self) -> str:
        """Stable name of a row: model, phase, kernel (what the known-open list holds)."""
        return f"{self.model}:{self.phase}:{self.kernel}"


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


def cache_path(models: Sequence[str], arch: int) -> str:
    """A cache file keyed by everything the result depends on: the vLLM version, the arch, the
    models, and the source of dsv4_ops.vllm (patch table, audit code)."""
    import glob
    import hashlib

    h = hashlib.sha256(f"{vllm_installed()}|{arch}|{','.join(models)}".encode())
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in sorted(glob.glob(os.path.join(here, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            h.update(path.encode() + f.read())
    root = os.environ.get("DSV4_OPS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv4_ops"))
    return os.path.join(root, f"audit-vllm-{h.hexdigest()[:16]}.json")


def run(models: Sequence[str] = MODELS, arch: int = 80, jobs: Optional[int] = None,
        cache: Optional[str] = "auto", timeout: float = 3600, modules: Sequence[str] = (),
        env: Optional[dict] = None) -> AuditResult:
    """Run the audit (in a subprocess). ``cache``: a JSON file reused when it exists; 'auto'
    (default) is ``cache_path(models, arch)``, None runs afresh. ``timeout`` (s) covers a cold
    TileLang cache: every mHC warmup key goes through nvcc (1-2 min a key on 2 shared cores)."""
    if cache == "auto" and not modules:
        cache = cache_path(models, arch)
    if cache and os.path.exists(cache):
        with open(cache) as f:
            return _result(json.load(f))
    if vllm_installed() is None:
        raise AuditError("dsv4-ops audit-vllm needs vLLM (pip install 'dsv4-ops[vllm]'); it is not installed")
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "dsv4_ops.vllm.audit._worker", "--models", ",".join(models), "--arch", str(arch)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    if modules:
        cmd += ["--modules", ",".join(modules)]
        cache = None if cache == "auto" else cache
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    marker = "\n@@AUDIT@@"
    if proc.returncode != 0 or marker not in proc.stdout:
        raise AuditError(f"audit worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout.rsplit(marker, 1)[1])
    if cache:
        os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
        with open(cache, "w") as f:
            json.dump(data, f)
    return _result(data)


def _result(data: dict) -> AuditResult:
    return AuditResult(data["vllm"], data["arch"], [Row(**r) for r in data["rows"]], data.get("notes", []))


def version_line(res: AuditResult) -> str:
    if res.vllm != VLLM_VERSION_TESTED:
        return (f"WARNING: vLLM {res.vllm} is installed; this audit and the plugin were written for "
                f"{VLLM_VERSION_TESTED}. Running anyway: rows are decided from this vLLM's code.")
    return f"vLLM {res.vllm}, target sm_{res.arch}"


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


__all__ = ["ALL_MODELS", "AuditError", "AuditResult", "MODELS", "Row", "VLLM_VERSION_TESTED", "format_table", "run",
           "summary_line", "version_line", "vllm_installed"]
