"""The dsv4-ops CLI: `check` passes on this machine, `bench` explains what it needs."""

import subprocess
import sys

import pytest
import torch


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dsv4_ops", *args], capture_output=True, text=True, timeout=timeout)


def test_check_passes_and_prints_every_section():
    out = _run("check")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for section in ("== environment", "== op table", "== AOT compile for sm_80 / sm_86", "== numeric self-test"):
        assert section in out.stdout
    assert "sm_80" in out.stdout and "sm_86" in out.stdout and "FAIL" not in out.stdout
    assert "all checks passed" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, bench runs the real benchmarks")
def test_bench_on_cpu_says_what_it_needs():
    out = _run("bench")
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stdout


def test_bad_override_fails_loudly(monkeypatch):
    out = subprocess.run([sys.executable, "-c", "import dsv4_ops.dispatch as d; d.kernel_variant((8, 0))"],
                         capture_output=True, text=True, env={**__import__('os').environ, "DSV4_AMPERE_IMPL": "bogus"})
    assert out.returncode != 0 and "DSV4_AMPERE_IMPL must be one of" in out.stderr
