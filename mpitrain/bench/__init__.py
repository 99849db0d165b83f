"""Benchmarks: collective overhead, single-rank training throughput, speedup curves."""
