"""Teacher-forced float64 check of every sparse-MLA call of a V3.2 run: the plugin backend's
``_forward_mqa_kernel`` is wrapped (not replaced); each call's q, cache and top-k indices are
kept and its output compared with softmax(scale * q.k) v over the valid entries, the keys decoded
from the cache BYTES by the decoder below (torch's own float8_e4m3fn, not this library's codec).
So a wrong kernel shows even where the fp8 cache's rounding hides it in the logits.

``IndexerChoice`` (attached to the recorder) checks the indexer's choice on the same calls: the
physical rows each query attends to are the float64 top-k of sum_h w[t,h] relu(q[t,h] . k[j])
over its request's causal keys, teacher-forced on vLLM's E4M3 indexer q and folded weights (what
``fused_q`` returned) and the indexer K cache's bytes, up to fp32 accumulation order (keys tied
with the k-th score may go either way; every row is checked, ties are counted); a query with
<= top-k causal keys must attend to all of them; a shared-indexer layer must attend to its
source layer's rows."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

NOPE, ROPE, TILE, REC = 512, 64, 128, 656


def decode_rows(kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float64 [..., 576] of flat cache rows (row r = block r // bs, position r % bs; the impl's
    physical indices with block size 1 over [num_blocks * bs] rows); -1 -> zeros."""
    c = kv_cache.squeeze(2) if kv_cache.dim() == 4 else kv_cache
    flat = c.reshape(-1, c.shape[-1])
    r = rows.clamp(min=0).long()
    if c.shape[-1] == NOPE + ROPE and c.dtype == torch.bfloat16:
        out = flat[r].double()
    else:
        b = flat.view(torch.uint8)[r]                                   # [..., 656] bytes
        codes = b[..., :NOPE].contiguous().view(torch.float8_e4m3fn).double()
        scale = b[..., NOPE:NOPE + 16].contiguous().view(torch.float32).double()   # [..., 4]
        nope = (codes.view(*codes.shape[:-1], NOPE // TILE, TILE) * scale[..., None]).flatten(-2)
        rope = b[..., NOPE + 16:REC].contiguous().view(torch.bfloat16).double()
        out = torch.cat((nope, rope), dim=-1)
    return torch.where((rows >= 0)[..., None], out, torch.zeros_like(out))


class MqaRecorder:
    def __init__(self, indexer_choice: "Optional[IndexerChoice]" = None):
        self.results: List[dict] = []
        self.indexer_choice = indexer_choice

    def install(self, impl_cls) -> None:
        orig = impl_cls._forward_mqa_kernel
        rec = self

        def wrapped(self_, q, kv_cache, topk_indices, valid_counts, **kw):
            out, lse = orig(self_, q, kv_cache, topk_indices, valid_counts, **kw)
            rec.check(self_, q, kv_cache, topk_indices, out, kw)
            return out, lse

        impl_cls._forward_mqa_kernel = wrapped

    def check(self, impl, q, kv_cache, topk_indices, out, kw) -> None:
        qq = (torch.cat(q, -1) if isinstance(q, tuple) else q).double().cpu()
        T = qq.shape[0]
        idx = topk_indices[:T].cpu()
        cap = kv_cache.shape[0] * kv_cache.shape[1]
        bad = int(((idx >= cap) | (idx < -1)).sum())
        k = decode_rows(kv_cache.cpu(), idx)                           # [T, K, 576]
        s = torch.einsum("thd,tkd->thk", qq, k) * float(impl.scale)
        s = s.masked_fill(~(idx >= 0)[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        ref = torch.einsum("thk,tkd->thd", p, k[..., :NOPE])
        got = out.double().cpu()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        rel = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        # per row: the error over the rounding model's bound (bf16 q exact, keys read as bf16,
        # fp32 accumulation, bf16 output; bounds.py)
        import bounds as B   # beside this module on the driver's path (test_checks_v32 imports only valid_top_k)

        with B.one_thread():
            _, var = B.attention_variance(qq, None, k, idx >= 0, None, float(impl.scale), dv=NOPE)
        rows = B.row_ratios(got.reshape(T, -1), ref.reshape(T, -1), var.reshape(T, -1))
        self.results.append(dict(kind="mqa", decode=bool(kw.get("is_decode")), tokens=T,
                                 valid=int((idx >= 0).sum()), out_of_range=bad, cos=cos, rel_max=rel,
                                 bound_ratio=float(rows.max()), cache=str(kv_cache.dtype),
                                 nonfinite=int((~torch.isfinite(got)).sum())))
        if self.indexer_choice is not None:
            self.indexer_choice.check(kw.get("layer"), kv_cache, idx)


def decode_index_k_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Indexer K entries -> float64 [N, 128]. cache [nb, bs, 132] (or [nb, bs, 1, 132]): per page
    bs rows of 128 E4M3 bytes, then bs fp32 scales."""
    c = cache.squeeze(2) if cache.dim() == 4 else cache
    nb, bs = c.shape[0], c.shape[1]
    page = c.reshape(nb, -1).view(torch.uint8)
    b, p = slots // bs, slots % bs
    codes = torch.stack([page[bi, pi * 128:(pi + 1) * 128] for bi, pi in zip(b.tolist(), p.tolist())])
    scale = torch.stack([page[bi, bs * 128 + 4 * pi: bs * 128 + 4 * pi + 4] for bi, pi in zip(b.tolist(), p.tolist())])
    return codes.contiguous().view(torch.float8_e4m3fn).double() * scale.contiguous().view(torch.float32).double()


def valid_top_k(score: torch.Tensor, chosen: List[int], k: int, rel_tol: float = 1e-5):
    """Is ``chosen`` (key positions) a top-``k`` of ``score`` [N] f64, up to fp32 accumulation
    order? Every key clearly above the k-th score is chosen, no chosen key is clearly below it, no
    key twice. E4M3 codes make exact ties common: keys tied with the k-th may go either way.
    Returns (valid, whether the k-th score is tied)."""
    kth = float(score.sort(descending=True).values[k - 1])
    tol = rel_tol * float(score.abs().max()) + 1e-9
    must = set((score > kth + tol).nonzero().flatten().tolist())
    ok = (len(set(chosen)) == len(chosen) == k and must <= set(chosen)
          and bool((score[chosen] >= kth - tol).all()))
    return ok, int(((score - kth).abs() <= tol).sum()) > 1


class IndexerChoice:
    """See the module doc. ``wrap_fused_q`` records each indexer layer's (E4M3 q, folded weights);
    the driver calls ``set_step`` before each forward with the batch's tokens ([(rid, pos)] in
    batch order) and the requests' MLA block ids (one KV-cache group, shared by the indexer)."""

    def __init__(self, model, block_size: int, topk: int):
        self.layers = model.model.layers
        self.bs, self.topk = block_size, topk
        self.q = None                       # (codes [T, Hi, 128] f64, weights [T, Hi] f64) of the last indexer layer
        self.q_layer = None
        self.results: List[dict] = []
        self.rows_of_layer: Dict[int, torch.Tensor] = {}
        self.tokens = None
        # the cache writers against float64 from each layer's input (kind "writer" rows)
        import writer_checks

        self.writers = writer_checks.V32Writers(model, self, self.results)

    def wrap_fused_q(self, fn):
        def fused_q(*args, **kw):
            out = fn(*args, **kw)
            if kw.get("has_indexer", True) and args[3] is not None:
                self.q = (out[0].cpu().double(), out[1].cpu().double())
            return out
        return fused_q

    def set_step(self, name: str, tokens: List[tuple], blocks: Dict[int, List[int]]) -> None:
        self.step, self.tokens, self.blocks = name, tokens, blocks
        self.offset: Dict[int, int] = {}
        self.rows_of_layer = {}

    def _layer_index(self, layer) -> int:
        name = getattr(layer, "layer_name", "") or ""
        return int(name.split("layers.")[1].split(".")[0])

    def check(self, layer, kv_cache: torch.Tensor, idx: torch.Tensor) -> None:
        li = self._layer_index(layer)
        c = kv_cache.squeeze(2) if kv_cache.dim() == 4 else kv_cache
        stride_rows = c.stride(0) // c.shape[-1]
        T, off = idx.shape[0], self.offset.get(li, 0)
        self.offset[li] = off + T
        toks = self.tokens[off:off + T]
        prev = self.rows_of_layer.get(li)
        self.rows_of_layer[li] = idx if prev is None else torch.cat((prev, idx))
        ix = self.layers[li].self_attn.indexer
        if ix is None:   # a shared-indexer layer: its source is the last layer before it with an indexer
            src = max(j for j in range(li) if self.layers[j].self_attn.indexer is not None)
            rows = self.rows_of_layer[li]
            same = bool(torch.equal(rows, self.rows_of_layer[src][:rows.shape[0]]))
            self.results.append(dict(kind="shared", step=self.step, layer=li, source=src, same=same))
            return
        icache = ix.k_cache.kv_cache.cpu()
        qf, w = self.q
        qf, w = qf[off:off + T], w[off:off + T]
        checked = mismatched = long_rows = outside = ties = 0
        for t, (rid, pos) in enumerate(toks):
            blk = self.blocks[rid]
            keys = torch.arange(pos + 1)
            phys = torch.tensor([blk[p // self.bs] * stride_rows + p % self.bs for p in keys.tolist()])
            slots = torch.tensor([blk[p // self.bs] * self.bs + p % self.bs for p in keys.tolist()])
            where = {int(r): i for i, r in enumerate(phys.tolist())}
            chosen_rows = [int(v) for v in idx[t].tolist() if v >= 0]
            outside += sum(r not in where for r in chosen_rows)
            chosen = sorted(where[r] for r in chosen_rows if r in where)
            if pos + 1 <= self.topk:
                checked += 1
                mismatched += chosen != list(range(pos + 1))
                continue
            k = decode_index_k_rows(icache, slots)
            score = (torch.relu(torch.einsum("hd,nd->hn", qf[t], k)) * w[t][:, None]).sum(0)
            ok, tied = valid_top_k(score, chosen, self.topk)
            ties += tied
            checked += 1
            long_rows += 1
            mismatched += not ok
        self.results.append(dict(kind="indexer", step=self.step, layer=li, tokens=T, checked=checked,
                                 mismatched=mismatched, long_rows=long_rows, ties=ties,
                                 outside_request=outside))


class RouteRecorder:
    """vLLM's expert choice, as the oracle is teacher-forced on it: each MoE layer's router
    (``_compute_routing`` of the layer's FusedMoE router, wrapped, not replaced) keeps the last
    forward's expert ids [T, k] and router logits [T, E] in ``last`` {layer: (ids, logits)}.
    ``remember`` files a step's rows under each token's prefix (the tokens up to and including
    it: a prefix-cache hit reads KV another request computed from the same tokens; a preempted
    request's recomputation files anew), ``forced`` lays them out for one request's oracle pass."""

    def __init__(self, model):
        self.last: Dict[int, tuple] = {}
        self.by_prefix: Dict[tuple, Dict[int, torch.Tensor]] = {}
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            routers = {id(m.router): m.router for m in layer.modules()
                       if hasattr(getattr(m, "router", None), "_compute_routing")}
            assert len(routers) <= 1, f"layer {i}: {len(routers)} routers"
            for r in routers.values():
                self._wrap(i, r)
                self.layers.append(i)

    def _wrap(self, i: int, router) -> None:
        orig = router._compute_routing

        def compute(hidden_states, router_logits, indices_type, **kw):
            weights, ids = orig(hidden_states, router_logits, indices_type, **kw)
            self.last[i] = (ids.detach().cpu().long(), router_logits.detach().cpu().float())
            return weights, ids

        router._compute_routing = compute

    def remember(self, rows: List[tuple]) -> None:
        """rows: [(the request's tokens up to this row, position)] in batch order, one a row of the
        last forward."""
        for i in self.layers:
            assert self.last[i][0].shape[0] >= len(rows), (i, self.last[i][0].shape, len(rows))
        for t, (tokens, pos) in enumerate(rows):
            self.by_prefix[tuple(tokens[:pos + 1])] = {i: (self.last[i][0][t], self.last[i][1][t]) for i in self.layers}
        self.last = {}

    def forced(self, tokens: List[int], k: int) -> Dict[int, torch.Tensor]:
        """{layer: vLLM's experts [len(tokens), k]}; -1 rows where no recorded step computed that
        token (the oracle keeps its own choice there)."""
        out = {i: torch.full((len(tokens), k), -1, dtype=torch.long) for i in self.layers}
        for p in range(len(tokens)):
            got = self.by_prefix.get(tuple(tokens[:p + 1]))
            if got is not None:
                for i in self.layers:
                    out[i][p] = got[i][0]
        return out

    def router_logits(self, tokens: List[int], start: int) -> Dict[int, torch.Tensor]:
        """{layer: vLLM's router logits [len(tokens) - start, E] f32} of rows recorded for
        positions start.. of ``tokens``."""
        rows = [self.by_prefix[tuple(tokens[:p + 1])] for p in range(start, len(tokens))]
        return {i: torch.stack([r[i][1] for r in rows]) for i in self.layers}
