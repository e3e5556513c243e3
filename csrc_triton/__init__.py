"""Triton kernels and device helpers of dsv4_ops (installed as ``dsv4_ops.csrc_triton``)."""
