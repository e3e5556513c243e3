"""Test set-up: the Triton interpreter on CPU-only machines, GPU markers, variant fixture.

Without a CUDA GPU, TRITON_INTERPRET=1 is set before any kernel module is imported, so the
kernels whose numerics the interpreter reproduces (fp8 decode, integer bit arithmetic,
fp32/fp16 tl.dot) run on the CPU. AOT checks rerun themselves without it.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dsv4_ops  # noqa: E402,F401  (registers the ops after the interpreter switch)

VARIANTS = ("portable", "native")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; the CPU suite checks references, fakes, opcheck, AOT")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """Each GPU test runs twice: DSV4_AMPERE_IMPL=portable (the sm_80 kernels) and native."""
    if request.param == "native" and HAS_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native fp8 needs sm_89+")
    monkeypatch.setenv("DSV4_AMPERE_IMPL", request.param)
    return request.param


@pytest.fixture
def interpret():
    """Marks a CPU test that runs a kernel through the Triton interpreter."""
    from triton import knobs

    if HAS_GPU:
        return "cuda"
    assert knobs.runtime.interpret, "conftest should have enabled TRITON_INTERPRET"
    return "cpu"


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """Fill with a value no kernel writes (NaN for floats, 0xAB/-1 bytes for ints)."""
    return t.fill_(float("nan") if t.is_floating_point() else (0xAB if t.dtype == torch.uint8 else -1))
