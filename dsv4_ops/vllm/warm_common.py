"""What the warm sets of both model families share (``warm_set``: DeepSeek-V4 / V4.1;
``warm_set_v32``: DeepSeek-V3.2 / GLM-5): the meta tensors of the calls, the routing of
``torch.ops.dsv4_ampere`` to the launchers, the device the launchers answer for, the tracing,
and the set on disk. Imports neither of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, FrozenSet, Iterable, List, Optional, Tuple

from .. import envs, warm_keys

# One value per Triton int class: equal to 1 (a constexpr), a multiple of 16, neither.
DATA_SIZES = (1, 16, 17)


INDEXER_DIM = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def int_class(v: int) -> int:
    """Triton's class of an int argument: 1 (a constexpr), 16 (multiple of 16) or 0."""
    return 1 if v == 1 else (16 if v % 16 == 0 else 0)


_DEVICE = ["meta"]


def _meta(shape, dtype):
    """A tensor of the calls: meta (enumeration), or zeros on a real device (``on_device``:
    zero slots, indices, lengths and positions are valid everywhere, so the calls run)."""
    import torch

    if _DEVICE[0] == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.zeros(shape, dtype=dtype, device=_DEVICE[0])


@contextlib.contextmanager
def on_device(device: str):
    """Run the call functions below on real tensors of ``device`` (GPU tests, benchmarks)."""
    saved = _DEVICE[0]
    _DEVICE[0] = device
    try:
        yield
    finally:
        _DEVICE[0] = saved


def prefill_logits(shapes: Any, M: int, N: int, cols: int, variant: str) -> None:
    """``fp8_fp4_mqa_logits``: q [M, Hi, 128] E4M3, k [N, 128], compressed [M, cols] output."""
    import torch

    from . import indexer as vidx

    Hi = shapes.index_heads
    vidx.fp8_fp4_mqa_logits((_meta((M, Hi, INDEXER_DIM), torch.float8_e4m3fn), None), (
        _meta((N, INDEXER_DIM), torch.float8_e4m3fn), _meta((N, 1), torch.float32)), _meta((M, Hi), torch.float32),
        _meta((M,), torch.int32), _meta((M,), torch.int32), cols)


@dataclasses.dataclass(frozen=True)
class WarmSet:
    """keys: the launch keys; classes: the token counts traced (batch_classes)."""

    shapes: Any
    max_tokens: int
    sms: int
    variant: str
    keys: FrozenSet[warm_keys.LaunchKey]
    classes: Tuple[int, ...]

    def __len__(self) -> int:
        return len(self.keys)


class _LauncherOps:
    """Stands in for ``torch.ops.dsv4_ampere`` while tracing: each op is its registered CUDA
    implementation (the Triton launcher; ``registration.all_ops``), so meta tensors reach the
    launchers (the real op would run its fake) and every branch behind an op is traced."""

    def __init__(self, real):
        from ..registration import all_ops

        self._impl = {op.name: op.cuda for op in all_ops()}
        self._real = real

    def __getattr__(self, name):
        impl = self._impl.get(name)
        if impl is None:
            return getattr(self._real, name)
        return impl


@contextlib.contextmanager
def routed_ops():
    """``torch.ops.dsv4_ampere.<op>`` -> the op's launcher for the block (module doc)."""
    import torch

    real = torch.ops.dsv4_ampere
    torch.ops.dsv4_ampere = _LauncherOps(real)
    try:
        yield
    finally:
        torch.ops.dsv4_ampere = real


# Where the launchers read the device's SM count (tests/test_warm_set.py checks this list
# against every ``multi_processor_count`` in the package, so a new one must be added here).
# Every launcher asks dispatch.device.num_sms (which DSV4_AMPERE_SMS overrides). A meta
# tensor's get_device() is -1 (dispatch.device.NO_DEVICE_SMS then) or its device is not 'cuda'
# (the CPU defaults): while tracing, get_device() of a meta tensor is 0 and these answer for a
# device of ``sms`` SMs.
SM_SOURCES = {
    "dsv4_ops.dispatch.device:num_sms": "every SM count: decode, fused and v3 plans (attention, paged_decode), "
                                        "v32 splits (via get_device()), the decode indexer's tiles a program "
                                        "(only where qc.is_cuda; tiles_per_prog is do_not_specialize and a grid "
                                        "size: no key depends on it), Engram's grid and sparse prefill's rule "
                                        "(engram.default_programs and dispatch.prefill.num_sms_of, patched for "
                                        "meta tensors)",
    "dsv4_ops.dispatch.device:_device_sms": "num_sms's device query (num_sms, patched, no longer calls it)",
}


@contextlib.contextmanager
def device_of(sms: int, variant: str):
    """Launchers called on meta tensors behave as on a CUDA device of ``sms`` SMs running
    ``variant`` (envs.IMPL overridden for the block)."""
    import torch

    from .. import engram
    from ..csrc_triton import engram as engram_kernels
    from ..dispatch import device as dispatch_device
    from ..dispatch import prefill as dispatch_prefill

    patches = [(dispatch_device, "num_sms", lambda device_index: sms),
               (engram, "default_programs", lambda device: sms * engram_kernels.LOOKUP_CONFIG["PROGRAMS_PER_SM"]),
               (dispatch_prefill, "num_sms_of", lambda t: sms)]
    real_get_device = torch.Tensor.get_device

    def get_device(t):
        return 0 if t.device.type == "meta" else real_get_device(t)

    patches.append((torch.Tensor, "get_device", get_device))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        with envs.override(**{envs.IMPL: variant}):
            yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def trace(calls: Iterable[Callable[[], None]], sms: int, variant: str = "portable",
          record: Optional[List[tuple]] = None) -> FrozenSet[warm_keys.LaunchKey]:
    """Launch keys of the calls (each a closure over the plugin's entry points / the ops) on
    meta tensors, for a device of ``sms`` SMs running ``variant``; record: also gets every
    launch's (JITFunction, args, kwargs) (tests)."""
    with device_of(sms, variant), routed_ops(), warm_keys.recording(record) as keys:
        for call in calls:
            call()
    return frozenset(keys)


CACHE_ENV = envs.WARM_SET_CACHE


def default_cache_dir() -> Optional[str]:
    """Where the vLLM warmup keeps built warm sets: $DSV4_AMPERE_WARM_SET_CACHE (0 / off: no
    cache), else ~/.cache/dsv4_ops/warm_sets."""
    return envs.get(CACHE_ENV)


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 of every .py file of the package, its kernels and its op registrations (what the
    set is traced from), with the torch and triton versions."""
    import hashlib
    import os

    import torch
    import triton

    import dsv4_ops as pkg

    from .. import csrc_triton, registration

    h = hashlib.sha256(f"{torch.__version__} {triton.__version__}".encode())
    for root in list(pkg.__path__) + list(csrc_triton.__path__) + list(registration.__path__):
        for dirpath, dirnames, files in sorted(os.walk(root)):
            dirnames.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def cache_key(shapes: Any, max_tokens: int, sms: int, variant: str, mode: str) -> str:
    """The file name of one set: the sources, the arguments and every DSV4_AMPERE_* setting."""
    import hashlib

    env = [(k, v) for k, v in envs.settings() if k != CACHE_ENV]
    text = repr((source_fingerprint(), dataclasses.astuple(shapes), max_tokens, sms, variant, mode, env))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_build(cache_dir: str, shapes: Any, max_tokens: int, sms: int, variant: str,
                 mode: str, build: Callable[[], "WarmSet"]) -> WarmSet:
    """``build()`` (the model's uncached builder), read from ``cache_dir`` when a set of the same
    key was written there (any unreadable file is rebuilt and rewritten, atomically)."""
    import os
    import pickle
    import tempfile

    path = os.path.join(cache_dir, cache_key(shapes, max_tokens, sms, variant, mode) + ".pkl")
    try:
        with open(path, "rb") as f:
            keys, classes = pickle.load(f)
        return WarmSet(shapes, max_tokens, sms, variant, frozenset(keys), tuple(classes))
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError):
        pass
    warm = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump((sorted(warm.keys, key=warm_keys.LaunchKey.label), warm.classes), f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a cache that cannot be written only costs the next start
        pass
    return warm


def serve_limits(vllm_config) -> dict:
    """What every model's shapes read from the serve config besides the model: the cache's block
    size and blocks, and the query rows a request has with speculative tokens (``next_n``)."""
    cache = getattr(vllm_config, "cache_config", None)
    kw = {}
    if getattr(cache, "block_size", None):
        kw["block_size"] = int(cache.block_size)
    if getattr(cache, "num_gpu_blocks", None):
        kw["num_blocks"] = int(cache.num_gpu_blocks)
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "num_speculative_tokens", None):
        kw["next_n"] = (1, 1 + int(spec.num_speculative_tokens))
    return kw

