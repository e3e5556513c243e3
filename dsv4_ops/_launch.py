"""Low-overhead Triton launches for the eager decode path.

``kernel[grid](*args)`` runs Triton's whole JIT call path on every launch: the argument
binder, a string cache key of the specialization and options, the global-value check and
(triton 3.6) a launch-metadata dict for the hook chain. On a slow host that is tens of us a
launch, paid per layer per token in vLLM's eager segments. ``FastKernel`` keeps the compiled
kernel of each specialization after its first (normal) launch and later calls the compiled
kernel's launcher directly:

    compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, enter_hook, exit_hook, *args)

the call that ``JITFunction.run`` itself makes, with the same positional layout in triton 3.6
(``CudaLauncher.__call__(gx, gy, gz, stream, function, *args)`` forwarding to the C
launcher) and 3.8 (``CudaLauncher.__call__(..., function, kernel_metadata, launch_metadata,
launch_enter_hook, launch_exit_hook, *args)``); constexpr arguments are passed and skipped by
the launcher in both.

Correctness of the cache key: Triton specializes a launch on the dtype of each pointer and
its 16-byte alignment, on each integer's type (i32 / i64 / u64), divisibility by 16 and
value 1 (3.6 and 3.8 turn an int equal to 1 into a constexpr); floats are not specialized;
constexprs by value. Our key holds all of these (it is finer than Triton's: launch_key),
the constexpr values themselves (callers pass them apart, as the trailing parameters), the
launch options and the current device, so a key hit always means the kernel Triton would
have picked.

Falls back to the normal launch when: the kernel is not a ``JITFunction`` (the interpreter),
``DSV4_AMPERE_FAST_LAUNCH=0`` was set at import, a launch hook is installed (profilers), or
any step of the direct path fails on a new triton (it then disables itself for the process).
"""

from __future__ import annotations

from threading import get_ident as _get_ident
from typing import Dict, Optional, Sequence

import torch

from . import envs

ENV_VAR = envs.FAST_LAUNCH
ENABLED = envs.get(ENV_VAR)

_INT32_MIN, _INT32_MAX, _INT64_MAX = -(2 ** 31), 2 ** 31 - 1, 2 ** 63 - 1


def arg_key(a) -> object:
    """What of one launch argument a compiled Triton kernel depends on (hashable)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, not (a.data_ptr() & 15))
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (a == 1, not (a & 15), _INT32_MIN <= a <= _INT32_MAX, a <= _INT64_MAX)
    if isinstance(a, float):
        return float
    return a  # constexpr values (hashable)


_TENSOR = torch.Tensor


def launch_key(args: Sequence[object]) -> tuple:
    """arg_key of every argument, flattened, with fast paths for exact ints and tensors (the
    common case: this runs on every launch). Ints: 1 -> 1; otherwise 8 + (multiple of 16)
    + 2 * (fits int32) + 4 * (above int64), so no code equals 1. Tensors: dtype, address % 16."""
    k = []
    ap = k.append
    for a in args:
        c = a.__class__
        if c is int:
            ap(1 if a == 1 else 8 + ((a & 15) == 0) + 2 * (_INT32_MIN <= a <= _INT32_MAX) + 4 * (a > _INT64_MAX))
        elif c is _TENSOR:
            ap(a.dtype)
            ap(a.data_ptr() & 15)
        else:
            ap(arg_key(a))
    return tuple(k)


_RUNTIME_KNOBS = None

TRACE = None
"""(thread ident, list) while dsv4_ops._host_plan records a launcher: every FastKernel call of
that thread appends (kernel, grid, args, consts, num_warps, num_stages, maxnreg) to the list (and
launches as usual)."""


def _hooks_idle() -> bool:
    """True when no Triton launch hook is installed (a profiler installs one)."""
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        _RUNTIME_KNOBS = knobs.runtime
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # an empty HookChain is idle
            return False
    return True


def _is_jit(fn) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(fn, JITFunction)


def disable(reason: str) -> None:
    """Turn the direct path off for this process (warns once)."""
    global ENABLED
    if ENABLED:
        import warnings

        warnings.warn(f"dsv4_ops: fast Triton launch disabled ({reason}); using kernel[grid](...)")
    ENABLED = False


class FastKernel:
    """A ``@triton.jit`` kernel launched through its cached compiled launcher.

    ``FastKernel(kernel)(grid, args, consts, num_warps, num_stages)``: grid a tuple of 1-3
    ints; args the runtime parameters in signature order; consts the values of the trailing
    constexpr parameters, in order (part of the cache key by value). Returns None. ``stats``
    counts direct ("fast") and normal ("slow") launches (tests, benchmarks).
    """

    __slots__ = ("fn", "jit", "cache", "stats", "_checked", "name")

    def __init__(self, fn):
        self.fn = fn
        self.name = getattr(getattr(fn, "fn", fn), "__name__", repr(fn))
        self.jit = _is_jit(fn)  # False under TRITON_INTERPRET (an InterpretedFunction)
        self.cache: Dict[tuple, list] = {}
        self.stats = {"fast": 0, "slow": 0}
        self._checked = False

    def _check_layout(self, n_args: int, n_consts: int) -> None:
        """The constexprs must be exactly the trailing n_consts parameters (keyed by value)."""
        params = getattr(self.fn, "params", None)
        if params is not None:
            const = [i for i, p in enumerate(params) if p.is_constexpr]
            if len(params) != n_args + n_consts or const != list(range(n_args, n_args + n_consts)):
                raise TypeError(f"{getattr(self.fn, '__name__', self.fn)}: launch passes {n_args} runtime "
                                f"arguments and {n_consts} constexprs; the kernel's constexprs are {const} of "
                                f"{len(params)} parameters")
        self._checked = True

    def __call__(self, grid: Sequence[int], args: tuple, consts: tuple, num_warps: int = 4,
                 num_stages: int = 3, maxnreg: Optional[int] = None) -> None:
        if not self._checked:
            self._check_layout(len(args), len(consts))
        if TRACE is not None and TRACE[0] == _get_ident():  # dsv4_ops._host_plan is recording a launcher
            TRACE[1].append((self, grid, args, consts, num_warps, num_stages, maxnreg))
        if maxnreg is not None:  # a register-capped compile: its own cache entries, the cap a launch option
            return self._call_opts(grid, args, consts, num_warps, num_stages, maxnreg)
        if self.jit and ENABLED and _hooks_idle():
            dev = torch._C._cuda_getDevice()
            key = (dev, num_warps, num_stages, consts, launch_key(args))
            hit = self.cache.get(key)
            if hit is not None:
                run, function, packed, verified = hit
                g1 = grid[1] if len(grid) > 1 else 1
                g2 = grid[2] if len(grid) > 2 else 1
                stream = torch._C._cuda_getCurrentRawStream(dev)
                if verified:
                    run(grid[0], g1, g2, stream, function, packed, None, None, None, *args, *consts)
                    self.stats["fast"] += 1
                    return
                try:  # the first direct call of an entry: a TypeError means the API moved
                    run(grid[0], g1, g2, stream, function, packed, None, None, None, *args, *consts)
                    hit[3] = True
                    self.stats["fast"] += 1
                    return
                except TypeError as exc:
                    disable(repr(exc))
            else:
                compiled = self.fn[tuple(grid)](*args, *consts, num_warps=num_warps, num_stages=num_stages)
                self.stats["slow"] += 1
                try:
                    if hasattr(compiled, "result"):  # async compile mode
                        compiled = compiled.result()
                    self.cache[key] = [compiled.run, compiled.function, compiled.packed_metadata, False]
                except AttributeError as exc:
                    disable(repr(exc))
                return
        self.fn[tuple(grid)](*args, *consts, num_warps=num_warps, num_stages=num_stages)
        self.stats["slow"] += 1

    def _call_opts(self, grid, args, consts, num_warps, num_stages, maxnreg) -> None:
        """__call__ with ``maxnreg`` (ptxas register cap): the same hit / miss / verify logic, the
        cap in the key (``(num_stages, maxnreg)`` in the num_stages slot) and in the normal launch."""
        opts = dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
        if self.jit and ENABLED and _hooks_idle():
            dev = torch._C._cuda_getDevice()
            key = (dev, num_warps, (num_stages, maxnreg), consts, launch_key(args))
            hit = self.cache.get(key)
            if hit is not None:
                g1 = grid[1] if len(grid) > 1 else 1
                g2 = grid[2] if len(grid) > 2 else 1
                stream = torch._C._cuda_getCurrentRawStream(dev)
                try:
                    hit[0](grid[0], g1, g2, stream, hit[1], hit[2], None, None, None, *args, *consts)
                    hit[3] = True
                    self.stats["fast"] += 1
                    return
                except TypeError as exc:
                    if hit[3]:
                        raise
                    disable(repr(exc))
            else:
                compiled = self.fn[tuple(grid)](*args, *consts, **opts)
                self.stats["slow"] += 1
                try:
                    if hasattr(compiled, "result"):
                        compiled = compiled.result()
                    self.cache[key] = [compiled.run, compiled.function, compiled.packed_metadata, False]
                except AttributeError as exc:
                    disable(repr(exc))
                return
        self.fn[tuple(grid)](*args, *consts, **opts)
        self.stats["slow"] += 1


def compiled_entry(fk: FastKernel, args: tuple, consts: tuple, num_warps: int, num_stages: int,
                   maxnreg: Optional[int] = None):
    """(run, function, packed_metadata) of the verified direct launch a FastKernel call with these
    arguments would make on the current device, or None (not compiled yet, not verified, the
    direct path off, or not a JITFunction). For callers that replay a launch with the same key."""
    if not (fk.jit and ENABLED):
        return None
    stages = num_stages if maxnreg is None else (num_stages, maxnreg)
    hit = fk.cache.get((torch._C._cuda_getDevice(), num_warps, stages, consts, launch_key(args)))
    if hit is None or not hit[3]:
        return None
    return hit[0], hit[1], hit[2]


def fast(fn) -> FastKernel:
    """The FastKernel of a @triton.jit function (one per function, shared by launchers)."""
    fk = _REGISTRY.get(id(fn))
    if fk is None or fk.fn is not fn:
        fk = _REGISTRY[id(fn)] = FastKernel(fn)
    return fk


_REGISTRY: Dict[int, FastKernel] = {}
