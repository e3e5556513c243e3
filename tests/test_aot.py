"""AOT compilation of every sm_8x kernel specialization on the CPU (no GPU needed).

Every registered op (``dsv4_ops.registration.all_ops()``) must have a portable
specialization, and every portable specialization must compile for sm_80 and sm_86 within
the shared-memory limit and with no e4m3 cvt (spills are reported; the attention and KV-cache
tests require none for their kernels). The compile runs once a session
(conftest fixture ``aot_results``).
"""

import pytest

from dsv4_ops import aot
from dsv4_ops.registration import all_ops

# Ops that launch other ops' kernels and have no kernel of their own: op -> the ops whose
# specializations cover it. Every other registered op needs a spec with spec.op == its name.
LAUNCHES_KERNELS_OF = {
    "kv_cache_gather_into": ("kv_cache_gather",),  # the gather kernel, writing into a workspace
    "sparse_mla_decode": ("sparse_mla_split", "merge_splits"),  # split + merge
    "merge_splits_out": ("merge_splits",),  # the merge kernel, writing into a given out
    "sparse_mla_decode_out": ("sparse_mla_split", "merge_splits"),
    # the V3.2 launchers: gather into a workspace, split-KV + the V4 merge
    "v32_kv_gather_into": ("v32_kv_gather",),
    "v32_sparse_mla_decode": ("v32_sparse_mla_decode", "merge_splits"),
    "v32_sparse_mla_decode_out": ("v32_sparse_mla_decode", "merge_splits"),
    "v32_sparse_mla_prefill_out": ("v32_sparse_mla_prefill", "merge_splits"),
}


@pytest.fixture(scope="module")
def portable(aot_results):
    return [r for r in aot_results if r.variant == "portable"]


def test_every_portable_specialization_compiles_for_sm80_and_sm86(portable):
    assert portable, "no kernel specializations were listed"
    failed = [f"sm_{r.arch} {r.label}: {r.error}" for r in portable if not r.ok]
    assert not failed, "\n".join(failed)
    specs = [s for s in aot.all_specs() if s.variant == "portable"]
    for arch in aot.AMPERE_ARCHS:  # a spec with archs (a shared-memory-gated config): those only
        want = sorted(s.label for s in specs if aot.compiled_for(s, arch))
        assert sorted(r.label for r in portable if r.arch == arch) == want, f"sm_{arch}"
    gated = [s for s in specs if s.archs]
    assert all(set(s.archs) < set(aot.AMPERE_ARCHS) for s in gated), [s.label for s in gated]


def test_resources_are_reported_and_within_limits(portable):
    for r in portable:
        where = f"sm_{r.arch} {r.label}"
        assert r.registers is not None and 0 < r.registers <= 255, where
        assert r.shared_bytes is not None and r.shared_bytes <= aot.SMEM_LIMIT[r.arch], where
        assert r.spill_bytes is not None, where  # zero spills: required per area (attention, KV cache tests)


def test_every_registered_op_has_a_portable_specialization():
    ops = [op.name for op in all_ops()]
    have = {s.op for s in aot.all_specs() if s.variant == "portable"}
    missing = []
    for op in ops:
        covered_by = LAUNCHES_KERNELS_OF.get(op, (op,))
        if not set(covered_by) <= have:
            missing.append(f"{op} (needs specs for {', '.join(covered_by)})")
    assert not missing, "registered ops without a portable AOT specialization: " + "; ".join(missing)
    stale = set(LAUNCHES_KERNELS_OF) - set(ops)
    assert not stale, f"LAUNCHES_KERNELS_OF names ops that are not registered: {sorted(stale)}"
    unknown = have - set(ops)
    assert not unknown, f"AOT specs name ops that are not registered: {sorted(unknown)}"


def test_the_check_can_fail_native_is_rejected_for_sm80(aot_results):
    encoders = [r for r in aot_results if r.arch == 80 and r.variant == "native" and "exact" in r.label]
    assert encoders and all(not r.ok for r in encoders)
    assert all("fp8e4nv" in r.error for r in encoders)


def test_e4m3_cvt_in_ptx_is_caught(aot_results):
    # sm_90 compiles the native encoder; its PTX holds the e4m3 cvt the sm_8x check forbids.
    res = [r for r in aot_results if r.arch == 90 and r.variant == "native" and "exact,fp32" in r.label]
    assert len(res) == 1
    assert not res[0].ok and "e4m3 cvt" in res[0].error


_PTX = """//
.version 8.0
.target sm_80
.address_size 64
.visible .entry k(.param .u64 p){
  .reg .b64 %rd<3>; .reg .f32 %f<2>;
  ld.param.u64 %rd1, [p];
  cvta.to.global.u64 %rd2, %rd1;
  ld.global.f32 %f1, [%rd2];
  st.global.f32 [%rd2], %f1;
  ret;
}
"""


def test_ptxas_usage_is_kept_by_ptx_and_arch(tmp_path, monkeypatch):
    """The second AOT pass reads the usage ptxas reported for the same PTX and arch; another
    PTX text or arch runs ptxas again."""
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    calls = []
    real = aot._run_ptxas
    monkeypatch.setattr(aot, "_run_ptxas", lambda *a: calls.append(a[1:]) or real(*a))
    first = aot._ptxas_usage(_PTX, 80)
    assert first["registers"] > 0 and first["spill_bytes"] == 0 and len(calls) == 1
    assert aot._ptxas_usage(_PTX, 80) == first and len(calls) == 1
    aot._ptxas_usage(_PTX.replace("ld.global.f32 %f1", "ld.global.cg.f32 %f1"), 80)
    aot._ptxas_usage(_PTX.replace("sm_80", "sm_86"), 86)
    assert len(calls) == 3
