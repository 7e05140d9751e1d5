"""``highrank analyze saturation``: the singular-value spectrum of the output matrix and the
anisotropy of the hidden states, for every checkpoint of runs (a curve over training) or for
--hf models (:mod:`highrank.analysis.saturation`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from highrank.cli.analyze.common import (
    add_hf_arguments,
    check_runs_or_hf,
    hf_record_path,
    record_each,
    write_summary,
)
from highrank.cli.choices import SATURATION_MAX_CONTEXTS, SATURATION_TOP_K
from highrank.util.argtypes import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs", nargs="*", metavar="RUN_DIR", help="runs of `highrank train` (or --hf)"
    )
    parser.add_argument(
        "--which",
        action="append",
        metavar="CHECKPOINT",
        help="only these checkpoints: best, last, finetuned, ... or .pt paths (repeatable; "
        "default: every checkpoint in RUN_DIR/checkpoints)",
    )
    parser.add_argument(  # the old spelling, kept for scripts (one vocabulary: issue 31)
        "--checkpoint", action="append", dest="which", default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--split", choices=("train", "valid", "test"), default="test")
    parser.add_argument("--data-dir", help="corpus folder (default: each run's data.dir)")
    parser.add_argument(
        "--max-contexts",
        type=positive_int,
        default=SATURATION_MAX_CONTEXTS,
        help="hidden states for the anisotropy: the first N contexts "
        f"({SATURATION_MAX_CONTEXTS})",
    )
    parser.add_argument(
        "--top-k",
        type=_sizes,
        default=SATURATION_TOP_K,
        help="k of the top-k energy shares, comma-separated "
        f"({','.join(map(str, SATURATION_TOP_K))})",
    )
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu)")
    add_hf_arguments(parser)
    parser.add_argument("--out", help="also write saturation.json and saturation.md here")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected k1,k2,... positive ints; got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected k1,k2,... positive ints; got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    try:
        return _run_all(args)
    except ValueError as error:  # this instrument's errors, HFInputError (a missing extra too)
        print(f"highrank analyze saturation: error: {error}", file=sys.stderr)
        return 2


def _run_all(args: argparse.Namespace) -> int:
    _check(args)
    records = record_each(args, _run, _hf)
    for record in records:
        print(summary_table(record), end="")
    if args.out:
        text = "\n".join(summary_table(r, markdown=True) for r in records)
        write_summary(args.out, "saturation", {"inputs": records}, text)
    return 0


def _check(args: argparse.Namespace) -> None:
    from highrank.analysis.saturation import SaturationError
    from highrank.runs.checkpoint import CHECKPOINT_FILES

    check_runs_or_hf(args, SaturationError)
    for which in args.which or ():
        if which not in CHECKPOINT_FILES and not which.endswith(".pt"):
            raise SaturationError(
                f"--which {which} names no checkpoint; expected one of "
                f"{', '.join(CHECKPOINT_FILES)} or a path to a .pt file"
            )
        if which.endswith(".pt") and len(args.run_dirs) > 1:
            raise SaturationError(
                f"--which {which} names a file of one run; give one RUN_DIR with it (the "
                "names best, last, ... apply to each run)"
            )


def _run(run_dir: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.output import run_record_path
    from highrank.analysis.saturation import analyze_saturation_run
    from highrank.runs.checkpoint import checkpoint_path

    record = analyze_saturation_run(
        run_dir,
        split=args.split,
        checkpoints=[checkpoint_path(run_dir, w) for w in args.which] if args.which else None,
        data_dir=args.data_dir,
        max_contexts=args.max_contexts,
        top_k=args.top_k,
        device=args.device,
        progress=not args.no_progress,
    )
    tag = f"{args.split}-first{args.max_contexts}"
    if args.which:  # some checkpoints only: never over the record of the whole curve
        tag += "-" + "+".join(Path(w).stem for w in args.which)
    if list(args.top_k) != list(SATURATION_TOP_K):  # other shares than the default record's
        tag += "-top" + "+".join(map(str, args.top_k))
    return record, run_record_path(run_dir, "saturation", tag)


def _hf(model: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from highrank.analysis.saturation import analyze_saturation_hf

    path = hf_record_path(args, "saturation", model, args.max_contexts)
    record = analyze_saturation_hf(
        model,
        args.text,
        window=args.window,
        bos=args.bos,
        max_contexts=args.max_contexts,
        top_k=args.top_k,
        device=args.device,
        progress=not args.no_progress,
    )
    return record, path


def summary_table(record: dict[str, Any], *, markdown: bool = False) -> str:
    from highrank.analysis.output import text_table
    from highrank.analysis.saturation import curve_headers, curve_rows

    title = record.get("run_dir") or record.get("model_name")
    table = text_table(curve_headers(record), curve_rows(record), markdown=markdown)
    return f"{'### ' if markdown else ''}{title}\n{table}"
