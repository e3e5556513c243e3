"""Test-side fixes to the Triton interpreter (triton 3.6-3.8) so vLLM's bf16 Triton kernels give
the answers a GPU gives when the end-to-end test runs them on the CPU.

Two defects, both measured (`tests/e2e/test_interpreter_patch.py`):
- ``create_dot`` hands bf16 operands to numpy as their raw uint16 bit patterns, so every bf16
  ``tl.dot`` multiplies integers (vLLM's ``fused_moe_kernel`` would return garbage);
- ``cast_impl`` truncates fp32 -> bf16 instead of rounding to nearest even.
Only these two paths change; every other cast (fp8 encode included) stays as the interpreter has
it, which is why no fp8 Triton kernel may be used as a stand-in.

Two costs without an effect are dropped (the kernels compute the same values):
- ``InterpreterOptions`` has ``sanitize_overflow=True`` with ``debug=False``, so every integer
  add / sub / mul is recomputed in int64 and range-checked for a ``device_assert`` that
  ``debug=False`` then discards (``TritonSemantic.device_assert`` returns before emitting it).
  With ``debug`` off, ``sanitize_overflow`` is turned off.
- each call of a ``@triton.jit`` device function inside a launch patches ``triton.language``
  again (``InterpretedFunction.__call__`` -> ``_patch_lang``: the same modules, the same
  members, already patched by the launch, ``GridExecutor.__call__``, until it restores them).
  Inside a launch that second patching is skipped; outside one it runs as before.
"""

from __future__ import annotations

import numpy as np


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    rounded = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, (u >> np.uint32(16)).astype(np.uint16) | np.uint16(0x40), rounded)
    return rounded


def apply() -> None:
    """Patch ``triton.runtime.interpreter.InterpreterBuilder`` in place (idempotent)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder, "_dsv4_e2e_patched", False):
        return
    TensorHandle = interp.TensorHandle
    orig_dot = builder.create_dot
    orig_cast = builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a_data = _bf16_bits_to_f32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
            b_data = _bf16_bits_to_f32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
            return TensorHandle(np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data,
                                d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(_f32_to_bf16_bits_rne(src.data), dst_type.scalar)
        return orig_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder._dsv4_e2e_patched = True
    _no_discarded_overflow_checks(interp)
    _patch_lang_once_a_launch(interp)


def _no_discarded_overflow_checks(interp) -> None:
    """``sanitize_overflow`` off wherever ``debug`` is off (see the module doc): on the options of
    the interpreter's builder (one instance, made at import) and of any later one."""
    import dataclasses

    def quiet(options):
        return options if options.debug else dataclasses.replace(options, sanitize_overflow=False)

    interp.interpreter_builder.options = quiet(interp.interpreter_builder.options)
    orig_init = interp.InterpreterBuilder.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self.options = quiet(self.options)

    interp.InterpreterBuilder.__init__ = __init__


def _patch_lang_once_a_launch(interp) -> None:
    """A launch (``GridExecutor.__call__``) patches the ``triton.language`` modules its kernel's
    globals name (``tl`` and / or ``tl.core``) through ``_patch_lang`` and restores them when the
    grid is done; a device-function call inside the launch whose globals name no other of those
    modules gets an empty scope instead of patching the same members again (one that names
    another, e.g. ``tl.core`` where the kernel had only ``tl``, patches as before). ``_patch_lang``
    is looked up as a module global at each call, so rebinding it reaches both callers."""
    import inspect
    import threading

    import triton.language as tl

    if not all(hasattr(interp, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return   # another interpreter layout: left as it is
    orig_patch_lang = interp._patch_lang
    orig_grid_call = interp.GridExecutor.__call__
    state = threading.local()

    def langs(fn) -> set:   # the modules _patch_lang patches for fn
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in [tl, tl.core]}

    def _patch_lang(fn):
        if getattr(state, "launch_pending", False):     # the launch's own patching: real, and tracked
            state.launch_pending = False
            scope = orig_patch_lang(fn)
            orig_restore = scope.restore

            def restore():
                try:
                    orig_restore()
                finally:
                    state.patched = None

            scope.restore = restore
            state.patched = langs(fn)
            return scope
        patched = getattr(state, "patched", None)
        if patched is not None:                          # inside that launch
            need = langs(fn)
            if need <= patched:
                return interp._LangPatchScope()
            patched |= need
        return orig_patch_lang(fn)

    def grid_call(self, *args, **kwargs):
        state.launch_pending = getattr(state, "patched", None) is None
        try:
            return orig_grid_call(self, *args, **kwargs)
        finally:
            state.launch_pending = False

    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = grid_call
