"""Triton launch keys: what one launch of a ``@triton.jit`` kernel compiles, recorded without
launching, and compiled ahead of a launch.

A launch compiles one specialization per *launch key*. Triton's ``JITFunction.run`` (3.6 and
3.8 alike) keys its in-memory cache of one device by ``str(specialization) + str(options)``:
the specialization is, per parameter, ``("constexpr", value)`` or the argument's Triton type
and attribute from ``native_specialize_impl`` (a pointer's dtype and 16-byte alignment; an
int's width and, unless the kernel says ``do_not_specialize``, whether it is 1, then a
constexpr, or a multiple of 16); the options are the launch's keyword arguments that are not
parameters, *as passed and in the order passed* (``num_warps=4`` given and omitted are two
keys, so are ``num_warps, num_stages`` and ``num_stages, num_warps``), plus ``debug`` and
``instrumentation_mode`` that ``run`` adds. A launch with a key not in memory compiles (or
loads from the on-disk cache) and fires ``jit_post_compile_hook``.

- ``recording()``: while active, every ``kernel[grid](...)`` (``JITFunction.run``) records its
  ``LaunchKey`` instead of running; ``dsv4_ops._launch.FastKernel`` is switched to its plain
  path for the duration, so its launches reach ``run`` in their real call form. Launchers
  can so be driven with ``meta`` tensors on any machine (nothing allocated, nothing runs).
- ``compile_jit(key)``: replays the launch through Triton's own ``JITFunction.warmup`` (=
  ``run(..., warmup=True)``): every parameter positionally (mock pointers of the recorded
  dtype and alignment, ints of the recorded class), the options as the launch passed them.
  Triton computes the key itself, so it is the key of the real launch by construction.
- ``triton_key(fn, args, kwargs)``: that key string as Triton's binder computes it, on any
  machine (tests check a replay's key equals the recorded launch's).
- ``compile_aot(key, arch)``: the same specialization compiled for ``sm_<arch>`` on any
  machine (no GPU; ``triton.compile`` with the key's signature, constexprs and attributes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

# Values that reproduce an int argument's specialization (type, attribute) at compile time.
_INT_VALUES = {("i32", "D"): 16, ("i32", ""): 17, ("i32", None): 17,
               ("i64", "D"): 2 ** 32, ("i64", ""): 2 ** 32 + 1, ("i64", None): 2 ** 32 + 1,
               ("u64", "D"): 2 ** 63 + 16, ("u64", ""): 2 ** 63 + 17, ("u64", None): 2 ** 63 + 17}


@dataclasses.dataclass(frozen=True)
class LaunchKey:
    """One compiled specialization. kernel: 'module:qualname' of the @triton.jit function;
    args: (name, type, attribute) per parameter in order, type 'constexpr' with the value as
    the attribute for constexprs (and for ints equal to 1, which Triton turns into
    constexprs); options: the (name, value) launch options the launch passed, in its order
    (part of Triton's key as they are: no defaults filled in, not sorted)."""

    kernel: str
    args: Tuple[Tuple[str, str, Any], ...]
    options: Tuple[Tuple[str, Any], ...]

    def label(self) -> str:
        """Short readable form: kernel name, constexprs and int attributes."""
        parts = []
        for name, ty, attr in self.args:
            if ty == "constexpr":
                parts.append(f"{name}={attr}")
            elif ty[0] in "iu" and attr:
                parts.append(f"{name}:{attr}")
        opts = ",".join(f"{k}={v}" for k, v in self.options) or "-"
        return f"{self.kernel.rsplit(':', 1)[-1]}[{','.join(parts)}]({opts})"


_JIT_OF: Dict[int, Any] = {}


def jit_function(fn):
    """The JITFunction of a kernel object. Under TRITON_INTERPRET=1 the module holds an
    InterpretedFunction; a JITFunction of the same source and decorator options is built
    (it compiles and specializes like the real one; nothing is launched through it)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    jit = _JIT_OF.get(id(fn))
    if jit is None:
        options = {k: v for k, v in getattr(fn, "kwargs", {}).items()
                   if k in ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline",
                            "repr", "launch_metadata")}
        jit = _JIT_OF[id(fn)] = (fn, JITFunction(fn.fn, **options))
    return jit[1]


def kernel_id(fn) -> str:
    """'module:qualname' of a JITFunction."""
    return f"{fn.fn.__module__}:{fn.fn.__qualname__}"


def resolve(kernel: str):
    """The JITFunction a LaunchKey names (imports its module)."""
    module, _, qualname = kernel.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_BACKEND = None


def _backend():
    """A CUDA backend object for Triton's specialization rules (needs no GPU)."""
    global _BACKEND
    if _BACKEND is None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        _BACKEND = make_backend(GPUTarget("cuda", 80, 32))
    return _BACKEND


_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "uint8": "u8",
                 "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "u1",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def _py_specialize(value, specialize: bool, align: bool) -> Tuple[str, Any]:
    """Triton's specialization rule for the argument kinds our launchers pass (used where
    this triton has no ``native_specialize_impl``)."""
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if specialize and value == 1:
            return ("constexpr", 1)
        ty = "i32" if -2 ** 31 <= value < 2 ** 31 else ("u64" if value >= 2 ** 63 else "i64")
        return (ty, ("D" if value % 16 == 0 else "") if specialize else None)
    if isinstance(value, float):
        return ("fp32", None)
    if hasattr(value, "data_ptr"):
        ty = "*" + _TRITON_TYPES[str(value.dtype).replace("torch.", "")]
        return (ty, ("D" if value.data_ptr() % 16 == 0 else "") if align else None)
    raise TypeError(f"warm_keys: no specialization rule for {type(value).__name__}")


def _specialize(value, param) -> Tuple[str, Any]:
    """(type, attribute) of one runtime argument, by Triton's own rule (its
    ``native_specialize_impl``, what the JIT binder calls, where this triton has it)."""
    specialize = not getattr(param, "do_not_specialize", False)
    align = not getattr(param, "do_not_specialize_on_alignment", False)
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:
        return _py_specialize(value, specialize, align)
    return tuple(native_specialize_impl(_backend(), value, bool(getattr(param, "is_const", False)), specialize,
                                        align))


def key_of(fn, args: tuple, kwargs: dict) -> LaunchKey:
    """The LaunchKey of ``fn[grid](*args, **kwargs)`` (kwargs: parameters and launch options)."""
    fn = jit_function(fn)
    names = [p.name for p in fn.params]
    params = {k: v for k, v in kwargs.items() if k in names}
    options = tuple((k, v) for k, v in kwargs.items() if k not in names)
    bound = fn.signature.bind(*args, **params)
    bound.apply_defaults()
    spec = []
    for p in fn.params:
        value = bound.arguments[p.name]
        if p.is_constexpr:
            spec.append((p.name, "constexpr", value))
        else:
            ty, attr = _specialize(value, p)
            spec.append((p.name, ty, value if ty == "constexpr" else attr))
    return LaunchKey(kernel_id(fn), tuple(spec), options)


@contextlib.contextmanager
def recording(calls: Optional[List[tuple]] = None) -> Iterator[Set[LaunchKey]]:
    """Record the LaunchKey of every launch in the block instead of running it (yields the
    set that fills; ``calls``, when given, also gets each launch's (JITFunction, args,
    kwargs) as passed). Patches ``JITFunction.run`` (and the interpreter's) and turns
    ``FastKernel``'s direct path off for the duration, so its launches take its plain
    ``fn[grid](*args, *consts, num_warps=, num_stages=)`` call, the one that compiles for it;
    not thread-safe (a tool for enumeration and startup, never for serving)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from . import _launch

    keys: Set[LaunchKey] = set()

    def jit_run(self, *args, grid, warmup, **kwargs):
        keys.add(key_of(self, args, kwargs))
        if calls is not None:
            calls.append((jit_function(self), args, dict(kwargs)))

    saved = (JITFunction.run, InterpretedFunction.run, _launch.ENABLED)
    JITFunction.run, InterpretedFunction.run, _launch.ENABLED = jit_run, jit_run, False
    try:
        yield keys
    finally:
        JITFunction.run, InterpretedFunction.run, _launch.ENABLED = saved


_BINDERS: Dict[int, Any] = {}


def triton_key(fn, args: tuple, kwargs: dict) -> Optional[str]:
    """The key ``JITFunction.run`` files ``fn[grid](*args, **kwargs)`` under in its in-memory
    cache, computed by Triton's own binder (``create_function_from_signature``) and
    ``compute_cache_key`` for a CUDA sm_80 backend, after the two options ``run`` adds
    (``debug``, ``instrumentation_mode``); needs no GPU. None where this triton lacks those
    functions (the GPU test of the warmup is then the only check)."""
    try:
        from triton import knobs
        from triton.runtime.jit import compute_cache_key, create_function_from_signature
    except ImportError:
        return None
    fn = jit_function(fn)
    binder = _BINDERS.get(id(fn))
    if binder is None:
        binder = _BINDERS[id(fn)] = (fn, create_function_from_signature(fn.signature, fn.params, _backend()))
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    if hasattr(knobs.compilation, "instrumentation_mode"):
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    _, specialization, options = binder[1](*args, **kwargs)
    return compute_cache_key({}, specialization, options)


class _MockPointer:
    """A pointer argument for JITFunction.warmup: dtype plus the alignment of its address."""

    def __init__(self, dtype, aligned: bool):
        self.dtype = dtype
        self._ptr = 0 if aligned else 2

    def data_ptr(self) -> int:
        return self._ptr


def _torch_dtype(ty: str):
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
             "u8": torch.uint8, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
             "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2, "u1": torch.bool}
    if ty not in table:
        raise ValueError(f"warm_keys: no torch dtype for Triton pointer type *{ty}")
    return table[ty]


def _argument(key: LaunchKey, name: str, ty: str, attr) -> Any:
    """A value that specializes as (ty, attr) does."""
    if ty == "constexpr":
        return attr
    if ty.startswith("*"):
        return _MockPointer(_torch_dtype(ty[1:]), attr == "D")
    if ty == "fp32":
        return 1.0
    if ty == "u1":
        return True
    if (ty, attr) in _INT_VALUES:
        return _INT_VALUES[(ty, attr)]
    raise ValueError(f"warm_keys: cannot rebuild argument {name} ({ty}, {attr!r}) of {key.kernel}")


def replay_arguments(key: LaunchKey) -> Tuple[list, Dict[str, Any]]:
    """(positional arguments, options) of a launch with exactly this key: every parameter
    positionally, the options in the launch's order (``fn.warmup(*args, grid=..., **options)``)."""
    return [_argument(key, *a) for a in key.args], dict(key.options)


def warmup_arguments(key: LaunchKey) -> Dict[str, Any]:
    """The same launch as keyword arguments (parameters, then the options in order)."""
    kwargs = {name: _argument(key, name, ty, attr) for name, ty, attr in key.args}
    kwargs.update(key.options)
    return kwargs


def compile_jit(key: LaunchKey) -> None:
    """Compile one key into the in-memory JIT cache of the current CUDA device: the launch
    replayed through ``JITFunction.warmup`` (Triton computes the key itself; nothing runs).
    Raises whatever Triton raises (a compile error names the kernel)."""
    args, options = replay_arguments(key)
    jit_function(resolve(key.kernel)).warmup(*args, grid=(1,), **options)


def compile_many_jit(keys, threads: int = 1) -> None:
    """compile_jit for every key; threads > 1 compiles in a pool through Triton's
    AsyncCompileMode where this triton has it (the pool is joined before returning)."""
    keys = list(keys)
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    if threads <= 1 or mode is None or len(keys) <= 1:
        for key in keys:
            compile_jit(key)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool, mode(pool):
        for key in keys:
            compile_jit(key)


def compile_aot(key: LaunchKey, arch: int = 80):
    """The key's specialization compiled for sm_<arch> on this machine (no GPU needed);
    returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    backend = _backend()
    for i, (name, ty, attr) in enumerate(key.args):
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif attr:
            attrs[(i,)] = backend.parse_attr(attr)
    src = ASTSource(jit_function(resolve(key.kernel)), signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(key.options))


def by_kernel(keys) -> Dict[str, List[LaunchKey]]:
    """Keys grouped by kernel name, each group sorted by label (reports)."""
    out: Dict[str, List[LaunchKey]] = {}
    for k in keys:
        out.setdefault(k.kernel.rsplit(":", 1)[-1], []).append(k)
    return {name: sorted(v, key=LaunchKey.label) for name, v in sorted(out.items())}
