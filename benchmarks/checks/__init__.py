"""Correctness, robustness and machine checks: fault campaigns, stop-and-resume under torchrun,
the GPU engines and the CUDA check of a lent machine, the suite's timing, the timed quick tour,
the warm start's agreement with its base model. Each module runs as
``python -m benchmarks.checks.NAME`` from the repository root; the index is
benchmarks/README.md."""
