"""Per-device decode tables: the v3 form's (config, splits) measured on a device by ``dsv4-ops tune``.

One JSON file per (device name, SM count, kernel variant), named as vLLM names its fused-MoE configs
(the device in the name, so a directory holds many devices):

    decode,device_name=NVIDIA_H200,sms=104,variant=portable.json
    {"format": "dsv4_ops.decode_table/1", "device_name": "NVIDIA_H200", "sms": 104, "variant": "portable",
     "source": "what measured it (commit, file or tune run)",
     "entries": {"640": {"64,8": {"config": "kh16n32w4", "splits": 3, "us": 39.15}, "16-31,8": {...}}}}

``entries`` maps K (key positions a token) to shape buckets "T,H" (a T range "lo-hi" is allowed; buckets
of one K may not overlap) -> the paged op's v3-form launch config (paged_chunk128.V3_CANDIDATES /
paged_f16dot.V4_CANDIDATES) and its split count; ``us`` (what it measured) is informative. The device
name is ``torch.cuda.get_device_name`` with blanks and slashes as ``_``; the SM count is the plan's
(``device.num_sms``: DSV4_AMPERE_SMS, else the device's), the variant the device's kernel variant.

Where a table is looked for, first hit wins: DSV4_AMPERE_DECODE_TABLE_DIR (a user directory, e.g.
``dsv4-ops tune --out``), then the tables shipped in ``dsv4_ops/tables/``. DSV4_AMPERE_DECODE_TABLES=0
turns every table off. No table, or a shape in no bucket: ``lookup`` is None and dispatch.decode's cost
model plans as it does without tables. A table is checked when it is loaded (first lookup on its device):
an unknown config, a config whose shared memory the device cannot give a block, a split count outside
1..min(MAX_SPLITS, the config's key blocks) or overlapping buckets raise TableError naming the file and
the entry; nothing runs in its place.

Host cost: ``lookup`` is one dict hit per (T, H, K, SMs) after the first (the knobs it reads are part
of the key, so a test that changes one sees the change).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Dict, Optional, Tuple

from .. import envs
from ..csrc_triton.decode.tiles import MAX_SPLITS
from .configs import config_fits, v3_config

FORMAT = "dsv4_ops.decode_table/1"
# The shipped tables: package data (setup.py package_data), beside this package.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tables")
TABLE_DIR_ENV = envs.DECODE_TABLE_DIR
TABLES_ENV = envs.DECODE_TABLES


class TableError(ValueError):
    """A decode table that cannot be used as written (the message names the file and the entry)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One bucket's plan: the v3-form config name and its split count; ``why``: file and bucket."""

    config: str
    splits: int
    why: str


def sanitize_device_name(name: str) -> str:
    """A device name as a file-name part (vLLM's get_device_name_as_file_name): blanks and '/' -> '_'."""
    return re.sub(r"[\s/]+", "_", name.strip())


def file_name(device_name: str, sms: int, variant: str) -> str:
    """The table's file name for a (sanitized) device name, SM count and kernel variant."""
    return f"decode,device_name={sanitize_device_name(device_name)},sms={int(sms)},variant={variant}.json"


def _parse_bucket(key: str, where: str) -> Tuple[int, int, int]:
    m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*,\s*(\d+)\s*", key)
    if not m:
        raise TableError(f"{where}: bucket {key!r} is not 'T,H' or 'Tlo-Thi,H'")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not 1 <= lo <= hi:
        raise TableError(f"{where}: bucket {key!r}: expected 1 <= T_lo <= T_hi")
    return lo, hi, int(m.group(3))


def parse(table: dict, path: str, smem: int) -> Dict[int, Dict[int, list]]:
    """The checked entries of a loaded table: {K: {H: [(T_lo, T_hi, Entry), ...]}}. ``smem``: bytes of
    shared memory a block may opt into on the device that will run it. TableError on anything wrong."""

    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise TableError(f"{path}: not a decode table (expected \"format\": {FORMAT!r})")
    entries = table.get("entries")
    if not isinstance(entries, dict):
        raise TableError(f"{path}: \"entries\" must map K to buckets")
    out: Dict[int, Dict[int, list]] = {}
    for k_text, buckets in entries.items():
        if not str(k_text).isdigit() or not isinstance(buckets, dict):
            raise TableError(f"{path}: entries key {k_text!r} must be K (digits) mapping to buckets")
        K = int(k_text)
        for key, val in buckets.items():
            where = f"{path}: K {K}, bucket {key!r}"
            lo, hi, H = _parse_bucket(key, where)
            if not isinstance(val, dict) or not isinstance(val.get("config"), str) or not isinstance(val.get("splits"), int):
                raise TableError(f"{where}: expected {{\"config\": name, \"splits\": int}}, got {val!r}")
            name, splits = val["config"], val["splits"]
            try:
                cfg = v3_config(name)
            except KeyError:
                raise TableError(f"{where}: no v3-form decode config named {name!r} (paged_chunk128.V3_CANDIDATES, "
                                 f"paged_f16dot.V4_CANDIDATES)") from None
            if not config_fits(name, smem):
                raise TableError(f"{where}: config {name!r} needs more shared memory a block than this device's "
                                 f"{smem} bytes")
            nb = -(-K // cfg["BLOCK_N"])
            if not 1 <= splits <= min(MAX_SPLITS, nb):
                raise TableError(f"{where}: splits {splits} outside 1..{min(MAX_SPLITS, nb)} ({name}: {nb} key "
                                 f"blocks of {cfg['BLOCK_N']})")
            rows = out.setdefault(K, {}).setdefault(H, [])
            for o_lo, o_hi, o in rows:
                if lo <= o_hi and o_lo <= hi:
                    raise TableError(f"{where}: overlaps {o.why.rsplit(' ', 1)[-1]}")
            rows.append((lo, hi, Entry(name, splits, f"{os.path.basename(path)} {K}:{key}")))
    return out


def load(path: str, smem: int) -> Dict[int, Dict[int, list]]:
    """parse() of the JSON file at ``path`` (TableError when it is not valid JSON)."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise TableError(f"{path}: cannot read a decode table: {exc}") from None
    return parse(table, path, smem)


def find(device_name: str, sms: int, variant: str) -> Optional[str]:
    """The path of the table for this device, SM count and variant (the user directory first), or None."""
    name = file_name(device_name, sms, variant)
    user = envs.get(TABLE_DIR_ENV)
    for folder in ((user,) if user else ()) + (SHIPPED_DIR,):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


# (device name, SMs, variant, smem, user dir) -> parsed table or None; (that key, T, H, K) -> Entry or None
_TABLES: dict = {}
_LOOKUPS: dict = {}
_DEVICES: dict = {}  # (CUDA device index, DSV4_AMPERE_IMPL) -> (sanitized name, variant, smem)
_LAST_DEVICE = [-1]  # the current device of the last eager lookup: what traced code plans for


def clear() -> None:
    """Forget every loaded table and lookup (tests, a tune run that wrote a table)."""
    _TABLES.clear()
    _LOOKUPS.clear()
    _DEVICES.clear()
    _LAST_DEVICE[0] = -1


def _device(index: int) -> Optional[Tuple[str, str, int]]:
    got = _DEVICES.get((index, envs.raw(envs.IMPL)))
    if got is None:
        import torch

        if torch.compiler.is_compiling():  # traced: no device queries (torch.compile reads plain dicts only)
            return None
        got = _DEVICES[(index, envs.raw(envs.IMPL))] = _query_device(index)
    return got


def _query_device(index: int) -> Tuple[str, str, int]:
    """(sanitized name, kernel variant, shared memory a block) of CUDA device ``index``."""
    import torch

    from . import device as _dev
    from .variant import _cuda_variant

    return (sanitize_device_name(torch.cuda.get_device_name(index)), _cuda_variant(index, envs.raw(envs.IMPL)),
            _dev.smem_per_block(index))


def _query_current_device() -> int:
    """The current CUDA device's index, or -1 (no CUDA, or CUDA not initialised)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return -1
    return torch.cuda.current_device()


def _current_device() -> int:
    """The current CUDA device's index, or -1 (no CUDA device initialised: no table). Traced code
    (torch.compile) gets the device of the last eager lookup, without a device query."""
    import torch

    if torch.compiler.is_compiling():
        return _LAST_DEVICE[0]
    _LAST_DEVICE[0] = _query_current_device()
    return _LAST_DEVICE[0]


def lookup_for(device_name: str, variant: str, smem: int, T: int, H: int, K: int, sms: int) -> Optional[Entry]:
    """The table entry for (T, H, K) on a device named ``device_name`` planning for ``sms`` SMs with kernel
    ``variant`` and ``smem`` bytes of shared memory a block, or None (tables off, no table, no bucket)."""
    if not envs.get(TABLES_ENV):
        return None
    return _lookup_for(device_name, variant, smem, T, H, K, sms)


def _lookup_for(device_name: str, variant: str, smem: int, T: int, H: int, K: int, sms: int) -> Optional[Entry]:
    user = envs.raw(TABLE_DIR_ENV)
    key = (device_name, sms, variant, smem, user, T, H, K)
    try:
        return _LOOKUPS[key]
    except KeyError:
        pass
    tkey = key[:5]
    if tkey not in _TABLES:
        path = find(device_name, sms, variant)
        _TABLES[tkey] = load(path, smem) if path else None
    table = _TABLES[tkey]
    got = None
    if table is not None:
        for lo, hi, entry in table.get(K, {}).get(H, ()):
            if lo <= T <= hi:
                got = entry
                break
    _LOOKUPS[key] = got
    return got


def lookup(T: int, H: int, K: int, sms: int) -> Optional[Entry]:
    """The table entry for (T, H, K) planned for ``sms`` SMs on the current CUDA device, or None (tables
    off, no CUDA device initialised, no table for the device / SM count / variant, no bucket)."""
    if not envs.get(TABLES_ENV):
        return None
    index = _current_device()
    if index < 0:
        return None
    dev = _device(index)
    if dev is None:
        return None
    name, variant, smem = dev
    return _lookup_for(name, variant, smem, T, H, K, sms)
