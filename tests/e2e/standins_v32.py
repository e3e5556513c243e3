"""CPU stand-ins for the vLLM C++ ops DeepSeek-V3.2's sm_80 path keeps (they are compiled for
sm_80 in vLLM's wheel and run there natively; the CPU run has no ``vllm._C``). Each is a
plain torch function of the op's documented semantics, counted like standins.py's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from standins import _define, _lib


def _silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_((F.silu(x[..., :d].float()) * x[..., d:].float()).to(out.dtype))


def _grouped_topk(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor, bias, scoring_func,
                  is_padding=None):
    """DeepSeek-V3 noaux_tc routing (``_custom_ops.grouped_topk``'s documented semantics):
    select with the bias-corrected scores (groups by the sum of their top-2), weigh with the
    uncorrected ones; returns (weights fp32 [n, topk], ids int32 [n, topk]). ``is_padding`` (a
    bool row mask, where vLLM passes one): padded rows get zero weights and -1 ids."""
    s = scores.float().sigmoid() if scoring_func == 1 else scores.float()
    sel = s + bias.float()[None]
    n, e = sel.shape
    group = sel.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(topk_group, dim=-1).indices, 1.0)
    keep = keep[:, :, None].expand(n, n_group, e // n_group).reshape(n, e).bool()
    ids = sel.masked_fill(~keep, float("-inf")).topk(topk, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    w, ids = w * routed_scaling_factor, ids.to(torch.int32)
    if is_padding is not None:
        pad = is_padding.bool()[:, None]
        w, ids = w.masked_fill(pad, 0.0), ids.masked_fill(pad, -1)
    return w, ids


def install() -> None:
    c, moe = _lib("_C"), _lib("_moe_C")
    _define(c, "_C", "silu_and_mul(Tensor(a!) out, Tensor x) -> ()", _silu_and_mul)
    _define(moe, "_moe_C", "grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, "
            "float routed_scaling_factor, Tensor bias, int scoring_func, Tensor? is_padding=None) -> (Tensor, Tensor)",
            _grouped_topk)
