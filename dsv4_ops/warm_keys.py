"""Triton launch keys: what one launch of a ``@triton.jit`` kernel compiles, recorded without
launching, and compiled ahead of a launch.

A launch compiles one specialization per *launch key*: the kernel, every constexpr by value,
every other argument's Triton type and specialization attribute (a pointer's dtype and its
16-byte alignment; an int's width and, unless the kernel says ``do_not_specialize``, whether
it is 1 (then a constexpr) or a multiple of 16), and the launch options (num_warps,
num_stages, enable_fp_fusion, ...). Triton's JIT keeps one compiled kernel per key in memory
per device; a launch with a new key compiles (or loads from the on-disk cache).

- ``recording()``: while active, launches through ``dsv4_ops._launch.FastKernel`` and
  ``kernel[grid](...)`` record their ``LaunchKey`` instead of running (so launchers can be
  driven with ``meta`` tensors on any machine: nothing is allocated on a GPU, nothing runs).
  The attributes come from Triton's own ``native_specialize_impl`` (what its binder calls).
- ``compile_jit(key)``: compiles one key into the JIT's in-memory cache of the current CUDA
  device (``JITFunction.warmup`` with mock pointers), so the later real launch finds it.
- ``compile_aot(key, arch)``: the same specialization compiled for ``sm_<arch>`` on any
  machine (no GPU; ``triton.compile`` with the key's signature, constexprs and attributes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, Dict, Iterator, List, Set, Tuple

# Launch options and their Triton (CUDA) defaults: a launch that omits one gets the same
# kernel as a launch that passes the default.
OPTION_DEFAULTS = {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": True}

# Values that reproduce an int argument's specialization (type, attribute) at compile time.
_INT_VALUES = {("i32", "D"): 16, ("i32", ""): 17, ("i32", None): 17,
               ("i64", "D"): 2 ** 32, ("i64", ""): 2 ** 32 + 1, ("i64", None): 2 ** 32 + 1,
               ("u64", "D"): 2 ** 63 + 16, ("u64", ""): 2 ** 63 + 17, ("u64", None): 2 ** 63 + 17}


@dataclasses.dataclass(frozen=True)
class LaunchKey:
    """One compiled specialization. kernel: 'module:qualname' of the @triton.jit function;
    args: (name, type, attribute) per parameter in order, type 'constexpr' with the value as
    the attribute for constexprs (and for ints equal to 1, which Triton turns into
    constexprs); options: sorted (name, value) launch options, defaults filled in."""

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
        opts = ",".join(f"{k}={v}" for k, v in self.options)
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
    options = dict(OPTION_DEFAULTS)
    options.update({k: v for k, v in kwargs.items() if k not in names})
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
    return LaunchKey(kernel_id(fn), tuple(spec), tuple(sorted(options.items())))


@contextlib.contextmanager
def recording() -> Iterator[Set[LaunchKey]]:
    """Record the LaunchKey of every launch in the block instead of running it (yields the
    set that fills). Patches ``FastKernel.__call__`` and ``JITFunction.run`` for the
    duration; not thread-safe (a tool for enumeration, never for serving)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from ._launch import FastKernel

    keys: Set[LaunchKey] = set()

    def fast_call(self, grid, args, consts, num_warps=4, num_stages=3):
        keys.add(key_of(self.fn, tuple(args) + tuple(consts), {"num_warps": num_warps, "num_stages": num_stages}))

    def jit_run(self, *args, grid, warmup, **kwargs):
        keys.add(key_of(self, args, kwargs))

    saved = (FastKernel.__call__, JITFunction.run, InterpretedFunction.run)
    FastKernel.__call__, JITFunction.run, InterpretedFunction.run = fast_call, jit_run, jit_run
    try:
        yield keys
    finally:
        FastKernel.__call__, JITFunction.run, InterpretedFunction.run = saved


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


def warmup_arguments(key: LaunchKey) -> Dict[str, Any]:
    """Keyword arguments (parameters and options) whose launch has exactly this key."""
    kwargs: Dict[str, Any] = {}
    for name, ty, attr in key.args:
        if ty == "constexpr":
            kwargs[name] = attr
        elif ty.startswith("*"):
            kwargs[name] = _MockPointer(_torch_dtype(ty[1:]), attr == "D")
        elif ty == "fp32":
            kwargs[name] = 1.0
        elif ty == "u1":
            kwargs[name] = True
        elif (ty, attr) in _INT_VALUES:
            kwargs[name] = _INT_VALUES[(ty, attr)]
        else:
            raise ValueError(f"warm_keys: cannot rebuild argument {name} ({ty}, {attr!r}) of {key.kernel}")
    kwargs.update(dict(key.options))
    return kwargs


def compile_jit(key: LaunchKey) -> None:
    """Compile one key into the in-memory JIT cache of the current CUDA device (no launch).
    Raises whatever Triton raises (a compile error names the kernel)."""
    jit_function(resolve(key.kernel)).warmup(grid=(1,), **warmup_arguments(key))


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
