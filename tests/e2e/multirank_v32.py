"""The DeepSeek-V3.2 / GLM-5 ranks of the multi-rank end-to-end run (``multirank.py --model v32``
or ``--model glm5``): vLLM's ``DeepseekV32ForCausalLM`` (GLM-5's class too) at tensor parallel
``--tp`` over gloo, the plugin on the Ampere path, one process a rank (forked by
``multirank.run_jobs`` like the V4 ranks).

The rank is the one-rank V3.2 e2e (driver_v32.py: its model preparation, recorders and float64
oracle, unchanged) built at this rank (``build.build`` given ``tp`` / ``rank`` / the gloo address)
on one checkpoint every run of the family loads (written by the family's one-rank run), with the
multirank seed, plus the checks only a rank's share has:

- ``attn``: the rank's attention partial (its own heads' query through ``q_b_proj``'s rows, the
  latent attention over the cache rows the indexer chose, ``W_UV`` and its columns of ``o_proj``:
  the tensor vLLM's fused all-reduce + RMSNorm takes) against float64 from the layer's input,
  row by row within the rounding-model bound (bounds.py's propagation, written out for MLA's
  absorbed path);
- the TP all-reduces: every one of the step in order (the embedding's, then per layer the
  attention's and the MLP's partial, each exactly once), the reduced value within one bf16
  rounding of the float64 sum of every rank's partial;
- ``mlp`` / ``moe``: the rank's MLP partial (its intermediate columns; the MoE's routed experts
  teacher-forced on vLLM's choice, which must be the float64 one where the router margin is
  clear, and its shared expert) against float64 (test_e2e.py's MoE bounds);
- ``shards``: the rank's q_b_proj / kv_b_proj rows and o_proj columns (its heads), MLP / expert
  columns, vocab rows of the embedding and LM head are the checkpoint's at its offset, and the
  replicated indexer's wq_b the whole checkpoint tensor;
- ``first_input``: layer 0's attention input from the whole (gathered) embedding;
- the one-rank e2e's checks on the rank's own calls (driver_v32 / checks_v32: every sparse-MLA
  call over the cache bytes on the rank's heads, every indexer choice, every cache row) and, on
  TP rank 0 (the ranks' logits are compared bitwise), the gathered logits against transformers'
  float64 model.
The trace (logits, each layer's attended rows, each MoE layer's experts, per token) goes into the
report for the cross-run comparison (test_e2e_multirank.py).
"""

from __future__ import annotations

import functools
import os
import shutil
import time

import torch

F64 = torch.float64
CACHE_DTYPES = {"v32": "auto", "glm5": "fp8"}   # as test_e2e_v32.py runs them (GLM-5: fp8 -> fp8_ds_mla)
PROMPTS = (40, 12)                               # request 0's and 1's prompt (driver_v32.run_plan's)


def _w(t):
    return t.detach().cpu().to(F64)


def _param(mod, suffix: str):
    """The one parameter of ``mod`` whose name ends with ``suffix`` (the fused MoE keeps its
    expert weights a level or two down: MoERunner)."""
    (p,) = [p for n, p in mod.named_parameters() if n.endswith(suffix)]
    return p


# --------------------------------------------------------------------------------- recording
class Sites:
    """Each layer's attention input / partial output and MLP input / partial output of the step,
    and each layer's sparse-MLA calls (the rows attended and the cache read)."""

    def __init__(self, model, impl_cls):
        self.attn, self.mlp, self.mqa = {}, {}, {}
        for i, layer in enumerate(model.model.layers):
            self._hook(layer.self_attn, i, self.attn)
            self._hook(layer.mlp, i, self.mlp)
        orig = impl_cls._forward_mqa_kernel
        sites = self

        def wrapped(self_, q, kv_cache, topk_indices, valid_counts, **kw):
            T = (q[0] if isinstance(q, tuple) else q).shape[0]
            li = int(kw["layer"].layer_name.split("layers.")[1].split(".")[0])
            sites.mqa.setdefault(li, []).append((topk_indices[:T].detach().cpu().clone(), kv_cache))
            return orig(self_, q, kv_cache, topk_indices, valid_counts, **kw)

        impl_cls._forward_mqa_kernel = wrapped

    @staticmethod
    def _hook(mod, i, into):
        def pre(m, args, kwargs):
            # self_attn(positions=, hidden_states=) (the decoder layer's call); mlp(hidden_states)
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[-1]
            pos = kwargs.get("positions", args[0] if len(args) == 2 else None)
            into[i] = dict(x=x.detach().cpu().clone(), positions=None if pos is None else pos.detach().cpu().clone())

        def post(m, args, kwargs, out):
            into[i]["out"] = (out[0] if isinstance(out, tuple) else out).detach().cpu().clone()

        mod.register_forward_pre_hook(pre, with_kwargs=True)
        mod.register_forward_hook(post, with_kwargs=True)

    def clear(self):
        self.attn.clear()
        self.mlp.clear()
        self.mqa.clear()


# --------------------------------------------------------------------------------- float64 checks
def _hlin(w, x, vx):
    """Per head y[t,h,:] = x[t,h,:] @ w[:,h,:] (w [n, H, m]: vLLM's W_UK / W_UV layout) and Var(y)."""
    import bounds as B

    y = torch.einsum("thn,nhm->thm", x, w)
    n = w.shape[0]
    vy = torch.einsum("thn,nhm->thm", vx, w * w) + n * B.V_ACC * torch.einsum("thn,nhm->thm", x * x, w * w) + B.rv(y)
    return y, vy


def check_attention(attn, rec, calls, tp_rank: int) -> dict:
    """The rank's attention partial against float64 from the layer input (see the module doc).
    The rounding model: bf16 x exact; fused_qkv_a_proj, q_a_layernorm, q_b_proj, the W_UK
    absorption, q_pe's RoPE, the attention over the cache rows (read as bf16 / decoded from the
    fp8_ds_mla bytes, exact), W_UV and o_proj each round to bf16 (bounds.py)."""
    import bounds as B
    import checks_v32
    import oracle as O
    import writer_checks as WC

    x, positions, got = rec["x"].to(F64), rec["positions"], rec["out"].to(F64)
    T = x.shape[0]
    idx = torch.cat([c[0] for c in calls])
    assert idx.shape[0] == T, (idx.shape, T)
    keys = checks_v32.decode_rows(calls[0][1].cpu(), idx)                 # [T, K, 576]
    valid = idx >= 0
    H, P, R = attn.num_local_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    L, V, qlr = attn.kv_lora_rank, attn.v_head_dim, attn.q_lora_rank
    with B.one_thread():
        wa = _w(attn.fused_qkv_a_proj.weight)[:qlr]
        qc, v = B._lin(wa, x, torch.zeros_like(x))
        qc, v = B._rms(qc, v, _w(attn.q_a_layernorm.weight), attn.q_a_layernorm.variance_epsilon)
        q, vq = B._lin(_w(attn.q_b_proj.weight), qc, v)
        q, vq = q.view(T, H, P + R), vq.view(T, H, P + R)
        kvb = _w(attn.kv_b_proj.weight).T.reshape(L, H, P + V)           # split_kv_b_proj's view
        w_uk, w_uv = kvb[..., :P], kvb[..., P:]
        ql, vql = _hlin(w_uk.permute(2, 1, 0), q[..., :P], vq[..., :P])   # q_nope W_UK^T: [T, H, L]
        cos, sin = WC.cos_sin(attn.rotary_emb, positions)
        qpe = O.rope_interleaved(q[..., P:], cos, sin)
        vqpe = B._rope_var(vq[..., P:], cos, sin, qpe)
        qf, vqf = torch.cat((ql, qpe), -1), torch.cat((vql, vqpe), -1)
        o, vo = B.attention_variance(qf, vqf, keys, valid, None, float(attn.impl.scale), dv=L)
        ov, vov = _hlin(w_uv, o, vo)
        ref, vref = B._lin(_w(attn.o_proj.weight), ov.reshape(T, H * V), vov.reshape(T, H * V))
        rows = B.row_ratios(got, ref, vref)
    import checks

    return dict(kind="attn", tokens=T, heads=[tp_rank * H, (tp_rank + 1) * H], cos=checks.cosine(got, ref),
                max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()),
                bound_ratio=float(rows.max()), bound_row=int(rows.argmax()), bound_rows_over=int((rows > 1).sum()),
                attended=int(valid.sum()))


def check_mlp(layer, rec, used, hf) -> dict:
    """The rank's MLP partial against float64 from the MLP's input: the dense SwiGLU on the rank's
    intermediate columns, or the MoE (routed experts on vLLM's choice ``used`` [T, k], weighed by
    the float64 router; its shared expert), the choice itself the float64 one where the margin is
    clear (checks.route_check, the V4 e2e's rule)."""
    import checks
    import oracle as O

    mlp = layer.mlp
    x, got = rec["x"].to(F64), rec["out"].to(F64)
    res = dict(tokens=x.shape[0])
    if hasattr(mlp, "gate_up_proj"):
        gu = _w(mlp.gate_up_proj.weight)
        n = gu.shape[0] // 2
        ref = O.swiglu(x, gu[:n], gu[n:], _w(mlp.down_proj.weight), None)
        res.update(kind="mlp", choice_mismatch=0)
    else:
        w13, w2 = _w(_param(mlp.experts, "w13_weight")), _w(_param(mlp.experts, "w2_weight"))
        n = w2.shape[-1]
        sh = mlp.shared_experts
        su = _w(sh.gate_up_proj.weight)
        m = su.shape[0] // 2
        shared = (su[:m], su[m:], _w(sh.down_proj.weight))
        experts = (w13[:, :n], w13[:, n:], w2)
        bias = getattr(mlp.gate, "e_score_correction_bias", None)
        bias = None if bias is None else _w(bias)
        scoring = getattr(hf, "scoring_func", "sigmoid")
        _, chosen, margin = O.moe(x, _w(mlp.gate.weight), bias, experts, shared, hf.num_experts_per_tok,
                                  hf.routed_scaling_factor, scoring=scoring, norm_topk_prob=hf.norm_topk_prob,
                                  swiglu_limit=None)
        mismatch, clear = checks.route_check(used, chosen, margin)
        scores = O.router_scores(x @ _w(mlp.gate.weight).T, scoring)
        ref, _ = O._moe_combine(x, scores, used.long(), experts, shared, hf.routed_scaling_factor,
                                hf.norm_topk_prob, None, None)
        res.update(kind="moe", choice_mismatch=mismatch, clear_rows=int(clear.sum()),
                   margins=[round(float(m), 6) for m in margin])
    res.update(cos=checks.cosine(got, ref), max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()))
    return res


def check_allreduces(calls, sites, n_layers: int, tp_group) -> list:
    """The step's TP all-reduces in call order: [the embedding's, then per layer attention, MLP];
    each sublayer's partial (the tensor its hook saw leave the module) is the input of exactly one,
    whose output is within one bf16 rounding of the float64 sum of every rank's partial."""
    tp = tp_group.world_size
    out = []
    for i in range(n_layers):
        for kind, rec in (("attn", sites.attn[i]), ("mlp", sites.mlp[i])):
            part = rec["out"]
            hits = [c for c in calls if c[0].shape == part.shape and torch.equal(c[0].cpu(), part)]
            row = dict(layer=i, kind="allreduce", site=kind, allreduces=len(hits), reduce_ratio=0.0)
            if tp > 1:
                # every rank's partial summed in float64 (every rank runs this in the same order)
                s, mag = part.to(F64).clone(), part.to(F64).abs()
                torch.distributed.all_reduce(s, group=tp_group.cpu_group)
                torch.distributed.all_reduce(mag, group=tp_group.cpu_group)
                if hits:
                    err = (hits[0][1].cpu().to(F64) - s).abs() / ((tp - 1) * 2.0 ** -8 * mag + 1e-30)
                    row["reduce_ratio"] = float(err.max())
            out.append(row)
    return out


def check_first_input(layer0, rec, ids, embed) -> dict:
    """Layer 0's attention input: input_layernorm of the token's row of the whole embedding
    (``embed``: every rank's vocab rows, gathered; the rank's forward looked up its own rows,
    zero elsewhere, and all-reduced them)."""
    import checks
    import oracle as O

    norm = layer0.input_layernorm
    ref = O.rms_norm(embed[ids.cpu().long()], _w(norm.weight), norm.variance_epsilon)
    got = rec["x"].to(F64)
    return dict(kind="first_input", tokens=got.shape[0], cos=checks.cosine(got, ref),
                max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()))


# --------------------------------------------------------------------------------- shards
def shard_checks(model, ckpt: str, tp_rank: int) -> list:
    """The rank's weights are the checkpoint's (transformers' names) at its offset."""
    from safetensors.torch import load_file

    ck = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            ck.update(load_file(os.path.join(ckpt, f)))
    out = []

    def same(name, got, want):
        ok = tuple(got.shape) == tuple(want.shape) and bool(torch.equal(got.detach().cpu().to(want.dtype), want))
        out.append(dict(param=name, ok=ok, shape=list(got.shape)))

    def rows(t, n):
        return t[tp_rank * n:(tp_rank + 1) * n]

    def cols(t, n):
        return t[:, tp_rank * n:(tp_rank + 1) * n]

    for i, layer in enumerate(model.model.layers):
        a, p = layer.self_attn, f"model.layers.{i}."
        H, P, R, V = a.num_local_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        same(p + "self_attn.q_b_proj", a.q_b_proj.weight, rows(ck[p + "self_attn.q_b_proj.weight"], H * (P + R)))
        same(p + "self_attn.kv_b_proj", a.kv_b_proj.weight, rows(ck[p + "self_attn.kv_b_proj.weight"], H * (P + V)))
        same(p + "self_attn.o_proj", a.o_proj.weight, cols(ck[p + "self_attn.o_proj.weight"], H * V))
        if a.indexer is not None:   # replicated: the whole checkpoint tensor on every rank
            same(p + "self_attn.indexer.wq_b", a.indexer.wq_b.weight, ck[p + "self_attn.indexer.wq_b.weight"])
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            n = mlp.down_proj.weight.shape[1]
            same(p + "mlp.gate_proj", mlp.gate_up_proj.weight[:n], rows(ck[p + "mlp.gate_proj.weight"], n))
            same(p + "mlp.down_proj", mlp.down_proj.weight, cols(ck[p + "mlp.down_proj.weight"], n))
        else:
            w13, w2 = _param(mlp.experts, "w13_weight"), _param(mlp.experts, "w2_weight")
            n = w2.shape[-1]
            g = ck.get(p + "mlp.experts.0.gate_proj.weight")
            if g is None:   # transformers' fused expert tensors [E, 2I, D] / [E, D, I]
                gu, dn = ck[p + "mlp.experts.gate_up_proj"], ck[p + "mlp.experts.down_proj"]
                g, d = gu[0, : gu.shape[1] // 2], dn[0]
            else:
                d = ck[p + "mlp.experts.0.down_proj.weight"]
            same(p + "mlp.experts.0.gate", w13[0, :n], rows(g, n))
            same(p + "mlp.experts.0.down", w2[0], cols(d, n))
            sh = mlp.shared_experts
            m = sh.down_proj.weight.shape[1]
            same(p + "mlp.shared_experts.down_proj", sh.down_proj.weight,
                 cols(ck[p + "mlp.shared_experts.down_proj.weight"], m))
    v = model.model.embed_tokens.weight.shape[0]
    same("model.embed_tokens", model.model.embed_tokens.weight, rows(ck["model.embed_tokens.weight"], v))
    v = model.lm_head.weight.shape[0]
    same("lm_head", model.lm_head.weight, rows(ck["lm_head.weight"], v))
    return out


# --------------------------------------------------------------------------------- the rank
def run(a, report, multirank) -> None:
    """One V3.2 / GLM-5 rank (``multirank._run`` for those models; ``multirank``: that module as
    the process runs it, ``__main__`` under ``--jobs``: its all-reduce recorder's list)."""
    import build
    import checks_v32
    import driver
    import driver_v32
    import v32_checkpoint

    family = a.model
    cache = a.cache_dtype or CACHE_DTYPES[family]
    report["planted"] = multirank.plant(a.plant, a.rank)
    done = os.path.join(a.ckpt, "DONE")
    write = v32_checkpoint.write

    def shared_checkpoint(family_=family, seed=0):
        """The family's one checkpoint: the one-rank run writes it (v32_checkpoint.write, then
        moved here), every other run waits for it."""
        if a.write_ckpt:
            tmp = write(family_, seed)
            os.makedirs(a.ckpt, exist_ok=True)
            for f in os.listdir(tmp):
                shutil.move(os.path.join(tmp, f), os.path.join(a.ckpt, f))
            open(done, "w").close()
            driver.mark("checkpoint")
        else:
            t0 = time.time()
            while not os.path.exists(done):
                if time.time() - t0 > 600:
                    raise TimeoutError(f"no checkpoint at {a.ckpt}")
                time.sleep(0.5)
            driver.mark("wait_checkpoint")
        return a.ckpt

    v32_checkpoint.write = shared_checkpoint
    build.build = functools.partial(build.build, tp=a.tp, pp=a.pp, rank=a.rank, init_method=a.init)
    ctx = driver_v32.prepare("cpu", cache, family)
    from vllm.distributed import get_tp_group

    tp_group = get_tp_group()
    tp_rank = tp_group.rank_in_group
    b = ctx["built"]
    model = b.model
    layers = model.model.layers
    hf = b.vllm_config.model_config.hf_config
    sites = Sites(model, type(layers[0].self_attn.impl))
    routes = checks_v32.RouteRecorder(model)
    report["tp_rank"], report["pp_rank"] = tp_rank, 0
    report["layers"] = [model.model.start_layer, model.model.end_layer]
    report["shards"] = shard_checks(model, a.ckpt, tp_rank)
    # the logits against transformers' float64 model: TP rank 0 (rank 1's are compared bitwise)
    oracle_logits = tp_rank == 0
    emb = model.model.embed_tokens.weight.detach()
    embed = (tp_group.all_gather(emb.contiguous(), dim=0) if tp_group.world_size > 1 else emb).to(F64)
    g = torch.Generator().manual_seed(multirank.SEED)
    sch, choice = ctx["runner"], ctx["choice"]
    P0, P1 = PROMPTS
    vocab = hf.vocab_size
    sch.add(0, torch.randint(2, vocab, (P0 + 4,), generator=g).tolist())
    sch.add(1, torch.randint(2, vocab, (P1 + 4,), generator=g).tolist())
    plan = [("prefill", [(0, P0)]), ("mixed", [(0, 1), (1, P1)]), ("decode1", [(0, 1), (1, 1)]),
            ("decode2", [(0, 1), (1, 1)])]
    results, trace = [], []
    for name, schedule in plan:
        t = time.time()
        starts = {rid: sch.requests[rid].computed for rid, _ in schedule}
        toks = [(rid, sch.requests[rid].computed + j) for rid, n in schedule for j in range(n)]
        for rid, n in schedule:
            sch._ensure_blocks(sch.requests[rid], sch.requests[rid].computed + n)
        choice.set_step(name, toks, {rid: list(sch.requests[rid].blocks[0]) for rid, _ in schedule})
        sites.clear()
        routes.last = {}
        multirank.ALLREDUCES.clear()
        hidden, logits, bt = sch.step(schedule)
        if oracle_logits:
            driver_v32.check_logits(ctx, name, [(rid, sch.requests[rid].tokens[: starts[rid] + n], starts[rid], n)
                                                for rid, n in schedule], logits)
        experts = {i: routes.last[i][0] for i in routes.layers}
        results.append(dict(step=name, layer=0, **check_first_input(layers[0], sites.attn[0], bt["input_ids"], embed)))
        for i, layer in enumerate(layers):
            results.append(dict(step=name, layer=i, **check_attention(layer.self_attn, sites.attn[i], sites.mqa[i],
                                                                        tp_rank)))
            results.append(dict(step=name, layer=i, **check_mlp(layer, sites.mlp[i], experts.get(i), hf)))
        calls = [c for v in multirank.ALLREDUCES.values() for c in v]
        for row in check_allreduces(calls, sites, len(layers), tp_group):
            results.append(dict(step=name, **row))
        results.append(dict(step=name, kind="allreduce_count", count=len(calls)))
        assert torch.isfinite(logits).all(), f"{name}: non-finite logits"
        trace.append(dict(step=name, logits=logits.float().cpu().tolist(),
                          topk={i: torch.cat([c[0] for c in sites.mqa[i]]).sort(-1).values.tolist() for i in sites.mqa},
                          experts={i: e.sort(-1).values.tolist() for i, e in experts.items()}))
        print(f"rank step {name} {time.time() - t:.1f}s", flush=True)
    rep = driver_v32.finish(ctx)
    for k, v in rep.items():
        if k not in ("phases",):
            report.setdefault(k, v)
    report["oracle_logits"] = oracle_logits
    report["rank_checks"] = results
    report["trace"] = trace
    report["num_local_heads"] = layers[0].self_attn.num_local_heads
