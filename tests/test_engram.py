"""Engram lookup (op ``engram_lookup``): E4M3 table rows by hash id, read as uint8.

CPU: the reference against an independent float64 formulation; the reference against vLLM
0.33.0's own ``_engram_lookup_kernel`` run in the Triton interpreter (bf16, packed, sorted);
this library's kernel through the interpreter; the op's CPU implementation; argument errors;
AOT sm_80/86. opcheck: tests/test_opcheck.py. GPU (both variants, no vLLM needed): a table in
device memory, and a REAL pinned host table of several GiB read over UVA.
"""

import os

import pytest
import torch

from dsv4_ops import aot, engram
from dsv4_ops.reference import ref_engram_lookup
from dsv4_ops.testing import HAS_GPU, poison_like, rng

DEV = "cuda" if HAS_GPU else "cpu"
DIM, QB = 256, 32  # V4.1-Flash: 256 E4M3 bytes and 8 UE8M0 bytes a row


def make_table(rows: int, seed: int, dim: int = DIM, qb: int = QB):
    """(codes uint8 [rows, dim] without NaN codes, scales uint8 [rows, dim // qb]) with bytes
    around 127 and a few edge bytes: 0 (gives 0.0), 127 (1.0), a small and a large exponent."""
    g = rng(seed)
    c = torch.randint(0, 256, (rows, dim), generator=g, dtype=torch.int64)
    c = torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)
    s = torch.randint(112, 142, (rows, dim // qb), generator=g, dtype=torch.int64).to(torch.uint8)
    if rows >= 4:
        s[0, 0], s[1, 1], s[2, 2], s[3, 3] = 0, 127, 20, 250
        c[1] = 0  # an all-zero row
    return c, s


def make_ids(T: int, cols: int, lo: int, hi: int, seed: int, dtype=torch.int32):
    """Hash ids in [lo - 3, hi + 3): some below and above this shard's range. Tokens 0 and 1
    read the edge rows 0..3 of make_table in every column."""
    ids = torch.randint(lo - 3, hi + 3, (T, cols), generator=rng(seed))
    if T >= 2 and hi - lo >= 4:
        ids[0] = lo + torch.arange(cols) % 4
        ids[1] = lo + (torch.arange(cols) + 2) % 4
    return ids.to(dtype)


def independent_lookup(codes, scales, ids, local_heads, vocab_start, vocab_end, head_start, total_heads):
    """Row by row in float64 through torch's own float8_e4m3fn: bf16 [T, L, D]."""
    T = ids.shape[0]
    dim = codes.shape[1]
    qb = dim // scales.shape[1]
    out = torch.zeros(T, local_heads, dim, dtype=torch.float64)
    for t in range(T):
        for h in range(local_heads):
            col = head_start + h
            if col >= total_heads:
                continue
            i = int(ids[t, col])
            if not vocab_start <= i < vocab_end or i - vocab_start >= codes.shape[0]:
                continue
            r = i - vocab_start
            vals = codes[r].view(torch.float8_e4m3fn).to(torch.float64)
            exps = scales[r].to(torch.float64).repeat_interleave(qb)
            out[t, h] = vals * torch.where(exps == 0, 0.0, torch.pow(2.0, exps - 127))  # byte 0: +-0
    return out.to(torch.bfloat16)


SHARDS = [  # (rows, T, total_heads, local_heads, head_start, vocab_start): TP shards of a table
    pytest.param(60, 5, 6, 3, 0, 0, id="first-shard"),
    pytest.param(60, 5, 6, 3, 3, 100, id="second-shard"),
    pytest.param(40, 4, 7, 4, 4, 37, id="padded-last-shard"),  # column 7 does not exist
    pytest.param(40, 3, 2, 2, 0, 0, id="tp1"),
]


@pytest.mark.parametrize("rows,T,total,local,head_start,v0", SHARDS)
def test_reference_matches_independent(rows, T, total, local, head_start, v0):
    codes, scales = make_table(rows, 1)
    ids = make_ids(T, total, v0, v0 + rows, 2)
    out = poison_like(torch.empty(T, local, DIM, dtype=torch.bfloat16))
    ref_engram_lookup(codes, scales, ids, out, v0, v0 + rows, head_start, total)
    want = independent_lookup(codes, scales, ids, local, v0, v0 + rows, head_start, total)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_reference_packed_and_sorted_agree_with_bf16():
    """Packed rows decode to the bf16 rows; a sorted lookup writes the same rows."""
    rows, T, total, local, h0, v0 = 50, 6, 4, 4, 0, 10
    codes, scales = make_table(rows, 3)
    ids = make_ids(T, total, v0, v0 + rows, 4)
    bf = poison_like(torch.empty(T, local, DIM, dtype=torch.bfloat16))
    ref_engram_lookup(codes, scales, ids, bf, v0, v0 + rows, h0, total)
    packed = poison_like(torch.empty(T, local, DIM + DIM // QB, dtype=torch.uint8))
    ref_engram_lookup(codes, scales, ids, packed, v0, v0 + rows, h0, total)
    p_codes, p_scales = packed[..., :DIM].reshape(-1, DIM), packed[..., DIM:].reshape(-1, DIM // QB)
    again = torch.empty_like(bf)
    ref_engram_lookup(p_codes, p_scales, torch.arange(T * local).view(T * local, 1), again.view(T * local, 1, DIM),
                      0, T * local, 0, 1)
    assert torch.equal(again.view(torch.int16), bf.view(torch.int16))
    local_ids = (ids.to(torch.int64) - v0).flatten()
    local_ids = torch.where((local_ids >= 0) & (local_ids < rows), local_ids, -1)
    srt, dst = local_ids.sort()
    by_sort = poison_like(torch.empty_like(bf))
    ref_engram_lookup(codes, scales, srt, by_sort, v0, v0 + rows, h0, total, dst.int())
    assert torch.equal(by_sort.view(torch.int16), bf.view(torch.int16))


# ---------------------------------------------------------------------------------------
# vLLM 0.33.0's own kernel, run in the Triton interpreter (CPU only; the GPU box has no vLLM)
# ---------------------------------------------------------------------------------------


def _vllm_kernel_interpreted(tmp_path_factory):
    """vLLM's ``_engram_lookup_kernel`` as an interpreter kernel, taken from the installed
    source without importing vLLM (the import costs more than a minute on a small CPU box):
    the function is copied verbatim into a module that binds the real triton."""
    import ast
    import importlib.util

    from triton import knobs

    if not knobs.runtime.interpret:
        pytest.skip("vLLM's kernel is an oracle only in the interpreter (CPU); the GPU box has no vLLM")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "models", "deepseek_v41", "common", "engram.py")
    src = open(path, encoding="utf-8").read()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_engram_lookup_kernel")
    body = "\n".join(src.splitlines()[node.lineno - 1:node.end_lineno])  # from `def`, decorator dropped
    mod_path = tmp_path_factory.mktemp("vllm_oracle") / "vllm_engram_oracle.py"
    mod_path.write_text("import triton\nimport triton.language as tl\n_SORTED_IS_CONSTEXPR = False\n\n\n"
                        "@triton.jit\n" + body + "\n")
    mspec = importlib.util.spec_from_file_location("vllm_engram_oracle", mod_path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod._engram_lookup_kernel


@pytest.mark.parametrize("mode", ["bf16", "packed", "sorted"])
def test_reference_matches_vllm_kernel(mode, tmp_path_factory):
    """The same step through vLLM's kernel (fp8 table, its launch arguments) and the reference."""
    kern = _vllm_kernel_interpreted(tmp_path_factory)
    rows, T, total, local, h0, v0 = 48, 5, 6, 3, 3, 200
    codes, scales = make_table(rows, 5)
    ids = make_ids(T, total, v0, v0 + rows, 6)
    width = DIM + DIM // QB if mode == "packed" else DIM
    dtype = torch.uint8 if mode == "packed" else torch.bfloat16
    got = poison_like(torch.empty(T, local, width, dtype=dtype))
    want = poison_like(torch.empty_like(got))
    n = T * local
    if mode == "sorted":
        loc = ids[:, h0:h0 + local].to(torch.int64) - v0
        lookup_ids, dst = loc.flatten().sort()
        dst = dst.int()
        ref_engram_lookup(codes, scales, lookup_ids, want, v0, v0 + rows, h0, total, dst)
    else:
        lookup_ids, dst = ids, ids
        ref_engram_lookup(codes, scales, ids, want, v0, v0 + rows, h0, total)
    kern[(2,)](codes.view(torch.float8_e4m3fn), scales, lookup_ids, dst, got, v0, v0 + rows, n,
               ids.stride(0), ids.stride(1), HEAD_START=h0, LOCAL_HEADS=local, TOTAL_HEADS=total, DIM=DIM,
               QUANT_BLOCK=QB, BLOCK_R=16, GRID=2, SORTED=mode == "sorted", PACKED=mode == "packed",
               OUT_STRIDE=got.stride(0), PEER_ROWS=0)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------------------------------
# This library's kernel (interpreter on CPU), the op, errors, AOT
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("mode", ["bf16", "packed-strided", "sorted"])
def test_kernel_matches_reference(interpret, mode, id_dtype):
    rows, T, total, local, h0, v0 = 40, 5, 7, 4, 4, 37
    codes, scales = make_table(rows, 7)
    ids_all = make_ids(T, total + 2, v0, v0 + rows, 8, id_dtype)
    ids = ids_all[:, 1:total + 1]  # a strided view, as vLLM passes hashes[:, layer]
    sorted_dst = None
    if mode == "packed-strided":  # out = packed_rows[:, layer] of a [T, layers, L, width] buffer
        out = poison_like(torch.empty(T, 2, local, DIM + DIM // QB, dtype=torch.uint8))[:, 1]
    else:
        out = poison_like(torch.empty(T, local, DIM, dtype=torch.bfloat16))
    if mode == "sorted":
        loc = ids[:, h0:h0 + local].to(torch.int64) - v0
        loc = torch.nn.functional.pad(loc, (0, local - loc.shape[1]), value=-1)
        ids, sorted_dst = loc.flatten().sort()
        sorted_dst = sorted_dst.to(id_dtype)
    want = poison_like(out.clone())
    ref_engram_lookup(codes, scales, ids, want, v0, v0 + rows, h0, total, sorted_dst)
    dev = interpret
    o = out.to(dev)
    engram.engram_lookup(codes.to(dev), scales.to(dev), ids.to(dev), o, v0, v0 + rows, h0, total,
                         None if sorted_dst is None else sorted_dst.to(dev), max_programs=2)
    assert torch.equal(o.cpu().view(torch.uint8), want.view(torch.uint8))


def test_op_cpu_matches_reference_and_takes_fp8_table():
    rows, T, total = 30, 4, 3
    codes, scales = make_table(rows, 9)
    ids = make_ids(T, total, 0, rows, 10)
    out = poison_like(torch.empty(T, total, DIM, dtype=torch.bfloat16))
    torch.ops.dsv4_ampere.engram_lookup(codes.view(torch.float8_e4m3fn), scales, ids, out, 0, rows, 0, total)
    want = independent_lookup(codes, scales, ids, total, 0, rows, 0, total)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def _args():
    codes, scales = make_table(8, 11)
    ids = make_ids(2, 2, 0, 8, 12)
    out = torch.zeros(2, 2, DIM, dtype=torch.bfloat16)
    return dict(weight=codes, scales=scales, ids=ids, out=out, vocab_start=0, vocab_end=8, head_start=0,
                total_heads=2)


@pytest.mark.parametrize("change,needle", [
    (dict(weight=torch.zeros(8, DIM, dtype=torch.int8)), "weight"),
    (dict(scales=torch.zeros(7, DIM // QB, dtype=torch.uint8)), "scales"),
    (dict(scales=torch.zeros(8, 3, dtype=torch.uint8)), "weight/scales"),
    (dict(ids=torch.zeros(2, 2, dtype=torch.float32)), "ids"),
    (dict(ids=torch.zeros(2, 1, dtype=torch.int32)), "ids"),
    (dict(out=torch.zeros(2, 2, DIM, dtype=torch.float32)), "out"),
    (dict(out=torch.zeros(2, 2, DIM + 1, dtype=torch.uint8)), "out"),
    (dict(out=torch.zeros(1, 2, DIM, dtype=torch.bfloat16)), "out"),
    (dict(vocab_end=-1), "vocab_end"),
    (dict(head_start=-2), "head_start"),
], ids=["weight-dtype", "scale-rows", "scale-cols", "ids-dtype", "ids-cols", "out-dtype", "out-width",
        "out-tokens", "vocab_end", "head_start"])
def test_bad_arguments_name_the_argument(change, needle):
    args = {**_args(), **change}
    with pytest.raises(ValueError, match=needle):
        engram.check_lookup_args(**args)
    with pytest.raises((ValueError, RuntimeError), match=needle):
        torch.ops.dsv4_ampere.engram_lookup(*args.values())


def test_aot_sm80_sm86(aot_results):
    """Every portable lookup specialization compiles for sm_80/86, no spills, no e4m3 cvt."""
    specs = [s for s in engram.aot_specs() if s.variant == "portable"]
    want = {(s.label, a) for s in specs for a in aot.AMPERE_ARCHS}
    rows = [r for r in aot_results if (r.label, r.arch) in want]
    assert {(r.label, r.arch) for r in rows} == want
    for r in rows:
        assert r.ok, r
        assert r.spill_bytes == 0, r


# ---------------------------------------------------------------------------------------
# GPU: device table, and a real pinned host table read over UVA (no vLLM needed)
# ---------------------------------------------------------------------------------------

HOST_TABLE_GIB = float(os.environ.get("DSV4_ENGRAM_TEST_GIB", "4"))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "packed"])
def test_gpu_device_table(variant, packed):
    rows, T, total, local, h0, v0 = 1 << 16, 64, 8, 4, 4, 12345
    codes, scales = make_table(rows, 13)
    ids = make_ids(T, total, v0, v0 + rows, 14)
    width = DIM + DIM // QB if packed else DIM
    out = poison_like(torch.empty(T, local, width, dtype=torch.uint8 if packed else torch.bfloat16))
    want = poison_like(out.clone())
    ref_engram_lookup(codes, scales, ids, want, v0, v0 + rows, h0, total)
    o = out.cuda()
    engram.engram_lookup(codes.cuda(), scales.cuda(), ids.cuda(), o, v0, v0 + rows, h0, total)
    assert torch.equal(o.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_pinned_host_table_over_uva(variant):
    """A table of several GiB in pinned host memory (beyond any L2), read through its CUDA
    view; rows spread over the whole table, the last row included."""
    rows = int(HOST_TABLE_GIB * 2 ** 30) // (DIM + DIM // QB)
    try:
        host_w = torch.empty(rows, DIM, dtype=torch.uint8, pin_memory=True)
        host_s = torch.empty(rows, DIM // QB, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        pytest.skip(f"cannot pin {HOST_TABLE_GIB} GiB here: {exc}")
    T, total = 64, 8
    ids = torch.randint(0, rows, (T, total), generator=rng(15), dtype=torch.int64)
    ids[0, 0], ids[0, 1], ids[1, 0] = rows - 1, 0, rows + 5  # last row, first row, not owned
    touched = ids[(ids >= 0) & (ids < rows)].unique()
    codes, scales = make_table(touched.numel(), 16)
    host_w.zero_()  # untouched rows are zero; the touched rows get known bytes
    host_s.fill_(127)
    host_w[touched], host_s[touched] = codes, scales
    w_view, s_view = engram.pinned_cuda_view(host_w), engram.pinned_cuda_view(host_s)
    assert w_view.is_cuda and w_view.data_ptr() == host_w.data_ptr()
    out = poison_like(torch.empty(T, total, DIM, dtype=torch.bfloat16, device="cuda"))
    engram.engram_lookup(w_view, s_view, ids.cuda(), out, 0, rows, 0, total)
    want = poison_like(torch.empty(T, total, DIM, dtype=torch.bfloat16))
    sub_ids = torch.searchsorted(touched, ids.clamp(0, rows - 1))
    sub_ids = torch.where((ids >= 0) & (ids < rows), sub_ids, -1)
    ref_engram_lookup(codes, scales, sub_ids, want, 0, touched.numel(), 0, total)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
