"""The warm set (dsv4_ops.vllm.warm_set) holds every Triton specialization the dispatch can
produce, for DeepSeek-V4-Flash and V4.1-Flash at TP 1, 2, 4, 8, and (warm_set_v32) for
DeepSeek-V3.2 / GLM-5 with either cache format (CPU: launchers driven with meta tensors, keys
by Triton's own specialization rule, sm_80 AOT compiles); the vLLM JIT warmup registers it; on
a GPU, a sweep of mixed batches after warmup compiles nothing."""

import functools
import os
import random
import subprocess
import sys

import pytest
import torch

from dsv4_ops import dispatch, warm_keys
from dsv4_ops.vllm import warm_set as ws
from dsv4_ops.vllm import warm_set_v32 as wv

MAX_TOKENS = 8192
SMS = (108, 132)  # A100, H200
MODELS = {"v4": ws.v4_flash, "v41": ws.v41_flash}


def _sweep_token_counts(shapes, sms, seed):
    """Token counts the sweep traces, chosen without batch_classes: every T up to 96, every
    T next to a change of a dispatch choice at any key width (scanned here), every 61st T
    and random T."""
    H = shapes.heads_per_rank
    widths = sorted({k + shapes.window for k in shapes.decode_topk_widths()} | set(shapes.prefill_index_widths()))
    picks = set(range(1, 97))
    prev = None
    for T in range(1, MAX_TOKENS + 1):
        cur = tuple(ws.t_choices(T, H, K, sms, "auto") for K in widths)
        if cur != prev:
            picks.update(t for t in (T - 1, T, T + 1, T + 15, T + 16, T + 17) if 1 <= t <= MAX_TOKENS)
        prev = cur
    picks.update(range(97, MAX_TOKENS + 1, 61))
    rng = random.Random(seed)
    picks.update(rng.randrange(97, MAX_TOKENS + 1) for _ in range(24))
    picks.update((MAX_TOKENS - 1, MAX_TOKENS))
    return sorted(picks)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_dispatched_specialization_is_warm(model, tp):
    shapes = MODELS[model](tp=tp)
    for sms in SMS:
        warm = ws.build(shapes, MAX_TOKENS, sms=sms, mode="auto")
        counts = _sweep_token_counts(shapes, sms, seed=tp * 1000 + sms)
        seen = ws.trace(ws.serve_calls(shapes, counts, "portable", sms, "auto"), sms)
        missing = sorted(k.label() for k in seen - warm.keys)
        assert not missing, f"{shapes.name} TP={tp} sms={sms}: {len(missing)} dispatched, not warm: {missing[:5]}"


@pytest.mark.parametrize("mode", [m for m in dispatch.decode.MODES if m != "auto"] + ["invariant"])
def test_every_decode_mode_is_warm(mode, monkeypatch):
    """The set follows DSV4_AMPERE_DECODE_KERNEL (every mode dispatch.decode has) and
    DSV4_AMPERE_BATCH_INVARIANT (read when it is built, as the launchers read them at each
    call)."""
    if mode == "invariant":
        monkeypatch.setenv(dispatch.workspace.BATCH_INVARIANT_ENV, "1")
    else:
        monkeypatch.setenv(dispatch.decode.ENV_VAR, mode)
    shapes = ws.v41_flash(tp=4)
    warm = ws.build(shapes, 2048, sms=108)
    counts = _sweep_token_counts(shapes, 108, seed=7)
    seen = ws.trace(ws.serve_calls(shapes, [t for t in counts if t <= 2048], "portable", 108), 108)
    assert seen <= warm.keys, sorted(k.label() for k in seen - warm.keys)[:3]
    kernels = {k.kernel.rsplit(":", 1)[-1] for k in warm.keys}
    paged = {"_dsv4_decode_v3_kernel", "_dsv4_decode_v4_kernel"}  # paged_chunk128, paged_f16dot
    step = {"_dsv4_decode_gather_kernel", "_dsv4_decode_indices_kernel"}  # the workspace step's gathers
    if mode == "v3":  # the route is the mode's: the paged op only, no workspace step
        assert kernels >= paged and not kernels & step, sorted(kernels)
    else:
        assert kernels >= step and not kernels & paged, sorted(kernels)
    if mode == "invariant":  # one heads plan for every T: no tiles split kernel on the decode path
        assert "_sparse_mla_split_kernel" not in kernels


def test_c128a_layers_decode_with_their_own_block_size():
    """V4's C128A compressed cache holds block_size // 128 = 2 tokens a block: its decode
    launches (every top-k width, 512 included; whichever kernel the composite picks) carry
    that block size, the C4A ones 64."""
    shapes = ws.v4_flash(tp=8)
    warm = ws.build(shapes, 64, sms=108, mode="auto")
    bs_c = {dict((a[0], a[1:]) for a in k.args)["bs_c"] for k in warm.keys if any(a[0] == "bs_c" for a in k.args)}
    assert {("i32", ""), ("i32", "D")} <= bs_c
    for K1 in (128, 256, 512):
        seen = ws.trace([lambda: ws.decode_step(shapes, 1, K1, "portable", True, "auto", ratio=128)], 108)
        assert seen <= warm.keys
        readers = [dict((a[0], a[1:]) for a in k.args) for k in seen if any(a[0] == "bs_c" for a in k.args)]
        assert readers and all(r["bs_c"] == ("i32", "") for r in readers)


def test_speculative_decode_rows_are_warm():
    """With MTP (2 query rows a request) the decode indexer logits of next_n = 2 are warm too."""
    shapes = ws.v4_flash(tp=8, next_n=(1, 2))
    warm = ws.build(shapes, 512, sms=108, mode="auto")
    seen = ws.trace(ws.serve_calls(shapes, range(1, 513, 3), "portable", 108, "auto"), 108)
    assert seen <= warm.keys
    paged = [k for k in warm.keys if "paged_mqa" in k.kernel]
    assert {dict((a[0], a[1:]) for a in k.args)["next_n"] for k in paged} == {("constexpr", 1), ("i32", "")}
    assert len(ws.build(ws.v4_flash(tp=8), 512, sms=108, mode="auto")) < len(warm)


def test_warm_set_tracks_the_batch_size_limit():
    """A smaller max_num_batched_tokens drops the large-T plans (heads with 1 split at
    T >= 2 * SMs), a larger one never loses a key."""
    shapes = ws.v41_flash(tp=8)
    small = ws.build(shapes, 64, sms=108, mode="auto")
    big = ws.build(shapes, MAX_TOKENS, sms=108, mode="auto")
    assert small.keys < big.keys
    direct = [k for k in big.keys - small.keys if ("DIRECT", "constexpr", True) in k.args]
    assert direct, "the one-split heads kernel (T >= 216 at 8 heads) must be warm only for big batches"


def test_keys_follow_tritons_specialization():
    """Ints equal to 1 become constexprs, multiples of 16 get 'D', pointers their dtype and
    alignment; options are part of the key as passed (Triton's run keys on str(options):
    num_warps=4 given vs omitted, and the order of the options, are distinct keys)."""
    from dsv4_ops.csrc_triton.decode import merge

    fn = merge._merge_splits_kernel
    m = torch.empty(64, dtype=torch.float32, device="meta")
    base = dict(D=512, BLOCK_S=1, BLOCK_D=512, HAS_SINK=False)
    args = (m, m, None, m.to(torch.bfloat16), m, 8, 1, 4096, 512)
    k1 = warm_keys.key_of(fn, args, dict(base, num_warps=4))
    k2 = warm_keys.key_of(fn, args, dict(base, num_warps=4, num_stages=3))
    k2r = warm_keys.key_of(fn, args, dict(base, num_stages=3, num_warps=4))
    k0 = warm_keys.key_of(fn, args, dict(base))
    assert len({k0, k1, k2, k2r}) == 4
    tk = {warm_keys.triton_key(fn, args, dict(base, **opts)) for opts in
          ({}, {"num_warps": 4}, {"num_warps": 4, "num_stages": 3}, {"num_stages": 3, "num_warps": 4})}
    assert len(tk) == 4, "Triton's own key tells these four launches apart too"
    k3 = warm_keys.key_of(fn, (m, m[1:], None, m.to(torch.bfloat16), m, 16, 32, 4096, 512), dict(base))
    args1, args3 = {a[0]: a[1:] for a in k1.args}, {a[0]: a[1:] for a in k3.args}
    assert args1["S"] == ("constexpr", 1) and args3["S"] == ("i32", "D")
    assert warm_keys.key_of(fn, (m, m, None, m, m, 8, 2, 4096, 512), dict(base)).args[6] == ("S", "i32", "")
    assert args1["H"] == ("i32", "") and args3["H"] == ("i32", "D")
    assert args1["lse_part_ptr"] == ("*fp32", "D") and args3["lse_part_ptr"] == ("*fp32", "")
    assert args1["out_ptr"] == ("*bf16", "D") and args1["sink_ptr"] == ("constexpr", None)
    rebuilt = warm_keys.warmup_arguments(k3)
    again = warm_keys.key_of(fn, (), rebuilt)
    assert again == k3, "warmup_arguments must reproduce the key it was built from"


def test_do_not_specialize_counts_take_one_key():
    """A kernel's do_not_specialize ints (data-dependent counts) are one key for 1, 16 and 17."""
    from dsv4_ops.csrc_triton import kv_cache as kk

    fn = warm_keys.jit_function(kk._kv_cache_gather_kernel)
    m8, m16 = torch.empty(64, dtype=torch.uint8, device="meta"), torch.empty(64, dtype=torch.bfloat16, device="meta")
    keys = {warm_keys.key_of(fn, (m8, m8.to(torch.int64), m16, n, 512, 4096, 64, 1 << 16, False, 16), {})
            for n in (1, 16, 17)}
    assert len(keys) == 1 and dict((a[0], a[1:]) for a in next(iter(keys)).args)["n"] == ("i32", None)


def _recorded_calls(shapes, counts, mode="auto"):
    calls = []
    ws.trace(ws.serve_calls(shapes, counts, "portable", 108, mode), 108, record=calls)
    return calls


@pytest.mark.parametrize("model", sorted(MODELS))
def test_replayed_warmup_has_the_launchs_own_triton_key(model):
    """Every launch the serve path makes (recorded as the launcher passed it: meta tensors,
    its ints, its options) and the warmup's replay of its LaunchKey (mock pointers, class
    values, the options in order) get the same key from Triton's own binder and
    compute_cache_key: the key JITFunction.run files the compiled kernel under. The
    emulation this replaced (options sorted, defaults filled in) gives another key."""
    shapes = MODELS[model](tp=8)
    calls = _recorded_calls(shapes, (1, 5, 16, 64, 300))
    assert len(calls) > 100
    seen = {}
    for fn, args, kwargs in calls:
        key = warm_keys.key_of(fn, args, kwargs)
        real = warm_keys.triton_key(fn, args, kwargs)
        assert real is not None
        assert seen.setdefault(key, real) == real, f"one LaunchKey, two Triton keys: {key.label()}"
        pos, options = warm_keys.replay_arguments(key)
        assert warm_keys.triton_key(fn, tuple(pos), options) == real, key.label()
    fn, args, kwargs = calls[0]
    names = {p.name for p in fn.params}
    old = {k: v for k, v in kwargs.items() if k in names}
    old.update(sorted({"num_warps": 4, "num_stages": 3, "enable_fp_fusion": True,
                       **{k: v for k, v in kwargs.items() if k not in names}}.items()))
    assert warm_keys.triton_key(fn, args, old) != warm_keys.triton_key(fn, args, kwargs)


def test_every_warm_key_rebuilds_to_itself():
    warm = ws.build(ws.v4_flash(tp=8), 512, sms=108, mode="auto")
    for key in warm.keys:
        assert warm_keys.key_of(warm_keys.resolve(key.kernel), (), warm_keys.warmup_arguments(key)) == key, key.label()


def test_warm_keys_compile_for_sm80_with_their_attributes():
    """One key of every kernel of the V4.1 TP=8 warm set compiles for sm_80 with its
    divisibility attributes (in a subprocess: the suite may run under the interpreter)."""
    code = (
        "from dsv4_ops import warm_keys\n"
        "from dsv4_ops.vllm import warm_set as ws\n"
        "w = ws.build(ws.v41_flash(tp=8), 256, sms=108, mode='auto')\n"
        "for name, keys in warm_keys.by_kernel(w.keys).items():\n"
        "    if name.startswith('_sparse_mla') or name.startswith('_mqa'): continue  # the slow ones: test_aot\n"
        "    k = max(keys, key=lambda k: sum(1 for a in k.args if a[2] == 'D'))\n"
        "    c = warm_keys.compile_aot(k, 80)\n"
        "    assert c.metadata.shared <= 163 * 1024, (name, c.metadata.shared)\n"
        "    print('ok', name)\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("ok ") >= 6, res.stdout


def test_every_aot_kernel_is_warm_or_named_off_the_serve_path():
    """Every kernel of the sm_8x AOT table (aot.all_specs: each launcher module lists what it
    can launch) is in the warm set of some model, TP and decode mode, or in
    warm_set.NOT_SERVED with its reason (and then in none): a new kernel that the plugin's
    entry points can reach is warmed by construction, one they cannot fails here."""
    from dsv4_ops import aot

    aot_kernels = {warm_keys.kernel_id(warm_keys.jit_function(s.kernel)).rsplit(":", 1)[-1]
                   for s in aot.all_specs() if s.variant == "portable"}
    warm = set()
    for mode in dispatch.decode.MODES:
        for make in MODELS.values():
            for tp in (1, 8):
                warm |= {k.kernel.rsplit(":", 1)[-1] for k in ws.build(make(tp=tp), 512, sms=108, mode=mode).keys}
    for make in wv.MODELS.values():
        for tp in (1, 8):
            for cache in wv.CACHE_DTYPES:
                warm |= {k.kernel.rsplit(":", 1)[-1] for k in wv.build(make(tp=tp, cache_dtype=cache), 512).keys}
    assert not (warm & set(ws.NOT_SERVED)), "NOT_SERVED lists a kernel the serve path launches"
    missing = sorted(aot_kernels - warm - set(ws.NOT_SERVED) - set(ws.SELECTABLE))
    assert not missing, f"AOT kernels neither warm nor in warm_set.NOT_SERVED / SELECTABLE: {missing}"


def test_the_balanced_split_is_warm_when_its_knob_is_on():
    """SELECTABLE's opt-in balanced decode kernels: off (the default) no warm set holds them; with
    DSV4_AMPERE_DECODE_BALANCE=1 the V4 / V4.1 sets at TP 8 on an A100's 108 SMs do."""
    from dsv4_ops import envs

    def kernels(make):
        return {k.kernel.rsplit(":", 1)[-1] for k in ws.build(make(tp=8), 512, sms=108, mode="auto").keys}

    balanced = {"_balance_plan_kernel", "_merge_balanced_kernel"}
    assert set(ws.SELECTABLE) >= balanced
    for make in MODELS.values():
        assert not (kernels(make) & balanced)
        with envs.override(**{envs.DECODE_BALANCE: "1"}):
            assert kernels(make) >= balanced


@pytest.mark.parametrize("model,tp,cache", [("v32", 8, "fp8_ds_mla"), ("glm5", 1, "auto")])
def test_v32_every_token_count_is_in_its_class(model, tp, cache):
    """DeepSeek-V3.2 / GLM-5: the set traced from the batch classes holds the keys of every token
    count up to the limit, traced one by one (a choice the class signature missed fails here)."""
    shapes = wv.MODELS[model](tp=tp, cache_dtype=cache)
    for sms in SMS:
        warm = wv.build(shapes, 160, sms=sms)
        seen = ws.trace(wv.serve_calls(shapes, range(1, 161), "portable", sms), sms)
        assert seen == warm.keys, sorted(k.label() for k in seen ^ warm.keys)[:3]
        kernels = {k.kernel.rsplit(":", 1)[-1] for k in warm.keys}
        assert {"_v32_kv_insert_kernel", "_indexer_k_insert_kernel", "_e4m3_encode_kernel"} <= kernels, kernels


def test_v32_trace_reaches_the_backend_and_the_writers(monkeypatch):
    """The V3.2 calls are the plugin's: the backend's _forward_mqa_kernel (decode and prefill)
    and v32_model's fused_norm_rope / fused_q replacements, on vLLM's argument shapes."""
    from dsv4_ops.vllm import v32_backend, v32_model

    called = []
    for mod, name in ((v32_backend, "forward_mqa_kernel"), (v32_model, "fused_norm_rope"), (v32_model, "fused_q")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: (called.append(_n), _r(*a, **k))[1])
    shapes = wv.deepseek_v32(tp=8)
    keys = ws.trace(wv.serve_calls(shapes, [5], "portable", 108), 108)
    assert sorted(set(called)) == ["forward_mqa_kernel", "fused_norm_rope", "fused_q"]
    assert called.count("forward_mqa_kernel") == 2 and called.count("fused_q") == 1  # the shared layer: no Q
    assert any("_v32_sparse_mla" in k.kernel for k in keys), sorted(k.label() for k in keys)


def test_v32_shapes_from_vllm_config():
    """V3.2 / GLM-5 configs give V32Shapes (through warm_set.shapes_from_vllm_config, what the
    warmup asks), ``--kv-cache-dtype fp8`` as fp8_ds_mla, bf16 as auto, MTP rows."""
    cfg = fake_vllm_config("DeepseekV32ForCausalLM", tp=8)
    cfg.model_config.hf_config = _Obj(architectures=["DeepseekV32ForCausalLM"], num_attention_heads=128,
                                      index_n_heads=64, index_topk=2048)
    cfg.cache_config = _Obj(block_size=64, num_gpu_blocks=1000, cache_dtype="fp8")
    s = ws.shapes_from_vllm_config(cfg)
    assert isinstance(s, wv.V32Shapes)
    assert (s.heads_per_rank, s.index_heads, s.cache_dtype, s.block_size, s.num_blocks) == (16, 64, "fp8_ds_mla", 64,
                                                                                           1000)
    cfg.model_config.hf_config.architectures = ["GlmMoeDsaForCausalLM"]
    cfg.cache_config.cache_dtype = "bfloat16"
    cfg.speculative_config = _Obj(num_speculative_tokens=1)
    g = ws.shapes_from_vllm_config(cfg)
    assert (g.name, g.cache_dtype, g.next_n) == ("GLM-5", "auto", (1, 2))
    assert ws.build(g, 64, sms=108).keys == wv.build(g, 64, sms=108).keys


def test_sm_count_sources_are_known():
    """Every place the package reads a device's SM count is listed in warm_set.SM_SOURCES
    (the trace answers for the target device there), so a new one fails here."""
    import ast
    import pathlib

    import dsv4_ops

    root = pathlib.Path(dsv4_ops.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if "audit" in path.parts:  # the audit's stand-in device properties, not a reader
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and "multi_processor_count" in ast.unparse(fn):
                mod = "dsv4_ops." + ".".join(path.relative_to(root).with_suffix("").parts)
                found.add(f"{mod}:{fn.name}")
    assert found and found <= set(ws.SM_SOURCES), sorted(found - set(ws.SM_SOURCES))


def test_the_membership_check_catches_a_missing_class():
    """The sweep above fails when the set lacks batch classes' keys: a set traced from the
    classes up to 64 tokens only (no one-split heads plan of T >= 2 * SMs) misses keys the
    sweep needs."""
    shapes = ws.v41_flash(tp=8)
    warm = ws.build(shapes, 1024, sms=108, mode="auto")
    partial = ws.trace(ws.serve_calls(shapes, [c for c in warm.classes if c <= 64], "portable", 108, "auto"), 108)
    assert partial < warm.keys
    counts = [t for t in _sweep_token_counts(shapes, 108, seed=3) if t <= 1024]
    seen = ws.trace(ws.serve_calls(shapes, counts, "portable", 108, "auto"), 108)
    assert seen <= warm.keys and seen - partial


def test_the_trace_reaches_the_plugins_entry_points(monkeypatch):
    """The decode call is vLLM's: the plugin's ampere_decode (its SWA-only layers pass the
    window slots' [:, :0] view as top-k, stride W, not a fresh [T, 0] tensor), and the ops
    run their launchers (a new branch behind an op is traced)."""
    from dsv4_ops.vllm import attention as vattn

    called = []
    real = vattn.ampere_decode
    monkeypatch.setattr(vattn, "ampere_decode", lambda *a, **k: (called.append(a[0].shape), real(*a, **k))[1])
    shapes = ws.v41_flash(tp=8)
    keys = ws.trace([lambda: ws.decode_step(shapes, 3, 0, "portable", False, "auto")], 108)
    assert called == [(3, 8, 512)]
    (paged,) = [k for k in keys if "_dsv4_decode_v3_kernel" in k.kernel]  # auto: the paged op, no workspace
    assert dict((a[0], a[1:]) for a in paged.args)["stride_topk_t"] == ("i32", "D")  # 128, the window


def test_the_set_on_disk_is_the_set_built(tmp_path, monkeypatch):
    """cached_build returns the set build() makes (first a miss that writes it, then a hit
    that reads it), keyed by the arguments and every DSV4_AMPERE_* setting; an unreadable
    file is rebuilt."""
    shapes = ws.v41_flash(tp=8)
    fresh = ws.build(shapes, 256, sms=108, mode="auto")
    first = ws.build(shapes, 256, sms=108, mode="auto", cache_dir=str(tmp_path))
    (path,) = tmp_path.glob("*.pkl")
    second = ws.build(shapes, 256, sms=108, mode="auto", cache_dir=str(tmp_path))
    assert first.keys == second.keys == fresh.keys and second.classes == fresh.classes
    key = ws.cache_key(shapes, 256, 108, "portable", "auto")
    assert path.name == key + ".pkl"
    assert key != ws.cache_key(shapes, 512, 108, "portable", "auto") != ws.cache_key(shapes, 256, 132, "portable",
                                                                                      "auto")
    monkeypatch.setenv(dispatch.workspace.BATCH_INVARIANT_ENV, "1")
    assert ws.cache_key(shapes, 256, 108, "portable", "auto") != key
    monkeypatch.delenv(dispatch.workspace.BATCH_INVARIANT_ENV)
    path.write_bytes(b"not a pickle")
    assert ws.build(shapes, 256, sms=108, mode="auto", cache_dir=str(tmp_path)).keys == fresh.keys
    monkeypatch.setenv(ws.CACHE_ENV, "0")
    assert ws.default_cache_dir() is None


# ---------------------------------------------------------------------------- vLLM wiring

class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def fake_vllm_config(arch="DeepseekV4ForCausalLM", tp=8, max_tokens=256):
    hf = _Obj(architectures=[arch], num_attention_heads=64, index_n_heads=64 if "V41" not in arch else 32,
              index_topk=512, sliding_window=128, compress_rates={"c4a": 4, "c128a": 128})
    return _Obj(model_config=_Obj(hf_config=hf, max_model_len=65536),
                parallel_config=_Obj(tensor_parallel_size=tp),
                scheduler_config=_Obj(max_num_batched_tokens=max_tokens),
                cache_config=_Obj(block_size=256, num_gpu_blocks=4096))


def test_shapes_from_vllm_config():
    s = ws.shapes_from_vllm_config(fake_vllm_config(tp=4))
    assert (s.heads_per_rank, s.index_heads, s.c128a, s.engram) == (16, 64, True, None)
    cfg41 = fake_vllm_config("DeepseekV41ForCausalLM", tp=8)
    cfg41.model_config.hf_config.compress_ratios = [0, 0, 2, 1, 0, 2]
    cfg41.cache_config.block_size = 128
    s41 = ws.shapes_from_vllm_config(cfg41)
    assert (s41.heads_per_rank, s41.index_heads, s41.engram, s41.ratios) == (8, 32, (256, 32), (1, 2))
    assert s41.decode_layer_kinds() == ((0, 1), (512, 1), (512, 2)) and s41.block_size == 128
    assert s.ratios == (4, 128) and s.decode_layer_kinds()[:2] == ((0, 1), (128, 128))
    other = fake_vllm_config("LlamaForCausalLM")
    assert ws.shapes_from_vllm_config(other) is None
    mtp = fake_vllm_config(tp=8)
    mtp.speculative_config = _Obj(num_speculative_tokens=3)
    assert ws.shapes_from_vllm_config(mtp).next_n == (1, 4)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_drafts_widths_are_warm(model):
    """Speculative decoding: DSpark's non-causal draft decode passes window + N rounded up to 64
    window slots (192 at window 128, N = 3) and the target verifies next_n = N + 1 rows a request;
    with the speculative config, the warm set holds every key a scan of draft and verify steps
    dispatches (every layer kind, both window widths, T up to 512); a set built for fewer tokens
    misses some (the scan can fail)."""
    cfg = fake_vllm_config("DeepseekV41ForCausalLM" if model == "v41" else "DeepseekV4ForCausalLM", tp=8)
    cfg.speculative_config = _Obj(num_speculative_tokens=3, method="dspark")
    got = ws.shapes_from_vllm_config(cfg)
    assert (got.next_n, got.draft_windows, got.swa_widths()) == ((1, 4), (192,), (128, 192))
    cfg.speculative_config = _Obj(num_speculative_tokens=1, method="mtp")  # causal draft: the plain window
    assert ws.shapes_from_vllm_config(cfg).draft_windows == ()
    shapes = MODELS[model](tp=8, next_n=(1, 4), draft_windows=(192,), max_model_len=1 << 20)
    warm = ws.build(shapes, 512, sms=108, mode="auto")
    counts = sorted(set(range(1, 97)) | set(range(97, 513, 13)) | {128, 256, 511, 512})
    calls = [functools.partial(ws.decode_step, shapes, T, K1, "portable", True, "auto", ratio, 192)
             for T in counts for K1, ratio in shapes.decode_layer_kinds()]
    seen = ws.trace(calls + ws.serve_calls(shapes, counts[::5], "portable", 108, "auto"), 108)
    assert seen <= warm.keys, sorted(k.label() for k in seen - warm.keys)[:3]
    # Whether the draft's width adds a specialization depends on the plan (the paged op's configs
    # and splits); the set without it may hold the scan too. The scan itself can fail: a set built
    # for fewer tokens misses keys of the larger steps.
    assert seen - ws.build(shapes, 64, sms=108, mode="auto").keys, "the scan cannot fail"


@pytest.mark.vllm_release  # the rest of this file traces our entry points only: one vLLM release is enough
def test_vllm_jit_warmup_compiles_the_warm_set(monkeypatch):
    """The wrapped JitWarmupRegistry.warmup adds one kernel whose keys are the warm set and
    compiles each through warm_keys.compile_jit (stubbed: no GPU); a compile error aborts."""
    pytest.importorskip("vllm")
    from vllm.model_executor.warmup import jit_warmup

    from dsv4_ops.vllm import warmup

    cfg = fake_vllm_config(tp=8, max_tokens=128)
    monkeypatch.setattr(warmup, "build_warm_set",
                        lambda c: ws.build(ws.shapes_from_vllm_config(c), 128, sms=108, variant="portable"))
    compiled = []
    monkeypatch.setattr(warm_keys, "compile_many_jit", lambda keys, threads=1: compiled.extend(keys))
    registry = jit_warmup.JitWarmupRegistry(cfg)
    warmup.warmup_filtered(jit_warmup.JitWarmupRegistry.warmup)(registry)
    expected = ws.build(ws.v4_flash(tp=8), 128, sms=108, mode="auto").keys
    assert set(compiled) == expected and len(compiled) == len(expected)

    def boom(keys, threads=1):
        raise RuntimeError("PTXAS error: a deliberately broken kernel")

    monkeypatch.setattr(warm_keys, "compile_many_jit", boom)
    with pytest.raises(RuntimeError, match="deliberately broken"):
        warmup.warmup_filtered(jit_warmup.JitWarmupRegistry.warmup)(jit_warmup.JitWarmupRegistry(cfg))
    monkeypatch.setenv(warmup.WARMUP_ENV, "0")
    warmup.warmup_filtered(jit_warmup.JitWarmupRegistry.warmup)(jit_warmup.JitWarmupRegistry(cfg))


# ---------------------------------------------------------------------------- GPU

SWEEP_TOKENS = (1, 2, 5, 16, 33, 63, 64, 77, 100, 150, 200, 263, 264, 300, 320)


def compile_counter():
    """(list that fills with one repr per Triton compile, uninstall()): Triton's post-compile
    hook (triton.knobs, 3.4+)."""
    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        seen.append(kwargs.get("repr", "?"))

    knobs.runtime.jit_post_compile_hook = hook

    def uninstall():
        knobs.runtime.jit_post_compile_hook = previous

    return seen, uninstall


def sweep_calls(shapes, sms: int, dev: str) -> None:
    """A mixed sweep on ``dev`` ('cuda', or 'meta' to record its keys on the CPU): the decode
    step through the plugin's ampere_decode (random slots and lengths) at every SWEEP_TOKENS
    count and layer kind, prefill attention with workspaces of other row counts, writers,
    indexer and Engram at sizes outside DATA_SIZES."""
    from dsv4_ops.vllm import attention as vattn

    H, bs = shapes.heads_per_rank, shapes.swa_block_size
    g = torch.Generator().manual_seed(0)
    mode = dispatch.decode.mode()
    with ws.on_device(dev):
        swa = ws._cache(shapes, bs)
        comps = {r: ws._cache(shapes, max(1, shapes.block_size // r)) for _, r in shapes.decode_layer_kinds()}
        for T in SWEEP_TOKENS:
            q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev)
            out = torch.empty_like(q)
            sink = torch.randn(H, generator=g).to(dev)
            for K1, ratio in shapes.decode_layer_kinds():
                comp_bs = max(1, shapes.block_size // ratio)
                comp = comps[ratio] if K1 else None
                topk = torch.randint(-1, 64 * comp_bs, (T, 1, K1), generator=g).to(torch.int32).to(dev) if K1 else None
                tlen = torch.full((T,), K1, dtype=torch.int32).to(dev) if K1 else None
                win = torch.randint(-1, 64 * bs, (T, 1, shapes.window), generator=g).to(torch.int32).to(dev)
                for wlen in (None, torch.full((T,), 100, dtype=torch.int32).to(dev)):
                    vattn.ampere_decode(q, out, swa, win, wlen, bs, comp, topk, tlen, comp_bs if K1 else bs, sink,
                                        512 ** -0.5)
            for width in shapes.prefill_index_widths():
                for n_kv in (700, 2048):
                    ws.prefill_attention(shapes, T, width, n_kv, "portable", mode)
            ws.indexer_calls(shapes, T, "portable")
            if shapes.engram is not None:
                ws.engram_calls(shapes, T, sms, "portable")
        ratio = shapes.ratios[-1]
        for n in (1, 33, 48):
            ws.prefill_gather(shapes, n, max(1, shapes.block_size // ratio), "portable")
            ws.cache_inserts(shapes, n, "portable")
            ws.prefill_logits(shapes, n, 100, 3 * n, "portable")


def v32_sweep_calls(shapes, dev: str) -> None:
    """The V3.2 sweep on ``dev``: the backend's attention, the writers and the indexer at token
    counts outside the batch classes, on zero tensors (valid slots and rows everywhere)."""
    with ws.on_device(dev):
        for T in SWEEP_TOKENS:
            for call in wv.serve_calls(shapes, [T], "portable", 0):
                call()


# the served shapes (V4 / V4.1: 4096 blocks, 64K context; V3.2: 64K context, fp8_ds_mla)
SWEEP_MODELS = {"v41": ws.v41_flash, "v4": ws.v4_flash,
                "v32": lambda tp: wv.deepseek_v32(tp=tp, max_model_len=65536)}
SWEEP_MAX_TOKENS = 8192


def test_the_gpu_sweep_is_covered_on_the_cpu():
    """The sweep's own launches (recorded on meta tensors) are all in the set it warms, at
    an H200's 132 SMs and an A100's 108: the GPU test then checks Triton's real keys."""
    for model, make in SWEEP_MODELS.items():
        for sms in SMS:
            shapes = make(tp=8)
            warm = ws.build(shapes, SWEEP_MAX_TOKENS, sms=sms, variant="portable", mode="auto")
            seen = ws.trace([lambda: any_sweep_calls(shapes, sms, "meta")], sms)
            assert seen and seen <= warm.keys, (model, sms, sorted(k.label() for k in seen - warm.keys)[:3])


def any_sweep_calls(shapes, sms: int, dev: str) -> None:
    if isinstance(shapes, wv.V32Shapes):
        v32_sweep_calls(shapes, dev)
    else:
        sweep_calls(shapes, sms, dev)


def gpu_sweep(model: str = "v41", tp: int = 8, max_tokens: int = SWEEP_MAX_TOKENS, threads: int = 4) -> dict:
    """Warm the model's set (portable, the served shapes) for batches <= max_tokens the way
    vLLM's warmup does (warm_keys.compile_many_jit with vLLM's default 4 threads: each key
    replayed through JITFunction.warmup), then run the mixed sweep on real CUDA tensors,
    counting Triton's compiles (post-compile hook) in both phases. build_s / warm_s are the
    startup cost of one worker (warm_s cold or warm as TRITON_CACHE_DIR is)."""
    import time

    shapes = SWEEP_MODELS[model](tp=tp)
    sms = dispatch.device.num_sms(torch.cuda.current_device())
    t0 = time.perf_counter()
    warm = ws.build(shapes, max_tokens, sms=sms, variant="portable")
    build_s = time.perf_counter() - t0
    warm_seen, uninstall = compile_counter()
    t0 = time.perf_counter()
    try:
        warm_keys.compile_many_jit(warm.keys, threads=threads)
    finally:
        uninstall()
    warm_s = time.perf_counter() - t0
    seen, uninstall = compile_counter()
    try:
        any_sweep_calls(shapes, sms, "cuda")
        torch.cuda.synchronize()
    finally:
        uninstall()
    return {"model": model, "tp": tp, "max_tokens": max_tokens, "sms": sms, "threads": threads,
            "cache": os.environ.get("DSV4_WARM_TAG", ""),
            "warm_keys": len(warm), "classes": len(warm.classes), "warmup_compiles": len(warm_seen),
            "build_s": round(build_s, 2), "warm_s": round(warm_s, 2), "compiles_after_warmup": len(seen),
            "new": seen[:8]}


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(SWEEP_MODELS))
def test_no_compile_after_warmup_on_a_mixed_batch_sweep(model):
    """After the warm set is compiled, a sweep of mixed decode / prefill / writer / indexer /
    Engram shapes triggers no Triton compile (post-compile hook). A fresh process: its JIT
    cache starts empty, so every kernel the sweep needs must come from the warmup, and the
    warmup compiled each key once. (H200, triton 3.6, 2026-12-01: 0 compiles for both models
    at TP 8, cold and warm cache, and V4.1 at TP 1; benchmarks/results/startup.md.)"""
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--sweep", model], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, DSV4_AMPERE_IMPL="portable"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    import json

    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    if os.environ.get("DSV4_WARM_REPORT"):  # benchmarks/bench_startup.py --assemble reads these lines
        with open(os.environ["DSV4_WARM_REPORT"], "a") as f:
            f.write(json.dumps(out) + "\n")
    assert out["warm_keys"] > 20 and out["warmup_compiles"] == out["warm_keys"]
    assert out["compiles_after_warmup"] == 0, f"compiled after warmup: {out['new']}"


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        import json

        import dsv4_ops  # noqa: F401

        i = sys.argv.index("--sweep")
        tp = int(sys.argv[i + 2]) if len(sys.argv) > i + 2 else 8
        print(json.dumps(gpu_sweep(sys.argv[i + 1], tp)))
