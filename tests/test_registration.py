"""Registration: every op of ``registration.all_ops()`` defined once, idempotent, with a
schema, a CUDA kernel, a CPU impl and a fake."""

import subprocess
import sys

import pytest
import torch

import dsv4_ops
from dsv4_ops.registration import NAMESPACE, all_ops, define_op, op_exists, op_names

OP_NAMES = op_names()


def test_op_list_is_not_empty_and_names_are_unique():
    assert OP_NAMES, "registration.all_ops() lists no op"
    dup = sorted({n for n in OP_NAMES if OP_NAMES.count(n) > 1})
    assert not dup, f"ops listed twice: {dup}"


def test_register_all_twice_is_harmless():
    before = {op: op_exists(op) for op in OP_NAMES}
    dsv4_ops.register_all()
    dsv4_ops.register_all()
    assert {op: op_exists(op) for op in OP_NAMES} == before
    assert define_op("e4m3_decode", "(Tensor codes) -> Tensor", cuda=None, fake=None) is False


def test_second_import_in_a_fresh_process():
    code = ("import importlib, torch, dsv4_ops; importlib.reload(dsv4_ops); dsv4_ops.register_all(); "
            "print(torch.ops.dsv4_ampere.e4m3_decode(torch.tensor([0x38], dtype=torch.uint8)).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.0"


@pytest.mark.parametrize("op", all_ops(), ids=lambda op: op.name)
def test_every_op_is_registered_with_cuda_cpu_and_meta_kernels(op):
    assert op_exists(op.name), f"{NAMESPACE}::{op.name} is listed in all_ops() but not registered"
    assert op.cpu is not None, f"{op.name}: no CPU implementation (the reference) in its OpDef"
    missing = [key for key in ("CUDA", "CPU", "Meta")
               if not torch._C._dispatch_has_kernel_for_dispatch_key(op.qualname, key)]
    assert not missing, f"{op.qualname}: no kernel for {missing}"
    schema = str(getattr(torch.ops.dsv4_ampere, op.name).default._schema)
    assert schema.startswith(op.qualname + "("), schema
