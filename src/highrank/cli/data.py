"""``highrank data stats``: lines, tokens and vocabulary of a corpus folder."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats"], help="stats: lines, tokens and vocabulary")
    parser.add_argument("directory", help="corpus folder with train.txt, valid.txt, test.txt")
    parser.add_argument("--mode", choices=["word", "char"], default="word", help="token unit")
    parser.add_argument("--cache-dir", help="token-id cache folder (default ~/.cache/highrank)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import json

    from highrank.data import CorpusError, corpus_stats, format_stats

    try:
        stats = corpus_stats(args.directory, mode=args.mode, cache_dir=args.cache_dir)
    except CorpusError as error:
        print(f"highrank data stats: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0
