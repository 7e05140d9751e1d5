"""``highrank translate``: translate a split with a trained translation run and score it (BLEU).

    highrank translate RUN_DIR [--split test] [--which best] [--beam 5] [--length-penalty 1.0]
                       [--greedy] [--max-len-a 1.5] [--max-len-b 10] [--out FILE]

Writes the detokenised hypotheses (``--out``, or ``RUN_DIR/translate-<split>-<which>-<search>
.txt``) and the record ``RUN_DIR/translate-<split>-<which>-<search>.json``, both atomically
(:mod:`highrank.evaluate.translation`), and prints sacreBLEU's score line and signature against
the raw target lines of the split. Decoding settings default to the run's ``[decode]``.
``highrank eval RUN_DIR --bleu`` is the same with those defaults.
"""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded, positive_int


def _non_negative_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0; got {text!r}")
    return value


def add_search_options(parser: argparse.ArgumentParser) -> None:
    """--beam, --length-penalty, --greedy, --max-len-a, --max-len-b, --out."""
    parser.add_argument(
        "--beam", type=positive_int, dest="beam_size", help="beam size (the run's decode.beam_size)"
    )
    parser.add_argument(
        "--length-penalty",
        type=_non_negative_float,
        help="GNMT length penalty alpha of ((5 + |y|) / 6) ** alpha (the run's "
        "decode.length_penalty)",
    )
    parser.add_argument(
        "--greedy", action="store_true", help="greedy search instead of beam search"
    )
    parser.add_argument(
        "--max-len-a", type=_non_negative_float, help="at most a * source length + b tokens"
    )
    parser.add_argument("--max-len-b", type=positive_int, help="(see --max-len-a)")
    parser.add_argument("--out", help="write the hypotheses here (default: in RUN_DIR)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a translation run of `highrank train`")
    parser.add_argument("--split", choices=["valid", "test"], default="test", help="(test)")
    parser.add_argument(
        "--which", default="best", help="checkpoint: best, last or a .pt path (best)"
    )
    parser.add_argument("--data-dir", help="parallel corpus folder (default: the run's data.dir)")
    add_search_options(parser)


def translate(args: argparse.Namespace) -> int:
    """Translate, score, write, print (the body of both verbs)."""
    from pathlib import Path

    from highrank.evaluate.translation import evaluate_bleu
    from highrank.runs.run_dir import RunDirError
    from highrank.train import resolve_device

    if args.out is not None and Path(args.out).is_dir():  # said before minutes of decoding
        raise RunDirError(f"--out {args.out} is a folder; give the file to write the "
                          "hypotheses to (e.g. --out hyp.de)")

    device = resolve_device("auto")
    record = evaluate_bleu(
        args.run_dir,
        split=args.split,
        which=args.which,
        data_dir=args.data_dir,
        out=args.out,
        device=device,
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        greedy=args.greedy or None,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
    )
    print(f"{record['summary']}")
    print(f"signature: {record['signature']}")
    print(
        f"translated {record['sentences']:,} sentences of {args.split} "
        f"({record['search']['name']}) in {record['seconds']:.1f} s; wrote "
        f"{record['hypotheses']} and {record['record']}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    return guarded("translate", lambda: translate(args))
