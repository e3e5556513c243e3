"""DeepSeek-V4 decode attention in one call: gather the top-k compressed slots and the
sliding-window slots from their two fp8_ds_mla caches into one bf16 workspace, then run
split-KV sparse MLA with the sink.

Workspace layout (bf16 [R >= T*(K1+K2), 512], rows):
  [0, T*K1)              compressed top-k rows, token-major (row t*K1 + j = topk_slots[t, j])
  [T*K1, T*(K1+K2))      window rows, token-major (row T*K1 + t*K2 + j = swa_slots[t, j])
indices[t] = concat(t*K1 + j, T*K1 + t*K2 + j), with -1 where the slot is invalid (< 0 or
>= num_blocks * block_size of its cache, where the gather wrote a zero row that must not be
attended) or the entry is past the token's length (j >= topk_length[t] / swa_length[t]).

Everything here calls ``torch.ops.dsv4_ampere.*`` on static shapes: no host sync, so the
composite captures into a CUDA graph and traces under ``torch.compile(fullgraph=True)``.
Host cost (vLLM runs this eagerly for mixed prefill + decode batches, per layer per
step): in plain eager CUDA calls (``_host_plan.direct_ok``: no compile, mode, functorch transform or
profiler) the paged op's step runs from a kept plan (``_kept_step``: one ``paged_plan.PagedPlan`` per
layout, made on the first call and reused by every layer of every step with that layout; no
allocation when ``out`` is given and the lse dropped: the partials live in per-stream scratch);
the ops are called without the dispatcher hop (``_direct_op``), the route memoised on the
environment it reads (``_host_plan.env_memo``), the ops replaying recorded launch plans
(``_host_plan.planned``). Argument checks live in the ops (cheap dtype/shape/device tests per call,
deep cache-layout checks once per layout).

The route (dispatch.decode.resolve_route): the paged op (modes auto and v3) is ONE op call,
``dsv4_decode_fused_out`` (dsv4_ops.paged_decode), reading the paged records by slot inside the
attention kernel (no workspace, no gather launch; + the merge launch when it splits; its plan is
dispatch.decode.plan_step's). The workspace step (modes tiles and heads, batch invariance): three
kernels and two op calls, ``dsv4_decode_gather`` (both gathers and the index build in one launch),
then ``sparse_mla_decode`` (``sparse_mla_decode_out`` when the caller gives the output buffer).
Same semantics.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import _host_plan, envs
from . import paged_plan as _pp
from .dispatch import decode as _dd
from .dispatch import device as _device
from .dispatch import windows as _windows
from .dispatch import workspace as _ws
from .layout import HEAD_DIM
from .registration import library as _library

def _direct_op(name: str) -> Callable:
    """A caller of ``torch.ops.dsv4_ampere.<name>`` that skips the dispatcher hop when
    ``direct_ok(first argument)``: it then calls the op's registered CUDA kernel itself (the same
    function the dispatcher would call, ``registration.library.cuda_impl``). Positional arguments
    only."""
    found = []

    def call(*args):
        if _host_plan._is_compiling():  # traced: the op itself (Dynamo sees the fake impl)
            return getattr(torch.ops.dsv4_ampere, name)(*args)
        if not found:
            found.append(_library.cuda_impl(name))
        impl = found[0]
        if impl is not None and _host_plan.direct_ok(args[0]):
            out = impl(*args)
            for observe in _host_plan.DIRECT_OBSERVERS:
                observe(name, args, out)
            return out
        # looked up at each call, never cached: whoever stands in for torch.ops.dsv4_ampere (the
        # warm set's tracer routes it to the launchers) is what a non-direct call reaches
        return getattr(torch.ops.dsv4_ampere, name)(*args)

    call.__name__ = name
    return call


_fused_out = _direct_op("dsv4_decode_fused_out")
_decode_gather = _direct_op("dsv4_decode_gather")
_sparse_mla_decode = _direct_op("sparse_mla_decode")
_sparse_mla_decode_out = _direct_op("sparse_mla_decode_out")
_is_compiling = torch.compiler.is_compiling


def _gather_two_launches(ops, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                         swa_slots, swa_length, swa_block_size, workspace):
    """The large-T path: two kv_cache_gather_into + dsv4_decode_indices (same workspace layout
    and indices as dsv4_decode_gather)."""
    T, K1 = topk_slots.shape
    K2 = swa_slots.shape[1]
    if swa_length is not None:
        j = torch.arange(K2, device=swa_slots.device)
        swa_slots = torch.where(j[None, :] < swa_length[:T, None], swa_slots, -1)
    if topk_length is not None:
        topk_length = topk_length[:T]
    if T * K1:
        ops.kv_cache_gather_into(compressed_cache, topk_slots, compressed_block_size, workspace, 0)
    if T * K2:
        ops.kv_cache_gather_into(swa_cache, swa_slots, swa_block_size, workspace, T * K1)
    return ops.dsv4_decode_indices(topk_slots, topk_length, swa_slots, compressed_cache.shape[0] * compressed_block_size,
                                   swa_cache.shape[0] * swa_block_size)


def _route() -> str:
    """dispatch.decode.route under the current DSV4_AMPERE_DECODE_KERNEL mode."""
    return _dd.route(_dd.mode())


_route_memo = _host_plan.env_memo(_route)  # memoised on the env it reads


def decode_peak_bytes(T: int, H: int, K1: int, K2: int, sms: int, smem: int, aligned: bool = True,
                      block_sizes: tuple = (64, 64)) -> Tuple[str, int]:
    """(route, bytes) of what one dsv4_decode_attention call allocates on the device besides
    its inputs and the caller's ``out`` (vLLM's memory profile skips the attention call, so
    these are the bytes it never reserved), for the current mode: the paged op's lse fp32
    [T, H] plus its split partials (fp32 [T, H, S, 513], + the balanced plan's words) when it
    splits; the workspace step's bf16 workspace [T * K, 512], int32 indices [T, K], and its
    kernel's partials + lse.
    ``aligned``: the caches' page strides and addresses are multiples of 16 (vLLM's are)."""
    K = K1 + K2
    m = _dd.mode()
    choice = _dd.route(m)
    if choice == "paged":
        S = _dd.plan_step(T, H, K, sms, smem, block_sizes, aligned=aligned).splits
        # + the balanced split's plan words (int32 [T * S + T], 16-byte aligned) when it may run (an upper bound)
        words = (T * S + T + 3) * 4 if S > 1 and envs.get(envs.DECODE_BALANCE) else 0
        return choice, T * H * 4 + (T * H * S * (HEAD_DIM + 1) * 4 + words if S > 1 else 0)
    wplan = _ws.plan(T, H, K, sms, m)  # modes tiles / heads; int32 indices (the gather's)
    partials = T * H * wplan.splits * (HEAD_DIM + 1) * 4 if (wplan.kernel == "tiles" or wplan.splits > 1) else 0
    return choice, T * K * HEAD_DIM * 2 + T * K * 4 + T * H * 4 + partials


def dsv4_decode_attention(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                          swa_cache: torch.Tensor, swa_slots: torch.Tensor, sink: Optional[torch.Tensor],
                          sm_scale: float, compressed_block_size: int, swa_block_size: int,
                          topk_length: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                          num_splits: int = 0, swa_length: Optional[torch.Tensor] = None,
                          out: Optional[torch.Tensor] = None, return_lse: bool = True,
                          step_plans: Optional[dict] = None,
                          plan: Optional["DecodeStepPlan"] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One DSv4 decode attention step.

    q bf16 [T, H, 512]; compressed_cache, swa_cache uint8 [num_blocks, page_bytes] (584-byte
    fp8_ds_mla records, see dsv4_ops.layout); topk_slots int [T, K1] slots of the compressed
    cache (-1: none); swa_slots int [T, K2] slots of the window cache (-1: none); sink float
    [H] or None; topk_length / swa_length int [>= T] or None (entries j >= length[t] are
    ignored); workspace bf16 [>= T*(K1+K2), 512] contiguous or None (allocated); num_splits
    0 = heuristic; out bf16 [T, H, 512] (dims unit-stride) to write in place, or None;
    return_lse False: the lse is not returned (None), so the eager paged path writes it into
    scratch instead of allocating it. step_plans: a dict the caller keeps for one step and one layer
    type (vLLM: per step metadata) or None: the step's first call of a layout makes its
    DecodeStepPlan there (make_decode_plan) and the later calls run it; where the balanced split runs
    (``DSV4_AMPERE_DECODE_BALANCE=1``) its plan words are made once a step there too
    (paged_plan.launch_paged). plan: a DecodeStepPlan (make_decode_plan) to run, or None.
    Returns out bf16 [T, H, 512] (``out`` itself when given), lse fp32 [T, H] (or None).
    Eager CUDA calls of the paged op (the common case) run the step's plan, or ``_kept_step``: the
    layout's plan, made once and reused by every later call; no allocation. A plan is run only by a
    call of its layout (else the call plans); traced calls ignore it (the op plans in the graph).
    """
    if workspace is None and _host_plan.ENABLED and _host_plan.direct_ok(q) and q.dtype is torch.bfloat16:
        args = (q, compressed_cache, topk_slots, swa_cache, swa_slots, sink, sm_scale, compressed_block_size,
                swa_block_size, topk_length, num_splits, swa_length, out, return_lse, step_plans)
        r = None
        if plan is not None:
            r = _run_step_plan(plan, *args)
        elif step_plans is not None:  # the step's plans of this layer type: made by its first call of a layout
            kept = step_plans.get(_STEP_PLAN)
            if kept is None:
                kept = step_plans[_STEP_PLAN] = []
            for p in kept:
                r = _run_step_plan(p, *args)
                if r is not None:
                    break
            if r is None and len(kept) < _STEP_PLANS_KEPT:
                p = make_decode_plan(q, compressed_cache, topk_slots, swa_cache, swa_slots, sink, compressed_block_size,
                                     swa_block_size, topk_length, num_splits, swa_length, out)
                if p is not None:
                    kept.append(p)
                    r = _run_step_plan(p, *args, checked=True)
        if r is None:
            r = _kept_step(*args)
        if r is not None:
            return r
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and q.dtype == torch.bfloat16):
        from ._checks import check_tensor

        check_tensor("q", q, dtypes=(torch.bfloat16,), ndim=3)
    T = q.shape[0]
    if not (isinstance(topk_slots, torch.Tensor) and topk_slots.dim() == 2 and topk_slots.shape[0] == T):
        raise ValueError(f"topk_slots: expected an int tensor of {T} rows (one per token), got "
                         f"{tuple(topk_slots.shape) if isinstance(topk_slots, torch.Tensor) else type(topk_slots)}")
    K1, K2 = topk_slots.shape[1], swa_slots.shape[1]
    rows = T * (K1 + K2)
    choice = _route() if _is_compiling() else _route_memo()  # traced: plain reads (no memo tables)
    if choice == "paged":
        # one op: the paged records read inside the attention kernel (no workspace)
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        lse = _fused_out(q, compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache, swa_slots,
                         swa_length, swa_block_size, sink, sm_scale, num_splits, out)
        return out, (lse if return_lse else None)
    if workspace is None:
        workspace = torch.empty((rows, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    elif not (workspace.dim() == 2 and workspace.shape[0] >= rows and workspace.shape[1] == HEAD_DIM):
        raise ValueError(f"workspace: expected at least ({rows}, {HEAD_DIM}), got {tuple(workspace.shape)}")
    if _ws.gather_in_one_launch(rows):
        indices = _decode_gather(compressed_cache, topk_slots, topk_length, compressed_block_size, swa_cache,
                                 swa_slots, swa_length, swa_block_size, workspace)
    else:
        indices = _gather_two_launches(torch.ops.dsv4_ampere, compressed_cache, topk_slots, topk_length,
                                       compressed_block_size, swa_cache, swa_slots, swa_length, swa_block_size,
                                       workspace)
    if out is None:
        out, lse = _sparse_mla_decode(q, workspace, indices, None, sink, sm_scale, num_splits)
        return out, (lse if return_lse else None)
    lse = _sparse_mla_decode_out(q, workspace, indices, None, sink, sm_scale, num_splits, out)
    return out, (lse if return_lse else None)


# ---- the kept plans of the eager paged step ----------------------------------------------------
# Key: every layout fact the composite's and the paged op's decisions and checks read (shapes,
# strides, dtypes, devices of every argument; the caches' address and storage offset % 16; the
# other arguments' addresses OR-ed % 16: when 0 the compiled kernels of the plan are called
# directly), the current device, the window tables, the overrides and the environment variables
# the planning read (learnt as _host_plan.env_memo learns them). One plan serves every layer of a
# step (same T, H, K, caches' layout) and every later step of that T: nothing is set per step.
_KEPT: dict = {}
_KEPT_ENV: list = []
_host_plan._TABLES.append(_KEPT)  # _host_plan.clear() forgets them too
_SLOW = object()  # the layout takes the general path (workspace step, a copy, a bad argument)


def _kept_key(q, cc, topk, cw, swa, sink, topk_length, num_splits, swa_length, out, bs_c, bs_w):
    """The layout key of one composite call (see above); AttributeError for a non-tensor."""
    return (torch._C._cuda_getDevice(), envs._OVERRIDE_KEY, _windows.identity(), bs_c, bs_w, num_splits,
            q.dtype, q.shape, q.stride(), q.get_device(),
            topk.dtype, topk.shape, topk.stride(), topk.get_device(),
            swa.dtype, swa.shape, swa.stride(), swa.get_device(),
            cc.dtype, cc.shape, cc.stride(), cc.get_device(), cc.data_ptr() & 15, cc.storage_offset() & 15,
            cw.dtype, cw.shape, cw.stride(), cw.get_device(), cw.data_ptr() & 15, cw.storage_offset() & 15,
            None if sink is None else (sink.dtype, sink.shape, sink.stride(), sink.get_device()),
            None if topk_length is None else (topk_length.dtype, topk_length.shape, topk_length.stride(),
                                              topk_length.get_device()),
            None if swa_length is None else (swa_length.dtype, swa_length.shape, swa_length.stride(),
                                             swa_length.get_device()),
            None if out is None else (out.dtype, out.shape, out.stride(), out.get_device()),
            (q.data_ptr() | topk.data_ptr() | swa.data_ptr() | (0 if sink is None else sink.data_ptr())
             | (0 if topk_length is None else topk_length.data_ptr())
             | (0 if swa_length is None else swa_length.data_ptr()) | (0 if out is None else out.data_ptr())) & 15)


def _make_kept(q, cc, topk, cw, swa, sink, topk_length, num_splits, swa_length, out, bs_c, bs_w, aligned):
    """The PagedPlan of a composite call that the paged op serves without a copy, else _SLOW.
    The composite's route and the op's checks and plan, as the general path
    makes them."""
    from . import paged_decode
    from .attention import check_splits
    from .dispatch import variant_for

    T, H = q.shape[0], q.shape[1]
    if topk.dim() != 2 or topk.shape[0] != T:
        return _SLOW
    if _dd.route(_dd.mode()) != "paged":
        return _SLOW
    paged_decode.check_fused_args(q, cc, topk, topk_length, bs_c, cw, swa, swa_length, bs_w, sink, out)
    if (topk.stride(1) != 1 and topk.shape[1]) or (swa.stride(1) != 1 and swa.shape[1]) \
            or any(x is not None and x.stride(0) != 1 for x in (topk_length, swa_length)) \
            or (sink is not None and (sink.dtype != torch.float32 or (sink.stride(0) != 1 and H > 1))):
        return _SLOW  # the launcher would copy: the general path
    if num_splits:
        check_splits(num_splits)
    if out is None:
        out = torch.empty_strided((T, H, HEAD_DIM), (H * HEAD_DIM, HEAD_DIM, 1), dtype=torch.bfloat16, device="meta")
    plan = _pp.make_paged_plan(q, cc, topk, topk_length, bs_c, cw, swa, swa_length, bs_w, sink is not None,
                               num_splits, out, variant_for(q))
    return plan, aligned


def _kept_miss(key, k, args):
    """Make (and keep) the plan of a key not kept yet: (PagedPlan, aligned) or _SLOW; a planning that
    raises is not kept (the general path raises it again with its own message)."""
    try:
        v, read = _host_plan._read_env_logged(_make_kept, args + (key[-1] == 0,))
    except (ValueError, TypeError, RuntimeError):
        return _SLOW
    new = [n for n in sorted(read or (), key=repr) if n not in _KEPT_ENV]
    if new:
        _KEPT_ENV.extend(new)
        _KEPT.clear()
        get = _host_plan._ENVIRON.get
        k = (key, tuple([get(n) for n in _KEPT_ENV]))
    if len(_KEPT) >= _host_plan.MAX_KEYS:
        _KEPT.clear()
    _KEPT[k] = v
    return v


def clear_kept() -> None:
    """Forget the kept plans (after changing module constants the planning reads)."""
    _KEPT.clear()


def _kept_plan(q, cc, topk, cw, swa, sink, bs_c, bs_w, topk_length, num_splits, swa_length, out):
    """(PagedPlan, aligned) of this layout, kept; None: the general path runs."""
    env = _host_plan._ENVIRON
    if env is None:
        return None
    get = env.get
    try:
        key = _kept_key(q, cc, topk, cw, swa, sink, topk_length, num_splits, swa_length, out, bs_c, bs_w)
        k = (key, tuple([get(n) for n in _KEPT_ENV]))
        got = _KEPT.get(k)
    except (AttributeError, TypeError, RuntimeError):  # a non-tensor, an unhashable argument, no storage
        return None
    if got is None:
        got = _kept_miss(key, k, (q, cc, topk, cw, swa, sink, topk_length, num_splits, swa_length, out, bs_c, bs_w))
    return None if got is _SLOW else got


def _kept_step(q, cc, topk, cw, swa, sink, sm_scale, bs_c, bs_w, topk_length, num_splits, swa_length, out,
               return_lse, step_plans=None):
    """The eager paged step from its kept plan: out allocated when None, lse allocated only when
    returned, the partials (and a dropped lse) in paged_plan's per-stream scratch, except while the
    stream captures a graph (then allocated, as the op does). None: the general path runs."""
    got = _kept_plan(q, cc, topk, cw, swa, sink, bs_c, bs_w, topk_length, num_splits, swa_length, out)
    if got is None:
        return None
    return _run_kept(got[0], got[1], q, cc, topk, cw, swa, sink, sm_scale, bs_c, bs_w, topk_length, num_splits,
                     swa_length, out, return_lse, step_plans)


def _run_kept(p, aligned, q, cc, topk, cw, swa, sink, sm_scale, bs_c, bs_w, topk_length, num_splits, swa_length, out,
              return_lse, step_plans):
    if out is None:
        out = torch.empty((p.T, p.H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    if q.is_cuda and torch._C._cuda_isCurrentStreamCapturing():
        lse = torch.empty((p.T, p.H), dtype=torch.float32, device=q.device)
        o_part = lse_part = None
        if not p.direct:
            o_part, lse_part = (torch.empty(s, dtype=torch.float32, device=q.device) for s in p.partials_shape())
    else:
        o_part, lse_part, lse = _pp.scratch_partials(p, q.device, not return_lse)
        if return_lse:
            lse = torch.empty((p.T, p.H), dtype=torch.float32, device=q.device)
    _pp.launch_paged(p, q, cc, topk, topk_length, cw, swa, swa_length, sink, sm_scale, out, lse, o_part, lse_part,
                     compiled=aligned, step_plans=step_plans)
    _host_plan.STATS["kept"] += 1
    if _host_plan.DIRECT_OBSERVERS:
        args = (q, cc, topk, topk_length, bs_c, cw, swa, swa_length, bs_w, sink, sm_scale, num_splits, out)
        for observe in _host_plan.DIRECT_OBSERVERS:
            observe("dsv4_decode_fused_out", args, lse)
    return out, (lse if return_lse else None)


# ---- the step's plan, made once and run by every layer (FlashInfer's plan() / run()) --------------


class DecodeStepPlan:
    """One decode step's plan for one layer type: every decision of its paged launch
    (``dispatch.decode.plan_step``: config, splits, balance; ``why`` says which rules decided) and the
    launch itself (``paged_plan.PagedPlan``), made once by ``make_decode_plan`` and run by each layer's
    ``dsv4_decode_attention(..., plan=...)`` (FlashMLA's get_mla_metadata / FlashInfer's plan() and
    run()). A call runs it when its layout key (every argument's dtype, shape, strides, device and
    16-byte alignment, the block sizes, the split count, the knobs the planning read) is the plan's;
    else the call plans as it would without one (never wrong, only a lookup more)."""

    __slots__ = ("paged", "aligned", "_key", "_why_args")

    def __init__(self, paged, aligned, key, why_args):
        self.paged, self.aligned, self._key, self._why_args = paged, aligned, key, why_args

    @property
    def config(self) -> str:
        """The launch config (paged_chunk128's h... or paged_f16dot's kh...)."""
        return self.paged.config

    @property
    def splits(self) -> int:
        return self.paged.splits

    @property
    def why(self) -> str:
        """The planner's reasons (computed on asking: never on the hot path)."""
        return _dd.plan_step(*self._why_args).why

    def __repr__(self) -> str:
        return f"DecodeStepPlan(T={self.paged.T}, H={self.paged.H}, config={self.config}, splits={self.splits})"


def _step_key(q, cc, topk, cw, swa, sink, bs_c, bs_w, topk_length, num_splits, swa_length, out):
    get = _host_plan._ENVIRON.get
    return (_kept_key(q, cc, topk, cw, swa, sink, topk_length, num_splits, swa_length, out, bs_c, bs_w),
            tuple([get(n) for n in _KEPT_ENV]))


def make_decode_plan(q: torch.Tensor, compressed_cache: torch.Tensor, topk_slots: torch.Tensor,
                     swa_cache: torch.Tensor, swa_slots: torch.Tensor, sink: Optional[torch.Tensor],
                     compressed_block_size: int, swa_block_size: int, topk_length: Optional[torch.Tensor] = None,
                     num_splits: int = 0, swa_length: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None) -> Optional[DecodeStepPlan]:
    """The plan of a ``dsv4_decode_attention`` call with these arguments (same meaning), for the calls
    that share its layout (a step's layers of one type): the paged op's launch, made now. None where
    the call would not take the kept paged launch (the workspace route, a copy of an argument, a
    traced, profiled or non-CUDA call): pass ``plan=None`` then."""
    if not (_host_plan.ENABLED and _host_plan.direct_ok(q) and q.dtype is torch.bfloat16
            and _host_plan._ENVIRON is not None):
        return None
    args = (q, compressed_cache, topk_slots, swa_cache, swa_slots, sink, compressed_block_size, swa_block_size,
            topk_length, num_splits, swa_length, out)
    got = _kept_plan(*args)
    if got is None:
        return None
    why_args = (got[0].T, got[0].H, topk_slots.shape[1] + swa_slots.shape[1], _device.num_sms_at(q.get_device()),
                _device.smem_per_block(q.get_device()), (compressed_block_size, swa_block_size), num_splits, "",
                topk_length is not None or swa_length is not None,
                topk_slots.dtype == torch.int32 and swa_slots.dtype == torch.int32, got[1])
    return DecodeStepPlan(got[0], got[1], _step_key(*args), why_args)


def _run_step_plan(plan, q, cc, topk, cw, swa, sink, sm_scale, bs_c, bs_w, topk_length, num_splits, swa_length, out,
                   return_lse, step_plans, checked=False):
    """Run ``plan`` (a DecodeStepPlan) when this call's layout key is the plan's (``checked``: the plan
    was just made from these very arguments), else None."""
    if not checked:
        try:
            key = _step_key(q, cc, topk, cw, swa, sink, bs_c, bs_w, topk_length, num_splits, swa_length, out)
        except (AttributeError, TypeError, RuntimeError):
            return None
        if key != plan._key:
            return None
    _host_plan.STATS["step_plan"] += 1
    return _run_kept(plan.paged, plan.aligned, q, cc, topk, cw, swa, sink, sm_scale, bs_c, bs_w, topk_length,
                     num_splits, swa_length, out, return_lse, step_plans)


_STEP_PLAN = "decode_step_plans"  # the key of a step_plans dict's DecodeStepPlan list
_STEP_PLANS_KEPT = 4  # layouts a step's layer type may hold (a target's and a draft's window widths, ...)
