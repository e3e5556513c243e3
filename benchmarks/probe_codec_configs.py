"""Probe: bf16 -> E4M3 exact encode (portable) under a few launch configs (BLOCK, num_warps)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from dsv4_ops import codec  # noqa: E402
from dsv4_ops.csrc_triton import codec as k  # noqa: E402

args = common.parse_args(__doc__)
xbf = torch.randn(128 << 20, device="cuda").bfloat16() * 200
rows = []
for block in (1024, 2048, 4096, 8192):
    for warps in (4, 8):
        k.CODEC_CONFIG.update({"BLOCK": block, "num_warps": warps})
        for label, variant, mode in (("portable exact", "portable", k.ENCODE_EXACT), ("native", "native", k.ENCODE_NATIVE)):
            us = common.time_us(lambda: codec.e4m3_encode(xbf, variant=variant, mode=mode))
            rows.append({"BLOCK": block, "num_warps": warps, "encoder": label, "us": us, "GB/s": 3 * xbf.numel() / us / 1e3})
common.write_results("codec_configs", args.out, rows, ["BLOCK", "num_warps", "encoder", "us", "GB/s"],
                     "bf16 input (256 MiB); launch-config probe behind csrc_triton/codec.py's CODEC_CONFIG.")
