"""The plugin's Engram lookup (``dsv4_ops.vllm.engram.engram_lookup_ampere``) against the
installed vLLM's (0.33.0 or 0.34.0) own ``ParallelEngramEmbedding.lookup`` at TP 1, 2 and 8,
every rank, over each table storage vLLM has.

vLLM's side is its installed source, not a copy: the shard geometry statements of
``ParallelEngramEmbedding.__init__`` (head_start, vocab range, heads a rank), its
``_get_shard_info``, ``_storage``, ``lookup`` (and, from 0.34.0, the ``_uses_small_host_pages``
property it reads), ``DPSharedEngramStorage.get_views`` and ``_engram_lookup_kernel`` are cut out
of ``models/deepseek_v41/common/engram.py`` by the AST and run on a stand-in module (importing
vLLM costs ~40 s here; its kernel runs under the Triton interpreter, CPU only). Both lookups
read the same stand-in object, so the plugin sees exactly the attributes vLLM's own method sees.

Storages (vLLM's ``_allocate_weights``): ``pinned`` (private pinned host tables, DP 1: two
allocations), ``shared-shm`` / ``shared-cumem`` (DP > 1, ``DPSharedEngramStorage``: ONE
allocation, the fp8 rows then the scales, split as vLLM's ``split_table``; 0.34.0 maps it from
host-NUMA cuMem (2 MiB GPU pages, ``huge_pages``) where FABRIC handles work, else from
``/dev/shm``) and ``device`` (``cpu_offload`` off). On CPU the accelerator view of a host tensor
is the tensor itself.

Per rank: a table LARGER than the rank's vocab range (the rows of the following ranks and
spare rows sit past ``vocab_end``), 15 hash columns (TP 8: the last rank has a padded
column), ids at every head boundary b of the table (b - 1 and b in every column: both edges
of every shard at every TP), the dead id -1, the table's last row, and in-bucket ids. The
plugin runs through the op (on CPU: the reference) and through the Triton launcher (the
kernel under the interpreter); its bytes must equal vLLM's, and the owned rows must be the
ones the shard's range gives.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import textwrap
import types

import pytest
import torch

from dsv4_ops import engram
from dsv4_ops.testing import poison_like, rng
from dsv4_ops.vllm import engram as plugin_engram

DIM, QB = 256, 32  # V4.1: 256 E4M3 bytes and 8 UE8M0 bytes a row
# Bucket sizes of the 15 hash columns (vLLM's are primes); the whole table has SPARE rows more.
HEAD_SIZES = (7, 11, 13, 5, 17, 19, 3, 23, 29, 2, 31, 37, 41, 43, 47)
SPARE = 9
N_ROWS = sum(HEAD_SIZES) + SPARE


def _vllm_engram_path() -> str:
    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("vLLM's Engram code is an oracle only under the Triton interpreter (CPU); the GPU box has no vLLM")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return os.path.join(spec.submodule_search_locations[0], "models", "deepseek_v41", "common", "engram.py")


def _segment(lines, first, last, decorators=False) -> str:
    start = min([first.lineno] + [d.lineno for d in first.decorator_list]) if decorators else first.lineno
    return textwrap.dedent("\n".join(lines[start - 1:last.end_lineno]))


_STANDIN = '''
import torch
import triton
import triton.language as tl
from torch import nn

_SORTED_IS_CONSTEXPR = False
_TP = [1, 0]  # (world size, rank) of the shard being built
_THRESHOLDS = [None, None]  # _engram_lookup_thresholds: vLLM sorts only on sm_100


def get_tensor_model_parallel_world_size():
    return _TP[0]


def get_tensor_model_parallel_rank():
    return _TP[1]


def _engram_lookup_thresholds(device):
    return tuple(_THRESHOLDS)


def get_accelerator_view_from_cpu_tensor(t):
    return t  # CPU: the host tensor is its own view


@triton.jit
{kernel}


class SharedStorage:
    """DPSharedEngramStorage: one allocation, the fp8 rows then the scales (vLLM's split_table),
    its CUDA views made at construction (0.34.0) -- here the same CPU memory."""

    def __init__(self, weight, scales, huge_pages):
        self.weight, self.weight_scale_inv, self.huge_pages = weight, scales, huge_pages
        self._views = (weight, scales)

{storage_methods}


class Shard:
    """ParallelEngramEmbedding's geometry, storage and lookup (TP only)."""

    _shared_memory = None
    _packed = None

    def __init__(self, head_sizes, tp_size, tp_rank, weight, scales, num_sms, storage="pinned"):
        _TP[:] = [tp_size, tp_rank]
        self.dp_size = 1
        self.dim, self.block_size = weight.shape[1], weight.shape[1] // scales.shape[1]
        self.cpu_offload, self._num_sms = storage != "device", num_sms
        self._views, self._view_src = None, None
{geometry}
        if storage.startswith("shared"):
            n = weight.numel()
            flat = torch.cat([weight.view(torch.uint8).reshape(-1), scales.reshape(-1)])
            weight = flat[:n].view(torch.float8_e4m3fn).view(-1, self.dim)
            scales = flat[n:].view(-1, scales.shape[1])
            self._shared_memory = SharedStorage(weight, scales, huge_pages=storage == "shared-cumem")
        self.weight, self.weight_scale_inv = weight, scales

{methods}
'''



@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory):
    """A module holding vLLM's kernel (interpreted), ``SharedStorage`` with vLLM's
    ``DPSharedEngramStorage.get_views``, and ``Shard``: vLLM's geometry statements
    (``self.n_hash_cols = ...`` through ``self.peer_rows, row_start = 0, ...``: no peer
    tables), ``_get_shard_info``, ``_storage``, ``lookup`` and whatever property of the class
    ``lookup`` reads (0.34.0: ``_uses_small_host_pages``), verbatim."""
    path = _vllm_engram_path()
    src = open(path, encoding="utf-8").read()
    lines = src.splitlines()
    tree = ast.parse(src)
    kern = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_engram_lookup_kernel")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ParallelEngramEmbedding")
    meth = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    body = meth["__init__"].body
    seg = [ast.get_source_segment(src, s) for s in body]
    first = next(i for i, s in enumerate(seg) if s.startswith("self.n_hash_cols = len(head_sizes)"))
    last = next(i for i, s in enumerate(seg) if s.startswith("self.peer_rows, row_start = 0"))
    geometry = _segment(lines, body[first], body[last])
    for name in ("self.head_start =", "self.part_num_embeddings =", "self.vocab_start_idx =", "self.vocab_end_idx =", "self.part_n_hash_cols ="):
        assert name in geometry, f"vLLM's ParallelEngramEmbedding.__init__ changed: no {name!r}"
    lookup_src = _segment(lines, meth["lookup"], meth["lookup"])
    props = [m for m, n in meth.items() if any(getattr(d, "id", None) == "property" for d in n.decorator_list)
             and f"self.{m}" in lookup_src]
    methods = "\n\n".join(_segment(lines, meth[m], meth[m], decorators=True)
                          for m in ("_get_shard_info", "_storage", *props, "lookup"))
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DPSharedEngramStorage")
    get_views = next(n for n in store.body if isinstance(n, ast.FunctionDef) and n.name == "get_views")
    text = _STANDIN.format(kernel=_segment(lines, kern, kern), geometry=textwrap.indent(geometry, " " * 8),
                           methods=textwrap.indent(methods, " " * 4),
                           storage_methods=textwrap.indent(_segment(lines, get_views, get_views), " " * 4))
    mod_path = tmp_path_factory.mktemp("vllm_engram") / "vllm_engram_standin.py"
    mod_path.write_text(text)
    mspec = importlib.util.spec_from_file_location("vllm_engram_standin", mod_path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def make_table(rows: int, seed: int):
    """(float8_e4m3fn codes [rows, DIM] without NaN codes, uint8 UE8M0 scales [rows, DIM // QB]
    in 112..141): every row non-zero, so an owned row never reads as a missing one."""
    g = rng(seed)
    c = torch.randint(1, 256, (rows, DIM), generator=g, dtype=torch.int64)
    c = torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)
    s = torch.randint(112, 142, (rows, DIM // QB), generator=g, dtype=torch.int64).to(torch.uint8)
    return c.view(torch.float8_e4m3fn), s


def make_ids(seed: int) -> torch.Tensor:
    """int32 [T, 15] as a strided view (vLLM passes column slices of a wider buffer): b - 1 and
    b in every column for every head boundary b (b = 0 gives the dead id -1), the table's last
    row, and tokens whose ids fall in their own column's bucket."""
    n = len(HEAD_SIZES)
    bounds = [0]
    for size in HEAD_SIZES:
        bounds.append(bounds[-1] + size)
    rows = [torch.full((n,), v) for b in bounds for v in (b - 1, b)]
    rows.append(torch.full((n,), N_ROWS - 1))
    g = rng(seed)
    lo, size = torch.tensor(bounds[:-1]), torch.tensor(HEAD_SIZES)
    rows += [lo + (torch.rand(n, generator=g) * size).long() for _ in range(3)]
    ids = torch.stack(rows)
    wide = torch.full((ids.shape[0], n + 3), -7, dtype=torch.int32)
    wide[:, 1:n + 1] = ids.to(torch.int32)
    return wide[:, 1:n + 1]


def plugin_through_kernel(monkeypatch):
    """On CPU the op's implementation is the reference: route the plugin's one op call to the
    Triton launcher instead (the kernel under the interpreter), arguments as the plugin passes
    them."""
    ops = types.SimpleNamespace(dsv4_ampere=types.SimpleNamespace(engram_lookup=engram.engram_lookup))
    monkeypatch.setattr(plugin_engram, "torch", types.SimpleNamespace(ops=ops, Tensor=torch.Tensor))


def new_out(T: int, local: int, packed: bool) -> torch.Tensor:
    if packed:  # a [T, layers, L, width] staging buffer's layer slice: token stride > row
        return poison_like(torch.empty(T, 2, local, DIM + DIM // QB, dtype=torch.uint8))[:, 1]
    return poison_like(torch.empty(T, local, DIM, dtype=torch.bfloat16))


CASES = [  # (tp, packed, background, route, vLLM sorts above a threshold of 0, storage)
    pytest.param(1, False, False, "op", False, "pinned", id="tp1-bf16-op"),
    pytest.param(1, True, True, "kernel", False, "shared-cumem", id="tp1-packed-kernel-bg-cumem"),
    pytest.param(2, False, True, "kernel", False, "device", id="tp2-bf16-kernel-bg-device"),
    pytest.param(2, True, False, "op", True, "shared-shm", id="tp2-packed-op-vllm-sorted-shm"),
    pytest.param(8, False, False, "kernel", False, "pinned", id="tp8-bf16-kernel"),
    pytest.param(8, True, True, "op", False, "shared-shm", id="tp8-packed-op-bg-shm"),
    pytest.param(8, True, False, "kernel", True, "pinned", id="tp8-packed-kernel-vllm-sorted"),
    pytest.param(8, False, False, "op", True, "shared-cumem", id="tp8-bf16-op-cumem-threshold"),
]


@pytest.mark.parametrize("tp,packed,background,route,vllm_sorts,storage", CASES)
def test_plugin_lookup_matches_vllm_every_rank(vllm_side, monkeypatch, tp, packed, background, route, vllm_sorts,
                                               storage):
    if route == "kernel":
        plugin_through_kernel(monkeypatch)
    monkeypatch.setattr(vllm_side, "_THRESHOLDS", [0 if vllm_sorts else None, None])
    weight, scales = make_table(N_ROWS, 100 + tp)
    ids = make_ids(200 + tp)
    T, n = ids.shape[0], len(HEAD_SIZES)
    seen_heads = []
    for rank in range(tp):
        probe = vllm_side.Shard(HEAD_SIZES, tp, rank, weight[:1], scales[:1], 6)
        v0, v1 = probe.vocab_start_idx, probe.vocab_end_idx
        # this rank's rows and every row after them: the table is larger than the vocab range
        shard = vllm_side.Shard(HEAD_SIZES, tp, rank, weight[v0:], scales[v0:], 6, storage)
        assert shard.weight.shape[0] > v1 - v0
        if hasattr(type(shard), "_uses_small_host_pages"):  # 0.34.0: a cuMem table (2 MiB pages) is never sorted
            assert shard._uses_small_host_pages == (storage in ("pinned", "shared-shm"))
        local, h0 = shard.part_n_hash_cols, shard.head_start
        seen_heads += [h for h in range(h0, h0 + local) if h < n]
        want, got = new_out(T, local, packed), new_out(T, local, packed)
        shard.lookup(ids, want, background)
        plugin_engram.engram_lookup_ampere(shard, ids, got, background)
        where = f"TP {tp} rank {rank} (heads {h0}..{h0 + local - 1}, vocab [{v0}, {v1}))"
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
        # the shard's own semantics, independently of vLLM: owned = a real column and an id in range
        cols = torch.arange(h0, h0 + local)
        gid = torch.where(cols < n, ids[:, cols.clamp(max=n - 1)].long(), -1)
        owned = (cols < n) & (gid >= v0) & (gid < v1)
        row_nonzero = got.view(torch.uint8).reshape(T, local, -1).ne(0).any(-1)
        assert torch.equal(row_nonzero, owned), where
        edge = {v0 - 1: False, v0: True, v1 - 1: True, v1: False}
        for value, is_owned in edge.items():  # both edges of the range, from both sides, were looked up
            hit = (gid == value) & (cols < n)
            assert hit.any() and bool(owned[hit].all()) == is_owned, (where, value)
    assert seen_heads == list(range(n))  # the ranks' heads tile the columns exactly once


def test_bf16_row_is_the_scaled_code(vllm_side):
    """One owned row by hand, so the comparison above cannot pass on two equally wrong decodes:
    code 0x38 (1.0) with scale byte 128 is 2.0, byte 0 gives 0.0."""
    weight, scales = make_table(N_ROWS, 7)
    v0 = vllm_side.Shard(HEAD_SIZES, 2, 1, weight[:1], scales[:1], 4).vocab_start_idx
    weight.view(torch.uint8)[v0] = 0x38
    scales[v0] = 128
    scales[v0, 1] = 0
    shard = vllm_side.Shard(HEAD_SIZES, 2, 1, weight[v0:], scales[v0:], 4)
    ids = torch.full((1, len(HEAD_SIZES)), -1, dtype=torch.int32)
    ids[0, shard.head_start] = v0
    got = new_out(1, shard.part_n_hash_cols, False)
    plugin_engram.engram_lookup_ampere(shard, ids, got)
    row = got[0, 0].float()
    assert torch.equal(row[:QB], torch.full((QB,), 2.0)) and torch.equal(row[QB:2 * QB], torch.zeros(QB))
    assert torch.equal(row[2 * QB:], torch.full((DIM - 2 * QB,), 2.0))
    assert torch.equal(got[0, 1:].float(), torch.zeros_like(got[0, 1:].float()))
