"""AOT compilation of every sm_8x kernel specialization on the CPU (no GPU needed)."""

import pytest

from dsv4_ops import aot


@pytest.fixture(scope="module")
def ampere_results():
    return aot.check(aot.AMPERE_ARCHS, ("portable",))


def test_every_portable_specialization_compiles_for_sm80_and_sm86(ampere_results):
    assert ampere_results, "no kernel specializations were listed"
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in ampere_results if not r.ok]
    assert not failed, "\n".join(failed)
    for arch in aot.AMPERE_ARCHS:
        labels = {r.label for r in ampere_results if r.arch == arch}
        assert labels == {s.label for s in aot.all_specs() if s.variant == "portable"}


def test_resources_are_reported_and_within_limits(ampere_results):
    for r in ampere_results:
        assert r.registers is not None and 0 < r.registers <= 255
        assert r.shared_bytes is not None and r.shared_bytes <= aot.SMEM_LIMIT[r.arch]
        assert r.spill_bytes is not None


def test_every_op_has_a_portable_specialization():
    ops = {s.op for s in aot.all_specs() if s.variant == "portable"}
    assert {"e4m3_decode", "e4m3_encode"} <= ops


def test_the_check_can_fail_native_is_rejected_for_sm80():
    results = aot.check((80,), ("native",))
    encoders = [r for r in results if r.op == "e4m3_encode" and "exact" in r.label]
    assert encoders and all(not r.ok for r in encoders)
    assert all("fp8e4nv" in r.error for r in encoders)


def test_e4m3_cvt_in_ptx_is_caught():
    # sm_90 compiles the native encoder; its PTX holds the e4m3 cvt the sm_8x check forbids.
    spec = next(s for s in aot.all_specs() if s.variant == "native" and "exact,fp32" in s.label)
    res = aot.compile_spec(spec, 90) if not aot._interpreting() else None
    if res is None:
        res = [r for r in aot.check((90,), ("native",)) if r.label == spec.label][0]
    assert not res.ok and "e4m3 cvt" in res.error
