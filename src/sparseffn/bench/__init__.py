"""Benchmark harness: synthetic activations, timing, CSV schema, plots."""
