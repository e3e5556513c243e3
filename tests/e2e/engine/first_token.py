"""Check (b) of the engine run: the float64 first token of every prompt of run_engine.py, from a
whole-prompt causal forward of the checkpoint directory itself, by transformers' own model
classes (the references tests/e2e/oracle.py is checked against): ``DeepseekV4ForCausalLM``
(its conversion mapping reads the original tensor names) and ``DeepseekV32ForCausalLM``
(v32_checkpoint.oracle; "v32" as is, for the default bf16 cache, "v32_fp8" with the fp8_ds_mla
rounding of the KV latent, for ``--kv-cache-dtype fp8``; V4's fp8 records are not modelled).
V4.1 has no transformers model: not covered. Not modelled either: the fp8 indexer keys, and
near-tie MoE routing upstream ("route_margin": the smallest V3.2 routing gap over all positions
and layers, for the record).

    python tests/e2e/engine/first_token.py CKPT_ROOT OUT.json [v4 v32 v32_fp8]

OUT.json: {model: [{"len": prompt length, "top": [argmax, runner-up], "margin": logit gap}]}.
The checkpoints are the bytes the device rewrites from the manifest (test_checkpoints.py), so
this runs on the CPU machine and travels in the bundle; summary.py compares it with the run.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

def dense_len(cfg: dict) -> int:
    """The longest prompt whose every position attends to all its keys without the indexer's
    top-k choosing (V3.2: index_topk tokens; V4: index_topk compressed entries of the CSA ratio).
    Past it the engine's selection runs on fp8 indexer keys, which this oracle does not model:
    on the CPU reference path (vLLM's scheduler + the model e2e, an 800-token V3.2 prompt) rows
    up to position 128 match float64 (cos >= 0.9976) and rows past it do not (cos down to 0.44),
    so there the comparison is reported, not checked."""
    ratio = (cfg.get("compress_rates") or {}).get("compressed_sparse_attention", 1)
    return int(cfg["index_topk"]) * int(ratio)


# A first token counts only where the float64 top-2 gap exceeds this many logits: the engine
# runs bf16 weights/activations and fp8 KV entries (tiny random models: logit std about 1).
CLEAR_MARGIN = 0.1


def load(ckpt: str, model: str):
    """transformers' model on the checkpoint, float64, eval; raises if any tensor went unread."""
    from transformers import AutoModelForCausalLM

    m, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, experts_implementation="eager",
                                                   attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"{model}: transformers did not read the checkpoint cleanly: {bad}")
    return m.eval()


def first_tokens(ckpt: str, model: str) -> list:
    from run_engine import prompts

    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    if model.startswith("v32"):
        import v32_checkpoint

        m = v32_checkpoint.oracle(ckpt, fp8_latent=model == "v32_fp8")
    else:
        m = load(ckpt, model)
    out = []
    for p in prompts(cfg["vocab_size"]):
        if model.startswith("v32"):
            lg, rm = v32_checkpoint.oracle_logits(m, p)
            lg, rm = lg[-1].double(), float(rm.min())
        else:
            with torch.no_grad():
                lg = m(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1].double()
            rm = None
        v, i = lg.topk(2)
        out.append(dict(len=len(p), top=i.tolist(), margin=float(v[0] - v[1]), route_margin=rm,
                        selection_free=len(p) <= dense_len(cfg)))
    return out


def agreement(oracle: list, tokens: list, clear: float = CLEAR_MARGIN) -> dict:
    """Compare the run's first generated tokens with the oracle: counts over the prompts whose
    margin is clear and which need no indexer selection (``selection_free``: checked), the
    indices that disagree there, and the same for the indexer-selected prompts (reported)."""
    firsts = [t[0] if t else None for t in tokens]
    n = min(len(oracle), len(firsts))
    clear_idx = [i for i in range(n) if oracle[i]["margin"] > clear]
    free = [i for i in clear_idx if oracle[i].get("selection_free", True)]
    sel = [i for i in clear_idx if i not in free]
    wrong = [i for i in free if firsts[i] != oracle[i]["top"][0]]
    sel_wrong = [i for i in sel if firsts[i] != oracle[i]["top"][0]]
    return dict(clear=len(free), agree=len(free) - len(wrong), wrong=wrong,
                unclear=[i for i in range(n) if i not in clear_idx],
                runner_up_where_wrong=[firsts[i] == oracle[i]["top"][1] for i in wrong],
                selected=len(sel), selected_agree=len(sel) - len(sel_wrong), selected_wrong=sel_wrong)


def main(argv) -> int:
    root, out = argv[0], argv[1]
    res = {m: first_tokens(os.path.join(root, m.split("_")[0]), m) for m in (argv[2:] or ["v4", "v32", "v32_fp8"])}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for m, r in res.items():
        print(m, [(o["top"][0], round(o["margin"], 3)) for o in r])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
