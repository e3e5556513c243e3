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
