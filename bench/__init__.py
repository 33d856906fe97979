"""Benchmarks, run as ``python -m semblend_sglang.bench [JOB]``."""
