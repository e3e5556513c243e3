"""vLLM 0.33.0's own V3.2 cache writer (``deepseek_v32.common.kernels.fused_norm_rope``, a Triton
kernel) against the plugin's replacement (``dsv4_ops.vllm.v32_model.fused_norm_rope``) on the
same fresh random inputs, both under the Triton interpreter on the CPU; prints one JSON line.

    python tests/v32_writer_compare.py      (tests/test_v32_writer.py runs it and checks the line)

vLLM's kernel stores ``tl.float8e4nv``; the interpreter casts fp32 to fp8 as an integer
conversion, so ``exact_fp8_casts`` below replaces that one conversion with the GPU's
``cvt.rn.satfinite`` (round to nearest even, saturating at 448: torch's float8_e4m3fn after a
clamp), and ``tests/e2e/interpreter_patch`` fixes fp32 -> bf16 to round to nearest even. For every
byte that differs the line says whether the value was a rounding tie in all but name: its
float64 value moves to the other code under a relative change of 2**-18 (the fp32 pipelines
differ in summation order and rsqrt by a few ulps, ~2**-22), and by how many codes it moved.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # vLLM keeps the real Triton (no placeholder) without a driver
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

EPS = 2.0 ** -18
E4M3 = torch.float8_e4m3fn


def exact_fp8_casts() -> None:
    """The interpreter's fp32/bf16/fp16 -> float8e4nv conversion as the GPU does it (RNE,
    satfinite). Triton lowers ``x.to(tl.float8e4nv)`` to ``create_fp_to_fp``, whose interpreter
    version (``_convert_float``) loses the carry when the mantissa rounds up into the exponent
    (7.78 -> 4.0)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    orig = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16, tl.bfloat16):
            data = np.ascontiguousarray(src.data)
            if src.dtype.scalar == tl.bfloat16:
                x = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).float()
            else:
                x = torch.from_numpy(data.astype(np.float32))
            codes = x.clamp(-448.0, 448.0).to(E4M3).view(torch.uint8).numpy()
            return interp.TensorHandle(codes, dst_type.scalar)
        return orig(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp


def csc(n: int, d: int, g) -> torch.Tensor:
    """A [n, d] fp32 cos|sin cache (random angles, so no symmetry hides a swapped half)."""
    ang = torch.rand(n, d // 2, generator=g, dtype=torch.float64) * 6.283
    return torch.cat((ang.cos(), ang.sin()), -1).float()


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    T, nb, bs = 7, 3, 64
    return dict(
        T=T, nb=nb, bs=bs,
        pos=torch.randint(0, 200, (T,), generator=g),
        slots=torch.tensor([5, 6, -1, 64 + 7, 128 + 63, 2, 100]),
        q_c=torch.randn(T, 96, generator=g).bfloat16(),
        kv_c=(torch.randn(T, 512, generator=g) * torch.exp2(torch.randint(-6, 6, (T, 1), generator=g))).bfloat16(),
        k_pe=torch.randn(T, 64, generator=g).bfloat16(),
        index_k=(torch.randn(T, 128, generator=g) * 2).bfloat16(),
        qw=torch.rand(96, generator=g).bfloat16() + 0.5, kvw=torch.rand(512, generator=g).bfloat16() + 0.5,
        lw=torch.rand(128, generator=g) + 0.5, lb=torch.randn(128, generator=g) * 0.1,
        cache=csc(256, 64, g))


def run(fn, a, fmt, interleave):
    T, nb, bs = a["T"], a["nb"], a["bs"]
    mla = (torch.zeros(nb, bs, 656, dtype=torch.uint8) if fmt == "fp8_ds_mla"
           else torch.zeros(nb, bs, 576, dtype=torch.bfloat16))
    idx = torch.zeros(nb, bs, 132, dtype=torch.uint8)
    topk = torch.zeros(T + 2, 16, dtype=torch.int32)
    fn(a["pos"], a["q_c"], a["qw"], 1e-6, a["kv_c"], a["kvw"], 1e-6, a["k_pe"], a["cache"], a["index_k"], a["lw"],
       a["lb"], 1e-6, a["cache"], topk, slot_mapping=a["slots"], indexer_k_cache=idx, mla_kv_cache=mla,
       mla_kv_cache_dtype=fmt, has_indexer=True, index_rope_interleave=interleave)
    return mla.view(torch.uint8).reshape(nb * bs, -1), idx.reshape(nb * bs, -1)


def f64_rows(a, interleave):
    """float64 values the caches quantize: normed kv_c [T, 512], roped k_pe [T, 64] (interleaved
    pairs), indexer K [T, 128] (LayerNorm, then RoPE on the first 64: NeoX or interleaved)."""
    x = a["kv_c"].double()
    kv = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * a["kvw"].double()
    cs = a["cache"].double()[a["pos"]]
    cos, sin = cs[:, :32], cs[:, 32:]

    def inter(v):
        v1, v2 = v[:, 0::2], v[:, 1::2]
        return torch.stack((v1 * cos - v2 * sin, v2 * cos + v1 * sin), -1).flatten(-2)

    pe = inter(a["k_pe"].double())
    k = a["index_k"].double()
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True) + 1e-6) \
        * a["lw"].double() + a["lb"].double()
    if interleave:
        rot = inter(k[:, :64])
    else:
        p, q = k[:, :32], k[:, 32:64]
        rot = torch.cat((p * cos - q * sin, q * cos + p * sin), -1)
    return kv, pe, torch.cat((rot, k[:, 64:]), -1)


def fragile_e4m3(v: torch.Tensor) -> torch.Tensor:
    def enc(t):
        return t.clamp(-448.0, 448.0).to(E4M3).view(torch.uint8)
    return enc(v * (1 - EPS)) != enc(v * (1 + EPS))


def fragile_bf16(v: torch.Tensor) -> torch.Tensor:
    return (v * (1 - EPS)).to(torch.bfloat16) != (v * (1 + EPS)).to(torch.bfloat16)


def code_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in E4M3 codes of one sign (uint8 codes; sign-magnitude order)."""
    def order(c):
        c = c.to(torch.int32)
        return torch.where(c >= 128, -(c - 128), c)
    return (order(a) - order(b)).abs()


def compare(seed: int, fmt: str, interleave: bool) -> dict:
    from vllm.models.deepseek_v32.common import kernels as vk

    from dsv4_ops.vllm import v32_model

    a = inputs(seed)
    m_v, i_v = run(vk.fused_norm_rope, a, fmt, interleave)
    m_o, i_o = run(v32_model.fused_norm_rope, a, fmt, interleave)
    kv, pe, k = f64_rows(a, interleave)
    ok = a["slots"] >= 0
    rows, toks = a["slots"][ok], torch.nonzero(ok).flatten()
    res = {"fmt": fmt, "interleave": interleave, "rows": int(rows.numel()),
           # every differing byte of both caches, written or not (the checks below look at parts)
           "mla_bytes_differ": int((m_v != m_o).sum()), "index_bytes_differ": int((i_v != i_o).sum())}
    if fmt == "fp8_ds_mla":
        rv, ro = m_v[rows], m_o[rows]
        sc_v = rv[:, 512:528].contiguous().view(torch.float32)
        res["scale_differ"] = int((sc_v != ro[:, 512:528].contiguous().view(torch.float32)).sum())
        v = kv[toks].reshape(-1, 4, 128) / sc_v.double()[:, :, None]
        _codes(res, "nope", rv[:, :512], ro[:, :512], fragile_e4m3(v.reshape(-1, 512)))
        bv, bo = rv[:, 528:].contiguous().view(torch.int16), ro[:, 528:].contiguous().view(torch.int16)
        _bf16(res, "rope", bv, bo, fragile_bf16(pe[toks]))
    else:
        rv, ro = m_v[rows].view(torch.int16), m_o[rows].view(torch.int16)
        _bf16(res, "row", rv, ro, fragile_bf16(torch.cat((kv, pe), -1)[toks]))
    blk, pos = rows // a["bs"], rows % a["bs"]
    page_v, page_o = i_v.reshape(a["nb"], -1), i_o.reshape(a["nb"], -1)
    d = torch.arange(128)
    cv, co = page_v[blk[:, None], pos[:, None] * 128 + d], page_o[blk[:, None], pos[:, None] * 128 + d]
    so = a["bs"] * 128 + pos[:, None] * 4 + torch.arange(4)
    sv = page_v[blk[:, None], so].contiguous().view(torch.float32).flatten()
    res["index_scale_differ"] = int((sv != page_o[blk[:, None], so].contiguous().view(torch.float32).flatten()).sum())
    _codes(res, "index", cv, co, fragile_e4m3(k[toks] / sv.double()[:, None]))
    return res


def _codes(res, name, v, o, fragile):
    diff = v != o
    res[f"{name}_values"] = int(v.numel())
    res[f"{name}_differ"] = int(diff.sum())
    res[f"{name}_differ_not_fragile"] = int((diff & ~fragile).sum())
    res[f"{name}_max_steps"] = int(code_steps(v, o).max())
    res[f"{name}_fragile"] = int(fragile.sum())


def _bf16(res, name, v, o, fragile):
    diff = v != o
    res[f"{name}_values"] = int(v.numel())
    res[f"{name}_differ"] = int(diff.sum())
    res[f"{name}_differ_not_fragile"] = int((diff & ~fragile).sum())
    res[f"{name}_max_steps"] = int((v.to(torch.int32) - o.to(torch.int32)).abs().max())


def main() -> int:
    import interpreter_patch

    interpreter_patch.apply()
    exact_fp8_casts()
    seed = int(os.environ.get("DSV4_WRITER_SEED") or int.from_bytes(os.urandom(4), "little"))
    out = {"seed": seed, "cases": [compare(seed + i, fmt, il) for i, (fmt, il) in
                                   enumerate((("fp8_ds_mla", False), ("fp8_ds_mla", True), ("auto", False)))]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
