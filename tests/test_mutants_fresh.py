"""The mutation check's rows stay current: every planted bug's text occurs exactly once in its
file (a row the code has moved past would otherwise be reported stale, not caught, and only
when someone runs ``python tests/mutants/run.py``), and names its tests."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mutants():
    spec = importlib.util.spec_from_file_location("dsv4_mutants", os.path.join(ROOT, "tests", "mutants", "mutants.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(mod)
    return mod.MUTANTS


MUTANTS = _mutants()


def test_names_are_unique_and_enough():
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names) >= 15


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_once_and_changes_the_code(m):
    with open(os.path.join(ROOT, m.file)) as f:
        text = f.read()
    assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.file}"
    assert m.new != m.old and m.tests
