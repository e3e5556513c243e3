"""Private decode CUDA graphs (dsv4_ops.vllm.decode_graph): keying, LRU, the switch, the
read-set guard of ``forward_decode_key`` (CPU, fake capture), and on the GPU: replay on new
values at the same addresses == eager, a new address recaptures and stays right, vLLM's own
capture around us runs eagerly, and the Ampere ``_forward_decode`` end to end."""

import sys
import types

import pytest
import torch

from dsv4_ops import reference
from dsv4_ops.layout import min_page_bytes
from dsv4_ops.testing import poison_like, rng
from dsv4_ops.vllm import attention as vattn
from dsv4_ops.vllm import decode_graph as dg
from dsv4_ops.vllm.table import V41

D = 512
CUDA0 = torch.device("cuda", 0)


# ---- CPU: keys, LRU, switch ------------------------------------------------------------------

def test_args_key_distinguishes_pointer_shape_stride_dtype_and_scalars():
    base = torch.zeros(4, 8)
    k = dg.args_key
    assert k((base, 1, None)) == k((base, 1, None))
    assert k((base,)) == k((base.view(4, 8),))  # same pointer, shape, strides
    assert k((base,)) != k((base[1:],))  # pointer
    assert k((base,)) != k((base.view(8, 4),))  # shape
    assert k((base[:, :4],)) != k((base.view(8, 4)[:4],))  # same pointer and shape, strides differ
    assert k((base,)) != k((base.view(torch.int32),))  # dtype
    assert k((base, 1)) != k((base, 2)) and k((base, 1)) != k((base, 1.0)) and k((base, 1)) != k((base, True))
    assert k((None,)) != k((0,))
    with pytest.raises(TypeError, match="cannot key"):
        k(([1, 2],))


class FakeGraph:
    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def replay(self):
        self.log.append("replay")
        self.fn()


def fake_cache(log, **kw):
    def capture(fn, device):
        log.append("capture")
        return FakeGraph(fn, log)

    return dg.GraphCache(capture=capture, **kw)


@pytest.fixture
def not_capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_first_sight_runs_eagerly_then_captures_then_replays(not_capturing):
    log = []
    c = fake_cache(log)
    fn = lambda: log.append("eager")  # noqa: E731
    c.run("k", fn, CUDA0)
    assert log == ["eager", "capture"]
    c.run("k", fn, CUDA0)
    c.run("k", fn, CUDA0)
    assert log[2:] == ["replay", "eager", "replay", "eager"]  # the fake replay re-runs fn
    assert c.stats["hits"] == 2 and c.stats["misses"] == 1 and c.stats["captures"] == 1


def test_lru_evicts_least_recently_used(not_capturing):
    log = []
    c = fake_cache(log, max_graphs=2)
    for key in ("a", "b", "a", "c"):  # "a" was used after "b": "b" goes
        c.run(key, lambda: None, CUDA0)
    assert list(c.graphs) == ["a", "c"] and c.stats["evictions"] == 1
    c.run("b", lambda: None, CUDA0)
    assert c.stats["misses"] == 4 and list(c.graphs) == ["c", "b"]


def test_capture_budget_turns_the_cache_off(not_capturing):
    log = []
    c = fake_cache(log, max_graphs=4, max_captures=3)
    calls = []
    with pytest.warns(RuntimeWarning, match="captures"):
        for i in range(5):
            c.run(i, lambda: calls.append(1), CUDA0)
    assert c.disabled and c.stats["captures"] == 3 and len(calls) == 5 and not c.graphs
    c.run(0, lambda: calls.append(1), CUDA0)  # even a key that had a graph: eager now
    assert len(calls) == 6 and c.stats["eager_off"] == 2  # the 5th call and this one


def test_failed_capture_keeps_the_eager_result_and_turns_off(not_capturing):
    calls = []

    def capture(fn, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    c = dg.GraphCache(capture=capture)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        c.run("k", lambda: calls.append(1), CUDA0)
    assert calls == [1] and c.stats["failures"] == 1 and c.disabled
    c.run("k", lambda: calls.append(1), CUDA0)
    assert calls == [1, 1]


def test_never_captures_while_capturing_or_on_cpu(monkeypatch):
    log = []
    c = fake_cache(log)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    c.run("k", lambda: log.append("eager"), CUDA0)
    c.run("k", lambda: log.append("eager"), torch.device("cpu"))
    assert log == ["eager", "eager"] and not c.graphs
    assert c.stats["eager_capturing"] == 1 and c.stats["eager_cpu"] == 1


def test_switch_default_off(monkeypatch):
    monkeypatch.delenv(dg.ENV_VAR, raising=False)
    assert not dg.enabled()
    monkeypatch.setenv(dg.ENV_VAR, "1")
    assert dg.enabled()
    monkeypatch.setenv(dg.ENV_VAR, "0")
    assert not dg.enabled()


# ---- the Ampere _forward_decode with recorded reads -----------------------------------------------

class Rec:
    """Attribute bag that logs every attribute read as 'name.attr'."""

    def __init__(self, name, log, **attrs):
        self.__dict__.update(_name=name, _log=log, _attrs=attrs)

    def __getattr__(self, k):
        if k not in self._attrs:
            raise AttributeError(k)
        self._log.add(f"{self._name}.{k}")
        return self._attrs[k]


def _fake_base(monkeypatch, v41: bool):
    """A vLLM-like base class in a fake module holding compute_global_topk_indices_and_lens."""
    name = (V41 + ".fake_flashmla") if v41 else "dsv4_fake_v4.nvidia.flashmla"
    mod = types.ModuleType(name)

    def compute(topk, t2r, block_table, block_size, is_valid):
        return torch.full_like(topk, 3), torch.full((topk.shape[0],), 2, dtype=torch.int32, device=topk.device)

    mod.compute_global_topk_indices_and_lens = compute
    monkeypatch.setitem(sys.modules, name, mod)
    return type("FakeBase", (), {"__module__": name})


def decode_world(kind, device="cpu", T=3, H=8, W=16, K=32, bs=16, nblk=4, seed=0, log=None):
    """(layer, q, kv_cache, swa_metadata, attn_metadata, swa_only, output) for kind in
    'swa_only', 'c4a' (V4 C4A), 'c128a' (V4 C128A), 'v41' (V4.1 C4A). Records written by the
    reference packer; slots random (some -1)."""
    g = rng(seed)
    log = set() if log is None else log

    def cache():
        c = torch.zeros(nblk, min_page_bytes(bs), dtype=torch.uint8)
        reference.ref_kv_cache_insert(torch.randn(nblk * bs, D, generator=g).to(torch.bfloat16), c,
                                      torch.arange(nblk * bs), bs)
        return c.view(nblk, bs, -1).to(device)

    def slots(n, width):
        return torch.randint(-1, nblk * bs, (n, 1, width), generator=g, dtype=torch.int32).to(device)

    swa_only = kind == "swa_only"
    ratio = 1 if swa_only else (128 if kind == "c128a" else 4)
    layer = Rec("layer", log, swa_cache_layer=Rec("swa_cache_layer", log, kv_cache=cache()),
                attn_sink=torch.randn(H, generator=g).to(device), scale=D ** -0.5, compress_ratio=ratio,
                topk_indices_buffer=torch.randint(-1, 64, (8, K), generator=g, dtype=torch.int32).to(device))
    sm = Rec("swa_metadata", log, num_decodes=T, num_decode_tokens=T, block_size=bs,
             decode_swa_indices=slots(T, W), decode_swa_lens=torch.full((T,), W, dtype=torch.int32, device=device),
             is_valid_token=torch.ones(8, dtype=torch.bool, device=device),
             token_to_req_indices=torch.arange(8, dtype=torch.int32, device=device))
    am_attrs = dict(block_size=bs * ratio, block_table=torch.arange(16, dtype=torch.int32, device=device).view(4, 4))
    if kind in ("c4a", "c128a"):
        am_attrs.update(c128a_global_decode_topk_indices=slots(T, K),
                        c128a_decode_topk_lens=torch.full((T,), K, dtype=torch.int32, device=device))
    am = None if swa_only else Rec("attn_metadata", log, **am_attrs)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    return layer, q, (None if swa_only else cache()), sm, am, swa_only, out


def _bind(layer, base):
    """Give the recorder the mixin's methods and the base class, as the real subclass has."""
    layer._attrs.update(_dsv4_ampere_base=base,
                        _decode_topk=lambda *a: vattn._AmpereAttentionMixin._decode_topk(layer, *a),
                        _dsv4_ampere_decode_step=lambda *a: vattn._AmpereAttentionMixin._dsv4_ampere_decode_step(
                            layer, *a))


@pytest.mark.parametrize("kind", ["swa_only", "c4a", "c128a", "v41"])
def test_forward_decode_key_covers_every_read(kind, monkeypatch):
    """Everything _forward_decode / _decode_topk / ampere_decode's arguments read on the layer
    and the metadata is read by forward_decode_key too (a new read must join the key)."""
    monkeypatch.delenv(dg.ENV_VAR, raising=False)
    body_reads, key_reads = set(), set()
    layer, q, kv, sm, am, swa_only, out = decode_world(kind, log=body_reads)
    _bind(layer, _fake_base(monkeypatch, kind == "v41"))
    seen = []
    monkeypatch.setattr(vattn, "ampere_decode", lambda *a, **k: seen.append(a))
    vattn._AmpereAttentionMixin._forward_decode(layer, q, kv, sm, am, swa_only, out)
    assert len(seen) == 1
    for r in (layer, sm, am, layer.swa_cache_layer):
        if r is not None:
            r.__dict__["_log"] = key_reads
    body_reads -= {"layer._decode_topk", "layer._dsv4_ampere_decode_step", "layer._dsv4_ampere_base"}  # methods / class
    dg.forward_decode_key(layer, q, kv, sm, am, swa_only, out, sm.num_decode_tokens)
    assert body_reads <= key_reads, f"read by the decode but not keyed: {sorted(body_reads - key_reads)}"


def _builders(model):
    """The metadata builders vLLM resolves CUDA-graph support over for a DeepSeek-V4 / V4.1
    layer set on the installed vLLM, read through the Ampere attention class the plugin selects
    (attention, sliding window, indexer, compressor: doctor._BACKENDS)."""
    import importlib

    from dsv4_ops.tools import doctor

    def get(path):
        mod, name = path.split(":")
        return getattr(importlib.import_module(mod), name)

    attn_path, indexer_path, compressor_path = doctor._BACKENDS[model]
    base = get(attn_path)
    ampere = vattn.make_ampere_attention_cls(base)
    # the Ampere class overrides no backend: it reports exactly what vLLM's FlashMLA class reports
    assert ampere.backend_cls is base.backend_cls and ampere.swa_backend_cls is base.swa_backend_cls
    return [ampere.backend_cls.get_builder_cls(), ampere.swa_backend_cls.get_builder_cls(),
            get(indexer_path).get_builder_cls(), get(compressor_path).get_builder_cls()]


@pytest.mark.parametrize("model", ["v4", "v41"])
def test_cudagraph_support_on_sm80_per_vllm_release(model):
    """What decode_graph's notes say about vLLM's capture, against the installed vLLM's own
    builders: vLLM resolves the mode from the least support over the layer set's builders. On
    sm_80 the indexer's is UNIFORM_BATCH unless the decode is flattened (next_n = 1 + speculative
    tokens not in (1, 2)), so without speculation both models resolve UNIFORM_BATCH on 0.33.0 and
    0.34.0 (FULL_AND_PIECEWISE: mixed batches run the breakable eager segment). With 2
    speculative tokens V4 resolves ALWAYS on both; V4.1 ALWAYS on 0.33.0 but UNIFORM_BATCH on
    0.34.0 (its FlashMLA, SWA and compressor builders, 'prefill metadata is not graph-safe'),
    whose FULL decode graphs take decode batches of up to max_decode_query_len tokens a request."""
    pytest.importorskip("vllm")
    from importlib.metadata import version

    from vllm.v1.attention.backend import AttentionCGSupport

    from dsv4_ops.tools import doctor
    from dsv4_ops.vllm import versions

    rel = versions.release(version("vllm"))
    builders = _builders(model)
    for k in (0, 1, 2, 3):
        spec = None if k == 0 else types.SimpleNamespace(num_speculative_tokens=k, max_num_new_slots_for_drafting=0,
                                                         enable_adaptive_verification=False)
        cfg = types.SimpleNamespace(speculative_config=spec, num_speculative_tokens=k, model_config=None)
        with doctor.platform_as(80):
            support = min((b.get_cudagraph_support(cfg, None) for b in builders), key=lambda s: s.value)
        flattened = 1 + k not in (1, 2)
        if not flattened or (model == "v41" and rel == "0.34.0"):
            assert support == AttentionCGSupport.UNIFORM_BATCH, (model, rel, k, support)
        else:
            assert support == AttentionCGSupport.ALWAYS, (model, rel, k, support)
        if model == "v41" and rel == "0.34.0":
            bound = builders[0].get_varlen_cudagraph_max_query_len(cfg, None)
            assert bound == 1 + k  # max_decode_query_len: 1 + speculative tokens + drafting slots (0 here)


def test_forward_decode_switch_on_cpu_tensors_runs_eagerly(monkeypatch):
    monkeypatch.setenv(dg.ENV_VAR, "1")
    layer, q, kv, sm, am, swa_only, out = decode_world("swa_only")
    _bind(layer, _fake_base(monkeypatch, False))
    seen = []
    monkeypatch.setattr(vattn, "ampere_decode", lambda *a, **k: seen.append(a))
    vattn._AmpereAttentionMixin._forward_decode(layer, q, kv, sm, am, swa_only, out)
    assert len(seen) == 1 and dg._CACHE_ATTR not in layer.__dict__


# ---- GPU ----------------------------------------------------------------------------------------

def decode_args(T, H, seed, W=128, K=512, bs=64, nblk=16):
    """Positional ampere_decode arguments on the GPU (3-D paged caches, [T, 1, K] slots)."""
    g = rng(seed)

    def cache():
        c = torch.zeros(nblk, min_page_bytes(bs), dtype=torch.uint8)
        reference.ref_kv_cache_insert(torch.randn(nblk * bs, D, generator=g).to(torch.bfloat16), c,
                                      torch.arange(nblk * bs), bs)
        return c.view(nblk, bs, -1).cuda()

    def slots(width):
        return torch.randint(-1, nblk * bs, (T, 1, width), generator=g, dtype=torch.int32).cuda()

    def lens(width):
        return torch.randint(0, width + 1, (T,), generator=g, dtype=torch.int32).cuda()

    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda")
    return [q, out, cache(), slots(W), lens(W), bs, cache(), slots(K), lens(K), bs,
            torch.randn(H, generator=g).cuda(), D ** -0.5]


def refill(static, fresh):
    """Copy fresh VALUES into the static buffers (addresses unchanged); poison the output."""
    for i, (s, f) in enumerate(zip(static, fresh)):
        if isinstance(s, torch.Tensor) and i != 1:
            s.copy_(f)
    poison_like(static[1])


def eager_out(args):
    a = list(args)
    a[1] = poison_like(torch.empty_like(args[1]))
    vattn.ampere_decode(*a)
    return a[1]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 8), (5, 64)], ids=["T1-H8", "T5-H64"])
def test_gpu_replay_on_new_values_matches_eager(variant, T, H):
    static = decode_args(T, H, seed=1)
    cache = dg.GraphCache()
    poison_like(static[1])
    dg.graphed(cache, vattn.ampere_decode, *static)  # miss: eager + capture
    assert cache.stats["captures"] == 1
    first = static[1].clone()
    assert torch.equal(first, eager_out(static))
    for seed in (2, 3, 4):
        refill(static, decode_args(T, H, seed=seed))
        dg.graphed(cache, vattn.ampere_decode, *static)
        torch.cuda.synchronize()
        want = eager_out(static)
        assert not torch.isnan(static[1]).any(), f"seed {seed}: replay left poisoned rows"
        assert torch.equal(static[1], want), f"seed {seed}: replay != eager"
    assert cache.stats["hits"] == 3 and cache.stats["captures"] == 1


@pytest.mark.gpu
def test_gpu_new_address_recaptures_and_stays_correct(variant):
    T, H = 3, 8
    a = decode_args(T, H, seed=5)
    cache = dg.GraphCache()
    dg.graphed(cache, vattn.ampere_decode, *a)
    b = list(a)
    b[0] = decode_args(T, H, seed=6)[0]  # a new q tensor: new address
    poison_like(b[1])
    dg.graphed(cache, vattn.ampere_decode, *b)
    assert cache.stats["captures"] == 2
    assert torch.equal(b[1], eager_out(b))
    refill(a, decode_args(T, H, seed=7))
    dg.graphed(cache, vattn.ampere_decode, *a)  # the first graph again, new values
    torch.cuda.synchronize()
    assert cache.stats["hits"] == 1 and torch.equal(a[1], eager_out(a))
    b[1] = poison_like(torch.empty_like(b[1]))  # a new output buffer: another capture
    dg.graphed(cache, vattn.ampere_decode, *b)
    assert cache.stats["captures"] == 3 and torch.equal(b[1], eager_out(b))


@pytest.mark.gpu
def test_gpu_inside_an_outer_capture_runs_eagerly(variant):
    from dsv4_ops.testing import capture_graph

    T, H = 2, 8
    static = decode_args(T, H, seed=8)
    cache = dg.GraphCache()
    g, _ = capture_graph(lambda: dg.graphed(cache, vattn.ampere_decode, *static))  # 2 warm-ups, then the capture
    assert cache.stats["eager_capturing"] == 1 and cache.stats["captures"] == 1  # the warm-ups' graph only
    refill(static, decode_args(T, H, seed=9))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static[1], eager_out(static))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["swa_only", "c128a", "v41"])
def test_gpu_forward_decode_graphs_on_equals_off(kind, variant, monkeypatch):
    """The Ampere _forward_decode with the switch on (graphs, incl. vLLM-like top-k mapping
    captured inside) == the switch off, over steps with new values at the same addresses."""
    layer, q, kv, sm, am, swa_only, out = decode_world(kind, device="cuda", T=4, H=16, W=64, K=128, bs=64)
    _bind(layer, _fake_base(monkeypatch, kind == "v41"))
    for step in range(3):
        if step:
            fresh = decode_world(kind, device="cuda", T=4, H=16, W=64, K=128, bs=64, seed=step)
            q.copy_(fresh[1])
            sm.decode_swa_indices.copy_(fresh[3].decode_swa_indices)
            layer.swa_cache_layer.kv_cache.copy_(fresh[0].swa_cache_layer.kv_cache)
        monkeypatch.setenv(dg.ENV_VAR, "1")
        poison_like(out)
        vattn._AmpereAttentionMixin._forward_decode(layer, q, kv, sm, am, swa_only, out)
        torch.cuda.synchronize()
        got = out.clone()
        monkeypatch.setenv(dg.ENV_VAR, "0")
        poison_like(out)
        vattn._AmpereAttentionMixin._forward_decode(layer, q, kv, sm, am, swa_only, out)
        assert torch.equal(got, out), f"step {step}: graph path != eager path"
    stats = layer.__dict__[dg._CACHE_ATTR].stats
    assert stats["captures"] == 1 and stats["hits"] == 2, stats

