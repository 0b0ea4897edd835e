"""pwcal: offline calibration of PagedWeight (quantization, sensitivity, residual heads, buckets)."""
