"""Test set-up: the Triton interpreter on CPU-only machines, GPU markers, shared fixtures.

Without a CUDA GPU, TRITON_INTERPRET=1 is set before any kernel module is imported, so the
kernels whose numerics the interpreter reproduces (fp8 decode, integer bit arithmetic,
fp32/fp16 tl.dot) run on the CPU. The AOT compile runs once a session, in a subprocess
without the interpreter (fixture ``aot_results``).

Helpers the tests share live in ``dsv4_ops.testing`` (HAS_GPU, poison_like, rng, the
attention comparison); tests import them from there, never from this file.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import dsv4_ops  # noqa: E402,F401  (registers the ops after the interpreter switch)
from dsv4_ops.testing import HAS_GPU  # noqa: E402

VARIANTS = ("portable", "native")


# Test files whose outcome depends on the installed vLLM release (they import it, read its source
# or run its model code): CI runs the whole suite on the newest supported release, then these
# (`pytest -m vllm_release`) on every other supported release (.ci/run). A file whose other tests
# never reach vLLM's code marks its release-dependent tests alone (@pytest.mark.vllm_release).
VLLM_RELEASE_FILES = frozenset({
    "test_vllm_plugin.py", "test_vllm_v32_plugin.py", "test_vllm_indexer.py", "test_audit_vllm.py",
    "test_audit_v32.py", "test_engram_plugin.py", "test_pp_partition.py", "test_doctor.py",
    "test_decode_graph.py", "test_wo_a_formats.py", "test_e2e.py", "test_e2e_v32.py", "test_e2e_sched.py",
    "test_e2e_multirank.py", "test_refusals.py", "test_doctor_values.py",
    "test_platform_plugin.py", "test_standins_engine.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in VLLM_RELEASE_FILES:
            item.add_marker(pytest.mark.vllm_release)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; the CPU suite checks references, fakes, opcheck, AOT")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With DSV4_TEST_OUTCOMES=<file> (benchmarks/device/gpu_suite.sh), append '<node id> <outcome>'
    for each phase that decides a test: the call, or a setup / teardown that failed or skipped.
    Under xdist the hook runs in each worker and again in the controller: only the controller
    (no PYTEST_XDIST_WORKER) writes, so each result is written once."""
    path = os.environ.get("DSV4_TEST_OUTCOMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and report.outcome == "passed"):
        return
    with open(path, "a") as f:
        f.write(f"{report.nodeid} {report.outcome}\n")


@pytest.fixture(autouse=True)
def _seed_global_rng():
    """A net under the explicit generators: whatever still draws from torch's global RNG
    (a library, a helper) draws the same numbers on every run of a test."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _decode_tables_off(monkeypatch):
    """The tests pin the plans of the windows and the cost model: a per-device decode table (shipped
    for the H200 at 132 / 112 / 104 SMs, dsv4_ops.dispatch.tables) would replace them on that GPU.
    tests/test_decode_tables.py turns the tables on where it tests them."""
    monkeypatch.setenv("DSV4_AMPERE_DECODE_TABLES", "0")


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """Each GPU test runs twice: DSV4_AMPERE_IMPL=portable (the sm_80 kernels) and native."""
    if request.param == "native" and HAS_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native fp8 needs sm_89+")
    monkeypatch.setenv("DSV4_AMPERE_IMPL", request.param)
    return request.param


@pytest.fixture
def interpret():
    """The device a kernel test runs on: 'cuda', or 'cpu' through the Triton interpreter."""
    from triton import knobs

    if HAS_GPU:
        return "cuda"
    assert knobs.runtime.interpret, "conftest should have enabled TRITON_INTERPRET"
    return "cpu"


# One AOT compile for the whole session: every portable specialization for sm_80 and sm_86,
# plus the few native ones the negative tests need (e4m3_encode for sm_80, where it must fail,
# and for sm_90, whose PTX holds the e4m3 cvt the sm_8x check must catch).
_AOT_SCRIPT = """
import dataclasses, json, multiprocessing, os
from concurrent.futures import ProcessPoolExecutor
from dsv4_ops import aot
specs = aot.all_specs()
jobs = [(i, a) for a in aot.AMPERE_ARCHS for i, s in enumerate(specs)
        if s.variant == "portable" and aot.compiled_for(s, a)]
native_enc = [i for i, s in enumerate(specs) if s.variant == "native" and s.op == "e4m3_encode"]
jobs += [(i, 80) for i in native_enc] + [(i, 90) for i in native_enc if "exact,fp32" in specs[i].label]
def compile_one(job):
    return dataclasses.asdict(aot.compile_spec(specs[job[0]], job[1]))
workers = min(4, os.cpu_count() or 1)
if workers > 1:  # compiles are independent; forked workers inherit the specs
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        rows = list(pool.map(compile_one, jobs))
else:
    rows = [compile_one(j) for j in jobs]
print(json.dumps(rows))
"""


@pytest.fixture(scope="session")
def aot_results(tmp_path_factory):
    """AotResult rows of the session's one AOT compile (see _AOT_SCRIPT), in a subprocess
    with TRITON_INTERPRET=0 (the interpreter replaces the JIT functions AOT needs). Under
    pytest-xdist the workers share one compile: the first to take the lock runs it and leaves
    its rows in the run's common temp folder, the others read them."""
    import fcntl

    from dsv4_ops import aot

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own (one per run, not shared across runs)
    rows_file, lock_file = shared / "aot_results.json", shared / "aot_results.lock"
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not rows_file.exists():
            env = dict(os.environ, TRITON_INTERPRET="0")
            res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True,
                                 timeout=900)
            assert res.returncode == 0, f"AOT subprocess failed ({res.returncode}):\n{res.stderr[-3000:]}"
            rows_file.write_text(res.stdout.strip().splitlines()[-1])
    return [aot.AotResult(**r) for r in json.loads(rows_file.read_text())]
