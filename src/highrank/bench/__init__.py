"""Benchmarks of the package's own layers (time and memory)."""
