"""Confine CUDA work to N SMs of the current GPU: a stream the CUDA driver creates inside a green
context (cuda-bindings), wrapped as a torch.cuda.ExternalStream.

torch 2.11's GreenContext.set_context() leaves torch's streams on the primary context, so kernels
still run on every SM; a stream made by ``cuGreenCtxStreamCreate`` runs eager launches (torch's
and Triton's), ``torch.cuda.graph(g, stream=s)`` captures and their replays on the context's SMs
only. The driver hands SMs out in groups (8 on sm_90): 104 and 112 bracket an A100's 108.

    from dsv4_ops.tools.green_ctx import GreenStream
    with GreenStream(104) as g:          # g.sms: SMs granted; DSV4_AMPERE_SMS=g.sms inside
        ... eager calls, torch.cuda.graph(graph, stream=g.stream), graph.replay() ...

Fails loudly (GreenContextError) where it cannot confine: no cuda-bindings, a driver without
green contexts, a grant other than the count asked for, or programs seen running on more SMs
than granted (``smids_used``: every program of a wide probe kernel reads its %smid).
"""

from __future__ import annotations

import torch

from .. import envs


class GreenContextError(RuntimeError):
    """The work cannot be confined to the SMs asked for."""


def _check(result):
    """The value of a cuda.bindings driver call's (CUresult, value...) tuple; raises on an error."""
    from cuda.bindings import driver as cu

    result = result if isinstance(result, tuple) else (result,)
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise GreenContextError(f"CUDA driver call failed: {result[0]!r}")
    return None if len(result) == 1 else (result[1] if len(result) == 2 else result[1:])


def _driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise GreenContextError("cuda-bindings is not installed: no green contexts, the work cannot be "
                                "confined to fewer SMs (pip install cuda-bindings)") from exc
    for name in ("cuDevSmResourceSplitByCount", "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
        if not hasattr(cu, name):
            raise GreenContextError(f"cuda.bindings has no {name}: green contexts need CUDA >= 12.4 bindings")
    return cu


def device_sms(device: int = 0) -> int:
    """SMs of the whole device (its properties, not DSV4_AMPERE_SMS)."""
    from ..dispatch import device as _device

    return _device._device_sms(device)  # the one reader of the property (tests/test_dispatch.py)


def smids_used(stream: torch.cuda.Stream, programs: int = 4096) -> int:
    """Distinct SMs that the ``programs`` programs of a probe kernel ran on, launched on ``stream``."""
    import triton
    import triton.language as tl

    @triton.jit
    def _smid_kernel(out_ptr, n_spin: tl.constexpr):
        pid = tl.program_id(0)
        a = tl.full([32], pid, tl.int32)
        # spin a little so the programs overlap and spread over every SM the stream may use
        acc = tl.full([32], 1.0, tl.float32)
        for _ in range(n_spin):
            acc = acc * 1.0001 + 0.5
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [a], dtype=tl.int32, is_pure=False, pack=1)
        keep = tl.where(acc > 0, smid, -1)  # keeps the spin loop alive
        tl.store(out_ptr + pid + tl.arange(0, 32) * 0, keep, mask=tl.arange(0, 32) == 0)

    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        _smid_kernel[(programs,)](out, 2000, num_warps=1)
    stream.synchronize()
    ids = out.cpu()
    if (ids < 0).any():
        raise GreenContextError("the SM probe kernel left programs unwritten")
    return int(torch.unique(ids).numel())


def green_stream(n_sms: int, device: int = 0):
    """(torch.cuda.ExternalStream, SMs granted, green context handle) of a driver green context of
    ``n_sms`` SMs on ``device``; keep the handle alive while the stream is used. Raises
    GreenContextError where the driver cannot make one, grants another count, or the stream's
    programs run on more SMs than granted."""
    cu = _driver()
    torch.cuda.init()
    total = device_sms(device)
    if not 0 < n_sms <= total:
        raise GreenContextError(f"asked for {n_sms} SMs of a device of {total}")
    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(device))
    res = _check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups = _check(cu.cuDevSmResourceSplitByCount(1, res, 0, n_sms))[0]
    granted = int(groups[0].sm.smCount)
    if granted != n_sms:
        raise GreenContextError(f"asked for {n_sms} SMs, the driver grants {granted} (its SM group size "
                                f"rounds the count): ask for a multiple of the group")
    desc = _check(cu.cuDevResourceGenerateDesc([groups[0]], 1))
    ctx = _check(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    handle = _check(cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    stream = torch.cuda.ExternalStream(int(handle), device=device)
    if granted < total:
        seen = smids_used(stream)
        if seen > granted:
            raise GreenContextError(f"a green context of {granted} SMs ran programs on {seen} SMs: not confined")
    return stream, granted, ctx


class GreenStream:
    """Context manager: a green-context stream of ``n_sms`` SMs made current, with
    DSV4_AMPERE_SMS (dsv4_ops.envs.SMS) overridden to the granted count for this process
    (envs.override) so the library plans for it; the stream waits for the caller's current stream on entry
    (inputs made before are complete); both restored on exit (the stream synchronised first). ``n_sms`` = the device's count: the
    ordinary primary-context stream, DSV4_AMPERE_SMS set all the same."""

    def __init__(self, n_sms: int, device: int = 0):
        self.asked, self.device = n_sms, device
        self.stream, self.sms, self._ctx = None, 0, None

    def __enter__(self) -> "GreenStream":
        total = device_sms(self.device)
        if self.asked == total:
            # a stream of its own: CUDA graphs cannot be captured on the legacy default stream
            self.stream, self.sms = torch.cuda.Stream(self.device), total
        else:
            self.stream, self.sms, self._ctx = green_stream(self.asked, self.device)
        self._override = envs.override(**{envs.SMS: str(self.sms)})
        self._override.__enter__()
        if envs.get(envs.SMS) != self.sms:
            raise GreenContextError(f"{envs.SMS} reads {envs.get(envs.SMS)}, expected {self.sms}")
        # work queued on the caller's stream (its inputs) completes before the new stream runs
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._stream_ctx = torch.cuda.stream(self.stream)
        self._stream_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stream.synchronize()
        self._stream_ctx.__exit__(*exc)
        self._override.__exit__(*exc)
        # the context is left alive: graphs captured on its stream may still be replayed by the caller


def _main(counts):
    """Prints the SMs each count's stream reaches and an SM-bound probe's time on it."""
    import triton.testing

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for n in counts:
        with GreenStream(n) as g:
            ms = triton.testing.do_bench(lambda: x @ x, return_mode="median")
            print(f"{g.sms} SMs: probe reached {smids_used(g.stream)} SMs, 8192^3 bf16 matmul {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    import sys

    _main([int(a) for a in sys.argv[1:]] or [device_sms(0), 112, 104])
