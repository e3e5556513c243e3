"""The capability-keyed op table with spoofed capabilities and the DSV4_AMPERE_IMPL override."""

import pytest

from dsv4_ops import dispatch, support
from dsv4_ops.registration import op_names

AUTO_CASES = [
    ((8, 0), "portable", "portable"), ((8, 6), "portable", "portable"), ((8, 7), "portable", "portable"),
    ((8, 9), "native", "native"), ((9, 0), "upstream", "native"), ((10, 0), "upstream", "native"),
    ((12, 0), "upstream", "native"),
]


@pytest.mark.parametrize("cap,entry,runs", AUTO_CASES, ids=[f"sm_{c[0]}{c[1]}" for c, _, _ in AUTO_CASES])
def test_table_auto(monkeypatch, cap, entry, runs):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.table_variant(cap) == entry
    assert dispatch.kernel_variant(cap) == runs
    assert dispatch.routes_to_dsv4_ops(cap) == (entry != "upstream")


def test_below_ampere_is_unsupported(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.table_variant((7, 5)) is None
    ok, reason = support.is_supported("e4m3_decode", capability=(7, 5))
    assert not ok and "sm_75" in reason
    with pytest.raises(RuntimeError, match="8.0"):
        dispatch.kernel_variant((7, 5))


@pytest.mark.parametrize("forced", ["portable", "native"])
def test_override_wins(monkeypatch, forced):
    monkeypatch.setenv(dispatch.ENV_VAR, forced)
    for cap in [(8, 0), (8, 9), (9, 0)]:
        assert dispatch.kernel_variant(cap) == forced
        assert dispatch.routes_to_dsv4_ops(cap)


def test_native_forced_on_sm80_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "native")
    ok, reason = support.is_supported("e4m3_encode", capability=(8, 0))
    assert not ok and "sm_89" in reason and "portable" in reason
    assert support.is_supported("e4m3_encode", capability=(9, 0))[0]


def test_bad_override_value(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="DSV4_AMPERE_IMPL"):
        dispatch.kernel_variant((8, 0))


def test_is_supported_reasons(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    ok, reason = support.is_supported("e4m3_decode", capability=(8, 0))
    assert ok and "portable" in reason
    ok, reason = support.is_supported("e4m3_decode", capability=(9, 0))
    assert ok and "upstream" in reason
    ok, reason = support.is_supported("no_such_op", capability=(8, 0))
    assert not ok and "unknown op" in reason
    ok, reason = support.is_supported("e4m3_decode", device="cpu")
    assert not ok and "CPU" in reason


def test_printable_table(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    text = support.format_table()
    lines = text.splitlines()
    assert len(lines) == 1 + len(dispatch.SHOWCASE_CAPABILITIES)
    assert lines[1].split()[:3] == ["sm_80", "portable", "portable"]
    assert lines[4].split()[:3] == ["sm_90", "upstream", "native"]
    for op in op_names():
        assert op in lines[0]


# ---- the dispatch package: one resolver per decision, each with its reason ------------------


def test_every_sm_count_honours_the_override(monkeypatch):
    """DSV4_AMPERE_SMS steers every SM count a launcher uses (no device query), and the count
    without a CUDA device is one constant."""
    import ast
    import pathlib

    import torch

    from dsv4_ops import engram, envs
    from dsv4_ops.csrc_triton import engram as engram_kernels

    monkeypatch.setenv(envs.SMS, "7")
    assert dispatch.device.num_sms(0) == dispatch.device.num_sms_at(3) == 7
    assert dispatch.prefill.num_sms_of(torch.empty(0, device="meta")) == dispatch.device.NO_DEVICE_SMS
    assert engram.default_programs(torch.device("cuda", 0)) == 7 * engram_kernels.LOOKUP_CONFIG["PROGRAMS_PER_SM"]
    assert dispatch.device.num_sms_at(-1) == dispatch.device.NO_DEVICE_SMS == 108
    root = pathlib.Path(dispatch.__file__).parents[1]
    readers = set()
    for path in root.rglob("*.py"):
        if "audit" in path.parts:  # the audit's stand-in device properties
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "multi_processor_count":
                readers.add(path.relative_to(root).as_posix())
    assert readers == {"dispatch/device.py"}


def test_decode_config_knob_forces_the_v3_config(monkeypatch):
    from dsv4_ops import envs

    dd = dispatch.decode
    monkeypatch.delenv(envs.DECODE_CONFIG, raising=False)
    auto, why = dd.resolve_v3_config(1, 8, 640, 163 * 1024)
    assert auto == dd.v3_config_name(1, 8, 640, 163 * 1024) == "h16n16w4" and "paged_chunk128" in why
    monkeypatch.setenv(envs.DECODE_CONFIG, "kh16n64w8")
    assert dd.resolve_v3_config(1, 8, 640, 163 * 1024) == ("kh16n64w8", f"forced by {envs.DECODE_CONFIG}")
    assert dd.v3_plan(1, 8, 640, 132).config == "kh16n64w8"
    assert dd.resolve_v3_config(1, 8, 640, 163 * 1024, "h16n32w4")[0] == "h16n32w4"  # the caller's config wins
    name, why = dd.resolve_v3_config(1, 8, 640, 163 * 1024, block_sizes=(64, 3))  # paged_f16dot: shifts
    assert name == dd.V3_ANY_BLOCK_SIZE_CONFIG and "power-of-two" in why
    monkeypatch.setenv(envs.DECODE_CONFIG, "kh99")
    with pytest.raises(ValueError, match=envs.DECODE_CONFIG):
        dd.resolve_v3_config(1, 8, 640, 163 * 1024)


def test_decode_resolvers_give_their_reasons(monkeypatch):
    import torch

    from dsv4_ops import envs

    dd = dispatch.decode
    monkeypatch.delenv(envs.DECODE_KERNEL, raising=False)
    monkeypatch.delenv(envs.BATCH_INVARIANT, raising=False)
    assert dd.resolve_mode() == ("auto", f"{envs.DECODE_KERNEL} unset: auto")
    assert dd.resolve_route("auto", 4, 8, 640, 163 * 1024) == ("fused", "auto: AUTO_FUSED_WINDOWS")
    assert dd.resolve_route("auto", 1, 8, 640, 163 * 1024)[0] == "v3"
    assert dd.resolve_route("auto", 4, 64, 640, 99 * 1024) == ("paged", dd.AUTO_PAGED_WHY)
    assert dd.resolve_route("tiles", 1, 8, 640, 163 * 1024)[0] == "workspace"
    aligned, odd = torch.zeros(4, 576 * 4, dtype=torch.uint8), torch.zeros(4, 584 * 4 + 8, dtype=torch.uint8)
    assert dd.resolve_composite("v3", aligned, aligned)[0] and not dd.resolve_composite("v3", odd, aligned)[0]
    assert dd.uses_fused_op("fused", odd, odd) and not dd.uses_fused_op("workspace", aligned, aligned)
    assert dd.uses_fused_op("paged", odd, odd) and dd.resolve_composite("paged", odd, aligned)[0]
    assert dd.resolve_gather(dd.FUSED_GATHER_MAX_ROWS)[0] and not dd.gather_in_one_launch(dd.FUSED_GATHER_MAX_ROWS + 1)
    p, why = dd.resolve_workspace("auto", 64, 8, 640, True, -1)
    assert p.kernel == "heads" and "AUTO_HEADS_MIN_T" in why
    p, why = dd.resolve_workspace("auto", 64, 8, 640, False, -1)
    assert p.kernel == "tiles" and "int32" in why and p.splits == dd.tile_splits(64, 8, 640)
    assert dd.workspace_plan("v3", 8, 8, 640, True, -1) == dd.tiles_plan(8, 8, 640)
    assert dd.resolve_paged_form(None, 1, 8, 640, 163 * 1024, aligned, aligned)[0] == "v3"
    form, why = dd.resolve_paged_form("v3", 1, 8, 640, 163 * 1024, aligned[:, 8:], aligned)
    assert form == "v1" and "16-byte" in why
    assert dd.paged_form("v1", 1, 8, 640, -1, aligned, aligned) == "v1"
    assert dd.is_f16dot(dd.v3_config("kh16n32w4")) and not dd.is_f16dot(dd.v3_config("h16n32w4"))
    assert dispatch.v32.resolve_form(False, "w128")[0] == "w64"
    assert dispatch.v32.resolve_form(True, "auto", True, 16, 16)[0] == "f16"


def test_the_route_memo_follows_swapped_windows(monkeypatch):
    """dsv4_decode's memo of the route keys on the window tables' identities: a swapped table is
    a new key (no stale route)."""
    from dsv4_ops import dsv4_decode, envs

    monkeypatch.delenv(envs.DECODE_KERNEL, raising=False)
    smem = 163 * 1024
    args = (4, 8, 640, smem)
    assert dsv4_decode._route_memo(*args, dispatch.decode.windows_identity()) == "fused"
    monkeypatch.setattr(dispatch.windows, "AUTO_FUSED_WINDOWS", ())
    assert dsv4_decode._route_memo(*args, dispatch.decode.windows_identity()) == "v3"
    monkeypatch.setattr(dispatch.windows, "AUTO_V3_WINDOWS", ())
    assert dsv4_decode._route_memo(*args, dispatch.decode.windows_identity()) == "paged"
