"""The paged decode's launch plan (op ``dsv4_decode_fused_out``), made once per layout and run many
times: FlashInfer's plan() / run() split, for the eager decode step that vLLM runs per layer.

``make_paged_plan`` turns the decisions of one paged decode call (dispatch.decode.plan_step: from the
layout only, T, H, K1, K2, the SM count, the caches' block sizes, page strides and alignment, the
device, the knobs) into its launch: the kernel, grids, constexprs and the integer launch arguments. ``launch_paged`` runs a plan on the call's tensors: one attention
launch (+ the merge when it splits), nothing else. The op's launcher
(``paged_decode.dsv4_decode_fused``) makes a plan per call and launches through FastKernel; the
composite's eager path (``dsv4_decode.dsv4_decode_attention``) keeps the plan of each layout in
``_KEPT`` (one plan serves every layer of a step: the layers share T, H, K and the caches'
layout) and launches through the compiled kernels directly, into ``scratch`` buffers.

Scratch (``scratch_partials``): the split partials (o_part fp32 [T, H, S, 512], lse_part fp32
[T, H, S]) and, for a caller that drops it, the lse fp32 [T, H] come from one buffer per (device,
stream), grown (never shrunk; exactly to the size asked, the old buffer freed first) to the
largest call seen: no allocation per call once warm. Safe because every
user of a buffer runs on that one stream, in order: a call's merge has read the partials before
the next call's attention kernel writes them. Never used while the stream is capturing a CUDA
graph (a graph would keep the buffer's address while a later growth frees it): captured calls
allocate from the graph's private pool, as the op does.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from . import _launch
from .attention import _merge_kernel
from .csrc_triton.decode import balance as _bk
from .csrc_triton.decode import merge as _mk
from .csrc_triton.decode import paged_chunk128 as _vk
from .csrc_triton.decode import paged_f16dot as _v4k
from .dispatch import decode as _dd
from .dispatch import device as _device
from .layout import HEAD_DIM

_v3_kernel = _launch.fast(_vk._dsv4_decode_v3_kernel)
_v4_kernel = _launch.fast(_v4k._dsv4_decode_v4_kernel)
_merge_balanced = _launch.fast(_mk._merge_balanced_kernel)
_balance_plan = _launch.fast(_bk._balance_plan_kernel)
# Tokens a step of the planning kernel's passes over the lengths (csrc_triton.decode.balance)
BALANCE_CHUNK = 128
# Partial rows the balanced merge takes a step at most (64 with the sink spills 48 B on sm_80)
BALANCED_MERGE_ROWS = 32


def _capped_v4(maxnreg: int):
    """A launch of the paged_f16dot kernel with a register cap, through Triton's own launch."""
    def kernel(grid, args, consts, num_warps, num_stages):
        _v4k._dsv4_decode_v4_kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    return kernel


class PagedPlan:
    """One paged decode call's decisions for a layout. T, H tokens and heads; config the launch
    config (paged_chunk128's or paged_f16dot's); splits S (direct: S == 1, the kernel writes out + lse);
    kernel a FastKernel (or a capped plain launch); grid / consts / num_warps / num_stages its
    launch; ints_a (H, K1, K2, S, G) and ints_b (strides, page facts) its integer arguments around
    sm_scale; merge_* the merge launch (S > 1). balanced: the splits follow the tokens' lengths
    (dispatch.decode.balanced): the planning kernel (plan_ints / plan_consts) writes the plan words
    (csrc_triton.decode.balance) into lse_part's tail, the attention kernel writes its partials as rows
    [T * S, H], and merge_kernel (the balanced merge) reads them by the plan. plan_arg: the attention
    kernel takes the plan pointer (paged_f16dot). entries: the compiled launchers (run, function,
    packed metadata) of the attention, merge and planning kernels once verified (``launch_paged``
    fills it)."""

    __slots__ = ("T", "H", "config", "splits", "direct", "kernel", "grid", "consts", "num_warps",
                 "num_stages", "ints_a", "ints_b", "merge_grid", "merge_ints", "merge_consts", "merge_warps",
                 "merge_stages", "entries", "balanced", "merge_kernel", "plan_arg", "plan_ints", "plan_consts")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def partials_shape(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(o_part, lse_part) shapes: fp32 [T, H, S, 512], fp32 [T, H, S]; balanced, lse_part is flat:
        the partial lse rows [T * S * H], then from ``words_offset()`` the plan words (int32 bits)."""
        T, H, S = self.T, self.H, self.splits
        if self.balanced:
            return (T, H, S, HEAD_DIM), (self.words_offset() + _bk.plan_words(T, S),)
        return (T, H, S, HEAD_DIM), (T, H, S)

    def words_offset(self) -> int:
        """Where the plan words start in a balanced lse_part: after the T * S * H lse rows, rounded up
        to 16 bytes (the kernels are specialized on the pointer's 16-byte alignment)."""
        return -(-self.T * self.splits * self.H // 4) * 4


def paged_aligned(compressed_cache: torch.Tensor, swa_cache: torch.Tensor) -> bool:
    """Both caches' addresses and page strides are multiples of 16 bytes (vLLM's are): the paged
    kernels' 16-byte vector reads (ALIGN) and paged_f16dot may run."""
    return not (compressed_cache.data_ptr() % 16 or swa_cache.data_ptr() % 16
                or compressed_cache.stride(0) % 16 or swa_cache.stride(0) % 16)


def make_paged_plan(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                    topk_length: Optional[torch.Tensor], compressed_block_size: int, swa_cache: torch.Tensor,
                    swa_slots: torch.Tensor, swa_length: Optional[torch.Tensor], swa_block_size: int,
                    has_sink: bool, num_splits: int, out: torch.Tensor, variant: str, config: str = "") -> PagedPlan:
    """The plan of ``dsv4_decode_fused`` for these (checked) inputs: reads only metadata (shapes,
    strides, dtypes, device, 16-byte alignment of the caches) and the knobs; every decision is
    dispatch.decode.plan_step's. Slots [T, K] with unit-stride entries; out bf16 [T, H, 512];
    num_splits 0 = the plan's count; config '' = the plan's."""
    T, H = q.shape[0], q.shape[1]
    K1, K2 = topk_slots.shape[1], swa_slots.shape[1]
    dev = q.get_device()
    aligned = paged_aligned(compressed_cache, swa_cache)
    plan = _dd.plan_step(T, H, K1 + K2, _device.num_sms_at(dev), _device.smem_per_block(dev),
                         (compressed_block_size, swa_block_size), num_splits, config,
                         topk_length is not None or swa_length is not None,
                         topk_slots.dtype == torch.int32 and swa_slots.dtype == torch.int32, aligned)
    name = plan.config
    cfg = _dd.v3_config(name)
    scalars = (compressed_cache.stride(0), compressed_block_size, compressed_cache.shape[0] * compressed_block_size,
               swa_cache.stride(0), swa_block_size, swa_cache.shape[0] * swa_block_size)
    maxnreg = None
    balanced = plan.balanced
    if _dd.is_f16dot(cfg):  # csrc_triton.decode.paged_f16dot: block sizes as shifts, 16-byte aligned caches
        scalars = (scalars[0], compressed_block_size.bit_length() - 1, scalars[2],
                   scalars[3], swa_block_size.bit_length() - 1, scalars[5])
        consts_tail = (True, cfg["PV_KEY"], cfg.get("STREAM", False), cfg.get("WIDE_PV", False), balanced)
        plan_arg = True
        maxnreg = cfg.get("maxnreg")
        # register-capped: the plain launch (no fast path for it)
        kernel = _capped_v4(maxnreg) if maxnreg and _v4_kernel.jit else _v4_kernel
    else:  # csrc_triton.decode.paged_chunk128: 16-byte vector reads where the caches allow them
        kernel, consts_tail, plan_arg = _v3_kernel, (cfg["PIPE"], aligned), False
    head = (plan.block_h, plan.block_n, variant == "native", topk_length is not None, swa_length is not None)
    S = plan.splits
    if plan.direct:
        consts = head + (has_sink, True) + consts_tail
        ints_b = (q.stride(0), q.stride(1), topk_slots.stride(0), swa_slots.stride(0), out.stride(0), out.stride(1),
                  *scalars)
        grid = (T * plan.groups,)
        merge = dict(merge_grid=None, merge_ints=None, merge_consts=None, merge_warps=None, merge_stages=None,
                     merge_kernel=None)
    else:
        consts = head + (False, False) + consts_tail
        ints_b = (q.stride(0), q.stride(1), topk_slots.stride(0), swa_slots.stride(0), 0, 0, *scalars)
        grid = (T * S * plan.groups,)
        if balanced:  # the merge steps over a token's partials S at a time (csrc_triton.decode.balance)
            bn = plan.block_n
            mcfg = _mk.merge_config(min(S, BALANCED_MERGE_ROWS), HEAD_DIM)
            merge = dict(merge_grid=(T * H, HEAD_DIM // mcfg["BLOCK_D"]),
                         merge_ints=(H, T * S, out.stride(0), out.stride(1)),
                         merge_consts=(HEAD_DIM, mcfg["BLOCK_S"], mcfg["BLOCK_D"], has_sink),
                         merge_kernel=_merge_balanced,
                         plan_ints=(T, S, K1, K2),
                         plan_consts=(bn, topk_length is not None, swa_length is not None, BALANCE_CHUNK))
        else:
            mcfg = _mk.merge_config(S, HEAD_DIM)
            merge = dict(merge_grid=(T * H, HEAD_DIM // mcfg["BLOCK_D"]),
                         merge_ints=(H, S, out.stride(0), out.stride(1)),
                         merge_consts=(HEAD_DIM, mcfg["BLOCK_S"], mcfg["BLOCK_D"], has_sink), merge_kernel=_merge_kernel)
        merge.update(merge_warps=mcfg["num_warps"], merge_stages=mcfg["num_stages"])
    return PagedPlan(T=T, H=H, config=name, splits=S, direct=plan.direct, kernel=kernel, grid=grid,
                     consts=consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                     ints_a=(H, K1, K2, S, plan.groups), ints_b=ints_b, entries=None, balanced=balanced,
                     plan_arg=plan_arg, **merge)


def launch_paged(p: PagedPlan, q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length,
                 sink, sm_scale: float, out, lse, o_part=None, lse_part=None, compiled: bool = False,
                 step_plans: Optional[dict] = None) -> None:
    """Run plan ``p``: the attention kernel into (out, lse) when direct, else into (o_part,
    lse_part) and the merge into (out, lse). Tensors as the plan was made for (sink fp32 [H] or
    None; o_part / lse_part of ``p.partials_shape()``, contiguous). ``compiled``: call the kernels'
    compiled launchers directly once verified (the caller keyed the plan on every argument's
    16-byte alignment being 0, so the specialization is the plan's); else FastKernel launches
    (what a recording of the op sees). Balanced (``p.balanced``): the planning kernel writes the plan
    words into lse_part's tail first; with ``step_plans`` (a dict the caller keeps for one step and one
    layer type) the words of the step's first call of this shape are kept there and later calls launch
    no planning kernel (the plan sets only the balance, so words from the step's first layer serve the
    others whatever their lengths)."""
    if not (p.T and p.H):
        return
    sm_scale = float(sm_scale)
    words = None
    make_plan = True
    if p.balanced and step_plans is not None:
        key = (p.plan_ints, p.plan_consts)
        words = step_plans.get(key)
        make_plan = words is None
        if make_plan:
            words = step_plans[key] = torch.empty(_bk.plan_words(p.T, p.splits), dtype=torch.int32,
                                                  device=lse_part.device)
    if p.direct:
        args = (q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, sink, out, lse)
    else:
        args = (q, compressed_cache, topk_slots, topk_length, swa_cache, swa_slots, swa_length, None, o_part,
                lse_part)
        if p.balanced:
            if words is None:
                words = lse_part.view(-1)[p.words_offset():].view(torch.int32)
            pargs = (topk_length, swa_length, words, *p.plan_ints)
            margs = (o_part, lse_part, words, sink, out, lse) + p.merge_ints
        else:
            margs = (o_part, lse_part, sink, out, lse) + p.merge_ints
    args = args + ((words,) if p.plan_arg else ()) + (*p.ints_a, sm_scale, *p.ints_b)
    e = p.entries
    if compiled and e is not None and _launch.ENABLED and _launch._hooks_idle():
        st = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        if p.balanced and make_plan:
            e[2][0](1, 1, 1, st, e[2][1], e[2][2], None, None, None, *pargs, *p.plan_consts)
            _balance_plan.stats["fast"] += 1
        g = p.grid
        e[0][0](g[0], 1, 1, st, e[0][1], e[0][2], None, None, None, *args, *p.consts)
        p.kernel.stats["fast"] += 1
        if not p.direct:
            m = p.merge_grid
            e[1][0](m[0], m[1], 1, st, e[1][1], e[1][2], None, None, None, *margs, *p.merge_consts)
            p.merge_kernel.stats["fast"] += 1
        return
    if p.balanced and make_plan:
        _balance_plan((1,), pargs, p.plan_consts, 4, 1)
    p.kernel(p.grid, args, p.consts, p.num_warps, p.num_stages)
    if not p.direct:
        p.merge_kernel(p.merge_grid, margs, p.merge_consts, p.merge_warps, p.merge_stages)
    if compiled and e is None and p.kernel.__class__ is _launch.FastKernel:
        first = _launch.compiled_entry(p.kernel, args, p.consts, p.num_warps, p.num_stages)
        second = (None if p.direct else
                  _launch.compiled_entry(p.merge_kernel, margs, p.merge_consts, p.merge_warps, p.merge_stages))
        # balanced: kept once a call has launched (and so verified) the planning kernel too
        third = _launch.compiled_entry(_balance_plan, pargs, p.plan_consts, 4, 1) if p.balanced and make_plan else None
        if first is not None and (p.direct or second is not None) and (not p.balanced or third is not None):
            p.entries = (first, second, third)


# ---- scratch: the split partials (and a dropped lse) without an allocation per call ----------

_SCRATCH: Dict[tuple, list] = {}  # (device index, raw stream) -> [fp32 buffer, {shape key: views}]
_VIEWS_KEPT = 64


def scratch_partials(p: PagedPlan, device: torch.device, want_lse: bool):
    """(o_part, lse_part, lse or None) for plan ``p`` on the current stream of ``device``: views of
    the stream's scratch buffer (see the module doc), lse included when ``want_lse``. The caller
    checked that the stream is not capturing."""
    dev = torch._C._cuda_getDevice() if device.type == "cuda" else -1
    key = (dev, torch._C._cuda_getCurrentRawStream(dev) if dev >= 0 else 0)
    entry = _SCRATCH.get(key)
    vkey = (p.T, p.H, p.splits if not p.direct else 0, want_lse)
    if entry is not None:
        got = entry[1].get(vkey)
        if got is not None:
            return got
    T, H, S = p.T, p.H, (p.splits if not p.direct else 0)
    o_shape, l_shape = p.partials_shape()
    n_o, n_x = T * H * S * HEAD_DIM, (T * H if want_lse else 0)
    n_l = math.prod(l_shape) if S else 0
    o0, l0 = 0, -(-n_o // 4) * 4  # each part starts at a multiple of 4 fp32: 16-byte aligned
    x0 = l0 + -(-n_l // 4) * 4
    need = x0 + n_x
    if entry is None or entry[0].numel() < need or entry[0].device != device:
        # the old buffer goes first (stream-ordered reuse is safe): a growth never holds both, and
        # the exact size keeps a call's peak what dsv4_decode.decode_peak_bytes accounts
        _SCRATCH.pop(key, None)
        entry = None
        entry = _SCRATCH[key] = [torch.empty(need, dtype=torch.float32, device=device), {}]
    buf = entry[0]
    views = (buf[o0:o0 + n_o].view(T, H, S, HEAD_DIM) if S else None,
             buf[l0:l0 + n_l].view(l_shape) if S else None,
             buf[x0:x0 + n_x].view(T, H) if want_lse else None)
    if len(entry[1]) >= _VIEWS_KEPT:
        entry[1].clear()
    entry[1][vkey] = views
    return views


def scratch_bytes() -> int:
    """Bytes held by the scratch buffers of every (device, stream)."""
    return sum(e[0].numel() * 4 for e in _SCRATCH.values())


def clear_scratch() -> None:
    """Drop every scratch buffer (tests; memory back to the caching allocator)."""
    _SCRATCH.clear()
