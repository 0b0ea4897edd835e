"""Triton kernels (fused mixed-precision MoE, paged attention), each beside its PyTorch reference.

Empty until the kernel issue lands; the reference math lives in ``pwrun.model.moe`` and
``pwrun.model.attention``.
"""
