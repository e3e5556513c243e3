"""docs/dispatch.md shows the window table of dsv4_ops/dispatch/windows.py: each table under its
``#### NAME`` heading must equal the module's tuple, row for row, and the doc shows no other
(a removed table left in the doc is drift too); its decode prose names no removed rule."""

import pathlib
import re
import sys

import pytest

from dsv4_ops.dispatch import windows

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "dispatch.md"


def _cell(text: str):
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def doc_tables() -> dict:
    """{heading: [row tuple, ...]} for every Markdown table right under a '#### NAME' heading."""
    tables, name, rows, in_table = {}, None, [], False
    for line in DOC.read_text().splitlines() + [""]:
        if line.startswith("#"):  # a heading: a table name when it is one word
            heading = re.fullmatch(r"#{2,4} (\w+)", line.strip())
            name, rows, in_table = (heading.group(1) if heading else None), [], False
            continue
        if name and line.startswith("|"):
            cells = [c for c in line.strip().strip("|").split("|")]
            if not in_table:  # the header row
                in_table = True
                continue
            if set("".join(cells).strip()) <= set("-: "):  # the separator
                continue
            rows.append(tuple(_cell(c) for c in cells))
        elif in_table:
            tables[name] = rows
            name, in_table = None, False
    return tables


@pytest.mark.parametrize("name", windows.TABLES)
def test_doc_table_equals_the_module(name):
    tables = doc_tables()
    assert name in tables, f"docs/dispatch.md has no table under '#### {name}'"
    assert tuple(tables[name]) == tuple(getattr(windows, name)), \
        f"docs/dispatch.md's {name} differs from dsv4_ops/dispatch/windows.py"


def test_the_doc_shows_the_modules_tables_and_no_other():
    assert set(doc_tables()) == set(windows.TABLES) == {"CONFIG_WINDOWS"}


def _decode_section() -> str:
    text = DOC.read_text()
    start = text.index("## DeepSeek-V4 decode")
    return text[start:text.index("\n## ", start + 1)]


@pytest.mark.parametrize("removed", ["AUTO_FUSED_WINDOWS", "AUTO_V3_WINDOWS", "AUTO_V3_SMEM_WINDOWS",
                                     "V3_CONFIG_WINDOWS", "resolve_paged_form", "resolve_composite", "v3_plan",
                                     "resolve_v3_config", "composite_split", "fused_splits", "form v1",
                                     "V3_ANY_BLOCK_SIZE_CONFIG", "AUTO_PAGED_WHY"])
def test_the_decode_prose_names_no_removed_rule(removed):
    """The doc describes the one planner: the v1 form, the fused mode and the shape-dependent route
    are gone from the code, so no rule of theirs is described (paged_chunk64 is named only as gone)."""
    assert removed not in _decode_section()


def test_the_decode_prose_names_the_planners_rules():
    """The rules the doc names exist, and its list of modes is DSV4_AMPERE_DECODE_KERNEL's."""
    from dsv4_ops import envs, paged_plan
    from dsv4_ops.dispatch import decode

    section = _decode_section()
    for name in ("plan_step", "resolve_route", "resolve_config", "v3_splits", "split_cap", "balanced",
                 "PAGED_PARTIALS_MAX_BYTES", "V3_CONFIG_MARGIN", "V3_COST", "v3_resident"):
        assert f"`{name}" in section and hasattr(decode, name), name
    assert "`paged_plan.paged_aligned`" in section and hasattr(paged_plan, "paged_aligned")
    line = re.search(r"`DSV4_AMPERE_DECODE_KERNEL` = (.*?) \(`resolve_mode`", section, re.S).group(1)
    assert tuple(re.findall(r"`(\w+)`", line)) == envs.DECODE_MODES


def test_the_parser_reads_a_planted_table(tmp_path, monkeypatch):
    planted = tmp_path / "d.md"
    planted.write_text("#### X\n\ntext\n\n| a | b |\n|---|---|\n| 1 | kh |\n| 2 | 3 |\n\nafter\n")
    monkeypatch.setattr(sys.modules[__name__], "DOC", planted)
    assert doc_tables() == {"X": [(1, "kh"), (2, 3)]}
