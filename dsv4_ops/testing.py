"""Input generators and exhaustive checks shared by the tests, the self-test and benchmarks.

Host syncs are fine here: nothing in this module runs on a decode path.
"""

from __future__ import annotations

from typing import Dict

import torch

from . import reference


def all_bf16(device="cpu") -> torch.Tensor:
    """bfloat16 [65536]: every bit pattern."""
    return torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)


def all_fp16(device="cpu") -> torch.Tensor:
    """float16 [65536]: every bit pattern."""
    return torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32, device=device).to(torch.int16).view(torch.float16)


def e4m3_midpoints(device="cpu") -> torch.Tensor:
    """float32 [252]: the midpoints between neighbouring E4M3 magnitudes (0..448), both signs."""
    mags = reference.ref_e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8)).double()
    mid = ((mags[1:] + mags[:-1]) / 2).float()
    return torch.cat([mid, -mid]).to(device)


def next_up_down(x: torch.Tensor) -> torch.Tensor:
    """float32: x, and x one ulp towards +inf and -inf (bit pattern +-1 on the magnitude)."""
    bits = x.view(torch.int32)
    return torch.cat([x, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])


def e4m3_specials(device="cpu") -> torch.Tensor:
    """float32: +-0, +-inf, NaN, +-448, 464 (the saturation midpoint), 480, huge, tiny, subnormals."""
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, -448.0, 464.0, -464.0,
            480.0, -480.0, 449.0, 465.0, 1e30, -1e30, 3.4e38, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
            2.0 ** -6, 2.0 ** -7, 1e-45, -1e-45, 1e-40, 2.0 ** -126]
    x = torch.tensor(vals, dtype=torch.float32)
    return torch.cat([x, next_up_down(x[torch.isfinite(x)])]).to(device)


def random_fp32_bits(n: int, device="cpu", generator=None) -> torch.Tensor:
    """float32 [n]: uniformly random bit patterns (NaNs, infs and subnormals included)."""
    return torch.randint(-(2 ** 31), 2 ** 31 - 1, (n,), dtype=torch.int32, device=device,
                         generator=generator).view(torch.float32)


def torch_saturating_e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's own encode: clamp to +-448 first (torch 2.11 gives NaN past 464 otherwise)."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def exhaustive_fp32_encode(encode, chunk_log2: int = 28, device="cuda") -> Dict[str, int]:
    """Encode all 2**32 float32 bit patterns with ``encode`` and compare with torch's cast.

    Returns counts: mismatches among non-NaN inputs, NaN inputs, and how many of the
    non-NaN mismatches are exact E4M3 midpoints.
    """
    mids = e4m3_midpoints(device)
    counts = {"inputs": 0, "nan_inputs": 0, "mismatches_non_nan": 0, "mismatches_at_midpoints": 0}
    chunk = 1 << chunk_log2
    for start in range(-(2 ** 31), 2 ** 31, chunk):
        x = torch.arange(start, start + chunk, dtype=torch.int64, device=device).to(torch.int32).view(torch.float32)
        got = encode(x)
        want = torch_saturating_e4m3(x)
        nan = torch.isnan(x)
        bad = (got != want) & ~nan
        counts["inputs"] += chunk
        counts["nan_inputs"] += int(nan.sum())
        counts["mismatches_non_nan"] += int(bad.sum())
        if bad.any():
            counts["mismatches_at_midpoints"] += int(torch.isin(x[bad], mids).sum())
        del x, got, want, nan, bad
    return counts


def capture_graph(fn):
    """Warm ``fn`` up on a side stream, then capture one call of it in a CUDA graph.

    Returns (graph, what the captured call returned): replaying the graph rewrites those
    outputs from whatever the captured input buffers hold then.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
