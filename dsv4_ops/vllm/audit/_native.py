"""Evidence for the non-Triton rows: cubins in vLLM's extension .so files, CuTeDSL inline PTX.

cuobjdump ships in the triton wheel (``triton/backends/nvidia/bin``).
"""

from __future__ import annotations

import functools
import glob
import inspect
import os
import re
import subprocess
from typing import Dict, List, Optional, Set, Tuple

E4M3_CVT = re.compile(r"cvt\.[\w.]*e4m3[\w.]*")


def cuobjdump() -> Optional[str]:
    from triton.backends.nvidia import compiler as nvc

    path = os.path.join(os.path.dirname(nvc.__file__), "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def vllm_sos() -> List[str]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.so"))) if spec else []


@functools.lru_cache(maxsize=None)
def elf_archs(so: str) -> Tuple[str, ...]:
    """The sm_XX of every cubin embedded in ``so``."""
    tool = cuobjdump()
    if not tool:
        return ()
    out = subprocess.run([tool, "--list-elf", so], capture_output=True, text=True).stdout
    return tuple(sorted(set(re.findall(r"\.(sm_\d+\w?)\.cubin", out))))


@functools.lru_cache(maxsize=None)
def entry_symbols(so: str, arch: int) -> Tuple[str, ...]:
    """Kernel entry symbols of the sm_<arch> cubins of ``so`` (empty when it has none)."""
    tool = cuobjdump()
    if not tool or f"sm_{arch}" not in elf_archs(so):
        return ()
    out = subprocess.run([tool, "-symbols", "-arch", f"sm_{arch}", so], capture_output=True, text=True).stdout
    return tuple(line.split()[-1] for line in out.splitlines() if "STO_ENTRY" in line)


def _tokens(op: str) -> List[str]:
    return [t for t in op.lower().split("_") if len(t) >= 3 or t.isdigit() or t in ("v4", "kv", "mqa", "k")]


def find_cpp_kernel(op: str, arch: int, namespace: str = "_C") -> Tuple[Optional[bool], str]:
    """(True, evidence) when an sm_<arch> cubin of a vLLM extension holds a kernel whose name
    contains every word of ``op``; (False, ...) when the extension has no sm_<arch> cubin at all;
    (None, ...) when cubins exist but no kernel name matched."""
    sos = [s for s in vllm_sos() if os.path.basename(s).startswith(namespace + ".") or
           os.path.basename(s).startswith(namespace + "_stable")] or vllm_sos()
    words = [t for t in _tokens(op) if t not in ("fused", "cuda")]
    for so in sos:
        for sym in entry_symbols(so, arch):
            low = sym.lower()
            if all(w in low for w in words):
                return True, f"sm_{arch} cubin in {os.path.basename(so)}: {sym[:90]}"
    names = ", ".join(f"{os.path.basename(s)} [{' '.join(elf_archs(s))}]" for s in sos)
    if not any(f"sm_{arch}" in elf_archs(s) for s in sos):
        return False, f"no sm_{arch} cubin in {names}"
    return None, f"no sm_{arch} kernel symbol matching {'+'.join(words)} in {names}"


def library_evidence(library: str, arch: int) -> str:
    """Why a DeepGEMM / FlashMLA / deep_select call cannot run on sm_<arch>."""
    if library == "FlashMLA":
        sos = [s for s in vllm_sos() if "flashmla" in os.path.basename(s)]
        return "; ".join(f"{os.path.basename(s)} cubins: {' '.join(elf_archs(s)) or 'none'}" for s in sos)
    if library == "deep_select":
        sos = [s for s in vllm_sos() if "deepselect" in os.path.basename(s)]
        return "; ".join(f"{os.path.basename(s)} cubins: {' '.join(elf_archs(s)) or 'none'}" for s in sos)
    if library == "DeepGEMM":
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        impls = glob.glob(os.path.join(os.path.dirname(spec.origin), "third_party", "deep_gemm", "include",
                                       "deep_gemm", "impls", "*"))
        archs = sorted({os.path.basename(p).split("_")[0] for p in impls})
        return (f"vendored DeepGEMM ships only {'/'.join(archs) or 'no'} implementations "
                f"(third_party/deep_gemm/include/deep_gemm/impls); is_deep_gemm_supported() is False on sm_{arch}")
    return ""


def cutedsl_evidence(kernel_obj) -> Tuple[Optional[bool], str]:
    """(False, evidence) when the kernel's module or the CuTeDSL helpers it imports emit an E4M3
    cvt (PTX that needs sm_89+); (None, ...) when no such instruction was found."""
    mod = inspect.getmodule(type(kernel_obj))
    try:
        src = inspect.getsource(mod)
    except (OSError, TypeError):
        return None, "CuTeDSL kernel source not readable"
    hits = set(E4M3_CVT.findall(src))
    via = []
    for name, obj in vars(mod).items():
        omod = getattr(obj, "__module__", "") or ""
        if callable(obj) and omod.startswith("vllm.cute_utils") and re.search(rf"\b{re.escape(name)}\(", src):
            try:
                found = set(E4M3_CVT.findall(inspect.getsource(obj)))
            except (OSError, TypeError):
                continue
            if found:
                hits |= found
                via.append(name)
    if hits:
        return False, (f"CuTeDSL inline PTX {', '.join(sorted(hits))} (E4M3 cvt needs sm_89+)"
                       + (f" via {', '.join(sorted(via))}" if via else ""))
    return None, "CuTeDSL kernel: no E4M3 cvt found in its source; not compiled for sm_8x"
