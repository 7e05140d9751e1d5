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

``highrank analyze rank --hf MODEL --text FILE --out DIR`` does the same for a Hugging Face
causal LM (a model folder or a ``.gguf`` file), its contexts read from the text in windows as
:mod:`highrank.analysis.hf_contexts` says; the same files, with ``TAG`` =
``<model>-<text stem>[-w<W>][-bos][-first<N>]``, go to ``DIR``. Before the forward passes it
states the memory the Gram matrix will need (on the smaller side: ``A A^T`` when there are
fewer contexts than words) and refuses, in one line, what would not fit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.commands import add_run_arguments
from highrank.analysis.contexts import load_run_split
from highrank.analysis.hf_contexts import (
    HFInputError,
    count_text_contexts,
    hf_mode,
    hf_tag,
    load_text_contexts,
    model_source,
    path_fingerprint,
    vocab_width,
    write_hf_logprob_matrix,
)
from highrank.analysis.logprob_matrix import (
    MATRIX_KINDS,
    DiskSpaceError,
    check_disk_space,
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
    GramMemoryError,
    plan_gram,
    rank_report_file,
    resolve_backend,
)
from highrank.analysis.spectrum import plot_spectrum
from highrank.runs.checkpoint import checkpoint_path
from highrank.runs.locks import LockedError, exclusive
from highrank.util.argtypes import positive_int


def analyze_run(
    run_dir: str | Path,
    *,
    split: str = "test",
    which: str = "best",
    data_dir: str | None = None,
    kind: str = "log_prob",
    batch_size: int = 1,
    bptt: int | None = None,
    max_contexts: int | None = None,
    keep_matrix: bool = False,
    backend: str = "auto",
    device: str = "cpu",
    block_rows: int = 2048,
    checkpoint_seconds: float = 600.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Write (or reuse) the run's matrix, compute its rank, save and return the record.

    ``bptt`` None: the run's own segment length (:func:`highrank.evaluate.default_bptt`)."""
    run_dir = Path(run_dir)
    resolve_backend(backend, device)  # a bad pair fails now, not after the matrix is written
    if bptt is None:
        bptt = _run_bptt(run_dir)
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
        "checkpoint_file": file_fingerprint(checkpoint_path(run_dir, which)),
        "data_dir": None if data_dir is None else str(Path(data_dir).resolve()),
    }
    folder.mkdir(parents=True, exist_ok=True)
    # One process per record: the matrix, its temporary and the Gram state have fixed names.
    with exclusive(folder / f"rank-{tag}.lock", f"the rank record {tag} of {run_dir}"):
        began = time.perf_counter()
        head = _ensure_matrix(run_dir, matrix_path, settings, data_dir, device, progress)
        matrix_seconds = time.perf_counter() - began
        record = {
            "run_dir": str(run_dir),
            "head": head,
            "checkpoint": which,  # as the other analyses' records name it
            **settings,
            "matrix_seconds": round(matrix_seconds, 2),
        }
        options = {"backend": backend, "device": device, "block_rows": block_rows}
        return _rank_of_matrix(
            matrix_path,
            folder,
            tag,
            record,
            run_record_path(run_dir, "rank", tag),
            keep_matrix=keep_matrix,
            checkpoint_seconds=checkpoint_seconds,
            progress=progress,
            **options,
        )


def _rank_of_matrix(
    matrix_path: Path,
    folder: Path,
    tag: str,
    record: dict[str, Any],
    record_path: Path,
    *,
    keep_matrix: bool,
    backend: str,
    device: str,
    block_rows: int,
    checkpoint_seconds: float,
    progress: bool,
) -> dict[str, Any]:
    """The rank report of the matrix at ``matrix_path``, added to ``record`` and saved to
    ``record_path``, the singular values beside it in ``folder``; the Gram matrix is
    checkpointed in ``folder/rank-TAG.state``. The matrix is deleted unless kept."""
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
        **record,
        **report,
        "s_max": float(values[0]),
        "singular_values_file": values_path.name,
        "rank_seconds": round(rank_seconds, 2),
        "backend": backend,
        "device": device,
    }
    write_json(record_path, record)
    if not keep_matrix:
        for path in (matrix_path, matrix_path.with_suffix(".json"), contexts_path(matrix_path)):
            path.unlink(missing_ok=True)
    return record


def analyze_hf(
    model_path: str | Path,
    text_path: str | Path,
    out: str | Path,
    *,
    window: int | None = None,
    bos: bool = False,
    max_contexts: int | None = None,
    batch_windows: int | None = None,
    keep_matrix: bool = False,
    backend: str = "auto",
    device: str = "cpu",
    block_rows: int = 2048,
    checkpoint_seconds: float = 600.0,
    progress: bool = False,
) -> dict[str, Any]:
    """:func:`analyze_run` for a Hugging Face causal LM (a model folder or a ``.gguf`` file)
    on a text, read as :mod:`highrank.analysis.hf_contexts` says; everything goes to
    ``out``: ``rank-TAG.json``, ``rank-TAG.singular_values.npy``, the matrix while it is
    needed (``logprob-TAG.npy``, reused when its settings match) and ``rank-TAG.state/``.
    The memory of the Gram matrix is stated and checked before the forward passes."""
    out = Path(out)
    resolve_backend(backend, device)  # a bad pair fails now, not after the matrix is written
    tag = hf_tag(model_path, text_path, window=window, bos=bos, max_contexts=max_contexts)
    matrix_path = out / f"logprob-{tag}.npy"
    model_source(model_path)  # a bad path fails before anything else
    if not Path(text_path).is_file():
        raise HFInputError(f"text file {text_path} does not exist")
    settings = {
        "model_fingerprint": path_fingerprint(model_path),
        "text_fingerprint": path_fingerprint(text_path),
        "window_asked": window,
        "bos": bos,
        "max_contexts": max_contexts,
    }
    options = {"backend": backend, "device": device, "block_rows": block_rows}
    record, seconds = _ensure_hf_matrix(
        model_path, text_path, matrix_path, settings, batch_windows, progress, options
    )
    record = {
        "tag": tag,
        "out_dir": str(out),
        **{key: value for key, value in record.items() if key not in _MATRIX_ONLY},
        **seconds,
        "threads": torch.get_num_threads(),
    }
    return _rank_of_matrix(
        matrix_path,
        out,
        tag,
        record,
        out / f"rank-{tag}.json",
        keep_matrix=keep_matrix,
        checkpoint_seconds=checkpoint_seconds,
        progress=progress,
        **options,
    )


# Keys of a matrix's side record that describe the file, not the analysis.
_MATRIX_ONLY = ("matrix", "shape", "dtype", "kind", "hf_settings")


def _ensure_hf_matrix(
    model_path, text_path, matrix_path, settings, batch_windows, progress, options
):
    """``(side record, seconds)`` of the matrix at ``matrix_path``: reused when it was
    written with ``settings`` (same model and text files, reading options), written
    otherwise; ``seconds`` are those of loading the model and text and of the forward
    passes (with the writing), this time."""
    if matrix_path.is_file() and matrix_path.with_suffix(".json").is_file():
        existing = matrix_record(matrix_path)
        if existing.get("hf_settings") == settings:
            return existing, {"matrix_reused": True, "load_seconds": 0.0, "matrix_seconds": 0.0}
    began = time.perf_counter()
    loaded = load_text_contexts(
        model_path,
        text_path,
        window=settings["window_asked"],
        bos=settings["bos"],
        device=options["device"],
        progress=progress,
    )
    load_seconds = time.perf_counter() - began
    rows = count_text_contexts(loaded.ids.numel(), settings["max_contexts"])
    width = vocab_width(loaded.model) or len(loaded.tokenizer)
    plan = plan_gram((rows, width), **options)
    check_disk_space(matrix_path, (rows, width))
    if progress:
        print(f"{loaded.name}: {loaded.ids.numel():,} tokens of {text_path}; {plan.describe()}")
    plan.check()  # before the forward passes, not after them
    began = time.perf_counter()
    record = write_hf_logprob_matrix(
        loaded.model,
        loaded.ids,
        matrix_path,
        window=loaded.window,
        bos_token_id=loaded.bos_token_id,
        max_contexts=settings["max_contexts"],
        batch_windows=batch_windows,
        progress=progress,
        source=str(text_path),
        metadata={**loaded.record(settings["max_contexts"]), "hf_settings": settings},
    )
    seconds = {
        "matrix_reused": False,
        "load_seconds": round(load_seconds, 2),
        "matrix_seconds": round(time.perf_counter() - began, 2),
    }
    return record, seconds


def _run_bptt(run_dir: Path) -> int:
    """The segment length the run's saved config implies (read without loading the model)."""
    from highrank.config import load_config
    from highrank.evaluate.perplexity import default_bptt
    from highrank.runs.run_dir import RunDirError

    path = run_dir / "config.toml"
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no config.toml; expected a run directory of `highrank train`"
        )
    return default_bptt(load_config(path))


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


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Name, size and modification time: a rewritten checkpoint no longer matches."""
    if not path.is_file():
        from highrank.runs.checkpoint import CheckpointError, missing_best_hint

        if path.name == "best.pt":  # the same hint as every verb
            raise CheckpointError(missing_best_hint(path.parent.parent))
        raise CheckpointError(f"checkpoint {path} does not exist")
    stat = path.stat()
    return {"file": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def run_label(record: dict[str, Any]) -> str:
    """``<run folder> (<head>, <tag>)``: how a record is named in tables and legends;
    ``<model> (<text file>, <contexts> contexts, window <W>)`` for a Hugging Face model."""
    if "model" in record:
        return (
            f"{record['model_name']} ({Path(record['text']).name}, "
            f"{record['shape'][0]:,} contexts, window {record['window']})"
        )
    tag = record_tag(
        record["split"], record["which"], kind=record["kind"], max_contexts=record["max_contexts"]
    )
    return f"{Path(record['run_dir']).name} ({record['head']}, {tag})"


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """One row per run: contexts x vocabulary, Press rank, effective ranks, s_max, seconds
    (loading a --hf model, writing the matrix, its rank)."""
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
            r.get("load_seconds", 0.0) + r["matrix_seconds"] + r["rank_seconds"],
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
        folder = Path(record.get("out_dir") or Path(record["run_dir"]) / ANALYSIS_DIR)
        curves[label] = np.load(folder / record["singular_values_file"])
        thresholds[label] = record["press_threshold"] / record["s_max"]
        if "resolution" in record:
            floors.append(record["resolution"] / record["s_max"])
    floor = max(floors, default=None)
    return plot_spectrum(curves, path, press_thresholds=thresholds, resolution=floor)


# ---- command line (wired into `highrank analyze rank` by analysis/commands.py) ------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, hf=True)
    parser.add_argument(
        "--kind",
        choices=MATRIX_KINDS,
        default="log_prob",
        help="log_prob, or the transformed logits of the softmax family (log_prob)",
    )
    parser.add_argument(
        "--max-contexts",
        type=positive_int,
        help="only the first N contexts (default: the whole split or text)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="columns the split is read in (1: stream order, as the papers)",
    )
    parser.add_argument(
        "--bptt",
        type=positive_int,
        help="segment length (default: a Transformer run's train.bptt, its training window; "
        "70 for AWD-LSTM runs)",
    )
    parser.add_argument(
        "--keep-matrix",
        action="store_true",
        help="keep the matrix .npy in RUN_DIR/analysis or --out (default: delete it)",
    )
    parser.add_argument("--backend", choices=GRAM_BACKENDS, default="auto", help="(auto)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    parser.add_argument(
        "--block-rows",
        type=positive_int,
        default=2048,
        help="rows read at a time, and the panel of A A^T when contexts < words (2048)",
    )
    parser.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=10.0,
        help="minutes between Gram-matrix checkpoints (10)",
    )
    parser.add_argument(
        "--out",
        help="also write rank.json, rank.md and spectrum.png here (with --hf: every record)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    try:
        records, written = _hf_records(args) if hf_mode(args) else _run_records(args)
    except (HFInputError, GramMemoryError, DiskSpaceError, LockedError) as error:
        print(f"highrank analyze rank: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(summary_table(records), end="")
    if args.out:
        out = Path(args.out)
        write_json(out / "rank.json", {"runs": records})
        (out / "rank.md").write_text(summary_table(records, markdown=True), encoding="utf-8")
        plot = write_spectrum(records, out / "spectrum.png")
        print(f"wrote {out / 'rank.json'}, {out / 'rank.md'}, {plot}")
    return 0


def _run_records(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[Path]]:
    records, written = [], []
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
        written.append(run_record_path(run_dir, "rank", tag))
    return records, written


def _hf_records(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[Path]]:
    if args.kind != "log_prob":
        raise HFInputError("--kind logits needs a highrank head; --hf models give log_prob")
    records, written = [], []
    for model_path in args.hf:
        record = analyze_hf(
            model_path,
            args.text,
            args.out,
            window=args.window,
            bos=args.bos,
            max_contexts=args.max_contexts,
            batch_windows=args.batch_windows,
            keep_matrix=args.keep_matrix,
            backend=args.backend,
            device=args.device,
            block_rows=args.block_rows,
            checkpoint_seconds=args.checkpoint_minutes * 60,
            progress=not args.no_progress,
        )
        records.append(record)
        written.append(Path(args.out) / f"rank-{record['tag']}.json")
    return records, written
