"""Private CUDA graphs of the Ampere decode step, replayed inside vLLM's eager segment.

Switch: ``DSV4_AMPERE_DECODE_GRAPHS=1`` turns it on; default OFF (read at every call, so a
process can flip it). When off, ``_forward_decode`` runs exactly as before.

What it does. ``GraphCache.run(key, fn, device)``: on the first call with ``key`` it runs
``fn()`` eagerly (the correct result for that call, and the warm-up: Triton compiles and the
direct-launch caches fill), then captures one more ``fn()`` into a ``torch.cuda.CUDAGraph``
(on a side stream, ``capture_error_mode="thread_local"``, memory from a private pool shared
by every decode graph of that device and stream; nothing runs during a capture, so the output
is not touched twice). Later calls with the same key replay the graph: one cudaGraphLaunch,
which re-reads the inputs IN PLACE at the captured addresses. That is correct only because
the key holds everything the captured work depends on:
- every tensor read, as (data_ptr, shape, strides, dtype), None kept as None;
- every Python scalar that reaches a kernel or a branch (T, block sizes, scale, swa_only,
  compress ratio, num_decodes);
- the kernel variant (``DSV4_AMPERE_IMPL``) and the current stream.
Nothing in the captured work depends on tensor VALUES on the host (no sync anywhere on the
decode path), so same key => same kernels, same arguments. Any new pointer => a new capture.
Bounded: at most ``max_graphs`` (64) graphs a layer, least recently used evicted; a cache
that has captured ``max_captures`` (256) graphs turns itself off (eager from then on, one
warning): an address that changes every step would otherwise pay a capture (~1 ms) a step.
Never captures: while the current stream is capturing (vLLM's own FULL graph around us: we
run eagerly and are captured into it), on CPU tensors, or after a failed capture (the cache
turns itself off, warns; that call's output came from the eager run).

Evidence from vLLM 0.33.0 and 0.34.0 (read in their sources; file:line as 0.33.0 / 0.34.0 where
they differ; everything below holds on both):
- ``compilation/breakable_cudagraph.py:100-116 / 108-124``: an ``@eager_break_during_capture``
  function called inside a breakable capture ENDS the current stream capture (``add_eager`` ->
  ``_end_segment`` -> ``capture_end``), runs eagerly, and records
  ``lambda: fn(*weak_args, **weak_kwargs)`` for replay; ``replay()`` (213-215 / 221-223) calls
  the graph segments and these lambdas in order on the current stream. So the eager body (our
  ``_forward_decode``) runs with no capture in progress, both at vLLM's capture time and at
  every replay: a private capture there is legal. With ``cudagraph_runtime_mode == FULL``
  (106-109 / 114-117), or outside any breakable capture (model runner V2 captures its FULL
  graphs with a plain ``torch.cuda.graph``, ``v1/worker/gpu/cudagraph_utils.py`` 0.34.0:531-537),
  ``fn`` runs inline, i.e. inside vLLM's own FULL capture when there is one:
  ``torch.cuda.is_current_stream_capturing()`` is then True and we run eagerly (our kernels
  land in vLLM's graph, as without this module).
- The replayed lambda holds weak refs to the CAPTURE-time arguments (111-116 / 119-124): the
  ``q`` / ``out`` that ``_sparse_indexer_and_attn`` receives (V4
  ``models/deepseek_v4/attention.py:737-761 / 694-718``, V4.1 ``models/deepseek_v41/attention.py``
  1034 / 1072) are the same graph-pool addresses at every replay of one batch descriptor, and
  ``forward_mqa`` slices them at offset 0 (``q[:num_decode_tokens]``, ``output[:num_decode_tokens]``:
  V4 ``nvidia/flashmla.py:166-171 / 162-167``, V4.1 180-185 / 192-197).
- The metadata tensors are views of builder-owned persistent buffers:
  ``DeepseekSparseSWAMetadataBuilder`` (``v1/attention/backends/mla/sparse_swa.py:504-560 /
  510-566`` allocates ``token_to_req_indices``, ``decode_swa_indices``, ``decode_swa_lens``,
  ``is_valid_token`` once; ``build`` (620-760 / 626-766) fills them in place and hands out
  ``decode_swa_indices[:T]`` / ``decode_swa_lens[:T]``; 0.34.0's DSpark non-causal index buffer is
  allocated once too); ``block_table`` is ``cm.block_table_tensor``
  (``models/deepseek_v4/sparse_mla.py:218``, the input batch's persistent table); C128A's
  ``c128a_global_decode_topk_indices`` is a view of ``c128a_global_decode_buffer`` (268-282; its
  WIDTH follows ``max_seq_len`` in powers of 2, so a C128A layer recaptures when the longest
  sequence crosses a power of 2); ``topk_indices_buffer`` is the model's one buffer
  (``models/deepseek_v4/attention.py:299 / 301``); the KV caches are allocated once. So for a
  fixed (batch descriptor, num_decode_tokens, num_decodes, C128A width) the key repeats step
  after step.
- Not covered by vLLM's buffers, hence captured INSIDE our graph: vLLM's
  ``compute_global_topk_indices_and_lens`` (``models/deepseek_v4/common/ops/cache_utils.py:550``,
  V4.1 0.34.0 ``models/deepseek_v41/common/ops/cache_utils.py:729``, unchanged) allocates its
  outputs with ``torch.empty_like`` every call; inside the graph they live in the private pool,
  so their addresses never enter the key.
- Caveat on the benefit: which batches reach the eager segment. vLLM captures uniform decode
  batches as FULL graphs and the other (mixed, token-keyed) batches as PIECEWISE graphs, the
  breakable wrapper only when the mode has piecewise graphs (``v1/worker/gpu/cudagraph_utils.py``
  195-198 / 228-231; V4 and V4.1 default to breakable graphs, ``config/vllm.py``
  ``DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES``; 0.34.0 removed the V1 runner, whose
  ``gpu_model_runner.py:5130-5150`` did the same). The mode is vLLM's ``cudagraph_mode``
  (default FULL_AND_PIECEWISE) downgraded to the LEAST support over the layer set's builders
  (``config/compilation.py:1376 / 1535`` ``resolve_cudagraph_mode_and_sizes``). The Ampere class
  keeps vLLM's ``backend_cls`` / ``swa_backend_cls``, so it reports what vLLM's FlashMLA builders
  report: V4 ALWAYS on both releases (``models/deepseek_v4/sparse_mla.py:289``,
  ``nvidia/flashmla.py:42 / 39``); V4.1 ALWAYS on 0.33.0 but UNIFORM_BATCH on 0.34.0
  (``models/deepseek_v41/sparse_mla.py:258``, ``nvidia/flashmla.py:44``, ``compressor.py:101``;
  "prefill metadata is not graph-safe"). The indexer's builder
  (``v1/attention/backends/mla/indexer.py:992-999 / 979-985``) gives UNIFORM_BATCH on sm_8x unless
  its decode is flattened (1 + speculative tokens not in (1, 2)). Hence on sm_8x
  (tests/test_decode_graph.py::test_cudagraph_support_on_sm80_per_vllm_release):
  * without speculation (or with 1 speculative token) both models resolve UNIFORM_BATCH on both
    releases: 0.34.0 changes nothing. Uniform decode batches within the capture sizes replay
    vLLM's FULL graph (our decode inside it, no eager host cost); mixed prefill + decode batches,
    ``cudagraph_mode=PIECEWISE`` and sizes past the FULL capture list run the eager segment,
    where this module applies; ``cudagraph_mode=FULL`` is downgraded (to FULL_AND_PIECEWISE).
  * with >= 2 speculative tokens (MTP / DSpark) V4 resolves ALWAYS on both, and so did V4.1 on
    0.33.0: ``cudagraph_mode=FULL`` then captured mixed batches, prefill included, as FULL
    graphs. V4.1 on 0.34.0 resolves UNIFORM_BATCH: FULL is downgraded to FULL_AND_PIECEWISE
    (a warning), its mixed batches reach the eager segment, and its FULL decode graphs take
    decode batches of 1 to ``max_decode_query_len`` (1 + speculative tokens + drafting slots,
    ``v1/attention/backend.py:565-583``) tokens a request, lengths read on the device
    (adaptive verification, ``v1/worker/gpu/spec_decode/adaptive_verification.py:614-638``; 0.33.0
    replayed any such batch). The Ampere decode reads the same metadata as vLLM's FlashMLA
    decode (host ``num_decode_tokens`` / ``num_decodes``, every per-token length and validity
    on the device), so it takes the batches vLLM's does (reasoned from the source; not run on a
    GPU here).
  Mixed batches vary num_decode_tokens per step: more keys (bounded by the LRU).
- 0.34.0 also removed the V1 runner's wide eager region (``_prepare_and_attn_eager``, 0.33.0
  V4 ``attention.py:542``, V4.1 ``attention.py:831``, used only with
  ``VLLM_USE_V2_MODEL_RUNNER=0``): the eager segment is ``_sparse_indexer_and_attn`` alone, as
  on 0.33.0's default runner; it holds this decode.

Why OFF by default: the correctness argument holds only while the key lists every input the
eager body reads; that list (``forward_decode_key``) mirrors ``_AmpereAttentionMixin.
_forward_decode`` / ``_decode_topk`` by hand (a test records the reads and checks it), and a
vLLM change that adds a read would silently go stale. The private pool also holds up to one
decode step's scratch (workspace T * 640 * 1 KiB, split partials) outside vLLM's memory
profile. Turn it on after ``benchmarks/bench_decode_graph.py`` shows a gain on the host.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

from .. import envs

ENV_VAR = envs.DECODE_GRAPHS
MAX_GRAPHS = 64
MAX_CAPTURES = 4 * MAX_GRAPHS
_CACHE_ATTR = "_dsv4_decode_graphs"


def enabled() -> bool:
    """True when ``DSV4_AMPERE_DECODE_GRAPHS=1`` (default off)."""
    return envs.get(ENV_VAR)


def tensor_key(t: Optional[torch.Tensor]) -> Optional[Tuple]:
    """(data_ptr, shape, strides, dtype) of a tensor; None stays None. No device field: CUDA's
    unified virtual addressing gives every allocation of the process, on any device, its own
    address, so the pointer names the device (and CPU tensors never reach a capture)."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def args_key(args: Sequence[Any]) -> Tuple:
    """Key of a flat argument list: tensors by ``tensor_key``, None, bool/int/float/str by
    (type, value). Anything else raises TypeError (an unkeyable argument must not be
    replayed)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(tensor_key(a))
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append((type(a).__name__, a))
        else:
            raise TypeError(f"decode_graph: cannot key an argument of type {type(a).__name__}")
    return tuple(out)


def context_key(device_index: int) -> Tuple:
    """The state outside the arguments that changes what gets captured: variant override and
    the current stream."""
    return (envs.raw(envs.IMPL), envs.override_key(), torch._C._cuda_getCurrentRawStream(device_index))


# ---- capture -------------------------------------------------------------------------------

_POOLS: Dict[Tuple[int, int], Any] = {}
_SIDE_STREAMS: Dict[int, torch.cuda.Stream] = {}


_POOL_ANCHORS: Dict[Tuple[int, int], Any] = {}


def _pool_for(device_index: int, stream: int, side: "torch.cuda.Stream"):
    """One private memory pool per (device, replay stream), shared by every decode graph: the
    graphs of one stream never run concurrently, and each frees its scratch before its
    capture ends, so they may reuse each other's scratch.

    The pool is anchored by an empty graph that lives as long as the process: the caching
    allocator frees a pool when its last graph dies, and a later capture into the same
    handle then fails its internal ``use_count > 0`` assertion (seen on the H200 once a
    test's cache had been collected)."""
    key = (device_index, stream)
    pool = _POOLS.get(key)
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
        anchor = torch.cuda.CUDAGraph()
        with torch.cuda.device(device_index), torch.cuda.stream(side), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
            anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
            anchor.capture_end()
        _POOLS[key], _POOL_ANCHORS[key] = pool, anchor
    return pool


def capture_cuda_graph(fn: Callable[[], Any], device: torch.device) -> torch.cuda.CUDAGraph:
    """Capture one ``fn()`` into a new CUDA graph (nothing runs). Side stream, thread-local
    capture mode (other threads' CUDA calls stay legal), the shared private pool."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cur = torch.cuda.current_stream(idx)
    side = _SIDE_STREAMS.get(idx)
    if side is None:
        side = _SIDE_STREAMS[idx] = torch.cuda.Stream(idx)
    pool = _pool_for(idx, cur.cuda_stream, side)
    side.wait_stream(cur)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(idx), torch.cuda.stream(side):
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        except BaseException:
            try:
                g.capture_end()
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
        g.capture_end()
    cur.wait_stream(side)
    return g


class GraphCache:
    """Graphs by key, least recently used evicted past ``max_graphs``.

    ``capture(fn, device) -> object with .replay()`` is injectable (tests use a fake).
    ``stats``: hits, misses, captures, evictions, eager_capturing (vLLM was capturing),
    eager_cpu, eager_off (switch off or cache disabled), failures.
    """

    def __init__(self, max_graphs: int = MAX_GRAPHS, max_captures: int = MAX_CAPTURES,
                 capture: Callable[[Callable[[], Any], torch.device], Any] = capture_cuda_graph,
                 name: str = "decode"):
        self.max_graphs, self.max_captures, self.capture, self.name = max_graphs, max_captures, capture, name
        self.graphs: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.disabled: Optional[str] = None
        self.stats = dict(hits=0, misses=0, captures=0, evictions=0, eager_capturing=0, eager_cpu=0,
                          eager_off=0, failures=0)

    def clear(self) -> None:
        self.graphs.clear()

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()
        warnings.warn(f"dsv4_ops decode graphs ({self.name}): off for this layer from now on: {why}",
                      RuntimeWarning, stacklevel=3)

    def run(self, key: Hashable, fn: Callable[[], Any], device: torch.device) -> None:
        """``fn()``'s effect (it must write only into its given buffers; its return value is
        dropped): a replay on a hit, else eager and, when allowed, a capture for next time."""
        st = self.stats
        if self.disabled is not None:
            st["eager_off"] += 1
            fn()
            return
        if device.type != "cuda":
            st["eager_cpu"] += 1
            fn()
            return
        if torch.cuda.is_current_stream_capturing():
            st["eager_capturing"] += 1
            fn()
            return
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            st["hits"] += 1
            g.replay()
            return
        st["misses"] += 1
        fn()  # this call's result, and the warm-up of everything the capture records
        if st["captures"] >= self.max_captures:
            self._disable(f"{st['captures']} captures (addresses keep changing; hits {st['hits']})")
            return
        try:
            g = self.capture(fn, device)
        except Exception as exc:  # noqa: BLE001 - eager already produced this call's output
            st["failures"] += 1
            self._disable(f"capture failed: {exc!r}"[:300])
            return
        st["captures"] += 1
        self.graphs[key] = g
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            st["evictions"] += 1


def cache_for(owner: Any, name: str = "decode") -> GraphCache:
    """The GraphCache stored on ``owner`` (a layer), created on first use."""
    cache = owner.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = GraphCache(name=name)
        owner.__dict__[_CACHE_ATTR] = cache
    return cache


# ---- the two call sites ------------------------------------------------------------------------

def forward_decode_key(layer: Any, q: torch.Tensor, kv_cache: Optional[torch.Tensor], swa_metadata: Any,
                       attn_metadata: Any, swa_only: bool, output: torch.Tensor, T: int) -> Tuple:
    """Everything ``_AmpereAttentionMixin._forward_decode`` (and ``_decode_topk``) reads.

    Keep in step with those two methods (tests/test_decode_graph.py records their reads).
    The top-k inputs of both branches (C4A / V4.1: the indexer buffer and block table; V4
    C128A: the precomputed indices) are keyed whenever the layer is not SWA-only: a branch's
    unused fields only cost spurious recaptures, never a wrong replay.
    """
    sm = swa_metadata
    parts = [T, bool(swa_only), float(layer.scale), int(sm.block_size), int(sm.num_decodes),
             tensor_key(q), tensor_key(output), tensor_key(layer.swa_cache_layer.kv_cache),
             tensor_key(sm.decode_swa_indices), tensor_key(sm.decode_swa_lens), tensor_key(layer.attn_sink)]
    if not swa_only:
        am = attn_metadata
        parts += [int(layer.compress_ratio), int(am.block_size), tensor_key(kv_cache),
                  tensor_key(layer.topk_indices_buffer), tensor_key(sm.token_to_req_indices),
                  tensor_key(am.block_table), tensor_key(sm.is_valid_token),
                  tensor_key(getattr(am, "c128a_global_decode_topk_indices", None)),
                  tensor_key(getattr(am, "c128a_decode_topk_lens", None))]
    parts.append(context_key(q.device.index if q.device.index is not None else torch.cuda.current_device())
                 if q.is_cuda else None)
    return tuple(parts)


def run_forward_decode(layer: Any, step: Callable[[], None], key_args: Tuple) -> None:
    """``step()`` through the layer's graph cache (``key_args``: ``forward_decode_key``'s
    arguments after ``layer``)."""
    q = key_args[0]
    if not q.is_cuda:
        step()
        return
    cache_for(layer).run(forward_decode_key(layer, *key_args), step, q.device)


def graphed(cache: GraphCache, fn: Callable[..., None], *args) -> None:
    """``fn(*args)`` (e.g. ``vllm.attention.ampere_decode`` with all its 12/13 positional
    arguments) through ``cache``; the key is every argument (``args_key``) plus ``context_key``.
    For benchmarks and tests."""
    q = args[0]
    key = args_key(args) + (context_key(q.device.index) if q.is_cuda else None,)
    cache.run(key, lambda: fn(*args), q.device)
