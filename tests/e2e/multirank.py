"""One rank of a multi-rank end-to-end run (tensor and / or pipeline parallel) on the CPU: vLLM's
own ``init_distributed_environment`` / ``initialize_model_parallel`` over gloo, vLLM's sharded
layers, all-reduces and pipeline stages, the plugin on the Ampere path, every layer this rank
holds checked against the float64 oracle (tests/e2e/checks.py) on this rank's own share.

One process a rank: ``python multirank.py --rank R ...`` runs one; test_e2e_multirank.py runs
``python multirank.py --jobs FILE``, which imports vLLM and sets up the harness once and forks
every rank of every layout from there (``run_jobs``). The one-rank reference run of a model
(``--tp 1 --pp 1 --write-ckpt``) first writes the checkpoint every run of that model loads with
vLLM's own loader (engine/checkpoints.py: the original DeepSeek tensor names), so vLLM's weight
loaders shard it and all runs hold the same weights.

What a rank checks, per step and layer it holds:
- attention: the rank's partial output (its heads' attention through its wo_a groups and its
  columns of wo_b: the input of the wo_b all-reduce) against the oracle on the same weights,
  row by row within the rounding-model bound (bounds.py); the all-reduced output against the
  float64 sum of every rank's partial (``reduce_ratio``); how many TP all-reduces the layer ran;
- the rank's weights are the checkpoint's rows for its heads / groups / expert columns / vocab
  slice (``shards``), so a rank that computes right on the wrong heads fails;
- the indexer (replicated: every rank all its heads), the MoE (the rank's partial, its expert
  columns), layer 0's mHC input from the whole embedding, the logits from the whole LM head;
- the run's logits (and the indexer's choices) go into the report: the test compares them with
  the one-rank run's and across ranks.

``--dp 2 --ep`` (V4): data parallel 2 with expert parallelism: each rank its own requests
(``prompts``: prompt set = the DP rank) on all heads, the experts split over the EP group; vLLM's
``CpuCommunicator`` for the groups and torch.distributed stand-ins for the ``all_gatherv`` /
``reduce_scatterv`` it lacks (``install_cpu_communicator``; MULTIRANK.md says why); the MoE
checked on every EP rank's experts, the rank's experts against its half of the checkpoint
(``expert_shard_checks``).

``--model v32`` / ``--model glm5`` (DeepSeek-V3.2 / GLM-5, vLLM's ``DeepseekV32ForCausalLM``):
the rank runs multirank_v32.py instead (the one-rank V3.2 e2e's driver at this rank, and the
per-rank checks written for V3.2's MLA layer names); the harness, the forks and the all-reduce
recorder are these.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "engine"))

import driver  # noqa: E402

SEED = 1234            # the requests' tokens: the same in every run of a layout
PLANTS = ("head_offset", "o_proj_twice", "engram_vocab_start", "stage2_no_input_ids", "v32_head_offset",
          "ep_expert_offset")

SITE = [None]          # (layer, "attn" | "ffn") while that sublayer runs on this rank
ALLREDUCES: dict = {}  # site -> [(input, output)] of the TP group's all-reduces this step
RECEIVED = [None]      # the hidden states a later pipeline stage received this step


def model_config(model: str, engram: bool) -> dict:
    """The tiny config of tests/e2e/build.py; ``engram``: with V4.1's Engram layer (layer 1,
    engine/checkpoints.engram_keys), under the architecture name vLLM resolves Engram for."""
    import build
    import checkpoints

    cfg = dict(build.CONFIGS[model])
    if engram:
        cfg = dict(cfg, architectures=["DeepseekV41ForCausalLM"], **checkpoints.engram_keys(cfg))
    return cfg


def install_tp_standins() -> None:
    """Stand-ins for the C++ ops only tensor parallelism reaches (the audit keeps them on sm_80),
    in torch, counted like tests/e2e/standins.py's: ``_C.vocab_parallel_embedding`` (the
    vocab-parallel embedding's fused lookup: the rank's rows, zero for ids another rank owns)."""
    import torch
    import standins

    def vocab_parallel_embedding(out, input_ids, weight, org_start: int, org_end: int, org_padding: int,
                                 added_start: int, added_end: int) -> None:
        ids = input_ids.long()
        org = (ids >= org_start) & (ids < org_end)
        added = (ids >= added_start) & (ids < added_end)
        local = torch.where(org, ids - org_start, ids - added_start + (org_end - org_start) + org_padding)
        local = torch.where(org | added, local, torch.zeros_like(local))
        out.copy_(weight[local] * (org | added)[:, None].to(weight.dtype))

    standins._define(standins._lib("_C"), "_C",
                     "vocab_parallel_embedding(Tensor! out, Tensor input_ids, Tensor weight, int org_start, "
                     "int org_end, int org_padding, int added_start, int added_end) -> ()",
                     vocab_parallel_embedding)


def install_cpu_communicator(standins: bool = True) -> None:
    """The device communicator vLLM's CPU platform gives every group (``CpuCommunicator``, gloo /
    torch.distributed, with the ``allgather_reducescatter`` all2all manager FusedMoE's EP dispatch
    and combine go through); the harness's platform (``UnspecifiedPlatform``) gives the base class,
    which has no all2all manager. For the DP + EP rank only (the TP / PP ranks keep theirs)."""
    from vllm.platforms import current_platform

    qual = "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"
    type(current_platform).get_device_communicator_cls = classmethod(lambda cls: qual)
    if standins:
        install_gatherv_standins()


GATHERV_CALLS: dict = {}   # stand-in name -> calls (the report's gatherv_calls)
GATHERV_SIZES: list = []   # the per-rank row counts all_gatherv saw (the DP ranks' batch sizes)


def install_gatherv_standins() -> None:
    """vLLM's ``CpuCommunicator`` has no ``all_gatherv`` / ``reduce_scatterv`` (the base class's
    raise NotImplementedError, base_device_communicator.py), which the allgather_reducescatter
    all2all manager calls for FusedMoE's DP dispatch (all2all.py ``dispatch`` /
    ``dispatch_router_logits``) and combine: stand-ins over torch.distributed (gloo) with the
    semantics of the CUDA communicator's (pynccl ``all_gatherv`` / ``reduce_scatterv``: rank r's
    ``sizes[r]`` rows, concatenated in rank order; the sum's rows of this rank)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def one(self, x, sizes):
        n = self.world_size
        sizes = list(sizes or [x.shape[0]] * n)
        GATHERV_SIZES.append(sizes)
        assert x.shape[0] == sizes[self.rank_in_group], (x.shape, sizes)
        pad = torch.zeros((max(sizes),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        pad[: x.shape[0]] = x
        outs = [torch.empty_like(pad) for _ in range(n)]
        dist.all_gather(outs, pad, group=self.device_group)
        return torch.cat([o[:k] for o, k in zip(outs, sizes)], 0)

    def all_gatherv(self, input_, dim=0, sizes=None):
        assert dim == 0, dim
        GATHERV_CALLS["all_gatherv"] = GATHERV_CALLS.get("all_gatherv", 0) + 1
        if isinstance(input_, torch.Tensor):
            return one(self, input_, sizes)
        return [one(self, x, sizes) for x in input_]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        GATHERV_CALLS["reduce_scatterv"] = GATHERV_CALLS.get("reduce_scatterv", 0) + 1
        dim = dim % input_.dim()
        x = input_.movedim(dim, 0).contiguous()
        n = self.world_size
        sizes = sizes or [x.shape[0] // n] * n
        assert sum(sizes) == x.shape[0], (x.shape, sizes)
        x = x.clone()
        dist.all_reduce(x, group=self.device_group)   # 2 ranks: one rounding of the sum, as a reduce-scatter
        r = self.rank_in_group
        lo = sum(sizes[:r])
        return x[lo: lo + sizes[r]].movedim(0, dim).contiguous()

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


def install_allreduce_recorder() -> None:
    """Record every tensor-parallel all-reduce (vLLM's ``GroupCoordinator.all_reduce``, which
    ``tensor_model_parallel_all_reduce`` calls) with the sublayer that ran it."""
    from vllm.distributed import parallel_state as ps

    orig = ps.GroupCoordinator.all_reduce

    def all_reduce(self, input_):
        before = input_.detach().clone()   # before the call: a communicator may reduce in place
        out = orig(self, input_)
        if self is ps._TP and self.world_size > 1:   # at TP 1 vLLM's all_reduce returns its input
            ALLREDUCES.setdefault(SITE[0] or ("other",), []).append((before, out.detach().clone()))
        return out

    ps.GroupCoordinator.all_reduce = all_reduce


def plant(kind: str, rank: int) -> str:
    """Deliberate bugs of a multi-rank layout (test_e2e_multirank.py shows each one fails)."""
    if not kind:
        return ""
    if kind in ("head_offset", "v32_head_offset"):
        # rank 1 loads rank 0's query heads: wq_b's (V3.2 / GLM-5: q_b_proj's) column-parallel
        # shard taken at offset 0 (the unquantized linears load through weight_loader_v2, which
        # slices at the parameter's tp_rank)
        from vllm.model_executor.layers import linear

        orig = linear.ColumnParallelLinear.weight_loader_v2
        suffix = ".self_attn.q_b_proj" if kind == "v32_head_offset" else ".attn.wq_b"

        def weight_loader_v2(self, param, loaded_weight, *a, **k):
            if rank == 1 and self.prefix.endswith(suffix):
                saved = param.tp_rank
                param.tp_rank = 0
                try:
                    return orig(self, param, loaded_weight, *a, **k)
                finally:
                    param.tp_rank = saved
            return orig(self, param, loaded_weight, *a, **k)

        linear.ColumnParallelLinear.weight_loader_v2 = weight_loader_v2
        return f"rank 1 loads {suffix[1:]} rows of heads 0.. (rank 0's)"
    if kind == "o_proj_twice":
        # the plugin's o_proj all-reduces its output, then vLLM's wo_b all-reduces again
        from dsv4_ops.vllm import attention as va
        from vllm.distributed import tensor_model_parallel_all_reduce

        good = va.ampere_o_proj

        def twice(*a, **k):
            return tensor_model_parallel_all_reduce(good(*a, **k))

        va.ampere_o_proj = twice
        return "o_proj all-reduces before wo_b's own all-reduce"
    if kind == "engram_vocab_start":
        # rank 1's Engram table shard starts at rank 0's rows
        from vllm.models.deepseek_v41.common import engram

        cls = engram.ParallelEngramEmbedding
        orig_init = cls.__init__

        def __init__(self, *a, **k):
            orig_init(self, *a, **k)
            if rank == 1:
                self.vocab_start_idx = 0

        cls.__init__ = __init__
        return "rank 1's Engram vocab start = 0"
    if kind == "stage2_no_input_ids":
        return "the second stage runs without input_ids"
    if kind == "ep_expert_offset":
        # rank 1 (EP) loads rank 0's experts: global expert e < n_local into local slot e, its own
        # experts nowhere (vLLM's weight loader asks RoutedExperts where a global expert lives)
        from vllm.model_executor.layers.fused_moe import routed_experts

        cls = routed_experts.RoutedExperts
        orig = cls._map_global_expert_id_to_local_expert_id

        def mapped(self, expert_id):
            if rank != 1:
                return orig(self, expert_id)
            return expert_id if expert_id < self.local_num_experts else -1

        cls._map_global_expert_id_to_local_expert_id = mapped
        return "rank 1 loads rank 0's experts (global 0.. into its local slots)"
    raise ValueError(f"unknown plant {kind!r}")


class Recorder:
    """capture.Recorder over the layers this stage holds, and the all-reduce sites."""

    def __new__(cls, model):
        import capture

        class _R(capture.Recorder):
            def __init__(self, model):
                self.model = model
                self.steps, self.current, self._handles = [], None, []
                m = model.model
                for i in range(m.start_layer, m.end_layer):
                    self._hook_layer(i, m.layers[i])
                    self._hook_site(i, m.layers[i])

            def _hook_site(self, i, layer):
                for kind, mod in (("attn", layer.attn), ("ffn", layer.ffn)):
                    def pre(mod_, args, kwargs, kind=kind):
                        SITE[0] = (i, kind)

                    def post(mod_, args, kwargs, out):
                        SITE[0] = None

                    self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                    self._handles.append(mod.register_forward_hook(post, with_kwargs=True))

        return _R(model)


def make_checker(model, cfg, tp_group):
    """checks.Checker on this rank's share: the attention and MoE checks on the partial each
    sublayer hands the all-reduce, the LM head and embedding gathered whole."""
    import torch
    import checks
    import oracle as O

    F64 = torch.float64
    tp = tp_group.world_size

    def gather(w):
        return tp_group.all_gather(w.detach().contiguous(), dim=0) if tp > 1 else w.detach()

    def summed(t):
        s = t.detach().to(F64).clone()
        if tp > 1:
            torch.distributed.all_reduce(s, group=tp_group.cpu_group)
        return s

    class MRChecker(checks.Checker):
        def __init__(self):
            super().__init__(model, cfg)
            m = model.model
            self.head = gather(model.lm_head.weight).to(F64) if hasattr(model, "lm_head") and \
                type(model.lm_head).__name__ != "PPMissingLayer" else None
            self.embed = gather(m.embed_tokens.weight).to(F64) if type(m.embed_tokens).__name__ != "PPMissingLayer" \
                else None

        def _reduce(self, step, site, got_out):
            calls = step.allreduces.get(site, [])
            if tp == 1:
                return got_out, dict(allreduces=len(calls), reduce_ratio=0.0)
            assert calls, f"{site}: no tensor-parallel all-reduce ran"
            partial = calls[0][0]
            # every rank's partial summed in float64; the all-reduce rounds each partial sum to bf16
            s, mag = summed(partial), summed(partial.to(F64).abs())
            err = (got_out.detach().to(F64) - s).abs() / ((tp - 1) * 2.0 ** -8 * mag + 1e-30)
            return partial, dict(allreduces=len(calls), reduce_ratio=float(err.max()))

        def check_attention(self, step, rec):
            attn = self.m.model.layers[rec.layer].attn
            partial, red = self._reduce(step, (rec.layer, "attn"), rec.out)
            res = super().check_attention(step, dataclasses.replace(rec, out=partial))
            res.update(red, heads=[tp_group.rank_in_group * attn.n_local_heads,
                                   (tp_group.rank_in_group + 1) * attn.n_local_heads])
            return res

        def check_moe(self, step, rec):
            partial, red = self._reduce(step, (rec.layer, "ffn"), rec.ffn_out)
            ex = self.m.model.layers[rec.layer].ffn.experts.routed_experts
            if ex.w13_weight.shape[0] == self.cfg["n_routed_experts"]:
                res = super().check_moe(step, dataclasses.replace(rec, ffn_out=partial))
            else:
                # expert parallel: vLLM's combine hands this rank its own tokens through every
                # expert; the oracle runs on every rank's experts, all-gathered over the EP group
                # (each rank's are its own checkpoint shard: expert_shard_checks)
                from vllm.distributed import get_ep_group

                saved = dict(ex._parameters)
                for nm in ("w13_weight", "w2_weight"):
                    ex._parameters[nm] = torch.nn.Parameter(
                        get_ep_group().all_gather(saved[nm].detach().contiguous(), dim=0), requires_grad=False)
                try:
                    res = super().check_moe(step, dataclasses.replace(rec, ffn_out=partial))
                finally:
                    ex._parameters.update(saved)
                res["ep_gathered"] = True
            res.update(red)
            return res

        def check_logits(self, step, hidden, logits):
            ref = hidden.cpu().to(F64) @ self.head.T
            got = logits.cpu().to(F64)[:, : self.head.shape[0]]
            res = dict(step=step.name, layer=-1, kind="logits", tokens=got.shape[0], cos=checks.cosine(got, ref),
                       max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()),
                       argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).double().mean()))
            self.results.append(res)
            return res

        def check_first_mhc(self, step, rec):
            layer = self.m.model.layers[0]
            x = self.embed[step.batch["input_ids"].cpu()]
            T, D = x.shape
            streams = x[:, None, :].expand(T, self.cfg["hc_mult"], D)
            if self.v4:
                pre, _, _ = O.mhc_coeffs(streams, checks._w(layer.hc_attn_fn), checks._w(layer.hc_attn_base),
                                         checks._w(layer.hc_attn_scale), self.cfg["hc_eps"], self.cfg["rms_norm_eps"],
                                         self.cfg["hc_sinkhorn_iters"])
                x = O.mhc_collapse(streams, pre)
            ref = O.rms_norm(x, checks._w(layer.attn_norm.weight), self.cfg["rms_norm_eps"])
            got = rec.x.cpu().to(F64)
            res = dict(step=step.name, layer=0, kind="mhc_first", tokens=T, cos=checks.cosine(got, ref),
                       max_abs=float((got - ref).abs().max()), ref_max=float(ref.abs().max()))
            self.results.append(res)
            return res

        def check_stage_input(self, step, rec, streams):
            """A later V4 stage's first attention input: vLLM's lone mhc_pre on the streams the
            previous stage sent (not a fused boundary, so not among check_mhc_boundaries'):
            their collapse with the pre mix of those streams, RMS-normed."""
            layer = self.m.model.layers[rec.layer]
            s = streams.cpu().to(F64)
            pre, _, _ = O.mhc_coeffs(s, checks._w(layer.hc_attn_fn), checks._w(layer.hc_attn_base),
                                     checks._w(layer.hc_attn_scale), self.cfg["hc_eps"], self.cfg["rms_norm_eps"],
                                     self.cfg["hc_sinkhorn_iters"])
            ref = O.rms_norm(O.mhc_collapse(s, pre), checks._w(layer.attn_norm.weight), self.cfg["rms_norm_eps"])
            got = rec.x.cpu().to(F64)
            res = dict(step=step.name, layer=rec.layer, kind="mhc_stage_input", tokens=got.shape[0],
                       cos=checks.cosine(got, ref), max_abs=float((got - ref).abs().max()),
                       ref_max=float(ref.abs().max()))
            self.results.append(res)
            return res

        def check_mhc_boundaries(self, step, calls):
            # the base class finds a call's layer through every layer's hc weights; a pipeline
            # stage holds only its own (the others are PPMissingLayer, without hc weights): they
            # stand in as layers with empty weights, which no recorded call carries
            m = self.m.model
            if m.start_layer == 0 and m.end_layer == len(m.layers):
                return super().check_mhc_boundaries(step, calls)
            import types

            empty = torch.empty(0)
            held = [m.layers[i] if m.start_layer <= i < m.end_layer else
                    types.SimpleNamespace(hc_attn_fn=empty, hc_ffn_fn=empty, hc_attn_base=None, hc_attn_scale=None,
                                          attn_norm=None, hc_ffn_base=None, hc_ffn_scale=None, ffn_norm=None)
                    for i in range(len(m.layers))]
            assert all(c["fn"].numel() for c in calls)
            full = self.m
            self.m = types.SimpleNamespace(model=types.SimpleNamespace(layers=held))
            try:
                return super().check_mhc_boundaries(step, calls)
            finally:
                self.m = full

    return MRChecker()


def expert_shard_checks(model, ckpt: str, ep_rank: int, ep: int) -> list:
    """Expert parallel: this rank's local experts are the checkpoint's experts
    ``ep_rank * n_local ..`` (vLLM's linear placement), whole (w1, w3, w2); [] without EP."""
    if ep == 1:
        return []
    import torch
    from safetensors.torch import load_file

    ck = load_file(os.path.join(ckpt, "model.safetensors"))
    m = model.model
    out = []
    for i in range(m.start_layer, m.end_layer):
        ex = m.layers[i].ffn.experts.routed_experts
        nl = ex.w13_weight.shape[0]
        for j in range(nl):
            e = ep_rank * nl + j
            want = (torch.cat([ck[f"layers.{i}.ffn.experts.{e}.w1.weight"], ck[f"layers.{i}.ffn.experts.{e}.w3.weight"]]),
                    ck[f"layers.{i}.ffn.experts.{e}.w2.weight"])
            for got, w, nm in ((ex.w13_weight[j], want[0], "w13"), (ex.w2_weight[j], want[1], "w2")):
                ok = tuple(got.shape) == tuple(w.shape) and bool(torch.equal(got.detach().cpu().to(w.dtype), w))
                out.append(dict(param=f"layers.{i}.ffn.experts.{e}.{nm}", ok=ok, ep_local=j))
    return out


def shard_checks(model, cfg, ckpt: str, tp_rank: int, tp: int) -> list:
    """Each attention layer's query heads, sink, wo_a groups and wo_b columns, the experts'
    intermediate columns and the vocab slices this rank holds are the checkpoint's at this rank's
    offset (vLLM's loaders did the sharding; a wrong offset would still pass the oracle checks,
    which use the rank's own weights)."""
    import torch
    from safetensors.torch import load_file

    ck = load_file(os.path.join(ckpt, "model.safetensors"))
    m = model.model
    out = []

    def same(name, got, want):
        ok = tuple(got.shape) == tuple(want.shape) and bool(torch.equal(got.detach().cpu().to(want.dtype), want))
        out.append(dict(param=name, ok=ok))

    def rows(t, n):   # rank's slice of dim 0 into tp parts of n
        return t[tp_rank * n:(tp_rank + 1) * n]

    for i in range(m.start_layer, m.end_layer):
        a, f = m.layers[i].attn, m.layers[i].ffn
        hl, d, g, r = a.n_local_heads, a.head_dim, a.n_local_groups, a.o_lora_rank
        same(f"layers.{i}.attn.wq_b", a.wq_b.weight, rows(ck[f"layers.{i}.attn.wq_b.weight"], hl * d))
        same(f"layers.{i}.attn.attn_sink", a.attn_sink[:hl].float(), rows(ck[f"layers.{i}.attn.attn_sink"].float(), hl))
        same(f"layers.{i}.attn.wo_a", a.wo_a.weight, rows(ck[f"layers.{i}.attn.wo_a.weight"], g * r))
        wo_b = ck[f"layers.{i}.attn.wo_b.weight"]
        same(f"layers.{i}.attn.wo_b", a.wo_b.weight, wo_b[:, tp_rank * g * r:(tp_rank + 1) * g * r])
        ex = f.experts.routed_experts
        n = ex.w2_weight.shape[-1]
        if ex.w13_weight.shape[0] != cfg["n_routed_experts"]:   # EP: expert_shard_checks
            continue
        same(f"layers.{i}.ffn.experts.0.w1", ex.w13_weight[0, :n], rows(ck[f"layers.{i}.ffn.experts.0.w1.weight"], n))
        same(f"layers.{i}.ffn.experts.0.w2", ex.w2_weight[0],
             ck[f"layers.{i}.ffn.experts.0.w2.weight"][:, tp_rank * n:(tp_rank + 1) * n])
        if getattr(m.layers[i], "engram", None) is not None:
            e = m.layers[i].engram.embed_tokens
            out.append(dict(param=f"layers.{i}.engram.embed_tokens", ok=True,
                            shape=list(e.weight.shape), attrs={k: v for k, v in vars(e).items()
                                                               if isinstance(v, int) and not k.startswith("_")}))
    if type(m.embed_tokens).__name__ != "PPMissingLayer":
        v = m.embed_tokens.weight.shape[0]
        same("embed", m.embed_tokens.weight, rows(ck["embed.weight"], v))
    if hasattr(model, "lm_head") and type(model.lm_head).__name__ != "PPMissingLayer":
        v = model.lm_head.weight.shape[0]
        same("head", model.lm_head.weight, rows(ck["head.weight"], v))
    return out


def forward(sch, bt, hook, no_input_ids: bool):
    """Scheduler.forward with vLLM's pipeline hand-off: a stage after the first receives the
    previous stage's ``IntermediateTensors`` (``recv_tensor_dict``), a stage before the last sends
    its own (``send_tensor_dict``), as vLLM's GPU worker does. Returns (hidden, logits) on the last
    stage, (None, None) elsewhere."""
    import torch
    from vllm.distributed import get_pp_group, get_tp_group
    from vllm.forward_context import set_forward_context
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu import attn_utils

    b = sch.b
    md = attn_utils.build_attn_metadata(
        attn_groups=b.attn_groups, num_reqs=bt["num_reqs"], num_tokens=bt["num_tokens"],
        query_start_loc_gpu=bt["query_start_loc_gpu"], query_start_loc_cpu=bt["query_start_loc_cpu"],
        max_query_len=bt["max_query_len"], seq_lens=bt["seq_lens"], max_seq_len=bt["max_seq_len"],
        block_tables=bt["block_tables"], slot_mappings=bt["slot_mappings"], kv_cache_config=b.kv_cache_config,
        seq_lens_cpu_upper_bound=bt["seq_lens"].cpu(), positions=bt["positions"],
        is_prefilling=bt["is_prefilling"], req_idx=bt["req_idx"])
    by_layer = attn_utils.build_slot_mappings_by_layer(bt["slot_mappings"], b.kv_cache_config)
    pp = get_pp_group()
    with torch.no_grad(), set_forward_context(md, b.vllm_config, num_tokens=bt["num_tokens"], slot_mapping=by_layer):
        hook(bt)
        it = None
        if not pp.is_first_rank:
            it = IntermediateTensors(pp.recv_tensor_dict(all_gather_group=get_tp_group()))
            RECEIVED[0] = it["hidden_states"].detach().clone()
        ids = None if (no_input_ids and not pp.is_first_rank) else bt["input_ids"]
        kw = {}
        depth = getattr(b.model, "token_lookback_depth", 0)
        if depth:
            kw["lookback_token_ids"] = lookback(sch, bt, depth)
        out = b.model(input_ids=ids, positions=bt["positions"], intermediate_tensors=it, **kw)
        if not pp.is_last_rank:
            assert isinstance(out, IntermediateTensors), type(out)
            pp.send_tensor_dict(out.tensors, all_gather_group=get_tp_group())
            return None, None
        hidden = out[0] if isinstance(out, tuple) else out
        return hidden, b.model.compute_logits(hidden)


def build_at(model_cls, vllm_config, partition: str) -> str:
    """Build this stage's model class again, in this PP process, at ``partition``: the error that
    stops it ('' if it builds)."""
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype

    saved = os.environ.get("VLLM_PP_LAYER_PARTITION")
    os.environ["VLLM_PP_LAYER_PARTITION"] = partition
    try:
        with set_default_torch_dtype(torch.bfloat16):
            model_cls(vllm_config=vllm_config, prefix="illegal")
        return ""
    except Exception as exc:  # noqa: BLE001 (the test reads which error)
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:1500]
    finally:
        if saved is None:
            os.environ.pop("VLLM_PP_LAYER_PARTITION")
        else:
            os.environ["VLLM_PP_LAYER_PARTITION"] = saved


def lookback(sch, bt, depth: int):
    """What V4.1's model state hands an Engram model (``_gather_lookback_kernel``): per request of
    the batch, the ``depth`` tokens before its first scheduled one, nearest first, -1 before the
    request's start; rows past the batch -1."""
    import torch

    out = torch.full((sch.b.vllm_config.scheduler_config.max_num_seqs, depth), -1, dtype=torch.int32)
    for row, (rid, n) in enumerate(bt["schedule"]):
        req = sch.requests[rid]
        for k in range(depth):
            pos = req.computed - 1 - k
            if pos >= 0:
                out[row, k] = req.tokens[pos]
    return out.to(sch.b.device)


def prompts(model_name: str, prompt_set: int):
    """The two requests' prompt lengths and token seed of a prompt set: set 0 every layout's; set 1
    DP rank 1's (other tokens, other lengths: the DP ranks' batches differ in size)."""
    P0, P1 = (40, 24) if model_name == "v41" else (136, 24)
    if prompt_set:
        P0, P1 = P0 - 8, P1 - 4
    return P0, P1, SEED + prompt_set


def run_plan(model_name, cfg, b, no_input_ids: bool, prompt_set=None) -> dict:
    import torch
    import standins
    import steps
    from vllm.distributed import get_pp_group, get_tp_group

    rec = Recorder(b.model)
    sch = steps.Scheduler(b)
    chk = make_checker(b.model, cfg, get_tp_group())
    chk.fwd_ctx = b.vllm_config.compilation_config.static_forward_context
    from vllm.distributed import get_dp_group

    if prompt_set is None:   # DP attention: each DP rank its own requests
        prompt_set = get_dp_group().rank_in_group
    P0, P1, seed = prompts(model_name, prompt_set)
    g = torch.Generator().manual_seed(seed)
    vocab = cfg["vocab_size"]
    sch.add(0, torch.randint(2, vocab, (P0 + 12,), generator=g).tolist())
    sch.add(1, torch.randint(2, vocab, (P1 + 12,), generator=g).tolist())
    plan = [("prefill", [(0, P0)]), ("mixed", [(0, 1), (1, P1)]), ("decode1", [(0, 1), (1, 1)]),
            ("decode2", [(0, 1), (1, 1)])]
    pp = get_pp_group()
    trace = []
    standins.RECORD_BOUNDARIES = model_name == "v4"
    for name, schedule in plan:
        t = time.time()
        standins.BOUNDARIES.clear()
        ALLREDUCES.clear()
        bt = sch.batch(schedule)
        hidden, logits = forward(sch, bt, lambda batch, n=name: rec.begin(n, batch), no_input_ids)
        for rid, n in schedule:
            sch.requests[rid].computed += n
        step = rec.current
        step.allreduces = dict(ALLREDUCES)
        for i, lr in sorted(step.layers.items()):
            chk.check_attention(step, lr)
            chk.check_indexer(step, lr)
            chk.check_moe(step, lr)
        if pp.is_first_rank:
            chk.check_first_mhc(step, step.layers[0])
        elif model_name == "v4":
            lo = b.model.model.start_layer
            chk.check_stage_input(step, step.layers[lo], RECEIVED[0])
        if standins.BOUNDARIES:   # V4's fused post/pre calls (recorded for V4 only)
            chk.check_mhc_boundaries(step, standins.BOUNDARIES)
        entry = dict(step=name, topk={i: lr.topk.tolist() for i, lr in step.layers.items() if lr.topk is not None},
                     allreduce_sites={f"{k[0]}:{k[1]}" if len(k) == 2 else k[0]: len(v) for k, v in ALLREDUCES.items()})
        if pp.is_last_rank:
            assert torch.isfinite(logits).all(), f"{name}: non-finite logits"
            chk.check_logits(step, hidden, logits)
            entry["logits"] = logits.float().cpu().tolist()
        trace.append(entry)
        print(f"rank step {name} {time.time() - t:.1f}s", flush=True)
    standins.RECORD_BOUNDARIES = False
    return dict(checks=chk.results, trace=trace)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v41")
    ap.add_argument("--engram", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1, help="data parallel size (DP attention: each rank its own requests)")
    ap.add_argument("--ep", action="store_true", help="expert parallel (vLLM's enable_expert_parallel)")
    ap.add_argument("--prompt-set", type=int, default=None,
                    help="the requests of this prompt set (default: the DP rank's; prompts())")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--init", default=None,
                    help="file://PATH or tcp://127.0.0.1:PORT (every rank of the group the same)")
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (written by --write-ckpt)")
    ap.add_argument("--write-ckpt", action="store_true", help="write the checkpoint first (a one-rank run)")
    ap.add_argument("--partition", default=None, help="VLLM_PP_LAYER_PARTITION")
    ap.add_argument("--illegal-partition", default=None,
                    help="after the run, build the model again at this VLLM_PP_LAYER_PARTITION (must be refused)")
    ap.add_argument("--plant", default=os.environ.get("DSV4_E2E_MR_PLANT", ""))
    ap.add_argument("--cache-dtype", default=None,
                    help="V3.2 / GLM-5: the KV cache dtype (default multirank_v32.CACHE_DTYPES)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.partition:
        os.environ["VLLM_PP_LAYER_PARTITION"] = a.partition
    import vllm

    report = dict(vllm=vllm.__version__, model=a.model, engram=a.engram, tp=a.tp, pp=a.pp, rank=a.rank,
                  partition=a.partition, plant=a.plant, pid=os.getpid())
    try:
        _run(a, report)
    except BaseException as exc:  # noqa: BLE001 (the test reads which error stopped the rank)
        import traceback

        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["traceback"] = traceback.format_exc()[-6000:]
        raise
    finally:
        report["phases"] = dict(driver.PHASES)
        with open(a.out + ".tmp", "w") as f:
            json.dump(report, f, default=str)
        os.replace(a.out + ".tmp", a.out)


PREPARED = [False]


def prepare() -> None:
    """What every rank sets up the same way, whatever its model and layout: the CPU harness
    (driver.setup: vLLM's import, the platform answers, the plugin), the model modules and the
    model-independent stand-ins. Done once a process; under ``--jobs`` once in the parent, whose
    forks inherit it (vLLM's import is most of a rank process's start on 2 cores)."""
    if PREPARED[0]:
        return
    driver.setup("cpu")
    import build  # noqa: F401
    import capture  # noqa: F401
    import checkpoints  # noqa: F401
    import checks  # noqa: F401
    import counters  # noqa: F401
    import oracle  # noqa: F401
    import platform_spoof
    import standins
    import steps  # noqa: F401
    import tripwire  # noqa: F401
    import safetensors.torch  # noqa: F401
    import vllm.models.deepseek_v41.nvidia.model  # noqa: F401
    import vllm.models.deepseek_v4.nvidia.model  # noqa: F401
    import vllm.models.deepseek_v41.nvidia.flashmla  # noqa: F401
    import vllm.models.deepseek_v4.nvidia.flashmla  # noqa: F401
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401
    from vllm.v1.worker.gpu import attn_utils  # noqa: F401

    standins.install_mhc()
    standins.install_flashmla_metadata()
    platform_spoof.cpu_vllm_streams()
    install_tp_standins()
    install_allreduce_recorder()
    driver.mark("prepare")
    PREPARED[0] = True


def _run(a, report) -> None:
    prepare()
    if a.model in ("v32", "glm5"):   # DeepSeek-V3.2 / GLM-5: the one-rank V3.2 e2e's driver at this rank
        import multirank_v32

        multirank_v32.run(a, report, sys.modules[__name__])   # this module (``__main__`` under --jobs)
        driver.mark("steps")
        return
    import build
    import counters
    import standins  # noqa: F401
    import tripwire
    from dsv4_ops.vllm import attention as ampere_attention
    from dsv4_ops.vllm import plugin

    tripwire.install(a.model, plugin.STATE.originals)
    flashmla = {"v41": "vllm.models.deepseek_v41.nvidia.flashmla", "v4": "vllm.models.deepseek_v4.nvidia.flashmla"}
    counters.install(a.model, [ampere_attention.make_ampere_attention_cls(
        sys.modules[flashmla[a.model]].DeepseekV4FlashMLAAttention)])
    counters.install_ops()
    report["planted"] = plant(a.plant, a.rank)
    driver.mark("imports")
    cfg = model_config(a.model, a.engram)
    done = os.path.join(a.ckpt, "DONE")
    if a.write_ckpt:
        import checkpoints

        checkpoints.write_v4(checkpoints.manifest(a.model, cfg), a.ckpt, seed=0)
        open(done, "w").close()
        driver.mark("checkpoint")
    else:
        t0 = time.time()
        while not os.path.exists(done):
            if time.time() - t0 > 600:
                raise TimeoutError(f"no checkpoint at {a.ckpt}")
            time.sleep(0.5)
        driver.mark("wait_checkpoint")

    def adjust(vc):
        if vc.engram_config is not None:   # the table in ordinary memory (the engine: pinned, UVA)
            from vllm.config import EngramConfig

            vc.engram_config = EngramConfig(cpu_offload=False)

    import checkpoints
    from vllm.model_executor.models.registry import ModelRegistry

    if a.dp > 1 and os.environ.get("DSV4_E2E_DP_VLLM_AS_IS") != "1":
        # DSV4_E2E_DP_VLLM_AS_IS=1: the harness's communicator (no all2all manager: the first
        # failure, MULTIRANK.md); =2: vLLM's CpuCommunicator without the gatherv stand-ins (the second)
        install_cpu_communicator(standins=os.environ.get("DSV4_E2E_DP_VLLM_AS_IS") != "2")

    if cfg["architectures"][0] == "DeepseekV41ForCausalLM":
        # vLLM's name for the VL wrapper; the text class, as the engine's platform entry point maps it
        ModelRegistry.register_model(cfg["architectures"][0], build.TEXT_MODELS["DeepseekV41LLMForCausalLM"])
    with checkpoints._cpu_device_queries():
        b = build.build(cfg, "cpu", model_dir=a.ckpt, tp=a.tp, pp=a.pp, rank=a.rank, init_method=a.init,
                        adjust=adjust, dp=a.dp, ep=a.ep)
    driver.mark("build")
    from vllm.distributed import get_pp_group, get_tp_group

    m = b.model.model
    report["layers"] = [m.start_layer, m.end_layer]
    report["tp_rank"], report["pp_rank"] = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    report["shards"] = shard_checks(b.model, cfg, a.ckpt, get_tp_group().rank_in_group, a.tp)
    from vllm.distributed import get_dp_group, get_ep_group

    ep = get_ep_group() if a.ep else None
    report["dp_rank"] = get_dp_group().rank_in_group
    report["ep_rank"], report["ep_size"] = (ep.rank_in_group, ep.world_size) if ep else (0, 1)
    report["shards"] += expert_shard_checks(b.model, a.ckpt, report["ep_rank"], report["ep_size"])
    report.update(run_plan(a.model, cfg, b, a.plant == "stage2_no_input_ids", a.prompt_set))
    report["gatherv_calls"] = dict(GATHERV_CALLS)
    report["gatherv_sizes"] = sorted({str(v) for v in GATHERV_SIZES})
    if a.illegal_partition:
        report["illegal_partition"] = build_at(type(m), b.vllm_config, a.illegal_partition)
    driver.mark("steps")
    report["tripped"] = list(tripwire.TRIPPED)
    report["ops_called"] = dict(counters.OPS)
    report["standin_calls"] = dict(standins.CALLS)


def run_jobs(path: str) -> None:
    """Every rank of every group named in the jobs file, one forked process each, from this one
    process after ``prepare()``: vLLM is imported once, not once a rank. The file: ``jobs``
    [{name, group, argv, log}], ``timeout`` (s), ``summary`` (where each rank's exit status and wall
    time go). A rank that dies leaves its group's peers blocked in gloo: they are killed a few
    seconds later (time to write their reports), the other groups go on."""
    import signal

    spec = json.load(open(path))
    prepare()
    import torch

    # a child that inherits a started OpenMP pool hangs at its first parallel region: the set-up
    # runs no parallel op, and each rank runs on one thread (no parallel region at all)
    zygote_threads = len(os.listdir("/proc/self/task"))
    # the inherited objects out of the collector's reach: a collection in a rank would otherwise
    # touch (and so copy) every page of the parent's heap
    import gc

    gc.collect()
    gc.freeze()
    t0 = time.time()
    live, done, failed_at = {}, {}, {}
    for job in spec["jobs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:   # the rank
            rc = 1
            try:
                # killed with the parent (a test timeout or interrupt kills the parent only)
                import ctypes

                ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                # one thread a rank: the ranks outnumber the cores (threads would only contend)
                torch.set_num_threads(1)
                driver.PHASES.clear()
                driver._last[0] = time.time()
                main(job["argv"])
                rc = 0
            except BaseException:  # noqa: BLE001 (main wrote the report; the log gets the traceback)
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        live[pid] = job
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            job = live.pop(pid)
            rc = os.waitstatus_to_exitcode(status)
            done[job["name"]] = dict(rc=rc, wall_s=round(time.time() - t0, 1))
            if rc != 0:
                failed_at.setdefault(job["group"], time.time())
            continue
        time.sleep(0.2)
        now = time.time()
        for pid, job in live.items():
            if now - t0 > spec["timeout"] or now - failed_at.get(job["group"], now + 1) > 5:
                os.kill(pid, signal.SIGKILL)
    with open(spec["summary"], "w") as f:
        json.dump(dict(ranks=done, prepare_s=driver.PHASES.get("setup", 0) + driver.PHASES.get("prepare", 0),
                       zygote_threads=zygote_threads), f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--jobs"]:
        run_jobs(sys.argv[2])
    else:
        main()
