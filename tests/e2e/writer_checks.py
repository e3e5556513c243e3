"""What every cache must hold, in float64 from each layer's captured input and DeepSeek's math
(independent of the plugin's and vLLM's cache writers), checked entry by entry against the
decoded cache bytes.

V4 / V4.1 (``Checker.check_attention`` calls ``v4_writers``): the compressed KV entries closed in
the step (gated pooling of the compressor's projections over the window, RMSNorm, GPT-J RoPE at
the window's first token, into the fp8_ds_mla record) and the indexer K entries (V4: the
indexer's own compressor; V4.1: ``k_norm(wk(latent))`` of the kv-source compressor's latent,
RoPE'd at the window's first token), from the layer inputs of every step so far (a window may
straddle steps). V3.2 / GLM-5 (``V32Writers``, installed by ``checks_v32.IndexerChoice``): each
token's MLA row (``rms_norm(kv_c)``, interleaved RoPE on ``k_pe``) and indexer K row
(LayerNorm, RoPE on the first rope dims, FP8 with one scale).

The bound per element is the E4M3 half step of the element (|x| / 16, or half a subnormal step
of the group's scale) plus the bf16 pipeline before the writer (4 bf16 ulps of the element's
magnitude plus the row's rms); bf16 parts carry only the latter. A RoPE'd channel's magnitude is
its pair's norm: the writers round the pair to bf16 before rotating it, so a channel that the
rotation brings near zero still carries the pair's rounding (Rope). Each check reports
max(error / bound): <= 1 passes.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch

import oracle as O

F64 = torch.float64
BF16_SLACK = 2 ** -6      # 4 bf16 ulps (unit roundoff 2**-8) relative to |x| + rms(row)


def _w(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().to(F64)


class Rope(NamedTuple):
    """Where a row's RoPE channels are: the last (first=True: the first) ``dim`` channels, paired
    (2i, 2i+1) when interleaved (GPT-J), else (i, i + dim/2) (NeoX)."""
    dim: int
    first: bool = False
    interleaved: bool = True


def magnitude(ref: torch.Tensor, rope: Optional[Rope]) -> torch.Tensor:
    """|ref| [..., D], with each RoPE'd channel's entry replaced by its pair's norm."""
    mag = ref.abs()
    if rope is None:
        return mag
    D, rd = ref.shape[-1], rope.dim
    lo = 0 if rope.first else D - rd
    r = ref[..., lo: lo + rd]
    if rope.interleaved:
        norm = (r[..., 0::2].pow(2) + r[..., 1::2].pow(2)).sqrt().repeat_interleave(2, dim=-1)
    else:
        half = (r[..., : rd // 2].pow(2) + r[..., rd // 2:].pow(2)).sqrt()
        norm = torch.cat((half, half), dim=-1)
    mag[..., lo: lo + rd] = norm
    return mag


def quant_ratio(dec: torch.Tensor, ref: torch.Tensor, n_fp8: int, group: int, pow2: bool,
                rope: Optional[Rope] = None) -> float:
    """max |dec - ref| / bound over one row. ref/dec [D] f64: the first ``n_fp8`` elements E4M3
    with one scale per ``group`` (pow2: a UE8M0 scale 2**ceil(log2(amax / 448)), else amax / 448),
    the rest bf16; ``rope`` says which channels were RoPE'd from a bf16 pair. A NaN/inf
    in dec gives inf."""
    if not torch.isfinite(dec).all():
        return float("inf")
    slack = BF16_SLACK * (magnitude(ref, rope) + float(ref.pow(2).mean().sqrt()) + 1e-30)
    bound = slack.clone()
    if n_fp8:
        amax = ref[:n_fp8].abs().view(-1, group).amax(1).clamp(min=1e-30) / 448
        scale = torch.exp2(torch.ceil(torch.log2(amax))) if pow2 else amax
        # half an E4M3 step (1.02: the writer's amax comes from its own rounded input), or half a
        # subnormal step of the group's scale (doubled: the writer's scale may be a binade up)
        bound[:n_fp8] += ref[:n_fp8].abs() / 16 * 1.02 + scale.repeat_interleave(group) * 2 ** -8
    return float(((dec - ref).abs() / bound).max())


def cos_sin(rotary, positions) -> tuple:
    cs = _w(rotary.cos_sin_cache)[torch.as_tensor(positions).long().cpu()]
    return cs[:, : cs.shape[1] // 2], cs[:, cs.shape[1] // 2:]


# ----------------------------------------------------------------------------------- V4 / V4.1
def request_ids(batch) -> List:
    """The request id of every block-table row of the step (the scheduler's schedule order, or
    the batch's ``req_ids``). A batch with neither gets ids of its own: windows that straddle
    steps then count as unseen rather than pairing another request's inputs."""
    sch = batch.get("schedule")
    if sch:
        return [rid for rid, _ in sch]  # the driver's ints or vLLM's request-id strings
    if batch.get("req_ids") is not None:
        return list(batch["req_ids"])
    return [(id(batch), r) for r in range(len(batch["query_start_loc_cpu"]) - 1)]


def _pooled(comp, rows: torch.Tensor) -> torch.Tensor:
    """The last compressed entry (before the norm) of a compressor over the layer inputs ``rows``
    [n, hidden] f64: the entry's window, plus the window before it for an overlapping compressor."""
    m = comp.compress_ratio
    ks = rows @ _w(comp.fused_wkv_wgate.weight).T
    if m == 1 or not getattr(comp, "has_gate", True):
        return ks[-1, : comp.head_dim]
    half = ks.shape[1] // 2
    kv, score = ks[:, :half], ks[:, half:]
    ape = getattr(comp, "ape", None)
    overlap = bool(getattr(comp, "overlap", False))
    return O.compress_pool(kv, score, None if ape is None else _w(ape), m, overlap)[-1]


def v4_writers(chk, step, rec, attn, req: List[int]) -> Dict[str, float]:
    """Compressed-KV and indexer-K writer checks of one V4/V4.1 layer and step. Returns
    comp_writer_err / index_writer_err (max error/bound, 0 if nothing was written), the number of
    entries checked and those whose window's inputs were not all seen (earlier steps skipped)."""
    hist = chk.__dict__.setdefault("_writer_hist", {}).setdefault(rec.layer, {})
    rids = request_ids(step.batch)
    x = rec.x.cpu().to(F64)
    pos = rec.positions.cpu().tolist()
    for t, p in enumerate(pos):
        hist[(rids[req[t]], p)] = x[t]
    comp = getattr(attn, "compressor", None)
    out = dict(comp_writer_err=0.0, comp_written=0, index_writer_err=0.0, index_written=0, writer_unseen=0,
               writer_padded=0)
    # a prefix hit's recomputed window (V4.1's SWA bounded replay): the runner pads those rows' slots
    # in the prefix-cacheable groups, so their entries are the prefix owner's, not this request's
    replay_starts, window = step.batch.get("replay_starts") or {}, step.batch.get("replay_window") or 0
    if comp is None or rec.comp_block_table is None:
        return out
    m = comp.compress_ratio
    ix = getattr(attn, "indexer", None)
    icomp = getattr(ix, "compressor", None) if ix is not None else None
    owns_k = ix is not None and bool(getattr(ix, "owns_k", False))
    ccache = chk.fwd_ctx[comp.k_cache_prefix].kv_cache
    eps = comp.rms_norm_eps
    for t, p in enumerate(pos):
        if (p + 1) % m:
            continue
        r, w = req[t], p // m
        if rids[r] in replay_starts and replay_starts[rids[r]] <= p < replay_starts[rids[r]] + window:
            out["writer_padded"] += 1
            continue
        first = max(0, (w - 1) * m) if (getattr(comp, "overlap", False) or getattr(icomp, "overlap", False)) else w * m
        keys = [(rids[r], j) for j in range(first, p + 1)]
        if any(k not in hist for k in keys):
            out["writer_unseen"] += 1
            continue
        rows = torch.stack([hist[k] for k in keys])
        own = rows if getattr(comp, "overlap", False) else rows[-m:]
        latent = O.rms_norm(_pooled(comp, own), _w(comp.norm.weight), eps)
        c, s = cos_sin(attn.rotary_emb, [w * m])
        ref = O.rope_interleaved(latent[None], c, s)[0]
        import checks

        dec = checks.decode_record(ccache, _slot(rec.comp_block_table, r, w, rec.comp_block_size),
                                   rec.comp_block_size)
        rope = Rope(2 * c.shape[-1])
        out["comp_writer_err"] = max(out["comp_writer_err"], quant_ratio(dec, ref, 448, 64, True, rope))
        out["comp_written"] += 1
        if icomp is not None or owns_k:
            if icomp is not None:      # V4: the indexer's own compressor of the layer input
                irows = rows if getattr(icomp, "overlap", False) else rows[-m:]
                k = O.rms_norm(_pooled(icomp, irows), _w(icomp.norm.weight), icomp.rms_norm_eps)
            else:                      # V4.1: k_norm(wk(latent)) of the kv-source's latent
                k = O.rms_norm(latent @ _w(ix.wk.weight).T, _w(ix.k_norm.weight), ix.k_norm.variance_epsilon)
            c, s = cos_sin(attn.indexer_rotary_emb, [w * m])
            kref = O.rope_interleaved(k[None], c, s)[0]
            kcache = ix.k_cache.kv_cache
            kdec = checks.decode_index_k(kcache, _slot(rec.index_block_table, r, w, kcache.shape[1]))
            kerr = quant_ratio(kdec, kref, 128, 128, False, Rope(2 * c.shape[-1]))
            out["index_writer_err"] = max(out["index_writer_err"], kerr)
            out["index_written"] += 1
    return out


def _slot(block_table: torch.Tensor, r: int, pos: int, bs: int) -> int:
    return int(block_table[r, pos // bs]) * bs + pos % bs


# ----------------------------------------------------------------------------------- V3.2 / GLM-5
def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on the FIRST 2*cos.shape[-1] channels of x [T, D] (the V3.2 indexer's key layout
    [rope | nope]); interleave: GPT-J pairs, else NeoX halves."""
    rd = 2 * cos.shape[-1]
    head, tail = x[:, :rd], x[:, rd:]
    if interleave:
        rot = O.rope_interleaved(head, cos, sin)
    else:
        rot = O.rope_neox(head, cos, sin)
    return torch.cat((rot, tail), dim=-1)


class V32Writers:
    """Hooks every V3.2/GLM-5 attention module; after its forward, checks this step's MLA cache
    rows and indexer K rows against float64 from the module's input. ``owner`` provides the
    step's tokens ([(rid, pos)]), the requests' block ids and the block size (IndexerChoice)."""

    def __init__(self, model, owner, results: list):
        self.owner, self.results = owner, results
        self._x: Dict[int, tuple] = {}
        for i, layer in enumerate(model.model.layers):
            self._hook(i, layer.self_attn)

    def _hook(self, i, attn):
        def pre(mod, args, kwargs):
            positions = args[0] if args else kwargs["positions"]
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            self._x[i] = (positions.detach().cpu().clone(), hidden.detach().cpu().to(F64))

        def post(mod, args, kwargs, out):
            if getattr(self.owner, "tokens", None) is None or i not in self._x:
                return
            import bounds

            with bounds.one_thread():
                self.check(i, mod)

        attn.register_forward_pre_hook(pre, with_kwargs=True)
        attn.register_forward_hook(post, with_kwargs=True)

    def check(self, i: int, attn) -> None:
        from checks_v32 import decode_index_k_rows, decode_rows

        positions, x = self._x.pop(i)
        toks = self.owner.tokens[: x.shape[0]]
        bs = self.owner.bs
        qkv = x @ _w(attn.fused_qkv_a_proj.weight).T
        kv_c = qkv[:, attn.q_lora_rank: attn.q_lora_rank + attn.kv_lora_rank]
        k_pe = qkv[:, attn.q_lora_rank + attn.kv_lora_rank:]
        c, s = cos_sin(attn.rotary_emb, positions)
        ref = torch.cat((O.rms_norm(kv_c, _w(attn.kv_a_layernorm.weight), attn.kv_a_layernorm.variance_epsilon),
                         O.rope_interleaved(k_pe, c, s)), dim=-1)           # [T, 576]
        cache = attn.kv_cache
        cc = cache.squeeze(2) if cache.dim() == 4 else cache
        stride_rows = cc.stride(0) // cc.shape[-1]
        phys = torch.tensor([self.owner.blocks[rid][p // bs] * stride_rows + p % bs for rid, p in toks])
        dec = decode_rows(cache.cpu(), phys)
        fp8 = not (cc.shape[-1] == 576 and cc.dtype == torch.bfloat16)
        rope = Rope(2 * c.shape[-1])
        kv_err = max(quant_ratio(dec[t], ref[t], 512 if fp8 else 0, 128, False, rope) for t in range(len(toks)))
        res = dict(kind="writer", step=self.owner.step, layer=i, tokens=len(toks), kv_writer_err=kv_err,
                   index_writer_err=0.0, index_written=0)
        ix = getattr(attn, "indexer", None)
        if ix is not None and not getattr(attn, "skip_topk", False):
            kw = x @ _w(ix.wk_weights_proj.weight).T
            k = torch.nn.functional.layer_norm(kw[:, : ix.head_dim], (ix.head_dim,), _w(ix.k_norm.weight),
                                               _w(ix.k_norm.bias), ix.k_norm.eps)
            c, s = cos_sin(attn.indexer_rope_emb, positions)
            interleave = bool(getattr(attn, "_index_rope_interleave", False))
            kref = rope_first(k, c, s, interleave)
            slots = torch.tensor([self.owner.blocks[rid][p // bs] * bs + p % bs for rid, p in toks])
            kdec = decode_index_k_rows(ix.k_cache.kv_cache.cpu(), slots)
            irope = Rope(2 * c.shape[-1], first=True, interleaved=interleave)
            res["index_writer_err"] = max(quant_ratio(kdec[t], kref[t], 128, 128, False, irope)
                                          for t in range(len(toks)))
            res["index_written"] = len(toks)
        self.results.append(res)

