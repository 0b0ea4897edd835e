"""Formats and costs, the bottom layer: the AP bit-plane codec, the cost model (M_i^b, page rounding, KV block
bytes, bytes read per decode step), the artifact manifest, Parquet tables, atomic writes and user errors.

It imports nothing of pwrun, pwcal or kernels; only ``pwformat.ap`` (the codec) imports torch.
"""
