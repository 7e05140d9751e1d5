"""Cost, speed and memory of the heads and their kernels: step times, inference and generation
speed, peak memory, compiled against eager, at the papers' shapes and at scale. Each module
runs as ``python -m benchmarks.heads.NAME`` from the repository root; the index is
benchmarks/README.md."""
