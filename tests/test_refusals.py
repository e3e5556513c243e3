"""The plugin's startup refusals and fallbacks, each input flipped alone, on every sm_8x capability
of the op table (sm_80 A100, sm_86 A10 / A40 / A6000, sm_87 Orin) and on sm_90 (where the plugin
patches nothing, so nothing is refused).

Inputs, each flipped by a test below:
- quant guard (``quant_guard.check_quant_config``, the hook on ``get_quant_method``): the quant
  method name, the weight block size, ``expert_dtype``, ``moe_quant_algo``, and the kernel config's
  ``linear_backend``, ``moe_backend``, ``linear_backend_per_quant``; ``check_model_quant``: the
  quant config's family; ``check_serve_settings``: ``lora_config``, ``indexer_logits_dtype``.
- startup checks (``plugin.register`` / ``startup_choices``): ``VLLM_BATCH_INVARIANT``,
  ``VLLM_MARLIN_INPUT_DTYPE``, ``VLLM_DISABLED_KERNELS``, the capability, ``DSV4_AMPERE_IMPL``.
- the sampler fallback: ``VLLM_USE_FLASHINFER_SAMPLER`` (unset / 0 / 1), and each piece of the
  toolchain FlashInfer's JIT needs (toolkit, nvcc, nvcc's CUDA major against torch's, headers,
  libcudart, libcuda, ninja, the host compiler).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace as NS

import pytest

vllm = pytest.importorskip("vllm", reason="the plugin's refusals need vLLM")

from dsv4_ops.vllm import plugin as vp  # noqa: E402
from dsv4_ops.vllm import quant_guard as qg  # noqa: E402
from dsv4_ops.vllm import serve_host as sh  # noqa: E402
from test_vllm_plugin import spoof  # noqa: E402  (the capability vLLM's platform answers)

SM8X = [(8, 0), (8, 6), (8, 7)]
SAMPLER = sh.SAMPLER_ENV
KERNEL_ENVS = ("VLLM_BATCH_INVARIANT", "VLLM_MARLIN_INPUT_DTYPE", "VLLM_DISABLED_KERNELS")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for k in KERNEL_ENVS + (SAMPLER, "DSV4_AMPERE_IMPL"):
        monkeypatch.delenv(k, raising=False)
    # the patch table's own check (1.5 s a register() here) reads none of the inputs under test;
    # tests/test_vllm_plugin.py runs it
    monkeypatch.setattr(vp, "check_table", lambda *a, **k: None)
    vp.reset()
    yield
    vp.reset()


# ---- the toolchain FlashInfer's sampler JIT needs -------------------------------------------

HOME = "/opt/cuda-13"
PIECES = ("toolkit", "nvcc", "nvcc major", "header", "libcudart", "libcuda", "ninja", "c++")


def toolchain(missing: str = ""):
    """A host with every piece FlashInfer's JIT uses, except ``missing``."""
    files = {f"{HOME}/bin/nvcc", f"{HOME}/lib64/libcudart.so", f"{HOME}/lib64/stubs/libcuda.so"} | \
        {f"{HOME}/include/{h}" for h in sh.SAMPLER_HEADERS}
    if missing == "nvcc":
        files.discard(f"{HOME}/bin/nvcc")
    if missing == "header":
        files.discard(f"{HOME}/include/curand_kernel.h")
    if missing == "libcudart":
        files.discard(f"{HOME}/lib64/libcudart.so")
    if missing == "libcuda":
        files.discard(f"{HOME}/lib64/stubs/libcuda.so")
    env = {} if missing == "toolkit" else {"CUDA_HOME": HOME}

    def which(name):
        if name == "nvcc" or (name == "ninja" and missing == "ninja") or (name == "c++" and missing == "c++"):
            return None
        return f"/usr/bin/{name}"

    return sh.read_toolchain(env, which=which, exists=lambda p: p in files and not p.startswith("/usr/local"),
                             nvcc_release=lambda _: "12.8" if missing == "nvcc major" else "13.0", jit_cache=False)


# what each missing piece's reason names (written from FlashInfer's needs, not copied from the code)
PIECE_WORDS = {"toolkit": "no CUDA toolkit", "nvcc": "no nvcc", "nvcc major": "12.8", "header": "curand_kernel.h",
               "libcudart": "libcudart", "libcuda": "libcuda.so", "ninja": "ninja", "c++": "C++ compiler"}


def test_the_complete_toolchain_builds():
    """The control of every flip below: nothing missing, FlashInfer's sampler stays."""
    assert sh.jit_problems(toolchain(), "13.0") == []
    env = {}
    said = vp.startup_choices(env, toolchain(), "13.0")
    assert SAMPLER not in env and said[0].startswith("sampler: FlashInfer")


@pytest.mark.parametrize("missing", PIECES)
def test_each_missing_toolchain_piece_applies_the_triton_sampler(missing):
    """One piece missing: the fallback is applied (VLLM_USE_FLASHINFER_SAMPLER=0 in the
    environment vLLM reads) and its log phrase names the piece; asked for FlashInfer's sampler
    (=1) it is refused with the same reason; =0 set by the user is kept and said."""
    tc = toolchain(missing)
    problems = sh.jit_problems(tc, "13.0")
    assert len(problems) == 1 and PIECE_WORDS[missing] in problems[0], problems
    env = {}
    said = vp.startup_choices(env, tc, "13.0")
    assert env == {SAMPLER: "0"} and said[0].startswith("sampler: Triton") and PIECE_WORDS[missing] in said[0]
    with pytest.raises(vp.UnauditedServePathError, match=f"{SAMPLER}=1 asks for FlashInfer") as err:
        vp.startup_choices({SAMPLER: "1"}, tc, "13.0")
    assert PIECE_WORDS[missing] in str(err.value)
    env = {SAMPLER: "0"}
    assert "as set" in vp.startup_choices(env, tc, "13.0")[0] and env == {SAMPLER: "0"}


@pytest.mark.parametrize("value,want", [("0", "kept"), ("1", "refused"), ("", "fallback"), ("yes", "fallback"),
                                        (None, "fallback")])
def test_sampler_setting_values(value, want):
    """VLLM_USE_FLASHINFER_SAMPLER as vLLM parses it (int): 0 keeps Triton, 1 demands FlashInfer,
    unset or unparsable leaves the choice to the plugin."""
    env = {} if value is None else {SAMPLER: value}
    if want == "refused":
        with pytest.raises(vp.UnauditedServePathError):
            vp.startup_choices(env, toolchain("ninja"), "13.0")
        return
    said = vp.startup_choices(env, toolchain("ninja"), "13.0")
    assert env[SAMPLER] == "0"
    assert ("as set" in said[0]) == (want == "kept")


@pytest.mark.parametrize("cap", SM8X + [(9, 0)])
def test_register_applies_the_sampler_fallback_on_every_sm8x(monkeypatch, caplog, cap):
    """register() on each capability with FlashInfer's JIT broken: sm_8x sets the Triton sampler
    and logs it; sm_90 leaves vLLM's choice alone. With the JIT able to build nothing is set."""
    spoof(monkeypatch, cap)
    logger = logging.getLogger("vllm.plugins.dsv4_ops")
    monkeypatch.setattr(logger, "propagate", True)
    for tc, fallback in ((toolchain("ninja"), cap[0] == 8), (toolchain(), False)):
        monkeypatch.setattr(sh, "read_toolchain", lambda tc=tc: tc)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.plugins.dsv4_ops"):
            vp.register()
        text = " ".join(r.getMessage() for r in caplog.records)
        assert (os.environ.get(SAMPLER) == "0") == fallback, (cap, fallback)
        assert ("sampler: Triton, set" in text) == fallback, text
        assert f"capability sm_{cap[0]}{cap[1]}" in text
        assert vp.STATE.routed == (cap[0] == 8)
        vp.reset()
        assert SAMPLER not in os.environ


@pytest.mark.parametrize("cap", SM8X)
def test_register_refuses_flashinfer_sampler_it_cannot_build(monkeypatch, cap):
    spoof(monkeypatch, cap)
    broken, whole = toolchain("libcuda"), toolchain()
    monkeypatch.setattr(sh, "read_toolchain", lambda: broken)
    monkeypatch.setenv(SAMPLER, "1")
    with pytest.raises(vp.UnauditedServePathError, match="libcuda.so"):
        vp.register()
    assert not vp.STATE.registered and vp.STATE.patched == []
    monkeypatch.setattr(sh, "read_toolchain", lambda: whole)
    vp.register()  # the control: the same setting where the JIT builds
    assert vp.STATE.routed and os.environ[SAMPLER] == "1"


# ---- kernel settings read at register ----------------------------------------------------------

KERNEL_SETTINGS = [("VLLM_BATCH_INVARIANT", "1", "0"), ("VLLM_MARLIN_INPUT_DTYPE", "fp8", ""),
                   ("VLLM_DISABLED_KERNELS", "MarlinExperts", "SomeOtherKernel"),
                   ("VLLM_DISABLED_KERNELS", "MarlinMxfp8LinearKernel", "")]


@pytest.mark.parametrize("cap", SM8X + [(9, 0)])
@pytest.mark.parametrize("name,bad,good", KERNEL_SETTINGS)
def test_each_kernel_setting_is_refused_on_every_sm8x(monkeypatch, cap, name, bad, good):
    """Each variable alone: refused at register on sm_8x, its name and value in the message; the
    harmless value of the same variable passes; sm_90 refuses nothing (vLLM's own kernels)."""
    spoof(monkeypatch, cap)
    monkeypatch.setattr(vp, "startup_choices", lambda _f=vp.startup_choices: _f(None, toolchain(), "13.0"))
    monkeypatch.setenv(name, bad)
    if cap[0] == 8:
        with pytest.raises(vp.UnauditedServePathError, match="Refused at startup") as err:
            vp.register()
        assert name in str(err.value) and bad in str(err.value)
        assert not vp.STATE.registered and vp.STATE.patched == []
    else:
        vp.register()
        assert vp.STATE.registered and not vp.STATE.routed
    vp.reset()
    monkeypatch.setenv(name, good)
    vp.register()
    assert vp.STATE.registered and vp.STATE.routed == (cap[0] == 8)


@pytest.mark.parametrize("cap,forced,routed", [((8, 0), "auto", True), ((8, 6), "auto", True), ((8, 7), "auto", True),
                                               ((9, 0), "auto", False), ((9, 0), "portable", True),
                                               ((7, 5), "auto", False), (None, "auto", False),
                                               (None, "portable", True)])
def test_routing_follows_capability_and_impl_override(monkeypatch, cap, forced, routed):
    if forced != "auto":
        monkeypatch.setenv("DSV4_AMPERE_IMPL", forced)
    got, why = vp.decide(cap)
    assert got == routed, why
    if forced != "auto":
        assert f"DSV4_AMPERE_IMPL={forced}" in why
    elif cap is not None and cap[0] == 8:
        assert "portable" in why


# ---- the quant guard ----------------------------------------------------------------------------

def _config(pkg, block, expert_dtype="fp4", moe_algo="", method="fp8"):
    import importlib

    cls = importlib.import_module(f"vllm.models.{pkg}.quant_config").DeepseekV4FP8Config
    cfg = cls.from_config({"quant_method": "fp8", "weight_block_size": block, "activation_scheme": "dynamic",
                           "fmt": "e4m3", "scale_fmt": "ue8m0"})
    cfg._resolved_expert_dtype, cfg._resolved_moe_quant_algo = expert_dtype, moe_algo
    if method != "fp8":
        cfg.get_name = lambda: method
    return cfg


AUDITED = {"v4": ("deepseek_v4", [128, 128]), "v41": ("deepseek_v41", [32, 32])}
LAYOUT_FLIPS = {  # one field of the audited layout changed: what the message must name
    "block": (dict(block=[64, 64]), "not a layout the audit covers"),
    "expert_dtype": (dict(expert_dtype="fp8"), "Fp8MoEMethod"),
    "moe_quant_algo": (dict(moe_algo="NVFP4"), "NVFP4"),
    "quant method": (dict(method="modelopt"), "'modelopt'"),
}
KERNEL_FLIPS = {
    "linear_backend": (NS(linear_backend="triton", moe_backend="auto", linear_backend_per_quant=None),
                       "--linear-backend triton"),
    "moe_backend": (NS(linear_backend="auto", moe_backend="flashinfer_cutlass", linear_backend_per_quant=None),
                    "--moe-backend flashinfer_cutlass"),
    "linear_backend_per_quant": (NS(linear_backend="auto", moe_backend="auto",
                                    linear_backend_per_quant={"fp8": "cutlass"}), "--linear-backend-per-quant fp8=cutlass"),
}
KERNEL_OK = NS(linear_backend="marlin", moe_backend="marlin", linear_backend_per_quant={"fp8": "auto"})


@pytest.mark.parametrize("variant", sorted(AUDITED))
@pytest.mark.parametrize("field", sorted(LAYOUT_FLIPS))
def test_quant_guard_refuses_each_layout_field(variant, field):
    pkg, block = AUDITED[variant]
    assert qg.check_quant_config(_config(pkg, block), variant, KERNEL_OK).problem is None  # the control
    kw, words = LAYOUT_FLIPS[field]
    cfg = _config(pkg, kw.get("block", block), kw.get("expert_dtype", "fp4"), kw.get("moe_algo", ""),
                  kw.get("method", "fp8"))
    with pytest.raises(qg.UnauditedServePathError, match="Refused at startup") as err:
        qg.check_quant_config(cfg, variant, KERNEL_OK)
    assert words in str(err.value) and ("V4.1" if variant == "v41" else "V4 ") in str(err.value)


@pytest.mark.parametrize("variant", sorted(AUDITED))
@pytest.mark.parametrize("field", sorted(KERNEL_FLIPS))
def test_quant_guard_refuses_each_backend_setting(variant, field):
    pkg, block = AUDITED[variant]
    kernel, words = KERNEL_FLIPS[field]
    with pytest.raises(qg.UnauditedServePathError, match="Refused at startup") as err:
        qg.check_quant_config(_config(pkg, block), variant, kernel)
    assert words in str(err.value)
    assert qg.check_quant_config(_config(pkg, block), variant, None).problem is None  # no kernel config: vLLM's


@pytest.mark.parametrize("cap", SM8X)
@pytest.mark.parametrize("field", ["moe_backend", "linear_backend_per_quant"])
def test_quant_guard_hook_refuses_backends_on_every_sm8x(monkeypatch, cap, field):
    """Installed by register() on each sm_8x: the first get_quant_method of a model build raises
    for a backend setting, before vLLM's own method runs; with the audited settings it passes
    through to vLLM's method."""
    import importlib

    kernel, words = KERNEL_FLIPS[field]
    spoof(monkeypatch, cap)
    monkeypatch.setattr(vp, "startup_choices", lambda: [])
    monkeypatch.setattr(qg, "_current_kernel_config", lambda: kernel)
    vp.register()
    cfg = _config("deepseek_v4", [128, 128])
    with pytest.raises(qg.UnauditedServePathError, match=words):
        cfg.get_quant_method(NS(), "model.layers.0.ffn.experts")
    monkeypatch.setattr(qg, "_current_kernel_config", lambda: KERNEL_OK)
    cls = importlib.import_module("vllm.models.deepseek_v4.quant_config").DeepseekV4FP8Config
    original = qg._ORIGINALS["vllm.models.deepseek_v4.quant_config"]
    good = _config("deepseek_v4", [128, 128])
    assert cls.__dict__["get_quant_method"] is not original
    assert good.get_quant_method(object(), "lm_head") is original(good, object(), "lm_head")


class _Quark:
    def get_name(self):
        return "quark"


@pytest.mark.parametrize("config,refused", [(None, False), ("fp8", False), (_Quark(), True)])
def test_model_quant_family(config, refused):
    cfg = _config("deepseek_v4", [128, 128]) if config == "fp8" else config
    if refused:
        with pytest.raises(qg.UnauditedServePathError, match="'quark'"):
            qg.check_model_quant(cfg, "v4")
    else:
        qg.check_model_quant(cfg, "v4")


@pytest.mark.parametrize("lora,dtype,words", [
    (None, None, None), (None, "auto", None), (None, "float32", None),
    (NS(max_loras=1), None, "--enable-lora"), (None, "bfloat16", "indexer_logits_dtype='bfloat16'"),
])
def test_serve_settings_each_field(lora, dtype, words):
    config = NS(lora_config=lora, attention_config=NS(indexer_logits_dtype=dtype))
    if words is None:
        qg.check_serve_settings("v41", config)
        return
    with pytest.raises(qg.UnauditedServePathError, match="Refused at startup") as err:
        qg.check_serve_settings("v41", config)
    assert words in str(err.value)
