"""Exactness counts of the encoders over all 2**32 float32 bit patterns (GPU).

Compares each encoder with torch's saturating cast (clamp to +-448, then float8_e4m3fn) and
writes the mismatch counts, per variant, to codec_exhaustive.{json,md}.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from dsv4_ops import codec, testing  # noqa: E402
from dsv4_ops.csrc_triton import codec as k  # noqa: E402


def main():
    args = common.parse_args(__doc__)
    rows = []
    encoders = [("portable", "exact (fp32-add RNE, the default)", k.ENCODE_EXACT),
                ("portable", "exact, integer only", k.ENCODE_EXACT_INT),
                ("portable", "fast (e4b15)", k.ENCODE_FAST)]
    if torch.cuda.get_device_capability() >= (8, 9):
        encoders.append(("native", "exact (fp8e4nv cvt)", k.ENCODE_NATIVE))
    for variant, label, mode in encoders:
        counts = testing.exhaustive_fp32_encode(lambda x: codec.e4m3_encode(x, variant=variant, mode=mode))
        rows.append({"variant": variant, "encoder": label, **counts})
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    finite = (codes & 0x7F) != 0x7F
    want = codes.view(torch.float8_e4m3fn).float()
    for variant in ("portable", "native"):
        got = codec.e4m3_decode(codes, variant=variant)
        rows.append({"variant": variant, "encoder": "decode: 256 codes", "inputs": 256,
                     "mismatches_non_nan": int((got[finite] != want[finite]).sum()),
                     "nan_inputs": 2, "mismatches_at_midpoints": "-"})
    common.write_results("codec_exhaustive", args.out, rows,
                         ["variant", "encoder", "inputs", "nan_inputs", "mismatches_non_nan", "mismatches_at_midpoints"],
                         "Against x.float().clamp(-448, 448).to(torch.float8_e4m3fn); NaN inputs excluded "
                         "from the mismatch counts. Decode rows: the 254 finite codes against torch.")


if __name__ == "__main__":
    main()
