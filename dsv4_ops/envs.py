"""Every ``DSV4_AMPERE_*`` environment variable, declared once: name, default, when it is read,
what it means. No other module spells one of these names or reads ``os.environ`` for it; they
call ``get(NAME)`` (the parsed value) or ``raw(NAME)``.

``override(**values)`` sets values for this process only, without touching ``os.environ``
(the warm set traces the launchers under a kernel variant and decode mode this way). Every
cache of a plan or recorded launch keys on ``override_key()``, so a plan made under one
override is never replayed under another.

``python -m dsv4_ops.envs`` prints the Markdown table the README carries (tests/test_envs.py
checks that the two agree).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

PREFIX = "DSV4_AMPERE_"
# Not a knob: the name under which the V3.2 / GLM-5 sparse-MLA backend registers with vLLM.
BACKEND_NAME = "DSV4_AMPERE_MLA_SPARSE"

# The knobs' names (module constants, so callers never spell them).
IMPL = "DSV4_AMPERE_IMPL"
DECODE_KERNEL = "DSV4_AMPERE_DECODE_KERNEL"
DECODE_CONFIG = "DSV4_AMPERE_DECODE_CONFIG"
SMS = "DSV4_AMPERE_SMS"
BATCH_INVARIANT = "DSV4_AMPERE_BATCH_INVARIANT"
V32_FORM = "DSV4_AMPERE_V32_FORM"
HOST_PLAN = "DSV4_AMPERE_HOST_PLAN"
DIRECT_OPS = "DSV4_AMPERE_DIRECT_OPS"
FAST_LAUNCH = "DSV4_AMPERE_FAST_LAUNCH"
DECODE_GRAPHS = "DSV4_AMPERE_DECODE_GRAPHS"
WARMUP = "DSV4_AMPERE_WARMUP"
WARM_SET_CACHE = "DSV4_AMPERE_WARM_SET_CACHE"
DECODE_TABLES = "DSV4_AMPERE_DECODE_TABLES"
DECODE_TABLE_DIR = "DSV4_AMPERE_DECODE_TABLE_DIR"
DECODE_BALANCE = "DSV4_AMPERE_DECODE_BALANCE"

_OFF = ("0", "false", "off")
_ON = ("1", "true", "on")


def _flag_default_on(v: str) -> bool:
    return v.strip().lower() not in _OFF


def _flag_default_off(v: str) -> bool:
    return v.strip().lower() in _ON


def _choice(name: str, choices: Tuple[str, ...], listed: str = "") -> Callable[[str], str]:
    """Parser of a choice (case and surrounding blanks ignored, empty = the first); ``listed``: the
    error's wording when it is not the default one."""
    def parse(v: str) -> str:
        v = v.strip().lower() or choices[0]
        if v not in choices:
            raise ValueError(listed.format(name=name, choices=choices, v=v) if listed
                             else f"{name}: expected one of {', '.join(choices)}, got {v!r}")
        return v
    return parse


def _sms(v: str) -> Optional[int]:
    if not v:
        return None
    if not v.strip().isdigit() or int(v) < 1:
        raise ValueError(f"{SMS}: expected a positive SM count, got {v!r}")
    return int(v)


def _text(v: str) -> str:
    return v


def _dir(v: str) -> Optional[str]:
    return v.strip() or None


def _cache_dir(v: str) -> Optional[str]:
    v = v.strip()
    if v.lower() in _OFF:
        return None
    return v or os.path.join(os.path.expanduser("~"), ".cache", "dsv4_ops", "warm_sets")


@dataclass(frozen=True)
class Knob:
    """One variable. ``when``: 'import' (read once when its module is imported), 'call' (read at
    each call; the plan caches key on its value) or 'startup' (read when vLLM starts)."""

    name: str
    default: str
    values: str
    when: str
    controls: str
    meaning: str
    parse: Callable[[str], object]


# The values of DSV4_AMPERE_DECODE_KERNEL (dispatch.decode.MODES).
DECODE_MODES = ("auto", "tiles", "heads", "v3")

KNOBS: Dict[str, Knob] = {k.name: k for k in (
    Knob(IMPL, "auto", "auto, portable, native", "call", "kernels",
         "Kernel variant. auto: the capability table (sm_80/86/87 portable, sm_89+ native); portable on "
         "an H200 runs exactly the kernels an A100 runs; any value other than auto also routes vLLM to "
         "this library on sm_90+.", _choice(IMPL, ("auto", "portable", "native"), "{name} must be one of {choices}, got {v!r}")),
    Knob(DECODE_KERNEL, "auto", ", ".join(DECODE_MODES), "call", "kernels",
         "DeepSeek-V4 decode kernel. auto and v3: the paged op, planned by dispatch.decode.plan_step "
         "(docs/dispatch.md); tiles / heads: the workspace step with that kernel.", _choice(DECODE_KERNEL, DECODE_MODES)),
    Knob(DECODE_CONFIG, "", "a paged config name (docs/dispatch.md)", "call", "kernels",
         "Force this launch config wherever the decode runs the paged op (benchmarks, tests).",
         _text),
    Knob(DECODE_TABLES, "1", "1, 0", "call", "kernels",
         "0: ignore every per-device decode table (dsv4-ops tune, dsv4_ops/tables/); the cost model plans.",
         _flag_default_on),
    Knob(DECODE_TABLE_DIR, "", "a directory", "call", "kernels",
         "Per-device decode tables to use before the shipped ones (dsv4-ops tune --out writes them; "
         "dsv4_ops.dispatch.tables).", _dir),
    Knob(DECODE_BALANCE, "0", "0, 1", "call", "kernels",
         "1: a split paged decode with lengths spreads the step's key blocks over its partial slots by the "
         "tokens' lengths (csrc_triton.decode.balance: one planning launch a call). Faster on ragged batches, "
         "slower on equal ones (benchmarks/results/decode_balance.md); off under DSV4_AMPERE_BATCH_INVARIANT=1.",
         _flag_default_off),
    Knob(SMS, "", "a positive integer", "call", "kernels",
         "Plan for this many SMs instead of the device's count (a green context or an MPS share).", _sms),
    Knob(BATCH_INVARIANT, "0", "0, 1", "call", "kernels",
         "1: decode plans depend on (H, K) only, so a token's output bits do not depend on its batch "
         "(heads kernel at every T).", _flag_default_off),
    Knob(V32_FORM, "auto", "auto, w64, w128, f16, f16:<config>", "call", "kernels",
         "DeepSeek-V3.2 / GLM-5 decode kernel form (dsv4_ops.dispatch.v32).", _text),
    Knob(HOST_PLAN, "1", "1, 0", "import", "host cost",
         "0: never replay recorded launch plans (every call runs its launcher's Python).", _flag_default_on),
    Knob(DIRECT_OPS, "1", "1, 0", "import", "host cost",
         "0: the decode composite calls its ops through torch.ops instead of their CUDA kernels directly.",
         _flag_default_on),
    Knob(FAST_LAUNCH, "1", "1, 0", "import", "host cost",
         "0: launch Triton kernels through kernel[grid] instead of the cached compiled launcher.",
         _flag_default_on),
    Knob(DECODE_GRAPHS, "0", "0, 1", "call", "vLLM",
         "1: the plugin's eager decode step replays its own per-layer CUDA graphs (mixed batches).",
         lambda v: v.strip() == "1"),
    Knob(WARMUP, "1", "1, 0", "startup", "vLLM",
         "0: skip compiling the warm set in vLLM's JIT warmup (kernels compile at first launch).",
         _flag_default_on),
    Knob(WARM_SET_CACHE, "", "a directory, 0", "startup", "vLLM",
         "Where built warm sets are kept (default ~/.cache/dsv4_ops/warm_sets; 0: no cache).", _cache_dir),
)}

_lock = threading.Lock()
_OVERRIDES: Dict[str, str] = {}
_OVERRIDE_KEY: Tuple = ()


def _knob(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        raise KeyError(f"{name} is not a dsv4_ops environment variable (dsv4_ops.envs.KNOBS)") from None


def raw(name: str) -> str:
    """The variable's text: an override, else the environment, else its default."""
    if _OVERRIDES and name in _OVERRIDES:
        return _OVERRIDES[name]
    value = os.environ.get(name)
    return _knob(name).default if value is None else value


def get(name: str):
    """The variable's parsed value (ValueError naming it on a bad one)."""
    return _knob(name).parse(raw(name))


def is_set(name: str) -> bool:
    """True when the variable is overridden or present in the environment."""
    _knob(name)
    return name in _OVERRIDES or name in os.environ


def override_key() -> Tuple:
    """The overrides in force, as a hashable value (part of every plan cache's key)."""
    return _OVERRIDE_KEY


@contextlib.contextmanager
def override(**values: str) -> Iterator[None]:
    """Set knobs for this process for the block (``override(DSV4_AMPERE_IMPL='portable')``);
    ``os.environ`` is left alone. Values are checked by the knob's parser first."""
    global _OVERRIDE_KEY
    for name, value in values.items():
        _knob(name).parse(str(value))
    with _lock:
        saved = dict(_OVERRIDES)
        _OVERRIDES.update({k: str(v) for k, v in values.items()})
        _OVERRIDE_KEY = tuple(sorted(_OVERRIDES.items()))
    try:
        yield
    finally:
        with _lock:
            _OVERRIDES.clear()
            _OVERRIDES.update(saved)
            _OVERRIDE_KEY = tuple(sorted(_OVERRIDES.items()))


def settings() -> Tuple[Tuple[str, str], ...]:
    """Every knob that is set (environment or override) with its text, sorted (cache keys)."""
    return tuple(sorted((n, raw(n)) for n in KNOBS if is_set(n)))


def markdown_table() -> str:
    """The README's environment table."""
    rows = ["| variable | default | values | read | meaning |", "|---|---|---|---|---|"]
    for k in KNOBS.values():
        default = f"`{k.default}`" if k.default else "unset"
        rows.append(f"| `{k.name}` | {default} | {k.values} | {k.when} | {k.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
