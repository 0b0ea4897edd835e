"""Any-Precision (AP) expert weights: bit-plane packing, memory accounting, artifact reading."""
