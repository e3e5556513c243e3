"""The e2e's Triton-interpreter patch (interpreter_patch.py), in a subprocess (it changes the
interpreter process-wide): bf16 ``tl.dot`` multiplies the values, fp32 -> bf16 rounds to nearest
even, with the overflow checks dropped the integer kernels compute what they computed with them
(int32 add / sub / mul wrapping, as on a GPU), and device functions called inside a launch (whose
``triton.language`` patching is not repeated) compute their values, the launch restoring the
language after it."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_SCRIPT = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp


@triton.jit
def int_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i)
    b = tl.load(b_ptr + i)
    tl.store(out_ptr + i, a * b + a - b)


@triton.jit
def _mix(a, b):
    return a * 3 + b


@triton.jit
def device_fn_kernel(x_ptr, out_ptr, red_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, _mix(_mix(x, i), x) + tl.cdiv(x, 7))
    # tl.sum / tl.max are device functions of triton.language.standard, whose globals name
    # tl.core only (until the interpreter's rewrite adds its own): they call core builtins
    tl.store(red_ptr, tl.sum(x, axis=0))
    tl.store(red_ptr + 1, tl.max(x, axis=0))


@triton.jit
def dot_cast_kernel(x_ptr, y_ptr, out_ptr, f_ptr, g_ptr, M: tl.constexpr):
    r = tl.arange(0, M)
    x = tl.load(x_ptr + r[:, None] * M + r[None, :])
    y = tl.load(y_ptr + r[:, None] * M + r[None, :])
    tl.store(out_ptr + r[:, None] * M + r[None, :], tl.dot(x, y))
    tl.store(g_ptr + r, tl.load(f_ptr + r).to(tl.bfloat16))


def run_int():
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    a = torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32, generator=g)
    b = torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32, generator=g)
    out = torch.empty_like(a)
    int_kernel[(1,)](a, b, out, N=64)
    return a, b, out


a, b, before = run_int()
assert interp.interpreter_builder.options.sanitize_overflow and not interp.interpreter_builder.options.debug
import interpreter_patch
interpreter_patch.apply()
assert not interp.interpreter_builder.options.sanitize_overflow
assert not interp.InterpreterBuilder().options.sanitize_overflow
_, _, after = run_int()
want = (a.numpy().astype(np.int64) * b.numpy() + a.numpy() - b.numpy())
want = ((want + 2**31) % 2**32 - 2**31).astype(np.int32)
assert torch.equal(before, after), "dropping the discarded overflow checks changed an integer result"
assert np.array_equal(after.numpy(), want), "int32 arithmetic does not wrap as on a GPU"

# device-function calls inside a launch, and the language restored after it
members = {k: v for k, v in vars(tl.core.tensor).items()}
for _ in range(2):
    x = torch.randint(0, 1000, (32,), dtype=torch.int32)
    out, red = torch.empty_like(x), torch.empty(2, dtype=torch.int32)
    device_fn_kernel[(1,)](x, out, red, N=32)
    i = torch.arange(32, dtype=torch.int32)
    assert torch.equal(out, (x * 3 + i) * 3 + x + (x + 6) // 7), (out, x)
    assert red.tolist() == [int(x.sum()), int(x.max())], (red, x)
    assert {k: v for k, v in vars(tl.core.tensor).items()} == members, "the launch left triton.language patched"

g = torch.Generator().manual_seed(int(sys.argv[2]))
M = 16
x = torch.randn(M, M, generator=g).to(torch.bfloat16)
y = torch.randn(M, M, generator=g).to(torch.bfloat16)
f = torch.randn(M, generator=g) * 3
out = torch.empty(M, M, dtype=torch.float32)
gb = torch.empty(M, dtype=torch.bfloat16)
dot_cast_kernel[(1,)](x, y, out, f, gb, M=M)
ref = x.float() @ y.float()
assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max()
assert torch.equal(gb, f.to(torch.bfloat16)), "fp32 -> bf16 is not round-to-nearest-even"
print("OK")
"""


def test_the_interpreter_patch():
    seed = int.from_bytes(os.urandom(4), "little")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, HERE, str(seed)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (seed, proc.stderr[-4000:])
