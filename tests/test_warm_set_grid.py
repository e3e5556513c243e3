"""The warm set over the configurations users run: decode and draft steps scanned over TP, the SM
count, max_model_len and the speculative config, every dispatched launch key inside the set built
for that configuration (tests/test_warm_set.py checks one configuration in depth).

Grid: TP (1, 2, 4, 8) x SM counts (the capability table's devices: A30 56, A100 / A800 108 on sm_80;
A10 72, RTX 3090 82, A40 / A6000 84 on sm_86; AGX Orin 16 on sm_87; and the green-context /
H200 counts 104, 108, 112, 132) x max_model_len (4K, 32K, 128K, 1M) x speculative configs (none,
MTP k = 1 / 3, DSpark k = 1 / 3 / 5) x model (V4, V4.1): 4 x 9 x 4 x 6 x 2. CI runs a fixed
sample of 12 rows (``GRID``): row i takes each axis' value at index (i * stride) mod its length
with strides coprime to the lengths (TP 1, SMs 2, length 1 after i // 4, spec 1, model i // 6), so
every value of every axis appears; ``DSV4_GRID_ALL=1`` runs every row (slow, for a release).

The scan is built here, not from the set's own call list: the rows a request has (1 and k + 1 with
speculation), the window widths a decode passes (the window, and DSpark's non-causal draft block
ceil((window + k) / 64) * 64), every layer kind, with and without SWA lengths, token counts 1..40
and every 7th up to the batch limit, the indexer's decode logits at each count for every row count a request has (called here with
the test's own next_n, as vLLM's sparse indexer calls it). The set is built
from the shapes alone (``shapes_from_vllm_config`` is tested in test_warm_set.py).
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest

pytest.importorskip("vllm", reason="the warm set traces the plugin's entry points")

from dsv4_ops.vllm import warm_set as ws  # noqa: E402

TPS = (1, 2, 4, 8)
SMS = (16, 56, 72, 82, 84, 104, 108, 112, 132)
LENS = (4096, 32768, 131072, 1 << 20)
SPECS = (("none", 0), ("mtp", 1), ("mtp", 3), ("dspark", 1), ("dspark", 3), ("dspark", 5))
MODELS = ("v4", "v41")
MAX_TOKENS = 64
WINDOW = 128


def _row(i):
    return (TPS[i % 4], SMS[(2 * i) % len(SMS)], LENS[(i + i // 4) % 4], SPECS[i % 6], MODELS[(i // 6 + i) % 2])


# Rows where DSpark's draft width (192 at window 128) changes a decode plan, found by scanning the
# whole grid's decode steps with and without that width (the sample above holds none of them):
# V4 at TP 8 and 4K at every SM count, V4.1 at TP 2 on 112 SMs, V4 / V4.1 at TP 4 and 8 on 16 or 56.
WIDTH_ROWS = [(8, 132, 4096, ("dspark", 3), "v4"), (2, 112, 32768, ("dspark", 5), "v41"),
              (4, 16, 1 << 20, ("dspark", 1), "v41")]

if os.environ.get("DSV4_GRID_ALL") == "1":
    GRID = list(itertools.product(TPS, SMS, LENS, SPECS, MODELS))
else:
    GRID = [_row(i) for i in range(12)] + WIDTH_ROWS


def test_the_sample_covers_every_value():
    for axis, values in enumerate((TPS, SMS, LENS, SPECS, MODELS)):
        assert {r[axis] for r in GRID} >= set(values), (axis, values)


def shapes_for(tp, max_model_len, spec, model):
    method, k = spec
    kw = dict(tp=tp, max_model_len=max_model_len)
    if k:
        kw["next_n"] = (1, 1 + k)
    if method == "dspark":
        kw["draft_windows"] = (-(-(WINDOW + k) // 64) * 64,)
    return (ws.v41_flash if model == "v41" else ws.v4_flash)(**kw)


def scan_calls(shapes, spec):
    method, k = spec
    widths = [WINDOW] + ([-(-(WINDOW + k) // 64) * 64] if method == "dspark" else [])
    counts = sorted(set(range(1, 41)) | set(range(41, MAX_TOKENS + 1, 7)) | {MAX_TOKENS})
    kinds = shapes.decode_layer_kinds()
    calls = [functools.partial(ws.decode_step, shapes, T, K1, "portable", with_len, "auto", ratio, K2)
             for T in counts for K1, ratio in kinds for K2 in widths for with_len in (False, True)]
    rows = (1, 1 + k) if k else (1,)
    calls += [functools.partial(decode_logits, shapes, T, n) for T in counts for n in rows if T % n == 0]
    return calls


def decode_logits(shapes, T, next_n):
    """The decode indexer's logits of T query rows, next_n a request: context lengths [B] and, with
    next_n > 1, [B, next_n]; max_model_len / ratio columns; block_size / ratio tokens a cache block."""
    import torch

    from dsv4_ops.vllm import indexer as vidx

    B, Hi, D = T // next_n, shapes.index_heads, ws.INDEXER_DIM
    for ratio in shapes.index_ratios:
        bs = max(1, shapes.block_size // ratio)
        cols = -(-shapes.max_model_len // ratio)
        cache = ws._meta((shapes.num_blocks, bs, 1, D + 4), torch.uint8)
        for ctx in {(B,), (B, next_n) if next_n > 1 else (B,)}:
            vidx.fp8_fp4_paged_mqa_logits((ws._meta((B, next_n, Hi, D), torch.float8_e4m3fn), None), cache,
                                          ws._meta((T, Hi), torch.float32), ws._meta(ctx, torch.int32),
                                          ws._meta((B, -(-cols // bs)), torch.int32), None, cols)


@pytest.mark.parametrize("tp,sms,max_model_len,spec,model", GRID,
                         ids=lambda v: v[0] + str(v[1]) if isinstance(v, tuple) else str(v))
def test_decode_and_draft_steps_are_warm(tp, sms, max_model_len, spec, model):
    shapes = shapes_for(tp, max_model_len, spec, model)
    warm = ws.build(shapes, MAX_TOKENS, sms=sms, mode="auto")
    seen = ws.trace(scan_calls(shapes, spec), sms)
    missing = sorted(k.label() for k in seen - warm.keys)
    assert not missing, f"{model} TP {tp}, {sms} SMs, {max_model_len} tokens, {spec}: {missing[:3]}"
