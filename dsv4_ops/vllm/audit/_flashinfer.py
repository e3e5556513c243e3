"""FlashInfer's sampling module (vLLM's fused top-k/top-p sampler) built for sm_<arch> on the CPU
with FlashInfer's own JIT (its ninja build, nvcc ``-gencode=arch=compute_<arch>,code=sm_<arch>``),
the way a GPU host builds it at first use; the evidence is the sm_<arch> cubin in the built
library (cuobjdump).

The build needs a CUDA toolkit (nvcc) and the CUDA headers FlashInfer includes (``curand.h``
ships in the ``nvidia-curand`` wheel, ``nvidia/cu13/include``: passed through ``CPATH``). It takes
minutes on 2 CPU cores, so it runs in a subprocess into ``DSV4_OPS_CACHE/flashinfer`` and is
reused while its output exists. On a host without the CUDA driver the final link fails
(``-lcudart -lcuda``); the compiled objects, which hold the sm_<arch> cubins, are the evidence.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Tuple

_BUILD = ("from flashinfer.jit.sampling import gen_sampling_module\n"
          "spec = gen_sampling_module(); spec.build(verbose=False); print(spec.get_library_path())\n")


def _cache_root() -> str:
    return os.path.join(os.environ.get("DSV4_OPS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv4_ops")),
                        "flashinfer")


def _cuda_include() -> Optional[str]:
    import site

    for base in site.getsitepackages():
        cand = os.path.join(base, "nvidia", "cu13", "include")
        if os.path.exists(os.path.join(cand, "curand.h")):
            return cand
    return None


def sampling_module(arch: int, timeout: float = 600) -> Tuple[Optional[bool], str]:
    """(True, evidence) when FlashInfer's sampling library built for sm_<arch> holds sm_<arch>
    cubins; (None, why) when it could not be built here."""
    from . import _native

    try:
        import flashinfer
    except ImportError:
        return None, "flashinfer is not installed"
    root = os.path.join(_cache_root(), flashinfer.__version__, str(arch))
    found = _built(root)
    err = ""
    if not found:
        env = dict(os.environ, FLASHINFER_CUDA_ARCH_LIST=f"{arch // 10}.{arch % 10}", FLASHINFER_WORKSPACE_BASE=root)
        inc = _cuda_include()
        if inc:
            env["CPATH"] = inc + (os.pathsep + env["CPATH"] if env.get("CPATH") else "")
        try:
            proc = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True,
                                  timeout=timeout)
            err = "\n".join(ln for ln in (proc.stderr or "").splitlines() if "error" in ln.lower())
        except subprocess.TimeoutExpired:
            return None, f"FlashInfer JIT build of the sampling module for sm_{arch} timed out ({timeout:.0f} s)"
        found = _built(root)
    if not found:
        return None, f"FlashInfer JIT build for sm_{arch} failed here: {(err.splitlines() or [''])[0].strip()[:200]}"
    kind, paths = found
    archs = sorted({a for p in paths for a in _native.elf_archs(p)})
    ok = bool(archs) and all(any(a.startswith(f"sm_{arch}") for a in _native.elf_archs(p)) for p in paths)
    what = ("linked library" if kind == "so" else
            f"objects {', '.join(os.path.basename(p) for p in paths)} (nvcc compiled them; the link step needs "
            "libcudart/libcuda, absent on a host without a driver)")
    return ok, (f"FlashInfer {flashinfer.__version__} JIT (nvcc, -gencode sm_{arch}) built its sampling module: "
                f"{what}; cubins {' '.join(archs) or 'none'}")


def _built(root: str):
    """('so', [library]) or ('o', [the sampling and renorm objects]) of a finished build, else None
    (FlashInfer builds under <root>/.cache/flashinfer/...: a hidden folder, so os.walk, not glob)."""
    found = {}
    for dirpath, _dirs, files in os.walk(root):
        if os.path.basename(dirpath) == "sampling":
            for f in files:
                found.setdefault(f, os.path.join(dirpath, f))
    if "sampling.so" in found:
        return "so", [found["sampling.so"]]
    objs = [found[f] for f in ("csrc_sampling.cuda.o", "csrc_renorm.cuda.o") if f in found]
    return ("o", objs) if len(objs) == 2 else None
