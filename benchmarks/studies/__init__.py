"""The experiments behind the results pages: each trains or analyses models with highrank's own
commands and records what it found under ``benchmarks/results/<study>/`` (with a README.md).
Each module runs as ``python -m benchmarks.studies.NAME`` from the repository root; the index
is benchmarks/README.md."""
