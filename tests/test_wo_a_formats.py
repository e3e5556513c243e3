"""Every wo_a weight format vLLM 0.33.0 can hand the plugin, decoded by
``dsv4_ops.vllm.weights.dequantize_linear_weight`` and by the load-time hook in
``dsv4_ops.vllm.o_proj``.

The layers are built by vLLM's own quant configs and methods on the CPU (TP = 1): the
DeepSeek ``DeepseekV4FP8Config`` picks ``ModelOptLinearMethod`` (V4.1 [32,32] UE8M0) or
``Fp8LinearMethod`` (V4, and V4.1 otherwise), their ``create_weights`` registers the
parameters, and the registered weight loaders fill them from checkpoint-shaped tensors.
Where sm_80 would pick a GPU kernel, the kernel choice is stood in for: Marlin FP8 by a
kernel whose post-load repacks the weight (as Marlin does), and MXFP8 bmm by vLLM's own
selector run as on CUDA (DeepGEMM bmm needs sm100, so it returns Emulation).

Oracles: a float64 dequantization written here with explicit loops over the checkpoint's
scale blocks and 2.0 ** (byte - 127) per byte, compared with ``atol=0, rtol=0`` (every
product is exact or correctly rounded once); and vLLM's own helpers where they exist
(``ModelOptLinearMethod.dequantize_weight`` = ``dequant_mxfp8_to_bf16``, and the DSv4 CPU
backend's ``_dequant_linear_weight`` for the block-FP8 formats it handles).
"""

import importlib
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("vllm", reason="the wo_a format tests need vllm==0.33.0 (pip install dsv4-ops[test])")

from dsv4_ops.vllm import o_proj as vo  # noqa: E402
from dsv4_ops.vllm import weights as vw  # noqa: E402

PREFIX = "model.layers.3.self_attn.wo_a"
G, R, K = 2, 64, 256  # wo_a: [G * R, K]
N = G * R


# ------------------------------------------------------------------------- oracles (float64)

def ue8m0_f64(b: torch.Tensor) -> torch.Tensor:
    """uint8 exponent bytes -> float64 2 ** (byte - 127), one Python power per byte."""
    return torch.tensor([[2.0 ** (int(e) - 127) for e in row] for row in b.tolist()], dtype=torch.float64)


def block_oracle(w: torch.Tensor, s: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """float64 [N, K]: every [bm, bk] block of w (fp8) times its float64 scale s[i, j]."""
    wd = w.to(torch.float64)
    out = torch.full_like(wd, float("nan"))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = wd[rows, cols] * float(s[i, j])
    assert not out.isnan().any()
    return out


def fp8_weight(g: torch.Generator, n: int = N, k: int = K) -> torch.Tensor:
    """e4m3 [n, k] with a wide spread of magnitudes and an all-zero 32 x 32 block."""
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 8, (n, 1), generator=g).float())
    w[:32, 32:64] = 0
    return w.clamp(-448, 448).to(torch.float8_e4m3fn)


def exponents(g: torch.Generator, shape) -> torch.Tensor:
    return torch.randint(112, 136, shape, generator=g, dtype=torch.uint8)


# ------------------------------------------------------------------ vLLM layers on the CPU

class _RepackingMarlin:
    """Stands in for MarlinFP8ScaledMMLinearKernel (sm_80's FP8 choice): its post-load
    replaces the fp8 weight with packed int32 words, as the real repack does."""

    def process_weights_after_loading(self, layer):
        n, k = layer.weight.shape
        layer.weight = torch.nn.Parameter(torch.full((k // 16, n * 4), 0x5A5A5A5A, dtype=torch.int32),
                                          requires_grad=False)


def _copy_loader(param, loaded, *args, **kwargs):
    """TP = 1 stand-in for ColumnParallelLinear's loader: the whole tensor, same shape."""
    assert param.shape == loaded.shape, (param.shape, loaded.shape)
    param.data.copy_(loaded)


@pytest.fixture
def vl(monkeypatch):
    """vLLM's quant modules with TP = 1 and sm_80's kernel choices (see the module docstring)."""
    import vllm.distributed as vdist
    import vllm.model_executor.parameter as vparam
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.kernels.linear.mxfp8.Mxfp8LinearKernel import Mxfp8LinearLayerConfig
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import MarlinFP8ScaledMMLinearKernel
    from vllm.platforms import current_platform

    fp8 = importlib.import_module("vllm.model_executor.layers.quantization.fp8")
    mo = importlib.import_module("vllm.model_executor.layers.quantization.modelopt")
    qc = importlib.import_module("vllm.models.deepseek_v41.quant_config")

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(vdist, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(fp8, "get_current_vllm_config", lambda: NS(model_config=NS(dtype=torch.bfloat16)))

    marlin = type("RepackingMarlin", (_RepackingMarlin, MarlinFP8ScaledMMLinearKernel), {"__init__": lambda self: None})
    monkeypatch.setattr(fp8, "init_fp8_linear_kernel", lambda **kw: marlin())
    monkeypatch.setattr(mo, "init_fp8_linear_kernel", lambda **kw: marlin())

    def mxfp8_kernel(*, weight_shape, bmm_batch_size=None):
        if bmm_batch_size is None:  # create-time choice (Marlin MXFP8 on sm_80); replaced for bmm
            return EmulationMxfp8LinearKernel(Mxfp8LinearLayerConfig(weight_shape=weight_shape))
        with monkeypatch.context() as m:
            m.setattr(type(current_platform), "is_cuda", lambda self: True)
            return init_mxfp8_linear_kernel(weight_shape=weight_shape, bmm_batch_size=bmm_batch_size)

    monkeypatch.setattr(mo, "init_mxfp8_linear_kernel", mxfp8_kernel)

    def set_expert_dtype(expert_dtype):  # "fp4": e8m0 linear scales; "fp8" (Flash-Base): float32
        hf = NS(expert_dtype=expert_dtype, quantization_config={})
        monkeypatch.setattr(qc, "get_current_vllm_config", lambda: NS(model_config=NS(hf_config=hf)))

    return NS(fp8=fp8, mo=mo, qc=qc, set_expert_dtype=set_expert_dtype)


def new_linear():
    from vllm.model_executor.layers.linear import LinearBase

    layer = LinearBase.__new__(LinearBase)  # isinstance LinearBase for get_quant_method
    torch.nn.Module.__init__(layer)
    layer.prefix = PREFIX
    return layer


def deepseek_layer(vl, block, expert_dtype="fp4", n=N, k=K, partitions=None):
    """wo_a as vLLM 0.33.0 builds it for a DeepSeek V4/V4.1 checkpoint with this block size."""
    vl.set_expert_dtype(expert_dtype)
    cfg = vl.qc.DeepseekV4FP8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
         "weight_block_size": block})
    layer = new_linear()
    layer.quant_method = cfg.get_quant_method(layer, PREFIX)
    layer.quant_method.create_weights(layer, k, partitions or [n], k, n, torch.bfloat16,
                                      weight_loader=_copy_loader)
    return layer


def modelopt_layer(vl, algo, n=N, k=K):
    spec, ctx, fmt = vl.mo.resolve(algo, None, PREFIX)
    layer = new_linear()
    layer.quant_method = vl.mo.ModelOptLinearMethod(spec, ctx, fmt)
    layer.quant_method.create_weights(layer, k, [n], k, n, torch.bfloat16, weight_loader=_copy_loader)
    return layer


def load(param, value):
    param.weight_loader(param, value)


def hooked_bf16(layer):
    """Run the plugin's hook + vLLM's real post-load; return the bf16 [G, R, K] the o_proj reads."""
    layer.is_bmm, layer.bmm_batch_size = True, G  # as DeepseekV4(1)Attention sets them
    vo.install_wo_a_bf16_hook(layer, G, R)
    layer.quant_method.process_weights_after_loading(layer)
    return vo.wo_a_weight_bf16(layer, G, R)


# --------------------------------------------------------------- V4.1 [32,32] UE8M0 (MXFP8)

def v41_mxfp8(vl, seed):
    g = torch.Generator().manual_seed(seed)
    layer = deepseek_layer(vl, [32, 32])
    w, ckpt = fp8_weight(g), exponents(g, (N // 32, K // 32))
    load(layer.weight, w)
    load(layer.weight_scale, ckpt.view(torch.float8_e8m0fnu))  # checkpoint: e8m0 [N/32, K/32]
    return layer, w, ckpt


def test_v41_32x32_ue8m0_is_modelopt_mxfp8_with_uint8_row_repeated_scales(vl):
    """Pins the vLLM facts the decoder relies on; if vLLM changes them, this says which."""
    layer, w, ckpt = v41_mxfp8(vl, 1)
    assert type(layer.quant_method).__name__ == "ModelOptLinearMethod"
    assert layer.weight.dtype == torch.float8_e4m3fn and tuple(layer.weight.shape) == (N, K)
    assert layer.weight_scale.dtype == torch.uint8 and tuple(layer.weight_scale.shape) == (N, K // 32)
    assert layer.weight_block_size == [1, 32]
    assert not hasattr(layer, "weight_scale_inv")
    assert torch.equal(layer.weight_scale.data, ckpt.repeat_interleave(32, dim=0))


def test_v41_mxfp8_matches_float64_oracle_and_vllm_dequant(vl):
    layer, w, ckpt = v41_mxfp8(vl, 2)
    got = vw.dequantize_linear_weight(layer)
    want = block_oracle(w, ue8m0_f64(ckpt), 32, 32)  # on the checkpoint's own [32, 32] grid
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), atol=0, rtol=0)
    theirs = layer.quant_method.dequantize_weight(layer)  # vLLM: dequant_mxfp8_to_bf16
    torch.testing.assert_close(got.to(torch.bfloat16), theirs, atol=0, rtol=0)


def test_v41_uint8_scale_is_an_exponent_not_a_multiplier(vl):
    """The bug this file was written for: byte 120 was used as x120 instead of x2**-7."""
    layer, w, _ = v41_mxfp8(vl, 3)
    layer.weight_scale.data.fill_(120)
    got = vw.dequantize_linear_weight(layer).double()
    torch.testing.assert_close(got, w.double() * 2.0 ** -7, atol=0, rtol=0)
    nz = w.float() != 0
    assert torch.all(got[nz] / w.double()[nz] == 2.0 ** -7), "scale byte applied as a multiplier"


def test_v41_hook_before_emulation_and_vllm_bf16_kept(vl):
    layer, w, ckpt = v41_mxfp8(vl, 4)
    got = hooked_bf16(layer)
    assert type(layer.quant_method.kernel).__name__ == "EmulationMxfp8LinearKernel"  # sm_80's bmm choice
    want = block_oracle(w, ue8m0_f64(ckpt), 32, 32).to(torch.bfloat16).view(G, R, K)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # vLLM's Emulation weight (bf16 at load) agreed with ours and is shared, not copied
    assert layer.weight.dtype == torch.bfloat16 and got.data_ptr() == layer.weight.data_ptr()
    # decoding the post-load layer again must not apply the leftover uint8 scale a second time
    torch.testing.assert_close(vw.dequantize_linear_weight(layer).to(torch.bfloat16).view(G, R, K), want,
                               atol=0, rtol=0)


def test_v41_emulation_keeping_mxfp8_weight_still_decoded(vl, monkeypatch):
    """VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0: vLLM keeps fp8 + uint8; ours is the copy used."""
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", False, raising=False)
    monkeypatch.setenv("VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", "0")
    layer, w, ckpt = v41_mxfp8(vl, 5)
    got = hooked_bf16(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn
    want = block_oracle(w, ue8m0_f64(ckpt), 32, 32).to(torch.bfloat16).view(G, R, K)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ----------------------------------------------------- block FP8 (Fp8LinearMethod, weight_scale_inv)

FP8_BLOCK_CASES = [
    pytest.param([128, 128], "fp4", N, id="v4-128x128-e8m0"),
    pytest.param([128, 128], "fp8", N, id="v4-flash-base-128x128-float32"),
    pytest.param([32, 32], "fp8", N, id="v41-32x32-float32"),
    pytest.param([128, 128], "fp4", 192, id="128x128-e8m0-partial-row-block"),
]


@pytest.mark.parametrize("block,expert_dtype,n", FP8_BLOCK_CASES)
def test_fp8_block_matches_float64_oracle_vllm_cpu_dequant_and_survives_marlin_repack(vl, block, expert_dtype, n):
    from vllm.models.deepseek_v4.cpu.cpu_sparse import _dequant_linear_weight

    g = torch.Generator().manual_seed(10 + n + block[0])
    layer = deepseek_layer(vl, block, expert_dtype, n=n)
    assert type(layer.quant_method).__name__ == "Fp8LinearMethod"
    assert layer.weight_block_size == block
    scale_shape = (-(-n // block[0]), -(-K // block[1]))
    assert tuple(layer.weight_scale_inv.shape) == scale_shape
    w = fp8_weight(g, n)
    if expert_dtype == "fp4":
        assert layer.weight_scale_inv.dtype == torch.float8_e8m0fnu
        b = exponents(g, scale_shape)
        s64, ckpt = ue8m0_f64(b), b.view(torch.float8_e8m0fnu)
    else:
        assert layer.weight_scale_inv.dtype == torch.float32
        ckpt = torch.rand(scale_shape, generator=g) * 3e-3 + 1e-5
        s64 = ckpt.double()
    load(layer.weight, w)
    load(layer.weight_scale_inv, ckpt)

    got = vw.dequantize_linear_weight(layer)
    torch.testing.assert_close(got, block_oracle(w, s64, *block).float(), atol=0, rtol=0)
    torch.testing.assert_close(got, _dequant_linear_weight(layer), atol=0, rtol=0)  # vLLM's DSv4 CPU path

    if n == N:
        bf16 = hooked_bf16(layer)
        assert layer.weight.dtype == torch.int32  # the stand-in Marlin repacked it after our copy
        torch.testing.assert_close(bf16, got.to(torch.bfloat16).view(G, R, K), atol=0, rtol=0)


# ---------------------------------------- per-tensor, per-channel, ModelOpt FP8 blocks, unquantized

def test_fp8_per_tensor_one_scale_per_partition(vl):
    g = torch.Generator().manual_seed(20)
    layer = deepseek_layer(vl, None, partitions=[N // 4, 3 * N // 4])  # block None: per-tensor
    assert type(layer.quant_method).__name__ == "Fp8LinearMethod"
    assert layer.weight_scale.dtype == torch.float32 and tuple(layer.weight_scale.shape) == (2,)
    w, s = fp8_weight(g), torch.tensor([3e-3, 7e-4])
    load(layer.weight, w)
    layer.weight_scale.data.copy_(s)
    want = torch.cat([w[: N // 4].double() * float(s[0]), w[N // 4:].double() * float(s[1])])
    torch.testing.assert_close(vw.dequantize_linear_weight(layer), want.float(), atol=0, rtol=0)
    layer.weight_scale.data = s[:1].clone()  # a single-partition layer: one scale
    torch.testing.assert_close(vw.dequantize_linear_weight(layer), (w.double() * float(s[0])).float(),
                               atol=0, rtol=0)


def test_modelopt_fp8_per_channel(vl):
    g = torch.Generator().manual_seed(21)
    layer = modelopt_layer(vl, "FP8_PER_CHANNEL_PER_TOKEN")
    assert tuple(layer.weight_scale.shape) == (N,) and getattr(layer, "weight_block_size", None) is None
    w, s = fp8_weight(g), torch.rand(N, generator=g) * 1e-2 + 1e-4
    load(layer.weight, w)
    load(layer.weight_scale, s)
    want = torch.stack([w[i].double() * float(s[i]) for i in range(N)])
    torch.testing.assert_close(vw.dequantize_linear_weight(layer), want.float(), atol=0, rtol=0)


def test_modelopt_fp8_pb_wo_4d_block_scale(vl):
    g = torch.Generator().manual_seed(22)
    layer = modelopt_layer(vl, "FP8_PB_WO", n=256)
    assert tuple(layer.weight_scale.shape) == (2, 1, 2, 1) and layer.weight_block_size == [128, 128]
    w, s = fp8_weight(g, 256), torch.rand(2, 1, 2, 1, generator=g) * 1e-2 + 1e-4
    load(layer.weight, w)
    load(layer.weight_scale, s)
    want = block_oracle(w, s[:, 0, :, 0].double(), 128, 128)
    torch.testing.assert_close(vw.dequantize_linear_weight(layer), want.float(), atol=0, rtol=0)


def test_unquantized_bf16_wo_a(vl):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    g = torch.Generator().manual_seed(23)
    layer = new_linear()
    layer.quant_method = UnquantizedLinearMethod()
    layer.quant_method.create_weights(layer, K, [N], K, N, torch.bfloat16, weight_loader=_copy_loader)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    load(layer.weight, w)
    assert torch.equal(vw.dequantize_linear_weight(layer), w.float())
    assert torch.equal(hooked_bf16(layer), w.view(G, R, K))


# ---------------------------------------------------------------- what must raise, at load

def _bare(weight, **attrs):
    layer = torch.nn.Module()
    layer.prefix = PREFIX
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    for name, value in attrs.items():
        setattr(layer, name, value)
    return layer


_W = torch.zeros(N, K).to(torch.float8_e4m3fn)
_U8 = torch.full((N, K // 32), 127, dtype=torch.uint8)

REJECT_CASES = [
    pytest.param(dict(weight_scale=_U8), "no weight_block_size", id="2d-scale-without-block-size"),
    pytest.param(dict(weight_scale=_U8[::32].clone(), weight_block_size=[1, 32]), r"expected \[128, 8\]",
                 id="ckpt-shaped-scale-with-1x32-block"),
    pytest.param(dict(weight_scale=_U8, weight_block_size=[32, 32]), r"expected \[4, 8\]",
                 id="row-repeated-scale-with-32x32-block"),
    pytest.param(dict(weight_scale=_U8.to(torch.int32), weight_block_size=[1, 32]), "unrecognised scale dtype",
                 id="int32-scale"),
    pytest.param(dict(weight_scale=_U8.float().to(torch.float8_e4m3fn), weight_block_size=[1, 32]),
                 "unrecognised scale dtype", id="e4m3-scale"),
    pytest.param(dict(weight_scale=_U8, weight_scale_inv=_U8, weight_block_size=[1, 32]), "ambiguous",
                 id="both-scale-names"),
    pytest.param(dict(), "neither weight_scale_inv nor weight_scale", id="fp8-without-scale"),
    pytest.param(dict(weight_scale=torch.full((N, K // 32), 255, dtype=torch.uint8), weight_block_size=[1, 32]),
                 "NaN", id="ue8m0-nan-byte"),
    pytest.param(dict(weight_scale=_U8, weight_block_size=[32]), "weight_block_size", id="bad-block-size"),
]


@pytest.mark.parametrize("attrs,match", REJECT_CASES)
def test_unrecognised_format_raises_naming_layer_and_tensor(attrs, match):
    with pytest.raises(ValueError, match=match) as e:
        vw.dequantize_linear_weight(_bare(_W, **attrs))
    assert PREFIX in str(e.value)


@pytest.mark.parametrize("weight", [
    pytest.param(torch.zeros(K // 16, N * 4, dtype=torch.int32), id="marlin-repacked-int32"),
    pytest.param(torch.zeros(N, K // 2, dtype=torch.uint8), id="nvfp4-packed-uint8"),
    pytest.param(torch.zeros(G, R, K).to(torch.float8_e4m3fn), id="3d-bmm-weight"),
])
def test_unrecognised_weight_raises(weight):
    with pytest.raises(ValueError, match=r"weight") as e:
        vw.dequantize_linear_weight(_bare(weight, weight_scale=_U8, weight_block_size=[1, 32]))
    assert PREFIX in str(e.value)


def test_hook_raises_at_load_and_vllm_post_load_not_run():
    calls = []
    layer = _bare(_W, weight_scale=_U8, quant_method=NS(process_weights_after_loading=calls.append))
    vo.install_wo_a_bf16_hook(layer, G, R)
    with pytest.raises(ValueError, match="no weight_block_size"):
        layer.quant_method.process_weights_after_loading(layer)
    assert calls == [] and getattr(layer, vo.WO_A_BF16_ATTR, None) is None


def test_hook_refuses_a_vllm_bf16_weight_that_disagrees():
    """A post-load that leaves a bf16 weight off by a power of two (a misread scale) is caught."""
    g = torch.Generator().manual_seed(30)
    w = fp8_weight(g)
    layer = _bare(w, weight_scale=torch.full((N, K // 32), 127, dtype=torch.uint8), weight_block_size=[1, 32])

    def post_load(lyr):
        lyr.weight = torch.nn.Parameter((w.float() * 2).to(torch.bfloat16), requires_grad=False)

    layer.quant_method = NS(process_weights_after_loading=post_load)
    vo.install_wo_a_bf16_hook(layer, G, R)
    with pytest.raises(ValueError, match="differs"):
        layer.quant_method.process_weights_after_loading(layer)


def test_ue8m0_decoder_covers_every_byte():
    b = torch.arange(255, dtype=torch.uint8)[None]
    for scale in (b, b.view(torch.float8_e8m0fnu)):
        got = vw.ue8m0_to_fp32(scale).double()
        assert torch.equal(got, ue8m0_f64(b)), "2 ** (byte - 127), byte 0 included (fp32 subnormal)"


# ------------------------------------------------------------ the quant methods the hook wraps

def test_wo_a_quant_methods_are_the_ones_vllm_selects(vl):
    listed = {(m, c) for m, c in vo.WO_A_QUANT_METHODS}
    for module, cls in listed:
        assert callable(getattr(getattr(importlib.import_module(module), cls), "process_weights_after_loading"))
    cases = [([32, 32], "fp4"), ([128, 128], "fp4"), ([128, 128], "fp8"), ([32, 32], "fp8")]
    for block, expert_dtype in cases:
        method = deepseek_layer(vl, block, expert_dtype).quant_method
        assert (type(method).__module__, type(method).__name__) in listed, (block, expert_dtype, type(method))
    vl.set_expert_dtype("fp4")
    cfg = vl.qc.DeepseekV4FP8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "ignored_layers": [PREFIX]})
    skipped = cfg.get_quant_method(new_linear(), PREFIX)
    assert (type(skipped).__module__, type(skipped).__name__) in listed
