"""Rank of a large log-probability matrix: highrank's streamed Gram method against
``numpy.linalg.svd`` on the whole matrix in memory, side by side on one machine.

    python -m benchmarks.heads.rank_at_scale MATRIX.npy [--rows N] [--methods numpy,gram]
        [--repeats 1] [--out benchmarks/results/rank-at-scale/NAME.json]

MATRIX.npy is a float32 log-probability matrix, e.g. written by
``highrank analyze rank RUN_DIR --keep-matrix`` (RUN_DIR/analysis/logprob-test-best.npy);
``--rows N`` takes its first N rows. Each (method, repeat) runs in a fresh process, so that
its peak resident memory (VmHWM, counted from after the imports) is its own; methods
alternate within each repeat. Both methods compute every singular value:

* numpy: ``np.load`` (whole matrix in RAM) then ``np.linalg.svd(A, compute_uv=False)`` in
  float32, as ``numpy.linalg.matrix_rank`` does;
* gram: :func:`highrank.analysis.rank.rank_report_file` (float64 Gram matrix from blocks of
  rows, then its eigenvalues) with the default backend; ``gram-torch`` and ``gram-scipy``
  name the backend.

The record holds each run's seconds and peak MiB, the Press and effective ranks of both, and
the largest difference between their singular values relative to s_max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.linalg  # noqa: F401  imported before timing: the gram method uses it
import scipy.linalg.blas  # noqa: F401

from benchmarks._common import module_name, save_array, write_json
from highrank.analysis.rank import (
    EFFECTIVE_RANK_EPSILONS,
    effective_rank,
    press_rank_from_singular_values,
    rank_report_file,
)
from highrank.bench.heads import proc_status_kib, reset_peak_rss
from highrank.util.machine import describe_machine

MODULE = module_name(__file__)  # benchmarks.heads.rank_at_scale

METHODS = ("numpy", "gram", "gram-torch", "gram-scipy")  # gram: the default backend


def child(method: str, path: str, values_out: str) -> dict:
    """One measurement in this (fresh) process; singular values saved to ``values_out``."""
    reset_peak_rss()
    start_kib = proc_status_kib("VmRSS")
    began = time.perf_counter()
    if method == "numpy":
        matrix = np.load(path)
        values = np.linalg.svd(matrix, compute_uv=False).astype(np.float64)
        shape, dtype = matrix.shape, matrix.dtype
        del matrix
    else:
        backend = method.removeprefix("gram").removeprefix("-") or "auto"
        report = rank_report_file(path, backend=backend)
        values, shape, dtype = report["singular_values"], report["shape"], np.float32
    seconds = time.perf_counter() - began
    save_array(values_out, values)
    return {
        "method": method,
        "seconds": seconds,
        "peak_mib": (proc_status_kib("VmHWM") - start_kib) / 1024,
        "press_rank": press_rank_from_singular_values(values, tuple(shape), dtype),
        "effective_rank": {str(e): effective_rank(values, e) for e in EFFECTIVE_RANK_EPSILONS},
    }


def prefix_file(path: Path, rows: int, folder: Path) -> Path:
    """The first ``rows`` rows of the matrix at ``path`` as a .npy in ``folder``."""
    matrix = np.load(path, mmap_mode="r")
    if rows > matrix.shape[0]:
        raise SystemExit(f"--rows {rows} exceeds the {matrix.shape[0]} rows of {path}")
    target = folder / f"first{rows}.npy"
    save_array(target, np.ascontiguousarray(matrix[:rows]))
    return target


def measure(path: Path, methods: list[str], repeats: int, scratch: Path) -> dict:
    runs, values = [], {}
    for repeat in range(repeats):
        for method in methods:
            out = scratch / f"{method}-{repeat}.npy"
            child = ["-m", MODULE, "--child", method, str(path), str(out)]
            command = [sys.executable, *child]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            runs.append({"repeat": repeat, **json.loads(result.stdout.splitlines()[-1])})
            values[method] = np.load(out)
            print(
                f"  {method} run {repeat + 1}/{repeats}: {runs[-1]['seconds']:.1f} s, "
                f"peak {runs[-1]['peak_mib']:.0f} MiB",
                flush=True,
            )
    summary = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        summary[method] = {
            "median_seconds": statistics.median(r["seconds"] for r in mine),
            "median_peak_mib": statistics.median(r["peak_mib"] for r in mine),
            "press_rank": mine[0]["press_rank"],
            "effective_rank": mine[0]["effective_rank"],
        }
    reference = methods[0]  # every other method is compared with the first one named
    for method in methods[1:]:
        a, b = values[reference], values[method]
        summary[method][f"max_relative_difference_to_{reference}"] = float(
            np.max(np.abs(a - b)) / a[0]
        )
        for key, field in (("time", "median_seconds"), ("memory", "median_peak_mib")):
            summary[method][f"{key}_ratio_to_{reference}"] = (
                summary[method][field] / summary[reference][field]
            )
    return {"runs": runs, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("matrix", type=Path)
    parser.add_argument("--rows", type=int, help="only the first N rows")
    parser.add_argument("--methods", default="numpy,gram")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    with tempfile.TemporaryDirectory(dir=args.matrix.parent) as scratch:
        scratch = Path(scratch)
        path = prefix_file(args.matrix, args.rows, scratch) if args.rows else args.matrix
        shape = np.load(path, mmap_mode="r").shape
        print(f"{path.name}: {shape[0]:,} x {shape[1]:,} float32", flush=True)
        result = measure(path, methods, args.repeats, scratch)
    result = {
        "matrix": str(args.matrix),
        "shape": list(shape),
        "repeats": args.repeats,
        "machine": describe_machine(),
        **result,
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:])))
    else:
        main()
