"""``highrank analyze gradient-bottleneck``: the share of the loss gradient on the logits
that the output layer passes back to the hidden state, for runs or --hf models
(:mod:`highrank.analysis.gradient_bottleneck`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from highrank.cli.analyze.common import (
    add_run_arguments,
    check_runs_or_hf,
    hf_record_path,
    record_each,
    write_summary,
)
from highrank.cli.choices import GRADIENT_MAX_CONTEXTS
from highrank.util.argtypes import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, hf=True)
    parser.add_argument(
        "--max-contexts",
        type=positive_int,
        default=GRADIENT_MAX_CONTEXTS,
        metavar="N",
        help=f"the first N contexts (tokens) of the split or text ({GRADIENT_MAX_CONTEXTS}); a "
        "high-rank head costs a Jacobian (d_in forward passes of the head) per token",
    )
    parser.add_argument(  # the old spelling, kept for scripts (one vocabulary: issue 31)
        "--max-tokens",
        type=positive_int,
        dest="max_contexts",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu)")
    parser.add_argument(
        "--out", help="also write gradient-bottleneck.json and .md here (with --hf: every record)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    try:
        return _run_all(args)
    except ValueError as error:  # this instrument's errors, HFInputError (a missing extra too)
        print(f"highrank analyze gradient-bottleneck: error: {error}", file=sys.stderr)
        return 2


def _run_all(args: argparse.Namespace) -> int:
    from highrank.analysis.gradient_bottleneck import GradientBottleneckError

    check_runs_or_hf(args, GradientBottleneckError)
    records = record_each(args, _run, _hf)
    print(summary_table(records), end="")
    if args.out:
        write_summary(args.out, "gradient-bottleneck", {"inputs": records},
                      summary_table(records, markdown=True))
    return 0


def _run(run_dir: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.gradient_bottleneck import analyze_gradient_bottleneck_run
    from highrank.analysis.output import record_tag, run_record_path

    record = analyze_gradient_bottleneck_run(
        run_dir,
        split=args.split,
        which=args.which,
        data_dir=args.data_dir,
        max_tokens=args.max_contexts,
        device=args.device,
        progress=not args.no_progress,
    )
    tag = record_tag(args.split, args.which, max_contexts=args.max_contexts)
    return record, run_record_path(run_dir, "gradient-bottleneck", tag)


def _hf(model: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.gradient_bottleneck import analyze_gradient_bottleneck_hf

    path = hf_record_path(args, "gradient-bottleneck", model, args.max_contexts)
    record = analyze_gradient_bottleneck_hf(
        model,
        args.text,
        window=args.window,
        bos=args.bos,
        max_tokens=args.max_contexts,
        device=args.device,
        progress=not args.no_progress,
    )
    return record, path


HEADERS = [
    "input",
    "head",
    "d_in",
    "V",
    "tokens",
    "mean share",
    "median",
    "energy-weighted",
    "mean share_w",
    "NLL",
    "seconds",
]


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    from highrank.analysis.output import text_table

    rows = []
    for r in records:
        share, literal = r["share"], r.get("share_w")
        rows.append(
            [
                r.get("run_dir") or r.get("model_name"),
                r["head"],
                r["d_in"],
                r["vocab_size"],
                r["n_tokens"],
                round(share["mean"], 4),
                round(share["median"], 4),
                round(share["energy_weighted"], 4),
                None if literal is None else round(literal["mean"], 4),
                round(r["mean_nll"], 3),
                r["seconds"],
            ]
        )
    return text_table(HEADERS, rows, markdown=markdown)
