"""End-to-end driver for DeepSeek-V3.2: vLLM's own ``DeepseekV32ForCausalLM``
with the plugin, on a tiny checkpoint written by transformers and read by vLLM's loader; every
step's logits against transformers' model in float64 on the same weights."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# A token whose smallest float64 routing margin (top-k gate score minus the next one, over the MoE
# layers) is at most this may pick another expert in bf16: its logits are left out (V4's e2e: the
# choice must match where the margin > 0.02). The scheduled run passes its own (``route_margin``).
ROUTE_MARGIN = 0.02
# With the fp8_ds_mla cache the attention output the router sees carries the E4M3 rounding, which
# the oracle models in float64 and the bf16 path rounds again: margins up to about 0.022 can flip
# an expert there (measured over fresh seeds; RESULTS of the e2e runs), so the cut is wider.
ROUTE_MARGIN_FP8 = 0.03


def cfg_topk(ckpt: str) -> int:
    with open(os.path.join(ckpt, "config.json")) as f:
        return int(json.load(f)["index_topk"])


def prepare(device: str, cache_dtype: str, family: str = "v32") -> dict:
    """The model with the plugin, its recorders and the float64 oracle (the steps are the
    caller's: ``run`` below, or vLLM's scheduler in sched_driver.py)."""
    import build
    import steps
    import v32_checkpoint

    import importlib

    import standins_v32
    standins_v32.install()

    import vllm.models.deepseek_v32 as v32_pkg
    if device == "cpu":
        import platform_spoof
        platform_spoof.cpu_cuda_attention_selector()
        # register() ran before the CPU run's is_cuda() answered True, so it had no CUDA selector
        # to offer the backend to; do now what it does on a CUDA host
        from dsv4_ops.vllm import plugin, v32_backend
        v32_backend.check_registration(plugin.VllmPatchError)
        v32_backend.install()
    from dsv4_ops.vllm import v32_backend
    assert v32_backend.installed(), f"the sm_8x sparse-MLA backend is not registered (missing ops: {v32_backend.missing_ops()})"
    # the package binds its classes by is_cuda() at import; the plugin's register() may have
    # imported it before the CPU run's is_cuda() answered True
    importlib.reload(v32_pkg)
    if device == "cpu":
        import vllm.model_executor.layers.attention.sparse_mla_attention  # noqa: F401
        platform_spoof.cpu_no_pinned_memory()
        platform_spoof.cpu_vllm_streams()
    report = dict(model=family, device=device, cache_dtype=cache_dtype,
                  model_class=v32_pkg.DeepseekV32ForCausalLM.__module__)
    # dead on sm_80 per the audit of these models (its dead rows), fp8 Triton launches, replaced
    # originals still bound: raise the moment the run reaches one
    import tripwire
    from dsv4_ops.vllm import plugin as _plugin
    import driver
    driver.mark("imports")
    report["tripwire"] = tripwire.install(family, _plugin.STATE.originals, models=("v32", "glm5"))
    driver.mark("tripwire")
    ckpt = v32_checkpoint.write(family)
    cfg = dict(architectures=[v32_checkpoint.FAMILIES[family][1]])
    b = build.build(cfg, device, model_dir=ckpt, cache_dtype=cache_dtype)
    driver.mark("build")
    cc = b.vllm_config.cache_config
    report["model_type"] = b.vllm_config.model_config.hf_config.model_type
    report["resolved"] = dict(block_size=cc.block_size, cache_dtype=str(cc.cache_dtype),
                              groups=[type(g.kv_cache_spec).__name__ for g in b.kv_cache_config.kv_cache_groups],
                              backends=sorted({type(g.backend).__name__ if hasattr(g, "backend") else str(g)
                                               for gs in b.attn_groups for g in gs}))
    import counters
    counters.install_ops()
    import checks_v32
    choice = checks_v32.IndexerChoice(b.model, cc.block_size, cfg_topk(ckpt))
    import vllm.models.deepseek_v32.attention as v32_attention
    v32_attention.fused_q = choice.wrap_fused_q(v32_attention.fused_q)
    mqa = checks_v32.MqaRecorder(choice)
    mqa.install(type(b.model.model.layers[0].self_attn.impl))
    oracle = v32_checkpoint.oracle(ckpt, fp8_latent=str(cc.cache_dtype) == "fp8_ds_mla", family=family)
    report["checks"] = []
    driver.mark("oracle")
    return dict(report=report, built=b, choice=choice, mqa=mqa, oracle=oracle, runner=steps.Scheduler(b))


def check_logits(ctx: dict, name: str, rows: list, logits) -> None:
    """rows: [(rid, the request's tokens up to this step's last, first position, n)] in batch order;
    each request's rows of ``logits`` against the float64 oracle over its tokens."""
    import torch
    import v32_checkpoint

    report, row = ctx["report"], 0
    fp8 = report.get("resolved", {}).get("cache_dtype") == "fp8_ds_mla"
    cut = ctx.get("route_margin", ROUTE_MARGIN_FP8 if fp8 else ROUTE_MARGIN)
    routes = ctx.get("routes")
    if routes is not None:
        routes.remember([(tokens, start + j) for _, tokens, start, n in rows for j in range(n)])
    for rid, tokens, start, n in rows:
        if routes is not None:
            got = logits[row:row + n].double().cpu()
            row += n
            report["checks"].append(dict(step=name, rid=rid, tokens=n, **teacher_forced(ctx, tokens, start, got, cut)))
            continue
        ref, margin = v32_checkpoint.oracle_logits(ctx["oracle"], tokens)
        # near-ties among the earlier tokens of the request: one that routed differently changed
        # their KV, which these rows attend to (reported: the scheduled test bounds them apart)
        context_ties = int((margin[:start] <= cut).sum())
        ref, margin = ref[start:], margin[start:]
        got = logits[row:row + n].double().cpu()
        row += n
        # a token whose expert choice is a near-tie in float64 may route differently in bf16
        # (V4's e2e: the choice must match where the margin > 0.02); those rows are reported
        # and left out of the comparison
        clear = margin > cut
        near_ties = int((~clear).sum())
        if not clear.any():
            report["checks"].append(dict(step=name, rid=rid, tokens=n, near_ties=near_ties, context_ties=context_ties,
                                         skipped=True))
            continue
        got, ref = got[clear], ref[clear]
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        report["checks"].append(dict(step=name, rid=rid, tokens=n, near_ties=near_ties, context_ties=context_ties,
                                     cos=cos, rel_max=rel,
                                     argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).double().mean())))


def teacher_forced(ctx: dict, tokens: list, start: int, got, cut: float) -> dict:
    """One request's rows [start, len(tokens)) of a step against the oracle teacher-forced on
    vLLM's expert choice (checks_v32.RouteRecorder): at every MoE layer, a token whose float64
    routing margin is at most ``cut`` takes vLLM's experts (either choice is valid there: bf16
    router noise may reorder keys that close); every other token of the step must have chosen the
    oracle's experts (checks.route_check, the V4 e2e's rule). Every row is compared."""
    import torch
    import checks
    import v32_checkpoint

    k = int(ctx["oracle"].config.num_experts_per_tok)
    forced = ctx["routes"].forced(tokens, k)
    ref, margin = v32_checkpoint.oracle_logits(ctx["oracle"], tokens, forced, cut)
    mismatch = step_forced = context_forced = 0
    key_spread, flips = 0.0, []
    vllm_logits = ctx["routes"].router_logits(tokens, start)
    for i, r in ctx["oracle"]._routes.items():
        used = forced[i][start:]
        assert bool((used >= 0).all()), f"layer {i}: vLLM's choice of a row of this step was not recorded"
        m, clear = checks.route_check(used, r["own"][start:], r["margin"][start:], cut)
        assert torch.equal(r["taken"][start:], ~clear), f"layer {i}: a near-tie row of this step not teacher-forced"
        mismatch += m
        step_forced += int((~clear).sum())
        context_forced += int(r["taken"][:start].sum())
        # vLLM's router keys minus the oracle's (the bias cancels): two experts' keys can trade places
        # only where the margin is below the spread of that difference over the row's experts
        err = vllm_logits[i].double().sigmoid() - r["logits"][start:].double().sigmoid()
        key_spread = max(key_spread, float((err.max(-1).values - err.min(-1).values).max()))
        differs = (used.sort(1).values != r["own"][start:].long().sort(1).values).any(1)
        flips += [round(float(v), 5) for v in r["margin"][start:][differs]]
    ref = ref[start:]
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    return dict(near_ties=0, context_ties=int((margin[:start] <= cut).sum()), route_mismatch=mismatch,
                teacher_forced=step_forced, context_forced=context_forced,
                route_rows=len(forced) * (len(tokens) - start),
                margins=[round(float(v), 5) for v in margin[start:]], key_spread=key_spread, flips=flips,
                cos=cos, rel_max=rel,
                argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).double().mean()))


def finish(ctx: dict) -> dict:
    """The run's recorders and counters into the report."""
    import counters
    import standins
    import tripwire

    report, b, choice = ctx["report"], ctx["built"], ctx["choice"]
    report["mqa"] = list(ctx["mqa"].results)
    report["indexer_choice"] = list(choice.results)
    report["index_topk"] = choice.topk
    report["ops_called"] = dict(counters.OPS)
    report["tripped"] = list(tripwire.TRIPPED)
    report["triton_launches"] = dict(tripwire.LAUNCHES)
    report["standin_calls"] = dict(standins.CALLS)
    import driver
    driver.mark("steps")
    report["phases"] = dict(driver.PHASES)
    report["indexer_layers"] = [i for i, l in enumerate(b.model.model.layers)
                                if getattr(l.self_attn, "indexer", None) is not None]
    report["impl_classes"] = sorted({type(l.self_attn.impl).__module__ + "." + type(l.self_attn.impl).__name__
                                     for l in b.model.model.layers})
    return report


def run(device: str, cache_dtype: str, family: str = "v32", prompt_len: int = 40, long_prompt_len: int = 0) -> dict:
    """The four steps on two requests (request 0's prompt ``prompt_len``), checked; with
    ``long_prompt_len``, then the same four steps on two new requests of the same built model
    whose first prompt is that long (past index_topk: the indexer selects), reported apart as
    ``report["long"]`` (its attention and indexer choice are checked, not its logits: the float64
    indexer may choose other keys than vLLM's E4M3 one on close scores)."""
    import torch

    ctx = prepare(device, cache_dtype, family)
    report = ctx["report"]
    seed = int(os.environ.get("DSV4_E2E_SEED") or int.from_bytes(os.urandom(4), "little"))
    report["seed"] = seed
    g = torch.Generator().manual_seed(seed)
    run_plan(ctx, g, (0, 1), prompt_len, logits=True)
    finish(ctx)
    if long_prompt_len:
        import tripwire

        # the recorders' lists start empty for the second plan; the first plan's stay in the report
        for rec in (ctx["mqa"].results, ctx["choice"].results):
            rec.clear()
        launches, tripped = dict(tripwire.LAUNCHES), len(tripwire.TRIPPED)
        run_plan(ctx, g, (2, 3), long_prompt_len, logits=False)
        report["long"] = dict(
            model=family, seed=seed, prompt_len=long_prompt_len, index_topk=ctx["choice"].topk,
            mqa=list(ctx["mqa"].results), indexer_choice=list(ctx["choice"].results),
            indexer_layers=report["indexer_layers"], tripwire=report["tripwire"],
            tripped=tripwire.TRIPPED[tripped:],
            triton_launches={k: v - launches.get(k, 0) for k, v in tripwire.LAUNCHES.items() if v > launches.get(k, 0)})
        import driver
        driver.mark("long")
        report["phases"] = dict(driver.PHASES)
    return report


def run_plan(ctx: dict, g, rids, prompt_len: int, logits: bool) -> None:
    """prefill, mixed, decode1, decode2 on two new requests ``rids`` (the first's prompt
    ``prompt_len``, the second's 12); the recorders check every step, and with ``logits`` every
    step's logits are checked against the float64 oracle."""
    import torch

    choice, sch = ctx["choice"], ctx["runner"]
    r0, r1 = rids
    P0, P1 = prompt_len, 12   # a prompt longer than index_topk (128) makes the indexer choose
    vocab = 512
    sch.add(r0, torch.randint(2, vocab, (P0 + 4,), generator=g).tolist())
    sch.add(r1, torch.randint(2, vocab, (P1 + 4,), generator=g).tolist())
    plan = [("prefill", [(r0, P0)]), ("mixed", [(r0, 1), (r1, P1)]), ("decode1", [(r0, 1), (r1, 1)]),
            ("decode2", [(r0, 1), (r1, 1)])]
    for name, schedule in plan:
        t = time.time()
        starts = {rid: sch.requests[rid].computed for rid, _ in schedule}
        toks = [(rid, sch.requests[rid].computed + j) for rid, n in schedule for j in range(n)]
        for rid, n in schedule:
            sch._ensure_blocks(sch.requests[rid], sch.requests[rid].computed + n)
        choice.set_step(name, toks, {rid: list(sch.requests[rid].blocks[0]) for rid, _ in schedule})
        hidden, step_logits, bt = sch.step(schedule)
        if logits:
            check_logits(ctx, name, [(rid, sch.requests[rid].tokens[: starts[rid] + n], starts[rid], n)
                                     for rid, n in schedule], step_logits)
        print(f"step {name} {time.time() - t:.1f}s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-dtype", default=None)
    ap.add_argument("--family", default="v32", choices=("v32", "glm5"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompt-len", type=int, default=40, help="request 0's prompt (> 128: the indexer selects)")
    ap.add_argument("--long-prompt-len", type=int, default=0,
                    help="then a second plan on the same model whose first prompt is this long (report['long'])")
    a = ap.parse_args(argv)
    import driver

    driver.setup(a.device)
    report = run(a.device, a.cache_dtype, a.family, a.prompt_len, a.long_prompt_len)
    text = json.dumps(report, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
