"""The test-only A100 platform distribution (tests/e2e/a100_platform): installed with pip into a
temporary target dir, its entry points are found by vLLM's own plugin loader, it is inert
without DSV4_E2E_A100=1, and with it vLLM's ``current_platform`` resolves to the CUDA platform
answering sm_80 / 108 SMs / an A100's name, and dsv4_ops' general plugin routes on it.
Each check runs in a fresh subprocess (platform resolution is once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the distribution is installed once a module (``site``); under pytest-xdist --dist loadgroup
# this module's tests stay on one worker, which installs it once
pytestmark = pytest.mark.xdist_group("e2e_engine_platform")

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.dirname(HERE)
DIST = os.path.join(E2E, "a100_platform")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("a100_site")
    sys.path.insert(0, DIST)
    import make_wheel

    sys.path.remove(DIST)
    whl = make_wheel.build(str(tmp_path_factory.mktemp("a100_wheel")))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(d), whl],
                   check=True, capture_output=True, timeout=300)
    return str(d)


def _run(site: str, code: str, enabled: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, E2E, os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL="INFO")
    env.pop("VLLM_PLUGINS", None)
    env.pop("DSV4_E2E_A100", None)
    if enabled:
        env["DSV4_E2E_A100"] = "1"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), log=p.stdout + p.stderr)


def test_entry_points_found_and_inert_when_disabled(site):
    r = _run(site, """
import json
from vllm.plugins import load_plugins_by_group
p = load_plugins_by_group("vllm.platform_plugins")
g = load_plugins_by_group("vllm.general_plugins")
print(json.dumps(dict(platform=sorted(p), general=sorted(g), answer=p["dsv4_e2e_a100"]() if "dsv4_e2e_a100" in p else "absent")))
""", enabled=False)
    assert "dsv4_e2e_a100" in r["platform"]
    assert {"dsv4_e2e_standins"} <= set(r["general"]), r["general"]
    assert r["answer"] is None


def test_current_platform_is_cuda_answering_as_a100(site):
    r = _run(site, """
import json, os
from vllm.platforms import current_platform as cp
from vllm.plugins import load_general_plugins
load_general_plugins()
from dsv4_ops.vllm import plugin
cap = cp.get_device_capability()
from vllm.model_executor.models.registry import ModelRegistry
archs = {a: [ModelRegistry.models[a].module_name, ModelRegistry.models[a].class_name]
         for a in ("DeepseekV41LLMForCausalLM", "DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM")}
print(json.dumps(dict(archs=archs, cls=type(cp).__name__, mro=[c.__name__ for c in type(cp).__mro__], cap=[cap.major, cap.minor],
      name=cp.get_device_name(), sms=cp.num_compute_units(), is_cuda=cp.is_cuda(),
      routed=plugin.STATE.routed, plugin_cap=list(plugin.STATE.capability or ()), pid=os.getpid())))
""", enabled=True)
    assert r["cls"] == "A100OnH200Platform" and "NvmlCudaPlatform" in r["mro"], r
    assert r["cap"] == [8, 0] and r["sms"] == 108 and "A100" in r["name"] and r["is_cuda"]
    assert r["routed"] and r["plugin_cap"] == [8, 0], r
    assert f"dsv4_e2e_a100 (pid {r['pid']}): platform" in r["log"]
    # the e2e classes (tripwire / counters armed after loading); v41x's VL architecture name runs
    # the armed text class (the tiny checkpoint has no vision tower)
    assert r["archs"]["DeepseekV41ForCausalLM"] == ["dsv4_e2e_a100.models", "DeepseekV41LLMForCausalLM"], r["archs"]
    assert r["archs"]["DeepseekV41LLMForCausalLM"] == ["dsv4_e2e_a100.models", "DeepseekV41LLMForCausalLM"]
    # dsv4_ops' own INFO line is not asserted: vLLM 0.33 configures its logging lazily
    # (configure_logging_if_needed), after the general plugins ran in this process, so the line
    # goes to Python's last-resort handler (WARNING and up only)


def _fp8_kernel_src(x_ptr):
    import triton.language as tl

    tl.store(x_ptr, tl.load(x_ptr).to(tl.float8e4nv))


def _bf16_kernel_src(x_ptr):
    import triton.language as tl

    tl.store(x_ptr, tl.load(x_ptr).to(tl.bfloat16))


def test_warmup_evidence_counts_an_fp8_triton_kernel_as_failing_as_on_sm80(monkeypatch):
    """On the H200 the JIT-warmup filter's compile of an fp8 Triton kernel succeeds; the harness
    makes it fail as Triton does on sm_80, so replaced kernels are dropped as on an A100."""
    import triton

    sys.path.insert(0, E2E)
    sys.path.insert(0, DIST)
    from dsv4_e2e_a100 import plugin as e2e_plugin

    from dsv4_ops.vllm import warmup

    class Owner:
        def __init__(self, fn):
            self.kernel = triton.heuristics({})(triton.jit(fn))   # a wrapper, as vLLM's may be
            self.asked = 0

        def get_warmup_keys(self):
            self.asked += 1
            return []

    monkeypatch.setattr(warmup, "compile_fails", warmup.compile_fails)
    warmup._COMPILED.clear()
    e2e_plugin._warmup_evidence_as_sm80()
    e2e_plugin._warmup_evidence_as_sm80()                      # idempotent: wrapped once
    assert warmup.compile_fails._dsv4_e2e_sm80
    fp8, bf16 = Owner(_fp8_kernel_src), Owner(_bf16_kernel_src)
    fails, error = warmup.compile_fails(fp8, (), {})
    assert fails and "_fp8_kernel_src names an fp8 type" in error
    assert fp8.asked == 0    # not compiled: the worker's tripwire would count a probe as a launch
    assert warmup.compile_fails(bf16, (), {}) == (False, "") and bf16.asked == 1
    warmup._COMPILED.clear()
