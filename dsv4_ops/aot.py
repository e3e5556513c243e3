"""Ahead-of-time compilation of every sm_8x kernel specialization, on the CPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 80, 32))`` builds a real cubin with
the ptxas inside the triton wheel, no GPU needed. A specialization passes when it compiles,
fits the target's shared memory per block and its PTX holds no E4M3 cvt (sm_80 has none).

Launcher modules list their specializations through ``aot_specs()``, built from the same
launch-config data they launch with; ``SPEC_MODULES`` names those modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

AMPERE_ARCHS = (80, 86)
# Shared memory a block may use (opt-in maximum), bytes.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
SPEC_MODULES = ("dsv4_ops.codec", "dsv4_ops.attention", "dsv4_ops.paged_decode", "dsv4_ops.kv_cache",
                "dsv4_ops.indexer", "dsv4_ops.engram", "dsv4_ops.sparse_prefill", "dsv4_ops.v32")
_E4M3_CVT = re.compile(r"cvt\.[\w.]*e4m3")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization a launcher can pick.

    variant: 'portable' (what sm_8x runs) or 'native' (sm_89+); signature maps every
    argument name to a Triton type ('*u8', 'i32', ...) or 'constexpr'; archs: the archs it is
    dispatched on and compiled for (empty: every arch), for a config whose shared memory only
    some hold (``archs_holding``).
    """

    op: str
    label: str
    kernel: object
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    variant: str
    num_warps: int = 4
    num_stages: int = 3
    archs: tuple = ()


def compiled_for(spec: "KernelSpec", arch: int) -> bool:
    """Whether the AOT check compiles ``spec`` for sm_<arch> (its archs, or every arch)."""
    return not spec.archs or arch in spec.archs


def archs_holding(smem_bytes: int, archs: Sequence[int] = AMPERE_ARCHS) -> tuple:
    """The archs whose blocks may opt into ``smem_bytes`` of shared memory (SMEM_LIMIT)."""
    return tuple(a for a in archs if SMEM_LIMIT[a] >= smem_bytes)


def optional_pointer(signature: Dict[str, str], constexprs: Dict[str, object], name: str,
                     ty: str, present: bool) -> None:
    """Type an optional pointer argument: ``ty`` when passed, else a None constexpr (how a
    launcher's ``None`` specializes), in place."""
    signature[name] = ty if present else "constexpr"
    if not present:
        constexprs[name] = None


@dataclasses.dataclass
class AotResult:
    op: str
    label: str
    variant: str
    arch: int
    ok: bool
    registers: Optional[int] = None
    spill_bytes: Optional[int] = None
    shared_bytes: Optional[int] = None
    error: str = ""


def all_specs() -> List[KernelSpec]:
    specs: List[KernelSpec] = []
    for name in SPEC_MODULES:
        specs.extend(importlib.import_module(name).aot_specs())
    return specs


def _ptxas_usage(ptx: str, arch: int) -> Dict[str, int]:
    """Registers and spill bytes from the wheel's ptxas -v, kept beside Triton's own cache by
    the PTX text, the arch and the ptxas binary (the usage is a function of those alone), so a
    second AOT pass over the same kernels (the test suite's, then ``dsv4-ops check``'s) costs no
    ptxas run; Triton's cache already spares it the compile."""
    import hashlib
    import json

    from triton import knobs
    from triton.backends.nvidia import compiler as nvc

    ptxas = os.path.join(os.path.dirname(nvc.__file__), "bin", "ptxas")
    stat = os.stat(ptxas)
    key = hashlib.sha256(f"{arch}\0{ptxas}\0{stat.st_size}\0{stat.st_mtime_ns}\0{ptx}".encode()).hexdigest()
    memo = os.path.join(knobs.cache.dir, "dsv4_ops_ptxas_usage", key + ".json")
    try:
        with open(memo) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    usage = _run_ptxas(ptxas, ptx, arch)
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp_memo = f"{memo}.{os.getpid()}"
        with open(tmp_memo, "w") as f:
            json.dump(usage, f)
        os.replace(tmp_memo, memo)  # atomic: parallel AOT passes may write the same entry
    except OSError:
        pass
    return usage


def _run_ptxas(ptxas: str, ptx: str, arch: int) -> Dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
        res = subprocess.run([ptxas, f"-arch={target.group(1) if target else f'sm_{arch}'}", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    return {"registers": int(regs.group(1)) if regs else -1, "spill_bytes": sum(spills)}


def compile_spec(spec: KernelSpec, arch: int) -> AotResult:
    """Compile one specialization for sm_<arch> on this machine and check it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    res = AotResult(spec.op, spec.label, spec.variant, arch, ok=False)
    try:
        src = ASTSource(spec.kernel, dict(spec.signature), constexprs=dict(spec.constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    except Exception as exc:  # noqa: BLE001 - any compiler error is a failed check
        lines = [ln.strip() for ln in str(exc.__cause__ or exc).splitlines() if re.search(r"[A-Za-z]", ln)]
        res.error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
        return res
    ptx = compiled.asm["ptx"]
    usage = _ptxas_usage(ptx, arch)
    res.registers, res.spill_bytes = usage["registers"], usage["spill_bytes"]
    res.shared_bytes = int(compiled.metadata.shared)
    problems = []
    if res.shared_bytes > SMEM_LIMIT[arch]:
        problems.append(f"shared memory {res.shared_bytes} B > sm_{arch} limit {SMEM_LIMIT[arch]} B")
    if _E4M3_CVT.search(ptx):
        problems.append("PTX holds an e4m3 cvt, which sm_8x lacks")
    res.error = "; ".join(problems)
    res.ok = not problems
    return res


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


def check(archs: Sequence[int] = AMPERE_ARCHS, variants: Sequence[str] = ("portable",)) -> List[AotResult]:
    """Compile every specialization of the given variants for each arch.

    Under the Triton interpreter (kernels are not JIT functions) it reruns itself in a
    subprocess with TRITON_INTERPRET=0.
    """
    if _interpreting():
        env = dict(os.environ, TRITON_INTERPRET="0")
        cmd = [sys.executable, "-m", "dsv4_ops.aot", "--json", "--archs", ",".join(map(str, archs)),
               "--variants", ",".join(variants)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode not in (0, 1):
            raise RuntimeError(f"AOT subprocess failed ({out.returncode}):\n{out.stderr[-2000:]}")
        return [AotResult(**row) for row in json.loads(out.stdout)]
    return [compile_spec(spec, arch) for arch in archs for spec in all_specs()
            if spec.variant in variants and compiled_for(spec, arch)]


def format_results(results: Sequence[AotResult]) -> str:
    rows = [("arch", "op", "specialization", "variant", "regs", "spill B", "smem B", "status")]
    for r in results:
        rows.append((f"sm_{r.arch}", r.op, r.label, r.variant, str(r.registers), str(r.spill_bytes),
                     str(r.shared_bytes), "ok" if r.ok else f"FAIL {r.error}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="AOT-compile dsv4_ops kernels for sm_8x on this machine")
    p.add_argument("--archs", default=",".join(map(str, AMPERE_ARCHS)))
    p.add_argument("--variants", default="portable")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = check([int(a) for a in args.archs.split(",")], args.variants.split(","))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results]))
    else:
        print(format_results(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
