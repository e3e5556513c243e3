"""docs/dispatch.md shows the window tables of dsv4_ops/dispatch/windows.py: each table under its
``#### NAME`` heading must equal the module's tuple, row for row, so neither drifts."""

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


def test_the_parser_reads_a_planted_table(tmp_path, monkeypatch):
    planted = tmp_path / "d.md"
    planted.write_text("#### X\n\ntext\n\n| a | b |\n|---|---|\n| 1 | kh |\n| 2 | 3 |\n\nafter\n")
    monkeypatch.setattr(sys.modules[__name__], "DOC", planted)
    assert doc_tables() == {"X": [(1, "kh"), (2, 3)]}
