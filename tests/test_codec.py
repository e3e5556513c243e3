"""E4M3 codec: references against torch, kernels (interpreter on CPU, real on GPU), the ops'
CPU implementation and torch.compile. opcheck of every op: test_opcheck.py."""

import pytest
import torch

from dsv4_ops import codec, reference, testing
from dsv4_ops.csrc_triton import codec as kcodec
from dsv4_ops.testing import rng

RANDOM_SEED = 20240531  # fp32_random: the same 2**20 bit patterns on every run

ALL_CODES = torch.arange(256, dtype=torch.uint8)
FINITE = (ALL_CODES & 0x7F) != 0x7F


def _encode_inputs():
    g = rng(RANDOM_SEED)
    return {
        "bf16_all": testing.all_bf16(),
        "fp16_all": testing.all_fp16(),
        "midpoints_pm_ulp": testing.next_up_down(testing.e4m3_midpoints()),
        "specials": testing.e4m3_specials(),
        "fp32_random": testing.random_fp32_bits(1 << 20, generator=g),
    }


# ---- references -------------------------------------------------------------------------

def test_ref_decode_matches_torch_on_all_codes():
    got = reference.ref_e4m3_decode(ALL_CODES)
    want = ALL_CODES.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[FINITE], want[FINITE])
    assert torch.isnan(got[~FINITE]).all() and torch.isnan(want[~FINITE]).all()


@pytest.mark.parametrize("name", ["bf16_all", "fp16_all", "midpoints_pm_ulp", "specials", "fp32_random"])
def test_ref_encode_exact_matches_torch(name):
    x = _encode_inputs()[name]
    got = reference.ref_e4m3_encode(x, exact=True)
    want = testing.torch_saturating_e4m3(x)
    nan = torch.isnan(x.float())
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[nan] & 0x7F, torch.full_like(got[nan], 0x7F))


def test_ref_encode_fast_differs_exactly_at_half_the_midpoints():
    mids = testing.e4m3_midpoints()
    exact = reference.ref_e4m3_encode(mids, exact=True)
    fast = reference.ref_e4m3_encode(mids, exact=False)
    differ = exact != fast
    assert int(differ.sum()) == 126
    # Where they differ, fast rounded away from zero: one code above the even neighbour.
    assert torch.equal((fast[differ] & 0x7F).long(), (exact[differ] & 0x7F).long() + 1)
    # Off the midpoints (one ulp either side) the two agree.
    near = torch.cat([(mids.view(torch.int32) + 1).view(torch.float32), (mids.view(torch.int32) - 1).view(torch.float32)])
    assert torch.equal(reference.ref_e4m3_encode(near, True), reference.ref_e4m3_encode(near, False))


def test_ref_encode_specials_saturate():
    x = torch.tensor([float("inf"), float("-inf"), 1e30, -1e30, 464.0, 465.0, 448.0, -0.0, 0.0])
    got = reference.ref_e4m3_encode(x).tolist()
    assert got == [0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x80, 0x00]


# ---- kernels: interpreter on CPU (faithful for decode and integer encode), real on GPU ----

@pytest.mark.parametrize("kvariant", ["portable", "native"])
def test_decode_kernel_all_codes(interpret, kvariant):
    codes = ALL_CODES.to(interpret)
    got = codec.e4m3_decode(codes, variant=kvariant).cpu()
    want = reference.ref_e4m3_decode(ALL_CODES)
    assert torch.equal(got[FINITE], want[FINITE])
    if kvariant == "portable":  # e4b15 has no NaN: documented +-480
        assert got[0x7F].item() == 480.0 and got[0xFF].item() == -480.0


@pytest.mark.parametrize("mode", [kcodec.ENCODE_EXACT, kcodec.ENCODE_EXACT_INT], ids=["fp32add", "intonly"])
@pytest.mark.parametrize("name", ["bf16_all", "fp16_all", "midpoints_pm_ulp", "specials", "fp32_random"])
def test_exact_encode_kernel_bit_exact(interpret, name, mode):
    x = _encode_inputs()[name]
    got = codec.e4m3_encode(x.to(interpret), variant="portable", mode=mode).cpu()
    want = reference.ref_e4m3_encode(x, exact=True)
    # A GPU's fp16 -> fp32 upcast drops the sign of NaN; the NaN code stays a NaN code.
    nan = torch.isnan(x.float())
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[nan] & 0x7F, want[nan] & 0x7F)


def test_decode_kernel_keeps_shape_and_noncontiguous_input(interpret):
    codes = torch.randint(0, 256, (3, 40, 7), dtype=torch.uint8, generator=rng(1)).transpose(0, 2).to(interpret)
    out = codec.e4m3_decode(codes, variant="portable")
    assert out.shape == codes.shape and out.dtype == torch.float32 and out.is_contiguous()
    want = reference.ref_e4m3_decode(codes.cpu())
    fin = (codes.cpu() & 0x7F) != 0x7F
    assert torch.equal(out.cpu()[fin], want[fin])


def test_empty_tensors(interpret):
    assert codec.e4m3_decode(torch.empty(0, 5, dtype=torch.uint8, device=interpret)).shape == (0, 5)
    assert codec.e4m3_encode(torch.empty(0, dtype=torch.bfloat16, device=interpret)).shape == (0,)


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.int8), torch.zeros(4)], ids=["int8", "float32"])
def test_decode_rejects_wrong_dtype(bad):
    with pytest.raises(ValueError, match="codes: expected dtype uint8"):
        codec.e4m3_decode(bad)


def test_encode_rejects_wrong_dtype():
    with pytest.raises(ValueError, match="x: expected dtype"):
        codec.e4m3_encode(torch.zeros(4, dtype=torch.float64))


# ---- the ops: CPU implementation (opcheck: test_opcheck.py) --------------------------------

def test_ops_cpu_impl_is_the_reference():
    x = testing.random_fp32_bits(4096, generator=rng(2))
    assert torch.equal(torch.ops.dsv4_ampere.e4m3_encode(x), reference.ref_e4m3_encode(x))
    assert torch.equal(torch.ops.dsv4_ampere.e4m3_encode(x, False), reference.ref_e4m3_encode(x, False))
    d = torch.ops.dsv4_ampere.e4m3_decode(ALL_CODES)
    assert torch.equal(d[FINITE], reference.ref_e4m3_decode(ALL_CODES)[FINITE])


# ---- GPU: both variants, exhaustive ---------------------------------------------------------

@pytest.mark.gpu
def test_gpu_decode_all_codes(variant):
    got = torch.ops.dsv4_ampere.e4m3_decode(ALL_CODES.cuda()).cpu()
    want = reference.ref_e4m3_decode(ALL_CODES)
    assert torch.equal(got[FINITE], want[FINITE])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16_all", "fp16_all", "midpoints_pm_ulp", "specials", "fp32_random"])
def test_gpu_exact_encode(variant, name):
    x = _encode_inputs()[name]
    got = torch.ops.dsv4_ampere.e4m3_encode(x.cuda(), True).cpu()
    want = reference.ref_e4m3_encode(x, exact=True)
    nan = torch.isnan(x.float())
    assert torch.equal(got[~nan], want[~nan])
    if variant == "portable":  # a NaN code; fp16 NaN loses its sign in the GPU's upcast
        assert torch.equal(got[nan] & 0x7F, want[nan] & 0x7F)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16_all", "midpoints_pm_ulp", "specials", "fp32_random"])
def test_gpu_fast_encode_is_the_e4b15_trick(variant, name):
    x = _encode_inputs()[name]
    got = torch.ops.dsv4_ampere.e4m3_encode(x.cuda(), False).cpu()
    want = reference.ref_e4m3_encode(x, exact=False)
    nan = torch.isnan(x.float())
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[nan] & 0x7F, torch.full_like(got[nan], 0x7E))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_exhaustive_fp32_encode(variant, mode):
    if mode == "fast" and variant == "native":
        pytest.skip("exact=False is the same e4b15 kernel on both variants; counted once")
    counts = testing.exhaustive_fp32_encode(lambda x: torch.ops.dsv4_ampere.e4m3_encode(x, mode == "exact"))
    assert counts["inputs"] == 2 ** 32
    if mode == "exact":
        assert counts["mismatches_non_nan"] == 0, counts
    else:
        assert counts["mismatches_non_nan"] == 126 and counts["mismatches_at_midpoints"] == 126, counts


@pytest.mark.gpu
def test_gpu_modes_agree_off_midpoints():
    x = (torch.randn(1 << 20, generator=rng(3)) * 300).bfloat16().cuda()
    exact = codec.e4m3_encode(x, mode=kcodec.ENCODE_EXACT)
    assert torch.equal(exact, codec.e4m3_encode(x, mode=kcodec.ENCODE_EXACT_INT))
    if torch.cuda.get_device_capability() >= (8, 9):
        assert torch.equal(exact, codec.e4m3_encode(x, mode=kcodec.ENCODE_NATIVE))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_codec_ops_trace_under_torch_compile_fullgraph(device):
    def roundtrip(x):
        return torch.ops.dsv4_ampere.e4m3_decode(torch.ops.dsv4_ampere.e4m3_encode(x, True)) * 2

    x = (torch.randn(64, 32, generator=rng(4)) * 50).to(device)
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), roundtrip(x))
