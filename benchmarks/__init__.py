"""The studies and measurements behind the numbers in README.md, docs/ and benchmarks/results/.

A package, not part of the library: run each script as a module from the repository root,
``python -m benchmarks.NAME --help``. What the scripts share lives in :mod:`benchmarks._common`
(repository paths, running the ``highrank`` command, machine facts, JSON records, committing
results) and :mod:`benchmarks.study` (the resumable runner of a study's stages).
"""
