"""dsv4_ampere::engram_lookup (DeepSeek-V4.1 Engram rows from an E4M3 table, read as uint8)."""

from dsv4_ops import engram, reference
from .library import OpDef


def _engram_lookup_cuda(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                        sorted_dst=None, max_programs=0):
    engram.engram_lookup(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                         sorted_dst, max_programs)


def _engram_lookup_cpu(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                       sorted_dst=None, max_programs=0):
    engram.check_lookup_args(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                             sorted_dst, max_programs)
    reference.ref_engram_lookup(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                                sorted_dst)


def _engram_lookup_fake(weight, scales, ids, out, vocab_start, vocab_end, head_start, total_heads,
                        sorted_dst=None, max_programs=0):
    return None


OPS = (
    OpDef("engram_lookup",
          "(Tensor weight, Tensor scales, Tensor ids, Tensor(a!) out, int vocab_start, int vocab_end, "
          "int head_start, int total_heads, Tensor? sorted_dst=None, int max_programs=0) -> ()",
          cuda=_engram_lookup_cuda, cpu=_engram_lookup_cpu, fake=_engram_lookup_fake),
)
