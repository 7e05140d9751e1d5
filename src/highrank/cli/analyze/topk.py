"""``highrank analyze topk``: the top-k next tokens of several runs (or --hf models) side
by side, with the reference token (:mod:`highrank.analysis.topk`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from highrank.cli.analyze.common import add_run_arguments, row_sources
from highrank.util.argtypes import positive_int
from highrank.util.atomic import write_text_atomic


def parse_positions(text: str) -> list[int]:
    """``"10,200"`` -> ``[10, 200]`` (argparse type of ``--positions``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated stream positions such as 10,200; got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``highrank analyze topk``."""
    add_run_arguments(parser, hf=True)
    choose = parser.add_mutually_exclusive_group(required=True)
    choose.add_argument(
        "--positions", type=parse_positions, help="stream positions of the contexts, e.g. 10,200"
    )
    choose.add_argument("--random", type=positive_int, metavar="N", help="N random contexts")
    choose.add_argument(
        "--margin",
        type=float,
        metavar="M",
        help="contexts where the first run beats the second by >= M nats on the reference",
    )
    parser.add_argument(
        "--count", type=positive_int, default=10, help="contexts --margin shows at most (10)"
    )
    parser.add_argument("--k", type=positive_int, default=5, help="tokens per model (5)")
    parser.add_argument(
        "--context-words", type=positive_int, default=8, help="context words shown (8)"
    )
    parser.add_argument("--max-contexts", type=positive_int, help="choose among the first N only")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random (0)")
    parser.add_argument("--device", default="cpu", help="where the models run (cpu)")
    parser.add_argument(
        "--out", help="also write topk.json and topk.txt here (with --hf: the records)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    """``highrank analyze topk``: print the side-by-side blocks; write JSON and text."""
    from highrank.analysis.output import record_tag, run_record_path, write_json
    from highrank.analysis.topk import TopKError, analyze_topk, format_report, report_title
    from highrank.causal_lm import HFInputError

    if args.random and args.max_contexts is None and not getattr(args, "hf", None):
        print("note: --random draws its contexts from the whole split, and the model reads "
              "every context up to the last one drawn (its state is carried); --max-contexts N "
              "draws among the first N only, which is faster", file=sys.stderr)
    try:
        record = analyze_topk(
            row_sources(args),
            positions=args.positions,
            random=args.random,
            margin=args.margin,
            count=args.count,
            k=args.k,
            context_words=args.context_words,
            max_contexts=args.max_contexts,
            seed=args.seed,
            progress=not args.no_progress,
        )
    except (TopKError, HFInputError) as error:
        print(f"highrank analyze topk: error: {error}", file=sys.stderr)
        return 2
    text = format_report(record["contexts"], report_title(record))
    print(text, end="")
    written = []
    if len(args.run_dirs) == 1:
        tag = record_tag(args.split, args.which, max_contexts=args.max_contexts)
        written.append(write_json(run_record_path(args.run_dirs[0], "topk", tag), record))
    if args.out:
        out = Path(args.out)
        written.append(write_json(out / "topk.json", record))
        written.append(write_text_atomic(out / "topk.txt", text))
    if written:
        print("wrote " + ", ".join(map(str, written)))
    return 0
