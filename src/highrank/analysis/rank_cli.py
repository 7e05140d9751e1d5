"""``highrank analyze rank RUN_DIR...``: each run's log-probability matrix on a split, its
Press rank, epsilon-effective ranks, singular values and the spectrum plot.

Per run, in ``RUN_DIR/analysis/`` (``TAG`` = split and checkpoint, e.g. ``test-best``, plus
``-logits`` or ``-first<N>`` when asked):

* ``rank-TAG.json``: the record (shape, Press rank and threshold, effective ranks, timings);
* ``rank-TAG.singular_values.npy``: every singular value, descending (float64);
* ``logprob-TAG.npy`` (+ ``.json``, ``.contexts.npz``): the matrix, kept with
  ``--keep-matrix`` (PTB test: 3.3 GB) and otherwise deleted once its rank is known.

An interrupted run resumes: the matrix is only deleted after success and is reused when its
record matches, and the Gram matrix is checkpointed in ``rank-TAG.state/``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from highrank.analysis.commands import add_run_arguments
from highrank.analysis.contexts import load_run_split
from highrank.analysis.logprob_matrix import (
    MATRIX_KINDS,
    contexts_path,
    matrix_record,
    write_log_prob_matrix,
)
from highrank.analysis.output import (
    ANALYSIS_DIR,
    record_tag,
    run_record_path,
    text_table,
    write_json,
)
from highrank.analysis.rank import (
    EFFECTIVE_RANK_EPSILONS,
    GRAM_BACKENDS,
    rank_report_file,
    resolve_backend,
)
from highrank.analysis.spectrum import plot_spectrum
from highrank.checkpoint import checkpoint_path
from highrank.cli import positive_int


def analyze_run(
    run_dir: str | Path,
    *,
    split: str = "test",
    which: str = "best",
    data_dir: str | None = None,
    kind: str = "log_prob",
    batch_size: int = 1,
    bptt: int = 70,
    max_contexts: int | None = None,
    keep_matrix: bool = False,
    backend: str = "auto",
    device: str = "cpu",
    block_rows: int = 2048,
    checkpoint_seconds: float = 600.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Write (or reuse) the run's matrix, compute its rank, save and return the record."""
    run_dir = Path(run_dir)
    resolve_backend(backend, device)  # a bad pair fails now, not after the matrix is written
    tag = record_tag(split, which, kind=kind, max_contexts=max_contexts)
    folder = run_dir / ANALYSIS_DIR
    matrix_path = folder / f"logprob-{tag}.npy"
    settings = {
        "split": split,
        "which": which,
        "kind": kind,
        "batch_size": batch_size,
        "bptt": bptt,
        "max_contexts": max_contexts,
        "checkpoint_file": _file_fingerprint(checkpoint_path(run_dir, which)),
        "data_dir": None if data_dir is None else str(Path(data_dir).resolve()),
    }
    began = time.perf_counter()
    head = _ensure_matrix(run_dir, matrix_path, settings, data_dir, device, progress)
    matrix_seconds = time.perf_counter() - began
    began = time.perf_counter()
    report = rank_report_file(
        matrix_path,
        block_rows=block_rows,
        backend=backend,
        device=device,
        state_dir=folder / f"rank-{tag}.state",
        checkpoint_seconds=checkpoint_seconds,
        progress=progress,
    )
    rank_seconds = time.perf_counter() - began
    values = report.pop("singular_values")
    values_path = folder / f"rank-{tag}.singular_values.npy"
    np.save(values_path, values)
    record = {
        "run_dir": str(run_dir),
        "head": head,
        "checkpoint": which,  # as the other analyses' records name it
        **settings,
        **report,
        "s_max": float(values[0]),
        "singular_values_file": values_path.name,
        "matrix_seconds": round(matrix_seconds, 2),
        "rank_seconds": round(rank_seconds, 2),
        "backend": backend,
        "device": device,
    }
    write_json(run_record_path(run_dir, "rank", tag), record)
    if not keep_matrix:
        for path in (matrix_path, matrix_path.with_suffix(".json"), contexts_path(matrix_path)):
            path.unlink(missing_ok=True)
    return record


def _ensure_matrix(run_dir, matrix_path, settings, data_dir, device, progress) -> str:
    """Reuse ``matrix_path`` when it was written by this function with ``settings`` (same
    split, checkpoint file, reading options); write it otherwise. Returns the head's name."""
    if matrix_path.is_file() and matrix_path.with_suffix(".json").is_file():
        existing = matrix_record(matrix_path)
        if "head_name" in existing and all(existing.get(k) == v for k, v in settings.items()):
            return existing["head_name"]
    loaded = load_run_split(
        run_dir, settings["split"], which=settings["which"], data_dir=data_dir, device=device
    )
    if progress:
        print(f"{run_dir}: writing the {settings['kind']} matrix of {loaded.source}")
    write_log_prob_matrix(
        matrix_path,
        loaded.model,
        loaded.ids,
        kind=settings["kind"],
        batch_size=settings["batch_size"],
        bptt=settings["bptt"],
        max_contexts=settings["max_contexts"],
        progress=progress,
        source=loaded.source,
        metadata={**settings, "run_dir": str(run_dir), "head_name": loaded.config.head.name},
    )
    return loaded.config.head.name


def _file_fingerprint(path: Path) -> dict[str, Any]:
    """Name, size and modification time: a rewritten checkpoint no longer matches."""
    if not path.is_file():
        from highrank.checkpoint import CheckpointError

        raise CheckpointError(f"checkpoint {path} does not exist")
    stat = path.stat()
    return {"file": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def run_label(record: dict[str, Any]) -> str:
    """``<run folder> (<head>, <tag>)``: how a record is named in tables and legends."""
    tag = record_tag(
        record["split"], record["which"], kind=record["kind"], max_contexts=record["max_contexts"]
    )
    return f"{Path(record['run_dir']).name} ({record['head']}, {tag})"


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """One row per run: contexts x vocabulary, Press rank, effective ranks, s_max, seconds."""
    epsilons = [str(eps) for eps in EFFECTIVE_RANK_EPSILONS]
    headers = [
        "run",
        "matrix",
        "Press rank",
        *[f"eff. rank {e}" for e in epsilons],
        "s_max",
        "seconds",
    ]
    rows = [
        [
            run_label(r),
            f"{r['shape'][0]:,} x {r['shape'][1]:,}",
            r["press_rank"],
            *[r["effective_rank"][e] for e in epsilons],
            r["s_max"],
            r["matrix_seconds"] + r["rank_seconds"],
        ]
        for r in records
    ]
    return text_table(headers, rows, markdown=markdown)


def write_spectrum(records: list[dict[str, Any]], path: Path) -> Path:
    """The spectrum plot of rank records, whose singular values were saved beside them in
    ``<run_dir>/analysis/`` (``run_dir`` as the record says, or as the reader found it)."""
    curves, thresholds, floors = {}, {}, []
    for record in records:
        label = run_label(record)
        folder = Path(record["run_dir"]) / ANALYSIS_DIR
        curves[label] = np.load(folder / record["singular_values_file"])
        thresholds[label] = record["press_threshold"] / record["s_max"]
        if "resolution" in record:
            floors.append(record["resolution"] / record["s_max"])
    floor = max(floors, default=None)
    return plot_spectrum(curves, path, press_thresholds=thresholds, resolution=floor)


# ---- command line (wired into `highrank analyze rank` by analysis/commands.py) ------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument(
        "--kind",
        choices=MATRIX_KINDS,
        default="log_prob",
        help="log_prob, or the transformed logits of the softmax family (log_prob)",
    )
    parser.add_argument(
        "--max-contexts",
        type=positive_int,
        help="only the first N contexts (default: the whole split)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="columns the split is read in (1: stream order, as the papers)",
    )
    parser.add_argument("--bptt", type=positive_int, default=70, help="segment length (70)")
    parser.add_argument(
        "--keep-matrix",
        action="store_true",
        help="keep the matrix .npy in RUN_DIR/analysis (default: delete it)",
    )
    parser.add_argument("--backend", choices=GRAM_BACKENDS, default="auto", help="(auto)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    parser.add_argument(
        "--block-rows", type=positive_int, default=2048, help="rows read at a time (2048)"
    )
    parser.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=10.0,
        help="minutes between Gram-matrix checkpoints (10)",
    )
    parser.add_argument("--out", help="also write rank.json, rank.md and spectrum.png here")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    records = []
    for run_dir in args.run_dirs:
        record = analyze_run(
            run_dir,
            split=args.split,
            which=args.which,
            data_dir=args.data_dir,
            kind=args.kind,
            batch_size=args.batch_size,
            bptt=args.bptt,
            max_contexts=args.max_contexts,
            keep_matrix=args.keep_matrix,
            backend=args.backend,
            device=args.device,
            block_rows=args.block_rows,
            checkpoint_seconds=args.checkpoint_minutes * 60,
            progress=not args.no_progress,
        )
        records.append(record)
        tag = record_tag(args.split, args.which, kind=args.kind, max_contexts=args.max_contexts)
        print(f"wrote {run_record_path(run_dir, 'rank', tag)}")
    print(summary_table(records), end="")
    if args.out:
        out = Path(args.out)
        write_json(out / "rank.json", {"runs": records})
        (out / "rank.md").write_text(summary_table(records, markdown=True), encoding="utf-8")
        plot = write_spectrum(records, out / "spectrum.png")
        print(f"wrote {out / 'rank.json'}, {out / 'rank.md'}, {plot}")
    return 0
