"""``highrank eval``: perplexity of a trained run on a split (hidden state carried).

Also the options and the JSON record ``highrank dynamic-eval`` shares with it.
"""

from __future__ import annotations

import argparse
import sys

from highrank.cli.common import guarded, positive_int
from highrank.cli.translate import add_search_options, translate


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
        help="score only the first N tokens of the split (a quick look; recorded under its "
        "own name, never as the split's figure)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def load_for_eval(args: argparse.Namespace):
    """The run's model, config and corpus, checked against the run's vocabulary."""
    from highrank.model import load_run_corpus

    return load_run_corpus(args.run_dir, args.which, data_dir=args.data_dir)


def split_ids(args: argparse.Namespace, corpus):
    """The split's token ids, the first ``--max-tokens`` of them when given: a memory map for
    a ``data.memmap`` run (:func:`highrank.data.streaming.split_stream`; read a segment at a
    time)."""
    from highrank.data.streaming import split_stream

    ids = split_stream(corpus, args.split)
    return ids if args.max_tokens is None else ids[: args.max_tokens]


def report_eval(args: argparse.Namespace, kind: str, result, extra: dict, corpus=None) -> None:
    """Write the record (:func:`record_name`) and print its one-line summary.

    The record names the checkpoint (file and sha256), the data directory, the split, the
    tokens scored and a sha256 of the split's file, so a figure can always be traced back.
    A character-level run's record also holds its bits per character.
    """
    from highrank.analysis.output import write_json
    from highrank.data.chars import bits_per_char
    from highrank.evaluate.records import data_facts, record_path

    data = data_facts(args, corpus)
    if corpus is not None and corpus.mode == "char":  # <eos> counted: it stands for a newline
        extra = {**extra, "bits_per_char": bits_per_char(result.loss, 1)}
    record = {
        "split": args.split,
        "checkpoint": args.which,
        **data,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        **extra,
    }
    path = write_json(record_path(args.run_dir, kind, args.split, args.which, data), record)
    bpc = f", {extra['bits_per_char']:.4f} bits per character" if "bits_per_char" in extra else ""
    print(
        f"{kind} {args.split}: loss {result.loss:.4f}, perplexity {result.perplexity:.2f}{bpc} "
        f"over {result.tokens:,} tokens; wrote {path}"
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
        "70 for AWD-LSTM runs)",
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
    from highrank.evaluate.perplexity import (
        check_segment_length,
        default_bptt,
        evaluate_perplexity,
        write_token_nll,
    )
    from highrank.train import distributed

    if distributed.only_process_zero("evaluation"):  # one evaluation, not one per process
        return 0
    if args.bleu or _is_translation_run(args.run_dir):
        word_only = [f"--{name.replace('_', '-')}" for name in WORD_LM_OPTIONS
                     if getattr(args, name, None)]
        if word_only:  # never decode the whole split and overwrite another evaluation's files
            print(f"highrank eval: error: {', '.join(word_only)} applies to language-model runs;"
                  " a translation run translates and scores whole sentences (`highrank "
                  "translate` has the decoding options)", file=sys.stderr)
            return 2
        return guarded("eval", lambda: translate(args))

    def job() -> int:
        model, config, corpus = load_for_eval(args)
        default_batch = {
            "valid": config.train.eval_batch_size,
            "test": config.train.test_batch_size,
        }
        batch_size = args.batch_size or default_batch[args.split]
        bptt = check_segment_length(config, args.bptt or default_bptt(config))
        result = evaluate_perplexity(
            model,
            split_ids(args, corpus),
            batch_size=batch_size,
            bptt=bptt,
            progress=not args.no_progress,
            return_token_nll=bool(args.token_nll),
            name=str(corpus.path(args.split)),
        )
        if args.token_nll:
            print(f"wrote {write_token_nll(args.token_nll, result, corpus.vocab)}")
        extra = {"batch_size": batch_size, "bptt": bptt}
        report_eval(args, "eval", result, extra, corpus)
        return 0

    return guarded("eval", job)


# Options of a language model's evaluation that mean nothing for a translation run.
WORD_LM_OPTIONS = ("max_tokens", "token_nll", "bptt", "batch_size")


def _is_translation_run(run_dir: str) -> bool:
    """Whether RUN_DIR's config is one of a translation family, seq2seq (False when it cannot
    be read: the perplexity path then says what is wrong)."""
    from highrank.config import FAMILIES, ConfigError, load_config
    from highrank.runs.run_dir import CONFIG_FILE

    try:
        config = load_config(f"{run_dir}/{CONFIG_FILE}")
        return FAMILIES[config.model.backbone].parallel_corpus
    except ConfigError:
        return False
