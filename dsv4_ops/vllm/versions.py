"""The vLLM releases this plugin is tested with, declared once.

Every version-dependent decision reads ``SUPPORTED`` (the patch table's ``Patch.versions``,
the plugin's startup refusal, the audit, doctor, the extras in ``pyproject.toml`` and the
README, which tests keep equal to it). ``NEWEST_DIFFED`` is the newest vLLM release whose
source was read against the table (``dsv4-ops audit-vllm --against <wheel>``); a later release
is refused until it is added here with its rows.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

SUPPORTED: Tuple[str, ...] = ("0.33.0", "0.34.0")  # oldest first
NEWEST_DIFFED = SUPPORTED[-1]
# pip's requirement for the supported range (pyproject's extras hold the same text; a test checks)
PIP_RANGE = f">={SUPPORTED[0]},<={SUPPORTED[-1]}"

# release -> (requirement, its pin that the package index does not serve, the release installed
# instead by ``python -m dsv4_ops.tools.install_vllm``)
UNAVAILABLE_PINS = {"0.34.0": ("flashinfer-python", "0.7.3", "0.7.4")}

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+[\w.]+)?$")


def release(version: Optional[str]) -> Optional[str]:
    """'X.Y.Z' of a release version string ('0.34.0', '0.34.0.post1', '0.34.0+cu130'); None for
    a dev / rc build or anything else, whose source may differ from every tested release."""
    m = _RELEASE.match(version or "")
    return ".".join(m.groups()) if m else None


def supported(version: Optional[str]) -> bool:
    return release(version) in SUPPORTED


def key(version: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def install_command(rel: str) -> str:
    """The command that installs vLLM release ``rel`` beside dsv4-ops."""
    if rel in UNAVAILABLE_PINS:
        return f"python -m dsv4_ops.tools.install_vllm {rel}"
    return f"pip install 'vllm=={rel}'"


def install_advice() -> str:
    """Every supported release with the command that works for it (newest first), and why a
    plain pip install does not work where it does not."""
    cmds = "; ".join(f"vLLM {r}: {install_command(r)}" for r in reversed(SUPPORTED))
    notes = "; ".join(f"a plain `pip install vllm=={r}` fails: it pins {name}=={pin}, which the package index does "
                      f"not serve; the installer installs the vLLM wheel with --no-deps, then its requirements with {name} {sub}"
                      for r, (name, pin, sub) in UNAVAILABLE_PINS.items() if r in SUPPORTED)
    return f"install a supported release ({cmds})" + (f" -- {notes}" if notes else "")


def refusal(version: Optional[str]) -> str:
    """Why ``version`` is refused, and what to do (the startup error's text)."""
    tested = ", ".join(SUPPORTED)
    rel = release(version)
    if rel is None:
        why = f"vLLM {version} is not a release this plugin knows (a dev or rc build?)"
    elif key(rel) > key(NEWEST_DIFFED):
        why = (f"vLLM {version} is newer than the newest release diffed against the patch table "
               f"({NEWEST_DIFFED}); run `dsv4-ops audit-vllm --against <vllm wheel or source dir>` to see what moved")
    else:
        why = f"vLLM {version} is older than the oldest supported release ({SUPPORTED[0]})"
    return (f"{why}. dsv4_ops supports vLLM {tested}: {install_advice()} (README, 'Supported vLLM versions'); "
            "or set VLLM_PLUGINS= to run vLLM without the plugin")


__all__ = ["NEWEST_DIFFED", "PIP_RANGE", "SUPPORTED", "UNAVAILABLE_PINS", "install_advice", "install_command", "key",
           "refusal", "release", "supported"]
