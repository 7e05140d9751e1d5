"""``highrank analyze unargmaxable``: tokens no hidden state can make the argmax of a run's
(or --hf model's) output layer (:mod:`highrank.analysis.unargmaxable`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from highrank.cli.analyze.common import check_hf_record, write_summary
from highrank.cli.choices import PATIENCE, RADIUS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs", nargs="*", metavar="RUN_DIR", help="runs of `highrank train` (or --hf)"
    )
    parser.add_argument("--which", default="best", help="checkpoint of the runs (best)")
    parser.add_argument(
        "--hf",
        action="append",
        metavar="MODEL",
        help="a Hugging Face model folder or .gguf file: its lm_head weight and bias "
        "(needs the hf extra; records go to --out)",
    )
    domain = parser.add_mutually_exclusive_group()
    domain.add_argument(
        "--radius",
        type=float,
        default=RADIUS,
        help=f"hidden states in the box |h_k| <= R ({RADIUS:g}, Grivas et al.)",
    )
    domain.add_argument(
        "--unbounded", action="store_true", help="any hidden state in R^d instead of a box"
    )
    parser.add_argument(
        "--patience",
        type=int,
        default=PATIENCE,
        help=f"braid reflections per token before its LP ({PATIENCE})",
    )
    parser.add_argument("--out", help="also write unargmaxable.json and unargmaxable.md here")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.hf_contexts import check_record_owner
    from highrank.analysis.output import write_json
    from highrank.analysis.unargmaxable import UnargmaxableError

    try:
        if bool(args.hf) == bool(args.run_dirs):
            raise UnargmaxableError("give RUN_DIR... or --hf MODEL (with --out DIR), not both")
        if args.hf and not args.out:
            raise UnargmaxableError("--hf needs --out DIR: the records are written there")
        radius = None if args.unbounded else args.radius
        # the record's radius is the one asked unless the head's domain is R^d: every model's
        # usual record is refused before any work, the other one (below) after its own
        for model in args.hf or ():
            check_record_owner(_hf_path(args.out, model, radius), model)
        records = []
        for source in args.hf or args.run_dirs:
            record, path = (_hf_record if args.hf else _run_record)(source, radius, args)
            if args.hf:
                check_hf_record(path, record)
            write_json(path, record)
            print(f"wrote {path}")
            if radius is not None and record.get("radius") is None:  # the head's domain is R^d
                print(f"note: {source}: --radius {radius:g} is not used: {record['analysed']}")
            records.append(record)
    except ValueError as error:  # UnargmaxableError, HFInputError (a missing hf extra too)
        print(f"highrank analyze unargmaxable: error: {error}", file=sys.stderr)
        return 2
    print(summary_table(records), end="")
    if args.out:
        write_summary(args.out, "unargmaxable", {"inputs": records},
                      summary_table(records, markdown=True))
    return 0


def _run_record(run_dir: str, radius: float | None, args) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.output import run_record_path
    from highrank.analysis.unargmaxable import analyze_unargmaxable_run, radius_tag

    options = {"radius": radius, "patience": args.patience, "progress": not args.no_progress}
    record = analyze_unargmaxable_run(run_dir, which=args.which, **options)
    tag = f"{Path(args.which).stem}-{radius_tag(record['radius'])}"
    return record, run_record_path(run_dir, "unargmaxable", tag)


def _hf_record(model_path: str, radius: float | None, args) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.unargmaxable import analyze_unargmaxable_hf

    options = {"radius": radius, "patience": args.patience, "progress": not args.no_progress}
    record = analyze_unargmaxable_hf(model_path, **options)
    return record, _hf_path(args.out, model_path, record["radius"])


def _hf_path(out: str, model_path: str, radius: float | None) -> Path:
    from highrank.analysis.hf_contexts import model_name
    from highrank.analysis.unargmaxable import radius_tag

    return Path(out) / f"unargmaxable-{model_name(model_path)}-{radius_tag(radius)}.json"


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    from highrank.analysis.output import text_table

    headers = ["input", "head", "V", "domain", "unargmaxable", "undecided", "LP tokens", "seconds"]
    rows = [
        [
            r.get("run_dir") or r.get("model"),
            r["head"],
            r["vocab_size"],
            r["domain"],
            r["unargmaxable"],
            r["undecided"],
            r["lp_tokens"],
            round(sum(r["seconds"].values()), 1),
        ]
        for r in records
    ]
    return text_table(headers, rows, markdown=markdown)
