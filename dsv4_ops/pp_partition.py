"""Legal pipeline-parallel layer partitions (``VLLM_PP_LAYER_PARTITION``) for DeepSeek-V4/V4.1.

Pure Python (no torch, no vLLM). Rules, from vLLM 0.33.0 (``models/deepseek_v41/attention.py``
L314-361, L441-468, L600-613; ``nvidia/model.py`` L858-893, L1289-1300):

- A V4.1 layer with ``compress_ratios[L] > 0`` reads the compressed KV cache of its KV source
  ``max(s in kv_source_layer_ids, s <= L)`` and, if it is an index source that does not own
  a K cache, that source's indexer K cache. A source on an earlier stage: vLLM raises
  NotImplementedError at model build ("PP splits inside a v4.1 kv-sharing group are not
  supported").
- Every compressed layer also reads the top-k indices its index source
  ``max(s in index_source_layer_ids, s <= L)`` publishes in a buffer local to the stage, and
  index sources after ``candidate_source_layer_id`` read the candidate blocks that layer
  publishes, also stage-local. A source on an earlier stage: nothing raises, the layer reads
  a buffer nobody wrote (silent garbage), so it is illegal here too.
- Decoder replay (a prefill speed-up, not a correctness rule) stays on only when the last
  KV source and every layer after it sit on the last stage; partitions that keep it rank first.

So a stage starting at layer ``a`` may extend to layer ``b - 1`` only while every compressed
layer in ``[a, b)`` finds its sources in ``[a, L]``. V4 (no ``kv_source_layer_ids``) shares
nothing across layers: every split is legal.

``VLLM_PP_LAYER_PARTITION`` is parsed as vLLM parses it (``distributed/utils.py``
``get_pp_indices``): comma-separated layer counts per stage, ``int()`` each, as many as
``--pipeline-parallel-size``, summing to ``num_hidden_layers``; unset, vLLM splits evenly and
gives the remainder to the stages before the last.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

ENV_VAR = "VLLM_PP_LAYER_PARTITION"
_MAX_LISTED = 5


class PPPartitionError(ValueError):
    """A pipeline partition that vLLM would reject or run wrongly for this model."""


@dataclass(frozen=True)
class Layout:
    """The cross-layer sharing of one model (layer ids are 0-based, backbone layers only)."""

    num_layers: int
    compress_ratios: Tuple[int, ...]
    kv_sources: Tuple[int, ...] = ()
    index_sources: Tuple[int, ...] = ()
    candidate_source: int = -1
    name: str = "model"
    limits: Tuple[int, ...] = field(default=(), repr=False)  # limits[a]: first layer a stage at a cannot hold

    @property
    def shares(self) -> bool:
        return bool(self.kv_sources)


def load_config(source: Union[str, os.PathLike, Mapping[str, Any], Any]) -> Dict[str, Any]:
    """config.json as a dict, from a path (file or model directory), a dict, or an object
    with attributes (a transformers / vLLM hf_config)."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    if hasattr(source, "to_dict"):
        return dict(source.to_dict())
    return dict(vars(source))


def _compress_ratios(cfg: Mapping[str, Any]) -> List[int]:
    """Per-layer ratios as vLLM's ``get_compress_ratios``: ``compress_ratios``, or
    ``compress_rates[layer_types[i]]``; [] when the config has neither."""
    if cfg.get("compress_ratios") is not None:
        return [int(r) for r in cfg["compress_ratios"]]
    rates, types = cfg.get("compress_rates"), cfg.get("layer_types")
    if rates is None or types is None:
        return []
    return [int(rates.get(t, 0)) for t in types]


def layout_from_config(source) -> Layout:
    """The sharing layout of a DeepSeek-V4 / V4.1 config (see ``load_config``)."""
    cfg = load_config(source)
    if "num_hidden_layers" not in cfg:
        raise PPPartitionError("config: no num_hidden_layers (is this a DeepSeek-V4 / V4.1 config.json?)")
    n = int(cfg["num_hidden_layers"])
    ratios = (_compress_ratios(cfg) + [0] * n)[:n]
    kv = tuple(sorted(int(s) for s in (cfg.get("kv_source_layer_ids") or ()) if int(s) < n))
    idx = tuple(sorted(int(s) for s in (cfg.get("index_source_layer_ids") or ()) if int(s) < n))
    cand = int(cfg.get("candidate_source_layer_id", -1) if cfg.get("candidate_topk_blocks", 0) else -1)
    name = "/".join(cfg.get("architectures") or [cfg.get("model_type", "model")])
    if kv and any(r > 0 for r in ratios) and not idx:
        raise PPPartitionError("config: kv_source_layer_ids without index_source_layer_ids")
    layout = Layout(n, tuple(ratios), kv, idx, cand, name)
    return Layout(n, layout.compress_ratios, kv, idx, cand, name, tuple(_limits(layout)))


def _source(sources: Sequence[int], layer: int) -> Optional[int]:
    below = [s for s in sources if s <= layer]
    return max(below) if below else None


_RAISES = "vLLM raises NotImplementedError at model build"
_GARBAGE = "a stage-local buffer: it would read what nobody wrote, silently"


def layer_needs(layout: Layout, layer: int) -> List[Tuple[int, str, str]]:
    """(source layer, what is read, what goes wrong when the source is on another stage)
    for each source ``layer`` needs on its own stage."""
    if not layout.shares or layout.compress_ratios[layer] <= 0:
        return []
    needs = []
    kv = _source(layout.kv_sources, layer)
    if kv is not None:
        needs.append((kv, "compressed KV cache", _RAISES))
    idx = _source(layout.index_sources, layer)
    if idx is not None:
        needs.append((idx, "top-k indices", _GARBAGE))
    if layer in layout.index_sources and 0 <= layout.candidate_source < layer:
        needs.append((layout.candidate_source, "candidate blocks", _GARBAGE))
    return needs


def _limits(layout: Layout) -> List[int]:
    """limits[a] = the first layer >= a that a stage starting at a cannot hold (num_layers if none)."""
    out = []
    for a in range(layout.num_layers):
        b = a
        while b < layout.num_layers and all(src >= a for src, _, _ in layer_needs(layout, b)):
            b += 1
        out.append(b)
    return out


def stage_bounds(counts: Sequence[int]) -> List[Tuple[int, int]]:
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def violations(layout: Layout, counts: Sequence[int]) -> List[str]:
    """Why a partition (layer counts per stage) is illegal; [] when it is legal."""
    reasons = []
    for i, (a, b) in enumerate(stage_bounds(counts)):
        for layer in range(a, b):
            for src, what, harm in layer_needs(layout, layer):
                if src < a:
                    reasons.append(f"stage {i} (layers {a}-{b - 1}): layer {layer} reads the {what} of layer {src}, "
                                   f"which is on an earlier stage ({harm})")
                    break
            else:
                continue
            break  # one reason per stage is enough
    return reasons


def keeps_decoder_replay(layout: Layout, counts: Sequence[int]) -> bool:
    """Whether the last KV source and every later layer sit on the last stage."""
    if not layout.kv_sources:
        return True
    return stage_bounds(counts)[-1][0] <= max(layout.kv_sources)


def vllm_default_partition(num_layers: int, pp: int) -> List[int]:
    """What vLLM 0.33.0 uses when VLLM_PP_LAYER_PARTITION is unset (``get_pp_indices``)."""
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return counts


def parse_partition(partition: str, num_layers: int, pp: int) -> List[int]:
    """Layer counts from a VLLM_PP_LAYER_PARTITION string, with vLLM's checks (and a stage
    of zero layers rejected). PPPartitionError naming what is wrong."""
    try:
        counts = [int(p) for p in str(partition).split(",")]
    except ValueError as exc:
        raise PPPartitionError(f"{ENV_VAR}={partition!r}: not a comma-separated list of integers") from exc
    if len(counts) != pp:
        raise PPPartitionError(f"{ENV_VAR}={partition!r}: {len(counts)} stages for --pipeline-parallel-size {pp}")
    if sum(counts) != num_layers:
        raise PPPartitionError(f"{ENV_VAR}={partition!r}: {sum(counts)} layers, the model has {num_layers}")
    if any(c < 1 for c in counts):
        raise PPPartitionError(f"{ENV_VAR}={partition!r}: every stage needs at least one layer")
    return counts


def _balance_key(layout: Layout, counts: Sequence[int]):
    return (max(counts), not keeps_decoder_replay(layout, counts), sum(c * c for c in counts),
            [-c for c in counts])


def best_partitions(layout: Layout, pp: int, limit: int = _MAX_LISTED) -> List[List[int]]:
    """The legal partitions with the smallest largest stage, best first (decoder replay kept,
    then the most even, then earlier stages larger, as vLLM's default); [] if none exists."""
    n = layout.num_layers
    if pp < 1 or pp > n:
        return []
    lim = list(layout.limits) or _limits(layout)
    # reach[k][a]: smallest possible largest stage covering layers a..n-1 with k stages.
    INF = n + 1
    reach = [[INF] * (n + 1) for _ in range(pp + 1)]
    reach[0][n] = 0
    for k in range(1, pp + 1):
        for a in range(n - 1, -1, -1):
            best = INF
            for b in range(a + 1, lim[a] + 1):
                if reach[k - 1][b] < INF:
                    best = min(best, max(b - a, reach[k - 1][b]))
            reach[k][a] = best
    m = reach[pp][0]
    if m >= INF:
        return []
    found: List[List[int]] = []

    def walk(a: int, k: int, acc: List[int]) -> None:
        if len(found) >= 20000:
            return
        if k == 0:
            if a == n:
                found.append(list(acc))
            return
        for b in range(a + 1, min(lim[a], a + m) + 1):
            if reach[k - 1][b] <= m:
                acc.append(b - a)
                walk(b, k - 1, acc)
                acc.pop()

    walk(0, pp, [])
    found.sort(key=lambda c: _balance_key(layout, c))
    return found[:limit]


def format_partition(counts: Sequence[int]) -> str:
    return ",".join(str(c) for c in counts)


def check_partition(config, partition: Optional[str], pp: Optional[int] = None) -> List[int]:
    """Layer counts of ``partition`` (None: vLLM's default split for ``pp``) after checking
    it against the model's sharing rules; PPPartitionError naming the problem and a legal
    ``VLLM_PP_LAYER_PARTITION`` otherwise. The plugin calls this at model build."""
    layout = config if isinstance(config, Layout) else layout_from_config(config)
    if partition is None:
        if pp is None:
            raise PPPartitionError("check_partition: give a partition string or the pipeline-parallel size")
        counts, what = vllm_default_partition(layout.num_layers, pp), f"vLLM's default split (no {ENV_VAR})"
    else:
        pp = pp or len(str(partition).split(","))
        counts, what = parse_partition(partition, layout.num_layers, pp), f"{ENV_VAR}={partition}"
    reasons = violations(layout, counts)
    if not reasons:
        return counts
    best = best_partitions(layout, pp)
    hint = (f"use {ENV_VAR}={format_partition(best[0])}" if best else
            f"no legal split of {layout.num_layers} layers into {pp} stages exists; use a smaller "
            f"--pipeline-parallel-size")
    raise PPPartitionError(f"{layout.name}: pipeline partition {format_partition(counts)} ({what}) is not "
                           f"legal: {'; '.join(reasons)}. {hint} (dsv4-ops pp-partition lists the options)")


def check_vllm_config(vllm_config) -> Optional[List[int]]:
    """The model-build check: the partition vLLM will use for this config (env variable or
    default), checked; None when PP is 1. Reads the env variable as vLLM does."""
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp <= 1:
        return None
    return check_partition(vllm_config.model_config.hf_config, os.environ.get(ENV_VAR), pp)


def report(config, pp: int) -> str:
    """The text ``dsv4-ops pp-partition`` prints: best legal values, where stages may start
    and why not elsewhere, and the verdict on vLLM's default split."""
    layout = config if isinstance(config, Layout) else layout_from_config(config)
    n = layout.num_layers
    lines = [f"{layout.name}: {n} layers, --pipeline-parallel-size {pp}"]
    if layout.shares:
        lines.append(f"KV sources {list(layout.kv_sources)}, index sources {list(layout.index_sources)}"
                     + (f", candidate source {layout.candidate_source}" if layout.candidate_source >= 0 else ""))
    else:
        lines.append("no cross-layer KV sharing: every split is legal")
    best = best_partitions(layout, pp)
    if best:
        lines.append("legal, most balanced (best first):")
        for c in best:
            note = "" if keeps_decoder_replay(layout, c) else "  (decoder replay off: last KV source not on the last stage)"
            lines.append(f"  {ENV_VAR}={format_partition(c)}{note}")
    else:
        lines.append(f"no legal partition of {n} layers into {pp} stages")
    if layout.shares:
        lim = list(layout.limits)
        starts = [a for a in range(1, n) if lim[a] > a]
        lines.append(f"a stage may start only at layers {[0] + starts}; elsewhere a compressed layer would lose a source:")
        groups: Dict[Tuple[int, str], List[int]] = {}
        for a in range(1, n):
            if lim[a] == a:
                src, what, _ = next(nd for nd in layer_needs(layout, a) if nd[0] < a)
                groups.setdefault((src, what), []).append(a)
        for (src, what), starts_ in groups.items():
            lines.append(f"  not at layers {starts_[0]}-{starts_[-1]}: they read the {what} of layer {src}")
    default = vllm_default_partition(n, pp)
    why = violations(layout, default)
    lines.append(f"vLLM's default without {ENV_VAR}: {format_partition(default)} -> "
                 + ("legal" if not why else "ILLEGAL: " + "; ".join(why)))
    return "\n".join(lines)
