"""Calibration statistics gathered while the lean model runs (observers of its MoE layers)."""
