"""The engine run's stand-ins that the model e2e never reaches (CPU, seconds)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import standins  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_rope_insert_is_the_kv_half_of_the_fused_insert(seed):
    """``_C.fused_deepseek_v4_kv_rope_insert`` writes the cache bytes the q+kv insert writes
    (V4.1's decoder-replay KV write relies on it, bit for bit), touches no other slot, and
    skips negative slots."""
    standins.install(cpu=True)
    g = torch.Generator().manual_seed(seed)
    T, nb, bs = 7, 4, 8
    rec = standins.DATA_BYTES + standins.SCALE_BYTES
    kv = torch.randn(T, 512, generator=g).to(torch.bfloat16)
    q = torch.randn(T, 2, 512, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 64, (T,), generator=g)
    cs = torch.randn(64, 64, generator=g)
    # block 0 is vLLM's null block (BlockPool.null_block, never handed to a request): the writer sends
    # skipped rows there, so a valid slot never lies in it
    slots = torch.randperm((nb - 1) * bs, generator=g)[:T] + bs
    slots[3] = -1
    poison = torch.randint(0, 256, (nb, bs * rec), generator=g, dtype=torch.uint8)
    ref = poison.clone()
    torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, ref, slots, pos, cs, 0, 1e-6, bs)
    got = poison.clone().view(nb, bs, rec)
    torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, got, slots, pos, cs, bs, None, False)
    assert torch.equal(got.view(nb, -1), ref)
    assert not torch.equal(ref, poison)   # the writes happened (the comparison can fail)
    # exactly the data records of the non-negative slots changed (page: bs data records, then scales)
    d = standins.DATA_BYTES
    changed = {b * bs + p for b in range(nb) for p in range(bs)
               if not torch.equal(ref[b, p * d:(p + 1) * d], poison[b, p * d:(p + 1) * d])}
    assert changed == {int(x) for x in slots if x >= 0}


def test_tilelang_kernels_module_without_tilelang():
    """Where tilelang cannot be imported (the H200 image), V4's code still imports the TileLang mHC
    kernel objects by name: their warmup registrations are counted and dropped, the first-layer
    broadcast epilogue runs the torch stand-in, any other kernel raises when called, vLLM's
    plain-Python helpers answer as in the real module, and a name the stand-in module lacks fails
    to import as before. A fresh process: the module is swapped."""
    import subprocess

    code = """
import sys
sys.modules["vllm.model_executor.kernels.mhc.tilelang_kernels"] = None   # as if tilelang were absent
import standins
standins.install_mhc()
from vllm.model_executor.kernels.mhc.tilelang_kernels import _MHC_PRE_BIG_FUSE_TILELANG_KERNEL as big, _MHC_POST_TILELANG_KERNEL as post
import vllm.model_executor.kernels.mhc.tilelang as tl
big.register_warmup(None, hidden_size=8); post.register_warmup(hidden_size=8)
assert standins.CALLS["mhc.warmup_dropped._MHC_POST_TILELANG_KERNEL"] == 1
assert big is standins.MHC_STANDINS["_MHC_PRE_BIG_FUSE_TILELANG_KERNEL"]
assert standins.CALLS["mhc.warmup_dropped._MHC_PRE_BIG_FUSE_TILELANG_KERNEL"] == 1
try:
    post(); raise SystemExit("a kernel without a stand-in ran")
except RuntimeError as e:
    assert "without tilelang" in str(e)
try:
    from vllm.model_executor.kernels.mhc.tilelang_kernels import mhc_pre_big_fuse_tilelang
    raise SystemExit("a missing name imported")
except ImportError:
    pass
from vllm.model_executor.kernels.mhc.warmup import MHC_PRE_NORM_KERNEL   # V4.1's: imports the module above
MHC_PRE_NORM_KERNEL.register_warmup(split_mode="fused", max_tokens=64, hidden_size=8)
assert standins.CALLS["mhc.warmup_dropped.MHC_PRE_NORM_KERNEL"] == 1
# V4.1's decoder layer (JIT warmup on) asks the module for the fused GEMM's split-k factors: vLLM's own
# plain-Python helpers, the values the real module gives
from vllm.model_executor.kernels.mhc.tilelang_kernels import mhc_fused_post_pre_splits, require_fused_post_pre_config
got = [mhc_fused_post_pre_splits(h, m) for h, m in SHAPES]
assert got == EXPECTED, (got, EXPECTED)
assert require_fused_post_pre_config(1, 4096, 4) == REQUIRED
import importlib
mod = importlib.import_module("vllm.model_executor.kernels.mhc.tilelang_kernels")
missing = [n for n in NEEDED if not hasattr(mod, n)]
assert not missing, f"vLLM's model / warmup code imports {missing} from the stand-in module"
print("ok")
"""
    real = pytest.importorskip("vllm.model_executor.kernels.mhc.tilelang_kernels")   # tilelang present here
    shapes = [(4096, 4), (7168, 4), (256, 4), (64, 4), (384, 2)]
    expected = [real.mhc_fused_post_pre_splits(h, m) for h, m in shapes]
    assert any(expected) and not all(expected)   # the shapes reach both answers: the comparison can fail
    # every name vLLM's code outside the TileLang wrappers (which install_mhc rebinds) imports from it
    import ast
    import glob

    import vllm
    root = os.path.dirname(vllm.__file__)
    needed = set()
    for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        if f.endswith(os.path.join("kernels", "mhc", "tilelang.py")):
            continue
        src = open(f).read()
        if "mhc.tilelang_kernels import" not in src:
            continue
        needed |= {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)
                   and n.module == real.__name__ for a in n.names}
    assert "mhc_fused_post_pre_splits" in needed   # the scan sees V4.1's model build
    code = (f"NEEDED = {sorted(needed)!r}\nSHAPES = {shapes!r}\nEXPECTED = {expected!r}\n"
            f"REQUIRED = {real.require_fused_post_pre_config(1, 4096, 4)!r}\n") + code
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH", "")]), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_import_only_ops_are_defined_and_refuse_to_run():
    """vLLM's compile-pass modules name these kept C++ ops at import (DSpark's and MTP's draft
    loaders import them even eagerly): each exists after install() and raises when called."""
    standins.install(cpu=True)
    for name in standins.IMPORT_ONLY_OPS:
        op = getattr(torch.ops._C, name).default
        with pytest.raises(RuntimeError, match="import-only stand-in"):
            op(torch.zeros(1))
