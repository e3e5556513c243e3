"""Where a model's serve-path scope starts and which vLLM modules it follows, as data.

These lists say which modules a default NVIDIA ``vllm serve`` (TP=8, PP=1, no MTP) of each
model can load: the scope read by ``ServeGraph.scope``. Which code inside that scope is never
reached on sm_8x is the audit's business (``dsv4_ops.vllm.audit._paths``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

# Roots besides <model>.nvidia.model: the indexer op and metadata builders that vLLM selects by name.
SHARED_ROOTS = (
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.v1.attention.backends.mla.sparse_swa",
    "vllm.model_executor.layers.indexer_topk",
)

# DeepSeek-V3.2 / GLM-5 (vllm.models.deepseek_v32; one model class on CUDA) are MLA models whose
# attention backend vLLM's selector picks (on sm_8x: dsv4_ops.vllm.v32_backend, built on vLLM's
# sparse-MLA base classes) and whose MoE / MLP / base CausalLM come from deepseek_v2.py: their
# scope follows those modules too (per model, so the V4/V4.1 scopes are unchanged).
V32_FAMILY = ("v32", "glm5")
SHARED_ROOTS_BY_MODEL = {m: (
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.model_executor.layers.indexer_topk",
    "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.v1.attention.backends.mla.sparse_utils",
    "vllm.v1.attention.backends.mla.index_group",
) for m in V32_FAMILY}
FOLLOW_BY_MODEL = {m: (
    "vllm.models.deepseek_v32",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.layers.attention",  # MLAAttention (re-exported by the package), sparse_mla_attention
    "vllm.v1.attention.backends.mla.sparse_utils",
    "vllm.v1.attention.backends.mla.index_group",
    "vllm.model_executor.layers.fused_embed_norm",
) for m in V32_FAMILY}

# The model whose scope is being read (set by ``_follow`` while a model's scope and rows are
# decided), for per-model lists that are looked up by name only (the audit's ``off_path``).
CURRENT_MODEL: Optional[str] = None


def shared_roots(model: str):
    return SHARED_ROOTS_BY_MODEL.get(model, SHARED_ROOTS)


# Architectures (keys of vLLM's model registry, registry.py) that each audited path serves: their
# classes are the roots of the class-level reachability graph (``_reach``). V4-Flash ships as
# DeepseekV4ForCausalLM; V4.1-Flash's only registered class is the vision-language wrapper
# (nvidia/vl_model.py: the ViT tower + DeepseekV41LLMForCausalLM). Draft paths add their class.
ARCHITECTURES = {
    "v4": {"default": ("DeepseekV4ForCausalLM",), "mtp": ("DeepSeekV4MTPModel",), "dspark": ("DSparkDraftModel",)},
    "v41": {"default": ("DeepseekV41ForCausalLM",), "mtp": (), "dspark": ("DSparkV41DraftModel",)},
    "v32": {"default": ("DeepseekV32ForCausalLM",), "mtp": ("DeepseekV32MTPModel",)},
    "glm5": {"default": ("GlmMoeDsaForCausalLM",), "mtp": ("DeepseekV32MTPModel",)},
}

# Speculative-decoding heads (module suffix under <model>.nvidia): outside the default scope.
EXTRA_PATH_PARTS = (".mtp", ".dspark")

# Module name parts never reached on sm_8x by default, and why.
OFF_PATH_MODULES = {
    ".flashinfer_sparse": "FlashInfer sparse-MLA backend: selected only on sm_100",
    ".flash_mla_mega_attn": "FlashMLA mega-attention: sm_100 only (declines other GPUs)",
    ".specialized_decode": "opt-in additional_config.decode_backend=latency_specialized",
    "mega_moe": "MegaMoE: opt-in --kernel-config moe_backend, DeepGEMM sm_100",
    "mega_mhc": "Mega-mHC: sm_100 only",
    "dcp_indexer": "decode context parallelism (DCP > 1): not the default serve",
}


# ------------------------------------------------------------------ evidence per vLLM release

@functools.lru_cache(maxsize=1)
def source_version() -> Optional[str]:
    """The version of the vLLM whose source is read (the one ``import vllm`` finds first on the
    path: the installed release, or the tree ``audit-vllm --against`` puts first), from its
    ``_version.py`` (wheels and built trees have it) or the distribution metadata that describes
    that very package; None when neither does (a bare source checkout)."""
    import importlib.util
    import os
    import re

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    pkg = os.path.dirname(os.path.abspath(spec.origin))
    path = os.path.join(pkg, "_version.py")
    if os.path.isfile(path):
        m = re.search(r"^__version__ = version = ['\"]([^'\"]+)['\"]", open(path).read(), re.M)
        if m:
            return m.group(1)
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("vllm")
    except PackageNotFoundError:
        return None
    here = os.path.abspath(str(dist.locate_file(os.path.join("vllm", "__init__.py"))))
    return dist.version if here == os.path.abspath(spec.origin) else None


def evidence_release(version: Optional[str] = None) -> str:
    """The supported release whose recorded evidence (guard regexes, launch recipes, kernel
    inventory) applies to vLLM ``version`` (default: the source read): its own release when it is
    supported, else the newest release diffed, so a newer tree is read against the newest
    evidence and what moved shows up as stale evidence or open rows, never as silently accepted."""
    from .. import versions

    rel = versions.release(source_version() if version is None else version)
    return rel if rel in versions.SUPPORTED else versions.NEWEST_DIFFED


@dataclass(frozen=True)
class Releases:
    """The vLLM releases a piece of evidence was read from: ``first`` to ``last`` (inclusive; ''
    leaves that end open). Not the patch table's ``until`` / ``since`` tuples, which are taken from
    ``SUPPORTED``: an open span keeps applying to a release added later, and evidence read from a
    release that is not supported (yet) never applies to one that is."""

    first: str = ""
    last: str = ""

    def __contains__(self, release: str) -> bool:
        from .. import versions

        k = versions.key(release)
        return (not self.first or versions.key(self.first) <= k) and (not self.last or k <= versions.key(self.last))


def since(release: str) -> Releases:
    return Releases(first=release)


def until(release: str) -> Releases:
    return Releases(last=release)


ANY = Releases()


def for_release(choices, version: Optional[str] = None):
    """The value of ``choices`` ({Releases: value}) recorded for ``evidence_release(version)``."""
    rel = evidence_release(version)
    for releases, value in choices.items():
        if rel in releases:
            return value
    raise KeyError(f"no evidence recorded for vLLM {rel} (recorded: {sorted(map(str, choices))})")
