"""V4's decode allocates nothing that vLLM's memory profile did not reserve (issue 27 item 4).

vLLM's ``profile_run`` forwards ``max_num_batched_tokens`` (N) tokens with ``skip_attn=True``:
the attention call itself is skipped, but every layer still allocates its attention output
``[N, heads, 512]`` bf16 (``DeepseekV4Attention._alloc_attn_out``) before it. A decode step of
T <= N tokens allocates that buffer T rows long, so (N - T) x H x 1 KiB of what the profile
peaked at is free when the attention runs: ``profile_headroom``. What one decode call allocates
besides its inputs and ``out`` (``dsv4_decode.decode_peak_bytes``: the paged op's lse and split
partials, or the workspace step's bf16 workspace T x K x 1 KiB + indices + partials) must fit
in it. At the default ``max_model_len`` (1M) V4's C128A top-k width reaches 8192 (K = 8320).
CPU: the accounting at every V4 decode layer kind; GPU: torch.cuda.max_memory_allocated around
the real call agrees with it."""

import pytest
import torch

from dsv4_ops import dispatch, dsv4_decode, envs
from dsv4_ops.layout import HEAD_DIM
from dsv4_ops.vllm import warm_set as ws

MAX_MODEL_LEN = 1 << 20
PROFILE_TOKENS = 2048  # vLLM's default max_num_batched_tokens on an A100 (A800 / H100: 8192)
A100_SMS, A100_SMEM = 108, 163 * 1024
DRAFT_WINDOW = 192  # DSpark's non-causal draft window width (window 128 + 3 tokens, rounded to 64)


def profile_headroom(T: int, H: int, N: int = PROFILE_TOKENS) -> int:
    """Bytes of the profiled peak free at a T-token attention call: the attention output the
    profile allocated for N tokens, less the T rows this step's output holds."""
    return (N - T) * H * HEAD_DIM * 2


def _v4_kinds():
    shapes = ws.v4_flash(tp=8, max_model_len=MAX_MODEL_LEN)
    return [(k1, k2) for k1, _ in shapes.decode_layer_kinds() for k2 in (shapes.window, DRAFT_WINDOW)]


def test_the_c128a_width_reaches_8192_at_1m():
    assert max(k1 for k1, _ in _v4_kinds()) == 8192


@pytest.mark.parametrize("H", [8, 64], ids=["tp8", "dp-attention"])
def test_v4_decode_peak_fits_the_profile_at_1m(H, monkeypatch):
    """Auto at max_model_len 1M, T = 512 (the capture ceiling) and every T class below: every V4
    layer kind (SWA-only, C4A, every C128A width, the draft's window) runs the paged op and its
    peak fits the headroom; forcing the workspace step (mode heads) at T = 512 does not."""
    monkeypatch.delenv(envs.DECODE_KERNEL, raising=False)
    monkeypatch.delenv(envs.BATCH_INVARIANT, raising=False)
    worst = 0
    for T in (1, 4, 16, 64, 128, 256, 512):
        for K1, K2 in _v4_kinds():
            route, peak = dsv4_decode.decode_peak_bytes(T, H, K1, K2, A100_SMS, A100_SMEM, True, (2, 64))
            assert route != "workspace", (T, H, K1, K2)
            assert peak <= profile_headroom(T, H), (T, H, K1, K2, peak, profile_headroom(T, H))
            worst = max(worst, peak)
    assert worst > 0
    monkeypatch.setenv(envs.DECODE_KERNEL, "heads")
    route, before = dsv4_decode.decode_peak_bytes(512, H, 8192, 128, A100_SMS, A100_SMEM, True, (2, 64))
    assert route == "workspace" and before >= 512 * 8320 * HEAD_DIM * 2 > profile_headroom(512, H)


def test_the_plan_caps_the_paged_ops_partials():
    """Every (T, H, K) the paged op takes stays within PAGED_PARTIALS_MAX_BYTES, aligned caches or
    not: the plan's split count is v3_splits' where its partials fit, else split_cap's (T = 512,
    H = 8, K = 8320: one split); a caller's count is kept."""
    dd = dispatch.decode
    capped = 0
    for H in (8, 16, 64):
        for T in (1, 2, 16, 64, 100, 256, 512, 1024):
            for K in (128, 256, 640, 1152, 4224, 8320):
                for aligned in (True, False):
                    p = dd.plan_step(T, H, K, A100_SMS, A100_SMEM, aligned=aligned)
                    cfg = dd.v3_config(p.config)
                    free = dd.v3_splits(T, H, K, A100_SMS, cfg["BLOCK_H"], cfg["BLOCK_N"], p.config, A100_SMEM)
                    assert p.splits == min(free, dd.split_cap(T, H)), (T, H, K, aligned, p)
                    assert p.splits == 1 or T * H * p.splits * (HEAD_DIM + 1) * 4 <= dd.PAGED_PARTIALS_MAX_BYTES
                    capped += p.splits < free
    assert capped > 0  # the cap binds somewhere in this grid
    assert dd.plan_step(512, 8, 8320, A100_SMS, A100_SMEM).splits == 1
    assert dd.plan_step(1, 8, 8320, A100_SMS, A100_SMEM).splits > 1
    assert dd.plan_step(512, 8, 8320, A100_SMS, A100_SMEM, splits=5).splits == 5


@pytest.mark.gpu
@pytest.mark.parametrize("K1", [8192, 512, 0], ids=["c128a-1m", "c4a", "swa"])
def test_measured_decode_peak_matches_the_accounting(K1, monkeypatch):
    """On the GPU, T = 512, H = 8 (TP 8), caches sized for a 1M-token request: the bytes one
    dsv4_decode_attention call adds to torch.cuda.max_memory_allocated are at most
    decode_peak_bytes (+ the allocator's 512-byte rounding) and fit the profile headroom; the
    forced workspace step measures its T x K x 1 KiB workspace (the accounting is not vacuous)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dsv4_ops.dispatch import device as _device

    monkeypatch.delenv(envs.DECODE_KERNEL, raising=False)
    monkeypatch.delenv(envs.BATCH_INVARIANT, raising=False)
    dev = torch.device("cuda")
    T, H, K2 = 512, 8, 128
    comp_bs, swa_bs = 2, 64  # V4: block 256 tokens, C128A 2 compressed slots a block; the window cache 64
    comp_slots = MAX_MODEL_LEN // 128
    page = lambda bs: -(-bs * 584 // 576) * 576  # noqa: E731 - vLLM's page, rounded to 576 B
    g = torch.Generator(device=dev).manual_seed(27)
    comp = torch.randint(0, 256, (max(comp_slots // comp_bs, 1), page(comp_bs)), dtype=torch.uint8, device=dev,
                         generator=g)
    swa = torch.randint(0, 256, (T * K2 // swa_bs + 64, page(swa_bs)), dtype=torch.uint8, device=dev, generator=g)
    comp.bitwise_and_(0x3F)  # every byte small: finite E4M3 codes, bf16 rope and UE8M0 scales (no inf / nan)
    swa.bitwise_and_(0x3F)
    q = torch.randn(T, H, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    topk = torch.randint(0, comp_slots, (T, K1), dtype=torch.int32, device=dev, generator=g)
    topk_len = torch.full((T,), K1, dtype=torch.int32, device=dev)
    swa_slots = torch.randint(0, swa.shape[0] * swa_bs, (T, K2), dtype=torch.int32, device=dev, generator=g)
    sink = torch.zeros(H, device=dev)
    sms, smem = _device.num_sms_at(dev.index or 0), _device.smem_per_block(dev.index or 0)

    def measure():
        dsv4_decode.dsv4_decode_attention(q, comp, topk, swa, swa_slots, sink, HEAD_DIM ** -0.5, comp_bs, swa_bs,
                                          topk_length=topk_len, out=out)  # compile / plan outside the window
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        dsv4_decode.dsv4_decode_attention(q, comp, topk, swa, swa_slots, sink, HEAD_DIM ** -0.5, comp_bs, swa_bs,
                                          topk_length=topk_len, out=out)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    after = measure()
    route, predicted = dsv4_decode.decode_peak_bytes(T, H, K1, K2, sms, smem, True, (comp_bs, swa_bs))
    assert torch.isfinite(out.float()).all()
    print(f"\nK1={K1}: route {route}, measured {after} B, accounted {predicted} B, "
          f"headroom {profile_headroom(T, H)} B")
    assert route != "workspace" and after <= predicted + 4 * 512 and after <= profile_headroom(T, H)
    monkeypatch.setenv(envs.DECODE_KERNEL, "heads")
    before = measure()
    route_b, predicted_b = dsv4_decode.decode_peak_bytes(T, H, K1, K2, sms, smem, True, (comp_bs, swa_bs))
    print(f"K1={K1}: forced workspace step: measured {before} B, accounted {predicted_b} B")
    assert route_b == "workspace" and T * (K1 + K2) * HEAD_DIM * 2 <= before <= predicted_b * 1.01 + (64 << 10)
