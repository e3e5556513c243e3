"""The README is the user's document: its set-up commands are the ones CI runs, its environment
table is the one dsv4_ops.envs generates, it stays short, and every relative link in it and in
docs/ points to a file that exists."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_README_LINES = 350


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_ci_runs_the_readme_test_command():
    readme = _read("README.md")
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in commands if "pytest" in c).strip()
    ci = _read(".ci", "run")
    assert test_cmd in ci, f"README test command not in .ci/run:\n{test_cmd}"
    assert "dsv4-ops check" in ci


def test_readme_environment_table_is_the_generated_one():
    from dsv4_ops.envs import markdown_table

    readme = _read("README.md")
    begin, end = "<!-- envs:begin -->", "<!-- envs:end -->"
    assert readme.count(begin) == 1 and readme.count(end) == 1, "README needs one envs:begin / envs:end pair"
    table = readme[readme.index(begin) + len(begin):readme.index(end)].strip("\n")
    assert table == markdown_table().strip("\n"), \
        "README environment table is stale: paste `python3 -m dsv4_ops.envs` between the envs markers"


def test_readme_is_at_most_350_lines():
    n = len(_read("README.md").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}); move details to docs/"


# [text](target) and ![alt](target), outside code; target up to the first space or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)


def _markdown_files():
    files = [os.path.join(ROOT, "README.md")]
    for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".md")]
    return files


def _slug(heading):
    """GitHub's anchor for a heading: lower case, code ticks and punctuation dropped, spaces -> '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path):
    text = _FENCE.sub("", _read(path))
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def test_relative_links_in_readme_and_docs_resolve():
    broken = []
    for path in _markdown_files():
        text = _CODE_SPAN.sub("", _FENCE.sub("", _read(path)))
        for target in _LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            where = f"{os.path.relpath(path, ROOT)} -> {target}"
            if not os.path.exists(dest):
                broken.append(f"{where} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
