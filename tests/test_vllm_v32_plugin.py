"""DeepSeek-V3.2 / GLM-5 through the vLLM plugin on sm_8x: the sparse-MLA
backend vLLM's own selector picks, its check at register(), and the model-level replacements.

The selector tests run vLLM 0.33.0's ``CudaPlatform.get_attn_backend_cls`` with the platform
answering as sm_80 (no GPU here): without the override it finds no valid backend, with it our
class. The numerics compare the replacements with vLLM's own torch RoPE
(``RotaryEmbedding.forward_static``) and with float64 formulations, and the backend's kernel
step with part B's V3.2 references (``dsv4_ops.reference``) or its ops when registered.
"""

import sys
import types

import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm==0.33.0")

# vllm.platforms.cuda imports its extension at import; without libcuda that fails (the audit's
# ViT probe does the same: the module is only read here, nothing of it runs on a GPU).
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))

from dsv4_ops import layout  # noqa: E402
from dsv4_ops import reference as R  # noqa: E402
from dsv4_ops.registration import op_exists  # noqa: E402
from dsv4_ops.vllm import plugin as vp  # noqa: E402
from dsv4_ops.vllm import table, v32_backend, v32_model  # noqa: E402


# ------------------------------------------------------------------ the selector and the registration

def _cuda_platform(cap):
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class _Target(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(*cap)

    return _Target


@pytest.fixture
def vllm_context():
    """A current VllmConfig (no model) as the selector's backends read it; device 'cpu' because
    this machine has no GPU (the platform class answers sm_80 itself)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


def _selector_config(kv_cache_dtype="auto"):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                                   block_size=None, use_mla=True, use_sparse=True)


@pytest.fixture
def override(monkeypatch):
    """The override installed as register() installs it (ops present, CUDA platform), then removed."""
    monkeypatch.setattr(v32_backend, "missing_ops", lambda: [])
    monkeypatch.setattr(v32_backend, "_on_cuda", lambda: True)
    v32_backend.uninstall()
    assert v32_backend.install() == [f"AttentionBackendEnum.{v32_backend.OVERRIDDEN_MEMBER}->{v32_backend.BACKEND_NAME}"]
    yield
    v32_backend.uninstall()


def test_vllm_finds_no_sparse_mla_backend_on_sm80_without_the_plugin(vllm_context):
    v32_backend.uninstall()
    with pytest.raises(ValueError, match="No valid attention backend found"):
        _cuda_platform((8, 0)).get_attn_backend_cls(None, _selector_config(), num_heads=16)


@pytest.mark.parametrize("cap", [(8, 0), (8, 6)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla", "fp8"])
def test_vllm_selector_picks_the_registered_backend_on_sm8x(vllm_context, override, cap, kv_cache_dtype):
    path = _cuda_platform(cap).get_attn_backend_cls(None, _selector_config(kv_cache_dtype), num_heads=16)
    assert path == v32_backend.CLASS_PATH
    cls = v32_backend.AmpereSparseMLABackend
    assert cls.get_name() == v32_backend.BACKEND_NAME and cls.is_sparse() and cls.is_mla()
    from vllm.platforms.interface import DeviceCapability

    assert not cls.supports_compute_capability(DeviceCapability(9, 0))  # sm_90+ keeps vLLM's backends


def test_the_backend_declines_other_caches_and_models(override):
    from vllm.platforms.interface import DeviceCapability

    cls = v32_backend.AmpereSparseMLABackend
    kw = dict(head_size=576, dtype=torch.bfloat16, block_size=None, use_mla=True, has_sink=False,
              use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
              device_capability=DeviceCapability(8, 0), attn_type="decoder")
    assert cls.validate_configuration(kv_cache_dtype="fp8_ds_mla", **kw) == []
    assert cls.validate_configuration(kv_cache_dtype="nvfp4_ds_mla", **kw)  # sm_100 only
    assert cls.validate_configuration(kv_cache_dtype="auto", **dict(kw, use_sparse=False))
    assert cls.validate_configuration(kv_cache_dtype="auto", **dict(kw, head_size=512))
    # another sparse-MLA model on sm_80 keeps vLLM's answer
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(
        model_type="kimi_k3", kv_lora_rank=512, qk_rope_head_dim=64, index_topk=2048)))
    import vllm.config

    real = vllm.config.get_current_vllm_config_or_none
    try:
        vllm.config.get_current_vllm_config_or_none = lambda: cfg
        assert "model types" in (v32_backend.combination_reason(576, "auto") or "")
        cfg.model_config.hf_text_config.model_type = "glm_moe_dsa"
        assert v32_backend.combination_reason(576, "auto") is None
    finally:
        vllm.config.get_current_vllm_config_or_none = real


def test_fp8_names_the_fp8_ds_mla_record_for_this_backend_only():
    """``--kv-cache-dtype fp8`` / ``fp8_e4m3``: MLAAttention asks vLLM's canonicalizer, which maps them
    to fp8_ds_mla for FLASHMLA_SPARSE by name; the patched one does the same for this backend and
    gives every other backend vLLM's own answer."""
    from vllm.model_executor.layers.attention import mla_attention as ma
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = ma._canonicalize_sparse_mla_kv_cache_dtype
    rows = [r for r in v32_model.PATCHES if r.symbol == "_canonicalize_sparse_mla_kv_cache_dtype"]
    assert len(rows) == 1 and rows[0].module == ma.__name__ and rows[0].wraps
    patched = rows[0].replacement(original)
    ours = types.SimpleNamespace(get_name=lambda: v32_backend.BACKEND_NAME)
    for name in ("fp8", "fp8_e4m3"):
        assert patched(ours, name) == "fp8_ds_mla"
    for name in ("auto", "bfloat16", "fp8_ds_mla", "fp8_e5m2"):
        assert patched(ours, name) == name  # fp8_e5m2 then meets the impl's refusal
    flashmla = AttentionBackendEnum.FLASHMLA_SPARSE.get_class()
    dense = types.SimpleNamespace(get_name=lambda: "TRITON_MLA")
    for backend in (flashmla, dense):
        for name in ("auto", "fp8", "fp8_e4m3"):
            assert patched(backend, name) == original(backend, name)
    assert patched(flashmla, "fp8") == "fp8_ds_mla" and patched(dense, "fp8") == "fp8"


def test_registration_check_passes_on_the_installed_vllm():
    v32_backend.check_registration(vp._error, cuda=True)


def test_registration_check_raises_when_the_priority_list_moves(monkeypatch):
    import vllm.platforms.cuda as cuda
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(cuda, "_get_backend_priorities",
                        lambda *a, **k: [AttentionBackendEnum.TRITON_MLA, AttentionBackendEnum.FLASHMLA_SPARSE])
    with pytest.raises(vp.VllmPatchError, match=r"sparse-MLA priority list is \['FLASHMLA_SPARSE'\]"):
        v32_backend.check_registration(vp._error, cuda=True)


def test_registration_check_raises_when_another_plugin_owns_the_member(monkeypatch):
    from vllm.v1.attention.backends import registry

    member = registry.AttentionBackendEnum[v32_backend.OVERRIDDEN_MEMBER]
    monkeypatch.setitem(registry._ATTN_OVERRIDES, member, "someone.else.Backend")
    with pytest.raises(vp.VllmPatchError, match="already overridden by someone.else.Backend"):
        v32_backend.check_registration(vp._error, cuda=True)


def test_registration_check_raises_when_the_sparse_mla_base_changes(monkeypatch):
    from vllm.model_executor.layers.attention import sparse_mla_attention as sma

    def _forward_mqa_kernel(self, q, kv_cache, topk_indices, *, layer, block_size):
        raise AssertionError

    monkeypatch.setattr(sma.SparseMLACommonImpl, "_forward_mqa_kernel", _forward_mqa_kernel)
    with pytest.raises(vp.VllmPatchError, match="_forward_mqa_kernel has parameters"):
        v32_backend.check_registration(vp._error, cuda=True)


def test_register_checks_the_backend_before_patching_anything(monkeypatch):
    """register() on sm_80 runs the backend check with the table's checks, before any patch."""
    vp.reset()
    monkeypatch.setattr(vp, "_capability", lambda: (8, 0))
    monkeypatch.setattr(v32_backend, "_on_cuda", lambda: True)
    monkeypatch.setattr(vp, "check_table", lambda rows, scan_source=True: None)
    calls = []

    def failing(error, cuda=None):
        calls.append(len(vp.STATE.originals))
        raise error("made-up registry change")

    monkeypatch.setattr(v32_backend, "check_registration", failing)
    with pytest.raises(vp.VllmPatchError, match="made-up registry change"):
        vp.register()
    assert calls == [0] and not vp.STATE.originals and not vp.STATE.registered
    assert not v32_backend.installed()
    vp.reset()


def test_the_v32_rows_pass_the_table_checks_on_vllm_source():
    rows = tuple(r for r in table.patches() if r.model == "v32")
    assert {r.symbol for r in rows} >= {"fused_norm_rope", "fused_q", "register_backend",
                                        "SparseMLACommonImpl._forward_mqa_kernel"}
    vp.check_table(rows, scan_source=True)


def test_a_changed_fused_q_signature_is_caught(monkeypatch):
    import vllm.models.deepseek_v32.attention as att

    def fused_q(positions, q_pe, q_pe_cos_sin_cache, index_q):
        raise AssertionError

    monkeypatch.setattr(att, "fused_q", fused_q)
    rows = tuple(r for r in table.patches() if r.model == "v32" and r.symbol == "fused_q")
    with pytest.raises(vp.VllmPatchError, match="deepseek_v32.attention.fused_q has parameters"):
        vp.check_table(rows, scan_source=False)


# ------------------------------------------------------------------ model-level replacements

def _cos_sin_cache(max_pos=4096, rot=64, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1).float()


def _vllm_rope(x, positions, cache, neox, rotary_dim):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    T, H, D = x.shape
    q, _ = RotaryEmbedding.forward_static(positions, x.double().clone(), None, D, rotary_dim, cache.double(), neox)
    return q.view(T, H, D)


@pytest.mark.parametrize("interleave", [False, True])  # DeepSeek-V3.2 NeoX; GLM indexer_rope_interleave
def test_fused_q_matches_vllm_rope_and_ue8m0_quant(interleave):
    g = torch.Generator().manual_seed(0)
    T, H, Hi = 5, 4, 3
    pos = torch.tensor([0, 1, 17, 1000, 4095])
    cache = _cos_sin_cache()
    q_pe = torch.randn(T, H, 64, generator=g).bfloat16()
    index_q = (torch.randn(T, Hi, 128, generator=g) * torch.logspace(-3, 2, Hi)[None, :, None]).bfloat16()
    index_q[1, 0] = 0  # an all-zero head: scale floor 1e-4 / 448
    w = torch.randn(T, Hi, generator=g).bfloat16()
    codes, w_out, q_pe_out = v32_model.fused_q(pos, q_pe, cache, index_q, cache, q_pe, torch.ones(1), w, 128 ** -0.5,
                                               Hi ** -0.5, True, interleave, False)
    ref_pe = _vllm_rope(q_pe, pos, cache, neox=False, rotary_dim=64)  # the MLA query rope is GPT-J
    torch.testing.assert_close(q_pe_out.double(), ref_pe, atol=2e-2, rtol=1e-2)
    x = _vllm_rope(index_q, pos, cache, neox=not interleave, rotary_dim=64)
    amax = x.abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-4) / 448)))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (T, Hi, 128)
    deq = codes.float().double() * scale[..., None]
    # E4M3 RNE: relative half-ulp 2**-4 of the value, or the subnormal step 2**-10 * scale
    err = (deq - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2.0 ** -4, scale[..., None] * 2.0 ** -10) * 1.0001).all())
    assert bool((codes.float().abs().amax(-1) <= 448).all()) and bool((codes.float().abs().amax(-1)[amax > 1e-3] >= 224).all())
    torch.testing.assert_close(w_out.double(), w.double() * scale * 128 ** -0.5 * Hi ** -0.5, rtol=1e-6, atol=0)


def test_fused_q_refuses_the_fp8_query_path():
    with pytest.raises(NotImplementedError, match="quantize_mqa"):
        v32_model.fused_q(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, 64).bfloat16(), _cos_sin_cache(8),
                          None, None, torch.zeros(1, 1, 512).bfloat16(), torch.ones(1), None, 0.0, 0.0, False)


def _v32_ops():
    """Part B's ops when registered, else its references (the contract the ops are tested to)."""
    if op_exists("v32_kv_insert"):
        return torch.ops.dsv4_ampere.v32_kv_insert, torch.ops.dsv4_ampere.v32_kv_gather
    return R.ref_v32_kv_insert, R.ref_v32_kv_gather


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("interleave", [False, True])
def test_fused_norm_rope_writes_both_caches(monkeypatch, fmt, interleave):
    insert, gather = _v32_ops()
    if not op_exists("v32_kv_insert"):
        monkeypatch.setattr(torch.ops.dsv4_ampere, "v32_kv_insert", insert, raising=False)
    g = torch.Generator().manual_seed(1)
    T, bs, nb = 6, 64, 3
    pos = torch.tensor([3, 4, 5, 70, 71, 9])
    slots = torch.tensor([5, 6, -1, 64 + 7, 128 + 63, 2])
    cache = _cos_sin_cache()
    q_c = torch.randn(T, 96, generator=g).bfloat16()
    kv_c = (torch.randn(T, 512, generator=g) * 3).bfloat16()
    k_pe = torch.randn(T, 64, generator=g).bfloat16()
    index_k = torch.randn(T, 128, generator=g).bfloat16()
    qw, kvw = torch.rand(96, generator=g).bfloat16() + 0.5, torch.rand(512, generator=g).bfloat16() + 0.5
    lw, lb = torch.rand(128, generator=g) + 0.5, torch.randn(128, generator=g) * 0.1
    if fmt == "auto":
        mla = torch.zeros(nb, bs, 576, dtype=torch.bfloat16)
    else:
        mla = torch.zeros(nb, bs, 656, dtype=torch.uint8)
    idx_cache = torch.full((nb, bs, 132), 0xAB, dtype=torch.uint8)
    topk = torch.zeros(8, 16, dtype=torch.int32)
    kv_out, pe_out, ik_out = torch.empty_like(kv_c), torch.empty_like(k_pe), torch.empty_like(index_k)
    q_out = v32_model.fused_norm_rope(pos, q_c, qw, 1e-6, kv_c, kvw, 1e-6, k_pe, cache, index_k, lw, lb, 1e-6, cache,
                                      topk, slot_mapping=slots, indexer_k_cache=idx_cache, mla_kv_cache=mla,
                                      mla_kv_cache_dtype=fmt, has_indexer=True, index_rope_interleave=interleave,
                                      kv_c_out=kv_out, k_pe_out=pe_out, index_k_out=ik_out)

    def rms(x, w):
        x = x.double()
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w.double()

    torch.testing.assert_close(q_out.double(), rms(q_c, qw), atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(kv_out.double(), rms(kv_c, kvw), atol=3e-2, rtol=1e-2)
    ref_pe = _vllm_rope(k_pe[:, None], pos, cache, neox=False, rotary_dim=64)[:, 0]
    torch.testing.assert_close(pe_out.double(), ref_pe, atol=2e-2, rtol=1e-2)
    assert bool((topk[:T] == -1).all()) and bool((topk[T:] == 0).all())
    # MLA cache: the written rows are the normed latent + roped k_pe (dequantized for fp8_ds_mla)
    ok = slots >= 0
    rows = gather(mla, slots[ok])
    want = torch.cat((kv_out, pe_out), dim=-1)[ok].double()
    tol = dict(atol=0, rtol=0) if fmt == "auto" else dict(atol=1e-1, rtol=2 ** -4)
    torch.testing.assert_close(rows.double(), want, **tol)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[ok]] = False
    assert bool((mla.view(nb * bs, -1)[untouched] == 0).all())
    # indexer K: LayerNorm then RoPE on the first 64 dims, NeoX unless interleaved; slot -1 skipped
    x = index_k.double()
    ln = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-6) * lw.double() \
        + lb.double()
    ref_k = _vllm_rope(ln[:, None].float(), pos, cache, neox=not interleave, rotary_dim=64)[:, 0]
    torch.testing.assert_close(ik_out.double(), ref_k, atol=3e-2, rtol=1e-2)
    # the indexer cache holds the E4M3 rows of that K (quantized from fp32, as vLLM's writer does:
    # byte for byte against vLLM's kernel in tests/test_v32_writer.py); slot -1 skipped
    keep = slots >= 0
    codes, scales = R.ref_indexer_read_rows(idx_cache, bs, slots[keep] // bs, slots[keep] % bs)
    got = codes.view(torch.float8_e4m3fn).double() * scales.double()[:, None]
    torch.testing.assert_close(got, ref_k[keep].double(), atol=2e-2, rtol=2 ** -4)
    untouched_idx = torch.ones(nb * bs, dtype=torch.bool)
    untouched_idx[slots[keep]] = False
    flat = idx_cache.view(nb, -1)
    data = flat[:, : bs * 128].reshape(nb * bs, 128)
    assert bool((data[untouched_idx] == 0xAB).all())


def test_fused_norm_rope_refuses_other_cache_formats():
    with pytest.raises(NotImplementedError, match="nvfp4_ds_mla"):
        v32_model._check_mla_cache_dtype("nvfp4_ds_mla")


# ------------------------------------------------------------------ the backend's kernel step

def _attention_oracle(q, rows, idx, scale):
    """float64 sparse attention, written independently: k = row[:576], v = row[:512]."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    for t in range(T):
        valid = [int(i) for i in idx[t] if 0 <= int(i) < rows.shape[0]]
        if not valid:
            continue
        k = rows[valid].double()
        s = (q[t].double() @ k.T) * scale
        p = torch.softmax(s, dim=-1)
        out[t] = p @ k[:, :512]
    return out


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("is_decode", [True, False])
def test_forward_mqa_kernel_attends_over_the_physical_rows(monkeypatch, fmt, is_decode):
    if not op_exists("v32_sparse_mla_decode"):
        monkeypatch.setattr(torch.ops.dsv4_ampere, "v32_sparse_mla_decode",
                            lambda q, kv, idx, tl, sc, ns=0: R.ref_v32_sparse_mla_decode(q, kv, idx, tl, sc),
                            raising=False)
        monkeypatch.setattr(torch.ops.dsv4_ampere, "v32_sparse_mla_prefill",
                            lambda q, kv, idx, tl, sc: R.ref_v32_sparse_mla(q, kv, idx, tl, sc), raising=False)
    insert, gather = _v32_ops()
    g = torch.Generator().manual_seed(2)
    nb, bs, stride_rows = 4, 64, 80  # a padded block stride (other layers' pages in between)
    d = 576 if fmt == "auto" else 656
    dtype = torch.bfloat16 if fmt == "auto" else torch.uint8
    store = torch.zeros(nb * stride_rows * d, dtype=dtype)
    cache = store.as_strided((nb, bs, d), (stride_rows * d, d, 1))
    n = 40
    slots = torch.randperm(nb * bs, generator=g)[:n]
    insert((torch.randn(n, 512, generator=g) * 2).bfloat16(), torch.randn(n, 64, generator=g).bfloat16(), cache,
           slots)
    phys = (slots // bs) * stride_rows + slots % bs  # vLLM's remap: block * block_stride_rows + offset
    T, H, K = 3, 4, 16
    cols = torch.randint(0, n, (T, K), generator=g)
    topk = phys[cols].to(torch.int32)
    topk[0, 3] = topk[1, ::2] = -1  # -1 gaps in place, as vLLM's remap leaves them
    topk[2] = -1                   # a token with no key: out 0
    q = torch.randn(T, H, 576, generator=g).bfloat16()
    impl = types.SimpleNamespace(scale=0.0625, need_to_return_lse_for_decode=False)
    out, lse = v32_backend.forward_mqa_kernel(impl, (q[..., :512], q[..., 512:]), cache, topk,
                                              (topk >= 0).sum(-1).int(), layer=None, block_size=bs,
                                              is_decode=is_decode)
    assert out.shape == (T, H, 512) and out.dtype == torch.bfloat16 and lse is None
    flat = v32_backend.kv_rows(cache, bs)[:, 0]
    rows = gather(flat.unsqueeze(1), torch.arange(flat.shape[0]))
    ref = _attention_oracle(q, rows, topk, 0.0625)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert bool((out[2] == 0).all())


def test_kv_rows_refuses_a_block_stride_that_is_not_whole_rows():
    store = torch.zeros(3 * 700, dtype=torch.uint8)
    bad = store.as_strided((3, 1, 656), (700, 656, 1))
    with pytest.raises(ValueError, match="whole number of rows"):
        v32_backend.kv_rows(bad, 1)


def test_layout_constants_agree_with_the_backend():
    assert layout.V32_HEAD_DIM_QK == v32_backend.HEAD_SIZE and layout.V32_HEAD_DIM_V == v32_backend.KV_LORA_RANK


def test_the_impl_accepts_what_mla_attention_passes_it():
    """register() checks that the keywords MLAAttention.__init__ passes to impl_cls(...) (read
    from vLLM's source) bind to the backend's impl; a narrower impl is caught."""
    impl = v32_backend.AmpereSparseMLAImpl
    assert v32_backend.impl_call_mismatch(impl) == ""

    class Narrow(impl):
        def __init__(self, num_heads, head_size, scale, kv_cache_dtype):
            raise AssertionError

    assert "unexpected keyword" in v32_backend.impl_call_mismatch(Narrow)
