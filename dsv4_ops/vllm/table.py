"""The patch table: every vLLM symbol the plugin replaces, overrides, keeps or hooks on sm_8x.

Each area module of this package (``attention``, ``compressed_cache``, ``o_proj``, ``warmup``,
``indexer``, ``engram``, ``mhc``, ``pipeline``, ``quant_guard``) defines ``PATCHES``, a tuple of
``Patch`` rows; ``patches()`` concatenates them in ``AREAS`` order. Rows hold callables, never names resolved by string.
``per_model`` writes one row per DeepSeek model package (V4, V4.1) from a single description.

Row kinds
  patch     ``setattr(owner, name, replacement)``; with ``wraps=True`` the replacement is a
            builder called as ``replacement(original)`` that returns the new object.
  override  a method of vLLM's class that the Ampere attention subclass overrides; checked only.
  kept      a vLLM method the Ampere class inherits unchanged and relies on; checked only.
  hook      a vLLM method that a dsv4_ops hook wraps on live objects (the wo_a load hook);
            checked only here, installed by its owner.
Every row is checked at ``register()`` before anything is patched (``dsv4_ops.vllm.plugin``):
the symbol exists, has ``params``, and ``reads`` (attributes / dataclass fields the
replacement reads on vLLM objects) are still there.

Versions: a row applies to the vLLM releases in ``versions`` (empty: every release of
``dsv4_ops.vllm.versions.SUPPORTED``). A symbol whose params, reads or known non-callers moved
between releases has one row per span (``until(v)`` / ``since(v)``); ``patches(version)`` is the
table of one release, and ``register()`` checks the installed release's.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

from . import versions as _versions

V4 = "vllm.models.deepseek_v4"
V41 = "vllm.models.deepseek_v41"
V32 = "vllm.models.deepseek_v32"  # DeepSeek-V3.2 and GLM-5 (one model class on CUDA); rows in v32_model
MODEL_PACKAGES = {"v4": V4, "v41": V41}
KINDS = ("patch", "override", "kept", "hook")

# Area modules of dsv4_ops.vllm that contribute rows, in table order (missing ones are skipped).
AREAS = ("attention", "compressed_cache", "o_proj", "warmup", "indexer", "engram", "mhc", "pipeline", "quant_guard",
         "v32_model")


@dataclass(frozen=True)
class Reads:
    """Attributes the replacement reads on objects of a vLLM class.

    module/cls: where the class lives; names: attribute names. A dataclass is checked against
    its fields; any other class against class attributes and ``self.<name> =`` assignments in
    the source of its methods (its MRO within vLLM).
    """

    module: str
    cls: str
    names: Tuple[str, ...]


@dataclass(frozen=True)
class Patch:
    """One row. module/symbol: where vLLM looks the name up at call time (``symbol`` may be
    ``Class.attr``). params: parameter names of the vLLM original (``self``/``cls`` excluded).
    replacement: what runs instead (kind patch/override), or the hook installer (kind hook);
    None for kept. model: 'v4', 'v41' or '' (both/neither). placeholders: names of vLLM
    stand-ins accepted unchecked (FlashMLA's ``_raise_flashmla_unavailable`` without CUDA).
    known_non_callers: modules that import the symbol by name but never call it on the
    DSv4 path (accepted by the call-site guard). versions: the vLLM releases the row applies
    to (empty: all supported).
    """

    module: str
    symbol: str
    params: Tuple[str, ...]
    why: str
    replacement: Optional[Callable] = None
    kind: str = "patch"
    wraps: bool = False
    model: str = ""
    reads: Tuple[Reads, ...] = ()
    placeholders: Tuple[str, ...] = ()
    known_non_callers: Tuple[str, ...] = ()
    versions: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Patch {self.module}.{self.symbol}: kind {self.kind!r} not in {KINDS}")
        unknown = [v for v in self.versions if v not in _versions.SUPPORTED]
        if unknown:
            raise ValueError(f"Patch {self.module}.{self.symbol}: versions {unknown} not in {_versions.SUPPORTED}")

    def applies_to(self, version: str) -> bool:
        """True when this row is part of the table for vLLM release ``version`` ('X.Y.Z')."""
        return not self.versions or version in self.versions
        if self.kind == "patch" and self.replacement is None:
            raise ValueError(f"Patch {self.module}.{self.symbol}: a patch row needs a replacement")

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.symbol}"

    def describe_replacement(self) -> str:
        """What runs instead, in words (the README table's third column)."""
        if self.kind == "kept":
            return "inherited unchanged"
        fn = self.replacement
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        name = name.replace("dsv4_ops.vllm.", "")
        return f"{name}(original)" if self.wraps else name


PerModel = Union[Any, Dict[str, Any]]


def _pick(value: PerModel, model: str) -> Any:
    return value[model] if isinstance(value, dict) else value


def per_model(rel_module: str, symbol: str, params: PerModel, why: str, replacement: PerModel = None,
              *, models: Tuple[str, ...] = ("v4", "v41"), **kw) -> Tuple[Patch, ...]:
    """One row per model package: ``rel_module`` is relative to ``vllm.models.deepseek_v4[1]``;
    ``params`` and ``replacement`` may be dicts keyed by 'v4' / 'v41'."""
    rows = []
    for model in models:
        rows.append(Patch(f"{MODEL_PACKAGES[model]}.{rel_module}", symbol, tuple(_pick(params, model)), why,
                          _pick(replacement, model), model=model, **{k: _pick(v, model) for k, v in kw.items()}))
    return tuple(rows)


ALL = "all"


def until(version: str) -> Tuple[str, ...]:
    """The supported releases up to and including ``version`` (a row's ``versions``)."""
    return tuple(v for v in _versions.SUPPORTED if _versions.key(v) <= _versions.key(version))


def since(version: str) -> Tuple[str, ...]:
    """The supported releases from ``version`` on (a row's ``versions``)."""
    return tuple(v for v in _versions.SUPPORTED if _versions.key(v) >= _versions.key(version))


def installed_release() -> Optional[str]:
    """'X.Y.Z' of the installed vLLM, read from its metadata without importing it (None: none
    installed, or not a release)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _versions.release(version("vllm"))
    except PackageNotFoundError:
        return None


def patches(version: Optional[str] = None) -> Tuple[Patch, ...]:
    """The table of one vLLM release, every area's rows in ``AREAS`` order.

    version: 'X.Y.Z'; None = the installed vLLM's release when it is a supported one, else
    every row; ``ALL`` = every row of every release."""
    if version is None:
        version = installed_release()
        version = version if version in _versions.SUPPORTED else ALL
    rows = []
    for area in AREAS:
        try:
            module = importlib.import_module(f"{__package__}.{area}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{area}":
                raise
            continue
        rows.extend(getattr(module, "PATCHES", ()))
    return tuple(r for r in rows if version == ALL or r.applies_to(version))


def patch_table_markdown(rows: Optional[Tuple[Patch, ...]] = None) -> str:
    """The patch table as Markdown; the README's copy is kept equal by tests/test_vllm_plugin.py."""
    rows = patches(ALL) if rows is None else rows
    out = ["| vLLM symbol | vLLM | kind | sm_8x replacement | why |", "|---|---|---|---|---|"]
    for e in rows:
        sym = f"{e.module.replace('vllm.models.', '')}.{e.symbol}"
        out.append(f"| `{sym}` | {', '.join(e.versions) or 'all'} | {e.kind} | {e.describe_replacement()} | {e.why} |")
    return "\n".join(out)


__all__ = ["ALL", "AREAS", "KINDS", "MODEL_PACKAGES", "Patch", "Reads", "V4", "V41", "installed_release",
           "patch_table_markdown", "patches", "per_model", "since", "until", "field"]
