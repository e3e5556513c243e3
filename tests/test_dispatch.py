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


def test_decode_config_knob_forces_the_config(monkeypatch):
    from dsv4_ops import envs

    dd = dispatch.decode
    monkeypatch.delenv(envs.DECODE_CONFIG, raising=False)
    monkeypatch.setenv(envs.DECODE_TABLES, "0")
    auto, why = dd.resolve_config(1, 8, 640, 163 * 1024)
    assert auto == "h16n16w4" and why == "no window: paged_chunk128's h16n16w4"
    assert dd.resolve_config(4, 8, 640, 163 * 1024) == ("h16n32w4", "no window: paged_chunk128's h16n32w4")
    name, why = dd.resolve_config(16, 8, 640, 163 * 1024)
    assert name == "kh16n32w4" and why == "CONFIG_WINDOWS row (16, 256, 1, 16, 640, 'kh16n32w4')"
    monkeypatch.setenv(envs.DECODE_CONFIG, "kh16n64w8")
    assert dd.resolve_config(1, 8, 640, 163 * 1024) == ("kh16n64w8", f"forced by {envs.DECODE_CONFIG}")
    p = dd.plan_step(1, 8, 640, 132, 163 * 1024)
    assert p.config == "kh16n64w8" and f"forced by {envs.DECODE_CONFIG}" in p.why
    assert dd.resolve_config(1, 8, 640, 163 * 1024, "h16n32w4") == ("h16n32w4", "the caller's config")  # it wins
    # paged_f16dot takes block sizes as shifts and reads 16-byte vectors: paged_chunk128's config for the shape
    name, why = dd.resolve_config(1, 8, 640, 163 * 1024, block_sizes=(64, 3))
    assert name == "h16n16w4" and "power-of-two" in why and "kh16n64w8" in why
    assert dd.resolve_config(4, 8, 640, 163 * 1024, block_sizes=(3, 64))[0] == "h16n32w4"
    # over caches that are not 16-byte aligned every plan runs paged_chunk128's unaligned config
    name, why = dd.resolve_config(4, 8, 640, 163 * 1024, aligned=False)
    assert name == "h16n32w8" and "16-byte aligned" in why
    assert dd.plan_step(4, 8, 640, 132, 163 * 1024, aligned=False).config == "h16n32w8"
    monkeypatch.setenv(envs.DECODE_CONFIG, "h16n16w4")  # a forced one too (h16n16w4 spills with ALIGN off)
    assert dd.resolve_config(4, 8, 640, 163 * 1024, block_sizes=(3, 5), aligned=False)[0] == "h16n32w8"
    assert dd.resolve_config(4, 8, 640, 163 * 1024, block_sizes=(3, 5))[0] == "h16n16w4"
    monkeypatch.setenv(envs.DECODE_CONFIG, "kh99")
    with pytest.raises(ValueError, match=envs.DECODE_CONFIG):
        dd.resolve_config(1, 8, 640, 163 * 1024)


def test_decode_resolvers_give_their_reasons(monkeypatch):
    from dsv4_ops import envs

    dd, ws = dispatch.decode, dispatch.workspace
    monkeypatch.delenv(envs.DECODE_KERNEL, raising=False)
    monkeypatch.delenv(envs.BATCH_INVARIANT, raising=False)
    assert dd.resolve_mode() == ("auto", f"{envs.DECODE_KERNEL} unset: auto")
    monkeypatch.setenv(envs.DECODE_KERNEL, "v3")
    assert dd.resolve_mode() == ("v3", f"{envs.DECODE_KERNEL}=v3")
    monkeypatch.setenv(envs.BATCH_INVARIANT, "1")
    with pytest.raises(ValueError, match="cannot be batch-invariant"):
        dd.resolve_mode()
    monkeypatch.delenv(envs.DECODE_KERNEL)
    assert dd.resolve_mode() == ("heads", f"{envs.BATCH_INVARIANT}=1 runs the heads kernel")
    assert dd.resolve_route("auto") == ("paged", "mode auto: the paged op")
    assert dd.resolve_route("v3") == ("paged", "mode v3: the paged op")
    assert dd.resolve_route("tiles") == ("workspace", "mode tiles: the workspace step")
    assert dd.route("heads") == "workspace"
    assert ws.resolve_gather(ws.FUSED_GATHER_MAX_ROWS)[0] and not ws.gather_in_one_launch(ws.FUSED_GATHER_MAX_ROWS + 1)
    p, why = ws.resolve_workspace("auto", 64, 8, 640, True, -1)
    assert p.kernel == "heads" and "AUTO_HEADS_MIN_T" in why
    p, why = ws.resolve_workspace("auto", 64, 8, 640, False, -1)
    assert p.kernel == "tiles" and "int32" in why and p.splits == ws.tile_splits(64, 8, 640)
    assert ws.workspace_plan("v3", 8, 8, 640, True, -1) == ws.tiles_plan(8, 8, 640)
    assert dd.is_f16dot(dd.v3_config("kh16n32w4")) and not dd.is_f16dot(dd.v3_config("h16n32w4"))
    assert dispatch.v32.resolve_form(False, "w128")[0] == "w64"
    assert dispatch.v32.resolve_form(True, "auto", True, 16, 16)[0] == "f16"


def test_the_removed_decode_surface_is_gone():
    """Issue 44: one planner. The v1 form (paged_chunk64), the fused mode and the shape-dependent
    route are gone, not left as dead aliases."""
    import importlib
    import inspect

    from dsv4_ops import envs, paged_decode, paged_plan

    dd = dispatch.decode
    assert envs.DECODE_MODES == dd.MODES == ("auto", "tiles", "heads", "v3")
    for name in ("v3_plan", "fused_plan", "fused_splits", "fused_form", "paged_form", "resolve_paged_form",
                 "auto_is_fused", "auto_is_v3", "uses_fused_op", "resolve_composite", "cache_aligned",
                 "windows_identity", "composite_splits", "composite_may_cap", "composite_split_cap",
                 "resolve_v3_config", "v3_launch_config", "v3_config_name", "v3_sm_config",
                 "V3_ANY_BLOCK_SIZE_CONFIG", "AUTO_PAGED_WHY"):
        assert not hasattr(dd, name), name
    for name in ("AUTO_FUSED_WINDOWS", "AUTO_V3_WINDOWS", "AUTO_V3_SMEM_WINDOWS", "V3_CONFIG_WINDOWS"):
        assert not hasattr(dispatch.windows, name), name
    assert dispatch.windows.TABLES == ("CONFIG_WINDOWS",)
    with pytest.raises(ImportError):
        importlib.import_module("dsv4_ops.csrc_triton.decode.paged_chunk64")
    assert list(inspect.signature(dd.resolve_route).parameters) == ["kernel_mode"]
    assert "form" not in inspect.signature(paged_decode.dsv4_decode_fused).parameters
    assert "form" not in paged_plan.PagedPlan.__slots__


def test_the_route_memo_follows_the_mode_not_the_windows(monkeypatch):
    """dsv4_decode's memo of the route keys on the environment it reads (the mode, batch invariance)
    and takes no shapes; a swapped window table changes the plan (and the table identities the kept
    plans key on), never the route."""
    import inspect

    from dsv4_ops import dsv4_decode, envs

    assert not inspect.signature(dsv4_decode._route).parameters
    monkeypatch.delenv(envs.DECODE_KERNEL, raising=False)
    monkeypatch.delenv(envs.BATCH_INVARIANT, raising=False)
    monkeypatch.setenv(envs.DECODE_TABLES, "0")
    assert dsv4_decode._route_memo() == "paged"
    for mode, want in (("tiles", "workspace"), ("heads", "workspace"), ("v3", "paged"), ("auto", "paged")):
        monkeypatch.setenv(envs.DECODE_KERNEL, mode)
        assert dsv4_decode._route_memo() == want, mode
    monkeypatch.setenv(envs.BATCH_INVARIANT, "1")
    assert dsv4_decode._route_memo() == "workspace"
    monkeypatch.delenv(envs.BATCH_INVARIANT)
    assert dsv4_decode._route_memo() == "paged"
    before, ident = dispatch.decode.plan_step(16, 8, 640, 132, 163 * 1024), dispatch.windows.identity()
    assert before.config == "kh16n32w4" and "CONFIG_WINDOWS row" in before.why
    monkeypatch.setattr(dispatch.windows, "CONFIG_WINDOWS", ())
    assert dispatch.windows.identity() != ident
    after = dispatch.decode.plan_step(16, 8, 640, 132, 163 * 1024)
    assert after.config == "h16n32w4" and "no window" in after.why
    assert dsv4_decode._route_memo() == "paged"
