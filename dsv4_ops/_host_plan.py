"""Recorded launch plans: a launcher's Python runs once per input layout, not once per call.

vLLM runs the attention region eagerly for mixed prefill + decode batches, so every layer pays
the host cost of the decode op every step; most of it is Python that gives the same answer
for every call with the same input layout: the argument checks, the plan (kernel form, splits,
config), the launch argument lists. ``planned(launcher)`` wraps a launcher (an op's CUDA
kernel) so that:

1. the first call of a layout key runs the launcher as it is (compiles, fills the FastKernel
   caches);
2. the second call runs it under a recorder: a ``TorchFunctionMode`` that sees every torch call
   the launcher makes, ``dsv4_ops._launch.TRACE``, which sees every FastKernel launch, and a
   counter on Triton's own launch entry points (``kernel[grid](...)``, ``compiled[grid]``, the
   interpreter). The plan is kept only when the launcher did nothing but read tensor metadata
   (shape, dtype, device, strides, dim, data_ptr, get_device, storage_offset), allocate with
   ``torch.empty`` / ``new_empty``, take ``.contiguous()`` / ``.to()`` that returned the tensor
   itself, and launch only through FastKernel direct launches (no ``kernel[grid]`` launch, no
   FastKernel miss) whose tensor arguments are the call's inputs or its own allocations and
   whose integers are no tensor's address (anything else, a copy, a view, an in-place op, a
   torch kernel, a plain Triton launch: the key is marked never to replay and the launcher
   keeps running);
3. later calls with the same key allocate what the recording allocated (same shapes, strides,
   dtypes, device) and make the recorded launches (same kernels, grids, constexprs, scalar
   arguments; tensors substituted by position), through the cached compiled launcher.

The key is everything the launcher's decisions may depend on: for each tensor argument its
class, shape, strides, dtype, device index, address % 16 and storage offset % 16 (which
tensor arguments are the same object, when any are); every other argument by class and value; the
current CUDA device; the in-process overrides (``envs.override_key()``); the values of the
environment variables the recording read (the
variable names are learnt during recordings, read from the raw environ dict, ~0.1 us each).
Every check the launcher makes is a function of the key (it reads no tensor values: launchers
never sync), so a key that passed the checks once passes them every time; a key that failed
raised in its first call and is never recorded. Launch-hook installs (profilers),
``DSV4_AMPERE_FAST_LAUNCH=0`` and ``DSV4_AMPERE_HOST_PLAN=0`` turn replays off (the launcher
runs). Module constants changed at run time (tests) are not in the key: call ``clear()``.

Contract for a wrapped launcher: its Python decisions and launch arguments depend only on the
key above (tests/test_host_cost.py checks the replayed launches against the launcher's own on
random layouts with a mocked launch).
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Dict, List

import torch
from torch.overrides import TorchFunctionMode

from . import _launch, envs

ENV_VAR = envs.HOST_PLAN
ENABLED = envs.get(ENV_VAR)
FAST_REPLAY = True  # generate one replay function per plan when every launch is direct
MAX_KEYS = 1024  # per launcher; the table is cleared when it grows past this
STATS = {"record": 0, "replay": 0, "refused": 0, "kept": 0, "step_plan": 0}  # kept: dsv4_decode._run_kept calls (step_plan: of them, those a DecodeStepPlan ran)

_TENSOR = torch.Tensor
_META = frozenset([
    _TENSOR.shape.__get__, _TENSOR.dtype.__get__, _TENSOR.device.__get__, _TENSOR.ndim.__get__,
    _TENSOR.is_cuda.__get__, _TENSOR.layout.__get__,
    _TENSOR.dim, _TENSOR.size, _TENSOR.stride, _TENSOR.get_device, _TENSOR.data_ptr, _TENSOR.storage_offset,
    _TENSOR.numel, _TENSOR.nelement, _TENSOR.element_size, _TENSOR.is_contiguous, _TENSOR.is_floating_point,
    _TENSOR.__len__, _TENSOR.itemsize.__get__,
    torch.device,  # torch.device(...) of a device the key holds (check_tensor compares devices)
])  # each a function of the key (shape, strides, dtype, device, address); requires_grad is not
_ALLOC = frozenset([torch.empty, _TENSOR.new_empty])
_SAME = frozenset([_TENSOR.contiguous, _TENSOR.to])  # allowed when they return the tensor itself

_ENVIRON = getattr(os.environ, "_data", None)  # CPython's raw environ dict (encoded keys)
_ENV_KEYS: List[object] = []  # encoded names of the variables recordings read, in order learnt


class _EnvLog(dict):
    """A copy of the raw environ dict that logs the keys read (installed during a recording)."""

    def __init__(self, data):
        super().__init__(data)
        self.read = set()

    def __getitem__(self, k):
        self.read.add(k)
        return dict.__getitem__(self, k)


class _Recorder(TorchFunctionMode):
    """Sees every torch call of the recorded launcher; ``ok`` stays True while each is metadata,
    an allocation (kept in ``allocs``) or a no-op contiguous() / to()."""

    def __init__(self):
        super().__init__()
        self.ok = True
        self.allocs: List[torch.Tensor] = []
        self.why = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _META:
            return out
        if func in _ALLOC and type(out) is _TENSOR:
            self.allocs.append(out)
            return out
        if func in _SAME and args and out is args[0]:
            return out
        if self.ok:
            self.ok, self.why = False, f"{getattr(func, '__qualname__', func)}"
        return out


_REFUSED = object()


class _Plan:
    __slots__ = ("allocs", "launches", "ret", "nargs", "fast")

    def __init__(self, allocs, launches, ret, nargs, fast=None):
        self.allocs = allocs  # [(shape, stride, dtype, device, contiguous)]
        self.launches = launches  # [(fk, grid, grid3, build_args, consts, nw, ns, direct | None, used allocs)]
        self.ret = ret  # build(a, m) -> the launcher's return value
        self.nargs = nargs
        self.fast = fast  # the generated replay (every launch direct), or None


_MISALIGNED = object()


def _fast_replay(specs, trace, inputs, allocs, result):
    """One generated function replaying the plan when every launch has a verified direct entry:
    the allocations, one alignment test, the stream, the compiled launchers called with literal
    argument lists; returns _MISALIGNED (nothing launched) when an allocation is not 16-byte
    aligned (the compiled kernels assumed it). None when it cannot be generated."""
    ns = {"_empty": torch.empty, "_empty_strided": torch.empty_strided, "_C": torch._C, "STATS": STATS,
          "_MISALIGNED": _MISALIGNED}

    def src(v, tag):
        if isinstance(v, _TENSOR):
            name = _source(v, inputs, allocs, alloc="m{}")  # the allocations are locals m0, m1, ...
            if name is None:
                raise LookupError
            return name
        ns[tag] = v
        return tag

    lines = ["def replay(a):"]
    for j, (shape, stride, dtype, device, contiguous) in enumerate(specs):
        ns[f"s{j}"], ns[f"st{j}"], ns[f"t{j}"], ns[f"d{j}"] = shape, stride, dtype, device
        lines.append(f"    m{j} = _empty(s{j}, dtype=t{j}, device=d{j})" if contiguous
                     else f"    m{j} = _empty_strided(s{j}, st{j}, dtype=t{j}, device=d{j})")
    used = sorted({j for fk, grid, largs, consts, nw, nst, mr in trace for j, t in enumerate(allocs)
                   if any(t is x for x in largs)})
    if used:
        lines.append("    if (" + " | ".join(f"m{j}.data_ptr()" for j in used) + ") & 15:")
        lines.append("        return _MISALIGNED")
    lines.append("    st = _C._cuda_getCurrentRawStream(_C._cuda_getDevice())")
    try:
        for i, (fk, grid, largs, consts, nw, nst, mr) in enumerate(trace):
            direct = _launch.compiled_entry(fk, tuple(largs), tuple(consts), nw, nst, mr)
            if direct is None:
                return None
            ns[f"r{i}"], ns[f"f{i}"], ns[f"p{i}"], ns[f"k{i}"] = direct[0], direct[1], direct[2], fk.stats
            g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
            vals = [src(v, f"c{i}_{n}") for n, v in enumerate(tuple(largs) + tuple(consts))]
            lines.append(f"    r{i}({g[0]}, {g[1]}, {g[2]}, st, f{i}, p{i}, None, None, None, {', '.join(vals)})")
            lines.append(f"    k{i}['fast'] += 1")
        if isinstance(result, tuple):
            ret = "(" + "".join(src(v, f"ret{n}") + ", " for n, v in enumerate(result)) + ")"
        else:
            ret = src(result, "ret")
    except LookupError:
        return None
    lines.append("    STATS['replay'] += 1")
    lines.append(f"    return {ret}")
    exec("\n".join(lines), ns)  # noqa: S102 - generated from names only; values bound in ns
    return ns["replay"]


_PLAIN = (int, float, bool, str, type(None))


def _key(args) -> tuple:
    """The layout key of a call (module doc). Runs on every call: kept to plain C calls."""
    k = [torch._C._cuda_getDevice(), envs._OVERRIDE_KEY]
    if _ENV_KEYS:
        env = _ENVIRON
        if env is not None:
            get = env.get
            for e in _ENV_KEYS:
                k.append(get(e))
        else:
            k.extend([os.environ.get(e) for e in _ENV_KEYS])
    tensors = []
    ap = k.append
    for a in args:
        c = a.__class__
        if c is _TENSOR or (c not in _PLAIN and isinstance(a, _TENSOR)):
            ap((c, a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15, a.storage_offset() & 15))
            tensors.append(a)
        else:  # the class too: True == 1 == 1.0 as dict keys, and a launcher may tell them apart
            ap(c)
            ap(a)
    if len(tensors) > 1 and len(set(map(id, tensors))) != len(tensors):
        ids = [id(t) for t in tensors]
        ap(tuple(ids.index(i) for i in ids))  # which tensor arguments are the same object
    return tuple(k)


def _source(x, inputs, allocs, alloc: str = "m[{}]"):
    """'a[i]' for a tensor from the call's inputs, ``alloc`` formatted with j for the launcher's
    j-th allocation, or None."""
    for i, t in enumerate(inputs):
        if t is x:
            return f"a[{i}]"
    for j, t in enumerate(allocs):
        if t is x:
            return alloc.format(j)
    return None


def _builder(values, inputs, allocs, what: str):
    """A compiled ``lambda a, m: (...)`` that rebuilds ``values`` with the tensors substituted by
    position and every other value a constant of the recording (or None if a tensor is unknown)."""
    names, parts = {}, []
    for n, v in enumerate(values):
        if isinstance(v, _TENSOR):
            src = _source(v, inputs, allocs)
            if src is None:
                return None
            parts.append(src)
        else:
            names[f"c{n}"] = v
            parts.append(f"c{n}")
    body = "(" + "".join(p + ", " for p in parts) + ")"
    return eval(f"lambda a, m: {body}", names)  # noqa: S307 - names only, values bound in the namespace


def _return_builder(ret, inputs, allocs):
    if isinstance(ret, _TENSOR):
        src = _source(ret, inputs, allocs)
        return None if src is None else eval(f"lambda a, m: {src}")  # noqa: S307
    if isinstance(ret, tuple):
        b = _builder(ret, inputs, allocs, "return")
        return b
    return (lambda a, m, _r=ret: _r) if ret is None or isinstance(ret, (int, float, bool)) else None


def _launch_entry_points():
    """(class, attribute) of every Triton launch entry a launcher could call besides the
    FastKernel direct path: ``kernel[grid](...)`` (JITFunction.run, autotuners and heuristics
    end there), the interpreter's, and ``compiled[grid](...)``."""
    points = []
    try:
        from triton.runtime.jit import JITFunction

        points.append((JITFunction, "run"))
    except ImportError:  # pragma: no cover
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        points.append((InterpretedFunction, "run"))
    except ImportError:  # pragma: no cover
        pass
    try:
        from triton.compiler.compiler import CompiledKernel

        points.append((CompiledKernel, "__getitem__"))
    except ImportError:  # pragma: no cover
        pass
    return points


class _CountPlainLaunches:
    """While active, counts calls of every Triton launch entry point (_launch_entry_points): a
    launcher that launches a kernel other than through a FastKernel hit must not be replayed
    (the replay would skip that launch). Patches the classes for the recording's duration only."""

    def __init__(self):
        self.count = 0
        self._saved = []

    def __enter__(self):
        for cls, name in _launch_entry_points():
            orig = cls.__dict__.get(name)
            if orig is None:
                continue

            def counted(inner_self, *a, _orig=orig, **k):
                self.count += 1
                return _orig(inner_self, *a, **k)

            self._saved.append((cls, name, orig))
            setattr(cls, name, counted)
        return self

    def __exit__(self, *exc):
        for cls, name, orig in reversed(self._saved):
            setattr(cls, name, orig)
        self._saved.clear()
        return False


def _learn(names: List[object]) -> None:
    """Add environment variables to every key. The plans already recorded did not read them (else
    they would be known), so each stays valid under the variables' current values: its key is
    extended with them, not dropped (a dropped key would leave its plan unreachable and recorded
    again)."""
    if not names:
        return
    at = 2 + len(_ENV_KEYS)  # _key: (device, override, env values..., arguments...)
    env = _ENVIRON if _ENVIRON is not None else os.environ
    values = tuple(env.get(e) for e in names)
    _ENV_KEYS.extend(names)
    for t in _TABLES:
        old = list(t.items())
        t.clear()
        t.update((k[:at] + values + k[at:], v) for k, v in old)


def _record(fn, args):
    """Run fn(*args) under the recorder; returns (its result, a _Plan or None)."""
    global _ENVIRON
    rec = _Recorder()
    plain = _CountPlainLaunches()
    slow0 = sum(k.stats["slow"] for k in _launch._REGISTRY.values())
    env_saved, env_log = _ENVIRON, None
    if env_saved is not None:
        env_log = _EnvLog(env_saved)
        os.environ._data = env_log
    trace: list = []
    _launch.TRACE = (threading.get_ident(), trace)
    try:
        with plain, rec:
            result = fn(*args)
    finally:
        _launch.TRACE = None
        if env_log is not None:
            os.environ._data = env_saved
            if dict(env_log) != env_saved:  # a write during the recording: keep it
                env_saved.clear()
                env_saved.update(env_log)
    if env_log is not None:
        _learn([k for k in sorted(env_log.read, key=repr) if k not in _ENV_KEYS])
    if not rec.ok:
        return result, None, rec.why
    if plain.count or sum(k.stats["slow"] for k in _launch._REGISTRY.values()) != slow0:
        return result, None, "a Triton launch other than a FastKernel direct launch"
    inputs = list(args)
    allocs = rec.allocs
    # An address passed as an integer would be replayed as a stale constant (the key holds only
    # address % 16): such a launcher is never replayed. (Storage offsets are not tested this way:
    # small offsets equal legitimate integer arguments; launchers pass tensors, not offsets.)
    seen = {v for t in inputs + allocs if isinstance(t, _TENSOR) for v in (t.data_ptr(),) if v}
    for fk, grid, largs, consts, nw, ns, mr in trace:
        for v in largs:
            if v.__class__ is int and v in seen:
                return result, None, f"{fk.name}: an integer argument equal to a tensor's address or storage offset"
    launches = []
    for fk, grid, largs, consts, nw, ns, mr in trace:
        build = _builder(largs, inputs, allocs, "launch")
        if build is None:
            return result, None, f"{fk.name}: a tensor argument that is neither an input nor an allocation"
        g = tuple(grid) + (1,) * (3 - len(grid))
        direct = _launch.compiled_entry(fk, tuple(largs), tuple(consts), nw, ns, mr)
        used = tuple(sorted({j for j, t in enumerate(allocs) if any(t is x for x in largs)}))
        launches.append((fk, tuple(grid), g, build, tuple(consts), nw, ns, mr, direct, used))
    ret = _return_builder(result, inputs, allocs)
    if ret is None:
        return result, None, "returns a tensor that is neither an input nor an allocation"
    specs = [(tuple(t.shape), t.stride(), t.dtype, t.device, t.is_contiguous()) for t in allocs]
    fast = _fast_replay(specs, trace, inputs, allocs, result) if FAST_REPLAY else None
    return result, _Plan(specs, launches, ret, len(args), fast), ""


def _replay(plan: _Plan, args):
    m = []
    for shape, stride, dtype, device, contiguous in plan.allocs:
        m.append(torch.empty(shape, dtype=dtype, device=device) if contiguous
                 else torch.empty_strided(shape, stride, dtype=dtype, device=device))
    stream = None
    for fk, grid, g, build, consts, nw, ns, mr, direct, used in plan.launches:
        largs = build(args, m)
        if direct is not None:
            for j in used:  # the compiled kernel assumed 16-byte aligned allocations (FastKernel's key)
                if m[j].data_ptr() & 15:
                    direct = None
                    break
        if direct is not None:
            if stream is None:
                stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            direct[0](g[0], g[1], g[2], stream, direct[1], direct[2], None, None, None, *largs, *consts)
            fk.stats["fast"] += 1
        else:
            fk(grid, largs, consts, nw, ns, mr)
    STATS["replay"] += 1
    return plan.ret(args, m)


_TABLES: List[Dict[tuple, object]] = []


def clear() -> None:
    """Forget every recorded plan (after changing module constants a launcher reads)."""
    for t in _TABLES:
        t.clear()


def planned(fn: Callable) -> Callable:
    """``fn`` (a launcher: positional arguments, no host sync) with recorded launch plans."""
    table: Dict[tuple, object] = {}
    _TABLES.append(table)

    def call(*args, **kwargs):
        if kwargs or not (ENABLED and _launch.ENABLED) or _launch.TRACE is not None:
            return fn(*args, **kwargs)  # (inside another recording, or on another thread during one: as is)
        key = _key(args)
        try:
            entry = table.get(key)
        except TypeError:  # an unhashable argument (a list): no plan
            return fn(*args)
        if entry.__class__ is _Plan:
            if _launch._hooks_idle():
                if entry.fast is not None:
                    r = entry.fast(args)
                    if r is not _MISALIGNED:
                        return r
                    return fn(*args)
                return _replay(entry, args)
            return fn(*args)
        if entry is _REFUSED:
            return fn(*args)
        if entry is None:  # first sight: run as is (compiles, warms the launch caches)
            result = fn(*args)
            if len(table) >= MAX_KEYS:
                table.clear()
            table[key] = 1
            return result
        result, plan, why = _record(fn, args)
        table[_key(args) if _ENV_KEYS and key != _key(args) else key] = plan if plan is not None else _REFUSED
        STATS["record" if plan is not None else "refused"] += 1
        return result

    call.__name__ = getattr(fn, "__name__", "planned")
    call.__qualname__ = getattr(fn, "__qualname__", call.__name__)
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn
    call.plans = table
    return call


# ---- memoised environment reads ---------------------------------------------------------------

_MISS = object()


def _read_env_logged(fn, args):
    """fn(*args) with the environ dict swapped for a logging copy: (result, names read)."""
    saved = _ENVIRON
    if saved is None:
        return fn(*args), None
    outer = os.environ._data  # another recording's log when this one is nested in it
    log = _EnvLog(saved)
    os.environ._data = log
    try:
        return fn(*args), log.read
    finally:
        os.environ._data = outer
        if type(outer) is _EnvLog:  # the outer recording read these too (through this call)
            outer.read |= log.read
        if dict(log) != saved:
            saved.clear()
            saved.update(log)


def env_memo(fn: Callable) -> Callable:
    """``fn`` (a pure function of its hashable arguments and of environment variables) memoised on
    its arguments and the values of the variables it read (learnt by running it with a logging
    environ dict; ~0.1 us a variable per call instead of ~0.6 us for ``os.environ.get``). An
    exception is not memoised (raised again on the next call). Without CPython's raw environ dict
    the function runs on every call."""
    names: List[object] = []
    table: Dict[tuple, object] = {}

    def call(*args):
        env = _ENVIRON
        if env is None:
            return fn(*args)
        get = env.get
        k = (args, envs._OVERRIDE_KEY, tuple([get(n) for n in names]))
        v = table.get(k, _MISS)
        cur = os.environ._data
        if type(cur) is _EnvLog:  # called inside another recording: a hit reads no variable, so
            cur.read.update(names)  # tell it the ones this answer depends on
        if v is _MISS:
            v, read = _read_env_logged(fn, args)
            new = [n for n in sorted(read, key=repr) if n not in names]
            if new:
                names.extend(new)
                table.clear()
                k = (args, envs._OVERRIDE_KEY, tuple([get(n) for n in names]))
            if len(table) >= MAX_KEYS:
                table.clear()
            table[k] = v
        return v

    call.__name__ = getattr(fn, "__name__", "env_memo")
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn
    call.cache_clear = table.clear
    return call


# ---- calling an op's CUDA kernel without the dispatcher hop -----------------------------------

DIRECT_ENV_VAR = envs.DIRECT_OPS
DIRECT = envs.get(DIRECT_ENV_VAR)
DIRECT_CPU = False  # benchmarks/bench_host_cost.py --mock: CPU tensors take the CUDA kernel too
_tf_mode = torch._C._is_torch_function_mode_enabled
_dispatch_stack = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
_profiler = torch.autograd.profiler


def direct_ok(t: torch.Tensor) -> bool:
    """True when calling an op's CUDA kernel directly does what ``torch.ops`` would: ``t`` (the
    op's first tensor argument) is a plain CUDA tensor (no subclass: no FakeTensor, no
    FunctionalTensor), nothing is compiling or tracing, no torch-function or dispatch mode is
    active (FakeTensorMode, make_fx, functionalization), no functorch transform (vmap, grad), no
    profiler (it records the op's name); ``DSV4_AMPERE_DIRECT_OPS=0`` turns it off."""
    return (DIRECT and not _is_compiling() and not _tf_mode() and not _dispatch_stack() and t.__class__ is _TENSOR
            and (t.is_cuda or DIRECT_CPU) and not _functorch_active() and not _profiler._is_profiler_enabled)


# Called as observer(name, args, out) after every direct call (``dsv4_decode._direct_op``;
# tests/e2e/counters.py counts the ops vLLM's forward reached through this path, which torch.ops
# never sees); empty in serving.
DIRECT_OBSERVERS: List[Callable] = []
