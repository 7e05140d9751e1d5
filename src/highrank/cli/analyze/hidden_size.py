"""``highrank analyze hidden-size``: the output layer's hidden size from the knee of the
spectrum of runs, matrices, rank records or --hf models (:mod:`highrank.analysis.hidden_size`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from highrank.cli.analyze.common import (
    add_hf_arguments,
    check_hf_record,
    check_out_folder,
    write_summary,
)
from highrank.cli.choices import GRAM_BACKENDS, MIN_GAP
from highrank.util.argtypes import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="*",
        metavar="RUN_DIR|MATRIX.npy|RANK.json",
        help="runs of `highrank train` (their rank record is reused or computed), log-prob "
        "matrices (.npy, contexts x vocabulary) or rank records (.json); or --hf MODEL",
    )
    parser.add_argument(
        "--min-gap",
        type=float,
        default=MIN_GAP,
        help=f"smallest gap s_k/s_(k+1) that counts as a knee ({MIN_GAP:g})",
    )
    parser.add_argument(
        "--expect", type=positive_int, help="a hidden size to check the knee against"
    )
    runs = parser.add_argument_group("runs (as `highrank analyze rank`)")
    runs.add_argument("--which", default="best", help="checkpoint (best)")
    runs.add_argument("--split", choices=("train", "valid", "test"), default="test")
    runs.add_argument("--data-dir", help="corpus folder (default: each run's data.dir)")
    runs.add_argument(
        "--max-contexts", type=positive_int, help="only the first N contexts (runs and --hf)"
    )
    gram = parser.add_argument_group("matrices on disk and runs")
    gram.add_argument("--backend", choices=GRAM_BACKENDS, default="auto", help="(auto)")
    gram.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    gram.add_argument("--block-rows", type=positive_int, default=2048, help="(2048)")
    add_hf_arguments(parser)  # --hf MODEL --text FILE: `highrank analyze rank --hf`, then the knee
    parser.add_argument(
        "--out", help="also write hidden-size.json and hidden-size.md here (with --hf: all)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.hidden_size import SPECTRUM, matches_hidden_size
    from highrank.analysis.output import write_json

    records = []
    try:
        _check_sources(args)
        for source in args.hf or args.inputs:
            record = _estimate_hf(source, args) if args.hf else _estimate(Path(source), args)
            if args.expect is not None:
                record["expected_hidden_size"] = args.expect
                record["matches_expected"] = matches_hidden_size(record, args.expect)
            path = _record_path(Path(source), record, args)
            if args.hf:
                check_hf_record(path, record)
            written = write_json(path, record)
            print(f"wrote {written}")
            records.append(record)
    except (ValueError, FileNotFoundError) as error:  # bad input, incl. the Gram memory plan
        print(f"highrank analyze hidden-size: error: {error}", file=sys.stderr)
        return 2
    print(summary_table(records), end="")
    for record in records:
        print(f"{record['source']}: {record['verdict']}")
        if record["low_rank_knee"] and record["knee"] >= record["n_values"] - 2:
            print(f"{record['source']}: the knee is among the spectrum's last values "
                  f"({record['knee']} of {record['n_values']}): too few contexts to tell a "
                  "softmax of that size from a head of higher rank; raise --max-contexts")
        if "expected_hidden_size" in record:
            print(f"{record['source']}: {_expectation(record)}")
    if args.out:
        write_summary(args.out, "hidden-size", {"spectrum": SPECTRUM, "inputs": records},
                      summary_table(records, markdown=True))
    return 0


def _expectation(record: dict) -> str:
    """What the spectrum says of ``--expect d``: a softmax of hidden size d has its knee at
    d + 1 (no bias) or d + 2 (bias), which needs more than d + 2 singular values to show."""
    d = record["expected_hidden_size"]
    where = f"a softmax of hidden size {d} has its knee at {d + 1} or {d + 2}"
    if record["n_values"] <= d + 2:
        return (f"too few singular values ({record['n_values']}: contexts or vocabulary) to "
                f"test --expect {d} ({where}); raise --max-contexts")
    if not record["low_rank_knee"]:
        return f"no knee, so not a softmax of hidden size {d} ({where})"
    agrees = "agrees with" if record["matches_expected"] else "does NOT agree with"
    return f"the knee at {record['knee']} {agrees} --expect {d} ({where})"


def _check_sources(args: argparse.Namespace) -> None:
    from highrank.analysis.hidden_size import HiddenSizeError

    if bool(args.hf) == bool(args.inputs):
        raise HiddenSizeError("give RUN_DIR|MATRIX.npy|RANK.json... or --hf MODEL, not both")
    if args.hf and not (args.text and args.out):
        raise HiddenSizeError("--hf needs --text FILE (the contexts) and --out DIR (the records)")
    if args.text and not args.hf:
        raise HiddenSizeError("--text goes with --hf MODEL")
    if args.out:
        check_out_folder(args.out, HiddenSizeError)


def _estimate_hf(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """`highrank analyze rank --hf MODEL` (its record and singular values go to --out), then
    the knee of those singular values."""
    from highrank.analysis.hidden_size import analyze_hidden_size
    from highrank.analysis.rows import RowSource

    source = RowSource.from_causal_lm(
        model,
        args.text,
        window=args.window,
        bos=args.bos,
        device=args.device,
        batch_windows=args.batch_windows,
    )
    return analyze_hidden_size(
        source,
        min_gap=args.min_gap,
        max_contexts=args.max_contexts,
        out=args.out,
        backend=args.backend,
        device=args.device,
        block_rows=args.block_rows,
        progress=not args.no_progress,
    )


def _estimate(source: Path, args: argparse.Namespace) -> dict[str, Any]:
    from highrank.analysis.hidden_size import (
        HiddenSizeError,
        analyze_run,
        estimate_from_rank_record,
        estimate_hidden_size_file,
    )

    gram = {"backend": args.backend, "device": args.device, "block_rows": args.block_rows}
    if source.is_dir():
        record = analyze_run(
            source,
            min_gap=args.min_gap,
            split=args.split,
            which=args.which,
            data_dir=args.data_dir,
            max_contexts=args.max_contexts,
            progress=not args.no_progress,
            **gram,
        )
        return {**record, "source": str(source)}
    if source.suffix == ".npy":
        return estimate_hidden_size_file(
            source, min_gap=args.min_gap, progress=not args.no_progress, **gram
        )
    if source.suffix == ".json":
        return estimate_from_rank_record(source, min_gap=args.min_gap)
    raise HiddenSizeError(
        f"{source}: expected a run directory, a .npy log-prob matrix or a rank record .json"
    )


def _record_path(source: Path, record: dict[str, Any], args: argparse.Namespace) -> Path:
    """``RUN_DIR/analysis/hidden-size-TAG.json`` for a run, ``--out/hidden-size-TAG.json``
    for a Hugging Face model, ``hidden-size-<stem>.json`` beside a matrix or record."""
    if "hf_tag" in record:
        return Path(args.out) / f"hidden-size-{record['hf_tag']}.json"
    if "tag" in record:
        from highrank.analysis.output import run_record_path

        return run_record_path(source, "hidden-size", record["tag"])
    return source.with_name(f"hidden-size-{source.stem}.json")


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    from highrank.analysis.output import text_table

    headers = ["input", "matrix", "knee", "gap", "low-rank", "d (bias)", "d (no bias)", "Press"]
    rows = []
    for r in records:
        size = r["hidden_size"] or {}
        rows.append(
            [
                r["source"],
                f"{r['shape'][0]:,} x {r['shape'][1]:,}",
                r["knee"],
                r["gap"],
                "yes" if r["low_rank_knee"] else "no",
                size.get("with_bias"),
                size.get("without_bias"),
                r["press_rank"],
            ]
        )
    return text_table(headers, rows, markdown=markdown)
