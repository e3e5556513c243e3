"""dsv4_ampere::e4m3_decode and dsv4_ampere::e4m3_encode."""

import torch

from dsv4_ops import codec, reference
from .library import OpDef


def _e4m3_decode_fake(codes):
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


def _e4m3_encode_fake(x, exact=True):
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


def _e4m3_encode_cuda(x, exact=True):
    return codec.e4m3_encode(x, exact)


def _e4m3_encode_cpu(x, exact=True):
    return reference.ref_e4m3_encode(x, exact)


OPS = (
    OpDef("e4m3_decode", "(Tensor codes) -> Tensor",
          cuda=codec.e4m3_decode, cpu=reference.ref_e4m3_decode, fake=_e4m3_decode_fake),
    OpDef("e4m3_encode", "(Tensor x, bool exact=True) -> Tensor",
          cuda=_e4m3_encode_cuda, cpu=_e4m3_encode_cpu, fake=_e4m3_encode_fake),
)
