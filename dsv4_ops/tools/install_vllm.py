"""Install a supported vLLM release when ``pip install vllm==X`` cannot resolve it.

vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, which the package index does not serve (it has
0.7.2.post1, then 0.7.4), so ``pip install vllm==0.34.0`` fails on its own. This installs the
vLLM wheel with ``--no-deps``, then vLLM's own requirement list with each unavailable pin
replaced by the release named in ``SUBSTITUTES`` (its API is the pinned one's: 0.7.4 is a patch
release). Usage::

    python -m dsv4_ops.tools.install_vllm [VERSION]            # into this environment
    python -m dsv4_ops.tools.install_vllm 0.33.0 --target DIR  # vLLM alone in DIR (PYTHONPATH=DIR)

``--target`` installs vLLM and its pinned FlashInfer (``--no-deps``) into DIR, for a second
supported release beside the installed one (they share torch and every other requirement; CI
runs the version-dependent tests on 0.33.0 so), and fails if this environment does not satisfy
the rest of that release's requirements.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from ..vllm import versions

# vLLM release -> {requirement name: the release installed instead of its unavailable pin}
SUBSTITUTES: Dict[str, Dict[str, str]] = {rel: {name: sub} for rel, (name, _, sub) in versions.UNAVAILABLE_PINS.items()}


def _pip(args: Sequence[str], dry_run: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", *args]
    print("+", " ".join(cmd), flush=True)
    if not dry_run:
        subprocess.run(cmd, check=True)


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements(metadata_requires: Sequence[str], version: str) -> List[str]:
    """vLLM's unconditional requirements (markers evaluated here, extras dropped), with the
    pins of ``SUBSTITUTES[version]`` replaced."""
    from packaging.requirements import Requirement

    subs = {_canon(k): v for k, v in SUBSTITUTES.get(version, {}).items()}
    out = []
    for line in metadata_requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _canon(req.name)
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}=={subs[name]}" if name in subs else f"{req.name}{extras}{req.specifier}")
    return out


def unmet(reqs: Sequence[str]) -> List[str]:
    """The requirements this environment does not satisfy (missing or another version)."""
    from importlib.metadata import PackageNotFoundError, version as installed
    from packaging.requirements import Requirement

    bad = []
    for line in reqs:
        req = Requirement(line)
        try:
            have = installed(req.name)
        except PackageNotFoundError:
            bad.append(f"{line} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{line} (have {have})")
    return bad


def _dist_requires(target: Optional[str]) -> List[str]:
    from importlib.metadata import PathDistribution, distribution
    import pathlib

    if target is None:
        return list(distribution("vllm").requires or [])
    found = glob.glob(os.path.join(target, "vllm-*.dist-info"))
    if not found:
        raise SystemExit(f"no vllm-*.dist-info in {target}")
    return list(PathDistribution(pathlib.Path(found[0])).requires or [])


def install(version: str, target: Optional[str] = None, dry_run: bool = False) -> int:
    if version not in versions.SUPPORTED:
        print(f"vLLM {version} is not supported; dsv4_ops supports {', '.join(versions.SUPPORTED)}", file=sys.stderr)
        return 2
    if target is None:
        _pip(["--no-deps", f"vllm=={version}"], dry_run)
        if dry_run:
            return 0
        _pip(requirements(_dist_requires(None), version), dry_run)
        return 0
    _pip(["--no-deps", "--upgrade", "--target", target, f"vllm=={version}"], dry_run)
    if dry_run:
        return 0
    reqs = requirements(_dist_requires(target), version)
    flashinfer = [r for r in reqs if _canon(r.split("=")[0].split("[")[0]) == "flashinfer-python"]
    if flashinfer:  # the one requirement whose pin differs between the supported releases
        _pip(["--no-deps", "--upgrade", "--target", target, *flashinfer], dry_run)
    bad = unmet([r for r in reqs if r not in flashinfer])
    if bad:
        print(f"vLLM {version} in {target} needs, beside it: " + "; ".join(bad), file=sys.stderr)
        return 1
    print(f"vLLM {version} in {target}: run with PYTHONPATH={target}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_ops.tools.install_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("version", nargs="?", default=versions.NEWEST_DIFFED, help=f"one of {', '.join(versions.SUPPORTED)}")
    ap.add_argument("--target", help="install vLLM (and its FlashInfer) alone into this directory")
    ap.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    args = ap.parse_args(argv)
    return install(args.version, args.target, args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())
