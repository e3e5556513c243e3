"""Input generators, comparisons and exhaustive checks shared by the tests, the self-test
and benchmarks.

Host syncs are fine here: nothing in this module runs on a decode path. Every random input
comes from a seeded ``torch.Generator`` (``rng(seed)``) on the CPU and is then moved, so a
failure replays with the seed its test prints or fixes.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import reference

HAS_GPU = torch.cuda.is_available()


def rng(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (draw on the CPU, then ``.to(device)``)."""
    return torch.Generator().manual_seed(int(seed))


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel writes (NaN for floats, 0xAB for uint8,
    -1 for other ints) so elements a kernel failed to write show; returns ``t``."""
    return t.fill_(float("nan") if t.is_floating_point() else (0xAB if t.dtype == torch.uint8 else -1))


_SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8"}


def short_id(v) -> str:
    """A readable pytest id for a parameter value (dtypes as bf16 / i32 ..., None as 'none')."""
    if isinstance(v, torch.dtype):
        return _SHORT_DTYPES.get(v, str(v).replace("torch.", ""))
    return "none" if v is None else str(v)


# Attention output tolerances (bf16 out against a float64 reference):
ATTN_OUT_RTOL = 5e-3  # relative Frobenius error over the whole output
ATTN_ROW_RTOL = 1.5e-2  # per row (token, head): max |out - ref| <= this * max |ref row|
# (an emulation of the kernels' bf16 p and bf16 output reaches 5.7e-3 on the GPU tests' cases)
ATTN_ROW_ATOL = 1e-30  # a row of zeros (no valid key) must come back zero
ATTN_LSE_ATOL = 1e-3  # natural-log LSE, absolute, per row


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, atol: float = ATTN_LSE_ATOL, what: str = "lse"):
    """LSE [...rows] on its own: no NaN, the same -inf rows, |lse - ref| <= atol on the rest;
    a failure names the worst row."""
    lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
    assert lse.shape == ref_lse.shape, f"{what}: shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
    assert not torch.isnan(lse).any(), f"{what}: NaN at rows {torch.nonzero(torch.isnan(lse))[:5].tolist()}"
    inf_diff = torch.isinf(lse) != torch.isinf(ref_lse)
    assert not inf_diff.any(), f"{what}: -inf pattern differs at rows {torch.nonzero(inf_diff)[:5].tolist()}"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = torch.where(fin, (lse - ref_lse).abs(), 0.0)
        worst = int(err.argmax())
        assert err.max().item() <= atol, (f"{what}: abs err {err.max().item():.3g} > {atol:g} at row "
                                          f"{list(torch.unravel_index(torch.tensor(worst), err.shape))}")


def assert_attention_close(out: torch.Tensor, lse: Optional[torch.Tensor], ref_out: torch.Tensor,
                           ref_lse: Optional[torch.Tensor], *, rtol: float = ATTN_OUT_RTOL,
                           row_rtol: float = ATTN_ROW_RTOL, row_atol: float = ATTN_ROW_ATOL,
                           lse_atol: float = ATTN_LSE_ATOL, what: str = "out"):
    """Attention output [...rows, D] against a float64 reference, three ways:

    1. relative Frobenius error over the whole tensor <= rtol (or absolute <= 1e-6);
    2. per row (every leading index, e.g. (token, head)): max |out - ref| <= row_rtol *
       max |ref row| + row_atol, so one bad head tile or split cannot hide in a large tensor;
    3. the LSE [...rows] separately (``assert_lse_close``), when given.
    """
    out, ref_out = out.double().cpu(), ref_out.double().cpu()
    assert out.shape == ref_out.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref_out.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in rows {torch.nonzero(torch.isnan(out).any(-1))[:5].tolist()}"
    diff = (out - ref_out).norm().item()
    err = diff / max(ref_out.norm().item(), 1e-30)
    assert err <= rtol or diff <= 1e-6, f"{what}: relative Frobenius err {err:.3g} > {rtol:g}"
    if out.numel():
        row_err = (out - ref_out).abs().amax(-1)
        row_bound = row_rtol * ref_out.abs().amax(-1) + row_atol
        bad = row_err > row_bound
        if bad.any():
            first = torch.nonzero(bad)[0]
            ratio = (row_err / row_bound.clamp_min(1e-300))[bad].max().item()
            raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} rows exceed max|err| <= {row_rtol:g} * "
                                 f"max|ref row|; first at row {first.tolist()} (err {row_err[tuple(first)].item():.3g},"
                                 f" row max {ref_out.abs().amax(-1)[tuple(first)].item():.3g}); worst {ratio:.3g}x")
    if lse is not None:
        assert_lse_close(lse, ref_lse, lse_atol)


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


# Most resident blocks an SM (CUDA's occupancy table): 16 on sm_86 / sm_87 / sm_89, 32 on sm_80 / sm_90.
_MAX_BLOCKS_AN_SM = {(8, 6): 16, (8, 7): 16, (8, 9): 16}


def arch_programs_an_sm(compiled, device: Optional[int] = None) -> int:
    """Programs of a compiled Triton kernel (``CompiledKernel``: its ``n_regs`` a thread,
    ``metadata.num_warps``, ``metadata.shared`` bytes) one SM of ``device`` holds by the arch's
    limits worked out by hand, the independent check of the driver's occupancy calculator
    (dispatch.device.resident_programs): registers (allocated 256 a warp at a time), threads,
    shared memory (1 KiB reserved a block: dispatch.device.blocks_by_smem's rule) and blocks."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    by_regs = props.regs_per_multiprocessor // (-(-compiled.n_regs * 32 // 256) * 256) // warps
    by_threads = props.max_threads_per_multi_processor // (warps * 32)
    by_smem = props.shared_memory_per_multiprocessor // (shared + 1024)
    return min(by_regs, by_threads, by_smem, _MAX_BLOCKS_AN_SM.get((props.major, props.minor), 32))
