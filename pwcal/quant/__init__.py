"""Any-Precision quantization of expert weights (SqueezeLLM seed + AP nested upscaling)."""
