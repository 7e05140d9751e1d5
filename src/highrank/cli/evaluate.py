"""``highrank eval``: perplexity of a trained run on a split (hidden state carried).

Also the options and the JSON record ``highrank dynamic-eval`` shares with it.
"""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded, positive_int
from highrank.cli.translate import add_search_options, translate


def add_eval_options(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR, --split, --which, --data-dir, --no-progress."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `highrank train`")
    parser.add_argument("--split", choices=["valid", "test"], default="test", help="(test)")
    parser.add_argument(
        "--which", default="best", help="checkpoint: best, last, finetuned or a .pt path (best)"
    )
    parser.add_argument("--data-dir", help="corpus folder (default: the run's data.dir)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def load_for_eval(args: argparse.Namespace):
    """The run's model, config and corpus, checked against the run's vocabulary."""
    from highrank.checkpoint import load_run_corpus

    return load_run_corpus(args.run_dir, args.which, data_dir=args.data_dir)


def report_eval(args: argparse.Namespace, kind: str, result, extra: dict) -> None:
    """Write ``RUN_DIR/<kind>-<split>-<which>.json`` and print its one-line summary."""
    import json
    from pathlib import Path

    record = {
        "split": args.split,
        "checkpoint": args.which,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        **extra,
    }
    path = Path(args.run_dir) / f"{kind}-{args.split}-{Path(args.which).stem}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(
        f"{kind} {args.split}: loss {result.loss:.4f}, perplexity {result.perplexity:.2f} "
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
    parser.add_argument("--bptt", type=positive_int, default=70, help="segment length (70)")
    parser.add_argument("--token-nll", help="also write per-token NLL to this .tsv or .npy file")
    parser.add_argument(
        "--bleu",
        action="store_true",
        help="a translation run: translate the split and score it with sacreBLEU, as "
        "`highrank translate` (the default for translation runs)",
    )
    add_search_options(parser)


def run(args: argparse.Namespace) -> int:
    from highrank.evaluate import evaluate_perplexity, write_token_nll

    if args.bleu or _is_translation_run(args.run_dir):
        return guarded("eval", lambda: translate(args))

    def job() -> int:
        model, config, corpus = load_for_eval(args)
        default_batch = {
            "valid": config.train.eval_batch_size,
            "test": config.train.test_batch_size,
        }
        batch_size = args.batch_size or default_batch[args.split]
        result = evaluate_perplexity(
            model,
            corpus.split(args.split),
            batch_size=batch_size,
            bptt=args.bptt,
            progress=not args.no_progress,
            return_token_nll=bool(args.token_nll),
            name=str(corpus.path(args.split)),
        )
        if args.token_nll:
            print(f"wrote {write_token_nll(args.token_nll, result, corpus.vocab)}")
        report_eval(args, "eval", result, {"batch_size": batch_size, "bptt": args.bptt})
        return 0

    return guarded("eval", job)


def _is_translation_run(run_dir: str) -> bool:
    """Whether RUN_DIR's config is a seq2seq one (False when it cannot be read: the
    perplexity path then says what is wrong)."""
    from highrank.config import ConfigError, load_config
    from highrank.runs import CONFIG_FILE

    try:
        return load_config(f"{run_dir}/{CONFIG_FILE}").model.backbone == "seq2seq"
    except ConfigError:
        return False
