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


# ------------------------------------------------------------------ check and the vLLM audit

def _audit_result(open_row: bool):
    from dsv4_ops.vllm import audit

    row = dict(model="v4", path="default", phase="forward", kernel="vllm.fake.ops._FAKE_KERNEL", tech="Triton",
               location="vllm.fake.ops:fake:1", evidence="AOT sm_80 fails: fp8e4nv", patch="")
    rows = [audit.Row(status="runs", **dict(row, kernel="vllm.fake.ops._OK_KERNEL"))]
    if open_row:
        rows.append(audit.Row(status="dead", **row))
    return audit.AuditResult("0.33.0", 80, rows, [])


@pytest.fixture
def quick_check(monkeypatch):
    """`dsv4-ops check --skip-aot` in this process with the numeric self-test stubbed to pass, so
    its exit code is decided by the audit section alone."""
    from dsv4_ops.tools import cli, selftest

    monkeypatch.setattr(selftest, "run", lambda: [{"check": "stub", "device": "cpu", "ok": True, "detail": ""}])
    return lambda: cli.main(["check", "--skip-aot"])


def test_check_fails_on_an_open_audit_row(quick_check, monkeypatch, capsys):
    from dsv4_ops.vllm import audit

    monkeypatch.setattr(audit, "vllm_installed", lambda: "0.33.0")
    for open_row, code in ((False, 0), (True, 1)):
        monkeypatch.setattr(audit, "run", lambda *a, _o=open_row, **k: _audit_result(_o))
        assert quick_check() == code, open_row
        out = capsys.readouterr().out
        assert ("FAIL: open row v4:forward:vllm.fake.ops._FAKE_KERNEL" in out) == open_row, out
        assert ("all checks passed" in out) != open_row


def test_check_fails_when_the_audit_cannot_run(quick_check, monkeypatch, capsys):
    from dsv4_ops.vllm import audit

    def broken(*a, **k):
        raise audit.AuditError("audit worker failed (exit 1)")

    monkeypatch.setattr(audit, "vllm_installed", lambda: "0.33.0")
    monkeypatch.setattr(audit, "run", broken)
    assert quick_check() == 1
    assert "FAIL: the audit could not run: audit worker failed" in capsys.readouterr().out


def test_check_skips_the_audit_without_vllm(quick_check, monkeypatch, capsys):
    from dsv4_ops.vllm import audit

    monkeypatch.setattr(audit, "vllm_installed", lambda: None)
    monkeypatch.setattr(audit, "run", lambda *a, **k: _audit_result(True))  # would fail, were it consulted
    assert quick_check() == 0
    out = capsys.readouterr().out
    assert "vLLM not installed: skipped" in out and "all checks passed" in out


def test_audit_against_exit_code_follows_what_it_found(monkeypatch, capsys):
    """`audit-vllm --against`: exit 1 when the target breaks a table row, has an open row or a
    kernel new or changed since the recorded release; 0 when it has none of them."""
    from dsv4_ops.tools import cli
    from dsv4_ops.vllm import audit
    from dsv4_ops.vllm.audit import _against

    clean = _audit_result(False)

    def report(table=(), result=clean, kernels=None):
        return _against.Report("x.whl", "0.99.0", "0.34.0", 1, list(table), result, ("v4",),
                               kernels or _against.KernelDiff(), True)

    new = _against.KernelDiff(new=[clean.rows[0]])
    gone = _against.KernelDiff(removed=["v4|default|forward|vllm.fake.ops._GONE|vllm.fake.ops:fake"])
    cases = [(report(), 0), (report(kernels=gone), 0), (report(table=["a row no longer matches"]), 1),
             (report(result=_audit_result(True)), 1), (report(kernels=new), 1)]
    for rep, code in cases:
        monkeypatch.setattr(_against, "against", lambda *a, _r=rep, **k: _r)
        assert cli.main(["audit-vllm", "--against", "x.whl"]) == code, rep
        out = capsys.readouterr().out
        assert ("FOUND" in out) == bool(code), out
    monkeypatch.setattr(_against, "against", lambda *a, **k: (_ for _ in ()).throw(audit.AuditError("not a wheel")))
    assert cli.main(["audit-vllm", "--against", "x.whl"]) == 2
