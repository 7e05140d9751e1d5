"""``highrank analyze topk``: the top-k next tokens of several runs (or --hf models) side
by side, with the reference token (:mod:`highrank.analysis.topk`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis.contexts import RunSplit, count_contexts, load_run_split
from highrank.analysis.hf_contexts import HFInputError
from highrank.analysis.output import record_tag, run_record_path, write_json
from highrank.analysis.topk import (
    TopKError,
    check_k,
    check_positions,
    check_same_vocabulary,
    context_records,
    format_report,
    margin_positions,
    random_positions,
    target_log_probs,
    topk_records,
)
from highrank.cli.analyze.common import add_run_arguments, hf_mode
from highrank.data.streaming import streams_equal
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
    try:
        record = _hf_record(args) if hf_mode(args) else _record(args)
    except (TopKError, HFInputError) as error:
        print(f"highrank analyze topk: error: {error}", file=sys.stderr)
        return 2
    text = format_report(record["contexts"], _title(record))
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


def _record(args: argparse.Namespace) -> dict[str, Any]:
    if args.margin is not None and len(args.run_dirs) < 2:
        raise TopKError("--margin compares two runs (A = first, B = second); got one RUN_DIR")
    splits = [
        load_run_split(
            run_dir, args.split, which=args.which, data_dir=args.data_dir, device=args.device
        )
        for run_dir in args.run_dirs
    ]
    names = run_names(args.run_dirs)
    check_same_vocabulary(names, [split.vocab for split in splits])
    _check_same_stream(names, splits)
    ids = splits[0].ids
    n_contexts = count_contexts(len(ids))  # len: a data.memmap run's ids are a memory map
    if args.max_contexts is not None:
        n_contexts = min(n_contexts, args.max_contexts)
    positions, selection, margins = _select(args, splits, n_contexts)
    records = topk_records(
        [split.model for split in splits],
        ids,
        splits[0].vocab,
        positions,
        names=names,
        k=args.k,
        context_words=args.context_words,
        bptt=[split.bptt for split in splits],
        progress=not args.no_progress,
    )
    for record, margin in zip(records, margins or [], strict=False):
        record["margin"] = margin
    return {
        "split": args.split,
        "checkpoint": args.which,
        "source": splits[0].source,
        "runs": [
            {
                "name": name,
                "run_dir": str(split.run_dir),
                "head": split.config.head.name,
                "bptt": split.bptt,
            }
            for name, split in zip(names, splits, strict=True)
        ],
        "n_contexts": n_contexts,
        "selection": selection,
        "k": args.k,
        "contexts": records,
    }


def _select(args: argparse.Namespace, splits: list[RunSplit], n_contexts: int):
    """``(positions, selection record, margins or None)`` for the chosen mode."""

    def targets(split: RunSplit) -> np.ndarray:
        return target_log_probs(
            split.model,
            split.ids,
            max_contexts=n_contexts,
            bptt=split.bptt,
            progress=not args.no_progress,
        )

    names = [str(split.run_dir) for split in splits[:2]]
    return _choose(args, n_contexts, lambda: [targets(s) for s in splits[:2]], names)


def _choose(args: argparse.Namespace, n_contexts: int, margins_of, names: Sequence[str]):
    """The selection of ``args`` among ``n_contexts`` contexts; ``margins_of()`` gives the
    target log-probs of models A and B (named ``names``) when ``--margin`` asks for them."""
    if args.positions is not None:
        positions = check_positions(args.positions, n_contexts)
        return positions, {"mode": "positions", "positions": positions}, None
    if args.random is not None:
        positions = random_positions(n_contexts, args.random, args.seed)
        return positions, {"mode": "random", "count": args.random, "seed": args.seed}, None
    a, b = margins_of()
    positions, margins = margin_positions(a, b, args.margin, args.count)
    selection = {
        "mode": "margin",
        "margin": args.margin,
        "count": args.count,
        "a": names[0],
        "b": names[1],
        "qualifying": int(np.count_nonzero(a - b >= args.margin)),
        "largest_difference": float(np.max(a - b)),
    }
    return positions.tolist(), selection, margins.tolist()


def _hf_record(args: argparse.Namespace) -> dict[str, Any]:
    """The top-k record of the ``--hf`` models on ``--text`` (all loaded at once: a
    context's rows of every model are needed together)."""
    from highrank.analysis.hf_contexts import (
        TokenizerVocab,
        causal_lm_rows_at,
        causal_lm_target_log_probs,
        count_text_contexts,
        load_text_contexts,
        vocab_width,
    )

    if args.margin is not None and len(args.hf) < 2:
        raise TopKError("--margin compares two models (A = first --hf, B = second); got one")
    loaded = [
        load_text_contexts(
            path,
            args.text,
            window=args.window,
            bos=args.bos,
            device=args.device,
            progress=not args.no_progress,
        )
        for path in args.hf
    ]
    names = run_names([str(path) for path in args.hf])
    _check_same_tokens(names, loaded)
    ids, width = loaded[0].ids, vocab_width(loaded[0].model) or len(loaded[0].tokenizer)
    vocab = TokenizerVocab(loaded[0].tokenizer, width)
    check_k(args.k, width)
    n_contexts = count_text_contexts(ids.numel(), args.max_contexts)
    progress = not args.no_progress

    def reading(model):
        return {"window": model.window, "bos_token_id": model.bos_token_id, "progress": progress}

    def margins_of():
        return [
            causal_lm_target_log_probs(m.model, ids, max_contexts=n_contexts, **reading(m))
            for m in loaded[:2]
        ]

    positions, selection, margins = _choose(args, n_contexts, margins_of, names[:2])
    rows = [causal_lm_rows_at(m.model, ids, positions, **reading(m)) for m in loaded]
    records = context_records(
        rows, ids, vocab, positions, names=names, k=args.k, context_words=args.context_words
    )
    for record, margin in zip(records, margins or [], strict=False):
        record["margin"] = margin
    return {
        "split": Path(args.text).name,
        "source": str(args.text),
        "runs": [
            {"name": name, **m.record(args.max_contexts)}
            for name, m in zip(names, loaded, strict=True)
        ],
        "n_contexts": n_contexts,
        "selection": selection,
        "k": args.k,
        "contexts": records,
    }


def _check_same_tokens(names: Sequence[str], loaded: Sequence[Any]) -> None:
    """Every model's tokenizer read the text into the same ids (one vocabulary)."""
    for name, other in zip(names[1:], loaded[1:], strict=True):
        if not torch.equal(other.ids, loaded[0].ids):
            raise TopKError(
                f"models {names[0]} and {name} tokenise {loaded[0].text} differently; top-k "
                "comparison needs models that share one tokenizer"
            )


def run_names(run_dirs: Sequence[str]) -> list[str]:
    """Short labels: each run directory's name, or its full path when names repeat."""
    names = [Path(run_dir).name or str(run_dir) for run_dir in run_dirs]
    return names if len(set(names)) == len(names) else [str(run_dir) for run_dir in run_dirs]


def _check_same_stream(names: Sequence[str], splits: Sequence[RunSplit]) -> None:
    for name, split in zip(names[1:], splits[1:], strict=True):
        if not streams_equal(split.ids, splits[0].ids):  # memory maps: a block at a time
            raise TopKError(
                f"runs {names[0]} and {name} read different {split.split} streams "
                f"({splits[0].source}, {split.source}); pass one corpus with --data-dir"
            )


def _title(record: dict[str, Any]) -> str:
    selection = record["selection"]
    runs = ", ".join(f"{r['name']} ({r['head']})" for r in record["runs"])
    text = f"top-{record['k']} next tokens on {record['split']} ({record['source']}): {runs}"
    if selection["mode"] != "margin":
        return text
    a, b = (run["name"] for run in record["runs"][:2])
    return text + (
        f"\nA = {a}, B = {b}: {selection['qualifying']} contexts where A gives the reference "
        f"token >= {selection['margin']} nats more than B (largest difference "
        f"{selection['largest_difference']:+.3f}); showing {len(record['contexts'])}"
    )
