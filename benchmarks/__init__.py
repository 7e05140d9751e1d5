"""The studies and measurements behind the numbers in README.md, docs/ and benchmarks/results/.

A package, not part of the library: run each script as a module from the repository root,
``python -m benchmarks.GROUP.NAME --help``, GROUP one of :mod:`benchmarks.heads` (what heads and
kernels cost), :mod:`benchmarks.studies` (the experiments with results pages) and
:mod:`benchmarks.checks` (correctness, robustness and machine checks). What the scripts share
lives in :mod:`benchmarks._common` (repository paths, running the ``highrank`` command, machine
facts, the writers of records, committing results) and :mod:`benchmarks.study` (the resumable
runner of a study's stages). The index is benchmarks/README.md.
"""
