"""``highrank data stats``: lines, tokens and vocabulary of a corpus folder; ``highrank data
zipf``: write a seeded Zipfian synthetic corpus (:mod:`highrank.data.zipf`)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=["stats", "zipf"],
        help="stats: lines, tokens and vocabulary; zipf: write a synthetic Zipfian corpus",
    )
    parser.add_argument(
        "directory", help="corpus folder with train.txt, valid.txt, test.txt (zipf: to write)"
    )
    parser.add_argument("--mode", choices=["word", "char"], default="word", help="token unit")
    parser.add_argument("--cache-dir", help="token-id cache folder (default ~/.cache/highrank)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    zipf = parser.add_argument_group("zipf (highrank.data.zipf)")
    zipf.add_argument("--tokens", type=int, default=1_000_000, help="train tokens, <eos> included")
    zipf.add_argument("--types", type=int, default=100_000, help="distinct words drawn from")
    zipf.add_argument("--exponent", type=float, default=1.0, help="Zipf exponent s")
    zipf.add_argument("--shards", type=int, default=0, help="train as N shard files in train/")
    zipf.add_argument("--seed", type=int, default=0, help="generator seed")


def run(args: argparse.Namespace) -> int:
    import json

    from highrank.data import CorpusError, corpus_stats, format_stats

    if args.action == "zipf":
        return _zipf(args)
    try:
        stats = corpus_stats(args.directory, mode=args.mode, cache_dir=args.cache_dir)
    except CorpusError as error:
        print(f"highrank data stats: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _zipf(args: argparse.Namespace) -> int:
    import json

    from highrank.data.zipf import write_zipf_corpus

    try:
        info = write_zipf_corpus(
            args.directory,
            train_tokens=args.tokens,
            types=args.types,
            exponent=args.exponent,
            shards=args.shards,
            seed=args.seed,
        )
    except ValueError as error:
        print(f"highrank data zipf: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else f"wrote {args.directory}: {info['tokens']}")
    return 0
