"""Teacher-forced float64 checks of one captured step, layer by layer (oracle math in oracle.py).

Each layer is run from its own captured input, so errors do not compound. The KV values the
oracle attends over are the bytes vLLM's run wrote, decoded here by an independent decoder (which
also checks the writers against the oracle's own K); discrete choices (the indexer top-k, the
experts) are taken from vLLM's run and checked for validity / against the oracle's choice.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

import bounds as B
import oracle as O
import writer_checks as WC
from checks_v32 import valid_top_k

F64 = torch.float64
MARGIN = 2e-2   # router-key gap above which vLLM's bf16 choice must equal the oracle's


def route_check(used: torch.Tensor, chosen: torch.Tensor, margin: torch.Tensor, cut: float = MARGIN):
    """The e2e's rule for a discontinuous expert choice: where the float64 router margin (the
    k-th minus the (k+1)-th key) is above ``cut``, bf16 router noise cannot reorder the keys, so
    vLLM's experts ``used`` [T, k] must be the oracle's ``chosen`` [T, k] (any order); below it
    either choice is valid and the oracle goes on with vLLM's (teacher-forced). Returns
    (mismatched rows among the clear ones, the clear mask [T])."""
    clear = margin > cut
    differs = (used.long().sort(1).values != chosen.long().sort(1).values).any(1)
    return int((differs & clear).sum()), clear


def _w(t: torch.Tensor) -> torch.Tensor:
    """A parameter or captured tensor as a float64 CPU tensor (the oracle runs on the CPU)."""
    return t.detach().cpu().to(F64)


def decode_record(cache: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    """One fp8_ds_mla record -> float64 [512]. ``cache`` [nb, bs, 584] view or its pages: per page
    all 576-byte data rows (448 E4M3 NoPE bytes, 64 bf16 RoPE dims), then all 8-byte scale rows
    (7 UE8M0 exponents, a pad). Written from the layout, with torch's own E4M3 decode."""
    nb = cache.shape[0]
    page = cache.reshape(nb, -1) if cache.is_contiguous() else cache.flatten(1)
    b, p = divmod(int(slot), block_size)
    rec = page[b, p * 576:(p + 1) * 576]
    sc = page[b, block_size * 576 + p * 8: block_size * 576 + p * 8 + 7]
    nope = rec[:448].clone().view(torch.float8_e4m3fn).to(F64).view(7, 64)
    scale = torch.exp2(sc.to(F64) - 127.0)
    rope = rec[448:576].clone().view(torch.bfloat16).to(F64)
    return torch.cat([(nope * scale[:, None]).reshape(-1), rope]).cpu()


def decode_index_k(cache: torch.Tensor, slot: int) -> torch.Tensor:
    """One indexer K entry -> float64 [128]. ``cache`` [nb, bs, 132]: per page bs rows of 128
    E4M3 bytes, then bs fp32 scales."""
    nb, bs = cache.shape[0], cache.shape[1]
    page = cache.reshape(nb, -1) if cache.is_contiguous() else cache.flatten(1)
    b, p = divmod(int(slot), bs)
    k = page[b, p * 128:(p + 1) * 128].clone().view(torch.float8_e4m3fn).to(F64)
    scale = page[b, bs * 128 + 4 * p: bs * 128 + 4 * p + 4].clone().view(torch.float32).to(F64)
    return (k * scale).cpu()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm() + 1e-30))


def _req_of(batch) -> List[int]:
    qsl = batch["query_start_loc_cpu"].tolist()
    out = []
    for r in range(len(qsl) - 1):
        out += [r] * (qsl[r + 1] - qsl[r])
    return out


def _slot(block_table: torch.Tensor, r: int, pos: int, bs: int) -> int:
    return int(block_table[r, pos // bs]) * bs + pos % bs


class Checker:
    """Float64 checks of one model (cfg: the tiny config dict; model: vLLM's built module)."""

    def __init__(self, model, cfg: dict):
        self.m, self.cfg = model, cfg
        self.v4 = cfg["model_type"] == "deepseek_v4"
        self.fwd_ctx = None   # set by the driver: vllm_config.compilation_config.static_forward_context
        self.results: List[dict] = []

    # -------------------------------------------------------------- attention
    def q_kv(self, attn, x, positions):
        """Oracle q [T, H, 512] and kv [T, 512] (RoPE applied), float64."""
        w = _w(attn.fused_wqa_wkv.weight)
        qr = O.rms_norm(x.to(F64) @ w[: attn.q_lora_rank].T, _w(attn.q_norm.weight), attn.eps)
        kv = O.rms_norm(x.to(F64) @ w[attn.q_lora_rank:].T, _w(attn.kv_norm.weight), attn.eps)
        q = (qr @ _w(attn.wq_b.weight).T).view(-1, attn.n_local_heads, attn.head_dim)
        if self.v4:   # V4: per-head RMSNorm without weight (V4.1 norms qr before wq_b only)
            q = O.rms_norm(q, None, attn.eps)
        cs = _w(attn.rotary_emb.cos_sin_cache)[positions.cpu()]
        cos, sin = cs[:, : cs.shape[1] // 2], cs[:, cs.shape[1] // 2:]
        return O.rope_interleaved(q, cos, sin), O.rope_interleaved(kv, cos, sin), (cos, sin)

    def check_attention(self, step, rec) -> Dict[str, float]:
        attn = self.m.model.layers[rec.layer].attn
        batch = step.batch
        T = rec.x.shape[0]
        q, kv, (cos, sin) = self.q_kv(attn, rec.x.cpu(), rec.positions.cpu())
        swa_cache = attn.swa_cache_layer.kv_cache
        bs = rec.swa_block_size
        req = _req_of(batch)
        pos = rec.positions.cpu().tolist()
        # 1. the SWA writer: this step's records decode to the oracle's K
        werr = 0.0
        for t in range(T):
            # the record's rounding model (writer_checks.quant_ratio: E4M3 half a step, subnormals
            # of the writer's scale, which may be a binade above the float64 one, plus the bf16
            # pipeline before the writer, RoPE'd channels at their pair's norm), as for the
            # compressed and indexer writers
            dec = decode_record(swa_cache, int(rec.swa_slot_mapping[t]), bs)
            werr = max(werr, WC.quant_ratio(dec, kv[t], 448, 64, True, WC.Rope(2 * cos.shape[-1])))
        # 2. keys: the request's window from the SWA cache, the chosen compressed entries
        W = attn.window_size
        keys, valid = [], []
        ratio = attn.compress_ratio if rec.comp_block_table is not None else 0
        comp_prefix = getattr(attn, "compressed_cache_prefix", None) or attn.prefix
        comp_cache = self.fwd_ctx[comp_prefix].kv_cache if ratio > 0 else None
        topk_bad = 0
        for t in range(T):
            r, p = req[t], pos[t]
            lo = max(0, p - W + 1) if rec.window_lo is None else max(0, p - W + 1, int(rec.window_lo[t]))
            ks = [decode_record(swa_cache, _slot(rec.swa_block_table, r, j, bs), bs) for j in range(lo, p + 1)]
            if ratio > 0:
                n_entries = (p + 1) // ratio
                # the indexer's choice, or (V4 C128A, no indexer) every visible entry
                chosen_w = rec.topk[t].tolist() if rec.topk is not None else list(range(n_entries))
                for w in chosen_w:
                    if w < 0:
                        continue
                    if w >= n_entries:
                        topk_bad += 1
                        continue
                    ks.append(decode_record(comp_cache, _slot(rec.comp_block_table, r, w, rec.comp_block_size),
                                            rec.comp_block_size))
            keys.append(torch.stack(ks))
        K = max(k.shape[0] for k in keys)
        keyt = torch.zeros(T, K, 512, dtype=F64)
        valid = torch.zeros(T, K, dtype=torch.bool)
        for t, k in enumerate(keys):
            keyt[t, : k.shape[0]] = k
            valid[t, : k.shape[0]] = True
        sink = _w(attn.attn_sink[: attn.n_local_heads])
        # the oracle uses DeepSeek's scale (head_dim ** -0.5), not the module's
        o, _ = O.sparse_attention(q, keyt, valid, sink, attn.head_dim ** -0.5)
        out = O.o_proj(o, cos, sin, attn.rotary_emb.rotary_dim if hasattr(attn.rotary_emb, "rotary_dim") else 64,
                       _w(attn.wo_a.weight), _w(attn.wo_b.weight), attn.n_local_groups)
        got = rec.out.cpu().to(F64)
        # per-row bounds from the rounding model (bounds.py): Z standard deviations per element
        with B.one_thread():
            bq, vq = B.q_variance(attn, rec.x.cpu().to(F64), cos, sin, self.v4, _w)
            bo, vo = B.attention_variance(bq, vq, keyt, valid, sink, attn.head_dim ** -0.5)
            _, vout = B.o_proj_variance(bo, vo, cos, sin, _w(attn.wo_a.weight), _w(attn.wo_b.weight),
                                        attn.n_local_groups)
            rows = B.row_ratios(got, out, vout)
            writers = WC.v4_writers(self, step, rec, attn, req)
        res = dict(step=step.name, layer=rec.layer, kind=f"attn(ratio={ratio})", tokens=T,
                   cos=cosine(got, out), max_abs=float((got - out).abs().max()),
                   ref_max=float(out.abs().max()), writer_err=werr, topk_out_of_range=topk_bad,
                   bound_ratio=float(rows.max()), bound_row=int(rows.argmax()),
                   bound_rows_over=int((rows > 1).sum()))
        res.update(writers)
        self.results.append(res)
        return res

    # -------------------------------------------------------------- indexer choice
    def check_indexer(self, step, rec) -> Dict[str, float]:
        """The compressed entries vLLM's indexer chose (top-k of its logits) are the oracle's top-k
        of sum_h w[t,h] relu(q[t,h] . k[w]) over the visible entries, wherever the oracle's gap
        between the k-th and (k+1)-th score is clear of the fp8 rounding of q and k."""
        attn = self.m.model.layers[rec.layer].attn
        ix = attn.indexer
        if ix is None or rec.topk is None:
            return {}
        ratio, topk = attn.compress_ratio, ix.topk_tokens
        x = rec.x.cpu().to(F64)
        w = _w(attn.fused_wqa_wkv.weight)
        qr = O.rms_norm(x @ w[: attn.q_lora_rank].T, _w(attn.q_norm.weight), attn.eps)
        q = (qr @ _w(ix.wq_b.weight).T).view(x.shape[0], ix.n_head, ix.head_dim)
        cs = _w(attn.indexer_rotary_emb.cos_sin_cache)[rec.positions.cpu()]
        q = O.rope_interleaved(q, cs[:, : cs.shape[1] // 2], cs[:, cs.shape[1] // 2:])
        weights = (x @ _w(ix.weights_proj.weight).T) * ix.softmax_scale * ix.n_head ** -0.5
        kcache = ix.k_cache.kv_cache
        req = _req_of(step.batch)
        q_err, q_scale_pow2, qf = 0.0, True, None
        if rec.index_q is not None:
            qf = rec.index_q.cpu().view(torch.float8_e4m3fn).to(F64)
            # the Q quant: vLLM's codes times the implied per-(token, head) scale are the oracle's q
            ok = weights.abs() > 1e-3 * weights.abs().max()
            implied = torch.where(ok, rec.index_w.cpu().to(F64) / torch.where(ok, weights, 1.0), 0.0)
            # (writer_checks' model: the bf16 slack of a RoPE'd channel is its pair's norm's)
            mag = WC.magnitude(q, WC.Rope(cs.shape[1]))
            bound = (q.abs() / 16 * 1.02 + implied[..., None].abs() * 2 ** -9
                     + WC.BF16_SLACK * (mag + q.pow(2).mean(-1, keepdim=True).sqrt()))
            q_err = float(((qf * implied[..., None] - q).abs() / bound)[ok].max())
            log2 = torch.log2(implied.abs()[ok])
            # the folded scale is a power of two up to the bf16 rounding of the weights
            q_scale_pow2 = bool(((log2 - log2.round()).abs() < 2e-2).all())
        pos = rec.positions.cpu().tolist()
        checked = mismatched = long_rows = ties = 0
        for t in range(x.shape[0]):
            n = (pos[t] + 1) // ratio
            chosen = sorted(v for v in rec.topk[t].tolist() if v >= 0)
            if n <= topk:
                checked += 1
                mismatched += chosen != list(range(n))
                continue
            if qf is None:
                raise AssertionError(f"layer {rec.layer}: the indexer's long path ran without indexer_q_quant")
            ks = torch.stack([decode_index_k(kcache, _slot(rec.index_block_table, req[t], e, kcache.shape[1]))
                              for e in range(n)])
            # teacher-forced on the fp8 rounding of q (checked against the float64 q below):
            # scores from vLLM's E4M3 q codes with the scale folded into the weights
            score = O.indexer_scores(qf[t:t + 1], rec.index_w[t:t + 1].cpu(), ks, 1.0, 1.0)[0]
            # a top-k of the oracle's scores up to fp32 accumulation order: entries tied with the
            # k-th may go either way (ties at 0 are common: the tiny indexer's 4 heads often all
            # score an entry below zero, and relu makes them equal)
            ok, tied = valid_top_k(score, chosen, topk)
            checked += 1
            long_rows += 1
            ties += tied
            mismatched += not ok

        res = dict(step=step.name, layer=rec.layer, kind="indexer", tokens=x.shape[0], checked=checked,
                   mismatched=mismatched, long_rows=long_rows, ties=ties, q_err=q_err, q_scale_pow2=q_scale_pow2)
        self.results.append(res)
        return res

    # -------------------------------------------------------------- MoE
    def check_moe(self, step, rec) -> Dict[str, float]:
        ffn = self.m.model.layers[rec.layer].ffn
        cfg = self.cfg
        x = rec.ffn_x.cpu()
        ex = ffn.experts.routed_experts
        I = ex.w2_weight.shape[-1]
        w13 = _w(ex.w13_weight)
        sh = ffn.shared_experts
        su = _w(sh.gate_up_proj.weight)
        shared = (su[:I * cfg["n_shared_experts"]], su[I * cfg["n_shared_experts"]:], _w(sh.down_proj.weight))
        experts = (w13[:, :I], w13[:, I:], _w(ex.w2_weight))
        _, chosen, margin = O.moe(x, _w(ffn.gate.weight), (None if getattr(ffn.gate, "e_score_correction_bias", None) is None
                                   else _w(ffn.gate.e_score_correction_bias)), experts, shared,
                                  cfg["num_experts_per_tok"], cfg["routed_scaling_factor"],
                                  scoring=cfg["scoring_func"], norm_topk_prob=cfg["norm_topk_prob"],
                                  swiglu_limit=cfg["swiglu_limit"])
        # teacher-forced on vLLM's choice; the choice itself must be the oracle's where the
        # margin is clear of bf16 router noise
        used = rec.experts.long()
        tid2eid = getattr(ffn.gate, "tid2eid", None)
        if tid2eid is not None and rec.ffn_ids is not None:   # hash routing: the table decides
            chosen = tid2eid.detach().cpu().long()[rec.ffn_ids.cpu().long()][:, : used.shape[1]]
            margin = torch.full((x.shape[0],), float("inf"), dtype=F64)
        mismatch, clear = route_check(used, chosen, margin)
        scores = O.router_scores(x.to(F64) @ _w(ffn.gate.weight).T, cfg["scoring_func"])
        out, _ = O._moe_combine(x.to(F64), scores, used, experts, shared, cfg["routed_scaling_factor"],
                                cfg["norm_topk_prob"], cfg["swiglu_limit"], cfg["swiglu_limit"])
        got = rec.ffn_out.cpu().to(F64)
        res = dict(step=step.name, layer=rec.layer, kind="moe", tokens=x.shape[0], cos=cosine(got, out),
                   max_abs=float((got - out).abs().max()), ref_max=float(out.abs().max()),
                   choice_mismatch=mismatch, clear_rows=int(clear.sum()))
        self.results.append(res)
        return res

    # -------------------------------------------------------------- first-layer mHC
    def check_first_mhc(self, step, rec) -> Dict[str, float]:
        """Layer 0's attention input from the embedding: the hc streams are copies of the token's
        embedding, collapsed with the mHC pre coefficients (V4; V4.1's first layer selects copy 0),
        then RMS-normed with attn_norm. On V4 this runs through the plugin's prenorm-GEMM row."""
        layer = self.m.model.layers[0]
        ids = step.batch["input_ids"].cpu()
        x = _w(self.m.model.embed_tokens.weight)[ids]
        T, D = x.shape
        hc = self.cfg["hc_mult"]
        streams = x[:, None, :].expand(T, hc, D)
        if self.v4:
            pre, _, _ = O.mhc_coeffs(streams, _w(layer.hc_attn_fn), _w(layer.hc_attn_base), _w(layer.hc_attn_scale),
                                     self.cfg["hc_eps"], self.cfg["rms_norm_eps"], self.cfg["hc_sinkhorn_iters"])
            collapsed = O.mhc_collapse(streams, pre)
        else:
            collapsed = x
        ref = O.rms_norm(collapsed, _w(layer.attn_norm.weight), self.cfg["rms_norm_eps"])
        got = rec.x.cpu().to(F64)
        res = dict(step=step.name, layer=0, kind="mhc_first", tokens=T, cos=cosine(got, ref),
                   max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()))
        self.results.append(res)
        return res

    # -------------------------------------------------------------- mHC boundaries (V4)
    def check_mhc_boundaries(self, step, calls: List[dict]) -> List[dict]:
        """Every V4 mHC boundary vLLM ran this step (the stand-ins' recorded calls: the post of one
        sublayer fused with the pre of the next, ``standins.BOUNDARIES``), from its own inputs:
        the new streams are ``mhc_expand`` of the block output with the incoming post / comb
        mixes; the outgoing pre / post / comb are ``mhc_coeffs`` of those streams (teacher-forced
        on vLLM's bf16 streams) and the next sublayer's input their collapse, RMS-normed."""
        sites = {}
        for i, layer in enumerate(self.m.model.layers):
            sites[layer.hc_attn_fn.data_ptr()] = (i, "attn", layer.hc_attn_base, layer.hc_attn_scale, layer.attn_norm)
            sites[layer.hc_ffn_fn.data_ptr()] = (i, "ffn", layer.hc_ffn_base, layer.hc_ffn_scale, layer.ffn_norm)
        eps, hc_eps, iters = self.cfg["rms_norm_eps"], self.cfg["hc_eps"], self.cfg["hc_sinkhorn_iters"]
        out = []
        for c in calls:
            i, side, base, scale, norm = sites[c["fn"].data_ptr()]
            T, n, d = c["residual"].shape
            new_ref = O.mhc_expand(_w(c["x"]), _w(c["residual"]), _w(c["post_in"]).reshape(T, n), _w(c["comb_in"]))
            streams = _w(c["new_res"]).reshape(T, n, d)
            pre, post, comb = O.mhc_coeffs(streams, _w(c["fn"]), _w(base), _w(scale), hc_eps, eps, iters)
            inp_ref = O.rms_norm(O.mhc_collapse(streams, pre), _w(norm.weight), eps)
            res = dict(step=step.name, layer=i, kind="mhc", side=side, tokens=T, in_place=c["in_place"])
            for name, got, ref in (("streams", streams, new_ref), ("post", _w(c["post"]).reshape(T, n), post),
                                   ("comb", _w(c["comb"]).reshape(T, n, n), comb),
                                   ("input", _w(c["layer_input"]).reshape(T, d), inp_ref)):
                res[f"{name}_cos"] = cosine(got, ref)
                res[f"{name}_rel"] = float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
            self.results.append(res)
            out.append(res)
        return out

    # -------------------------------------------------------------- logits
    def check_logits(self, step, hidden, logits):
        lm = _w(self.m.lm_head.weight)
        ref = hidden.cpu().to(F64) @ lm.T
        got = logits.cpu().to(F64)[:, : lm.shape[0]]
        res = dict(step=step.name, layer=-1, kind="logits", tokens=got.shape[0], cos=cosine(got, ref),
                   max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()),
                   argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).double().mean()))
        self.results.append(res)
        return res
