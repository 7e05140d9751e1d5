"""``highrank analyze kl``: expected pairwise KL divergence of runs or --hf models
(:mod:`highrank.analysis.kl`): one record per run, a table, a summary with ``--out``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from highrank.analysis.contexts import load_run_split
from highrank.analysis.hf_contexts import HFInputError
from highrank.analysis.kl import (
    DEFAULT_PAIRS,
    PROTOCOL,
    KLError,
    causal_lm_pairwise_kl,
    matrix_pairwise_kl,
    open_matrix,
    run_pairwise_kl,
)
from highrank.analysis.logprob_matrix import matrix_record
from highrank.analysis.output import record_tag, run_record_path, text_table, write_json
from highrank.cli.analyze.common import add_run_arguments, hf_mode
from highrank.util.argtypes import positive_int
from highrank.util.atomic import write_text_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``highrank analyze kl``."""
    add_run_arguments(parser, hf=True)
    parser.add_argument(
        "--pairs", type=positive_int, default=DEFAULT_PAIRS, help="context pairs (10000)"
    )
    parser.add_argument(
        "--max-contexts", type=positive_int, help="pair among the first N contexts only"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the pair sampler (0)")
    parser.add_argument(
        "--matrix",
        action="append",
        metavar="PATH",
        help="read rows from this log-prob .npy (written with batch_size 1) instead of running "
        "the model; give one per RUN_DIR, in the same order",
    )
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu)")
    parser.add_argument("--out", help="also write kl.json and kl.md here (with --hf: every record)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


HEADERS = ["head", "run", "pairs", "mean KL", "std", "s.e."]


def table_rows(records: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """One row per run, in :data:`HEADERS` order (non-finite numbers as ``-``)."""
    numbers = ("mean", "std", "stderr")
    return [
        [r["head"], r.get("run_dir") or r["model"], r["pairs"], *(_finite(r[k]) for k in numbers)]
        for r in records
    ]


def run(args: argparse.Namespace) -> int:
    """``highrank analyze kl``: one record per run, a table, and a summary with ``--out``."""
    try:
        hf = hf_mode(args)
        records = _hf_records(args) if hf else _records(args)
    except (KLError, HFInputError) as error:
        print(f"highrank analyze kl: error: {error}", file=sys.stderr)
        return 2
    if hf:
        written = [write_json(Path(args.out) / f"kl-{r['tag']}.json", r) for r in records]
    else:
        tag = record_tag(args.split, args.which, max_contexts=args.max_contexts)
        written = [write_json(run_record_path(r["run_dir"], "kl", tag), r) for r in records]
    print(text_table(HEADERS, table_rows(records)), end="")
    infinite = [r.get("run_dir") or r["model"] for r in records if r["infinite_pairs"]]
    if infinite:
        print(f"infinite divergences (a zero probability): {', '.join(infinite)}")
    if args.out:
        written += _write_summary(Path(args.out), records)
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _records(args: argparse.Namespace) -> list[dict[str, Any]]:
    matrices = args.matrix or []
    if matrices and len(matrices) != len(args.run_dirs):
        raise KLError(
            f"--matrix was given {len(matrices)} time(s) for {len(args.run_dirs)} RUN_DIR(s); "
            "expected one matrix per run directory, in the same order"
        )
    options = {"n_pairs": args.pairs, "seed": args.seed, "max_contexts": args.max_contexts}
    records = []
    for index, run_dir in enumerate(args.run_dirs):
        if matrices:
            record = _matrix_record(run_dir, matrices[index], args, options)
        else:
            split = load_run_split(
                run_dir, args.split, which=args.which, data_dir=args.data_dir, device=args.device
            )
            record = run_pairwise_kl(split, progress=not args.no_progress, **options)
        records.append({**record, "checkpoint": args.which})
    return records


def _hf_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per ``--hf`` model on ``--text``, each model loaded in turn."""
    from highrank.analysis.hf_contexts import describe_contexts, hf_tag, load_text_contexts

    if args.matrix:
        raise KLError("--matrix reads rows of runs; with --hf the model itself is run")
    records = []
    for model_path in args.hf:
        loaded = load_text_contexts(
            model_path,
            args.text,
            window=args.window,
            bos=args.bos,
            device=args.device,
            progress=not args.no_progress,
        )
        result = causal_lm_pairwise_kl(
            loaded.model,
            loaded.ids,
            window=loaded.window,
            bos_token_id=loaded.bos_token_id,
            n_pairs=args.pairs,
            seed=args.seed,
            max_contexts=args.max_contexts,
            progress=not args.no_progress,
        )
        contexts = describe_contexts(loaded.window, loaded.bos_token_id)
        tag = hf_tag(
            model_path, args.text, window=args.window, bos=args.bos, max_contexts=args.max_contexts
        )
        records.append(
            {
                "tag": tag,
                **loaded.record(args.max_contexts),
                "source": str(args.text),
                "split": Path(args.text).name,  # what the summary's note names
                "rows_from": "model",
                **result,
                "protocol": {
                    **PROTOCOL,
                    "contexts": f"the first n contexts of the text: {contexts}",
                },
                "numpy": np.__version__,
            }
        )
        del loaded  # one model in memory at a time
    return records


def _matrix_record(run_dir: str, path: str, args: argparse.Namespace, options: dict) -> dict:
    """The KL record of ``run_dir`` from the matrix at ``path``, after checking the matrix
    is the run's log-probabilities of ``args.split`` in stream order."""
    from highrank.runs.run_dir import RunDir

    run = RunDir.open(run_dir)
    vocab_size = len(run.load_vocab())
    matrix = open_matrix(path)
    side = _side_record(path)
    expected = {"kind": "log_prob", "batch_size": 1, "split": args.split, "which": args.which}
    for key, value in expected.items():
        if key in side and side[key] != value:
            raise KLError(
                f"{path}: its record says {key}={side[key]!r}; the KL protocol needs "
                f"{key}={value!r} (rewrite the matrix, or change --split / --which)"
            )
    if matrix.shape[1] != vocab_size:
        raise KLError(
            f"{path} has {matrix.shape[1]} columns but run {run_dir} has a vocabulary of "
            f"{vocab_size}; is it the matrix of another run?"
        )
    return {
        "run_dir": str(run_dir),
        "head": run.load_config().head.name,
        "split": args.split,
        "source": side.get("source"),
        "rows_from": str(path),
        "max_contexts": options["max_contexts"],
        **matrix_pairwise_kl(matrix, **options),
        "protocol": PROTOCOL,
        "numpy": np.__version__,
    }


def _side_record(path: str) -> dict[str, Any]:
    """The matrix's ``NAME.json`` written beside it, or ``{}`` when there is none."""
    if not Path(path).with_suffix(".json").is_file():
        return {}
    try:
        return matrix_record(path)
    except ValueError as error:
        raise KLError(str(error)) from None


def _write_summary(out: Path, records: list[dict[str, Any]]) -> list[Path]:
    title = "# Expected pairwise KL divergence E[KL(P(.|c) || P(.|c'))]\n\n"
    first = records[0]
    note = (
        f"\n{first['pairs']:,} ordered pairs of distinct contexts, uniform with replacement, "
        f"seed {first['seed']}, split {first['split']}; KL in nats, float64.\n"
    )
    table = text_table(HEADERS, table_rows(records), markdown=True)
    return [
        write_json(out / "kl.json", {"protocol": first["protocol"], "runs": records}),
        write_text_atomic(out / "kl.md", title + table + note),
    ]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
