"""The Any-Precision MoE kernels (SPEC section 7): ``dispatch`` picks a path per call from ``configs/ap_moe.json``
(typed by ``launch``).

Paths: ``decode`` (+ ``decode_dot``, ``bit_transpose``, ``lut_shuffle``, ``pair_sort``, ``layout``), ``mid``,
``prefill`` (both on ``tile``). ``experts`` is the table-addressed weight layout they read; ``ref`` is the
pure-PyTorch reference (dequantizing with ``pwformat.ap``).
"""
