"""The benchmarks' name for dsv4_ops.tools.green_ctx (driver green contexts: CUDA work confined to N
SMs), kept so ``from green_ctx import GreenStream`` keeps working beside the scripts.

    python benchmarks/green_ctx.py [N ...]      # the SMs each count's stream reaches, and a probe's time
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_ops.tools.green_ctx import (  # noqa: E402,F401
    GreenContextError,
    GreenStream,
    _main,
    device_sms,
    green_stream,
    smids_used,
)

if __name__ == "__main__":
    _main([int(a) for a in sys.argv[1:]] or [device_sms(0), 112, 104])
