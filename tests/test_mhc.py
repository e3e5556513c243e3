"""V4's first-layer mHC on sm_8x: the torch replacement of DeepGEMM's tf32_hc_prenorm_gemm.

CPU: the replacement's (out, sqrsum) against float64; then the whole first-layer mHC pre
(the broadcast big-fuse math applied to those outputs, as ``mhc_pre_big_fuse_broadcast_with_
norm_tilelang`` does it) against vLLM 0.33.0's own torch reference ``mhc_pre_torch`` on the
broadcast residual; the wrapper's routing. The patch row's signature against the installed
vLLM: tests/test_vllm_plugin.py (whole table).
"""

import importlib.util
import os

import pytest
import torch

from dsv4_ops.testing import rng
from dsv4_ops.vllm import mhc

HC = 4
N = HC * (2 + HC)


def _vllm_mhc_torch():
    """vLLM's ``model_executor/kernels/mhc/torch.py`` (imports only torch), loaded from the
    installed file without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "model_executor", "kernels", "mhc", "torch.py")
    mspec = importlib.util.spec_from_file_location("vllm_mhc_torch_oracle", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def _inputs(T: int, H: int, seed: int):
    g = rng(seed)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16)
    fn = torch.randn(N, HC * H, generator=g) * H ** -0.5
    fn_bcast = fn.view(N, HC, H).sum(dim=1)  # vLLM's finalize_mhc_broadcast_weights
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(N, generator=g) * 0.1
    return x, fn, fn_bcast, scale, base


@pytest.mark.parametrize("T,H", [(1, 256), (7, 512), (33, 1024)])
def test_gemm_outputs_match_float64(T, H):
    x, _, fn_bcast, _, _ = _inputs(T, H, T)
    out, sqrsum = mhc.hc_prenorm_gemm_torch(x, fn_bcast)
    assert out.shape == (1, T, N) and out.dtype == torch.float32
    assert sqrsum.shape == (1, T) and sqrsum.dtype == torch.float32
    xd = x.double()
    torch.testing.assert_close(out[0].double(), xd @ fn_bcast.double().t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sqrsum[0].double(), xd.square().sum(-1), rtol=2e-5, atol=0)  # fp32 sum of K >= 0 terms


def _broadcast_big_fuse(out, sqrsum, scale, base, x, H, rms_eps, pre_eps, sk_eps, post_mult, repeat):
    """What the broadcast big-fuse TileLang kernel computes from the GEMM outputs (without
    its fused RMSNorm of layer_input): mixes, then pre/post/comb as in vLLM's kernels."""
    rms = torch.rsqrt(sqrsum.sum(0) / H + rms_eps)  # [T]
    mixes = out.sum(0) * rms[:, None]  # [T, N]
    pre = torch.sigmoid(mixes[:, :HC] * scale[0] + base[:HC]) + pre_eps
    post = torch.sigmoid(mixes[:, HC:2 * HC] * scale[1] + base[HC:2 * HC]) * post_mult
    cm = mixes[:, 2 * HC:].view(-1, HC, HC) * scale[2] + base[2 * HC:].view(1, HC, HC)
    cm = torch.softmax(cm, dim=-1) + sk_eps
    cm = cm / (cm.sum(-2, keepdim=True) + sk_eps)
    for _ in range(repeat - 1):
        cm = cm / (cm.sum(-1, keepdim=True) + sk_eps)
        cm = cm / (cm.sum(-2, keepdim=True) + sk_eps)
    layer_input = (pre.sum(-1, keepdim=True) * x.float()).to(torch.bfloat16)  # every stream is x
    return post.unsqueeze(-1), cm, layer_input


@pytest.mark.parametrize("T,H", [(3, 256), (16, 1024)])
def test_first_layer_mhc_matches_vllm_reference(T, H):
    """Replacement GEMM + the broadcast fuse == vLLM's mhc_pre_torch on the residual x
    broadcast to hc_mult streams with the full hc_attn_fn."""
    ref = _vllm_mhc_torch()
    x, fn, fn_bcast, scale, base = _inputs(T, H, 100 + T)
    eps = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0, sinkhorn_repeat=20)
    out, sqrsum = mhc.hc_prenorm_gemm_torch(x, fn_bcast)
    post, comb, layer_input = _broadcast_big_fuse(out, sqrsum, scale, base, x, H, *eps.values())
    residual = x.unsqueeze(1).expand(T, HC, H).contiguous()
    v_post, v_comb, v_layer_input = ref.mhc_pre_torch(residual, fn, scale, base, **eps)
    torch.testing.assert_close(post, v_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, v_comb, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer_input.float(), v_layer_input.float(), rtol=1e-2, atol=1e-2)


def test_wrapper_routes_only_the_forced_deepgemm_call():
    calls = []

    def original(x, fn, *, hidden_size, hc_mult, use_tilelang_fallback=True):
        calls.append(use_tilelang_fallback)
        return "vllm"

    wrapped = mhc.hc_prenorm_gemm_outputs_ampere(original)
    x, _, fn_bcast, _, _ = _inputs(2, 256, 5)
    assert wrapped(x, fn_bcast, hidden_size=256, hc_mult=HC) == "vllm"
    out, sqrsum = wrapped(x, fn_bcast, hidden_size=256, hc_mult=HC, use_tilelang_fallback=False)
    assert calls == [True] and out.shape == (1, 2, N) and sqrsum.shape == (1, 2)


def test_patch_row_names_the_forced_call():
    row, deep_gemm_row = mhc.PATCHES
    assert row.symbol == "_hc_prenorm_gemm_outputs" and row.wraps and row.model == "v4"
    assert row.params == ("x", "fn", "hidden_size", "hc_mult", "use_tilelang_fallback")
    assert (deep_gemm_row.module, deep_gemm_row.symbol) == ("vllm.utils.deep_gemm", "tf32_hc_prenorm_gemm")
    assert deep_gemm_row.params == ("x", "fn", "out", "sqrsum", "num_split") and not deep_gemm_row.wraps


@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "three-splits"])
def test_tf32_hc_prenorm_gemm_replacement_sums_to_the_float64_result(splits):
    """The DeepGEMM drop-in writes split-K partials: their sum over splits is x @ fn.T and
    the row sums of x**2 (what every vLLM consumer reduces), with poisoned buffers first."""
    from dsv4_ops.vllm.mhc import tf32_hc_prenorm_gemm_ampere

    g = torch.Generator().manual_seed(splits)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    fn = torch.randn(24, 256, generator=g)
    out = torch.full((splits, 5, 24), float("nan"))
    sq = torch.full((splits, 5), float("nan"))
    tf32_hc_prenorm_gemm_ampere(x, fn, out, sq, splits)
    xd = x.double()
    torch.testing.assert_close(out.double().sum(0), xd @ fn.double().t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sq.double().sum(0), (xd * xd).sum(-1), rtol=1e-6, atol=1e-4)
    with pytest.raises(ValueError, match="do not match"):
        tf32_hc_prenorm_gemm_ampere(x, fn, torch.empty(splits, 5, 23), sq, splits)
