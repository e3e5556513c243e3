"""The README's two set-up commands are the ones CI runs."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
