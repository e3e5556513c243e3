"""The warm set (dsv4_ops.vllm.warm_set) holds every Triton specialization the dispatch can
produce, for DeepSeek-V4-Flash and V4.1-Flash at TP 1, 2, 4, 8 (CPU: launchers driven with
meta tensors, keys by Triton's own specialization rule, sm_80 AOT compiles); the vLLM JIT
warmup registers it; on a GPU, a sweep of mixed batches after warmup compiles nothing."""

import os
import random
import subprocess
import sys

import pytest
import torch

from dsv4_ops import decode_plan, warm_keys
from dsv4_ops.vllm import warm_set as ws

MAX_TOKENS = 8192
SMS = (108, 132)  # A100, H200
MODELS = {"v4": ws.v4_flash, "v41": ws.v41_flash}


def _sweep_token_counts(shapes, sms, seed):
    """Token counts the sweep traces, chosen without batch_classes: every T up to 96, every
    T next to a change of the decode plan at any key width (scanned here), every 61st T and
    random T."""
    H = shapes.heads_per_rank
    widths = sorted({k + shapes.window for k in shapes.decode_topk_widths()} | set(shapes.prefill_index_widths()))
    picks = set(range(1, 97))
    prev = None
    for T in range(1, MAX_TOKENS + 1):
        cur = tuple(decode_plan.plan(T, H, K, sms, "auto") for K in widths)
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
        # and nothing in the warm set is unreachable by the same calls at its own batch classes
        assert warm.keys == ws.trace(ws.serve_calls(shapes, warm.classes, "portable", sms, "auto"), sms)


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
    alignment; options take Triton's defaults (a launch omitting num_stages == passing 3)."""
    from dsv4_ops.csrc_triton import merge

    fn = merge._merge_splits_kernel
    m = torch.empty(64, dtype=torch.float32, device="meta")
    base = dict(D=512, BLOCK_S=1, BLOCK_D=512, HAS_SINK=False)
    k1 = warm_keys.key_of(fn, (m, m, None, m.to(torch.bfloat16), m, 8, 1, 4096, 512), dict(base, num_warps=4))
    k2 = warm_keys.key_of(fn, (m, m, None, m.to(torch.bfloat16), m, 8, 1, 4096, 512),
                          dict(base, num_warps=4, num_stages=3))
    k3 = warm_keys.key_of(fn, (m, m[1:], None, m.to(torch.bfloat16), m, 16, 32, 4096, 512), dict(base))
    assert k1 == k2
    args1, args3 = {a[0]: a[1:] for a in k1.args}, {a[0]: a[1:] for a in k3.args}
    assert args1["S"] == ("constexpr", 1) and args3["S"] == ("i32", "D")
    assert warm_keys.key_of(fn, (m, m, None, m, m, 8, 2, 4096, 512), dict(base)).args[6] == ("S", "i32", "")
    assert args1["H"] == ("i32", "") and args3["H"] == ("i32", "D")
    assert args1["lse_part_ptr"] == ("*fp32", "D") and args3["lse_part_ptr"] == ("*fp32", "")
    assert args1["out_ptr"] == ("*bf16", "D") and args1["sink_ptr"] == ("constexpr", None)
    rebuilt = warm_keys.warmup_arguments(k3)
    again = warm_keys.key_of(fn, (), rebuilt)
    assert again == k3, "warmup_arguments must reproduce the key it was built from"


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
    s41 = ws.shapes_from_vllm_config(fake_vllm_config("DeepseekV41ForCausalLM", tp=8))
    assert (s41.heads_per_rank, s41.index_heads, s41.engram) == (8, 32, (256, 32))
    other = fake_vllm_config("LlamaForCausalLM")
    assert ws.shapes_from_vllm_config(other) is None


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
    warmup.warmup_with_warm_set(jit_warmup.JitWarmupRegistry.warmup)(registry)
    expected = ws.build(ws.v4_flash(tp=8), 128, sms=108, mode="auto").keys
    assert set(compiled) == expected and len(compiled) == len(expected)

    def boom(keys, threads=1):
        raise RuntimeError("PTXAS error: a deliberately broken kernel")

    monkeypatch.setattr(warm_keys, "compile_many_jit", boom)
    with pytest.raises(RuntimeError, match="deliberately broken"):
        warmup.warmup_with_warm_set(jit_warmup.JitWarmupRegistry.warmup)(jit_warmup.JitWarmupRegistry(cfg))
    monkeypatch.setenv(warmup.WARMUP_ENV, "0")
    warmup.warmup_with_warm_set(jit_warmup.JitWarmupRegistry.warmup)(jit_warmup.JitWarmupRegistry(cfg))


# ---------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_no_compile_after_warmup_on_a_mixed_batch_sweep():
    """Warm the V4-shape set (TP = 8, portable) for batches <= 320 tokens, then run the real
    ops through torch.ops over mixed decode/prefill shapes: Triton's post-compile hook must
    not fire once. Runs in a fresh process (an empty JIT cache)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = dict(os.environ, DSV4_AMPERE_IMPL="portable")
    res = subprocess.run([sys.executable, "-m", "tests._warm_sweep"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "compiles after warmup: 0" in res.stdout, res.stdout[-3000:]
