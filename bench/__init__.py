"""Benchmark suites, run from the repository root as ``python -m bench.<suite>`` (see docs/performance.md)."""
