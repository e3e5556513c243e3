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


def kernel_base_name(mangled: str) -> str:
    """The unqualified function name of an Itanium-mangled kernel symbol (``_ZN4vllm...9myKernelI...``
    -> ``myKernel``); the symbol itself when it is not mangled."""
    return nested_names(mangled)[-1]


def nested_names(mangled: str) -> List[str]:
    """The qualified name of a mangled symbol as a list (``_ZN4vllm3ops6kernelI...`` ->
    ['vllm', 'ops', 'kernel']); [symbol] when it is not mangled."""
    if not mangled.startswith("_Z"):
        return [mangled]
    i, names = 2, []
    nested = mangled[i:i + 1] == "N"
    i += 1 if nested else 0
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while j < len(mangled) and mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        names.append(mangled[j:j + n])
        i = j + n
        if not nested:
            break
    return names or [mangled]


def _norm(name: str) -> str:
    low = name.lower().replace("_", "")
    for suffix in ("kernelreducedgrid", "kernel"):
        if low.endswith(suffix):
            return low[: -len(suffix)]
    return low


def find_cpp_kernel(op: str, arch: int, namespace: str = "_C") -> Tuple[Optional[bool], str]:
    """(True, evidence) when an sm_<arch> cubin of a vLLM extension holds a kernel whose name is the
    op's name (case, underscores and a ``Kernel`` suffix aside: ``top_k_per_row_prefill`` ->
    ``vllm::topKPerRowPrefill``; exact, so ``fused_deepseek_v4_kv_rope_insert`` does not match
    ``fusedDeepseekV4QNormRopeKVRopeQuantInsertKernel``); (False, ...) when the extension has no
    sm_<arch> cubin at all; (None, ...) when cubins exist but no kernel has the op's name (the op
    launches a kernel named otherwise: not established)."""
    sos = [s for s in vllm_sos() if os.path.basename(s).startswith(namespace + ".") or
           os.path.basename(s).startswith(namespace + "_stable")] or vllm_sos()
    want = _norm(op)
    for so in sos:
        for sym in entry_symbols(so, arch):
            base = kernel_base_name(sym)
            if _norm(base) == want:
                n = sum(kernel_base_name(x) == base for x in entry_symbols(so, arch))
                return True, f"sm_{arch} cubin in {os.path.basename(so)}: {base} ({n} instantiation(s))"
    names = ", ".join(f"{os.path.basename(s)} [{' '.join(elf_archs(s))}]" for s in sos)
    if not any(f"sm_{arch}" in elf_archs(s) for s in sos):
        return False, f"no sm_{arch} cubin in {names}"
    for so in sos:
        got = _family(so, op, arch)
        if got is not None:
            return got
    return None, (f"no sm_{arch} kernel named like the op ({op}) in {names}; the op launches a kernel of "
                  "another name, which the audit does not guess")


def _archs_of(so: str) -> List[int]:
    return sorted({int(re.match(r"sm_(\d+)", a).group(1)) for a in elf_archs(so)})


def _family(so: str, op: str, arch: int) -> Optional[Tuple[bool, str]]:
    """Two exact-name readings of the cubins when no kernel is named like the op:

    - a kernel family named by the op plus a suffix (``cooperative_topk`` ->
      ``cooperative_topk_cs2``...): True when sm_<arch> has it, False when only other archs do;
    - the op's C++ namespace (``vllm::deepseek_v4_fused_ops`` for ``fused_deepseek_v4_*``: every
      word of the namespace but ``ops`` is a word of the op name): True when sm_<arch> holds every
      kernel instantiation of that namespace that any other arch of the same file holds (so the
      kernel the op launches, whichever it is, is built for sm_<arch>)."""
    want = _norm(op)
    others = [a for a in _archs_of(so) if a != arch]
    fam = {a: sorted({kernel_base_name(x) for x in entry_symbols(so, a)
                      if _norm(kernel_base_name(x)).startswith(want)}) for a in [arch] + others}
    if fam[arch]:
        return True, f"sm_{arch} cubin in {os.path.basename(so)}: kernel family {', '.join(fam[arch])}"
    elsewhere = [a for a in others if fam[a]]
    if elsewhere:
        return False, (f"kernel family {', '.join(fam[elsewhere[0]])} is in the {os.path.basename(so)} cubins for "
                       f"{' '.join(f'sm_{a}' for a in elsewhere)} only, not sm_{arch}")
    words = set(op.lower().split("_"))
    spaces = {tuple(nested_names(x)[:-1]) for x in entry_symbols(so, arch)}
    for ns in sorted(spaces):
        if len(ns) < 2 or not (set(ns[-1].lower().split("_")) - {"ops"}) <= words:
            continue
        per = {a: sorted(x for x in entry_symbols(so, a) if tuple(nested_names(x)[:-1]) == ns)
               for a in [arch] + others}
        if per[arch] and all(set(per[a]) <= set(per[arch]) for a in others):
            bases = sorted({kernel_base_name(x) for x in per[arch]})
            return True, (f"sm_{arch} cubin in {os.path.basename(so)} holds every kernel of the op's namespace "
                          f"{'::'.join(ns)} that the {' '.join(f'sm_{a}' for a in others)} cubins hold "
                          f"({len(per[arch])} instantiations of {', '.join(bases)}); the op launches one of them")
    return None


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
