"""A report of one e2e driver run, once a pytest-xdist run (see ``session_report``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def session_report(tmp_path_factory, key: str, make):
    """``make()``'s report (a JSON-able dict), once for all xdist workers of this run: ``key``
    names the driver run (model, configuration). Without xdist it is ``make()``. A report that
    could not be made is not stored (the next worker that asks runs it again, and fails the same
    way)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    root = tmp_path_factory.getbasetemp().parent      # one directory a run, shared by its workers
    path = os.path.join(str(root), f"e2e-report-{key}.json")
    with _locked(path + ".lock"):
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        report = make()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)
        return report
