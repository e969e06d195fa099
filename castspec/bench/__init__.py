"""Benchmarks: engine speed against transformers, and the method comparison harness."""
