"""The MoE kernels (SPEC section 7). Any-Precision experts: ``dispatch`` picks a path per call from
``configs/ap_moe.json`` (typed by ``launch``); paths ``decode`` (+ ``decode_dot``, ``bit_transpose``, ``lut_shuffle``,
``pair_sort``, ``layout``), ``mid``, ``prefill`` (both on ``tile``). 16-bit experts: ``dense`` (GEMV and grouped
GEMM). ``experts`` is the table-addressed weight layout they read; ``ref`` holds the pure-PyTorch references
(dequantizing with ``pwformat.ap``).
"""
