"""Triton kernels, each file with its launcher and pure-PyTorch ``*_ref`` twin; leaves of the import graph.

``moe/`` (the Any-Precision MoE: decode, mid-size and prefill paths, dispatch, reference), ``paged_attention``,
``dense_gemv``, ``norm``, ``rope_kv``, ``route_topk``, ``warmup`` (compile decode kernels before serving);
launch configs are data in ``configs/*.json``. Nothing here imports the runtime.
"""
