"""``highrank eval``: perplexity of a trained run on a split (hidden state carried).

The work is :func:`highrank.evaluate.run.evaluate_run`; this verb writes its record and prints
it (a translation run: ``highrank translate``'s BLEU). Also the options and the record writing
``highrank dynamic-eval`` shares with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from highrank.cli.common import guarded, positive_int, refuse
from highrank.cli.translate import add_search_options, translate
from highrank.util.paths import run_dir_problem


def add_eval_options(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR, --split, --which, --data-dir, --max-tokens, --no-progress."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `highrank train`")
    parser.add_argument("--split", choices=["valid", "test"], default="test", help="(test)")
    parser.add_argument(
        "--which", default="best", help="checkpoint: best, last, finetuned or a .pt path (best)"
    )
    parser.add_argument("--data-dir", help="corpus folder (default: the run's data.dir)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        metavar="N",
        help="read only the first N tokens of the split (<eos> counted): a column's first "
        "token has no prediction, so N - 1 are scored in one column, (N // B - 1) x B in B "
        "columns; the record keeps N and the tokens scored (a quick look: recorded under its "
        "own name, never as the split's figure)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def report_eval(args: argparse.Namespace, kind: str, record: dict) -> None:
    """Write ``record`` (:func:`highrank.evaluate.run.record_file`) and print its summary.

    The record names the checkpoint (file and sha256), the data directory, the split, the
    tokens scored and a sha256 of the split's file, so a figure can always be traced back.
    A character-level run's record also holds its bits per character.
    """
    from highrank.evaluate.run import record_file
    from highrank.util.atomic import write_json

    path = write_json(record_file(args.run_dir, record, kind), record)
    bpc = f", {record['bits_per_char']:.4f} bits per character" if "bits_per_char" in record else ""
    read = record.get("tokens_read")  # --max-tokens N: N read, fewer scored (see its help)
    read = f" (of the first {read:,} read: a column's first has no prediction)" if read else ""
    print(
        f"{kind} {args.split}: loss {record['loss']:.4f}, perplexity {record['perplexity']:.2f}"
        f"{bpc} over {record['tokens']:,} tokens{read}; wrote {path}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_eval_options(parser)
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help="columns (default: the run's eval_batch_size (10) for valid, test_batch_size (1) "
        "for test)",
    )
    parser.add_argument(
        "--bptt",
        type=positive_int,
        help="segment length (default: a Transformer run's train.bptt, its training window; "
        "70 for AWD-LSTM runs, whose hidden state crosses segments but whose mfs / cpr heads "
        "read the tokens and layers of their own segment only: their figures depend on it)",
    )
    parser.add_argument("--token-nll", help="also write per-token NLL to this .tsv or .npy file")
    parser.add_argument(
        "--bleu",
        action="store_true",
        help="a translation run: translate the split and score it with sacreBLEU, as "
        "`highrank translate` (the default for translation runs)",
    )
    add_search_options(parser)


def run(args: argparse.Namespace) -> int:
    # before torch is imported, and before an evaluation that --token-nll could not keep
    status = refuse("eval", run_dir_problem(args.run_dir) or _token_nll_problem(args.token_nll))
    if status:
        return status
    from highrank.train import distributed

    if distributed.only_process_zero("evaluation"):  # one evaluation, not one per process
        return 0

    def job() -> int:
        from highrank.evaluate.run import evaluate_run, is_translation_run, run_config

        own_config = run_config(args.run_dir)  # read once (None: the checks below say why)
        if args.bleu or is_translation_run(own_config):
            return _translate(args)
        record = evaluate_run(
            args.run_dir,
            args.split,
            args.which,
            data_dir=args.data_dir,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            bptt=args.bptt,
            token_nll=args.token_nll or None,
            progress=not args.no_progress,
            own_config=own_config,
        )
        if args.token_nll:
            print(f"wrote {Path(args.token_nll)}")
        report_eval(args, "eval", record)
        return 0

    return guarded("eval", job)


def _token_nll_problem(path: str | None) -> str | None:
    if not path:
        return None
    if Path(path).suffix.lower() not in (".tsv", ".npy"):
        return f"--token-nll {path}: expected a .tsv or .npy file name"
    folder = Path(path).parent
    if not folder.is_dir():
        return f"--token-nll {path}: the folder {folder} does not exist"
    return None


# Options of a language model's evaluation that mean nothing for a translation run.
WORD_LM_OPTIONS = ("max_tokens", "token_nll", "bptt", "batch_size")


def _translate(args: argparse.Namespace) -> int:
    """A translation run (or --bleu): translate the split and score it, as `highrank translate`."""
    word_only = [f"--{name.replace('_', '-')}" for name in WORD_LM_OPTIONS
                 if getattr(args, name, None)]
    if word_only:  # never decode the whole split and overwrite another evaluation's files
        print(f"highrank eval: error: {', '.join(word_only)} applies to language-model runs;"
              " a translation run translates and scores whole sentences (`highrank "
              "translate` has the decoding options)", file=sys.stderr)
        return 2
    return translate(args)
