"""shared_report.session_report: under pytest-xdist a report is made once for all workers of a run
(the others read it), a report that could not be made is not stored, and without xdist every
call makes its own."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from .shared_report import session_report
except ImportError:  # tests/e2e collected as a rootdir (no package)
    sys.path.insert(0, HERE)
    from shared_report import session_report


def _run(tmp_path):
    """A stand-in for tmp_path_factory whose workers' temporary directories share ``tmp_path``."""
    return SimpleNamespace(getbasetemp=lambda: tmp_path / "popen-gw0")


def test_one_report_for_every_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    run, key, made = _run(tmp_path), "model_v41", []

    def make():
        made.append(1)
        return {"seed": 7, "rows": [1, 2]}

    assert session_report(run, key, make) == {"seed": 7, "rows": [1, 2]}
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert session_report(run, key, make) == {"seed": 7, "rows": [1, 2]}
    assert len(made) == 1


def test_a_failed_report_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    run, key = _run(tmp_path), "model_v4"

    def fail():
        raise AssertionError("driver failed")

    with pytest.raises(AssertionError):
        session_report(run, key, fail)
    assert session_report(run, key, lambda: {"ok": True}) == {"ok": True}


def test_without_xdist_each_call_makes_its_report(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    made = []
    for _ in range(2):
        session_report(_run(tmp_path), "model_v41", lambda: made.append(1) or {})
    assert len(made) == 2
