"""Registration: every op once, idempotent, with a schema, a CUDA kernel, a CPU impl and a fake."""

import subprocess
import sys

import torch

import dsv4_ops
from dsv4_ops import dispatch
from dsv4_ops.registration import define_op, op_exists


def test_register_all_twice_is_harmless():
    before = {op: op_exists(op) for op in dispatch.OPS}
    dsv4_ops.register_all()
    dsv4_ops.register_all()
    assert {op: op_exists(op) for op in dispatch.OPS} == before
    assert define_op("e4m3_decode", "(Tensor codes) -> Tensor", cuda=None, fake=None) is False


def test_second_import_in_a_fresh_process():
    code = ("import importlib, torch, dsv4_ops; importlib.reload(dsv4_ops); dsv4_ops.register_all(); "
            "print(torch.ops.dsv4_ampere.e4m3_decode(torch.tensor([0x38], dtype=torch.uint8)).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.0"


def test_defined_ops_have_cuda_cpu_and_fake_kernels():
    defined = [op for op in dispatch.OPS if op_exists(op)]
    assert {"e4m3_decode", "e4m3_encode"} <= set(defined)
    for op in defined:
        name = f"dsv4_ampere::{op}"
        for key in ("CUDA", "CPU", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (op, key)
