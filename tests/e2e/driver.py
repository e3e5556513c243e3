"""End-to-end driver: one process runs vLLM 0.33.0's DeepSeek model with the plugin (see
test_e2e.py, which runs this module in a subprocess and reads its JSON report)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def setup(device: str):
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    import platform_spoof
    cpu = device == "cpu"
    platform_spoof.set_environment(cpu)
    if cpu:
        import interpreter_patch
        interpreter_patch.apply()
    import torch  # noqa: F401
    import standins
    standins.install(cpu=cpu)
    import vllm  # noqa: F401
    platform_spoof.spoof_platform(cpu)
    if cpu:
        platform_spoof.cpu_streams()
    from dsv4_ops.vllm import plugin
    plugin.register()
    assert plugin.STATE.routed, f"plugin did not route: {plugin.STATE}"
    platform_spoof.enable_cuda_answers()
    return plugin


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v41")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    plugin = setup(a.device)
    import build
    import standins
    import vllm.models.deepseek_v41.nvidia.model  # noqa: F401 (the modules whose names are rebound)
    print("mhc stand-ins:", standins.install_mhc())
    if a.device == "cpu":
        import platform_spoof
        platform_spoof.cpu_vllm_streams()
    b = build.build(build.V41_CONFIG, a.device)
    print("built", time.time() - t0, len(b.kv_caches), b.kernel_block_sizes,
          b.vllm_config.cache_config.block_size, b.vllm_config.cache_config.cache_dtype, flush=True)
    import torch
    import steps
    sch = steps.Scheduler(b)
    g = torch.Generator().manual_seed(1)
    P = 40
    sch.add(0, torch.randint(2, 500, (P + 4,), generator=g).tolist())
    h, logits, bt = sch.step([(0, P)])
    print("prefill", time.time() - t0, logits.shape, torch.isfinite(logits).all().item(), flush=True)


if __name__ == "__main__":
    main()
